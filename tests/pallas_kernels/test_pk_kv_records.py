"""The in-kernel KV-record codecs (interpret mode) against deepinfer_jax.numerics, byte for byte, and their export.

Decoding is checked on every code of every format with a spread of scale bytes (including UE8M0 byte 0, whose
2^-127 is a subnormal, and the NaN bytes), encoding on random groups over a wide range of magnitudes plus the
cases where a division-free rounding decision could go wrong: values exactly on E2M1/E4M3 midpoints, group maxima
exactly at 6 · 2^k / 448 · 2^k, FP4 scales exactly on E4M3 midpoints, zeros, signed zeros, subnormals, NaN and
infinity. Equality is of bit patterns (NaN = NaN), as the tolerance is zero.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from deepinfer_jax.numerics import kv_records as kr
from deepinfer_jax.numerics.formats import fp4_e4m3_record_format, mxfp4_record_format, mxfp8_record_format
from pallas_kernels.kv_records import decode_records, encode_records, store_records

FMT = {"mxfp8": mxfp8_record_format, "fp4": fp4_e4m3_record_format, "mxfp4": mxfp4_record_format}
# every finite non-negative E4M3 value, ascending
_E4M3 = np.sort(np.arange(0, 127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64))


def _same_bits(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return (a.view(np.int32) == b.view(np.int32)) | (np.isnan(a) & np.isnan(b))


def _records_every_code(kind: str, rng: np.random.Generator) -> np.ndarray:
    """Records whose code bytes cycle through every byte value and whose scale bytes cover the edge cases."""
    d = 64
    fmt = FMT[kind](d)
    rows = 32
    codes = (np.arange(rows * fmt.code_bytes) % 256).astype(np.uint8).reshape(rows, fmt.code_bytes)
    special = (
        [0, 1, 2, 126, 127, 128, 200, 254, 255]
        if kind != "fp4"
        else [0, 1, 7, 8, 0x7E, 0x7F, 0x80, 0xFE, 0xFF]
    )
    scales = rng.integers(0, 256, (rows, fmt.scale_bytes), dtype=np.uint8)
    scales.flat[: len(special)] = special
    scales[-1] = 127 if kind != "fp4" else 0x38  # a row with scale 1
    return np.concatenate([codes, scales], axis=1)


@pytest.mark.parametrize("kind", ["mxfp8", "fp4", "mxfp4"])
def test_decode_is_bit_exact_on_every_code(kind):
    rng = np.random.default_rng(1)
    records = _records_every_code(kind, rng)
    fmt = FMT[kind](64)
    want = np.asarray(jax.jit(lambda r: kr.decode_records(r, fmt))(records))
    got = np.asarray(decode_records(records, kind, 64, interpret=True))
    assert _same_bits(want, got).all()
    assert np.isnan(want).any() and (want == 0).any()  # the NaN and zero cases were exercised


def test_fp8_latent_and_float_records_decode_like_the_cache():
    from deepinfer_jax.cache import paged

    rng = np.random.default_rng(4)
    c, r = 200, 16  # two scale groups, the second one short
    vals = (rng.standard_normal((9, c + r)) * np.exp2(rng.integers(-6, 6, (9, 1)))).astype(np.float32)
    rec = paged.encode_latent_fp8(jnp.asarray(vals), c)
    want = np.asarray(paged.decode_latent_fp8(rec, c, r))
    got = np.asarray(decode_records(rec, "fp8_latent", c, rope=r, interpret=True))
    assert _same_bits(want, got).all()
    np.testing.assert_array_equal(np.asarray(decode_records(vals, None, c + r, interpret=True)), vals)


def _encode_cases(rng: np.random.Generator, d: int = 64) -> np.ndarray:
    wide = rng.standard_normal((24, d)) * np.exp2(rng.integers(-40, 40, (24, 1)))
    mids = np.array(
        [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 1, 1.5, 2, 3, 4, 7, 448 / 6], np.float64
    )
    on_mid = np.tile(mids, d // len(mids) + 1)[:d][None] * np.exp2(rng.integers(-6, 6, (12, 1)))
    on_mid[:, 0] = 6.0 * np.exp2(rng.integers(-6, 6, 12))  # group maximum exactly 6 · 2^k
    on_mid[::2, 32] = 448.0 * np.exp2(rng.integers(-6, 6, 6))  # and 448 · 2^k
    e4m3_mids = np.array([1.0625, 1.1875, 432.0, 2**-9 * 1.5, 7.5 * 2**-9, 1.9375, 3.5 * 2**-9, 0.5625])
    fp4_scale = rng.standard_normal((8, d)) * 0.01
    fp4_scale[np.arange(8), np.arange(8) * 3] = 6 * e4m3_mids  # a group amax / 6 exactly on an E4M3 midpoint
    # one float32 ulp either side of those thresholds: an estimate of amax / 6 or amax / 448 by a multiplication
    # with the rounded reciprocal lands on the wrong side of them, the exact rule must not
    m = np.array([(a + b) / 2 for a, b in itertools.pairwise(_E4M3)], np.float64)
    m = m[(m >= 2**-9) & (m <= 448)]
    near = np.concatenate(
        [np.nextafter(np.float32(6 * m), np.float32(np.inf)), np.nextafter(np.float32(6 * m), np.float32(0))]
    )
    near_mid = np.resize(rng.standard_normal((1, d)) * 1e-4, (-(-len(near) // 4), d))
    for i, v in enumerate(near):
        near_mid[i // 4, 16 * (i % 4)] = v  # one threshold per FP4 group (groups of 16)
    k = rng.integers(-8, 8, 16)
    pow2 = np.concatenate([6.0 * np.exp2(k), 448.0 * np.exp2(k)]).astype(np.float32)
    near_p2 = np.concatenate(
        [pow2, np.nextafter(pow2, np.float32(np.inf)), np.nextafter(pow2, np.float32(0))]
    )
    near_pow = np.resize(rng.standard_normal((1, d)) * 1e-6, (-(-len(near_p2) // 2), d))
    for i, v in enumerate(near_p2):
        near_pow[i // 2, 32 * (i % 2)] = v  # one per MXFP group (groups of 32)
    special = rng.standard_normal((10, d))
    special[0, 3] = np.nan
    special[1, 40] = np.inf
    special[2, 17] = -np.inf
    special[3] = 0.0
    special[4] = -0.0
    special[5, :20] = 1e-40  # float32 subnormals
    special[6] *= 1e30
    special[7] *= 1e-30
    special[8, :32] = 6 * 448
    special[9] = -(2.0**-9) * 6
    return np.concatenate([wide, on_mid, fp4_scale, near_mid, near_pow, special]).astype(np.float32)


@pytest.mark.parametrize("kind", ["mxfp8", "fp4", "mxfp4"])
def test_encode_is_bit_exact(kind):
    x = _encode_cases(np.random.default_rng(2))
    fmt = FMT[kind](x.shape[1])
    want = np.asarray(jax.jit(lambda v: kr.encode_records(v, fmt))(x))
    got = np.asarray(encode_records(x, kind, interpret=True))
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_store_writes_only_the_named_rows_and_handles_ragged_group_counts():
    rng = np.random.default_rng(3)
    d = 96  # 6 FP4 groups / 3 MXFP8 groups: not a power of two (padded groups must never be stored)
    x = rng.standard_normal((5, d)).astype(np.float32)
    fmt = FMT["fp4"](d)
    pages = rng.integers(
        0, 256, (3, 4, fmt.record_bytes), dtype=np.uint8
    )  # [NB, E, bytes], arbitrary old bytes
    slots = np.array([7, -1, 0, 11, -1], np.int32)
    got = np.asarray(store_records(jnp.asarray(pages), x, jnp.asarray(slots), "fp4", interpret=True))
    want = pages.reshape(12, -1).copy()
    enc = np.asarray(kr.encode_records(jnp.asarray(x), fmt))
    for n, s in enumerate(slots):
        if s >= 0:
            want[s] = enc[n]
    np.testing.assert_array_equal(got.reshape(12, -1), want)
    # nothing to store: the pages come back unchanged
    same = store_records(jnp.asarray(pages), x[:0], jnp.zeros((0,), jnp.int32), "fp4", interpret=True)
    np.testing.assert_array_equal(np.asarray(same), pages)


def test_store_refuses_mismatched_pages():
    with pytest.raises(ValueError, match="uint8"):
        store_records(jnp.zeros((4, 10), jnp.uint8), jnp.zeros((2, 64)), jnp.zeros((2,), jnp.int32), "mxfp8")
    with pytest.raises(ValueError, match="kind"):
        store_records(jnp.zeros((4, 66), jnp.uint8), jnp.zeros((2, 64)), jnp.zeros((2,), jnp.int32), "nvfp4")


def test_codecs_export_for_cuda(triton_calls):
    s = jax.ShapeDtypeStruct
    assert triton_calls(lambda r: decode_records(r, "fp4", 512), s((40, 288), jnp.uint8)) == 1
    assert (
        triton_calls(
            lambda p, v, i: store_records(p, v, i, "mxfp8"),
            s((64, 528), jnp.uint8),
            s((9, 512), jnp.float32),
            s((9,), jnp.int32),
        )
        == 1
    )
