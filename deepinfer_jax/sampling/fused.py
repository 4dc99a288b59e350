"""The kernel backends of op ``"sample"``: the fused Pallas sampler (``pallas_gpu``) and one named Ascend call.

``pallas_gpu`` (:func:`sample_pallas`). The **token** of every row -- logit bias, penalties, masks, allowed ids,
grammar bitmask, ``force_top_k``, greedy argmax, temperature, min_p, top-k/top-p and the position-keyed draw, and
the row's error flag -- comes from one Pallas kernel, :func:`pallas_kernels.sampler.sample_tokens` (its module
docstring says how it avoids sorting and where its float sums differ from the reference's). The **reported
values** stay in ``jnp`` around the kernel, computed by the reference's own functions from the kernel's token:

* ``logprobs_mode`` ``"raw_logprobs"`` (the default) / ``"raw_logits"``: ``log_softmax`` of the raw logits (or
  the logits) at the token, its rank and the top-n alternatives -- one pass over the raw row, no pipeline;
* ``"processed_logprobs"`` / ``"processed_logits"`` and ``sum_smaller``: these need the processed row, which the
  kernel never writes out, so the reference's :func:`~deepinfer_jax.sampling.pipeline.processed_logits` (with its
  sort) runs again in ``jnp`` for them. The token is still the kernel's.

``ascend`` (:func:`sample_ascend`): the reference as one named custom call ``deepinfer.ascend.sample``
(:mod:`deepinfer_jax.ops.ascend`); the :class:`SamplingTensors` fields travel as separate operands.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from deepinfer_jax.ops.ascend import ascend_impl
from deepinfer_jax.sampling import pipeline
from deepinfer_jax.sampling.pipeline import SampleOutput
from deepinfer_jax.sampling.tensors import SamplingTensors

__all__ = [
    "draft_sample_ascend",
    "draft_sample_pallas",
    "sample_ascend",
    "sample_pallas",
    "verify_ascend",
    "verify_pallas",
]


def _report(
    raw: jax.Array,
    row: SamplingTensors,
    counts: jax.Array | None,
    token: jax.Array,
    ok: jax.Array,
    *,
    num_logprobs: int,
    logprobs_mode: str,
    force_top_k: int,
    sum_smaller: bool,
) -> SampleOutput:
    """One row's :class:`SampleOutput` around the kernel's token, as ``pipeline._sample_row`` reports it."""
    raw = raw.astype(jnp.float32)
    processed = raw  # unused by the raw modes
    if logprobs_mode.startswith("processed") or sum_smaller:
        x, final, _ = pipeline.processed_logits(raw, row, counts, force_top_k=force_top_k)
        processed = jnp.where(row.temperature <= 0, x, final)
    reported = pipeline.reported_values(raw, processed, logprobs_mode)
    top_ids, top_lps = pipeline._top_n(reported, num_logprobs)
    if sum_smaller:
        cdf = pipeline._inclusive_cdf(jax.nn.softmax(processed), jnp.concatenate([token[None], top_ids]))
        smaller, top_smaller = jnp.where(ok, cdf[0], 0.0), cdf[1:]
    else:
        smaller, top_smaller = jnp.zeros((), jnp.float32), jnp.zeros((num_logprobs,), jnp.float32)
    rank = pipeline._rank_of(reported, token)
    return SampleOutput(token, reported[token], rank, top_ids, top_lps, ok, smaller, top_smaller)


def sample_pallas(
    logits: jax.Array,
    st: SamplingTensors,
    token_counts: jax.Array | None,
    *,
    num_logprobs: int,
    batch_invariant: bool,
    logprobs_mode: str = "raw_logprobs",
    force_top_k: int = 0,
    sum_smaller: bool = False,
    interpret: bool = False,
) -> SampleOutput:
    """Op ``"sample"`` with its token from the fused Pallas kernel (module docstring); the reference's signature
    plus ``interpret`` (run the kernel with the Pallas interpreter)."""
    from pallas_kernels.sampler import sample_tokens

    tokens, ok = sample_tokens(logits, st, token_counts, force_top_k=force_top_k, interpret=interpret)
    return _reports(
        logits,
        st,
        token_counts,
        tokens,
        ok,
        batch_invariant=batch_invariant,
        num_logprobs=num_logprobs,
        logprobs_mode=logprobs_mode,
        force_top_k=force_top_k,
        sum_smaller=sum_smaller,
    )


def _reports(
    logits: jax.Array,
    st: SamplingTensors,
    token_counts: jax.Array | None,
    tokens: jax.Array,
    ok: jax.Array,
    *,
    batch_invariant: bool,
    **options: Any,
) -> SampleOutput:
    """:func:`_report` of every row: a row map under ``batch_invariant``, else ``vmap``."""
    report = functools.partial(_report, **options)
    if batch_invariant:
        if token_counts is None:
            return lax.map(lambda xs: report(xs[0], xs[1], None, xs[2], xs[3]), (logits, st, tokens, ok))
        return lax.map(lambda xs: report(*xs), (logits, st, token_counts, tokens, ok))
    counts_axis = None if token_counts is None else 0
    return jax.vmap(report, in_axes=(0, 0, counts_axis, 0, 0))(logits, st, token_counts, tokens, ok)


def draft_sample_pallas(
    logits: jax.Array,
    st: SamplingTensors,
    *,
    force_top_k: int,
    batch_invariant: bool,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Op ``"draft_sample"`` from the fused kernel's draft mode: the token and the distribution it was drawn
    from both come from the kernel (each row alone, so ``batch_invariant`` holds by construction)."""
    from pallas_kernels.sampler import draft_tokens

    del batch_invariant
    return draft_tokens(logits, st, force_top_k=force_top_k, interpret=interpret)


def verify_pallas(
    logits: jax.Array,
    st: SamplingTensors,
    counts: jax.Array | None,
    drafts: jax.Array,
    draft_logprobs: jax.Array,
    is_fresh: jax.Array,
    *,
    num_logprobs: int,
    logprobs_mode: str,
    force_top_k: int,
    batch_invariant: bool,
    interpret: bool = False,
) -> Any:
    """Op ``"verify"`` from the fused kernel's verify mode: each row's token, acceptance and acceptance
    probability from the kernel, the reported values of the token in ``jnp`` around it (as for ``sample``)."""
    from deepinfer_jax.sampling.speculative import _RowResult
    from pallas_kernels.sampler import verify_tokens

    token, accept, accept_prob, ok = verify_tokens(
        logits, st, counts, drafts, draft_logprobs, is_fresh, force_top_k=force_top_k, interpret=interpret
    )
    rep = _reports(
        logits,
        st,
        counts,
        jnp.maximum(token, 0),
        ok,
        batch_invariant=batch_invariant,
        num_logprobs=num_logprobs,
        logprobs_mode=logprobs_mode,
        force_top_k=force_top_k,
        sum_smaller=False,
    )
    return _RowResult(token, accept, accept_prob, ok, rep.logprob, rep.rank, rep.top_ids, rep.top_logprobs)


def _sample_fields(
    logits: Any,
    temperature: Any,
    top_p: Any,
    top_k: Any,
    min_p: Any,
    repetition_penalty: Any,
    presence_penalty: Any,
    frequency_penalty: Any,
    seed: Any,
    position: Any,
    masked_ids: Any,
    golden: Any,
    bias_ids: Any,
    bias_values: Any,
    allowed_ids: Any,
    token_bitmask: Any,
    token_counts: Any,
    *,
    num_logprobs: int,
    batch_invariant: bool,
    logprobs_mode: str,
    force_top_k: int,
    sum_smaller: bool,
) -> SampleOutput:
    """The reference of op ``"sample"`` with the :class:`SamplingTensors` fields as separate arrays."""
    st = SamplingTensors(
        temperature,
        top_p,
        top_k,
        min_p,
        repetition_penalty,
        presence_penalty,
        frequency_penalty,
        seed,
        position,
        masked_ids,
        golden,
        bias_ids,
        bias_values,
        allowed_ids,
        token_bitmask,
    )
    return pipeline._sample_reference(
        logits,
        st,
        token_counts,
        num_logprobs=num_logprobs,
        batch_invariant=batch_invariant,
        logprobs_mode=logprobs_mode,
        force_top_k=force_top_k,
        sum_smaller=sum_smaller,
    )


_sample_named = ascend_impl("sample", _sample_fields)


def sample_ascend(
    logits: jax.Array,
    st: SamplingTensors,
    token_counts: jax.Array | None,
    *,
    num_logprobs: int,
    batch_invariant: bool,
    logprobs_mode: str = "raw_logprobs",
    force_top_k: int = 0,
    sum_smaller: bool = False,
) -> SampleOutput:
    """Op ``"sample"`` as the named custom call ``deepinfer.ascend.sample`` (its reference elsewhere)."""
    out = _sample_named(
        logits,
        *st,
        token_counts,
        num_logprobs=num_logprobs,
        batch_invariant=batch_invariant,
        logprobs_mode=logprobs_mode,
        force_top_k=force_top_k,
        sum_smaller=sum_smaller,
    )
    return SampleOutput(*out)


def _draft_fields(
    logits: Any,
    temperature: Any,
    top_p: Any,
    top_k: Any,
    min_p: Any,
    repetition_penalty: Any,
    presence_penalty: Any,
    frequency_penalty: Any,
    seed: Any,
    position: Any,
    masked_ids: Any,
    golden: Any,
    bias_ids: Any,
    bias_values: Any,
    allowed_ids: Any,
    token_bitmask: Any,
    *,
    force_top_k: int,
    batch_invariant: bool,
) -> tuple[jax.Array, jax.Array]:
    """The reference of op ``"draft_sample"`` with the :class:`SamplingTensors` fields as separate arrays."""
    from deepinfer_jax.sampling.speculative import _draft_reference

    st = SamplingTensors(
        temperature,
        top_p,
        top_k,
        min_p,
        repetition_penalty,
        presence_penalty,
        frequency_penalty,
        seed,
        position,
        masked_ids,
        golden,
        bias_ids,
        bias_values,
        allowed_ids,
        token_bitmask,
    )
    return _draft_reference(logits, st, force_top_k=force_top_k, batch_invariant=batch_invariant)


def _verify_fields(
    logits: Any,
    temperature: Any,
    top_p: Any,
    top_k: Any,
    min_p: Any,
    repetition_penalty: Any,
    presence_penalty: Any,
    frequency_penalty: Any,
    seed: Any,
    position: Any,
    masked_ids: Any,
    golden: Any,
    bias_ids: Any,
    bias_values: Any,
    allowed_ids: Any,
    token_bitmask: Any,
    counts: Any,
    drafts: Any,
    draft_logprobs: Any,
    is_fresh: Any,
    *,
    num_logprobs: int,
    logprobs_mode: str,
    force_top_k: int,
    batch_invariant: bool,
) -> Any:
    """The reference of op ``"verify"`` with the :class:`SamplingTensors` fields as separate arrays."""
    from deepinfer_jax.sampling.speculative import _verify_reference

    st = SamplingTensors(
        temperature,
        top_p,
        top_k,
        min_p,
        repetition_penalty,
        presence_penalty,
        frequency_penalty,
        seed,
        position,
        masked_ids,
        golden,
        bias_ids,
        bias_values,
        allowed_ids,
        token_bitmask,
    )
    return _verify_reference(
        logits,
        st,
        counts,
        drafts,
        draft_logprobs,
        is_fresh,
        num_logprobs=num_logprobs,
        logprobs_mode=logprobs_mode,
        force_top_k=force_top_k,
        batch_invariant=batch_invariant,
    )


_draft_named = ascend_impl("draft_sample", _draft_fields)
_verify_named = ascend_impl("verify", _verify_fields)


def draft_sample_ascend(
    logits: jax.Array, st: SamplingTensors, *, force_top_k: int, batch_invariant: bool
) -> tuple[jax.Array, jax.Array]:
    """Op ``"draft_sample"`` as the named custom call ``deepinfer.ascend.draft_sample``."""
    return tuple(_draft_named(logits, *st, force_top_k=force_top_k, batch_invariant=batch_invariant))


def verify_ascend(
    logits: jax.Array,
    st: SamplingTensors,
    counts: jax.Array | None,
    drafts: jax.Array,
    draft_logprobs: jax.Array,
    is_fresh: jax.Array,
    *,
    num_logprobs: int,
    logprobs_mode: str,
    force_top_k: int,
    batch_invariant: bool,
) -> Any:
    """Op ``"verify"`` as the named custom call ``deepinfer.ascend.verify`` (the rows' reference elsewhere)."""
    from deepinfer_jax.sampling.speculative import _RowResult

    out = _verify_named(
        logits,
        *st,
        counts,
        drafts,
        draft_logprobs,
        is_fresh,
        num_logprobs=num_logprobs,
        logprobs_mode=logprobs_mode,
        force_top_k=force_top_k,
        batch_invariant=batch_invariant,
    )
    return _RowResult(*out)
