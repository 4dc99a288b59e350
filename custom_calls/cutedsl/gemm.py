"""CuteDSL FP8 block-scaled GEMM (op ``"fp8_block_linear"``) for SM100, with a CPU path.

``y[t, n] = Σ_k x[t, k] · w[n, k]`` where ``w = e4m3(w_q) · scale[n // b0, k // b1]``. The weight stays in its
checkpoint format in global memory: one byte per element plus one scale per ``b0 × b1`` block. The kernel walks
the reduction one scale block at a time, sums ``x · e4m3(code)`` over the block's ``b1`` columns in float32 and
multiplies the block's partial sum by its scale once, which is the block-scaled GEMM's defining saving (one
scale multiplication per block instead of per element). A dequantised weight never exists, not even a tile of it.

Work split: one thread per output column and ``TOKENS = 8`` token rows, ``128`` columns per CTA; the grid is
``(ceil(N / 128), ceil(T / 8))``. Each weight byte is read and decoded once per CTA and used for the eight rows
(float32 accumulators in registers); the activations a warp reads are the same address for all its lanes
(a broadcast). On the GPU the wrapper runs this SIMT kernel only where the tensor-core kernel of
:mod:`.tc_gemm` would not be exact: float32 activations (parity mode) and DeepSeek-V3's float32 ``scale_inv``
blocks. bf16 activations with UE8M0 scales take the tcgen05 kernel (compiled for sm_100a, not run on hardware).

:func:`fp8_block_linear` is the op implementation. On the ``cuda`` platform it lowers to the
``cutlass_call`` custom call; on every other platform (``lax.platform_dependent``) it runs the tiled ``jnp``
reference of :func:`deepinfer_jax.numerics.qlinear.fp8_linear`, so a model that selected this kernel still
compiles for the host.
"""

from __future__ import annotations

from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import jax
import jax.numpy as jnp
from jax import lax

from custom_calls.cutedsl import _device
from custom_calls.cutedsl._common import (
    cast_activations,
    check_out_dtype,
    cutlass_call,
    tensor_core_ok,
    token_tile,
)
from deepinfer_jax.numerics.elements import as_uint8
from deepinfer_jax.numerics.qlinear import fp8_linear

__all__ = ["THREADS", "TOKENS", "fp8_block_gemm", "fp8_block_linear"]

#: Threads per CTA, one output column each.
THREADS = 128
#: Token rows per CTA: each decoded weight element serves this many rows from registers.
TOKENS = 8
# Unroll factor of the loop over a scale block's columns (a block is 32 columns for V4/V4.1, 128 for V3; full
# unrolling of 128 columns would multiply code size for no gain in a load-bound loop).
_UNROLL = 8


@cute.kernel
def _fp8_block_gemm_kernel(
    x: cute.Tensor,
    w: cute.Tensor,
    s: cute.Tensor,
    out: cute.Tensor,
    block_rows: cutlass.Constexpr[int],
    block_cols: cutlass.Constexpr[int],
    ue8m0: cutlass.Constexpr[bool],
):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, bidy, _ = cute.arch.block_idx()
    n = bidx * THREADS + tidx
    t0 = bidy * TOKENS
    num_tokens = out.shape[0]
    k_total = x.shape[1]
    if n < out.shape[1]:
        acc = cute.make_rmem_tensor((TOKENS,), cutlass.Float32)
        part = cute.make_rmem_tensor((TOKENS,), cutlass.Float32)
        acc.fill(0.0)
        row_block = n // block_rows
        for kb in cutlass.range(s.shape[1]):
            part.fill(0.0)
            for j in cutlass.range(block_cols, unroll=_UNROLL):
                k = kb * block_cols + j
                if k < k_total:
                    wv = _device.e4m3_to_f32(cutlass.Int32(w[n, k]))  # decoded once, used for TOKENS rows
                    for m in cutlass.range_constexpr(TOKENS):
                        if t0 + m < num_tokens:
                            part[m] = part[m] + x[t0 + m, k].to(cutlass.Float32) * wv
            for m in cutlass.range_constexpr(TOKENS):
                if cutlass.const_expr(ue8m0):
                    acc[m] = acc[m] + _device.apply_ue8m0(part[m], cutlass.Int32(s[row_block, kb]))
                else:
                    acc[m] = acc[m] + part[m] * s[row_block, kb].to(cutlass.Float32)
        for m in cutlass.range_constexpr(TOKENS):
            if t0 + m < num_tokens:
                out[t0 + m, n] = acc[m].to(out.element_type)


@cute.jit
def fp8_block_gemm(
    stream: cuda.CUstream,
    x: cute.Tensor,
    w: cute.Tensor,
    s: cute.Tensor,
    out: cute.Tensor,
    block_rows: cutlass.Constexpr[int] = 32,
    block_cols: cutlass.Constexpr[int] = 32,
    ue8m0: cutlass.Constexpr[bool] = True,
):
    """Host-side launch: ``x [T, K]``, ``w [N, K]`` uint8 E4M3 codes, ``s [ceil(N/b0), ceil(K/b1)]``
    (uint8 UE8M0 when ``ue8m0``, else float32 ``scale_inv``), ``out [T, N]``."""
    grid_x = (out.shape[1] + THREADS - 1) // THREADS
    grid_y = (out.shape[0] + TOKENS - 1) // TOKENS
    _fp8_block_gemm_kernel(x, w, s, out, block_rows, block_cols, ue8m0).launch(
        grid=[grid_x, grid_y, 1], block=[THREADS, 1, 1], stream=stream
    )


def _check_inputs(x: jax.Array, w_q: jax.Array, scale: jax.Array, block: Any) -> tuple[int, int]:
    if (
        not isinstance(block, tuple | list)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(f"block must be a pair of positive ints (rows, cols), got {block!r}")
    b0, b1 = int(block[0]), int(block[1])
    if x.ndim != 2:
        raise ValueError(f"x must have shape [T, K], got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a floating-point array, got dtype {x.dtype}")
    if w_q.ndim != 2 or w_q.shape[1] != x.shape[1]:
        raise ValueError(f"w_q must have shape [N, K={x.shape[1]}], got shape {w_q.shape}")
    if w_q.dtype not in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.uint8)):
        raise TypeError(f"w_q must be float8_e4m3fn or its uint8 bit pattern, got dtype {w_q.dtype}")
    expected = (-(-w_q.shape[0] // b0), -(-w_q.shape[1] // b1))
    if scale.shape != expected:
        raise ValueError(
            f"scale must have shape {expected} for w_q of shape {w_q.shape} and block {(b0, b1)}, "
            f"got {scale.shape}"
        )
    if scale.dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float8_e8m0fnu), jnp.dtype(jnp.uint8)):
        raise TypeError(
            f"scale must be float32 (scale_inv) or UE8M0 bytes (float8_e8m0fnu, uint8), got dtype {scale.dtype}"
        )
    return b0, b1


def fp8_block_linear(
    x: jax.Array,
    w_q: jax.Array,
    scale: jax.Array,
    *,
    block: tuple[int, int] = (32, 32),
    activation_cast: str = "none",
    out_dtype: Any = jnp.bfloat16,
) -> jax.Array:
    """``x [T, K] · Wᵀ -> [T, N]`` for an FP8 block-scaled weight, with the signature of op ``"fp8_block_linear"``.

    ``w_q [N, K]`` is float8_e4m3fn or its uint8 bit pattern; ``scale [ceil(N/b0), ceil(K/b1)]`` holds UE8M0
    exponent bytes (float8_e8m0fnu or uint8) or float32 ``weight_scale_inv``. ``activation_cast`` is
    ``"none"``, ``"mxfp8"`` or ``"fp8_token_128"``; accumulation is float32.
    """
    x, w_q, scale = jnp.asarray(x), jnp.asarray(w_q), jnp.asarray(scale)
    b0, b1 = _check_inputs(x, w_q, scale, block)
    out_dtype = check_out_dtype(out_dtype)
    xc = cast_activations(x, activation_cast)
    codes = as_uint8(w_q, "w_q")
    ue8m0 = scale.dtype != jnp.dtype(jnp.float32)
    scale_in = as_uint8(scale, "scale") if ue8m0 else scale
    num_tokens, num_out = x.shape[0], w_q.shape[0]
    if num_tokens == 0 or num_out == 0:
        return jnp.zeros((num_tokens, num_out), out_dtype)

    def on_gpu(xc: jax.Array, codes: jax.Array, scale_in: jax.Array) -> jax.Array:
        out_shape = jax.ShapeDtypeStruct((num_tokens, num_out), out_dtype)
        if tensor_core_ok(xc, ue8m0=ue8m0):  # tcgen05 (tc_gemm.py); compiled for sm_100a, not run on hardware
            from custom_calls.cutedsl.tc_gemm import fp8_block_gemm_tc

            call = cutlass_call(
                fp8_block_gemm_tc,
                output_shape_dtype=out_shape,
                bn=token_tile(num_tokens),
                block_rows=b0,
                block_cols=b1,
            )
            return call(xc, codes, scale_in)
        call = cutlass_call(
            fp8_block_gemm, output_shape_dtype=out_shape, block_rows=b0, block_cols=b1, ue8m0=ue8m0
        )
        return call(xc, codes, scale_in)

    def elsewhere(xc: jax.Array, codes: jax.Array, scale_in: jax.Array) -> jax.Array:
        return fp8_linear(xc, codes, scale_in, block=(b0, b1), out_dtype=out_dtype)

    return lax.platform_dependent(xc, codes, scale_in, cuda=on_gpu, default=elsewhere)
