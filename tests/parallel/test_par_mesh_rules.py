"""The (dp, ep) mesh and the logical-axis rules, on 8 virtual CPU devices."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec

import deepinfer_jax
from deepinfer_jax.config.tree import ParallelConfig
from deepinfer_jax.models.builtin import hf_config
from deepinfer_jax.models.deepseek_v3 import weights as v3_weights
from deepinfer_jax.parallel import expert_parallel as ep_mod
from deepinfer_jax.parallel import mesh as mesh_mod
from deepinfer_jax.parallel import rules


@pytest.mark.parametrize(("dp", "ep"), [(2, 4), (1, 8), (1, 1)])
def test_mesh_places_ep_groups_on_consecutive_devices(dp, ep):
    mesh = mesh_mod.make_mesh(dp, ep)
    assert mesh_mod.mesh_sizes(mesh) == (dp, ep)
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    expected = np.array([d.id for d in jax.devices()[: dp * ep]]).reshape(dp, ep)
    np.testing.assert_array_equal(ids, expected)


def test_mesh_from_config_and_refusals():
    mesh = mesh_mod.mesh_from_config(ParallelConfig(data_parallel_size=2, expert_parallel_size=4))
    assert dict(mesh.shape) == {"dp": 2, "ep": 4}
    with pytest.raises(ValueError, match=r"2 \* 8 = 16 devices, but only 8"):
        mesh_mod.make_mesh(2, 8)
    with pytest.raises(ValueError, match="expert_parallel_size = 0"):
        mesh_mod.make_mesh(1, 0)
    with pytest.raises(TypeError, match="data_parallel_size must be an int"):
        mesh_mod.make_mesh(2.0, 4)
    with pytest.raises(ValueError, match="context_parallel_size = 2"):
        mesh_mod.mesh_from_config(ParallelConfig(context_parallel_size=2))
    with pytest.raises(TypeError, match="ParallelConfig"):
        mesh_mod.mesh_from_config({"data_parallel_size": 1})


def test_logical_to_spec_table():
    mesh = mesh_mod.make_mesh(2, 4)
    spec = rules.logical_to_spec(("expert_slot", "moe_mlp", "embed"), (8, 4, 4), mesh)
    assert spec == PartitionSpec("ep", None, None)
    assert rules.logical_to_spec(("batch", "embed"), (16, 4), mesh) == PartitionSpec(("dp", "ep"), None)
    # Logical expert axes (router rows, bias) and everything else stay replicated.
    assert rules.logical_to_spec(("expert", "embed"), (6, 4), mesh) == PartitionSpec(None, None)
    with pytest.raises(
        ValueError, match=r"w: dimension 0 \('expert_slot'\) has size 6, not a multiple of the 4"
    ):
        rules.logical_to_spec(("expert_slot", "embed"), (6, 4), mesh, name="w")
    with pytest.raises(ValueError, match="names mesh axes \\['cp'\\]"):
        rules.logical_to_spec(("embed",), (4,), mesh, {"embed": "cp"})
    with pytest.raises(ValueError, match="to two dimensions"):
        rules.logical_to_spec(("batch", "expert_slot"), (8, 8), mesh)
    with pytest.raises(ValueError, match="2 logical axis names"):
        rules.logical_to_spec(("a", "b"), (4,), mesh)


@pytest.fixture(scope="module")
def tiny_v3_params():
    return deepinfer_jax.init_random(hf_config("tiny-v3"), 3)


def test_shard_tiny_v3_params_experts_over_ep_rest_replicated(tiny_v3_params):
    params = tiny_v3_params
    mesh = mesh_mod.make_mesh(2, 4)
    num_experts = params["layers"][1]["mlp"]["router"].shape[0]
    # 8 experts + 2 extra replicas -> 12 slots, 3 per EP rank: an expert count ep does not divide works.
    placement = ep_mod.initial_placement(num_experts, 4, extra=2)
    assert placement.num_slots == 12
    placed = ep_mod.experts_to_slots(params, placement)
    assert placed["layers"][0]["mlp"] is not params["layers"][0]["mlp"]  # a new tree; leaves are shared
    assert placed["mtp"][0]["layer"]["mlp"]["experts"]["up"]["weight"].shape[0] == 12  # MTP layers too
    axes = rules.slot_axes(v3_weights.logical_axes(placed))
    sharded = rules.shard_params(placed, axes, mesh)

    gate = sharded["layers"][1]["mlp"]["experts"]["gate"]["weight"]
    assert gate.sharding.spec == PartitionSpec("ep", None, None)
    assert {s.data.shape[0] for s in gate.addressable_shards} == {3}
    # Device (dp, ep) holds slots [3*ep, 3*ep + 3): the same on both dp replicas.
    logical = np.asarray(params["layers"][1]["mlp"]["experts"]["gate"]["weight"])
    slot_map = np.asarray(placement.slot_to_expert)
    for shard in gate.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), logical[slot_map[shard.index[0]]])
    for leaf in (
        sharded["layers"][1]["mlp"]["router"],
        sharded["layers"][1]["mlp"]["bias"],
        sharded["layers"][1]["attn"]["w_uk"],
        sharded["embed"],
    ):
        assert leaf.sharding.is_fully_replicated
    with pytest.raises(ValueError, match="2 logical-axis leaves"):
        rules.param_shardings(
            {"a": np.zeros(2), "b": np.zeros(2), "c": np.zeros(2)}, {"a": ("x",), "b": ("y",)}, mesh
        )
