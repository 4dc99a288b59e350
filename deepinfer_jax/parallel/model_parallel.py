"""Expert parallelism inside the unmodified model code: parameters laid out for a mesh, MoE layers that follow.

The model families call op ``moe_experts`` with whatever their parameter tree holds under ``"experts"``.
:func:`shard_model_params` replaces each such entry with a :class:`SlotExperts`: the layer's routed-expert
stacks in slot layout ``[P, ...]`` sharded over ``ep``, the layer's :class:`~.expert_parallel.ExpertPlacement`
(replicated int32 arrays) and, as static metadata, the mesh and the transport. Importing this package registers
:class:`SlotExperts` with op ``moe_experts`` (:func:`deepinfer_jax.models.common.moe.register_expert_layout`),
so a forward that meets one runs :func:`~.expert_parallel.ep_moe_experts` for that layer: dispatch, local expert
compute, combine. Everything else the forward does is untouched; with the rest of the parameters replicated,
XLA runs it replicated (or as the caller's input shardings say).

Why a container type and not a context (``use_mesh``) or a flag in the model: the placement has to reach the op,
and as data (an EPLB re-placement swaps arrays of the same shapes, so the jitted step never recompiles); the
parameter tree is the one argument every model function already threads to its MoE layers. The mesh and the
transport are static metadata of the pytree node, so two parameter trees laid out for different meshes are two
jit cache entries, never a silent mix.

Every MoE layer gets its own placement (drafter layers may have fewer experts than the backbone), by default the
initial one, ``slot i`` holding ``expert i mod E`` over ``E + extra`` slots rounded up to a multiple of ``ep``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from deepinfer_jax.checkpoint.deferred import ExpertStack
from deepinfer_jax.models.common.linear import LinearNumerics
from deepinfer_jax.models.common.moe import Routing, register_expert_layout
from deepinfer_jax.parallel.eplb import move_experts_on_mesh
from deepinfer_jax.parallel.expert_parallel import (
    ExpertPlacement,
    ep_moe_experts,
    initial_placement,
    resolve_transport,
)
from deepinfer_jax.parallel.mesh import mesh_sizes
from deepinfer_jax.parallel.rules import DEFAULT_RULES, Rules, logical_to_spec, slot_axes

__all__ = [
    "SlotExperts",
    "place_on_mesh",
    "replace_slot_experts",
    "shard_model_params",
    "slot_expert_layers",
]

EXPERTS_KEY = "experts"
"""The key under which every model family keeps a MoE layer's routed-expert stacks."""


@dataclasses.dataclass(frozen=True)
class SlotExperts:
    """One MoE layer's routed experts laid out for expert parallelism (a pytree node; module docstring).

    Attributes:
      experts: ``{"gate", "up", "down"}`` linear weights in slot layout ``[P, ...]``, sharded over ``ep``.
      placement: the layer's :class:`ExpertPlacement` (``P`` slots of ``E`` experts), replicated.
      mesh: the ``(dp, ep)`` mesh (static).
      transport: the transport of :func:`ep_moe_experts` (static; ``"auto"`` picks by platform).
    """

    experts: dict[str, Any]
    placement: ExpertPlacement
    mesh: Mesh
    transport: str = "auto"

    @property
    def num_slots(self) -> int:
        """Physical slots ``P``."""
        return self.placement.num_slots

    @property
    def num_experts(self) -> int:
        """Logical experts ``E``."""
        return self.placement.num_experts

    def __iter__(self) -> Any:
        # A kernel implementation of op moe_experts reading these weights as logical [E, ...] stacks would index
        # slots with logical ids and compute garbage; every such implementation starts by listing the keys of
        # `experts`, so refusing iteration turns that mistake into an error naming the cause.
        raise TypeError(
            "SlotExperts: slot-layout experts are computed by the expert-parallel implementation of op "
            "moe_experts (registered by deepinfer_jax.parallel); an implementation that reads them as a mapping "
            "of logical expert stacks was called instead"
        )

    def with_placement(self, placement: ExpertPlacement) -> SlotExperts:
        """The same layer re-placed (EPLB): slot weights moved from the current slots, shapes unchanged.

        The move runs on the mesh by point-to-point sends (:func:`~.eplb.move_experts_on_mesh`): no device holds
        more than its own slots and a few buffers of that size.

        The moved weights keep the shardings of the current ones and the new placement is replicated like the
        current one, so a jitted forward fed the result runs without compiling again.
        """
        moved = move_experts_on_mesh(self.experts, self.placement, placement, self.mesh)
        moved = jax.tree_util.tree_map(lambda new, old: place_on_mesh(new, old.sharding), moved, self.experts)
        placed = jax.tree_util.tree_map(
            lambda new, old: place_on_mesh(new, old.sharding), placement, self.placement
        )
        return dataclasses.replace(self, experts=moved, placement=placed)


jax.tree_util.register_dataclass(
    SlotExperts, data_fields=["experts", "placement"], meta_fields=["mesh", "transport"]
)


def _slot_moe_experts(
    x: jax.Array,
    routing: Routing,
    experts: SlotExperts,
    numerics: LinearNumerics,
    *,
    swiglu_limit: float | None = None,
    weight_before_down: bool = False,
    out_dtype: Any = None,
) -> jax.Array:
    """Op ``moe_experts`` for :class:`SlotExperts`: the expert-parallel layer, same result as the unsharded op."""
    return ep_moe_experts(
        x,
        routing,
        experts.experts,
        experts.placement,
        numerics,
        experts.mesh,
        swiglu_limit=swiglu_limit,
        weight_before_down=weight_before_down,
        out_dtype=out_dtype,
        transport=experts.transport,
    ).out


register_expert_layout(SlotExperts, _slot_moe_experts)


def place_on_mesh(value: Any, sharding: NamedSharding) -> jax.Array:
    """``value`` as a global array with ``sharding``, also when the mesh spans processes.

    ``jax.device_put`` places on devices this process can address, and re-lays a global array out (every process
    calls it alike); on a multi-process mesh a host value (every process holds all of it: each loaded the same
    checkpoint) is cut into this process's shards.
    """
    if sharding.is_fully_addressable or (isinstance(value, jax.Array) and not value.is_fully_addressable):
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _slots_on_mesh(stack: Any, slot_to_expert: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """Logical expert stack ``[E, ...]`` as the slot-layout global array ``[P, ...]`` with ``sharding``.

    Each device's shard is gathered on the host from the logical stack (``slot_to_expert`` of its slot range)
    and copied to that device alone: the ``[P, ...]`` stack never exists whole, on the host or on any device,
    and a device receives only its own slots. A stack loaded into host memory (or onto the CPU device) is read
    in place; one on an accelerator is read back to the host once; a deferred
    :class:`~deepinfer_jax.checkpoint.deferred.ExpertStack` reads from the checkpoint just the experts of the
    shards asked for (on a multi-process mesh, those of this process's devices).
    """
    if isinstance(stack, ExpertStack):  # deferred: read only the experts of the shards asked for
        host, take = stack, stack.rows
    else:
        host = np.asarray(stack)
        take = host.__getitem__
    shape = (int(slot_to_expert.shape[0]), *host.shape[1:])

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        rows = take(slot_to_expert[index[0]])
        return np.ascontiguousarray(rows[(slice(None), *index[1:])])

    return jax.make_array_from_callback(shape, sharding, shard)


def _path_name(path: tuple[str, ...]) -> str:
    return ".".join(path) or "<root>"


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(a, str) for a in x)


def _expert_count(experts: Mapping[str, Any], where: str) -> int:
    counts = {int(leaf.shape[0]) for leaf in jax.tree_util.tree_leaves(dict(experts)) if leaf.ndim >= 1}
    if len(counts) != 1:
        raise ValueError(f"{where}: expert stacks disagree on the expert count: leading dimensions {counts}")
    return counts.pop()


def shard_model_params(
    params: Any,
    axes: Any,
    mesh: Mesh,
    *,
    placement: ExpertPlacement | Mapping[str, ExpertPlacement] | None = None,
    extra: int = 0,
    transport: str = "auto",
    rules: Rules = DEFAULT_RULES,
) -> Any:
    """``params`` laid out on ``mesh``: every ``"experts"`` entry a :class:`SlotExperts`, the rest by ``rules``.

    Args:
      params: a model family's parameter tree (nested dicts and lists), experts in logical layout ``[E, ...]``.
      axes: its logical axis names (the family's ``logical_axes(params)``), same structure.
      mesh: a ``(dp, ep)`` mesh (:func:`~.mesh.make_mesh`), single- or multi-process.
      placement: ``None`` for the initial placement of each layer (``E + extra`` slots rounded up to a
        multiple of ``ep``); one :class:`ExpertPlacement` for every MoE layer (their expert counts must match
        it); or a mapping from the dotted path of an ``"experts"`` entry (``"layers.3.ffn.experts"``) to its
        placement, layers not named getting the initial one.
      extra: redundant slots of the initial placements.
      transport: the :func:`~.expert_parallel.ep_moe_experts` transport of every layer.
      rules: the logical-axis -> mesh-axis table.

    Returns:
      A tree shaped like ``params`` (each ``"experts"`` mapping replaced by a :class:`SlotExperts` node) of
      global arrays: what a jitted forward of the family takes unchanged to run its MoE layers expert-parallel.

    Raises:
      ValueError: an ``"experts"`` entry whose stacks disagree on the expert count, a placement for another
        expert count or for a path that is no MoE layer, an unknown transport, or a leaf the rules cannot shard
        (the message names the leaf).
    """
    _, ep = mesh_sizes(mesh)
    resolve_transport(transport, mesh)
    by_path: Mapping[str, ExpertPlacement] = {}
    single: ExpertPlacement | None = None
    if isinstance(placement, ExpertPlacement):
        single = placement
    elif isinstance(placement, Mapping):
        by_path = placement
    elif placement is not None:
        raise TypeError(
            f"placement: expected None, an ExpertPlacement or a mapping of paths to them, "
            f"got {type(placement).__name__}"
        )
    replicated = NamedSharding(mesh, PartitionSpec())
    seen: set[str] = set()

    def layer(experts: Mapping[str, Any], experts_axes: Any, path: tuple[str, ...]) -> SlotExperts:
        where = _path_name(path)
        count = _expert_count(experts, where)
        chosen = by_path.get(where, single)
        if chosen is None:
            chosen = initial_placement(count, ep, extra)
        if chosen.num_experts != count:
            raise ValueError(
                f"placement of {where}: {chosen.num_experts} experts, but the layer has {count} (num_experts)"
            )
        if chosen.num_slots % ep:
            raise ValueError(
                f"placement of {where}: {chosen.num_slots} slots are not a multiple of "
                f"expert_parallel_size = {ep}"
            )
        seen.add(where)
        gather = np.asarray(chosen.slot_to_expert)
        laid = walk(dict(experts), slot_axes(experts_axes), path, gather)
        placed = jax.tree_util.tree_map(lambda a: place_on_mesh(a, replicated), chosen)
        return SlotExperts(experts=laid, placement=placed, mesh=mesh, transport=transport)

    def walk(node: Any, node_axes: Any, path: tuple[str, ...], gather: np.ndarray | None = None) -> Any:
        if isinstance(node, Mapping):
            if not isinstance(node_axes, Mapping) or set(node_axes) != set(node):
                raise ValueError(f"axes: {_path_name(path)} does not match the parameter tree's keys")
            return {
                k: layer(v, node_axes[k], (*path, str(k)))
                if k == EXPERTS_KEY and isinstance(v, Mapping) and gather is None
                else walk(v, node_axes[k], (*path, str(k)), gather)
                for k, v in node.items()
            }
        if isinstance(node, (list, tuple)):
            if not isinstance(node_axes, (list, tuple)) or len(node_axes) != len(node):
                raise ValueError(f"axes: {_path_name(path)} does not match the parameter tree's list")
            return type(node)(
                walk(v, a, (*path, str(i)), gather) for i, (v, a) in enumerate(zip(node, node_axes))
            )
        if not _is_axes(node_axes):
            raise TypeError(f"axes: {_path_name(path)} has {node_axes!r}, expected a tuple of axis names")
        name = _path_name(path)
        if gather is None:
            spec = logical_to_spec(node_axes, tuple(node.shape), mesh, rules, name=name)
            return place_on_mesh(node, NamedSharding(mesh, spec))
        count = int(gather.max()) + 1 if gather.size else 0
        if node.ndim < 1 or node.shape[0] < count:
            raise ValueError(f"{name}: shape {tuple(node.shape)}; expected [num_experts, ...] expert stacks")
        shape = (int(gather.shape[0]), *node.shape[1:])
        spec = logical_to_spec(node_axes, shape, mesh, rules, name=name)
        return _slots_on_mesh(node, gather, NamedSharding(mesh, spec))

    out = walk(params, axes, ())
    unknown = sorted(set(by_path) - seen)
    if unknown:
        raise ValueError(f"placement: {unknown} name no MoE layer; MoE layers: {sorted(seen)}")
    return out


def slot_expert_layers(params: Any) -> dict[str, SlotExperts]:
    """Every :class:`SlotExperts` of a laid-out tree by dotted path (``"layers.3.ffn.experts"``), in tree order."""
    found: dict[str, SlotExperts] = {}

    def walk(node: Any, path: tuple[str, ...]) -> None:
        if isinstance(node, SlotExperts):
            found[_path_name(path)] = node
        elif isinstance(node, Mapping):
            for k, v in node.items():
                walk(v, (*path, str(k)))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, (*path, str(i)))

    walk(params, ())
    return found


def replace_slot_experts(params: Any, updates: Mapping[str, SlotExperts]) -> Any:
    """``params`` with the :class:`SlotExperts` at the dotted paths of ``updates`` swapped (e.g. after EPLB).

    Other leaves are shared, not copied. A path that names no :class:`SlotExperts` is refused.
    """
    done: set[str] = set()

    def walk(node: Any, path: tuple[str, ...]) -> Any:
        name = _path_name(path)
        if isinstance(node, SlotExperts):
            if name in updates:
                new = updates[name]
                if not isinstance(new, SlotExperts):
                    raise TypeError(f"updates[{name!r}]: expected a SlotExperts, got {type(new).__name__}")
                done.add(name)
                return new
            return node
        if isinstance(node, Mapping):
            return {k: walk(v, (*path, str(k))) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v, (*path, str(i))) for i, v in enumerate(node))
        return node

    out = walk(params, ())
    missing = sorted(set(updates) - done)
    if missing:
        raise ValueError(f"updates: {missing} name no slot-layout MoE layer of params")
    return out
