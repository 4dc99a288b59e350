"""C++ XLA FFI dequantisers: built with g++, bit-exact against the numpy codecs under jit and vmap, exported.

The numpy codecs of :mod:`deepinfer_jax.numerics.host` are the reference; results are compared as float32 bit
patterns (NaN positions compared separately), so a flushed subnormal, a lost sign of zero or a rounding slip
fails. The CUDA variant is only compiled (for sm_90a and sm_100a) and exported, never run.
"""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from custom_calls import ffi
from custom_calls.ffi import build as ffi_build
from deepinfer_jax.numerics import host

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None, reason="g++ is not on PATH: cannot build the FFI library"
)


@pytest.fixture(scope="module", autouse=True)
def library():
    return ffi.load()  # builds custom_calls/ffi/build/libdeepinfer_dequant.so when missing or stale


def assert_same_bits(got, want) -> None:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.fixture(scope="module")
def rng() -> np.random.Generator:
    return np.random.default_rng(7)


def test_library_is_built_in_the_build_folder(library):
    assert library.name == ffi_build.CPU_LIBRARY and library.stat().st_size > 0
    assert library.parent == ffi_build.DEFAULT_BUILD_DIR


def test_every_e4m3_code_and_ue8m0_byte_decodes_like_numpy():
    # All 256 codes against all 256 scale bytes: subnormal codes, NaN codes, the subnormal 2^-127 scale, the NaN
    # scale, overflow to infinity and flush to zero all occur.
    codes = np.tile(np.arange(256, dtype=np.uint8), (256, 1))
    scale = np.arange(256, dtype=np.uint8).reshape(256, 1)
    got = jax.jit(lambda c, s: ffi.fp8_block_dequantize(c, s, block=(1, 256)))(codes, scale)
    with np.errstate(over="ignore"):
        want = host.dequantize_fp8_blockwise(codes, scale, (1, 256))
    assert_same_bits(got, want)


def test_fp8_float32_scale_inv_and_edge_tiles(rng):
    w = rng.standard_normal((130, 200)).astype(np.float32) * 3
    q, s = host.quantize_fp8_blockwise(w, (128, 128), "float32")
    s[0, 1] = 1e-37  # products below the normal range: flushed to signed zeros
    got = jax.jit(lambda q, s: ffi.fp8_block_dequantize(q, s, block=(128, 128)))(q, s)
    assert_same_bits(got, host.dequantize_fp8_blockwise(q, s, (128, 128)))


def test_mxfp4_every_byte_and_scale_decodes_like_numpy(rng):
    packed = np.tile(np.arange(256, dtype=np.uint8), (16, 2))  # every nibble pair, 1024 elements per row
    scale = rng.integers(0, 256, (16, 32), dtype=np.uint8)
    scale[0, :2] = (0, 255)
    got = jax.jit(ffi.mxfp4_dequantize)(packed, scale)
    with np.errstate(over="ignore"):
        assert_same_bits(got, host.dequantize_mxfp4(packed, scale))


def test_vmap_over_experts_matches_the_batched_numpy_codec(rng):
    w = rng.standard_normal((3, 40, 64)).astype(np.float32) * np.exp2(rng.integers(-30, 30, (3, 1, 1)))
    q, s = host.quantize_fp8_blockwise(w, (32, 32))
    got = jax.jit(jax.vmap(lambda a, b: ffi.fp8_block_dequantize(a, b, block=(32, 32))))(q, s)
    assert_same_bits(got, host.dequantize_fp8_blockwise(q, s, (32, 32)))

    packed, scale = host.quantize_mxfp4(w)
    got = jax.jit(jax.vmap(ffi.mxfp4_dequantize, in_axes=(0, None)))(packed, np.asarray(scale[0]))
    want = np.stack([host.dequantize_mxfp4(p, scale[0]) for p in packed])
    assert_same_bits(got, want)


@settings(max_examples=15, deadline=None)
@given(
    batch=st.integers(0, 2),
    rows=st.integers(1, 70),
    cols=st.integers(1, 70),
    b0=st.sampled_from([1, 16, 32, 128]),
    b1=st.sampled_from([1, 32, 128]),
    seed=st.integers(0, 2**31 - 1),
)
def test_fp8_any_shape_and_block_matches_numpy(batch, rows, cols, b0, b1, seed):
    r = np.random.default_rng(seed)
    lead = (2,) * batch
    codes = r.integers(0, 256, (*lead, rows, cols), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    scale = r.integers(100, 150, (*lead, -(-rows // b0), -(-cols // b1)), dtype=np.uint8)
    got = ffi.fp8_block_dequantize(codes, scale.view(ml_dtypes.float8_e8m0fnu), block=(b0, b1))
    assert_same_bits(got, host.dequantize_fp8_blockwise(codes, scale, (b0, b1)))


def test_export_for_cpu_round_trips_and_names_the_targets(rng):
    spec = (jax.ShapeDtypeStruct((4, 64), jnp.uint8), jax.ShapeDtypeStruct((2, 2), jnp.uint8))
    fn = jax.jit(lambda c, s: ffi.fp8_block_dequantize(c, s, block=(2, 32)))
    exp = jax.export.export(fn, disabled_checks=ffi.export_disabled_checks())(*spec)
    assert f"custom_call @{ffi.FP8_TARGET}" in exp.mlir_module()
    restored = jax.export.deserialize(exp.serialize())
    codes = rng.integers(0, 256, (4, 64), dtype=np.uint8)
    scale = rng.integers(110, 140, (2, 2), dtype=np.uint8)
    assert_same_bits(restored.call(codes, scale), host.dequantize_fp8_blockwise(codes, scale, (2, 32)))
    with pytest.raises(ValueError, match="custom call"):  # the safety check is real: it needs the opt-out
        jax.export.export(fn)(*spec)


def test_host_fast_paths_equal_the_numpy_codecs(rng):
    w = rng.standard_normal((70, 96)).astype(np.float32)
    q, s = host.quantize_fp8_blockwise(w, (32, 32))
    assert_same_bits(ffi.host_fp8_block_dequantize(q, s, (32, 32)), host.dequantize_fp8_blockwise(q, s))
    packed, scale = host.quantize_mxfp4(w)
    assert_same_bits(ffi.host_mxfp4_dequantize(packed, scale), host.dequantize_mxfp4(packed, scale))


def test_bad_operands_are_refused_with_the_field_named():
    codes = np.zeros((4, 64), np.uint8)
    with pytest.raises(ValueError, match=r"scale must have shape \(1, 2\)"):
        ffi.fp8_block_dequantize(codes, np.zeros((2, 2), np.uint8), block=(32, 32))
    with pytest.raises(ValueError, match="block must be a pair"):
        ffi.fp8_block_dequantize(codes, np.zeros((1, 2), np.uint8), block=(32,))
    with pytest.raises(TypeError, match="codes must have an 8-bit storage dtype"):
        ffi.fp8_block_dequantize(codes.astype(np.float32), np.zeros((1, 2), np.uint8))
    with pytest.raises(ValueError, match="a multiple of 32"):
        ffi.mxfp4_dequantize(np.zeros((4, 8), np.uint8), np.zeros((4, 0), np.uint8))
    with pytest.raises(FileNotFoundError, match="no such file"):
        ffi.load_cuda("does/not/exist.so")


def test_build_commands_follow_the_notes(tmp_path):
    cmd = ffi_build.cpu_command(tmp_path / "lib.so")
    assert cmd[:5] == ["g++", "-O2", "-std=c++17", "-shared", "-fPIC"]
    cuda = ffi_build.cuda_command(tmp_path / "lib.so")
    assert "arch=compute_90a,code=sm_90a" in cuda and "arch=compute_100a,code=sm_100a" in cuda
    with pytest.raises(ValueError, match="CUDA architecture"):
        ffi_build.cuda_command(tmp_path / "lib.so", archs=["hopper"])
    with pytest.raises(FileNotFoundError, match="not found on PATH"):
        ffi_build.build_cpu(tmp_path, compiler="no-such-compiler-xyz")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) is not on PATH")
def test_cuda_variant_compiles_for_sm90a_and_sm100a_and_exports():
    lib = ffi_build.build_cuda()
    data = lib.read_bytes()
    assert data[:4] == b"\x7fELF"
    for arch in (b"sm_90a", b"sm_100a"):  # the fatbinary records each embedded cubin's architecture
        assert arch in data, f"{arch.decode()} code missing from {lib.name}"
    assert ffi.load_cuda(lib) == lib
    spec = (jax.ShapeDtypeStruct((8, 64), jnp.uint8), jax.ShapeDtypeStruct((8, 4), jnp.uint8))
    exp = jax.export.export(
        jax.jit(ffi.mxfp4_dequantize), platforms=["cuda"], disabled_checks=ffi.export_disabled_checks()
    )(*spec)
    assert f"custom_call @{ffi.MXFP4_TARGET}" in exp.mlir_module()
