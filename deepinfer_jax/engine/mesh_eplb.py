"""EPLB inside the engine loop: each global step's expert counts in, re-placed expert slots out.

The balancing itself is :mod:`deepinfer_jax.parallel.eplb` (spec/engine.md §11.3). This module connects it to a
running engine on a mesh with ``ep > 1`` (:mod:`deepinfer_jax.engine.runner`):

* **Counts.** The mesh step, built with ``expert_counts=True``, returns the rows each device's local slots
  received in every MoE layer, all layers in one array (one transfer per step; padding tokens are routed
  nowhere, so they never count). :meth:`MeshExpertBalancer.split` cuts it per layer; summed over the ``dp``
  groups (they share one placement) that is each layer's per-slot load ``[P]``.
* **Observation.** :meth:`MeshExpertBalancer.observe` feeds one step's counts to an
  :class:`~deepinfer_jax.parallel.eplb.ExpertLoadBalancer` per group of MoE layers with the same
  ``(experts, slots)`` shape (every layer of a model, as a rule), and records the step's measured imbalance
  (``Σ_layers max rank load / Σ_layers mean rank load``, DeepInfer's ``moe_lb`` for one step).
* **Re-placement.** When a re-placement is due, :meth:`MeshExpertBalancer.rearrange` computes the new
  placements from the window and swaps each layer's :class:`~deepinfer_jax.parallel.SlotExperts` for the same
  layer re-placed (``with_placement``: slot weights gathered from the old slots, same shapes, same shardings).
  The runner hands the new parameter tree to the step executor: the placement is data, so nothing recompiles.

A step still in flight when a re-placement happens ran with the old placements; the runner keeps the
placements each step was dispatched with (:meth:`MeshExpertBalancer.snapshot`) and the window converts that
step's slot counts to logical expert loads with them.

What counts as a prefill step (skipped unless ``parallel.eplb_after_prefill``): a step in which no device runs
a decode row (one output token fed to sample the next, ``StepPlan.is_prefill``). Steps that mix prefill chunks and decode rows count: their load is what the
experts serve.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
from absl import logging
from jax.sharding import Mesh

from deepinfer_jax.config.tree import ParallelConfig
from deepinfer_jax.parallel import replace_slot_experts, slot_expert_layers
from deepinfer_jax.parallel.eplb import ExpertLoadBalancer, device_loads
from deepinfer_jax.parallel.expert_parallel import ExpertPlacement
from deepinfer_jax.parallel.mesh import mesh_sizes

__all__ = ["IMBALANCE_HISTORY", "MeshExpertBalancer", "describe_placement"]

IMBALANCE_HISTORY = 100_000
"""Steps of measured imbalance a balancer keeps (a serving engine runs without end)."""


def describe_placement(placement: ExpertPlacement, ep: int) -> str:
    """One line: the logical experts of each EP rank's slots and the experts with more than one replica."""
    slots = np.asarray(placement.slot_to_expert).reshape(ep, -1)
    count = np.asarray(placement.replica_count)
    ranks = "; ".join(f"rank {r}: {row.tolist()}" for r, row in enumerate(slots))
    extra = {int(e): int(c) for e, c in enumerate(count) if c > 1}
    return f"{ranks}; replicas {extra or 'none'}"


class MeshExpertBalancer:
    """EPLB and MoE load statistics for the MoE layers of a parameter tree laid out on a ``(dp, ep)`` mesh.

    Args:
      cfg: the ``parallel`` config (interval, window, ``eplb_after_prefill``, statistics interval,
        ``eplb_log_detail``: log every layer's new placement, :func:`describe_placement`);
        ``eplb_interval_steps = 0`` keeps the placements and only measures and logs the imbalance.
      params: the laid-out parameter tree (:func:`~deepinfer_jax.parallel.shard_model_params`); the initial
        placements are read from it.
      mesh: the mesh the parameters are laid out on.

    Attributes:
      imbalances: the measured imbalance of each of the last :data:`IMBALANCE_HISTORY` observed steps that
        routed any token (1.0 = even).
      rearrangements: re-placements done so far.
      total_peak, total_mean: ``Σ`` over observed steps and layers of the busiest rank's rows and of the mean
        rank's rows (their ratio is ``moe_lb``).
    """

    def __init__(self, cfg: ParallelConfig, params: Any, mesh: Mesh) -> None:
        if not isinstance(cfg, ParallelConfig):
            raise TypeError(f"cfg: expected a ParallelConfig, got {type(cfg).__name__}")
        self.dp, self.ep = mesh_sizes(mesh)
        if cfg.expert_parallel_size != self.ep:
            raise ValueError(
                f"parallel.expert_parallel_size = {cfg.expert_parallel_size} differs from the mesh's ep = {self.ep}"
            )
        layers = slot_expert_layers(params)
        if not layers:
            raise ValueError(
                "params: no slot-layout MoE layer to balance (lay them out with shard_model_params)"
            )
        self._num_slots = {path: layer.num_slots for path, layer in layers.items()}
        groups: dict[tuple[int, int], list[str]] = {}
        for path, layer in layers.items():
            groups.setdefault((layer.num_experts, layer.num_slots), []).append(path)
        self.groups: tuple[tuple[str, ...], ...] = tuple(tuple(paths) for paths in groups.values())
        self.balancers: tuple[ExpertLoadBalancer, ...] = tuple(
            ExpertLoadBalancer(
                cfg,
                num_layers=len(paths),
                num_experts=experts,
                placements=[layers[p].placement for p in paths],
            )
            for (experts, _), paths in zip(groups, self.groups, strict=True)
        )
        self.enabled = cfg.eplb_interval_steps > 0
        self.log_detail = cfg.eplb_log_detail
        self.imbalances: collections.deque[float] = collections.deque(maxlen=IMBALANCE_HISTORY)
        self.rearrangements = 0
        self.total_peak = 0.0
        self.total_mean = 0.0

    @property
    def paths(self) -> tuple[str, ...]:
        """The balanced MoE layers' dotted parameter paths, in tree order (the columns of the step's counts)."""
        return tuple(self._num_slots)

    def split(self, counts: Any) -> dict[str, np.ndarray]:
        """One step's ``StepOutput.expert_counts`` (:func:`~deepinfer_jax.engine.step.step`), ``[dp * ep, Σ P / ep]``
        (layers side by side in tree order), as ``{layer path: [dp * ep, P / ep]}``."""
        c = np.asarray(counts, np.int64)
        widths = [slots // self.ep for slots in self._num_slots.values()]
        if c.shape != (self.dp * self.ep, sum(widths)):
            raise ValueError(
                f"counts: shape {c.shape}, expected ({self.dp * self.ep}, {sum(widths)}): every device's slot "
                "counts of every MoE layer"
            )
        bounds = np.cumsum([0, *widths])
        return {p: c[:, bounds[i] : bounds[i + 1]] for i, p in enumerate(self.paths)}

    def placements(self) -> dict[str, ExpertPlacement]:
        """Every layer's current placement (NumPy arrays) by dotted path."""
        return {
            path: placement
            for paths, balancer in zip(self.groups, self.balancers, strict=True)
            for path, placement in zip(paths, balancer.placements, strict=True)
        }

    def snapshot(self) -> tuple[tuple[ExpertPlacement, ...], ...]:
        """The current placements, group by group: what a step dispatched now runs with (see :meth:`observe`)."""
        return tuple(tuple(b.placements) for b in self.balancers)

    def observe(
        self,
        counts: Any,
        *,
        prefill: bool = False,
        snapshot: tuple[tuple[ExpertPlacement, ...], ...] | None = None,
    ) -> bool:
        """Account one step's counts (:meth:`split`'s input); True when :meth:`rearrange` is due.

        Each layer's per-slot load ``[P]`` is its devices' counts summed over the ``dp`` groups, which share one
        placement. ``snapshot`` is :meth:`snapshot` as of the step's dispatch (default: the current placements).
        """
        per_slot = {p: c.reshape(self.dp, -1).sum(axis=0) for p, c in self.split(counts).items()}
        loads = np.stack([device_loads(c, self.ep) for c in per_slot.values()])  # [layers, ep]
        peak, mean = float(loads.max(axis=-1).sum()), float(loads.mean(axis=-1).sum())
        self.total_peak += peak
        self.total_mean += mean
        if mean > 0:
            self.imbalances.append(peak / mean)
        due = False
        snaps = snapshot if snapshot is not None else (None,) * len(self.balancers)
        for paths, balancer, snap in zip(self.groups, self.balancers, snaps, strict=True):
            stacked = np.stack([per_slot[p] for p in paths])
            due |= balancer.observe(stacked, prefill=prefill, placements=snap)
        return due and self.enabled

    def rearrange(self, params: Any) -> Any:
        """``params`` with every MoE layer re-placed from the window (same shapes and shardings)."""
        layers = slot_expert_layers(params)
        updates = {}
        for paths, balancer in zip(self.groups, self.balancers, strict=True):
            old = list(balancer.placements)
            for path, before, placement in zip(paths, old, balancer.plan_rearrangement(), strict=True):
                if not np.array_equal(before.slot_to_expert, placement.slot_to_expert):
                    updates[path] = layers[path].with_placement(placement)
                if self.log_detail:
                    logging.info("EPLB %s: %s", path, describe_placement(placement, self.ep))
        self.rearrangements += 1
        logging.info(
            "EPLB: re-placement %d moved the experts of %d of %d MoE layers",
            self.rearrangements,
            len(updates),
            len(self._num_slots),
        )
        return replace_slot_experts(params, updates) if updates else params
