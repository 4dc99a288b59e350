"""Host (numpy/ml_dtypes) codecs: the contract signatures, agreement with jnp bit for bit, no JAX import."""

from __future__ import annotations

import inspect
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from _numerics_ref import bits, fp8_blockwise, pack_low_first, quantize_rows, random_tensor
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_jax.numerics import codecs, host, kv_records
from deepinfer_jax.numerics.formats import FP4_E4M3_16, MXFP4, MXFP8

quantize_fp8 = jax.jit(codecs.quantize_fp8_blockwise, static_argnums=(1, 2))
dequantize_fp8 = jax.jit(codecs.dequantize_fp8_blockwise, static_argnums=(2, 3))
quantize_mxfp4 = jax.jit(codecs.quantize_mxfp4)
dequantize_mxfp4 = jax.jit(codecs.dequantize_mxfp4, static_argnums=2)
encode = jax.jit(kv_records.encode_records, static_argnums=1)
decode = jax.jit(kv_records.decode_records, static_argnums=(1, 2))
encode_page = jax.jit(kv_records.encode_page, static_argnums=1)


def test_host_signatures_are_the_published_contract():
    sig = inspect.signature(host.quantize_fp8_blockwise)
    assert list(sig.parameters) == ["w", "block", "scale_fmt"]
    assert sig.parameters["block"].default == (32, 32) and sig.parameters["scale_fmt"].default == "ue8m0"
    assert list(inspect.signature(host.quantize_mxfp4).parameters) == ["w"]
    sig = inspect.signature(host.dequantize_fp8_blockwise)
    assert list(sig.parameters) == ["q", "scale", "block"] and sig.parameters["block"].default == (32, 32)
    assert list(inspect.signature(host.dequantize_mxfp4).parameters) == ["packed", "scale"]


def test_host_output_dtypes_and_shapes():
    w = random_tensor(np.random.default_rng(0), (70, 96))
    q, s = host.quantize_fp8_blockwise(w)
    assert q.dtype == ml_dtypes.float8_e4m3fn and q.shape == (70, 96)
    assert s.dtype == ml_dtypes.float8_e8m0fnu and s.shape == (3, 3)
    _, s3 = host.quantize_fp8_blockwise(w, block=(128, 128), scale_fmt="float32")
    assert s3.dtype == np.float32 and s3.shape == (1, 1)
    packed, scale = host.quantize_mxfp4(w[:, :64])
    assert packed.dtype == np.uint8 and packed.shape == (70, 32)
    assert scale.dtype == ml_dtypes.float8_e8m0fnu and scale.shape == (70, 2)
    assert host.dequantize_fp8_blockwise(q, s).dtype == np.float32
    assert host.dequantize_mxfp4(packed, scale).shape == (70, 64)


def test_host_matches_the_independent_reference():
    rng = np.random.default_rng(1)
    w = random_tensor(rng, (45, 70), spread=8)
    w[2, 3] = np.nan
    for block, fmt in (((32, 32), "ue8m0"), ((128, 128), "float32")):
        q, s = host.quantize_fp8_blockwise(w, block, fmt)
        want_codes, want_scales = fp8_blockwise(w, block, fmt)
        np.testing.assert_array_equal(q.view(np.uint8), want_codes)
        np.testing.assert_array_equal(
            s.view(np.uint8) if fmt == "ue8m0" else bits(s),
            want_scales if fmt == "ue8m0" else bits(want_scales),
        )
    packed, scale = host.quantize_mxfp4(w[:, :64])
    codes, scales = quantize_rows(w[:, :64], "mxfp4")
    np.testing.assert_array_equal(packed, pack_low_first(codes))
    np.testing.assert_array_equal(scale.view(np.uint8), scales)


def _special_tensor(seed: int, shape: tuple[int, int]) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = random_tensor(rng, shape, spread=30)
    flat = x.reshape(-1)
    picks = rng.integers(0, flat.size, size=6)
    flat[picks] = [np.nan, np.inf, -np.inf, 1e-40, -0.0, 0.0]
    x[rng.integers(shape[0])] = 0.0
    return x


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_host_and_jnp_weight_codecs_agree_bit_for_bit(seed):
    w = _special_tensor(seed, (40, 96))
    for block, fmt in (((32, 32), "ue8m0"), ((128, 128), "float32"), ((1, 32), "ue8m0")):
        hq, hs = host.quantize_fp8_blockwise(w, block, fmt)
        jq, js = quantize_fp8(w, block, fmt)
        np.testing.assert_array_equal(np.asarray(jq).view(np.uint8), hq.view(np.uint8))
        np.testing.assert_array_equal(np.asarray(js).view(np.uint8), hs.view(np.uint8))
        np.testing.assert_array_equal(
            bits(np.asarray(dequantize_fp8(jq, js, block, np.float32))),
            bits(host.dequantize_fp8_blockwise(hq, hs, block)),
        )
    hp, hsc = host.quantize_mxfp4(w)
    jp, jsc = quantize_mxfp4(w)
    np.testing.assert_array_equal(np.asarray(jp), hp)
    np.testing.assert_array_equal(np.asarray(jsc).view(np.uint8), hsc.view(np.uint8))
    np.testing.assert_array_equal(
        bits(np.asarray(dequantize_mxfp4(jp, jsc, np.float32))), bits(host.dequantize_mxfp4(hp, hsc))
    )


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_host_and_jnp_records_agree_bit_for_bit(seed):
    x = _special_tensor(seed, (6, 128))
    for fmt in (
        kv_records.window_record_format(128),
        kv_records.compressed_record_format(128),
        kv_records.indexer_record_format(128),
        kv_records.latent_record_format(96, 32),
    ):
        h = host.encode_records(x, fmt)
        np.testing.assert_array_equal(np.asarray(encode(x, fmt)), h)
        np.testing.assert_array_equal(
            bits(np.asarray(decode(h, fmt, np.float32))), bits(host.decode_records(h, fmt))
        )
    page = host.pack_page(
        host.encode_records(x, kv_records.indexer_record_format(128)), kv_records.indexer_record_format(128)
    )
    np.testing.assert_array_equal(page, np.asarray(encode_page(x, kv_records.indexer_record_format(128))))
    np.testing.assert_array_equal(
        host.unpack_page(page, kv_records.indexer_record_format(128), 6),
        host.encode_records(x, kv_records.indexer_record_format(128)),
    )


@pytest.mark.parametrize("scheme", [MXFP8, MXFP4, FP4_E4M3_16], ids=["mxfp8", "mxfp4", "fp4_e4m3"])
def test_host_group_codec_matches_jnp_on_ragged_groups(scheme):
    x = _special_tensor(2, (3, 50))
    hc, hs = host.quantize_groups(x, scheme)
    jq = jax.jit(codecs.quantize_groups, static_argnums=1)(x, scheme)
    np.testing.assert_array_equal(np.asarray(jq.codes), hc)
    np.testing.assert_array_equal(np.asarray(jq.scales), hs)
    deq = jax.jit(codecs.dequantize_groups, static_argnums=(2, 3))(jq.codes, jq.scales, scheme, np.float32)
    np.testing.assert_array_equal(bits(np.asarray(deq)), bits(host.dequantize_groups(hc, hs, scheme)))


def test_host_input_errors_name_the_field():
    with pytest.raises(ValueError, match="w in-dimension must be a multiple of 32 for MXFP4, got 40"):
        host.quantize_mxfp4(np.zeros((2, 40), np.float32))
    with pytest.raises(ValueError, match="scale_fmt must be 'ue8m0' or 'float32'"):
        host.quantize_fp8_blockwise(np.zeros((2, 32), np.float32), scale_fmt="fp32")
    with pytest.raises(TypeError, match="w must be a floating-point array, got dtype int64"):
        host.quantize_fp8_blockwise(np.zeros((2, 32), np.int64))
    with pytest.raises(ValueError, match=r"scale must have shape \(1, 1\)"):
        host.dequantize_fp8_blockwise(
            np.zeros((2, 32), ml_dtypes.float8_e4m3fn), np.zeros((2, 1), np.float32)
        )
    with pytest.raises(TypeError, match=r"scale must be float32 .* got float64"):
        host.dequantize_fp8_blockwise(
            np.zeros((2, 32), ml_dtypes.float8_e4m3fn), np.zeros((1, 1), np.float64)
        )


def test_importing_host_does_not_import_jax():
    code = (
        "import sys\n"
        "import deepinfer_jax.numerics.host as h\n"
        "import numpy as np\n"
        "h.quantize_mxfp4(np.ones((2, 32), np.float32))\n"
        "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith('jax'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
