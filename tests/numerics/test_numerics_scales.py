"""Scale rules: the power-of-two rule on the f32 quotient, E4M3 per-16 scales, float32 scale_inv, margins, NaN."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from _numerics_ref import E4M3_ALL_VALUES, bits, ceil_log2
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_jax.numerics import elements, scales
from deepinfer_jax.numerics.formats import (
    E2M1_UE8M0_AMAX_MARGIN,
    E4M3_AMAX_MARGIN,
    FP4_E4M3_AMAX_MARGIN,
)

jit_pow2 = jax.jit(scales.pow2_scales, static_argnums=(1, 2))
jit_fp4 = jax.jit(scales.e4m3_fp4_scales, static_argnums=(1,))


def _ref_pow2_byte(amax: float, qmax: float, margin: float) -> int:
    ratio = np.float32(max(amax, margin)) / np.float32(qmax)  # the f32 quotient the spec rounds up
    return ceil_log2(float(ratio)) + 127


def test_ceil_log2_on_exact_powers_and_their_neighbours():
    e = np.arange(-126, 127)
    p = (2.0 ** e.astype(np.float64)).astype(np.float32)
    above = np.nextafter(p, np.float32(np.inf))
    below = np.nextafter(p, np.float32(0))
    got = np.asarray(scales.ceil_log2_exponent(np.concatenate([p, above, below[1:]])))
    np.testing.assert_array_equal(got, np.concatenate([e, e + 1, e[1:]]))


@pytest.mark.parametrize(
    ("qmax", "margin"), [(448.0, E4M3_AMAX_MARGIN), (6.0, E2M1_UE8M0_AMAX_MARGIN)], ids=["e4m3", "e2m1"]
)
def test_pow2_rule_on_boundaries(qmax, margin):
    # amax exactly Qmax * 2^k gives scale 2^k; the next float32 up needs 2^(k+1).
    k = np.arange(-20, 20)
    exact = (qmax * 2.0 ** k.astype(np.float64)).astype(np.float32)
    amax = np.concatenate([exact, np.nextafter(exact, np.float32(np.inf))])
    for fn in (scales.pow2_scales, jit_pow2):
        got = fn(amax, qmax, margin)
        want = [_ref_pow2_byte(float(a), qmax, margin) for a in amax]
        np.testing.assert_array_equal(np.asarray(got.stored), want)
        np.testing.assert_array_equal(np.asarray(got.stored)[: len(k)], k + 127)
        np.testing.assert_array_equal(np.asarray(got.stored)[len(k) :], k + 128)
        np.testing.assert_array_equal(bits(np.asarray(got.divisor)), bits(2.0 ** (np.asarray(want) - 127.0)))


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_pow2_rule_matches_frexp_reference_on_random_amax(seed):
    rng = np.random.default_rng(seed)
    amax = (rng.random(64) * 2.0 ** rng.integers(-140, 120, size=64)).astype(np.float32)
    for qmax, margin in ((448.0, E4M3_AMAX_MARGIN), (6.0, E2M1_UE8M0_AMAX_MARGIN)):
        got = np.asarray(jit_pow2(amax, qmax, margin).stored)
        # Reference clamps with the subnormal flush first (amax below 2^-126 counts as zero).
        flushed = np.where(amax < 2.0**-126, 0.0, amax)
        np.testing.assert_array_equal(got, [_ref_pow2_byte(float(a), qmax, margin) for a in flushed])


def test_margins_make_all_zero_groups_finite():
    zero = np.zeros(1, np.float32)
    # E4M3: ceil(log2(1e-4 / 448)) = ceil(-22.09...) = -22 -> byte 105 (computed independently here).
    assert math.ceil(math.log2(1e-4 / 448)) == -22
    assert int(np.asarray(scales.pow2_scales(zero, 448.0, E4M3_AMAX_MARGIN).stored)[0]) == 105
    # E2M1 with UE8M0: 6 * 2^-126 / 6 = 2^-126 exactly -> byte 1 (the smallest normal power of two).
    assert int(np.asarray(scales.pow2_scales(zero, 6.0, E2M1_UE8M0_AMAX_MARGIN).stored)[0]) == 1
    # FP4 with E4M3 scales: 6 * 2^-9 / 6 = 2^-9 -> the smallest E4M3 subnormal, code 0x01.
    fp4 = scales.e4m3_fp4_scales(zero, FP4_E4M3_AMAX_MARGIN)
    assert int(np.asarray(fp4.stored)[0]) == 0x01 and float(np.asarray(fp4.divisor)[0]) == 2.0**-9
    v3 = scales.float32_scales(zero, E4M3_AMAX_MARGIN)
    assert np.asarray(v3.stored)[0] == np.float32(1e-4) / np.float32(448)


def test_e4m3_fp4_scale_rounds_to_nearest_even_and_caps_at_448():
    # amax / 6 exactly on the midpoint between E4M3 1.0 (0x38) and 1.125 (0x39): ties to the even code 0x38.
    amax = np.array([6 * 1.0625, 6 * 1.0625 * (1 + 2**-20), 6 * 448 * 10.0, 6 * 448.0, 6 * 0.3], np.float32)
    for fn in (scales.e4m3_fp4_scales, jit_fp4):
        got = fn(amax, FP4_E4M3_AMAX_MARGIN)
        stored = np.asarray(got.stored)
        np.testing.assert_array_equal(stored[:4], [0x38, 0x39, 0x7E, 0x7E])
        # 0.3 lies between E4M3 0.28125 and 0.3125; the nearer one is 0.3125.
        assert E4M3_ALL_VALUES[stored[4]] == np.float32(0.3125)
        np.testing.assert_array_equal(bits(np.asarray(got.divisor)), bits(E4M3_ALL_VALUES[stored]))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_amax_poisons_the_group(bad):
    amax = np.array([bad, 1.0], np.float32)
    p = scales.pow2_scales(amax, 448.0, E4M3_AMAX_MARGIN)
    np.testing.assert_array_equal(np.asarray(p.stored), [0xFF, 119])  # 1/448 -> scale 2^-8 -> byte 119
    np.testing.assert_array_equal(np.asarray(p.poisoned), [True, False])
    assert np.all(np.isfinite(np.asarray(p.divisor))), "the divisor stays finite so codes never become NaN"
    f = scales.e4m3_fp4_scales(amax, FP4_E4M3_AMAX_MARGIN)
    assert int(np.asarray(f.stored)[0]) == 0x7F and np.isfinite(np.asarray(f.divisor)[0])
    v = scales.float32_scales(amax, E4M3_AMAX_MARGIN)
    assert np.isnan(np.asarray(v.stored)[0]) and np.isfinite(np.asarray(v.divisor)[0])


def test_group_amax_detects_nan_and_inf_that_a_max_reduction_may_drop():
    # This shape and position made XLA:CPU's vectorised max reduction return 1.0 for the NaN group.
    x = np.ones((12, 16, 32), np.float32)
    x[0, 0, 5] = np.nan
    x[0, 3, 0] = -np.inf
    for fn in (scales.group_amax, jax.jit(scales.group_amax)):
        got = np.asarray(fn(x)).reshape(-1)
        assert np.isnan(got[0]) and np.isnan(got[3])
        assert np.all(got[[1, 2, 4, 5, 100]] == 1.0)


@pytest.mark.parametrize(
    ("qmax", "margin", "lowest"),
    [(448.0, E4M3_AMAX_MARGIN, 105), (6.0, E2M1_UE8M0_AMAX_MARGIN, 1)],
    ids=["e4m3", "e2m1"],
)
def test_every_reachable_ue8m0_byte_round_trips(qmax, margin, lowest):
    """amax = Qmax * 2^(b-127) encodes byte b and decodes to exactly that power, for every byte the rule can
    produce: from the margin's byte up to the largest whose amax is still a finite float32."""
    with np.errstate(over="ignore"):
        amax = (qmax * 2.0 ** (np.arange(256) - 127.0)).astype(np.float32)
    reachable = np.flatnonzero(np.isfinite(amax) & (amax >= margin))
    assert reachable[0] == lowest
    got = jit_pow2(amax[reachable], qmax, margin)
    np.testing.assert_array_equal(np.asarray(got.stored), reachable)
    decoded = np.asarray(jax.jit(elements.ue8m0_decode)(np.asarray(got.stored)))
    np.testing.assert_array_equal(bits(decoded), bits(np.asarray(got.divisor)))
    np.testing.assert_array_equal(bits(decoded), bits(2.0 ** (reachable - 127.0)))
