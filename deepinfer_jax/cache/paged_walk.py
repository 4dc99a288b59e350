"""Reading paged compressed entries a page at a time, and the few-token history reads of compressors.

The compressed layers of DeepSeek-V4 and V4.1 keep one entry per ``r`` positions in paged blocks (layout in
:mod:`deepinfer_jax.cache.ragged`: entry ``c`` of a row lives at ``block_tables[row, c·r // block]``, offset
``(c·r % block) // r``; a page holds ``E = block // r`` entries). A query at position ``p`` may use entry ``c``
only once its window is complete, ``(c + 1)·r <= p + 1``. This module holds the reads that walk those pages
without ever gathering a sequence's whole compressed context with its full head dimension for every token:

* :func:`walk_pages` -- the generic loop: a ``lax.fori_loop`` over block-table columns, bounded by the batch's
  longest context, handing ``body`` each token's entries of one page (``chunk`` pages per iteration) with their
  compressed indices and visibility. Temporary memory is ``T · chunk · E`` entries per iteration.
* :func:`paged_scores` -- a score per token and entry (``[T, N]``, ``N = M · E`` for block tables of ``M``
  columns, ``-inf`` where not visible), for the lightning indexer: only the scores of the whole context are
  materialised, the keys one page at a time.
* :func:`topk_entries` -- the ``k`` best visible entries per token as compressed indices (``-1`` = none), in the
  order and with the tie-breaking of ``lax.top_k`` on the compressed-index axis (lower index first), so the
  selection equals a dense top-k over the same entries. Read them back with
  :func:`~deepinfer_jax.cache.ragged.gather_entries`.
* :func:`paged_attend_all` -- attention of every token over **all** its visible entries (shared key = value),
  as an online-softmax :class:`SoftmaxState` (running max, sum and weighted values, float32). The caller merges
  it with the other parts of the same softmax (the sliding window, selected entries) with
  :func:`merge_softmax` and normalises once with :func:`finish_softmax`, which also adds per-head sink logits
  (probability mass without a value, DeepSeek-V4's attention sinks).
* :func:`attend_dense` -- the same state for keys already gathered per token (``[T, K, D]`` with a mask), e.g.
  the window from :func:`~deepinfer_jax.cache.ragged.history` or the top-k entries.
* :func:`emitting_tokens` -- for compressors: the indices of the (few) tokens that complete a compressed entry
  in this step; :func:`~deepinfer_jax.cache.ragged.history` with ``index=`` those tokens gathers only for them, so the ``r`` (or ``2r``) projections an entry pools are gathered for those tokens only
  (``(T // r + S) · depth`` items rather than ``T · depth``).

Every read is masked by position and validity, never by stored zeros: a state slot or a block is reused by a
later sequence without being cleared. Padding tokens (``meta.valid`` false) see nothing; their outputs are
meaningless and must not be written anywhere by the caller.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from deepinfer_jax.cache.ragged import RaggedMeta

__all__ = [
    "SoftmaxState",
    "attend_dense",
    "emitting_tokens",
    "finish_softmax",
    "merge_softmax",
    "paged_attend_all",
    "paged_scores",
    "topk_entries",
    "walk_pages",
]

_HIGHEST = lax.Precision.HIGHEST


def _check_geometry(ratio: int, block_size: int, chunk: int) -> int:
    for name, value in (("ratio", ratio), ("block_size", block_size), ("chunk", chunk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"paged walk: {name} must be an int >= 1, got {value!r}")
    if block_size % ratio:
        raise ValueError(f"paged walk: ratio {ratio} does not divide the cache block of {block_size} tokens")
    return block_size // ratio


def walk_pages(
    pages: Any,
    meta: RaggedMeta,
    body: Callable[[jax.Array, Any, jax.Array, jax.Array, Any], Any],
    init: Any,
    *,
    ratio: int,
    block_size: int,
    chunk: int = 1,
) -> Any:
    """Fold ``body`` over the pages of every token's row, ``chunk`` block-table columns per iteration.

    Args:
      pages: pytree of ``[num_blocks, block_size // ratio, ...]`` page arrays of one layer.
      meta: the step's addressing.
      body: ``body(step, entries, index, visible, carry) -> carry`` where ``entries`` is the pytree with leaves
        ``[T, chunk·E, ...]`` (this iteration's pages of each token's row, unallocated pages read as zeros),
        ``index`` the int32 ``[T, chunk·E]`` compressed indices and ``visible`` the bool ``[T, chunk·E]`` mask
        (complete for the token's position, allocated, and the token real).
      init: the initial carry.
      ratio, block_size: the layer's compression ratio and the cache block (``ratio`` must divide it).
      chunk: block-table columns per iteration (more pages per iteration: fewer loop trips, more memory).

    The loop runs ``ceil(ceil(max(context_lens) / block_size) / chunk)`` times: never over columns that no row
    of the batch has reached. Returns the final carry.
    """
    per_page = _check_geometry(ratio, block_size, chunk)
    num_blocks = jax.tree.leaves(pages)[0].shape[0]
    max_cols = meta.block_tables.shape[1]
    padded_cols = -(-max_cols // chunk) * chunk
    # [S, padded_cols]: the rows' tables are sliced per iteration and only then spread over the tokens, so
    # no [T, columns] array is ever built (at a long max_model_len that would be the largest temporary).
    tables = jnp.pad(meta.block_tables, ((0, 0), (0, padded_cols - max_cols)), constant_values=-1)
    limit = (meta.positions + 1) // ratio  # entries complete for each token
    max_len = jnp.max(jnp.where(meta.seq_slots >= 0, meta.context_lens, 0)).astype(jnp.int32)
    used_cols = jnp.minimum((max_len + block_size - 1) // block_size, max_cols)
    trips = (used_cols + chunk - 1) // chunk
    offsets = jnp.arange(per_page, dtype=jnp.int32)

    def step(i: jax.Array, carry: Any) -> Any:
        cols = lax.dynamic_slice_in_dim(tables, i * chunk, chunk, axis=1)[meta.row]  # [T, chunk]
        allocated = cols >= 0
        safe = jnp.where(allocated, cols, num_blocks)
        entries = jax.tree.map(
            lambda p: (
                p.at[safe]
                .get(mode="fill", fill_value=0)
                .reshape(safe.shape[0], chunk * per_page, *p.shape[2:])
            ),
            pages,
        )
        first = (i * chunk + jnp.arange(chunk, dtype=jnp.int32)) * per_page  # [chunk]
        index = (first[:, None] + offsets[None, :]).reshape(-1)  # [chunk·E]
        index = jnp.broadcast_to(index, (safe.shape[0], chunk * per_page))
        visible = (index < limit[:, None]) & jnp.repeat(allocated, per_page, axis=1) & meta.valid[:, None]
        return body(i, entries, index, visible, carry)

    return lax.fori_loop(0, trips, step, init)


def paged_scores(
    pages: Any,
    meta: RaggedMeta,
    score_fn: Callable[[Any], jax.Array],
    *,
    ratio: int,
    block_size: int,
    dtype: Any = jnp.float32,
    chunk: int = 1,
) -> jax.Array:
    """Scores ``[T, M·E]`` of every token against every entry of its row, ``-inf`` where not visible.

    ``score_fn(entries) -> [T, K]`` scores the entries of one iteration (leaves ``[T, K, ...]``, ``K =
    chunk·E``); its result is cast to ``dtype`` (e.g. bfloat16, where the indexer materialises its scores in
    bfloat16) before masking. Column ``c`` is compressed entry ``c``; columns past the batch's longest context
    stay ``-inf``.
    """
    per_page = _check_geometry(ratio, block_size, chunk)
    tokens = meta.num_tokens
    width = meta.block_tables.shape[1] * per_page
    padded = -(-meta.block_tables.shape[1] // chunk) * chunk * per_page

    def body(i: jax.Array, entries: Any, index: jax.Array, visible: jax.Array, out: jax.Array) -> jax.Array:
        s = score_fn(entries).astype(dtype)
        s = jnp.where(visible, s, jnp.asarray(-jnp.inf, dtype))
        return lax.dynamic_update_slice_in_dim(out, s, i * chunk * per_page, axis=1)

    init = jnp.full((tokens, padded), -jnp.inf, dtype)
    out = walk_pages(pages, meta, body, init, ratio=ratio, block_size=block_size, chunk=chunk)
    return out[:, :width]


def topk_entries(scores: jax.Array, k: int) -> jax.Array:
    """Compressed indices ``[T, k]`` of the ``k`` highest finite scores of each row, ``-1`` for none.

    ``k == 0`` or ``k >= N`` keeps every finite entry (the dense case: all visible entries are attended), still
    as ``[T, N]`` (or ``[T, k]``) indices. Ties go to the lower index (``lax.top_k``).
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"topk_entries: k (index_topk) must be an int >= 0, got {k!r}")
    width = scores.shape[-1]
    take = width if k == 0 else min(k, width)
    values, idx = lax.top_k(scores.astype(jnp.float32), take)
    index = jnp.where(values > -jnp.inf, idx, -1).astype(jnp.int32)
    if k > width:
        index = jnp.pad(index, ((0, 0), (0, k - width)), constant_values=-1)
    return index


class SoftmaxState(NamedTuple):
    """An un-normalised softmax over part of the keys, per token and head (all float32).

    Attributes:
      peak: ``[T, H]`` running maximum logit (``-inf`` when no key was visible).
      total: ``[T, H]`` sum of ``exp(logit - peak)``.
      acc: ``[T, H, D]`` sum of ``exp(logit - peak) · value``.
    """

    peak: jax.Array
    total: jax.Array
    acc: jax.Array


def _empty_state(tokens: int, heads: int, dim: int) -> SoftmaxState:
    return SoftmaxState(
        jnp.full((tokens, heads), -jnp.inf, jnp.float32),
        jnp.zeros((tokens, heads), jnp.float32),
        jnp.zeros((tokens, heads, dim), jnp.float32),
    )


def _accumulate(state: SoftmaxState, logits: jax.Array, values: jax.Array, mask: jax.Array) -> SoftmaxState:
    """``state`` plus keys with ``logits [T, H, K]``, ``values [T, K, D]`` and ``mask [T, K]``."""
    logits = jnp.where(mask[:, None, :], logits, -jnp.inf)
    peak = jnp.maximum(state.peak, jnp.max(logits, axis=-1))
    safe = jnp.where(jnp.isfinite(peak), peak, 0.0)
    correction = jnp.where(jnp.isfinite(state.peak), jnp.exp(state.peak - safe), 0.0)
    probs = jnp.where(mask[:, None, :], jnp.exp(logits - safe[..., None]), 0.0)
    total = state.total * correction + jnp.sum(probs, axis=-1)
    acc = state.acc * correction[..., None] + jnp.einsum(
        "thk,tkd->thd", probs, values.astype(jnp.float32), precision=_HIGHEST
    )
    return SoftmaxState(peak, total, acc)


def _logits(q: jax.Array, keys: jax.Array, scale: float) -> jax.Array:
    return jnp.einsum(
        "thd,tkd->thk", q.astype(jnp.float32), keys.astype(jnp.float32), precision=_HIGHEST
    ) * jnp.float32(scale)


def attend_dense(q: jax.Array, keys: jax.Array, mask: jax.Array, *, scale: float) -> SoftmaxState:
    """Softmax state of queries ``q [T, H, D]`` over per-token keys = values ``keys [T, K, D]`` (``mask [T, K]``)."""
    tokens, heads, dim = q.shape
    return _accumulate(_empty_state(tokens, heads, dim), _logits(q, keys, scale), keys, mask)


def paged_attend_all(
    q: jax.Array,
    pages: Any,
    meta: RaggedMeta,
    *,
    ratio: int,
    block_size: int,
    scale: float,
    chunk: int = 1,
    decode: Callable[[Any], jax.Array] | None = None,
) -> SoftmaxState:
    """Softmax state of ``q [T, H, D]`` over every visible entry of its row's pages ``[num_blocks, E, D]``.

    Keys are values (DeepSeek-V4's shared K = V head). One page (``chunk`` pages) per token per iteration.
    ``decode`` maps one iteration's stored entries (``pages``' leaves gathered to ``[T, K, ...]``) to keys
    ``[T, K, D]``, for pages that hold quantised records (default: the pages hold the keys).
    """
    tokens, heads, dim = q.shape

    def body(
        i: jax.Array, entries: Any, index: jax.Array, visible: jax.Array, state: SoftmaxState
    ) -> SoftmaxState:
        keys = entries if decode is None else decode(entries)
        return _accumulate(state, _logits(q, keys, scale), keys, visible)

    return walk_pages(
        pages,
        meta,
        body,
        _empty_state(tokens, heads, dim),
        ratio=ratio,
        block_size=block_size,
        chunk=chunk,
    )


def merge_softmax(*states: SoftmaxState) -> SoftmaxState:
    """One state over the union of the keys of ``states`` (disjoint key sets of the same queries)."""
    if not states:
        raise ValueError("merge_softmax: expected at least one SoftmaxState")
    peak = states[0].peak
    for s in states[1:]:
        peak = jnp.maximum(peak, s.peak)
    safe = jnp.where(jnp.isfinite(peak), peak, 0.0)
    total = jnp.zeros_like(states[0].total)
    acc = jnp.zeros_like(states[0].acc)
    for s in states:
        w = jnp.where(jnp.isfinite(s.peak), jnp.exp(s.peak - safe), 0.0)
        total = total + s.total * w
        acc = acc + s.acc * w[..., None]
    return SoftmaxState(peak, total, acc)


def finish_softmax(state: SoftmaxState, sinks: jax.Array | None = None) -> jax.Array:
    """Normalised outputs ``[T, H, D]`` float32; ``sinks [H]`` add one value-less logit per head.

    With sinks the weights sum to less than one (the sink takes its share); without, a row that saw no key
    returns zeros.
    """
    if sinks is None:
        return state.acc / jnp.where(state.total > 0, state.total, 1.0)[..., None]
    sink = sinks.astype(jnp.float32)[None, :]
    peak = jnp.maximum(state.peak, sink)
    w = jnp.where(jnp.isfinite(state.peak), jnp.exp(state.peak - peak), 0.0)
    total = state.total * w + jnp.exp(sink - peak)
    return state.acc * (w / total)[..., None]


def emitting_tokens(meta: RaggedMeta, ratio: int) -> jax.Array:
    """int32 ``[E]``: indices of the real tokens at positions ``p`` with ``(p + 1) % ratio == 0``, then ``T``.

    A row of ``n`` tokens completes at most ``n // ratio + 1`` entries, so ``E = T // ratio + min(S, T)``
    bounds every batch (static). The padding indices equal ``T`` (out of range: fill on gathers, drop on
    scatters).
    """
    if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
        raise ValueError(f"emitting_tokens: ratio must be an int >= 1, got {ratio!r}")
    tokens = meta.num_tokens
    bound = min(tokens, tokens // ratio + min(meta.num_rows, tokens))
    emits = meta.valid & ((meta.positions + 1) % ratio == 0)
    (index,) = jnp.nonzero(emits, size=bound, fill_value=tokens)
    return index.astype(jnp.int32)
