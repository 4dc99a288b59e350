"""DeepSeek-V4.1 checkpoint contract (spec/model.md §13) and parameter assembly.

:func:`expected_tensors` lists every tensor a V4.1 checkpoint of a config carries -- name, shape and storage
dtypes -- from the static layer plan (:func:`~.plan_v41.build_v41_plan`): which layers own a compressor, indexer
queries or indexer keys follows from the sharing maps, not from the raw lists, so a consumer is never asked for
weights it cannot have. Tensors the reference loader tolerates but a layer's role does not use (``indexer.wk`` on
an index source that reads shared indexer keys, ``compressor.wgate`` on a ratio-1 layer, hash-routing tables,
``hc_head_*`` under the shifted schedule) are listed as *optional*: shape-checked when present, logged and
dropped by :func:`assemble_params`. The vision side (``vision.*``, ``aligner.*``, ``image_*``) and the image-token
routing bias ``ffn.gate.bias_vl`` are outside the text model: :data:`IGNORED_TENSORS` skips them. The loader
resolves the optional ``model.`` prefix.

:func:`assemble_params` builds a tree of plain dicts (linear weights as the format-keyed dicts of
:mod:`deepinfer_jax.models.common.linear`) with the load-time fusions of §13.5 that the forward uses:

* routed experts stacked in index order, ``[E, I, H/2]`` packed E2M1 codes with ``[E, I, H/32]`` UE8M0 scales
  for ``w1`` and ``w3`` and ``[E, H, I/2]`` for ``w2`` (the ``moe_experts`` op takes gate and up separately);
* the shared expert's ``w1`` and ``w3`` concatenated along the output rows (``w1`` first) into one FP8 GEMM
  ``w13`` -- legal because both heights are whole 32-row scale blocks, so the scale grids stack too;
* FP8 codes and UE8M0 scales kept as their ``uint8`` bit patterns (they are decoded tile by tile inside the
  GEMM, never as a whole; float32 parity mode is weight-only dequantisation, ``ARCHITECTURE.md`` §8);
* the Engram compression map of the model's tokenizer (§9.1) as ``engram_compress int32 [V]``.

The DSpark draft layers ``mtp.*`` are loaded into ``params["mtp"]`` with the same block structure.

**Float-weight checkpoints** (no ``quantization_config``, e.g. a training run's float32 master weights): every
tensor that a quantised checkpoint stores as FP8 or MXFP4 -- the projections, the routed experts (``[out, in]``,
not packed), the Engram tables -- is stored unquantised in the config's ``dtype`` (``bfloat16`` or ``float32``),
with no ``.scale`` companion, and so are the tensors a quantised checkpoint keeps in BF16. They assemble into
dense linear dicts (``{"weight"}``; experts ``[E, out, in]``, the shared ``w13`` concatenated the same way) and a
dense Engram table ``{"weight": [rows, De]}``, which the model functions run as unquantised GEMMs and a plain row
gather (no activation round trip: that belongs to FP8 / MXFP4 GEMMs only).
"""

from __future__ import annotations

import fnmatch
import functools
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.checkpoint.deferred import stack_experts
from deepinfer_jax.config.v41 import DeepseekV41Config
from deepinfer_jax.models.deepseek_v4 import params as v4_params
from deepinfer_jax.models.deepseek_v4.engram import CompressionMap, engram_table_sizes
from deepinfer_jax.models.deepseek_v4.plan_v41 import V41DraftLayerPlan, V41LayerPlan, build_v41_plan
from deepinfer_jax.numerics.elements import as_uint8

__all__ = [
    "IGNORED_TENSORS",
    "TensorSpec",
    "assemble_params",
    "compute_dtype",
    "engram_compression",
    "expected_tensors",
    "init_params",
    "tokenizer_file",
]

_log = logging.getLogger(__name__)

TensorSpec = tuple[tuple[int | None, ...], tuple[str, ...], bool]
"""``(shape, accepted storage dtype names, optional)`` -- the form the shared loader takes."""

IGNORED_TENSORS: tuple[str, ...] = ("vision.*", "aligner.*", "image_*", "*.ffn.gate.bias_vl")
"""Stored names the text model skips: the vision tower and projector, the image embeddings and the image-token
routing bias (a text-only batch has no image token, §8.1)."""

_BF16 = ("bfloat16",)
_F32 = ("float32",)
_FP8 = ("float8_e4m3fn", "uint8")
_UE8M0 = ("float8_e8m0fnu", "uint8")
_FP4 = ("uint8", "int8", "float4_e2m1fn_x2")
_INT = ("int64", "int32")
_MXFP4_GROUP = 32
_PREFIX = re.compile(r"^model\.")


def compute_dtype(dtype: Any) -> Any:
    """The float dtype of a precision mode: float32 (parity mode) or bfloat16 (production mode)."""
    return v4_params.compute_dtype(dtype)


# ------------------------------------------------------------------------------------------- the manifest


class _Manifest:
    """Collects ``name -> TensorSpec`` with the FP8 / MXFP4 ``.scale`` companions (§12.1).

    Without a ``quantization_config`` (a float-weight checkpoint) the FP8 / MXFP4 positions are unquantised
    ``[out, in]`` tensors in the checkpoint's ``dtype``, as are the tensors a quantised checkpoint keeps in BF16.
    """

    def __init__(self, cfg: DeepseekV41Config) -> None:
        q = cfg.quantization
        self.block = tuple(q.weight_block_size) if q is not None else None
        self.float_dtypes = _BF16 if q is None and cfg.checkpoint_dtype != "float32" else _F32
        self.dense_dtypes = _BF16 if q is not None else self.float_dtypes
        self.out: dict[str, TensorSpec] = {}

    def put(self, name: str, shape: tuple[int | None, ...], dtypes: tuple[str, ...], optional: bool) -> None:
        self.out[name] = (tuple(shape), dtypes, optional)

    def dense(self, name: str, shape: tuple[int, ...], *, optional: bool = False) -> None:
        self.put(name, shape, self.dense_dtypes, optional)

    def f32(self, name: str, shape: tuple[int, ...], *, optional: bool = False) -> None:
        self.put(name, shape, _F32, optional)

    def fp8(self, prefix: str, rows: int, cols: int, *, optional: bool = False) -> None:
        if self.block is None:
            self.put(f"{prefix}.weight", (rows, cols), self.float_dtypes, optional)
            return
        br, bc = self.block
        self.put(f"{prefix}.weight", (rows, cols), _FP8, optional)
        self.put(f"{prefix}.scale", (-(-rows // br), -(-cols // bc)), _UE8M0, optional)

    def mxfp4(self, prefix: str, rows: int, cols: int) -> None:
        if self.block is None:
            self.put(f"{prefix}.weight", (rows, cols), self.float_dtypes, False)
            return
        self.put(f"{prefix}.weight", (rows, cols // 2), _FP4, False)
        self.put(f"{prefix}.scale", (rows, cols // _MXFP4_GROUP), _UE8M0, False)


def _engram_rows(cfg: DeepseekV41Config) -> tuple[int, ...]:
    """Rows of each Engram layer's table: ``Σ P_l`` of §9.3 (they depend only on the Engram sizes)."""
    assert cfg.engram_max_ngram_size and cfg.engram_n_heads and cfg.engram_vocab_size
    sizes = engram_table_sizes(
        cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads, cfg.engram_vocab_size
    )
    rows = tuple(sum(sum(order) for order in layer) for layer in sizes)
    declared = cfg.engram_num_embeddings
    if declared is not None and tuple(declared) != rows:
        raise ValueError(
            f"text_config.engram_num_embeddings = {list(declared)!r}: the table sizes of engram_vocab_size = "
            f"{cfg.engram_vocab_size} give {list(rows)!r} rows; they must be equal"
            + (f" (in {cfg.source})" if cfg.source else "")
        )
    return rows


def _block(man: _Manifest, cfg: DeepseekV41Config, p: str, experts: int) -> None:
    """What every backbone and draft block has: norms, mHC, the attention core, the MoE (§13.3, §13.4)."""
    H, D, Nh, Rq = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.q_lora_rank
    G, Ro, m = cfg.o_groups, cfg.o_lora_rank, cfg.hc_mult
    channels = m * (m + 2)
    for sub in ("attn", "ffn"):
        man.dense(f"{p}{sub}_norm.weight", (H,))
        man.f32(f"{p}hc_{sub}_fn", (channels, m * H))
        man.f32(f"{p}hc_{sub}_base", (channels,))
        man.f32(f"{p}hc_{sub}_scale", (3,))
    a = f"{p}attn."
    man.fp8(f"{a}wq_a", Rq, H)
    man.dense(f"{a}q_norm.weight", (Rq,))
    man.fp8(f"{a}wq_b", Nh * D, Rq)
    man.fp8(f"{a}wkv", D, H)
    man.dense(f"{a}kv_norm.weight", (D,))
    man.fp8(f"{a}wo_a", G * Ro, (Nh // G) * D)
    man.fp8(f"{a}wo_b", H, G * Ro)
    man.f32(f"{a}attn_sink", (Nh,))
    f = f"{p}ffn."
    man.dense(f"{f}gate.weight", (experts, H))
    man.f32(f"{f}gate.bias", (experts,))
    man.put(f"{f}gate.tid2eid", (cfg.vocab_size, None), _INT, True)  # hash routing: not in V4.1, tolerated
    inter = cfg.moe_intermediate_size
    for e in range(experts):
        man.mxfp4(f"{f}experts.{e}.w1", inter, H)
        man.mxfp4(f"{f}experts.{e}.w3", inter, H)
        man.mxfp4(f"{f}experts.{e}.w2", H, inter)
    if cfg.n_shared_experts:
        width = cfg.n_shared_experts * inter
        man.fp8(f"{f}shared_experts.w1", width, H)
        man.fp8(f"{f}shared_experts.w3", width, H)
        man.fp8(f"{f}shared_experts.w2", H, width)


def _hc_head(man: _Manifest, cfg: DeepseekV41Config, prefix: str, *, optional: bool) -> None:
    m, H = cfg.hc_mult, cfg.hidden_size
    man.f32(f"{prefix}hc_head_fn", (m, m * H), optional=optional)
    man.f32(f"{prefix}hc_head_base", (m,), optional=optional)
    man.f32(f"{prefix}hc_head_scale", (1,), optional=optional)


def expected_tensors(cfg: DeepseekV41Config) -> dict[str, TensorSpec]:
    """Every tensor of a V4.1 checkpoint of ``cfg``: ``name -> (shape, storage dtypes, optional)`` (§13).

    Required tensors follow the layer roles of the plan (§7.10); optional ones are tolerated leftovers that the
    model does not read (module docstring). Names carry no ``model.`` prefix (the loader resolves it).

    Raises:
        TypeError: ``cfg`` is not a :class:`DeepseekV41Config`.
        ConfigValueError / ValueError: the config is incomplete or breaks a plan rule, or its
            ``engram_num_embeddings`` disagree with the derived table sizes.
    """
    if not isinstance(cfg, DeepseekV41Config):
        raise TypeError(f"cfg: expected a DeepseekV41Config, got {type(cfg).__name__}")
    cfg.require_complete("listing the DeepSeek-V4.1 checkpoint tensors")
    plan = build_v41_plan(cfg)
    man = _Manifest(cfg)
    H, V, D, Rq, m = cfg.hidden_size, cfg.vocab_size, cfg.head_dim, cfg.q_lora_rank, cfg.hc_mult
    man.dense("embed.weight", (V, H))
    man.dense("norm.weight", (H,))
    man.dense("head.weight", (V, H))
    _hc_head(man, cfg, "", optional=cfg.hc_shifted)
    Hi, Di = cfg.index_n_heads, cfg.index_head_dim
    engram_rows = (
        dict(zip(cfg.engram_layer_ids, _engram_rows(cfg), strict=True)) if cfg.engram_enabled else {}
    )
    for lp in plan.layers:
        p = f"layers.{lp.layer}."
        _block(man, cfg, p, cfg.n_routed_experts)
        if lp.is_compressed:
            a = f"{p}attn."
            assert Hi is not None and Di is not None
            kv = not lp.is_kv_source
            man.dense(f"{a}compressor.wkv.weight", (D, H), optional=kv)
            man.dense(f"{a}compressor.wgate.weight", (D, H), optional=kv or lp.ratio == 1)
            man.dense(f"{a}compressor.norm.weight", (D,), optional=kv)
            idx = not lp.is_index_source
            man.fp8(f"{a}indexer.wq_b", Hi * Di, Rq, optional=idx)
            man.dense(f"{a}indexer.weights_proj.weight", (Hi, H), optional=idx)
            ik = not lp.is_index_k_source
            man.dense(f"{a}indexer.wk.weight", (Di, D), optional=ik)
            man.dense(f"{a}indexer.k_norm.weight", (Di,), optional=ik)
        if lp.has_engram:
            assert cfg.engram_max_ngram_size and cfg.engram_n_heads and cfg.engram_head_dim
            De = cfg.engram_head_dim
            width = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * De
            e = f"{p}engram."
            if man.block is None:
                man.put(f"{e}embed.weight", (engram_rows[lp.layer], De), man.float_dtypes, False)
            else:
                man.put(f"{e}embed.weight", (engram_rows[lp.layer], De), _FP8, False)
                man.put(f"{e}embed.scale", (engram_rows[lp.layer], De // _MXFP4_GROUP), _UE8M0, False)
            man.fp8(f"{e}wkv", (m + 1) * H, width)
            man.dense(f"{e}q_weight", (m, H))
            man.dense(f"{e}k_weight", (m, H))
    for dp in plan.draft_layers:
        p = f"mtp.{dp.index}."
        assert cfg.dspark_n_routed_experts is not None and cfg.dspark_markov_rank is not None
        _block(man, cfg, p, cfg.dspark_n_routed_experts)
        if dp.holds_main_proj:
            targets = plan.draft_target_layer_ids or ()
            man.fp8(f"{p}main_proj", H, len(targets) * H)
            man.dense(f"{p}main_norm.weight", (H,))
        if dp.holds_heads:
            Rm = cfg.dspark_markov_rank
            man.dense(f"{p}norm.weight", (H,))
            man.dense(f"{p}markov_head.embed.weight", (V, Rm))
            man.dense(f"{p}markov_head.head.weight", (V, Rm))
            man.dense(f"{p}confidence_head.proj.weight", (1, H + Rm))
            _hc_head(man, cfg, p, optional=not dp.holds_hc_head)
    return man.out


# ------------------------------------------------------------------------------------ Engram compression


def tokenizer_file(cfg: DeepseekV41Config) -> Path | None:
    """``tokenizer.json`` beside the config file the config was read from, if there is one."""
    if not cfg.source:
        return None
    config_file = Path(cfg.source.split(" (section ")[0])  # yaml sources read "file.yaml (section model)"
    if not config_file.is_file():  # e.g. "<config dict>"
        return None
    candidate = config_file.parent / "tokenizer.json"
    return candidate if candidate.is_file() else None


@functools.lru_cache(maxsize=8)
def _compression_cached(cfg: DeepseekV41Config, tokenizer: str | None) -> CompressionMap:
    if tokenizer is not None:
        return CompressionMap.from_tokenizer(tokenizer)
    V, Vc = cfg.vocab_size, cfg.engram_compressed_vocab_size
    if Vc != V:
        key = "text_config.engram_compressed_vocab_size"
        raise ValueError(
            f"{key} = {Vc!r}: Engram needs the model's tokenizer.json to build the compression map (spec §9.1), "
            f"and none lies beside {cfg.source or 'the config (a config dict has no folder)'}; without a "
            f"tokenizer only the identity map is possible, which needs {key} = vocab_size = {V}"
        )
    return CompressionMap.from_table(np.arange(V, dtype=np.int32), source="identity (no tokenizer.json)")


def engram_compression(cfg: DeepseekV41Config) -> CompressionMap | None:
    """The §9.1 compression map of the model: from the ``tokenizer.json`` beside its config file, or the
    identity when there is no tokenizer and ``engram_compressed_vocab_size == vocab_size``; ``None`` without
    Engram. Cached per (config, tokenizer file): building it decodes every vocabulary entry.

    Configs compare equal whatever folder they were read from, so two checkpoints with equal configs and
    different tokenizers must state ``engram_compressed_vocab_size`` for their compiled forwards (whose hash
    multipliers depend on it) to stay apart; the map itself travels in the parameters.

    Raises:
        ValueError: no tokenizer and a compressed vocabulary size other than ``vocab_size``.
    """
    if not cfg.engram_enabled:
        return None
    tokenizer = tokenizer_file(cfg)
    return _compression_cached(cfg, None if tokenizer is None else str(tokenizer))


# ------------------------------------------------------------------------------------------- assembly


def _dtype_name(a: Any) -> str:
    return np.dtype(a.dtype).name


def _checked(cfg: DeepseekV41Config, tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Resolve the ``model.`` prefix, drop ignored names, and refuse anything that breaks the contract."""
    expected = expected_tensors(cfg)
    named: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for name, value in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensors: names must be str, got {type(name).__name__} {name!r}")
        bare = _PREFIX.sub("", name)
        if any(fnmatch.fnmatchcase(bare, pattern) for pattern in IGNORED_TENSORS):
            continue
        if bare in named:
            raise ValueError(
                f"tensor {name!r}: names the same DeepSeek-V4.1 tensor as {spelled[bare]!r}; a checkpoint must "
                "store each tensor once, with or without the 'model.' prefix"
            )
        named[bare], spelled[bare] = value, name
    missing = sorted(n for n, (_, _, optional) in expected.items() if not optional and n not in named)
    if missing:
        raise ValueError(
            f"checkpoint lacks {len(missing)} DeepSeek-V4.1 tensor(s): {missing[:8]}"
            + (" ..." if len(missing) > 8 else "")
        )
    unexpected = sorted(set(named) - set(expected))
    if unexpected:
        raise ValueError(
            f"checkpoint has {len(unexpected)} tensor(s) a DeepSeek-V4.1 model of this config does not have: "
            f"{unexpected[:8]}" + (" ..." if len(unexpected) > 8 else "")
        )
    unused = []
    for name, arr in named.items():
        shape, dtypes, optional = expected[name]
        found = tuple(arr.shape)
        if len(found) != len(shape) or any(e is not None and e != f for e, f in zip(shape, found)):
            raise ValueError(f"tensor {spelled[name]!r}: shape {found}, expected {shape}")
        if _dtype_name(arr) not in dtypes:
            raise ValueError(f"tensor {spelled[name]!r}: dtype {_dtype_name(arr)}, expected one of {dtypes}")
        if optional:
            unused.append(name)
    if unused:
        _log.info("DeepSeek-V4.1: %d stored tensor(s) unused by their layer's role: %s", len(unused), unused)
        for name in unused:
            del named[name]
    return named


class _Assembler:
    """Turns checked checkpoint tensors into parameter leaves (module docstring for the formats)."""

    def __init__(self, cfg: DeepseekV41Config, named: Mapping[str, Any], fdtype: Any) -> None:
        self.cfg = cfg
        self.named = named
        self.fdtype = fdtype

    # jnp casts (not NumPy) keep assembly traceable, so jax.eval_shape gives the abstract tree of a real-size
    # model without reading or allocating it (the real-shape compile tests).

    def vec(self, name: str) -> jax.Array:
        # Norm weights, mHC tensors, sinks and biases are float32 in every mode (BF16 values upcast exactly).
        return jnp.asarray(self.named[name]).astype(jnp.float32)

    def dense(self, name: str) -> jax.Array:
        return jnp.asarray(self.named[name]).astype(jnp.float32).astype(self.fdtype)

    def fp8(self, prefix: str) -> dict[str, jax.Array]:
        """An FP8 block-scaled linear (``{"weight", "scale"}`` bytes), or ``{"weight"}`` of a float checkpoint."""
        if self.cfg.quantization is None:
            return {"weight": self.dense(f"{prefix}.weight")}
        return {
            "weight": as_uint8(jnp.asarray(self.named[f"{prefix}.weight"]), f"{prefix}.weight"),
            "scale": as_uint8(jnp.asarray(self.named[f"{prefix}.scale"]), f"{prefix}.scale"),
        }

    def stacked(self, prefix: str, experts: int, which: str) -> dict[str, jax.Array]:
        """Experts ``0 .. experts-1`` of one matrix stacked in index order: ``{"packed", "scale"}`` ``[E, ...]``."""

        def one(e: int) -> dict[str, jax.Array]:
            part = self.fp8(f"{prefix}.{e}.{which}")
            if self.cfg.quantization is None:
                return part  # float checkpoint: {"weight": [out, in]}, stacked [E, out, in]
            return {"packed": part["weight"], "scale": part["scale"]}

        return stack_experts(experts, one)

    def shared(self, f: str) -> dict[str, Any]:
        cfg = self.cfg
        rows = int(cfg.quantization.weight_block_size[0]) if cfg.quantization is not None else 1
        width = cfg.n_shared_experts * cfg.moe_intermediate_size
        if width % rows:
            raise ValueError(
                f"text_config.n_shared_experts * moe_intermediate_size = {width}: the fused shared-expert "
                f"[w1; w3] needs whole {rows}-row FP8 scale blocks"
            )
        w1, w3 = self.fp8(f"{f}shared_experts.w1"), self.fp8(f"{f}shared_experts.w3")
        return {
            "w13": {k: jnp.concatenate([w1[k], w3[k]], axis=0) for k in w1},
            "down": self.fp8(f"{f}shared_experts.w2"),
        }

    def block(self, p: str, experts: int) -> dict[str, Any]:
        """Norms, mHC, attention core and MoE of one backbone or draft block."""
        a, f = f"{p}attn.", f"{p}ffn."
        attn = {
            "wq_a": self.fp8(f"{a}wq_a"),
            "q_norm": self.vec(f"{a}q_norm.weight"),
            "wq_b": self.fp8(f"{a}wq_b"),
            "wkv": self.fp8(f"{a}wkv"),
            "kv_norm": self.vec(f"{a}kv_norm.weight"),
            "wo_a": self.fp8(f"{a}wo_a"),
            "wo_b": self.fp8(f"{a}wo_b"),
            "sinks": self.vec(f"{a}attn_sink"),
        }
        ffn: dict[str, Any] = {
            "gate": {"weight": self.vec(f"{f}gate.weight")},  # router logits are float32 in every mode (§8.1)
            "bias": self.vec(f"{f}gate.bias"),
            "experts": {
                "gate": self.stacked(f"{f}experts", experts, "w1"),
                "up": self.stacked(f"{f}experts", experts, "w3"),
                "down": self.stacked(f"{f}experts", experts, "w2"),
            },
        }
        if self.cfg.n_shared_experts:
            ffn["shared"] = self.shared(f)
        return {
            "attn_norm": self.vec(f"{p}attn_norm.weight"),
            "ffn_norm": self.vec(f"{p}ffn_norm.weight"),
            "hc_attn": {k: self.vec(f"{p}hc_attn_{k}") for k in ("fn", "base", "scale")},
            "hc_ffn": {k: self.vec(f"{p}hc_ffn_{k}") for k in ("fn", "base", "scale")},
            "attn": attn,
            "ffn": ffn,
        }

    def backbone_layer(self, lp: V41LayerPlan) -> dict[str, Any]:
        """A backbone block plus what its roles own: compressor, indexer parts, Engram."""
        p = f"layers.{lp.layer}."
        layer = self.block(p, self.cfg.n_routed_experts)
        a = f"{p}attn."
        if lp.is_kv_source:
            comp = {
                "wkv": self.dense(f"{a}compressor.wkv.weight"),
                "norm": self.vec(f"{a}compressor.norm.weight"),
            }
            if lp.ratio == 2:
                comp["wgate"] = self.dense(f"{a}compressor.wgate.weight")
            layer["attn"]["compressor"] = comp
        indexer: dict[str, Any] = {}
        if lp.is_index_source:
            indexer["wq_b"] = self.fp8(f"{a}indexer.wq_b")
            indexer["weights_proj"] = self.dense(f"{a}indexer.weights_proj.weight")
        if lp.is_index_k_source:
            indexer["wk"] = self.dense(f"{a}indexer.wk.weight")
            indexer["k_norm"] = self.vec(f"{a}indexer.k_norm.weight")
        if indexer:
            layer["attn"]["indexer"] = indexer
        if lp.has_engram:
            e = f"{p}engram."
            layer["engram"] = {
                "embed": self.fp8(f"{e}embed"),
                "wkv": self.fp8(f"{e}wkv"),
                "q_weight": self.vec(f"{e}q_weight"),
                "k_weight": self.vec(f"{e}k_weight"),
            }
        return layer

    def draft_layer(self, dp: V41DraftLayerPlan) -> dict[str, Any]:
        """``mtp.{i}``: a window-attention block with the draft expert count, plus the drafter's own heads."""
        cfg = self.cfg
        p = f"mtp.{dp.index}."
        assert cfg.dspark_n_routed_experts is not None
        layer = self.block(p, cfg.dspark_n_routed_experts)
        if dp.holds_main_proj:
            layer["main_proj"] = self.fp8(f"{p}main_proj")
            layer["main_norm"] = self.vec(f"{p}main_norm.weight")
        if dp.holds_heads:
            layer["norm"] = self.vec(f"{p}norm.weight")
            layer["markov_embed"] = self.dense(f"{p}markov_head.embed.weight")
            layer["markov_head"] = self.dense(f"{p}markov_head.head.weight")
            layer["confidence"] = self.dense(f"{p}confidence_head.proj.weight")
            if dp.holds_hc_head:
                layer["hc_head"] = {k: self.vec(f"{p}hc_head_{k}") for k in ("fn", "base", "scale")}
        return layer


def assemble_params(
    cfg: DeepseekV41Config, tensors: Mapping[str, Any], dtype: Any = "float32"
) -> dict[str, Any]:
    """The parameter tree of ``cfg`` from checkpoint ``tensors`` (module docstring for the layout).

    Args:
        cfg: the parsed V4.1 config (its ``source`` locates ``tokenizer.json`` for Engram).
        tensors: name -> array (NumPy or JAX), names with or without ``model.``; ignored names may be present.
        dtype: the precision mode, ``"float32"`` (parity) or ``"bfloat16"`` (production: unquantised weights in
            bfloat16; norms, mHC tensors, sinks, biases and the router stay float32).

    Raises:
        ValueError: a required tensor missing, an unknown one present, or a shape / dtype off the contract
            (the message names the tensor and expected against found); no compression map for Engram; a dtype
            that is not a precision mode.
    """
    fdtype = compute_dtype(dtype)
    if not isinstance(cfg, DeepseekV41Config):
        raise TypeError(f"cfg: expected a DeepseekV41Config, got {type(cfg).__name__}")
    if not isinstance(tensors, Mapping):
        raise TypeError(
            f"tensors: expected a mapping of tensor names to arrays, got {type(tensors).__name__}"
        )
    build = _Assembler(cfg, _checked(cfg, tensors), fdtype)
    plan = build_v41_plan(cfg)
    params: dict[str, Any] = {
        "embed": build.dense("embed.weight"),
        "head": build.dense("head.weight"),
        "norm": build.vec("norm.weight"),
        "layers": [build.backbone_layer(lp) for lp in plan.layers],
    }
    if not cfg.hc_shifted:
        params["hc_head"] = {k: build.vec(f"hc_head_{k}") for k in ("fn", "base", "scale")}
    compression = engram_compression(cfg)
    if compression is not None:
        params["engram_compress"] = jnp.asarray(compression.table, jnp.int32)
    if plan.draft_layers:
        params["mtp"] = [build.draft_layer(dp) for dp in plan.draft_layers]
    return params


def init_params(cfg: DeepseekV41Config, seed: int, dtype: Any = "float32") -> dict[str, Any]:
    """Random parameters for ``cfg``: the deterministic synthetic V4.1 checkpoint of ``seed``, assembled.

    With the built-in ``tiny-v41`` config (read from its folder, so that its tokenizer is found) and the
    built-in seed this equals loading ``tiny-v41``.
    """
    from deepinfer_jax.models.builtin import TensorRngFactory
    from deepinfer_jax.models.deepseek_v4.synthetic import generate_v41_weights

    compute_dtype(dtype)
    if not isinstance(cfg, DeepseekV41Config):
        raise TypeError(f"cfg: expected a DeepseekV41Config, got {type(cfg).__name__}")
    tensors = generate_v41_weights(cfg.hf, TensorRngFactory(seed))
    return assemble_params(cfg, tensors, dtype)
