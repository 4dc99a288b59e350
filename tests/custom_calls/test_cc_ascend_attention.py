"""The attention-side ops on the ``ascend`` backend: one named custom call each in a program exported for
``"ascend"`` (with the op's static arguments as attributes), and the reference lowering everywhere else."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import deepinfer_jax.cache.paged
import deepinfer_jax.models.deepseek_v4.attention
import deepinfer_jax.models.deepseek_v4.compressor
import deepinfer_jax.models.deepseek_v4.mhc  # noqa: F401  (registers mhc_sinkhorn)
from deepinfer_jax import ops

pytest.importorskip("custom_calls.ascend.named")
from custom_calls.ascend.lowerings import target_name

S = jax.ShapeDtypeStruct
I32, F32, U8, BF16 = jnp.int32, jnp.float32, jnp.uint8, jnp.bfloat16

#: op -> (static keyword arguments, argument shape structs, expected attributes in the exported module)
CASES = {
    "paged_mla_attention": (
        {"scale": 0.1},
        (
            S((4, 8, 64), BF16),
            S((4, 8, 16), BF16),
            S((2, 5, 4, 80), BF16),
            1,
            S((4,), I32),
            S((4,), I32),
            S((2, 3), I32),
            S((2,), I32),
        ),
        ("layer = 1", "scale = "),
    ),
    "v4_sparse_attention": (
        {"scale": 0.125, "window_format": "mxfp8", "compressed_format": "fp4"},
        (
            S((4, 8, 64), BF16),
            S((4, 8, 66), U8),
            S((4, 8), jnp.bool_),
            S((8,), F32),
            S((5, 4, 36), U8),
            S((4, 6), I32),
        ),
        ('window_format = "mxfp8"', 'compressed_format = "fp4"'),
    ),
    "v4_sink_attention": (
        {"scale": 0.1},
        (S((1, 4, 8, 64), F32), S((1, 6, 64), F32), S((1, 4, 6), jnp.bool_), S((8,), F32)),
        ("scale = ",),
    ),
    "v4_indexer_scores": ({}, (S((1, 4, 8, 64), F32), S((1, 6, 64), F32), S((1, 4, 8), F32)), ()),
    "v4_indexer_topk": (
        {"k": 5, "key_format": "mxfp4", "score_dtype": BF16},
        (S((4, 8, 64), BF16), S((4, 8), F32), S((6, 4, 34), U8), S((2, 3), I32), S((4,), I32), S((4,), I32)),
        ("k = 5", 'key_format = "mxfp4"', 'score_dtype = "bfloat16"', 'candidates = "none"'),
    ),
    "kv_store_records": (
        {"key_format": "fp4"},
        (S((6, 4, 36), U8), S((3, 64), F32), S((3,), I32)),
        ('key_format = "fp4"',),
    ),
    "v4_compress_store": (
        {"eps": 1e-6, "rope_dim": 16, "key_format": "mxfp8"},
        (
            S((6, 4, 66), U8),
            S((3, 2, 64), F32),
            S((3, 2, 64), F32),
            S((64,), F32),
            S((3, 8), F32),
            S((3, 8), F32),
            S((3,), I32),
        ),
        ("rope_dim = 16", 'entry_dtype = "bfloat16"'),
    ),
    "mhc_sinkhorn": ({"iters": 20, "eps": 1e-6}, (S((5, 4, 4), F32),), ("iters = 20",)),
}


@pytest.fixture(scope="module")
def selection():
    return ops.resolve_selection(None, backend="ascend", strict=True, platform="ascend")


def _fn(selection, op, statics, specs):
    impl = selection.select(op).fn
    arrays = [i for i, a in enumerate(specs) if isinstance(a, S)]

    def f(*xs):
        args = list(specs)
        for i, x in zip(arrays, xs, strict=True):
            args[i] = x
        return impl(*args, **statics)

    return f, [specs[i] for i in arrays]


@pytest.mark.parametrize("op", sorted(CASES))
def test_exports_one_named_custom_call_with_its_attributes(selection, op):
    assert selection.backends()[op] == "ascend"
    statics, specs, attrs = CASES[op]
    f, arrays = _fn(selection, op, statics, specs)
    target = target_name(op)
    exported = export.export(
        jax.jit(f), platforms=["ascend"], disabled_checks=[export.DisabledSafetyCheck.custom_call(target)]
    )(*arrays)
    text = exported.mlir_module()
    assert re.findall(r"stablehlo\.custom_call @([\w.$]+)\(", text) == [target]
    config = text[text.index(f"@{target}(") :].split("\n")[0]
    for attr in attrs:
        assert attr in config, (attr, config)


def test_elsewhere_the_named_call_runs_the_reference(selection):
    rng = np.random.default_rng(50)
    statics, specs, _ = CASES["v4_sparse_attention"]
    arrays = [
        jnp.asarray(rng.integers(0, 120, s.shape) if s.dtype == U8 else rng.standard_normal(s.shape), s.dtype)
        if s.dtype != I32
        else jnp.asarray(rng.integers(-1, 20, s.shape), I32)
        for s in specs
    ]
    arrays[2] = jnp.asarray(rng.random((4, 8)) < 0.5)
    got = jax.jit(lambda *a: selection.select("v4_sparse_attention").fn(*a, **statics))(*arrays)
    want = ops.select("v4_sparse_attention", backend="reference")(*arrays, **statics)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_unsupported_attributes_are_refused(selection):
    with pytest.raises(TypeError, match="attribute"):
        selection.select("mhc_sinkhorn").fn(jnp.zeros((1, 4, 4)), iters=[3], eps=1e-6)
