"""RMSNorm against hand-computed values and NumPy/ml_dtypes twins written here."""

from __future__ import annotations

import functools
import math

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_jax.ops import rms_norm

BF16 = ml_dtypes.bfloat16


def _np(x) -> np.ndarray:
    return np.asarray(jax.device_get(x))


# ------------------------------------------------------------------ hand-computed values


def test_four_element_case_by_hand():
    # x = [1, 2, 3, 4]: mean(x²) = (1 + 4 + 9 + 16) / 4 = 7.5, rms = sqrt(7.5) = 2.7386127875...
    # y = x / rms = [0.36514837, 0.73029674, 1.09544512, 1.46059349]; weight [1, -0.5, 2, 0.25]
    # gives [0.36514837, -0.36514837, 2.19089023, 0.36514837].
    x = jnp.array([1.0, 2.0, 3.0, 4.0], jnp.float32)
    w = jnp.array([1.0, -0.5, 2.0, 0.25], jnp.float32)
    expected = np.array([0.36514837, -0.36514837, 2.19089023, 0.36514837], np.float32)
    # XLA:CPU's rsqrt is not correctly rounded (a few ulp, ~2.4e-7 relative per ulp); 1e-6 covers it and the
    # multiply, and is still 100x tighter than any real mistake (a wrong mean or eps) would produce.
    np.testing.assert_allclose(_np(rms_norm(x, w, eps=0.0)), expected, rtol=1e-6)
    np.testing.assert_allclose(_np(rms_norm(x, eps=0.0)), expected * [1, -2, 0.5, 4], rtol=1e-6)


def test_eps_effect_by_hand():
    # x = [3, 4, 0, 0]: mean(x²) = 25 / 4 = 6.25.
    x = jnp.array([3.0, 4.0, 0.0, 0.0], jnp.float32)
    # eps = 0:    rsqrt(6.25) = 1 / 2.5       -> [1.2, 1.6, 0, 0]
    np.testing.assert_allclose(_np(rms_norm(x, eps=0.0)), [1.2, 1.6, 0.0, 0.0], rtol=1e-6)
    # eps = 2.75: rsqrt(6.25 + 2.75) = 1 / 3  -> [1, 4/3, 0, 0]
    np.testing.assert_allclose(_np(rms_norm(x, eps=2.75)), [1.0, 4.0 / 3.0, 0.0, 0.0], rtol=1e-6)
    # an all-zero row stays zero (no NaN) as long as eps > 0
    np.testing.assert_array_equal(_np(rms_norm(jnp.zeros(4), eps=1e-6)), np.zeros(4, np.float32))


# ------------------------------------------------------------------ rounding points, bit for bit


@pytest.fixture(scope="module")
def exact_rows():
    """Rows whose normaliser is exactly 1 on every platform, so the test isolates the rounding points.

    XLA's rsqrt is an approximation whose last bit differs between platforms and from NumPy, so a bit-exact
    comparison needs inputs where it is exact: entries k/1024 with |k| < 1024 (at most 10 significant bits: not
    representable in bf16, so rounding them matters), 8 per row (the sum of squares then needs < 24 bits, so
    every summation order gives the same float32), and eps = 1 - mean(x²) (exact too) so that
    mean(x²) + eps == 1 and rsqrt gives exactly 1. All rows are sign-flipped permutations of one base row, so
    they share the mean and one scalar eps serves the whole batch.
    """
    rng = np.random.default_rng(7)
    base = rng.integers(100, 1024, size=8)
    rows = np.stack([rng.permutation(base) * rng.choice([-1, 1], size=8) for _ in range(64)])
    x = (rows / 1024.0).astype(np.float32)
    mean_sq = np.float32(np.sum(base.astype(np.int64) ** 2) / 8 / 1024.0**2)
    eps = float(np.float32(1.0) - mean_sq)
    assert np.float32(mean_sq) + np.float32(eps) == np.float32(1.0)
    w = rng.uniform(-2.0, 2.0, size=8).astype(BF16)  # production weights are bf16
    return x, w, eps


def _twin_production(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """model.md §5.1 with a normaliser of exactly 1: bf16(bf16(x) * w)."""
    n_bf16 = x.astype(BF16).astype(np.float32)
    return (n_bf16 * w.astype(np.float32)).astype(BF16)


def _twin_single_rounding(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return (x * w.astype(np.float32)).astype(BF16)


def test_production_and_parity_rounding_points(exact_rows):
    x, w, eps = exact_rows
    prod = _np(rms_norm(jnp.asarray(x), jnp.asarray(w), eps=eps, out_dtype=jnp.bfloat16))
    parity = _np(rms_norm(jnp.asarray(x), jnp.asarray(w), eps=eps))
    single = _np(
        rms_norm(jnp.asarray(x), jnp.asarray(w), eps=eps, out_dtype=jnp.bfloat16, round_intermediate=False)
    )
    assert prod.dtype == BF16 and parity.dtype == np.float32 and single.dtype == BF16

    # each mode matches its twin bit for bit
    np.testing.assert_array_equal(prod.view(np.uint16), _twin_production(x, w).view(np.uint16))
    np.testing.assert_array_equal(parity, x * w.astype(np.float32))
    np.testing.assert_array_equal(single.view(np.uint16), _twin_single_rounding(x, w).view(np.uint16))

    # ...and the modes really differ: double rounding changes some entries relative to one rounding of the
    # exact product, and float32 keeps bits bf16 cannot hold.
    assert np.count_nonzero(prod.view(np.uint16) != single.view(np.uint16)) > 0
    assert np.count_nonzero(prod.astype(np.float32) != parity) > 0


def test_bf16_input_defaults_to_production_rounding(exact_rows):
    x, w, eps = exact_rows
    xb = x.astype(BF16)  # bf16 activations: out_dtype defaults to bf16, rounding points on
    got = _np(rms_norm(jnp.asarray(xb), jnp.asarray(w), eps=eps))
    np.testing.assert_array_equal(
        got.view(np.uint16), _twin_production(xb.astype(np.float32), w).view(np.uint16)
    )


def test_weight_none_skips_the_multiply(exact_rows):
    x, _, eps = exact_rows
    np.testing.assert_array_equal(_np(rms_norm(jnp.asarray(x), eps=eps)), x)
    got = _np(rms_norm(jnp.asarray(x), None, eps=eps, out_dtype=jnp.bfloat16))
    np.testing.assert_array_equal(got.view(np.uint16), x.astype(BF16).view(np.uint16))


# ------------------------------------------------------------------ general inputs, against a float64 twin


def _twin_f64(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    y = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w.astype(np.float64)


@settings(max_examples=30, deadline=None)
@given(
    x=hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=16),
        elements=st.floats(-100, 100, width=32),
    ),
    eps=st.sampled_from([1e-20, 1e-6, 0.5]),
    with_weight=st.booleans(),
)
def test_matches_float64_twin(x, eps, with_weight):
    rng = np.random.default_rng(x.size)
    w = rng.uniform(-3, 3, size=x.shape[-1]).astype(np.float32) if with_weight else None
    got = _np(rms_norm(jnp.asarray(x), None if w is None else jnp.asarray(w), eps=eps))
    want = _twin_f64(x, w, eps)
    # float32 error budget: the sum of up to 16 squares (~16 ulp worst case), the approximate rsqrt (a few ulp)
    # and two multiplies: well under 4e-6 relative to the row scale. atol covers rows that are all zero.
    scale = np.abs(want).max(axis=-1, keepdims=True) if with_weight else 1.0
    np.testing.assert_allclose(got, want, rtol=4e-6, atol=float(np.max(4e-6 * scale)) + 1e-30)


def test_leading_shapes_reduce_over_the_last_axis():
    x = jax.random.normal(jax.random.key(0), (2, 3, 8), jnp.float32)
    w = jnp.linspace(-1, 1, 8)
    flat = rms_norm(x.reshape(6, 8), w, eps=1e-6)
    np.testing.assert_array_equal(_np(rms_norm(x, w, eps=1e-6)), _np(flat).reshape(2, 3, 8))


def test_jit():
    x = jax.random.normal(jax.random.key(1), (4, 16), jnp.float32)
    w = jnp.ones(16, jnp.bfloat16) * 1.5
    f = jax.jit(functools.partial(rms_norm, eps=1e-6, out_dtype=jnp.bfloat16))
    got = f(x, w)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        _np(got).view(np.uint16), _np(rms_norm(x, w, eps=1e-6, out_dtype=jnp.bfloat16)).view(np.uint16)
    )


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("kwargs", "exc", "pattern"),
    [
        ({"weight": jnp.ones(3)}, ValueError, r"weight must have shape \(4,\) .* got \(3,\)"),
        ({"eps": -1.0}, ValueError, "eps must be finite and >= 0, got -1.0"),
        ({"eps": math.nan}, ValueError, "eps must be finite"),
        ({"eps": "1e-6"}, TypeError, "eps must be a real number, got str"),
        ({"out_dtype": jnp.int32}, TypeError, "out_dtype must be a floating dtype, got int32"),
        ({"round_intermediate": 1}, TypeError, "round_intermediate must be a bool or None"),
        ({"weight": jnp.ones(4, jnp.int32)}, TypeError, "weight must be a floating array"),
    ],
)
def test_bad_input(kwargs, exc, pattern):
    args = {"weight": None, "eps": 1e-6, **kwargs}
    with pytest.raises(exc, match=pattern):
        rms_norm(jnp.ones((2, 4)), args.pop("weight"), **args)


def test_bad_x():
    with pytest.raises(TypeError, match="x must be a floating array, got dtype int32"):
        rms_norm(jnp.ones(4, jnp.int32), eps=1e-6)
    with pytest.raises(ValueError, match=r"at least one axis .* got shape \(\)"):
        rms_norm(jnp.float32(1.0), eps=1e-6)
