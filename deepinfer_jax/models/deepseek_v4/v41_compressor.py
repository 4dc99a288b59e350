"""DeepSeek-V4.1 compressed keys (ratio 1 and 2) and the sparse indexer, over whole sequences (spec §7.3, §7.4).

V4.1 replaces V4's CSA/HCA compressors by two simpler ones, and its indexer reads keys derived from the
compressed KV itself:

* **C1** (ratio 1): one compressed key per token, ``c_t = u_t · wkv_cᵀ``.
* **C2** (ratio 2): one key per pair of tokens ``2j, 2j+1``: ``c_j = Σ_t softmax_t(g_t) ⊙ a_t`` with
  ``a_t = u_t · wkv_cᵀ`` and ``g_t = u_t · wgateᵀ`` (float32), per channel, no position bias, no overlap -- the
  gated pooling of V4's compressor (op ``v4_compressor_pool``) over windows of two slots, reused here.
* Both: ``P_j = RMSNorm(c_j; compressor.norm)`` (the *pre-RoPE* compressed KV, which feeds the indexer keys),
  ``k_j = P_j`` rotated at ``j · r`` on its last ``Dr`` dims, read back through the compressed-cache format
  (FP4 or MXFP8 in production mode, §12.4 item 3).
* **Indexer keys** ``ki_j = RMSNorm(P_j · wkᵀ; k_norm)`` rotated at ``j · r`` and MXFP4 round-tripped; **queries**
  ``qi = q_n · indexer.wq_bᵀ`` per head, rotated at ``p``, MXFP4 round-tripped; **head weights**
  ``wI = x̂ · weights_projᵀ``. Scores ``I(p, j) = Σ_h wI[h] · ReLU(q̃i[h] · k̃i_j)`` are V4's op
  ``v4_indexer_scores``; selection is V4's top-k over visible keys (``j < ⌊(p+1)/r⌋``).

* **Candidate blocks** (§7.6): the candidate source groups its compressed keys into blocks of ``bs`` and keeps,
  per query, the ``Bc`` blocks with the best maximum score (the newest block always); candidate consumers score
  only keys inside those blocks.

The whole-prefix functions (positions ``0 .. S-1`` of each sequence) are the reference; the incremental path
(:func:`init_compressor_state`, :func:`compress_step`, :func:`read_keys`) feeds chunks through V4's chunked
compressor and reproduces them. The round trips are named by
:class:`~deepinfer_jax.numerics.activation.CastPolicy` kinds (``"none"`` in float32 parity mode), so prefill
and decode read identical key values.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from deepinfer_jax.models.common.linear import LinearNumerics, LinearParams, linear
from deepinfer_jax.models.deepseek_v4.compressor import (
    CompressorState,
    compress_chunk,
    indexer_select,
    init_compressor_state,
    visible_entries,
)
from deepinfer_jax.numerics.activation import kv_cast
from deepinfer_jax.ops import apply_rope, rms_norm, rope_cos_sin
from deepinfer_jax.ops import get as get_op

__all__ = [
    "CompressedKV",
    "CompressorState",
    "candidate_blocks",
    "compress_kv",
    "compress_step",
    "indexer_keys",
    "indexer_query",
    "indexer_topk",
    "init_compressor_state",
    "read_keys",
    "restrict_to_candidates",
]

_BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)


class CompressedKV(NamedTuple):
    """Compressed keys of a prefix: ``pre_rope`` (``P``, feeds the indexer keys) and ``keys`` (``k̃``, attended)."""

    pre_rope: jax.Array
    keys: jax.Array


def _check_ratio(ratio: int) -> int:
    if isinstance(ratio, bool) or ratio not in (1, 2):
        raise ValueError(f"ratio (compress_ratios entry) = {ratio!r}: a V4.1 compressor has ratio 1 or 2")
    return ratio


def _rotate_blocks(x: jax.Array, ratio: int, freqs: jax.Array, rope_dim: int) -> jax.Array:
    """RoPE of entry ``j`` at position ``j · ratio`` (its block's first token), on the last ``rope_dim`` dims."""
    cos, sin = rope_cos_sin(jnp.arange(x.shape[-2], dtype=jnp.int32) * ratio, freqs)
    table = (*x.shape[:-1], cos.shape[-1])
    return apply_rope(x, jnp.broadcast_to(cos, table), jnp.broadcast_to(sin, table), rope_dim=rope_dim)


def compress_kv(
    u: jax.Array,
    wkv: jax.Array,
    wgate: jax.Array | None,
    norm_weight: jax.Array,
    *,
    ratio: int,
    eps: float,
    rope_freqs: jax.Array,
    rope_dim: int,
    cache_cast: str = "none",
) -> CompressedKV:
    """Compressed KV of the complete blocks of ``u [B, S, H]`` (the compressor input, §7.3/§7.9).

    Args:
        wkv, wgate: ``compressor.wkv`` / ``compressor.wgate`` ``[D, H]`` (``wgate`` only for ratio 2).
        norm_weight: ``compressor.norm`` ``[D]``.
        ratio: 1 or 2; ``S // ratio`` entries come out (an incomplete last block has no key yet).
        rope_freqs, rope_dim: the layer's (compress) RoPE frequencies and ``Dr``.
        cache_cast: the compressed-cache read-back round trip (``"fp4_e4m3"``, ``"mxfp8"`` or ``"none"``).

    Returns ``CompressedKV(pre_rope [B, N, D], keys [B, N, D])`` in ``u``'s dtype.
    """
    ratio = _check_ratio(ratio)
    if (wgate is None) != (ratio == 1):
        raise ValueError(f"compress_kv: ratio {ratio} {'takes no' if ratio == 1 else 'needs a'} wgate")
    batch, seq, _ = u.shape
    n = seq // ratio
    dense = LinearNumerics()
    if ratio == 1:
        c = linear(u, {"weight": wkv}, dense)
    else:
        # §5.2: the C2 projections stay float32; the pooled vector is rounded to u's dtype before the norm.
        a = linear(u[:, : 2 * n], {"weight": wkv}, dense, out_dtype=jnp.float32)
        g = linear(u[:, : 2 * n], {"weight": wgate}, dense, out_dtype=jnp.float32)
        pairs = (batch, n, 2, a.shape[-1])
        c = get_op("v4_compressor_pool")(a.reshape(pairs), g.reshape(pairs)).astype(u.dtype)
    pre_rope = rms_norm(c, norm_weight, eps=eps, out_dtype=u.dtype)
    keys = kv_cast(_rotate_blocks(pre_rope, ratio, rope_freqs, rope_dim), cache_cast).astype(u.dtype)
    return CompressedKV(pre_rope=pre_rope, keys=keys)


def indexer_keys(
    pre_rope: jax.Array,
    wk: jax.Array,
    k_norm: jax.Array,
    *,
    ratio: int,
    eps: float,
    rope_freqs: jax.Array,
    rope_dim: int,
    cast: str = "none",
) -> jax.Array:
    """Indexer keys ``k̃i [B, N, Di]`` from the pre-RoPE compressed KV ``P [B, N, D]`` (§7.4).

    ``wk [Di, D]`` and ``k_norm [Di]`` belong to the index-K source; ``cast`` is the indexer-cache round trip
    (``"mxfp4"`` in production mode).
    """
    ratio = _check_ratio(ratio)
    ki = rms_norm(
        linear(pre_rope, {"weight": wk}, LinearNumerics()), k_norm, eps=eps, out_dtype=pre_rope.dtype
    )
    return kv_cast(_rotate_blocks(ki, ratio, rope_freqs, rope_dim), cast).astype(pre_rope.dtype)


def indexer_query(
    q_latent: jax.Array,
    x_hat: jax.Array,
    wq_b: LinearParams,
    weights_proj: jax.Array,
    positions: jax.Array,
    *,
    n_heads: int,
    rope_freqs: jax.Array,
    rope_dim: int,
    numerics: LinearNumerics,
    ratio: int,
    cast: str = "none",
) -> tuple[jax.Array, jax.Array]:
    """Indexer queries ``q̃i [B, S, Hi, Di]`` and head weights ``wI [B, S, Hi]`` of an index source (§7.4).

    ``q_latent`` is the normalised query latent ``q_n`` of §7.1 (shared with the attention query), ``x_hat``
    the layer's attention-norm output; ``wq_b`` is the ``indexer.wq_b`` linear (FP8 in a checkpoint),
    ``weights_proj [Hi, H]`` dense. C2 layers keep ``wI``'s projection in float32 before rounding (§5.2).
    """
    ratio = _check_ratio(ratio)
    q = linear(q_latent, wq_b, numerics)
    q = q.reshape(*q.shape[:-1], n_heads, q.shape[-1] // n_heads)
    cos, sin = rope_cos_sin(positions, rope_freqs)
    q = kv_cast(apply_rope(q, cos, sin, rope_dim=rope_dim), cast).astype(q_latent.dtype)
    w_dtype = jnp.float32 if ratio == 2 else x_hat.dtype
    w = linear(x_hat, {"weight": weights_proj}, LinearNumerics(), out_dtype=w_dtype).astype(x_hat.dtype)
    return q, w


def indexer_topk(
    q: jax.Array,
    keys: jax.Array,
    weights: jax.Array,
    positions: jax.Array,
    *,
    ratio: int,
    top_k: int,
    score_dtype: jnp.dtype = jnp.float32,
    candidates: jax.Array | None = None,
    candidate_block_size: int | None = None,
) -> jax.Array:
    """``Sel(p)`` as a mask ``[B, S, N]``: the ``top_k`` best visible keys by ``I(p, j)`` (all when fewer).

    Scores accumulate in float32 and are materialised in ``score_dtype`` (bfloat16 in production mode, §7.4);
    only visible keys (``j < ⌊(p+1)/r⌋``) compete. A candidate consumer passes the source's block mask
    ``candidates [B, S, NB]`` and ``candidate_block_size``: then only keys inside those blocks compete (§7.6).
    """
    ratio = _check_ratio(ratio)
    scores = get_op("v4_indexer_scores")(q, keys, weights).astype(score_dtype)
    visible = visible_entries(positions, ratio, keys.shape[-2])
    if candidates is not None:
        if candidate_block_size is None:
            raise ValueError("indexer_topk: candidates given without candidate_block_size")
        visible = visible & restrict_to_candidates(candidates, candidate_block_size, keys.shape[-2])
    return indexer_select(scores, visible, top_k)


def indexer_scores(q: jax.Array, keys: jax.Array, weights: jax.Array, *, score_dtype: jnp.dtype) -> jax.Array:
    """``I(p, j)`` of every query against every key (the candidate source needs them, not only the top-k)."""
    return get_op("v4_indexer_scores")(q, keys, weights).astype(score_dtype)


# ------------------------------------------------------------------------------------ candidate blocks


def candidate_blocks(
    scores: jax.Array,
    positions: jax.Array,
    *,
    ratio: int,
    block_size: int,
    topk_blocks: int,
) -> jax.Array:
    """``Cand(p)`` of the candidate source as a mask ``[B, S, NB]`` over blocks of ``block_size`` keys (§7.6).

    A block's score is the maximum ``I(p, j)`` over its visible keys (capped at the bfloat16 maximum, so that
    only the forced block is infinite); the newest block ``⌈visible(p)/bs⌉ − 1`` is always kept (score +∞);
    the ``topk_blocks`` best blocks among those with a visible key are kept, all of them when fewer.
    """
    ratio = _check_ratio(ratio)
    for name, value in (("block_size", block_size), ("topk_blocks", topk_blocks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"candidate_blocks: {name} must be an int >= 1, got {value!r}")
    n = scores.shape[-1]
    n_blocks = -(-n // block_size)
    visible = visible_entries(positions, ratio, n)
    masked = jnp.where(visible, scores.astype(jnp.float32), -jnp.inf)
    masked = jnp.pad(
        masked, [(0, 0)] * (masked.ndim - 1) + [(0, n_blocks * block_size - n)], constant_values=-jnp.inf
    )
    block_max = jnp.minimum(
        jnp.max(masked.reshape(*masked.shape[:-1], n_blocks, block_size), axis=-1), _BF16_MAX
    )
    count = (jnp.asarray(positions, jnp.int32) + 1) // ratio
    newest = (count + block_size - 1) // block_size - 1
    index = jnp.arange(n_blocks, dtype=jnp.int32)
    eligible = index <= newest[..., None]
    block_score = jnp.where(index == newest[..., None], jnp.inf, block_max)
    if topk_blocks >= n_blocks:
        return eligible
    values, idx = lax.top_k(jnp.where(eligible, block_score, -jnp.inf), topk_blocks)
    picked = jax.nn.one_hot(idx, n_blocks, dtype=jnp.bool_) & (values > -jnp.inf)[..., None]
    return jnp.any(picked, axis=-2) & eligible


def restrict_to_candidates(candidates: jax.Array, block_size: int, num_keys: int) -> jax.Array:
    """Expand a block mask ``[..., NB]`` to a key mask ``[..., num_keys]`` (key ``j`` is in block ``j // bs``)."""
    return jnp.repeat(candidates, block_size, axis=-1)[..., :num_keys]


# ------------------------------------------------------------------------------------ incremental state


def _identity_freqs(rope_dim: int) -> jax.Array:
    return jnp.zeros((rope_dim // 2,), jnp.float32)


def compress_step(
    state: CompressorState,
    u: jax.Array,
    start: jax.Array,
    wkv: jax.Array,
    wgate: jax.Array | None,
    norm_weight: jax.Array,
    *,
    ratio: int,
    eps: float,
    rope_dim: int,
) -> CompressorState:
    """Feed ``S`` new compressor inputs ``u [B, S, H]`` at positions ``start .. start+S-1`` (shared by the batch).

    V4's chunked compressor does the bookkeeping (tail of the incomplete block, writing completed entries);
    V4.1 blocks are non-overlapping, have no position bias, and pool one slot (ratio 1: weight exactly 1) or two.
    The state's ``entries`` hold the **pre-RoPE** ``P_j`` (V4's compressor rotates at write time, so it runs here
    with all-zero frequencies, an exact identity rotation): the indexer keys need ``P``; :func:`read_keys`
    rotates and casts them for attention. ``state`` comes from :func:`init_compressor_state` with
    ``overlap=False``, width ``D`` and ratio ``ratio``.
    """
    ratio = _check_ratio(ratio)
    if (wgate is None) != (ratio == 1):
        raise ValueError(f"compress_step: ratio {ratio} {'takes no' if ratio == 1 else 'needs a'} wgate")
    dense = LinearNumerics()
    a = linear(u, {"weight": wkv}, dense, out_dtype=jnp.float32 if ratio == 2 else u.dtype)
    if ratio == 1:
        g = jnp.zeros(a.shape, jnp.float32)
    else:
        g = linear(u, {"weight": wgate}, dense, out_dtype=jnp.float32)
    return compress_chunk(
        state,
        a.astype(state.tail_kv.dtype),
        g,
        start,
        ape=jnp.zeros((ratio, a.shape[-1]), jnp.float32),
        norm_weight=norm_weight,
        norm_eps=eps,
        rope_freqs=_identity_freqs(rope_dim),
        rope_dim=rope_dim,
    )


def read_keys(
    state: CompressorState, *, ratio: int, rope_freqs: jax.Array, rope_dim: int, cache_cast: str = "none"
) -> jax.Array:
    """The attended keys ``k̃ [B, capacity, D]`` of a state: ``P_j`` rotated at ``j · r``, then cache-cast.

    Entries not written yet are zero and stay zero; visibility (:func:`visible_entries`) keeps them out.
    """
    ratio = _check_ratio(ratio)
    return kv_cast(_rotate_blocks(state.entries, ratio, rope_freqs, rope_dim), cache_cast).astype(
        state.entries.dtype
    )
