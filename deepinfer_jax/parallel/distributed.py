"""Multi-process start-up: ``jax.distributed.initialize`` from :class:`~deepinfer_jax.config.tree.ParallelConfig`.

A mesh spanning several hosts (or several processes on one host) needs every process to join one JAX
distributed system before any backend starts: afterwards ``jax.devices()`` lists the devices of *all*
processes, host-major, and :func:`~.mesh.make_mesh` lays its ``(dp, ep)`` grid over them as over local devices.
Each process runs the same program on the same inputs (SPMD); arrays on the mesh are global, each process
holding the shards of its own devices (:func:`~.model_parallel.place_on_mesh` builds them).

On the CPU, cross-process collectives go through gloo (``jax_cpu_collectives_implementation``, the default
of the installed JAX); :func:`initialize` selects it explicitly when the config still says ``"none"``, so a
multi-process CPU run never compiles collectives that cannot leave the process.
"""

from __future__ import annotations

import math
import threading

import jax

from deepinfer_jax.config.tree import ParallelConfig

__all__ = ["initialize", "is_multi_process"]

_LOCK = threading.Lock()
_ACTIVE: tuple[str, int, int] | None = None


def _parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"parallel.coordinator_address = {address!r}: expected 'host:port' with a port in [1, 65535]"
        )
    return host, int(port)


def is_multi_process(cfg: ParallelConfig) -> bool:
    """Whether ``cfg`` asks for more than one process (``num_processes > 1``)."""
    if not isinstance(cfg, ParallelConfig):
        raise TypeError(f"cfg: expected a ParallelConfig, got {type(cfg).__name__}")
    return cfg.num_processes is not None and cfg.num_processes > 1


def initialize(cfg: ParallelConfig) -> bool:
    """Join the JAX distributed system ``cfg`` describes; returns whether this is a multi-process run.

    * ``num_processes`` unset or 1 (and no coordinator): a no-op returning ``False``; nothing is started.
    * ``num_processes > 1``: calls ``jax.distributed.initialize(coordinator_address, num_processes,
      process_id, initialization_timeout=...)``; process 0 also hosts the coordinator service at that address.
      Must run before anything touches a JAX backend (``jax.devices()``, creating an array, compiling).
    * Calling it again with the same settings returns ``True`` without doing anything (so every entry point may
      call it); a second call with other settings, or a distributed system started elsewhere with another
      process count or index, is refused.

    Raises:
      TypeError: ``cfg`` is not a :class:`ParallelConfig`.
      ValueError: a coordinator address without a process count, a multi-process config lacking
        ``coordinator_address`` or ``process_id``, a malformed address, or settings that contradict an
        already initialised distributed system (each message names the fields and values).
      RuntimeError: a JAX backend was already started in this process, so it can no longer join.
    """
    global _ACTIVE
    if not isinstance(cfg, ParallelConfig):
        raise TypeError(f"cfg: expected a ParallelConfig, got {type(cfg).__name__}")
    count, pid, address = cfg.num_processes, cfg.process_id, cfg.coordinator_address
    if count is None and address is not None:
        raise ValueError(
            f"parallel.coordinator_address = {address!r} is set but parallel.num_processes is not; set both "
            "(and parallel.process_id) for a multi-process run"
        )
    if not is_multi_process(cfg):
        return False
    if address is None:
        raise ValueError(f"parallel.num_processes = {count} needs parallel.coordinator_address ('host:port')")
    if pid is None:
        raise ValueError(
            f"parallel.num_processes = {count} needs parallel.process_id (this process's index in [0, {count}))"
        )
    _parse_address(address)
    wanted = (address, count, pid)
    with _LOCK:
        if jax.distributed.is_initialized():
            if wanted == _ACTIVE:
                return True
            if _ACTIVE is None and (jax.process_count(), jax.process_index()) == (count, pid):
                _ACTIVE = wanted  # started by someone else with the same process layout: adopt it
                return True
            have = _ACTIVE or ("<unknown>", jax.process_count(), jax.process_index())
            raise ValueError(
                "jax.distributed is already initialised with coordinator_address, num_processes, process_id = "
                f"{have}; parallel asks for {wanted}"
            )
        if jax.config.jax_cpu_collectives_implementation in (None, "none"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        try:
            jax.distributed.initialize(
                coordinator_address=address,
                num_processes=count,
                process_id=pid,
                initialization_timeout=max(1, math.ceil(cfg.initialization_timeout_s)),
            )
        except RuntimeError as e:
            raise RuntimeError(
                f"jax.distributed.initialize (process {pid} of {count}, coordinator {address}) failed: {e}. "
                "It must run before any JAX computation or device query in the process."
            ) from e
        _ACTIVE = wanted
    return True
