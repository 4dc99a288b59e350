"""DeepSeek-V4.1 attention over a whole prefix, with cross-layer sharing and YOCO (spec §7.1-§7.11).

One call per backbone layer, in layer order, for the normalised inputs ``x̂ [B, S, H]`` of positions
``0 .. S-1``; the values a source layer produces for later consumers travel in a :class:`CrossLayer` tuple that
the caller threads through the loop (the plan says statically who produces and who reads what):

* queries ``q_n = RMSNorm(x̂·wq_aᵀ; q_norm)``, ``q = q_n·wq_bᵀ`` per head, RoPE on the last ``Dr`` dims -- no
  per-head query norm in V4.1 (V4's query path has one, so :func:`.attention.attention_layer` is not reused);
* window keys ``s̃ = cast(RoPE(RMSNorm(x̂·wkvᵀ; kv_norm)))`` for the last ``W`` positions (every layer owns its
  window; it is never shared);
* compressed layers add the compressed keys of their KV source (:mod:`.v41_compressor`; a KV source after
  ``n_prefill_layer`` compresses the YOCO shared hidden), restricted to ``Sel(p)`` from their index source, which
  a candidate consumer picks among the candidate source's blocks;
* V4's sink attention op (``v4_sink_attention``), de-rotation of the output's RoPE slice at the query position
  and V4's grouped output projection.

This is the reference the cached, incremental path must reproduce; it keeps every key of the prefix in memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config.v41 import DeepseekV41Config
from deepinfer_jax.models.common import taps
from deepinfer_jax.models.common.linear import LinearNumerics, linear
from deepinfer_jax.models.deepseek_v4.attention import grouped_output_projection
from deepinfer_jax.models.deepseek_v4.compressor import indexer_select, visible_entries
from deepinfer_jax.models.deepseek_v4.plan_v41 import V41LayerPlan
from deepinfer_jax.models.deepseek_v4.v41_compressor import (
    candidate_blocks,
    compress_kv,
    indexer_keys,
    indexer_query,
    indexer_scores,
    restrict_to_candidates,
)
from deepinfer_jax.numerics.activation import CastPolicy, kv_cast
from deepinfer_jax.ops import RopeParams, apply_rope, rms_norm, rope_cos_sin
from deepinfer_jax.ops import get as get_op

__all__ = ["CrossLayer", "V41AttentionSpec", "attention_prefix"]


@dataclasses.dataclass(frozen=True)
class V41AttentionSpec:
    """Static facts of one backbone layer's attention (hashable; a ``jax.jit`` static argument).

    ``casts`` is the precision mode's :class:`CastPolicy` (window, compressed-cache and indexer round trips);
    ``score_dtype`` the dtype indexer scores are materialised in (bfloat16 in production mode).
    """

    heads: int
    head_dim: int
    rope_dim: int
    window: int
    o_groups: int
    o_rank: int
    eps: float
    rope_freqs: tuple[float, ...]
    ratio: int
    index_heads: int
    index_topk: int
    candidate_topk_blocks: int | None
    candidate_block_size: int | None
    casts: CastPolicy = dataclasses.field(default_factory=CastPolicy)
    score_dtype: str = "float32"

    @classmethod
    def from_config(
        cls, cfg: DeepseekV41Config, layer: int, casts: CastPolicy | None = None
    ) -> V41AttentionSpec:
        compressed = cfg.compress_ratios[layer] > 0
        freqs = RopeParams.from_config(cfg.layer_rope(layer)).frequencies(cfg.qk_rope_head_dim)
        casts = casts or CastPolicy()
        return cls(
            heads=cfg.num_attention_heads,
            head_dim=cfg.head_dim,
            rope_dim=cfg.qk_rope_head_dim,
            window=cfg.sliding_window,
            o_groups=cfg.o_groups,
            o_rank=cfg.o_lora_rank,
            eps=cfg.rms_norm_eps,
            rope_freqs=tuple(float(f) for f in np.asarray(freqs)),
            ratio=cfg.compress_ratios[layer],
            index_heads=(cfg.index_n_heads or 0) if compressed else 0,
            index_topk=(cfg.index_topk or 0) if compressed else 0,
            candidate_topk_blocks=cfg.candidate_topk_blocks,
            candidate_block_size=cfg.candidate_block_size,
            casts=casts,
            score_dtype="float32" if casts.indexer == "none" else "bfloat16",
        )

    def freqs(self) -> jax.Array:
        return jnp.asarray(np.asarray(self.rope_freqs, np.float32))


class CrossLayer(NamedTuple):
    """Values written by a source layer and read by later layers within one forward (§7.11).

    Each slot holds the value of the nearest preceding producer, which is exactly what a consumer needs because
    sharing segments are contiguous (the plan checks it). ``None`` until produced.

    Attributes:
        shared_hidden: ``ĥ [B, S, H]``, the attention-norm output of ``n_prefill_layer``.
        pre_rope, keys: ``P`` and ``k̃`` ``[B, N, D]`` of the current KV segment.
        index_keys: ``k̃i [B, N, Di]`` of the current index-K segment.
        selection: ``Sel`` as a mask ``[B, S, N]`` from the current index source.
        candidates: ``Cand`` as a block mask ``[B, S, NB]`` from the candidate source.
    """

    shared_hidden: jax.Array | None = None
    pre_rope: jax.Array | None = None
    keys: jax.Array | None = None
    index_keys: jax.Array | None = None
    selection: jax.Array | None = None
    candidates: jax.Array | None = None


def _require(value: jax.Array | None, what: str, layer: V41LayerPlan, source: int) -> jax.Array:
    if value is None:
        raise ValueError(
            f"attention_prefix: layer {layer.layer} reads the {what} of layer {source}, which has not produced it; "
            "run the layers in order with the CrossLayer returned by the previous one"
        )
    return value


def _compressed_part(
    p: Mapping[str, Any],
    x_hat: jax.Array,
    q_latent: jax.Array,
    positions: jax.Array,
    layer: V41LayerPlan,
    spec: V41AttentionSpec,
    cross: CrossLayer,
    numerics: LinearNumerics,
) -> tuple[jax.Array, jax.Array, CrossLayer]:
    """Compressed keys of the layer and which of them each query attends to (§7.3-§7.6, §7.11)."""
    freqs, ratio = spec.freqs(), spec.ratio
    if layer.is_kv_source:
        u = x_hat
        if layer.compressor_input == "shared":
            u = _require(cross.shared_hidden, "shared hidden", layer, layer.layer)
        cp = p["compressor"]
        ckv = compress_kv(
            u,
            cp["wkv"],
            cp.get("wgate"),
            cp["norm"],
            ratio=ratio,
            eps=spec.eps,
            rope_freqs=freqs,
            rope_dim=spec.rope_dim,
            cache_cast=spec.casts.compressed_keys,
        )
        cross = cross._replace(pre_rope=ckv.pre_rope, keys=ckv.keys)
    keys = _require(cross.keys, "compressed keys", layer, layer.kv_source)
    visible = visible_entries(positions, ratio, keys.shape[1])
    visible = jnp.broadcast_to(visible, (x_hat.shape[0], *visible.shape[-2:]))
    if not layer.uses_indexer:
        return keys, visible, cross
    if layer.is_index_k_source:
        ip = p["indexer"]
        ki = indexer_keys(
            _require(cross.pre_rope, "pre-RoPE compressed KV", layer, layer.kv_source),
            ip["wk"],
            ip["k_norm"],
            ratio=ratio,
            eps=spec.eps,
            rope_freqs=freqs,
            rope_dim=spec.rope_dim,
            cast=spec.casts.indexer,
        )
        cross = cross._replace(index_keys=ki)
    if layer.is_index_source:
        ip = p["indexer"]
        qi, wi = indexer_query(
            q_latent,
            x_hat,
            ip["wq_b"],
            ip["weights_proj"],
            positions,
            n_heads=spec.index_heads,
            rope_freqs=freqs,
            rope_dim=spec.rope_dim,
            numerics=numerics,
            ratio=ratio,
            cast=spec.casts.indexer,
        )
        ki = _require(cross.index_keys, "indexer keys", layer, layer.index_k_source)
        scores = indexer_scores(qi, ki, wi, score_dtype=jnp.dtype(spec.score_dtype))
        allowed = visible
        if layer.is_candidate_consumer:
            cand = _require(cross.candidates, "candidate blocks", layer, layer.candidate_source or 0)
            assert spec.candidate_block_size is not None
            allowed = allowed & restrict_to_candidates(cand, spec.candidate_block_size, keys.shape[1])
        cross = cross._replace(selection=indexer_select(scores, allowed, spec.index_topk))
        if layer.is_candidate_source:
            assert spec.candidate_block_size is not None and spec.candidate_topk_blocks is not None
            cand = candidate_blocks(
                scores,
                positions,
                ratio=ratio,
                block_size=spec.candidate_block_size,
                topk_blocks=spec.candidate_topk_blocks,
            )
            cross = cross._replace(candidates=cand)
    selection = _require(cross.selection, "top-k selection", layer, layer.index_source)
    return keys, selection, cross


def attention_prefix(
    p: Mapping[str, Any],
    x_hat: jax.Array,
    layer: V41LayerPlan,
    spec: V41AttentionSpec,
    cross: CrossLayer,
    numerics: LinearNumerics,
) -> tuple[jax.Array, CrossLayer]:
    """One layer's attention over positions ``0 .. S-1``: ``x̂ [B, S, H]`` -> ``(y [B, S, H], cross)``.

    ``p`` holds ``wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, sinks`` (linear weights as dicts, norms and sinks
    as arrays) plus, by role, ``compressor`` (``wkv``, ``wgate`` for ratio 2, ``norm``) and ``indexer``
    (``wq_b`` as a linear dict, ``weights_proj``; ``wk``, ``k_norm`` on index-K sources).
    """
    b, s, _ = x_hat.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    if layer.captures_shared_hidden:
        cross = cross._replace(shared_hidden=x_hat)
    cos, sin = rope_cos_sin(positions, spec.freqs())

    q_latent = rms_norm(linear(x_hat, p["wq_a"], numerics), p["q_norm"], eps=spec.eps)
    q = linear(q_latent, p["wq_b"], numerics).reshape(b, s, spec.heads, spec.head_dim)
    q = apply_rope(q, cos, sin, rope_dim=spec.rope_dim)
    window = rms_norm(linear(x_hat, p["wkv"], numerics), p["kv_norm"], eps=spec.eps)
    window = kv_cast(apply_rope(window, cos, sin, rope_dim=spec.rope_dim), spec.casts.window_keys)
    window = window.astype(x_hat.dtype)
    t = jnp.arange(s, dtype=jnp.int32)
    in_window = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - spec.window)
    keys, mask = window, jnp.broadcast_to(in_window, (b, s, s))
    if layer.is_compressed:
        ckeys, selected, cross = _compressed_part(p, x_hat, q_latent, positions, layer, spec, cross, numerics)
        keys = jnp.concatenate([keys, ckeys.astype(keys.dtype)], axis=1)
        mask = jnp.concatenate([mask, selected], axis=2)
        # For training objectives (the indexer's distillation target) and inspection (the attention pattern:
        # window keys then compressed keys, the mask over them, the sinks); a no-op outside taps.collect().
        taps.record(
            "v41_attention",
            layer=layer.layer,
            x_hat=x_hat,
            q_latent=q_latent,
            queries=q,
            compressed_keys=ckeys,
            pre_rope=cross.pre_rope,
            keys=keys,
            mask=mask,
            sinks=p["sinks"],
            scale=spec.head_dim**-0.5,
        )

    out = get_op("v4_sink_attention")(q, keys, mask, p["sinks"], scale=spec.head_dim**-0.5)
    out = apply_rope(out, cos, sin, rope_dim=spec.rope_dim, inverse=True)
    y = grouped_output_projection(
        out, p["wo_a"], p["wo_b"], groups=spec.o_groups, rank=spec.o_rank, numerics=numerics
    )
    return y, cross
