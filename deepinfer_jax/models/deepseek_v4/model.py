"""The DeepSeek-V4 forward as a pure function over a parameter tree and an explicit incremental state.

``forward_chunk(params, ids, start, state, plan=..., numerics=...)`` runs ``S`` new tokens (positions
``start .. start+S-1``) of a batch of sequences through the model and returns their logits and the advanced
state; ``start`` may be one position for the whole batch or one per row (``[B]``), and ``lengths`` may mark
right padding, so sequences at different positions (decoding, prefilling) share one call. A full forward is
one chunk from position 0 on a fresh state (:func:`forward_logits`); decode is a chunk of one token. Both
paths execute the same code, so "token-by-token decode equals the full forward" is a property of the state
bookkeeping (window ring, compressor tails and overlap series), which the tests check.

Per layer (model.md §6-§8 with V4's layer kinds): mHC mixes -> collapse -> attention norm -> attention
(:mod:`.attention`) -> mHC expand; mHC mixes -> collapse -> FFN norm -> MoE (score-routed with the
``sqrtsoftplus`` router and a selection bias, or hash-routed by ``tid2eid[token]``; clamped SwiGLU on routed and
shared experts) -> mHC expand. After the last layer the HC head collapses the streams, then the final norm and
the LM head give float32 logits.

:class:`V4Plan` is everything static about a config (dimensions, layer kinds, RoPE tables), hashable so it can be
a ``jax.jit`` static argument: the layer loop is unrolled at trace time.

Precision modes (``ARCHITECTURE.md`` §8) are part of the plan, so each mode is one compiled forward:

* ``V4Plan.from_config(cfg)`` / ``numerics_for(cfg)`` -- float32 parity mode: float32 activations, FP8/MXFP4
  weights dequantised weight-only, no round trip.
* ``V4Plan.from_config(cfg, "bfloat16")`` / ``numerics_for(cfg, "bfloat16")`` -- production mode: bfloat16
  embeddings, streams and sub-layer outputs at the spec's rounding points (RMSNorm rounds twice, the mHC read and
  write-back once each, the MoE output once), the MXFP8 activation cast in front of every FP8/MXFP4 GEMM
  (spec §12.2), and the cache round trips of §12.4 (MXFP8 window keys, FP4 compressed entries, MXFP4 indexer
  keys and queries, bfloat16 indexer scores). mHC mixes, the router, sinks, softmaxes and the logits stay
  float32. The parameters must be assembled in the same mode (``assemble_params(..., "bfloat16")``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config.v4 import DeepseekV4Config
from deepinfer_jax.models.common.embedding import embed_tokens, lm_head
from deepinfer_jax.models.common.linear import LinearNumerics, linear
from deepinfer_jax.models.common.mlp import swiglu
from deepinfer_jax.models.common.moe import route
from deepinfer_jax.models.deepseek_v4.attention import (
    AttentionSpec,
    AttentionState,
    attention_layer,
    init_attention_state,
)
from deepinfer_jax.models.deepseek_v4.mhc import hc_collapse, hc_expand, hc_head, hc_mixes
from deepinfer_jax.models.deepseek_v4.params import compute_dtype
from deepinfer_jax.numerics.activation import CastPolicy
from deepinfer_jax.ops import RopeParams, rms_norm
from deepinfer_jax.ops import get as get_op

__all__ = [
    "V4Plan",
    "forward_chunk",
    "forward_logits",
    "init_state",
    "moe_layer",
    "numerics_for",
]

# A compression ratio must divide the 128-token cache block (DeepseekV4Config enforces it at parse time).
CACHE_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class V4Plan:
    """Static description of a DeepSeek-V4 model in one precision mode (hashable).

    ``dtype`` is the activation dtype of the mode (``"float32"`` or ``"bfloat16"``) and ``casts`` its
    quantise-dequantise round trips (also held by each layer's :class:`AttentionSpec`).
    """

    vocab_size: int
    hidden: int
    attention: tuple[AttentionSpec, ...]
    mlp_types: tuple[str, ...]
    hc_mult: int
    hc_eps: float
    hc_sinkhorn_iters: int
    eps: float
    scoring: str
    top_k: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float | None
    dtype: str = "float32"
    casts: CastPolicy = dataclasses.field(default_factory=CastPolicy)

    @property
    def num_layers(self) -> int:
        return len(self.attention)

    @classmethod
    def from_config(cls, cfg: DeepseekV4Config, dtype: Any = "float32") -> V4Plan:
        """Derive the plan from a parsed config (every dimension and ratio comes from it) for precision mode
        ``dtype`` (``"float32"`` parity or ``"bfloat16"`` production)."""
        if not isinstance(cfg, DeepseekV4Config):
            raise TypeError(f"V4Plan.from_config: expected a DeepseekV4Config, got {type(cfg).__name__}")
        mode = jnp.dtype(compute_dtype(dtype)).name
        casts = CastPolicy.for_mode("deepseek_v4", mode)
        cfg.require_complete("building a DeepSeek-V4 model")
        rope_dim = cfg.qk_rope_head_dim
        main = tuple(float(f) for f in RopeParams.from_config(cfg.rope).frequencies(rope_dim))
        compress_rope = RopeParams.from_config(cfg.compress_rope) if cfg.compressed_layer_ids else None
        for rope, key in ((RopeParams.from_config(cfg.rope), "rope"), (compress_rope, "compress_rope")):
            if rope is not None and rope.magnitude != 1.0:
                raise ValueError(
                    f"{key}: attention_factor / mscale give a cos/sin magnitude of {rope.magnitude}, but "
                    "DeepSeek-V4 applies no YaRN magnitude scaling (expected 1.0)"
                )
        compress = (
            tuple(float(f) for f in compress_rope.frequencies(rope_dim))
            if compress_rope is not None
            else main
        )
        specs = []
        for i, kind in enumerate(cfg.layer_types):
            ratio = cfg.compress_ratios[i]
            if ratio and CACHE_BLOCK % ratio:
                raise ValueError(
                    f"compress_ratios[{i}] = {ratio}: a compression ratio must divide the {CACHE_BLOCK}-token "
                    "cache block"
                )
            csa = kind == "compressed_sparse_attention"
            specs.append(
                AttentionSpec(
                    kind=kind,
                    heads=cfg.num_attention_heads,
                    head_dim=cfg.head_dim,
                    rope_dim=rope_dim,
                    window=cfg.sliding_window,
                    o_groups=cfg.o_groups,
                    o_rank=cfg.o_lora_rank,
                    eps=cfg.rms_norm_eps,
                    rope_freqs=main if kind == "sliding_attention" else compress,
                    ratio=ratio,
                    index_heads=(cfg.index_n_heads or 0) if csa else 0,
                    index_dim=(cfg.index_head_dim or 0) if csa else 0,
                    index_topk=(cfg.index_topk or 0) if csa else 0,
                    casts=casts,
                    score_dtype="float32" if casts.indexer == "none" else "bfloat16",
                )
            )
        return cls(
            vocab_size=cfg.vocab_size,
            hidden=cfg.hidden_size,
            attention=tuple(specs),
            mlp_types=tuple(cfg.mlp_layer_types),
            hc_mult=cfg.hc_mult,
            hc_eps=cfg.hc_eps,
            hc_sinkhorn_iters=cfg.hc_sinkhorn_iters,
            eps=cfg.rms_norm_eps,
            scoring=cfg.scoring_func,
            top_k=cfg.num_experts_per_tok,
            norm_topk_prob=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor,
            swiglu_limit=cfg.swiglu_limit,
            dtype=mode,
            casts=casts,
        )


def numerics_for(cfg: DeepseekV4Config, dtype: Any = "float32") -> LinearNumerics:
    """Linear numerics of the checkpoint's weight formats in precision mode ``dtype``.

    Parity mode (float32) dequantises FP8/MXFP4 weights weight-only; production mode (bfloat16) first applies the
    MXFP8 activation cast of spec §12.2 to every input of an FP8 or MXFP4 GEMM (unquantised weights never see it).
    """
    q = cfg.quantization
    mode = jnp.dtype(compute_dtype(dtype)).name
    return LinearNumerics(
        block=tuple(q.weight_block_size) if q is not None else None,
        activation_cast=CastPolicy.for_mode("deepseek_v4", mode).gemm_input,
    )


def init_state(plan: V4Plan, batch: int, max_len: int, dtype: Any = None) -> tuple[AttentionState, ...]:
    """A fresh incremental state for ``batch`` sequences of up to ``max_len`` tokens.

    ``dtype`` (default: the plan's activation dtype) is the dtype of the stored keys; the compressor tails are
    float32 in every mode.
    """
    for name, value in (("batch", batch), ("max_len", max_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"init_state: {name} must be an int >= 1, got {value!r}")
    dtype = jnp.dtype(plan.dtype if dtype is None else dtype)
    return tuple(init_attention_state(spec, batch, max_len, dtype) for spec in plan.attention)


def moe_layer(
    p: Mapping[str, Any],
    x: jax.Array,
    ids: jax.Array,
    plan: V4Plan,
    numerics: LinearNumerics,
    *,
    hashed: bool,
) -> jax.Array:
    """The MoE FFN for normalised ``x [B, S, H]``: routed experts (hash or score routed) plus shared experts.

    The routed sum and the shared experts' output meet in float32 and are rounded once to ``x.dtype``.
    """
    b, s, h = x.shape
    flat = x.reshape(b * s, h)
    logits = linear(flat, p["gate"], numerics, out_dtype=jnp.float32)
    expert_ids = jnp.take(p["tid2eid"], ids.reshape(-1), axis=0) if hashed else None
    routing = route(
        logits,
        scoring=plan.scoring,
        top_k=plan.top_k,
        bias=None if hashed else p["bias"],
        norm_topk_prob=plan.norm_topk_prob,
        routed_scaling_factor=plan.routed_scaling_factor,
        expert_ids=expert_ids,
    )
    out = get_op("moe_experts")(
        flat,
        routing,
        p["experts"],
        numerics,
        swiglu_limit=plan.swiglu_limit,
        weight_before_down=True,
        out_dtype=jnp.float32,
    )
    if "shared" in p:
        out = out + _shared_experts(flat, p["shared"], numerics, limit=plan.swiglu_limit)
    return out.astype(x.dtype).reshape(b, s, h)


def _shared_experts(
    x: jax.Array, p: Mapping[str, Any], numerics: LinearNumerics, *, limit: float | None
) -> jax.Array:
    """Shared experts ``down(SwiGLU(gate(x), up(x)))`` -> float32 (model.md §8.2).

    Like the routed experts, the two first projections stay float32 into the clamped SwiGLU and only the
    activation is rounded to ``x.dtype`` before the down projection.
    """
    g = linear(x, p["gate"], numerics, out_dtype=jnp.float32)
    u = linear(x, p["up"], numerics, out_dtype=jnp.float32)
    a = swiglu(g, u, limit=limit).astype(x.dtype)
    return linear(a, p["down"], numerics, out_dtype=jnp.float32)


def _concrete(value: Any) -> np.ndarray | None:
    """``value`` as a host int64 array when it is concrete (not traced under ``jax.jit``), else ``None``."""
    try:
        return np.asarray(value, dtype=np.int64)
    except (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return None


def _check_rows(
    state: tuple[AttentionState, ...], start: Any, lengths: Any, batch: int, seq: int, plan: V4Plan
) -> None:
    """Refuse a malformed ``start``/``lengths`` and, when they are concrete, a chunk that would not fit the state.

    Shapes and dtypes are checked always (they are static under ``jax.jit``). Values only when concrete: under
    ``jax.jit`` they are traced, and callers that jit must keep ``0 <= lengths <= S`` and
    ``start + lengths <= max_len`` of :func:`init_state` themselves (the engine's scheduler does).
    """
    for name, value in (("start", start), ("lengths", lengths)):
        if value is None:
            continue
        dtype = getattr(value, "dtype", None)
        if dtype is None and isinstance(value, int) and not isinstance(value, bool):
            dtype = np.dtype(np.int64)
        if dtype is None or not np.issubdtype(dtype, np.integer):
            raise TypeError(
                f"forward_chunk: {name} must be an int scalar or an int [{batch}] vector, got "
                f"{type(value).__name__} of dtype {dtype}"
            )
        if np.shape(value) not in ((), (batch,)):
            raise ValueError(
                f"forward_chunk: {name} must be a scalar or a [{batch}] vector (one per batch row), got shape "
                f"{np.shape(value)}"
            )
    first = _concrete(start)
    count = np.int64(seq) if lengths is None else _concrete(lengths)
    if first is not None and (first < 0).any():
        raise ValueError(f"forward_chunk: start = {first.tolist()} must be >= 0")
    if count is not None and ((count < 0) | (count > seq)).any():
        raise ValueError(
            f"forward_chunk: lengths = {count.tolist()} must lie in [0, {seq}] (the chunk's tokens)"
        )
    if first is None or count is None:
        return
    end = int(np.max(np.broadcast_to(first + count, (batch,))))
    for i, (spec, layer) in enumerate(zip(plan.attention, state, strict=True)):
        if layer.compressor is None:
            continue
        capacity = layer.compressor.entries.shape[1]
        needed = end // spec.ratio
        if needed > capacity:
            raise ValueError(
                f"forward_chunk: positions up to {end} need {needed} compressed entries in layer {i} "
                f"(ratio {spec.ratio}), but the state holds {capacity}; build it with a larger max_len"
            )


def forward_chunk(
    params: Mapping[str, Any],
    ids: jax.Array,
    start: jax.Array,
    state: tuple[AttentionState, ...],
    *,
    plan: V4Plan,
    numerics: LinearNumerics,
    lengths: jax.Array | None = None,
) -> tuple[jax.Array, tuple[AttentionState, ...]]:
    """Logits ``float32 [B, S, V]`` of tokens ``ids [B, S]`` at positions ``start ..``, and the new state.

    ``start`` is an int scalar (every row at the same position) or an int vector ``[B]``: row ``b`` holds
    positions ``start[b] .. start[b]+S-1``, so one call can decode some sequences while others prefill.
    ``lengths`` (scalar or ``[B]``, default ``S``) is how many of a row's ``S`` tokens are real; the rest is
    right padding whose logits are meaningless and which leaves that row's state exactly as if only the real
    tokens had been fed. Both may be traced: changing their values neither syncs with the host nor recompiles.
    """
    if ids.ndim != 2:
        raise ValueError(f"forward_chunk: ids must be [batch, tokens], got shape {ids.shape}")
    if len(state) != plan.num_layers:
        raise ValueError(f"forward_chunk: state has {len(state)} layers, the plan {plan.num_layers}")
    _check_rows(state, start, lengths, ids.shape[0], ids.shape[1], plan)
    x = embed_tokens(params["embed"], ids, dtype=jnp.dtype(plan.dtype))
    streams = jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], plan.hc_mult, x.shape[-1]))
    hc = {"hc_eps": plan.hc_eps, "sinkhorn_iters": plan.hc_sinkhorn_iters, "norm_eps": plan.eps}
    new_state = []
    for i, (spec, lp) in enumerate(zip(plan.attention, params["layers"], strict=True)):
        mix = hc_mixes(streams, **lp["hc_attn"], **hc)
        xn = rms_norm(hc_collapse(streams, mix.pre), lp["attn_norm"], eps=plan.eps)
        y, layer_state = attention_layer(lp["attn"], xn, start, state[i], spec, numerics, lengths=lengths)
        new_state.append(layer_state)
        streams = hc_expand(streams, y, mix.post, mix.comb)
        mix = hc_mixes(streams, **lp["hc_ffn"], **hc)
        xn = rms_norm(hc_collapse(streams, mix.pre), lp["ffn_norm"], eps=plan.eps)
        f = moe_layer(lp["ffn"], xn, ids, plan, numerics, hashed=plan.mlp_types[i] == "hash_moe")
        streams = hc_expand(streams, f, mix.post, mix.comb)
    h = hc_head(streams, **params["hc_head"], hc_eps=plan.hc_eps, norm_eps=plan.eps)
    h = rms_norm(h, params["norm"], eps=plan.eps)
    return lm_head(h, params["head"]), tuple(new_state)


def forward_logits(
    params: Mapping[str, Any], ids: jax.Array, *, plan: V4Plan, numerics: LinearNumerics
) -> jax.Array:
    """Full-sequence logits ``float32 [B, S, V]`` (one chunk from position 0 on a fresh state)."""
    state = init_state(plan, ids.shape[0], ids.shape[1])
    logits, _ = forward_chunk(params, ids, jnp.int32(0), state, plan=plan, numerics=numerics)
    return logits
