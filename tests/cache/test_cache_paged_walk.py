"""Page-walking reads of compressed entries against dense per-sequence numpy references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ragged_meta import plan_meta  # tests/ragged_meta.py

from deepinfer_jax.cache import paged_walk as pw
from deepinfer_jax.cache import ragged

# Float32 sums of a few dozen terms computed in a different order (online softmax with rescaling against one
# exp/sum pass in float64): a few ulps, so 1e-5 relative leaves ample margin while catching any wrong key.
RTOL, ATOL = 1e-5, 1e-6


class Scene:
    """Rows with random contexts over shuffled blocks of one layer's pages, and each row's dense entries."""

    def __init__(self, seed: int, ratio: int, block: int, starts, counts, pad_tokens=2, pad_rows=1, dim=6):
        rng = np.random.default_rng(seed)
        self.ratio, self.block = ratio, block
        per_page = block // ratio
        cols = max(-(-(a + n) // block) for a, n in zip(starts, counts, strict=True)) + 1
        num_blocks = len(starts) * cols + 3
        blocks = rng.permutation(np.arange(1, num_blocks))
        tables = []
        for s, (a, n) in enumerate(zip(starts, counts, strict=True)):
            need = -(-(a + n) // block)
            tables.append(list(blocks[s * cols : s * cols + need]))
        # Pages hold random data everywhere (stale entries of earlier sequences included): every read must be
        # masked by position, so garbage in unused entries must never change a result.
        self.pages = rng.standard_normal((num_blocks, per_page, dim)).astype(np.float32)
        self.meta = plan_meta(starts, counts, pad_tokens, pad_rows, range(len(starts)), tables)
        self.tables, self.num_rows, self.dim = tables, len(starts), dim
        self.rng = rng

    def dense(self, row: int) -> np.ndarray:
        """Every entry of a row in compressed order: ``[len(table)·E, dim]``."""
        return np.concatenate([self.pages[b] for b in self.tables[row]], axis=0).reshape(-1, self.dim)

    def tokens(self):
        """``(t, row, position)`` of every real token."""
        seq, pos = np.asarray(self.meta.token_seq), np.asarray(self.meta.positions)
        return [(t, int(seq[t]), int(pos[t])) for t in range(len(seq)) if seq[t] < self.num_rows]


_SHAPES = [
    # ratio, block, starts, counts
    (4, 16, [0, 37, 5], [9, 1, 30]),
    (2, 8, [3, 0], [1, 17]),
    (16, 16, [40, 0, 16], [1, 33, 15]),
]


@pytest.mark.parametrize("chunk", [1, 2])
@pytest.mark.parametrize("ratio,block,starts,counts", _SHAPES)
def test_paged_scores_and_topk_match_a_dense_selection(ratio, block, starts, counts, chunk):
    scene = Scene(ratio + block, ratio, block, starts, counts)
    q = scene.rng.standard_normal((scene.meta.num_tokens, scene.dim)).astype(np.float32)
    scores = pw.paged_scores(
        jnp.asarray(scene.pages),
        scene.meta,
        lambda e: jnp.einsum("tkd,td->tk", e, q, precision=jax.lax.Precision.HIGHEST),
        ratio=ratio,
        block_size=block,
        chunk=chunk,
    )
    scores = np.asarray(scores)
    width = scene.meta.block_tables.shape[1] * (block // ratio)
    assert scores.shape == (scene.meta.num_tokens, width)
    k = 3
    index = np.asarray(pw.topk_entries(jnp.asarray(scores), k))
    real = {t for t, _, _ in scene.tokens()}
    for t in range(scene.meta.num_tokens):
        if t not in real:
            assert np.all(np.isneginf(scores[t])) and np.all(index[t] == -1)
    for t, row, p in scene.tokens():
        visible = (p + 1) // ratio
        want = scene.dense(row)[:visible] @ q[t].astype(np.float64)
        np.testing.assert_allclose(scores[t, :visible], want, rtol=RTOL, atol=ATOL)
        assert np.all(np.isneginf(scores[t, visible:]))
        best = sorted(range(visible), key=lambda c: (-want[c], c))[:k]
        assert index[t].tolist() == best + [-1] * (k - len(best))


def test_topk_ties_go_to_the_lower_index_and_k_zero_keeps_all():
    scores = jnp.asarray([[1.0, 3.0, 3.0, -jnp.inf, 3.0], [-jnp.inf] * 5], jnp.float32)
    assert np.asarray(pw.topk_entries(scores, 2)).tolist() == [[1, 2], [-1, -1]]
    assert np.asarray(pw.topk_entries(scores, 0)).tolist() == [[1, 2, 4, 0, -1], [-1] * 5]
    assert np.asarray(pw.topk_entries(scores, 7)).tolist() == [[1, 2, 4, 0, -1, -1, -1], [-1] * 7]
    with pytest.raises(ValueError, match="index_topk"):
        pw.topk_entries(scores, -1)


def _reference_attention(q, key_sets, sinks, scale):
    """Softmax with sinks over the union of ``key_sets`` (keys = values), float64 numpy: ``[H, D]``."""
    keys = np.concatenate([k for k in key_sets if len(k)], axis=0).astype(np.float64)
    logits = (q.astype(np.float64) @ keys.T) * scale  # [H, K]
    peak = np.maximum(logits.max(axis=-1), sinks)
    probs = np.exp(logits - peak[:, None])
    denom = probs.sum(-1) + np.exp(sinks - peak)
    return (probs @ keys) / denom[:, None]


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("ratio,block,starts,counts", _SHAPES)
def test_attend_all_merged_with_a_window_and_sinks_matches_one_softmax(ratio, block, starts, counts, chunk):
    scene = Scene(7 * ratio + block, ratio, block, starts, counts)
    tokens, heads, window = scene.meta.num_tokens, 3, 4
    q = scene.rng.standard_normal((tokens, heads, scene.dim)).astype(np.float32)
    win = scene.rng.standard_normal((tokens, window, scene.dim)).astype(np.float32)
    win_mask = scene.rng.random((tokens, window)) < 0.7
    win_mask[:, -1] = True  # a token always sees itself
    sinks = scene.rng.standard_normal(heads).astype(np.float32)
    scale = 0.4
    paged = pw.paged_attend_all(
        jnp.asarray(q),
        jnp.asarray(scene.pages),
        scene.meta,
        ratio=ratio,
        block_size=block,
        scale=scale,
        chunk=chunk,
    )
    dense = pw.attend_dense(jnp.asarray(q), jnp.asarray(win), jnp.asarray(win_mask), scale=scale)
    out = np.asarray(pw.finish_softmax(pw.merge_softmax(dense, paged), jnp.asarray(sinks)))
    for t, row, p in scene.tokens():
        visible = scene.dense(row)[: (p + 1) // ratio]
        want = _reference_attention(q[t], [win[t][win_mask[t]], visible], sinks, scale)
        np.testing.assert_allclose(out[t], want, rtol=RTOL, atol=ATOL)
    # Without sinks, an all-masked state normalises to zeros rather than NaN.
    empty = pw.attend_dense(
        jnp.asarray(q), jnp.asarray(win), jnp.zeros_like(jnp.asarray(win_mask)), scale=scale
    )
    assert np.all(np.asarray(pw.finish_softmax(empty)) == 0)


def test_walk_stops_at_the_longest_context():
    # One row at 5 tokens with a table of 4 columns: the walk must touch 1 column, whatever the table width.
    scene = Scene(3, 4, 8, [0], [5], pad_tokens=0, pad_rows=0)
    meta = scene.meta._replace(
        block_tables=jnp.pad(scene.meta.block_tables, ((0, 0), (0, 3)), constant_values=7)
    )
    trips = pw.walk_pages(
        jnp.asarray(scene.pages), meta, lambda i, e, idx, vis, c: c + 1, jnp.int32(0), ratio=4, block_size=8
    )
    assert int(trips) == 1


def test_geometry_is_checked():
    scene = Scene(1, 4, 16, [0], [4])
    with pytest.raises(ValueError, match="ratio 3 does not divide the cache block of 16"):
        pw.paged_scores(jnp.asarray(scene.pages), scene.meta, lambda e: e[..., 0], ratio=3, block_size=16)
    with pytest.raises(ValueError, match="chunk must be an int >= 1, got 0"):
        pw.walk_pages(
            jnp.asarray(scene.pages), scene.meta, lambda *a: a[-1], 0, ratio=4, block_size=16, chunk=0
        )


_history = jax.jit(ragged.history, static_argnums=3)
_emitting = jax.jit(pw.emitting_tokens, static_argnums=1)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), ratio=st.sampled_from([1, 2, 4]), num_rows=st.integers(1, 3))
def test_emitters_and_their_history_match_history_of_every_token(data, ratio, num_rows):
    # Fixed shapes (32 tokens, 5 rows, 6 slots) so each ratio compiles once; the padding varies instead.
    depth = ring_len = 2 * ratio
    starts = [data.draw(st.integers(0, 20)) for _ in range(num_rows)]
    counts = [data.draw(st.integers(0, 9)) for _ in range(num_rows)]
    num_slots = 6
    slots = list(np.random.default_rng(sum(starts)).permutation(num_slots)[:num_rows])
    rng = np.random.default_rng(len(starts) + sum(counts))
    # Stale garbage everywhere in the ring: reads are masked by position, never by zeros.
    ring = rng.standard_normal((num_slots, ring_len, 3)).astype(np.float32)
    meta = plan_meta(starts, counts, 32 - sum(counts), 5 - num_rows, slots, [[0]] * 5)
    new = rng.standard_normal((meta.num_tokens, 3)).astype(np.float32)
    index = np.asarray(_emitting(meta, ratio))
    seq, pos = np.asarray(meta.token_seq), np.asarray(meta.positions)
    want = [t for t in range(meta.num_tokens) if seq[t] < num_rows and (pos[t] + 1) % ratio == 0]
    assert index.tolist() == want + [meta.num_tokens] * (len(index) - len(want))
    items, present = _history(jnp.asarray(ring), jnp.asarray(new), meta, depth, index=jnp.asarray(index))
    full, full_present = _history(jnp.asarray(ring), jnp.asarray(new), meta, depth)
    items, present, full, full_present = map(np.asarray, (items, present, full, full_present))
    for e, t in enumerate(index):
        if t >= meta.num_tokens:
            assert not present[e].any()
            continue
        np.testing.assert_array_equal(present[e], full_present[t])
        np.testing.assert_array_equal(items[e], full[t])
