"""DeepSeek-V4 building blocks against independent NumPy references written here, and their invariants."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_jax.models.common.linear import LinearNumerics
from deepinfer_jax.models.deepseek_v4 import compressor as comp
from deepinfer_jax.models.deepseek_v4.attention import grouped_output_projection, sink_attention
from deepinfer_jax.models.deepseek_v4.mhc import hc_expand, sinkhorn
from deepinfer_jax.ops import list_ops

# Float32 against float64 NumPy on O(1) values: a few float32 ulps per reduction.
ATOL = 1e-5


def _np_sinkhorn(x: np.ndarray, iters: int, eps: float) -> np.ndarray:
    x = np.exp(x - x.max(-1, keepdims=True))
    x = x / x.sum(-1, keepdims=True) + eps
    x = x / (x.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        x = x / (x.sum(-1, keepdims=True) + eps)
        x = x / (x.sum(-2, keepdims=True) + eps)
    return x


def test_v4_ops_are_registered():
    assert {"v4_sink_attention", "v4_compressor_pool", "v4_indexer_scores", "moe_experts"} <= set(list_ops())


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 5), iters=st.integers(1, 25), seed=st.integers(0, 2**16))
def test_v4_sinkhorn_matches_numpy_and_is_column_stochastic(m, iters, seed):
    logits = np.random.default_rng(seed).normal(scale=3.0, size=(3, m, m))
    out = np.asarray(sinkhorn(jnp.asarray(logits, jnp.float32), iters=iters, eps=1e-6))
    np.testing.assert_allclose(out, _np_sinkhorn(logits, iters, 1e-6), atol=ATOL)
    assert (out > 0).all()
    # The last step divides each column by (its sum + eps): column sums are S / (S + eps) <= 1, and equal to 1
    # up to eps / S, where S can be small after one round (a column every row gives little weight).
    assert (out.sum(-2) <= 1.0 + 1e-6).all()


def test_v4_sinkhorn_rejects_zero_iterations():
    with pytest.raises(ValueError, match="hc_sinkhorn_iters"):
        sinkhorn(jnp.zeros((2, 2)), iters=0, eps=1e-6)


def test_v4_hc_expand_hand_computed():
    """R'[b] = post[b]·y + Σ_a comb[a, b]·R[a], with comb indexed [source, destination]."""
    r = jnp.asarray([[1.0, 2.0], [10.0, 20.0]])  # two streams, H = 2
    comb = jnp.asarray([[0.0, 1.0], [1.0, 0.0]])  # swap
    out = hc_expand(r, jnp.asarray([1.0, 1.0]), jnp.asarray([0.5, 2.0]), comb)
    np.testing.assert_allclose(out, [[10.5, 20.5], [3.0, 4.0]])
    comb = jnp.asarray([[1.0, 1.0], [0.0, 0.0]])  # stream 0 feeds both
    np.testing.assert_allclose(hc_expand(r, jnp.zeros(2), jnp.zeros(2), comb), [[1.0, 2.0], [1.0, 2.0]])


def _np_sink_attention(q, kv, mask, sinks, scale):
    logits = np.einsum("bshd,btd->bsht", q, kv) * scale
    logits = np.where(mask[:, :, None, :], logits, -np.inf)
    full = np.concatenate([logits, np.broadcast_to(sinks[None, None, :, None], (*logits.shape[:3], 1))], -1)
    p = np.exp(full - full.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    return np.einsum("bsht,btd->bshd", p[..., :-1], kv)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), s=st.sampled_from([1, 4]), t=st.sampled_from([1, 7]))
def test_v4_sink_attention_matches_numpy(seed, s, t):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(2, s, 3, 8))
    kv = rng.normal(size=(2, t, 8))
    mask = rng.random((2, s, t)) < 0.6
    mask[..., 0] = True  # every query keeps at least one key
    sinks = rng.normal(size=3)
    out = sink_attention(
        jnp.asarray(q, jnp.float32),
        jnp.asarray(kv, jnp.float32),
        jnp.asarray(mask),
        jnp.asarray(sinks, jnp.float32),
        scale=8**-0.5,
    )
    np.testing.assert_allclose(out, _np_sink_attention(q, kv, mask, sinks, 8**-0.5), atol=ATOL)


def test_v4_sink_takes_probability_mass():
    """One key and a sink logit equal to the key's logit: the output is half the value."""
    kv = jnp.asarray([[[2.0, -4.0]]])
    q = jnp.zeros((1, 1, 1, 2))  # logit 0 for the key
    out = sink_attention(q, kv, jnp.ones((1, 1, 1), bool), jnp.zeros(1), scale=1.0)
    np.testing.assert_allclose(out[0, 0, 0], [1.0, -2.0])


def test_v4_grouped_output_projection_matches_numpy():
    rng = np.random.default_rng(0)
    b, s, heads, d, groups, rank, hidden = 1, 3, 4, 5, 2, 3, 7
    o = rng.normal(size=(b, s, heads, d)).astype(np.float32)
    wo_a = rng.normal(size=(groups * rank, heads // groups * d)).astype(np.float32)
    wo_b = rng.normal(size=(hidden, groups * rank)).astype(np.float32)
    out = grouped_output_projection(
        jnp.asarray(o),
        {"weight": jnp.asarray(wo_a)},
        {"weight": jnp.asarray(wo_b)},
        groups=groups,
        rank=rank,
        numerics=LinearNumerics(),
    )
    grouped = o.reshape(b, s, groups, -1)
    z = np.concatenate([grouped[:, :, g] @ wo_a[g * rank : (g + 1) * rank].T for g in range(groups)], -1)
    np.testing.assert_allclose(out, z @ wo_b.T, rtol=1e-5, atol=1e-5)


def test_v4_compressor_pool_matches_numpy_and_ignores_minus_inf_slots():
    rng = np.random.default_rng(1)
    kv, gate = rng.normal(size=(2, 6, 4)), rng.normal(size=(2, 6, 4))
    gate[0, :3] = -np.inf
    w = np.exp(gate - gate.max(-2, keepdims=True))
    ref = (w / w.sum(-2, keepdims=True) * kv).sum(-2)
    out = comp.compressor_pool(jnp.asarray(kv, jnp.float32), jnp.asarray(gate, jnp.float32))
    np.testing.assert_allclose(out, ref, atol=ATOL)


def _np_compress(kv, gate, ape, ratio, width, overlap, norm_w, eps):
    """Independent whole-sequence compressor (no state): entries of every complete window, before RoPE."""
    n = kv.shape[0] // ratio
    out = []
    for w in range(n):
        cur_kv, cur_g = kv[w * ratio : (w + 1) * ratio], gate[w * ratio : (w + 1) * ratio] + ape
        if overlap:
            slots_kv, slots_g = [cur_kv[:, width:]], [cur_g[:, width:]]
            if w > 0:
                prev_kv = kv[(w - 1) * ratio : w * ratio, :width]
                prev_g = gate[(w - 1) * ratio : w * ratio, :width] + ape[:, :width]
                slots_kv.insert(0, prev_kv)
                slots_g.insert(0, prev_g)
            cur_kv, cur_g = np.concatenate(slots_kv), np.concatenate(slots_g)
        p = np.exp(cur_g - cur_g.max(0))
        pooled = (p / p.sum(0) * cur_kv).sum(0)
        out.append(pooled / np.sqrt((pooled**2).mean() + eps) * norm_w)
    return np.asarray(out).reshape(n, width)


@settings(max_examples=8, deadline=None)
@given(
    overlap=st.booleans(),
    ratio=st.sampled_from([2, 4]),
    cuts=st.lists(st.sampled_from([1, 3, 4, 6]), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_v4_compress_chunk_any_chunking_matches_whole_sequence(overlap, ratio, cuts, seed):
    """Feeding the tokens in arbitrary chunks (ending inside or at the edge of windows) emits exactly the
    entries of an independent whole-sequence computation; RoPE is off (frequency 0) to isolate the pooling."""
    rng = np.random.default_rng(seed)
    width, total = 4, sum(cuts)
    feats = 2 * width if overlap else width
    kv, gate = rng.normal(size=(total, feats)), rng.normal(size=(total, feats))
    ape, norm_w = rng.normal(size=(ratio, feats)), 1 + 0.1 * rng.normal(size=width)
    state = comp.init_compressor_state(1, ratio, width, total // ratio + 1, overlap=overlap)
    chunk = jax.jit(comp.compress_chunk, static_argnames=("norm_eps", "rope_dim"))
    start = 0
    for size in cuts:
        state = chunk(
            state,
            jnp.asarray(kv[None, start : start + size], jnp.float32),
            jnp.asarray(gate[None, start : start + size], jnp.float32),
            jnp.int32(start),
            ape=jnp.asarray(ape, jnp.float32),
            norm_weight=jnp.asarray(norm_w, jnp.float32),
            norm_eps=1e-6,
            rope_freqs=jnp.zeros(1, jnp.float32),
            rope_dim=2,
        )
        start += size
    ref = _np_compress(kv, gate, ape, ratio, width, overlap, norm_w, 1e-6)
    entries = np.asarray(state.entries)[0]
    np.testing.assert_allclose(entries[: len(ref)], ref, atol=1e-5)
    assert not entries[len(ref) :].any()


def test_v4_indexer_scores_hand_computed():
    q = jnp.asarray([[[[1.0, 0.0], [0.0, 1.0]]]])  # B=1, S=1, two heads
    keys = jnp.asarray([[[2.0, -1.0], [-1.0, 3.0]]])  # two entries
    weights = jnp.asarray([[[0.5, 2.0]]])
    # entry 0: 0.5*relu(2) + 2*relu(-1) = 1; entry 1: 0.5*relu(-1) + 2*relu(3) = 6
    np.testing.assert_allclose(comp.indexer_scores(q, keys, weights), [[[1.0, 6.0]]])


def test_v4_indexer_select_top_k_among_visible_only():
    scores = jnp.asarray([[[5.0, 1.0, 4.0, 9.0, 2.0]]])
    visible = jnp.asarray([[[True, True, True, False, False]]])
    np.testing.assert_array_equal(
        comp.indexer_select(scores, visible, 2), [[[True, False, True, False, False]]]
    )
    # fewer visible entries than top_k: all visible ones, nothing else
    np.testing.assert_array_equal(comp.indexer_select(scores, visible, 4), visible)
    np.testing.assert_array_equal(comp.indexer_select(scores, visible, 0), visible)  # 0 = no sparse selection
    with pytest.raises(ValueError, match="index_topk"):
        comp.indexer_select(scores, visible, -1)


def test_v4_visible_entries_wait_for_complete_windows():
    vis = np.asarray(comp.visible_entries(jnp.arange(9), 4, 3))
    # entry w is visible from position (w + 1) * 4 - 1 on
    assert vis.sum(-1).tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2]
