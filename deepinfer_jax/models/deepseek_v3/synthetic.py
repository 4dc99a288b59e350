"""Deterministic random weights in the DeepSeek-V3 (HF) checkpoint layout.

`generate_v3_weights` turns a raw V3 `config.json` dict into the complete tensor manifest a checkpoint of that
shape carries under the usual HF names (`model.layers.N.self_attn.q_a_proj.weight`, ...): MLA attention (with
or without the low-rank query path), dense SwiGLU layers below `first_k_dense_replace`, DeepSeekMoE layers with
the router's `e_score_correction_bias` and the shared experts, and the multi-token-prediction layers that follow
the backbone (`model.layers.{L+i}.{embed_tokens,enorm,hnorm,eh_proj,shared_head.*}` plus a full decoder layer).

Storage follows the config: without a `quantization_config` every weight is BF16 (the router bias float32);
with one, the attention and MLP projections are FP8 E4M3 with float32 `weight_scale_inv` block scales on the
ceil-div grid of `weight_block_size` (128x128 in real checkpoints), while embeddings, heads, norms, the router
and the MTP `eh_proj` stay BF16 as in the released checkpoints.

Values: linear weights Gaussian scaled by `in^(-1/2)` (rounded to BF16, then quantised when FP8); norm weights
around 1 with noise; router biases small but non-zero. Each tensor has its own random stream
`rng_factory(name)`, so tensors never influence one another and the bytes depend only on NumPy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from deepinfer_jax.models.synthetic_base import BF16, RngFactory, TensorEmitter
from deepinfer_jax.numerics import host

__all__ = ["V3_GENERATOR_VERSION", "generate_v3_weights"]

# Bump when the values or the layout the generator emits change: the built-in model cache keys on it.
V3_GENERATOR_VERSION = "deepseek_v3-synthetic-1"

_BF16 = BF16
_NORM_NOISE = 0.1
_GATE_BIAS_STD = 0.1
_MISSING = object()


def _int(cfg: Mapping[str, Any], key: str, default: Any = _MISSING, *, minimum: int = 1) -> int:
    value = cfg.get(key)
    if value is None:
        if default is _MISSING:
            raise ValueError(f"{key}: required key is missing")
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{key}: expected an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{key}: {value} is below the minimum {minimum}")
    return value


@dataclass(frozen=True)
class _V3Shapes:
    vocab: int
    hidden: int
    layers: int
    mtp_layers: int
    heads: int
    q_rank: int | None  # None: a single full-rank `q_proj`
    kv_rank: int
    nope: int
    rope: int
    v_dim: int
    dense_inter: int
    first_dense: int
    experts: int
    shared: int
    moe_inter: int

    @staticmethod
    def from_config(cfg: Mapping[str, Any]) -> _V3Shapes:
        layers = _int(cfg, "num_hidden_layers")
        mtp_layers = _int(cfg, "num_nextn_predict_layers", 0, minimum=0)
        first_dense = _int(cfg, "first_k_dense_replace", 0, minimum=0)
        any_moe = first_dense < layers + mtp_layers
        any_dense = first_dense > 0
        return _V3Shapes(
            vocab=_int(cfg, "vocab_size"),
            hidden=_int(cfg, "hidden_size"),
            layers=layers,
            mtp_layers=mtp_layers,
            heads=_int(cfg, "num_attention_heads"),
            q_rank=_int(cfg, "q_lora_rank", None),
            kv_rank=_int(cfg, "kv_lora_rank"),
            nope=_int(cfg, "qk_nope_head_dim"),
            rope=_int(cfg, "qk_rope_head_dim"),
            v_dim=_int(cfg, "v_head_dim"),
            dense_inter=_int(cfg, "intermediate_size") if any_dense else 0,
            first_dense=first_dense,
            experts=_int(cfg, "n_routed_experts") if any_moe else 0,
            shared=_int(cfg, "n_shared_experts", 0, minimum=0) if any_moe else 0,
            moe_inter=_int(cfg, "moe_intermediate_size") if any_moe else 0,
        )


def _block_size(cfg: Mapping[str, Any]) -> tuple[int, int] | None:
    """FP8 block shape from `quantization_config`, or None for an unquantised (BF16) checkpoint."""
    q = cfg.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, Mapping):
        raise TypeError(f"quantization_config: expected a mapping, got {type(q).__name__}")
    if q.get("quant_method") != "fp8":
        raise ValueError(
            f"quantization_config.quant_method: {q.get('quant_method')!r} is not supported (expected 'fp8')"
        )
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt: {fmt!r} is not supported (expected 'e4m3')")
    block = q.get("weight_block_size", [128, 128])
    if (
        not isinstance(block, (list, tuple))
        or len(block) != 2
        or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in block)
    ):
        raise ValueError(f"quantization_config.weight_block_size: expected two positive ints, got {block!r}")
    return (block[0], block[1])


class _Emitter(TensorEmitter):
    def __init__(self, rng_factory: RngFactory, block: tuple[int, int] | None) -> None:
        super().__init__(rng_factory)
        self._block = block

    def bf16_linear(self, name: str, out_dim: int, in_dim: int) -> None:
        """A weight that V3 checkpoints keep in BF16 even when quantised (router, heads, MTP `eh_proj`)."""
        self._put(name, self._gaussian_bf16(name, out_dim, in_dim))

    def linear(self, name: str, out_dim: int, in_dim: int) -> None:
        """A projection that FP8 checkpoints store as E4M3 `weight` + float32 `weight_scale_inv`."""
        w = self._gaussian_bf16(name, out_dim, in_dim)
        if self._block is None:
            self._put(name, w)
            return
        q, scale_inv = host.quantize_fp8_blockwise(
            w.astype(np.float32), block=self._block, scale_fmt="float32"
        )
        self._put(name, q)
        self._put(f"{name.removesuffix('.weight')}.weight_scale_inv", scale_inv)

    def embedding(self, name: str, rows: int, cols: int) -> None:
        self._put(name, self._normal(name, (rows, cols)).astype(_BF16))

    def norm(self, name: str, width: int) -> None:
        self._put(name, (1.0 + np.float32(_NORM_NOISE) * self._normal(name, (width,))).astype(_BF16))

    def f32_normal(self, name: str, shape: tuple[int, ...], std: float) -> None:
        self._put(name, self._normal(name, shape) * np.float32(std))


def _decoder_layer(em: _Emitter, s: _V3Shapes, layer: int) -> None:
    p = f"model.layers.{layer}."
    a = f"{p}self_attn."
    qk_dim = s.nope + s.rope
    em.norm(f"{p}input_layernorm.weight", s.hidden)
    em.norm(f"{p}post_attention_layernorm.weight", s.hidden)
    if s.q_rank is None:
        em.linear(f"{a}q_proj.weight", s.heads * qk_dim, s.hidden)
    else:
        em.linear(f"{a}q_a_proj.weight", s.q_rank, s.hidden)
        em.norm(f"{a}q_a_layernorm.weight", s.q_rank)
        em.linear(f"{a}q_b_proj.weight", s.heads * qk_dim, s.q_rank)
    em.linear(f"{a}kv_a_proj_with_mqa.weight", s.kv_rank + s.rope, s.hidden)
    em.norm(f"{a}kv_a_layernorm.weight", s.kv_rank)
    em.linear(f"{a}kv_b_proj.weight", s.heads * (s.nope + s.v_dim), s.kv_rank)
    em.linear(f"{a}o_proj.weight", s.hidden, s.heads * s.v_dim)

    mlp = f"{p}mlp."
    if layer < s.first_dense:
        em.linear(f"{mlp}gate_proj.weight", s.dense_inter, s.hidden)
        em.linear(f"{mlp}up_proj.weight", s.dense_inter, s.hidden)
        em.linear(f"{mlp}down_proj.weight", s.hidden, s.dense_inter)
        return
    em.bf16_linear(f"{mlp}gate.weight", s.experts, s.hidden)
    em.f32_normal(f"{mlp}gate.e_score_correction_bias", (s.experts,), _GATE_BIAS_STD)
    for e in range(s.experts):
        em.linear(f"{mlp}experts.{e}.gate_proj.weight", s.moe_inter, s.hidden)
        em.linear(f"{mlp}experts.{e}.up_proj.weight", s.moe_inter, s.hidden)
        em.linear(f"{mlp}experts.{e}.down_proj.weight", s.hidden, s.moe_inter)
    if s.shared:
        width = s.shared * s.moe_inter
        em.linear(f"{mlp}shared_experts.gate_proj.weight", width, s.hidden)
        em.linear(f"{mlp}shared_experts.up_proj.weight", width, s.hidden)
        em.linear(f"{mlp}shared_experts.down_proj.weight", s.hidden, width)


def generate_v3_weights(hf_config: Mapping[str, Any], rng_factory: RngFactory) -> dict[str, np.ndarray]:
    """The full DeepSeek-V3 tensor manifest for `hf_config` (flat HF keys), with random values.

    Args:
      hf_config: the raw `config.json` dict.
      rng_factory: `name -> numpy.random.Generator`, one independent stream per tensor name.

    Returns:
      HF tensor name -> array in its storage dtype (`bfloat16`, `float32`, and `float8_e4m3fn` weights with
      float32 `weight_scale_inv` when the config is FP8-quantised).
    """
    if not isinstance(hf_config, Mapping):
        raise TypeError(f"config: expected a mapping, got {type(hf_config).__name__}")
    s = _V3Shapes.from_config(hf_config)
    em = _Emitter(rng_factory, _block_size(hf_config))
    em.embedding("model.embed_tokens.weight", s.vocab, s.hidden)
    em.norm("model.norm.weight", s.hidden)
    em.bf16_linear("lm_head.weight", s.vocab, s.hidden)
    for layer in range(s.layers):
        _decoder_layer(em, s, layer)
    for i in range(s.mtp_layers):
        layer = s.layers + i
        p = f"model.layers.{layer}."
        em.embedding(f"{p}embed_tokens.weight", s.vocab, s.hidden)
        em.norm(f"{p}enorm.weight", s.hidden)
        em.norm(f"{p}hnorm.weight", s.hidden)
        em.bf16_linear(f"{p}eh_proj.weight", s.hidden, 2 * s.hidden)
        em.norm(f"{p}shared_head.norm.weight", s.hidden)
        em.bf16_linear(f"{p}shared_head.head.weight", s.vocab, s.hidden)
        _decoder_layer(em, s, layer)
    return em.tensors
