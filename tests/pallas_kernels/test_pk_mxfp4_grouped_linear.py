"""The Pallas ragged grouped MXFP4 GEMM (plain and fused with SwiGLU) in interpret mode against the reference
ops, its work list, and its CUDA export."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_jax.numerics import host
from deepinfer_jax.ops.grouped_gemm import mxfp4_grouped_linear as reference
from deepinfer_jax.ops.grouped_gemm import mxfp4_grouped_swiglu as reference_swiglu
from pallas_kernels._common import Tiles
from pallas_kernels.mxfp4_grouped_linear import (
    mxfp4_grouped_linear,
    mxfp4_grouped_swiglu,
    num_work_slots,
    work_list,
)

# 16-row tiles, 32 columns (N = 40: one partial column tile), 64-wide k steps (K = 96: one partial step).
# Grid: (cdiv(45, 16) + 5 - 1) slots x 2 column tiles = 14 programs per call.
SMALL = Tiles(block_t=16, block_n=32, block_k=64)
T, N, K, E = 45, 40, 96, 5

# Ragged groups: empty groups (first and middle), a group of one row, groups that are not tile multiples and
# straddle tile boundaries, and 7 padding rows past the sum.
SIZES = [0, 17, 1, 0, 20]


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(20)
    weights = [host.quantize_mxfp4(rng.standard_normal((E, N, K)).astype(np.float32)) for _ in range(2)]
    x = rng.standard_normal((T, K)).astype(np.float32)
    return x, weights


def test_work_list_covers_each_row_once():
    sizes = jnp.asarray(SIZES, jnp.int32)
    work = np.asarray(work_list(sizes, T, 16))
    assert work.shape == (num_work_slots(T, E, 16), 4) == (7, 4)
    owner = np.full(T, -1)
    for expert, tile, lo, hi in work:
        if expert < 0:
            continue
        assert tile * 16 <= lo < hi <= tile * 16 + 16
        assert (owner[lo:hi] == -1).all()
        owner[lo:hi] = expert
    np.testing.assert_array_equal(owner, np.repeat([-1, 1, 2, 4, -1], [0, 17, 1, 20, 7]))


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 30), min_size=E, max_size=E),
    block_t=st.sampled_from([16, 32]),
)
def test_work_list_property(sizes, block_t):
    """Every row below min(sum, T) is owned by exactly its group; rows past it by nobody (groups clip at T)."""
    work = np.asarray(work_list(jnp.asarray(sizes, jnp.int32), T, block_t))
    owner = np.full(T, -1)
    for expert, tile, lo, hi in work:
        if expert >= 0:
            assert tile * block_t <= lo < hi <= (tile + 1) * block_t
            assert (owner[lo:hi] == -1).all()
            owner[lo:hi] = expert
    want = np.repeat(np.arange(E), sizes)[:T]
    np.testing.assert_array_equal(owner, np.concatenate([want, np.full(T - len(want), -1)]))


@settings(max_examples=4, deadline=None)
@given(cuts=st.lists(st.integers(0, T), min_size=E - 1, max_size=E - 1), pad=st.integers(0, 9))
def test_random_ragged_groups_match_reference(case, cuts, pad):
    """Random group boundaries (empty groups, single rows, unaligned) and a random amount of padding."""
    x, ((p, s), _) = case
    bounds = np.sort(np.asarray([0, *cuts, T - pad]).clip(0, T - pad))
    sizes = jnp.asarray(np.diff(bounds), jnp.int32)
    want = reference(x, p, s, sizes, out_dtype=jnp.float32)
    got = mxfp4_grouped_linear(x, p, s, sizes, out_dtype=jnp.float32, tiles=SMALL, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("sizes", [SIZES, [45, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
def test_matches_reference(case, sizes):
    x, ((p, s), _) = case
    g = jnp.asarray(sizes, jnp.int32)
    want = reference(x, p, s, g, out_dtype=jnp.float32)
    got = mxfp4_grouped_linear(x, p, s, g, out_dtype=jnp.float32, tiles=SMALL, interpret=True)
    # summation order only (k steps of 64 vs one dot over 96 terms): well under 1e-4 at magnitudes ~30
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
    assert not np.asarray(got)[sum(sizes) :].any()  # padding rows are exactly 0


def test_matches_reference_bf16_mxfp8(case):
    x, ((p, s), _) = case
    g = jnp.asarray(SIZES, jnp.int32)
    xb = jnp.asarray(x, jnp.bfloat16)
    want = reference(xb, p, s, g, activation_cast="mxfp8")
    got = mxfp4_grouped_linear(
        xb, p, s.view(np.uint8), g, activation_cast="mxfp8", tiles=SMALL, interpret=True
    )
    # bf16 operands are exact (MXFP8 values, E2M1 x 2^k weights), float32 accumulation, one bf16 rounding of
    # the output each: at most one bf16 ulp apart when the summation order moves a value across a rounding point
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2**-7, atol=1e-2
    )


@pytest.mark.parametrize("limit", [None, 2.5])
def test_fused_swiglu_matches_reference(case, limit):
    x, ((gp, gs), (up, us)) = case
    g = jnp.asarray(SIZES, jnp.int32)
    want = reference_swiglu(x, gp, gs, up, us, g, limit=limit, out_dtype=jnp.float32)
    got = mxfp4_grouped_swiglu(
        x, gp, gs, up, us, g, limit=limit, out_dtype=jnp.float32, tiles=SMALL, interpret=True
    )
    # GEMM summation order plus float32 sigmoid/products on values up to ~40^2: 1e-5 relative
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-4)


def test_refuses_bad_input(case):
    x, ((p, s), (up, us)) = case
    g = jnp.asarray(SIZES, jnp.int32)
    with pytest.raises(ValueError, match=r"group_sizes must be an integer array of shape \(5,\)"):
        mxfp4_grouped_linear(x, p, s, g[:3], interpret=True)
    with pytest.raises(ValueError, match="must be a multiple of the MXFP4 group size"):
        mxfp4_grouped_linear(x[:, :40], p[:, :, :20], s[:, :, :1], g, interpret=True)
    with pytest.raises(ValueError, match="gate and up experts must have the same shape"):
        mxfp4_grouped_swiglu(x, p, s, up[:, :8], us[:, :8], g, interpret=True)
    with pytest.raises(ValueError, match="block_k = 16 must be a multiple of 32"):
        mxfp4_grouped_linear(x, p, s, g, tiles=Tiles(16, 16, 16), interpret=True)


def test_exports_for_cuda_with_a_triton_call(case, triton_calls):
    x, ((p, s), (up, us)) = case
    sizes = jax.ShapeDtypeStruct((E,), jnp.int32)
    xs = jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
    w = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (p, s, up, us)]
    assert (
        triton_calls(
            lambda a, b, c, d: mxfp4_grouped_linear(a, b, c, d, activation_cast="mxfp8"), xs, *w[:2], sizes
        )
        == 1
    )
    assert (
        triton_calls(
            lambda a, b, c, d, e, f: mxfp4_grouped_swiglu(a, b, c, d, e, f, limit=7.0), xs, *w, sizes
        )
        == 1
    )
