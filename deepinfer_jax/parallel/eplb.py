"""Expert-parallel load balancing (EPLB, spec/engine.md §11.3): windowed load counts -> a new expert placement.

The pieces, host side and in NumPy (they run every few hundred steps on a few kilobytes of counts):

* :class:`ExpertLoadWindow` -- a ring of the last ``W`` steps' per-layer *logical* expert loads, filled from the
  per-slot counts :func:`~deepinfer_jax.parallel.expert_parallel.ep_moe_experts` returns;
* :func:`replicate` -- greedy replication: ``P - E`` rounds, each giving one more replica to the expert that
  lowers the summed (over steps) peak per-replica load the most;
* :func:`place` -- greedy placement of the replicas, heaviest first, each on the rank whose resulting peak load
  (summed over steps) is lowest, ties to the lowest rank;
* :func:`rebalance` -- both, giving an :class:`~deepinfer_jax.parallel.expert_parallel.ExpertPlacement`;
* :func:`move_experts` -- the slot weights of the new placement, gathered from the old slots (on a mesh the
  gather over the ``ep``-sharded slot axis is XLA's collective); same shapes, so nothing recompiles;
* :func:`imbalance` -- the load-balance figure ``max / mean`` device load (1.0 = perfect), DeepInfer's
  ``moe_lb``;
* :class:`RearrangeSchedule` -- when to re-place: first after ``max(1, I // 4)`` counted steps, then every
  ``I``;
* :class:`ExpertLoadBalancer` -- all of the above for the MoE layers of one model, configured from
  :class:`~deepinfer_jax.config.tree.ParallelConfig`, logging ``moe_lb`` and the imbalance before and after each
  re-placement.

The placement is data (int32 arrays of fixed shape), so the jitted MoE step takes a new placement and new slot
weights without recompiling.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from deepinfer_jax.config.tree import ParallelConfig
from deepinfer_jax.parallel.expert_parallel import ExpertPlacement, initial_placement, placement_from_slots
from deepinfer_jax.parallel.mesh import EP, mesh_sizes

__all__ = [
    "ExpertLoadBalancer",
    "ExpertLoadWindow",
    "RearrangeSchedule",
    "device_loads",
    "expected_imbalance",
    "imbalance",
    "logical_counts",
    "move_experts",
    "move_experts_on_mesh",
    "place",
    "rebalance",
    "replicate",
]

_TIE_BREAK = (
    1e-4  # spec/engine.md §11.3: per-replica load + 1e-4 · expert index, so equal loads resolve by index
)


def _int(field: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{field} must be an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{field} = {value} must be >= {low}")
    return int(value)


def _window(counts: Any, field: str = "counts") -> np.ndarray:
    w = np.asarray(counts, np.float64)
    if w.ndim == 1:
        w = w[None, :]
    if w.ndim != 2 or w.shape[1] == 0:
        raise ValueError(f"{field}: expected [steps, experts] loads, got shape {np.shape(counts)}")
    if (w < 0).any() or not np.isfinite(w).all():
        raise ValueError(f"{field}: loads must be finite and >= 0")
    return w


def device_loads(slot_counts: Any, ep: int) -> np.ndarray:
    """Rows per EP rank ``[..., ep]`` from per-slot rows ``[..., P]`` (rank ``r`` holds slots ``r·L … r·L+L-1``)."""
    ep = _int("expert_parallel_size", ep, 1)
    c = np.asarray(slot_counts, np.float64)
    if c.shape[-1] % ep:
        raise ValueError(
            f"slot_counts: {c.shape[-1]} slots are not a multiple of expert_parallel_size = {ep}"
        )
    return c.reshape(*c.shape[:-1], ep, c.shape[-1] // ep).sum(axis=-1)


def imbalance(slot_counts: Any, ep: int) -> float:
    """``max / mean`` rows per EP rank (summed over any leading axes first); 1.0 when nothing was routed."""
    loads = device_loads(slot_counts, ep)
    loads = loads.reshape(-1, loads.shape[-1]).sum(axis=0)
    mean = loads.mean()
    return float(loads.max() / mean) if mean > 0 else 1.0


def expected_imbalance(window: Any, placement: ExpertPlacement, ep: int) -> float:
    """The imbalance ``window`` loads ``[steps, E]`` would give under ``placement``, replicas sharing evenly.

    Summed over the window's steps; used to log what a re-placement is expected to achieve before any token
    has been routed with it.
    """
    w = _window(window, "window").sum(axis=0)
    s2e = np.asarray(placement.slot_to_expert)
    per_slot = w[s2e] / np.asarray(placement.replica_count)[s2e]
    return imbalance(per_slot, ep)


def logical_counts(slot_counts: Any, placement: ExpertPlacement) -> np.ndarray:
    """Rows per logical expert ``[E]`` from rows per physical slot ``[P]`` under ``placement``."""
    c = np.asarray(slot_counts)
    s2e = np.asarray(placement.slot_to_expert)
    if c.shape != s2e.shape:
        raise ValueError(f"slot_counts: shape {c.shape} does not match the placement's {s2e.shape[0]} slots")
    return np.bincount(s2e, weights=c, minlength=placement.num_experts).astype(np.int64)


def replicate(window: Any, num_slots: int) -> np.ndarray:
    """Replica counts ``int [E]`` summing to ``num_slots``: greedy over ``num_slots - E`` rounds (§11.3 step 1).

    ``window`` is ``[steps, E]`` logical loads (or one step ``[E]``). Each round gives a replica to the expert
    ``j`` that minimises ``Σ_steps max_e load_e / c_e`` once ``c_j`` grew by one (per-replica loads carry the
    ``1e-4 · e`` tie-breaker; equal totals go to the lowest index).
    """
    w = _window(window, "window")
    experts = w.shape[1]
    num_slots = _int("num_slots", num_slots, experts)
    count = np.ones(experts, np.int64)
    tie = _TIE_BREAK * np.arange(experts)
    for _ in range(num_slots - experts):
        per = w / count + tie  # [steps, E]
        if experts > 1:
            top2 = np.sort(per, axis=1)[:, -2:]  # second, first
            best = np.argmax(per, axis=1)
            excl = np.where(np.arange(experts)[None, :] == best[:, None], top2[:, :1], top2[:, 1:])
        else:
            excl = np.zeros_like(per)
        grown = w / (count + 1) + tie
        cost = np.maximum(excl, grown).sum(axis=0)
        count[int(np.argmin(cost))] += 1
    return count


def place(window: Any, count: Any, ep: int) -> np.ndarray:
    """``slot_to_expert int [P]`` for replica ``count``s on ``ep`` ranks (§11.3 step 2).

    Replicas (each carrying ``load_e / c_e`` per step) are taken in descending window-total order (stable:
    equal loads keep expert order); each goes to the rank with free slots that minimises
    ``Σ_steps max(peak, rank_load + replica_load)``, ties to the lowest rank, and fills that rank's next slot.
    """
    w = _window(window, "window")
    count = np.asarray(count, np.int64)
    if count.shape != (w.shape[1],) or (count < 1).any():
        raise ValueError(f"count: expected {w.shape[1]} replica counts >= 1, got {count.tolist()}")
    ep = _int("expert_parallel_size", ep, 1)
    slots = int(count.sum())
    if slots % ep:
        raise ValueError(f"count: {slots} replicas are not a multiple of expert_parallel_size = {ep}")
    per_rank = slots // ep
    experts = np.repeat(np.arange(w.shape[1]), count)
    loads = (w / count)[:, experts]  # [steps, replicas]
    order = np.argsort(-loads.sum(axis=0), kind="stable")
    rank_load = np.zeros((w.shape[0], ep))
    filled = np.zeros(ep, np.int64)
    slot_to_expert = np.empty(slots, np.int64)
    for rep in order:
        peak = rank_load.max(axis=1, keepdims=True)
        cost = np.maximum(peak, rank_load + loads[:, rep : rep + 1]).sum(axis=0)
        cost[filled >= per_rank] = np.inf
        r = int(np.argmin(cost))
        slot_to_expert[r * per_rank + filled[r]] = experts[rep]
        filled[r] += 1
        rank_load[:, r] += loads[:, rep]
    return slot_to_expert


def rebalance(window: Any, num_slots: int, ep: int) -> ExpertPlacement:
    """A new :class:`ExpertPlacement` of ``num_slots`` slots on ``ep`` ranks from ``[steps, E]`` loads."""
    w = _window(window, "window")
    count = replicate(w, num_slots)
    return placement_from_slots(place(w, count, ep), w.shape[1])


@jax.jit
def _gather_slots(slot_experts: Any, source: jax.Array) -> Any:
    return jax.tree_util.tree_map(lambda leaf: jnp.take(leaf, source, axis=0), slot_experts)


def move_experts(slot_experts: Any, old: ExpertPlacement, new: ExpertPlacement) -> Any:
    """Slot-layout expert weights for placement ``new``, copied from the slots of ``old`` (no logical copy needed).

    New slot ``s`` takes old slot ``old.expert_slots[new.slot_to_expert[s], 0]`` (the first old replica of the
    same expert). Output shapes (and shardings, under jit) equal the input's, so a jitted step fed the result
    does not recompile.
    """
    if old.num_slots != new.num_slots or old.num_experts != new.num_experts:
        raise ValueError(
            f"move_experts: placements differ in shape: {old.num_slots} slots / {old.num_experts} experts "
            f"vs {new.num_slots} / {new.num_experts}"
        )
    source = old.expert_slots[new.slot_to_expert, 0]
    return _gather_slots(slot_experts, source)


def _moves_body(local: Any, source: jax.Array, *, ep: int) -> Any:
    """One device's new slots from the old ones, inside a ``shard_map`` over the mesh (:func:`move_experts_on_mesh`).

    ``local`` holds this device's ``L = P / ep`` old slots; ``source [P]`` is the old slot each new slot copies.
    Round ``k`` sends, from every rank ``r`` to rank ``(r + k) mod ep``, the ``L`` rows that rank wants from ``r``
    (rows it wants from elsewhere are sent too but not kept: shapes are static); round 0 is a local copy.
    """
    rank = lax.axis_index(EP)

    def one(leaf: jax.Array) -> jax.Array:
        slots = leaf.shape[0]
        mine = source[rank * slots + jnp.arange(slots)]  # the old slots my new slots copy
        out = jnp.zeros_like(leaf)
        for k in range(ep):
            dest = (rank + k) % ep
            wanted = source[dest * slots + jnp.arange(slots)]  # what rank `dest` copies, by old slot
            send = jnp.take(leaf, wanted % slots, axis=0)
            if k:
                send = lax.ppermute(send, EP, perm=[(r, (r + k) % ep) for r in range(ep)])
            keep = (mine // slots) == (rank - k) % ep  # rows of this round's sender
            out = jnp.where(keep.reshape(-1, *(1,) * (leaf.ndim - 1)), send, out)
        return out

    return jax.tree_util.tree_map(one, local)


@functools.cache
def _mover(mesh: Mesh, treedef: Any) -> Any:
    _, ep = mesh_sizes(mesh)
    specs = jax.tree_util.tree_unflatten(treedef, [PartitionSpec(EP)] * treedef.num_leaves)
    body = functools.partial(_moves_body, ep=ep)
    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(specs, PartitionSpec()), out_specs=specs, check_vma=False)
    )


def move_experts_on_mesh(slot_experts: Any, old: ExpertPlacement, new: ExpertPlacement, mesh: Mesh) -> Any:
    """:func:`move_experts` for slot stacks sharded over ``ep`` on ``mesh``, moved by point-to-point sends.

    Every device keeps its own ``P / ep`` slots: in ``ep - 1`` rounds of ``ppermute`` each rank sends every other
    rank the rows it wants (plus a local copy), so no device ever holds more than its share and a few buffers of
    the same size, where a gather would assemble the whole ``[P, ...]`` stack on every device. The result has the
    input's shardings; the move compiles once per mesh and stack shapes.
    """
    if old.num_slots != new.num_slots or old.num_experts != new.num_experts:
        raise ValueError(
            f"move_experts: placements differ in shape: {old.num_slots} slots / {old.num_experts} experts "
            f"vs {new.num_slots} / {new.num_experts}"
        )
    source = np.asarray(_host_placement(old).expert_slots)[np.asarray(_host_placement(new).slot_to_expert), 0]
    treedef = jax.tree_util.tree_structure(slot_experts)
    return _mover(mesh, treedef)(slot_experts, np.asarray(source, np.int32))


class ExpertLoadWindow:
    """Ring buffer of the last ``window_steps`` steps' logical expert loads ``[steps, layers, E]``."""

    def __init__(self, window_steps: int, num_layers: int, num_experts: int) -> None:
        self.window_steps = _int("parallel.eplb_window_steps", window_steps, 1)
        self.num_layers = _int("num_layers", num_layers, 1)
        self.num_experts = _int("num_experts", num_experts, 1)
        self._ring = np.zeros((self.window_steps, self.num_layers, self.num_experts), np.int64)
        self._steps = 0

    @property
    def steps_recorded(self) -> int:
        """Steps recorded since creation (the ring keeps the last ``window_steps`` of them)."""
        return self._steps

    def record(self, slot_counts: Any, placements: list[ExpertPlacement]) -> None:
        """Add one step: per-layer slot counts ``[layers, P]`` under each layer's placement."""
        counts = np.asarray(slot_counts)
        if counts.ndim != 2 or counts.shape[0] != self.num_layers or len(placements) != self.num_layers:
            raise ValueError(
                f"record: expected slot counts [{self.num_layers}, slots] and {self.num_layers} placements, "
                f"got {counts.shape} and {len(placements)}"
            )
        row = np.stack([logical_counts(c, p) for c, p in zip(counts, placements, strict=True)])
        self._ring[self._steps % self.window_steps] = row
        self._steps += 1

    def loads(self, layer: int) -> np.ndarray:
        """The recorded ``[steps, E]`` loads of ``layer`` (oldest first; fewer rows before the ring is full)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer = {layer} is outside [0, {self.num_layers})")
        n = min(self._steps, self.window_steps)
        idx = (np.arange(self._steps - n, self._steps)) % self.window_steps
        return self._ring[idx, layer]


class RearrangeSchedule:
    """When to re-place experts: after ``max(1, I // 4)`` counted steps, then every ``I`` (0 = never)."""

    def __init__(self, interval_steps: int, window_steps: int) -> None:
        self.interval = _int("parallel.eplb_interval_steps", interval_steps, 0)
        window_steps = _int("parallel.eplb_window_steps", window_steps, 1)
        if self.interval and window_steps > self.interval:
            raise ValueError(
                f"parallel.eplb_window_steps = {window_steps} must be <= parallel.eplb_interval_steps = "
                f"{self.interval}"
            )
        self._counted = 0
        self._next = max(1, self.interval // 4)

    def step(self) -> bool:
        """Count one step; True when a re-placement is due after it."""
        if not self.interval:
            return False
        self._counted += 1
        if self._counted < self._next:
            return False
        self._next += self.interval
        return True


class ExpertLoadBalancer:
    """EPLB for the MoE layers of one model (spec/engine.md §11.3), driven by the per-step slot counts.

    ``observe`` is called once per engine step with every MoE layer's ``slot_counts`` (from
    :func:`~deepinfer_jax.parallel.expert_parallel.ep_moe_experts`) and says when a re-placement is due;
    ``rearrange`` then computes the new placements from the window and moves the slot weights. Every
    ``moe_load_stats_interval_steps`` steps ``moe_lb = Σ max / Σ mean`` rows per rank (over layers and steps) is
    logged, as DeepInfer does.
    """

    def __init__(
        self,
        cfg: ParallelConfig,
        *,
        num_layers: int,
        num_experts: int,
        placements: Sequence[ExpertPlacement] | None = None,
    ) -> None:
        if not isinstance(cfg, ParallelConfig):
            raise TypeError(f"cfg: expected a ParallelConfig, got {type(cfg).__name__}")
        self.ep = cfg.expert_parallel_size
        self.after_prefill = cfg.eplb_after_prefill
        self.stats_interval = cfg.moe_load_stats_interval_steps
        num_layers = _int("num_layers", num_layers, 1)
        if placements is None:
            placement = initial_placement(num_experts, self.ep, cfg.eplb_num_redundant_experts)
            self.placements: list[ExpertPlacement] = [placement] * num_layers
        else:
            self.placements = [_host_placement(p) for p in placements]
            if len(self.placements) != num_layers:
                raise ValueError(f"placements: {len(self.placements)} given for num_layers = {num_layers}")
            shapes = {(p.num_experts, p.num_slots) for p in self.placements}
            if len(shapes) != 1 or next(iter(shapes))[0] != num_experts:
                raise ValueError(
                    f"placements: (experts, slots) {sorted(shapes)}; expected one shape with {num_experts} experts"
                )
            if self.placements[0].num_slots % self.ep:
                raise ValueError(
                    f"placements: {self.placements[0].num_slots} slots are not a multiple of "
                    f"expert_parallel_size = {self.ep}"
                )
        self.window = ExpertLoadWindow(cfg.eplb_window_steps, num_layers, num_experts)
        self.schedule = RearrangeSchedule(cfg.eplb_interval_steps, cfg.eplb_window_steps)
        self._pending = False
        self._steps = 0
        self._sum_max = 0.0
        self._sum_mean = 0.0
        self.last_moe_lb: float | None = None

    @property
    def num_slots(self) -> int:
        """Physical slots per MoE layer."""
        return self.placements[0].num_slots

    def observe(
        self,
        slot_counts: Any,
        *,
        prefill: bool = False,
        placements: Sequence[ExpertPlacement] | None = None,
    ) -> bool:
        """Account one step's ``[layers, P]`` slot counts; True when :meth:`rearrange` should run now.

        Prefill steps are left out of the window unless ``parallel.eplb_after_prefill``, which records them and
        asks for a re-placement at the next non-prefill step. ``placements`` are those the step ran with when
        they are no longer the current ones (a step dispatched before a re-placement and read after it); the
        window converts slot counts to logical expert loads with them.
        """
        counts = np.asarray(slot_counts)
        used = self.placements if placements is None else list(placements)
        loads = device_loads(counts, self.ep)  # [layers, ep]
        self._sum_max += float(loads.max(axis=-1).sum())
        self._sum_mean += float(loads.mean(axis=-1).sum())
        self._steps += 1
        if self._steps % self.stats_interval == 0:
            self.last_moe_lb = self._sum_max / self._sum_mean if self._sum_mean > 0 else 1.0
            logging.info("moe_lb = %.4f over the last %d steps", self.last_moe_lb, self.stats_interval)
            self._sum_max = self._sum_mean = 0.0
        if self.schedule.interval == 0:
            return False
        if prefill:
            if self.after_prefill:
                self.window.record(counts, used)
                self._pending = True
            return False
        self.window.record(counts, used)
        due = self.schedule.step() or self._pending
        self._pending = False
        return due

    def plan_rearrangement(self) -> list[ExpertPlacement]:
        """New placements for every layer from the window, adopted as the current ones and returned.

        The caller moves the weights (:meth:`rearrange` does it for plain slot stacks; the engine swaps each
        layer's :class:`~deepinfer_jax.parallel.SlotExperts` with ``with_placement``). The imbalance each layer's
        window had and is expected to have is logged. A layer that routed nothing during the window keeps its
        placement.
        """
        planned = []
        for layer, old in enumerate(self.placements):
            loads = self.window.loads(layer)
            if not loads.any():  # nothing routed through this layer in the window: no evidence to move on
                planned.append(old)
                continue
            new = rebalance(loads, self.num_slots, self.ep)
            logging.info(
                "EPLB layer %d: imbalance %.3f -> %.3f (expected, over a %d-step window)",
                layer,
                expected_imbalance(loads, old, self.ep),
                expected_imbalance(loads, new, self.ep),
                loads.shape[0],
            )
            planned.append(new)
        self.placements = list(planned)
        return planned

    def rearrange(self, slot_experts: Sequence[Any]) -> list[Any]:
        """New placements for every layer from the window; returns the layers' moved slot weights.

        ``slot_experts[i]`` is layer ``i``'s expert stacks in slot layout under the current placement.
        """
        if len(slot_experts) != len(self.placements):
            raise ValueError(
                f"slot_experts: {len(slot_experts)} layers given, the balancer has {len(self.placements)}"
            )
        old = list(self.placements)
        new = self.plan_rearrangement()
        return [move_experts(w, o, n) for w, o, n in zip(slot_experts, old, new, strict=True)]


def _host_placement(placement: ExpertPlacement) -> ExpertPlacement:
    """``placement`` as NumPy arrays (a replicated global array is read from this process's first shard)."""
    if not isinstance(placement, ExpertPlacement):
        raise TypeError(f"placements: expected ExpertPlacement entries, got {type(placement).__name__}")

    def host(a: Any) -> np.ndarray:
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            a = a.addressable_data(0)
        return np.asarray(a)

    return ExpertPlacement(*(host(a) for a in placement))
