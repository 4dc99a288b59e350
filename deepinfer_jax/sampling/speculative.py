"""Speculative decoding: drafting a token, and the acceptance rule that verifies drafts (spec/engine.md §8.4).

Both are pure functions of arrays. They jit with static options, carry no state, and never synchronise with the
host. Each row runs the same logit pipeline as :func:`~deepinfer_jax.sampling.pipeline.sample`, through
:func:`~deepinfer_jax.sampling.pipeline.processed_logits`.

**Drafting** (:func:`draft_sample`). One draft token per row, drawn from the row's processed distribution (no
penalties) with the fixed-point categorical and its own random stream :data:`DRAFT_STREAM`. The row also
returns the log-probabilities it drew from: ``log_softmax`` of the filtered, temperature-scaled logits, or, for a
greedy row, a point mass (0 at the argmax, -inf elsewhere).

**Verification** (:func:`verify`). A sequence that feeds ``R`` rows proposes ``n = num_drafts <= R - 1`` drafts.
Row ``j < n`` checks draft ``d_j``, the token proposed for the position row ``j`` samples. Row ``n`` is the fresh
row. Let ``Q_j`` be row ``j``'s processed target distribution (a point mass on the argmax for a greedy row) and
``P_j`` the draft's distribution (``exp`` of the stored draft log-probabilities). Then:

* a sampled verify row accepts ``d`` when ``u < min(Q_j(d) / P_j(d), 1)``, ``u`` a float uniform in
  ``[0, 1)``. A missing draft (``d < 0``) or one outside ``Q_j``'s support (filtered by the masks, min_p,
  top-k or top-p) is rejected. On rejection the row emits a draw from the residual
  ``max(Q_j - e^{-ε} P_j, 0)`` renormalised (ε = :data:`ACCEPT_PENALTY`). If that residual has no mass, it
  emits the lowest id with the largest processed logit. The factor ``e^{-ε}`` is DeepInfer's tiny penalty.
  For a normalised ``P`` it leaves the residual a mass of at least ``1 - e^{-ε}``, and the emitted
  distribution stays within about ε of ``Q_j``. ``accept_prob`` is ``max(1 - Σ residual, 0)``;
* a greedy verify row accepts ``d`` exactly when ``d`` is the argmax (lowest id on ties), and otherwise emits
  the argmax;
* the fresh row emits exactly what :func:`~deepinfer_jax.sampling.pipeline.sample` would draw for it;
* a golden token ``g`` (teacher forcing) accepts ``d`` iff ``d == g``, and is the row's token otherwise;
* only the longest accepted prefix counts. ``num_accepted = a`` is its length. The sequence emits
  ``d_0 … d_{a-1}`` and then row ``a``'s token (the bonus token). Rows after ``a`` are ignored. A row whose
  logits are unusable (``ok`` false) ends the prefix, and its entry is -1.

**Random numbers.** All draws are pure functions of ``(seed, position, stream)``
(:func:`~deepinfer_jax.sampling.rng.random_bits`). ``position`` is the position of the token the row samples
(``st.position`` of that verification row). The streams are :data:`~deepinfer_jax.sampling.rng.SAMPLE_STREAM`
(0) for the fresh row's draw, :data:`RESIDUAL_STREAM` (1) for the residual draw, :data:`ACCEPT_STREAM` (2) for the
acceptance uniform and :data:`DRAFT_STREAM` (3) for drafting. The draft for a position, its acceptance test and
its residual draw therefore use independent bits, and the result does not depend on the batch or on the row's
place in it.

**What differs from DeepInfer.** DeepInfer keys verification row ``j`` at position ``base + j·10000019`` and
shifts the draft model's seed by a constant. Here each row draws at its own position, with one stream per
purpose. A greedy row takes the exact argmax, where DeepInfer clamps the temperature to 1e-5 and runs the
sampled path. A verify row falls back to the argmax of its processed logits when the residual is empty;
DeepInfer uses the raw logits there.

**Batch invariance.** Without ``batch_invariant`` the row function is vectorised (``vmap``). With it, the
function runs under ``lax.map``, one ``[V]`` loop body for every row, as in :func:`sample`. Each row's results,
and so each sequence's, are then bitwise the same whatever ``S`` is. The prefix rule afterwards uses integer
arithmetic only.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from deepinfer_jax.ops.registry import register_impl, register_op, select
from deepinfer_jax.sampling.pipeline import (
    LOGPROBS_MODES,
    _check_num_logprobs,
    _rank_of,
    _top_n,
    processed_logits,
    reported_values,
)
from deepinfer_jax.sampling.rng import (
    SAMPLE_STREAM,
    categorical_from_weights,
    fixed_point_weights,
    random_bits,
)
from deepinfer_jax.sampling.tensors import SamplingTensors

__all__ = [
    "ACCEPT_PENALTY",
    "ACCEPT_STREAM",
    "DRAFT_STREAM",
    "RESIDUAL_STREAM",
    "VerifyOutput",
    "draft_sample",
    "verify",
]

RESIDUAL_STREAM = 1
"""Stream of the residual draw of a rejected verify row."""

ACCEPT_STREAM = 2
"""Stream of a verify row's acceptance uniform."""

DRAFT_STREAM = 3
"""Stream of drafting (:func:`draft_sample`)."""

ACCEPT_PENALTY = 5e-5
"""ε: the residual subtracts ``e^{-ε}·P`` rather than ``P`` (DeepInfer's tiny penalty)."""

_NEG_INF = float("-inf")
_DRAFT_SCALE = math.exp(-ACCEPT_PENALTY)  # e^{-ε}


class VerifyOutput(NamedTuple):
    """What :func:`verify` returns (``S`` sequences of ``R`` verification rows).

    Attributes:
      tokens: int32 ``[S, R]`` the emitted tokens in order: the accepted drafts, then the bonus token. Entries
        after the bonus token are -1, and so is the bonus entry itself when that row's logits were unusable.
      num_accepted: int32 ``[S]`` how many drafts were accepted (the bonus token is ``tokens[s, num_accepted]``).
      logprob: float32 ``[S, R]`` each emitted token's reported value (``logprobs_mode``) in its own row; 0
        where ``tokens`` is -1.
      rank: int32 ``[S, R]`` its 1-based rank in that row (ties by ascending id); 0 where ``tokens`` is -1.
      top_ids: int32 ``[S, R, n]`` the row's ``n`` highest-valued ids; -1 where ``tokens`` is -1.
      top_logprobs: float32 ``[S, R, n]`` their values; 0 where ``tokens`` is -1.
      accept_prob: float32 ``[S, R - 1]`` each verify row's acceptance probability: ``max(1 - Σ residual, 0)``
        for a sampled row, 1 or 0 (draft equals the argmax) for a greedy row, 0 for rows past ``num_drafts``
        and for unusable rows.
      ok: bool ``[S, R]`` whether each row's logits were usable (NaN- and +inf-free, something left after the
        masks). This is reported for every row, used or not.
    """

    tokens: jax.Array
    num_accepted: jax.Array
    logprob: jax.Array
    rank: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    accept_prob: jax.Array
    ok: jax.Array


class _RowResult(NamedTuple):
    token: jax.Array  # the token the row would emit (its draft if accepted, else its candidate); -1 if not ok
    accept: jax.Array  # the row accepts its draft (never for the fresh row or an unusable row)
    accept_prob: jax.Array
    ok: jax.Array
    logprob: jax.Array
    rank: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


# ---------------------------------------------------------------------------------------------------------------
# One row


def _uniform(bits: jax.Array) -> jax.Array:
    """A float32 uniform in ``[0, 1)`` from a uint32: its top 24 bits times 2^-24, exactly."""
    return (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def _residual_weights(q: jax.Array, p: jax.Array) -> jax.Array:
    """The unnormalised residual ``max(Q - e^{-ε} P, 0)`` of one row."""
    return jnp.maximum(q - jnp.float32(_DRAFT_SCALE) * p, 0.0)


def _draft_row(
    logits: jax.Array, row: SamplingTensors, *, top_k_top_p: bool | None, force_top_k: int
) -> tuple[jax.Array, jax.Array]:
    x, final, ok = processed_logits(logits, row, None, force_top_k=force_top_k, top_k_top_p=top_k_top_p)
    vocab = x.shape[-1]
    greedy = row.temperature <= 0
    top = jnp.argmax(x).astype(jnp.int32)
    weights = fixed_point_weights(jax.nn.softmax(final))
    drawn = categorical_from_weights(weights, random_bits(row.seed, row.position, DRAFT_STREAM))
    token = jnp.where(greedy, top, drawn)
    point_mass = jnp.where(lax.iota(jnp.int32, vocab) == token, 0.0, _NEG_INF)
    logprobs = jnp.where(greedy, point_mass, jax.nn.log_softmax(final))
    return jnp.where(ok, token, -1), jnp.where(ok, logprobs, _NEG_INF)


def _verify_row(
    logits: jax.Array,
    row: SamplingTensors,
    counts: jax.Array | None,
    draft: jax.Array,
    draft_logprobs: jax.Array,
    is_fresh: jax.Array,
    *,
    num_logprobs: int,
    top_k_top_p: bool | None,
    logprobs_mode: str,
    force_top_k: int,
) -> _RowResult:
    raw = logits.astype(jnp.float32)
    x, final, ok = processed_logits(raw, row, counts, force_top_k=force_top_k, top_k_top_p=top_k_top_p)
    vocab = raw.shape[-1]
    greedy = row.temperature <= 0
    top = jnp.argmax(x).astype(jnp.int32)
    q = jax.nn.softmax(final)

    # The fresh row: sample()'s own draw (stream 0).
    drawn = categorical_from_weights(
        fixed_point_weights(q), random_bits(row.seed, row.position, SAMPLE_STREAM)
    )
    fresh = jnp.where(greedy, top, drawn)

    # A verify row, sampled: the ratio test, else the residual draw.
    has_draft = (draft >= 0) & (draft < vocab)
    d = jnp.clip(draft, 0, vocab - 1)
    in_support = has_draft & (final[d] > _NEG_INF)
    log_ratio = jax.nn.log_softmax(final)[d] - draft_logprobs[d]
    u = _uniform(random_bits(row.seed, row.position, ACCEPT_STREAM))
    accept_sampled = in_support & (u < jnp.exp(jnp.minimum(log_ratio, 0.0)))
    residual = _residual_weights(q, jnp.exp(draft_logprobs))
    mass = jnp.sum(residual)
    weights = fixed_point_weights(residual / jnp.where(mass > 0, mass, 1.0))
    residual_token = categorical_from_weights(weights, random_bits(row.seed, row.position, RESIDUAL_STREAM))
    residual_token = jnp.where(mass > 0, residual_token, top)

    # A verify row, greedy: exact argmax.
    hit = has_draft & (draft == top)
    accept = jnp.where(greedy, hit, accept_sampled)
    rejected = jnp.where(greedy, top, residual_token)
    accept_prob = jnp.where(greedy, hit.astype(jnp.float32), jnp.maximum(1.0 - mass, 0.0))

    golden = row.golden >= 0
    accept = jnp.where(golden, has_draft & (draft == row.golden), accept)
    candidate = jnp.where(golden, row.golden, jnp.where(is_fresh, fresh, rejected))
    accept = accept & ~is_fresh & ok
    token = jnp.where(ok, jnp.where(accept, draft, candidate), -1)

    reported = reported_values(raw, jnp.where(greedy, x, final), logprobs_mode)
    top_ids, top_lps = _top_n(reported, num_logprobs)
    safe = jnp.maximum(token, 0)
    return _RowResult(
        token,
        accept,
        jnp.where(ok & ~is_fresh, accept_prob, 0.0),
        ok,
        reported[safe],
        _rank_of(reported, safe),
        top_ids,
        top_lps,
    )


# ---------------------------------------------------------------------------------------------------------------
# Batched


def _map_rows(
    row_fn: Callable[..., Any], args: tuple[Any, ...], st: SamplingTensors, vocab: int, batch_invariant: bool
) -> Any:
    """Apply ``row_fn(top_k_top_p=...)`` to every row of ``args``, as :func:`sample` does."""
    if batch_invariant:
        fn = functools.partial(row_fn, top_k_top_p=None)
        return lax.map(lambda xs: fn(*xs), args)

    def batched(filtering: bool) -> Any:
        return jax.vmap(functools.partial(row_fn, top_k_top_p=filtering))(*args)

    # Decided for the whole batch: under vmap a per-row cond would run both branches anyway.
    filtering = jnp.any((st.temperature > 0) & ((st.top_k < vocab) | (st.top_p < 1.0)))
    return lax.cond(filtering, lambda: batched(True), lambda: batched(False))


def _check_options(fn: str, force_top_k: Any, batch_invariant: Any) -> int:
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"{fn}: batch_invariant must be a bool, got {type(batch_invariant).__name__}")
    if isinstance(force_top_k, bool) or not isinstance(force_top_k, numbers.Integral) or force_top_k < 0:
        raise ValueError(f"{fn}: force_top_k = {force_top_k!r} must be an int >= 0")
    return int(force_top_k)


def _check_array(fn: str, name: str, a: Any, shape: tuple[int, ...], dtype: Any) -> None:
    if not (hasattr(a, "dtype") and hasattr(a, "shape")):
        raise TypeError(f"{fn}: {name} must be an array, got {type(a).__name__}")
    if tuple(a.shape) != shape or a.dtype != dtype:
        raise TypeError(f"{fn}: {name} must be {jnp.dtype(dtype)} {shape}, got {a.dtype} {tuple(a.shape)}")


def _draft_reference(
    logits: jax.Array, st: SamplingTensors, *, force_top_k: int, batch_invariant: bool
) -> tuple[jax.Array, jax.Array]:
    """The jnp reference of op ``"draft_sample"`` (arguments checked by :func:`draft_sample`)."""
    row_fn = functools.partial(_draft_row, force_top_k=force_top_k)
    return _map_rows(row_fn, (logits, st), st, logits.shape[-1], batch_invariant)


def _verify_reference(
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
) -> _RowResult:
    """The jnp reference of op ``"verify"``: every verification row on its own, ``N`` rows flattened from
    ``[S, R]`` (``logits [N, V]``, ``st`` with ``N`` rows, ``counts [N, V]`` or ``None``, ``drafts [N]`` with -1
    for none, ``draft_logprobs [N, V]``, ``is_fresh [N]``); :func:`verify` applies the prefix rule to the
    result."""
    vocab = logits.shape[-1]
    row_fn = functools.partial(
        _verify_row, num_logprobs=num_logprobs, logprobs_mode=logprobs_mode, force_top_k=force_top_k
    )
    if counts is None:
        row_fn = functools.partial(row_fn, counts=None)

        def one(lg, r, d, lp, f, *, top_k_top_p):
            return row_fn(lg, r, draft=d, draft_logprobs=lp, is_fresh=f, top_k_top_p=top_k_top_p)

        args = (logits, st)
    else:

        def one(lg, r, c, d, lp, f, *, top_k_top_p):
            return row_fn(lg, r, c, d, lp, f, top_k_top_p=top_k_top_p)

        args = (logits, st, counts)
    return _map_rows(one, (*args, drafts, draft_logprobs, is_fresh), st, vocab, batch_invariant)


register_op(
    "draft_sample",
    _draft_reference,
    doc="Speculative drafting: one token per row from its processed distribution, and that distribution",
)
register_op(
    "verify",
    _verify_reference,
    doc="Speculative verification rows: acceptance test, residual / fresh draw, reported values",
)
# The tokens, acceptances and draft distributions from the fused Pallas sampler's draft / verify modes, the
# reported values in jnp around them; the references as named Ascend calls (deepinfer_jax/sampling/fused.py).
for _op in ("draft_sample", "verify"):
    register_impl(
        _op,
        "pallas_gpu",
        f"deepinfer_jax.sampling.fused:{_op}_pallas",
        platforms=("gpu",),
        reason="the fused Pallas Triton sampler needs the pallas_kernels package",
    )
    register_impl(_op, "ascend", f"deepinfer_jax.sampling.fused:{_op}_ascend", platforms=("ascend",))
del _op


def draft_sample(
    logits: jax.Array, st: SamplingTensors, *, force_top_k: int = 0, batch_invariant: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Draw one draft token per row from its processed distribution (stream :data:`DRAFT_STREAM`).

    No penalties apply, and ``st.golden`` is ignored.

    Args:
      logits: float32 ``[S, V]``, the draft model's logits.
      st: :class:`SamplingTensors` with ``S`` rows; ``st.position`` is the position each draft is proposed for.
      force_top_k: static; > 0 keeps only each row's top-k ids (0 = off).
      batch_invariant: static; bitwise row results independent of ``S`` (``lax.map`` over rows).

    Returns:
      ``(tokens, logprobs)``: int32 ``[S]`` the drafts, and float32 ``[S, V]`` the log-probabilities each was
      drawn from. For a sampled row that is ``log_softmax`` of its filtered, scaled logits. For a greedy row it
      is 0 at the argmax and -inf elsewhere. A row with unusable logits drafts -1 with all -inf.
    """
    if not (hasattr(logits, "dtype") and hasattr(logits, "shape")) or len(logits.shape) != 2:
        raise TypeError(f"draft_sample: logits must be a float32 [S, V] array, got {type(logits).__name__}")
    rows, vocab = (int(n) for n in logits.shape)
    _check_array("draft_sample", "logits", logits, (rows, vocab), jnp.float32)
    if not isinstance(st, SamplingTensors):
        raise TypeError(f"draft_sample: st must be a SamplingTensors, got {type(st).__name__}")
    if tuple(st.temperature.shape) != (rows,):
        raise ValueError(f"draft_sample: st has rows {tuple(st.temperature.shape)}, logits has ({rows},)")
    k = _check_options("draft_sample", force_top_k, batch_invariant)
    return select("draft_sample")(logits, st, force_top_k=k, batch_invariant=batch_invariant)


def verify(
    logits: jax.Array,
    st: SamplingTensors,
    counts: jax.Array | None,
    drafts: jax.Array,
    draft_logprobs: jax.Array,
    num_drafts: jax.Array,
    *,
    num_logprobs: int = 0,
    logprobs_mode: str = "raw_logprobs",
    force_top_k: int = 0,
    batch_invariant: bool = False,
) -> VerifyOutput:
    """Verify each sequence's drafts and emit its accepted prefix and bonus token (module docstring).

    Args:
      logits: float32 ``[S, R, V]``, the target model's logits of each sequence's ``R`` verification rows.
      st: :class:`SamplingTensors` whose leaves have leading axes ``[S, R]``. Each verification row has its own
        row, and ``st.position[s, j]`` is the position of the token row ``j`` samples.
      counts: int32 ``[S, R, V]`` each row's penalty count state, or ``None`` for no penalties.
      drafts: int32 ``[S, R - 1]``. ``drafts[s, j]`` is the token proposed for row ``j``'s position; -1 means
        no draft.
      draft_logprobs: float32 ``[S, R - 1, V]`` the log-probabilities each draft was drawn from
        (:func:`draft_sample`).
      num_drafts: int32 ``[S]`` in ``[0, R - 1]``, how many drafts sequence ``s`` verifies (values outside are
        clipped). Row ``num_drafts[s]`` is its fresh row, and rows after it are ignored.
      num_logprobs: static ``n`` in ``[0, 20]``: how many top alternatives to report per emitted token.
      logprobs_mode: static; what the reported values are (as for :func:`sample`).
      force_top_k: static; > 0 keeps only each row's top-k ids (0 = off).
      batch_invariant: static; bitwise results per sequence independent of ``S`` (``lax.map`` over rows).

    Returns:
      :class:`VerifyOutput`.
    """
    fn = "verify"
    if not (hasattr(logits, "dtype") and hasattr(logits, "shape")) or len(logits.shape) != 3:
        raise TypeError(f"{fn}: logits must be a float32 [S, R, V] array")
    seqs, rows, vocab = (int(n) for n in logits.shape)
    if rows < 1:
        raise ValueError(f"{fn}: logits must have at least one verification row, got R = {rows}")
    _check_array(fn, "logits", logits, (seqs, rows, vocab), jnp.float32)
    if not isinstance(st, SamplingTensors):
        raise TypeError(f"{fn}: st must be a SamplingTensors, got {type(st).__name__}")
    if tuple(st.temperature.shape) != (seqs, rows):
        raise ValueError(f"{fn}: st has rows {tuple(st.temperature.shape)}, logits has {(seqs, rows)}")
    if counts is not None:
        _check_array(fn, "counts", counts, (seqs, rows, vocab), jnp.int32)
    _check_array(fn, "drafts", drafts, (seqs, rows - 1), jnp.int32)
    _check_array(fn, "draft_logprobs", draft_logprobs, (seqs, rows - 1, vocab), jnp.float32)
    _check_array(fn, "num_drafts", num_drafts, (seqs,), jnp.int32)
    n = _check_num_logprobs(fn, num_logprobs)
    if n > vocab:
        raise ValueError(f"{fn}: num_logprobs = {n} exceeds the vocabulary size {vocab}")
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"{fn}: logprobs_mode = {logprobs_mode!r} must be one of {LOGPROBS_MODES}")
    k = _check_options(fn, force_top_k, batch_invariant)

    nd = jnp.clip(jnp.asarray(num_drafts), 0, rows - 1)
    j = lax.iota(jnp.int32, rows)[None, :]
    padded = jnp.concatenate([jnp.asarray(drafts), jnp.full((seqs, 1), -1, jnp.int32)], axis=1)
    padded = jnp.where(j < nd[:, None], padded, -1)
    padded_lp = jnp.concatenate(
        [jnp.asarray(draft_logprobs), jnp.full((seqs, 1, vocab), _NEG_INF, jnp.float32)], axis=1
    )
    is_fresh = j == nd[:, None]

    flat = seqs * rows
    flat_st = SamplingTensors(*(jnp.asarray(a).reshape(flat, *a.shape[2:]) for a in st))
    out = select("verify")(
        logits.reshape(flat, vocab),
        flat_st,
        None if counts is None else counts.reshape(flat, vocab),
        padded.reshape(flat),
        padded_lp.reshape(flat, vocab),
        is_fresh.reshape(flat),
        num_logprobs=n,
        logprobs_mode=logprobs_mode,
        force_top_k=k,
        batch_invariant=batch_invariant,
    )
    out = jax.tree.map(lambda a: a.reshape(seqs, rows, *a.shape[1:]), out)

    # The prefix rule. Row num_drafts never accepts (its draft is -1), so a first non-accepting row exists.
    num_accepted = jnp.argmax(~out.accept, axis=1).astype(jnp.int32)
    emitted = (j <= num_accepted[:, None]) & (out.token >= 0)
    tokens = jnp.where(emitted, out.token, -1)
    accept_prob = jnp.where(j[:, : rows - 1] < nd[:, None], out.accept_prob[:, : rows - 1], 0.0)
    return VerifyOutput(
        tokens=tokens,
        num_accepted=num_accepted,
        logprob=jnp.where(emitted, out.logprob, 0.0),
        rank=jnp.where(emitted, out.rank, 0),
        top_ids=jnp.where(emitted[..., None], out.top_ids, -1),
        top_logprobs=jnp.where(emitted[..., None], out.top_logprobs, 0.0),
        accept_prob=accept_prob,
        ok=out.ok,
    )
