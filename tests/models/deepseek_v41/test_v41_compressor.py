"""V4.1 ratio-1/ratio-2 compressed KV and the sparse indexer (spec §7.3, §7.4), against float64 NumPy loops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.models.common.linear import LinearNumerics
from deepinfer_jax.models.deepseek_v4 import v41_compressor as v41
from deepinfer_jax.numerics import MXFP4, fp4_e4m3_record_format, host

B, S, H, D, DR, HI, DI = 2, 13, 64, 96, 32, 4, 64
EPS = 1e-6
THETA = 160000.0


# Jitted once per static setting (eager op-by-op dispatch of the codecs is far slower on CPU).
compress_kv = jax.jit(v41.compress_kv, static_argnames=("ratio", "eps", "rope_dim", "cache_cast"))
indexer_keys = jax.jit(v41.indexer_keys, static_argnames=("ratio", "eps", "rope_dim", "cast"))
indexer_query = jax.jit(
    v41.indexer_query, static_argnames=("n_heads", "rope_dim", "numerics", "ratio", "cast")
)
indexer_topk = jax.jit(
    v41.indexer_topk, static_argnames=("ratio", "top_k", "score_dtype", "candidate_block_size")
)


def spec_freqs(d: int) -> np.ndarray:
    return THETA ** (-np.arange(0, d, 2) / d)


def spec_rope(v: np.ndarray, pos: float, d: int) -> np.ndarray:
    out = v.copy()
    z = v[-d:]
    for i, f in enumerate(spec_freqs(d)):
        c, s = np.cos(pos * f), np.sin(pos * f)
        out[len(v) - d + 2 * i] = z[2 * i] * c - z[2 * i + 1] * s
        out[len(v) - d + 2 * i + 1] = z[2 * i] * s + z[2 * i + 1] * c
    return out


def spec_rms(v: np.ndarray, w: np.ndarray) -> np.ndarray:
    return v / np.sqrt(np.mean(v * v) + EPS) * w


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(0)
    return {
        "u": rng.normal(size=(B, S, H)),
        "wkv": rng.normal(size=(D, H)) / np.sqrt(H),
        "wgate": rng.normal(size=(D, H)) / np.sqrt(H),
        "norm": 1 + 0.1 * rng.normal(size=D),
        "wk": rng.normal(size=(DI, D)) / np.sqrt(D),
        "k_norm": 1 + 0.1 * rng.normal(size=DI),
        "q_lat": rng.normal(size=(B, S, 32)),
        "wq_b": rng.normal(size=(HI * DI, 32)) / np.sqrt(32),
        "weights_proj": rng.normal(size=(HI, H)) / np.sqrt(H),
    }


def f32(x):
    return jnp.asarray(x, jnp.float32)


def spec_compress(w, ratio):
    """§7.3 per block and channel: projections, 2-way softmax pool (ratio 2), norm, RoPE at j·r."""
    n = S // ratio
    pre = np.zeros((B, n, D))
    keys = np.zeros((B, n, D))
    for b in range(B):
        for j in range(n):
            toks = [w["u"][b, j * ratio + t] for t in range(ratio)]
            a = [w["wkv"] @ x for x in toks]
            if ratio == 1:
                c = a[0]
            else:
                g = [w["wgate"] @ x for x in toks]
                e0, e1 = np.exp(g[0]), np.exp(g[1])
                c = (e0 * a[0] + e1 * a[1]) / (e0 + e1)
            pre[b, j] = spec_rms(c, w["norm"])
            keys[b, j] = spec_rope(pre[b, j], j * ratio, DR)
    return pre, keys


@pytest.mark.parametrize("ratio", [1, 2])
def test_compress_kv_against_loops(weights, ratio):
    w = weights
    out = compress_kv(
        f32(w["u"]),
        f32(w["wkv"]),
        f32(w["wgate"]) if ratio == 2 else None,
        f32(w["norm"]),
        ratio=ratio,
        eps=EPS,
        rope_freqs=f32(spec_freqs(DR)),
        rope_dim=DR,
    )
    pre, keys = spec_compress(w, ratio)
    assert out.keys.shape == (B, S // ratio, D)  # the odd last token of ratio 2 has no key yet
    # float32 GEMMs over 64 inputs and a norm on O(1) values: 2e-5 absolute covers the rounding.
    np.testing.assert_allclose(np.asarray(out.pre_rope), pre, atol=2e-5)
    np.testing.assert_allclose(np.asarray(out.keys), keys, atol=2e-5)


def test_compressed_cache_cast_is_the_fp4_round_trip(weights):
    w = weights
    args = (f32(w["u"]), f32(w["wkv"]), f32(w["wgate"]), f32(w["norm"]))
    kw = {"ratio": 2, "eps": EPS, "rope_freqs": f32(spec_freqs(DR)), "rope_dim": DR}
    plain = compress_kv(*args, **kw)
    cast = compress_kv(*args, **kw, cache_cast="fp4_e4m3")
    # The stored keys are the FP4 (E4M3 per-16 scales) record of the rotated keys: checked with the NumPy codec.
    fmt = fp4_e4m3_record_format(D)
    want = host.decode_records(host.encode_records(np.asarray(plain.keys), fmt), fmt)
    np.testing.assert_array_equal(np.asarray(cast.keys), want)
    np.testing.assert_array_equal(np.asarray(cast.pre_rope), np.asarray(plain.pre_rope))  # P is never cast


def test_ratio_and_gate_are_checked(weights):
    w = weights
    kw = {"eps": EPS, "rope_freqs": f32(spec_freqs(DR)), "rope_dim": DR}
    with pytest.raises(ValueError, match="ratio 1 or 2"):
        compress_kv(f32(w["u"]), f32(w["wkv"]), None, f32(w["norm"]), ratio=4, **kw)
    with pytest.raises(ValueError, match="ratio 2 needs a wgate"):
        compress_kv(f32(w["u"]), f32(w["wkv"]), None, f32(w["norm"]), ratio=2, **kw)
    with pytest.raises(ValueError, match="ratio 1 takes no wgate"):
        compress_kv(f32(w["u"]), f32(w["wkv"]), f32(w["wgate"]), f32(w["norm"]), ratio=1, **kw)


@pytest.mark.parametrize("ratio", [1, 2])
def test_indexer_against_loops(weights, ratio):
    w = weights
    pre, _ = spec_compress(w, ratio)
    n = S // ratio
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    freqs = f32(spec_freqs(DR))
    ki = indexer_keys(
        f32(pre), f32(w["wk"]), f32(w["k_norm"]), ratio=ratio, eps=EPS, rope_freqs=freqs, rope_dim=DR
    )
    qi, wi = indexer_query(
        f32(w["q_lat"]),
        f32(w["u"]),
        {"weight": f32(w["wq_b"])},
        f32(w["weights_proj"]),
        positions,
        n_heads=HI,
        rope_freqs=freqs,
        rope_dim=DR,
        numerics=LinearNumerics(),
        ratio=ratio,
    )
    top_k = 3
    mask = jax.jit(indexer_topk, static_argnames=("ratio", "top_k"))(
        qi, ki, wi, positions, ratio=ratio, top_k=top_k
    )

    spec_ki = np.stack(
        [
            [spec_rope(spec_rms(w["wk"] @ pre[b, j], w["k_norm"]), j * ratio, DR) for j in range(n)]
            for b in range(B)
        ]
    )
    q_all = np.einsum("bsk,ok->bso", w["q_lat"], w["wq_b"]).reshape(B, S, HI, DI)
    spec_qi = np.stack(
        [[[spec_rope(q_all[b, p, h], p, DR) for h in range(HI)] for p in range(S)] for b in range(B)]
    )
    spec_w = np.einsum("bsk,hk->bsh", w["u"], w["weights_proj"])
    # float32 against float64 on O(1) values: 2e-5 absolute.
    np.testing.assert_allclose(np.asarray(ki), spec_ki, atol=2e-5)
    np.testing.assert_allclose(np.asarray(qi), spec_qi, atol=2e-5)
    np.testing.assert_allclose(np.asarray(wi), spec_w, atol=2e-5)

    for b in range(B):
        for p in range(S):
            visible = (p + 1) // ratio
            scores = [
                sum(spec_w[b, p, h] * max(0.0, spec_qi[b, p, h] @ spec_ki[b, j]) for h in range(HI))
                for j in range(visible)
            ]
            order = np.argsort(scores)[::-1]
            want = set(order[:top_k].tolist())
            if len(scores) > top_k:
                # Random data: the k-th and (k+1)-th scores are well apart, so float32 picks the same set.
                assert scores[order[top_k - 1]] - scores[order[top_k]] > 1e-4
            got = set(np.flatnonzero(np.asarray(mask[b, p])).tolist())
            assert got == want, (b, p)


def test_indexer_queries_mxfp4_per_head(weights):
    w = weights
    positions = jnp.arange(S, dtype=jnp.int32)[None].repeat(B, 0)
    kw = {
        "n_heads": HI,
        "rope_freqs": f32(spec_freqs(DR)),
        "rope_dim": DR,
        "numerics": LinearNumerics(),
        "ratio": 1,
    }
    args = (f32(w["q_lat"]), f32(w["u"]), {"weight": f32(w["wq_b"])}, f32(w["weights_proj"]), positions)
    plain, _ = indexer_query(*args, **kw)
    cast, _ = indexer_query(*args, **kw, cast="mxfp4")
    codes, scales = host.quantize_groups(np.asarray(plain), MXFP4)
    np.testing.assert_array_equal(np.asarray(cast), host.dequantize_groups(codes, scales, MXFP4))


# ------------------------------------------------------------------------------------ candidate blocks


def spec_candidates(scores: np.ndarray, p: int, ratio: int, bs: int, bc: int) -> set[int]:
    """§7.6 for one query: block maxima over visible keys, newest block forced, top-Bc blocks."""
    visible = (p + 1) // ratio
    nb = -(-visible // bs)
    block_score = [max(scores[j] for j in range(b * bs, min((b + 1) * bs, visible))) for b in range(nb)]
    if nb:
        block_score[nb - 1] = np.inf
    return set(np.argsort(block_score)[::-1][:bc].tolist())


@pytest.mark.parametrize("ratio", [1, 2])
def test_candidate_blocks_and_consumer_selection(ratio):
    rng = np.random.default_rng(4)
    seq, n, bs, bc = 40, 40 // ratio, 4, 3
    scores = rng.normal(size=(1, seq, n)).astype(np.float32)
    positions = jnp.arange(seq, dtype=jnp.int32)[None]
    cand = v41.candidate_blocks(jnp.asarray(scores), positions, ratio=ratio, block_size=bs, topk_blocks=bc)
    assert cand.shape == (1, seq, -(-n // bs))
    for p in range(seq):
        assert set(np.flatnonzero(np.asarray(cand[0, p])).tolist()) == spec_candidates(
            scores[0, p], p, ratio, bs, bc
        )

    # A consumer sees key j exactly when its block j // bs was kept.
    keys_mask = np.asarray(v41.restrict_to_candidates(cand, bs, n))
    assert keys_mask.shape == (1, seq, n)
    assert np.array_equal(keys_mask[0], np.asarray(cand[0])[:, np.arange(n) // bs])
    # Candidates hold at most Bc·bs keys.
    assert int(np.asarray(keys_mask).sum(-1).max()) <= bc * bs


def test_indexer_topk_with_candidates(weights):
    """End to end: the consumer path of indexer_topk equals a top-k restricted to the candidate keys."""
    w = weights
    ratio, bs, bc, top_k = 1, 2, 2, 3
    pre, _ = spec_compress(w, ratio)
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    freqs = f32(spec_freqs(DR))
    ki = indexer_keys(
        f32(pre), f32(w["wk"]), f32(w["k_norm"]), ratio=ratio, eps=EPS, rope_freqs=freqs, rope_dim=DR
    )
    qi, wi = indexer_query(
        f32(w["q_lat"]),
        f32(w["u"]),
        {"weight": f32(w["wq_b"])},
        f32(w["weights_proj"]),
        positions,
        n_heads=HI,
        rope_freqs=freqs,
        rope_dim=DR,
        numerics=LinearNumerics(),
        ratio=ratio,
    )
    scores = np.asarray(v41.indexer_scores(qi, ki, wi, score_dtype=jnp.float32))
    cand = v41.candidate_blocks(jnp.asarray(scores), positions, ratio=ratio, block_size=bs, topk_blocks=bc)
    mask = indexer_topk(
        qi, ki, wi, positions, ratio=ratio, top_k=top_k, candidates=cand, candidate_block_size=bs
    )
    for b in range(B):
        for p in range(S):
            allowed = [j for j in range((p + 1) // ratio) if cand[b, p, j // bs]]
            want = set(sorted(allowed, key=lambda j: -scores[b, p, j])[:top_k])
            assert set(np.flatnonzero(np.asarray(mask[b, p])).tolist()) == want


def test_candidate_arguments_are_checked():
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        v41.candidate_blocks(
            jnp.zeros((1, 2, 4)), jnp.zeros((1, 2), jnp.int32), ratio=1, block_size=0, topk_blocks=1
        )


# --------------------------------------------------------------------------------- incremental = full


@pytest.mark.parametrize("ratio", [1, 2])
def test_chunked_compression_equals_full(weights, ratio):
    w = weights
    freqs = f32(spec_freqs(DR))
    full = compress_kv(
        f32(w["u"]),
        f32(w["wkv"]),
        f32(w["wgate"]) if ratio == 2 else None,
        f32(w["norm"]),
        ratio=ratio,
        eps=EPS,
        rope_freqs=freqs,
        rope_dim=DR,
        cache_cast="fp4_e4m3",
    )
    step = jax.jit(v41.compress_step, static_argnames=("ratio", "eps", "rope_dim"))
    state = v41.init_compressor_state(B, ratio, D, 16, overlap=False)
    start = 0
    for size in (5, 1, 1, 6):  # a prompt ending inside a C2 block, then decode steps, then a chunk
        chunk = f32(w["u"][:, start : start + size])
        state = step(
            state,
            chunk,
            jnp.int32(start),
            f32(w["wkv"]),
            f32(w["wgate"]) if ratio == 2 else None,
            f32(w["norm"]),
            ratio=ratio,
            eps=EPS,
            rope_dim=DR,
        )
        start += size
    n = S // ratio
    read = jax.jit(v41.read_keys, static_argnames=("ratio", "rope_dim", "cache_cast"))
    keys = read(state, ratio=ratio, rope_freqs=freqs, rope_dim=DR, cache_cast="fp4_e4m3")
    # The chunked path runs the same per-block float32 operations (a one-slot softmax weighs exactly 1), so the
    # entries, and hence their FP4 records, are bit-identical: prefill and decode read the same keys.
    np.testing.assert_array_equal(np.asarray(state.entries[:, :n]), np.asarray(full.pre_rope))
    np.testing.assert_array_equal(np.asarray(keys[:, :n]), np.asarray(full.keys))
    assert not np.asarray(state.entries[:, n:]).any()  # nothing written past the complete blocks
