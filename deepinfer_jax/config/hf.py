"""Typed reading of HF ``config.json`` dicts.

transformers writes many keys an inference engine never reads (``initializer_range``, ``id2label``, ...), so
the readers here look up only the keys they are asked for and ignore the rest. Every lookup states the
expected type; a mismatch or a missing required key is refused with a message naming the key (its full path,
e.g. ``text_config.hidden_size``), the file and the expected type.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deepinfer_jax.config.base import coerce
from deepinfer_jax.config.errors import ConfigTypeError, ConfigValueError, describe_value

__all__ = ["REQUIRED", "V41_TOP_LEVEL_KEYS", "HFReader", "hf_key_path", "set_hf_key"]


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()
"""Sentinel default of :meth:`HFReader.get`: the key must be present."""

# Keys that live at the top level of a V4.1 config.json; every other model key is under ``text_config``.
V41_TOP_LEVEL_KEYS = frozenset(
    {
        "architectures",
        "model_type",
        "dtype",
        "torch_dtype",
        "quantization_config",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "vision_config",
        "text_config",
        "transformers_version",
    }
)


class HFReader:
    """Typed, read-only view of one level of an HF config dict.

    Args:
        data: the mapping at this level.
        source: where the dict came from, for messages (``"ckpt/config.json"``).
        prefix: the dotted path of this level inside the file (``"text_config"``), empty at the top.
    """

    def __init__(self, data: Mapping[str, Any], *, source: str, prefix: str = "") -> None:
        self.data = data
        self.source = source
        self.prefix = prefix

    def path(self, key: str) -> str:
        """The full dotted path of ``key`` in the file."""
        return f"{self.prefix}.{key}" if self.prefix else key

    def has(self, key: str) -> bool:
        return key in self.data

    def get(self, key: str, tp: Any, default: Any = REQUIRED) -> Any:
        """Return ``data[key]`` checked against the annotation ``tp`` (e.g. ``int``, ``float | None``).

        A missing key returns ``default``; with the default :data:`REQUIRED` it is an error. A present key is
        always type-checked, so an explicit ``null`` passes only where ``tp`` allows ``None``.
        """
        if key not in self.data:
            if default is REQUIRED:
                raise ConfigValueError(
                    f"config key {self.path(key)} is required but missing (in {self.source})",
                    field=self.path(key),
                )
            return default
        try:
            return coerce(self.data[key], tp, self.path(key))
        except ConfigTypeError as exc:
            raise ConfigTypeError(f"config key {exc} (in {self.source})", field=exc.field) from None
        except ConfigValueError as exc:
            raise ConfigValueError(f"config key {exc} (in {self.source})", field=exc.field) from None

    def sub(self, key: str, *, required: bool = True) -> HFReader | None:
        """Reader for the nested mapping at ``key`` (``None`` when absent or null and not required)."""
        value = self.data.get(key)
        if value is None:
            if required:
                what = "missing" if key not in self.data else "null"
                raise ConfigValueError(
                    f"config key {self.path(key)} is required but {what} (in {self.source})",
                    field=self.path(key),
                )
            return None
        if not isinstance(value, Mapping):
            raise ConfigTypeError(
                f"config key {self.path(key)}: expected mapping, got {describe_value(value)} (in {self.source})",
                field=self.path(key),
            )
        return HFReader(value, source=self.source, prefix=self.path(key))

    def error(self, key: str, message: str) -> ConfigValueError:
        """A :class:`ConfigValueError` about ``key`` (message completed with its path and the file)."""
        return ConfigValueError(
            f"config key {self.path(key)} {message} (in {self.source})", field=self.path(key)
        )


def hf_key_path(hf: Mapping[str, Any], dotted: str) -> tuple[str, ...]:
    """Where a dotted model key lives in ``hf``.

    V4.1 nests its model keys under ``text_config``; a key given as ``num_hidden_layers`` (by a yaml
    override, a gin binding ``model.num_hidden_layers`` or a keyword override) is routed there unless it is one
    of the V4.1 top-level keys. An explicit ``text_config.x`` is taken as written. Flat (V3, V4) dicts keep
    the path as written.
    """
    if not dotted or any(not part for part in dotted.split(".")):
        raise ConfigValueError(
            f"model key {dotted!r}: empty component in dotted name", field=f"model.{dotted}"
        )
    parts = tuple(dotted.split("."))
    if isinstance(hf.get("text_config"), Mapping) and parts[0] not in V41_TOP_LEVEL_KEYS:
        return ("text_config", *parts)
    return parts


def set_hf_key(hf: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """Set ``hf[path[0]][path[1]]... = value`` in place, creating intermediate dicts.

    Refuses to descend through a non-mapping value (``rope_scaling.factor`` where ``rope_scaling`` is null
    creates the dict; where it is a number it is an error).
    """
    node = hf
    for i, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None:
            child = {}
            node[part] = child
        elif not isinstance(child, dict):
            if isinstance(child, Mapping):
                child = dict(child)
                node[part] = child
            else:
                where = ".".join(path[: i + 1])
                raise ConfigTypeError(
                    f"model key {'.'.join(path)}: {where} is {describe_value(child)}, not a mapping",
                    field="model." + ".".join(path),
                )
        node = child
    node[path[-1]] = value
