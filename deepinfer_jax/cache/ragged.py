"""Addressing for a flat ragged token batch over per-sequence state slots and paged compressed caches.

An engine step (ARCHITECTURE §4) runs the tokens of many sequences as one flat batch: token ``t`` belongs to row
``token_seq[t]`` (``>= S`` marks padding) at absolute position ``positions[t]``; a row's tokens are contiguous,
``query_start[s] .. query_start[s+1]``, and hold consecutive positions ending at ``context_lens[s] - 1``. Every
row owns a **state slot** (``seq_slots[s]``) and a **block table** (``block_tables[s]``).

DeepSeek-V4 and V4.1 keep three kinds of per-sequence memory (``spec/engine.md`` §6.3), and this module holds the
addressing all three need, written once:

* **Position rings** in the state slot: the last ``R`` items of a sequence (window keys, the projections of an
  incomplete compression window, recent Engram ids), item of position ``q`` at ring index ``q % R``.
  :func:`history` gives every token the items at positions ``p - depth + 1 .. p`` of its own row, each taken
  from this step's new items when the position lies in this step and from the ring otherwise (so a prefill
  chunk, a decode token and a mix of both see exactly what one pass over the whole sequence would).
  :func:`ring_write` then stores each row's last ``R`` new items.
* **Paged compressed entries**: compressed token ``c`` of a ratio-``r`` layer covers positions
  ``[c·r, (c+1)·r)`` and lives in the page of its first position, ``block_tables[s, c·r // block]`` at offset
  ``(c·r % block) // r``; token ``p`` emits it when ``(p + 1) % r == 0`` (:func:`compressed_slots`).
  :func:`gather_entries` reads chosen entries back by compressed index.

Everything is a gather or a scatter with out-of-range indices dropped or filled, so padding tokens and unused
table entries (``-1``) never touch live data, and temporary memory scales with the tokens of the step, never with
the cache.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from deepinfer_jax.ops.tiling import tile_rows, tiled_map, untile_rows

__all__ = [
    "RaggedMeta",
    "compressed_slots",
    "gather_entries",
    "history",
    "make_meta",
    "page_rows",
    "replay_bounded",
    "replay_compact",
    "ring_write",
    "rowwise_meta",
    "write_entries",
]


class RaggedMeta(NamedTuple):
    """Per-step addressing of a flat ragged batch (built once per step by :func:`make_meta`).

    Attributes:
      token_seq: int32 ``[T]`` row of each token; ``S`` (or more) for padding.
      positions: int32 ``[T]`` absolute positions.
      query_start: int32 ``[S+1]`` row offsets into the token axis.
      context_lens: int32 ``[S]`` tokens of each row after this step.
      seq_slots: int32 ``[S]`` state slot of each row (``-1`` padding).
      block_tables: int32 ``[S, M]`` physical blocks (``-1`` unused).
      valid: bool ``[T]`` real (non-padding) tokens.
      row: int32 ``[T]`` the token's row clamped into ``[0, S)`` (safe for gathers; mask with ``valid``).
      row_start: int32 ``[S]`` first position of each row in this step.
      slot: int32 ``[T]`` the token's state slot (``-1`` for padding).
      snapshots: prefix caching's state snapshots written by this step, or ``None``: int32 ``[3, J]`` rows
        ``(row, boundary, slot)``: after the step, state slot ``slot`` holds what row ``row``'s slot holds right
        after position ``boundary - 1`` (the step copied the row's slot there before it ran, and
        :func:`ring_write` adds the row's items of positions ``[boundary - R, boundary)``); ``slot = -1`` = none.
      replay_from: SWA bounded replay (``docs/models_v41.md``): int32 ``[S]`` the first position each row's YOCO
        consumer layers may see (``R = L - K``; ``-1`` = no bound), or ``None`` when truncation is off.
    """

    token_seq: jax.Array
    positions: jax.Array
    query_start: jax.Array
    context_lens: jax.Array
    seq_slots: jax.Array
    block_tables: jax.Array
    valid: jax.Array
    row: jax.Array
    row_start: jax.Array
    slot: jax.Array
    snapshots: jax.Array | None = None
    replay_from: jax.Array | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_seq.shape[0])

    @property
    def num_rows(self) -> int:
        return int(self.seq_slots.shape[0])

    def last_token(self) -> jax.Array:
        """int32 ``[S]``: index of each row's last token in this step (clamped; a row without tokens gives 0)."""
        return jnp.clip(self.query_start[1:] - 1, 0, self.num_tokens - 1)


def make_meta(
    token_seq: jax.Array,
    positions: jax.Array,
    query_start: jax.Array,
    context_lens: jax.Array,
    seq_slots: jax.Array,
    block_tables: jax.Array,
    snapshots: jax.Array | None = None,
    replay_from: jax.Array | None = None,
) -> RaggedMeta:
    """Build the :class:`RaggedMeta` of a step from the plan's arrays (see ``engine/plan.py``)."""
    rows = seq_slots.shape[0]
    valid = token_seq < rows
    row = jnp.where(valid, token_seq, 0).astype(jnp.int32)
    counts = query_start[1:] - query_start[:-1]
    row_start = (context_lens - counts).astype(jnp.int32)
    slot = jnp.where(valid, seq_slots[row], -1).astype(jnp.int32)
    return RaggedMeta(
        token_seq.astype(jnp.int32),
        positions.astype(jnp.int32),
        query_start.astype(jnp.int32),
        context_lens.astype(jnp.int32),
        seq_slots.astype(jnp.int32),
        block_tables.astype(jnp.int32),
        valid,
        row,
        row_start,
        slot,
        None if snapshots is None else snapshots.astype(jnp.int32),
        None if replay_from is None else replay_from.astype(jnp.int32),
    )


def replay_bounded(meta: RaggedMeta) -> tuple[RaggedMeta, jax.Array]:
    """SWA bounded replay: ``(meta, bound)`` with the state slot of every token below its row's bound set to
    ``-1`` (so :func:`ring_write` skips it) and ``bound [T]`` each token's first visible position (``-1``: none).
    Without ``meta.replay_from`` the meta is returned unchanged with no bound."""
    if meta.replay_from is None:
        return meta, jnp.full((meta.num_tokens,), -1, jnp.int32)
    bound = jnp.where(meta.valid, meta.replay_from[meta.row], -1)
    slot = jnp.where(meta.positions >= bound, meta.slot, -1)
    return meta._replace(slot=slot), bound


def replay_compact(meta: RaggedMeta, size: int) -> tuple[RaggedMeta, jax.Array]:
    """The compact layout of SWA bounded replay: ``(compact meta, gather [size])``.

    Each row keeps its tokens at positions ``>= replay_from`` (``clip = clamp(R - row_start, 0, count - 1)``
    tokens are removed from its front, so a chunk entirely before its bound keeps its last token as a
    placeholder). ``gather[i]`` is the full-layout index of compact token ``i`` (``T`` for padding); the compact
    meta has the kept tokens' rows and positions, compact row offsets, and the same context lengths, slots and
    block tables (so row starts move to the first kept position). ``size`` is static: the caller guarantees that
    the kept tokens fit (at most ``K`` per row).
    """
    assert meta.replay_from is not None
    tokens, rows = meta.num_tokens, meta.num_rows
    counts = meta.query_start[1:] - meta.query_start[:-1]
    bound = meta.replay_from
    clip = jnp.where(
        (bound >= 0) & (counts > 0), jnp.clip(bound - meta.row_start, 0, jnp.maximum(counts - 1, 0)), 0
    )
    kept = counts - clip
    query_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(kept).astype(jnp.int32)])
    t = jnp.arange(tokens, dtype=jnp.int32)
    local = t - meta.query_start[meta.row]
    keep = meta.valid & (local >= clip[meta.row])
    dest = jnp.where(keep, query_start[meta.row] + local - clip[meta.row], size)
    gather = jnp.full((size,), tokens, jnp.int32).at[dest].set(t, mode="drop")
    real = gather < tokens
    token_seq = jnp.where(real, meta.token_seq.at[gather].get(mode="fill", fill_value=rows), rows)
    positions = jnp.where(real, meta.positions.at[gather].get(mode="fill", fill_value=0), 0)
    compact = make_meta(
        token_seq,
        positions,
        jnp.minimum(query_start, size),
        meta.context_lens,
        meta.seq_slots,
        meta.block_tables,
        meta.snapshots,
        meta.replay_from,
    )
    return compact, gather


def rowwise_meta(fn: Any, tile: int | None, meta: RaggedMeta, tokens: Any) -> Any:
    """``fn(meta, tokens)`` for a pytree ``tokens`` of token-major arrays, optionally in fixed tiles of tokens.

    Like :func:`~deepinfer_jax.ops.tiling.rowwise`, for computations that also read the step's addressing: each
    tile gets ``meta`` with its token fields (``token_seq``, ``positions``, ``valid``, ``row``, ``slot``) cut to
    the tile and the row fields whole. Padding tokens of the last tile are marked as padding (``token_seq = S``,
    ``valid`` false, ``slot = -1``). Attention reads the caches through batched contractions whose size is the
    step's token count; on XLA:CPU a token's result then depends on that count, so batch-invariant mode runs
    them per tile. ``None`` leaves of ``tokens`` (absent optional inputs) pass through.
    """
    if tile is None:
        return fn(meta, tokens)
    fields = (
        tile_rows(meta.token_seq, tile, meta.num_rows),
        tile_rows(meta.positions, tile),
        tile_rows(meta.valid, tile, False),
        tile_rows(meta.row, tile),
        tile_rows(meta.slot, tile, -1),
    )

    def one(xs: tuple[Any, Any]) -> Any:
        (token_seq, positions, valid, row, slot), part = xs
        local = meta._replace(token_seq=token_seq, positions=positions, valid=valid, row=row, slot=slot)
        return fn(local, part)

    tiled = (fields, jax.tree.map(lambda a: tile_rows(a, tile), tokens))
    out = tiled_map(one, tiled, tile, meta.num_tokens)
    return jax.tree.map(lambda a: untile_rows(a, meta.num_tokens), out)


def history(
    ring: Any, new: Any, meta: RaggedMeta, depth: int, *, index: jax.Array | None = None
) -> tuple[Any, jax.Array]:
    """Items at positions ``p - depth + 1 .. p`` of each token's own row: ``(items, present)``.

    Args:
      ring: per-slot ring(s), a pytree of arrays ``[num_slots, R, ...]``; position ``q`` at ring index ``q % R``.
        It holds the row's items of positions before this step (``R >= depth - 1`` so the ring still has every
        needed one).
      new: this step's items, a pytree of the same structure with leaves ``[T, ...]`` (token-major).
      meta: the step's addressing.
      depth: how many positions each token looks back (itself included).
      index: int ``[E]``, only these tokens (``>= T`` or negative = none); a compressor reads the window of
        the few tokens that complete an entry. Default: every token (``E = T``).

    Returns:
      ``items``: the pytree with leaves ``[E, depth, ...]``; index ``j`` holds position ``p - depth + 1 + j``.
      ``present``: bool ``[E, depth]``, false for negative positions, padding tokens and entries of ``index``
      that name no token (their items are zeros from the fill, and the caller masks them).
    """
    ring_len = jax.tree.leaves(ring)[0].shape[1]
    if ring_len < depth - 1:
        raise ValueError(f"history: the ring holds {ring_len} positions, fewer than depth - 1 = {depth - 1}")
    tokens = meta.num_tokens
    if index is None:
        real, row, positions, slots = meta.valid, meta.row, meta.positions, meta.slot
    else:
        named = (index >= 0) & (index < tokens)
        safe = jnp.where(named, index, 0)
        real, row, positions, slots = (
            named & meta.valid[safe],
            meta.row[safe],
            meta.positions[safe],
            meta.slot[safe],
        )
    offs = jnp.arange(depth, dtype=jnp.int32) - (depth - 1)
    pos = positions[:, None] + offs[None, :]  # [E, depth]
    present = (pos >= 0) & real[:, None]
    start = meta.row_start[row][:, None]
    in_step = pos >= start
    new_index = meta.query_start[row][:, None] + (pos - start)
    new_index = jnp.where(in_step & present, new_index, tokens)  # out of range -> fill
    slot = jnp.where(present & ~in_step, slots[:, None], -1)
    ring_index = jnp.mod(pos, ring_len)

    def pick(r: jax.Array, n: jax.Array) -> jax.Array:
        from_new = n.at[new_index].get(mode="fill", fill_value=0)
        safe_slot = jnp.where(slot >= 0, slot, r.shape[0])
        from_ring = r.at[safe_slot, ring_index].get(mode="fill", fill_value=0).astype(n.dtype)
        sel = in_step.reshape(in_step.shape + (1,) * (n.ndim - 1))
        return jnp.where(sel, from_new, from_ring)

    return jax.tree.map(pick, ring, new), present


def ring_write(ring: Any, new: Any, meta: RaggedMeta, *, after: Any = None) -> Any:
    """``ring`` with each row's last ``R`` new items stored at ``[slot, position % R]``.

    Earlier tokens of a chunk longer than ``R`` would be overwritten by later ones in the same scatter, so they
    are skipped (the order of duplicate scatter indices is unspecified); padding tokens are dropped.

    ``after`` names what was read from the ring before this write (e.g. :func:`history`'s items). The write is
    then ordered after those reads through ``lax.optimization_barrier``, which lets XLA update the (donated) ring
    in place: without it XLA copies the whole ring -- every slot of every sequence -- to keep the old version
    readable, which at tiny model sizes was most of a decode step.
    """
    if after is not None:
        ring, _ = jax.lax.optimization_barrier((ring, after))
    ring_len = jax.tree.leaves(ring)[0].shape[1]
    end = meta.query_start[1:][meta.row]
    keep = meta.valid & (end - jnp.arange(meta.num_tokens, dtype=jnp.int32) <= ring_len) & (meta.slot >= 0)

    def put(r: jax.Array, n: jax.Array) -> jax.Array:
        target = jnp.where(keep, meta.slot, r.shape[0])
        return r.at[target, jnp.mod(meta.positions, ring_len)].set(n.astype(r.dtype), mode="drop")

    ring = jax.tree.map(put, ring, new)
    if meta.snapshots is not None:
        ring = _snapshot_write(ring, new, meta, ring_len)
    return ring


def _snapshot_write(ring: Any, new: Any, meta: RaggedMeta, ring_len: int) -> Any:
    """Each snapshot ``(row, boundary h, slot)`` of :class:`RaggedMeta` gets the row's items of positions
    ``[h - R, h)`` that lie in this step (the older ones came with the slot copy made before the step)."""
    rows, ends, slots = meta.snapshots[0], meta.snapshots[1], meta.snapshots[2]
    num_rows = meta.num_rows
    row = jnp.clip(rows, 0, num_rows - 1)
    start = meta.row_start[row]  # [J] first position of the row in this step
    pos = ends[:, None] - ring_len + jnp.arange(ring_len, dtype=jnp.int32)[None, :]  # [J, R]
    ok = (slots[:, None] >= 0) & (pos >= start[:, None]) & (pos >= 0) & (pos < ends[:, None])
    index = jnp.where(ok, meta.query_start[row][:, None] + pos - start[:, None], meta.num_tokens)
    target = jnp.where(ok, slots[:, None], jax.tree.leaves(ring)[0].shape[0])
    ring_index = jnp.mod(pos, ring_len)

    def put(r: jax.Array, n: jax.Array) -> jax.Array:
        items = n.at[index].get(mode="fill", fill_value=0)
        return r.at[target, ring_index].set(items.astype(r.dtype), mode="drop")

    return jax.tree.map(put, ring, new)


def compressed_slots(meta: RaggedMeta, ratio: int, block_size: int, num_blocks: int) -> tuple[jax.Array, ...]:
    """Where each token's compressed entry goes: ``(emits [T], index [T], blocks [T], offsets [T])``.

    Token ``p`` completes compressed entry ``c = (p + 1) // r - 1`` when ``(p + 1) % r == 0``. Its page is
    ``block_tables[row, c·r // block_size]`` at offset ``(c·r % block_size) // r``. Tokens that emit nothing,
    padding and unallocated table entries get block ``num_blocks`` (dropped by a ``mode="drop"`` scatter).
    """
    if block_size % ratio:
        raise ValueError(
            f"compressed_slots: ratio {ratio} does not divide the cache block of {block_size} tokens"
        )
    emits = meta.valid & ((meta.positions + 1) % ratio == 0)
    index = (meta.positions + 1) // ratio - 1
    first = index * ratio
    max_blocks = meta.block_tables.shape[1]
    column = jnp.clip(first // block_size, 0, max_blocks - 1)
    block = meta.block_tables[meta.row, column]
    ok = emits & (block >= 0) & (first // block_size < max_blocks)
    blocks = jnp.where(ok, block, num_blocks).astype(jnp.int32)
    offsets = ((first % block_size) // ratio).astype(jnp.int32)
    return ok, index.astype(jnp.int32), blocks, offsets


def page_rows(blocks: jax.Array, offsets: jax.Array, entries_per_block: int, num_blocks: int) -> jax.Array:
    """Flat page rows ``block · E + offset`` of :func:`compressed_slots`' ``blocks``/``offsets`` (pages viewed as
    ``[num_blocks · E, ...]``, as the store ops address them); ``-1`` where the block is out of range (nothing to
    write)."""
    ok = (blocks >= 0) & (blocks < num_blocks)
    return jnp.where(ok, blocks * entries_per_block + offsets, -1).astype(jnp.int32)


def write_entries(pages: Any, entries: Any, blocks: jax.Array, offsets: jax.Array) -> Any:
    """``pages`` (pytree of ``[num_blocks, block_size // r, ...]``) with ``entries`` (leaves ``[T, ...]``) written.

    Use the ``blocks``/``offsets`` of :func:`compressed_slots`; out-of-range blocks are dropped.
    """
    return jax.tree.map(
        lambda p, e: p.at[blocks, offsets].set(e.astype(p.dtype), mode="drop"), pages, entries
    )


def gather_entries(
    pages: Any,
    meta: RaggedMeta,
    index: jax.Array,
    ratio: int,
    block_size: int,
    *,
    rows: jax.Array | None = None,
) -> Any:
    """Compressed entries ``index [T, K]`` (compressed indices, ``-1`` = none) of each token's row.

    Returns the pytree with leaves ``[T, K, ...]``; a missing index or an unallocated page reads zeros (mask with
    the caller's own visibility). ``rows`` overrides the row of each token (default ``meta.row``).
    """
    row = meta.row if rows is None else rows
    entries_per_block = block_size // ratio
    max_blocks = meta.block_tables.shape[1]
    column = jnp.clip(index // entries_per_block, 0, max_blocks - 1)
    block = meta.block_tables[row[:, None], column]
    num_blocks = jax.tree.leaves(pages)[0].shape[0]
    block = jnp.where((index >= 0) & (block >= 0), block, num_blocks)
    offset = jnp.mod(index, entries_per_block)
    return jax.tree.map(lambda p: p.at[block, offset].get(mode="fill", fill_value=0), pages)
