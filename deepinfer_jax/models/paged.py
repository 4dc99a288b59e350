"""What a model family provides to the engine step: its paged caches, their size, and a forward over a ragged batch.

The engine step (:mod:`deepinfer_jax.engine.step`) is family-agnostic: it resolves pending token ids, keeps the
penalty counts, samples and advances the per-slot state. Everything that depends on the model goes through a
:class:`PagedModel` -- a frozen, hashable object (a static argument of the jitted step) that says

* how much device memory one cache block (all layers) and one state slot take (:meth:`PagedModel.layout`), so
  the memory planner (:func:`~deepinfer_jax.cache.plan.plan_memory`) can size the block pool;
* how to build the zeroed cache pytree for ``num_blocks`` blocks and ``num_slots`` state slots
  (:meth:`PagedModel.init_cache`); the step donates it, so every update is in place;
* how to run the model over one flat ragged batch (:meth:`PagedModel.forward`): token ids ``[T]`` plus the
  step's :class:`~deepinfer_jax.cache.ragged.RaggedMeta`, returning float32 logits of each row's last token and
  the updated cache.

Each family's paged model lives with the family (``models/deepseek_v3/paged.py``, ``models/deepseek_v4/paged.py``,
``models/deepseek_v4/paged_v41.py``) and is built by its :class:`~deepinfer_jax.models.registry.ModelFamily`
(``paged_model``), so the engine never branches on the family.
"""

from __future__ import annotations

import abc
from typing import Any

import jax
import jax.numpy as jnp

from deepinfer_jax.cache.plan import CacheLayout
from deepinfer_jax.cache.ragged import RaggedMeta

__all__ = ["CacheLayout", "PagedModel", "copy_rows", "copy_tree", "zeros"]


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

    block_axis: int = 0
    """The block axis of the per-block leaves of :meth:`cache_parts` (per-slot leaves have their slot axis 0)."""

    def cache_parts(self, cache: Any) -> tuple[Any, Any]:
        """``(per-block leaves, per-slot leaves)`` of the cache: what a block of positions and what a sequence's
        state slot own (``None`` for a part the family does not have)."""
        from deepinfer_jax.cache.stores import CompressedCache

        if isinstance(cache, CompressedCache):  # V4 / V4.1
            return (cache.kv, cache.ik), (cache.window, cache.state, cache.engram, cache.draft)
        raise NotImplementedError(f"{type(self).__name__} does not say which cache leaves are per block")

    def with_parts(self, cache: Any, blocks: Any, slots: Any) -> Any:
        """``cache`` with the parts of :meth:`cache_parts` replaced."""
        kv, ik = blocks
        window, state, engram, draft = slots
        return cache._replace(kv=kv, ik=ik, window=window, state=state, engram=engram, draft=draft)

    def copy_cache(
        self, cache: Any, block_src: jax.Array, block_dst: jax.Array, slot_src: jax.Array, slot_dst: jax.Array
    ) -> Any:
        """The cache with blocks ``block_dst`` holding copies of ``block_src`` (every layer, every per-block
        store) and state slots ``slot_dst`` holding clones of ``slot_src`` (every per-sequence store); -1
        destinations are skipped. What a fork of ``n > 1`` samples and prefix caching's snapshots do."""
        blocks, slots = self.cache_parts(cache)
        return self.with_parts(
            cache,
            copy_tree(blocks, block_src, block_dst, axis=self.block_axis),
            copy_tree(slots, slot_src, slot_dst),
        )

    def read_cache(self, cache: Any, blocks: jax.Array, slots: jax.Array) -> tuple[Any, Any]:
        """The contents of ``blocks`` and ``slots`` (int32 ``[K]``, clamped; read what is valid): the per-block
        leaves with ``K`` on their block axis, the per-slot leaves with ``K`` first (prefix caching's host tier)."""
        b, s = self.cache_parts(cache)
        take = lambda x, i, axis: jnp.take(x, jnp.clip(i, 0, x.shape[axis] - 1), axis=axis)  # noqa: E731
        return (
            jax.tree.map(lambda x: take(x, blocks, self.block_axis), b),
            jax.tree.map(lambda x: take(x, slots, 0), s),
        )

    def write_cache(self, cache: Any, blocks: jax.Array, slots: jax.Array, data: tuple[Any, Any]) -> Any:
        """``cache`` with :meth:`read_cache`'s ``data`` written back into ``blocks`` and ``slots`` (-1 = skip)."""
        b, s = self.cache_parts(cache)

        def put(x: jax.Array, d: jax.Array, ids: jax.Array, axis: int) -> jax.Array:
            index = (slice(None),) * axis + (jnp.where(ids >= 0, ids, x.shape[axis]),)
            return x.at[index].set(d.astype(x.dtype), mode="drop")

        return self.with_parts(
            cache,
            jax.tree.map(lambda x, d: put(x, d, blocks, self.block_axis), b, data[0]),
            jax.tree.map(lambda x, d: put(x, d, slots, 0), s, data[1]),
        )

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
        (batch-invariant mode, :mod:`deepinfer_jax.ops.tiling`).
        """

    # ---- speculative decoding (engine/step.py): families with draft layers override these.

    @property
    def num_draft_layers(self) -> int:
        """Draft layers the family runs in the step (V3's MTP layers, V4.1's DSpark layers); 0: the model cannot
        draft."""
        return 0

    @property
    def draft_kind(self) -> str:
        """How the step drafts: ``"mtp"`` (:meth:`draft_hidden` / :meth:`draft_head`, V3) or ``"dspark"`` (a
        block per row from the model's ``dspark_block`` / ``dspark_logits``, V4.1)."""
        return "mtp"

    def forward_hidden(
        self, params: Any, cache: Any, token_ids: jax.Array, meta: RaggedMeta, *, tile: int | None
    ) -> tuple[jax.Array, Any]:
        """:meth:`forward` up to the LM head's input: ``(hidden [T, H], cache)``."""
        raise NotImplementedError(f"{type(self).__name__} does not draft")

    def head(self, params: Any, hidden: jax.Array, *, tile: int | None) -> jax.Array:
        """Float32 logits ``[N, V]`` of LM-head inputs ``hidden [N, H]`` (:meth:`forward_hidden`'s rows)."""
        raise NotImplementedError(f"{type(self).__name__} does not draft")

    def draft_hidden(
        self,
        params: Any,
        cache: Any,
        hidden: jax.Array,
        next_ids: jax.Array,
        meta: RaggedMeta,
        *,
        tile: int | None,
    ) -> tuple[jax.Array, Any]:
        """The draft layer over a ragged batch: token ``t`` at position ``p`` pairs ``hidden[t]`` with the token
        at ``p + 1`` (``next_ids[t]``) and writes the draft layer's cache at ``p``; ``(hidden_out [T, H],
        cache)``, whose :meth:`draft_head` predicts the token at ``p + 2``."""
        raise NotImplementedError(f"{type(self).__name__} does not draft")

    def draft_head(self, params: Any, hidden: jax.Array, *, tile: int | None) -> jax.Array:
        """Float32 draft logits ``[N, V]`` of :meth:`draft_hidden`'s outputs."""
        raise NotImplementedError(f"{type(self).__name__} does not draft")


def copy_rows(x: jax.Array, src: jax.Array, dst: jax.Array, axis: int = 0) -> jax.Array:
    """``x`` with its entries ``dst`` along ``axis`` replaced by its entries ``src`` (int32 ``[K]`` each; a
    negative destination skips its pair). The destinations are distinct and never sources, so the copies
    commute."""
    n = x.shape[axis]
    rows = jnp.take(x, jnp.clip(src, 0, n - 1), axis=axis)
    # Order the write after the read, so XLA updates the (donated) array in place instead of copying all of
    # it to keep the rows it reads valid (as ring_write does): steps with prefix-cache snapshots copy every step.
    x, rows = jax.lax.optimization_barrier((x, rows))
    index = (slice(None),) * axis + (jnp.where(dst >= 0, dst, n),)
    return x.at[index].set(rows, mode="drop")


def copy_tree(tree: Any, src: jax.Array, dst: jax.Array, axis: int = 0) -> Any:
    """:func:`copy_rows` on every array leaf of ``tree`` (``None`` leaves stay ``None``)."""
    return jax.tree.map(lambda x: copy_rows(x, src, dst, axis), tree)


def zeros(shape: tuple[int, ...], dtype: Any, sharding: Any = None) -> jax.Array:
    """A zeroed device array, optionally created directly with ``sharding``."""
    if sharding is None:
        return jnp.zeros(shape, dtype)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()
