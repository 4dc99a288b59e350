"""Device-side re-allocation of verify rows under overlapped scheduling (engine spec §8.6.2).

The host fixes the step's verify row count ``total_q`` with confidences from two rounds back
(:func:`deepinfer_jax.engine.spec_budget.plan_verify_lengths`). When the step is dispatched before the previous
one has finished, the device already holds newer confidences, so it redoes only the split of those rows between
the requests, in the order the host uses: each real request keeps its own row, and the ``total_q - num_seqs``
remaining rows go to the draft entries of highest cumulative confidence across the whole batch (ties: lower
flat index ``s * K + k`` first, i.e. lower request, then earlier draft). The result has static shapes, so it
runs inside the jitted step without a host round trip. Kept apart from :mod:`~deepinfer_jax.engine.spec_budget`
so that the host side never imports JAX.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["Repacked", "reallocate", "repack_rows", "resplit"]


def reallocate(
    confidences: jax.Array, num_drafts: jax.Array, total_q: jax.Array | int, num_seqs: jax.Array | int
) -> jax.Array:
    """Per-row verify lengths ``seqlen_q`` (int32 ``[S]``) for a fixed row budget ``total_q``.

    ``confidences`` (float32 ``[S, K]``): per-draft acceptance confidences of each row. ``num_drafts`` (int32
    ``[S]``): drafts row ``s`` actually has; entries at ``k >= num_drafts[s]`` do not exist (a fresh row has 0).
    ``num_seqs``: rows ``>= num_seqs`` are padding and get length 0.

    Entry ``(s, k)`` is worth the cumulative product of row ``s``'s confidences up to ``k``. Entries that do not
    exist (past ``num_drafts``, or in padding rows) count as 0 for the product and are ranked after every real
    entry and never taken, so a row never verifies more drafts than it has, and on the real entries the order
    (value descending, flat index ascending, stable) matches the host's queue exactly. Confidences are clipped
    to ``[0, 1]`` and NaN counts as 0. Real row ``s`` gets ``1 + #(its entries ranked below total_q - num_seqs)``.
    Jit-able: ``total_q`` and ``num_seqs`` may be traced scalars.
    """
    conf = jnp.asarray(confidences, jnp.float32)
    if conf.ndim != 2:
        raise ValueError(f"confidences: expected a [S, K] array, got shape {conf.shape}")
    s_rows, k_drafts = conf.shape
    nd = jnp.asarray(num_drafts, jnp.int32)
    if nd.shape != (s_rows,):
        raise ValueError(f"num_drafts: expected shape ({s_rows},), got {nd.shape}")
    total_q = jnp.asarray(total_q, jnp.int32)
    num_seqs = jnp.asarray(num_seqs, jnp.int32)

    real = jnp.arange(s_rows, dtype=jnp.int32) < num_seqs
    valid = (jnp.arange(k_drafts, dtype=jnp.int32)[None, :] < nd[:, None]) & real[:, None]
    conf = jnp.clip(jnp.where(jnp.isnan(conf), 0.0, conf), 0.0, 1.0)
    rates = jnp.cumprod(jnp.where(valid, conf, 0.0), axis=1)
    # Ascending sort key: -rate for real entries (+ 0.0 turns -0.0 into 0.0 so zeros tie), +inf for the rest.
    key = jnp.where(valid, -rates + 0.0, jnp.inf).reshape(-1)
    order = jnp.argsort(key, stable=True)
    n = s_rows * k_drafts
    rank = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32)).reshape(s_rows, k_drafts)
    taken = valid & (rank < total_q - num_seqs)
    seqlen = 1 + jnp.sum(taken, axis=1, dtype=jnp.int32)
    return jnp.where(real, seqlen, 0).astype(jnp.int32)


def resplit(
    confidences: jax.Array, num_drafts: jax.Array, eligible: jax.Array, num_draft_tokens: int
) -> jax.Array:
    """The step's verify lengths with the freshest confidences: ``num_drafts`` (int32 ``[S]``, the host's split)
    re-split among the ``eligible`` rows (bool ``[S]``: decode rows whose drafts the planner chose from; the rest
    keep theirs) by :func:`reallocate`, keeping their total. Every eligible row has ``num_draft_tokens`` drafts in
    its pool; ``confidences`` (float32 ``[S, K]``) are the pool's. Returns the new ``num_drafts``."""
    rows = num_drafts.shape[0]
    avail = jnp.where(eligible, num_draft_tokens, 0).astype(jnp.int32)
    total = rows + jnp.sum(jnp.where(eligible, num_drafts, 0))
    seqlen = reallocate(jnp.where(eligible[:, None], confidences, 0.0), avail, total, rows)
    return jnp.where(eligible, seqlen - 1, num_drafts).astype(jnp.int32)


class Repacked(NamedTuple):
    """The ragged layout of a step after its rows' draft counts changed (:func:`repack_rows`)."""

    token_ids: jax.Array
    positions: jax.Array
    token_seq: jax.Array
    query_start: jax.Array
    context_lens: jax.Array
    source: jax.Array
    """int32 ``[T]``: the old flat index each new token's per-token data comes from (``-1``: a draft slot, or
    padding)."""


def repack_rows(
    token_ids: jax.Array,
    positions: jax.Array,
    token_seq: jax.Array,
    query_start: jax.Array,
    context_lens: jax.Array,
    num_drafts: jax.Array,
    new_drafts: jax.Array,
    *,
    draft_token: int,
) -> Repacked:
    """The flat token layout of the same rows with ``new_drafts`` (int32 ``[S]``) drafts instead of
    ``num_drafts``: each row keeps its known tokens (its first ``length - num_drafts``) and their positions, then
    ``new_drafts`` slots of ``draft_token`` at the next positions; rows stay in order and contiguous; the total
    is unchanged when ``sum(new_drafts) == sum(num_drafts)`` (the caller's invariant), so the padding after the
    last row stays padding (``token_seq = S``). ``context_lens`` move by ``new_drafts - num_drafts``."""
    tokens = token_ids.shape[0]
    rows = num_drafts.shape[0]
    lengths = query_start[1:] - query_start[:-1]
    known = lengths - num_drafts
    new_lengths = jnp.where(lengths > 0, known + new_drafts, 0)
    qs = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(new_lengths).astype(jnp.int32)])
    t = jnp.arange(tokens, dtype=jnp.int32)
    row = jnp.searchsorted(qs[1:], t, side="right").astype(jnp.int32)  # the row whose range holds t
    real = row < rows
    r = jnp.where(real, row, 0)
    offset = t - qs[r]
    old_first = query_start[r]
    first_pos = positions[jnp.clip(old_first, 0, tokens - 1)]
    is_known = real & (offset < known[r])
    source = jnp.where(is_known, old_first + offset, -1)
    safe = jnp.clip(source, 0, tokens - 1)
    return Repacked(
        token_ids=jnp.where(is_known, token_ids[safe], jnp.where(real, draft_token, 0)).astype(
            token_ids.dtype
        ),
        positions=jnp.where(real, first_pos + offset, 0).astype(positions.dtype),
        token_seq=jnp.where(real, row, rows).astype(token_seq.dtype),
        query_start=qs,
        context_lens=jnp.where(lengths > 0, context_lens - num_drafts + new_drafts, context_lens).astype(
            context_lens.dtype
        ),
        source=source,
    )
