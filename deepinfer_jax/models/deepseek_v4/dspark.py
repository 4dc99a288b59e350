"""The DSpark drafter of DeepSeek-V4.1 (spec/model.md §11): target features, context keys, one draft step.

The drafter proposes ``B`` tokens per sequence in one block-parallel pass over ``M`` extra HC blocks
(``params["mtp"]``, checkpoint prefix ``mtp.{i}``), conditioned on the backbone through *context keys*:

1. **Target features** (§11.1). The backbone forward captures, at every layer ``t`` of
   ``dspark_target_layer_ids`` (list order), the stream state entering that layer's attention mixes -- after the
   previous FFN write-back and after Engram, as the reference does -- and reduces it to
   ``φ_t = round(mean_s R_t[s])``; ``Φ = [φ_t1, φ_t2, …]``. The rounding is ``bf16`` in production mode and the
   identity in float32 parity mode (:attr:`DSparkStatic.round_features`).
2. **Context keys** (§11.1). ``c = RMSNorm(Φ·main_projᵀ; main_norm)`` (``mtp.0`` owns both), then for every
   draft layer ``i`` and backbone position ``t``: ``κ_i,t = cast(RoPE(RMSNorm(c_t·wkv_iᵀ; kv_norm_i), t))`` with
   the main ``rope_theta`` (no YaRN) and the precision mode's draft-key round trip (MXFP8 in production mode).
   They are what the draft layer's window cache holds for the prefix.
3. **Draft step** (§11.2), batched over sequences, each with its own last known position ``p``: the block
   ``[g, noise × (B−1)]`` at positions ``p+1 … p+B`` runs through the draft layers. Every query of the block
   attends to the context keys of positions ``max(0, p−W+1) … p`` *and to all B block keys* (no causal mask inside
   the block), with the per-head sinks and the grouped output projection; the FFN is the MoE with the drafter's
   own expert count (``dspark_n_routed_experts`` / ``dspark_num_experts_per_tok``). The streams are collapsed by
   the HC schedule (shifted: the last draft FFN's pre-mix; non-shifted: ``mtp.{M−1}.hc_head_*``) into ``h_i``.
4. **Sequential Markov-corrected heads**: for ``i = 0 … B−1``, with ``prev_0 = g`` and ``prev_i = d_{i−1}``,
   ``m_i = markov_embed[prev_i]``, ``logit_i = RMSNorm(h_i; norm)·headᵀ + m_i·markov_headᵀ`` (the LM head is the
   backbone's), ``conf_i = sigmoid(clamp([h_i; m_i]·confᵀ / T_conf, −60, 60))`` and ``d_i = argmax logit_i``.

Decisions the spec leaves to the port:

* **Clamp.** The spec (the contract) clamps the scaled confidence logit to ``[−60, 60]`` as the reference does;
  vLLM and SGLang do not. The clamp is kept: it changes nothing below ``|raw/T| = 60`` (where the sigmoid is
  already within ``1e−26`` of 0 or 1) and keeps a saturated negative logit from underflowing ``conf`` to exactly
  0 (``sigmoid(−60) ≈ 8.8e−27`` is a normal float32; the upper side rounds to 1 in float32 either way).
* **Block size.** ``B`` defaults to ``dspark_block_size`` (SGLang's reading) and can be overridden, as the
  reference overrides it with its own draft-length setting.
* **Draft tokens** are the argmax of the corrected logits (the engine's sampling rules come later); their
  log-probabilities are ``log_softmax(logit_i)[d_i]``.
* **Context keys by position.** :class:`ContextKeys` pairs each key row with its absolute position, so the same
  step reads a full-prefix key array (positions ``0 … S−1``) or a ring buffer (positions per slot, ``−1`` for an
  empty one); the window test is ``max(0, p−W+1) ≤ position ≤ p``.

Everything is a pure function of the parameter tree of :func:`~.v41_params.assemble_params`; ``static`` is a
``jax.jit`` static argument (:class:`DSparkStatic` is hashable).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config.v41 import DeepseekV41Config
from deepinfer_jax.models.common.embedding import embed_tokens, lm_head
from deepinfer_jax.models.common.linear import linear
from deepinfer_jax.models.deepseek_v4.attention import grouped_output_projection
from deepinfer_jax.models.deepseek_v4.mhc import hc_collapse, hc_expand, hc_head, hc_mixes
from deepinfer_jax.models.deepseek_v4.v41_attention import V41AttentionSpec
from deepinfer_jax.models.deepseek_v4.v41_model import V41Static, forward_with_features, moe_layer
from deepinfer_jax.numerics.activation import kv_cast
from deepinfer_jax.ops import RopeParams, apply_rope, rms_norm, rope_cos_sin
from deepinfer_jax.ops import get as get_op

__all__ = [
    "CONFIDENCE_CLAMP",
    "ContextKeys",
    "DSparkStatic",
    "DraftOutput",
    "PrefixDraft",
    "context_keys",
    "draft",
    "draft_after_prefix",
    "draft_hidden",
    "dspark_features",
    "target_features",
]

CONFIDENCE_CLAMP = 60.0
"""Bound of the scaled confidence logit before the sigmoid (§11.2 step 4)."""

_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class DSparkStatic:
    """Everything static about the drafter (hashable: a ``jax.jit`` static argument).

    Attributes:
        backbone: the backbone statics (plan, numerics, HC and MoE settings shared with the draft layers).
        attention: the draft layers' attention (window-only, main ``rope_theta`` without YaRN, backbone ``W``).
        target_layer_ids: ``dspark_target_layer_ids``, in list order (the order of ``Φ``'s blocks).
        num_layers: ``M``, the number of draft layers.
        block_size: ``B``, drafts per step (default ``dspark_block_size``).
        noise_token_id: the id filling block positions ``1 … B−1``.
        num_experts, top_k: the draft MoE's routed experts and experts per token.
        markov_rank: ``Rm``, the width of the Markov tables.
        confidence_temperature: ``T_conf`` (> 0).
        round_features: round ``φ_t`` to bfloat16 (production mode); off in float32 parity mode.
    """

    backbone: V41Static
    attention: V41AttentionSpec
    target_layer_ids: tuple[int, ...]
    num_layers: int
    block_size: int
    noise_token_id: int
    num_experts: int
    top_k: int
    markov_rank: int
    confidence_temperature: float
    round_features: bool

    @classmethod
    def from_config(
        cls,
        cfg: DeepseekV41Config,
        backbone: V41Static | None = None,
        *,
        dtype: str | None = None,
        block_size: int | None = None,
        confidence_temperature: float = 1.0,
    ) -> DSparkStatic:
        """The drafter statics of ``cfg``; the precision mode is the backbone's.

        Args:
            cfg: a V4.1 config with draft layers and known ``dspark_target_layer_ids``.
            backbone: the backbone statics; default: those of ``cfg`` in mode ``dtype`` (its Engram map from the
                tokenizer).
            dtype: ``"float32"`` (parity: no rounding, no cast) or ``"bfloat16"`` (production: ``bf16(φ)`` and
                MXFP8 draft keys); ``None`` = the backbone's mode (float32 when the backbone is built here).
            block_size: ``B``; ``None`` takes ``dspark_block_size``.
            confidence_temperature: ``T_conf``, a finite real > 0.

        Raises:
            TypeError: ``cfg`` is not a :class:`DeepseekV41Config`, ``backbone`` not a :class:`V41Static`, or
                ``block_size`` not an int.
            ValueError: no draft layers, unknown or empty target layers, a bad ``block_size``,
                ``confidence_temperature`` or ``dtype``, a ``dtype`` other than the backbone's, or ``backbone``
                built for another layer count.
        """
        if not isinstance(cfg, DeepseekV41Config):
            raise TypeError(f"cfg: expected a DeepseekV41Config, got {type(cfg).__name__}")
        if dtype is not None and dtype not in _DTYPES:
            raise ValueError(f"dtype: {dtype!r} is not a precision mode; expected one of {_DTYPES}")
        if cfg.num_nextn_predict_layers < 1:
            raise ValueError(
                f"text_config.num_nextn_predict_layers = {cfg.num_nextn_predict_layers}: the model has no DSpark "
                "draft layers (need >= 1)"
            )
        targets = cfg.dspark_target_layer_ids
        if not targets:
            raise ValueError(
                f"text_config.dspark_target_layer_ids = {None if targets is None else list(targets)!r}: the "
                "drafter needs at least one backbone target layer"
            )
        size = cfg.dspark_block_size if block_size is None else block_size
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"block_size: expected an int, got {type(size).__name__} {size!r}")
        if size < 1:
            raise ValueError(f"block_size: {size} drafts per step; must be >= 1")
        temp = confidence_temperature
        if (
            isinstance(temp, bool)
            or not isinstance(temp, (int, float))
            or not math.isfinite(temp)
            or temp <= 0
        ):
            raise ValueError(f"confidence_temperature: {temp!r}; must be a finite real > 0")
        required = {
            "dspark_noise_token_id": cfg.dspark_noise_token_id,
            "dspark_n_routed_experts": cfg.dspark_n_routed_experts,
            "dspark_num_experts_per_tok": cfg.dspark_num_experts_per_tok,
            "dspark_markov_rank": cfg.dspark_markov_rank,
        }
        for key, value in required.items():
            if value is None:
                raise ValueError(f"text_config.{key} = None: required by the DSpark drafter")
        if backbone is None:
            from deepinfer_jax.models.deepseek_v4.family_v41 import static_for

            backbone = static_for(cfg, dtype or "float32")
        if not isinstance(backbone, V41Static):
            raise TypeError(f"backbone: expected a V41Static, got {type(backbone).__name__}")
        if backbone.plan.num_layers != cfg.num_hidden_layers:
            raise ValueError(
                f"backbone: statics of {backbone.plan.num_layers} layers, text_config.num_hidden_layers = "
                f"{cfg.num_hidden_layers}"
            )
        if dtype is not None and dtype != backbone.dtype:
            raise ValueError(f"dtype: {dtype!r}, but the backbone statics are in mode {backbone.dtype!r}")
        # The backbone's round trips: the draft keys' MXFP8 cast (§12.4 item 5) in production mode, none in parity.
        casts = backbone.casts
        attention = V41AttentionSpec(
            heads=cfg.num_attention_heads,
            head_dim=cfg.head_dim,
            rope_dim=cfg.qk_rope_head_dim,
            window=cfg.sliding_window,
            o_groups=cfg.o_groups,
            o_rank=cfg.o_lora_rank,
            eps=cfg.rms_norm_eps,
            # §3.2: draft layers rotate with the main rope_theta and no YaRN, like the window-only layers.
            rope_freqs=tuple(
                float(f)
                for f in np.asarray(RopeParams.from_config(cfg.rope).frequencies(cfg.qk_rope_head_dim))
            ),
            ratio=0,
            index_heads=0,
            index_topk=0,
            candidate_topk_blocks=None,
            candidate_block_size=None,
            casts=casts,
        )
        return cls(
            backbone=backbone,
            attention=attention,
            target_layer_ids=tuple(targets),
            num_layers=cfg.num_nextn_predict_layers,
            block_size=size,
            noise_token_id=int(required["dspark_noise_token_id"]),
            num_experts=int(required["dspark_n_routed_experts"]),
            top_k=int(required["dspark_num_experts_per_tok"]),
            markov_rank=int(required["dspark_markov_rank"]),
            confidence_temperature=float(temp),
            round_features=backbone.dtype == "bfloat16",
        )


class ContextKeys(NamedTuple):
    """The draft layers' window-cache content for the known prefix of each sequence.

    Attributes:
        keys: one ``[Bs, N, D]`` array per draft layer (``κ_i``, §11.1).
        positions: ``[Bs, N]`` int32 absolute position of each key row; a negative position marks an empty slot.
    """

    keys: tuple[jax.Array, ...]
    positions: jax.Array


class DraftOutput(NamedTuple):
    """One draft step for ``Bs`` sequences: ``tokens [Bs, B]`` int32, ``logprobs`` and ``confidences``
    ``[Bs, B]`` float32 (``confidences[:, i]`` = predicted probability that draft ``i`` is accepted)."""

    tokens: jax.Array
    logprobs: jax.Array
    confidences: jax.Array


# ------------------------------------------------------------------------------------------ checks


def _draft_params(params: Mapping[str, Any], static: DSparkStatic) -> Sequence[Mapping[str, Any]]:
    """``params["mtp"]`` after checking the layer count, the expert count and the heads' presence."""
    mtp = params.get("mtp")
    if mtp is None or len(mtp) != static.num_layers:
        found = "none" if mtp is None else len(mtp)
        raise ValueError(
            f"params['mtp']: {found} draft layers, text_config.num_nextn_predict_layers = {static.num_layers}"
        )
    for i, layer in enumerate(mtp):
        experts = layer["ffn"]["bias"].shape[0]
        if experts != static.num_experts:
            raise ValueError(
                f"params['mtp'][{i}]['ffn']: {experts} routed experts, text_config.dspark_n_routed_experts = "
                f"{static.num_experts}"
            )
    for key, owner in (("main_proj", 0), ("main_norm", 0), ("norm", -1), ("markov_embed", -1)):
        if key not in mtp[owner]:
            raise ValueError(f"params['mtp'][{owner % len(mtp)}]: missing {key!r} (§13.4)")
    if not static.backbone.hc_shifted and "hc_head" not in mtp[-1]:
        raise ValueError(
            f"params['mtp'][{len(mtp) - 1}]: the non-shifted HC schedule needs 'hc_head' (hc_head_fn / _base / "
            "_scale)"
        )
    return mtp


def _int_vector(name: str, x: Any, rows: int | None = None) -> jax.Array:
    x = jnp.asarray(x)
    if x.ndim != 1 or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name}: expected an integer array [sequences], got {x.dtype} {x.shape}")
    if rows is not None and x.shape[0] != rows:
        raise ValueError(f"{name}: {x.shape[0]} rows, expected {rows} (one per sequence)")
    return x.astype(jnp.int32)


# --------------------------------------------------------------------------------- features (§11.1)


def target_features(captured: Mapping[int, jax.Array], *, static: DSparkStatic) -> jax.Array:
    """``Φ [..., T·H]`` from the backbone's captured stream means ``{t: [..., H]}`` (list order of targets)."""
    missing = [t for t in static.target_layer_ids if t not in captured]
    if missing:
        raise ValueError(
            f"captured: no feature of target layers {missing}; run the backbone with "
            f"capture_layers={static.target_layer_ids}"
        )
    phi = jnp.concatenate([captured[t] for t in static.target_layer_ids], axis=-1)
    return phi.astype(jnp.bfloat16) if static.round_features else phi


def dspark_features(
    params: Mapping[str, Any], ids: jax.Array, *, static: DSparkStatic
) -> tuple[jax.Array, jax.Array]:
    """The backbone over ``ids [B, S]`` (positions ``0 … S−1``): ``(logits [B, S, V], Φ [B, S, T·H])``."""
    logits, captured = forward_with_features(
        params, ids, static=static.backbone, capture_layers=static.target_layer_ids
    )
    return logits, target_features(captured, static=static)


def context_keys(
    params: Mapping[str, Any],
    features: jax.Array,
    *,
    static: DSparkStatic,
    positions: jax.Array | None = None,
) -> ContextKeys:
    """Context keys of every draft layer from ``Φ [Bs, N, T·H]`` at ``positions [Bs, N]`` (default ``0 … N−1``).

    ``c = RMSNorm(Φ·main_projᵀ; main_norm)``; ``κ_i = cast(RoPE(RMSNorm(c·wkv_iᵀ; kv_norm_i), position))``.
    """
    mtp = _draft_params(params, static)
    spec, numerics = static.attention, static.backbone.numerics
    width = len(static.target_layer_ids) * static.backbone.hidden
    if features.ndim != 3 or features.shape[-1] != width:
        raise ValueError(
            f"features: expected [sequences, tokens, {width}] (len(dspark_target_layer_ids) * hidden_size), "
            f"got {features.shape}"
        )
    b, n, _ = features.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    positions = jnp.asarray(positions)
    if positions.shape != (b, n) or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(
            f"positions: expected integers of shape {(b, n)}, got {positions.dtype} {positions.shape}"
        )
    positions = positions.astype(jnp.int32)
    dtype = jnp.dtype(static.backbone.dtype)
    c = linear(features.astype(dtype), mtp[0]["main_proj"], numerics)
    c = rms_norm(c, mtp[0]["main_norm"], eps=spec.eps)
    cos, sin = rope_cos_sin(positions, spec.freqs())
    keys = []
    for layer in mtp:
        k = rms_norm(linear(c, layer["attn"]["wkv"], numerics), layer["attn"]["kv_norm"], eps=spec.eps)
        k = apply_rope(k, cos, sin, rope_dim=spec.rope_dim)
        keys.append(kv_cast(k, spec.casts.draft_keys).astype(dtype))
    return ContextKeys(keys=tuple(keys), positions=positions)


# ------------------------------------------------------------------------------- draft step (§11.2)


def _block_attention(
    p: Mapping[str, Any],
    x_hat: jax.Array,
    positions: jax.Array,
    context: jax.Array,
    context_visible: jax.Array,
    spec: V41AttentionSpec,
    static: DSparkStatic,
) -> jax.Array:
    """One draft layer's attention: ``x̂ [Bs, B, H]`` at ``positions [Bs, B]`` -> ``[Bs, B, H]``.

    Keys = the visible context keys ``[Bs, N, D]`` then the block's own ``B`` keys, which every block query sees.
    """
    numerics = static.backbone.numerics
    b, s, _ = x_hat.shape
    cos, sin = rope_cos_sin(positions, spec.freqs())
    q_latent = rms_norm(linear(x_hat, p["wq_a"], numerics), p["q_norm"], eps=spec.eps)
    q = linear(q_latent, p["wq_b"], numerics).reshape(b, s, spec.heads, spec.head_dim)
    q = apply_rope(q, cos, sin, rope_dim=spec.rope_dim)
    block = rms_norm(linear(x_hat, p["wkv"], numerics), p["kv_norm"], eps=spec.eps)
    block = kv_cast(apply_rope(block, cos, sin, rope_dim=spec.rope_dim), spec.casts.draft_keys)
    keys = jnp.concatenate([context.astype(x_hat.dtype), block.astype(x_hat.dtype)], axis=1)
    mask = jnp.concatenate(
        [
            jnp.broadcast_to(context_visible[:, None, :], (b, s, context.shape[1])),
            jnp.ones((b, s, s), dtype=bool),  # bidirectional inside the block
        ],
        axis=2,
    )
    out = get_op("v4_sink_attention")(q, keys, mask, p["sinks"], scale=spec.head_dim**-0.5)
    out = apply_rope(out, cos, sin, rope_dim=spec.rope_dim, inverse=True)
    return grouped_output_projection(
        out, p["wo_a"], p["wo_b"], groups=spec.o_groups, rank=spec.o_rank, numerics=numerics
    )


def _hc_sublayer(
    streams: jax.Array, hc: Mapping[str, jax.Array], carried_pre: jax.Array, static: V41Static, body: Any
) -> tuple[jax.Array, jax.Array]:
    """One HC-wrapped sub-layer (§6.4): the same schedule as the backbone's; returns ``(R', own pre-mix)``."""
    mix = hc_mixes(
        streams, **hc, hc_eps=static.hc_eps, sinkhorn_iters=static.hc_sinkhorn_iters, norm_eps=static.eps
    )
    read = carried_pre if static.hc_shifted else mix.pre
    return hc_expand(streams, body(hc_collapse(streams, read)), mix.post, mix.comb), mix.pre


def draft_hidden(
    params: Mapping[str, Any],
    context: ContextKeys,
    block_ids: jax.Array,
    p: jax.Array,
    *,
    static: DSparkStatic,
) -> jax.Array:
    """The collapsed, pre-norm hidden ``h [Bs, B', H]`` of the block ``block_ids [Bs, B']`` at ``p+1 … p+B'``.

    ``p [Bs]`` is each sequence's last position known to the backbone; the block sees the context keys of
    ``max(0, p−W+1) … p`` (by :attr:`ContextKeys.positions`) and all of its own keys.
    """
    mtp = _draft_params(params, static)
    bb = static.backbone
    block_ids = jnp.asarray(block_ids)
    if block_ids.ndim != 2 or not jnp.issubdtype(block_ids.dtype, jnp.integer):
        raise ValueError(
            f"block_ids: expected an integer array [sequences, block], got {block_ids.dtype} "
            f"{block_ids.shape}"
        )
    b, s = block_ids.shape
    p = _int_vector("p", p, b)
    if len(context.keys) != static.num_layers:
        raise ValueError(
            f"context.keys: {len(context.keys)} arrays, one per draft layer expected ({static.num_layers})"
        )
    ctx_pos = jnp.asarray(context.positions)
    n = ctx_pos.shape[-1]
    if ctx_pos.shape != (b, n):
        raise ValueError(f"context.positions: shape {ctx_pos.shape}, expected ({b}, N)")
    for i, k in enumerate(context.keys):
        if k.shape != (b, n, static.attention.head_dim):
            raise ValueError(
                f"context.keys[{i}]: shape {k.shape}, expected {(b, n, static.attention.head_dim)} (head_dim)"
            )
    low = jnp.maximum(p - static.attention.window + 1, 0)
    visible = (ctx_pos >= low[:, None]) & (ctx_pos <= p[:, None])
    positions = p[:, None] + 1 + jnp.arange(s, dtype=jnp.int32)[None, :]
    moe_static = dataclasses.replace(bb, top_k=static.top_k)
    spec = static.attention

    x = embed_tokens(params["embed"], block_ids, dtype=jnp.dtype(bb.dtype))
    m = bb.hc_mult
    streams = jnp.broadcast_to(x[:, :, None, :], (b, s, m, x.shape[-1]))
    carried_pre = jnp.broadcast_to(jax.nn.one_hot(0, m, dtype=jnp.float32), (b, s, m))  # first sub-layer
    for layer, ctx in zip(mtp, context.keys, strict=True):

        def attention(x: jax.Array, layer: Mapping[str, Any] = layer, ctx: jax.Array = ctx) -> jax.Array:
            x_hat = rms_norm(x, layer["attn_norm"], eps=bb.eps)
            return _block_attention(layer["attn"], x_hat, positions, ctx, visible, spec, static)

        def ffn(x: jax.Array, layer: Mapping[str, Any] = layer) -> jax.Array:
            return moe_layer(layer["ffn"], rms_norm(x, layer["ffn_norm"], eps=bb.eps), moe_static)

        streams, carried_pre = _hc_sublayer(streams, layer["hc_attn"], carried_pre, bb, attention)
        streams, carried_pre = _hc_sublayer(streams, layer["hc_ffn"], carried_pre, bb, ffn)
    if bb.hc_shifted:
        return hc_collapse(streams, carried_pre)  # §6.5: the last draft FFN's own pre-mix
    return hc_head(streams, **mtp[-1]["hc_head"], hc_eps=bb.hc_eps, norm_eps=bb.eps)


def draft(
    params: Mapping[str, Any],
    context: ContextKeys,
    golden: jax.Array,
    p: jax.Array,
    *,
    static: DSparkStatic,
) -> DraftOutput:
    """One draft step for ``Bs`` sequences (§11.2): ``golden [Bs]`` is the token the backbone chose for position
    ``p+1`` (``p [Bs]`` its last known position); returns ``B`` argmax drafts for positions ``p+2 … p+B+1``.

    Jittable with ``static`` static; ``p`` and ``golden`` are traced (no recompilation per position).
    """
    golden = _int_vector("golden", golden)
    b, size = golden.shape[0], static.block_size
    noise = jnp.full((b, size - 1), static.noise_token_id, jnp.int32)
    h = draft_hidden(params, context, jnp.concatenate([golden[:, None], noise], axis=1), p, static=static)
    last = params["mtp"][-1]
    base = lm_head(rms_norm(h, last["norm"], eps=static.attention.eps), params["head"])  # [Bs, B, V] float32
    inv_t = jnp.float32(1.0 / static.confidence_temperature)
    prev = golden
    tokens, logprobs, confidences = [], [], []
    for i in range(size):
        markov = embed_tokens(last["markov_embed"], prev)  # [Bs, Rm]
        logits = base[:, i] + lm_head(markov, last["markov_head"])
        raw = lm_head(jnp.concatenate([h[:, i], markov.astype(h.dtype)], axis=-1), last["confidence"])[..., 0]
        conf = jax.nn.sigmoid(jnp.clip(raw * inv_t, -CONFIDENCE_CLAMP, CONFIDENCE_CLAMP))
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), token[:, None], axis=-1)[:, 0]
        tokens.append(token)
        logprobs.append(logp)
        confidences.append(conf)
        prev = token
    return DraftOutput(
        tokens=jnp.stack(tokens, axis=1),
        logprobs=jnp.stack(logprobs, axis=1),
        confidences=jnp.stack(confidences, axis=1),
    )


class PrefixDraft(NamedTuple):
    """Everything :func:`draft_after_prefix` computes on the way to the drafts.

    Attributes:
        logits: the backbone's float32 logits ``[Bs, S, V]``.
        features: ``Φ [Bs, S, T·H]``.
        context: the context keys of positions ``0 … S−1``.
        golden: ``g [Bs]``, the argmax of each row's last real logits.
        p: ``[Bs]`` each row's last real position.
        drafts: the :class:`DraftOutput` after ``g``.
    """

    logits: jax.Array
    features: jax.Array
    context: ContextKeys
    golden: jax.Array
    p: jax.Array
    drafts: DraftOutput


def draft_after_prefix(
    params: Mapping[str, Any],
    ids: jax.Array,
    *,
    static: DSparkStatic,
    lengths: jax.Array | None = None,
) -> PrefixDraft:
    """Run the backbone over ``ids [Bs, S]``, take ``g = argmax`` of each row's last logits and draft after it.

    ``lengths [Bs]`` (default ``S``) gives each row's real length: row ``r`` is the prefix ``ids[r, :lengths[r]]``
    (the rest is padding, which the causal backbone and the window test never let a real position see), so
    ``p = lengths − 1``. Concrete lengths are checked to lie in ``[1, S]``. The intermediates are returned with
    the drafts (:class:`PrefixDraft`) so that a caller can continue from the same context keys.
    """
    ids = jnp.asarray(ids)
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"ids: expected an integer array [batch, seq], got {ids.dtype} {ids.shape}")
    b, s = ids.shape
    if lengths is None:
        lengths = jnp.full((b,), s, jnp.int32)
    elif isinstance(lengths, (np.ndarray, list, tuple)):
        concrete = np.asarray(lengths)
        if concrete.shape == (b,) and ((concrete < 1) | (concrete > s)).any():
            raise ValueError(f"lengths: {concrete.tolist()}; each must lie in [1, {s}] (the padded length)")
    lengths = _int_vector("lengths", lengths, b)
    logits, features = dspark_features(params, ids, static=static)
    p = lengths - 1
    golden = jnp.argmax(jnp.take_along_axis(logits, p[:, None, None], axis=1)[:, 0], axis=-1).astype(
        jnp.int32
    )
    context = context_keys(params, features, static=static)
    drafts = draft(params, context, golden, p, static=static)
    return PrefixDraft(logits=logits, features=features, context=context, golden=golden, p=p, drafts=drafts)
