"""One place that turns the ``ops`` config section into the implementation every op uses.

:func:`resolve_selection` reads ``ops.backend`` (``"auto"``, ``"reference"`` or a backend name), ``ops.overrides``
(per op), ``ops.strict`` and ``ops.interpret`` and, for a platform, returns an :class:`OpSelection`: one
:class:`~deepinfer_jax.ops.registry.Selected` per registered op, plus the lines that say what was chosen and why.
``deepinfer-jax info`` prints exactly this object, and the engine runs its step under it:

```python
from deepinfer_jax import ops

selection = ops.resolve_selection(engine_config.ops)  # platform: jax.default_backend()
selection.log()  # one INFO line per op, once per process and selection
with ops.use_selection(selection):  # while tracing: every ops.select(name) inside follows it
    lowered = jax.jit(step).lower(*args)
step = jax.jit(ops.bind_selection(step_fn, selection))  # the same, as a function wrapper
```

Model code does not change: it already asks the registry for ops by name (``ops.select("rms_norm")``,
``ops.get("v4_sink_attention")``), and a call that names no backend is answered by the active selection.

**Rules** (each a documented choice, docs/ops.md):

* ``backend="auto"``: the registry's best available implementation per op (ties: CuteDSL, Pallas, Ascend).
* ``backend="reference"``: every op runs its reference.
* ``backend=<name>``: every op that *has* a ``<name>`` implementation uses it when it can run on the platform.
  An op with no ``<name>`` implementation at all runs its reference: a global backend is a preference over the
  ops that have kernels, not a claim that every op has one. When the implementation exists but cannot run here
  (wrong platform, missing toolchain, failed probe) the op falls back to the reference with a logged warning,
  or -- with ``strict`` -- resolution fails, naming every such op in one :class:`BackendUnavailableError`.
  ``strict`` with a backend that no op implements at all is also an error.
* ``overrides={op: backend}``: names one op explicitly, so under ``strict`` that op must run exactly that
  backend (an op without one is an error too).
* ``interpret=True`` runs the ``pallas_gpu`` kernels with the Pallas interpreter on any platform (CPU tests of a
  whole model with the kernels selected; about 0.1 ms per grid step). Kernels that take no ``interpret=``
  argument cannot be interpreted and count as unable to run.

A selection is resolved once; ops registered later (a model family imported after resolution) are resolved on
first use with the same settings. Selections are hashable (by platform, settings and the chosen backend of each
op), so one can be a static argument of a jitted function. A ``jax.jit`` cache does not see context variables:
a function jitted once and traced under two different selections must take the selection as a static argument
(or be wrapped per selection with :func:`bind_selection`), or the second call reuses the first trace.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from absl import logging

from deepinfer_jax.ops.registry import (
    AUTO,
    KNOWN_BACKENDS,
    REFERENCE,
    BackendUnavailableError,
    OpRegistry,
    Selected,
    SelectionPolicy,
    activate,
    active_policy,
    deactivate,
    default_registry,
    normalize_platform,
)

__all__ = [
    "OpChoice",
    "OpSelection",
    "active_selection",
    "bind_selection",
    "resolve_selection",
    "use_selection",
]

PALLAS = "pallas_gpu"

_logged_lock = threading.Lock()
_logged: set[Any] = set()


@dataclasses.dataclass(frozen=True)
class OpChoice:
    """What one op uses under a selection: the backend that runs, the one asked for, and why.

    ``fell_back`` is true when the requested implementation exists but cannot run here (not when the op simply
    has no kernel of a globally requested backend).
    """

    op: str
    backend: str
    requested: str
    reason: str
    fell_back: bool

    def line(self) -> str:
        mark = " (fallback)" if self.fell_back else ""
        return f"op {self.op}: {self.backend}{mark} -- {self.reason}"


def _settings(cfg: Any, **given: Any) -> tuple[str, dict[str, str], bool, bool]:
    """``(backend, overrides, strict, interpret)`` from a duck-typed ops config and keyword overrides."""

    def pick(name: str, default: Any) -> Any:
        if given.get(name) is not None:
            return given[name]
        return getattr(cfg, name, default) if cfg is not None else default

    backend = pick("backend", AUTO)
    overrides = pick("overrides", None) or {}
    strict = pick("strict", False)
    interpret = pick("interpret", False)
    if not isinstance(backend, str):
        raise TypeError(f"ops.backend must be a str, got {type(backend).__name__} {backend!r}")
    if backend not in (AUTO, *KNOWN_BACKENDS):
        raise ValueError(
            f"ops.backend: unknown backend {backend!r}; known backends: {', '.join((AUTO, *KNOWN_BACKENDS))}"
        )
    if not isinstance(overrides, Mapping):
        raise TypeError(f"ops.overrides must map op names to backends, got {type(overrides).__name__}")
    for flag, value in (("strict", strict), ("interpret", interpret)):
        if not isinstance(value, bool):
            raise TypeError(f"ops.{flag} must be a bool, got {type(value).__name__} {value!r}")
    return backend, dict(overrides), strict, interpret


def _accepts_interpret(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "interpret" in params


class OpSelection(SelectionPolicy):
    """The resolved implementation of every op for one platform and one ``ops`` config (module docstring).

    Attributes:
      platform: the platform the ops were chosen for (``jax.default_backend()`` names, plus ``"ascend"``).
      backend, overrides, strict, interpret: the settings it was resolved from.
      choices: one :class:`OpChoice` per op, sorted by op name.
    """

    def __init__(
        self,
        *,
        registry: OpRegistry,
        platform: str,
        backend: str,
        overrides: Mapping[str, str],
        strict: bool,
        interpret: bool,
    ) -> None:
        self.registry = registry
        self.platform = platform
        self.backend = backend
        self.overrides = dict(sorted(overrides.items()))
        self.strict = strict
        self.interpret = interpret
        self._selected: dict[tuple[str, str], Selected] = {}
        self._fell_back: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    # ---------------------------------------------------------------------------------------------- resolving

    def _resolve(self, name: str, platform: str) -> tuple[Selected, str | None]:
        """The selection of op ``name`` on ``platform`` and, when a requested backend cannot run, why not."""
        reg = self.registry
        requested = self.overrides.get(name, self.backend)
        explicit = name in self.overrides
        if requested == AUTO:
            return reg.select_auto(name, platform), None
        if requested == REFERENCE:
            why = "reference requested" + (" (override)" if explicit else "")
            return Selected(name, reg.reference(name), REFERENCE, why, platform, requested), None
        if not explicit and not reg.has_implementation(name, requested):
            reason = f"no {requested} implementation of this op; reference"
            return Selected(name, reg.reference(name), REFERENCE, reason, platform, requested), None
        interpreted = self.interpret and requested == PALLAS
        fn, why = reg.implementation(name, requested, platform, any_platform=interpreted)
        if fn is not None and interpreted:
            if _accepts_interpret(fn):
                fn = functools.partial(fn, interpret=True)
            else:
                fn, why = None, "the pallas_gpu implementation takes no interpret= argument"
        if fn is not None:
            how = " in interpret mode" if interpreted else ""
            reason = f"{requested} requested{' (override)' if explicit else ''}{how}"
            return Selected(name, fn, requested, reason, platform, requested), None
        reason = f"fallback from {requested}: {why}"
        return Selected(name, reg.reference(name), REFERENCE, reason, platform, requested), why

    def _fallback(self, sel: Selected, why: str) -> None:
        self.registry.log_once(
            logging.WARNING,
            sel.op,
            sel.requested,
            sel.platform,
            why,
            "op %r: backend %r cannot run on %s (%s); using the reference",
        )

    def _get(self, name: str, platform: str) -> Selected:
        key = (name, platform)
        with self._lock:
            cached = self._selected.get(key)
        if cached is not None:
            return cached
        sel, why = self._resolve(name, platform)
        if why is not None:
            if self.strict:
                raise BackendUnavailableError(
                    f"ops.strict: op {name!r} cannot run backend {sel.requested!r} on {platform}: {why}"
                )
            self._fallback(sel, why)
        with self._lock:
            if why is not None:
                self._fell_back.add(key)
            return self._selected.setdefault(key, sel)

    def resolve_all(self) -> OpSelection:
        """Resolve every registered op now; under ``strict`` one error names every op that cannot run."""
        names = self.registry.list_ops()
        if (
            self.strict
            and self.backend not in (AUTO, REFERENCE)
            and not any(self.registry.has_implementation(n, self.backend) for n in names)
        ):
            raise BackendUnavailableError(
                f"ops.strict: ops.backend = {self.backend!r}, but no registered op has a {self.backend} "
                "implementation"
            )
        resolved, failures = {}, []
        for name in names:
            sel, why = self._resolve(name, self.platform)
            resolved[name] = (sel, why)
            if why is not None:
                failures.append(f"{name} ({sel.requested}: {why})")
        if self.strict and failures:
            raise BackendUnavailableError(
                f"ops.strict: {len(failures)} op(s) cannot run the requested backend on {self.platform}: "
                + "; ".join(failures)
            )
        for name, (sel, why) in resolved.items():
            if why is not None:
                self._fallback(sel, why)
            with self._lock:
                if why is not None:
                    self._fell_back.add((name, self.platform))
                self._selected.setdefault((name, self.platform), sel)
        return self

    # ------------------------------------------------------------------------------------- SelectionPolicy

    def choose(self, name: str, platform: str | None) -> Selected:
        """The implementation of op ``name`` (resolved now if the op was registered after this selection)."""
        plat = self.platform if platform is None else normalize_platform(platform)
        return self._get(name, plat)

    def select(self, name: str) -> Selected:
        """The implementation of op ``name`` on this selection's platform."""
        return self.choose(name, None)

    # ------------------------------------------------------------------------------------------- reporting

    @property
    def choices(self) -> tuple[OpChoice, ...]:
        with self._lock:
            items = sorted((n, s) for (n, p), s in self._selected.items() if p == self.platform)
            fell = {n for n, p in self._fell_back if p == self.platform}
        return tuple(OpChoice(n, s.backend, s.requested, s.reason, n in fell) for n, s in items)

    def backends(self) -> dict[str, str]:
        """``{op: backend that runs}``."""
        return {c.op: c.backend for c in self.choices}

    def lines(self) -> list[str]:
        """The selection in words: a header, then one line per op."""
        head = (
            f"ops on {self.platform}: backend={self.backend}, overrides={self.overrides or {}}, "
            f"strict={self.strict}, interpret={self.interpret}"
        )
        return [head, *(c.line() for c in self.choices)]

    def as_dict(self) -> dict[str, Any]:
        """What ``deepinfer-jax info`` prints (json-able)."""
        return {
            "platform": self.platform,
            "backend": self.backend,
            "overrides": dict(self.overrides),
            "strict": self.strict,
            "interpret": self.interpret,
            "selected": {
                c.op: {
                    "backend": c.backend,
                    "requested": c.requested,
                    "reason": c.reason,
                    "fell_back": c.fell_back,
                }
                for c in self.choices
            },
        }

    def log(self) -> None:
        """Log :meth:`lines` at INFO, once per process for equal selections (a run logs what each op uses)."""
        key = self._key()
        with _logged_lock:
            if key in _logged:
                return
            _logged.add(key)
        for line in self.lines():
            logging.info("%s", line)

    # ------------------------------------------------------------------------------------------ identity

    def _key(self) -> tuple[Any, ...]:
        return (
            id(self.registry),
            self.platform,
            self.backend,
            tuple(self.overrides.items()),
            self.strict,
            self.interpret,
            tuple((c.op, c.backend) for c in self.choices),
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OpSelection) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (
            f"OpSelection(platform={self.platform!r}, backend={self.backend!r}, overrides={self.overrides!r}, "
            f"strict={self.strict}, interpret={self.interpret}, ops={len(self.choices)})"
        )


def resolve_selection(
    ops_config: Any = None,
    *,
    platform: str | None = None,
    registry: OpRegistry | None = None,
    backend: str | None = None,
    overrides: Mapping[str, str] | None = None,
    strict: bool | None = None,
    interpret: bool | None = None,
) -> OpSelection:
    """Resolve every registered op under an ``ops`` config (module docstring for the rules).

    Args:
      ops_config: any object with ``backend`` / ``overrides`` / ``strict`` (and optionally ``interpret``)
        attributes, e.g. ``EngineConfig.ops``; ``None`` means the defaults (``auto``).
      platform: the platform to choose for (default ``jax.default_backend()``; ``"cuda"`` means ``"gpu"``;
        ``"ascend"`` when exporting for Ascend).
      registry: the registry (default: the project's).
      backend, overrides, strict, interpret: replace the config's values when given.

    Raises:
      ValueError / TypeError: an unknown backend, an override naming an unknown op or backend, a non-bool flag.
      BackendUnavailableError: ``strict`` and a requested backend cannot run (every such op is named).
    """
    reg = registry or default_registry
    be, ov, st, it = _settings(
        ops_config, backend=backend, overrides=overrides, strict=strict, interpret=interpret
    )
    known = set(reg.list_ops())
    for name, value in ov.items():
        if name not in known:
            raise ValueError(
                f"ops.overrides: unknown op {name!r}; registered ops: {', '.join(sorted(known))}"
            )
        if value not in (AUTO, *KNOWN_BACKENDS):
            raise ValueError(
                f"ops.overrides[{name!r}]: unknown backend {value!r}; known backends: "
                f"{', '.join((AUTO, *KNOWN_BACKENDS))}"
            )
    sel = OpSelection(
        registry=reg,
        platform=normalize_platform(platform),
        backend=be,
        overrides=ov,
        strict=st,
        interpret=it,
    )
    return sel.resolve_all()


def active_selection() -> OpSelection | None:
    """The selection :func:`use_selection` made active in this context, if any."""
    policy = active_policy()
    return policy if isinstance(policy, OpSelection) else None


@contextlib.contextmanager
def use_selection(selection: OpSelection | None) -> Iterator[OpSelection | None]:
    """Within the block, registry calls that name no backend follow ``selection`` (``None``: plain auto)."""
    if selection is not None and not isinstance(selection, OpSelection):
        raise TypeError(f"use_selection expects an OpSelection or None, got {type(selection).__name__}")
    token = activate(selection)
    try:
        yield selection
    finally:
        deactivate(token)


def bind_selection(fn: Callable[..., Any], selection: OpSelection) -> Callable[..., Any]:
    """``fn`` wrapped to run (and therefore trace) under ``selection``; jit the wrapper, one per selection."""
    if not isinstance(selection, OpSelection):
        raise TypeError(f"bind_selection expects an OpSelection, got {type(selection).__name__}")

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with use_selection(selection):
            return fn(*args, **kwargs)

    return wrapped
