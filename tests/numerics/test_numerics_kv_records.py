"""Per-token KV records: sizes from the layout, exact byte positions, round trips, block-sectioned pages."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _numerics_ref import E4M3_ALL_VALUES, bits, dequantize_rows, quantize_rows, random_tensor, record
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_jax.numerics import kv_records as kr
from deepinfer_jax.numerics.formats import RecordFormat

encode = jax.jit(kr.encode_records, static_argnums=1)
decode = jax.jit(kr.decode_records, static_argnums=(1, 2))
encode_page = jax.jit(kr.encode_page, static_argnums=1)
decode_page = jax.jit(kr.decode_page, static_argnums=(1, 2, 3))

WINDOW = kr.window_record_format(512)
COMPRESSED = kr.compressed_record_format(512)
INDEXER = kr.indexer_record_format(128)
REF_SCHEME = {"window": "mxfp8", "compressed": "fp4_e4m3", "indexer": "mxfp4"}


def test_record_sizes_follow_from_the_layout():
    assert (WINDOW.code_bytes, WINDOW.scale_bytes, WINDOW.record_bytes) == (512, 16, 528)
    assert (COMPRESSED.code_bytes, COMPRESSED.scale_bytes, COMPRESSED.record_bytes) == (256, 32, 288)
    assert kr.compressed_record_format(512, use_fp4=False).record_bytes == 528
    assert (INDEXER.code_bytes, INDEXER.scale_bytes, INDEXER.record_bytes) == (64, 4, 68)
    assert kr.latent_record_format(512, 64).record_bytes == 1152
    # A width that is not the production one derives its size the same way (nothing is hard-coded).
    assert kr.window_record_format(64).record_bytes == 66 and kr.indexer_record_format(64).record_bytes == 34


def test_record_format_refuses_inconsistent_layouts():
    with pytest.raises(
        ValueError, match=r"RecordFormat\('window'\).num_elements must be a multiple of group_size 32, got 48"
    ):
        kr.window_record_format(48)
    with pytest.raises(ValueError, match="element must be one of"):
        RecordFormat("x", 32, "e5m2", "ue8m0", 32)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"num_elements must be an int, got float"):
        kr.mxfp4_record_format(32.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", [WINDOW, COMPRESSED, INDEXER], ids=lambda f: f.name)
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_records_match_reference_layout_and_values(fmt, seed):
    rng = np.random.default_rng(seed)
    x = random_tensor(rng, (2, 3, fmt.num_elements), spread=12)
    x[0, 0, 7] = np.nan
    x[1, 2, :] = 0.0
    scheme = REF_SCHEME[fmt.name]
    got = np.asarray(encode(x, fmt))
    assert got.dtype == np.uint8 and got.shape == (2, 3, fmt.record_bytes)
    np.testing.assert_array_equal(got, record(x, scheme))
    codes, scales = quantize_rows(x, scheme)
    np.testing.assert_array_equal(
        bits(np.asarray(decode(got, fmt))), bits(dequantize_rows(codes, scales, scheme))
    )


def test_window_record_byte_positions_by_hand():
    x = np.zeros((64,), np.float32)
    x[0] = 448.0  # group 0: amax 448 -> scale 2^0, byte 127; element 0 -> E4M3 0x7E
    x[1] = -1.0  # -> E4M3 0xB8
    x[32] = 0.75  # group 1: amax 0.75 -> 0.75/448 rounds up to 2^-9, byte 118; 0.75 / 2^-9 = 384 -> 0x7C
    rec = np.asarray(kr.encode_window_kv(x))
    assert rec.shape == (66,)
    assert (rec[0], rec[1], rec[32]) == (0x7E, 0xB8, 0x7C)
    assert (rec[64], rec[65]) == (127, 118)
    assert E4M3_ALL_VALUES[0x7C] == 384.0


def test_compressed_record_byte_positions_by_hand():
    x = np.zeros((32,), np.float32)
    x[0], x[1] = 1.5, -6.0  # group 0: amax 6 -> E4M3 scale 1.0 (0x38); codes 3 and 0xF -> byte 0xF3
    x[16] = 0.25  # group 1: amax 0.25 -> scale e4m3(0.25/6) = 0.04296875 (checked with ml_dtypes below)
    rec = np.asarray(kr.encode_compressed_kv(x))
    assert rec.shape == (18,)
    assert rec[0] == 0xF3 and rec[16] == 0x38
    want_scale = np.array([np.float32(0.25) / np.float32(6)], np.float32).astype(ml_dtypes.float8_e4m3fn)
    assert rec[17] == want_scale.view(np.uint8)[0]
    sf = float(want_scale.astype(np.float32)[0])
    # 0.25 / sf lands between E2M1 4 and 6; it is 5.82..., nearest 6 (code 7) in the low nibble of byte 8.
    assert 5.0 < 0.25 / sf < 6.0 and rec[8] == 0x07


def test_indexer_record_byte_positions_by_hand():
    x = np.zeros((64,), np.float32)
    x[1] = 3.0  # group 0 amax 3 -> 3/6 = 0.5 -> scale 2^-1 (byte 126); 3 / 0.5 = 6 -> code 7, high nibble
    x[62] = -0.25  # group 1 amax 0.25 -> 0.25/6 -> 2^-4 (byte 123); -0.25 / 2^-4 = -4 -> code 0xE, low nibble
    rec = np.asarray(kr.encode_indexer_k(x))
    assert rec.shape == (34,)
    assert rec[0] == 0x70 and rec[31] == 0x0E
    assert (rec[32], rec[33]) == (126, 123)


def test_named_codecs_infer_the_width_and_refuse_bad_record_lengths():
    x = random_tensor(np.random.default_rng(1), (3, 512))
    enc_window, dec_window = jax.jit(kr.encode_window_kv), jax.jit(kr.decode_window_kv)
    enc_comp = jax.jit(kr.encode_compressed_kv, static_argnums=1)
    dec_comp = jax.jit(kr.decode_compressed_kv, static_argnums=1)
    window = enc_window(x)
    assert window.shape == (3, 528) and dec_window(window).shape == (3, 512)
    fp4 = enc_comp(x, True)
    assert fp4.shape == (3, 288) and dec_comp(fp4, True).shape == (3, 512)
    mx = enc_comp(x, False)
    assert mx.shape == (3, 528) and dec_comp(mx, False).shape == (3, 512)
    np.testing.assert_array_equal(np.asarray(mx), np.asarray(window))
    idx = jax.jit(kr.encode_indexer_k)(x[:, :128])
    assert idx.shape == (3, 68) and jax.jit(kr.decode_indexer_k)(idx).shape == (3, 128)
    with pytest.raises(ValueError, match="window-KV records must have a multiple of 33 bytes"):
        kr.decode_window_kv(np.zeros((2, 100), np.uint8))
    with pytest.raises(ValueError, match="FP4 compressed-KV records must have a multiple of 9 bytes"):
        kr.decode_compressed_kv(np.zeros((2, 100), np.uint8))
    with pytest.raises(ValueError, match="last dimension 528"):
        kr.decode_records(np.zeros((2, 100), np.uint8), WINDOW)
    with pytest.raises(ValueError, match="must have last dimension 512, got shape"):
        kr.encode_records(np.zeros((2, 100), np.float32), WINDOW)
    with pytest.raises(TypeError, match="must be floating point, got dtype int32"):
        kr.encode_records(np.zeros((2, 512), np.int32), WINDOW)


def test_quantize_dequantize_records_is_decode_of_encode_in_the_input_dtype():
    x = jnp.asarray(random_tensor(np.random.default_rng(2), (4, 512)), jnp.bfloat16)
    got = jax.jit(kr.quantize_dequantize_records, static_argnums=1)(x, COMPRESSED)
    assert got.dtype == jnp.bfloat16
    want = decode(encode(x, COMPRESSED), COMPRESSED, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_bf16_latent_records_are_little_endian():
    fmt = kr.latent_record_format(2, 2)
    x = np.array([[1.0, -2.0, 0.5, 3.0]], np.float32)
    rec = np.asarray(kr.encode_records(x, fmt))
    assert rec.tolist() == [[0x80, 0x3F, 0x00, 0xC0, 0x00, 0x3F, 0x40, 0x40]]
    np.testing.assert_array_equal(np.asarray(kr.decode_records(rec, fmt)), x)


# ---------------------------------------------------------------------------------------------------- pages


@settings(max_examples=10, deadline=None)
@given(num_tokens=st.sampled_from([1, 2, 5, 64]), seed=st.integers(0, 2**32 - 1))
def test_indexer_page_is_block_sectioned(num_tokens, seed):
    rng = np.random.default_rng(seed)
    x = random_tensor(rng, (2, num_tokens, 128))
    records = np.asarray(encode(x, INDEXER))
    page = np.asarray(encode_page(x, INDEXER))
    assert page.shape == (2, num_tokens * 68)
    # All tokens' 64-byte code rows first, then all tokens' 4-byte scale rows, in token order.
    np.testing.assert_array_equal(page[:, : num_tokens * 64], records[:, :, :64].reshape(2, -1))
    np.testing.assert_array_equal(page[:, num_tokens * 64 :], records[:, :, 64:].reshape(2, -1))
    np.testing.assert_array_equal(np.asarray(kr.unpack_page(page, INDEXER, num_tokens)), records)
    np.testing.assert_array_equal(
        bits(np.asarray(decode_page(page, INDEXER, num_tokens, jnp.float32))),
        bits(np.asarray(decode(records, INDEXER))),
    )


def test_page_errors_name_the_expected_size():
    with pytest.raises(ValueError, match="page of 4 tokens must have last dimension 272, got shape"):
        kr.unpack_page(np.zeros(270, np.uint8), INDEXER, 4)
    with pytest.raises(ValueError, match="num_tokens must be a positive int, got 0"):
        kr.unpack_page(np.zeros(0, np.uint8), INDEXER, 0)
