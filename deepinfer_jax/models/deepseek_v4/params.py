"""DeepSeek-V4 checkpoint contract: tensor names (both spellings), expected shapes/dtypes, parameter assembly.

Real V4 checkpoints use DeepSeek's native names (``embed.weight``, ``layers.N.attn.wq_a.weight``, ...); a model
saved by transformers 5.24 spells a few of them differently (``model.embed_tokens.weight``,
``model.layers.N.…``, ``model.hc_head.hc_fn``; spec/oracles.md). :func:`canonical_name` maps either spelling to
the native one, and everything else here speaks native names only.

The parameter tree :func:`assemble_params` builds is plain nested dicts of arrays. Linear weights are dicts whose
keys name their storage format (see :mod:`deepinfer_jax.models.common.linear`): ``{"weight"}`` unquantised,
``{"weight", "scale"}`` FP8 block-scaled (UE8M0 scales), ``{"packed", "scale"}`` MXFP4 routed experts. They stay
in that format; nothing is dequantised here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.checkpoint.deferred import stack_experts
from deepinfer_jax.config.v4 import DeepseekV4Config
from deepinfer_jax.numerics.elements import as_uint8

__all__ = [
    "FLOAT_DTYPES",
    "TRANSFORMERS_ALIASES",
    "assemble_params",
    "canonical_name",
    "checkpoint_contract",
    "compute_dtype",
    "expected_tensors",
    "ignored_tensor",
]

FLOAT_DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32")
_FP8 = ("float8_e4m3fn", "uint8")
_UE8M0 = ("float8_e8m0fnu", "uint8")
_INT = ("int64", "int32")

# transformers' spelling (after removing its "model." prefix) -> native name, for the tensors whose names differ.
TRANSFORMERS_ALIASES: dict[str, str] = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
_MTP = re.compile(r"^(model\.)?mtp\.")
# The window K=V norm: `attn.kv_norm` (as the tiny checkpoints and transformers' save_pretrained write it) or the
# shorter `attn.norm` that transformers' loader also maps onto it.
_SHORT_KV_NORM = re.compile(r"^(layers\.\d+\.attn\.)norm\.weight$")


def canonical_name(name: str) -> str:
    """The DeepSeek-native spelling of a V4 tensor name given in any accepted spelling (``model.`` or not)."""
    bare = name[len("model.") :] if name.startswith("model.") else name
    bare = _SHORT_KV_NORM.sub(r"\1kv_norm.weight", bare)
    return TRANSFORMERS_ALIASES.get(bare, bare)


def _other_spellings(native: str) -> list[str]:
    """Names besides ``native`` (and its ``model.`` form) under which a checkpoint may store the tensor."""
    others = [hf for hf, nat in TRANSFORMERS_ALIASES.items() if nat == native]
    if native.endswith(".attn.kv_norm.weight"):
        others.append(native[: -len("kv_norm.weight")] + "norm.weight")
    return others


def ignored_tensor(name: str) -> bool:
    """Tensors a V4 checkpoint may carry that the model does not read: the MTP draft layers ``mtp.*``."""
    return bool(_MTP.match(name))


def _linear(
    out: dict[str, tuple[tuple[int, ...], tuple[str, ...]]],
    prefix: str,
    rows: int,
    cols: int,
    cfg: DeepseekV4Config,
    *,
    quantised: bool,
    expert: bool = False,
) -> None:
    q = cfg.quantization
    if q is None or not quantised:
        out[f"{prefix}.weight"] = ((rows, cols), FLOAT_DTYPES)
        return
    if expert and q.expert_format == "fp4":
        out[f"{prefix}.weight"] = ((rows, cols // 2), ("int8", "uint8"))
        out[f"{prefix}.scale"] = ((rows, cols // 32), _UE8M0)
        return
    br, bc = q.weight_block_size
    out[f"{prefix}.weight"] = ((rows, cols), _FP8)
    out[f"{prefix}.scale"] = ((-(-rows // br), -(-cols // bc)), _UE8M0)


def expected_tensors(cfg: DeepseekV4Config) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Every tensor the model reads, by native name: ``name -> (shape, accepted dtype names)``.

    Weights the reference keeps in BF16 whatever the checkpoint's quantisation (router gate, compressors,
    indexer weights projection, head) are listed as floats; FP8 projections carry a ``.scale`` beside them.
    """
    h, d, heads = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
    m = cfg.hc_mult
    out: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {
        "embed.weight": ((cfg.vocab_size, h), FLOAT_DTYPES),
        "head.weight": ((cfg.vocab_size, h), FLOAT_DTYPES),
        "norm.weight": ((h,), FLOAT_DTYPES),
        "hc_head_fn": ((m, m * h), FLOAT_DTYPES),
        "hc_head_base": ((m,), FLOAT_DTYPES),
        "hc_head_scale": ((1,), FLOAT_DTYPES),
    }
    channels = m * (m + 2)
    for i, kind in enumerate(cfg.layer_types):
        p = f"layers.{i}."
        for sub in ("attn", "ffn"):
            out[f"{p}{sub}_norm.weight"] = ((h,), FLOAT_DTYPES)
            out[f"{p}hc_{sub}_fn"] = ((channels, m * h), FLOAT_DTYPES)
            out[f"{p}hc_{sub}_base"] = ((channels,), FLOAT_DTYPES)
            out[f"{p}hc_{sub}_scale"] = ((3,), FLOAT_DTYPES)
        a = f"{p}attn."
        _linear(out, f"{a}wq_a", cfg.q_lora_rank, h, cfg, quantised=True)
        out[f"{a}q_norm.weight"] = ((cfg.q_lora_rank,), FLOAT_DTYPES)
        _linear(out, f"{a}wq_b", heads * d, cfg.q_lora_rank, cfg, quantised=True)
        _linear(out, f"{a}wkv", d, h, cfg, quantised=True)
        out[f"{a}kv_norm.weight"] = ((d,), FLOAT_DTYPES)
        group_in = (heads // cfg.o_groups) * d
        _linear(out, f"{a}wo_a", cfg.o_groups * cfg.o_lora_rank, group_in, cfg, quantised=True)
        _linear(out, f"{a}wo_b", h, cfg.o_groups * cfg.o_lora_rank, cfg, quantised=True)
        out[f"{a}attn_sink"] = ((heads,), FLOAT_DTYPES)
        if kind != "sliding_attention":
            ratio = cfg.compress_ratios[i]
            series = 2 if kind == "compressed_sparse_attention" else 1
            _compressor(out, f"{a}compressor", d, h, ratio, series)
        if kind == "compressed_sparse_attention":
            assert cfg.index_n_heads is not None and cfg.index_head_dim is not None
            di, hi = cfg.index_head_dim, cfg.index_n_heads
            _compressor(out, f"{a}indexer.compressor", di, h, cfg.compress_ratios[i], 2)
            _linear(out, f"{a}indexer.wq_b", hi * di, cfg.q_lora_rank, cfg, quantised=True)
            out[f"{a}indexer.weights_proj.weight"] = ((hi, h), FLOAT_DTYPES)
        f = f"{p}ffn."
        out[f"{f}gate.weight"] = ((cfg.n_routed_experts, h), FLOAT_DTYPES)
        if cfg.mlp_layer_types[i] == "hash_moe":
            out[f"{f}gate.tid2eid"] = ((cfg.vocab_size, cfg.num_experts_per_tok), _INT)
        else:
            out[f"{f}gate.bias"] = ((cfg.n_routed_experts,), FLOAT_DTYPES)
        inter = cfg.moe_intermediate_size
        for e in range(cfg.n_routed_experts):
            _linear(out, f"{f}experts.{e}.w1", inter, h, cfg, quantised=True, expert=True)
            _linear(out, f"{f}experts.{e}.w2", h, inter, cfg, quantised=True, expert=True)
            _linear(out, f"{f}experts.{e}.w3", inter, h, cfg, quantised=True, expert=True)
        if cfg.n_shared_experts:
            width = cfg.n_shared_experts * inter
            _linear(out, f"{f}shared_experts.w1", width, h, cfg, quantised=True)
            _linear(out, f"{f}shared_experts.w2", h, width, cfg, quantised=True)
            _linear(out, f"{f}shared_experts.w3", width, h, cfg, quantised=True)
    return out


def checkpoint_contract(cfg: DeepseekV4Config) -> dict[str, tuple[tuple[int, ...], tuple[str, ...], bool]]:
    """:func:`expected_tensors` in the ``name -> (shape, dtypes, optional)`` form the shared loader takes.

    The loader resolves the ``model.`` prefix itself; the few tensors transformers names differently are listed
    under both names as optional, and :func:`assemble_params` then insists on exactly one of each pair.
    """
    contract: dict[str, tuple[tuple[int, ...], tuple[str, ...], bool]] = {}
    for name, (shape, dtypes) in expected_tensors(cfg).items():
        others = _other_spellings(name)
        contract[name] = (shape, dtypes, bool(others))
        for other in others:
            contract[other] = (shape, dtypes, True)
    return contract


def _compressor(
    out: dict[str, tuple[tuple[int, ...], tuple[str, ...]]],
    prefix: str,
    width: int,
    hidden: int,
    ratio: int,
    series: int,
) -> None:
    out[f"{prefix}.wkv.weight"] = ((series * width, hidden), FLOAT_DTYPES)
    out[f"{prefix}.wgate.weight"] = ((series * width, hidden), FLOAT_DTYPES)
    out[f"{prefix}.ape"] = ((ratio, series * width), FLOAT_DTYPES)
    out[f"{prefix}.norm.weight"] = ((width,), FLOAT_DTYPES)


def compute_dtype(dtype: Any) -> Any:
    """The float dtype of a precision mode: float32 (parity mode) or bfloat16 (production mode).

    The mode is also the dtype of the unquantised weights :func:`assemble_params` builds, which is how the
    forward tells the two modes apart (``params["embed"].dtype``).
    """
    name = str(getattr(dtype, "name", dtype))
    if name == "float32":
        return jnp.float32
    if name == "bfloat16":
        return jnp.bfloat16
    raise ValueError(f"dtype: {dtype!r} is not a precision mode; expected 'float32' or 'bfloat16'")


def _to_device(a: Any, dtype: Any) -> jax.Array:
    arr = a if isinstance(a, jax.Array) else np.asarray(a)
    if np.dtype(arr.dtype).kind == "f" or np.dtype(arr.dtype).name == "bfloat16":
        return jnp.asarray(arr).astype(jnp.float32).astype(dtype)
    return jnp.asarray(arr)


def _tid2eid(table: Any, name: str, experts: int) -> jax.Array:
    """The hash-routing table as int32, refusing expert ids outside ``[0, n_routed_experts)``."""
    host = np.asarray(table)
    low, high = int(host.min()), int(host.max())
    if low < 0 or high >= experts:
        raise ValueError(
            f"tensor {name!r}: expert ids range over [{low}, {high}], expected [0, {experts}) (n_routed_experts)"
        )
    return jnp.asarray(host.astype(np.int32))


def _canonical_tensors(tensors: Mapping[str, Any]) -> dict[str, Any]:
    named: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for name, value in tensors.items():
        if ignored_tensor(name):
            continue
        native = canonical_name(name)
        if native in named:
            raise ValueError(
                f"tensor {name!r}: names the same DeepSeek-V4 tensor {native!r} as {spelled[native]!r}; a "
                "checkpoint must use one spelling per tensor"
            )
        named[native] = value
        spelled[native] = name
    return named


def assemble_params(
    cfg: DeepseekV4Config, tensors: Mapping[str, Any], dtype: Any = "float32"
) -> dict[str, Any]:
    """The parameter tree from ``tensors`` (native or transformers names; ``mtp.*`` ignored).

    Float weights are cast to the precision mode's dtype (float32 parity mode: the exact upcast of BF16); norms,
    mHC tensors, sinks, biases and the compressor position bias are float32 in every mode (spec/oracles.md).
    FP8 codes, UE8M0 scales and MXFP4 packs are kept as stored bytes. Raises ``ValueError`` naming the tensor
    for a missing or unexpected tensor and for a shape or dtype that differs from :func:`expected_tensors`.
    """
    dtype = compute_dtype(dtype)
    named = _canonical_tensors(tensors)
    expected = expected_tensors(cfg)
    missing = sorted(set(expected) - set(named))
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} DeepSeek-V4 tensor(s): {missing[:5]}")
    unexpected = sorted(set(named) - set(expected))
    if unexpected:
        raise ValueError(
            f"checkpoint has {len(unexpected)} tensor(s) a DeepSeek-V4 model does not read: {unexpected[:5]}"
        )
    for name, (shape, dtypes) in expected.items():
        arr = named[name]
        if tuple(arr.shape) != shape:
            raise ValueError(f"tensor {name!r}: shape {tuple(arr.shape)}, expected {shape}")
        if np.dtype(arr.dtype).name not in dtypes:
            raise ValueError(f"tensor {name!r}: dtype {np.dtype(arr.dtype).name}, expected one of {dtypes}")

    def vec(name: str) -> Any:
        return _to_device(named[name], jnp.float32)  # norms, mHC, sinks, biases, ape: float32 (oracles.md)

    fp4_experts = cfg.quantization is not None and cfg.quantization.expert_format == "fp4"

    def lin(prefix: str, *, packed: bool = False) -> dict[str, Any]:
        if f"{prefix}.scale" in named:
            key = "packed" if packed else "weight"
            w, scale = jnp.asarray(named[f"{prefix}.weight"]), jnp.asarray(named[f"{prefix}.scale"])
            return {key: as_uint8(w, f"{prefix}.weight"), "scale": as_uint8(scale, f"{prefix}.scale")}
        return {"weight": _to_device(named[f"{prefix}.weight"], dtype)}

    def stacked(prefix: str, count: int, which: str) -> dict[str, Any]:
        return stack_experts(count, lambda e: lin(f"{prefix}.{e}.{which}", packed=fp4_experts))

    def compressor(prefix: str) -> dict[str, Any]:
        return {
            "wkv": lin(f"{prefix}.wkv"),
            "wgate": lin(f"{prefix}.wgate"),
            "ape": vec(f"{prefix}.ape"),
            "norm": vec(f"{prefix}.norm.weight"),
        }

    layers = []
    for i, kind in enumerate(cfg.layer_types):
        p = f"layers.{i}."
        a = f"{p}attn."
        attn: dict[str, Any] = {
            "wq_a": lin(f"{a}wq_a"),
            "q_norm": vec(f"{a}q_norm.weight"),
            "wq_b": lin(f"{a}wq_b"),
            "wkv": lin(f"{a}wkv"),
            "kv_norm": vec(f"{a}kv_norm.weight"),
            "wo_a": lin(f"{a}wo_a"),
            "wo_b": lin(f"{a}wo_b"),
            "sinks": vec(f"{a}attn_sink"),
        }
        if kind != "sliding_attention":
            attn["compressor"] = compressor(f"{a}compressor")
        if kind == "compressed_sparse_attention":
            attn["indexer"] = {
                "compressor": compressor(f"{a}indexer.compressor"),
                "wq_b": lin(f"{a}indexer.wq_b"),
                "weights_proj": lin(f"{a}indexer.weights_proj"),
            }
        f = f"{p}ffn."
        ffn: dict[str, Any] = {
            "gate": {"weight": _to_device(named[f"{f}gate.weight"], jnp.float32)},
            "experts": {
                "gate": stacked(f"{f}experts", cfg.n_routed_experts, "w1"),
                "up": stacked(f"{f}experts", cfg.n_routed_experts, "w3"),
                "down": stacked(f"{f}experts", cfg.n_routed_experts, "w2"),
            },
        }
        if cfg.mlp_layer_types[i] == "hash_moe":
            ffn["tid2eid"] = _tid2eid(named[f"{f}gate.tid2eid"], f"{f}gate.tid2eid", cfg.n_routed_experts)
        else:
            ffn["bias"] = vec(f"{f}gate.bias")
        if cfg.n_shared_experts:
            ffn["shared"] = {
                "gate": lin(f"{f}shared_experts.w1"),
                "up": lin(f"{f}shared_experts.w3"),
                "down": lin(f"{f}shared_experts.w2"),
            }
        layers.append(
            {
                "attn_norm": vec(f"{p}attn_norm.weight"),
                "ffn_norm": vec(f"{p}ffn_norm.weight"),
                "hc_attn": {k: vec(f"{p}hc_attn_{k}") for k in ("fn", "base", "scale")},
                "hc_ffn": {k: vec(f"{p}hc_ffn_{k}") for k in ("fn", "base", "scale")},
                "attn": attn,
                "ffn": ffn,
            }
        )
    return {
        "embed": _to_device(named["embed.weight"], dtype),
        "head": _to_device(named["head.weight"], dtype),
        "norm": vec("norm.weight"),
        "hc_head": {k: vec(f"hc_head_{k}") for k in ("fn", "base", "scale")},
        "layers": layers,
    }
