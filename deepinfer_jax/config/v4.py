"""DeepSeek-V4 model config (``model_type: deepseek_v4``) and the base it shares with V4.1.

V4 and V4.1 share the attention skeleton (one shared K=V head with a RoPE tail, grouped low-rank output
projection, sliding window, compressed keys with a sparse indexer), mHC and the sqrt-softplus MoE. They differ
in how layers are described:

* V4 (spec/oracles.md): transformers 5.24 writes ``layer_types`` (``sliding_attention`` /
  ``compressed_sparse_attention`` / ``heavily_compressed_attention``) with ``compress_rates``
  (``{"compressed_sparse_attention": m, "heavily_compressed_attention": m'}``) and ``mlp_layer_types``
  (``hash_moe`` / ``moe``); real checkpoints carry the legacy ``compress_ratios`` (per layer 0/m/m'),
  ``compress_rate_csa`` / ``compress_rate_hca`` and ``num_hash_layers``. Both are accepted and normalised to
  per-layer tuples.
* V4.1 (:mod:`deepinfer_jax.config.v41`): per-layer ratios 0/1/2 plus cross-layer sharing lists.

RoPE: sliding-window-only (and draft) layers use the main rope (``rope_theta``, never YaRN); compressed
layers use the compress rope (``compress_rope_theta`` with optional YaRN, no magnitude scaling). Spellings:
the nested ``rope_parameters = {main: {...}, compress: {...}}`` of transformers, or the legacy flat
``rope_theta`` / ``compress_rope_theta`` / ``rope_scaling``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from deepinfer_jax.config.base import check_range
from deepinfer_jax.config.errors import ConfigValueError
from deepinfer_jax.config.hf import REQUIRED, HFReader
from deepinfer_jax.config.model import ModelConfig, RopeConfig, read_rope_entry

__all__ = [
    "ATTENTION_LAYER_TYPES",
    "MLP_LAYER_TYPES",
    "DeepseekV4BaseConfig",
    "DeepseekV4Config",
    "read_v4_ropes",
]

LayerType = Literal["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
MlpLayerType = Literal["hash_moe", "moe"]
ATTENTION_LAYER_TYPES: tuple[str, ...] = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
MLP_LAYER_TYPES: tuple[str, ...] = ("hash_moe", "moe")
_DEFAULT_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
# Compressed entries are stored per 128-token cache block, so a ratio must divide 128.
_RATIO_DIVIDES = 128


def read_v4_ropes(text: HFReader, *, compressed: bool) -> tuple[RopeConfig, RopeConfig]:
    """Return ``(main, compress)`` ropes from either V4 spelling.

    Args:
        text: reader on the level that holds the model keys.
        compressed: whether any layer is compressed; then the compress base key is required (it may be
            ``null`` = unknown), otherwise it may be absent.
    """
    nested_key = next(
        (
            key
            for key in ("rope_parameters", "rope_scaling")
            if isinstance(text.data.get(key), Mapping) and ({"main", "compress"} & set(text.data[key]))
        ),
        None,
    )
    if nested_key is not None:
        nested = text.sub(nested_key)
        assert nested is not None  # sub(required=True) never returns None
        main_reader, compress_reader = nested.sub("main"), nested.sub("compress")
        assert main_reader is not None and compress_reader is not None
        main = read_rope_entry(main_reader, magnitude_scaling=False)
        compress = read_rope_entry(compress_reader, default_attention_factor=1.0, magnitude_scaling=False)
        # transformers also writes the flat bases beside the nested dict; they must say the same.
        for flat_key, rope in (("rope_theta", main), ("compress_rope_theta", compress)):
            if text.has(flat_key):
                flat = text.get(flat_key, float | None)
                if flat != rope.theta:
                    raise text.error(flat_key, f"= {flat!r} contradicts {rope.theta_key} = {rope.theta!r}")
        return main, compress
    if text.data.get("rope_parameters") is not None:
        raise text.error(
            "rope_parameters",
            "must be the nested {main: {...}, compress: {...}} form in a DeepSeek-V4/V4.1 config "
            "(or use the legacy rope_theta / compress_rope_theta / rope_scaling keys)",
        )
    main = RopeConfig(theta=text.get("rope_theta", float | None), theta_key=text.path("rope_theta"))
    compress_theta = text.get("compress_rope_theta", float | None, REQUIRED if compressed else None)
    scaling = text.sub("rope_scaling", required=False)
    if scaling is None:
        compress = RopeConfig(theta=compress_theta, theta_key=text.path("compress_rope_theta"))
    else:
        compress = read_rope_entry(
            scaling,
            theta=compress_theta,
            theta_key=text.path("compress_rope_theta"),
            default_attention_factor=1.0,
            magnitude_scaling=False,
        )
    return main, compress


def read_qk_rope_head_dim(text: HFReader, head_dim: int) -> int:
    """``qk_rope_head_dim``, or ``head_dim * partial_rotary_factor`` (transformers' V4 spelling); both must agree."""
    factor = text.get("partial_rotary_factor", float | None, None)
    from_factor = None
    if factor is not None:
        from_factor = head_dim * factor
        if from_factor != int(from_factor):
            raise text.error(
                "partial_rotary_factor", f"= {factor!r}: head_dim * factor = {from_factor} is not whole"
            )
        from_factor = int(from_factor)
    if text.has("qk_rope_head_dim"):
        dim = text.get("qk_rope_head_dim", int)
        if from_factor is not None and from_factor != dim:
            raise text.error(
                "partial_rotary_factor",
                f"= {factor!r} gives {from_factor} RoPE dims, but qk_rope_head_dim = {dim}",
            )
        return dim
    if from_factor is None:
        raise text.error("qk_rope_head_dim", "is required (or partial_rotary_factor) but missing")
    return from_factor


@dataclass(frozen=True, kw_only=True)
class DeepseekV4BaseConfig(ModelConfig):
    """Fields V4 and V4.1 share.

    Attributes:
        head_dim: ``D``, the whole shared K/V vector including the rotary tail.
        qk_rope_head_dim: ``Dr``, the rotary dims (the **last** ``Dr`` of each head vector).
        compress_rope: the RoPE of compressed layers (base ``compress_rope_theta``, optional YaRN).
        compress_ratios: per backbone layer (length ``num_hidden_layers``): 0 = sliding window only,
            otherwise the KV compression ratio.
        index_topk, index_n_heads, index_head_dim: the sparse indexer (``None`` when no layer has one).
        swiglu_limit: SwiGLU clamp, ``None`` = no clamp.
    """

    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    num_key_value_heads: int = 1
    sliding_window: int
    index_topk: int | None = None
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    hc_mult: int
    hc_eps: float
    hc_sinkhorn_iters: int
    swiglu_limit: float | None
    attention_bias: bool = False
    attention_dropout: float = 0.0
    compress_rope: RopeConfig
    compress_ratios: tuple[int, ...]

    _SCORING_FUNCS: ClassVar[tuple[str, ...]] = ("sqrtsoftplus",)

    @classmethod
    def _parse_attention(cls, text: HFReader, *, compressed: bool) -> dict[str, Any]:
        head_dim = text.get("head_dim", int)
        main, compress = read_v4_ropes(text, compressed=compressed)
        return {
            "head_dim": head_dim,
            "qk_rope_head_dim": read_qk_rope_head_dim(text, head_dim),
            "q_lora_rank": text.get("q_lora_rank", int),
            "o_lora_rank": text.get("o_lora_rank", int),
            "o_groups": text.get("o_groups", int),
            "num_key_value_heads": text.get("num_key_value_heads", int, 1),
            "sliding_window": text.get("sliding_window", int),
            "index_topk": text.get("index_topk", int | None, None),
            "index_n_heads": text.get("index_n_heads", int | None, None),
            "index_head_dim": text.get("index_head_dim", int | None, None),
            "hc_mult": text.get("hc_mult", int),
            "hc_eps": text.get("hc_eps", float),
            "hc_sinkhorn_iters": text.get("hc_sinkhorn_iters", int),
            "swiglu_limit": text.get("swiglu_limit", float | None),
            "attention_bias": text.get("attention_bias", bool, False),
            "attention_dropout": text.get("attention_dropout", float, 0.0),
            "rope": main,
            "compress_rope": compress,
            "scoring_func": text.get("scoring_func", str),
            "topk_method": text.get("topk_method", str, "noaux_tc"),
        }

    def _indexed_layers(self) -> tuple[int, ...]:
        """Backbone layers that run the sparse indexer (they need the ``index_*`` keys)."""
        return tuple(i for i, r in enumerate(self.compress_ratios) if r > 0)

    def _validate(self) -> None:
        super()._validate()
        n = self._name
        if self.num_key_value_heads != 1:
            raise ConfigValueError(
                f"{n('num_key_value_heads')} = {self.num_key_value_heads}: must be 1 (one shared K=V head)",
                field=n("num_key_value_heads"),
            )
        check_range(n("qk_rope_head_dim"), self.qk_rope_head_dim, ge=2, lt=self.head_dim)
        if self.qk_rope_head_dim % 2:
            raise ConfigValueError(
                f"{n('qk_rope_head_dim')} = {self.qk_rope_head_dim}: must be even (RoPE rotates pairs)",
                field=n("qk_rope_head_dim"),
            )
        for name in (
            "q_lora_rank",
            "o_lora_rank",
            "o_groups",
            "sliding_window",
            "hc_mult",
            "hc_sinkhorn_iters",
        ):
            check_range(n(name), getattr(self, name), ge=1)
        if self.num_attention_heads % self.o_groups:
            raise ConfigValueError(
                f"{n('o_groups')} = {self.o_groups}: must divide num_attention_heads = {self.num_attention_heads}",
                field=n("o_groups"),
            )
        check_range(n("hc_eps"), self.hc_eps, gt=0)
        check_range(n("swiglu_limit"), self.swiglu_limit, gt=0)
        if self.attention_bias:
            raise ConfigValueError(f"{n('attention_bias')} = True: must be false", field=n("attention_bias"))
        if self.attention_dropout != 0.0:
            raise ConfigValueError(
                f"{n('attention_dropout')} = {self.attention_dropout!r}: must be 0.0",
                field=n("attention_dropout"),
            )
        if self.scoring_func not in self._SCORING_FUNCS:
            raise ConfigValueError(
                f"{n('scoring_func')} = {self.scoring_func!r}: must be one of "
                f"{', '.join(repr(s) for s in self._SCORING_FUNCS)}",
                field=n("scoring_func"),
            )
        if self.topk_method != "noaux_tc":
            raise ConfigValueError(
                f"{n('topk_method')} = {self.topk_method!r}: must be 'noaux_tc' (bias-corrected top-k)",
                field=n("topk_method"),
            )
        if self.rope.is_yarn:
            raise ConfigValueError(
                f"{self.rope.theta_key}: the main RoPE must be plain; YaRN applies only to compressed layers "
                f"(put it in the compress rope)",
                field=self.rope.theta_key,
            )
        indexed = self._indexed_layers()
        if indexed:
            for name in ("index_topk", "index_n_heads", "index_head_dim"):
                if getattr(self, name) is None:
                    raise ConfigValueError(
                        f"{n(name)} is required because layer {indexed[0]} has a sparse indexer, but it is "
                        "missing or null",
                        field=n(name),
                    )
            check_range(n("index_topk"), self.index_topk, ge=0)
            check_range(n("index_n_heads"), self.index_n_heads, ge=1)
            check_range(n("index_head_dim"), self.index_head_dim, ge=1)
        for i, ratio in enumerate(self.compress_ratios):
            if ratio < 0 or (ratio > 0 and _RATIO_DIVIDES % ratio):
                raise ConfigValueError(
                    f"{n('compress_ratios')}[{i}] = {ratio}: a compression ratio must be 0 (sliding window only) "
                    f"or divide {_RATIO_DIVIDES}",
                    field=n("compress_ratios"),
                )
        if len(self.compress_ratios) != self.num_hidden_layers:
            raise ConfigValueError(
                f"{n('compress_ratios')}: {len(self.compress_ratios)} entries for num_hidden_layers = "
                f"{self.num_hidden_layers}",
                field=n("compress_ratios"),
            )

    @property
    def nope_head_dim(self) -> int:
        """``Dc = head_dim - qk_rope_head_dim``, the non-rotary part of the shared K/V vector."""
        return self.head_dim - self.qk_rope_head_dim

    @property
    def compressed_layer_ids(self) -> tuple[int, ...]:
        """Backbone layers with compressed keys (ratio > 0)."""
        return tuple(i for i, r in enumerate(self.compress_ratios) if r > 0)

    def layer_rope(self, layer: int) -> RopeConfig:
        """The RoPE a backbone layer uses: the compress rope for compressed layers, the main one otherwise."""
        return self.compress_rope if self.compress_ratios[layer] > 0 else self.rope

    def _nullable_values(self) -> Iterator[tuple[str, Any]]:
        yield from super()._nullable_values()
        if self.compressed_layer_ids:
            for key in self.compress_rope.missing():
                yield key, None

    def derived(self) -> dict[str, Any]:
        return {
            **super().derived(),
            "nope_head_dim": self.nope_head_dim,
            "compressed_layer_ids": list(self.compressed_layer_ids),
        }


@dataclass(frozen=True, kw_only=True)
class DeepseekV4Config(DeepseekV4BaseConfig):
    """DeepSeek-V4: CSA/HCA compressed attention and hash-routed MoE layers.

    Attributes:
        layer_types: per backbone layer attention kind (normalised from ``compress_ratios`` if needed).
        compress_rate_csa, compress_rate_hca: the compression ratio of CSA / HCA layers.
        compress_ratios: per backbone layer ratio: 0 (sliding), ``compress_rate_csa`` or ``compress_rate_hca``.
        mlp_layer_types: per backbone layer ``"hash_moe"`` (experts chosen by ``tid2eid[token]``) or ``"moe"``.
    """

    MODEL_TYPE: ClassVar[str] = "deepseek_v4"
    ARCHITECTURE: ClassVar[str] = "DeepseekV4ForCausalLM"
    _SCORING_FUNCS: ClassVar[tuple[str, ...]] = ("sqrtsoftplus", "sigmoid")

    layer_types: tuple[LayerType, ...]
    compress_rate_csa: int
    compress_rate_hca: int
    mlp_layer_types: tuple[MlpLayerType, ...]

    @classmethod
    def _parse(cls, reader: HFReader) -> dict[str, Any]:
        fields = cls._parse_common(reader, reader)
        n_layers = fields["num_hidden_layers"]
        rates = dict(_DEFAULT_COMPRESS_RATES)
        given = reader.get("compress_rates", Mapping[str, int] | None, None)
        if given is not None:
            for key in given:
                if key not in rates:
                    raise reader.error(
                        "compress_rates", f"has unknown key {key!r}; allowed: {', '.join(sorted(rates))}"
                    )
            rates.update(given)
        for legacy, layer_type in (
            ("compress_rate_csa", "compressed_sparse_attention"),
            ("compress_rate_hca", "heavily_compressed_attention"),
        ):
            if reader.has(legacy):
                rates[layer_type] = reader.get(legacy, int)
        csa, hca = rates["compressed_sparse_attention"], rates["heavily_compressed_attention"]

        layer_types = reader.get("layer_types", tuple[LayerType, ...] | None, None)
        legacy_ratios = reader.get("compress_ratios", tuple[int, ...] | None, None)
        if legacy_ratios is not None:
            from_ratios = cls._types_from_ratios(reader, legacy_ratios, n_layers, csa, hca, fields)
            if layer_types is not None and tuple(layer_types[:n_layers]) != from_ratios:
                raise reader.error("compress_ratios", f"= {list(legacy_ratios)!r} contradicts layer_types")
            layer_types = from_ratios
        if layer_types is None:
            raise reader.error("layer_types", "is required (or the legacy compress_ratios) but missing")
        if len(layer_types) != n_layers:
            raise reader.error(
                "layer_types", f"has {len(layer_types)} entries for num_hidden_layers = {n_layers}"
            )

        mlp_types = reader.get("mlp_layer_types", tuple[MlpLayerType, ...] | None, None)
        if reader.has("num_hash_layers"):
            n_hash = reader.get("num_hash_layers", int)
            if not 0 <= n_hash <= n_layers:
                raise reader.error("num_hash_layers", f"= {n_hash}: must be in [0, {n_layers}]")
            from_count = ("hash_moe",) * n_hash + ("moe",) * (n_layers - n_hash)
            if mlp_types is not None and tuple(mlp_types) != from_count:
                raise reader.error("num_hash_layers", f"= {n_hash} contradicts mlp_layer_types")
            mlp_types = from_count
        if mlp_types is None:
            raise reader.error("mlp_layer_types", "is required (or the legacy num_hash_layers) but missing")
        if len(mlp_types) != n_layers:
            raise reader.error(
                "mlp_layer_types", f"has {len(mlp_types)} entries for num_hidden_layers = {n_layers}"
            )

        ratio_of = {
            "sliding_attention": 0,
            "compressed_sparse_attention": csa,
            "heavily_compressed_attention": hca,
        }
        compress_ratios = tuple(ratio_of[t] for t in layer_types)
        fields.update(cls._parse_attention(reader, compressed=any(compress_ratios)))
        fields.update(
            layer_types=layer_types,
            compress_rate_csa=csa,
            compress_rate_hca=hca,
            compress_ratios=compress_ratios,
            mlp_layer_types=mlp_types,
        )
        return fields

    @staticmethod
    def _types_from_ratios(
        reader: HFReader, ratios: tuple[int, ...], n_layers: int, csa: int, hca: int, fields: dict[str, Any]
    ) -> tuple[str, ...]:
        # Real checkpoints may list the MTP layers' entries after the backbone's: accept L or L + M entries.
        allowed_lengths = {n_layers, n_layers + fields["num_nextn_predict_layers"]}
        if len(ratios) not in allowed_lengths:
            raise reader.error(
                "compress_ratios",
                f"has {len(ratios)} entries; expected num_hidden_layers = {n_layers} "
                f"(or num_hidden_layers + num_nextn_predict_layers = {max(allowed_lengths)})",
            )
        if csa == hca:
            raise reader.error(
                "compress_ratios", f"cannot be mapped to layer kinds: the CSA and HCA rates are both {csa}"
            )
        kind = {
            0: "sliding_attention",
            csa: "compressed_sparse_attention",
            hca: "heavily_compressed_attention",
        }
        out = []
        for i, ratio in enumerate(ratios[:n_layers]):
            if ratio not in kind:
                raise reader.error(
                    f"compress_ratios[{i}]",
                    f"= {ratio}: expected 0, the CSA rate {csa} or the HCA rate {hca}"
                    + ("" if _RATIO_DIVIDES % ratio == 0 else f" (and a ratio must divide {_RATIO_DIVIDES})"),
                )
            out.append(kind[ratio])
        return tuple(out)

    def _indexed_layers(self) -> tuple[int, ...]:
        # Only CSA layers have the lightning indexer; HCA layers attend to all their compressed keys.
        return tuple(i for i, t in enumerate(self.layer_types) if t == "compressed_sparse_attention")

    def _validate(self) -> None:
        n = self._name
        for name in ("compress_rate_csa", "compress_rate_hca"):
            rate = getattr(self, name)
            if rate < 1 or _RATIO_DIVIDES % rate:
                raise ConfigValueError(
                    f"{n(name)} = {rate}: a compression ratio must divide {_RATIO_DIVIDES} "
                    "(compressed entries are stored per 128-token block)",
                    field=n(name),
                )
        super()._validate()
        ratio_of = {
            "sliding_attention": 0,
            "compressed_sparse_attention": self.compress_rate_csa,
            "heavily_compressed_attention": self.compress_rate_hca,
        }
        expected = tuple(ratio_of[t] for t in self.layer_types)
        if self.compress_ratios != expected:
            raise ConfigValueError(
                f"{n('compress_ratios')} = {list(self.compress_ratios)!r}: must follow layer_types and the CSA/HCA "
                f"rates, i.e. {list(expected)!r}",
                field=n("compress_ratios"),
            )
        if (
            len(self.layer_types) != self.num_hidden_layers
            or len(self.mlp_layer_types) != self.num_hidden_layers
        ):
            raise ConfigValueError(
                f"{n('layer_types')} / {n('mlp_layer_types')}: need num_hidden_layers = {self.num_hidden_layers} "
                f"entries, got {len(self.layer_types)} / {len(self.mlp_layer_types)}",
                field=n("layer_types"),
            )

    @property
    def hash_layer_ids(self) -> tuple[int, ...]:
        """Backbone layers with hash-routed MoE."""
        return tuple(i for i, t in enumerate(self.mlp_layer_types) if t == "hash_moe")

    @property
    def num_hash_layers(self) -> int:
        return len(self.hash_layer_ids)

    def derived(self) -> dict[str, Any]:
        return {**super().derived(), "hash_layer_ids": list(self.hash_layer_ids)}
