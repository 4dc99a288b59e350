"""A bfloat16 model of V4 or V4.1 over an unquantised key cache (``kv_cache_dtype="float32"``): the key writes.

The cache then holds plain float values with the precision mode's own cache round trips applied (MXFP8 window,
FP4 compressed and MXFP4 indexer casts, ``numerics.activation.kv_cast``). ``v4_compress_store`` cannot apply such a
cast between its RoPE and its write, so for these stores the paged models pool, normalise and rotate the entries
themselves and write them with ``kv_store_records`` (``paged._compress``, ``paged_v41._compress``); the record cache
goes through ``v4_compress_store``. Every reader decodes a record to the value the cast gives, so the two caches
must hold the same keys after the same writes: the float pages equal the decoded record pages, value for value
(both paths round at the same points; checked: bitwise equal). Only the writes are compiled here (one layer's
compressors over one ragged step), not the whole model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ragged_meta import plan_meta  # tests/ragged_meta.py

import deepinfer_jax
from deepinfer_jax.models.deepseek_v4.attention import CSA, SLIDING
from deepinfer_jax.models.deepseek_v4.paged import V4PagedModel
from deepinfer_jax.models.deepseek_v4.paged_v41 import V41PagedModel, _StepCross

BLOCK, BLOCKS, SLOTS = 16, 8, 3


def _meta():
    """A prefill of 37 tokens from 0 beside a decode at position 47 (completing entries of ratio 1, 2, 4, 16)."""
    return plan_meta([0, 47], [37, 1], 2, 1, [1, 2], [[3, 1, 6], [2, 4, 5, 7]])


@pytest.fixture(scope="module", params=["tiny-v4", "tiny-v41"])
def family(request):
    return request.param, deepinfer_jax.load_model(request.param, "bfloat16")


def _v4_pages(model, cache_dtype: str, layer: int):
    """The pages one V4 layer's compressors write (entries, and for CSA the indexer keys)."""
    paged = V4PagedModel.create(model, block_size=BLOCK, dtype="bfloat16", cache_dtype=cache_dtype)
    spec, p = paged.plan.attention[layer], model.params["layers"][layer]["attn"]
    kv_page, ik_page, ring, index_ring = paged.slots[layer]
    cache = paged.init_cache(BLOCKS, SLOTS)
    meta = _meta()
    rng = np.random.default_rng(layer)
    parts = [(ring, cache.kv[kv_page], paged.compressed, p["compressor"])]
    if spec.kind == CSA:
        parts.append((index_ring, cache.ik[ik_page], paged.indexer, p["indexer"]["compressor"]))
    out = []
    for ring_index, pages, store, cp in parts:
        rings = cache.state[ring_index]
        kv, gate = (
            jnp.asarray(rng.standard_normal((meta.num_tokens, rings[0].shape[-1])), jnp.float32)
            for _ in range(2)
        )

        def write(r, pg, a, g, cp=cp, store=store):
            return paged._compress(r, pg, a, g, cp, spec, meta, store, jnp.bfloat16)[1]

        out.append((store, jax.jit(write)(rings, pages, kv, gate)))
    return out


def _v41_pages(model, cache_dtype: str, layer: int):
    paged = V41PagedModel.create(model, block_size=BLOCK, dtype="bfloat16", cache_dtype=cache_dtype)
    lp, spec, p = paged.layers[layer], paged.static.attention[layer], model.params["layers"][layer]
    c = paged.init_cache(BLOCKS, SLOTS)
    meta = _meta()
    hidden = model.params["embed"].shape[-1]
    x_hat = jnp.asarray(np.random.default_rng(layer).standard_normal((meta.num_tokens, hidden)), jnp.bfloat16)

    def writes(kv, ik, state, x):
        cache = {"kv": list(kv), "ik": list(ik), "state": list(state)}
        _, cache = paged._compressed_writes(p, lp, spec, x, _StepCross(), cache, meta, None)
        return cache["kv"][paged.kv_sources.index(layer)], cache["ik"][paged.index_k_sources.index(layer)]

    kv, ik = jax.jit(writes)(c.kv, c.ik, c.state, x_hat)
    return [(paged.compressed_store, kv), (paged.indexer_store, ik)]


def _pages(name, model, cache_dtype):
    if name == "tiny-v4":
        plan = V4PagedModel.create(model, block_size=BLOCK, dtype="bfloat16", cache_dtype="float32").plan
        kinds = [spec.kind for spec in plan.attention]
        csa = kinds.index(CSA)
        hca = next(i for i, k in enumerate(kinds) if k not in (CSA, SLIDING))
        return _v4_pages(model, cache_dtype, csa) + _v4_pages(model, cache_dtype, hca)
    paged = V41PagedModel.create(model, block_size=BLOCK, dtype="bfloat16", cache_dtype="float32")
    sources = [lp for lp in paged.layers if lp.is_kv_source and lp.is_index_k_source]
    ratio_2 = next(lp.layer for lp in sources if lp.ratio == 2)
    ratio_1 = next(lp.layer for lp in sources if lp.ratio == 1)
    return _v41_pages(model, cache_dtype, ratio_2) + _v41_pages(model, cache_dtype, ratio_1)


def test_float_cache_holds_the_decoded_records(family):
    name, model = family
    plain, records = _pages(name, model, "float32"), _pages(name, model, "quantized")
    assert len(plain) == len(records) >= 3
    for (p_store, p_pages), (r_store, r_pages) in zip(plain, records, strict=True):
        assert not p_store.encodes_in_ops and p_store.cast != "none"  # the chain + plain store path
        assert r_store.encodes_in_ops and r_store.record is not None
        want = np.asarray(r_store.decode(r_pages, jnp.float32))
        got = np.asarray(p_pages, np.float32)
        assert np.abs(want).max() > 0  # entries were written
        np.testing.assert_array_equal(got, want)
