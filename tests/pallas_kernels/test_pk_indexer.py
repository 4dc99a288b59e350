"""The lightning indexer: the streaming top-k of op ``v4_indexer_topk`` (reference and Pallas kernel, interpret
mode) against an independent dense numpy selection, and the dense ``v4_indexer_scores`` kernel.

The dense reference scores every visible entry of every token in float64 and takes the top-k with numpy's stable
sort (ties to the lower index), which is what one ``lax.top_k`` over the whole row does. The batch has a row with
an unallocated page inside its context, a row shorter than ``k`` (-1 padding), a padding token (limit 0), chunk
boundaries inside a row, and candidate blocks. Scores are well separated at float32 (continuous random values), so
the selection is exact; with bfloat16 scores many entries tie and the tie order is checked too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.cache.paged_walk import topk_entries
from deepinfer_jax.models.deepseek_v4.compressor import indexer_scores
from deepinfer_jax.numerics import kv_records as kr
from deepinfer_jax.numerics.formats import mxfp4_record_format
from deepinfer_jax.ops import indexer as ref
from pallas_kernels import indexer as kern

T, HI, DI, NB, E, K = 5, 3, 64, 10, 4, 6
TABLES = np.array([[1, 2, -1, 3], [4, 5, 6, 7], [8, 9, -1, -1]], np.int32)
ROWS = np.array([0, 1, 2, 1, 0], np.int32)
LIMIT = np.array([16, 13, 3, 9, 0], np.int32)  # token 4: padding


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(30)
    vals = rng.standard_normal((NB, E, DI)).astype(np.float32)
    pages = np.asarray(kr.encode_records(jnp.asarray(vals), mxfp4_record_format(DI)))
    keys = np.asarray(kr.decode_records(jnp.asarray(pages), mxfp4_record_format(DI)), np.float64)
    q = rng.standard_normal((T, HI, DI)).astype(np.float32)
    w = rng.random((T, HI)).astype(np.float32)
    return pages, keys, q, w


def _dense(keys, q, w, allowed_extra=None, dtype=np.float32):
    scores = np.full((T, TABLES.shape[1] * E), -np.inf)
    for t in range(T):
        for j in range(scores.shape[1]):
            b = TABLES[ROWS[t], j // E]
            ok = j < LIMIT[t] and b >= 0 and (allowed_extra is None or allowed_extra[t, j])
            if ok:
                s = np.maximum(q[t].astype(np.float64) @ keys[b, j % E], 0) @ w[t].astype(np.float64)
                scores[t, j] = float(jnp.asarray(s, jnp.float32).astype(dtype).astype(jnp.float32))
    order = np.argsort(-scores, axis=1, kind="stable")[:, :K]
    top = np.take_along_axis(scores, order, axis=1)
    return np.where(np.isfinite(top), order, -1), scores


# 3: a chunk boundary inside rows; 8: a chunk wider than every context (pages past the longest are not scored);
# None: the default, capped at the table's 4 pages.
@pytest.mark.parametrize("chunk_pages", [1, 3, 8, None])
def test_streaming_topk_equals_the_dense_selection(case, chunk_pages):
    pages, keys, q, w = case
    want, _ = _dense(keys, q, w)
    args = (q, w, pages, TABLES, ROWS, LIMIT)
    kw = dict(k=K, key_format="mxfp4", chunk_pages=chunk_pages)
    np.testing.assert_array_equal(np.asarray(ref.v4_indexer_topk(*args, **kw)), want)
    np.testing.assert_array_equal(np.asarray(kern.v4_indexer_topk(*args, interpret=True, **kw)), want)


def test_bf16_scores_tie_like_one_dense_top_k(case):
    pages, keys, q, w = case
    want, scores = _dense(keys, q, w, dtype=jnp.bfloat16)
    args = (q, w, pages, TABLES, ROWS, LIMIT)
    kw = dict(k=K, key_format="mxfp4", score_dtype=jnp.bfloat16, chunk_pages=1)
    np.testing.assert_array_equal(np.asarray(ref.v4_indexer_topk(*args, **kw)), want)
    np.testing.assert_array_equal(np.asarray(topk_entries(jnp.asarray(scores, jnp.float32), K)), want)
    got = np.asarray(kern.v4_indexer_topk(*args, interpret=True, **kw))
    # the kernel's float32 sums may round to the other bf16 neighbour at a rounding boundary: every pick must
    # score (in bf16) at least the reference's k-th score, and the sets agree wherever no tie straddles it
    for t in range(T):
        picked = got[t][got[t] >= 0]
        assert len(picked) == (want[t] >= 0).sum()
        if len(picked):
            kth = scores[t, want[t][want[t] >= 0][-1]]
            assert (scores[t, picked] >= kth - abs(kth) * 2**-7).all()


def test_candidate_blocks_restrict_the_competition(case):
    pages, keys, q, w = case
    cand = np.zeros((T, 8), bool)
    cand[:, ::2] = True  # candidate blocks of 2 entries: entries 0-1, 4-5, 8-9, 12-13
    extra = np.repeat(cand, 2, axis=1)
    want, _ = _dense(keys, q, w, allowed_extra=extra)
    args = (q, w, pages, TABLES, ROWS, LIMIT)
    kw = dict(k=K, key_format="mxfp4", candidates=cand, candidate_block_size=2, chunk_pages=2)
    np.testing.assert_array_equal(np.asarray(ref.v4_indexer_topk(*args, **kw)), want)
    np.testing.assert_array_equal(np.asarray(kern.v4_indexer_topk(*args, interpret=True, **kw)), want)


def test_dense_scores_kernel_matches_the_model_op():
    rng = np.random.default_rng(31)
    q = jnp.asarray(rng.standard_normal((2, 3, HI, DI)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((2, 21, DI)), jnp.float32)
    w = jnp.asarray(rng.random((2, 3, HI)), jnp.float32)
    got = np.asarray(kern.v4_indexer_scores(q, keys, w, interpret=True))
    # float32 IEEE dots in both, different summation order: ~1e-6 relative on sums of magnitude ~10
    np.testing.assert_allclose(got, np.asarray(indexer_scores(q, keys, w)), rtol=1e-5, atol=1e-5)


def test_arguments_are_checked(case):
    pages, _, q, w = case
    with pytest.raises(ValueError, match="index_topk"):
        ref.v4_indexer_topk(q, w, pages, TABLES, ROWS, LIMIT, k=0)
    with pytest.raises(ValueError, match="go together"):
        kern.v4_indexer_topk(q, w, pages, TABLES, ROWS, LIMIT, k=2, candidates=np.ones((T, 2), bool))


def test_exports_for_cuda_at_v41_flash_shape(triton_calls):
    s = jax.ShapeDtypeStruct
    i32 = jnp.int32

    def f(q, w, pages, bt, rows, limit):
        return kern.v4_indexer_topk(
            q, w, pages, bt, rows, limit, k=512, key_format="mxfp4", score_dtype=jnp.bfloat16
        )

    specs = (s((64, 32, 128), jnp.bfloat16), s((64, 32), jnp.float32), s((4097, 64, 68), jnp.uint8))
    specs += (s((64, 1024), i32), s((64,), i32), s((64,), i32))
    assert triton_calls(f, *specs) == 1  # one kernel, called once per streaming step
    dense = (s((1, 4, 32, 128), jnp.bfloat16), s((1, 256, 128), jnp.bfloat16), s((1, 4, 32), jnp.float32))
    assert triton_calls(kern.v4_indexer_scores, *dense) == 1
