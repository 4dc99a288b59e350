"""Gin files and bindings as a config source, without gin's global state.

gin-config keeps one process-wide registry of configurables and bindings; using it directly would let two
config loads (two engines, a sweep's points, two tests) leak bindings into each other. Only gin's *parser* is
used here: statements are read into plain ``(path, value, location)`` records, macros are resolved locally
and nothing is registered or bound globally. The supported language is gin's binding syntax:

.. code-block:: none

    # comments
    cache.block_size = 64
    scheduler.max_num_seqs = 4
    engine.dtype = "float32"            # root fields live under "engine"
    model.num_hidden_layers = 3         # any HF key (dotted for nesting: model.rope_scaling.factor)
    ops.overrides = {"rope": "reference"}
    BLOCK = 64                          # a macro ...
    cache.block_size = %BLOCK           # ... and its use
    include "other.gin"                 # relative to the including file

Configurable references (``@name``), scopes (``scope/cache.x``) and ``import`` statements have no meaning for a
config tree and are refused with the file and line.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gin import config_parser

from deepinfer_jax.config.errors import ConfigValueError

__all__ = ["GinBinding", "parse_gin"]


@dataclass(frozen=True)
class GinBinding:
    """One binding: ``path`` is the dotted target split into parts (``("cache", "block_size")``)."""

    path: tuple[str, ...]
    value: Any
    location: str


@dataclass(frozen=True)
class _MacroRef:
    name: str
    location: str


class _Delegate(config_parser.ParserDelegate):
    """Builds placeholder objects for macros and refuses configurable references."""

    def __init__(self, where: str) -> None:
        self.where = where

    def configurable_reference(self, scoped_configurable_name: str, evaluate: bool) -> Any:
        raise ConfigValueError(
            f"{self.where}: configurable reference @{scoped_configurable_name} is not supported in config "
            "bindings; bind plain values"
        )

    def macro(self, macro_name: str) -> Any:
        return _MacroRef(macro_name, self.where)


def _location(where: str, loc: config_parser.Location) -> str:
    return f"{where}:{loc.line_num}" if loc.line_num is not None else where


def _parse_text(
    text: str,
    where: str,
    base_dir: Path | None,
    statements: list[tuple[str, str, Any, str]],
    seen: tuple[Path, ...],
) -> None:
    try:
        parser = config_parser.ConfigParser(text, _Delegate(where))
        for stmt in parser:
            if isinstance(stmt, config_parser.IncludeStatement):
                include = Path(stmt.filename)
                if not include.is_absolute() and base_dir is not None:
                    include = base_dir / include
                _parse_file(include, statements, seen, included_from=_location(where, stmt.location))
            elif isinstance(stmt, config_parser.BindingStatement):
                loc = _location(where, stmt.location)
                if stmt.scope:
                    raise ConfigValueError(
                        f"{loc}: scoped binding {stmt.scope}/{stmt.selector}.{stmt.arg_name} is not supported "
                        "(scopes have no meaning for the config tree)"
                    )
                statements.append((stmt.selector, stmt.arg_name, stmt.value, loc))
            else:
                raise ConfigValueError(
                    f"{_location(where, stmt.location)}: import statements are not supported in config bindings"
                )
    except SyntaxError as exc:
        line = f":{exc.lineno}" if exc.lineno else ""
        raise ConfigValueError(f"{where}{line}: gin syntax error: {exc.msg}") from None


def _parse_file(
    path: Path, statements: list[tuple[str, str, Any, str]], seen: tuple[Path, ...], included_from: str = ""
) -> None:
    resolved = path.resolve()
    if resolved in seen:
        raise ConfigValueError(f"gin file {path} includes itself (via {included_from})")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        via = f" (included from {included_from})" if included_from else ""
        raise FileNotFoundError(f"cannot read gin file {path}{via}: {exc.strerror or exc}") from None
    _parse_text(text, str(path), path.parent, statements, (*seen, resolved))


def _resolve(value: Any, macros: dict[str, Any], stack: tuple[str, ...] = ()) -> Any:
    if isinstance(value, _MacroRef):
        if value.name not in macros:
            raise ConfigValueError(f"{value.location}: undefined macro %{value.name}")
        if value.name in stack:
            raise ConfigValueError(f"{value.location}: macro %{value.name} refers to itself")
        return _resolve(macros[value.name], macros, (*stack, value.name))
    if isinstance(value, list):
        return [_resolve(v, macros, stack) for v in value]
    if isinstance(value, tuple):
        return tuple(_resolve(v, macros, stack) for v in value)
    if isinstance(value, dict):
        return {k: _resolve(v, macros, stack) for k, v in value.items()}
    return value


def parse_gin(files: Sequence[str | Path] = (), bindings: Iterable[str] | str = ()) -> list[GinBinding]:
    """Parse gin files, then binding strings, into bindings in application order (later wins).

    Args:
        files: gin files, applied in order.
        bindings: binding strings (one binding per string, or several separated by newlines), applied after
            the files.

    Raises:
        ConfigValueError: syntax errors, undefined macros and unsupported statements, with file and line.
        FileNotFoundError: a gin file (or an included one) cannot be read.
    """
    statements: list[tuple[str, str, Any, str]] = []
    for path in files:
        _parse_file(Path(path), statements, ())
    if isinstance(bindings, str):
        bindings = [bindings]
    for i, text in enumerate(bindings):
        _parse_text(text, f"gin binding #{i} {text.strip()!r}", None, statements, ())

    macros: dict[str, Any] = {}
    targets: list[tuple[str, str, Any, str]] = []
    for selector, arg_name, value, loc in statements:
        if not arg_name:  # "NAME = value" defines a macro
            macros[selector] = value
        else:
            targets.append((selector, arg_name, value, loc))
    return [
        GinBinding((*selector.split("."), arg_name), _resolve(value, macros), loc)
        for selector, arg_name, value, loc in targets
    ]
