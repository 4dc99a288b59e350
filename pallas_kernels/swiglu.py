"""Pallas (Triton) clamped SwiGLU: the ``pallas_gpu`` implementation of op ``"swiglu"``.

``u [T, 2I] = [gate | up]`` -> ``silu(min(gate, L)) · clamp(up, -L, L)`` ``[T, I]`` in float32, rounded once.
One program reads a ``block_t × block_n`` tile of the gate half and the matching tile of the up half (same
columns, offset by ``I``) and writes one tile of the output: a single pass over ``u``. Rows and columns past the
edges are masked, so ``T`` and ``I`` need not be multiples of the tile. The elementwise work is trivial; what the
kernel buys over XLA is never materialising the two halves as separate slices of a non-contiguous layout.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import Tiles, cdiv, compiler_params, pick_tiles, swiglu_f32

__all__ = ["TILES", "swiglu"]

#: ``(max rows, tiles)``; ``block_k`` is unused (no reduction).
TILES: tuple[tuple[int, Tiles], ...] = (
    (64, Tiles(block_t=16, block_n=256, block_k=16, num_warps=4, num_stages=1)),
    (1 << 30, Tiles(block_t=64, block_n=256, block_k=16, num_warps=8, num_stages=1)),
)


def _kernel(u_ref: Any, o_ref: Any, *, tiles: Tiles, limit: float | None) -> None:
    from jax.experimental.pallas import triton as pl_triton

    bt, bn = tiles.block_t, tiles.block_n
    num_rows, width = o_ref.shape
    t, n = pl.program_id(0), pl.program_id(1)
    rows = t * bt + jnp.arange(bt, dtype=jnp.int32)
    cols = n * bn + jnp.arange(bn, dtype=jnp.int32)
    mask = (rows < num_rows)[:, None] & (cols < width)[None, :]
    gate = pl_triton.load(u_ref.at[pl.ds(t * bt, bt), pl.ds(n * bn, bn)], mask=mask, other=0.0)
    up = pl_triton.load(u_ref.at[pl.ds(t * bt, bt), pl.ds(width + n * bn, bn)], mask=mask, other=0.0)
    out = swiglu_f32(gate.astype(jnp.float32), up.astype(jnp.float32), limit)
    pl_triton.store(o_ref.at[pl.ds(t * bt, bt), pl.ds(n * bn, bn)], out.astype(o_ref.dtype), mask=mask)


def swiglu(
    u: jax.Array,
    *,
    limit: float | None = None,
    out_dtype: Any = None,
    tiles: Tiles | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Clamped SwiGLU with the Triton kernel (signature of op ``swiglu``); ``u`` is ``[T, 2I]``.

    Leading dimensions beyond two are flattened into rows.
    """
    u = jnp.asarray(u)
    if u.ndim < 1 or u.shape[-1] % 2 or not jnp.issubdtype(u.dtype, jnp.floating):
        raise ValueError(f"swiglu: u must be a float [..., 2I] array, got {u.dtype} {u.shape}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int | float) or not limit > 0):
        raise ValueError(f"swiglu: limit must be a real number > 0 or None, got {limit!r}")
    out_dtype = jnp.dtype(u.dtype if out_dtype is None else out_dtype)
    lead, width = u.shape[:-1], u.shape[-1] // 2
    u2 = u.reshape(-1, u.shape[-1])
    num_rows = u2.shape[0]
    if num_rows == 0 or width == 0:
        return jnp.zeros((*lead, width), out_dtype)
    tiles = tiles or pick_tiles(TILES, num_rows, width, 16)
    out = pl.pallas_call(
        functools.partial(_kernel, tiles=tiles, limit=None if limit is None else float(limit)),
        out_shape=jax.ShapeDtypeStruct((num_rows, width), out_dtype),
        grid=(cdiv(num_rows, tiles.block_t), cdiv(width, tiles.block_n)),
        compiler_params=compiler_params(tiles),
        interpret=interpret,
        name="swiglu",
    )(u2)
    return out.reshape(*lead, width)
