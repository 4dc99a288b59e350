"""The DeepSeek-V3 checkpoint contract and the load-time transforms that turn it into model parameters.

:func:`expected_tensors` lists every tensor a checkpoint of a config must hold (HF names, shape, accepted
dtypes); the checkpoint layer checks a checkpoint against it before anything is used. :func:`assemble_params`
turns the loaded tensors into the parameter pytree the model functions take:

* unquantised weights are cast to the compute dtype (float32 parity mode, bfloat16 production mode); the
  router weight and ``e_score_correction_bias`` stay float32 in both modes, as the routing decisions are
  sensitive to rounding and transformers keeps them float32 too;
* FP8 weights stay FP8: E4M3 codes as ``uint8`` bytes plus their float32 ``weight_scale_inv`` grid, consumed
  tile by tile by :mod:`deepinfer_jax.numerics.qlinear` (weight-only in float32 mode, with the per-token-per-128
  activation cast in bfloat16 mode);
* the routed experts of a layer are stacked into ``[E, out, in]`` arrays (one grouped GEMM per projection);
* MLA's ``kv_b_proj`` is additionally split and folded into the per-head absorbed forms ``w_uk [Nh, nope, C]``
  and ``w_uv [Nh, v, C]`` used by the cached decode path (the naive full forward keeps using ``kv_b_proj``).

Parameter tree (linear weights are the dicts of :mod:`deepinfer_jax.models.common.linear`)::

    embed [V, H], norm [H], lm_head [V, H]
    layers[i]: input_norm, post_attn_norm,
               attn: q_proj | (q_a_proj, q_a_norm, q_b_proj), kv_a_proj, kv_a_norm, kv_b_proj, o_proj,
                     w_uk, w_uv
               mlp (dense): gate, up, down
               mlp (MoE):   router, bias, experts {gate, up, down}, shared {gate, up, down} (if any)
    mtp[d]: embed, enorm, hnorm, eh_proj, head_norm, head, layer (a decoder layer as above)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.checkpoint.deferred import stack_experts
from deepinfer_jax.config.v3 import DeepseekV3Config
from deepinfer_jax.numerics.codecs import dequantize_fp8_blockwise
from deepinfer_jax.numerics.elements import as_uint8

__all__ = [
    "COMPUTE_DTYPES",
    "FLOAT_DTYPES",
    "IGNORED_TENSORS",
    "assemble_params",
    "check_supported",
    "compute_dtype",
    "expected_tensors",
    "init_params",
    "logical_axes",
]

COMPUTE_DTYPES: tuple[str, ...] = ("float32", "bfloat16")
FLOAT_DTYPES: tuple[str, ...] = ("bfloat16", "float32", "float16")
"""Dtypes an unquantised tensor may be stored in (it is cast to the compute dtype at load)."""

IGNORED_TENSORS: tuple[str, ...] = ("*.rotary_emb.inv_freq",)
"""Checkpoint names the loader skips: RoPE tables some exporters store but the model recomputes."""

Expected = dict[str, tuple[tuple[int, ...], tuple[str, ...]]]


def compute_dtype(dtype: Any) -> jnp.dtype:
    """The compute dtype of a precision mode name (``"float32"`` or ``"bfloat16"``)."""
    name = str(getattr(dtype, "name", dtype))
    if name not in COMPUTE_DTYPES:
        raise ValueError(
            f"dtype: {dtype!r} is not a supported precision mode; expected one of {COMPUTE_DTYPES}"
        )
    return jnp.dtype(name)


def check_supported(cfg: DeepseekV3Config) -> None:
    """Refuse config features the V3 model does not implement, naming the key (before any weight is read)."""
    if not isinstance(cfg, DeepseekV3Config):
        raise TypeError(f"config: expected a DeepseekV3Config, got {type(cfg).__name__}")
    cfg.require_complete("building DeepSeek-V3 parameters")
    if cfg.hf.get("attention_bias"):
        raise ValueError(
            f"attention_bias = {cfg.hf['attention_bias']!r} (in {cfg.source or '<config dict>'}): DeepSeek-V3 "
            "projections have no bias; only false is supported"
        )
    if not cfg.rope_interleave:
        raise ValueError(
            f"rope_interleave = False (in {cfg.source or '<config dict>'}): only interleaved RoPE pairs, the "
            "layout of DeepSeek checkpoints, are supported"
        )
    q = cfg.quantization
    if q is not None and (q.quant_method != "fp8" or q.scale_fmt != "float32" or q.expert_format != "fp8"):
        raise ValueError(
            f"quantization_config (in {cfg.source or '<config dict>'}): DeepSeek-V3 checkpoints are FP8 E4M3 "
            f"with float32 weight_scale_inv; got quant_method={q.quant_method!r}, scale_fmt={q.scale_fmt!r}, "
            f"expert format {q.expert_format!r}"
        )


# --------------------------------------------------------------------------------------------- contract


def _layer_linears(cfg: DeepseekV3Config, layer: int) -> Iterator[tuple[str, int, int]]:
    """(name without ``.weight``, out, in) of every FP8-quantisable projection of decoder layer ``layer``."""
    p = f"model.layers.{layer}."
    heads, qk = cfg.num_attention_heads, cfg.qk_head_dim
    if cfg.q_lora_rank is None:
        yield f"{p}self_attn.q_proj", heads * qk, cfg.hidden_size
    else:
        yield f"{p}self_attn.q_a_proj", cfg.q_lora_rank, cfg.hidden_size
        yield f"{p}self_attn.q_b_proj", heads * qk, cfg.q_lora_rank
    yield f"{p}self_attn.kv_a_proj_with_mqa", cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.hidden_size
    yield f"{p}self_attn.kv_b_proj", heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank
    yield f"{p}self_attn.o_proj", cfg.hidden_size, heads * cfg.v_head_dim
    if _is_dense(cfg, layer):
        inter = cfg.intermediate_size
        yield f"{p}mlp.gate_proj", inter, cfg.hidden_size
        yield f"{p}mlp.up_proj", inter, cfg.hidden_size
        yield f"{p}mlp.down_proj", cfg.hidden_size, inter
        return
    inter = cfg.moe_intermediate_size
    for e in range(cfg.n_routed_experts):
        yield f"{p}mlp.experts.{e}.gate_proj", inter, cfg.hidden_size
        yield f"{p}mlp.experts.{e}.up_proj", inter, cfg.hidden_size
        yield f"{p}mlp.experts.{e}.down_proj", cfg.hidden_size, inter
    if cfg.n_shared_experts:
        width = cfg.n_shared_experts * inter
        yield f"{p}mlp.shared_experts.gate_proj", width, cfg.hidden_size
        yield f"{p}mlp.shared_experts.up_proj", width, cfg.hidden_size
        yield f"{p}mlp.shared_experts.down_proj", cfg.hidden_size, width


def _is_dense(cfg: DeepseekV3Config, layer: int) -> bool:
    """Dense FFN below ``first_k_dense_replace``; MoE above, MTP layers included (they follow the backbone)."""
    return layer < cfg.first_k_dense_replace


def expected_tensors(cfg: DeepseekV3Config) -> Expected:
    """Every tensor of a V3 checkpoint for ``cfg``: HF name -> (shape, accepted dtype names).

    FP8 checkpoints (a ``quantization_config``) store each attention/MLP projection as ``float8_e4m3fn`` plus a
    float32 ``weight_scale_inv`` on the ceil-div grid of ``weight_block_size``; embeddings, heads, norms, the
    router and the MTP ``eh_proj`` are unquantised, as in the released checkpoints. MTP layers
    (``num_nextn_predict_layers``) follow the backbone as ``model.layers.{L + d}``.
    """
    check_supported(cfg)
    H, V = cfg.hidden_size, cfg.vocab_size
    out: Expected = {}
    block = cfg.quantization.weight_block_size if cfg.quantization is not None else None

    def put(name: str, shape: tuple[int, ...], dtypes: tuple[str, ...] = FLOAT_DTYPES) -> None:
        out[name] = (shape, dtypes)

    def projection(name: str, rows: int, cols: int) -> None:
        if block is None:
            put(f"{name}.weight", (rows, cols))
            return
        put(f"{name}.weight", (rows, cols), ("float8_e4m3fn",))
        put(f"{name}.weight_scale_inv", (-(-rows // block[0]), -(-cols // block[1])), ("float32",))

    put("model.embed_tokens.weight", (V, H))
    put("model.norm.weight", (H,))
    if not cfg.tie_word_embeddings:
        put("lm_head.weight", (V, H))
    for layer in range(cfg.num_layers_total):
        p = f"model.layers.{layer}."
        put(f"{p}input_layernorm.weight", (H,))
        put(f"{p}post_attention_layernorm.weight", (H,))
        if cfg.q_lora_rank is not None:
            put(f"{p}self_attn.q_a_layernorm.weight", (cfg.q_lora_rank,))
        put(f"{p}self_attn.kv_a_layernorm.weight", (cfg.kv_lora_rank,))
        if not _is_dense(cfg, layer):
            put(f"{p}mlp.gate.weight", (cfg.n_routed_experts, H))
            put(f"{p}mlp.gate.e_score_correction_bias", (cfg.n_routed_experts,))
        for name, rows, cols in _layer_linears(cfg, layer):
            projection(name, rows, cols)
        if layer >= cfg.num_hidden_layers:
            put(f"{p}embed_tokens.weight", (V, H))
            put(f"{p}enorm.weight", (H,))
            put(f"{p}hnorm.weight", (H,))
            put(f"{p}eh_proj.weight", (H, 2 * H))
            put(f"{p}shared_head.norm.weight", (H,))
            put(f"{p}shared_head.head.weight", (V, H))
    return out


# --------------------------------------------------------------------------------------------- assembly


class _Assembler:
    def __init__(self, cfg: DeepseekV3Config, tensors: Mapping[str, jax.Array], dtype: jnp.dtype) -> None:
        self.cfg = cfg
        self.tensors = tensors
        self.dtype = dtype
        self.block = cfg.quantization.weight_block_size if cfg.quantization is not None else None

    def get(self, name: str) -> jax.Array:
        try:
            return jnp.asarray(self.tensors[name])
        except KeyError:
            raise ValueError(
                f"assemble_params: tensor {name!r} is missing (check the tensors against expected_tensors first)"
            ) from None

    def float(self, name: str, dtype: Any = None) -> jax.Array:
        return self.get(name).astype(dtype or self.dtype)

    def linear(self, name: str) -> dict[str, jax.Array]:
        w = self.get(f"{name}.weight")
        scale_name = f"{name}.weight_scale_inv"
        if scale_name in self.tensors:
            return {"weight": as_uint8(w, f"{name}.weight"), "scale": self.float(scale_name, jnp.float32)}
        if w.dtype == jnp.float8_e4m3fn:
            raise ValueError(f"assemble_params: {name}.weight is float8_e4m3fn but {scale_name} is missing")
        return {"weight": w.astype(self.dtype)}

    def dense_weight(self, name: str) -> jax.Array:
        """A projection as a plain float array in the compute dtype (dequantised if FP8): load-time folds only."""
        p = self.linear(name)
        if "scale" not in p:
            return p["weight"]
        if self.block is None:
            raise ValueError(
                f"assemble_params: {name}.weight_scale_inv is present but the config has no quantization_config"
            )
        return dequantize_fp8_blockwise(p["weight"], p["scale"], self.block, dtype=jnp.float32).astype(
            self.dtype
        )

    def stacked(self, names: list[str]) -> dict[str, Any]:
        return stack_experts(len(names), lambda e: self.linear(names[e]))

    def attention(self, layer: int) -> dict[str, Any]:
        cfg = self.cfg
        a = f"model.layers.{layer}.self_attn."
        out: dict[str, Any] = {}
        if cfg.q_lora_rank is None:
            out["q_proj"] = self.linear(f"{a}q_proj")
        else:
            out["q_a_proj"] = self.linear(f"{a}q_a_proj")
            out["q_a_norm"] = self.float(f"{a}q_a_layernorm.weight")
            out["q_b_proj"] = self.linear(f"{a}q_b_proj")
        out["kv_a_proj"] = self.linear(f"{a}kv_a_proj_with_mqa")
        out["kv_a_norm"] = self.float(f"{a}kv_a_layernorm.weight")
        out["kv_b_proj"] = self.linear(f"{a}kv_b_proj")
        out["o_proj"] = self.linear(f"{a}o_proj")
        # Absorbed MLA: kv_b_proj rows are, per head, [k_nope (nope) ; v (v_head_dim)] over the latent.
        heads, nope = cfg.num_attention_heads, cfg.qk_nope_head_dim
        kv_b = self.dense_weight(f"{a}kv_b_proj").reshape(heads, nope + cfg.v_head_dim, cfg.kv_lora_rank)
        out["w_uk"] = kv_b[:, :nope, :]
        out["w_uv"] = kv_b[:, nope:, :]
        return out

    def mlp(self, layer: int) -> dict[str, Any]:
        cfg = self.cfg
        m = f"model.layers.{layer}.mlp."
        if _is_dense(cfg, layer):
            return {k: self.linear(f"{m}{k}_proj") for k in ("gate", "up", "down")}
        experts = range(cfg.n_routed_experts)
        out: dict[str, Any] = {
            "router": self.float(f"{m}gate.weight", jnp.float32),
            "bias": self.float(f"{m}gate.e_score_correction_bias", jnp.float32),
            "experts": {
                k: self.stacked([f"{m}experts.{e}.{k}_proj" for e in experts]) for k in ("gate", "up", "down")
            },
        }
        if cfg.n_shared_experts:
            out["shared"] = {k: self.linear(f"{m}shared_experts.{k}_proj") for k in ("gate", "up", "down")}
        return out

    def layer(self, layer: int) -> dict[str, Any]:
        p = f"model.layers.{layer}."
        return {
            "input_norm": self.float(f"{p}input_layernorm.weight"),
            "post_attn_norm": self.float(f"{p}post_attention_layernorm.weight"),
            "attn": self.attention(layer),
            "mlp": self.mlp(layer),
        }

    def mtp(self, layer: int) -> dict[str, Any]:
        p = f"model.layers.{layer}."
        return {
            "embed": self.float(f"{p}embed_tokens.weight"),
            "enorm": self.float(f"{p}enorm.weight"),
            "hnorm": self.float(f"{p}hnorm.weight"),
            "eh_proj": self.linear(f"{p}eh_proj"),
            "head_norm": self.float(f"{p}shared_head.norm.weight"),
            "head": self.float(f"{p}shared_head.head.weight"),
            "layer": self.layer(layer),
        }


def assemble_params(
    cfg: DeepseekV3Config, tensors: Mapping[str, jax.Array], dtype: Any = "float32"
) -> dict[str, Any]:
    """Model parameters from checkpoint tensors (HF names, as :func:`expected_tensors` lists them).

    Args:
      cfg: the model config.
      tensors: HF name -> array (device or host) in its checkpoint dtype.
      dtype: the precision mode, ``"float32"`` (parity) or ``"bfloat16"`` (production).
    """
    check_supported(cfg)
    asm = _Assembler(cfg, tensors, compute_dtype(dtype))
    embed = asm.float("model.embed_tokens.weight")
    return {
        "embed": embed,
        "norm": asm.float("model.norm.weight"),
        "lm_head": embed if cfg.tie_word_embeddings else asm.float("lm_head.weight"),
        "layers": [asm.layer(i) for i in range(cfg.num_hidden_layers)],
        "mtp": [asm.mtp(i) for i in range(cfg.num_hidden_layers, cfg.num_layers_total)],
    }


def init_params(cfg: DeepseekV3Config, seed: int, dtype: Any = "float32") -> dict[str, Any]:
    """Random parameters for ``cfg``: the deterministic synthetic checkpoint of ``seed``, assembled.

    The values come from :func:`deepinfer_jax.models.deepseek_v3.synthetic.generate_v3_weights` (NumPy only,
    one random stream per tensor), so ``init_params`` of the built-in ``tiny-v3`` config equals loading the
    materialised ``tiny-v3`` checkpoint with the same seed.
    """
    from deepinfer_jax.models.builtin import TensorRngFactory
    from deepinfer_jax.models.deepseek_v3.synthetic import generate_v3_weights

    check_supported(cfg)
    tensors = generate_v3_weights(cfg.hf, TensorRngFactory(seed))
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return assemble_params(cfg, {k: np.asarray(v) for k, v in tensors.items()}, dtype)


# --------------------------------------------------------------------------------------------- logical axes

# Logical axis names of each parameter (ARCHITECTURE.md §2): parallel/ maps them to mesh axes with one rules
# table. Linear weights are [out, in]; an FP8 weight's block-scale grid has the same two axes (coarser).
_LINEAR_AXES: dict[str, tuple[str, ...]] = {
    "q_proj": ("q_heads", "embed"),
    "q_a_proj": ("q_lora", "embed"),
    "q_b_proj": ("q_heads", "q_lora"),
    "kv_a_proj": ("kv_lora_rope", "embed"),
    "kv_b_proj": ("kv_heads", "kv_lora"),
    "o_proj": ("embed", "o_heads"),
    "eh_proj": ("embed", "embed_pair"),
}
_VECTOR_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("vocab", "embed"),
    "head": ("vocab", "embed"),
    "q_a_norm": ("q_lora",),
    "kv_a_norm": ("kv_lora",),
    "w_uk": ("heads", "qk_nope", "kv_lora"),
    "w_uv": ("heads", "v_head", "kv_lora"),
    "router": ("expert", "embed"),
    "bias": ("expert",),
}


def _axes_for(keys: tuple[str, ...], ndim: int) -> tuple[str, ...]:
    leaf = keys[-1]
    if leaf in ("weight", "scale", "packed"):
        owner = keys[-2]
        if owner in _LINEAR_AXES:
            return _LINEAR_AXES[owner]
        if "experts" in keys:
            return ("expert", "embed", "moe_mlp") if owner == "down" else ("expert", "moe_mlp", "embed")
        width = "moe_mlp" if "shared" in keys else "mlp"
        return ("embed", width) if owner == "down" else (width, "embed")
    if leaf in _VECTOR_AXES:
        return _VECTOR_AXES[leaf]
    if ndim == 1:  # the hidden-size norms
        return ("embed",)
    raise ValueError(f"logical_axes: no axis names for parameter {'.'.join(keys)}")


def logical_axes(params: Any) -> Any:
    """The logical axis names of every parameter leaf, as a pytree of tuples shaped like ``params``.

    E.g. ``embed -> ("vocab", "embed")``, routed expert ``gate -> ("expert", "moe_mlp", "embed")``,
    ``w_uk -> ("heads", "qk_nope", "kv_lora")``; each tuple has one name per array dimension.
    """

    def name(entry: Any) -> str:
        return str(getattr(entry, "key", getattr(entry, "idx", entry)))

    def one(path: tuple[Any, ...], leaf: jax.Array) -> tuple[str, ...]:
        keys = tuple(name(p) for p in path)
        axes = _axes_for(keys, leaf.ndim)
        if len(axes) != leaf.ndim:
            raise ValueError(f"logical_axes: {'.'.join(keys)} has shape {leaf.shape}, names {axes}")
        return axes

    return jax.tree_util.tree_map_with_path(one, params)
