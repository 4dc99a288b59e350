"""The Pallas paged absorbed-MLA kernel (interpret mode) against op ``paged_mla_attention``'s reference.

One ragged batch covers the cases: tokens of different rows at different positions, a one-token row at position 0,
a row whose block table has unused (-1) entries, a padding token (output 0), heads not a multiple of the head
tile, a latent width not a multiple of the value chunk, a block size smaller than the key tile, and a key tile
that ends inside a block. An empty batch returns an empty result without a kernel launch.

Tolerances: float32 caches and queries use float32 IEEE dots in the kernel, so only the summation order differs
(~1e-6 on values of magnitude ~1). bfloat16 queries run the score dots on bf16 operands (exact products) and round
the probabilities to bf16 for the value dot (relative error <= 2^-9 per weight): outputs are averages of values of
magnitude ~1-3, so 1e-2 absolute is a few times that bound, while a wrong key, block or mask shifts them by O(0.1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.cache import paged
from pallas_kernels._attention import AttnTiles
from pallas_kernels.paged_mla import paged_mla_attention as kernel

L, NB, BS, C, R, H = 2, 10, 8, 80, 16, 5  # C = 80: a 64 + 16 chunk split; H = 5: one partial head tile
TILES = AttnTiles(block_h=16, block_k=16, chunk=64)  # block_k 16 > block size 8: keys of two blocks per step


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(5)
    values = rng.standard_normal((L, NB, BS, C + R)).astype(np.float32)
    tables = np.array([[1, 2, -1, -1], [3, 4, 5, 6], [7, -1, -1, -1]], np.int32)
    token_seq = np.array([0, 1, 1, 1, 2, 3], np.int32)  # token 5: padding (row 3 of 3 rows)
    positions = np.array([10, 0, 20, 31, 0, 0], np.int32)
    context = np.array([11, 32, 1], np.int32)
    q_lat = rng.standard_normal((6, H, C)).astype(np.float32)
    q_pe = rng.standard_normal((6, H, R)).astype(np.float32)
    return values, tables, token_seq, positions, context, q_lat, q_pe


def _run(fn, cache, q_lat, q_pe, b, **kw):
    _, tables, token_seq, positions, context, _, _ = b
    return np.asarray(
        fn(q_lat, q_pe, cache, 1, token_seq, positions, tables, context, scale=0.15, **kw), np.float32
    )


@pytest.mark.parametrize(
    ("storage", "q_dtype", "atol"), [("float32", jnp.float32, 2e-6), ("bfloat16", jnp.bfloat16, 1e-2)]
)
def test_float_caches_match_the_reference(batch, storage, q_dtype, atol):
    values, *_, q_lat, q_pe = batch
    cache = jnp.asarray(values, storage)
    ql, qp = jnp.asarray(q_lat, q_dtype), jnp.asarray(q_pe, q_dtype)
    want = _run(paged.paged_mla_attention, cache, ql, qp, batch)
    got = _run(kernel, cache, ql, qp, batch, tiles=TILES, interpret=True)
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)
    assert (got[5] == 0).all() and np.abs(got[:5]).min(axis=-1).max() > 0  # padding gives 0; real rows do not


def test_fp8_latent_cache_matches_the_reference(batch):
    values, *_, q_lat, q_pe = batch
    cache = paged.encode_latent_fp8(jnp.asarray(values), C)
    ql, qp = jnp.asarray(q_lat, jnp.bfloat16), jnp.asarray(q_pe, jnp.bfloat16)
    want = _run(paged.paged_mla_attention, cache, ql, qp, batch)
    got = _run(kernel, cache, ql, qp, batch, tiles=TILES, interpret=True)
    # the kernel applies each 128-group's float32 scale to the partial dot instead of each element: same products,
    # other rounding; bf16 probabilities as above
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-2)
    # and the FP8 cache is what it claims: the reference over it equals the reference over its decoded values
    decoded = paged.decode_latent_fp8(cache, C, R)
    np.testing.assert_allclose(want, _run(paged.paged_mla_attention, decoded, ql, qp, batch), atol=1e-6)


def test_one_token_and_empty_batches(batch):
    values, tables, *_ = batch
    cache = jnp.asarray(values)
    rng = np.random.default_rng(6)
    ql = jnp.asarray(rng.standard_normal((1, H, C)), jnp.float32)
    qp = jnp.asarray(rng.standard_normal((1, H, R)), jnp.float32)
    args = (cache, 0, np.array([1], np.int32), np.array([0], np.int32), tables, np.array([0, 1, 0], np.int32))
    want = paged.paged_mla_attention(ql, qp, *args, scale=0.2)
    got = kernel(ql, qp, *args, scale=0.2, interpret=True)
    # a single key: the output is exactly that key's latent (softmax weight 1)
    np.testing.assert_allclose(np.asarray(got)[0], np.broadcast_to(values[0, 3, 0, :C], (H, C)), atol=1e-6)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
    empty = kernel(ql[:0], qp[:0], cache, 0, *(a[:0] for a in args[2:4]), tables, args[5], scale=0.2)
    assert empty.shape == (0, H, C)


def test_a_traced_layer_reads_that_layer(batch):
    """Inside a scanned run of layers the layer index is traced: the kernel reads it as an operand. Each layer of
    a ``lax.scan`` over both layers gives the reference's result for that static layer (the two layers hold
    different values, so reading the wrong one fails)."""
    values, tables, token_seq, positions, context, q_lat, q_pe = batch
    cache = jnp.asarray(values)

    def one(layer, fn, **kw):
        return fn(q_lat, q_pe, cache, layer, token_seq, positions, tables, context, scale=0.15, **kw)

    scanned = jax.jit(
        lambda: jax.lax.scan(
            lambda c, i: (c, one(i, kernel, tiles=TILES, interpret=True)), 0, jnp.arange(L, dtype=jnp.int32)
        )[1]
    )()
    for layer in range(L):
        want = np.asarray(one(layer, paged.paged_mla_attention))
        np.testing.assert_allclose(np.asarray(scanned[layer]), want, rtol=0, atol=2e-6)
    assert np.abs(np.asarray(scanned[0]) - np.asarray(scanned[1]))[:5].max() > 0.1


def test_refuses_mismatched_caches(batch):
    values, tables, token_seq, positions, context, q_lat, q_pe = batch
    with pytest.raises(ValueError, match="width"):
        kernel(q_lat, q_pe, jnp.zeros((L, NB, BS, C)), 0, token_seq, positions, tables, context, scale=1.0)
    with pytest.raises(ValueError, match="layer"):
        kernel(q_lat, q_pe, jnp.asarray(values), 2, token_seq, positions, tables, context, scale=1.0)


@pytest.mark.parametrize("storage", ["bfloat16", "fp8"])
def test_exports_for_cuda_at_v3_shape(triton_calls, storage):
    s = jax.ShapeDtypeStruct
    width = paged.fp8_latent_record_bytes(512, 64) if storage == "fp8" else 576
    cache = s((61, 1024, 64, width), jnp.uint8 if storage == "fp8" else jnp.bfloat16)

    def f(ql, qp, c, ts, pos, bt, ctx):
        return kernel(ql, qp, c, 3, ts, pos, bt, ctx, scale=0.1)

    i32 = jnp.int32
    specs = (s((8, 128, 512), jnp.bfloat16), s((8, 128, 64), jnp.bfloat16), cache)
    specs += (s((8,), i32), s((8,), i32), s((8, 256), i32), s((8,), i32))
    assert triton_calls(f, *specs) == 1
