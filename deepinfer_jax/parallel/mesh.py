"""The ``(dp, ep)`` device mesh (ARCHITECTURE §5).

Every device is an attention rank that owns whole sequences; the ``ep`` axis groups ``ep`` consecutive devices
into one expert-parallel group that together holds every expert slot once, and ``dp`` places ``dp`` such groups
side by side (each a full replica of the experts). DeepInfer's EP64 decode is ``dp=1, ep=64``; two EP4 groups
on eight devices are ``dp=2, ep=4``. ``data_parallel_size`` therefore counts expert-group replicas, not
attention ranks: the number of attention ranks is always ``dp * ep``.

The mesh uses ``AxisType.Auto`` axes. With ``Explicit`` axes (``jax.make_mesh``'s default on JAX 0.12) every
array entering a ``shard_map`` must already carry the exact ``in_specs`` sharding, which would force every caller
(engine, tests, notebooks) to place the token batch by hand before each MoE layer; with ``Auto`` axes the
``shard_map`` boundaries reshard what they are given and jit's sharding propagation handles the rest. Arrays that
live on the mesh for long (parameters, caches) are still placed explicitly, through :mod:`.rules`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from deepinfer_jax.config.tree import ParallelConfig

__all__ = ["ALL_AXES", "DP", "EP", "make_mesh", "mesh_from_config", "mesh_sizes"]

DP = "dp"
"""Mesh axis of expert-group replicas (data parallelism across EP groups)."""
EP = "ep"
"""Mesh axis of the expert-parallel group: expert slots are sharded over it."""
ALL_AXES: tuple[str, str] = (DP, EP)
"""Both axes, major to minor: the ``PartitionSpec`` entry that spreads a dimension over every device."""


def _check_size(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{field} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{field} = {value} must be >= 1")
    return int(value)


def make_mesh(dp: int, ep: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``(dp, ep)`` mesh with ``Auto`` axes over the first ``dp * ep`` of ``devices`` (default: all devices).

    Device ``d`` of the list sits at ``(d // ep, d % ep)``: an EP group is ``ep`` consecutive devices, as in the
    reference engine's rank layout (spec/engine.md §12.1), so with one process per host and ``ep`` a multiple of
    the devices per host an EP group spans whole hosts in order.

    Raises:
      TypeError / ValueError: a size that is not a positive int, or more devices asked for than exist.
    """
    dp = _check_size("data_parallel_size", dp)
    ep = _check_size("expert_parallel_size", ep)
    pool = list(jax.devices() if devices is None else devices)
    need = dp * ep
    if need > len(pool):
        platform = pool[0].platform if pool else "none"
        hint = ""
        if platform == "cpu":
            hint = (
                f"; on the CPU, start the process with XLA_FLAGS=--xla_force_host_platform_device_count={need} "
                "for that many virtual devices"
            )
        raise ValueError(
            f"data_parallel_size * expert_parallel_size = {dp} * {ep} = {need} devices, but only "
            f"{len(pool)} {platform} device(s) are available{hint}"
        )
    grid = np.asarray(pool[:need], dtype=object).reshape(dp, ep)
    return Mesh(grid, ALL_AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def mesh_from_config(cfg: ParallelConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The mesh of ``cfg`` (:class:`~deepinfer_jax.config.tree.ParallelConfig`).

    Context parallelism (``context_parallel_size > 1``) has no mesh axis yet and is refused rather than ignored.
    """
    if not isinstance(cfg, ParallelConfig):
        raise TypeError(f"cfg: expected a ParallelConfig, got {type(cfg).__name__}")
    if cfg.context_parallel_size != 1:
        raise ValueError(
            f"parallel.context_parallel_size = {cfg.context_parallel_size}: context-parallel prefill is not "
            "implemented; only 1 is supported"
        )
    return make_mesh(cfg.data_parallel_size, cfg.expert_parallel_size, devices)


def mesh_sizes(mesh: Mesh) -> tuple[int, int]:
    """``(dp, ep)`` of a mesh built by :func:`make_mesh`; a mesh with other axes is refused."""
    if tuple(mesh.axis_names) != ALL_AXES:
        raise ValueError(f"mesh: axis names {tuple(mesh.axis_names)} are not {ALL_AXES}")
    return int(mesh.shape[DP]), int(mesh.shape[EP])
