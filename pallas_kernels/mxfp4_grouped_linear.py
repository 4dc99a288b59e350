"""Pallas (Triton) ragged grouped MXFP4 expert GEMM, plain and fused with the clamped SwiGLU.

``pallas_gpu`` implementations of ops ``"mxfp4_grouped_linear"`` and ``"mxfp4_grouped_swiglu"``. Rows of ``x``
are sorted by expert; expert ``e`` owns rows ``[start_e, end_e)`` with ``start_e = sum(group_sizes[:e])``.

**Work list.** A row tile may hold the tail of one group and the head of the next, so the grid does not run over
row tiles but over *(group, row tile)* pairs: every non-empty group visits the row tiles it overlaps. There are at
most ``cdiv(T, block_t) + E - 1`` such pairs (each boundary between non-empty groups adds at most one shared
tile), a static bound, so the grid has that many slots; :func:`work_list` fills them with
``(expert, row tile, first row, end row)`` and marks unused slots with expert ``-1`` (the program exits at once).
Programs write disjoint row ranges, so shared tiles need no atomics. Rows no group owns (padding past
``sum(group_sizes)``) are never written: the output starts as zeros (an aliased buffer), which is the contract.

**Decoding.** Per reduction step the program loads ``block_n × block_k/2`` packed bytes, splits them into the low
(even element) and high (odd element) nibbles, decodes E2M1 by bit manipulation, multiplies by the UE8M0 scale of
each element's 32-wide group, and interleaves the two halves back to ``block_n × block_k`` (Triton ``join``) so
the activations are read contiguously. The fused variant does this for the gate (``w1``) and up (``w3``) weights
of the same output columns and applies the SwiGLU before the store.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer_jax.numerics.activation import activation_cast
from pallas_kernels._common import (
    Tiles,
    apply_ue8m0,
    cdiv,
    compiler_params,
    compute_dtype_for,
    dot_nt,
    e2m1_bits_to_f32,
    pick_tiles,
    swiglu_f32,
)

__all__ = ["TILES", "mxfp4_grouped_linear", "mxfp4_grouped_swiglu", "num_work_slots", "work_list"]

#: ``(max rows, tiles)``. Decode batches spread a few rows over many experts (groups of 1-2 rows), so row tiles
#: stay at the ``tl.dot`` minimum and the columns go wide; prefill groups hold hundreds of rows each.
TILES: tuple[tuple[int, Tiles], ...] = (
    (512, Tiles(block_t=16, block_n=128, block_k=128, num_warps=4, num_stages=3)),
    (4096, Tiles(block_t=64, block_n=128, block_k=128, num_warps=4, num_stages=3)),
    (1 << 30, Tiles(block_t=128, block_n=128, block_k=128, num_warps=8, num_stages=3)),
)

_GROUP = 32  # MXFP4 elements per scale
_CASTS = ("none", "mxfp8")


def num_work_slots(num_rows: int, num_experts: int, block_t: int) -> int:
    """The static number of (group, row tile) slots: ``cdiv(T, block_t) + E - 1`` (at least 1)."""
    return max(cdiv(num_rows, block_t) + num_experts - 1, 1)


def work_list(group_sizes: jax.Array, num_rows: int, block_t: int) -> jax.Array:
    """``int32 [slots, 4]``: ``(expert, row tile, first row, end row)`` per slot, expert ``-1`` when unused.

    Groups are clipped to the ``T`` rows that exist; negative sizes count as empty.
    """
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    num_experts = sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(sizes), num_rows)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    nonempty = ends > starts
    first_tile = starts // block_t
    count = jnp.where(nonempty, (jnp.maximum(ends, 1) - 1) // block_t - first_tile + 1, 0)
    slot_end = jnp.cumsum(count)
    slot = jnp.arange(num_work_slots(num_rows, num_experts, block_t), dtype=jnp.int32)
    expert = jnp.searchsorted(slot_end, slot, side="right").astype(jnp.int32)
    valid = expert < num_experts
    e = jnp.minimum(expert, num_experts - 1)
    tile = first_tile[e] + slot - (slot_end[e] - count[e])
    lo = jnp.maximum(tile * block_t, starts[e])
    hi = jnp.minimum(tile * block_t + block_t, ends[e])
    return jnp.stack(
        [
            jnp.where(valid, e, -1),
            jnp.where(valid, tile, 0),
            jnp.where(valid, lo, 0),
            jnp.where(valid, hi, 0),
        ],
        axis=1,
    )


def _decode_tile(
    p_ref: Any,
    s_ref: Any,
    expert: jax.Array,
    col0: jax.Array,
    cols: jax.Array,
    col_ok: jax.Array,
    kb: jax.Array,
    tiles: Tiles,
) -> jax.Array:
    """Dequantised float32 weight tile ``[block_n, block_k]`` of reduction step ``kb`` (zeros outside)."""
    from jax.experimental.pallas import triton as pl_triton

    bn, bk = tiles.block_n, tiles.block_k
    half = bk // 2
    k_bytes = p_ref.shape[2]
    byte_idx = kb * half + jnp.arange(half, dtype=jnp.int32)
    mask = col_ok[:, None] & (byte_idx < k_bytes)[None, :]
    packed = pl_triton.load(p_ref.at[expert, pl.ds(col0, bn), pl.ds(kb * half, half)], mask=mask, other=0)
    packed = packed.astype(jnp.int32)
    # byte j holds elements 2j (low) and 2j+1 (high); both belong to 32-group (2j) // 32 = j // 16
    groups = jnp.minimum(byte_idx, k_bytes - 1) // (_GROUP // 2)
    scale = s_ref[expert, jnp.minimum(cols, p_ref.shape[1] - 1)[:, None], groups[None, :]]
    low = apply_ue8m0(e2m1_bits_to_f32(packed & 15), scale)
    high = apply_ue8m0(e2m1_bits_to_f32(packed >> 4), scale)
    low = jnp.where(mask, low, 0.0)
    high = jnp.where(mask, high, 0.0)
    return jnp.stack([low, high], axis=-1).reshape(bn, bk)


def _kernel(*refs: Any, tiles: Tiles, fused: bool, limit: float | None, compute_dtype: Any) -> None:
    from jax.experimental.pallas import triton as pl_triton

    if fused:
        work_ref, x_ref, gp_ref, gs_ref, up_ref, us_ref, _, o_ref = refs
        weights = ((gp_ref, gs_ref), (up_ref, us_ref))
    else:
        work_ref, x_ref, p_ref, s_ref, _, o_ref = refs
        weights = ((p_ref, s_ref),)
    bt, bn, bk = tiles.block_t, tiles.block_n, tiles.block_k
    slot, n = pl.program_id(0), pl.program_id(1)
    expert = work_ref[slot, 0]
    tile = work_ref[slot, 1]
    lo = work_ref[slot, 2]
    hi = work_ref[slot, 3]
    k_total = x_ref.shape[1]
    n_total = weights[0][0].shape[1]

    @pl.when(expert >= 0)
    def _():
        rows = tile * bt + jnp.arange(bt, dtype=jnp.int32)
        row_ok = (rows >= lo) & (rows < hi)
        cols = n * bn + jnp.arange(bn, dtype=jnp.int32)
        col_ok = cols < n_total

        def step(kb, accs):
            kk = kb * bk + jnp.arange(bk, dtype=jnp.int32)
            xt = pl_triton.load(
                x_ref.at[pl.ds(tile * bt, bt), pl.ds(kb * bk, bk)],
                mask=row_ok[:, None] & (kk < k_total)[None, :],
                other=0.0,
            )
            return tuple(
                acc + dot_nt(xt, _decode_tile(p, s, expert, n * bn, cols, col_ok, kb, tiles), compute_dtype)
                for acc, (p, s) in zip(accs, weights, strict=True)
            )

        zeros = tuple(jnp.zeros((bt, bn), jnp.float32) for _ in weights)
        accs = jax.lax.fori_loop(0, pl.cdiv(k_total, bk), step, zeros)
        out = swiglu_f32(accs[0], accs[1], limit) if fused else accs[0]
        pl_triton.store(
            o_ref.at[pl.ds(tile * bt, bt), pl.ds(n * bn, bn)],
            out.astype(o_ref.dtype),
            mask=row_ok[:, None] & col_ok[None, :],
        )


def _check(
    x: jax.Array, pairs: tuple[tuple[str, jax.Array, jax.Array], ...], group_sizes: Any, cast: str, op: str
) -> jax.Array:
    """Validate the arguments of a grouped call; returns ``group_sizes`` as an array."""
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{op}: x must be a float [tokens, in] array, got {x.dtype} {x.shape}")
    k_total = x.shape[1]
    if k_total % _GROUP:
        raise ValueError(f"{op}: K = {k_total} must be a multiple of the MXFP4 group size {_GROUP}")
    for name, packed, scale in pairs:
        if packed.ndim != 3 or packed.shape[2] * 2 != k_total:
            raise ValueError(
                f"{op}: {name} packed weight must have shape [E, N, {k_total // 2}], got {packed.shape}"
            )
        want = (*packed.shape[:2], k_total // _GROUP)
        if scale.shape != want:
            raise ValueError(f"{op}: {name} scale must have shape {want}, got {scale.shape}")
    num_experts = pairs[0][1].shape[0]
    sizes = jnp.asarray(group_sizes)
    if sizes.shape != (num_experts,) or not jnp.issubdtype(sizes.dtype, jnp.integer):
        raise ValueError(
            f"{op}: group_sizes must be an integer array of shape ({num_experts},), got {sizes.dtype} {sizes.shape}"
        )
    if cast not in _CASTS:
        raise ValueError(f"{op}: activation_cast = {cast!r} is not one of {_CASTS}")
    return sizes


def _bytes(a: jax.Array) -> jax.Array:
    a = jnp.asarray(a)
    if a.dtype == jnp.uint8:
        return a
    if a.dtype in (jnp.int8, jnp.float8_e8m0fnu):
        return jax.lax.bitcast_convert_type(a, jnp.uint8)
    raise TypeError(
        f"MXFP4 weights and scales must be 8-bit storage (uint8, int8, float8_e8m0fnu), got {a.dtype}"
    )


def _grouped_call(
    x: jax.Array,
    weights: tuple[tuple[jax.Array, jax.Array], ...],
    sizes: jax.Array,
    *,
    activation_cast_kind: str,
    limit: float | None,
    out_dtype: Any,
    tiles: Tiles | None,
    interpret: bool,
    name: str,
) -> jax.Array:
    num_rows, k_total = x.shape
    n_total = weights[0][0].shape[1]
    if num_rows == 0 or n_total == 0:
        return jnp.zeros((num_rows, n_total), out_dtype)
    x = activation_cast(x, activation_cast_kind)
    tiles = tiles or pick_tiles(TILES, num_rows, n_total, k_total, k_multiple=_GROUP)
    if tiles.block_k % _GROUP:
        raise ValueError(f"{name}: tiles.block_k = {tiles.block_k} must be a multiple of {_GROUP}")
    work = work_list(sizes, num_rows, tiles.block_t)
    flat = [a for pair in weights for a in (_bytes(pair[0]), _bytes(pair[1]))]
    kernel = functools.partial(
        _kernel, tiles=tiles, fused=len(weights) == 2, limit=limit, compute_dtype=compute_dtype_for(x.dtype)
    )
    zeros = jnp.zeros((num_rows, n_total), out_dtype)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_rows, n_total), out_dtype),
        grid=(work.shape[0], cdiv(n_total, tiles.block_n)),
        input_output_aliases={len(flat) + 2: 0},
        compiler_params=compiler_params(tiles),
        interpret=interpret,
        name=name,
    )(work, x, *flat, zeros)


def mxfp4_grouped_linear(
    x: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    group_sizes: jax.Array,
    *,
    activation_cast: str = "none",
    out_dtype: Any = jnp.bfloat16,
    tiles: Tiles | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Ragged grouped MXFP4 GEMM with the Triton kernel (signature of op ``mxfp4_grouped_linear``)."""
    x, packed, scale = jnp.asarray(x), jnp.asarray(packed), jnp.asarray(scale)
    sizes = _check(x, (("experts", packed, scale),), group_sizes, activation_cast, "mxfp4_grouped_linear")
    return _grouped_call(
        x,
        ((packed, scale),),
        sizes,
        activation_cast_kind=activation_cast,
        limit=None,
        out_dtype=out_dtype,
        tiles=tiles,
        interpret=interpret,
        name="mxfp4_grouped_linear",
    )


def mxfp4_grouped_swiglu(
    x: jax.Array,
    gate_packed: jax.Array,
    gate_scale: jax.Array,
    up_packed: jax.Array,
    up_scale: jax.Array,
    group_sizes: jax.Array,
    *,
    limit: float | None = None,
    activation_cast: str = "none",
    out_dtype: Any = jnp.bfloat16,
    tiles: Tiles | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Fused first expert GEMM + clamped SwiGLU with the Triton kernel (signature of op ``mxfp4_grouped_swiglu``)."""
    x = jnp.asarray(x)
    pairs = (
        ("gate", jnp.asarray(gate_packed), jnp.asarray(gate_scale)),
        ("up", jnp.asarray(up_packed), jnp.asarray(up_scale)),
    )
    sizes = _check(x, pairs, group_sizes, activation_cast, "mxfp4_grouped_swiglu")
    if pairs[0][1].shape != pairs[1][1].shape:
        raise ValueError(
            f"mxfp4_grouped_swiglu: gate and up experts must have the same shape, got {pairs[0][1].shape} "
            f"and {pairs[1][1].shape}"
        )
    if limit is not None and not (
        isinstance(limit, int | float) and not isinstance(limit, bool) and limit > 0
    ):
        raise ValueError(f"mxfp4_grouped_swiglu: limit must be a real number > 0 or None, got {limit!r}")
    return _grouped_call(
        x,
        ((pairs[0][1], pairs[0][2]), (pairs[1][1], pairs[1][2])),
        sizes,
        activation_cast_kind=activation_cast,
        limit=None if limit is None else float(limit),
        out_dtype=out_dtype,
        tiles=tiles,
        interpret=interpret,
        name="mxfp4_grouped_swiglu",
    )
