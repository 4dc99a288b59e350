"""The Pallas clamped SwiGLU in interpret mode against the reference op, and its CUDA export."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.ops.swiglu import swiglu as reference
from pallas_kernels._common import Tiles
from pallas_kernels.swiglu import swiglu

SMALL = Tiles(block_t=16, block_n=16, block_k=16)  # T = 21, I = 40: 2 x 3 programs with edge tiles both ways


@pytest.fixture(scope="module")
def u():
    return (np.random.default_rng(30).standard_normal((21, 80)) * 8).astype(np.float32)


@pytest.mark.parametrize("limit", [None, 7.0])
def test_matches_reference(u, limit):
    want = reference(u, limit=limit)
    got = swiglu(u, limit=limit, tiles=SMALL, interpret=True)
    # the same float32 formula; the sigmoid may differ by an ulp between the fused and unfused forms
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_bf16_in_and_out_and_leading_axes(u):
    ub = jnp.asarray(u, jnp.bfloat16).reshape(3, 7, 80)
    got = swiglu(ub, limit=7.0, tiles=SMALL, interpret=True)
    assert got.shape == (3, 7, 40) and got.dtype == jnp.bfloat16
    want = reference(ub, limit=7.0)
    # float32 math rounded once to bf16 by both
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2**-8, atol=1e-6
    )


def test_refuses_bad_input(u):
    with pytest.raises(ValueError, match=r"u must be a float \[\.\.\., 2I\] array"):
        swiglu(u[:, :79], interpret=True)
    with pytest.raises(ValueError, match="limit must be a real number > 0"):
        swiglu(u, limit=0.0, interpret=True)


def test_exports_for_cuda_with_a_triton_call(u, triton_calls):
    spec = jax.ShapeDtypeStruct(u.shape, jnp.bfloat16)
    assert triton_calls(lambda a: swiglu(a, limit=10.0), spec) == 1
