"""Pallas (Triton) paged absorbed-MLA attention: the ``pallas_gpu`` implementation of op ``"paged_mla_attention"``.

DeepSeek-V3's absorbed MLA is multi-query attention over the paged latent cache
(:mod:`deepinfer_jax.cache.paged`): every head scores the shared key ``[c | k_pe]`` of a cached token with
``q_lat · c + q_pe · k_pe`` and averages the latents ``c``. One program takes ``block_h`` heads of one token and
walks that token's keys ``block_k`` at a time, up to its own position: the block of each key comes from the
token's block-table row (read per key, so any block size works), the key rows are loaded straight from the cache
(no gathered copy of the context ever exists), and an online softmax keeps ``block_h × C`` float32 accumulators
split into ``chunk``-wide column pieces.

Cache formats: float32 / bfloat16 ``[L, NB, bs, C + R]``, or the FP8 latent record (``uint8``: E4M3 codes with one
float32 scale per 128 latent values, bf16 rope). FP8 codes are decoded in the kernel and each 128-value group's
scale multiplies the group's partial dot product (and the probability of the key for the value sum) instead of
every element: a group is one value chunk, so the record is never expanded to floats. The scale bytes are
assembled into the float32 in registers.

The grid is ``(tokens, ceil(heads / block_h))``; a token's loop runs ``ceil((position + 1) / block_k)`` steps,
so a decode batch costs its own context, not the batch's longest. Padding tokens (``token_seq >= S``) give 0.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._attention import AttnTiles, OnlineSoftmax, dot_kt
from pallas_kernels._common import cdiv, next_pow2
from pallas_kernels._records import e4m3_value

__all__ = ["TILES", "paged_mla_attention", "pick_tiles"]

#: The default tile: 16 heads (V3 has 128: 8 programs per token), 32 keys per step, 128-value chunks (one FP8
#: scale group each). Untuned: no GPU has run it yet.
TILES = AttnTiles(block_h=16, block_k=32, chunk=128, num_warps=4, num_stages=2)


def pick_tiles(heads: int, kv_rank: int, block_size: int) -> AttnTiles:
    """:data:`TILES` shrunk to a small problem (fewer padded heads and keys)."""
    import dataclasses

    return dataclasses.replace(
        TILES,
        block_h=max(16, min(TILES.block_h, next_pow2(heads))),
        block_k=max(16, min(TILES.block_k, next_pow2(block_size))),
        chunk=max(16, min(TILES.chunk, next_pow2(kv_rank))),
    )


def _kernel(
    layer_ref: Any,
    tok_ref: Any,
    pos_ref: Any,
    bt_ref: Any,
    ql_ref: Any,
    qr_ref: Any,
    kv_ref: Any,
    o_ref: Any,
    *,
    tiles: AttnTiles,
    seqs: int,
    max_blocks: int,
    num_blocks: int,
    block_size: int,
    heads: int,
    kv_rank: int,
    rope_dim: int,
    fp8: bool,
    scale: float,
    compute_dtype: Any,
) -> None:
    from jax.experimental.pallas import triton as pl_triton

    bh, bk, dc = tiles.block_h, tiles.block_k, tiles.chunk
    t, hb = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    row_raw = tok_ref[t]
    real = row_raw < seqs
    row = jnp.where(real, row_raw, 0)
    pos = pos_ref[t]
    n_keys = jnp.where(real, jnp.minimum(pos + 1, max_blocks * block_size), 0)

    h = hb * bh + jnp.arange(bh, dtype=jnp.int32)
    hrow = (t * heads + jnp.minimum(h, heads - 1))[:, None]
    n_chunks = cdiv(kv_rank, dc)
    cols = [i * dc + jnp.arange(dc, dtype=jnp.int32)[None, :] for i in range(n_chunks)]
    q_lat = [
        jnp.where(c < kv_rank, ql_ref[hrow, jnp.minimum(c, kv_rank - 1)], 0).astype(compute_dtype)
        for c in cols
    ]
    rp = next_pow2(rope_dim)
    rcols = jnp.arange(rp, dtype=jnp.int32)[None, :]
    q_pe = jnp.where(rcols < rope_dim, qr_ref[hrow, jnp.minimum(rcols, rope_dim - 1)], 0).astype(
        compute_dtype
    )
    row_bytes = kv_ref.shape[1]
    groups = cdiv(kv_rank, 128)  # scale groups of an FP8 record; chunk i lies in group (i * chunk) // 128

    def step(i: jax.Array, state: Any) -> Any:
        p = i * bk + jnp.arange(bk, dtype=jnp.int32)
        live = p < n_keys
        col = jnp.minimum(p // block_size, max_blocks - 1)
        blk = bt_ref[row * max_blocks + col]
        blk = jnp.clip(blk, 0, num_blocks - 1)  # -1 (unused) reads the reserved block 0, masked by position
        krow1 = (layer * num_blocks + blk) * block_size + p % block_size
        krow = krow1[:, None]

        def load(byte_cols: jax.Array) -> jax.Array:
            return kv_ref[krow, jnp.clip(byte_cols, 0, row_bytes - 1)]

        def load_column(byte_col: int) -> jax.Array:  # one byte of every key row: [bk]
            return kv_ref[krow1, byte_col].astype(jnp.int32)

        logits = jnp.zeros((bh, bk), jnp.float32)
        values = []
        key_scales = []
        for ci, c in enumerate(cols):
            cc = jnp.minimum(c, kv_rank - 1)
            if fp8:
                k = e4m3_value(load(cc).astype(jnp.int32))
                base = kv_rank + 4 * ((ci * dc) // 128)  # one scale group per chunk (chunk <= 128, aligned)
                sbits = (
                    load_column(base)
                    | (load_column(base + 1) << 8)
                    | (load_column(base + 2) << 16)
                    | (load_column(base + 3) << 24)
                )
                s = jax.lax.bitcast_convert_type(sbits, jnp.float32)  # [bk]
            else:
                k = load(cc).astype(jnp.float32)
                s = None
            k = jnp.where((c < kv_rank) & live[:, None], k, 0.0)
            part = dot_kt(q_lat[len(values)], k, compute_dtype)
            logits = logits + (part if s is None else part * s[None, :])
            values.append(k)
            key_scales.append(s)
        if fp8:
            rbase = kv_rank + 4 * groups + 2 * jnp.minimum(rcols, rope_dim - 1)
            rbits = load(rbase).astype(jnp.int32) | (load(rbase + 1).astype(jnp.int32) << 8)
            k_pe = jax.lax.bitcast_convert_type(rbits << 16, jnp.float32)
        else:
            k_pe = load(kv_rank + jnp.minimum(rcols, rope_dim - 1)).astype(jnp.float32)
        k_pe = jnp.where((rcols < rope_dim) & live[:, None], k_pe, 0.0)
        logits = (logits + dot_kt(q_pe, k_pe, compute_dtype)) * jnp.float32(scale)
        logits = jnp.where(live[None, :], logits, -jnp.inf)
        # FP8: a chunk's values are codes; its keys' scales multiply the probabilities instead of the tile
        return OnlineSoftmax.update(state, logits, tuple(values), compute_dtype, tuple(key_scales))

    state = OnlineSoftmax.init(bh, tuple(dc for _ in cols))
    state = jax.lax.fori_loop(0, (n_keys + bk - 1) // bk, step, state)
    out = OnlineSoftmax.finish(state)
    # Masked lanes address past the end (never a clamped duplicate of a live element: in interpret mode a masked
    # store writes the old value back, and two writes to one element land in an undefined order).
    hmask = (h < heads)[:, None]
    srow = jnp.where(hmask, hrow, o_ref.shape[0])
    for c, o in zip(cols, out, strict=True):
        cmask = c < kv_rank
        pl_triton.store(o_ref.at[srow, jnp.where(cmask, c, kv_rank)], o, mask=hmask & cmask)


def paged_mla_attention(
    q_lat: jax.Array,
    q_pe: jax.Array,
    cache: jax.Array,
    layer: int | jax.Array,
    token_seq: jax.Array,
    positions: jax.Array,
    block_tables: jax.Array,
    context_lens: jax.Array,
    *,
    scale: float,
    tiles: AttnTiles | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Op ``"paged_mla_attention"`` (signature and result of the reference in :mod:`deepinfer_jax.cache.paged`).

    ``context_lens`` is accepted for the signature: each token's own position bounds its keys. ``layer`` may be
    traced (a scanned run of layers): the kernel reads it as an operand; a static one is range-checked here.
    ``tiles`` overrides :func:`pick_tiles`; ``interpret=True`` runs the kernel with the Pallas interpreter.
    """
    del context_lens
    tokens, heads, kv_rank = q_lat.shape
    rope_dim = q_pe.shape[-1]
    num_layers, num_blocks, block_size, width = cache.shape
    fp8 = cache.dtype == jnp.uint8
    if not fp8 and width != kv_rank + rope_dim:
        raise ValueError(f"paged_mla_attention: cache width {width} != {kv_rank} + {rope_dim}")
    if not isinstance(layer, jax.Array) and not 0 <= int(layer) < num_layers:
        raise ValueError(f"paged_mla_attention: layer {layer} outside the cache's {num_layers} layers")
    if tokens == 0:
        return jnp.zeros((0, heads, kv_rank), jnp.float32)
    seqs, max_blocks = block_tables.shape
    tiles = tiles or pick_tiles(heads, kv_rank, block_size)
    if fp8 and tiles.chunk > 128:
        raise ValueError(
            "paged_mla_attention: FP8 latent caches need chunk <= 128 (one scale group per chunk)"
        )
    low = jnp.dtype(q_lat.dtype) == jnp.bfloat16 and (fp8 or cache.dtype == jnp.bfloat16)
    compute_dtype = jnp.bfloat16 if low else jnp.float32
    kernel = functools.partial(
        _kernel,
        tiles=tiles,
        seqs=seqs,
        max_blocks=max_blocks,
        num_blocks=num_blocks,
        block_size=block_size,
        heads=heads,
        kv_rank=kv_rank,
        rope_dim=rope_dim,
        fp8=fp8,
        scale=float(scale),
        compute_dtype=compute_dtype,
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((tokens * heads, kv_rank), jnp.float32),
        grid=(tokens, cdiv(heads, tiles.block_h)),
        compiler_params=tiles.compiler_params(),
        interpret=interpret,
        name="paged_mla_attention",
    )(
        jnp.asarray(layer, jnp.int32).reshape(1),
        token_seq.astype(jnp.int32),
        positions.astype(jnp.int32),
        block_tables.astype(jnp.int32).reshape(-1),
        q_lat.reshape(tokens * heads, kv_rank),
        q_pe.reshape(tokens * heads, rope_dim),
        cache.reshape(num_layers * num_blocks * block_size, width),
    )
    return out.reshape(tokens, heads, kv_rank)
