"""CuteDSL clamped SwiGLU (op ``"swiglu"``, model.md §5.4) for SM100, with a CPU path.

``u = [gate | up]`` of width ``2I`` per row; in float32::

    g   = min(gate, L)            one-sided clamp
    v   = clamp(up, -L, L)        two-sided clamp
    out = g · sigmoid(g) · v

and no clamps when the limit is ``None``. The limit is a compile-time constant of the kernel (one per model).
One thread per output element, ``128`` columns of one row per CTA, grid ``(ceil(I/128), T)``: a plain elementwise
kernel, one read of ``u`` and one half-width write, for callers that produce ``[gate | up]`` with a separate GEMM
(the MoE's expert path uses the fused :func:`custom_calls.cutedsl.grouped_gemm.mxfp4_grouped_swiglu` instead).

:func:`swiglu` lowers to the ``cutlass_call`` custom call on ``cuda`` and to the same formula in ``jnp`` on every
other platform. The float32 epilogue is :func:`custom_calls.cutedsl._device.clamped_swiglu`, shared with the fused
grouped kernel.
"""

from __future__ import annotations

import math
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import jax
import jax.numpy as jnp
from jax import lax

from custom_calls.cutedsl import _device
from custom_calls.cutedsl._common import check_limit, check_out_dtype, cutlass_call, swiglu_f32

__all__ = ["THREADS", "swiglu", "swiglu_kernel_launch"]

#: Threads per CTA, one output element each.
THREADS = 128


@cute.kernel
def _swiglu_kernel(u: cute.Tensor, out: cute.Tensor, limit: cutlass.Constexpr[float | None]):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, bidy, _ = cute.arch.block_idx()
    col = bidx * THREADS + tidx
    row = bidy
    inter = out.shape[1]
    if col < inter:
        g = u[row, col].to(cutlass.Float32)
        v = u[row, col + inter].to(cutlass.Float32)
        out[row, col] = _device.clamped_swiglu(g, v, limit).to(out.element_type)


@cute.jit
def swiglu_kernel_launch(
    stream: cuda.CUstream, u: cute.Tensor, out: cute.Tensor, limit: cutlass.Constexpr[float | None] = None
):
    """Host-side launch: ``u [T, 2I]``, ``out [T, I]``."""
    grid_x = (out.shape[1] + THREADS - 1) // THREADS
    _swiglu_kernel(u, out, limit).launch(grid=[grid_x, out.shape[0], 1], block=[THREADS, 1, 1], stream=stream)


def swiglu(u: jax.Array, *, limit: float | None = None, out_dtype: Any = None) -> jax.Array:
    """Clamped SwiGLU ``[..., 2I] -> [..., I]`` with the signature of op ``"swiglu"``.

    ``out_dtype`` defaults to ``u.dtype``; leading dimensions are flattened into the kernel's row axis.
    """
    u = jnp.asarray(u)
    if u.ndim < 1 or u.shape[-1] % 2:
        raise ValueError(f"u must have an even last dimension [..., 2I] = [gate | up], got shape {u.shape}")
    if not jnp.issubdtype(u.dtype, jnp.floating):
        raise TypeError(f"u must be a floating-point array, got dtype {u.dtype}")
    limit = check_limit(limit)
    out_dtype = check_out_dtype(u.dtype if out_dtype is None else out_dtype)
    lead, inter = u.shape[:-1], u.shape[-1] // 2
    rows = math.prod(lead)
    if rows == 0 or inter == 0:
        return jnp.zeros((*lead, inter), out_dtype)
    u2 = u.reshape(rows, 2 * inter)

    def on_gpu(u2: jax.Array) -> jax.Array:
        call = cutlass_call(
            swiglu_kernel_launch,
            output_shape_dtype=jax.ShapeDtypeStruct((rows, inter), out_dtype),
            limit=limit,
        )
        return call(u2)

    def elsewhere(u2: jax.Array) -> jax.Array:
        return swiglu_f32(u2[:, :inter], u2[:, inter:], limit).astype(out_dtype)

    return lax.platform_dependent(u2, cuda=on_gpu, default=elsewhere).reshape(*lead, inter)
