"""The persistent compilation cache: a second start of the same model and buckets compiles nothing.

JAX keeps compiled executables on disk when ``jax_compilation_cache_dir`` is set, keyed by everything that
changes the program: the lowered module's fingerprint (shapes, dtypes, shardings, the op selection baked into
it), the compile options, the backend, its devices and the jax / jaxlib versions. A changed model, bucket, mesh or
setting is a different key, so a stale entry is never served; the cache only saves compiling the same program
twice. It is one setting per process: the first engine (or a script calling :func:`configure`) that turns it on
chooses the folder for the whole process.

:func:`configure` applies ``ops.compile_cache`` / ``ops.kernel_cache_dir`` (``DEEPINFER_JIT_CACHE_DIR``):

* ``kernel_cache_dir`` given: that folder, whatever JAX was told before (the engine setting is explicit);
* else, when JAX's own cache is already configured (``JAX_COMPILATION_CACHE_DIR`` or
  ``jax.config.update``), that one is kept: it is the user's setting;
* else ``<cache>/jit``, where ``<cache>`` is ``$DEEPINFER_JAX_CACHE`` or ``~/.cache/deepinfer_jax`` (the folder
  of the materialised built-in models).

When the engine chooses the folder, it also caches programs however fast they compiled
(``jax_persistent_cache_min_compile_time_secs = 0``; JAX's default of 1 s would leave a CPU engine's many
sub-second programs to be compiled at every start) unless ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` is set.

:func:`counters` reads JAX's own monitoring events (``/jax/compilation_cache/cache_hits`` and
``.../cache_misses``), counted process-wide from the first call of this module.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pickle
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.experimental.compilation_cache import compilation_cache

__all__ = [
    "CacheCounters",
    "TraceCounters",
    "compile_traced",
    "configure",
    "counters",
    "default_dir",
    "source_fingerprint",
    "struct_of",
    "trace_counters",
]

_MIN_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
_HIT = "/jax/compilation_cache/cache_hits"
_MISS = "/jax/compilation_cache/cache_misses"
_SAVED = "/jax/compilation_cache/compile_time_saved_sec"


@dataclasses.dataclass(frozen=True)
class CacheCounters:
    """Process-wide persistent-cache events so far (subtract two readings for an interval).

    Attributes:
      hits: compilations served from the persistent cache.
      misses: compilations that looked in the cache, found nothing and compiled (then wrote the entry, when it
        took at least the minimum compile time).
      saved_seconds: compile time the hits saved (their recorded compile time less the time to read them).
    """

    hits: int = 0
    misses: int = 0
    saved_seconds: float = 0.0

    def __sub__(self, other: CacheCounters) -> CacheCounters:
        return CacheCounters(
            self.hits - other.hits, self.misses - other.misses, self.saved_seconds - other.saved_seconds
        )


_lock = threading.Lock()
_counts = {"hits": 0, "misses": 0, "saved": 0.0, "trace_hits": 0, "trace_misses": 0}
_listening = False


def _on_event(event: str, **_: object) -> None:
    if event == _HIT:
        with _lock:
            _counts["hits"] += 1
    elif event == _MISS:
        with _lock:
            _counts["misses"] += 1


def _on_duration(event: str, duration_secs: float, **_: object) -> None:
    if event == _SAVED:
        with _lock:
            _counts["saved"] += float(duration_secs)


def _listen() -> None:
    global _listening
    with _lock:
        if _listening:
            return
        _listening = True
    jax.monitoring.register_event_listener(_on_event)
    jax.monitoring.register_event_duration_secs_listener(_on_duration)


def counters() -> CacheCounters:
    """The persistent cache's hits, misses and saved seconds in this process so far."""
    _listen()
    with _lock:
        return CacheCounters(_counts["hits"], _counts["misses"], _counts["saved"])


def default_dir() -> Path:
    """``$DEEPINFER_JAX_CACHE/jit``, else ``~/.cache/deepinfer_jax/jit``."""
    root = os.environ.get("DEEPINFER_JAX_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "deepinfer_jax") / "jit"


def configure(enabled: bool = True, directory: str | os.PathLike[str] | None = None) -> str | None:
    """Apply ``ops.compile_cache`` (``enabled``) and ``ops.kernel_cache_dir`` (``directory``) to this process.

    Returns the folder compiled programs are cached in, or ``None`` when nothing is cached. When this function
    chose the folder (``directory`` given, or the default), traced programs (:func:`compile_traced`) are kept
    in its ``traces/`` sub-folder while JAX's folder stays that one; a folder configured through JAX itself gets
    JAX's cache only. See the module
    docstring for which folder wins. ``enabled=False`` leaves JAX's settings as they are: a cache configured
    through JAX itself stays in use (a warning says so), and ``directory`` is then refused.
    """
    global _trace_dir
    _listen()
    current = jax.config.jax_compilation_cache_dir or None
    if not enabled:
        _trace_dir = None
        if directory is not None:
            raise ValueError(
                f"ops.kernel_cache_dir = {str(directory)!r} with ops.compile_cache = False: a cache folder for a "
                "disabled cache; drop one of the two"
            )
        if current:
            logging.warning(
                "ops.compile_cache = False, but JAX's own persistent cache is configured "
                "(jax_compilation_cache_dir = %s) and stays in use for this process",
                current,
            )
        return current
    if directory is None and current:
        if _trace_dir is None or str(_trace_dir.parent) != current:
            _trace_dir = None  # a folder configured through JAX: JAX's cache only, no trace cache
        return current  # the user's JAX setting (or this module's, from an earlier call)
    target = str(Path(directory) if directory is not None else default_dir())
    Path(target).mkdir(parents=True, exist_ok=True)
    if target != current:
        jax.config.update("jax_compilation_cache_dir", target)
        if _MIN_TIME_ENV not in os.environ:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        compilation_cache.reset_cache()  # the next compile opens the new folder
        logging.info("persistent compilation cache: %s", target)
    _trace_dir = Path(target) / "traces"
    return target


# ------------------------------------------------------------------------------------------------ traces
#
# JAX's cache saves the XLA compile, but every start still traces and lowers the step in Python, which is most of
# a second start's time (a small V4.1 step: seconds per bucket on 2 CPU cores). compile_traced keeps the lowered
# program itself, serialised with jax.export, under a key of everything the trace depends on; a later start
# deserialises it and compiles a thin wrapper around it (which JAX's cache then serves).

_trace_dir: Path | None = None
_TRACE_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class TraceCounters:
    """Process-wide :func:`compile_traced` outcomes: programs read from the trace cache, and traced anew."""

    hits: int = 0
    misses: int = 0


def trace_counters() -> TraceCounters:
    """The trace cache's hits and misses in this process so far."""
    with _lock:
        return TraceCounters(_counts["trace_hits"], _counts["trace_misses"])


def _package_files() -> list[Path]:
    import deepinfer_jax

    root = Path(deepinfer_jax.__file__).resolve().parent
    files = sorted(root.rglob("*.py"))
    for name in ("pallas_kernels", "custom_calls"):
        other = root.parent / name
        if other.is_dir():
            files += sorted(other.rglob("*.py"))
    return files


@functools.cache
def source_fingerprint() -> str:
    """sha256 over the source of ``deepinfer_jax``, ``pallas_kernels`` and ``custom_calls`` and the jax / jaxlib
    versions: any change of the code that traces a program is a different trace key."""
    import jaxlib

    h = hashlib.sha256(f"jax {jax.__version__} jaxlib {jaxlib.__version__} format {_TRACE_FORMAT}".encode())
    for path in _package_files():
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def struct_of(x: Any) -> jax.ShapeDtypeStruct:
    """The abstract argument :func:`compile_traced` takes for array ``x`` (numpy or jax): shape, dtype, sharding."""
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), sharding=getattr(x, "sharding", None))


def _describe(structs: Any) -> str:
    leaves, tree = jax.tree.flatten(structs)
    parts = [str(tree)]
    for leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        spec = getattr(sharding, "spec", None)
        parts.append(f"{leaf.shape}/{leaf.dtype}/{spec}/{getattr(sharding, 'memory_kind', None)}")
    return "\n".join(parts)


def _devices_of(structs: Any) -> str:
    for leaf in jax.tree.leaves(structs):
        sharding = getattr(leaf, "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None:
            return f"mesh {dict(mesh.shape)} {[(d.platform, d.device_kind, d.id) for d in mesh.devices.flat]}"
        if sharding is not None:
            return f"devices {[(d.platform, d.device_kind, d.id) for d in sharding.device_set]}"
    d = jax.devices()[0]
    return f"default {d.platform} {d.device_kind}"


def compile_traced(
    fn: Callable[..., Any],
    args: Sequence[Any],
    *,
    static_key: str,
    donate_argnums: tuple[int, ...] = (),
) -> Callable[..., Any]:
    """``jax.jit(fn, donate_argnums=...).lower(*args).compile()``, but through the trace cache when it is on.

    ``args`` are pytrees of ``jax.ShapeDtypeStruct`` (with shardings); ``static_key`` must describe everything
    else the trace depends on that the source fingerprint and the arguments' structure, shapes, dtypes and
    shardings do not (configs and options baked into ``fn``). The result takes the same pytrees and returns
    ``fn``'s output pytree. Without a cache folder, or for arguments spread over several processes, this is
    plain ``jit``. A cache entry that cannot be read is traced anew (and rewritten).
    """
    jitted = jax.jit(fn, donate_argnums=donate_argnums)
    directory = _trace_dir
    if directory is not None and str(directory.parent) != (jax.config.jax_compilation_cache_dir or ""):
        directory = (
            None  # JAX's folder changed since configure: the trace cache goes with the folder it chose
        )
    multi_process = any(
        not getattr(getattr(leaf, "sharding", None), "is_fully_addressable", True)
        for leaf in jax.tree.leaves(args)
    )
    if directory is None or multi_process or re.search(r" at 0x[0-9a-fA-F]+", static_key):
        # No folder; shards in other processes; or a static part known only by its address (a new key per
        # process would only fill the folder).
        return jitted.lower(*args).compile()
    flat_args, in_tree = jax.tree.flatten(tuple(args))
    key = hashlib.sha256(
        "\n--\n".join(
            (source_fingerprint(), _devices_of(args), _describe(tuple(args)), str(donate_argnums), static_key)
        ).encode()
    ).hexdigest()
    path = directory / f"{key}.trace"
    counts = [len(jax.tree.leaves(a)) for a in args]
    donated = tuple(i for a in donate_argnums for i in range(sum(counts[:a]), sum(counts[: a + 1])))
    exported = out_tree = None
    if path.exists():
        try:
            out_tree, blob = pickle.loads(path.read_bytes())
            exported = jax.export.deserialize(blob)
        except Exception as err:  # a torn or foreign file: trace anew
            logging.warning("trace cache: %s unreadable (%s); tracing anew", path.name, err)
            exported = None
    if exported is None:
        holder: list[Any] = []

        def flat_fn(*leaves: Any) -> list[Any]:
            outs, tree = jax.tree.flatten(fn(*jax.tree.unflatten(in_tree, leaves)))
            holder.append(tree)
            return outs

        try:
            exported = jax.export.export(jax.jit(flat_fn, donate_argnums=donated))(*flat_args)
        except Exception as err:  # e.g. a custom call or host callback jax.export will not serialise
            logging.info("trace cache: cannot export this program (%s); compiling without it", err)
            with _lock:
                _counts["trace_misses"] += 1
            return jitted.lower(*args).compile()
        out_tree = holder[-1]
        try:
            directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_bytes(pickle.dumps((out_tree, exported.serialize())))
            os.replace(tmp, path)
        except Exception as err:  # the cache is an optimisation: a full disk only costs the next start
            logging.warning("trace cache: cannot write %s (%s)", path, err)
        with _lock:
            _counts["trace_misses"] += 1
    else:
        with _lock:
            _counts["trace_hits"] += 1
    compiled = jax.jit(exported.call, donate_argnums=donated).lower(*flat_args).compile()
    return _FlatCall(compiled, out_tree)


class _FlatCall:
    """A compiled program over flat leaves, called with the original pytrees."""

    def __init__(self, compiled: Any, out_tree: Any) -> None:
        self._compiled = compiled
        self._out_tree = out_tree

    def __call__(self, *args: Any) -> Any:
        return jax.tree.unflatten(self._out_tree, self._compiled(*jax.tree.leaves(args)))
