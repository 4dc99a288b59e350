"""Deeply immutable, hashable containers for config values.

Config objects are frozen dataclasses that JAX code can take as static (hashed) arguments, so every field must
be immutable *and* hashable. ``dict`` and ``list`` values (an HF ``config.json``, a per-op backend table) are
therefore stored as :class:`FrozenMapping` and ``tuple``; :func:`thaw` turns them back into plain JSON-able
containers, e.g. to write ``config.json`` unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["FrozenMapping", "freeze", "thaw"]


class FrozenMapping(Mapping[str, Any]):
    """An insertion-ordered, read-only, hashable mapping.

    Unlike ``types.MappingProxyType`` it is hashable (when its values are), which a frozen dataclass used as a
    static argument of ``jax.jit`` needs, and it cannot be mutated through a retained reference to the
    original dict because it holds its own copy.
    """

    __slots__ = ("_data", "_hash")

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        self._data: dict[str, Any] = dict(data or {})
        self._hash: int | None = None

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        if self._hash is None:
            # Order-independent, like dict equality.
            self._hash = hash(frozenset(self._data.items()))
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FrozenMapping):
            return self._data == other._data
        if isinstance(other, Mapping):
            return self._data == dict(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"FrozenMapping({self._data!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenMapping, (self._data,))


def freeze(value: Any) -> Any:
    """Return a deeply immutable copy: mappings become :class:`FrozenMapping`, lists and tuples tuples."""
    if isinstance(value, Mapping):
        return FrozenMapping({k: freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """Inverse of :func:`freeze`: mappings become ``dict`` and tuples ``list`` (JSON containers)."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [thaw(v) for v in value]
    return value
