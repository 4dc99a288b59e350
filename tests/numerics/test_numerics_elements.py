"""Element codes: every E4M3 / E2M1 / UE8M0 code, RNE at every tie, saturation, subnormals, NaN/inf."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _numerics_ref import E4M3_ALL_VALUES, bits, e2m1_codes, e4m3_codes
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_jax.numerics import elements, host

ALL_BYTES = np.arange(256, dtype=np.uint8)
FINITE_E4M3 = ALL_BYTES[np.isfinite(E4M3_ALL_VALUES)]
E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]

jit_e4m3_encode = jax.jit(elements.e4m3_encode)
jit_e2m1_encode = jax.jit(elements.e2m1_encode)


def _both_e4m3(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.asarray(elements.e4m3_encode(x)), np.asarray(jit_e4m3_encode(x)), host.e4m3_encode(x)


# ---------------------------------------------------------------------------------------------------- E4M3


def test_e4m3_decodes_all_256_codes_like_ml_dtypes():
    ref = ALL_BYTES.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    for got in (np.asarray(elements.e4m3_decode(ALL_BYTES)), host.e4m3_decode(ALL_BYTES)):
        finite = np.isfinite(ref)
        np.testing.assert_array_equal(bits(got)[finite], bits(ref)[finite])
        assert np.all(np.isnan(got[~finite]))
    assert set(ALL_BYTES[~np.isfinite(ref)]) == {0x7F, 0xFF}


def test_e4m3_round_trips_every_finite_code_including_subnormals_and_negative_zero():
    values = E4M3_ALL_VALUES[FINITE_E4M3]
    for got in _both_e4m3(values):
        np.testing.assert_array_equal(got, FINITE_E4M3)
    # Subnormal E4M3 codes 0x01..0x07 are k * 2^-9: normal float32 values, so no flush is involved.
    np.testing.assert_array_equal(E4M3_ALL_VALUES[1:8], np.arange(1, 8) * 2.0**-9)


def test_e4m3_rounds_to_nearest_even_at_every_tie():
    pos = np.sort(E4M3_ALL_VALUES[FINITE_E4M3][E4M3_ALL_VALUES[FINITE_E4M3] >= 0])
    pos = np.unique(pos)
    lo, hi = pos[:-1], pos[1:]
    mid = ((lo.astype(np.float64) + hi) / 2).astype(np.float32)
    assert np.all(mid.astype(np.float64) == (lo.astype(np.float64) + hi) / 2), "midpoints are exact in f32"
    lo_code = np.array([np.flatnonzero(v == E4M3_ALL_VALUES)[0] for v in lo], np.uint8)
    hi_code = np.array([np.flatnonzero(v == E4M3_ALL_VALUES)[0] for v in hi], np.uint8)
    # Of two neighbouring codes exactly one has an even mantissa (lowest bit 0): the tie goes there.
    want = np.where(lo_code % 2 == 0, lo_code, hi_code)
    for got in _both_e4m3(np.concatenate([mid, -mid])):
        np.testing.assert_array_equal(got, np.concatenate([want, want | 0x80]))
    above = np.nextafter(mid, np.float32(np.inf))
    below = np.nextafter(mid, np.float32(0))
    for got in _both_e4m3(np.concatenate([above, below])):
        np.testing.assert_array_equal(got, np.concatenate([hi_code, lo_code]))


@pytest.mark.parametrize(
    ("value", "code"),
    [
        (448.0, 0x7E),
        (449.0, 0x7E),
        (464.0, 0x7E),
        (1e30, 0x7E),
        (np.inf, 0x7E),
        (-500.0, 0xFE),
        (-np.inf, 0xFE),
    ],
)
def test_e4m3_saturates_at_448(value, code):
    for got in _both_e4m3(np.array([value], np.float32)):
        assert got[0] == code


def test_e4m3_nan_input_gives_a_nan_code_and_subnormal_float32_flushes_to_signed_zero():
    for got in _both_e4m3(np.array([np.nan, 1e-40, -1e-40, 0.0, -0.0], np.float32)):
        assert got[0] in (0x7F, 0xFF)
        np.testing.assert_array_equal(got[1:], [0x00, 0x80, 0x00, 0x80])


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_e4m3_encode_matches_ml_dtypes_on_random_float32(seed):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=256) * 2.0 ** rng.integers(-12, 10, size=256)).astype(np.float32)
    for got in _both_e4m3(x):
        np.testing.assert_array_equal(got, e4m3_codes(x))


# ---------------------------------------------------------------------------------------------------- E2M1


def test_e2m1_decodes_all_16_codes():
    codes = np.arange(16, dtype=np.uint8)
    ref = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(bits(ref), bits(np.array(E2M1_TABLE, np.float32)))  # the spec's table
    for got in (np.asarray(elements.e2m1_decode(codes)), host.e2m1_decode(codes)):
        np.testing.assert_array_equal(bits(got), bits(ref))


def test_e2m1_round_trips_all_16_codes():
    values = np.array(E2M1_TABLE, np.float32)
    for got in (
        np.asarray(elements.e2m1_encode(values)),
        np.asarray(jit_e2m1_encode(values)),
        host.e2m1_encode(values),
    ):
        np.testing.assert_array_equal(got, np.arange(16))


# Every midpoint between neighbouring magnitudes, and the code round-to-nearest-even picks (by hand).
E2M1_TIES = [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6)]


@pytest.mark.parametrize(("value", "code"), E2M1_TIES)
def test_e2m1_rounds_ties_to_even(value, code):
    x = np.array([value, -value], np.float32)
    for got in (np.asarray(elements.e2m1_encode(x)), host.e2m1_encode(x)):
        np.testing.assert_array_equal(got, [code, code | 8])
    nudged = np.array(
        [np.nextafter(np.float32(value), np.float32(9)), np.nextafter(np.float32(value), np.float32(0))]
    )
    for got in (np.asarray(elements.e2m1_encode(nudged)), host.e2m1_encode(nudged)):
        assert got[0] == e2m1_codes(nudged[:1])[0] and got[1] == e2m1_codes(nudged[1:])[0]
        assert got[0] > got[1], "just above a midpoint rounds up, just below rounds down"


@pytest.mark.parametrize("value", [6.0, 6.5, 7.0, 100.0, 3.4e38, np.inf])
def test_e2m1_saturates_at_6(value):
    x = np.array([value, -value], np.float32)
    for got in (np.asarray(elements.e2m1_encode(x)), host.e2m1_encode(x)):
        np.testing.assert_array_equal(got, [7, 15])


def test_e2m1_signed_zero_and_subnormal_inputs():
    x = np.array([0.0, -0.0, 0.1, -0.1, 1e-40, -1e-40], np.float32)
    for got in (np.asarray(elements.e2m1_encode(x)), host.e2m1_encode(x)):
        np.testing.assert_array_equal(got, [0, 8, 0, 8, 0, 8])


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_e2m1_encode_matches_reference_and_ml_dtypes(seed):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=256) * 3).astype(np.float32)
    x[:8] = rng.choice([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0], size=8) * rng.choice([-1, 1], size=8)
    ref = e2m1_codes(x)
    # ml_dtypes' float4 conversion is an independent RNE-with-saturation implementation for finite inputs.
    np.testing.assert_array_equal(ref, x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8))
    for got in (np.asarray(elements.e2m1_encode(x)), np.asarray(jit_e2m1_encode(x)), host.e2m1_encode(x)):
        np.testing.assert_array_equal(got, ref)


# ---------------------------------------------------------------------------------------------------- UE8M0


def test_ue8m0_decodes_every_byte_exactly():
    ref = ALL_BYTES.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    for got in (np.asarray(elements.ue8m0_decode(ALL_BYTES)), host.ue8m0_decode(ALL_BYTES)):
        np.testing.assert_array_equal(bits(got[:255]), bits(ref[:255]))
        assert np.isnan(got[255])
    np.testing.assert_array_equal(
        bits(ref[:255]), bits(np.array([2.0 ** (b - 127) for b in range(255)], np.float32))
    )
    np.testing.assert_array_equal(np.asarray(elements.ue8m0_exponent(ALL_BYTES)), np.arange(256) - 127)


def test_scale_by_pow2_is_exact_for_every_scale_byte_and_flushes_below_the_normal_range():
    codes = E4M3_ALL_VALUES[FINITE_E4M3]
    e = np.arange(-127, 128)
    got = np.asarray(jax.jit(elements.scale_by_pow2)(codes[:, None], e[None, :]))
    with np.errstate(over="ignore"):  # 448 * 2^127 overflows to inf, in float32 and in the library alike
        want = (codes[:, None].astype(np.float64) * 2.0 ** e[None, :].astype(np.float64)).astype(np.float32)
    want = np.where(np.abs(want) < 2.0**-126, np.copysign(np.float32(0), want), want)
    np.testing.assert_array_equal(bits(got), bits(want))
    assert np.isnan(np.asarray(elements.scale_by_pow2(np.float32(1.0), 128)))


# ---------------------------------------------------------------------------------------------------- packing


def test_nibbles_pack_low_nibble_first():
    codes = np.array([[1, 2, 3, 4, 15, 0]], np.uint8)
    want = np.array([[0x21, 0x43, 0x0F]], np.uint8)
    np.testing.assert_array_equal(np.asarray(elements.pack_nibbles(codes)), want)
    np.testing.assert_array_equal(host.pack_nibbles(codes), want)
    np.testing.assert_array_equal(np.asarray(elements.unpack_nibbles(want)), codes)
    np.testing.assert_array_equal(host.unpack_nibbles(want.view(np.int8)), codes)
    with pytest.raises(ValueError, match="even last dimension"):
        elements.pack_nibbles(np.zeros(3, np.uint8))


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(0, 15), min_size=32, max_size=32))
def test_nibbles_round_trip(values):
    codes = np.array(values, np.uint8).reshape(4, 8)
    np.testing.assert_array_equal(np.asarray(elements.unpack_nibbles(elements.pack_nibbles(codes))), codes)
    np.testing.assert_array_equal(host.unpack_nibbles(host.pack_nibbles(codes)), codes)


def test_as_uint8_accepts_the_checkpoint_storage_dtypes_and_refuses_others():
    b = np.array([0, 127, 255], np.uint8)
    for view in (b, b.view(np.int8), b.view(ml_dtypes.float8_e8m0fnu), b.view(ml_dtypes.float8_e4m3fn)):
        np.testing.assert_array_equal(np.asarray(elements.as_uint8(jnp.asarray(view))), b)
    with pytest.raises(TypeError, match=r"scale must have an 8-bit storage dtype.*float32"):
        elements.as_uint8(np.zeros(2, np.float32), "scale")


# ---------------------------------------------------------------------------------------------------- traps


def test_flush_subnormals_keeps_the_sign():
    x = np.array([1e-40, -1e-40, 2.0**-126, -(2.0**-126), 0.0, 1.0], np.float32)
    want = np.array([0.0, -0.0, 2.0**-126, -(2.0**-126), 0.0, 1.0], np.float32)
    np.testing.assert_array_equal(bits(np.asarray(elements.flush_subnormals(x))), bits(want))
    np.testing.assert_array_equal(bits(host.flush_subnormals(x)), bits(want))


def test_exact_divide_is_correctly_rounded_under_jit_where_plain_division_by_a_broadcast_is_not():
    rng = np.random.default_rng(0)
    a = (rng.random((4096, 16)) * 1000).astype(np.float32)
    d = (rng.random(4096) * 10 + 0.1).astype(np.float32)
    want = a / d[:, None]
    got = np.asarray(jax.jit(lambda a, d: elements.exact_divide(a, d[:, None]))(a, d))
    np.testing.assert_array_equal(bits(got), bits(want))
    got_const = np.asarray(jax.jit(lambda a: elements.exact_divide(a, 448.0))(a))
    np.testing.assert_array_equal(bits(got_const), bits(a / np.float32(448.0)))
