"""SWA bounded replay (YOCO prefill truncation) in the V4.1 cached path: ``mask`` against ``compact``.

Both modes narrow the consumer layers' windows to positions ``>= R = L - K``; ``compact`` also runs those layers
on the kept rows only. On every kept row they compute the same function of the same inputs, so their logits agree
up to float32 reassociation (matmuls of other shapes: ``T`` rows against ``K`` rows); the tolerance is the one of
``test_v41_paged.py`` (2e-5 of the largest logit, about 20x what is measured), far below what one key inside or
outside the rectangle changes (rows near ``R`` move by 1e-2 and more when the bound is ignored).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import deepinfer_jax
from deepinfer_jax.cache.ragged import make_meta, replay_compact
from deepinfer_jax.models.deepseek_v4.paged_v41 import V41PagedModel

RTOL = 2e-5
BLOCK, T, L, K = (
    16,
    96,
    96,
    20,
)  # one row of L prompt tokens, padded to a T-token bucket; K >= W + 0 (no drafts)
R = L - K


@functools.cache
def _model():
    return deepinfer_jax.load_model("tiny-v41", "float32")


@functools.cache
def _forward(mode: str):
    paged = V41PagedModel.create(
        _model(), block_size=BLOCK, dtype="float32", cache_dtype="float32", replay=mode, replay_keep=K
    )
    fwd = jax.jit(
        lambda params, cache, ids, meta, index: paged.forward(
            params, cache, ids, meta, tile=None, logit_index=index
        )
    )
    return paged, fwd


def _run(mode: str, tokens: np.ndarray, chunks: list[int]) -> np.ndarray:
    """The logits of positions ``[R, L)`` of one sequence prefilled in ``chunks`` (each padded to ``T``)."""
    paged, fwd = _forward(mode)
    cache = paged.init_cache(8, 2)
    table = jnp.arange(L // BLOCK, dtype=jnp.int32)[None]
    start, out = 0, []
    for n in chunks:
        ids = np.zeros(T, np.int32)
        ids[:n] = tokens[start : start + n]
        pos = np.zeros(T, np.int32)
        pos[:n] = np.arange(start, start + n)
        meta = make_meta(
            jnp.asarray(np.where(np.arange(T) < n, 0, 1), jnp.int32),
            jnp.asarray(pos),
            jnp.asarray([0, n], jnp.int32),
            jnp.asarray([start + n], jnp.int32),
            jnp.asarray([1], jnp.int32),
            table,
            replay_from=jnp.asarray([R], jnp.int32),
        )
        # The kept positions of this chunk (clamped into it: earlier rows repeat the chunk's first row).
        index = np.clip(np.arange(R, L) - start, 0, n - 1).astype(np.int32)
        logits, cache = fwd(_model().params, cache, jnp.asarray(ids), meta, jnp.asarray(index))
        kept = (np.arange(R, L) >= start) & (np.arange(R, L) < start + n)
        out.append((np.asarray(logits), kept))
        start += n
    result = np.zeros_like(out[0][0])
    for logits, kept in out:
        result[kept] = logits[kept]
    return result


def _tokens() -> np.ndarray:
    return np.random.default_rng(7).integers(3, 500, size=L).astype(np.int32)


def _close(a: np.ndarray, b: np.ndarray) -> None:
    scale = np.abs(b).max(axis=-1, keepdims=True)
    worst = float((np.abs(a - b) / scale).max())
    assert worst <= RTOL, f"largest difference {worst:.2e} of the row's largest logit (allowed {RTOL:.0e})"


def test_mask_and_compact_agree_on_the_kept_rows():
    tokens = _tokens()
    mask = _run("mask", tokens, [L])
    compact = _run("compact", tokens, [L])
    _close(compact, mask)  # every kept row, the sampled (last) row included
    # Compact runs the consumer layers on K rows of the T-row chunk (a static size min(T, S * K)).
    meta = make_meta(
        jnp.zeros(T, jnp.int32),
        jnp.arange(T, dtype=jnp.int32),
        jnp.asarray([0, T], jnp.int32),
        jnp.asarray([T], jnp.int32),
        jnp.asarray([1], jnp.int32),
        jnp.zeros((1, 6), jnp.int32),
        replay_from=jnp.asarray([R], jnp.int32),
    )
    small, gather = replay_compact(meta, min(T, 1 * K))
    assert gather.shape == (K,) and int(small.query_start[1]) == K < T
    np.testing.assert_array_equal(np.asarray(small.positions), np.arange(R, L))


def test_chunked_prefill_matches_one_chunk():
    """Three chunks: the first two lie entirely before R (each keeps one placeholder row), the third holds R."""
    tokens = _tokens()
    one = _run("compact", tokens, [L])
    chunked = _run("compact", tokens, [32, 32, 32])
    _close(chunked, one)
