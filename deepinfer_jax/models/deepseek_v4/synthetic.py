"""Deterministic random weights in the DeepSeek-V4 and DeepSeek-V4.1 checkpoint layouts.

The built-in tiny models (`deepinfer_jax.models.builtin`) need a complete checkpoint without anyone downloading
one. The two generators here turn a raw HF `config.json` dict into the full tensor manifest a real checkpoint of
that shape would carry - every name, shape and storage dtype - filled with random values:

* `generate_v41_weights`: DeepSeek-V4.1 (`model_type = "deepseek_v41"`, keys nested under `text_config`),
  exactly the contract of `spec/model.md` §13: FP8 E4M3 linears with 32x32 UE8M0 `.scale` blocks, MXFP4 routed
  experts (packed `U8` + `F8_E8M0` scales), F32 hyper-connection tensors / sinks / gate biases, BF16 norms and
  the BF16 side projections; per-layer presence follows the layer's roles (KV source, index source, index-K
  source, ratio 1 vs 2, Engram layer) and the draft layers `mtp.{i}`.
* `generate_v4_weights`: DeepSeek-V4 (`model_type = "deepseek_v4"`, flat keys) under the DeepSeek-native names
  (`layers.N.attn.wq_a.weight`, ...) that real V4 checkpoints use and that transformers 5.24 renames on load:
  CSA layers with overlapping-window compressors (`2·D`-wide `wkv`/`wgate`, `ape [ratio, 2·D]`) and a lightning
  indexer with its own compressor, HCA layers with a plain compressor, hash-routed MoE layers with `tid2eid`.

Values follow `spec/model.md` §15.4: linear weights are Gaussian scaled by `in^(-1/2)`, rounded to BF16 and then
quantised to the checkpoint format; norm weights scatter around 1; hyper-connection parameters start from the
§6.6 training initialisation plus noise (so mixing is near, but never exactly, the identity); sinks are N(0, 1);
gate biases are small. Every parameter that a default initialisation would leave at 0 or 1 is randomised, so no
code path of a model under test degenerates into an identity.

Every tensor is drawn from its own random stream, `rng_factory(name)`, so adding or removing one tensor never
changes the bytes of another, and the values depend only on NumPy (never on JAX).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from deepinfer_jax.models.synthetic_base import BF16, RngFactory, TensorEmitter
from deepinfer_jax.numerics import host

__all__ = [
    "V4_GENERATOR_VERSION",
    "V41_GENERATOR_VERSION",
    "engram_table_sizes",
    "generate_v4_weights",
    "generate_v41_weights",
]

# Bump when the values or the layout a generator emits change: the built-in model cache keys on it.
V41_GENERATOR_VERSION = "deepseek_v41-synthetic-1"
V4_GENERATOR_VERSION = "deepseek_v4-synthetic-1"

_BF16 = BF16
_F32 = np.dtype(np.float32)

# mHC training initialisation (spec/model.md §2.4, §6.6); only used to centre the random values.
_HC_PRE_INIT = 3.0
_HC_RES_INIT = 3.0
_HC_SCALE_CENTRE = 0.3  # larger than the training init (0.01) so the input-dependent part of the mix matters
_NORM_NOISE = 0.1
_GATE_BIAS_STD = 0.1
_APE_STD = 0.5
_MISSING = object()


# ---------------------------------------------------------------------------------------------------------------
# Reading the raw config dict


class _Fields:
    """Typed access to one level of an HF config dict; errors name the key path, the value and the limit."""

    def __init__(self, mapping: Any, where: str) -> None:
        if not isinstance(mapping, Mapping):
            raise TypeError(f"{where or 'config'}: expected a mapping, got {type(mapping).__name__}")
        self._m = mapping
        self._where = where

    def path(self, key: str) -> str:
        return f"{self._where}.{key}" if self._where else key

    def has(self, key: str) -> bool:
        return self._m.get(key) is not None

    def raw(self, key: str, default: Any = None) -> Any:
        value = self._m.get(key)
        return default if value is None else value

    def int(self, key: str, default: Any = _MISSING, *, minimum: int = 1) -> int:
        value = self._m.get(key)
        if value is None:
            if default is _MISSING:
                raise ValueError(f"{self.path(key)}: required key is missing")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{self.path(key)}: expected an int, got {value!r} ({type(value).__name__})")
        if value < minimum:
            raise ValueError(f"{self.path(key)}: {value} is below the minimum {minimum}")
        return value

    def int_list(self, key: str, default: Any = _MISSING) -> list[int]:
        value = self._m.get(key)
        if value is None:
            if default is _MISSING:
                raise ValueError(f"{self.path(key)}: required key is missing")
            return list(default)
        if not isinstance(value, (list, tuple)) or any(
            isinstance(v, bool) or not isinstance(v, int) for v in value
        ):
            raise TypeError(f"{self.path(key)}: expected a list of ints, got {value!r}")
        return list(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self._m.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise TypeError(f"{self.path(key)}: expected a bool, got {value!r} ({type(value).__name__})")
        return value

    def sub(self, key: str) -> _Fields:
        if key not in self._m:
            raise ValueError(f"{self.path(key)}: required section is missing")
        return _Fields(self._m[key], self.path(key))


def _check_layer_ids(fields: _Fields, key: str, ids: Sequence[int], num_layers: int) -> None:
    for i in ids:
        if not 0 <= i < num_layers:
            raise ValueError(f"{fields.path(key)}: layer id {i} is outside [0, {num_layers})")


@dataclass(frozen=True)
class _WeightFormat:
    """How linear weights are stored: FP8 with UE8M0 block scales (and MXFP4 experts), or unquantised."""

    fp8_block: tuple[int, int] | None  # None: unquantised BF16 linears
    expert_fp4: bool

    @staticmethod
    def from_config(hf_config: _Fields) -> _WeightFormat:
        if not hf_config.has("quantization_config"):
            return _WeightFormat(fp8_block=None, expert_fp4=False)
        q = hf_config.sub("quantization_config")
        method = q.raw("quant_method")
        if method != "fp8":
            raise ValueError(f"{q.path('quant_method')}: {method!r} is not supported (expected 'fp8')")
        scale_fmt = q.raw("scale_fmt", "ue8m0")
        if scale_fmt != "ue8m0":
            raise ValueError(f"{q.path('scale_fmt')}: {scale_fmt!r} is not supported (expected 'ue8m0')")
        block = q.int_list("weight_block_size", [32, 32])
        if len(block) != 2 or min(block) < 1:
            raise ValueError(f"{q.path('weight_block_size')}: expected two positive ints, got {block!r}")
        expert_dtype = q.raw("expert_dtype", "fp8")
        if expert_dtype not in ("fp4", "fp8"):
            raise ValueError(
                f"{q.path('expert_dtype')}: {expert_dtype!r} is not supported (expected 'fp4' or 'fp8')"
            )
        return _WeightFormat(fp8_block=(block[0], block[1]), expert_fp4=expert_dtype == "fp4")


# ---------------------------------------------------------------------------------------------------------------
# Drawing tensors


class _Emitter(TensorEmitter):
    """Draws each named tensor from its own stream and stores it in its checkpoint format."""

    def __init__(self, rng_factory: RngFactory, fmt: _WeightFormat, norm_dtype: np.dtype) -> None:
        super().__init__(rng_factory)
        self.fmt = fmt
        self._norm_dtype = norm_dtype

    def bf16_linear(self, prefix: str, out_dim: int, in_dim: int) -> None:
        """A linear layer that the checkpoint always keeps in BF16 (gate, compressor, indexer side paths)."""
        self._put(f"{prefix}.weight", self._gaussian_bf16(f"{prefix}.weight", out_dim, in_dim))

    def linear(self, prefix: str, out_dim: int, in_dim: int) -> None:
        """A projection that is FP8 block-scaled in quantised checkpoints (`.weight` E4M3 + `.scale` UE8M0)."""
        w = self._gaussian_bf16(f"{prefix}.weight", out_dim, in_dim)
        if self.fmt.fp8_block is None:
            self._put(f"{prefix}.weight", w)
            return
        q, scale = host.quantize_fp8_blockwise(
            w.astype(np.float32), block=self.fmt.fp8_block, scale_fmt="ue8m0"
        )
        self._put(f"{prefix}.weight", q)
        self._put(f"{prefix}.scale", scale)

    def expert_linear(self, prefix: str, out_dim: int, in_dim: int) -> None:
        """A routed-expert matrix: MXFP4 (packed `[out, in/2]` + `[out, in/32]` scales) when configured."""
        if not self.fmt.expert_fp4:
            self.linear(prefix, out_dim, in_dim)
            return
        if in_dim % 32:
            raise ValueError(
                f"{prefix}.weight: MXFP4 experts need an input width divisible by 32, got {in_dim} "
                "(hidden_size / moe_intermediate_size)"
            )
        w = self._gaussian_bf16(f"{prefix}.weight", out_dim, in_dim)
        packed, scale = host.quantize_mxfp4(w.astype(np.float32))
        self._put(f"{prefix}.weight", packed)
        self._put(f"{prefix}.scale", scale)

    def embedding(self, name: str, rows: int, cols: int) -> None:
        self._put(name, self._normal(name, (rows, cols)).astype(_BF16))

    def fp8_table(self, prefix: str, rows: int, cols: int) -> None:
        """An Engram n-gram table: E4M3 rows with one UE8M0 scale per row and 32 columns (§12.1.3), or BF16."""
        t = self._normal(f"{prefix}.weight", (rows, cols)).astype(_BF16)
        if self.fmt.fp8_block is None:
            self._put(f"{prefix}.weight", t)
            return
        if cols % 32:
            raise ValueError(f"{prefix}.weight: FP8 Engram rows need a width divisible by 32, got {cols}")
        q, scale = host.quantize_fp8_blockwise(t.astype(np.float32), block=(1, 32), scale_fmt="ue8m0")
        self._put(f"{prefix}.weight", q)
        self._put(f"{prefix}.scale", scale)

    def norm(self, name: str, width: int) -> None:
        w = 1.0 + np.float32(_NORM_NOISE) * self._normal(name, (width,))
        self._put(name, w.astype(self._norm_dtype))

    def around_one(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> None:
        w = 1.0 + np.float32(_NORM_NOISE) * self._normal(name, shape)
        self._put(name, w.astype(dtype))

    def f32_normal(self, name: str, shape: tuple[int, ...], std: float) -> None:
        self._put(name, self._normal(name, shape) * np.float32(std))

    def tid2eid(self, name: str, vocab: int, experts: int, top_k: int) -> None:
        """Hash routing table: `top_k` distinct experts per token id (int64, as transformers stores it)."""
        if top_k > experts:
            raise ValueError(f"{name}: num_experts_per_tok {top_k} exceeds n_routed_experts {experts}")
        rng = self._rngs(name)
        table = rng.permuted(np.tile(np.arange(experts, dtype=np.int64), (vocab, 1)), axis=1)[:, :top_k]
        self._put(name, table)

    def hc_mix(self, prefix: str, sub: str, m: int, hidden: int, ell: int) -> None:
        """`hc_{sub}_{fn,base,scale}` of one sub-layer (§6.1), centred on the §6.6 init for layer index `ell`."""
        channels = m * (m + 2)
        base = np.concatenate(
            [
                np.full(m, -_HC_PRE_INIT, np.float32),
                np.zeros(m, np.float32),
                np.where(np.eye(m, dtype=bool), _HC_RES_INIT, -_HC_RES_INIT).astype(np.float32).ravel(),
            ]
        )
        base[ell % m] = _HC_PRE_INIT
        base += np.float32(0.5) * self._normal(f"{prefix}hc_{sub}_base", (channels,))
        # With `fn ~ N(0, 1/(m·H))` the mix logits of a unit-RMS stream state are ~N(0, 1) before `scale`.
        fn = self._normal(f"{prefix}hc_{sub}_fn", (channels, m * hidden)) * np.float32((m * hidden) ** -0.5)
        scale = _HC_SCALE_CENTRE * (1.0 + 0.25 * self._normal(f"{prefix}hc_{sub}_scale", (3,)))
        self._put(f"{prefix}hc_{sub}_fn", fn)
        self._put(f"{prefix}hc_{sub}_base", base.astype(np.float32))
        self._put(f"{prefix}hc_{sub}_scale", scale.astype(np.float32))

    def hc_head(self, prefix: str, m: int, hidden: int, ell: int) -> None:
        """`hc_head_{fn,base,scale}`: the stream collapse of the non-shifted schedule (§6.5, §6.6)."""
        base = np.full(m, -_HC_PRE_INIT, np.float32)
        base[ell % m] = _HC_PRE_INIT
        base += np.float32(0.5) * self._normal(f"{prefix}hc_head_base", (m,))
        fn = self._normal(f"{prefix}hc_head_fn", (m, m * hidden)) * np.float32((m * hidden) ** -0.5)
        scale = _HC_SCALE_CENTRE * (1.0 + 0.25 * self._normal(f"{prefix}hc_head_scale", (1,)))
        self._put(f"{prefix}hc_head_fn", fn)
        self._put(f"{prefix}hc_head_base", base.astype(np.float32))
        self._put(f"{prefix}hc_head_scale", scale.astype(np.float32))


# ---------------------------------------------------------------------------------------------------------------
# Shapes shared by V4 and V4.1


@dataclass(frozen=True)
class _Core:
    vocab: int
    hidden: int
    layers: int
    heads: int
    head_dim: int
    q_rank: int
    o_groups: int
    o_rank: int
    hc: int
    experts: int
    shared: int
    top_k: int
    inter: int

    @staticmethod
    def from_fields(tc: _Fields) -> _Core:
        core = _Core(
            vocab=tc.int("vocab_size"),
            hidden=tc.int("hidden_size"),
            layers=tc.int("num_hidden_layers"),
            heads=tc.int("num_attention_heads"),
            head_dim=tc.int("head_dim"),
            q_rank=tc.int("q_lora_rank"),
            o_groups=tc.int("o_groups"),
            o_rank=tc.int("o_lora_rank"),
            hc=tc.int("hc_mult"),
            experts=tc.int("n_routed_experts"),
            shared=tc.int("n_shared_experts", 0, minimum=0),
            top_k=tc.int("num_experts_per_tok"),
            inter=tc.int("moe_intermediate_size"),
        )
        if core.heads % core.o_groups:
            raise ValueError(
                f"{tc.path('o_groups')}: {core.o_groups} does not divide num_attention_heads {core.heads}"
            )
        if core.top_k > core.experts:
            raise ValueError(
                f"{tc.path('num_experts_per_tok')}: {core.top_k} exceeds n_routed_experts {core.experts}"
            )
        return core


def _attention_core(em: _Emitter, p: str, c: _Core) -> None:
    """Query path, window K=V projection, grouped output projection and sinks (every layer of V4 and V4.1)."""
    em.linear(f"{p}attn.wq_a", c.q_rank, c.hidden)
    em.norm(f"{p}attn.q_norm.weight", c.q_rank)
    em.linear(f"{p}attn.wq_b", c.heads * c.head_dim, c.q_rank)
    em.linear(f"{p}attn.wkv", c.head_dim, c.hidden)
    em.norm(f"{p}attn.kv_norm.weight", c.head_dim)
    em.linear(f"{p}attn.wo_a", c.o_groups * c.o_rank, (c.heads // c.o_groups) * c.head_dim)
    em.linear(f"{p}attn.wo_b", c.hidden, c.o_groups * c.o_rank)
    em.f32_normal(f"{p}attn.attn_sink", (c.heads,), 1.0)


def _v41_moe(em: _Emitter, p: str, c: _Core, experts: int) -> None:
    """V4.1 MoE: router weight, selection bias and the image-token selection bias, then the experts."""
    em.bf16_linear(f"{p}ffn.gate", experts, c.hidden)
    em.f32_normal(f"{p}ffn.gate.bias", (experts,), _GATE_BIAS_STD)
    em.f32_normal(f"{p}ffn.gate.bias_vl", (experts,), _GATE_BIAS_STD)
    _experts(em, p, c, experts)


def _experts(em: _Emitter, p: str, c: _Core, experts: int) -> None:
    for e in range(experts):
        em.expert_linear(f"{p}ffn.experts.{e}.w1", c.inter, c.hidden)
        em.expert_linear(f"{p}ffn.experts.{e}.w2", c.hidden, c.inter)
        em.expert_linear(f"{p}ffn.experts.{e}.w3", c.inter, c.hidden)
    if c.shared:
        width = c.shared * c.inter
        em.linear(f"{p}ffn.shared_experts.w1", width, c.hidden)
        em.linear(f"{p}ffn.shared_experts.w2", c.hidden, width)
        em.linear(f"{p}ffn.shared_experts.w3", width, c.hidden)


def _block_common(em: _Emitter, p: str, c: _Core, ell: int) -> None:
    em.norm(f"{p}attn_norm.weight", c.hidden)
    em.norm(f"{p}ffn_norm.weight", c.hidden)
    em.hc_mix(p, "attn", c.hc, c.hidden, ell)
    em.hc_mix(p, "ffn", c.hc, c.hidden, ell)
    _attention_core(em, p, c)


# ---------------------------------------------------------------------------------------------------------------
# DeepSeek-V4.1


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def engram_table_sizes(
    layer_ids: Sequence[int], max_ngram: int, n_heads: int, vocab_size: int
) -> list[list[list[int]]]:
    """Per Engram layer, per n-gram order `2..max_ngram`, per hash head: the distinct prime table sizes (§9.3).

    Layers are walked in config order, then orders, then heads; each order restarts its search at
    `vocab_size - 1` and takes the next prime above the running start that no earlier table has used.
    """
    if max_ngram < 2:
        raise ValueError(f"engram_max_ngram_size: {max_ngram} is below the minimum 2")
    used: set[int] = set()
    sizes: list[list[list[int]]] = []
    for _ in layer_ids:
        per_order: list[list[int]] = []
        for _order in range(2, max_ngram + 1):
            start = vocab_size - 1
            heads: list[int] = []
            for _head in range(n_heads):
                candidate = start + 1
                while candidate in used or not _is_prime(candidate):
                    candidate += 1
                used.add(candidate)
                heads.append(candidate)
                start = candidate
            per_order.append(heads)
        sizes.append(per_order)
    return sizes


@dataclass(frozen=True)
class _Engram:
    """Engram tables per layer: row counts (`engram_num_embeddings`, checked against §9.3) and widths."""

    rows: dict[int, int]
    head_dim: int
    width: int  # input width of `engram.wkv`: (Nmax - 1) orders x Ne heads x De

    @staticmethod
    def from_fields(tc: _Fields, c: _Core) -> _Engram:
        layers = tc.int_list("engram_layer_ids", [])
        _check_layer_ids(tc, "engram_layer_ids", layers, c.layers)
        if not layers:
            return _Engram(rows={}, head_dim=0, width=0)
        if c.hc < 2:
            raise ValueError(f"{tc.path('hc_mult')}: Engram needs at least 2 streams, got {c.hc}")
        max_ngram = tc.int("engram_max_ngram_size", minimum=2)
        heads = tc.int("engram_n_heads")
        head_dim = tc.int("engram_head_dim")
        sizes = engram_table_sizes(layers, max_ngram, heads, tc.int("engram_vocab_size"))
        derived = [sum(sum(order) for order in layer) for layer in sizes]
        declared = tc.int_list("engram_num_embeddings", derived)
        if declared != derived:
            raise ValueError(
                f"{tc.path('engram_num_embeddings')}: {declared} does not match the table sizes derived from "
                f"engram_vocab_size / engram_n_heads / engram_max_ngram_size ({derived})"
            )
        return _Engram(
            rows=dict(zip(layers, declared, strict=True)),
            head_dim=head_dim,
            width=(max_ngram - 1) * heads * head_dim,
        )


def _source_layers(tc: _Fields, key: str, default: Iterable[int] | None, num_layers: int) -> set[int]:
    ids = tc.int_list(key, default if default is not None else _MISSING)
    _check_layer_ids(tc, key, ids, num_layers)
    return set(ids)


def generate_v41_weights(hf_config: Mapping[str, Any], rng_factory: RngFactory) -> dict[str, np.ndarray]:
    """The full DeepSeek-V4.1 tensor manifest (`spec/model.md` §13) for `hf_config`, with random values.

    Args:
      hf_config: the raw `config.json` dict (model keys nested under `text_config`).
      rng_factory: `name -> numpy.random.Generator`, one independent stream per tensor name.

    Returns:
      HF tensor name -> array in its storage dtype (`float8_e4m3fn`, `float8_e8m0fnu`, `uint8`, `bfloat16`,
      `float32`).
    """
    top = _Fields(hf_config, "")
    tc = top.sub("text_config")
    c = _Core.from_fields(tc)
    fmt = _WeightFormat.from_config(top)
    em = _Emitter(rng_factory, fmt, _BF16)

    num_layers = c.layers
    num_draft = tc.int("num_nextn_predict_layers", 0, minimum=0)
    ratios = tc.int_list("compress_ratios")
    if len(ratios) != num_layers + num_draft:
        raise ValueError(
            f"{tc.path('compress_ratios')}: has {len(ratios)} entries, expected num_hidden_layers + "
            f"num_nextn_predict_layers = {num_layers + num_draft}"
        )
    for layer, r in enumerate(ratios):
        if r not in (0, 1, 2):
            raise ValueError(f"{tc.path('compress_ratios')}[{layer}]: ratio {r} is not one of 0, 1, 2")

    kv_sources = _source_layers(tc, "kv_source_layer_ids", None, num_layers)
    index_sources = _source_layers(tc, "index_source_layer_ids", None, num_layers)
    # The index-K default is the KV-source list, not the index-source list (§2.3).
    index_k_sources = _source_layers(tc, "index_k_source_layer_ids", sorted(kv_sources), num_layers)
    compressed = any(r > 0 for r in ratios[:num_layers])
    index_heads = tc.int("index_n_heads") if compressed else 0
    index_dim = tc.int("index_head_dim") if compressed else 0

    engram = _Engram.from_fields(tc, c)

    shifted = tc.bool("hc_shifted", True)
    m, hidden = c.hc, c.hidden

    em.embedding("embed.weight", c.vocab, hidden)
    em.norm("norm.weight", hidden)
    em.bf16_linear("head", c.vocab, hidden)
    if not shifted:
        em.hc_head("", m, hidden, num_layers)

    for layer in range(num_layers):
        p = f"layers.{layer}."
        r = ratios[layer]
        _block_common(em, p, c, layer)
        if r > 0 and layer in kv_sources:
            em.bf16_linear(f"{p}attn.compressor.wkv", c.head_dim, hidden)
            if r == 2:
                em.bf16_linear(f"{p}attn.compressor.wgate", c.head_dim, hidden)
            em.norm(f"{p}attn.compressor.norm.weight", c.head_dim)
        if r > 0 and layer in index_sources:
            em.linear(f"{p}attn.indexer.wq_b", index_heads * index_dim, c.q_rank)
            em.bf16_linear(f"{p}attn.indexer.weights_proj", index_heads, hidden)
        if r > 0 and layer in index_k_sources:
            em.bf16_linear(f"{p}attn.indexer.wk", index_dim, c.head_dim)
            em.norm(f"{p}attn.indexer.k_norm.weight", index_dim)
        _v41_moe(em, p, c, c.experts)
        if layer in engram.rows:
            em.fp8_table(f"{p}engram.embed", engram.rows[layer], engram.head_dim)
            em.linear(f"{p}engram.wkv", (m + 1) * hidden, engram.width)
            em.around_one(f"{p}engram.q_weight", (m, hidden), _BF16)
            em.around_one(f"{p}engram.k_weight", (m, hidden), _BF16)

    if num_draft:
        _draft_layers(em, tc, c, num_draft, shifted=shifted)
    return em.tensors


def _draft_layers(em: _Emitter, tc: _Fields, c: _Core, num_draft: int, *, shifted: bool) -> None:
    """`mtp.{i}`: SWA-only HC blocks with the draft expert count, plus the drafter's own heads (§13.4)."""
    targets = tc.int_list("dspark_target_layer_ids")
    _check_layer_ids(tc, "dspark_target_layer_ids", targets, c.layers)
    if not targets:
        raise ValueError(f"{tc.path('dspark_target_layer_ids')}: draft layers need at least one target layer")
    markov_rank = tc.int("dspark_markov_rank")
    draft_experts = tc.int("dspark_n_routed_experts", c.experts)
    hidden = c.hidden
    for i in range(num_draft):
        p = f"mtp.{i}."
        _block_common(em, p, c, c.layers + i + 1)
        _v41_moe(em, p, c, draft_experts)
        if i == 0:
            em.linear(f"{p}main_proj", hidden, len(targets) * hidden)
            em.norm(f"{p}main_norm.weight", hidden)
        if i == num_draft - 1:
            em.norm(f"{p}norm.weight", hidden)
            em.embedding(f"{p}markov_head.embed.weight", c.vocab, markov_rank)
            em.bf16_linear(f"{p}markov_head.head", c.vocab, markov_rank)
            em.bf16_linear(f"{p}confidence_head.proj", 1, hidden + markov_rank)
            if not shifted:
                em.hc_head(p, c.hc, hidden, c.layers + num_draft)


# ---------------------------------------------------------------------------------------------------------------
# DeepSeek-V4

_SLIDING = "sliding_attention"
_CSA = "compressed_sparse_attention"
_HCA = "heavily_compressed_attention"


def _v4_compress_rates(tc: _Fields) -> dict[str, int]:
    rates = {_CSA: 4, _HCA: 128}
    if tc.has("compress_rates"):
        given = tc.sub("compress_rates")
        for kind in (_CSA, _HCA):
            rates[kind] = given.int(kind, rates[kind])
    rates[_CSA] = tc.int("compress_rate_csa", rates[_CSA])
    rates[_HCA] = tc.int("compress_rate_hca", rates[_HCA])
    return rates


def _v4_layer_types(tc: _Fields, num_layers: int, rates: Mapping[str, int]) -> list[str]:
    """Per-layer attention kind from `layer_types`, else legacy `compress_ratios`, else transformers' default."""
    if tc.has("layer_types"):
        types = list(tc.raw("layer_types"))
        for layer, kind in enumerate(types):
            if kind not in (_SLIDING, _CSA, _HCA):
                raise ValueError(
                    f"{tc.path('layer_types')}[{layer}]: {kind!r} is not one of {_SLIDING}, {_CSA}, {_HCA}"
                )
    elif tc.has("compress_ratios"):
        if rates[_CSA] == rates[_HCA]:
            raise ValueError(
                f"{tc.path('compress_ratios')}: CSA and HCA share the rate {rates[_CSA]}, so a ratio cannot "
                "name a layer kind; give layer_types instead"
            )
        by_ratio = {0: _SLIDING, rates[_CSA]: _CSA, rates[_HCA]: _HCA}
        types = []
        for layer, r in enumerate(tc.int_list("compress_ratios")):
            if r not in by_ratio:
                raise ValueError(
                    f"{tc.path('compress_ratios')}[{layer}]: ratio {r} is none of 0, {rates[_CSA]} (CSA), "
                    f"{rates[_HCA]} (HCA)"
                )
            types.append(by_ratio[r])
    else:
        # transformers 5.24 default: two HCA layers, then CSA and HCA alternating.
        types = [_HCA] * min(num_layers, 2) + [_CSA if i % 2 else _HCA for i in range(max(num_layers - 2, 0))]
    if len(types) < num_layers:
        raise ValueError(
            f"{tc.path('layer_types')}: {len(types)} entries for num_hidden_layers = {num_layers}"
        )
    return types[:num_layers]


def _v4_mlp_types(tc: _Fields, num_layers: int) -> list[str]:
    if tc.has("mlp_layer_types"):
        types = list(tc.raw("mlp_layer_types"))
        for layer, kind in enumerate(types):
            if kind not in ("hash_moe", "moe"):
                raise ValueError(
                    f"{tc.path('mlp_layer_types')}[{layer}]: {kind!r} is not 'hash_moe' or 'moe'"
                )
        if len(types) < num_layers:
            raise ValueError(
                f"{tc.path('mlp_layer_types')}: {len(types)} entries for num_hidden_layers = {num_layers}"
            )
        return types[:num_layers]
    num_hash = tc.int("num_hash_layers", 3, minimum=0)  # transformers 5.24's default
    return ["hash_moe" if layer < num_hash else "moe" for layer in range(num_layers)]


def _v4_compressor(em: _Emitter, p: str, width: int, hidden: int, ratio: int, *, overlap: bool) -> None:
    """A V4 compressor: `wkv`/`wgate` (two series when windows overlap), the position bias `ape`, the norm."""
    series = 2 if overlap else 1
    em.bf16_linear(f"{p}.wkv", series * width, hidden)
    em.bf16_linear(f"{p}.wgate", series * width, hidden)
    em.f32_normal(f"{p}.ape", (ratio, series * width), _APE_STD)
    em.norm(f"{p}.norm.weight", width)


def generate_v4_weights(hf_config: Mapping[str, Any], rng_factory: RngFactory) -> dict[str, np.ndarray]:
    """The DeepSeek-V4 tensor manifest for `hf_config` under DeepSeek-native names, with random values.

    Norm weights, hyper-connection tensors, sinks, compressor position biases and gate biases are float32 (the
    dtypes transformers keeps in float32 inside a bf16 model); other weights are BF16, or FP8 / MXFP4 when the
    config carries a `quantization_config`. `mtp.*` draft tensors are not generated: no V4 reference reads them.
    """
    tc = _Fields(hf_config, "")
    c = _Core.from_fields(tc)
    em = _Emitter(rng_factory, _WeightFormat.from_config(tc), _F32)
    rates = _v4_compress_rates(tc)
    layer_types = _v4_layer_types(tc, c.layers, rates)
    mlp_types = _v4_mlp_types(tc, c.layers)
    index_heads = tc.int("index_n_heads") if _CSA in layer_types else 0
    index_dim = tc.int("index_head_dim") if _CSA in layer_types else 0
    m, hidden = c.hc, c.hidden

    em.embedding("embed.weight", c.vocab, hidden)
    em.norm("norm.weight", hidden)
    em.bf16_linear("head", c.vocab, hidden)
    em.hc_head("", m, hidden, c.layers)
    for layer in range(c.layers):
        p = f"layers.{layer}."
        _block_common(em, p, c, layer)
        kind = layer_types[layer]
        if kind == _CSA:
            _v4_compressor(em, f"{p}attn.compressor", c.head_dim, hidden, rates[_CSA], overlap=True)
            _v4_compressor(em, f"{p}attn.indexer.compressor", index_dim, hidden, rates[_CSA], overlap=True)
            em.linear(f"{p}attn.indexer.wq_b", index_heads * index_dim, c.q_rank)
            em.bf16_linear(f"{p}attn.indexer.weights_proj", index_heads, hidden)
        elif kind == _HCA:
            _v4_compressor(em, f"{p}attn.compressor", c.head_dim, hidden, rates[_HCA], overlap=False)
        em.bf16_linear(f"{p}ffn.gate", c.experts, hidden)
        if mlp_types[layer] == "hash_moe":
            em.tid2eid(f"{p}ffn.gate.tid2eid", c.vocab, c.experts, c.top_k)
        else:
            em.f32_normal(f"{p}ffn.gate.bias", (c.experts,), _GATE_BIAS_STD)
        _experts(em, p, c, c.experts)
    return em.tensors
