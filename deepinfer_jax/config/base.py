"""Type checking and normalisation shared by every frozen config dataclass.

A config dataclass declares its fields with ordinary annotations (``int``, ``float | None``,
``tuple[int, ...]``, ``Literal["auto", "dummy"]``, ``Mapping[str, str]``, another config class). On
construction -- including ``dataclasses.replace`` -- :class:`Checked` verifies every value against its
annotation, normalises containers to immutable ones (list -> tuple, dict -> :class:`FrozenMapping`) and then
calls the class's ``_validate`` for range and consistency checks. The type rules are strict on purpose:

* ``bool`` is never accepted as an ``int`` (``True`` for a layer count is a bug, not a 1);
* an ``int`` is accepted where a ``float`` is expected (JSON and YAML write ``10000`` for a RoPE base);
* strings are never converted to numbers here; the environment-variable parser does that explicitly.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, Union

from deepinfer_jax.config.errors import ConfigTypeError, ConfigValueError, describe_value
from deepinfer_jax.config.frozen import FrozenMapping, freeze

__all__ = ["Checked", "check_range", "coerce"]


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {_type_name(args[0])}"
        return f"list of {len(args)} values"
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping):
        return "mapping"
    if tp is Any:
        return "any value"
    return getattr(tp, "__name__", str(tp))


class _Mismatch(Exception):
    """Internal: the value does not match one member of a union; try the next."""


def _coerce(value: Any, tp: Any, name: str) -> Any:
    if tp is Any:
        return freeze(value)
    if tp is type(None):
        if value is None:
            return None
        raise _Mismatch
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for member in typing.get_args(tp):
            try:
                return _coerce(value, member, name)
            except _Mismatch:
                continue
        raise _Mismatch
    if origin is Literal:
        # Literal fields are string enums: a wrong string is a value error naming the allowed ones.
        choices = typing.get_args(tp)
        if isinstance(value, str):
            if value in choices:
                return value
            raise ConfigValueError(
                f"{name} = {value!r}: must be one of {', '.join(repr(c) for c in choices)}", field=name
            )
        raise _Mismatch
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise _Mismatch
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce_item(v, args[0], f"{name}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigValueError(
                f"{name} = {list(value)!r}: expected exactly {len(args)} values, got {len(value)}", field=name
            )
        return tuple(_coerce_item(v, a, f"{name}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping):
        if not isinstance(value, Mapping):
            raise _Mismatch
        key_tp, val_tp = typing.get_args(tp) or (Any, Any)
        out = {}
        for k, v in value.items():
            if key_tp is str and not isinstance(k, str):
                raise ConfigTypeError(f"{name}: keys must be strings, got {describe_value(k)}", field=name)
            out[k] = _coerce_item(v, val_tp, f"{name}[{k!r}]")
        return FrozenMapping(out)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise _Mismatch
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise _Mismatch
    raise TypeError(f"unsupported annotation {tp!r} for {name}")  # a programming error, not bad input


def _coerce_item(value: Any, tp: Any, name: str) -> Any:
    try:
        return _coerce(value, tp, name)
    except _Mismatch:
        raise ConfigTypeError(
            f"{name}: expected {_type_name(tp)}, got {describe_value(value)}", field=name
        ) from None


def coerce(value: Any, tp: Any, name: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and return its normalised (immutable) form.

    Raises:
        ConfigTypeError: naming ``name``, the expected type and the value.
        ConfigValueError: for a string outside a ``Literal`` set or a fixed-length tuple of the wrong length.
    """
    return _coerce_item(value, tp, name)


def check_range(
    name: str,
    value: float | None,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> None:
    """Refuse ``value`` outside the given bounds with a message naming field, value and limit.

    ``None`` passes (optional fields are checked only when set).
    """
    if value is None:
        return
    if ge is not None and not value >= ge:
        raise ConfigValueError(f"{name} = {value!r}: must be >= {ge!r}", field=name)
    if gt is not None and not value > gt:
        raise ConfigValueError(f"{name} = {value!r}: must be > {gt!r}", field=name)
    if le is not None and not value <= le:
        raise ConfigValueError(f"{name} = {value!r}: must be <= {le!r}", field=name)
    if lt is not None and not value < lt:
        raise ConfigValueError(f"{name} = {value!r}: must be < {lt!r}", field=name)


class Checked:
    """Mixin for frozen dataclasses: type-check and normalise all fields, then run ``_validate``.

    Subclasses set ``_PREFIX`` to their place in the tree (``"cache"``) so that messages name the full dotted
    field (``cache.block_size``); fields are addressed through :meth:`_name`.
    """

    _PREFIX: ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = _type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            normalised = coerce(value, hints[f.name], self._name(f.name))
            if normalised is not value:
                object.__setattr__(self, f.name, normalised)
        self._validate()

    def _name(self, field_name: str) -> str:
        return f"{self._PREFIX}.{field_name}" if self._PREFIX else field_name

    def _validate(self) -> None:
        """Range and consistency checks of the subclass (types are already checked)."""
