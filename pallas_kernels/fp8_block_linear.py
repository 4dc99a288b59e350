"""Pallas (Triton) FP8 block-scaled GEMM: the ``pallas_gpu`` implementation of op ``"fp8_block_linear"``.

One program computes a ``block_t × block_n`` tile of ``y = Q(x) · deq(W)ᵀ``: it walks the reduction axis in
``block_k`` steps, loads the E4M3 bytes of a ``block_n × block_k`` weight tile, decodes them (integer bit
manipulation, see :mod:`pallas_kernels._common`), multiplies each element by its block's scale (gathered from
the small ``[ceil(N/b0), ceil(K/b1)]`` scale grid, so any block shape and any tile size work), and accumulates
``x_tile · w_tileᵀ`` in float32. The weight is only ever decoded one tile at a time, in registers.

Edges: rows past ``T``, columns past ``N`` and reduction steps past ``K`` are masked (loads give 0, stores are
skipped), so no shape needs padding. The activation cast (``"mxfp8"`` / ``"fp8_token_128"``) is an elementwise
per-group round trip that XLA fuses into one pass before the kernel.

Tile sizes come from :data:`TILES`, keyed by the number of rows (decode steps are a few rows, prefill
thousands); ``interpret=True`` runs the same kernel on the CPU (tests).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer_jax.numerics.activation import V3_ACTIVATION_BLOCK
from deepinfer_jax.numerics.activation import activation_cast as activation_cast_fn
from deepinfer_jax.numerics.codecs import check_block
from pallas_kernels._common import (
    Tiles,
    apply_ue8m0,
    cdiv,
    compiler_params,
    compute_dtype_for,
    dot_nt,
    e4m3_bits_to_f32,
    pick_tiles,
)

__all__ = ["TILES", "fp8_block_linear"]

#: ``(max rows, tiles)``: small row counts (decode) take thin row tiles and wide column tiles, so the few rows
#: stream the weight once; prefill takes square tiles that reuse each decoded weight tile across many rows.
TILES: tuple[tuple[int, Tiles], ...] = (
    (16, Tiles(block_t=16, block_n=128, block_k=64, num_warps=4, num_stages=3)),
    (64, Tiles(block_t=32, block_n=128, block_k=64, num_warps=4, num_stages=3)),
    (256, Tiles(block_t=64, block_n=128, block_k=64, num_warps=4, num_stages=3)),
    (1 << 30, Tiles(block_t=128, block_n=128, block_k=64, num_warps=8, num_stages=3)),
)

_CASTS = {
    "none": "none",
    "mxfp8": "mxfp8",
    "fp8_token_128": "fp8_token_block",
    "fp8_token_block": "fp8_token_block",
}


def _kernel(
    x_ref: Any,
    w_ref: Any,
    s_ref: Any,
    o_ref: Any,
    *,
    tiles: Tiles,
    block: tuple[int, int],
    ue8m0: bool,
    compute_dtype: Any,
) -> None:
    from jax.experimental.pallas import triton as pl_triton

    bt, bn, bk = tiles.block_t, tiles.block_n, tiles.block_k
    b0, b1 = block
    num_rows, k_total = x_ref.shape
    n_total = w_ref.shape[0]
    t, n = pl.program_id(0), pl.program_id(1)
    rows = t * bt + jnp.arange(bt, dtype=jnp.int32)
    cols = n * bn + jnp.arange(bn, dtype=jnp.int32)
    row_ok, col_ok = rows < num_rows, cols < n_total
    scale_rows = jnp.minimum(cols, n_total - 1) // b0

    def step(k, acc):
        kk = k * bk + jnp.arange(bk, dtype=jnp.int32)
        k_ok = kk < k_total
        xt = pl_triton.load(
            x_ref.at[pl.ds(t * bt, bt), pl.ds(k * bk, bk)], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        w_mask = col_ok[:, None] & k_ok[None, :]
        codes = pl_triton.load(w_ref.at[pl.ds(n * bn, bn), pl.ds(k * bk, bk)], mask=w_mask, other=0)
        scale = s_ref[scale_rows[:, None], (jnp.minimum(kk, k_total - 1) // b1)[None, :]]
        values = e4m3_bits_to_f32(codes)
        w = apply_ue8m0(values, scale) if ue8m0 else values * scale
        w = jnp.where(w_mask, w, 0.0)
        return acc + dot_nt(xt, w, compute_dtype)

    acc = jax.lax.fori_loop(0, pl.cdiv(k_total, bk), step, jnp.zeros((bt, bn), jnp.float32))
    pl_triton.store(
        o_ref.at[pl.ds(t * bt, bt), pl.ds(n * bn, bn)],
        acc.astype(o_ref.dtype),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def _as_code_bytes(a: jax.Array, name: str) -> jax.Array:
    if a.dtype == jnp.uint8:
        return a
    if a.dtype in (jnp.float8_e4m3fn, jnp.float8_e8m0fnu, jnp.int8):
        return jax.lax.bitcast_convert_type(a, jnp.uint8)
    raise TypeError(
        f"fp8_block_linear: {name} must be 8-bit storage (uint8, int8 or float8), got dtype {a.dtype}"
    )


def fp8_block_linear(
    x: jax.Array,
    w_q: jax.Array,
    scale: jax.Array,
    *,
    block: tuple[int, int] = (32, 32),
    activation_cast: str = "none",
    out_dtype: Any = jnp.bfloat16,
    tiles: Tiles | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``Q(x) · deq(w_q, scale)ᵀ`` -> ``[T, N]`` with the Triton kernel (signature of op ``fp8_block_linear``).

    ``tiles`` overrides the table choice (benchmarks, tests); ``interpret=True`` runs the kernel with the Pallas
    interpreter on any backend.
    """
    b0, b1 = check_block(block)
    x, w_q, scale = jnp.asarray(x), jnp.asarray(w_q), jnp.asarray(scale)
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"fp8_block_linear: x must be a float [tokens, in] array, got {x.dtype} {x.shape}")
    if w_q.ndim != 2 or w_q.shape[1] != x.shape[1]:
        raise ValueError(f"fp8_block_linear: w_q must have shape [N, {x.shape[1]}], got {w_q.shape}")
    n_total, k_total = w_q.shape
    grid_shape = (cdiv(n_total, b0), cdiv(k_total, b1))
    if scale.shape != grid_shape:
        raise ValueError(
            f"fp8_block_linear: scale must have shape {grid_shape} for w_q {w_q.shape} and block {(b0, b1)}, "
            f"got {scale.shape}"
        )
    if activation_cast not in _CASTS:
        raise ValueError(
            f"fp8_block_linear: activation_cast = {activation_cast!r} is not one of {tuple(_CASTS)}"
        )
    ue8m0 = scale.dtype != jnp.float32
    scale = _as_code_bytes(scale, "scale") if ue8m0 else scale
    codes = _as_code_bytes(w_q, "w_q")
    x = activation_cast_fn(
        x, _CASTS[activation_cast], block=V3_ACTIVATION_BLOCK
    )  # fused by XLA, before the kernel
    num_rows = x.shape[0]
    if num_rows == 0 or n_total == 0:
        return jnp.zeros((num_rows, n_total), out_dtype)
    tiles = tiles or pick_tiles(TILES, num_rows, n_total, k_total)
    # bf16 operands are exact only for power-of-two scales: e4m3 times a float32 scale_inv (V3) is not a bf16
    compute_dtype = compute_dtype_for(x.dtype) if ue8m0 else jnp.float32
    kernel = functools.partial(_kernel, tiles=tiles, block=(b0, b1), ue8m0=ue8m0, compute_dtype=compute_dtype)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_rows, n_total), out_dtype),
        grid=(cdiv(num_rows, tiles.block_t), cdiv(n_total, tiles.block_n)),
        compiler_params=compiler_params(tiles),
        interpret=interpret,
        name="fp8_block_linear",
    )(x, codes, scale)
