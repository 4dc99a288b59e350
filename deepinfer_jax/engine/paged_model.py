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
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from deepinfer_jax.cache.ragged import RaggedMeta

__all__ = [
    "BATCH_INVARIANT_TILE",
    "CacheLayout",
    "MemoryPlan",
    "PagedCacheSpec",
    "PagedModel",
    "plan_memory",
    "rowwise",
]

_MIB = 1 << 20

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


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Per-unit device bytes of a family's caches.

    Attributes:
      block_size: tokens per cache block.
      bytes_per_block: bytes of one block across every layer that stores paged data.
      bytes_per_slot: bytes of one state slot (window rings, compression state; 0 when the family has none).
      dtype: the storage precision in words (``"float32"``, ``"bfloat16"``, or a format summary).
      lines: human-readable lines describing the records (printed by the memory breakdown).
    """

    block_size: int
    bytes_per_block: int
    bytes_per_slot: int
    dtype: str
    lines: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class PagedCacheSpec:
    """The sized cache of one engine: block and slot counts with the family's layout."""

    layout: CacheLayout
    num_blocks: int
    num_slots: int

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def dtype(self) -> str:
        return self.layout.dtype

    @property
    def bytes_per_block(self) -> int:
        return self.layout.bytes_per_block

    @property
    def bytes_per_token(self) -> float:
        """Paged bytes per cached token (all layers); state slots are per sequence, not per token."""
        return self.layout.bytes_per_block / self.layout.block_size

    @property
    def usable_tokens(self) -> int:
        """Token capacity of the allocatable blocks (all but the reserved block 0)."""
        return (self.num_blocks - 1) * self.layout.block_size

    @property
    def block_bytes(self) -> int:
        return self.num_blocks * self.layout.bytes_per_block

    @property
    def slot_bytes(self) -> int:
        return self.num_slots * self.layout.bytes_per_slot


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

    def check_block_size(self, block_size: int) -> None:  # noqa: B027 - optional hook, no-op by default
        """Refuse a cache block size the family cannot page (default: any)."""


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The outcome of :func:`plan_memory`: the sized spec and the numbers behind it."""

    spec: PagedCacheSpec
    budget_bytes: int
    reserved_bytes: int

    @property
    def unused_bytes(self) -> int:
        return self.budget_bytes - self.reserved_bytes - self.spec.slot_bytes - self.spec.block_bytes

    def describe(self) -> str:
        """A multi-line human-readable breakdown (printed when an engine starts)."""
        s, lay = self.spec, self.spec.layout
        lines = [
            f"KV cache plan: budget {self.budget_bytes / _MIB:.1f} MiB ({lay.dtype})",
            f"  per-slot sampling state and other reservations: {self.reserved_bytes / _MIB:.2f} MiB",
            *(f"  {line}" for line in lay.lines),
            f"  state slots: {s.num_slots} x {lay.bytes_per_slot} B = {s.slot_bytes / _MIB:.2f} MiB",
            f"  block: {lay.block_size} tokens, {lay.bytes_per_block} B over all layers",
            f"  blocks: {s.num_blocks} ({s.num_blocks - 1} usable + reserved block 0) = "
            f"{s.block_bytes / _MIB:.2f} MiB, {s.usable_tokens} tokens",
            f"  unused: {self.unused_bytes / _MIB:.2f} MiB",
        ]
        return "\n".join(lines)


def plan_memory(
    layout: CacheLayout,
    budget_bytes: int,
    *,
    num_slots: int,
    reserved_bytes: int = 0,
    num_blocks: int | None = None,
) -> MemoryPlan:
    """Size the block pool: the budget minus reservations and state slots, in whole blocks.

    ``num_blocks`` fixes the count instead (it must still fit). At least two blocks (the reserved one and one
    usable) must fit, else ``ValueError`` naming what one block and the slots take.
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1:
        raise ValueError(f"kv_cache_memory: expected a positive number of bytes, got {budget_bytes!r}")
    if isinstance(reserved_bytes, bool) or not isinstance(reserved_bytes, int) or reserved_bytes < 0:
        raise ValueError(f"reserved_bytes: expected an int >= 0, got {reserved_bytes!r}")
    slots = num_slots * layout.bytes_per_slot
    available = budget_bytes - reserved_bytes - slots
    per_block = max(layout.bytes_per_block, 1)
    fitting = available // per_block if available > 0 else 0
    if num_blocks is None:
        num_blocks = int(fitting)
    elif num_blocks > fitting:
        raise ValueError(
            f"cache.num_blocks = {num_blocks}: needs {num_blocks * per_block} B but kv_cache_memory leaves "
            f"{max(available, 0)} B after {reserved_bytes} B of sampling state and {slots} B of state slots"
        )
    if num_blocks < 2:
        raise ValueError(
            f"kv_cache_memory = {budget_bytes} B: too small for the paged cache; one block of {layout.block_size} "
            f"tokens takes {per_block} B, at least 2 blocks (one reserved) plus {slots} B of state slots "
            f"({num_slots} x {layout.bytes_per_slot} B) and {reserved_bytes} B of sampling state are needed "
            f"({2 * per_block + slots + reserved_bytes} B)"
        )
    return MemoryPlan(PagedCacheSpec(layout, int(num_blocks), num_slots), budget_bytes, reserved_bytes)


def zeros(shape: tuple[int, ...], dtype: Any, sharding: Any = None) -> jax.Array:
    """A zeroed device array, optionally created directly with ``sharding``."""
    if sharding is None:
        return jnp.zeros(shape, dtype)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()
