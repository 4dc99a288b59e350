"""Whole models, unmodified, running their MoE layers expert-parallel on 8 virtual CPU devices.

Each family's own jitted full forward (``Model.logits``) gets parameters from ``shard_model_params``; op
``moe_experts`` meets the slot-layout experts and runs ``ep_moe_experts``. The one-device forward of the same
model is the reference.

Tolerance: the expert-parallel layer runs the same float32 per-row arithmetic as the unsharded op and sums each
token's picks in the same order; only XLA:CPU's GEMM blocking for a different number of rows per expert moves
the last bits of a MoE output, and those differences pass through the remaining layers. Measured: at most
4.6e-6 on logits of magnitude up to 4 (about 10 float32 ulp at that magnitude), so ``atol = 5e-5`` (ten times
that) with ``rtol = 1e-5``; greedy tokens must be identical.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from deepinfer_jax.checkpoint.model_loading import Model, load_model
from deepinfer_jax.models.common.linear import LinearNumerics
from deepinfer_jax.models.common.moe import Routing
from deepinfer_jax.parallel import (
    SlotExperts,
    ep_moe_experts,
    initial_placement,
    make_mesh,
    placement_from_slots,
    replace_slot_experts,
    shard_model_params,
    slot_expert_layers,
)

TOL = {"rtol": 1e-5, "atol": 5e-5}
# Six tokens in two sequences: fewer tokens (and sequences) than the eight devices, so devices with no token of
# their own still take part in every dispatch and combine.
SHAPE = (2, 3)
MESHES = [(2, 4), (1, 8)]
_SLOW_FAMILIES = {"tiny-v4", "tiny-v41"}  # each compiles three forwards of ~10 s on a 2-core machine


@functools.cache
def _model(name: str) -> Model:
    return load_model(name)


@functools.cache
def _ids(name: str) -> np.ndarray:
    vocab = _model(name).config.vocab_size
    return np.random.default_rng(7).integers(0, vocab, SHAPE).astype(np.int32)


@functools.cache
def _reference(name: str) -> np.ndarray:
    return _model(name).logits(_ids(name))


def _sharded(model: Model, dp: int, ep: int, **kwargs) -> Model:
    mesh = make_mesh(dp, ep)
    params = shard_model_params(model.params, model.family.logical_axes(model.params), mesh, **kwargs)
    return Model(model.config, params, model.family, model.dtype)


def _cases():
    for name in ("tiny-v3", "tiny-v4", "tiny-v41"):
        marks = [pytest.mark.slow] if name in _SLOW_FAMILIES else []
        for dp, ep in MESHES:
            if name == "tiny-v41" and (dp, ep) != MESHES[0]:
                continue  # ~30 s of compilation; V4.1's expert layer is V4's, checked on both meshes
            yield pytest.param(name, dp, ep, id=f"{name}-dp{dp}-ep{ep}", marks=marks)


@pytest.mark.parametrize("name,dp,ep", list(_cases()))
def test_sharded_forward_matches_one_device(name, dp, ep):
    model = _model(name)
    sharded = _sharded(model, dp, ep)
    layers = slot_expert_layers(sharded.params)
    assert layers, "no MoE layer was laid out in slots"
    for where, layer in layers.items():
        assert layer.num_slots % ep == 0, where
        leaf = jax.tree_util.tree_leaves(layer.experts)[0]
        assert leaf.sharding.spec == PartitionSpec("ep", None, None), where
    got = sharded.logits(_ids(name))
    want = _reference(name)
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
    np.testing.assert_allclose(got, want, **TOL)


def _count_all_to_all(text: str) -> int:
    return text.count("stablehlo.all_to_all") + text.count('"stablehlo.all_to_all"')


def test_forward_dispatches_through_the_expert_parallel_layer():
    """The lowered forward holds exactly one expert-parallel exchange per MoE layer, and the unsharded none."""
    model = _model("tiny-v3")
    dp, ep = 2, 4
    sharded = _sharded(model, dp, ep)
    forward = jax.jit(model.family.forward_logits, static_argnums=1)
    ids = _ids("tiny-v3")
    in_model = _count_all_to_all(forward.lower(sharded.params, model.config, ids).as_text())
    assert _count_all_to_all(forward.lower(model.params, model.config, ids).as_text()) == 0

    # One layer alone, composed by hand, fixes how many all_to_all ops one exchange lowers to.
    layer = next(iter(slot_expert_layers(sharded.params).values()))
    tokens, hidden = ids.size, model.config.hidden_size
    k = model.config.num_experts_per_tok
    routing = Routing(jnp.zeros((tokens, k), jnp.int32), jnp.ones((tokens, k), jnp.float32))
    one = jax.jit(
        lambda x, r, se, pl: ep_moe_experts(
            x, r, se, pl, LinearNumerics(), layer.mesh, transport="all_to_all"
        )
    )
    per_layer = _count_all_to_all(
        one.lower(jnp.zeros((tokens, hidden)), routing, layer.experts, layer.placement).as_text()
    )
    moe_layers = sum("router" in layer_p["mlp"] for layer_p in model.params["layers"])
    assert per_layer > 0 and moe_layers > 0
    assert in_model == moe_layers * per_layer


def test_replacement_keeps_logits_and_compiled_step():
    """An EPLB re-placement swaps data only: same logits, and the jitted forward does not compile again."""
    model = _model("tiny-v3")
    sharded = _sharded(model, 2, 4, extra=4)  # 8 experts + 4 replicas = 12 slots, 3 per rank
    forward = jax.jit(model.family.forward_logits, static_argnums=1)
    ids = _ids("tiny-v3")
    before = np.asarray(forward(sharded.params, model.config, ids))
    compiled = forward._cache_size()  # jit caches are shared by wrappers of one function: count the delta
    updates = {}
    for where, layer in slot_expert_layers(sharded.params).items():
        # Reversed order, and the replicas go to experts 7..4 instead of 0..3: every slot moves.
        slots = (np.arange(layer.num_slots)[::-1] % layer.num_experts).astype(np.int32)
        updates[where] = layer.with_placement(placement_from_slots(slots, layer.num_experts))
    moved = replace_slot_experts(sharded.params, updates)
    after = np.asarray(forward(moved, model.config, ids))
    assert forward._cache_size() == compiled
    np.testing.assert_array_equal(after.argmax(-1), before.argmax(-1))
    np.testing.assert_allclose(after, before, **TOL)
    np.testing.assert_allclose(after, _reference("tiny-v3"), **TOL)


def test_drafter_layers_get_their_own_placement():
    """V4.1's drafter layers have 4 experts against the backbone's 8: each layer is laid out for its own count."""
    model = _model("tiny-v41")
    mesh = make_mesh(1, 8)
    params = shard_model_params(model.params, model.family.logical_axes(model.params), mesh, extra=1)
    layers = slot_expert_layers(params)
    draft = {k: v for k, v in layers.items() if k.startswith("mtp.")}
    backbone = {k: v for k, v in layers.items() if k.startswith("layers.")}
    assert draft and backbone
    assert {(v.num_experts, v.num_slots) for v in draft.values()} == {(4, 8)}  # 4 + 1 rounded up to 8
    assert {(v.num_experts, v.num_slots) for v in backbone.values()} == {(8, 16)}  # 8 + 1 rounded up to 16
    for layer in layers.values():
        packed = layer.experts["gate"]["packed"]
        assert packed.shape[0] == layer.num_slots
        assert packed.sharding.spec == PartitionSpec("ep", None, None)


def test_refusals():
    model = _model("tiny-v3")
    mesh = make_mesh(2, 4)
    axes = model.family.logical_axes(model.params)
    with pytest.raises(
        ValueError, match=r"placement of layers\.1\.mlp\.experts: 6 experts, but the layer has 8"
    ):
        shard_model_params(model.params, axes, mesh, placement=initial_placement(6, 4))
    with pytest.raises(ValueError, match=r"\['layers\.0\.mlp\.experts'\] name no MoE layer"):
        shard_model_params(
            model.params, axes, mesh, placement={"layers.0.mlp.experts": initial_placement(8, 4)}
        )
    with pytest.raises(TypeError, match="placement: expected None"):
        shard_model_params(model.params, axes, mesh, placement=[1, 2])
    with pytest.raises(ValueError, match="transport"):
        shard_model_params(model.params, axes, mesh, transport="carrier_pigeon")
    params = shard_model_params(model.params, axes, mesh)
    layer = next(iter(slot_expert_layers(params).values()))
    # A kernel reading slot-layout experts as logical stacks would compute garbage; it fails instead.
    with pytest.raises(TypeError, match="slot-layout experts"):
        set(layer)
    with pytest.raises(ValueError, match=r"\['nowhere'\] name no slot-layout MoE layer"):
        replace_slot_experts(params, {"nowhere": layer})
    with pytest.raises(TypeError, match="expected a SlotExperts"):
        where = next(iter(slot_expert_layers(params)))
        replace_slot_experts(params, {where: layer.experts})
    assert isinstance(layer, SlotExperts)


def test_layout_hook_forwards_the_call_unchanged():
    """Op ``moe_experts`` hands a registered container type to its implementation with every argument."""
    from deepinfer_jax.models.common.moe import moe_experts, register_expert_layout

    class Layout:  # a container type of this test only
        pass

    calls = []

    def impl(x, routing, experts, numerics, **kwargs):
        calls.append((x, routing, experts, numerics, kwargs))
        return x * 2

    register_expert_layout(Layout, impl)
    layout, x = Layout(), jnp.ones((3, 4))
    routing = Routing(jnp.zeros((3, 2), jnp.int32), jnp.ones((3, 2)))
    out = moe_experts(x, routing, layout, LinearNumerics(), swiglu_limit=7.0, weight_before_down=True)
    np.testing.assert_array_equal(out, 2 * np.ones((3, 4)))
    [(got_x, got_routing, got_layout, _, kwargs)] = calls
    assert got_x is x and got_routing is routing and got_layout is layout
    assert kwargs == {"swiglu_limit": 7.0, "weight_before_down": True, "out_dtype": None}
    # The kernel backends of the op (selected on GPU / Ascend) honour the same hook.
    from deepinfer_jax.ops.moe_kernels import moe_grouped_experts_ascend, moe_grouped_experts_pallas

    for kernel in (moe_grouped_experts_pallas, moe_grouped_experts_ascend):
        np.testing.assert_array_equal(kernel(x, routing, layout, LinearNumerics(), swiglu_limit=3.0), 2 * x)
        assert calls[-1][2] is layout and calls[-1][4] == {"swiglu_limit": 3.0}
    with pytest.raises(TypeError, match="layout must be a class"):
        register_expert_layout(layout, impl)
    with pytest.raises(TypeError, match="impl must be callable"):
        register_expert_layout(Layout, None)
