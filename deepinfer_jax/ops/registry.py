"""The op registry: one reference implementation per op, optional faster ones per backend.

Model code never decides which kernel runs. It names an op (``"rms_norm"``, ``"rope"``, ...) and the registry picks
an implementation from three inputs:

* the **platform** the computation is compiled for (``jax.default_backend()``, or an explicit ``platform=``);
* the **configured backend** (``"auto"`` or one of :data:`KNOWN_BACKENDS`), with optional per-op overrides;
* whether the candidate can actually run here (its ``available()`` probe, e.g. "is the CuteDSL package installed").

The reference implementation (``jnp``/``lax``, registered with the op) is the numerical truth and runs on every
platform, so a selection can always succeed: when the requested backend cannot run, the registry falls back to the
reference and logs why, once per distinct reason (selection happens at trace time, and a jitted function retraces
for every new shape bucket, so logging on every selection would repeat the same line many times). ``strict=True``
turns that fallback into an error, for benchmarks and kernel tests that must not silently measure the reference.

Selection never reads device properties (SM counts, compute capability): those would differ between the machine
that traces and the one that runs an exported program. Anything machine-specific belongs in the config, or in an
implementation's ``available()`` probe, which should be cheap and side-effect free because it runs at every
selection.

Kernel modules are imported lazily: an implementation may be registered as a ``"package.module:attribute"``
string, resolved on first selection. A kernel whose toolchain is missing (no CuteDSL wheel on a CPU machine) then
costs nothing until it is asked for, and its import error becomes the logged fallback reason.
"""

from __future__ import annotations

import contextvars
import dataclasses
import importlib
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
from absl import logging

REFERENCE = "reference"
AUTO = "auto"

#: Every backend name the registry accepts, reference first (see ARCHITECTURE.md §3).
KNOWN_BACKENDS: tuple[str, ...] = (REFERENCE, "pallas_gpu", "cutedsl_sm100", "ascend")

#: Platform names as ``jax.default_backend()`` reports them, plus ``"ascend"`` for exported Ascend programs.
KNOWN_PLATFORMS: tuple[str, ...] = ("cpu", "gpu", "tpu", "ascend")

# Spellings of a platform that name the same place as a `jax.default_backend()` value: `jax.export` and
# `lax.platform_dependent` speak of "cuda"/"rocm" where `jax.default_backend()` says "gpu".
_PLATFORM_ALIASES: dict[str, str] = {"cuda": "gpu", "rocm": "gpu"}

# The order "auto" tries non-reference implementations in, when their priorities tie: the most specialised first.
# A CuteDSL SM100 kernel only exists for one GPU generation and is the fastest there; its `available()` probe
# rejects other machines, and the portable Pallas kernel is the next choice.
_AUTO_ORDER: tuple[str, ...] = ("cutedsl_sm100", "pallas_gpu", "ascend")


_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


class BackendUnavailableError(RuntimeError):
    """A backend was requested with ``strict=True`` and cannot run this op here."""


class SelectionPolicy:
    """What an active op selection (``deepinfer_jax.ops.selection``) must provide to the registry.

    While one is active (:func:`activate`), every :meth:`OpRegistry.select` call that names no backend and no
    overrides (the way model code asks for an op) is answered by :meth:`choose`, so a whole traced step follows
    one ``ops`` config without the model code passing it around.
    """

    registry: OpRegistry

    def choose(self, name: str, platform: str | None) -> Selected:  # pragma: no cover - interface
        raise NotImplementedError


_ACTIVE: contextvars.ContextVar[SelectionPolicy | None] = contextvars.ContextVar(
    "deepinfer_ops_selection", default=None
)


def active_policy() -> SelectionPolicy | None:
    """The op selection in effect in this context (``None``: plain ``"auto"``)."""
    return _ACTIVE.get()


def activate(policy: SelectionPolicy | None) -> contextvars.Token[SelectionPolicy | None]:
    """Make ``policy`` the active selection; undo with :func:`deactivate` (prefer ``selection.use_selection``)."""
    return _ACTIVE.set(policy)


def deactivate(token: contextvars.Token[SelectionPolicy | None]) -> None:
    _ACTIVE.reset(token)


@dataclasses.dataclass(frozen=True)
class Selected:
    """The outcome of a selection: the function to call, which backend it belongs to, and why it was chosen.

    Calling a :class:`Selected` calls its function, so model code can hold on to it like a plain function.
    """

    op: str
    fn: Callable[..., Any]
    backend: str
    reason: str
    platform: str
    requested: str

    @property
    def fell_back(self) -> bool:
        """True when a specific non-reference backend was requested but the reference was chosen."""
        return self.requested not in (AUTO, REFERENCE) and self.backend == REFERENCE

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


@dataclasses.dataclass
class _Impl:
    """One registered non-reference implementation of an op."""

    backend: str
    target: Callable[..., Any] | str
    platforms: tuple[str, ...]
    available: Callable[[], bool] | None
    reason: str
    priority: int
    resolved: Callable[..., Any] | None = None

    def probe(self) -> tuple[Callable[..., Any] | None, str | None]:
        """Resolve the function and run the availability check.

        Returns ``(fn, None)`` when the implementation can run, ``(None, why_not)`` otherwise. A probe that raises
        counts as "not available" (the error text is the reason): probing is how the registry finds out that a
        toolchain is missing, and a missing toolchain must not break a model that can run on the reference.
        """
        if self.available is not None:
            try:
                ok = self.available()
            except Exception as e:  # a failing probe means "cannot run here", whatever the probe raised
                return None, f"{self.reason} (availability check raised {type(e).__name__}: {e})"
            if not ok:
                return None, self.reason
        if self.resolved is None:
            if callable(self.target):
                self.resolved = self.target
            else:
                try:
                    self.resolved = _import_target(self.target)
                except (ImportError, AttributeError) as e:
                    return None, f"cannot import {self.target!r} ({type(e).__name__}: {e})"
        return self.resolved, None


@dataclasses.dataclass
class _Op:
    name: str
    reference: Callable[..., Any]
    doc: str
    impls: dict[str, _Impl] = dataclasses.field(default_factory=dict)


def _import_target(target: str) -> Callable[..., Any]:
    module_name, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise AttributeError(f"{target!r} resolves to a non-callable {type(obj).__name__}")
    return obj


def _check_name(field: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{field} must be a str, got {type(value).__name__} {value!r}")
    if not _NAME_RE.fullmatch(value):
        raise ValueError(
            f"{field} must be a non-empty identifier (letters, digits, '_', starting with a letter), got {value!r}"
        )
    return value


def _check_backend(field: str, value: Any, *, allow_auto: bool) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{field} must be a str, got {type(value).__name__} {value!r}")
    allowed = ((AUTO,) if allow_auto else ()) + KNOWN_BACKENDS
    if value not in allowed:
        raise ValueError(f"{field}: unknown backend {value!r}; known backends: {', '.join(allowed)}")
    return value


def normalize_platform(platform: str | None) -> str:
    """The platform name selection uses: ``jax.default_backend()`` when ``None``, aliases (``"cuda"``) mapped.

    Any platform string is accepted here (a plugin may report a name this module has never heard of; such a
    platform simply has no kernels registered and gets the reference).
    """
    if platform is None:
        platform = jax.default_backend()
    if not isinstance(platform, str) or not platform:
        raise TypeError(
            f"platform must be a non-empty str or None, got {type(platform).__name__} {platform!r}"
        )
    platform = platform.lower()
    return _PLATFORM_ALIASES.get(platform, platform)


class OpRegistry:
    """A table of ops, each with its reference implementation and optional per-backend alternatives.

    The project uses one module-level instance (:data:`default_registry`, behind the module-level functions);
    tests build private instances so that fake backends never leak into the real table.
    """

    def __init__(self) -> None:
        self._ops: dict[str, _Op] = {}
        self._lock = threading.Lock()
        self._logged: set[tuple[str, str, str, str]] = set()

    # ------------------------------------------------------------------ registration

    def register_op(self, name: str, reference_fn: Callable[..., Any], *, doc: str) -> Callable[..., Any]:
        """Register op ``name`` with its reference implementation; returns ``reference_fn`` unchanged.

        ``doc`` is a one-line description shown by :meth:`describe`.
        """
        _check_name("op name", name)
        if not callable(reference_fn):
            raise TypeError(f"op {name!r}: reference_fn must be callable, got {type(reference_fn).__name__}")
        if not isinstance(doc, str) or not doc.strip():
            raise ValueError(f"op {name!r}: doc must be a non-empty str, got {doc!r}")
        with self._lock:
            if name in self._ops:
                raise ValueError(
                    f"op {name!r} is already registered (reference {self._ops[name].reference!r})"
                )
            self._ops[name] = _Op(name=name, reference=reference_fn, doc=doc.strip())
        return reference_fn

    def register_impl(
        self,
        op_name: str,
        backend: str,
        fn: Callable[..., Any] | str,
        *,
        platforms: Iterable[str] = ("gpu",),
        available: Callable[[], bool] | None = None,
        reason: str | None = None,
        priority: int = 0,
    ) -> None:
        """Register ``fn`` as the ``backend`` implementation of op ``op_name``.

        Args:
          op_name: a registered op.
          backend: one of :data:`KNOWN_BACKENDS` other than ``"reference"`` (the reference comes with the op).
          fn: the implementation, or a ``"package.module:attribute"`` string imported on first selection, so that
            kernel modules (and their toolchains) are only loaded when chosen.
          platforms: the platforms (:data:`KNOWN_PLATFORMS`) the implementation compiles for.
          available: an optional probe returning True when the implementation can run on this machine.
          reason: what the probe checks, in words; logged as the fallback reason when the probe fails.
          priority: among implementations ``"auto"`` may pick on one platform, higher wins; ties go to the more
            specialised backend (CuteDSL SM100, then Pallas, then Ascend).
        """
        _check_backend("backend", backend, allow_auto=False)
        if backend == REFERENCE:
            raise ValueError(
                f"op {op_name!r}: the reference implementation is given to register_op, not register_impl"
            )
        if not (callable(fn) or (isinstance(fn, str) and ":" in fn)):
            raise TypeError(
                f"op {op_name!r} backend {backend!r}: fn must be callable or a 'module:attribute' string, got {fn!r}"
            )
        if isinstance(platforms, str):
            raise TypeError(f"platforms must be a sequence of platform names, got the str {platforms!r}")
        platforms = tuple(platforms)
        if not all(isinstance(p, str) for p in platforms):
            raise TypeError(f"platforms must hold platform names (str), got {platforms!r}")
        plats = tuple(_PLATFORM_ALIASES.get(p, p) for p in platforms)
        if not plats:
            raise ValueError(f"op {op_name!r} backend {backend!r}: platforms must name at least one platform")
        for p in plats:
            if p not in KNOWN_PLATFORMS:
                raise ValueError(
                    f"op {op_name!r} backend {backend!r}: unknown platform {p!r}; known platforms: "
                    f"{', '.join(KNOWN_PLATFORMS)}"
                )
        if available is not None and not callable(available):
            raise TypeError(f"available must be a callable or None, got {type(available).__name__}")
        if reason is not None and not isinstance(reason, str):
            raise TypeError(f"reason must be a str or None, got {type(reason).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an int, got {type(priority).__name__} {priority!r}")
        with self._lock:
            op = self._get_op(op_name)
            if backend in op.impls:
                raise ValueError(f"op {op_name!r} already has a {backend!r} implementation")
            op.impls[backend] = _Impl(
                backend=backend,
                target=fn,
                platforms=plats,
                available=available,
                reason=reason or f"the {backend} availability check failed",
                priority=priority,
            )

    # ------------------------------------------------------------------ queries

    def list_ops(self) -> list[str]:
        """Registered op names, sorted."""
        return sorted(self._ops)

    def backends_for(self, name: str) -> list[str]:
        """Backends with an implementation of op ``name`` (the reference first)."""
        op = self._get_op(name)
        return [REFERENCE, *(b for b in KNOWN_BACKENDS if b in op.impls)]

    def doc(self, name: str) -> str:
        """The one-line description op ``name`` was registered with."""
        return self._get_op(name).doc

    def _get_op(self, name: str) -> _Op:
        if not isinstance(name, str):
            raise TypeError(f"op name must be a str, got {type(name).__name__} {name!r}")
        try:
            return self._ops[name]
        except KeyError:
            known = ", ".join(sorted(self._ops)) or "none"
            raise ValueError(f"unknown op {name!r}; registered ops: {known}") from None

    # ------------------------------------------------------------------ selection

    def select(
        self,
        name: str,
        *,
        backend: str | None = None,
        overrides: Mapping[str, str] | None = None,
        platform: str | None = None,
        strict: bool = False,
    ) -> Selected:
        """Choose the implementation of op ``name`` for ``platform`` under the configured backend.

        ``overrides`` maps op names to backends and wins over ``backend`` for the ops it names. ``"auto"`` picks
        the best implementation registered for the platform whose availability check passes, else the reference.
        A specific backend that cannot run here (not registered for this op, not for this platform, or its check
        fails) falls back to the reference with a logged warning, or raises :class:`BackendUnavailableError` when
        ``strict`` is set.

        ``backend=None`` (the default) with no ``overrides`` means "what the active op selection says"
        (``deepinfer_jax.ops.selection.use_selection``), and ``"auto"`` when none is active.
        """
        op = self._get_op(name)
        if backend is None:
            policy = _ACTIVE.get()
            if overrides is None and policy is not None and policy.registry is self:
                return policy.choose(name, platform)
            backend = AUTO
        _check_backend("backend", backend, allow_auto=True)
        requested = backend
        if overrides is not None:
            self._check_overrides(overrides)
            requested = overrides.get(name, backend)
        plat = normalize_platform(platform)

        if requested == REFERENCE:
            return Selected(name, op.reference, REFERENCE, "reference requested", plat, requested)
        if requested == AUTO:
            return self._select_auto(op, plat)

        impl = op.impls.get(requested)
        if impl is None:
            why = f"no {requested} implementation is registered for this op"
        elif plat not in impl.platforms:
            why = f"the {requested} implementation is registered for {', '.join(impl.platforms)}, not {plat}"
        else:
            fn, why = impl.probe()
            if fn is not None:
                return Selected(name, fn, requested, f"{requested} requested", plat, requested)
        if strict:
            raise BackendUnavailableError(f"op {name!r}: backend {requested!r} cannot run on {plat}: {why}")
        self._log_once(
            logging.WARNING,
            name,
            requested,
            plat,
            why,
            "op %r: backend %r cannot run on %s (%s); using the reference",
        )
        return Selected(name, op.reference, REFERENCE, f"fallback from {requested}: {why}", plat, requested)

    def implementation(
        self, name: str, backend: str, platform: str | None = None, *, any_platform: bool = False
    ) -> tuple[Callable[..., Any] | None, str]:
        """The ``backend`` implementation of op ``name`` if it can run on ``platform``: ``(fn, "")`` or
        ``(None, why_not)``. ``any_platform`` skips the platform check (Pallas interpret mode runs anywhere)."""
        op = self._get_op(name)
        _check_backend("backend", backend, allow_auto=False)
        if backend == REFERENCE:
            return op.reference, ""
        plat = normalize_platform(platform)
        impl = op.impls.get(backend)
        if impl is None:
            return None, f"no {backend} implementation is registered for this op"
        if not any_platform and plat not in impl.platforms:
            return (
                None,
                f"the {backend} implementation is registered for {', '.join(impl.platforms)}, not {plat}",
            )
        fn, why = impl.probe()
        return fn, why or ""

    def has_implementation(self, name: str, backend: str) -> bool:
        """True when op ``name`` has a registered ``backend`` implementation (on any platform)."""
        return backend == REFERENCE or backend in self._get_op(name).impls

    def reference(self, name: str) -> Callable[..., Any]:
        """The reference implementation of op ``name``."""
        return self._get_op(name).reference

    def select_auto(self, name: str, platform: str | None = None, *, log: bool = True) -> Selected:
        """What ``backend="auto"`` picks for op ``name`` on ``platform`` (no active selection consulted)."""
        return self._select_auto(self._get_op(name), normalize_platform(platform), log=log)

    def log_once(self, level: int, op: str, backend: str, plat: str, why: str, fmt: str) -> None:
        """Log ``fmt % (op, backend, plat, why)`` at ``level`` once per ``(op, backend, platform, why)``."""
        self._log_once(level, op, backend, plat, why, fmt)

    def _select_auto(self, op: _Op, plat: str, *, log: bool = True) -> Selected:
        candidates = sorted(
            (impl for impl in op.impls.values() if plat in impl.platforms),
            key=lambda impl: (-impl.priority, _AUTO_ORDER.index(impl.backend)),
        )
        skipped: list[str] = []
        for impl in candidates:
            fn, why = impl.probe()
            if fn is not None:
                return Selected(op.name, fn, impl.backend, f"auto: best available on {plat}", plat, AUTO)
            skipped.append(f"{impl.backend}: {why}")
            if log:
                self._log_once(
                    logging.INFO, op.name, impl.backend, plat, str(why), "op %r: auto skips %r on %s (%s)"
                )
        if skipped:
            reason = "auto: no registered implementation can run (" + "; ".join(skipped) + ")"
        else:
            reason = f"auto: no implementation registered for {plat}"
        return Selected(op.name, op.reference, REFERENCE, reason, plat, AUTO)

    def _check_overrides(self, overrides: Mapping[str, str]) -> None:
        if not isinstance(overrides, Mapping):
            raise TypeError(
                f"overrides must be a mapping of op name to backend, got {type(overrides).__name__}"
            )
        for op_name, be in overrides.items():
            if op_name not in self._ops:
                known = ", ".join(sorted(self._ops)) or "none"
                raise ValueError(f"overrides: unknown op {op_name!r}; registered ops: {known}")
            _check_backend(f"overrides[{op_name!r}]", be, allow_auto=True)

    def _log_once(self, level: int, op: str, backend: str, plat: str, why: str, fmt: str) -> None:
        key = (op, backend, plat, why)
        with self._lock:
            if key in self._logged:
                return
            self._logged.add(key)
        logging.log(level, fmt, op, backend, plat, why)

    def select_from(self, cfg: Any, name: str, *, platform: str | None = None) -> Selected:
        """:meth:`select` with the backend, overrides (and optional ``strict``) read from an ops config object.

        ``cfg`` is duck-typed: anything with ``backend`` (str) and ``overrides`` (mapping or None) attributes,
        such as ``deepinfer_jax.config.OpsConfig``; a ``strict`` attribute is honoured when present.
        """
        missing = [a for a in ("backend", "overrides") if not hasattr(cfg, a)]
        if missing:
            raise TypeError(
                f"select_from expects an ops config with attributes 'backend' and 'overrides'; "
                f"{type(cfg).__name__} lacks {', '.join(map(repr, missing))}"
            )
        return self.select(
            name,
            backend=cfg.backend,
            overrides=cfg.overrides,
            platform=platform,
            strict=bool(getattr(cfg, "strict", False)),
        )

    def get(
        self,
        name: str,
        *,
        backend: str | None = None,
        overrides: Mapping[str, str] | None = None,
        platform: str | None = None,
        strict: bool = False,
    ) -> Callable[..., Any]:
        """The selected implementation's function (see :meth:`select`)."""
        return self.select(name, backend=backend, overrides=overrides, platform=platform, strict=strict).fn

    def call(
        self,
        name: str,
        /,
        *args: Any,
        backend: str | None = None,
        overrides: Mapping[str, str] | None = None,
        platform: str | None = None,
        strict: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Select op ``name`` and call it with ``args``/``kwargs``.

        The keywords ``backend``, ``overrides``, ``platform`` and ``strict`` belong to the selection; no op may use
        them as parameter names.
        """
        return self.select(name, backend=backend, overrides=overrides, platform=platform, strict=strict)(
            *args, **kwargs
        )

    # ------------------------------------------------------------------ reporting

    def describe_rows(self, *, platform: str | None = None) -> list[dict[str, str]]:
        """One row per op: the name, each backend's platforms (``"-"`` if none), and what ``auto`` picks.

        Availability probes run here (and an unavailable implementation is marked), so the table reflects this
        machine; the ``auto`` column is for ``platform`` (default: the current one). No fallback is logged.
        """
        plat = normalize_platform(platform)
        rows = []
        for name in self.list_ops():
            op = self._ops[name]
            row = {"op": name, REFERENCE: "all"}
            for be in KNOWN_BACKENDS[1:]:
                impl = op.impls.get(be)
                if impl is None:
                    row[be] = "-"
                    continue
                cell = ",".join(impl.platforms)
                if impl.probe()[0] is None:
                    cell += " (unavailable)"
                row[be] = cell
            row["auto"] = self._select_auto(op, plat, log=False).backend
            row["doc"] = op.doc
            rows.append(row)
        return rows

    def describe(self, *, platform: str | None = None) -> str:
        """A plain-text table of ops × backends, with the ``auto`` choice for ``platform`` (``deepinfer-jax info``)."""
        plat = normalize_platform(platform)
        rows = self.describe_rows(platform=plat)
        columns = ["op", *KNOWN_BACKENDS, "auto"]
        header = {c: (f"auto ({plat})" if c == "auto" else c) for c in columns}
        widths = {
            c: max(len(header[c]), *(len(r[c]) for r in rows)) if rows else len(header[c]) for c in columns
        }
        lines = ["  ".join(header[c].ljust(widths[c]) for c in columns).rstrip()]
        lines.append("  ".join("-" * widths[c] for c in columns))
        lines += ["  ".join(r[c].ljust(widths[c]) for c in columns).rstrip() for r in rows]
        return "\n".join(lines)


#: The registry the project's ops register into and model code selects from.
default_registry = OpRegistry()

# The module-level API is the default registry's bound methods (same signatures and docstrings), so there is one
# definition of each operation rather than a wrapper per method.
register_op = default_registry.register_op
register_impl = default_registry.register_impl
select = default_registry.select
select_from = default_registry.select_from
get = default_registry.get
call = default_registry.call
list_ops = default_registry.list_ops
describe = default_registry.describe
