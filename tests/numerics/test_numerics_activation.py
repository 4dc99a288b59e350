"""Activation round trips (§12.2, §12.4, §16) and the precision-mode switch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _numerics_ref import bits, dequantize_rows, e4m3_codes, flush, quantize_rows, random_tensor

from deepinfer_jax.numerics import activation
from deepinfer_jax.numerics.activation import CastPolicy

cast = jax.jit(activation.activation_cast, static_argnums=(1, 2))
kv_cast = jax.jit(activation.kv_cast, static_argnums=1)


def _ref_v3_token_block(x: np.ndarray, block: int) -> np.ndarray:
    """E4M3 with float32 scale max(amax, 1e-4)/448 per token per block (ragged last block), dequantised."""
    out = np.zeros_like(x)
    for r in range(x.shape[0]):
        for j in range(0, x.shape[1], block):
            v = flush(x[r, j : j + block])
            s = np.float32(max(float(np.abs(v).max()), 1e-4)) / np.float32(448.0)
            codes = e4m3_codes((v / s).astype(np.float32))
            vals = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
            out[r, j : j + block] = flush((vals * np.float64(s)).astype(np.float32))
    return out


@pytest.mark.parametrize(("kind", "scheme"), [("mxfp8", "mxfp8")])
def test_mxfp8_gemm_input_cast_matches_reference(kind, scheme):
    x = random_tensor(np.random.default_rng(0), (5, 96), spread=10)
    want = dequantize_rows(*quantize_rows(x, scheme), scheme)
    np.testing.assert_array_equal(bits(np.asarray(cast(x, kind, 128))), bits(want))


def test_v3_per_token_per_128_cast_matches_reference_including_a_ragged_block():
    x = random_tensor(np.random.default_rng(1), (4, 200), spread=6)
    got = np.asarray(cast(x, "fp8_token_block", 128))
    np.testing.assert_array_equal(bits(got), bits(_ref_v3_token_block(x, 128)))
    # The scale is amax/448, not a power of two: each block's amax element comes back (almost) exactly.
    amax_pos = np.abs(x[:, :128]).argmax(axis=1)
    np.testing.assert_allclose(got[np.arange(4), amax_pos], x[np.arange(4), amax_pos], rtol=2e-7)


@pytest.mark.parametrize(
    ("kind", "scheme"), [("mxfp8", "mxfp8"), ("fp4_e4m3", "fp4_e4m3"), ("mxfp4", "mxfp4")]
)
def test_kv_casts_match_reference(kind, scheme):
    x = random_tensor(np.random.default_rng(2), (3, 128), spread=10)
    want = dequantize_rows(*quantize_rows(x, scheme), scheme)
    np.testing.assert_array_equal(bits(np.asarray(kv_cast(x, kind))), bits(want))


def test_casts_keep_the_input_dtype_and_none_is_the_identity():
    x = jnp.asarray(random_tensor(np.random.default_rng(3), (2, 64)), jnp.bfloat16)
    for kind in activation.ACTIVATION_CAST_KINDS:
        assert cast(x, kind, 128).dtype == jnp.bfloat16
    for kind in activation.KV_CAST_KINDS:
        assert kv_cast(x, kind).dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(activation.activation_cast(x, "none")), np.asarray(x))
    # MXFP8 values (4 significant bits times a power of two) are exact in bf16: the cast is idempotent.
    once = cast(x, "mxfp8", 128)
    np.testing.assert_array_equal(
        np.asarray(cast(once, "mxfp8", 128), np.float32), np.asarray(once, np.float32)
    )


def test_cast_kind_errors():
    with pytest.raises(
        ValueError,
        match=r"activation cast kind must be one of \('none', 'mxfp8', 'fp8_token_block'\), got 'fp8'",
    ):
        activation.activation_cast(np.zeros((1, 32), np.float32), "fp8")
    with pytest.raises(ValueError, match="KV cast kind must be one of"):
        activation.kv_cast(np.zeros((1, 32), np.float32), "int8")
    with pytest.raises(ValueError, match="block must be a positive int, got 0"):
        activation.fp8_token_block_cast(np.zeros((1, 32), np.float32), block=0)
    with pytest.raises(TypeError, match="x must be a floating-point array, got dtype int32"):
        activation.mxfp8_cast(np.zeros((1, 32), np.int32))


def test_cast_policy_for_each_precision_mode():
    for family in ("deepseek_v3", "deepseek_v4", "deepseek_v41"):
        assert CastPolicy.for_mode(family, "float32") == CastPolicy()
    v41 = CastPolicy.for_mode("deepseek_v41", "bfloat16")
    assert v41 == CastPolicy("mxfp8", "mxfp8", "fp4_e4m3", "mxfp4", "mxfp8")
    assert CastPolicy.for_mode("deepseek_v4", "bfloat16", use_fp4_sparse_kv=False).compressed_keys == "mxfp8"
    assert CastPolicy.for_mode("deepseek_v3", "bfloat16") == CastPolicy(gemm_input="fp8_token_block")
    with pytest.raises(ValueError, match=r"family must be one of .* got 'llama'"):
        CastPolicy.for_mode("llama", "bfloat16")
    with pytest.raises(ValueError, match=r"dtype must be one of .* got 'float16'"):
        CastPolicy.for_mode("deepseek_v41", "float16")
    with pytest.raises(ValueError, match=r"CastPolicy\.window_keys must be one of"):
        CastPolicy(window_keys="fp8")  # type: ignore[arg-type]


def test_cast_policy_applies_its_switches():
    x = random_tensor(np.random.default_rng(4), (2, 64))
    prod = CastPolicy.for_mode("deepseek_v41", "bfloat16")
    parity = CastPolicy.for_mode("deepseek_v41", "float32")
    np.testing.assert_array_equal(np.asarray(parity.cast_gemm_input(x)), x)
    np.testing.assert_array_equal(np.asarray(parity.cast_indexer(x)), x)
    got = jax.jit(lambda x: (prod.cast_gemm_input(x), prod.cast_compressed_keys(x), prod.cast_indexer(x)))(x)
    np.testing.assert_array_equal(bits(np.asarray(got[0])), bits(np.asarray(cast(x, "mxfp8", 128))))
    np.testing.assert_array_equal(bits(np.asarray(got[1])), bits(np.asarray(kv_cast(x, "fp4_e4m3"))))
    np.testing.assert_array_equal(bits(np.asarray(got[2])), bits(np.asarray(kv_cast(x, "mxfp4"))))
