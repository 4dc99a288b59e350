"""CuteDSL MXFP4 grouped expert GEMMs (ops ``"mxfp4_grouped_linear"``, ``"mxfp4_grouped_swiglu"``) for SM100.

Tokens arrive sorted by expert, ``group_sizes[e]`` consecutive rows per expert (the layout the MoE dispatch
produces); rows past ``Σ group_sizes`` are padding and give zeros. Expert ``e``'s weight is MXFP4: ``packed
[E, N, K/2]`` bytes holding two E2M1 codes each (element ``2i`` in the low nibble) and one UE8M0 scale byte per
32 elements, ``scale [E, N, K/32]``. For row ``t`` of expert ``e``::

    y[t, n] = Σ_g 2^(scale[e, n, g] - 127) · Σ_{j<32} x[t, 32g + j] · e2m1(code[e, n, 32g + j])

The kernel unpacks the nibbles and applies each group's scale once to the group's float32 partial sum; nothing
is dequantised into memory. The expert ranges are turned into a per-row expert index ``[T]`` (an ``int32``
side input computed by XLA from ``group_sizes``, ``E`` for padding rows), so a CTA needs no search.

Work split: one thread per output element, ``128`` output columns of one row per CTA, grid ``(ceil(N/128), T)``.
The fused form (:func:`mxfp4_grouped_swiglu`) computes an element's gate (``w1``) and up (``w3``) products in the
same thread and applies the clamped SwiGLU (model.md §5.4) before its single rounding.

Both wrappers lower to the ``cutlass_call`` custom call on ``cuda`` and run the loop-over-experts ``jnp``
reference :func:`deepinfer_jax.numerics.qlinear.grouped_mxfp4_linear` on every other platform. On ``cuda``, bf16
activations take the tcgen05 tensor-core kernels of :mod:`.tc_gemm` instead (compiled for sm_100a, not run on
hardware), with a static (row tile, expert) work list from :func:`custom_calls.cutedsl._common.work_slots`;
these SIMT kernels remain for float32 activations.
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
    GROUPED_ACTIVATION_CASTS,
    cast_activations,
    check_limit,
    check_out_dtype,
    cutlass_call,
    swiglu_f32,
    tensor_core_ok,
    token_tile,
    work_slots,
)
from deepinfer_jax.numerics.elements import as_uint8
from deepinfer_jax.numerics.formats import MXFP4
from deepinfer_jax.numerics.qlinear import grouped_mxfp4_linear, token_expert_ids

__all__ = [
    "THREADS",
    "mxfp4_grouped_gemm",
    "mxfp4_grouped_linear",
    "mxfp4_grouped_swiglu",
    "mxfp4_grouped_swiglu_gemm",
]

#: Threads per CTA, one output column each.
THREADS = 128
_GROUP = MXFP4.group_size  # 32 elements per scale byte
_GROUP_BYTES = _GROUP // 2


@cute.jit
def _mxfp4_dot(x: cute.Tensor, packed: cute.Tensor, s: cute.Tensor, t, e, n) -> cutlass.Float32:
    """``Σ_k x[t, k] · W_e[n, k]`` for MXFP4 expert ``e``, one scale multiplication per 32-element group."""
    acc = cutlass.Float32(0.0)
    for g in cutlass.range(s.shape[2]):
        part = cutlass.Float32(0.0)
        for j in cutlass.range_constexpr(_GROUP_BYTES):
            byte = cutlass.Int32(packed[e, n, g * _GROUP_BYTES + j])
            k = g * _GROUP + 2 * j
            part = part + x[t, k].to(cutlass.Float32) * _device.e2m1_to_f32(byte & 0xF)
            part = part + x[t, k + 1].to(cutlass.Float32) * _device.e2m1_to_f32(byte >> 4)
        acc = acc + _device.apply_ue8m0(part, cutlass.Int32(s[e, n, g]))
    return acc


@cute.kernel
def _mxfp4_grouped_gemm_kernel(
    x: cute.Tensor,
    packed: cute.Tensor,
    s: cute.Tensor,
    row_expert: cute.Tensor,
    out: cute.Tensor,
):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, bidy, _ = cute.arch.block_idx()
    n = bidx * THREADS + tidx
    t = bidy
    if n < out.shape[1]:
        acc = cutlass.Float32(0.0)
        e = row_expert[t]
        if e >= 0 and e < packed.shape[0]:
            acc = _mxfp4_dot(x, packed, s, t, e, n)
        out[t, n] = acc.to(out.element_type)


@cute.kernel
def _mxfp4_grouped_swiglu_kernel(
    x: cute.Tensor,
    gate_packed: cute.Tensor,
    gate_s: cute.Tensor,
    up_packed: cute.Tensor,
    up_s: cute.Tensor,
    row_expert: cute.Tensor,
    out: cute.Tensor,
    limit: cutlass.Constexpr[float | None],
):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, bidy, _ = cute.arch.block_idx()
    i = bidx * THREADS + tidx
    t = bidy
    if i < out.shape[1]:
        result = cutlass.Float32(0.0)
        e = row_expert[t]
        if e >= 0 and e < gate_packed.shape[0]:
            g = _mxfp4_dot(x, gate_packed, gate_s, t, e, i)
            v = _mxfp4_dot(x, up_packed, up_s, t, e, i)
            result = _device.clamped_swiglu(g, v, limit)
        out[t, i] = result.to(out.element_type)


@cute.jit
def mxfp4_grouped_gemm(
    stream: cuda.CUstream,
    x: cute.Tensor,
    packed: cute.Tensor,
    s: cute.Tensor,
    row_expert: cute.Tensor,
    out: cute.Tensor,
):
    """Host-side launch: ``x [T, K]``, ``packed [E, N, K/2]`` uint8, ``s [E, N, K/32]`` uint8 UE8M0,
    ``row_expert [T]`` int32, ``out [T, N]``."""
    grid_x = (out.shape[1] + THREADS - 1) // THREADS
    _mxfp4_grouped_gemm_kernel(x, packed, s, row_expert, out).launch(
        grid=[grid_x, out.shape[0], 1], block=[THREADS, 1, 1], stream=stream
    )


@cute.jit
def mxfp4_grouped_swiglu_gemm(
    stream: cuda.CUstream,
    x: cute.Tensor,
    gate_packed: cute.Tensor,
    gate_s: cute.Tensor,
    up_packed: cute.Tensor,
    up_s: cute.Tensor,
    row_expert: cute.Tensor,
    out: cute.Tensor,
    limit: cutlass.Constexpr[float | None] = None,
):
    """Host-side launch of the fused first expert GEMM: ``gate``/``up`` experts ``[E, I, K/2]`` with scales
    ``[E, I, K/32]``, ``out [T, I] = swiglu(x·W1ᵀ, x·W3ᵀ)``."""
    grid_x = (out.shape[1] + THREADS - 1) // THREADS
    _mxfp4_grouped_swiglu_kernel(x, gate_packed, gate_s, up_packed, up_s, row_expert, out, limit).launch(
        grid=[grid_x, out.shape[0], 1], block=[THREADS, 1, 1], stream=stream
    )


def _zero_padding_rows(out: jax.Array, sizes: jax.Array) -> jax.Array:
    """Rows past ``sum(group_sizes)`` are padding: the tcgen05 kernels never write them, the op returns 0."""
    rows = jnp.arange(out.shape[0], dtype=jnp.int32)[:, None]
    return jnp.where(rows < jnp.sum(sizes), out, jnp.zeros((), out.dtype))


def _check_tokens(x: jax.Array) -> None:
    if x.ndim != 2:
        raise ValueError(f"x must have shape [T, K], got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a floating-point array, got dtype {x.dtype}")
    if x.shape[1] % _GROUP:
        raise ValueError(f"x must have K a multiple of the MXFP4 group size {_GROUP}, got K={x.shape[1]}")


def _check_experts(name: str, packed: jax.Array, scale: jax.Array, k: int) -> None:
    if packed.ndim != 3 or packed.shape[2] * 2 != k:
        raise ValueError(
            f"{name} packed weight must have shape [E, N, K/2={k // 2}], got shape {packed.shape}"
        )
    if packed.dtype not in (jnp.dtype(jnp.uint8), jnp.dtype(jnp.int8)):
        raise TypeError(f"{name} packed weight must be uint8 nibble pairs, got dtype {packed.dtype}")
    expected = (*packed.shape[:2], k // _GROUP)
    if scale.shape != expected:
        raise ValueError(f"{name} scale must have shape {expected} (UE8M0 per 32 inputs), got {scale.shape}")
    if scale.dtype not in (jnp.dtype(jnp.uint8), jnp.dtype(jnp.float8_e8m0fnu)):
        raise TypeError(
            f"{name} scale must be UE8M0 bytes (float8_e8m0fnu or uint8), got dtype {scale.dtype}"
        )


def _check_group_sizes(group_sizes: jax.Array, num_experts: int) -> jax.Array:
    if group_sizes.shape != (num_experts,):
        raise ValueError(
            f"group_sizes must have shape ({num_experts},) (one per expert), got {group_sizes.shape}"
        )
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must be an integer array, got dtype {group_sizes.dtype}")
    return group_sizes.astype(jnp.int32)


def mxfp4_grouped_linear(
    x: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    group_sizes: jax.Array,
    *,
    activation_cast: str = "none",
    out_dtype: Any = jnp.bfloat16,
) -> jax.Array:
    """Ragged grouped GEMM ``[T, K] -> [T, N]`` over MXFP4 experts, signature of op ``"mxfp4_grouped_linear"``.

    ``x`` rows are sorted by expert, ``group_sizes [E]`` rows each (``Σ ≤ T``; later rows give zeros);
    ``activation_cast`` is ``"none"`` or ``"mxfp8"``.
    """
    x, packed, scale, group_sizes = (jnp.asarray(a) for a in (x, packed, scale, group_sizes))
    _check_tokens(x)
    _check_experts("experts", packed, scale, x.shape[1])
    sizes = _check_group_sizes(group_sizes, packed.shape[0])
    out_dtype = check_out_dtype(out_dtype)
    xc = cast_activations(x, activation_cast, allowed=GROUPED_ACTIVATION_CASTS)
    codes, scale_bytes = as_uint8(packed, "packed"), as_uint8(scale, "scale")
    num_tokens, num_out = x.shape[0], packed.shape[1]
    if num_tokens == 0 or num_out == 0:
        return jnp.zeros((num_tokens, num_out), out_dtype)

    def on_gpu(xc: jax.Array, codes: jax.Array, scale_bytes: jax.Array, sizes: jax.Array) -> jax.Array:
        out_shape = jax.ShapeDtypeStruct((num_tokens, num_out), out_dtype)
        if tensor_core_ok(xc):  # tcgen05 (tc_gemm.py); compiled for sm_100a, not run on hardware
            from custom_calls.cutedsl.tc_gemm import mxfp4_grouped_gemm_tc

            tile = token_tile(num_tokens)
            call = cutlass_call(mxfp4_grouped_gemm_tc, output_shape_dtype=out_shape, bn=tile)
            out = call(xc, codes, scale_bytes, work_slots(sizes, num_tokens, tile))
            return _zero_padding_rows(out, sizes)
        row_expert = token_expert_ids(num_tokens, packed.shape[0], group_sizes=sizes)
        call = cutlass_call(mxfp4_grouped_gemm, output_shape_dtype=out_shape)
        return call(xc, codes, scale_bytes, row_expert)

    def elsewhere(xc: jax.Array, codes: jax.Array, scale_bytes: jax.Array, sizes: jax.Array) -> jax.Array:
        return grouped_mxfp4_linear(xc, codes, scale_bytes, group_sizes=sizes, out_dtype=out_dtype)

    return lax.platform_dependent(xc, codes, scale_bytes, sizes, cuda=on_gpu, default=elsewhere)


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
) -> jax.Array:
    """``swiglu([x·W1ᵀ | x·W3ᵀ])`` per expert group ``-> [T, I]``, signature of op ``"mxfp4_grouped_swiglu"``.

    One kernel computes both products of an output element in float32 and applies the clamped SwiGLU before
    the single rounding to ``out_dtype``, so the ``[T, 2I]`` intermediate never reaches memory.
    """
    arrays = (x, gate_packed, gate_scale, up_packed, up_scale, group_sizes)
    x, gate_packed, gate_scale, up_packed, up_scale, group_sizes = (jnp.asarray(a) for a in arrays)
    _check_tokens(x)
    _check_experts("gate", gate_packed, gate_scale, x.shape[1])
    _check_experts("up", up_packed, up_scale, x.shape[1])
    if gate_packed.shape != up_packed.shape:
        raise ValueError(
            f"gate and up experts must have the same shape, got {gate_packed.shape} and {up_packed.shape}"
        )
    sizes = _check_group_sizes(group_sizes, gate_packed.shape[0])
    limit = check_limit(limit)
    out_dtype = check_out_dtype(out_dtype)
    xc = cast_activations(x, activation_cast, allowed=GROUPED_ACTIVATION_CASTS)
    weights = tuple(
        as_uint8(a, name)
        for a, name in (
            (gate_packed, "gate_packed"),
            (gate_scale, "gate_scale"),
            (up_packed, "up_packed"),
            (up_scale, "up_scale"),
        )
    )
    num_tokens, inter = x.shape[0], gate_packed.shape[1]
    if num_tokens == 0 or inter == 0:
        return jnp.zeros((num_tokens, inter), out_dtype)

    def on_gpu(xc: jax.Array, gp: jax.Array, gs: jax.Array, up: jax.Array, us: jax.Array, sizes: jax.Array):
        out_shape = jax.ShapeDtypeStruct((num_tokens, inter), out_dtype)
        if tensor_core_ok(xc):  # tcgen05 (tc_gemm.py); compiled for sm_100a, not run on hardware
            from custom_calls.cutedsl.tc_gemm import mxfp4_grouped_swiglu_gemm_tc

            tile = token_tile(num_tokens)
            call = cutlass_call(
                mxfp4_grouped_swiglu_gemm_tc, output_shape_dtype=out_shape, bn=tile, limit=limit
            )
            out = call(xc, gp, gs, up, us, work_slots(sizes, num_tokens, tile))
            return _zero_padding_rows(out, sizes)
        row_expert = token_expert_ids(num_tokens, gate_packed.shape[0], group_sizes=sizes)
        call = cutlass_call(mxfp4_grouped_swiglu_gemm, output_shape_dtype=out_shape, limit=limit)
        return call(xc, gp, gs, up, us, row_expert)

    def elsewhere(
        xc: jax.Array, gp: jax.Array, gs: jax.Array, up: jax.Array, us: jax.Array, sizes: jax.Array
    ):
        g = grouped_mxfp4_linear(xc, gp, gs, group_sizes=sizes, out_dtype=jnp.float32)
        v = grouped_mxfp4_linear(xc, up, us, group_sizes=sizes, out_dtype=jnp.float32)
        return swiglu_f32(g, v, limit).astype(out_dtype)

    return lax.platform_dependent(xc, *weights, sizes, cuda=on_gpu, default=elsewhere)
