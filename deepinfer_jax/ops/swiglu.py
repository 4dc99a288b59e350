"""Clamped SwiGLU (model.md §5.4), registered as op ``"swiglu"``.

The first expert projection produces ``u = [u_gate | u_up]`` (each ``I`` wide, gate first); the activation is

    g = min(u_gate, L);   v = clamp(u_up, -L, L);   out = g · sigmoid(g) · v

computed in float32 and rounded once to ``out_dtype``. The gate clamp is one-sided (a very negative gate already
gives ~0 through the sigmoid); with ``limit=None`` (DeepSeek-V3) both clamps are skipped.

Taking the concatenated ``[T, 2I]`` tensor rather than two arrays is the layout a fused first GEMM writes (one
GEMM over ``[w1; w3]``), and it is what the kernels read: one pass over ``u``, one write of the half-width result.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp

from deepinfer_jax.ops.registry import register_impl, register_op

__all__ = ["check_swiglu_limit", "swiglu", "swiglu_math"]


def check_swiglu_limit(op: str, limit: Any) -> float | None:
    """Validate a SwiGLU clamp limit: ``None`` or a finite real ``> 0``; returns it as a float."""
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, numbers.Real):
        raise TypeError(f"{op}: limit must be a real number or None, got {type(limit).__name__} {limit!r}")
    value = float(limit)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{op}: limit must be finite and > 0 (or None), got {limit!r}")
    return value


def swiglu_math(gate: jax.Array, up: jax.Array, limit: float | None) -> jax.Array:
    """The float32 activation of two same-shaped halves; shared by the reference and the kernels' epilogues."""
    g = gate.astype(jnp.float32)
    v = up.astype(jnp.float32)
    if limit is not None:
        lim = jnp.float32(limit)
        g = jnp.minimum(g, lim)
        v = jnp.clip(v, -lim, lim)
    return g * jax.nn.sigmoid(g) * v


def swiglu(u: jax.Array, *, limit: float | None = None, out_dtype: Any = None) -> jax.Array:
    """Clamped SwiGLU of ``u [..., 2I] = [gate | up]`` -> ``[..., I]`` in ``out_dtype`` (default ``u.dtype``)."""
    u = jnp.asarray(u)
    if u.ndim < 1 or u.shape[-1] % 2:
        raise ValueError(f"swiglu: u must have an even last dimension [..., 2I] = [gate | up], got {u.shape}")
    if not jnp.issubdtype(u.dtype, jnp.floating):
        raise TypeError(f"swiglu: u must be a floating-point array, got dtype {u.dtype}")
    limit = check_swiglu_limit("swiglu", limit)
    dtype = jnp.dtype(u.dtype if out_dtype is None else out_dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"swiglu: out_dtype must be a floating dtype, got {dtype}")
    half = u.shape[-1] // 2
    return swiglu_math(u[..., :half], u[..., half:], limit).astype(dtype)


register_op(
    "swiglu",
    swiglu,
    doc="clamped SwiGLU of [gate | up] in f32: silu(min(g, L)) · clamp(u, ±L) (model.md §5.4)",
)
register_impl(
    "swiglu",
    "pallas_gpu",
    "pallas_kernels.swiglu:swiglu",
    platforms=("gpu",),
    reason="the Pallas Triton kernel needs the pallas_kernels package",
)
register_impl(
    "swiglu",
    "ascend",
    "custom_calls.ascend.lowerings:swiglu",
    platforms=("ascend",),
    reason="the Ascend lowering needs the custom_calls package",
)
