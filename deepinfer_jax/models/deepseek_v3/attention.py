"""Multi-head latent attention (MLA) of DeepSeek-V3, in its naive and its absorbed form.

Per token, MLA projects the hidden state to

* queries: ``q = q_b(RMSNorm(q_a(x)))`` (or a plain ``q_proj(x)`` when ``q_lora_rank`` is null), split per head
  into ``q_nope`` (``qk_nope_head_dim``) and ``q_pe`` (``qk_rope_head_dim``, rotated);
* one shared latent ``c = RMSNorm(kv_a(x)[:C])`` (``C = kv_lora_rank``) and one shared rotated key
  ``k_pe = rope(kv_a(x)[C:])``.

**Naive form** (:func:`mla_naive`, the full forward without cache): ``kv_b_proj`` expands the latent into per-head
``k_nope`` and ``v``; every head attends over ``[k_nope ; k_pe]`` with softmax scale
``qk_head_dim^-1/2 · mscale²`` (the YaRN correction). This is transformers' computation.

**Absorbed form** (:func:`mla_absorbed`, the cached path): ``q_nope · k_nopeᵀ = (q_nope · W_UK) · cᵀ`` and
``p · v = (p · c) · W_UVᵀ``, so the cache holds only ``c`` and ``k_pe`` -- ``kv_lora_rank + qk_rope_head_dim``
values per token -- and attention is multi-query over ``C + R``-wide keys with ``C``-wide values. The up
projections ``W_UK``/``W_UV`` are folded from ``kv_b_proj`` at load. Its core (scores, mask, softmax, weighted
latent sum) is the registered op ``"mla_attention"``, so a paged or kernel implementation can replace it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from deepinfer_jax.models.common.linear import LinearNumerics, linear
from deepinfer_jax.ops.registry import register_op, select

__all__ = ["mla_absorbed", "mla_attention", "mla_naive", "mla_project"]

_HIGHEST = lax.Precision.HIGHEST


def _einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """Einsum with float32 accumulation.

    Narrow float operands are widened to float32 first: exact (every bf16 value is a float32 value), the same
    products and float32 sums as a bf16 GEMM with float32 accumulation, and XLA:CPU cannot execute some
    bf16 x bf16 -> f32 batched dots at all ("Unsupported element type for DotThunk").
    """
    common = jnp.promote_types(jnp.promote_types(a.dtype, b.dtype), jnp.float32)
    return jnp.einsum(
        spec, a.astype(common), b.astype(common), precision=_HIGHEST, preferred_element_type=jnp.float32
    )


def mla_project(
    x: jax.Array,
    p: dict[str, Any],
    cos: jax.Array,
    sin: jax.Array,
    *,
    num_heads: int,
    nope_dim: int,
    rope_dim: int,
    kv_rank: int,
    eps: float,
    numerics: LinearNumerics,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Queries and the latent key/value of ``x [B, T, H]``: ``(q_nope, q_pe, c, k_pe)``.

    Shapes: ``q_nope [B, T, Nh, nope]``, ``q_pe [B, T, Nh, R]`` (rotated), ``c [B, T, C]`` (normalised latent),
    ``k_pe [B, T, R]`` (rotated); all in ``x.dtype``. ``cos``/``sin`` are ``[B, T, R/2]`` tables.
    """
    rms_norm = select("rms_norm")
    rope = select("rope")
    if "q_proj" in p:
        q = linear(x, p["q_proj"], numerics)
    else:
        q = linear(
            rms_norm(linear(x, p["q_a_proj"], numerics), p["q_a_norm"], eps=eps), p["q_b_proj"], numerics
        )
    q = q.reshape(*x.shape[:-1], num_heads, nope_dim + rope_dim)
    q_nope = q[..., :nope_dim]
    q_pe = rope(q[..., nope_dim:], cos, sin, rope_dim=rope_dim)
    kv = linear(x, p["kv_a_proj"], numerics)
    c = rms_norm(kv[..., :kv_rank], p["kv_a_norm"], eps=eps)
    k_pe = rope(kv[..., kv_rank:], cos, sin, rope_dim=rope_dim)
    return q_nope, q_pe, c, k_pe


def _softmax(scores: jax.Array, mask: jax.Array) -> jax.Array:
    """Float32 softmax over the last axis with masked entries excluded (a fully masked row gives zeros)."""
    scores = jnp.where(mask, scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    e = jnp.where(mask, jnp.exp(scores - peak), 0.0)
    total = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(total > 0, total, 1.0)


def mla_naive(
    q_nope: jax.Array,
    q_pe: jax.Array,
    c: jax.Array,
    k_pe: jax.Array,
    kv_b: dict[str, jax.Array],
    *,
    v_dim: int,
    scale: float,
    numerics: LinearNumerics,
) -> jax.Array:
    """Causal MLA over one whole sequence per batch row, expanding keys/values with ``kv_b_proj``.

    Returns the per-head outputs ``[B, T, Nh * v_dim]`` in ``q_nope.dtype`` (ready for ``o_proj``).
    """
    b, t, heads, nope = q_nope.shape
    kv = linear(c, kv_b, numerics).reshape(b, t, heads, nope + v_dim)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    scores = _einsum("bthd,bshd->bhts", q_nope, k_nope) + _einsum("bthr,bsr->bhts", q_pe, k_pe)
    causal = jnp.tril(jnp.ones((t, t), bool))
    probs = _softmax(scores * jnp.float32(scale), causal[None, None])
    out = _einsum("bhts,bshd->bthd", probs.astype(v.dtype), v)
    return out.reshape(b, t, heads * v_dim).astype(q_nope.dtype)


def mla_attention(
    q_lat: jax.Array,
    q_pe: jax.Array,
    kv_cache: jax.Array,
    q_positions: jax.Array,
    *,
    scale: float,
) -> jax.Array:
    """Absorbed MLA core over a contiguous per-sequence cache (reference of op ``"mla_attention"``).

    Args:
      q_lat: ``[B, T, Nh, C]`` queries already multiplied into the latent space (``q_nope · W_UK``).
      q_pe: ``[B, T, Nh, R]`` rotated RoPE queries.
      kv_cache: ``[B, S, C + R]``: slot ``s`` holds the latent and rotated key of the token at position ``s``.
      q_positions: ``int [B, T]`` positions of the queries; slot ``s`` is visible to a query at ``p`` iff
        ``s <= p`` (causal, and slots never written yet lie beyond every query).
      scale: softmax scale (``qk_head_dim^-1/2 · mscale²``).

    Returns:
      ``[B, T, Nh, C]`` float32: the probability-weighted latent, to be multiplied by ``W_UVᵀ``.
    """
    kv_rank = q_lat.shape[-1]
    c, k_pe = kv_cache[..., :kv_rank], kv_cache[..., kv_rank:]
    scores = _einsum("bthc,bsc->bhts", q_lat, c) + _einsum("bthr,bsr->bhts", q_pe, k_pe)
    slots = jnp.arange(kv_cache.shape[1], dtype=jnp.int32)
    mask = slots[None, None, None, :] <= q_positions.astype(jnp.int32)[:, None, :, None]
    probs = _softmax(scores * jnp.float32(scale), mask)
    return _einsum("bhts,bsc->bthc", probs.astype(kv_cache.dtype), c)


register_op(
    "mla_attention",
    mla_attention,
    doc="absorbed MLA (MQA over latent + rope keys) on a contiguous per-sequence cache (model.md §16)",
)


def mla_absorbed(
    q_nope: jax.Array,
    q_pe: jax.Array,
    kv_cache: jax.Array,
    q_positions: jax.Array,
    w_uk: jax.Array,
    w_uv: jax.Array,
    *,
    scale: float,
) -> jax.Array:
    """MLA with the up projections absorbed: ``[B, T, Nh * v_dim]`` outputs in ``q_nope.dtype``.

    ``w_uk [Nh, nope, C]`` and ``w_uv [Nh, v, C]`` are the per-head blocks of ``kv_b_proj``.
    """
    b, t, heads, _ = q_nope.shape
    q_lat = _einsum("bthd,hdc->bthc", q_nope, w_uk).astype(q_nope.dtype)
    o_lat = select("mla_attention")(q_lat, q_pe, kv_cache, q_positions, scale=scale)
    out = _einsum("bthc,hvc->bthv", o_lat.astype(q_nope.dtype), w_uv)
    return out.reshape(b, t, heads * w_uv.shape[1]).astype(q_nope.dtype)
