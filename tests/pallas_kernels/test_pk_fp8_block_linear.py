"""The Pallas FP8 block-scaled GEMM in interpret mode against the reference op, and its CUDA export."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.numerics import host
from deepinfer_jax.ops.gemm import fp8_block_linear as reference
from pallas_kernels._common import Tiles, pick_tiles
from pallas_kernels.fp8_block_linear import TILES, fp8_block_linear

# Small tiles keep interpret mode to a few dozen grid steps (about 0.1 ms each) while still covering edge tiles.
SMALL = Tiles(block_t=16, block_n=32, block_k=32)


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(10)
    w = rng.standard_normal((72, 100)).astype(np.float32)  # N = 72, K = 100: ragged edge tiles both ways
    q, s = host.quantize_fp8_blockwise(w, (32, 32))
    x = rng.standard_normal((37, 100)).astype(np.float32)  # T = 37: a partial last row tile
    return x, q, s


@pytest.mark.parametrize("cast", ["none", "mxfp8"])
def test_matches_reference_float32(case, cast):
    x, q, s = case
    want = reference(x, q, s, activation_cast=cast, out_dtype=jnp.float32)
    got = fp8_block_linear(x, q, s, activation_cast=cast, out_dtype=jnp.float32, tiles=SMALL, interpret=True)
    # same products, different summation order (per 32-wide k step vs one dot): float32 rounding of K = 100
    # terms of magnitude <= ~40 is below 1e-4; a wrong scale or edge mask is off by O(1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


def test_matches_reference_bf16_bytes_and_v3_scales():
    rng = np.random.default_rng(11)
    w = rng.standard_normal((40, 160)).astype(np.float32)
    q, s = host.quantize_fp8_blockwise(w, (128, 128), scale_fmt="float32")
    x = jnp.asarray(rng.standard_normal((5, 160)), jnp.bfloat16)
    kw = dict(block=(128, 128), activation_cast="fp8_token_128")
    want = reference(x, q, s, **kw)
    got = fp8_block_linear(x, q.view(np.uint8), s, tiles=SMALL, interpret=True, **kw)
    assert got.dtype == jnp.bfloat16 and got.shape == (5, 40)
    # both round a float32 accumulator to bf16 once; summation order may flip that rounding by one bf16 ulp
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2**-7, atol=1e-2
    )


def test_nan_scale_poisons_its_block_only(case):
    x, q, s = case
    s_bytes = s.view(np.uint8).copy()
    s_bytes[1, 0] = 0xFF  # rows 32..63, columns 0..31
    got = np.asarray(fp8_block_linear(x, q, s_bytes, out_dtype=jnp.float32, tiles=SMALL, interpret=True))
    assert np.isnan(got[:, 32:64]).all() and np.isfinite(got[:, :32]).all() and np.isfinite(got[:, 64:]).all()


def test_tile_table_is_keyed_by_rows_and_shrinks_to_the_problem():
    assert pick_tiles(TILES, 8, 4096, 4096).block_t == 16
    assert pick_tiles(TILES, 4096, 4096, 4096) == TILES[-1][1]
    assert pick_tiles(TILES, 3, 40, 20) == Tiles(16, 64, 32, TILES[0][1].num_warps, TILES[0][1].num_stages)
    with pytest.raises(ValueError, match="power of two"):
        Tiles(block_t=24, block_n=32, block_k=32)


def test_refuses_bad_input(case):
    x, q, s = case
    with pytest.raises(ValueError, match="scale must have shape"):
        fp8_block_linear(x, q, s[:1], interpret=True)
    with pytest.raises(ValueError, match="activation_cast = 'mxfp4'"):
        fp8_block_linear(x, q, s, activation_cast="mxfp4", interpret=True)


def test_exports_for_cuda_with_a_triton_call(case, triton_calls):
    x, q, s = case
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x.astype(jnp.bfloat16), q.view(np.uint8), s)]
    assert triton_calls(lambda a, b, c: fp8_block_linear(a, b, c, activation_cast="mxfp8"), *specs) == 1
