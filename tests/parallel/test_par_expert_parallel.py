"""Expert-parallel MoE on 8 virtual CPU devices equals the unsharded op ``moe_experts``.

Tolerance: the sharded layer runs the same per-row float32 GEMMs as the reference (op ``moe_experts`` with the
rows of one slot gathered together) and sums a token's k picks in the same order, so results agree to rounding;
only XLA:CPU's choice of GEMM kernel for a different number of rows can move the last bits (a few ulp of values
of order 10), hence ``rtol = atol = 1e-5``. On this machine the difference is 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import export

import deepinfer_jax
from deepinfer_jax.config.v3 import DeepseekV3Config
from deepinfer_jax.models.builtin import hf_config
from deepinfer_jax.models.common import swiglu_mlp
from deepinfer_jax.models.common.linear import LinearNumerics
from deepinfer_jax.models.common.moe import Routing, moe_experts
from deepinfer_jax.models.deepseek_v3 import model as v3_model
from deepinfer_jax.numerics.codecs import quantize_fp8_blockwise, quantize_mxfp4
from deepinfer_jax.parallel import expert_parallel as epm
from deepinfer_jax.parallel.mesh import make_mesh

TOL = {"rtol": 1e-5, "atol": 1e-5}
E, H, INTER, K = 6, 16, 8, 2  # 6 experts: not a multiple of ep = 4 or 8, so slots are padded with replicas
NUMERICS = LinearNumerics()
_reference = jax.jit(functools.partial(moe_experts, numerics=NUMERICS))


@pytest.fixture(scope="module")
def experts():
    rng = np.random.default_rng(0)

    def w(*shape):
        return {"weight": jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[-1]), jnp.float32)}

    return {"gate": w(E, INTER, H), "up": w(E, INTER, H), "down": w(E, H, INTER)}


@functools.cache
def _runner(dp: int, ep: int, transport: str):
    mesh = make_mesh(dp, ep)
    return jax.jit(lambda x, r, se, pl: epm.ep_moe_experts(x, r, se, pl, NUMERICS, mesh, transport=transport))


def _routing(rng, tokens, skewed):
    ids = np.stack([rng.permutation(E)[:K] for _ in range(tokens)]).astype(np.int32)
    if skewed:  # every token's first pick is expert 0: its slots' device receives the device's whole batch
        ids[:, 0] = 0
        ids[:, 1] = np.where(ids[:, 1] == 0, 1, ids[:, 1])
    return Routing(jnp.asarray(ids), jnp.asarray(rng.random((tokens, K)), jnp.float32))


@pytest.mark.parametrize(("dp", "ep"), [(2, 4), (1, 8)])
@pytest.mark.parametrize("transport", ["all_to_all", "ragged_emulated"])
@pytest.mark.parametrize(("tokens", "skewed"), [(3, False), (16, True)])
def test_sharded_equals_unsharded(experts, dp, ep, transport, tokens, skewed):
    rng = np.random.default_rng(tokens)
    x = jnp.asarray(rng.normal(size=(tokens, H)), jnp.float32)
    routing = _routing(rng, tokens, skewed)
    placement = epm.initial_placement(E, ep)
    got = _runner(dp, ep, transport)(x, routing, epm.place_experts(experts, placement), placement)
    want = _reference(x, routing, experts)
    np.testing.assert_allclose(np.asarray(got.out), np.asarray(want), **TOL)
    # Every pick is received exactly once, by a slot holding its expert.
    s2e = np.asarray(placement.slot_to_expert)
    per_expert = np.bincount(s2e, weights=np.asarray(got.slot_counts), minlength=E)
    np.testing.assert_array_equal(per_expert, np.bincount(np.asarray(routing.ids).ravel(), minlength=E))


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_property_any_routing_with_placeholders(experts, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    ids = data.draw(
        st.lists(st.lists(st.integers(-1, E - 1), min_size=K, max_size=K), min_size=5, max_size=5),
        label="ids",
    )
    routing = Routing(jnp.asarray(ids, jnp.int32), jnp.asarray(rng.random((5, K)), jnp.float32))
    x = jnp.asarray(rng.normal(size=(5, H)), jnp.float32)
    extra = data.draw(st.integers(0, 5), label="extra")
    placement = epm.initial_placement(E, 4, extra)
    placement = epm.placement_from_slots(np.asarray(placement.slot_to_expert), E)
    got = _runner(2, 4, "all_to_all")(x, routing, epm.place_experts(experts, placement), placement)
    np.testing.assert_allclose(np.asarray(got.out), np.asarray(_reference(x, routing, experts)), **TOL)
    assert int(got.slot_counts.sum()) == int((np.asarray(ids) >= 0).sum())  # placeholders are not dispatched


def test_placement_tables_and_replica_choice():
    assert epm.num_slots(6, 4) == 8 and epm.num_slots(8, 8) == 8 and epm.num_slots(8, 4, 1) == 12
    pl = epm.initial_placement(6, 4)
    np.testing.assert_array_equal(pl.slot_to_expert, [0, 1, 2, 3, 4, 5, 0, 1])
    np.testing.assert_array_equal(pl.replica_count, [2, 2, 1, 1, 1, 1])
    np.testing.assert_array_equal(pl.expert_slots[:2], [[0, 6, -1], [1, 7, -1]])
    ids = np.array([[0, 1], [0, 5], [1, -1], [0, 2]], np.int32)
    for rank in range(4):
        got = np.asarray(epm.physical_slots(jnp.asarray(ids), pl, rank))
        table, count = np.asarray(pl.expert_slots), np.asarray(pl.replica_count)
        for t, row in enumerate(ids):
            for j, e in enumerate(row):
                want = -1 if e < 0 else table[e, (rank + t * 23333) % count[e]]  # spec/engine.md §11.1
                assert got[t, j] == want
    with pytest.raises(ValueError, match=r"experts \[2\] have no slot"):
        epm.placement_from_slots(np.array([0, 1, 0, 1]), 3)
    with pytest.raises(ValueError, match=r"slot_to_expert\[1\] = 7 is outside \[0, 3\)"):
        epm.placement_from_slots(np.array([0, 7, 2]), 3)
    with pytest.raises(ValueError, match="transport"):
        epm.resolve_transport("nccl", make_mesh(1, 1))
    assert epm.resolve_transport("auto", make_mesh(2, 4)) == "all_to_all"  # XLA:CPU has no ragged_all_to_all


def test_ragged_transport_lowers_for_cuda(experts):
    mesh = make_mesh(2, 4)
    placement = epm.initial_placement(E, 4)
    sds = jax.ShapeDtypeStruct
    slot_experts = jax.tree_util.tree_map(
        lambda a: sds((placement.num_slots, *a.shape[1:]), a.dtype), epm.place_experts(experts, placement)
    )
    fn = jax.jit(lambda x, r, se, pl: epm.ep_moe_experts(x, r, se, pl, NUMERICS, mesh, transport="ragged"))
    exported = export.export(
        fn, platforms=["cuda"], disabled_checks=[export.DisabledSafetyCheck.custom_call("ragged_all_to_all")]
    )(
        sds((16, H), jnp.float32),
        Routing(sds((16, K), jnp.int32), sds((16, K), jnp.float32)),
        slot_experts,
        jax.tree_util.tree_map(lambda a: sds(a.shape, a.dtype), placement),
    )
    text = exported.mlir_module()
    # Dispatch (rows, slot ids, weights) and combine: four ragged exchanges, within each EP group of 4.
    assert text.count("stablehlo.custom_call @ragged_all_to_all") == 4
    assert "replica_groups = dense<[[0, 1, 2, 3], [4, 5, 6, 7]]>" in text
    assert exported.platforms == ("cuda",)


@pytest.fixture(scope="module")
def tiny_v3():
    hf = hf_config("tiny-v3")
    return DeepseekV3Config.from_hf(hf), hf


# float32: parity mode. bfloat16: production mode; both paths round the float32 sum once to bfloat16, so a
# last-bit difference of the float32 sum can flip one bfloat16 rounding: 1 bf16 ulp (2**-8 relative).
@pytest.mark.parametrize(
    ("dp", "ep", "dtype", "tol"),
    [(2, 4, "float32", TOL), (1, 8, "float32", TOL), (2, 4, "bfloat16", {"rtol": 2**-8, "atol": 2**-8})],
)
def test_whole_tiny_v3_moe_layer(tiny_v3, dp, ep, dtype, tol):
    cfg, hf = tiny_v3
    params = deepinfer_jax.init_random(hf, 3, dtype)
    p = params["layers"][1]["mlp"]
    pl = v3_model.plan(cfg, dtype)
    tokens = 5  # fewer tokens than devices: most devices run placeholders only
    x = jnp.asarray(np.random.default_rng(1).normal(size=(tokens, cfg.hidden_size)), dtype)
    mesh = make_mesh(dp, ep)
    placement = epm.initial_placement(cfg.n_routed_experts, ep, extra=3)
    slot_experts = epm.place_experts(p["experts"], placement)

    @jax.jit
    def sharded_layer(x, p, slot_experts, placement):
        routing = v3_model.moe_routing(x, p, pl)
        y = epm.ep_moe_experts(
            x, routing, slot_experts, placement, pl.numerics, mesh, out_dtype=jnp.float32
        ).out
        return (y + swiglu_mlp(x, p["shared"], pl.numerics, out_dtype=jnp.float32)).astype(x.dtype)

    got = sharded_layer(x, p, slot_experts, placement)
    want = jax.jit(v3_model.feed_forward, static_argnums=2)(x, p, pl)
    assert got.dtype == want.dtype == jnp.dtype(dtype)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)


def test_refuses_bad_inputs(experts):
    mesh = make_mesh(1, 4)
    pl = epm.initial_placement(E, 4)
    x = jnp.zeros((4, H))
    r = Routing(jnp.zeros((4, K), jnp.int32), jnp.zeros((4, K)))
    with pytest.raises(
        ValueError, match=r"slot_experts\.down\.weight has shape \(6, 16, 8\); expected \[8, \.\.\.\] slots"
    ):
        epm.ep_moe_experts(x, r, experts, pl, NUMERICS, mesh)
    with pytest.raises(ValueError, match="do not match x"):
        epm.ep_moe_experts(x[:3], r, epm.place_experts(experts, pl), pl, NUMERICS, mesh)
    with pytest.raises(ValueError, match="slot_experts lack"):
        epm.ep_moe_experts(x, r, {"gate": experts["gate"]}, pl, NUMERICS, mesh)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_quantised_experts_v4_style(fmt):
    # Checkpoint-format experts (FP8 block-scaled, MXFP4) are gathered into slots scale grids and all, and the
    # V4 options (routing weight before the down projection, clamped SwiGLU) pass through to the op.
    rng = np.random.default_rng(5)
    hidden, inter, tokens = 32, 32, 6

    def q(*shape):
        w = jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[-1]), jnp.float32)
        if fmt == "fp8":
            codes, scale = quantize_fp8_blockwise(w, (16, 16))
            return {"weight": codes, "scale": scale}
        packed, scale = quantize_mxfp4(w)
        return {"packed": packed, "scale": scale}

    experts = {"gate": q(E, inter, hidden), "up": q(E, inter, hidden), "down": q(E, hidden, inter)}
    numerics = LinearNumerics(block=(16, 16) if fmt == "fp8" else None)
    x = jnp.asarray(rng.normal(size=(tokens, hidden)), jnp.float32)
    routing = _routing(rng, tokens, skewed=False)
    opts = {"swiglu_limit": 0.5, "weight_before_down": True}
    mesh = make_mesh(2, 4)
    placement = epm.initial_placement(E, 4, extra=1)
    got = jax.jit(lambda x, r, se, pl: epm.ep_moe_experts(x, r, se, pl, numerics, mesh, **opts))(
        x, routing, epm.place_experts(experts, placement), placement
    )
    want = jax.jit(lambda x, r, e: moe_experts(x, r, e, numerics, **opts))(x, routing, experts)
    np.testing.assert_allclose(np.asarray(got.out), np.asarray(want), **TOL)
