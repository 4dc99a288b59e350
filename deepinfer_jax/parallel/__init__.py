"""Parallel execution on a ``(dp, ep)`` device mesh: the mesh, the sharding rules, expert-parallel MoE and EPLB.

Importing this package registers the slot layout of routed experts (:class:`SlotExperts`) with op
``moe_experts``, so a model forward over parameters from :func:`shard_model_params` runs its MoE layers
expert-parallel with no change to the model code.

See docs/parallelism.md for the layout, the communication per layer and what is not built yet.
"""

from deepinfer_jax.parallel.eplb import (
    ExpertLoadBalancer,
    ExpertLoadWindow,
    RearrangeSchedule,
    imbalance,
    move_experts,
    rebalance,
)
from deepinfer_jax.parallel.expert_parallel import (
    ExpertPlacement,
    MoEOutput,
    ep_moe_experts,
    experts_to_slots,
    initial_placement,
    local_moe_experts,
    num_slots,
    place_experts,
    placement_from_slots,
)
from deepinfer_jax.parallel.mesh import DP, EP, make_mesh, mesh_from_config
from deepinfer_jax.parallel.model_parallel import (
    SlotExperts,
    place_on_mesh,
    replace_slot_experts,
    shard_model_params,
    slot_expert_layers,
)
from deepinfer_jax.parallel.rules import (
    DEFAULT_RULES,
    logical_to_spec,
    param_shardings,
    shard_params,
    slot_axes,
)

__all__ = [
    "DEFAULT_RULES",
    "DP",
    "EP",
    "ExpertLoadBalancer",
    "ExpertLoadWindow",
    "ExpertPlacement",
    "MoEOutput",
    "RearrangeSchedule",
    "SlotExperts",
    "ep_moe_experts",
    "experts_to_slots",
    "imbalance",
    "initial_placement",
    "local_moe_experts",
    "logical_to_spec",
    "make_mesh",
    "mesh_from_config",
    "move_experts",
    "num_slots",
    "param_shardings",
    "place_experts",
    "place_on_mesh",
    "placement_from_slots",
    "rebalance",
    "replace_slot_experts",
    "shard_model_params",
    "shard_params",
    "slot_axes",
    "slot_expert_layers",
]
