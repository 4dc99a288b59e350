"""MoE gate, routed experts, SwiGLU and the linear formats of models/common, against NumPy references.

Every reference here is written in the test with NumPy / ml_dtypes (float64 where it matters), independent of
the jnp code under test. Float32 tolerances: the jnp side accumulates dot products of a few dozen terms in
float32 (relative error ~1e-6), so 1e-5 relative leaves an order of magnitude of headroom while a wrong
selection, weight or formula changes values by far more.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_jax.models.common import (
    LinearNumerics,
    Routing,
    embed_tokens,
    grouped_linear,
    linear,
    linear_format,
    lm_head,
    moe_experts,
    route,
    swiglu,
)
from deepinfer_jax.ops import select

F32 = LinearNumerics()


# --------------------------------------------------------------------------------------------- references


def ref_route(logits, *, scoring, top_k, bias=None, n_group=None, topk_group=None, norm=True, scale=1.0):
    z = np.asarray(logits, np.float64)
    if scoring == "sigmoid":
        s = 1.0 / (1.0 + np.exp(-z))
    else:
        s = np.sqrt(np.where(z > 20, z, np.log1p(np.exp(np.minimum(z, 20)))))
    choice = s + (0.0 if bias is None else np.asarray(bias, np.float64))
    T, E = z.shape
    ids = np.zeros((T, top_k), np.int64)
    for t in range(T):
        c = choice[t].copy()
        if n_group is not None and n_group > 1:
            per = E // n_group
            groups = c.reshape(n_group, per)
            gscore = np.sort(groups, axis=1)[:, ::-1][:, : min(2, per)].sum(1)
            keep = np.argsort(-gscore, kind="stable")[:topk_group]
            allowed = np.zeros(n_group, bool)
            allowed[keep] = True
            c = np.where(np.repeat(allowed, per), c, -np.inf)
        ids[t] = np.argsort(-c, kind="stable")[:top_k]
    w = np.take_along_axis(s, ids, 1)
    if norm:
        w = w / (w.sum(1, keepdims=True) + 1e-20)
    return ids, w * scale


def ref_experts(x, ids, w, gate, up, down, limit=None):
    x = np.asarray(x, np.float64)
    out = np.zeros((x.shape[0], down.shape[1]))
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            g = gate[e] @ x[t]
            u = up[e] @ x[t]
            if limit is not None:
                g = np.minimum(g, limit)
                u = np.clip(u, -limit, limit)
            out[t] += w[t, j] * (down[e] @ (g / (1 + np.exp(-g)) * u))
    return out


def np_fp8_quantize(w, block):
    """E4M3 codes + float32 scale_inv per block (amax / 448), written independently of the project."""
    rows, cols = w.shape
    gr, gc = -(-rows // block[0]), -(-cols // block[1])
    scale = np.zeros((gr, gc), np.float32)
    codes = np.zeros_like(w, dtype=ml_dtypes.float8_e4m3fn)
    for i in range(gr):
        for j in range(gc):
            sl = np.s_[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            amax = np.abs(w[sl]).max()
            s = np.float32(amax / 448.0) if amax > 0 else np.float32(1.0)
            scale[i, j] = s
            codes[sl] = (w[sl] / s).astype(ml_dtypes.float8_e4m3fn)
    return codes, scale


def np_fp8_dequantize(codes, scale, block):
    full = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[: codes.shape[0], : codes.shape[1]]
    return codes.astype(np.float32) * full


# --------------------------------------------------------------------------------------------- gate


@pytest.mark.parametrize("scoring", ["sigmoid", "sqrtsoftplus"])
def test_route_matches_reference_with_groups_bias_and_scaling(scoring):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((16, 12)).astype(np.float32) * 3
    bias = (rng.standard_normal(12) * 0.3).astype(np.float32)
    got = route(
        jnp.asarray(logits),
        scoring=scoring,
        top_k=3,
        bias=jnp.asarray(bias),
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    ids, w = ref_route(logits, scoring=scoring, top_k=3, bias=bias, n_group=4, topk_group=2, scale=2.5)
    np.testing.assert_array_equal(np.sort(np.asarray(got.ids), 1), np.sort(ids, 1))
    order_got, order_ref = np.argsort(np.asarray(got.ids), 1), np.argsort(ids, 1)
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(got.weights), order_got, 1),
        np.take_along_axis(w, order_ref, 1),
        rtol=1e-5,
    )


def test_route_bias_selects_but_does_not_weight():
    # Hand case: scores sigmoid(0) = 0.5 for all; the bias alone decides, the weights stay the unbiased 0.5s.
    logits = jnp.zeros((1, 4))
    r = route(logits, scoring="sigmoid", top_k=2, bias=jnp.array([0.0, 1.0, 0.0, 2.0]), norm_topk_prob=False)
    assert sorted(np.asarray(r.ids)[0].tolist()) == [1, 3]
    np.testing.assert_allclose(np.asarray(r.weights), [[0.5, 0.5]])


def test_route_group_limit_uses_top2_sum():
    # Group 0 = [0.9, 0.0], group 1 = [0.6, 0.6]: the best single expert is in group 0, but group 1's
    # top-2 sum (1.2) beats group 0's (0.9), so with one group kept both picks come from group 1.
    scores = np.array([[0.9, 1e-9, 0.6, 0.6]])
    logits = jnp.asarray(np.log(scores / (1 - scores)), jnp.float32)  # sigmoid(logit(s)) = s
    r = route(logits, scoring="sigmoid", top_k=2, n_group=2, topk_group=1)
    assert sorted(np.asarray(r.ids)[0].tolist()) == [2, 3]


def test_route_softplus_threshold_and_external_ids():
    logits = jnp.array([[25.0, 0.0, -3.0]])
    r = route(logits, scoring="sqrtsoftplus", top_k=2, expert_ids=jnp.array([[2, 0]]), norm_topk_prob=False)
    s0 = np.sqrt(25.0)  # above the threshold softplus is the identity
    s2 = np.sqrt(np.log1p(np.exp(-3.0)))
    np.testing.assert_array_equal(np.asarray(r.ids), [[2, 0]])
    np.testing.assert_allclose(np.asarray(r.weights), [[s2, s0]], rtol=1e-6)


def test_route_refuses_bad_arguments():
    with pytest.raises(ValueError, match="top_k = 5"):
        route(jnp.zeros((2, 4)), scoring="sigmoid", top_k=5)
    with pytest.raises(ValueError, match="does not divide"):
        route(jnp.zeros((2, 6)), scoring="sigmoid", top_k=2, n_group=4, topk_group=1)
    with pytest.raises(ValueError, match="scoring"):
        route(jnp.zeros((2, 4)), scoring="softmax", top_k=2)
    with pytest.raises(ValueError, match="expert_ids"):
        route(jnp.zeros((2, 4)), scoring="sigmoid", top_k=2, expert_ids=jnp.zeros((2, 3), jnp.int32))


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    groups=st.sampled_from([(1, 1), (2, 1), (4, 2), (8, 3)]),
    top_k=st.integers(1, 4),
    norm=st.booleans(),
)
def test_route_property_matches_reference(seed, groups, top_k, norm):
    n_group, topk_group = groups
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((6, 16)).astype(np.float32) * 2
    bias = (rng.standard_normal(16) * 0.2).astype(np.float32)
    top_k = min(top_k, topk_group * 16 // n_group)
    got = route(
        jnp.asarray(logits),
        scoring="sigmoid",
        top_k=top_k,
        bias=jnp.asarray(bias),
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm,
        routed_scaling_factor=1.7,
    )
    ids, w = ref_route(
        logits,
        scoring="sigmoid",
        top_k=top_k,
        bias=bias,
        n_group=n_group,
        topk_group=topk_group,
        norm=norm,
        scale=1.7,
    )
    # Ties are measure-zero for Gaussian logits; ids come out in descending score order on both sides.
    np.testing.assert_array_equal(np.asarray(got.ids), ids)
    np.testing.assert_allclose(np.asarray(got.weights), w, rtol=1e-5)
    if norm:
        np.testing.assert_allclose(np.asarray(got.weights).sum(1), 1.7, rtol=1e-5)


# --------------------------------------------------------------------------------------------- experts


@pytest.fixture(scope="module")
def expert_case():
    rng = np.random.default_rng(1)
    E, H, inter, T, K = 6, 20, 12, 9, 2
    x = rng.standard_normal((T, H)).astype(np.float32)
    gate = (rng.standard_normal((E, inter, H)) / np.sqrt(H)).astype(np.float32)
    up = (rng.standard_normal((E, inter, H)) / np.sqrt(H)).astype(np.float32)
    down = (rng.standard_normal((E, H, inter)) / np.sqrt(inter)).astype(np.float32)
    ids = np.stack([rng.choice(E - 1, K, replace=False) for _ in range(T)]).astype(
        np.int32
    )  # expert 5 unused
    w = rng.uniform(0.1, 1.0, (T, K)).astype(np.float32)
    return x, ids, w, gate, up, down


@pytest.mark.parametrize("limit", [None, 0.5])
@pytest.mark.parametrize("before", [False, True])
def test_moe_experts_dense_matches_reference(expert_case, limit, before):
    x, ids, w, gate, up, down = expert_case
    experts = {k: {"weight": jnp.asarray(v)} for k, v in (("gate", gate), ("up", up), ("down", down))}
    got = moe_experts(
        jnp.asarray(x),
        Routing(jnp.asarray(ids), jnp.asarray(w)),
        experts,
        F32,
        swiglu_limit=limit,
        weight_before_down=before,
    )
    want = ref_experts(x, ids, w, gate, up, down, limit)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_moe_experts_fp8_matches_numpy_dequantised_reference(expert_case):
    # Block 8x8 on dims 12 and 20: partial edge blocks on both axes (the ceil-div grid).
    x, ids, w, gate, up, down = expert_case
    block = (8, 8)
    experts, deq = {}, {}
    for name, arr in (("gate", gate), ("up", up), ("down", down)):
        q = [np_fp8_quantize(a, block) for a in arr]
        experts[name] = {
            "weight": jnp.asarray(np.stack([c for c, _ in q])),
            "scale": jnp.asarray(np.stack([s for _, s in q])),
        }
        deq[name] = np.stack([np_fp8_dequantize(c, s, block) for c, s in q])
    got = moe_experts(
        jnp.asarray(x), Routing(jnp.asarray(ids), jnp.asarray(w)), experts, LinearNumerics(block=block)
    )
    want = ref_experts(x, ids, w, deq["gate"], deq["up"], deq["down"])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_moe_experts_is_the_registered_reference_and_jits(expert_case):
    x, ids, w, gate, up, down = expert_case
    sel = select("moe_experts", backend="reference")
    assert sel.fn is moe_experts
    experts = {k: {"weight": jnp.asarray(v)} for k, v in (("gate", gate), ("up", up), ("down", down))}
    f = jax.jit(lambda x, r, e: sel(x, r, e, F32))
    got = f(jnp.asarray(x), Routing(jnp.asarray(ids), jnp.asarray(w)), experts)
    want = ref_experts(x, ids, w, gate, up, down)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# --------------------------------------------------------------------------------------------- linears


def test_linear_formats_dense_fp8_mxfp4():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    w = (rng.standard_normal((40, 64)) / 8).astype(np.float32)
    np.testing.assert_allclose(
        np.asarray(linear(jnp.asarray(x), {"weight": jnp.asarray(w)}, F32)), x @ w.T, rtol=1e-5, atol=1e-5
    )
    codes, scale = np_fp8_quantize(w, (16, 48))
    got = linear(
        jnp.asarray(x),
        {"weight": jnp.asarray(codes), "scale": jnp.asarray(scale)},
        LinearNumerics(block=(16, 48)),
    )
    want = x @ np_fp8_dequantize(codes, scale, (16, 48)).T
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)

    # MXFP4, decoded by hand: E2M1 magnitudes, low nibble = even element, UE8M0 scale 2^(s - 127) per 32.
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    nib = rng.integers(0, 16, (40, 64)).astype(np.uint8)
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
    sbytes = rng.integers(120, 130, (40, 2)).astype(np.uint8)
    dense = e2m1[nib] * np.repeat(2.0 ** (sbytes.astype(np.float32) - 127), 32, axis=1)
    got = linear(jnp.asarray(x), {"packed": jnp.asarray(packed), "scale": jnp.asarray(sbytes)}, F32)
    np.testing.assert_allclose(np.asarray(got), x @ dense.T, rtol=1e-5, atol=1e-4)

    assert linear_format({"weight": 0}) == "dense"
    with pytest.raises(ValueError, match="match no format"):
        linear_format({"w": 0})
    with pytest.raises(ValueError, match=r"LinearNumerics\.block is None"):
        linear(jnp.asarray(x), {"weight": jnp.asarray(codes), "scale": jnp.asarray(scale)}, F32)


def test_grouped_linear_skips_out_of_range_ids():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 8)).astype(np.float32)
    w = rng.standard_normal((3, 4, 8)).astype(np.float32)
    ids = np.array([0, 2, 3, 1, -1], np.int32)
    got = np.asarray(grouped_linear(jnp.asarray(x), {"weight": jnp.asarray(w)}, jnp.asarray(ids), F32))
    for t, e in enumerate(ids):
        want = w[e] @ x[t] if 0 <= e < 3 else np.zeros(4)
        np.testing.assert_allclose(got[t], want, rtol=1e-5, atol=1e-6)


def test_swiglu_hand_values():
    g = jnp.array([0.0, 1.0, 5.0])
    u = jnp.array([2.0, -3.0, 4.0])
    silu = np.array([0.0, 1 / (1 + np.exp(-1.0)), 5 / (1 + np.exp(-5.0))])
    np.testing.assert_allclose(np.asarray(swiglu(g, u)), silu * [2, -3, 4], rtol=1e-6)
    # limit 2: gate clamped above (5 -> 2), up clamped both sides (-3 -> -2, 4 -> 2)
    lim = np.array([0.0, 1 / (1 + np.exp(-1.0)), 2 / (1 + np.exp(-2.0))]) * [2, -2, 2]
    np.testing.assert_allclose(np.asarray(swiglu(g, u, limit=2.0)), lim, rtol=1e-6)


def test_embedding_and_head():
    table = jnp.arange(12.0).reshape(4, 3)
    np.testing.assert_array_equal(
        np.asarray(embed_tokens(table, jnp.array([[3, 0]]))), [[[9, 10, 11], [0, 1, 2]]]
    )
    h = jnp.ones((2, 3), jnp.bfloat16)
    logits = lm_head(h, table.astype(jnp.bfloat16))
    assert logits.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(logits), [[3, 12, 21, 30]] * 2)
    with pytest.raises(TypeError, match="integers"):
        embed_tokens(table, jnp.array([0.5]))
