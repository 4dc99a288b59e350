"""Logical-axis -> mesh-axis rules, and placing a parameter (or cache) pytree on the mesh with them.

Every parameter leaf carries logical axis names (``weights.logical_axes(params)`` of a model family, e.g.
``("expert", "moe_mlp", "embed")`` for a stack of routed experts); this module holds the one table that turns
them into ``PartitionSpec`` entries (ARCHITECTURE §2, §5):

* ``expert_slot`` -> ``ep``: the physical expert slots of a MoE layer (logical experts padded with replicas up to
  a multiple of ``ep``, :mod:`.expert_parallel`) are split over the EP group and replicated over ``dp``;
* per-sequence axes -> ``("dp", "ep")``: attention is data parallel over *every* device, so token batches,
  sequences, their state slots and cache blocks are spread over the whole mesh;
* every other axis is replicated: attention, dense MLPs, shared experts, norms, embeddings and heads are small
  next to the experts (and DeepInfer replicates them too), and replicating them keeps attention free of
  collectives.

``expert`` (a *logical* expert index) is deliberately not sharded: the router ``[E, H]`` and correction bias
``[E]`` are read by every device to route its own tokens, and a stack of routed experts is only sharded after
:func:`slot_axes` renamed its leading axis, i.e. after the stack was laid out in physical slots whose count
``ep`` divides (any expert count works that way).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from deepinfer_jax.parallel.mesh import ALL_AXES, EP

__all__ = [
    "DEFAULT_RULES",
    "EXPERT_SLOT",
    "PER_SEQUENCE_AXES",
    "Rules",
    "logical_to_spec",
    "param_shardings",
    "shard_params",
    "slot_axes",
]

MeshAxes = str | tuple[str, ...] | None
Rules = Mapping[str, MeshAxes]

EXPERT_SLOT = "expert_slot"
"""Logical axis of a MoE layer's physical expert slots (the leading axis of slot-layout expert stacks)."""

PER_SEQUENCE_AXES: tuple[str, ...] = (
    "batch",
    "tokens",
    "sequence",
    "cache_batch",
    "cache_block",
    "state_slot",
)
"""Logical axes that index sequences, their tokens or their cache storage: data parallel over every device."""

DEFAULT_RULES: Rules = {EXPERT_SLOT: EP, **dict.fromkeys(PER_SEQUENCE_AXES, ALL_AXES)}
"""The rules table: logical axis -> mesh axis (or axes); an axis not listed is replicated."""


def _mesh_axes(entry: MeshAxes) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def logical_to_spec(
    axes: tuple[str, ...],
    shape: tuple[int, ...],
    mesh: Mesh,
    rules: Rules = DEFAULT_RULES,
    *,
    name: str = "array",
) -> PartitionSpec:
    """The ``PartitionSpec`` of an array of ``shape`` with logical ``axes`` under ``rules`` on ``mesh``.

    Raises ``ValueError`` naming the leaf when the names do not match the rank, a rule names a mesh axis the mesh
    lacks, two dimensions would use the same mesh axis, or a sharded dimension does not divide evenly (uneven
    shards would silently change the per-device shapes the compiled step expects).
    """
    if len(axes) != len(shape):
        raise ValueError(f"{name}: {len(axes)} logical axis names {axes} for an array of shape {shape}")
    used: set[str] = set()
    entries: list[MeshAxes] = []
    for dim, (logical, size) in enumerate(zip(axes, shape, strict=True)):
        targets = _mesh_axes(rules.get(logical))
        if not targets:
            entries.append(None)
            continue
        missing = [a for a in targets if a not in mesh.shape]
        if missing:
            raise ValueError(
                f"{name}: rule {logical!r} -> {targets} names mesh axes {missing} that the mesh "
                f"{tuple(mesh.axis_names)} does not have"
            )
        twice = used.intersection(targets)
        if twice:
            raise ValueError(f"{name}: logical axes {axes} map mesh axes {sorted(twice)} to two dimensions")
        used.update(targets)
        parts = 1
        for a in targets:
            parts *= int(mesh.shape[a])
        if size % parts:
            raise ValueError(
                f"{name}: dimension {dim} ({logical!r}) has size {size}, not a multiple of the {parts} shards "
                f"of mesh axes {targets}"
            )
        entries.append(targets[0] if len(targets) == 1 else targets)
    return PartitionSpec(*entries)


def _path_name(path: tuple[Any, ...]) -> str:
    return ".".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path) or "<root>"


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(a, str) for a in x)


def param_shardings(params: Any, axes: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
    """A pytree of ``NamedSharding`` shaped like ``params`` (arrays or ``ShapeDtypeStruct``) from its ``axes``.

    ``axes`` is the tree of logical-axis tuples (one per leaf, e.g. from ``weights.logical_axes``); its
    structure must match ``params``. Works on abstract shapes, so a loader can place each tensor as it reads it.
    """
    flat_axes = jax.tree_util.tree_leaves(axes, is_leaf=_is_axes)
    flat_params, params_def = jax.tree_util.tree_flatten_with_path(params)
    if len(flat_axes) != len(flat_params):
        raise ValueError(
            f"axes: {len(flat_axes)} logical-axis leaves for {len(flat_params)} parameter leaves; "
            "the trees must have the same structure"
        )
    shardings = []
    for (path, leaf), leaf_axes in zip(flat_params, flat_axes, strict=True):
        if not _is_axes(leaf_axes):
            raise TypeError(f"axes: {_path_name(path)} has {leaf_axes!r}, expected a tuple of axis names")
        spec = logical_to_spec(leaf_axes, tuple(leaf.shape), mesh, rules, name=_path_name(path))
        shardings.append(NamedSharding(mesh, spec))
    return jax.tree_util.tree_unflatten(params_def, shardings)


def shard_params(params: Any, axes: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
    """``params`` placed on ``mesh`` leaf by leaf as ``axes`` and ``rules`` say (one ``device_put`` per leaf).

    Routed-expert stacks must be in slot layout with :func:`slot_axes` names to be split over ``ep``; in
    logical layout they are replicated like everything else.
    """
    return jax.device_put(params, param_shardings(params, axes, mesh, rules))


def slot_axes(axes: Any) -> Any:
    """``axes`` with the leading ``expert`` of every routed-expert stack renamed :data:`EXPERT_SLOT`.

    A routed-expert stack is a leaf named ``("expert", a, b)``: one matrix (or FP8 scale grid) per expert. The
    router ``("expert", "embed")`` and the correction bias ``("expert",)`` index logical experts and keep their
    names, hence stay replicated.
    """

    def one(leaf_axes: tuple[str, ...]) -> tuple[str, ...]:
        if len(leaf_axes) == 3 and leaf_axes[0] == "expert":
            return (EXPERT_SLOT, *leaf_axes[1:])
        return leaf_axes

    return jax.tree_util.tree_map(one, axes, is_leaf=_is_axes)
