"""Pieces shared by the attention kernels: tiles, dot products, the online (flash) softmax.

A program owns a tile of query heads of one token and walks that token's keys ``block_k`` at a time. The running
state per head is ``(peak, total, acc)``: the largest logit so far, ``Σ exp(logit - peak)`` and
``Σ exp(logit - peak) · value`` (the value may be split into column chunks, one accumulator each, so no tile wider
than ``chunk`` columns is ever held). Logits of masked keys are ``-inf`` and contribute nothing; a head that saw no
key keeps ``peak = -inf`` and ``total = 0``.

**Numerics.** With float32 queries every dot is an IEEE float32 dot (``HIGHEST``), like the references. With
bfloat16 queries (production) ``q · k`` runs on bf16 operands with float32 accumulation, which is exact per
product (decoded MXFP8/FP4/E4M3 keys are bf16 values), and ``p · v`` rounds the probabilities ``p`` to bf16 before
the tensor-core dot (relative error ``<= 2^-9`` per weight) -- the usual flash-attention trade, tested against the
reference at a tolerance that says so.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["AttnTiles", "OnlineSoftmax", "dot_kt", "dot_pv"]


@dataclasses.dataclass(frozen=True)
class AttnTiles:
    """``block_h`` query heads per program, ``block_k`` keys per step, value columns in chunks of ``chunk``;
    Triton's ``num_warps`` / ``num_stages``. Powers of two, ``block_h`` and ``block_k`` at least 16."""

    block_h: int = 16
    block_k: int = 32
    chunk: int = 128
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_h", "block_k", "chunk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"AttnTiles.{name} must be a power of two >= 16, got {v!r}")

    def compiler_params(self) -> Any:
        from jax.experimental.pallas import triton as pl_triton

        return pl_triton.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


def _precision(dtype: Any) -> Any:
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def dot_kt(q: jax.Array, k: jax.Array, compute_dtype: Any) -> jax.Array:
    """``q [H, d] · k [K, d]ᵀ -> [H, K]`` float32."""
    return lax.dot_general(
        q.astype(compute_dtype),
        k.astype(compute_dtype),
        (((1,), (1,)), ((), ())),
        precision=_precision(compute_dtype),
        preferred_element_type=jnp.float32,
    )


def dot_pv(p: jax.Array, v: jax.Array, compute_dtype: Any) -> jax.Array:
    """``p [H, K] · v [K, d] -> [H, d]`` float32."""
    return lax.dot_general(
        p.astype(compute_dtype),
        v.astype(compute_dtype),
        (((1,), (0,)), ((), ())),
        precision=_precision(compute_dtype),
        preferred_element_type=jnp.float32,
    )


class OnlineSoftmax:
    """The running softmax of one head tile: ``(peak [H], total [H], acc chunks [H, d_i])``, carried by kernels."""

    @staticmethod
    def init(heads: int, widths: tuple[int, ...]) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]:
        return (
            jnp.full((heads,), -jnp.inf, jnp.float32),
            jnp.zeros((heads,), jnp.float32),
            tuple(jnp.zeros((heads, w), jnp.float32) for w in widths),
        )

    @staticmethod
    def update(
        state: tuple[jax.Array, jax.Array, tuple[jax.Array, ...]],
        logits: jax.Array,
        values: tuple[jax.Array, ...],
        compute_dtype: Any,
        value_scales: tuple[jax.Array | None, ...] | None = None,
    ) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]:
        """Fold keys with ``logits [H, K]`` (``-inf`` = masked) and value chunks ``[K, d_i]`` into ``state``.

        ``value_scales[i] [K]`` multiplies each key's value chunk ``i`` (a per-key scale kept outside the tile).
        """
        peak, total, acc = state
        new_peak = jnp.maximum(peak, jnp.max(logits, axis=1))
        safe = jnp.where(new_peak == -jnp.inf, 0.0, new_peak)
        correction = jnp.exp(peak - safe)  # exp(-inf) = 0 where nothing was seen yet
        p = jnp.exp(logits - safe[:, None])
        total = total * correction + jnp.sum(p, axis=1)
        scales = value_scales or (None,) * len(values)
        acc = tuple(
            a * correction[:, None] + dot_pv(p if s is None else p * s[None, :], v, compute_dtype)
            for a, v, s in zip(acc, values, scales, strict=True)
        )
        return new_peak, total, acc

    @staticmethod
    def finish(
        state: tuple[jax.Array, jax.Array, tuple[jax.Array, ...]], sink: jax.Array | None = None
    ) -> tuple[jax.Array, ...]:
        """Normalised value chunks; ``sink [H]`` adds one value-less logit per head (DeepSeek-V4 sinks)."""
        peak, total, acc = state
        if sink is None:
            denom = jnp.where(total > 0, total, 1.0)
            return tuple(a / denom[:, None] for a in acc)
        top = jnp.maximum(peak, sink)
        w = jnp.exp(peak - top)  # 0 when no key was seen (peak = -inf)
        denom = total * w + jnp.exp(sink - top)
        return tuple(a * (w / denom)[:, None] for a in acc)
