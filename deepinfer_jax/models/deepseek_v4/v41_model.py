"""The DeepSeek-V4.1 full-prefix forward as a pure function: ``ids [B, S]`` at positions ``0 .. S-1`` -> logits.

Data flow (spec/model.md §1), per backbone layer ``l`` in plan order:

1. the previous FFN's write-back leaves the stream state ``R [B, S, m, H]``;
2. Engram (§9) on ``R`` if ``l`` is an Engram layer: compressed ids -> n-gram ids -> hashed rows -> FP8 table
   rows -> ``engram.wkv`` -> per-stream gated value added to each stream;
3. attention sub-layer (§6.4): mixes from ``R``, read ``x = Σ π_s R[s]``, ``x̂ = RMSNorm(x; attn_norm)``,
   §7.11 attention through :func:`~.v41_attention.attention_prefix` (which threads the shared hidden, compressed
   keys, indexer keys, top-k selections and candidate blocks from source layers to consumers), write-back;
4. FFN sub-layer: the same around the §8 MoE (sqrt-softplus router with selection bias, MXFP4 routed experts with
   the routing weight applied before ``w2``, one fused FP8 shared expert).

The read mix ``π`` follows the HC schedule (§6.4). *Shifted* (``hc_shifted``, the released checkpoint's): each
sub-layer reads with the pre-mix its predecessor computed from the predecessor's own input state; the very first
sub-layer reads stream 0; the final collapse (§6.5) uses the last FFN's pre-mix. *Non-shifted*: each sub-layer
reads with its own pre-mix and the ``hc_head_*`` tensors collapse the streams. Either way ``post`` and ``comb``
come from the sub-layer's own input. Then the final RMSNorm and the LM head give float32 logits (§10).

Precision modes (``ARCHITECTURE.md`` §8) live in :class:`V41Static`, so each mode is one compiled forward:

* **float32 parity mode** (``V41Static.from_config(cfg, compression)``): float32 activations; FP8 and MXFP4
  weights are decoded tile by tile inside their GEMMs (weight-only) and no round trip of §12.4 is applied.
* **bfloat16 production mode** (``dtype="bfloat16"``): bfloat16 embeddings, streams and sub-layer outputs at the
  spec's rounding points (RMSNorm rounds twice (§5.1); the mHC read and write-back once each (§6.4); projections
  round their outputs except the float32 ones of §5.2; the routed and shared expert outputs are summed in float32
  and rounded once (§8.2)); the MXFP8 activation cast in front of every FP8/MXFP4 GEMM (§12.2); and the round
  trips of §12.4 -- MXFP8 window keys, FP4 (or MXFP8 with ``use_fp4_sparse_kv = false``) compressed keys, MXFP4
  indexer queries and keys, bfloat16 indexer scores. mHC mixes, the router, the Engram gate, sinks, softmaxes and
  the logits stay float32. The parameters must be assembled in the same mode.

This path keeps every key of the prefix in memory; it is the reference an incremental, cached path must
reproduce. The DSpark drafter (``params["mtp"]``) is not run here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from deepinfer_jax.config.v41 import DeepseekV41Config
from deepinfer_jax.models.common import taps
from deepinfer_jax.models.common.embedding import embed_tokens, lm_head
from deepinfer_jax.models.common.linear import LinearNumerics, linear
from deepinfer_jax.models.common.mlp import swiglu
from deepinfer_jax.models.common.moe import route
from deepinfer_jax.models.deepseek_v4.engram import (
    CompressionMap,
    EngramLayout,
    engram_layer,
    hash_rows,
    ngram_ids,
)
from deepinfer_jax.models.deepseek_v4.mhc import hc_collapse, hc_expand, hc_head, hc_mixes
from deepinfer_jax.models.deepseek_v4.params import compute_dtype
from deepinfer_jax.models.deepseek_v4.plan_v41 import V41LayerPlan, V41Plan, build_v41_plan
from deepinfer_jax.models.deepseek_v4.v41_attention import CrossLayer, V41AttentionSpec, attention_prefix
from deepinfer_jax.numerics.activation import CastPolicy
from deepinfer_jax.ops import get as get_op
from deepinfer_jax.ops import rms_norm

__all__ = ["V41Static", "forward_logits", "forward_with_features", "moe_layer", "shared_expert"]


@dataclasses.dataclass(frozen=True)
class V41Static:
    """Everything static about a V4.1 forward (hashable: a ``jax.jit`` static argument).

    Attributes:
        plan: the static layer plan (§3, §7.8).
        attention: one :class:`V41AttentionSpec` per backbone layer.
        numerics: FP8 block shape and activation cast of the precision mode (parity: no cast).
        engram: the Engram layout (table sizes, offsets, hash multipliers), ``None`` without Engram.
        hc_shifted: the HC schedule (§6.4); the non-shifted one needs ``params["hc_head"]``.
        dtype: the activation dtype of the precision mode, ``"float32"`` or ``"bfloat16"``.
        casts: the round trips of the precision mode (also held by each attention spec); the draft keys' cast
            (§12.4 item 5) is here for the drafter.
    """

    plan: V41Plan
    attention: tuple[V41AttentionSpec, ...]
    numerics: LinearNumerics
    engram: EngramLayout | None
    hc_shifted: bool
    vocab_size: int
    hidden: int
    hc_mult: int
    hc_eps: float
    hc_sinkhorn_iters: int
    eps: float
    scoring: str
    top_k: int
    routed_scaling_factor: float
    swiglu_limit: float | None
    dtype: str = "float32"
    casts: CastPolicy = dataclasses.field(default_factory=CastPolicy)

    @classmethod
    def from_config(
        cls, cfg: DeepseekV41Config, compression: CompressionMap | None = None, dtype: Any = "float32"
    ) -> V41Static:
        """The statics of ``cfg`` in precision mode ``dtype`` (``"float32"`` parity, ``"bfloat16"`` production);
        ``compression`` is required exactly when Engram is on.

        Raises:
            TypeError: ``cfg`` is not a :class:`DeepseekV41Config`.
            ValueError: Engram on without a compression map (or off with one), or a map that disagrees with
                the config (:meth:`EngramLayout.from_config` names the key); a dtype that is not a precision mode.
        """
        if not isinstance(cfg, DeepseekV41Config):
            raise TypeError(f"cfg: expected a DeepseekV41Config, got {type(cfg).__name__}")
        mode = jnp.dtype(compute_dtype(dtype)).name
        cfg.require_complete("building a DeepSeek-V4.1 model")
        plan = build_v41_plan(cfg)
        if cfg.engram_enabled != (compression is not None):
            raise ValueError(
                f"compression: {'required' if cfg.engram_enabled else 'not used'} with "
                f"text_config.engram_layer_ids = {list(cfg.engram_layer_ids)!r}"
            )
        layout = EngramLayout.from_config(cfg, compression) if compression is not None else None
        q = cfg.quantization
        # Parity mode: every round trip of §12.4 off; production: all on (compressed keys FP4 or MXFP8).
        casts = CastPolicy.for_mode("deepseek_v41", mode, cfg.use_fp4_sparse_kv)
        return cls(
            plan=plan,
            attention=tuple(
                V41AttentionSpec.from_config(cfg, i, casts) for i in range(cfg.num_hidden_layers)
            ),
            numerics=LinearNumerics(
                block=tuple(q.weight_block_size) if q is not None else None, activation_cast=casts.gemm_input
            ),
            engram=layout,
            hc_shifted=cfg.hc_shifted,
            vocab_size=cfg.vocab_size,
            hidden=cfg.hidden_size,
            hc_mult=cfg.hc_mult,
            hc_eps=cfg.hc_eps,
            hc_sinkhorn_iters=cfg.hc_sinkhorn_iters,
            eps=cfg.rms_norm_eps,
            scoring=cfg.scoring_func,
            top_k=cfg.num_experts_per_tok,
            routed_scaling_factor=cfg.routed_scaling_factor,
            swiglu_limit=cfg.swiglu_limit,
            dtype=mode,
            casts=casts,
        )


# ---------------------------------------------------------------------------------------------- FFN (§8)


def shared_expert(
    x: jax.Array,
    p: Mapping[str, Any],
    numerics: LinearNumerics,
    *,
    limit: float | None,
    out_dtype: Any = None,
) -> jax.Array:
    """The shared experts as one SwiGLU FFN whose first GEMM is the fused ``[w1; w3]`` (``p["w13"]``).

    The output is in ``out_dtype`` (default ``x.dtype``); :func:`moe_layer` asks for float32 so that the routed
    and shared outputs are summed before the one rounding of §8.2.
    """
    u = linear(x, p["w13"], numerics, out_dtype=jnp.float32)
    half = u.shape[-1] // 2
    a = swiglu(u[..., :half], u[..., half:], limit=limit).astype(x.dtype)
    return linear(a, p["down"], numerics, out_dtype=out_dtype or x.dtype)


def moe_layer(p: Mapping[str, Any], x: jax.Array, static: V41Static) -> jax.Array:
    """§8 for normalised ``x [B, S, H]``: routed experts (op ``moe_experts``) plus the shared expert."""
    b, s, h = x.shape
    flat = x.reshape(b * s, h)
    logits = linear(flat, p["gate"], static.numerics, out_dtype=jnp.float32)
    routing = route(
        logits,
        scoring=static.scoring,
        top_k=static.top_k,
        bias=p["bias"],
        norm_topk_prob=True,
        routed_scaling_factor=static.routed_scaling_factor,
    )
    taps.record("moe_routing", ids=routing.ids, num_experts=logits.shape[-1])  # training only (bias balance)
    out = get_op("moe_experts")(
        flat,
        routing,
        p["experts"],
        static.numerics,
        swiglu_limit=static.swiglu_limit,
        weight_before_down=True,  # §8.2: the reference scales the activation before w2
        out_dtype=jnp.float32,
    )
    if "shared" in p:
        shared = shared_expert(
            flat, p["shared"], static.numerics, limit=static.swiglu_limit, out_dtype=jnp.float32
        )
        out = out + shared
    return out.astype(x.dtype).reshape(b, s, h)  # f = Σ out_e + out_s, rounded once (§8.2)


# ----------------------------------------------------------------------------------------- the forward


def _sublayer(
    streams: jax.Array,
    hc: Mapping[str, jax.Array],
    carried_pre: jax.Array,
    static: V41Static,
    body: Callable[[jax.Array], tuple[jax.Array, Any]],
) -> tuple[jax.Array, jax.Array, Any]:
    """One HC-wrapped sub-layer (§6.4): mixes, read, ``body``, write-back.

    ``body`` maps the read ``x [B, S, H]`` to ``(y, aux)``; returns ``(R', this sub-layer's pre-mix, aux)``.
    """
    mix = hc_mixes(
        streams, **hc, hc_eps=static.hc_eps, sinkhorn_iters=static.hc_sinkhorn_iters, norm_eps=static.eps
    )
    read = carried_pre if static.hc_shifted else mix.pre
    y, aux = body(hc_collapse(streams, read))
    return hc_expand(streams, y, mix.post, mix.comb), mix.pre, aux


def _engram_ngrams(params: Mapping[str, Any], ids: jax.Array, static: V41Static) -> jax.Array:
    """N-gram ids ``[B, S, Nmax]`` of compressed tokens, the history before position 0 filled with pad (§9.2)."""
    layout = static.engram
    assert layout is not None
    table = params.get("engram_compress")
    if table is None:
        raise ValueError(
            "params: Engram layers need 'engram_compress' (the raw -> compressed id table of §9.1); assemble the "
            "parameters with v41_params.assemble_params"
        )
    if table.shape != (static.vocab_size,):
        raise ValueError(f"params['engram_compress']: shape {table.shape}, expected ({static.vocab_size},)")
    compressed = jnp.take(table, ids, axis=0)
    grams, _ = ngram_ids(compressed, None, max_ngram_size=layout.max_ngram_size, pad_id=layout.pad_id)
    return grams


def _layer(
    p: Mapping[str, Any],
    streams: jax.Array,
    carried_pre: jax.Array,
    cross: CrossLayer,
    grams: jax.Array | None,
    lp: V41LayerPlan,
    spec: V41AttentionSpec,
    static: V41Static,
    capture: dict[int, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array, CrossLayer]:
    """One backbone layer: Engram, attention and MoE sub-layers (module docstring).

    ``capture``, when given, receives ``{layer: float32 mean over streams}`` of the state entering the attention
    mixes (after Engram): the DSpark target feature of §11.1 before its precision-mode rounding.
    """
    if lp.has_engram:
        assert grams is not None and static.engram is not None and lp.engram_slot is not None
        rows = hash_rows(grams, static.engram, lp.engram_slot)
        streams = engram_layer(p["engram"], streams, rows, eps=static.eps, numerics=static.numerics)
    if capture is not None:
        capture[lp.layer] = jnp.mean(streams.astype(jnp.float32), axis=-2)

    def attention(x: jax.Array) -> tuple[jax.Array, CrossLayer]:
        x_hat = rms_norm(x, p["attn_norm"], eps=static.eps)
        return attention_prefix(p["attn"], x_hat, lp, spec, cross, static.numerics)

    def ffn(x: jax.Array) -> tuple[jax.Array, None]:
        return moe_layer(p["ffn"], rms_norm(x, p["ffn_norm"], eps=static.eps), static), None

    streams, carried_pre, cross = _sublayer(streams, p["hc_attn"], carried_pre, static, attention)
    streams, carried_pre, _ = _sublayer(streams, p["hc_ffn"], carried_pre, static, ffn)
    return streams, carried_pre, cross


def forward_logits(params: Mapping[str, Any], ids: jax.Array, *, static: V41Static) -> jax.Array:
    """Float32 logits ``[B, S, V]`` of ``ids [B, S]`` (each row a sequence starting at position 0).

    ``params`` is the tree of :func:`~.v41_params.assemble_params`; ``static`` is a ``jax.jit`` static argument.
    """
    return forward_with_features(params, ids, static=static)[0]


def forward_with_features(
    params: Mapping[str, Any], ids: jax.Array, *, static: V41Static, capture_layers: tuple[int, ...] = ()
) -> tuple[jax.Array, dict[int, jax.Array]]:
    """:func:`forward_logits` plus ``{t: mean_s R_t[s]}`` (float32 ``[B, S, H]``) for each ``t`` in
    ``capture_layers``, ``R_t`` being the stream state entering layer ``t``'s attention mixes, after Engram
    (the DSpark target features of §11.1, reduced but not yet rounded to the precision mode).

    Raises:
        ValueError: a capture layer outside ``[0, num_hidden_layers)``.
    """
    for i, layer in enumerate(capture_layers):
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < static.plan.num_layers:
            raise ValueError(
                f"capture_layers[{i}]: {layer!r} is not a backbone layer index in [0, {static.plan.num_layers})"
            )
    ids = jnp.asarray(ids)
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"ids: expected an integer array [batch, seq], got {ids.dtype} {ids.shape}")
    if len(params["layers"]) != static.plan.num_layers:
        raise ValueError(f"params: {len(params['layers'])} layers, the plan has {static.plan.num_layers}")
    if not static.hc_shifted and "hc_head" not in params:
        raise ValueError("params: the non-shifted HC schedule needs 'hc_head' (hc_head_fn / _base / _scale)")
    b, s = ids.shape
    m = static.hc_mult
    x = embed_tokens(params["embed"], ids, dtype=jnp.dtype(static.dtype))
    streams = jnp.broadcast_to(x[:, :, None, :], (b, s, m, x.shape[-1]))  # §6.2
    # Shifted schedule: the first sub-layer reads stream 0 (one-hot, exactly).
    carried_pre = jnp.broadcast_to(jax.nn.one_hot(0, m, dtype=jnp.float32), (b, s, m))
    grams = _engram_ngrams(params, ids, static) if static.engram is not None else None
    cross = CrossLayer()
    features: dict[int, jax.Array] = {}
    for lp, spec, p in zip(static.plan.layers, static.attention, params["layers"], strict=True):
        capture = features if lp.layer in capture_layers else None
        streams, carried_pre, cross = _layer(p, streams, carried_pre, cross, grams, lp, spec, static, capture)
    if static.hc_shifted:
        h = hc_collapse(streams, carried_pre)  # §6.5: the last FFN's own pre-mix
    else:
        h = hc_head(streams, **params["hc_head"], hc_eps=static.hc_eps, norm_eps=static.eps)
    h = rms_norm(h, params["norm"], eps=static.eps)
    return lm_head(h, params["head"]), features
