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

__all__ = ["sample_ascend", "sample_pallas"]


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
    report = functools.partial(
        _report,
        num_logprobs=num_logprobs,
        logprobs_mode=logprobs_mode,
        force_top_k=force_top_k,
        sum_smaller=sum_smaller,
    )
    if batch_invariant:
        if token_counts is None:
            return lax.map(lambda xs: report(xs[0], xs[1], None, xs[2], xs[3]), (logits, st, tokens, ok))
        return lax.map(lambda xs: report(*xs), (logits, st, token_counts, tokens, ok))
    counts_axis = None if token_counts is None else 0
    return jax.vmap(report, in_axes=(0, 0, counts_axis, 0, 0))(logits, st, token_counts, tokens, ok)


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
