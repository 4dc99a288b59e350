"""Parallel execution on a ``(dp, ep)`` device mesh: the mesh, the sharding rules, expert-parallel MoE and EPLB.

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
    num_slots,
    place_experts,
    placement_from_slots,
)
from deepinfer_jax.parallel.mesh import DP, EP, make_mesh, mesh_from_config
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
    "ep_moe_experts",
    "experts_to_slots",
    "imbalance",
    "initial_placement",
    "logical_to_spec",
    "make_mesh",
    "mesh_from_config",
    "move_experts",
    "num_slots",
    "param_shardings",
    "place_experts",
    "placement_from_slots",
    "rebalance",
    "shard_params",
    "slot_axes",
]
