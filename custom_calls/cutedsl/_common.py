"""JAX-side helpers shared by the CuteDSL op wrappers: argument checks, activation casts, the ``cutlass_call``.

The activation round trips of the production mode (model.md §12.2) run in ``jnp`` before the kernel, where XLA
fuses them into the producer of the activations; the kernels themselves take the (already cast) activations and
the weights in their stored formats.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from deepinfer_jax.numerics.activation import activation_cast

#: Activation-cast names of the ops -> (numerics cast kind, block).
ACTIVATION_CASTS: dict[str, tuple[str, int]] = {
    "none": ("none", 0),
    "mxfp8": ("mxfp8", 32),  # E4M3 per 32 channels, UE8M0 scale (V4/V4.1)
    "fp8_token_128": ("fp8_token_block", 128),  # E4M3 per token per 128 channels, float32 scale (V3)
}

#: Activation casts of the MXFP4 expert GEMMs (V4/V4.1 only).
GROUPED_ACTIVATION_CASTS: tuple[str, ...] = ("none", "mxfp8")

# The name deepinfer_jax.numerics.activation.CastPolicy uses for the V3 cast, accepted as a synonym.
_CAST_SYNONYMS = {"fp8_token_block": "fp8_token_128"}

#: Output dtypes the kernels can store.
OUT_DTYPES: tuple[jnp.dtype, ...] = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float16))


def cast_activations(
    x: jax.Array, kind: str, *, allowed: tuple[str, ...] = tuple(ACTIVATION_CASTS)
) -> jax.Array:
    """Apply the GEMM-input cast ``kind`` (one of ``allowed``) to ``x``."""
    if not isinstance(kind, str):
        raise TypeError(f"activation_cast must be a str, got {type(kind).__name__} {kind!r}")
    canonical = _CAST_SYNONYMS.get(kind, kind)
    if canonical not in allowed:
        raise ValueError(f"activation_cast = {kind!r} is not one of {allowed}")
    numerics_kind, block = ACTIVATION_CASTS[canonical]
    if numerics_kind == "none":
        return x
    return activation_cast(x, numerics_kind, block=block)


def check_out_dtype(out_dtype: Any) -> jnp.dtype:
    """``out_dtype`` as a numpy dtype, refused unless the kernels can store it."""
    try:
        dt = jnp.dtype(out_dtype)
    except TypeError as e:
        raise TypeError(f"out_dtype must be a dtype, got {out_dtype!r}") from e
    if dt not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {[str(d) for d in OUT_DTYPES]}, got {dt}")
    return dt


def check_limit(limit: Any) -> float | None:
    """A SwiGLU clamp limit: ``None`` or a finite real ``> 0``, returned as a float (a kernel constant)."""
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, numbers.Real):
        raise TypeError(f"limit must be a real number or None, got {type(limit).__name__} {limit!r}")
    value = float(limit)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"limit must be finite and > 0 (or None), got {limit!r}")
    return value


def swiglu_f32(gate: jax.Array, up: jax.Array, limit: float | None) -> jax.Array:
    """The clamped SwiGLU of model.md §5.4 in float32 (the kernels' epilogue, for the CPU paths)."""
    g = gate.astype(jnp.float32)
    v = up.astype(jnp.float32)
    if limit is not None:
        g = jnp.minimum(g, jnp.float32(limit))
        v = jnp.clip(v, -jnp.float32(limit), jnp.float32(limit))
    return g * jax.nn.sigmoid(g) * v


def cutlass_call(fn: Callable[..., None], **kwargs: Any) -> Callable[..., Any]:
    """``cutlass.jax.cutlass_call`` (imported here, on first use, so that only GPU lowering needs CuteDSL's JAX
    extension loaded)."""
    import cutlass.jax

    return cutlass.jax.cutlass_call(fn, **kwargs)


def tensor_core_ok(x: jax.Array, *, ue8m0: bool = True) -> bool:
    """Whether the tcgen05 kernels (:mod:`custom_calls.cutedsl.tc_gemm`) compute this product exactly: bf16
    activations and power-of-two weight scales (float32 activations and V3 ``scale_inv`` take the SIMT kernels)."""
    return jnp.dtype(x.dtype) == jnp.bfloat16 and ue8m0


def token_tile(num_tokens: int) -> int:
    """Tokens per tcgen05 CTA (the MMA's N): 16 for a decode step of at most 16 tokens, else 64."""
    return 16 if num_tokens <= 16 else 64


def work_slots(group_sizes: jax.Array, num_rows: int, tile: int) -> jax.Array:
    """The grouped tcgen05 kernels' work list: int32 ``[ceil(num_rows / tile) + E - 1, 4]``.

    Rows are sorted by expert (``group_sizes [E]`` rows each). Each slot is one (row tile, expert) pair that
    intersect: ``(expert, first row of the tile, first live row, end of the live rows)``; the live rows of all
    slots partition the grouped rows exactly once. Unused slots (the list has a static length) have no live row.
    """
    sizes = group_sizes.astype(jnp.int32)
    num_experts = sizes.shape[0]
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    tiles = -(-num_rows // tile)
    first = jnp.arange(tiles, dtype=jnp.int32)[:, None] * tile  # [tiles, 1]
    lo = jnp.maximum(first, starts[None, :])
    hi = jnp.minimum(first + tile, ends[None, :])
    hit = (lo < hi).reshape(-1)
    count = tiles + num_experts - 1
    (pick,) = jnp.nonzero(hit, size=count, fill_value=0)
    used = jnp.arange(count) < jnp.sum(hit)
    expert = (pick % num_experts).astype(jnp.int32)
    row0 = (pick // num_experts).astype(jnp.int32) * tile
    lo_s = jnp.where(used, lo.reshape(-1)[pick], 0)
    hi_s = jnp.where(used, hi.reshape(-1)[pick], 0)
    return jnp.stack([expert, row0, lo_s, hi_s], axis=1).astype(jnp.int32)
