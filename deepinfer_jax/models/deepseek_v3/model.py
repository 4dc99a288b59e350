"""The DeepSeek-V3 forward: pure functions over the parameter pytree of :mod:`.weights`.

* :func:`forward_logits` -- full causal forward of whole sequences, no cache (``[B, S] -> [B, S, V]`` float32
  logits); naive MLA, transformers' computation, used for parity.
* :func:`init_cache` / :func:`forward` -- the cached path: a contiguous per-sequence cache of MLA latents
  (``kv_lora_rank + qk_rope_head_dim`` values per token and layer, MTP layers included) and absorbed attention.
  Prefill and decode are the same call; ``positions`` say where each token goes.
* :func:`mtp_forward` -- the multi-token-prediction layer(s) as a draft head: from the main model's post-norm
  hidden state ``h_i`` and the next token ``t_{i+1}`` it predicts token ``i + 2``.

The precision mode follows the parameters (ARCHITECTURE §8): float32 parameters run the float32 parity mode
(FP8 weights dequantised weight-only inside the linear), bfloat16 parameters the production mode (bf16
activations and rounding points, per-token-per-128 FP8 activation casts in front of every FP8 GEMM). The
router always runs in float32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config.v3 import DeepseekV3Config
from deepinfer_jax.models.common import (
    LinearNumerics,
    Routing,
    embed_tokens,
    linear,
    lm_head,
    route,
    swiglu_mlp,
    taps,
)
from deepinfer_jax.models.common.layer_runs import run_layers, stack_layers
from deepinfer_jax.models.deepseek_v3.attention import mla_absorbed, mla_naive, mla_project
from deepinfer_jax.models.deepseek_v3.weights import check_supported, compute_dtype
from deepinfer_jax.numerics.activation import CastPolicy
from deepinfer_jax.ops.registry import select
from deepinfer_jax.ops.rope import RopeParams, rope_cos_sin

__all__ = [
    "V3Plan",
    "feed_forward",
    "forward",
    "forward_hidden",
    "forward_logits",
    "init_cache",
    "moe_routing",
    "mtp_forward",
    "plan",
    "scan_layout",
]

Params = dict[str, Any]
Cache = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class V3Plan:
    """Static facts derived once from a config and a precision mode (hashable; traced code reads only these)."""

    cfg: DeepseekV3Config
    dtype: str
    numerics: LinearNumerics
    freqs: tuple[float, ...]
    rope_magnitude: float
    softmax_scale: float

    def cos_sin(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """RoPE tables ``[..., R/2]`` at integer ``positions`` (YaRN frequencies and magnitude of the config)."""
        return rope_cos_sin(
            positions, np.asarray(self.freqs, np.float32), attention_factor=self.rope_magnitude
        )


@functools.lru_cache(maxsize=64)
def plan(cfg: DeepseekV3Config, dtype: str) -> V3Plan:
    """The :class:`V3Plan` of ``cfg`` in precision mode ``dtype`` (cached: configs are hashable)."""
    check_supported(cfg)
    mode = compute_dtype(dtype).name
    rope = RopeParams.from_config(cfg.rope)
    block = cfg.quantization.weight_block_size if cfg.quantization is not None else None
    cast = CastPolicy.for_mode("deepseek_v3", mode).gemm_input if block is not None else "none"
    return V3Plan(
        cfg=cfg,
        dtype=mode,
        numerics=LinearNumerics(block=block, activation_cast=cast),
        freqs=tuple(float(f) for f in rope.frequencies(cfg.qk_rope_head_dim)),
        rope_magnitude=float(rope.magnitude),
        softmax_scale=float(cfg.qk_head_dim**-0.5 * rope.softmax_scale_correction),
    )


def _plan_for(params: Params, cfg: DeepseekV3Config) -> V3Plan:
    if not isinstance(params, dict) or "embed" not in params:
        raise TypeError(
            "params: expected the DeepSeek-V3 parameter dict (from assemble_params / init_params)"
        )
    return plan(cfg, jnp.dtype(params["embed"].dtype).name)


# ------------------------------------------------------------------------------------------------ blocks


def moe_routing(tokens: jax.Array, p: Params, pl: V3Plan) -> Routing:
    """DeepSeekMoE routing of ``tokens [N, H]``: float32 router logits, sigmoid scores, group-limited top-k."""
    cfg = pl.cfg
    logits = linear(tokens, {"weight": p["router"]}, pl.numerics, out_dtype=jnp.float32)
    return route(
        logits,
        scoring=cfg.scoring_func,
        top_k=cfg.num_experts_per_tok,
        bias=p["bias"],
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
    )


def _moe(x: jax.Array, p: Params, pl: V3Plan) -> jax.Array:
    tokens = x.reshape(-1, x.shape[-1])
    routing = moe_routing(tokens, p, pl)
    taps.record(
        "moe_routing", ids=routing.ids, num_experts=p["router"].shape[0]
    )  # training only (bias balance)
    y = select("moe_experts")(tokens, routing, p["experts"], pl.numerics, out_dtype=jnp.float32)
    if "shared" in p:
        y = y + swiglu_mlp(tokens, p["shared"], pl.numerics, out_dtype=jnp.float32)
    return y.astype(x.dtype).reshape(x.shape)


def feed_forward(x: jax.Array, p: Params, pl: V3Plan) -> jax.Array:
    """A layer's feed-forward block: DeepSeekMoE (routed + shared experts) or, in the first layers, dense SwiGLU."""
    if "router" in p:
        return _moe(x, p, pl)
    return swiglu_mlp(x, p, pl.numerics)


def _attention(
    x: jax.Array,
    p: Params,
    pl: V3Plan,
    cos: jax.Array,
    sin: jax.Array,
    cache: jax.Array | None,
    positions: jax.Array | None,
) -> tuple[jax.Array, jax.Array | None]:
    cfg = pl.cfg
    q_nope, q_pe, c, k_pe = mla_project(
        x,
        p,
        cos,
        sin,
        num_heads=cfg.num_attention_heads,
        nope_dim=cfg.qk_nope_head_dim,
        rope_dim=cfg.qk_rope_head_dim,
        kv_rank=cfg.kv_lora_rank,
        eps=cfg.rms_norm_eps,
        numerics=pl.numerics,
    )
    if cache is None:
        out = mla_naive(
            q_nope,
            q_pe,
            c,
            k_pe,
            p["kv_b_proj"],
            v_dim=cfg.v_head_dim,
            scale=pl.softmax_scale,
            numerics=pl.numerics,
        )
    else:
        if positions is None:
            raise ValueError("attention with a cache needs the tokens' positions")
        entry = jnp.concatenate([c, k_pe], axis=-1).astype(cache.dtype)
        rows = jnp.arange(x.shape[0], dtype=jnp.int32)[:, None]
        cache = cache.at[rows, positions].set(entry)
        out = mla_absorbed(q_nope, q_pe, cache, positions, p["w_uk"], p["w_uv"], scale=pl.softmax_scale)
    return linear(out, p["o_proj"], pl.numerics), cache


def _decoder_layer(
    x: jax.Array,
    p: Params,
    pl: V3Plan,
    cos: jax.Array,
    sin: jax.Array,
    cache: jax.Array | None = None,
    positions: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""
    rms_norm = select("rms_norm")
    eps = pl.cfg.rms_norm_eps
    h, cache = _attention(rms_norm(x, p["input_norm"], eps=eps), p["attn"], pl, cos, sin, cache, positions)
    x = x + h
    x = x + feed_forward(rms_norm(x, p["post_attn_norm"], eps=eps), p["mlp"], pl)
    return x, cache


def _check_ids(input_ids: Any, cfg: DeepseekV3Config, name: str = "input_ids") -> jax.Array:
    if isinstance(input_ids, np.ndarray | list | tuple):
        arr = np.asarray(input_ids)
        if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{name}: expected an integer array [batch, seq], got {arr.dtype} {arr.shape}")
        if arr.size and (arr.min() < 0 or arr.max() >= cfg.vocab_size):
            raise ValueError(
                f"{name}: token ids must be in [0, vocab_size={cfg.vocab_size}), got min {arr.min()} max {arr.max()}"
            )
    ids = jnp.asarray(input_ids)
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{name}: expected an integer array [batch, seq], got {ids.dtype} {ids.shape}")
    return ids.astype(jnp.int32)


def _hidden_states(params: Params, pl: V3Plan, ids: jax.Array) -> jax.Array:
    dtype = jnp.dtype(pl.dtype)
    x = embed_tokens(params["embed"], ids, dtype=dtype)
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    cos, sin = pl.cos_sin(positions)
    x = run_layers(params["layers"], lambda x, layer, i: _decoder_layer(x, layer, pl, cos, sin)[0], x)
    return select("rms_norm")(x, params["norm"], eps=pl.cfg.rms_norm_eps)


# ------------------------------------------------------------------------------------------------ public


def forward_logits(params: Params, cfg: DeepseekV3Config, input_ids: jax.Array) -> jax.Array:
    """Full causal forward without cache: ``input_ids [B, S]`` -> float32 logits ``[B, S, V]``.

    Every row is one sequence starting at position 0. ``cfg`` must be static under ``jax.jit``.
    """
    pl = _plan_for(params, cfg)
    ids = _check_ids(input_ids, cfg)
    return lm_head(_hidden_states(params, pl, ids), params["lm_head"])


def forward_hidden(
    params: Params, cfg: DeepseekV3Config, input_ids: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """:func:`forward_logits` that also returns the post-final-norm hidden states ``[B, S, H]`` (MTP input)."""
    pl = _plan_for(params, cfg)
    h = _hidden_states(params, pl, _check_ids(input_ids, cfg))
    return lm_head(h, params["lm_head"]), h


def init_cache(cfg: DeepseekV3Config, batch: int, max_len: int, dtype: Any = "float32") -> Cache:
    """An empty cache: ``{"latent": [num_layers_total, batch, max_len, kv_lora_rank + qk_rope_head_dim]}``.

    Slot ``s`` of a row holds the token at position ``s``; decode writes one slot per step. ``dtype`` is the
    storage dtype: float32 in parity mode, bfloat16 in production (1152 bytes per token and layer at V3's
    512 + 64).
    """
    check_supported(cfg)
    for name, value in (("batch", batch), ("max_len", max_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"init_cache: {name} must be a positive int, got {value!r}")
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    return {"latent": jnp.zeros((cfg.num_layers_total, batch, max_len, width), compute_dtype(dtype))}


def _check_cache_args(cfg: DeepseekV3Config, ids: jax.Array, positions: Any, cache: Cache) -> jax.Array:
    if not isinstance(cache, dict) or "latent" not in cache:
        raise TypeError("cache: expected the dict init_cache returns")
    lat = cache["latent"]
    want = (cfg.num_layers_total, ids.shape[0], cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    if lat.ndim != 4 or (lat.shape[0], lat.shape[1], lat.shape[3]) != want:
        raise ValueError(
            f"cache['latent']: shape {lat.shape} does not fit [layers={want[0]}, batch={want[1]}, max_len, {want[2]}]"
        )
    if isinstance(positions, np.ndarray | list | tuple):
        pos = np.asarray(positions)
        if pos.shape != ids.shape:
            raise ValueError(f"positions: shape {pos.shape} must equal input_ids' shape {ids.shape}")
        if pos.size and (pos.min() < 0 or pos.max() >= lat.shape[2]):
            raise ValueError(
                f"positions: values must be in [0, max_len={lat.shape[2]}), got min {pos.min()} max {pos.max()}"
            )
    pos = jnp.asarray(positions)
    if pos.shape != ids.shape or not jnp.issubdtype(pos.dtype, jnp.integer):
        raise ValueError(f"positions: expected integers of shape {ids.shape}, got {pos.dtype} {pos.shape}")
    return pos.astype(jnp.int32)


def forward(
    params: Params,
    cfg: DeepseekV3Config,
    input_ids: jax.Array,
    positions: jax.Array,
    cache: Cache,
    *,
    return_hidden: bool = False,
) -> tuple[jax.Array, Cache] | tuple[jax.Array, Cache, jax.Array]:
    """Cached forward (absorbed MLA): logits ``[B, T, V]`` of ``input_ids [B, T]`` at ``positions [B, T]``.

    The tokens' latents are written into their slots first, then each query attends to every slot at or
    before its position. A prompt is one call with positions ``0..T-1``; each decode step is a call with
    ``T = 1``. Returns ``(logits, cache)``, plus the post-final-norm hidden states (the MTP input) when
    ``return_hidden``. Positions must lie inside the cache (checked when they are concrete).
    """
    pl = _plan_for(params, cfg)
    ids = _check_ids(input_ids, cfg)
    pos = _check_cache_args(cfg, ids, positions, cache)
    lat = cache["latent"]
    cos, sin = pl.cos_sin(pos)
    x = embed_tokens(params["embed"], ids, dtype=jnp.dtype(pl.dtype))

    def body(carry: tuple[jax.Array, jax.Array], layer: Params, i: Any) -> tuple[jax.Array, jax.Array]:
        x, lat = carry
        x, layer_cache = _decoder_layer(x, layer, pl, cos, sin, lat[i], pos)
        return x, lat.at[i].set(layer_cache)

    x, lat = run_layers(params["layers"], body, (x, lat))
    h = select("rms_norm")(x, params["norm"], eps=cfg.rms_norm_eps)
    logits = lm_head(h, params["lm_head"])
    if return_hidden:
        return logits, {"latent": lat}, h
    return logits, {"latent": lat}


def mtp_forward(
    params: Params,
    cfg: DeepseekV3Config,
    hidden: jax.Array,
    next_ids: jax.Array,
    positions: jax.Array | None = None,
    cache: Cache | None = None,
    *,
    depth: int = 0,
) -> tuple[jax.Array, jax.Array, Cache | None]:
    """One MTP layer as a draft head: ``(logits [B, T, V], hidden_out [B, T, H], cache)``.

    For each position ``i``: ``h' = eh_proj([enorm(embed(next_ids_i)) ; hnorm(hidden_i)])``, one full decoder
    layer (MoE), then ``shared_head.norm`` and ``shared_head.head``. ``hidden`` is the main model's post-final-norm
    hidden state at ``i`` (the LM-head input) and ``next_ids`` the token at ``i + 1``; the logits predict token
    ``i + 2``. ``hidden_out`` is the MTP layer's post-norm hidden, the ``hidden`` of the next draft step.

    Without ``cache`` the rows are whole sequences from position 0 (causal attention among themselves); with a
    cache (from :func:`init_cache`; MTP layer ``d`` uses entry ``num_hidden_layers + d``) tokens are written at
    ``positions`` and attend to earlier slots, so drafting one token per step is one call with ``T = 1``.
    """
    pl = _plan_for(params, cfg)
    if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth < len(params["mtp"]):
        raise ValueError(f"mtp_forward: depth = {depth!r}; this model has {len(params['mtp'])} MTP layer(s)")
    ids = _check_ids(next_ids, cfg, "next_ids")
    if hidden.shape != (*ids.shape, cfg.hidden_size):
        raise ValueError(
            f"mtp_forward: hidden {hidden.shape} must be [B, T, hidden_size] matching next_ids {ids.shape}"
        )
    p = params["mtp"][depth]
    rms_norm = select("rms_norm")
    eps = cfg.rms_norm_eps
    dtype = jnp.dtype(pl.dtype)
    e = rms_norm(embed_tokens(p["embed"], ids, dtype=dtype), p["enorm"], eps=eps)
    h = rms_norm(hidden.astype(dtype), p["hnorm"], eps=eps)
    x = linear(jnp.concatenate([e, h], axis=-1), p["eh_proj"], pl.numerics)
    if cache is None:
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
        cos, sin = pl.cos_sin(jnp.asarray(positions))
        x, _ = _decoder_layer(x, p["layer"], pl, cos, sin)
        new_cache = None
    else:
        if positions is None:
            raise ValueError("mtp_forward: positions are required with a cache")
        pos = _check_cache_args(cfg, ids, positions, cache)
        cos, sin = pl.cos_sin(pos)
        slot = cfg.num_hidden_layers + depth
        lat = cache["latent"]
        x, layer_cache = _decoder_layer(x, p["layer"], pl, cos, sin, lat[slot], pos)
        new_cache = {"latent": lat.at[slot].set(layer_cache)}
    out = rms_norm(x, p["head_norm"], eps=eps)
    return lm_head(out, p["head"]), out, new_cache


def scan_layout(params: Params, cfg: DeepseekV3Config, *, min_run: int) -> Params:
    """``params`` with each run of at least ``min_run`` same-structure decoder layers stacked (the MoE layers
    after ``first_k_dense_replace``, and the dense ones before when there are enough of them), run with
    ``lax.scan`` by every forward of this module and of the paged engine (:mod:`..common.layer_runs`)."""
    del cfg  # the structure is read from the parameters: a quantised and a float layer never share a stack
    return {**params, "layers": stack_layers(params["layers"], min_run=min_run)}
