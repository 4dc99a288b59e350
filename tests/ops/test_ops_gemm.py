"""Weight-side ops (fp8_block_linear, mxfp4_grouped_linear, mxfp4_grouped_swiglu, swiglu, moe_grouped_experts)
against independent numpy references built on the host codecs (numpy + ml_dtypes, no JAX)."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_jax import ops
from deepinfer_jax.numerics import host
from deepinfer_jax.numerics.formats import MXFP8
from deepinfer_jax.ops.grouped_gemm import mxfp4_grouped_linear, mxfp4_grouped_swiglu
from deepinfer_jax.ops.moe_kernels import moe_grouped_experts, register_moe_experts_backends, sort_by_expert
from deepinfer_jax.ops.registry import OpRegistry
from deepinfer_jax.ops.swiglu import swiglu

# float32 GEMMs of K <= 160 terms of magnitude ~1: the reference and numpy differ only in summation order, a few
# ulp of the largest partial sum (~40 here), so 1e-5 relative plus 1e-4 absolute has ample margin while any
# wrong scale, nibble order or row assignment is off by O(1).
RTOL, ATOL = 1e-5, 1e-4


def _np_swiglu(g: np.ndarray, u: np.ndarray, limit: float | None) -> np.ndarray:
    g = g.astype(np.float64)
    u = u.astype(np.float64)
    if limit is not None:
        g = np.minimum(g, limit)
        u = np.clip(u, -limit, limit)
    return g / (1.0 + np.exp(-g)) * u


def _np_mxfp8(x: np.ndarray) -> np.ndarray:
    codes, scales = host.quantize_groups(x, MXFP8)
    return host.dequantize_groups(codes, scales, MXFP8)


def _np_grouped(x: np.ndarray, w: np.ndarray, sizes: list[int]) -> np.ndarray:
    out = np.zeros((x.shape[0], w.shape[1]), np.float64)
    start = 0
    for e, n in enumerate(sizes):
        out[start : start + n] = x[start : start + n].astype(np.float64) @ w[e].T.astype(np.float64)
        start += n
    return out


@pytest.fixture(scope="module")
def fp8_weights():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((72, 100)).astype(np.float32)  # N, K not multiples of the 32x32 block
    q, s = host.quantize_fp8_blockwise(w, (32, 32))
    return (
        q,
        s,
        host.dequantize_fp8_blockwise(q, s, (32, 32)),
        rng.standard_normal((11, 100)).astype(np.float32),
    )


@pytest.fixture(scope="module")
def mxfp4_experts():
    rng = np.random.default_rng(2)
    e, n, k = 4, 24, 64
    packed, scale, dense = [], [], []
    for _ in range(2):  # two expert weight sets (gate, up) of the same shape
        w = rng.standard_normal((e, n, k)).astype(np.float32)
        p, s = host.quantize_mxfp4(w)
        packed.append(p)
        scale.append(s)
        dense.append(host.dequantize_mxfp4(p, s))
    x = rng.standard_normal((20, k)).astype(np.float32)
    return packed, scale, dense, x


def test_fp8_block_linear_matches_numpy(fp8_weights):
    q, s, w, x = fp8_weights
    y = ops.call("fp8_block_linear", x, q, s, out_dtype=jnp.float32, backend="reference")
    np.testing.assert_allclose(np.asarray(y), x @ w.T, rtol=RTOL, atol=ATOL)
    # bytes instead of float8 storage are the same weight
    y8 = ops.call("fp8_block_linear", x, q.view(np.uint8), s.view(np.uint8), out_dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(y8), np.asarray(y))


def test_fp8_block_linear_mxfp8_cast_and_bf16_out(fp8_weights):
    q, s, w, x = fp8_weights
    y = ops.call("fp8_block_linear", x, q, s, activation_cast="mxfp8")
    assert y.dtype == jnp.bfloat16 and y.shape == (11, 72)
    want = _np_mxfp8(x) @ w.T
    # one bf16 rounding of the output: relative 2^-8
    np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=2**-8, atol=1e-3)


def test_fp8_block_linear_v3_float32_scales():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((130, 256)).astype(np.float32)
    q, s = host.quantize_fp8_blockwise(w, (128, 128), scale_fmt="float32")
    wd = host.dequantize_fp8_blockwise(q, s, (128, 128))
    x = rng.standard_normal((3, 256)).astype(np.float32)
    for cast in ("fp8_token_128", "fp8_token_block"):
        y = ops.call(
            "fp8_block_linear", x, q, s, block=(128, 128), activation_cast=cast, out_dtype=jnp.float32
        )
        codes, scales = host.quantize_groups(x, host.QuantScheme("e4m3", "float32", 128))
        xq = host.dequantize_groups(codes, scales, host.QuantScheme("e4m3", "float32", 128))
        np.testing.assert_allclose(np.asarray(y), xq @ wd.T, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"activation_cast": "fp4"}, ValueError, "activation_cast = 'fp4'"),
        ({"activation_cast": 3}, TypeError, "activation_cast must be a str"),
        ({"out_dtype": jnp.int32}, TypeError, "out_dtype must be a floating dtype"),
        ({"block": (32,)}, ValueError, "block must be a pair"),
    ],
)
def test_fp8_block_linear_refuses_bad_arguments(fp8_weights, kwargs, error, match):
    q, s, _, x = fp8_weights
    with pytest.raises(error, match=match):
        ops.call("fp8_block_linear", x, q, s, **kwargs)


def test_fp8_block_linear_refuses_bad_shapes(fp8_weights):
    q, s, _, x = fp8_weights
    with pytest.raises(ValueError, match=r"x must have shape \[tokens, in\]"):
        ops.call("fp8_block_linear", x[None], q, s)
    with pytest.raises(ValueError, match="scale must have shape"):
        ops.call("fp8_block_linear", x, q, s[:, :2])


@settings(max_examples=15, deadline=None)
@given(
    u=st.lists(st.floats(-30, 30, width=32), min_size=8, max_size=8),
    limit=st.one_of(st.none(), st.floats(0.5, 10.0)),
)
def test_swiglu_matches_numpy(u, limit):
    arr = np.asarray(u, np.float32).reshape(2, 4)
    y = swiglu(arr, limit=limit)
    # float32 sigmoid and products: a few ulp
    np.testing.assert_allclose(np.asarray(y), _np_swiglu(arr[:, :2], arr[:, 2:], limit), rtol=1e-5, atol=1e-6)


def test_swiglu_clamps_and_refuses():
    u = np.array([[100.0, -100.0, 100.0, -100.0]], np.float32)  # gate 100, -100; up 100, -100
    y = np.asarray(swiglu(u, limit=10.0))
    np.testing.assert_allclose(y, [[10.0 / (1 + np.exp(-10.0)) * 10.0, 0.0]], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="even last dimension"):
        swiglu(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"limit must be finite and > 0"):
        swiglu(u, limit=-1.0)
    with pytest.raises(TypeError, match="limit must be a real number"):
        swiglu(u, limit="7")


@pytest.mark.parametrize("sizes", [[5, 0, 1, 9], [0, 0, 0, 0], [20, 0, 0, 0], [3, 3, 3, 3]])
def test_mxfp4_grouped_linear_matches_numpy(mxfp4_experts, sizes):
    packed, scale, dense, x = mxfp4_experts
    y = mxfp4_grouped_linear(x, packed[0], scale[0], jnp.asarray(sizes, jnp.int32), out_dtype=jnp.float32)
    want = _np_grouped(x, dense[0], sizes)  # rows past sum(sizes) stay 0
    np.testing.assert_allclose(np.asarray(y), want, rtol=RTOL, atol=ATOL)


def test_mxfp4_grouped_swiglu_matches_numpy(mxfp4_experts):
    packed, scale, dense, x = mxfp4_experts
    sizes = [7, 1, 0, 10]
    y = mxfp4_grouped_swiglu(
        x, packed[0], scale[0], packed[1], scale[1], jnp.asarray(sizes), limit=3.0, out_dtype=jnp.float32
    )
    g, u = _np_grouped(x, dense[0], sizes), _np_grouped(x, dense[1], sizes)
    np.testing.assert_allclose(np.asarray(y), _np_swiglu(g, u, 3.0), rtol=RTOL, atol=ATOL)
    # padding rows (18, 19) are exactly zero
    assert not np.asarray(y)[18:].any()


def test_grouped_ops_refuse_bad_input(mxfp4_experts):
    packed, scale, _, x = mxfp4_experts
    with pytest.raises(ValueError, match=r"group_sizes must have shape \(4,\)"):
        mxfp4_grouped_linear(x, packed[0], scale[0], jnp.zeros((3,), jnp.int32))
    with pytest.raises(TypeError, match="group_sizes must be an integer array"):
        mxfp4_grouped_linear(x, packed[0], scale[0], jnp.zeros((4,), jnp.float32))
    with pytest.raises(ValueError, match="activation_cast = 'fp8_token_128'"):
        mxfp4_grouped_linear(
            x, packed[0], scale[0], jnp.zeros((4,), jnp.int32), activation_cast="fp8_token_128"
        )
    with pytest.raises(ValueError, match="holds K = 64 inputs, x has 32"):
        mxfp4_grouped_linear(x[:, :32], packed[0], scale[0], jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="gate and up experts must have the same shape"):
        mxfp4_grouped_swiglu(x, packed[0], scale[0], packed[1][:2], scale[1][:2], jnp.zeros((4,), jnp.int32))


def test_sort_by_expert_counts_and_inverts():
    ids = jnp.array([[2, 0], [5, 2], [-1, 1]], jnp.int32)  # 5 and -1 are out of range for E = 3
    order, inverse, sizes = sort_by_expert(ids, 3)
    np.testing.assert_array_equal(np.asarray(sizes), [1, 1, 2])
    np.testing.assert_array_equal(np.asarray(order), [1, 5, 0, 3, 2, 4])
    np.testing.assert_array_equal(np.asarray(order)[np.asarray(inverse)], np.arange(6))


@pytest.fixture(scope="module")
def moe_case(mxfp4_experts):
    from deepinfer_jax.models.common.linear import LinearNumerics
    from deepinfer_jax.models.common.moe import Routing

    rng = np.random.default_rng(4)
    e, i, h = 4, 32, 64
    # gate/up [E, I, H] and down [E, H, I] with I = 32 (one MXFP4 group)
    dp, ds = host.quantize_mxfp4(rng.standard_normal((e, h, i)).astype(np.float32))
    gate_w = rng.standard_normal((e, 32, h)).astype(np.float32)
    up_w = rng.standard_normal((e, 32, h)).astype(np.float32)
    gp, gs = host.quantize_mxfp4(gate_w)
    up, us = host.quantize_mxfp4(up_w)
    experts = {
        "gate": {"packed": gp, "scale": gs},
        "up": {"packed": up, "scale": us},
        "down": {"packed": dp, "scale": ds},
    }
    x = rng.standard_normal((6, h)).astype(np.float32)
    ids = jnp.array([[0, 3], [3, 3], [1, 0], [0, 2], [4, 1], [2, 0]], jnp.int32)  # id 4: out of range
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (6, 2)), jnp.float32)
    return x, Routing(ids, weights), experts, LinearNumerics(block=None, activation_cast="none")


@pytest.mark.parametrize("weight_before_down", [False, True])
def test_moe_grouped_experts_matches_models_reference(moe_case, weight_before_down):
    from deepinfer_jax.models.common.moe import moe_experts

    x, routing, experts, numerics = moe_case
    kw = dict(swiglu_limit=5.0, weight_before_down=weight_before_down)
    want = moe_experts(x, routing, experts, numerics, **kw)
    got = moe_grouped_experts(x, routing, experts, numerics, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=RTOL, atol=ATOL)


def test_moe_grouped_experts_fp8_and_dense_experts(moe_case):
    from deepinfer_jax.models.common.linear import LinearNumerics
    from deepinfer_jax.models.common.moe import moe_experts

    x, routing, _, _ = moe_case
    rng = np.random.default_rng(5)
    dense = {
        "gate": {"weight": rng.standard_normal((4, 32, 64)).astype(np.float32)},
        "up": {"weight": rng.standard_normal((4, 32, 64)).astype(np.float32)},
        "down": {"weight": rng.standard_normal((4, 64, 32)).astype(np.float32)},
    }
    fp8 = {
        k: dict(zip(("weight", "scale"), host.quantize_fp8_blockwise(v["weight"], (32, 32))))
        for k, v in dense.items()
    }
    for experts, numerics in ((dense, LinearNumerics()), (fp8, LinearNumerics(block=(32, 32)))):
        want = moe_experts(x, routing, experts, numerics)
        got = moe_grouped_experts(x, routing, experts, numerics)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=RTOL, atol=ATOL)


def test_moe_experts_gets_kernel_backends():
    import deepinfer_jax.models.common  # noqa: F401  (defines the moe_experts op)

    register_moe_experts_backends()
    assert register_moe_experts_backends() == []  # idempotent
    backends = ops.default_registry.backends_for("moe_experts")
    assert {"pallas_gpu", "ascend"} <= set(backends)
    assert ops.select("moe_experts", platform="gpu").backend == "pallas_gpu"
    assert register_moe_experts_backends(OpRegistry()) == []  # no moe_experts op there


@pytest.mark.parametrize("op", ["fp8_block_linear", "mxfp4_grouped_linear", "mxfp4_grouped_swiglu", "swiglu"])
def test_pallas_gpu_on_cpu_falls_back_with_a_log_line(op, caplog):
    sel = ops.select(op, backend="pallas_gpu", platform="cpu")
    assert sel.fell_back and sel.backend == "reference"
    assert "registered for gpu, not cpu" in sel.reason
    # the log line: a fresh registry holding the same registration logs it (the default one logs once per run)
    reg = OpRegistry()
    reg.register_op(op, ops.default_registry.select(op, backend="reference").fn, doc="copy")
    reg.register_impl(op, "pallas_gpu", f"pallas_kernels.x:{op}", platforms=("gpu",))
    with caplog.at_level(logging.WARNING):
        reg.select(op, backend="pallas_gpu", platform="cpu")
    assert any(
        "cannot run on cpu" in r.getMessage() and "using the reference" in r.getMessage()
        for r in caplog.records
    )


def test_auto_picks_kernels_only_where_registered():
    assert ops.select("swiglu", platform="cpu").backend == "reference"
    assert ops.select("swiglu", platform="gpu").backend == "pallas_gpu"
    assert ops.select("swiglu", platform="ascend").backend == "ascend"
    assert jax.default_backend() == "cpu"
