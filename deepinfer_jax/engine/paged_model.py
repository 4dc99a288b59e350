"""What a model family provides to the engine step: its paged caches, their size, and a forward over a ragged batch.

The engine step (:mod:`deepinfer_jax.engine.step`) is family-agnostic: it resolves pending token ids, keeps the
penalty counts, samples and advances the per-slot state. Everything that depends on the model goes through a
:class:`PagedModel` -- a frozen, hashable object (a static argument of the jitted step) that says

* how much device memory one cache block (all layers) and one state slot take (:meth:`PagedModel.layout`), so
  the memory planner (:func:`plan_memory`) can size the block pool from ``kv_cache_memory``;
* how to build the zeroed cache pytree for ``num_blocks`` blocks and ``num_slots`` state slots
  (:meth:`PagedModel.init_cache`); the step donates it, so every update is in place;
* how to run the model over one flat ragged batch (:meth:`PagedModel.forward`): token ids ``[T]`` plus the
  step's :class:`~deepinfer_jax.cache.ragged.RaggedMeta`, returning float32 logits of each row's last token and
  the updated cache.

DeepSeek-V3 keeps one paged latent cache (``engine/paged_v3.py``). DeepSeek-V4 and V4.1 keep paged compressed
entries plus window rings and compression state in state slots (``engine/paged_v4.py``, ``engine/paged_v41.py``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from deepinfer_jax.cache.plan import CacheLayout, MemoryPlan, PagedCacheSpec, plan_memory
from deepinfer_jax.cache.ragged import RaggedMeta

__all__ = [
    "BATCH_INVARIANT_TILE",
    "CacheLayout",
    "MemoryPlan",
    "PagedCacheSpec",
    "PagedModel",
    "plan_memory",
    "rowwise",
    "rowwise_meta",
]

BATCH_INVARIANT_TILE = 8
"""Rows per tile of every per-token computation in batch-invariant mode (a row's matmuls then always see the
same shape, so its results are bitwise independent of the batch)."""


def rowwise(fn: Callable[..., Any], tile: int | None, *args: jax.Array) -> Any:
    """``fn(*args)`` for token-major ``args`` (leading axis ``T``), optionally in fixed tiles of rows.

    With a tile, every matmul inside ``fn`` sees the same ``[tile, ...]`` shape whatever ``T`` is, so a row's
    result does not depend on how many other tokens share the step (on XLA:CPU a float32 matmul row does
    otherwise; batch-invariant mode). ``T`` is padded up to a multiple of the tile and the padding cut off.
    """
    if tile is None:
        return fn(*args)
    tokens = args[0].shape[0]
    padded = -(-tokens // tile) * tile

    def split(a: jax.Array) -> jax.Array:
        a = jnp.pad(a, [(0, padded - tokens)] + [(0, 0)] * (a.ndim - 1))
        return a.reshape(padded // tile, tile, *a.shape[1:])

    out = jax.lax.map(lambda xs: fn(*xs), tuple(split(a) for a in args))
    return jax.tree.map(lambda a: a.reshape(padded, *a.shape[2:])[:tokens], out)


def rowwise_meta(
    fn: Callable[[RaggedMeta, Any], Any], tile: int | None, meta: RaggedMeta, tokens: Any
) -> Any:
    """``fn(meta, tokens)`` for a pytree ``tokens`` of token-major arrays, optionally in fixed tiles of tokens.

    Like :func:`rowwise`, for computations that also read the step's addressing: each tile gets ``meta`` with
    its token fields (``token_seq``, ``positions``, ``valid``, ``row``, ``slot``) cut to the tile and the row
    fields whole. Padding tokens of the last tile are marked as padding (``token_seq = S``, ``valid`` false,
    ``slot = -1``). Attention reads the caches through batched contractions whose size is the step's token
    count; on XLA:CPU a token's result then depends on that count, so batch-invariant mode runs them per tile.
    ``None`` leaves of ``tokens`` (absent optional inputs) pass through.
    """
    if tile is None:
        return fn(meta, tokens)
    num = meta.num_tokens
    padded = -(-num // tile) * tile
    pad = padded - num

    def split(a: jax.Array, fill: Any = 0) -> jax.Array:
        a = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1), constant_values=fill)
        return a.reshape(padded // tile, tile, *a.shape[1:])

    fields = (
        split(meta.token_seq, meta.num_rows),
        split(meta.positions),
        split(meta.valid, False),
        split(meta.row),
        split(meta.slot, -1),
    )

    def one(xs: tuple[Any, Any]) -> Any:
        (token_seq, positions, valid, row, slot), part = xs
        local = meta._replace(token_seq=token_seq, positions=positions, valid=valid, row=row, slot=slot)
        return fn(local, part)

    out = jax.lax.map(one, (fields, jax.tree.map(split, tokens)))
    return jax.tree.map(lambda a: a.reshape(padded, *a.shape[2:])[:num], out)


class PagedModel(abc.ABC):
    """A model family as the engine step runs it (module docstring). Subclasses are frozen dataclasses."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Width of the logits."""

    @abc.abstractmethod
    def layout(self) -> CacheLayout:
        """Bytes per block and per state slot."""

    @abc.abstractmethod
    def init_cache(self, num_blocks: int, num_slots: int, sharding: Any = None) -> Any:
        """A zeroed cache pytree for ``num_blocks`` blocks (block 0 reserved) and ``num_slots`` state slots."""

    @abc.abstractmethod
    def forward(
        self,
        params: Any,
        cache: Any,
        token_ids: jax.Array,
        meta: RaggedMeta,
        *,
        tile: int | None,
        logit_index: jax.Array | None = None,
    ) -> tuple[jax.Array, Any]:
        """Run ``token_ids [T]`` (concrete ids) through the model: ``(logits float32 [N, V], cache)``.

        ``logit_index`` (int32 ``[N]``) names the tokens whose logits are returned; the default,
        ``meta.last_token()``, is each row's last token (``N = S``). Prompt logprobs pass every token
        (``arange(T)``). With ``tile`` every per-token computation runs in fixed tiles of that many tokens
        (batch-invariant mode).
        """


def zeros(shape: tuple[int, ...], dtype: Any, sharding: Any = None) -> jax.Array:
    """A zeroed device array, optionally created directly with ``sharding``."""
    if sharding is None:
        return jnp.zeros(shape, dtype)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()
