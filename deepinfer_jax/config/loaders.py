"""Loading the config tree from its sources, lowest to highest priority:

1. dataclass defaults;
2. the HF ``config.json`` of the model (a checkpoint directory, a ``config.json`` file, or the ``model:``
   section of a yaml file);
3. a yaml file: its ``model:`` section (HF keys with their own names and nesting, deep-merged over the
   ``config.json``) and its tree sections ``engine:``, ``cache:``, ``parallel:``, ``scheduler:``,
   ``speculative:``, ``sampling:``, ``ops:``;
4. gin files and bindings (``cache.block_size = 64``, ``engine.dtype = "float32"``, ``model.num_hidden_layers =
   3``), parsed without touching gin's global state;
5. ``DEEPINFER_*`` environment variables (:mod:`deepinfer_jax.config.env`);
6. keyword overrides / absl flags: a dict of dotted names; a ``None`` value does not apply, so that a flag left
   unset lets the lower sources decide.

Model keys given by any source are routed into the HF dict (for V4.1, ``num_hidden_layers`` means
``text_config.num_hidden_layers``) and the whole dict is parsed once at the end, so the parsed model config and
its :attr:`~deepinfer_jax.config.model.ModelConfig.hf` dict always agree. When a value is refused, the message
also names the source that supplied it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from deepinfer_jax.config import env as env_module
from deepinfer_jax.config.errors import ConfigTypeError, ConfigValueError, describe_value
from deepinfer_jax.config.ginparse import parse_gin
from deepinfer_jax.config.hf import V41_TOP_LEVEL_KEYS, hf_key_path, set_hf_key
from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.config.tree import SECTIONS, EngineConfig

__all__ = [
    "YAML_SECTIONS",
    "load_config",
    "load_model_config",
    "load_yaml",
    "parse_overrides",
    "read_yaml_file",
]

YAML_SECTIONS: tuple[str, ...] = ("model", "engine", *SECTIONS)
"""Top-level sections a config yaml may have."""


# ------------------------------------------------------------------------------------------------- yaml


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader with two fixes for config files.

    * YAML 1.2 floats: PyYAML follows YAML 1.1, where ``1e-6`` (no dot) is a *string*; every other tool
      (JSON, Python) reads it as a number, and a silent string would only fail later with a confusing type
      error.
    * Duplicate keys are an error instead of "last one wins", which silently hides a typo'd override.
    """


_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, Any] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise ConfigValueError(
                f"{loader.name}:{key_node.start_mark.line + 1}: duplicate key {key!r} "
                f"(first at line {seen[key] + 1})"
            )
        seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_yaml_file(path: str | Path) -> Any:
    """Read a yaml file with the strict loader (YAML 1.2 floats, duplicate keys refused)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise FileNotFoundError(f"cannot read yaml file {path}: {exc.strerror or exc}") from None
    loader = _StrictLoader(text)
    loader.name = str(path)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        raise ConfigValueError(f"{path}: invalid yaml: {exc}") from None
    finally:
        loader.dispose()


def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _check_section_fields(section: str, values: Any, path: Path) -> None:
    if not isinstance(values, Mapping):
        raise ConfigTypeError(
            f"section {section!r} of {path}: expected a mapping of fields, got {describe_value(values)}",
            field=section,
        )
    allowed = EngineConfig.ROOT_FIELDS if section == "engine" else _field_names(SECTIONS[section])
    for key in values:
        if key not in allowed:
            raise ConfigValueError(
                f"unknown field {key!r} in section {section!r} of {path}; allowed: {', '.join(allowed)}",
                field=f"{section}.{key}",
            )


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a config yaml, refusing unknown sections and unknown fields.

    Returns:
        The file's dict (sections present in the file only). The ``model:`` section is an HF ``config.json``
        dict; it is checked by the model parser, not here (HF dicts legitimately hold keys nobody reads).

    Raises:
        ConfigValueError / ConfigTypeError: naming the key, the file and the allowed names.
        FileNotFoundError: the file cannot be read.
    """
    path = Path(path)
    data = read_yaml_file(path)
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigTypeError(
            f"{path}: a config yaml must be a mapping of sections, got {describe_value(data)}"
        )
    for section, values in data.items():
        if section not in YAML_SECTIONS:
            raise ConfigValueError(
                f"unknown section {section!r} in {path}; allowed: {', '.join(YAML_SECTIONS)}",
                field=str(section),
            )
        if section == "model":
            if not isinstance(values, Mapping):
                raise ConfigTypeError(
                    f"section 'model' of {path}: expected an HF config.json mapping, got {describe_value(values)}",
                    field="model",
                )
        elif values is not None:
            _check_section_fields(section, values, path)
    return {k: (dict(v) if isinstance(v, Mapping) else {}) for k, v in data.items()}


# ----------------------------------------------------------------------------------------- model files


def _read_json(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise FileNotFoundError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigValueError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
    if not isinstance(data, dict):
        raise ConfigTypeError(f"{path}: a config.json must hold a JSON object, got {describe_value(data)}")
    return data


def _model_source(path: Path) -> tuple[dict[str, Any] | None, dict[str, Any], str, str | None]:
    """Read a model argument: ``(hf_dict, yaml_sections, source_name, model_path)``."""
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        return _read_json(config), {}, str(config), str(path)
    suffix = path.suffix.lower()
    if suffix == ".json":
        return _read_json(path), {}, str(path), str(path.parent)
    if suffix in (".yaml", ".yml"):
        data = load_yaml(path)
        model = data.pop("model", None)
        return model, data, f"{path} (section model)", None
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    raise ConfigValueError(
        f"model path {path}: expected a checkpoint directory, a config.json or a .yaml/.yml file",
        field="model",
    )


def load_model_config(path: str | Path) -> ModelConfig:
    """Parse the model config at ``path``: a checkpoint directory, a ``config.json`` or a yaml (``model:``)."""
    hf, _, source, _ = _model_source(Path(path))
    if hf is None:
        raise ConfigValueError(f"{path} has no 'model' section", field="model")
    return ModelConfig.from_hf(hf, source=source)


def _deep_merge(base: dict[str, Any], update: Mapping[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), Mapping):
            merged = dict(base[key])
            _deep_merge(merged, value)
            base[key] = merged
        else:
            base[key] = copy.deepcopy(value)


def _merge_model_section(hf: dict[str, Any], section: Mapping[str, Any]) -> None:
    """Deep-merge a yaml ``model:`` section over ``hf``, routing flat keys into ``text_config`` for V4.1.

    A V4.1 yaml overlay may spell ``num_hidden_layers: 3`` flat; left at the top level the parser would
    ignore it, so it goes where the model reads it, exactly like a dotted override.
    """
    nested = isinstance(hf.get("text_config"), Mapping)
    routed: dict[str, Any] = {}
    for key, value in section.items():
        if nested and key not in V41_TOP_LEVEL_KEYS:
            routed.setdefault("text_config", {})[key] = value
        else:
            _deep_merge(routed, {key: value})
    _deep_merge(hf, routed)


# ------------------------------------------------------------------------------------------- overrides


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """Parse ``["cache.block_size=64", "engine.dtype=float32"]`` (e.g. from a repeated absl flag) into a dict.

    Values are read as yaml scalars/flow collections (``64`` -> int, ``1e-6`` -> float, ``[1, 2]`` -> list,
    ``null`` -> None, anything else a string).
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigValueError(f"override {item!r}: expected NAME=VALUE (e.g. cache.block_size=64)")
        loader = _StrictLoader(text)
        try:
            out[key.strip()] = loader.get_single_data()
        except yaml.YAMLError as exc:
            raise ConfigValueError(f"override {item!r}: cannot parse the value: {exc}") from None
        finally:
            loader.dispose()
    return out


class _Settings:
    """Accumulates tree settings and model-key overrides with the source of each, later sources winning."""

    def __init__(self) -> None:
        self.values: dict[str, tuple[Any, str]] = {}  # "cache.block_size" / root "dtype" -> (value, source)
        self.model: dict[str, tuple[Any, str]] = {}  # dotted model key -> (value, source)

    def target(self, dotted: str, source: str) -> tuple[bool, str]:
        """Validate a dotted name; return ``(is_model_key, key)`` where it is stored."""
        parts = dotted.split(".")
        head = parts[0]
        if head == "model":
            if len(parts) < 2 or not all(parts[1:]):
                raise ConfigValueError(
                    f"{source}: {dotted!r} must name a model key (model.hidden_size)", field=dotted
                )
            return True, ".".join(parts[1:])
        if head == "engine":
            parts = parts[1:]
            if len(parts) != 1:
                raise ConfigValueError(
                    f"{source}: {dotted!r} must name one root field (engine.dtype)", field=dotted
                )
            head = parts[0]
        if len(parts) == 1:
            if head in SECTIONS:
                raise ConfigValueError(
                    f"{source}: {dotted!r} names a section; set its fields one by one ({head}.<field>)",
                    field=dotted,
                )
            if head not in EngineConfig.ROOT_FIELDS:
                raise ConfigValueError(
                    f"{source}: unknown setting {dotted!r}; root fields: {', '.join(EngineConfig.ROOT_FIELDS)}; "
                    f"sections: {', '.join(('model', *SECTIONS))}",
                    field=dotted,
                )
            return False, head
        if head not in SECTIONS:
            raise ConfigValueError(
                f"{source}: unknown section {head!r} in {dotted!r}; allowed: "
                f"{', '.join(('engine', 'model', *SECTIONS))}",
                field=dotted,
            )
        fields = _field_names(SECTIONS[head])
        if len(parts) != 2 or parts[1] not in fields:
            raise ConfigValueError(
                f"{source}: unknown field {dotted!r}; fields of {head!r}: {', '.join(fields)}", field=dotted
            )
        return False, dotted

    def set(self, dotted: str, value: Any, source: str) -> None:
        is_model, key = self.target(dotted, source)
        store = self.model if is_model else self.values
        # Re-insert so that iteration order is the order of the *last* setting: model keys are applied in
        # that order, and two spellings of one key ("x" and "text_config.x") must resolve by priority.
        store.pop(key, None)
        store[key] = (value, source)

    def section_kwargs(self, section: str) -> dict[str, Any]:
        prefix = section + "."
        return {k[len(prefix) :]: v for k, (v, _) in self.values.items() if k.startswith(prefix)}

    def root_kwargs(self) -> dict[str, Any]:
        return {k: v for k, (v, _) in self.values.items() if "." not in k}

    def source_of(self, field: str | None) -> str | None:
        if field is None:
            return None
        base = field.split("[")[0]
        if base in self.values:
            return self.values[base][1]
        for key, (_, source) in self.model.items():
            if base in (key, f"text_config.{key}") or base.endswith("." + key):
                return source
        return None


def _with_source(exc: ConfigValueError | ConfigTypeError, settings: _Settings) -> Exception:
    source = settings.source_of(exc.field)
    if source is None or source in str(exc):
        return exc
    return type(exc)(f"{exc} [set by {source}]", field=exc.field)


def load_config(
    model: str | Path | None = None,
    *,
    yaml_path: str | Path | None = None,
    gin_files: Iterable[str | Path] = (),
    gin_bindings: Iterable[str] | str = (),
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> EngineConfig:
    """Build the :class:`EngineConfig` from all sources (priority in the module docstring); see
    :func:`load_config_with_sources` for the arguments."""
    config, _ = load_config_with_sources(
        model,
        yaml_path=yaml_path,
        gin_files=gin_files,
        gin_bindings=gin_bindings,
        env=env,
        overrides=overrides,
    )
    return config


def load_config_with_sources(
    model: str | Path | None = None,
    *,
    yaml_path: str | Path | None = None,
    gin_files: Iterable[str | Path] = (),
    gin_bindings: Iterable[str] | str = (),
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[EngineConfig, dict[str, str]]:
    """:func:`load_config` and, for every tree field a source set, where its value came from
    (``{"cache.block_size": "yaml file f.yaml", "seed": "environment variable DEEPINFER_X", ...}``; root fields
    bare). Fields left at their defaults are absent.

    Without any model source the result has ``model=None``: engine settings only (enough for ``info`` and
    for checking a settings file); building a model from it is refused by
    :meth:`EngineConfig.require_model`.

    Args:
        model: checkpoint directory, ``config.json`` or yaml file; ``None`` if ``yaml_path`` has the model
            section. A directory (or the directory of a ``config.json``) becomes the default ``model_path``.
            A yaml given here is used whole: its ``model:`` section is the HF base and its other sections
            apply below those of ``yaml_path``.
        yaml_path: a config yaml (:func:`load_yaml`).
        gin_files, gin_bindings: gin sources, files first.
        env: environment to read ``DEEPINFER_*`` variables from; ``None`` = ``os.environ``, ``{}`` = none.
        overrides: dotted names to values (``{"cache.block_size": 64, "dtype": "float32",
            "model.num_hidden_layers": 3}``); ``None`` values are skipped.

    Raises:
        ConfigValueError / ConfigTypeError: any bad value, naming the field, the value, the limit and the source
            that set it.
    """
    settings = _Settings()
    hf: dict[str, Any] | None = None
    sources: list[str] = []
    model_path: str | None = None

    yaml_layers: list[tuple[dict[str, Any], str]] = []
    if model is not None:
        hf, sections, source, model_path = _model_source(Path(model))
        sources.append(source)
        if sections:
            yaml_layers.append((sections, str(model)))
    if yaml_path is not None:
        data = load_yaml(yaml_path)
        model_section = data.pop("model", None)
        if model_section is not None:
            if hf is None:
                hf = copy.deepcopy(model_section)
            else:
                _merge_model_section(hf, model_section)
            sources.append(f"{yaml_path} (section model)")
        yaml_layers.append((data, str(yaml_path)))
    for sections, name in yaml_layers:
        for section, values in sections.items():
            for key, value in values.items():
                prefix = "engine" if section == "engine" else section
                settings.set(f"{prefix}.{key}", value, f"yaml file {name}")

    for binding in parse_gin(tuple(gin_files), gin_bindings):
        settings.set(".".join(binding.path), binding.value, f"gin {binding.location}")

    for dotted, (value, source) in env_module.read_env(env).items():
        settings.set(dotted, value, source)

    for dotted, value in (overrides or {}).items():
        if not isinstance(dotted, str):
            raise ConfigTypeError(
                f"override key {dotted!r}: expected a dotted name string", field=str(dotted)
            )
        if value is None:
            settings.target(dotted, "override")  # the name must be valid, but a None value does not apply
            continue
        settings.set(dotted, value, f"override {dotted}")

    if hf is None and settings.model:
        keys = ", ".join(f"model.{k}" for k in settings.model)
        raise ConfigValueError(
            f"{keys}: model keys were given but there is no model config to apply them to; pass model= "
            "(checkpoint directory, config.json or yaml) or a yaml_path with a 'model:' section",
            field="model",
        )
    if hf is not None:
        for dotted, (value, _) in settings.model.items():
            set_hf_key(hf, hf_key_path(hf, dotted), copy.deepcopy(value))

    try:
        model_cfg = None if hf is None else ModelConfig.from_hf(hf, source=" + ".join(sources) or None)
        sections_built = {name: cls(**settings.section_kwargs(name)) for name, cls in SECTIONS.items()}
        root = settings.root_kwargs()
        if model_path is not None:
            root.setdefault("model_path", model_path)
        config = EngineConfig(model=model_cfg, **sections_built, **root)
        return config, {k: source for k, (_, source) in settings.values.items()}
    except (ConfigValueError, ConfigTypeError) as exc:
        raise _with_source(exc, settings) from None
