"""The Pallas V4 sink-attention kernels (interpret mode) against the references of ``v4_sparse_attention`` and
``v4_sink_attention``, and their CUDA export at V4.1-Flash shapes.

The batch mixes the edge cases: a token with no key at all (output 0, the sink takes everything), tokens with
only window keys, only compressed keys, ragged masks, ``-1`` slots, a head count that is not a multiple of the head
tile, a width that is not a multiple of the value chunk (D = 96) and key counts that end inside a key tile.

Tolerances: float32 queries run float32 IEEE dots (summation order only, ~1e-6 on O(1) outputs); bfloat16
queries give bfloat16 outputs, where one ulp at magnitude ~1 is 2^-7, so 2^-6 allows the flash-style bf16
probabilities on top of the final rounding; a wrong key, scale byte or mask changes outputs by O(0.1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.models.deepseek_v4.attention import sink_attention
from deepinfer_jax.numerics import kv_records as kr
from deepinfer_jax.ops import sparse_attention as ref
from pallas_kernels import sparse_attention as kern
from pallas_kernels._attention import AttnTiles

T, H, D, W, NB, E, K = 5, 5, 96, 12, 6, 4, 7
TILES = AttnTiles(block_h=16, block_k=16, chunk=64)


def _case(rng, wf, cf):
    wv = rng.standard_normal((T, W, D)).astype(np.float32)
    pv = rng.standard_normal((NB, E, D)).astype(np.float32)
    window = (
        wv if wf is None else np.asarray(kr.encode_records(jnp.asarray(wv), ref.key_record_format(wf, D)))
    )
    pages = pv if cf is None else np.asarray(kr.encode_records(jnp.asarray(pv), ref.key_record_format(cf, D)))
    mask = rng.random((T, W)) < 0.6
    slots = rng.integers(-1, NB * E, (T, K)).astype(np.int32)
    mask[0], slots[0] = False, -1  # nothing to attend
    mask[1] = False  # compressed keys only
    slots[2] = -1  # window keys only
    return window, mask, pages, slots


@pytest.mark.parametrize(
    ("q_dtype", "wf", "cf", "atol"),
    [
        (jnp.float32, None, None, 2e-6),
        (jnp.float32, "mxfp8", "mxfp8", 2e-6),
        (jnp.bfloat16, "mxfp8", "fp4", 2**-6),
    ],
)
def test_sparse_attention_matches_the_reference(q_dtype, wf, cf, atol):
    rng = np.random.default_rng(20)
    window, mask, pages, slots = _case(rng, wf, cf)
    q = jnp.asarray(rng.standard_normal((T, H, D)), q_dtype)
    sinks = jnp.asarray(rng.standard_normal(H), jnp.float32)
    kw = dict(scale=0.125, window_format=wf, compressed_format=cf)
    want = ref.v4_sparse_attention(q, window, mask, sinks, pages, slots, **kw)
    got = kern.v4_sparse_attention(q, window, mask, sinks, pages, slots, tiles=TILES, interpret=True, **kw)
    assert got.dtype == want.dtype == q_dtype
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)
    assert (got[0] == 0).all() and (np.abs(got[1:]).max(axis=(1, 2)) > 0.05).all()


def test_window_only_and_empty_batches():
    rng = np.random.default_rng(21)
    window, mask, _, _ = _case(rng, "mxfp8", None)
    q = jnp.asarray(rng.standard_normal((T, H, D)), jnp.float32)
    sinks = jnp.zeros((H,), jnp.float32)
    kw = dict(scale=0.2, window_format="mxfp8")
    want = ref.v4_sparse_attention(q, window, mask, sinks, **kw)
    got = kern.v4_sparse_attention(q, window, mask, sinks, tiles=TILES, interpret=True, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-6)
    empty = kern.v4_sparse_attention(q[:0], window[:0], mask[:0], sinks, interpret=True, **kw)
    assert empty.shape == (0, H, D)


def test_dense_sink_attention_matches_the_model_op():
    rng = np.random.default_rng(22)
    b, s, t = 2, 3, 9
    q = jnp.asarray(rng.standard_normal((b, s, H, D)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((b, t, D)), jnp.float32)
    mask = jnp.asarray(np.tril(np.ones((s, t), bool), k=t - s)[None].repeat(b, 0))
    sinks = jnp.asarray(rng.standard_normal(H), jnp.float32)
    want = sink_attention(q, kv, mask, sinks, scale=0.1)
    got = kern.v4_sink_attention(q, kv, mask, sinks, scale=0.1, tiles=TILES, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-6)


def test_exports_for_cuda_at_v41_flash_shape(triton_calls):
    s = jax.ShapeDtypeStruct
    tokens, heads, dim = 64, 64, 512

    def f(q, window, mask, sinks, pages, slots):
        return kern.v4_sparse_attention(
            q,
            window,
            mask,
            sinks,
            pages,
            slots,
            scale=dim**-0.5,
            window_format="mxfp8",
            compressed_format="fp4",
        )

    specs = (
        s((tokens, heads, dim), jnp.bfloat16),
        s((tokens, 128, 528), jnp.uint8),
        s((tokens, 128), jnp.bool_),
        s((heads,), jnp.float32),
        s((4096, 64, 288), jnp.uint8),
        s((tokens, 512), jnp.int32),
    )
    assert triton_calls(f, *specs) == 1
    dense = (s((1, 16, heads, dim), jnp.bfloat16), s((1, 16, dim), jnp.bfloat16), s((1, 16, 16), jnp.bool_))
    assert (
        triton_calls(lambda q, kv, m, sk: kern.v4_sink_attention(q, kv, m, sk, scale=0.1), *dense, specs[3])
        == 1
    )
