"""Group and weight codecs against the independent reference: layouts, ragged blocks, zeros, NaN/inf, jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _numerics_ref import (
    bits,
    dequantize_rows,
    fp8_blockwise,
    fp8_blockwise_dequant,
    pack_low_first,
    quantize_rows,
    random_tensor,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_jax.numerics import codecs
from deepinfer_jax.numerics.formats import FP4_E4M3_16, MXFP4, MXFP8, QuantScheme

SCHEMES = {"mxfp8": MXFP8, "mxfp4": MXFP4, "fp4_e4m3": FP4_E4M3_16}


# Tests call the codecs under jit (one compile per shape; eager dispatch would compile every primitive).
quantize_groups = jax.jit(codecs.quantize_groups, static_argnums=1)
dequantize_groups = jax.jit(codecs.dequantize_groups, static_argnums=(2, 3))
qdq_groups = jax.jit(codecs.quantize_dequantize_groups, static_argnums=1)
quantize_fp8 = jax.jit(codecs.quantize_fp8_blockwise, static_argnums=(1, 2))
dequantize_fp8 = jax.jit(codecs.dequantize_fp8_blockwise, static_argnums=(2, 3))
quantize_mxfp4 = jax.jit(codecs.quantize_mxfp4)
dequantize_mxfp4 = jax.jit(codecs.dequantize_mxfp4, static_argnums=2)


def _with_specials(rng: np.random.Generator, x: np.ndarray) -> np.ndarray:
    """Sprinkle exact zeros groups, signed zeros, float32 subnormals, NaN and inf into a [rows, n] tensor."""
    x = x.copy()
    x[0, :32] = 0.0
    x[1, 3] = -0.0
    x[1, 4] = 1e-40
    x[2, rng.integers(x.shape[1])] = np.nan
    x[3, rng.integers(x.shape[1])] = -np.inf
    return x


# ---------------------------------------------------------------------------------------------------- groups


@pytest.mark.parametrize("name", sorted(SCHEMES))
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_quantize_groups_matches_reference(name, seed):
    rng = np.random.default_rng(seed)
    x = _with_specials(rng, random_tensor(rng, (6, 64), spread=20))
    want_codes, want_scales = quantize_rows(x, name)
    got = quantize_groups(x, SCHEMES[name])
    np.testing.assert_array_equal(np.asarray(got.codes), want_codes)
    np.testing.assert_array_equal(np.asarray(got.scales), want_scales)
    deq = dequantize_groups(got.codes, got.scales, SCHEMES[name])
    np.testing.assert_array_equal(bits(np.asarray(deq)), bits(dequantize_rows(want_codes, want_scales, name)))


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_nan_or_inf_poisons_exactly_its_own_group(name):
    scheme = SCHEMES[name]
    g = scheme.group_size
    x = np.full((2, 3 * g), 1.5, np.float32)
    x[0, g + 1] = np.nan
    x[1, 2 * g] = np.inf
    q = quantize_groups(x, scheme)
    nan_byte = 0xFF if scheme.scale == "ue8m0" else 0x7F
    np.testing.assert_array_equal(np.asarray(q.scales)[0, 1], nan_byte)
    np.testing.assert_array_equal(np.asarray(q.scales)[1, 2], nan_byte)
    np.testing.assert_array_equal(np.asarray(q.codes)[0, g : 2 * g], 0)
    deq = np.asarray(dequantize_groups(q.codes, q.scales, scheme))
    assert np.all(np.isnan(deq[0, g : 2 * g])) and np.all(np.isnan(deq[1, 2 * g :]))
    np.testing.assert_array_equal(deq[0, :g], 1.5)  # neighbours are untouched (1.5 is representable)
    np.testing.assert_array_equal(deq[1, :g], 1.5)


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_all_zero_groups_decode_to_positive_zero_with_the_margin_scale(name):
    scheme = SCHEMES[name]
    q = quantize_groups(np.zeros((1, scheme.group_size), np.float32), scheme)
    np.testing.assert_array_equal(np.asarray(q.codes), 0)
    assert int(np.asarray(q.scales)[0, 0]) == {"mxfp8": 105, "mxfp4": 1, "fp4_e4m3": 0x01}[name]
    deq = np.asarray(dequantize_groups(q.codes, q.scales, scheme))
    np.testing.assert_array_equal(bits(deq), 0)


@pytest.mark.parametrize("name", ["mxfp8", "mxfp4"])
def test_representable_groups_round_trip_exactly(name):
    """A group whose amax is exactly Qmax * 2^k and whose values are codes * 2^k comes back bit-exact."""
    scheme = SCHEMES[name]
    rng = np.random.default_rng(1)
    if name == "mxfp8":
        table = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        table = table[np.isfinite(table)]
    else:
        table = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    vals = rng.choice(table, size=(8, 32)).astype(np.float32)
    vals[:, 0] = scheme.qmax
    x = vals * (2.0 ** np.arange(-4, 4)[:, None]).astype(np.float32)
    q = quantize_groups(x, scheme)
    np.testing.assert_array_equal(bits(np.asarray(dequantize_groups(q.codes, q.scales, scheme))), bits(x))


def test_ragged_last_group_is_zero_padded():
    x = random_tensor(np.random.default_rng(2), (3, 45))
    q = quantize_groups(x, MXFP8)
    assert q.codes.shape == (3, 45) and q.scales.shape == (3, 2)
    padded = np.pad(x, ((0, 0), (0, 19)))
    want_codes, want_scales = quantize_rows(padded, "mxfp8")
    np.testing.assert_array_equal(np.asarray(q.codes), want_codes[:, :45])
    np.testing.assert_array_equal(np.asarray(q.scales), want_scales)
    assert dequantize_groups(q.codes, q.scales, MXFP8).shape == (3, 45)


def test_leading_batch_dimensions_and_bf16_input():
    x = random_tensor(np.random.default_rng(3), (2, 3, 4, 64))
    q = quantize_groups(jnp.asarray(x, jnp.bfloat16), MXFP4)
    want_codes, want_scales = quantize_rows(x.astype(ml_dtypes.bfloat16).astype(np.float32), "mxfp4")
    np.testing.assert_array_equal(np.asarray(q.codes), want_codes)
    np.testing.assert_array_equal(np.asarray(q.scales), want_scales)
    out = qdq_groups(jnp.asarray(x, jnp.bfloat16), MXFP4)
    assert out.dtype == jnp.bfloat16 and out.shape == x.shape


def test_group_codec_input_errors():
    with pytest.raises(TypeError, match="x must be a floating-point array, got dtype int32"):
        quantize_groups(np.zeros((2, 32), np.int32), MXFP8)
    with pytest.raises(ValueError, match=r"scales must have shape \(2, 1\).*got \(2, 2\)"):
        dequantize_groups(np.zeros((2, 32), np.uint8), np.zeros((2, 2), np.uint8), MXFP8)
    with pytest.raises(ValueError, match="group_size must be even"):
        QuantScheme("e2m1", "ue8m0", 3)
    with pytest.raises(ValueError, match="'e4m3' is defined only for element 'e2m1'"):
        QuantScheme("e4m3", "e4m3", 16)


# ---------------------------------------------------------------------------------------------------- FP8 weights


@pytest.mark.parametrize(
    ("shape", "block", "scale_fmt"),
    [
        ((70, 45), (32, 32), "ue8m0"),  # V4/V4.1 blocks, neither dimension a multiple
        ((64, 96), (32, 32), "ue8m0"),
        ((200, 300), (128, 128), "float32"),  # V3 blocks, float32 weight_scale_inv, ragged edges
        ((5, 64), (1, 32), "ue8m0"),  # Engram tables: one scale per row per 32 columns
    ],
)
def test_fp8_blockwise_matches_reference(shape, block, scale_fmt):
    rng = np.random.default_rng(4)
    w = random_tensor(rng, shape, spread=6)
    w[0, 0] = 1e-40
    want_codes, want_scales = fp8_blockwise(w, block, scale_fmt)
    for q, s in [quantize_fp8(w, block, scale_fmt)]:
        assert q.dtype == jnp.float8_e4m3fn
        assert s.dtype == (jnp.float8_e8m0fnu if scale_fmt == "ue8m0" else jnp.float32)
        assert s.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
        np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_codes)
        if scale_fmt == "ue8m0":
            np.testing.assert_array_equal(np.asarray(s).view(np.uint8), want_scales)
        else:
            np.testing.assert_array_equal(bits(np.asarray(s)), bits(want_scales))
        deq = np.asarray(dequantize_fp8(q, s, block))
        np.testing.assert_array_equal(bits(deq), bits(fp8_blockwise_dequant(want_codes, want_scales, block)))


def test_fp8_blockwise_scale_is_power_of_two_for_ue8m0_and_amax_over_448_for_float32():
    w = np.zeros((32, 32), np.float32)
    w[3, 4] = 300.0  # amax / 448 = 0.67 -> power-of-two scale 1.0 (byte 127); V3 scale_inv = 300/448
    _, s = quantize_fp8(w)
    assert int(np.asarray(s).view(np.uint8)[0, 0]) == 127
    _, s32 = quantize_fp8(w, scale_fmt="float32")
    assert np.asarray(s32)[0, 0] == np.float32(300.0) / np.float32(448.0)
    q32, _ = quantize_fp8(w, scale_fmt="float32")
    assert np.asarray(q32).view(np.uint8)[3, 4] == 0x7E  # the amax element maps to 448


def test_fp8_blockwise_poisons_a_block_holding_nan():
    w = np.ones((64, 64), np.float32)
    w[40, 3] = np.nan
    q, s = quantize_fp8(w)
    sb = np.asarray(s).view(np.uint8)
    assert sb[1, 0] == 0xFF and np.all(sb[[0, 0, 1], [0, 1, 1]] != 0xFF)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8)[32:, :32], 0)
    deq = np.asarray(dequantize_fp8(q, s))
    assert np.all(np.isnan(deq[32:, :32])) and np.all(deq[:32] == 1.0)
    _, s32 = quantize_fp8(w, scale_fmt="float32")
    assert np.isnan(np.asarray(s32)[1, 0])


def test_fp8_blockwise_batches_over_experts():
    w = random_tensor(np.random.default_rng(5), (3, 40, 64))
    q, s = quantize_fp8(w)
    assert q.shape == (3, 40, 64) and s.shape == (3, 2, 2)
    for e in range(3):
        want_codes, want_scales = fp8_blockwise(w[e], (32, 32), "ue8m0")
        np.testing.assert_array_equal(np.asarray(q[e]).view(np.uint8), want_codes)
        np.testing.assert_array_equal(np.asarray(s[e]).view(np.uint8), want_scales)
    deq = dequantize_fp8(q, s, dtype=jnp.bfloat16)
    assert deq.dtype == jnp.bfloat16 and deq.shape == (3, 40, 64)


def test_fp8_blockwise_input_errors():
    w = np.zeros((40, 64), np.float32)
    with pytest.raises(ValueError, match="scale_fmt must be 'ue8m0' or 'float32', got 'e5m2'"):
        quantize_fp8(w, scale_fmt="e5m2")
    with pytest.raises(ValueError, match="block must be a pair of positive ints"):
        quantize_fp8(w, block=(0, 32))
    q, s = quantize_fp8(w)
    with pytest.raises(ValueError, match=r"scale must have shape \(2, 2\).*block \(32, 32\), got \(2, 1\)"):
        dequantize_fp8(q, s[:, :1])
    with pytest.raises(TypeError, match=r"scale must be float32 .* got float16"):
        dequantize_fp8(q, np.zeros((2, 2), np.float16))


# ---------------------------------------------------------------------------------------------------- MXFP4 weights


def test_mxfp4_weights_match_reference_and_pack_the_even_element_low():
    rng = np.random.default_rng(6)
    w = _with_specials(rng, random_tensor(rng, (6, 64), spread=10))
    want_codes, want_scales = quantize_rows(w, "mxfp4")
    for packed, scale in [quantize_mxfp4(w)]:
        assert packed.dtype == jnp.uint8 and packed.shape == (6, 32)
        assert scale.dtype == jnp.float8_e8m0fnu and scale.shape == (6, 2)
        np.testing.assert_array_equal(np.asarray(packed), pack_low_first(want_codes))
        np.testing.assert_array_equal(np.asarray(scale).view(np.uint8), want_scales)
        deq = np.asarray(dequantize_mxfp4(packed, scale))
        np.testing.assert_array_equal(bits(deq), bits(dequantize_rows(want_codes, want_scales, "mxfp4")))
    # By hand: amax 6 -> scale 2^0 (byte 127); element 0 = 0.5 (code 1), element 1 = 6 (code 7) -> byte 0x71.
    row = np.zeros((1, 32), np.float32)
    row[0, :2] = [0.5, 6.0]
    packed, scale = quantize_mxfp4(row)
    assert int(np.asarray(packed)[0, 0]) == 0x71 and int(np.asarray(scale).view(np.uint8)[0, 0]) == 127


def test_mxfp4_accepts_int8_storage_and_refuses_bad_shapes():
    w = random_tensor(np.random.default_rng(7), (4, 64))
    packed, scale = quantize_mxfp4(w)
    a = dequantize_mxfp4(packed, scale)
    b = dequantize_mxfp4(np.asarray(packed).view(np.int8), np.asarray(scale).view(np.uint8))
    np.testing.assert_array_equal(bits(np.asarray(a)), bits(np.asarray(b)))
    with pytest.raises(ValueError, match="w in-dimension must be a multiple of 32 for MXFP4, got 48"):
        quantize_mxfp4(np.zeros((2, 48), np.float32))
    with pytest.raises(ValueError, match=r"scale must have shape \(4, 2\)"):
        dequantize_mxfp4(packed, scale[:, :1])


def test_eager_and_jit_agree_bit_for_bit():
    # Eager dispatch compiles every primitive separately; one scheme of each scale kind keeps this cheap.
    rng = np.random.default_rng(8)
    x = _with_specials(rng, random_tensor(rng, (4, 32), spread=20))
    eager, jitted = codecs.quantize_groups(x, FP4_E4M3_16), quantize_groups(x, FP4_E4M3_16)
    np.testing.assert_array_equal(np.asarray(eager.codes), np.asarray(jitted.codes))
    np.testing.assert_array_equal(np.asarray(eager.scales), np.asarray(jitted.scales))
    np.testing.assert_array_equal(
        bits(np.asarray(codecs.dequantize_groups(eager.codes, eager.scales, FP4_E4M3_16))),
        bits(np.asarray(dequantize_groups(jitted.codes, jitted.scales, FP4_E4M3_16))),
    )
    (qe, se), (qj, sj) = codecs.quantize_fp8_blockwise(x, (32, 32)), quantize_fp8(x, (32, 32), "ue8m0")
    np.testing.assert_array_equal(np.asarray(qe).view(np.uint8), np.asarray(qj).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(se).view(np.uint8), np.asarray(sj).view(np.uint8))
