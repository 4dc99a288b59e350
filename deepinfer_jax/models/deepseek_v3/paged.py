"""DeepSeek-V3 in the engine: the decoder layers of one step over a flat ragged batch and the paged latent cache.

Every layer writes each token's MLA latent (``c`` and the rotated ``k_pe``) into the paged cache at the token's
(block table, position), then attends blockwise over each sequence's blocks with op ``"paged_mla_attention"``
(the absorbed form: queries are mapped into the latent space by ``W_UK``, outputs out of it by ``W_UV``). The
MLP/MoE block is the contiguous model's own (``deepseek_v3.model.feed_forward``), so both paths share one
implementation of DeepSeekMoE. In batch-invariant mode every per-token computation runs in fixed tiles
(:func:`~deepinfer_jax.ops.tiling.rowwise`), the attention included.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from deepinfer_jax.cache.paged import (
    LatentCacheSpec,
    init_latent_cache,
    latent_cache_dtype,
    latent_cache_layout,
    slot_mapping,
    write_tokens,
)
from deepinfer_jax.cache.ragged import RaggedMeta
from deepinfer_jax.config.v3 import DeepseekV3Config
from deepinfer_jax.models.common import embed_tokens, linear, lm_head
from deepinfer_jax.models.common.layer_runs import run_layers
from deepinfer_jax.models.deepseek_v3 import model as v3_model
from deepinfer_jax.models.deepseek_v3.attention import mla_project
from deepinfer_jax.models.paged import CacheLayout, PagedModel
from deepinfer_jax.ops.registry import select
from deepinfer_jax.ops.tiling import rowwise

__all__ = [
    "PagedMeta",
    "V3PagedModel",
    "cache_storage",
    "forward_logits",
    "forward_paged",
    "head_logits",
    "mtp_logits",
    "mtp_paged",
    "paged_decoder_layer",
    "paged_model",
]

Params = dict[str, Any]
_HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class PagedMeta:
    """Per-step addressing shared by every layer (computed once per step)."""

    blocks: jax.Array  # int32 [T] physical block of each token (num_blocks = padding, dropped)
    offsets: jax.Array  # int32 [T] row inside that block
    token_seq: jax.Array
    positions: jax.Array
    block_tables: jax.Array
    context_lens: jax.Array


def _einsum32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """Float32 einsum. Operands are widened first: a product of two bf16 values is exact in float32, so this
    equals a bf16 x bf16 -> f32 dot, which XLA:CPU does not implement for batched dots."""
    return jnp.einsum(
        spec,
        a.astype(jnp.float32),
        b.astype(jnp.float32),
        precision=_HIGHEST,
        preferred_element_type=jnp.float32,
    )


def paged_decoder_layer(
    x: jax.Array,
    p: Params,
    pl: v3_model.V3Plan,
    cos: jax.Array,
    sin: jax.Array,
    cache: jax.Array,
    layer: int | jax.Array,
    meta: PagedMeta,
    *,
    tile: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One V3 decoder layer over the flat batch ``x [T, H]``, its latents written to ``cache[layer]``.

    ``layer`` is a Python int, or a traced ``int32`` scalar inside a scanned run of layers.

    The same pre-norm residual block as the contiguous-cache model: ``x + attn(norm(x))`` then
    ``x + mlp(norm(x))`` (dense MLP or DeepSeekMoE), with the attention reading the paged cache through op
    ``"paged_mla_attention"``. ``cos``/``sin`` are the ``[T, R/2]`` RoPE tables of the tokens' positions. With
    ``tile``, every per-token computation runs in fixed tiles of that many tokens (:func:`rowwise`).
    """
    cfg = pl.cfg
    rms_norm = select("rms_norm")
    eps = cfg.rms_norm_eps
    attn = p["attn"]

    def project(x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        q_nope, q_pe, c, k_pe = mla_project(
            rms_norm(x, p["input_norm"], eps=eps)[None],
            attn,
            cos[None],
            sin[None],
            num_heads=cfg.num_attention_heads,
            nope_dim=cfg.qk_nope_head_dim,
            rope_dim=cfg.qk_rope_head_dim,
            kv_rank=cfg.kv_lora_rank,
            eps=eps,
            numerics=pl.numerics,
        )
        q_lat = _einsum32("thd,hdc->thc", q_nope[0], attn["w_uk"]).astype(q_nope.dtype)
        return q_lat, q_pe[0], jnp.concatenate([c[0], k_pe[0]], axis=-1)

    def finish(x: jax.Array, o_lat: jax.Array) -> jax.Array:
        out = _einsum32("thc,hvc->thv", o_lat.astype(x.dtype), attn["w_uv"])
        x = x + linear(out.reshape(1, out.shape[0], -1).astype(x.dtype), attn["o_proj"], pl.numerics)[0]
        return x + v3_model.feed_forward(rms_norm(x, p["post_attn_norm"], eps=eps)[None], p["mlp"], pl)[0]

    q_lat, q_pe, entries = rowwise(project, tile, x, cos, sin)
    # kv_rank: an FP8 latent record of V3's real 512 + 64 does not tell its latent width by its size alone.
    cache = write_tokens(cache, layer, entries, meta.blocks, meta.offsets, kv_rank=cfg.kv_lora_rank)

    def attend(q_lat: jax.Array, q_pe: jax.Array, token_seq: jax.Array, positions: jax.Array) -> jax.Array:
        return select("paged_mla_attention")(
            q_lat,
            q_pe,
            cache,
            layer,
            token_seq,
            positions,
            meta.block_tables,
            meta.context_lens,
            scale=pl.softmax_scale,
        )

    # In batch-invariant mode the attention runs in fixed tiles too: its batched contractions are otherwise sized
    # by the step's token count, and XLA:CPU's result for a token then depends on it. (Padding tokens of the
    # last tile read row 0; their outputs are cut off.)
    o_lat = rowwise(attend, tile, q_lat, q_pe, meta.token_seq, meta.positions)
    return rowwise(finish, tile, x, o_lat), cache


def forward_paged(
    params: Params,
    cfg: DeepseekV3Config,
    token_ids: jax.Array,
    cache: jax.Array,
    meta: PagedMeta,
    *,
    tile: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The V3 backbone over a flat ragged batch: final-norm hidden states ``[T, H]`` and the updated cache.

    ``token_ids [T]`` are concrete ids (the step has already resolved pending ``-1`` entries).
    """
    pl = v3_model.plan(cfg, jnp.dtype(params["embed"].dtype).name)
    x = embed_tokens(params["embed"], token_ids, dtype=jnp.dtype(pl.dtype))
    cos, sin = pl.cos_sin(meta.positions)

    def body(carry: tuple[jax.Array, jax.Array], layer: Params, i: Any) -> tuple[jax.Array, jax.Array]:
        return paged_decoder_layer(carry[0], layer, pl, cos, sin, carry[1], i, meta, tile=tile)

    x, cache = run_layers(params["layers"], body, (x, cache))
    return select("rms_norm")(x, params["norm"], eps=cfg.rms_norm_eps), cache


def _paged_meta(cache: jax.Array, meta: RaggedMeta) -> PagedMeta:
    blocks, offsets = slot_mapping(
        meta.block_tables, meta.token_seq, meta.positions, cache.shape[2], cache.shape[1]
    )
    return PagedMeta(blocks, offsets, meta.token_seq, meta.positions, meta.block_tables, meta.context_lens)


def forward_logits(
    params: Params,
    cfg: DeepseekV3Config,
    token_ids: jax.Array,
    cache: jax.Array,
    meta: RaggedMeta,
    *,
    tile: int | None = None,
    logit_index: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Float32 logits of the tokens ``logit_index`` (default each row's last token) and the updated cache."""
    hidden, cache = forward_paged(params, cfg, token_ids, cache, _paged_meta(cache, meta), tile=tile)
    index = meta.last_token() if logit_index is None else logit_index
    return head_logits(params, hidden[index], tile=tile), cache


def head_logits(params: Params, hidden: jax.Array, *, tile: int | None = None) -> jax.Array:
    """Float32 logits of the LM head on post-final-norm hidden states ``[N, H]``."""
    return rowwise(lambda h: lm_head(h, params["lm_head"]), tile, hidden)


def mtp_paged(
    params: Params,
    cfg: DeepseekV3Config,
    hidden: jax.Array,
    next_ids: jax.Array,
    cache: jax.Array,
    meta: RaggedMeta,
    *,
    tile: int | None = None,
    depth: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """MTP layer ``depth`` over a flat ragged batch: its post-norm hidden states ``[T, H]`` and the cache.

    Token ``t`` at position ``p`` pairs the main model's post-final-norm hidden state ``hidden[t]`` (or, for a
    second draft step, the MTP layer's own output) with ``next_ids[t]``, the token at ``p + 1``; the layer's
    latent is written to cache layer ``num_hidden_layers + depth`` at ``p``, so later steps attend to it. Its
    head (:func:`mtp_logits`) predicts the token at ``p + 2``. The same computation as
    :func:`deepinfer_jax.models.deepseek_v3.model.mtp_forward`, over the paged cache.
    """
    pl = v3_model.plan(cfg, jnp.dtype(params["embed"].dtype).name)
    p = params["mtp"][depth]
    rms_norm = select("rms_norm")
    eps = cfg.rms_norm_eps
    dtype = jnp.dtype(pl.dtype)

    def project(h: jax.Array, ids: jax.Array) -> jax.Array:
        e = rms_norm(embed_tokens(p["embed"], ids, dtype=dtype), p["enorm"], eps=eps)
        h = rms_norm(h.astype(dtype), p["hnorm"], eps=eps)
        return linear(jnp.concatenate([e, h], axis=-1)[None], p["eh_proj"], pl.numerics)[0]

    x = rowwise(project, tile, hidden, next_ids)
    cos, sin = pl.cos_sin(meta.positions)
    layer = cfg.num_hidden_layers + depth
    x, cache = paged_decoder_layer(
        x, p["layer"], pl, cos, sin, cache, layer, _paged_meta(cache, meta), tile=tile
    )
    return rms_norm(x, p["head_norm"], eps=eps), cache


def mtp_logits(params: Params, hidden: jax.Array, *, tile: int | None = None, depth: int = 0) -> jax.Array:
    """Float32 draft logits of MTP layer ``depth`` from its post-norm hidden states ``[N, H]``."""
    head = params["mtp"][depth]["head"]
    return rowwise(lambda h: lm_head(h, head), tile, hidden)


@dataclasses.dataclass(frozen=True)
class V3PagedModel(PagedModel):
    """DeepSeek-V3: one paged MLA latent cache ``[L, num_blocks, block, C + R]`` (``cache/paged.py``)."""

    cfg: Any  # DeepseekV3Config (frozen, hashable)
    block_size: int
    dtype: str  # "float32" | "bfloat16"

    @property
    def vocab_size(self) -> int:
        return int(self.cfg.vocab_size)

    def latent_spec(self, num_blocks: int) -> LatentCacheSpec:
        return LatentCacheSpec(
            num_layers=int(self.cfg.num_layers_total),
            num_blocks=num_blocks,
            block_size=self.block_size,
            kv_rank=int(self.cfg.kv_lora_rank),
            rope_dim=int(self.cfg.qk_rope_head_dim),
            dtype=self.dtype,
        )

    def layout(self) -> CacheLayout:
        return latent_cache_layout(self.cfg, block_size=self.block_size, dtype=self.dtype)

    def init_cache(self, num_blocks: int, num_slots: int) -> Any:
        return init_latent_cache(self.latent_spec(num_blocks))

    block_axis = 1  # the latent pages are [layers, blocks, block_size, width]

    def cache_parts(self, cache: Any) -> tuple[Any, Any]:
        """All of the cache is per block: V3 keeps no per-slot state in it."""
        return cache, None

    def with_parts(self, cache: Any, blocks: Any, slots: Any) -> Any:
        return blocks

    def forward(
        self,
        params: Any,
        cache: Any,
        token_ids: jax.Array,
        meta: RaggedMeta,
        *,
        tile: int | None,
        logit_index: jax.Array | None = None,
    ) -> tuple[jax.Array, Any]:
        return forward_logits(params, self.cfg, token_ids, cache, meta, tile=tile, logit_index=logit_index)

    @property
    def num_draft_layers(self) -> int:
        return int(self.cfg.num_nextn_predict_layers)

    def forward_hidden(
        self, params: Any, cache: Any, token_ids: jax.Array, meta: RaggedMeta, *, tile: int | None
    ) -> tuple[jax.Array, Any]:
        return forward_paged(params, self.cfg, token_ids, cache, _paged_meta(cache, meta), tile=tile)

    def head(self, params: Any, hidden: jax.Array, *, tile: int | None) -> jax.Array:
        return head_logits(params, hidden, tile=tile)

    def draft_hidden(
        self,
        params: Any,
        cache: Any,
        hidden: jax.Array,
        next_ids: jax.Array,
        meta: RaggedMeta,
        *,
        tile: int | None,
    ) -> tuple[jax.Array, Any]:
        return mtp_paged(params, self.cfg, hidden, next_ids, cache, meta, tile=tile)

    def draft_head(self, params: Any, hidden: jax.Array, *, tile: int | None) -> jax.Array:
        return mtp_logits(params, hidden, tile=tile)


def cache_storage(dtype: str, kv_cache_dtype: str = "auto") -> str:
    """The latent cache's storage for precision ``dtype`` and the ``kv_cache_dtype`` setting (``ValueError``
    naming the value and the choices)."""
    return latent_cache_dtype(dtype, kv_cache_dtype)


def paged_model(
    model: Any, *, block_size: int, dtype: str, kv_cache_dtype: str = "auto", draft_tokens: int = 0
) -> V3PagedModel:
    """The engine's view of a loaded V3 model (``load_model``'s result); its MTP layers draft whenever the step
    speculates (``draft_tokens`` needs nothing of the latent cache)."""
    return V3PagedModel(model.config, block_size, cache_storage(dtype, kv_cache_dtype))
