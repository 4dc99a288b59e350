"""Ragged grouped MXFP4 expert GEMMs (model.md §8.2, §12.1.2): ops ``"mxfp4_grouped_linear"`` and
``"mxfp4_grouped_swiglu"``.

The MoE sorts its (token, expert) rows by expert before the expert GEMMs, so expert ``e`` owns the contiguous
rows ``[sum(group_sizes[:e]), sum(group_sizes[:e+1]))`` of ``x [T, K]``. Groups may be empty, may hold a single
row and need not be multiples of any tile. Rows past ``sum(group_sizes)`` are padding (a fixed-size buffer
bucketed by the scheduler) and come out as zeros. Weights stay in the checkpoint's MXFP4 layout: ``packed
[E, N, K/2]`` uint8 with element ``2i`` in the low nibble and ``2i+1`` in the high nibble, ``scale [E, N, K/32]``
UE8M0.

``mxfp4_grouped_swiglu`` is the first expert GEMM and the clamped SwiGLU in one op: gate (``w1``) and up (``w3``)
are separate weight arrays, as in the checkpoint, so no per-step concatenation of the expert weights is needed;
kernels compute both products for the same output columns and apply the activation before writing, so the
``[T, 2I]`` intermediate never reaches memory.

References loop over experts (:func:`deepinfer_jax.numerics.qlinear.grouped_mxfp4_linear`, decoding tile by
tile); ``lax.ragged_dot`` would need more temporary memory than the expert weights on XLA:CPU. Kernels of the
same names and signatures are registered for ``pallas_gpu`` and ``ascend``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from deepinfer_jax.numerics import qlinear
from deepinfer_jax.numerics.activation import V3_ACTIVATION_BLOCK
from deepinfer_jax.ops.gemm import _check_out_dtype, _check_tokens, canonical_activation_cast, numerics_cast
from deepinfer_jax.ops.registry import register_impl, register_op
from deepinfer_jax.ops.swiglu import check_swiglu_limit, swiglu_math

__all__ = ["GROUPED_ACTIVATION_CASTS", "check_group_sizes", "mxfp4_grouped_linear", "mxfp4_grouped_swiglu"]

#: Activation casts of the MXFP4 expert GEMMs (V4/V4.1 only, so no V3 per-128 cast).
GROUPED_ACTIVATION_CASTS: tuple[str, ...] = ("none", "mxfp8")


def check_group_sizes(op: str, group_sizes: Any, num_experts: int) -> jax.Array:
    """``group_sizes`` as ``int32 [E]``; refuses other shapes and non-integer dtypes.

    Values are data (traced), so ``sum <= T`` and non-negativity cannot be checked here; rows past ``T`` are
    never read or written.
    """
    sizes = jnp.asarray(group_sizes)
    if sizes.shape != (num_experts,):
        raise ValueError(
            f"{op}: group_sizes must have shape ({num_experts},) (one per expert), got {sizes.shape}"
        )
    if not jnp.issubdtype(sizes.dtype, jnp.integer):
        raise TypeError(f"{op}: group_sizes must be an integer array, got dtype {sizes.dtype}")
    return sizes.astype(jnp.int32)


def _check_mxfp4_experts(op: str, name: str, packed: Any, scale: Any, in_features: int) -> None:
    shape = jnp.shape(packed)
    if len(shape) != 3:
        raise ValueError(f"{op}: {name} packed weight must have shape [E, N, K/2], got {shape}")
    if shape[2] * 2 != in_features:
        raise ValueError(
            f"{op}: {name} packed weight {shape} holds K = {shape[2] * 2} inputs, x has {in_features}"
        )
    if in_features % 32:
        raise ValueError(f"{op}: K = {in_features} must be a multiple of the MXFP4 group size 32")
    expected = (shape[0], shape[1], in_features // 32)
    if jnp.shape(scale) != expected:
        raise ValueError(
            f"{op}: {name} scale must have shape {expected} (UE8M0 per 32 inputs), got {jnp.shape(scale)}"
        )


def mxfp4_grouped_linear(
    x: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    group_sizes: jax.Array,
    *,
    activation_cast: str = "none",
    out_dtype: Any = jnp.bfloat16,
) -> jax.Array:
    """Ragged grouped GEMM ``y[r] = Q(x[r]) · W[e(r)]ᵀ`` over rows sorted by expert -> ``[T, N]`` (reference).

    Args:
      x: ``[T, K]`` rows sorted by expert.
      packed: ``uint8 [E, N, K/2]`` E2M1 pairs (low nibble = even element).
      scale: ``[E, N, K/32]`` UE8M0 (``float8_e8m0fnu`` or ``uint8``).
      group_sizes: ``int [E]`` rows per expert; rows past the sum are padding and give 0.
      activation_cast: ``"none"`` (weight-only) or ``"mxfp8"`` (production V4/V4.1).
      out_dtype: floating dtype of the result.
    """
    op = "mxfp4_grouped_linear"
    x = _check_tokens(op, x)
    _check_mxfp4_experts(op, "experts", packed, scale, x.shape[1])
    sizes = check_group_sizes(op, group_sizes, jnp.shape(packed)[0])
    kind = canonical_activation_cast(op, activation_cast, GROUPED_ACTIVATION_CASTS)
    dtype = _check_out_dtype(op, out_dtype)
    return qlinear.grouped_mxfp4_linear(
        x,
        packed,
        scale,
        group_sizes=sizes,
        activation_cast=numerics_cast(kind),
        activation_block=V3_ACTIVATION_BLOCK,
        out_dtype=dtype,
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
) -> jax.Array:
    """``swiglu([Q(x)·W1ᵀ | Q(x)·W3ᵀ])`` per expert group -> ``[T, I]`` (reference of the fused op).

    ``gate_*`` are the ``w1`` experts and ``up_*`` the ``w3`` experts, both ``[E, I, K/2]`` / ``[E, I, K/32]``.
    The two products are kept in float32 until the activation, which is rounded once to ``out_dtype``;
    padding rows give 0.
    """
    op = "mxfp4_grouped_swiglu"
    x = _check_tokens(op, x)
    _check_mxfp4_experts(op, "gate", gate_packed, gate_scale, x.shape[1])
    _check_mxfp4_experts(op, "up", up_packed, up_scale, x.shape[1])
    if jnp.shape(gate_packed) != jnp.shape(up_packed):
        raise ValueError(
            f"{op}: gate and up experts must have the same shape, got {jnp.shape(gate_packed)} and "
            f"{jnp.shape(up_packed)}"
        )
    sizes = check_group_sizes(op, group_sizes, jnp.shape(gate_packed)[0])
    limit = check_swiglu_limit(op, limit)
    kind = canonical_activation_cast(op, activation_cast, GROUPED_ACTIVATION_CASTS)
    dtype = _check_out_dtype(op, out_dtype)
    common = dict(group_sizes=sizes, activation_cast=numerics_cast(kind), out_dtype=jnp.float32)
    g = qlinear.grouped_mxfp4_linear(x, gate_packed, gate_scale, **common)
    u = qlinear.grouped_mxfp4_linear(x, up_packed, up_scale, **common)
    return swiglu_math(g, u, limit).astype(dtype)


register_op(
    "mxfp4_grouped_linear",
    mxfp4_grouped_linear,
    doc="ragged grouped MXFP4 expert GEMM over rows sorted by expert, padding rows give 0 (model.md §8.2)",
)
register_op(
    "mxfp4_grouped_swiglu",
    mxfp4_grouped_swiglu,
    doc="first MXFP4 expert GEMM (w1, w3) fused with the clamped SwiGLU, rows sorted by expert (model.md §8.2)",
)
# Both ops live in one kernel module (the fused op is the plain kernel with a second accumulator).
for _op in ("mxfp4_grouped_linear", "mxfp4_grouped_swiglu"):
    register_impl(
        _op,
        "pallas_gpu",
        f"pallas_kernels.mxfp4_grouped_linear:{_op}",
        platforms=("gpu",),
        reason="the Pallas Triton kernel needs the pallas_kernels package",
    )
    register_impl(
        _op,
        "ascend",
        f"custom_calls.ascend.lowerings:{_op}",
        platforms=("ascend",),
        reason="the Ascend lowering needs the custom_calls package",
    )
