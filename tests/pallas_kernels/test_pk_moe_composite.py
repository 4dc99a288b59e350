"""Sorted-dispatch routed experts running on the Pallas kernels (interpret mode) against the models' reference
``moe_experts``: sorting, the fused first GEMM, routing weights, the second GEMM and the un-sort together."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.numerics import host
from deepinfer_jax.ops import default_registry
from deepinfer_jax.ops.moe_kernels import moe_grouped_experts
from deepinfer_jax.ops.registry import OpRegistry
from pallas_kernels import mxfp4_grouped_linear as grouped_kernels
from pallas_kernels._common import Tiles

SMALL = Tiles(block_t=16, block_n=32, block_k=32)


@pytest.fixture(scope="module")
def kernel_registry():
    """A private registry whose ``pallas_gpu`` grouped ops are the interpreted kernels, registered for the CPU."""
    reg = OpRegistry()
    calls: dict[str, int] = {}
    for op in ("mxfp4_grouped_linear", "mxfp4_grouped_swiglu", "swiglu"):
        reg.register_op(op, default_registry.select(op, backend="reference").fn, doc=op)
    for op in ("mxfp4_grouped_linear", "mxfp4_grouped_swiglu"):
        kernel = functools.partial(getattr(grouped_kernels, op), tiles=SMALL, interpret=True)

        def counted(*args, _kernel=kernel, _op=op, **kwargs):
            calls[_op] = calls.get(_op, 0) + 1
            return _kernel(*args, **kwargs)

        reg.register_impl(op, "pallas_gpu", counted, platforms=("cpu",))
    return reg, calls


@pytest.mark.parametrize("weight_before_down", [True, False])
def test_sorted_dispatch_on_kernels_matches_reference(kernel_registry, weight_before_down):
    from deepinfer_jax.models.common.linear import LinearNumerics
    from deepinfer_jax.models.common.moe import Routing, moe_experts

    reg, calls = kernel_registry
    rng = np.random.default_rng(50)
    e, h, i = 4, 64, 32
    experts = {}
    for name, shape in (("gate", (e, i, h)), ("up", (e, i, h)), ("down", (e, h, i))):
        packed, scale = host.quantize_mxfp4(rng.standard_normal(shape).astype(np.float32))
        experts[name] = {"packed": packed, "scale": scale}
    x = rng.standard_normal((7, h)).astype(np.float32)
    # expert 1 gets no row, expert 2 one row; id 9 is out of range and contributes nothing
    ids = jnp.array([[0, 3], [3, 0], [2, 0], [0, 3], [9, 3], [3, 0], [0, 3]], jnp.int32)
    routing = Routing(ids, jnp.asarray(rng.uniform(0.2, 1.0, (7, 2)), jnp.float32))
    numerics = LinearNumerics(activation_cast="none")
    kw = dict(swiglu_limit=6.0, weight_before_down=weight_before_down)
    before = dict(calls)
    got = moe_grouped_experts(
        x, routing, experts, numerics, backend="pallas_gpu", platform="cpu", registry=reg, **kw
    )
    assert calls["mxfp4_grouped_swiglu"] == before.get("mxfp4_grouped_swiglu", 0) + 1
    assert calls["mxfp4_grouped_linear"] == before.get("mxfp4_grouped_linear", 0) + 1
    want = moe_experts(x, routing, experts, numerics, **kw)
    # float32 throughout; only GEMM summation order differs (K = 64 and 32 terms)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
