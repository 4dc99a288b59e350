"""Ascend lowering backend: the ops run their reference lowering on CPU, and export for ``"ascend"`` as named
custom calls with their attributes; a whole MoE layer exports with exactly the expected custom calls."""

from __future__ import annotations

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from deepinfer_jax import ops
from deepinfer_jax.numerics import host

lowerings = pytest.importorskip("custom_calls.ascend.lowerings")

CHECKS = [export.DisabledSafetyCheck.custom_call(t) for t in lowerings.CUSTOM_CALL_TARGETS]
CALL_RE = re.compile(r"stablehlo\.custom_call @([\w.$]+)\(")


def _export_ascend(fn, *args):
    specs = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.asarray(a).dtype) for a in args]
    exported = export.export(jax.jit(fn), platforms=["ascend"], disabled_checks=CHECKS)(*specs)
    return exported.mlir_module()


def _calls(text: str) -> Counter:
    return Counter(CALL_RE.findall(text))


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(40)
    fq, fs = host.quantize_fp8_blockwise(rng.standard_normal((48, 64)).astype(np.float32), (32, 32))
    gp, gs = host.quantize_mxfp4(rng.standard_normal((3, 32, 64)).astype(np.float32))
    up, us = host.quantize_mxfp4(rng.standard_normal((3, 32, 64)).astype(np.float32))
    x = rng.standard_normal((6, 64)).astype(np.float32)
    return x, (fq, fs), (gp, gs), (up, us)


def test_platform_is_known_to_jax():
    from jax._src import xla_bridge

    assert xla_bridge.is_known_platform("ascend")
    assert jax.default_backend() == "cpu"  # registering the lowering target changes nothing at run time


def test_ops_run_their_reference_lowering_on_cpu(weights):
    x, (fq, fs), (gp, gs), (up, us) = weights
    sizes = jnp.array([2, 0, 3], jnp.int32)
    pairs = [
        (
            lowerings.fp8_block_linear(x, fq, fs, activation_cast="mxfp8", out_dtype=jnp.float32),
            ops.call("fp8_block_linear", x, fq, fs, activation_cast="mxfp8", out_dtype=jnp.float32),
        ),
        (
            lowerings.mxfp4_grouped_linear(x, gp, gs, sizes, out_dtype=jnp.float32),
            ops.call("mxfp4_grouped_linear", x, gp, gs, sizes, out_dtype=jnp.float32),
        ),
        (
            lowerings.mxfp4_grouped_swiglu(x, gp, gs, up, us, sizes, limit=4.0, out_dtype=jnp.float32),
            ops.call("mxfp4_grouped_swiglu", x, gp, gs, up, us, sizes, limit=4.0, out_dtype=jnp.float32),
        ),
        (lowerings.swiglu(x, limit=1.5), ops.call("swiglu", x, limit=1.5)),
    ]
    for got, want in pairs:
        # the same reference computation lowered through the primitive: identical up to XLA fusion choices
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_each_op_exports_as_one_named_call_with_attributes(weights):
    x, (fq, fs), (gp, gs), (up, us) = weights
    sizes = np.array([2, 0, 3], np.int32)
    text = _export_ascend(
        lambda a, b, c: lowerings.fp8_block_linear(a, b, c, activation_cast="fp8_token_block"), x, fq, fs
    )
    assert _calls(text) == Counter({"deepinfer.ascend.fp8_block_linear": 1})
    for attr in (
        'activation_cast = "fp8_token_128"',
        "block_cols = 32",
        "block_rows = 32",
        'scale_format = "ue8m0"',
    ):
        assert attr in text
    text = _export_ascend(
        lambda *a: lowerings.mxfp4_grouped_swiglu(*a, limit=7.0, activation_cast="mxfp8"),
        x,
        gp,
        gs,
        up,
        us,
        sizes,
    )
    assert _calls(text) == Counter({"deepinfer.ascend.mxfp4_grouped_swiglu": 1})
    assert "has_limit = true" in text and "limit = 7.0" in text and 'activation_cast = "mxfp8"' in text
    text = _export_ascend(lambda a: lowerings.swiglu(a), x)
    assert _calls(text) == Counter({"deepinfer.ascend.swiglu": 1}) and "has_limit = false" in text


def test_multi_platform_export_keeps_the_cpu_reference(weights):
    x = weights[0]
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
    exported = export.export(
        jax.jit(lambda a: lowerings.swiglu(a, limit=2.0)), platforms=["ascend", "cpu"], disabled_checks=CHECKS
    )(*specs)
    assert exported.platforms == ("ascend", "cpu")
    np.testing.assert_allclose(
        np.asarray(exported.call(x)), np.asarray(ops.call("swiglu", x, limit=2.0)), rtol=1e-6
    )


def test_whole_moe_layer_exports_with_exactly_the_expected_calls():
    """Gate (bf16 router + top-k from models/common), routed MXFP4 experts (op moe_experts), FP8 shared expert."""
    from deepinfer_jax.models.common.linear import LinearNumerics
    from deepinfer_jax.models.common.moe import route
    from deepinfer_jax.ops.moe_kernels import register_moe_experts_backends

    register_moe_experts_backends()
    rng = np.random.default_rng(41)
    e, h, i, k = 8, 64, 32, 2
    experts = {}
    for name, shape in (("gate", (e, i, h)), ("up", (e, i, h)), ("down", (e, h, i))):
        packed, scale = host.quantize_mxfp4(rng.standard_normal(shape).astype(np.float32))
        experts[name] = {"packed": packed, "scale": scale}
    shared = {
        name: host.quantize_fp8_blockwise(rng.standard_normal(shape).astype(np.float32), (32, 32))
        for name, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i)))
    }
    router = jnp.asarray(rng.standard_normal((e, h)), jnp.bfloat16)
    bias = jnp.zeros((e,), jnp.float32)
    numerics = LinearNumerics(block=(32, 32), activation_cast="mxfp8")

    def select(name):
        return ops.select(name, backend="ascend", platform="ascend", strict=True)

    def moe_layer(x):
        logits = jnp.dot(x.astype(jnp.bfloat16), router.T, preferred_element_type=jnp.float32)
        routing = route(logits, scoring="sqrtsoftplus", top_k=k, bias=bias, routed_scaling_factor=1.5)
        routed = select("moe_experts")(
            x, routing, experts, numerics, swiglu_limit=7.0, weight_before_down=True
        )
        fp8 = select("fp8_block_linear")
        g = fp8(x, *shared["gate"], activation_cast="mxfp8", out_dtype=jnp.float32)
        u = fp8(x, *shared["up"], activation_cast="mxfp8", out_dtype=jnp.float32)
        a = select("swiglu")(jnp.concatenate([g, u], axis=-1), limit=7.0, out_dtype=x.dtype)
        return routed + fp8(a, *shared["down"], activation_cast="mxfp8", out_dtype=x.dtype)

    x = np.zeros((16, h), np.float32)
    calls = _calls(_export_ascend(moe_layer, jnp.asarray(x, jnp.bfloat16)))
    assert calls == Counter(
        {
            "deepinfer.ascend.mxfp4_grouped_swiglu": 1,
            "deepinfer.ascend.mxfp4_grouped_linear": 1,
            "deepinfer.ascend.fp8_block_linear": 3,
            "deepinfer.ascend.swiglu": 1,
        }
    )


def test_ascend_moe_experts_runs_on_cpu_like_the_reference():
    """The Ascend composite's non-Ascend lowering is the reference: same numbers as models/common on CPU."""
    from deepinfer_jax.models.common.linear import LinearNumerics
    from deepinfer_jax.models.common.moe import Routing, moe_experts
    from deepinfer_jax.ops.moe_kernels import register_moe_experts_backends

    register_moe_experts_backends()
    rng = np.random.default_rng(42)
    experts = {}
    for name, shape in (("gate", (3, 32, 64)), ("up", (3, 32, 64)), ("down", (3, 64, 32))):
        packed, scale = host.quantize_mxfp4(rng.standard_normal(shape).astype(np.float32))
        experts[name] = {"packed": packed, "scale": scale}
    x = rng.standard_normal((5, 64)).astype(np.float32)
    routing = Routing(jnp.array([[0, 2], [2, 1], [1, 0], [0, 2], [2, 0]], jnp.int32), jnp.full((5, 2), 0.5))
    numerics = LinearNumerics(activation_cast="mxfp8")
    ascend = ops.select("moe_experts", backend="ascend", platform="ascend", strict=True)
    got = ascend(x, routing, experts, numerics, swiglu_limit=7.0, weight_before_down=True)
    want = moe_experts(x, routing, experts, numerics, swiglu_limit=7.0, weight_before_down=True)
    # float32 with identical per-row MXFP8 casts; GEMM summation order only
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
