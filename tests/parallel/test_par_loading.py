"""Parameters on a mesh without any device holding the whole model.

On a mesh, ``LLM`` reads and assembles the parameters in host memory (engine/llm.py ``_load_for``) and
``shard_model_params`` copies to each device only its shards; expert stacks are gathered into slot layout shard
by shard on the host (``_slots_on_mesh``), so the ``[P, ...]`` stack exists nowhere whole. On the 8 virtual CPU
devices "host memory" is a CPU device like the others, so the tests pin the load to device 5 and check that
assembly leaves every parameter there, and that the slot shards each device receives are the logical experts
its slots name.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from deepinfer_jax.checkpoint.model_loading import load_model
from deepinfer_jax.engine.llm import host_device
from deepinfer_jax.parallel import shard_model_params, slot_expert_layers
from deepinfer_jax.parallel.expert_parallel import placement_from_slots
from deepinfer_jax.parallel.mesh import make_mesh


@pytest.mark.parametrize("name", ["tiny-v3", "tiny-v4", "tiny-v41"])
def test_assembly_stays_on_the_device_it_reads_to(name):
    """The families' assembly (expert stacking, dtype conversions) runs where the tensors were read: nothing
    lands on the default device. With the CPU device as the target that keeps a real checkpoint in host memory."""
    target = jax.devices()[5]
    with jax.default_device(target):
        model = load_model(name, "bfloat16", sharding=jax.sharding.SingleDeviceSharding(target))
    leaves = jax.tree.leaves(model.params)
    assert leaves and all(leaf.devices() == {target} for leaf in leaves)
    assert host_device() is not None and host_device().platform == "cpu"


def test_expert_slots_are_gathered_shard_by_shard(monkeypatch):
    mesh = make_mesh(2, 4)
    rng = np.random.default_rng(0)
    experts = {"gate": {"weight": rng.normal(size=(6, 3, 5)).astype(np.float32)}}
    axes = {"gate": {"weight": ("expert", "mlp", "embed")}}
    s2e = np.array([5, 0, 1, 1, 2, 3, 4, 0])  # replicas of experts 0 and 1, out of order
    placement = placement_from_slots(s2e, 6)
    requested = []
    real = jax.make_array_from_callback

    def spy(shape, sharding, callback):
        return real(shape, sharding, lambda index: requested.append(index) or callback(index))

    monkeypatch.setattr(jax, "make_array_from_callback", spy)
    laid = shard_model_params({"experts": experts}, {"experts": axes}, mesh, placement=placement)
    monkeypatch.undo()
    weight = slot_expert_layers(laid)["experts"].experts["gate"]["weight"]
    assert weight.shape == (8, 3, 5)
    host = experts["gate"]["weight"]
    np.testing.assert_array_equal(np.asarray(weight), host[s2e])
    for shard in weight.addressable_shards:
        assert shard.data.shape == (2, 3, 5)  # each device holds its own two slots only
        np.testing.assert_array_equal(np.asarray(shard.data), host[s2e[shard.index[0]]])
    # Every request was for one device's slot range: the whole [8, ...] stack was never gathered.
    assert requested and all(len(range(8)[i[0]]) == 2 for i in requested)
    with pytest.raises(ValueError, match=r"gate\.weight: shape \(\)"):
        bad = {"experts": {"gate": {"weight": np.float32(1.0)}, "up": {"weight": host}}}
        bad_axes = {"experts": {"gate": {"weight": ("expert", "mlp", "embed")}, "up": axes["gate"]}}
        shard_model_params(bad, bad_axes, mesh, placement=placement)
