"""A laid-out parameter tree as one device sees it inside the engine's ``shard_map`` step.

The engine runs every step as one ``jax.shard_map`` over the ``(dp, ep)`` mesh (``engine/step.py``): each
device runs the model on its own tokens. Inside that manual region a :class:`~deepinfer_jax.parallel.SlotExperts`
(routed experts in ``ep``-sharded slots) would start a global-view expert-parallel ``shard_map`` of its own, which
cannot nest there. :func:`manual_params` swaps every one for :class:`ManualSlotExperts`, the device's own
``P / ep`` slots with the layer's placement, and op ``moe_experts`` then runs the per-device body (dispatch over
``ep``, local experts, combine) directly. A tree without slot layers -- one device, or ``ep = 1`` -- passes
through unchanged: its MoE layers run locally, with no collective.

A step opens a :func:`~deepinfer_jax.ops.tiling.token_scope` with its real tokens around the model: the MoE then
routes padding tokens to no expert and adds each layer's rows per local slot to the scope's sums (EPLB's input,
:func:`expert_counts`), also from inside batch-invariant tiles.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from deepinfer_jax.models.common.linear import LinearNumerics
from deepinfer_jax.models.common.moe import Routing
from deepinfer_jax.ops.moe_kernels import register_expert_layout
from deepinfer_jax.ops.tiling import TokenScope, current_scope
from deepinfer_jax.parallel.expert_parallel import ExpertPlacement, local_moe_experts, resolve_transport
from deepinfer_jax.parallel.mesh import EP, mesh_sizes
from deepinfer_jax.parallel.model_parallel import SlotExperts, slot_expert_layers

__all__ = [
    "ManualSlotExperts",
    "expert_count_layout",
    "expert_counts",
    "manual_params",
    "param_specs",
]

_COUNTS = "expert_counts:"
"""Prefix of the token-scope sums holding a MoE layer's rows per local slot (then its dotted path)."""


@dataclasses.dataclass(frozen=True)
class ManualSlotExperts:
    """One MoE layer's routed experts as one device sees them inside the engine's ``shard_map`` (a pytree node).

    Attributes:
      experts: the device's slots of ``{"gate", "up", "down"}``, ``[P / ep, ...]``.
      placement: the layer's :class:`ExpertPlacement` (all ``P`` slots, replicated).
      ep: the expert-parallel group size (static).
      transport: a concrete transport of :mod:`deepinfer_jax.parallel.expert_parallel` (static).
      platform: the devices' platform, for the choice of the expert-compute backend (static).
      path: the layer's dotted path in the parameter tree (static; keys the step's expert counts).
    """

    experts: dict[str, Any]
    placement: ExpertPlacement
    ep: int
    transport: str
    platform: str
    path: str = ""


jax.tree_util.register_dataclass(
    ManualSlotExperts,
    data_fields=["experts", "placement"],
    meta_fields=["ep", "transport", "platform", "path"],
)


def expert_counts(scope: TokenScope, layout: tuple[tuple[str, int], ...]) -> jax.Array:
    """The rows each local slot received in every layer of ``layout`` (:func:`expert_count_layout`), side by
    side, ``int32 [Σ P / ep]``, from a step's token scope (zeros for a layer the step did not run)."""
    paths = {path for path, _ in layout}
    unknown = sorted(
        k[len(_COUNTS) :] for k in scope.sums if k.startswith(_COUNTS) and k[len(_COUNTS) :] not in paths
    )
    if unknown:
        raise ValueError(f"expert counts: MoE layers {unknown} are not slot-layout layers of params")
    parts = [scope.sums.get(_COUNTS + path, jnp.zeros(width, jnp.int32)) for path, width in layout]
    return jnp.concatenate(parts) if parts else jnp.zeros(0, jnp.int32)


def _manual_moe_experts(
    x: jax.Array,
    routing: Routing,
    experts: ManualSlotExperts,
    numerics: LinearNumerics,
    *,
    swiglu_limit: float | None = None,
    weight_before_down: bool = False,
    out_dtype: Any = None,
) -> jax.Array:
    """Op ``moe_experts`` for :class:`ManualSlotExperts`: this device's tokens, expert-parallel over ``ep``.

    Inside a step's :func:`~deepinfer_jax.ops.tiling.token_scope` the padding tokens are dropped from the routing
    (expert id ``-1``) and the rows each local slot received are added to the scope's sums.
    """
    scope = current_scope()
    if scope is not None and scope.valid.shape[0] == x.shape[0]:
        routing = Routing(jnp.where(scope.valid[:, None], routing.ids, -1), routing.weights)
    result = local_moe_experts(
        x,
        routing,
        experts.experts,
        experts.placement,
        numerics,
        ep=experts.ep,
        swiglu_limit=swiglu_limit,
        weight_before_down=weight_before_down,
        out_dtype=out_dtype,
        transport=experts.transport,
        platform=experts.platform,
    )
    if scope is not None:
        scope.add(_COUNTS + experts.path, result.slot_counts)
    return result.out


register_expert_layout(ManualSlotExperts, _manual_moe_experts)


def _is_slot_experts(x: Any) -> bool:
    return isinstance(x, SlotExperts)


def expert_count_layout(params: Any, ep: int) -> tuple[tuple[str, int], ...]:
    """``(dotted path, slots per device)`` of every slot-layout MoE layer of ``params``, in tree order: the
    columns of a step's expert counts."""
    return tuple((path, layer.num_slots // ep) for path, layer in slot_expert_layers(params).items())


def param_specs(params: Any) -> Any:
    """The ``shard_map`` in-specs of a laid-out parameter tree: expert slots over ``ep``, the rest replicated."""

    def one(x: Any) -> Any:
        if isinstance(x, SlotExperts):
            return dataclasses.replace(
                x,
                experts=jax.tree.map(lambda _: PartitionSpec(EP), x.experts),
                placement=jax.tree.map(lambda _: PartitionSpec(), x.placement),
            )
        return PartitionSpec()

    return jax.tree.map(one, params, is_leaf=_is_slot_experts)


def manual_params(params: Any, mesh: Mesh) -> Any:
    """Inside the manual region: every :class:`SlotExperts` replaced by its :class:`ManualSlotExperts` view.

    A layer laid out for another mesh is refused: its slots would be split for a different EP group size.
    """
    _, ep = mesh_sizes(mesh)

    def one(path: Any, x: Any) -> Any:
        if isinstance(x, SlotExperts):
            # Read only here: an abstract mesh (a step lowered for export) has no devices, and no slot layout.
            platform = mesh.devices.flat[0].platform
            if x.mesh != mesh:
                raise ValueError(
                    f"params: a MoE layer is laid out for mesh {dict(x.mesh.shape)}, but the step runs on "
                    f"{dict(mesh.shape)}; lay the parameters out with shard_model_params on the step's mesh"
                )
            name = jax.tree_util.keystr(path, simple=True, separator=".")
            return ManualSlotExperts(
                x.experts, x.placement, ep, resolve_transport(x.transport, mesh), platform, name
            )
        return x

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=_is_slot_experts)
