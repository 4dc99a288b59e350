"""Plan-style ragged metadata for the cache tests (``tests/cache``), built the way the scheduler lays out a step."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from deepinfer_jax.cache import ragged

__all__ = ["plan_meta"]


def plan_meta(
    starts: Sequence[int],
    counts: Sequence[int],
    pad_tokens: int,
    pad_rows: int,
    slots: Sequence[int],
    tables: Sequence[Sequence[int]],
) -> ragged.RaggedMeta:
    """Rows feeding ``counts[s]`` tokens from position ``starts[s]``, in state slot ``slots[s]`` with block table
    ``tables[s]``, then ``pad_tokens`` padding tokens (owned by the sentinel row) and ``pad_rows`` empty rows."""
    token_seq, positions, query_start = [], [], [0]
    for s, (a, n) in enumerate(zip(starts, counts, strict=True)):
        token_seq += [s] * n
        positions += list(range(a, a + n))
        query_start.append(query_start[-1] + n)
    rows = len(starts) + pad_rows
    token_seq += [rows] * pad_tokens
    positions += [0] * pad_tokens
    query_start += [query_start[-1]] * pad_rows
    context = [a + n for a, n in zip(starts, counts, strict=True)] + [0] * pad_rows
    width = max(len(t) for t in tables)
    bt = np.full((rows, width), -1, np.int32)
    for s, t in enumerate(tables):
        bt[s, : len(t)] = t
    return ragged.make_meta(
        jnp.asarray(token_seq, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        jnp.asarray(query_start, jnp.int32),
        jnp.asarray(context, jnp.int32),
        jnp.asarray(list(slots) + [-1] * pad_rows, jnp.int32),
        jnp.asarray(bt),
    )
