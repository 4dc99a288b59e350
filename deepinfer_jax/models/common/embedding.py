"""Token embedding lookup and the LM head.

Both are plain: the embedding is a row gather with no scaling (model.md §4), the head a float32-accumulated
GEMM whose logits stay float32 (§5.2: "LM-head logits" are one of the f32 outputs), so sampling never sees
bf16-rounded logits even in production mode.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["embed_tokens", "lm_head"]


def embed_tokens(table: jax.Array, ids: jax.Array, *, dtype: Any = None) -> jax.Array:
    """Rows ``table[ids]`` -> ``[..., H]`` in ``dtype`` (default: the table's).

    Ids must be integers; out-of-range ids are the caller's to refuse before tracing (inside a jitted step a
    gather clamps them, which would silently read the last row).
    """
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"embed_tokens: ids must be integers, got dtype {ids.dtype}")
    if table.ndim != 2:
        raise ValueError(f"embed_tokens: table must be [vocab, hidden], got shape {table.shape}")
    return jnp.take(table, ids, axis=0).astype(dtype or table.dtype)


def lm_head(h: jax.Array, weight: jax.Array) -> jax.Array:
    """Logits ``h · Wᵀ`` for ``weight [V, H]`` -> float32 ``[..., V]`` (float32 accumulation and output)."""
    if weight.ndim != 2 or weight.shape[1] != h.shape[-1]:
        raise ValueError(f"lm_head: weight {weight.shape} does not take hidden states of width {h.shape[-1]}")
    common = jnp.promote_types(h.dtype, weight.dtype)
    return lax.dot_general(
        h.astype(common),
        weight.astype(common),
        (((h.ndim - 1,), (1,)), ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
