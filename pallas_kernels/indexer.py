"""Pallas (Triton) lightning-indexer scores: ``Σ_h w[h] · ReLU(q[h] · k_j)`` with the keys decoded in the kernel.

One program scores ``block_e`` entries of one token: it reads each entry's page from the token's block-table row,
loads the entry's record (MXFP4: 64 code bytes and 4 UE8M0 bytes at ``Di = 128``) or float key, decodes it in
registers (:mod:`pallas_kernels._records`, bit-exact with ``numerics``), and computes the ``[Hi, block_e]`` head
dot products on the tensor cores (bf16 operands are exact here: MXFP4 values are bf16 values) or in float32.

* ``"v4_indexer_topk"`` (:func:`v4_indexer_topk`): a streaming top-k over the pages, this kernel scoring one
  chunk of ``chunk_pages`` block-table columns per step and ``lax.top_k`` merging it into the running ``[T, k]``
  (the merge and its exactness are those of ``deepinfer_jax/ops/indexer.py``).
* ``"v4_indexer_scores"`` (:func:`v4_indexer_scores`): the models' dense form, ``q [B, S, Hi, Di]`` against float
  ``keys [B, T, Di]`` -> ``[B, S, T]``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._attention import dot_kt
from pallas_kernels._common import cdiv, next_pow2
from pallas_kernels._records import RecordLayout, decode_bytes, record_layout

__all__ = ["IndexerTiles", "v4_indexer_scores", "v4_indexer_topk"]

# Entries scored per streaming step when chunk_pages is not given, at most the whole table (as the reference op's
# default).
_CHUNK_ENTRIES = 2048


@dataclasses.dataclass(frozen=True)
class IndexerTiles:
    """``block_e`` entries per program; Triton's warps and stages. Untuned (no GPU has run it yet)."""

    block_e: int = 64
    num_warps: int = 4
    num_stages: int = 2


def _score_kernel(
    q_ref: Any,
    w_ref: Any,
    keys_ref: Any,
    bt_ref: Any,
    rows_ref: Any,
    limit_ref: Any,
    cand_ref: Any,
    first_ref: Any,
    o_ref: Any,
    *,
    layout: RecordLayout,
    heads: int,
    dim: int,
    be: int,
    num_entries: int,
    paged: bool,
    per_page: int,
    max_blocks: int,
    num_blocks: int,
    dense_keys: int,
    queries_per_batch: int,
    cand_block: int,
    compute_dtype: Any,
) -> None:
    from jax.experimental.pallas import triton as pl_triton

    t, eb = pl.program_id(0), pl.program_id(1)
    hp, dp = next_pow2(heads), next_pow2(dim)
    hh = jnp.arange(hp, dtype=jnp.int32)
    hcol = jnp.minimum(hh, heads - 1)
    dcol = jnp.arange(dp, dtype=jnp.int32)[None, :]
    q = q_ref[(t * heads + hcol)[:, None], jnp.minimum(dcol, dim - 1)]
    q = jnp.where((hh[:, None] < heads) & (dcol < dim), q, 0).astype(compute_dtype)
    w = jnp.where(hh < heads, w_ref[t * heads + hcol].astype(jnp.float32), 0.0)
    local = eb * be + jnp.arange(be, dtype=jnp.int32)
    in_chunk = local < num_entries
    if paged:
        j = first_ref[0] + local
        row = rows_ref[t]
        col = jnp.minimum(j // per_page, max_blocks - 1)
        blk = bt_ref[row * max_blocks + col]
        ok = in_chunk & (blk >= 0) & (j < limit_ref[t]) & (j // per_page < max_blocks)
        krow = jnp.clip(blk, 0, num_blocks - 1) * per_page + j % per_page
        if cand_block:
            nb = cand_ref.shape[1]
            ok = ok & (cand_ref[t, jnp.minimum(j // cand_block, nb - 1)] != 0)
    else:
        j = local
        ok = in_chunk
        krow = (t // queries_per_batch) * dense_keys + jnp.minimum(j, dense_keys - 1)
    width = keys_ref.shape[1]

    def load(byte_cols: jax.Array) -> jax.Array:
        v = keys_ref[krow[:, None], jnp.clip(byte_cols, 0, width - 1)]
        return v if layout.kind == "float" else v.astype(jnp.int32)

    k = decode_bytes(load, layout, jnp.minimum(dcol, dim - 1))
    k = jnp.where(ok[:, None] & (dcol < dim), k, 0.0)
    dots = dot_kt(q, k, compute_dtype)  # [Hp, be]
    s = jnp.sum(jnp.maximum(dots, 0.0) * w[:, None], axis=0)
    s = jnp.where(ok, s, -jnp.inf)
    ocol = jnp.where(in_chunk, local, o_ref.shape[1])  # masked lanes address past the end (see paged_mla)
    pl_triton.store(o_ref.at[t, ocol], s, mask=in_chunk)


def _scores(
    q: jax.Array,
    weights: jax.Array,
    keys2d: jax.Array,
    *,
    layout: RecordLayout,
    num_entries: int,
    paged: bool,
    block_tables: jax.Array | None = None,
    rows: jax.Array | None = None,
    limit: jax.Array | None = None,
    candidates: jax.Array | None = None,
    candidate_block_size: int | None = None,
    first: jax.Array | None = None,
    per_page: int = 1,
    num_blocks: int = 1,
    dense_keys: int = 1,
    queries_per_batch: int = 1,
    tiles: IndexerTiles | None = None,
    interpret: bool = False,
) -> jax.Array:
    tokens, heads, dim = q.shape
    tiles = tiles or IndexerTiles()
    be = max(16, min(tiles.block_e, next_pow2(num_entries)))
    exact = layout.kind != "float" or jnp.dtype(keys2d.dtype) == jnp.bfloat16
    compute_dtype = jnp.bfloat16 if jnp.dtype(q.dtype) == jnp.bfloat16 and exact else jnp.float32
    i32 = jnp.int32
    bt = (block_tables if block_tables is not None else jnp.zeros((1, 1), i32)).astype(i32)
    cand = candidates.astype(jnp.int8) if candidates is not None else jnp.zeros((1, 1), jnp.int8)
    kernel = functools.partial(
        _score_kernel,
        layout=layout,
        heads=heads,
        dim=dim,
        be=be,
        num_entries=num_entries,
        paged=paged,
        per_page=per_page,
        max_blocks=bt.shape[1],
        num_blocks=num_blocks,
        dense_keys=dense_keys,
        queries_per_batch=queries_per_batch,
        cand_block=int(candidate_block_size or 0) if candidates is not None else 0,
        compute_dtype=compute_dtype,
    )
    from jax.experimental.pallas import triton as pl_triton

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((tokens, num_entries), jnp.float32),
        grid=(tokens, cdiv(num_entries, be)),
        compiler_params=pl_triton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="v4_indexer_scores",
    )(
        q.reshape(tokens * heads, dim),
        weights.reshape(tokens * heads),
        keys2d,
        bt.reshape(-1),
        (rows if rows is not None else jnp.zeros((tokens,), i32)).astype(i32),
        (limit if limit is not None else jnp.zeros((tokens,), i32)).astype(i32),
        cand,
        (first if first is not None else jnp.zeros((), i32)).astype(i32).reshape(1),
    )


def v4_indexer_topk(
    q: jax.Array,
    weights: jax.Array,
    pages: jax.Array,
    block_tables: jax.Array,
    rows: jax.Array,
    limit: jax.Array,
    *,
    k: int,
    key_format: str | None = None,
    score_dtype: Any = jnp.float32,
    candidates: jax.Array | None = None,
    candidate_block_size: int | None = None,
    chunk_pages: int | None = None,
    tiles: IndexerTiles | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Op ``"v4_indexer_topk"`` (signature of ``deepinfer_jax.ops.indexer.v4_indexer_topk``)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"v4_indexer_topk: k (index_topk) must be an int >= 1, got {k!r}")
    if (candidates is None) != (candidate_block_size is None):
        raise ValueError("v4_indexer_topk: candidates and candidate_block_size go together")
    dim = q.shape[-1]
    layout = record_layout(key_format, dim)
    num_blocks, per_page = pages.shape[0], pages.shape[1]
    keys2d = pages.reshape(num_blocks * per_page, pages.shape[-1])
    if q.shape[0] == 0:
        return jnp.zeros((0, k), jnp.int32)

    tokens = q.shape[0]
    if chunk_pages is None:
        chunk_pages = max(1, min(_CHUNK_ENTRIES // per_page, block_tables.shape[1]))
    chunk = chunk_pages * per_page
    rows, limit = rows.astype(jnp.int32), limit.astype(jnp.int32)

    def step(i: jax.Array, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        values, index = carry
        first = (i * chunk).astype(jnp.int32)
        s = _scores(
            q,
            weights,
            keys2d,
            layout=layout,
            num_entries=chunk,
            paged=True,
            block_tables=block_tables,
            rows=rows,
            limit=limit,
            candidates=candidates,
            candidate_block_size=candidate_block_size,
            first=first,
            per_page=per_page,
            num_blocks=num_blocks,
            tiles=tiles,
            interpret=interpret,
        )
        s = s.astype(score_dtype).astype(jnp.float32)  # materialised in score_dtype before competing
        # running entries first: lax.top_k keeps the earlier of equal values, i.e. the lower index
        cand = jnp.concatenate([values, s], axis=1)
        ids = jnp.concatenate(
            [index, jnp.broadcast_to(first + jnp.arange(chunk, dtype=jnp.int32), s.shape)], 1
        )
        top, pos = jax.lax.top_k(cand, k)
        return top, jnp.take_along_axis(ids, pos, axis=1)

    init = (jnp.full((tokens, k), -jnp.inf, jnp.float32), jnp.full((tokens, k), -1, jnp.int32))
    trips = (jnp.max(limit) + chunk - 1) // chunk
    values, index = jax.lax.fori_loop(0, trips, step, init)
    return jnp.where(values > -jnp.inf, index, -1)


def v4_indexer_scores(
    q: jax.Array,
    keys: jax.Array,
    weights: jax.Array,
    *,
    tiles: IndexerTiles | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Op ``"v4_indexer_scores"``: ``q [B, S, Hi, Di]``, float ``keys [B, T, Di]``, ``weights [B, S, Hi]`` ->
    float32 ``[B, S, T]``."""
    b, s, h, d = q.shape
    t = keys.shape[1]
    if b * s == 0 or t == 0:
        return jnp.zeros((b, s, t), jnp.float32)
    out = _scores(
        q.reshape(b * s, h, d),
        weights.reshape(b * s, h),
        keys.reshape(b * t, d),
        layout=record_layout(None, d),
        num_entries=t,
        paged=False,
        dense_keys=t,
        queries_per_batch=s,
        tiles=tiles,
        interpret=interpret,
    )
    return out.reshape(b, s, t)
