"""SwiGLU feed-forward blocks: the (optionally clamped) activation and the dense / shared-expert MLP.

DeepSeek's dense FFN layers (V3's first ``first_k_dense_replace`` layers), its shared experts and each routed
expert are the same three-projection SwiGLU: ``down(act(gate(x)) · up(x))``. V4/V4.1 clamp the two branches
(model.md §5.4); V3 does not (``limit=None``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from deepinfer_jax.models.common.linear import LinearNumerics, LinearParams, linear

__all__ = ["swiglu", "swiglu_mlp"]


def swiglu(gate: jax.Array, up: jax.Array, *, limit: float | None = None) -> jax.Array:
    """``silu(min(gate, L)) · clamp(up, -L, L)`` in float32 (model.md §5.4); no clamps when ``limit`` is None.

    The clamp is one-sided on the gate branch (large negative gates already give ~0 through the sigmoid) and
    two-sided on the up branch. Returns float32: callers round once, where the reference rounds.
    """
    g = gate.astype(jnp.float32)
    u = up.astype(jnp.float32)
    if limit is not None:
        if not limit > 0:
            raise ValueError(f"swiglu: limit must be > 0 or None, got {limit!r}")
        lim = jnp.float32(limit)
        g = jnp.minimum(g, lim)
        u = jnp.clip(u, -lim, lim)
    return g * jax.nn.sigmoid(g) * u


def swiglu_mlp(
    x: jax.Array,
    p: Mapping[str, LinearParams],
    numerics: LinearNumerics,
    *,
    limit: float | None = None,
    out_dtype: Any = None,
) -> jax.Array:
    """A SwiGLU MLP with weights ``p = {"gate": ..., "up": ..., "down": ...}`` (linear weight dicts).

    The activation is rounded to ``x.dtype`` before the down projection (bf16 in production, where the
    reference feeds a bf16 tensor to that GEMM; a no-op in float32 parity mode).
    """
    missing = {"gate", "up", "down"} - set(p)
    if missing:
        raise ValueError(f"swiglu_mlp: weights lack {sorted(missing)}; got keys {sorted(p)}")
    g = linear(x, p["gate"], numerics)
    u = linear(x, p["up"], numerics)
    a = swiglu(g, u, limit=limit).astype(x.dtype)
    return linear(a, p["down"], numerics, out_dtype=out_dtype or x.dtype)
