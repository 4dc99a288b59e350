"""The logit pipeline and the sampler (spec/engine.md §9.1, with the product contract of the engine issue).

Per row, in float32, in this order:

0. ``logit_bias`` (vLLM's ``{id: bias}``) is added to the raw logits;
1. **penalties** on the biased logits: repetition (vLLM semantics: for ids in the prompt or the output, a positive
   logit is divided by the penalty and a non-positive one multiplied by it), then frequency
   (``- f · output count``) and presence (``- p · [count > 0]``), both over the output only;
2. **masks**: the row's ``masked_ids`` (banned ids; EOS and stop ids before ``min_tokens``; EOS before
   ``first_n_token_no_eos``; the step's ``bad_words`` completions) become -inf, and so does every id outside a
   row's ``allowed_token_ids`` and every id the row's grammar bitmask (structured outputs) does not allow; with
   ``force_top_k = k > 0`` (an engine setting) every id outside the
   row's top k (ties by ascending id) too;
3. **greedy** rows (temperature 0) take the exact argmax here, lowest id on ties, and use no random number;
4. a row with a **golden** token (teacher forcing) emits it whatever was drawn;
5. **temperature**: ``(x - max x) / T`` (subtracting the maximum first keeps tiny temperatures finite);
6. **min_p**: keep ids with ``p >= min_p · p_max``; since the maximum scaled logit is 0, ``p / p_max`` is
   ``exp(scaled)`` and the test is ``exp(scaled) >= min_p``;
7. **top-k and top-p jointly**: ids ordered by probability (renormalised over the min_p survivors) descending,
   ties by ascending id; top-k keeps the first ``k``, top-p keeps an id when the mass strictly before it is
   ``<= top_p``; both keep a prefix of that order and the kept set is the shorter one;
8. **log_softmax** over the kept ids, and an exact fixed-point inverse-CDF **draw** keyed by (seed, position)
   (:mod:`deepinfer_jax.sampling.rng`).

**Reported log-probabilities** follow ``logprobs_mode`` (vLLM's four values): ``"raw_logprobs"`` (the default:
``log_softmax`` of the raw logits, before any processing), ``"raw_logits"``, ``"processed_logprobs"`` (the
distribution the token is drawn from: after penalties, masks, temperature and the filters, ``log_softmax`` over
the kept ids, floored at -9999 as DeepInfer reports them; a greedy row's is the penalised, masked
``log_softmax``) and ``"processed_logits"`` (those logits, -inf where filtered). Ranks and the top-n
alternatives are taken in the same values. With ``sum_smaller`` each reported id also gets its inclusive CDF in
the processed distribution, ids ordered by ascending probability and ties by ascending id.

A row is an error row (``ok = False``, token 0) when its raw logits hold a NaN or +inf, or when no finite logit
survives the masks: the engine ends that request with ``finish_reason="error"`` instead of emitting garbage.

Batch invariance. The pipeline is written once, for one row, and mapped over the rows in one of two ways. The
default vectorises it (``vmap``): fastest, and a request's tokens are independent of its batch except at
floating-point near-ties, because XLA may pick a different reduction order for a different batch shape. With
``batch_invariant=True`` the same row function runs under ``lax.map``: one compiled loop body of shape ``[V]``
serves every row of every batch size, so each row's results are bitwise identical whatever the batch or its
place in it. The sort that top-k/top-p need is skipped when no row (vmap) or not this row (map) filters; the
skipped filter is an exact identity, so that choice never changes a result.
"""

from __future__ import annotations

import functools
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from deepinfer_jax.ops.registry import register_impl, register_op, select
from deepinfer_jax.sampling.counts import COUNT_MASK, PROMPT_FLAG
from deepinfer_jax.sampling.rng import categorical_from_weights, fixed_point_weights, random_bits
from deepinfer_jax.sampling.tensors import SamplingTensors

__all__ = [
    "LOGPROBS_MODES",
    "MAX_LOGPROBS",
    "SampleOutput",
    "TokenLogprobs",
    "apply_masks",
    "apply_penalties",
    "filter_logits",
    "processed_logits",
    "reported_values",
    "sample",
    "token_logprobs",
]

MAX_LOGPROBS = 20
"""The most top-n alternatives a row may report (``SamplingParams.logprobs``)."""

_NEG_INF = float("-inf")

LOGPROBS_MODES: tuple[str, ...] = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
"""What reported log-probabilities are (vLLM's ``logprobs_mode``; module docstring)."""

LOGPROB_FLOOR = -9999.0
"""DeepInfer's floor of processed log-probabilities (a filtered id reports this instead of -inf)."""


class SampleOutput(NamedTuple):
    """What :func:`sample` returns, every field with leading axis ``S``.

    Attributes:
      tokens: int32 ``[S]`` the sampled (argmax, or golden) token; 0 on error rows.
      logprob: float32 ``[S]`` its reported value (``logprobs_mode``).
      rank: int32 ``[S]`` its 1-based rank in the reported values (ties by ascending id).
      top_ids: int32 ``[S, n]`` the ``n`` highest-valued ids, ties by ascending id.
      top_logprobs: float32 ``[S, n]`` their reported values.
      ok: bool ``[S]`` false when the row's logits were unusable (NaN, +inf, or nothing left after masks).
      sum_smaller: float32 ``[S]`` the token's inclusive CDF in the processed distribution (zeros unless
        ``sum_smaller``).
      top_sum_smaller: float32 ``[S, n]`` the same for the top-n ids.
    """

    tokens: jax.Array
    logprob: jax.Array
    rank: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    ok: jax.Array
    sum_smaller: jax.Array
    top_sum_smaller: jax.Array


class TokenLogprobs(NamedTuple):
    """What :func:`token_logprobs` returns: the given tokens' log-probabilities, ranks and top-n alternatives."""

    logprob: jax.Array
    rank: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


# ---------------------------------------------------------------------------------------------------------------
# Stages (one row: 1-D arrays over the vocabulary; batched by the callers)


def apply_penalties(
    logits: jax.Array,
    counts: jax.Array,
    repetition_penalty: jax.Array,
    presence_penalty: jax.Array,
    frequency_penalty: jax.Array,
) -> jax.Array:
    """Stage 1 on one row: repetition, frequency and presence penalties (exact identities at their neutral values)."""
    generated = counts & COUNT_MASK
    seen = ((counts & PROMPT_FLAG) != 0) | (generated > 0)
    penalised = jnp.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty)
    x = jnp.where(seen, penalised, logits)
    x = x - frequency_penalty * generated.astype(jnp.float32)
    return x - presence_penalty * (generated > 0).astype(jnp.float32)


def apply_masks(logits: jax.Array, masked_ids: jax.Array) -> jax.Array:
    """Stage 2 on one row: ``masked_ids`` (``-1`` = unused) become -inf."""
    vocab = logits.shape[-1]
    ids = jnp.where(masked_ids >= 0, masked_ids, vocab)
    return logits.at[ids].set(_NEG_INF, mode="drop")


def _min_p_keep(scaled: jax.Array, min_p: jax.Array) -> jax.Array:
    return jnp.exp(scaled) >= min_p


def _top_k_top_p_keep(masked: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """The joint top-k/top-p keep mask of one row of scaled, min_p-masked logits (stage 7)."""
    vocab = masked.shape[-1]
    ids = lax.iota(jnp.int32, vocab)
    probs = jax.nn.softmax(masked)
    # Probability descending, ties by ascending id (+0 and -0 tie in lax.sort's comparator).
    neg_sorted, sorted_ids = lax.sort((-probs, ids), num_keys=2)
    sorted_probs = -neg_sorted
    mass_before = jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(sorted_probs)[:-1]])
    keep_sorted = (ids < top_k) & ((top_p >= 1.0) | (mass_before <= top_p))
    # Both rules keep a prefix, so their conjunction is the shorter prefix; its last entry is the cut-off and
    # an id is kept iff it precedes or equals the cut-off in (probability desc, id asc) order. The prefix ends
    # at the first dropped entry (taken explicitly rather than by counting: a tree-shaped float cumsum is not
    # guaranteed monotone to the last ulp). The first entry always survives (k >= 1, top_p > 0).
    first_drop = jnp.where(jnp.all(keep_sorted), vocab, jnp.argmax(~keep_sorted))
    last = jnp.maximum(first_drop - 1, 0)
    cut_p, cut_id = sorted_probs[last], sorted_ids[last]
    return (probs > cut_p) | ((probs == cut_p) & (ids <= cut_id))


def filter_logits(
    logits: jax.Array,
    temperature: jax.Array,
    min_p: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    *,
    top_k_top_p: bool | None = None,
) -> jax.Array:
    """Stages 5–7 on one row of penalised, masked logits: the scaled logits of the kept ids, -inf elsewhere.

    ``top_k_top_p``: ``True``/``False`` to force the sorting stage on or off (the caller knows whether any row
    filters), ``None`` to decide per row with ``lax.cond``. Greedy rows (temperature 0) are scaled by 1: their
    result is not used for the token, and dividing by zero would only produce NaNs.
    """
    vocab = logits.shape[-1]
    t = jnp.where(temperature > 0, temperature, 1.0)
    scaled = (logits - jnp.max(logits)) / t
    masked = jnp.where(_min_p_keep(scaled, min_p), scaled, _NEG_INF)
    if top_k_top_p is False:
        return masked

    def with_filter(m: jax.Array) -> jax.Array:
        return jnp.where(_top_k_top_p_keep(m, top_k, top_p), m, _NEG_INF)

    if top_k_top_p is True:
        return with_filter(masked)
    active = (top_k < vocab) | (top_p < 1.0)
    return lax.cond(active, with_filter, lambda m: m, masked)


def _rank_of(logprobs: jax.Array, token: jax.Array) -> jax.Array:
    """1-based rank of ``token`` in one row, ids ordered by log-probability desc and ties by ascending id."""
    ids = lax.iota(jnp.int32, logprobs.shape[-1])
    value = logprobs[token]
    ahead = (logprobs > value) | ((logprobs == value) & (ids < token))
    return 1 + jnp.sum(ahead, dtype=jnp.int32)


def _top_n(logprobs: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    if n == 0:
        return jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.float32)
    # XLA's TopK puts the lower index first among equal values: exactly the ascending-id tie order.
    values, ids = lax.top_k(logprobs, n)
    return ids.astype(jnp.int32), values


# ---------------------------------------------------------------------------------------------------------------
# One row, end to end


def _force_top_k(x: jax.Array, k: int) -> jax.Array:
    """Every id outside the row's top ``k`` (ties by ascending id) becomes -inf (spec §9.8: the row samples in
    its top-k space)."""
    _, ids = lax.top_k(x, k)
    keep = jnp.zeros(x.shape, jnp.bool_).at[ids].set(True)
    return jnp.where(keep, x, _NEG_INF)


def _inclusive_cdf(probs: jax.Array, tokens: jax.Array) -> jax.Array:
    """The inclusive CDF of each of ``tokens`` in one row's ``probs``, ids ordered by ascending probability and
    ties by ascending id."""
    ids = lax.iota(jnp.int32, probs.shape[-1])

    def one(t: jax.Array) -> jax.Array:
        p = probs[t]
        before = (probs < p) | ((probs == p) & (ids <= t))
        return jnp.sum(jnp.where(before, probs, 0.0))

    return jax.vmap(one)(tokens)


def processed_logits(
    logits: jax.Array,
    row: SamplingTensors,
    counts: jax.Array | None,
    *,
    force_top_k: int,
    top_k_top_p: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Stages 0–2 and 5–7 on one row: what :func:`sample` and speculative verification both draw from.

    Args:
      logits: ``[V]`` one row of raw logits (cast to float32).
      row: that row's :class:`SamplingTensors` (every leaf without the row axis).
      counts: int32 ``[V]`` its count state, or ``None`` for no penalties.
      force_top_k: static; > 0 keeps only the row's top-k ids (0 = off).
      top_k_top_p: as for :func:`filter_logits`.

    Returns:
      ``(x, final, ok)``: ``x`` the logits after bias, penalties, masks, allowed ids, grammar bitmask and
      force-top-k (a greedy row takes its argmax); ``final`` the temperature-scaled, min_p/top-k/top-p filtered
      logits a sampled row draws from (-inf where filtered); ``ok`` false when the raw logits hold a NaN or +inf
      or no finite logit survives the masks.
    """
    raw = logits.astype(jnp.float32)
    vocab = raw.shape[-1]
    x = raw
    if row.bias_ids.shape[-1]:
        # vLLM's logit_bias: added to the raw logits, before the penalties.
        x = x.at[jnp.where(row.bias_ids >= 0, row.bias_ids, vocab)].add(row.bias_values, mode="drop")
    if counts is not None:
        x = apply_penalties(x, counts, row.repetition_penalty, row.presence_penalty, row.frequency_penalty)
    x = apply_masks(x, row.masked_ids)
    if row.allowed_ids.shape[-1]:
        ids = jnp.where(row.allowed_ids >= 0, row.allowed_ids, vocab)
        allowed = jnp.zeros((vocab,), jnp.bool_).at[ids].set(True, mode="drop")
        x = jnp.where((row.allowed_ids[0] < 0) | allowed, x, _NEG_INF)
    if row.token_bitmask.shape[-1]:
        # Grammar mask (structured outputs): bit t % 32 of word t // 32 allows token t.
        ids = jnp.arange(vocab, dtype=jnp.int32)
        bits = (row.token_bitmask[ids // 32] >> (ids % 32)) & 1
        x = jnp.where(bits != 0, x, _NEG_INF)
    if force_top_k:
        x = _force_top_k(x, min(force_top_k, x.shape[-1]))
    ok = ~jnp.any(jnp.isnan(raw)) & ~jnp.any(raw == jnp.inf) & jnp.any(jnp.isfinite(x))
    final = filter_logits(x, row.temperature, row.min_p, row.top_k, row.top_p, top_k_top_p=top_k_top_p)
    return x, final, ok


def reported_values(raw: jax.Array, processed: jax.Array, logprobs_mode: str) -> jax.Array:
    """One row's reported values (``logprobs_mode``) from its float32 raw logits and the logits its token is
    drawn from (``x`` for a greedy row, ``final`` otherwise)."""
    if logprobs_mode == "raw_logprobs":
        return jax.nn.log_softmax(raw)
    if logprobs_mode == "raw_logits":
        return raw
    if logprobs_mode == "processed_logprobs":
        return jnp.maximum(jax.nn.log_softmax(processed), LOGPROB_FLOOR)
    return processed


def _sample_row(
    logits: jax.Array,
    row: SamplingTensors,
    counts: jax.Array | None,
    *,
    num_logprobs: int,
    top_k_top_p: bool | None,
    logprobs_mode: str,
    force_top_k: int,
    sum_smaller: bool,
) -> SampleOutput:
    raw = logits.astype(jnp.float32)
    x, final, ok = processed_logits(raw, row, counts, force_top_k=force_top_k, top_k_top_p=top_k_top_p)
    greedy = row.temperature <= 0
    greedy_token = jnp.argmax(x).astype(jnp.int32)

    weights = fixed_point_weights(jax.nn.softmax(final))
    drawn = categorical_from_weights(weights, random_bits(row.seed, row.position))

    token = jnp.where(greedy, greedy_token, drawn)
    token = jnp.where(row.golden >= 0, row.golden, token)
    token = jnp.where(ok, token, 0)
    processed = jnp.where(greedy, x, final)  # the logits the token is drawn from
    reported = reported_values(raw, processed, logprobs_mode)
    top_ids, top_lps = _top_n(reported, num_logprobs)
    if sum_smaller:
        cdf = _inclusive_cdf(jax.nn.softmax(processed), jnp.concatenate([token[None], top_ids]))
        smaller, top_smaller = jnp.where(ok, cdf[0], 0.0), cdf[1:]
    else:
        smaller, top_smaller = jnp.zeros((), jnp.float32), jnp.zeros((num_logprobs,), jnp.float32)
    return SampleOutput(
        token, reported[token], _rank_of(reported, token), top_ids, top_lps, ok, smaller, top_smaller
    )


def _check_num_logprobs(fn: str, num_logprobs: Any) -> int:
    if isinstance(num_logprobs, bool) or not isinstance(num_logprobs, numbers.Integral):
        raise TypeError(f"{fn}: num_logprobs must be an int, got {type(num_logprobs).__name__}")
    if not 0 <= num_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"{fn}: num_logprobs = {num_logprobs} must be in [0, {MAX_LOGPROBS}]")
    return int(num_logprobs)


def _check_logits(fn: str, logits: jax.Array) -> tuple[int, int]:
    if not (hasattr(logits, "dtype") and hasattr(logits, "shape")):
        raise TypeError(f"{fn}: logits must be an array, got {type(logits).__name__}")
    if len(logits.shape) != 2 or logits.dtype != jnp.float32:
        raise TypeError(f"{fn}: logits must be float32 [S, V], got {logits.dtype} {tuple(logits.shape)}")
    return int(logits.shape[0]), int(logits.shape[1])


def _sample_reference(
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
    """The jnp reference of op ``"sample"`` (arguments already checked by :func:`sample`)."""
    options = {"logprobs_mode": logprobs_mode, "force_top_k": force_top_k, "sum_smaller": sum_smaller}
    if batch_invariant:
        row_fn = functools.partial(_sample_row, num_logprobs=num_logprobs, top_k_top_p=None, **options)
        if token_counts is None:
            return lax.map(lambda xs: row_fn(xs[0], xs[1], None), (logits, st))
        return lax.map(lambda xs: row_fn(*xs), (logits, st, token_counts))

    vocab = logits.shape[1]
    counts_axis = None if token_counts is None else 0

    def batched(filtering: bool) -> SampleOutput:
        row_fn = functools.partial(_sample_row, num_logprobs=num_logprobs, top_k_top_p=filtering, **options)
        return jax.vmap(row_fn, in_axes=(0, 0, counts_axis))(logits, st, token_counts)

    # Whether anyone filters is decided for the whole batch: vmap would turn a per-row cond into "run both".
    filtering = jnp.any((st.temperature > 0) & ((st.top_k < vocab) | (st.top_p < 1.0)))
    return lax.cond(filtering, lambda: batched(True), lambda: batched(False))


register_op(
    "sample",
    _sample_reference,
    doc="Logit pipeline (penalties, masks, temperature, min_p, top-k/top-p) and position-keyed sampling",
)
# The token from one fused Pallas kernel, the reported values in jnp around it; the reference as one named
# Ascend call (deepinfer_jax/sampling/fused.py).
register_impl(
    "sample",
    "pallas_gpu",
    "deepinfer_jax.sampling.fused:sample_pallas",
    platforms=("gpu",),
    reason="the fused Pallas Triton sampler needs the pallas_kernels package",
)
register_impl("sample", "ascend", "deepinfer_jax.sampling.fused:sample_ascend", platforms=("ascend",))


def sample(
    logits: jax.Array,
    st: SamplingTensors,
    token_counts: jax.Array | None = None,
    *,
    num_logprobs: int = 0,
    batch_invariant: bool = False,
    logprobs_mode: str = "raw_logprobs",
    force_top_k: int = 0,
    sum_smaller: bool = False,
    backend: str | None = None,
) -> SampleOutput:
    """Sample one token per row. Jit-able; no host synchronisation.

    Args:
      logits: float32 ``[S, V]``, one row per sampled sequence (padding rows included).
      st: the step's :class:`SamplingTensors` with ``S`` rows (on device, or numpy to be traced as constants).
      token_counts: int32 ``[S, V]`` the rows' count state (:mod:`deepinfer_jax.sampling.counts`, gathered by
        slot), or ``None`` when no row uses a penalty (penalties are then skipped).
      num_logprobs: static ``n`` in ``[0, 20]``: how many top alternatives to report per row.
      batch_invariant: static; bitwise row results independent of ``S`` and of the row's place.
      logprobs_mode: static; what the reported values are (:data:`LOGPROBS_MODES`, module docstring).
      force_top_k: static; > 0 keeps only each row's top-k ids before temperature (0 = off).
      sum_smaller: static; also report each reported id's inclusive CDF (``SampleOutput.sum_smaller``).
      backend: which registered implementation of op ``"sample"`` to use (``"auto"``, ``"reference"``, ...);
        ``None`` follows the active op selection (:mod:`deepinfer_jax.ops.selection`), else ``"auto"``.

    Returns:
      :class:`SampleOutput`.
    """
    rows, vocab = _check_logits("sample", logits)
    if not isinstance(st, SamplingTensors):
        raise TypeError(f"sample: st must be a SamplingTensors, got {type(st).__name__}")
    if st.num_rows != rows:
        raise ValueError(f"sample: st has {st.num_rows} rows, logits has {rows}")
    if token_counts is not None and (token_counts.shape != (rows, vocab) or token_counts.dtype != jnp.int32):
        raise TypeError(
            f"sample: token_counts must be int32 {(rows, vocab)} like the logits, "
            f"got {token_counts.dtype} {tuple(token_counts.shape)}"
        )
    n = _check_num_logprobs("sample", num_logprobs)
    if n > vocab:
        raise ValueError(f"sample: num_logprobs = {n} exceeds the vocabulary size {vocab}")
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"sample: batch_invariant must be a bool, got {type(batch_invariant).__name__}")
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"sample: logprobs_mode = {logprobs_mode!r} must be one of {LOGPROBS_MODES}")
    if isinstance(force_top_k, bool) or not isinstance(force_top_k, numbers.Integral) or force_top_k < 0:
        raise ValueError(f"sample: force_top_k = {force_top_k!r} must be an int >= 0")
    impl = select("sample", backend=backend)
    return impl(
        logits,
        st,
        token_counts,
        num_logprobs=n,
        batch_invariant=batch_invariant,
        logprobs_mode=logprobs_mode,
        force_top_k=int(force_top_k),
        sum_smaller=bool(sum_smaller),
    )


def token_logprobs(
    logits: jax.Array, token_ids: jax.Array, *, num_logprobs: int = 0, batch_invariant: bool = False
) -> TokenLogprobs:
    """Log-probabilities of given tokens under ``log_softmax(logits)`` (prompt logprobs), with ranks and top-n.

    No penalty, mask or temperature applies: a prompt token's log-probability is the model's own (vLLM's
    semantics of ``prompt_logprobs``). Rows are positions; ``token_ids[i]`` is the token that followed row ``i``.
    """
    rows, vocab = _check_logits("token_logprobs", logits)
    token_ids = jnp.asarray(token_ids, jnp.int32)
    if token_ids.shape != (rows,):
        raise ValueError(f"token_logprobs: token_ids must have shape ({rows},), got {token_ids.shape}")
    n = _check_num_logprobs("token_logprobs", num_logprobs)
    if n > vocab:
        raise ValueError(f"token_logprobs: num_logprobs = {n} exceeds the vocabulary size {vocab}")

    def row(x: jax.Array, token: jax.Array) -> TokenLogprobs:
        lp = jax.nn.log_softmax(x)
        token = jnp.clip(token, 0, vocab - 1)
        top_ids, top_lps = _top_n(lp, n)
        return TokenLogprobs(lp[token], _rank_of(lp, token), top_ids, top_lps)

    if batch_invariant:
        return lax.map(lambda xs: row(*xs), (logits, token_ids))
    return jax.vmap(row)(logits, token_ids)
