"""Model configs parsed from HF ``config.json``: the shared base, RoPE and quantisation settings.

One frozen dataclass per family (:class:`~deepinfer_jax.config.v3.DeepseekV3Config`,
:class:`~deepinfer_jax.config.v4.DeepseekV4Config`, :class:`~deepinfer_jax.config.v41.DeepseekV41Config`)
derives from :class:`ModelConfig`. Fields carry the HF key names, so model code reads ``cfg.hidden_size`` the
way the checkpoint spells it; spelling variants (``rope_scaling`` vs ``rope_parameters``, ``layer_types`` vs
``compress_ratios``) are normalised at parse time, and the original dict is kept in :attr:`ModelConfig.hf`
so that a writer can emit ``config.json`` unchanged.

Values no source knows may be ``null`` in a real-shape config (the RoPE base of V4.1-Flash): such a config
parses and can be used for sizing; :meth:`ModelConfig.missing_fields` lists them and
:meth:`ModelConfig.require_complete` refuses to go further (e.g. before building parameters).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from deepinfer_jax.config.base import Checked, check_range
from deepinfer_jax.config.errors import ConfigTypeError, ConfigValueError
from deepinfer_jax.config.frozen import thaw
from deepinfer_jax.config.hf import REQUIRED, HFReader, hf_key_path, set_hf_key

__all__ = [
    "MODEL_FAMILIES",
    "ModelConfig",
    "QuantizationConfig",
    "RopeConfig",
    "parse_hf_config",
]

_YARN_PARAMS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
_YARN_OPTIONAL = ("mscale", "mscale_all_dim", "attention_factor")


@dataclass(frozen=True, kw_only=True)
class RopeConfig(Checked):
    """One rotary-embedding instance: its base and optional YaRN context extension.

    The YaRN fields are ``None`` when there is no scaling (``rope_type == "default"``). ``mscale`` /
    ``mscale_all_dim`` are the V3 magnitude corrections; ``attention_factor`` is the transformers name for
    an explicit cos/sin magnitude factor (V4 and V4.1 use 1.0: no magnitude scaling). A ``None`` base or YaRN
    parameter in a yarn rope means "unknown" (see :meth:`missing`).

    ``theta_key`` and ``scaling_key`` record where the values were spelled in ``config.json`` (e.g.
    ``"text_config.compress_rope_theta"``, ``"rope_parameters.compress"``), so that messages and
    :meth:`missing` name the key the user has to fix. They take no part in equality or hashing.
    """

    theta: float | None
    rope_type: Literal["default", "yarn"] = "default"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    theta_key: str = field(default="rope_theta", compare=False)
    scaling_key: str = field(default="rope_scaling", compare=False)

    def _name(self, field_name: str) -> str:
        if field_name == "theta":
            return self.theta_key
        if field_name in ("theta_key", "scaling_key"):
            return f"rope.{field_name}"
        return f"{self.scaling_key}.{field_name}"

    @property
    def is_yarn(self) -> bool:
        return self.rope_type == "yarn"

    def _validate(self) -> None:
        check_range(self._name("theta"), self.theta, gt=0)
        if self.rope_type == "default":
            for name in (*_YARN_PARAMS, "mscale", "mscale_all_dim"):
                if getattr(self, name) is not None:
                    raise ConfigValueError(
                        f"{self._name(name)} = {getattr(self, name)!r}: YaRN parameters need rope_type 'yarn', "
                        f"got rope_type 'default'",
                        field=self._name(name),
                    )
            return
        check_range(self._name("factor"), self.factor, gt=0)
        check_range(
            self._name("original_max_position_embeddings"), self.original_max_position_embeddings, ge=1
        )
        check_range(self._name("beta_fast"), self.beta_fast, gt=0)
        check_range(self._name("beta_slow"), self.beta_slow, gt=0)
        check_range(self._name("attention_factor"), self.attention_factor, gt=0)

    def missing(self) -> tuple[str, ...]:
        """Keys whose value is needed but unknown (``null``)."""
        out = [self.theta_key] if self.theta is None else []
        if self.is_yarn:
            out += [self._name(p) for p in _YARN_PARAMS if getattr(self, p) is None]
        return tuple(out)


@dataclass(frozen=True, kw_only=True)
class QuantizationConfig(Checked):
    """The checkpoint's weight quantisation (HF ``quantization_config``).

    Attributes:
        quant_method: ``"fp8"`` (E4M3 block-scaled weights) -- the only method DeepSeek checkpoints use.
        fmt: the FP8 element format.
        weight_block_size: ``(rows, cols)`` of one scale block: ``(128, 128)`` for V3, ``(32, 32)`` for V4.1.
        scale_fmt: ``"ue8m0"`` (power-of-two scales, V4/V4.1) or ``"float32"`` (a float32
            ``weight_scale_inv`` beside each weight, V3, whose config has no ``scale_fmt`` key).
        expert_dtype: routed-expert format, ``"fp4"`` (MXFP4) or ``"fp8"``; ``None`` = same as the weights.
        activation_scheme: ``"dynamic"`` (activations quantised on the fly).
    """

    _PREFIX: ClassVar[str] = "quantization_config"

    quant_method: Literal["fp8"]
    fmt: Literal["e4m3"] = "e4m3"
    weight_block_size: tuple[int, int]
    scale_fmt: Literal["ue8m0", "float32"] = "float32"
    expert_dtype: Literal["fp8", "fp4"] | None = None
    activation_scheme: Literal["dynamic"] = "dynamic"

    def _validate(self) -> None:
        for i, size in enumerate(self.weight_block_size):
            check_range(f"{self._PREFIX}.weight_block_size[{i}]", size, ge=1)

    @property
    def expert_format(self) -> str:
        """The routed experts' storage format (``"fp4"`` or ``"fp8"``)."""
        return self.expert_dtype or self.quant_method

    @classmethod
    def from_hf(cls, reader: HFReader, top_level_expert_dtype: str | None = None) -> QuantizationConfig:
        expert = reader.get("expert_dtype", str | None, None)
        if expert is None:
            expert = top_level_expert_dtype
        return _construct(
            cls,
            reader,
            quant_method=reader.get("quant_method", str),
            fmt=reader.get("fmt", str, "e4m3"),
            weight_block_size=reader.get("weight_block_size", tuple[int, int]),
            scale_fmt=reader.get("scale_fmt", str | None, None) or "float32",
            expert_dtype=expert,
            activation_scheme=reader.get("activation_scheme", str, "dynamic"),
        )


def _construct(cls: type, reader: HFReader, **kwargs: Any) -> Any:
    """Build a config dataclass, adding the file name to any error its validation raises."""
    try:
        return cls(**kwargs)
    except (ConfigValueError, ConfigTypeError) as exc:
        if reader.source in str(exc):
            raise
        raise type(exc)(f"{exc} (in {reader.source})", field=exc.field) from None


def read_rope_entry(
    reader: HFReader,
    *,
    theta: Any = REQUIRED,
    theta_key: str | None = None,
    default_attention_factor: float | None = None,
    magnitude_scaling: bool = True,
) -> RopeConfig:
    """Parse a transformers-style rope dict (``rope_parameters`` or one of its ``main``/``compress`` entries).

    The type is read from ``rope_type`` or the older ``type`` (both may be present; they must agree). Keys a
    rope instance does not use here (``partial_rotary_factor``, ...) are ignored. ``theta`` overrides the
    entry's own ``rope_theta`` (legacy ``rope_scaling`` dicts carry no base); ``magnitude_scaling=False``
    drops ``mscale``/``mscale_all_dim`` (V4 and V4.1 never apply them).
    """
    rope_type = reader.get("rope_type", str | None, None)
    legacy_type = reader.get("type", str | None, None)
    if rope_type is not None and legacy_type is not None and rope_type != legacy_type:
        raise reader.error("type", f"= {legacy_type!r} contradicts rope_type = {rope_type!r}")
    rope_type = rope_type or legacy_type or "default"
    if rope_type not in ("default", "yarn"):
        raise reader.error(
            "rope_type", f"= {rope_type!r}: unsupported RoPE type; supported: 'default', 'yarn'"
        )
    if theta is REQUIRED:
        theta = reader.get("rope_theta", float | None)
    kwargs: dict[str, Any] = {}
    if rope_type == "yarn":
        for name in _YARN_PARAMS:
            kwargs[name] = reader.get(
                name, (int if name == "original_max_position_embeddings" else float) | None
            )
        for name in _YARN_OPTIONAL:
            kwargs[name] = reader.get(name, float | None, None)
        if kwargs["attention_factor"] is None:
            kwargs["attention_factor"] = default_attention_factor
        if not magnitude_scaling:
            kwargs["mscale"] = kwargs["mscale_all_dim"] = None
    return _construct(
        RopeConfig,
        reader,
        theta=theta,
        rope_type=rope_type,
        theta_key=theta_key or reader.path("rope_theta"),
        scaling_key=reader.prefix or "rope_scaling",
        **kwargs,
    )


MODEL_FAMILIES: dict[str, type[ModelConfig]] = {}
"""``model_type`` -> config class; filled as the family modules are imported."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig(Checked):
    """Fields every DeepSeek family shares; a family subclass adds its own and parses its spelling.

    Attributes:
        hf: the complete original ``config.json`` dict (read-only); :meth:`to_hf_dict` returns a plain copy.
        source: where it was read from (for messages); not part of equality.
        architectures: the HF ``architectures`` list.
        checkpoint_dtype: dtype of the checkpoint's unquantised tensors (HF ``dtype``/``torch_dtype``).
            The engine's compute dtype is :attr:`EngineConfig.dtype`, not this.
        quantization: the checkpoint's weight quantisation, ``None`` for an unquantised checkpoint.
        rope: the main RoPE (V3: every layer; V4/V4.1: sliding-window-only and draft layers).

    The remaining fields are the HF keys of the same name.
    """

    MODEL_TYPE: ClassVar[str] = ""
    ARCHITECTURE: ClassVar[str] = ""

    @property
    def checkpoint_dtype_key(self) -> str:
        """The ``config.json`` key :attr:`checkpoint_dtype` came from: ``dtype`` (newer exports) or
        ``torch_dtype``."""
        hf = self.hf or {}
        return "dtype" if hf.get("dtype") is not None or "torch_dtype" not in hf else "torch_dtype"

    hf: Mapping[str, Any] = field(repr=False)
    source: str | None = field(default=None, compare=False, repr=False)
    architectures: tuple[str, ...] = ()
    checkpoint_dtype: str | None = None
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_nextn_predict_layers: int = 0
    num_attention_heads: int
    rms_norm_eps: float
    max_position_embeddings: int | None
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    quantization: QuantizationConfig | None = None
    rope: RopeConfig
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    scoring_func: str
    norm_topk_prob: bool
    topk_method: str

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.MODEL_TYPE:
            MODEL_FAMILIES[cls.MODEL_TYPE] = cls

    # ----------------------------------------------------------------------------------------- identity

    @property
    def family(self) -> str:
        """``"deepseek_v3"``, ``"deepseek_v4"`` or ``"deepseek_v41"`` (the HF ``model_type``)."""
        return self.MODEL_TYPE

    @property
    def num_layers_total(self) -> int:
        """Backbone plus draft (MTP/DSpark) layers."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    # ------------------------------------------------------------------------------------------ parsing

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], *, source: str | None = None) -> ModelConfig:
        """Parse an HF ``config.json`` dict.

        On :class:`ModelConfig` itself this dispatches on ``model_type``; on a family class the
        ``model_type`` must be that family's.
        """
        source = source or "<config dict>"
        if not isinstance(hf, Mapping):
            raise ConfigTypeError(f"model config from {source}: expected a mapping, got {type(hf).__name__}")
        reader = HFReader(hf, source=source)
        model_type = reader.get("model_type", str)
        family = MODEL_FAMILIES.get(model_type)
        if family is None:
            raise reader.error(
                "model_type", f"= {model_type!r}: unsupported; supported: {', '.join(sorted(MODEL_FAMILIES))}"
            )
        if cls is not ModelConfig and family is not cls:
            raise reader.error("model_type", f"= {model_type!r}: expected {cls.MODEL_TYPE!r}")
        kwargs = family._parse(reader)
        return _construct(family, reader, hf=hf, source=source, **kwargs)

    @classmethod
    def _parse(cls, reader: HFReader) -> dict[str, Any]:
        """Read this family's keys into constructor keyword arguments (subclasses extend)."""
        raise NotImplementedError(f"{cls.__name__} is abstract; parse through ModelConfig.from_hf")

    @classmethod
    def _parse_common(cls, top: HFReader, text: HFReader) -> dict[str, Any]:
        """Keys shared by all families; ``text`` is where model keys live (``text_config`` for V4.1)."""
        architectures = top.get("architectures", tuple[str, ...] | None, None) or ()
        if architectures and (len(architectures) != 1 or architectures[0] != cls.ARCHITECTURE):
            raise top.error(
                "architectures", f"= {list(architectures)!r}: expected exactly one name, {cls.ARCHITECTURE!r}"
            )
        dtype = top.get("dtype", str | None, None)
        if dtype is None:
            dtype = top.get("torch_dtype", str | None, None)
        quant_reader = top.sub("quantization_config", required=False)
        quantization = None
        if quant_reader is not None:
            quantization = QuantizationConfig.from_hf(quant_reader, top.get("expert_dtype", str | None, None))
        return {
            "architectures": architectures,
            "checkpoint_dtype": dtype,
            "vocab_size": text.get("vocab_size", int),
            "hidden_size": text.get("hidden_size", int),
            "num_hidden_layers": text.get("num_hidden_layers", int),
            "num_nextn_predict_layers": text.get("num_nextn_predict_layers", int, 0),
            "num_attention_heads": text.get("num_attention_heads", int),
            "rms_norm_eps": text.get("rms_norm_eps", float),
            "max_position_embeddings": text.get("max_position_embeddings", int | None),
            "hidden_act": text.get("hidden_act", str, "silu"),
            "tie_word_embeddings": text.get("tie_word_embeddings", bool, False),
            "bos_token_id": top.get("bos_token_id", int | None, None),
            "eos_token_id": top.get("eos_token_id", int | tuple[int, ...] | None, None),
            "pad_token_id": top.get("pad_token_id", int | None, None),
            "quantization": quantization,
            "moe_intermediate_size": text.get("moe_intermediate_size", int),
            "n_routed_experts": text.get("n_routed_experts", int),
            "n_shared_experts": text.get("n_shared_experts", int),
            "num_experts_per_tok": text.get("num_experts_per_tok", int),
            "routed_scaling_factor": text.get("routed_scaling_factor", float),
            "norm_topk_prob": text.get("norm_topk_prob", bool),
        }

    # ------------------------------------------------------------------------------------- validation

    def _validate(self) -> None:
        n = self._name
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            check_range(n(name), getattr(self, name), ge=1)
        check_range(n("num_nextn_predict_layers"), self.num_nextn_predict_layers, ge=0)
        check_range(n("rms_norm_eps"), self.rms_norm_eps, gt=0)
        check_range(n("max_position_embeddings"), self.max_position_embeddings, ge=1)
        check_range(n("moe_intermediate_size"), self.moe_intermediate_size, ge=1)
        check_range(n("n_routed_experts"), self.n_routed_experts, ge=1)
        check_range(n("n_shared_experts"), self.n_shared_experts, ge=0)
        check_range(n("num_experts_per_tok"), self.num_experts_per_tok, ge=1, le=self.n_routed_experts)
        check_range(n("routed_scaling_factor"), self.routed_scaling_factor, gt=0)
        if self.hidden_act != "silu":
            raise ConfigValueError(
                f"{n('hidden_act')} = {self.hidden_act!r}: only 'silu' (SwiGLU) is supported",
                field=n("hidden_act"),
            )
        if self.checkpoint_dtype is not None and self.checkpoint_dtype not in (
            "bfloat16",
            "float32",
            "float16",
        ):
            key = self.checkpoint_dtype_key
            raise ConfigValueError(
                f"{key} = {self.checkpoint_dtype!r} (config.json's dtype of the checkpoint's unquantised tensors, "
                "not the engine's dtype setting): must be one of 'bfloat16', 'float32', 'float16'",
                field=key,
            )
        for name in ("bos_token_id", "pad_token_id"):
            check_range(name, getattr(self, name), ge=0, lt=self.vocab_size)
        eos = self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)
        for token in eos:
            check_range("eos_token_id", token, ge=0, lt=self.vocab_size)

    def _layer_ids(self, name: str, ids: tuple[int, ...] | None, *, limit: int | None = None) -> None:
        """Check a layer-id list: strictly increasing (sorted, no duplicates) and inside ``[0, limit)``."""
        if ids is None:
            return
        limit = self.num_hidden_layers if limit is None else limit
        for i, layer in enumerate(ids):
            check_range(f"{self._name(name)}[{i}]", layer, ge=0, lt=limit)
            if i and layer <= ids[i - 1]:
                raise ConfigValueError(
                    f"{self._name(name)} = {list(ids)!r}: must be sorted in increasing order without duplicates",
                    field=self._name(name),
                )

    # ----------------------------------------------------------------------------------- completeness

    def _nullable_values(self) -> Iterator[tuple[str, Any]]:
        """(key, value) of every value that may be ``null`` for sizing but is needed to build the model."""
        yield self._name("max_position_embeddings"), self.max_position_embeddings
        for key in self.rope.missing():
            yield key, None

    def missing_fields(self) -> tuple[str, ...]:
        """Config keys whose value is needed but unknown (``null``), as dotted paths in ``config.json``."""
        return tuple(dict.fromkeys(key for key, value in self._nullable_values() if value is None))

    def require_complete(self, purpose: str) -> None:
        """Refuse to continue towards ``purpose`` (e.g. ``"building parameters"``) if any value is unknown.

        Raises:
            ConfigValueError: naming every missing key, the purpose and the source file.
        """
        missing = self.missing_fields()
        if missing:
            raise ConfigValueError(
                f"{self.family} config from {self.source or '<config dict>'} is incomplete for {purpose}: "
                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} null (unknown); set "
                f"{'it' if len(missing) == 1 else 'them'} from the checkpoint's config.json",
                field=missing[0],
            )

    # ------------------------------------------------------------------------------------ conversions

    def to_hf_dict(self) -> dict[str, Any]:
        """A plain (JSON-able) copy of the original ``config.json`` dict."""
        return thaw(self.hf)

    def with_hf_overrides(self, overrides: Mapping[str, Any], *, source: str | None = None) -> ModelConfig:
        """A new config parsed from :attr:`hf` with dotted keys replaced.

        Keys are routed as :func:`~deepinfer_jax.config.hf.hf_key_path` describes (for V4.1, ``hidden_size``
        means ``text_config.hidden_size``). Going through the HF dict keeps :attr:`hf` and the parsed fields
        in step, which ``dataclasses.replace`` on a model field would not.
        """
        hf = self.to_hf_dict()
        for dotted, value in overrides.items():
            set_hf_key(hf, hf_key_path(hf, dotted), copy.deepcopy(thaw(value)))
        return ModelConfig.from_hf(hf, source=source or self.source)

    def derived(self) -> dict[str, Any]:
        """Quantities derived from the keys (for ``info`` and tests); families add their own."""
        return {"num_layers_total": self.num_layers_total}

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of the parsed fields (``hf`` excluded), the family and the derived values."""
        out: dict[str, Any] = {"family": self.family}
        for f in dataclasses.fields(self):
            if f.name in ("hf", "source"):
                continue
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                value = {g.name: thaw(getattr(value, g.name)) for g in dataclasses.fields(value)}
            out[f.name] = thaw(value)
        out["derived"] = self.derived()
        out["missing_fields"] = list(self.missing_fields())
        return out


def parse_hf_config(hf: Mapping[str, Any], *, source: str | None = None) -> ModelConfig:
    """Parse an HF ``config.json`` dict of any supported family (dispatch on ``model_type``)."""
    return ModelConfig.from_hf(hf, source=source)
