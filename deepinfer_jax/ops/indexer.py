"""The DeepSeek-V4/V4.1 lightning indexer over paged key records with a streaming top-k: op ``"v4_indexer_topk"``.

``Sel(p)`` of an index-source layer (``spec/model.md`` §7.4) for every token of a flat ragged batch: the ``k``
compressed entries with the highest ``I(p, j) = Σ_h w[h] · ReLU(q[h] · k_j)`` among the visible ones, where the
keys ``k_j`` are read from the layer's paged indexer cache in their stored format (MXFP4 records, §12.3.3, or
float vectors). Scores accumulate in float32 and are materialised in ``score_dtype`` (bfloat16 in production
mode) before they compete, like the model's ``indexer_scores(...).astype(score_dtype)``.

**Streaming.** The entries of a token's row are scored ``chunk_pages`` block-table columns at a time, and each
chunk is merged into a running ``[T, k]`` top-k with ``lax.top_k`` over ``[running | chunk]``: the whole score
row of a 128K context is never held. The merge is exact: the running entries precede the chunk's (they have lower
compressed indices) and ``lax.top_k`` prefers the earlier of equal values, so the result -- order and ties
included -- equals one ``lax.top_k`` over the whole row, i.e. :func:`deepinfer_jax.cache.paged_walk.topk_entries`
of the masked dense scores.

Visibility: entry ``j`` of token ``t``'s row competes iff ``j < limit[t]`` (``(p + 1) // r`` for a real token,
0 for padding), its page is allocated, and -- for candidate consumers (§7.6) -- its candidate block
``j // candidate_block_size`` is set in ``candidates [T, NB]``. The result is ``[T, k]`` compressed indices,
``-1`` where fewer than ``k`` entries compete. The reference scores a chunk one page at a time (each page's records
gathered for every token and decoded: ``[T, E, Di]`` float32), so its working set is one page per token whatever
the chunk. The ``pallas_gpu`` kernel replaces the per-chunk scorer (keys decoded in registers,
``pallas_kernels/indexer.py``); the merge stays ``lax.top_k``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from deepinfer_jax.ops.ascend import ascend_impl
from deepinfer_jax.ops.registry import register_impl, register_op
from deepinfer_jax.ops.sparse_attention import decode_keys

__all__ = ["DEFAULT_CHUNK_ENTRIES", "merge_topk", "streaming_topk", "v4_indexer_topk"]

#: Entries scored per streaming step when ``chunk_pages`` is not given (rounded to whole pages).
DEFAULT_CHUNK_ENTRIES = 2048

_HIGHEST = lax.Precision.HIGHEST

#: ``scorer(q, weights, pages, block_tables, rows, limit, candidates, first_entry, *, num_entries, ...)`` ->
#: float32 scores ``[T, num_entries]`` of entries ``first_entry .. first_entry + num_entries - 1``, ``-inf`` where
#: an entry does not compete.
Scorer = Callable[..., jax.Array]


def merge_topk(
    values: jax.Array, index: jax.Array, scores: jax.Array, first: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Merge chunk ``scores [T, C]`` (entries ``first + 0 .. C - 1``) into the running ``(values, index) [T, k]``."""
    k = values.shape[1]
    cand = jnp.concatenate([values, scores.astype(jnp.float32)], axis=1)
    ids = jnp.concatenate(
        [index, jnp.broadcast_to(first + jnp.arange(scores.shape[1], dtype=jnp.int32), scores.shape)], axis=1
    )
    top, pos = lax.top_k(cand, k)
    return top, jnp.take_along_axis(ids, pos, axis=1)


def _page_scores(
    q: jax.Array,
    weights: jax.Array,
    pages: jax.Array,
    block_tables: jax.Array,
    rows: jax.Array,
    limit: jax.Array,
    candidates: jax.Array | None,
    first: jax.Array,
    *,
    key_format: str | None,
    candidate_block_size: int | None,
) -> jax.Array:
    """Float32 scores ``[T, E]`` of the ``E`` entries of one page of every token's row, from entry ``first``."""
    num_blocks, per_page = pages.shape[0], pages.shape[1]
    max_blocks = block_tables.shape[1]
    j = first + jnp.arange(per_page, dtype=jnp.int32)  # [E]
    col = jnp.clip(j // per_page, 0, max_blocks - 1)
    blk = block_tables[rows[:, None], col[None, :]]  # [T, E]
    ok = (blk >= 0) & (j[None, :] < limit[:, None]) & (j[None, :] // per_page < max_blocks)
    if candidates is not None:
        assert candidate_block_size is not None
        cb = jnp.clip(j // candidate_block_size, 0, candidates.shape[1] - 1)
        ok = ok & jnp.take(candidates, cb, axis=1)
    safe = jnp.where(ok, blk, num_blocks)
    stored = pages.at[safe, (j % per_page)[None, :]].get(mode="fill", fill_value=0)  # [T, E, ...]
    keys = decode_keys(stored, key_format, q.shape[-1])
    dots = jnp.einsum("thd,ted->the", q.astype(jnp.float32), keys, precision=_HIGHEST)
    s = jnp.einsum("the,th->te", jax.nn.relu(dots), weights.astype(jnp.float32), precision=_HIGHEST)
    return jnp.where(ok, s, -jnp.inf)


def reference_scorer(
    q: jax.Array,
    weights: jax.Array,
    pages: jax.Array,
    block_tables: jax.Array,
    rows: jax.Array,
    limit: jax.Array,
    candidates: jax.Array | None,
    first: jax.Array,
    *,
    num_entries: int,
    key_format: str | None,
    candidate_block_size: int | None,
) -> jax.Array:
    """The jnp scorer: ``Σ_h w · ReLU(q · k)`` in float32 (``HIGHEST``), one page of the chunk at a time.

    Each page's records are gathered for every token and decoded (``[T, E, Di]`` float32), so the working set is
    one page per token whatever the chunk; the chunk's scores ``[T, num_entries]`` are what the merge needs. Pages
    past every token's ``limit`` are not scored (their columns stay ``-inf``), so a decode step over short contexts
    costs the pages they hold, not the chunk's 2048 entries.
    """
    per_page = pages.shape[1]
    if num_entries % per_page:
        raise ValueError(
            f"v4_indexer_topk: a chunk of {num_entries} entries is not whole pages of {per_page}"
        )

    def one(i: jax.Array, out: jax.Array) -> jax.Array:
        s = _page_scores(
            q,
            weights,
            pages,
            block_tables,
            rows,
            limit,
            candidates,
            first + i * per_page,
            key_format=key_format,
            candidate_block_size=candidate_block_size,
        )
        return lax.dynamic_update_slice_in_dim(out, s, i * per_page, axis=1)

    # Only the chunk's pages some token can see are scored (a short context in a long chunk costs its pages, not
    # the chunk's); the rest stay -inf, as _page_scores would have made them.
    pages_in_chunk = num_entries // per_page
    seen = jnp.max(limit, initial=0).astype(jnp.int32) - first
    trips = jnp.clip((seen + per_page - 1) // per_page, 0, pages_in_chunk)
    init = jnp.full((q.shape[0], num_entries), -jnp.inf, jnp.float32)
    return lax.fori_loop(0, trips, one, init)


def streaming_topk(
    scorer: Scorer,
    q: jax.Array,
    weights: jax.Array,
    pages: jax.Array,
    block_tables: jax.Array,
    rows: jax.Array,
    limit: jax.Array,
    *,
    k: int,
    score_dtype: Any,
    chunk_entries: int,
    candidates: jax.Array | None = None,
    **scorer_kwargs: Any,
) -> jax.Array:
    """The streaming top-k loop of the module docstring around any per-chunk ``scorer``."""
    tokens = q.shape[0]
    dtype = jnp.dtype(score_dtype)
    values = jnp.full((tokens, k), -jnp.inf, jnp.float32)
    index = jnp.full((tokens, k), -1, jnp.int32)
    trips = (jnp.max(limit, initial=0).astype(jnp.int32) + chunk_entries - 1) // chunk_entries

    def step(i: jax.Array, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        first = (i * chunk_entries).astype(jnp.int32)
        s = scorer(
            q,
            weights,
            pages,
            block_tables,
            rows,
            limit,
            candidates,
            first,
            num_entries=chunk_entries,
            **scorer_kwargs,
        )
        s = s.astype(dtype).astype(jnp.float32)  # materialised in score_dtype, as the model's scores are
        return merge_topk(*carry, s, first)

    values, index = lax.fori_loop(0, trips, step, (values, index))
    return jnp.where(values > -jnp.inf, index, -1).astype(jnp.int32)


def _check(q: Any, weights: Any, pages: Any, block_tables: Any, rows: Any, limit: Any, k: Any) -> None:
    if q.ndim != 3:
        raise ValueError(f"v4_indexer_topk: q must be [T, Hi, Di], got {q.shape}")
    tokens, heads, _ = q.shape
    if weights.shape != (tokens, heads):
        raise ValueError(f"v4_indexer_topk: weights must be [{tokens}, {heads}], got {weights.shape}")
    if pages.ndim != 3:
        raise ValueError(f"v4_indexer_topk: pages must be [num_blocks, E, ...], got {pages.shape}")
    if block_tables.ndim != 2 or rows.shape != (tokens,) or limit.shape != (tokens,):
        raise ValueError(
            f"v4_indexer_topk: block_tables [S, M], rows [{tokens}], limit [{tokens}] expected, got "
            f"{block_tables.shape}, {rows.shape}, {limit.shape}"
        )
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"v4_indexer_topk: k (index_topk) must be an int >= 1, got {k!r}")


def chunk_for(per_page: int, chunk_pages: int | None, max_blocks: int | None = None) -> int:
    """Entries per streaming step: ``chunk_pages`` pages, or about :data:`DEFAULT_CHUNK_ENTRIES` but no more than
    a row's whole table (``max_blocks`` pages): a shorter table is one step, with no merge over columns that
    cannot exist."""
    if chunk_pages is None:
        chunk_pages = max(1, DEFAULT_CHUNK_ENTRIES // per_page)
        if max_blocks is not None:
            chunk_pages = max(1, min(chunk_pages, max_blocks))
    if isinstance(chunk_pages, bool) or not isinstance(chunk_pages, int) or chunk_pages < 1:
        raise ValueError(f"v4_indexer_topk: chunk_pages must be an int >= 1, got {chunk_pages!r}")
    return chunk_pages * per_page


def v4_indexer_topk(
    q: jax.Array,
    weights: jax.Array,
    pages: jax.Array,
    block_tables: jax.Array,
    rows: jax.Array,
    limit: jax.Array,
    *,
    k: int,
    key_format: str | None = None,
    score_dtype: Any = jnp.float32,
    candidates: jax.Array | None = None,
    candidate_block_size: int | None = None,
    chunk_pages: int | None = None,
) -> jax.Array:
    """``Sel(p)`` as compressed indices ``[T, k]`` (``-1`` = none), streaming over the pages (module docstring).

    Args:
      q: ``[T, Hi, Di]`` indexer queries (MXFP4-round-tripped by the caller, as the model does).
      weights: ``[T, Hi]`` head weights.
      pages: the indexer cache ``[num_blocks, E, record_bytes]`` (``key_format="mxfp4"``) or float ``[..., Di]``.
      block_tables: int ``[S, M]``; rows: int ``[T]`` the row of each token (clamped); limit: int ``[T]`` how many
        leading entries of the row each token may see (0 for padding tokens).
      k: ``index_topk``.
      score_dtype: the dtype scores are materialised in before they compete.
      candidates, candidate_block_size: the candidate-block mask ``[T, NB]`` of a candidate consumer (§7.6).
      chunk_pages: block-table columns scored per step (default: about 2048 entries, at most the whole table).
    """
    q, weights, pages, block_tables, rows, limit = (
        jnp.asarray(a) for a in (q, weights, pages, block_tables, rows, limit)
    )
    _check(q, weights, pages, block_tables, rows, limit, k)
    if (candidates is None) != (candidate_block_size is None):
        raise ValueError("v4_indexer_topk: candidates and candidate_block_size go together")
    return streaming_topk(
        reference_scorer,
        q,
        weights,
        pages,
        block_tables,
        rows.astype(jnp.int32),
        limit.astype(jnp.int32),
        k=k,
        score_dtype=score_dtype,
        chunk_entries=chunk_for(pages.shape[1], chunk_pages, block_tables.shape[1]),
        candidates=candidates,
        key_format=key_format,
        candidate_block_size=candidate_block_size,
    )


register_op(
    "v4_indexer_topk",
    v4_indexer_topk,
    doc="DeepSeek-V4/V4.1 lightning indexer over paged MXFP4 key records with a streaming per-query top-k",
)
register_impl(
    "v4_indexer_topk",
    "pallas_gpu",
    "pallas_kernels.indexer:v4_indexer_topk",
    platforms=("gpu",),
    reason="the Pallas Triton kernel needs the pallas_kernels package",
)
register_impl(
    "v4_indexer_topk", "ascend", ascend_impl("v4_indexer_topk", v4_indexer_topk), platforms=("ascend",)
)
