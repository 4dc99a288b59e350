"""Host-side bookkeeping of the paged cache: the block allocator and the state-slot manager (numpy only).

The device caches are fixed pools: ``num_blocks`` pages of ``block_size`` token positions (compressed KV,
indexer keys, the V3 latent) and ``num_slots`` per-sequence state slots (window rings, compression state, the
last sampled token). These classes decide which sequence owns which page or slot; the device never allocates.

Conventions (spec/engine.md §6.1):

* Id 0 of each pool is reserved and never handed out. Padding rows of a step can point at it without aliasing
  a live sequence, and a zeroed table entry can never name a real page by accident.
* Ownership is counted: an allocated id has one owner, and :meth:`IdPool.share` adds owners (the ``n``
  samples of one prompt share its full pages). :meth:`IdPool.free` drops one owner per id and returns an id to
  the free list when its last owner lets go. Freeing an id that is not allocated, or the reserved id, is a bug
  in the caller and raises at once instead of corrupting the free list.
* Freed ids go to the back of a FIFO free list and allocation takes from the front, so a just-freed page is
  reused as late as possible. With asynchronous scheduling a page freed on the host may still be written by a
  step already dispatched; the device runs steps in order, so the next owner's writes always come later, but
  late reuse also keeps such pages untouched for longer, which makes stale-read bugs easier to see.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Iterable

import numpy as np

__all__ = [
    "AllocStatus",
    "BlockAllocator",
    "CacheExhaustedError",
    "IdPool",
    "StateSlotManager",
    "blocks_for_tokens",
]

RESERVED_ID = 0


class CacheExhaustedError(RuntimeError):
    """An allocation asked for more ids than are free. Callers check :meth:`IdPool.can_allocate` first; the
    scheduler turns a shortage into waiting or preemption, so seeing this error means a scheduling bug."""


class AllocStatus(enum.Enum):
    """Answer of :meth:`IdPool.can_allocate`: possible now, possible once others free theirs, or never."""

    OK = "ok"
    LATER = "later"
    NEVER = "never"


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` positions: ``ceil(num_tokens / block_size)``."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens = {num_tokens} must be >= 0")
    if block_size < 1:
        raise ValueError(f"block_size = {block_size} must be >= 1")
    return -(-num_tokens // block_size)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} = {value} must be >= {minimum}")
    return int(value)


class IdPool:
    """A fixed pool of integer ids ``1 .. size - 1`` (id 0 reserved) with FIFO reuse and ownership checks.

    ``kind`` names the resource in error messages ("block", "state slot").
    """

    def __init__(self, size: int, *, kind: str = "id") -> None:
        self._size = _check_int(f"number of {kind}s", size, 2)
        self._kind = kind
        self._free: collections.deque[int] = collections.deque(range(1, self._size))
        self._refs = np.zeros(self._size, dtype=np.int64)

    @property
    def _allocated(self) -> np.ndarray:
        return self._refs > 0

    def reset(self) -> None:
        """Free every id at once (after a failed run: whatever the owners were, nothing is owned now)."""
        self._free = collections.deque(range(1, self._size))
        self._refs[:] = 0

    @property
    def size(self) -> int:
        """Total ids, the reserved id 0 included."""
        return self._size

    @property
    def capacity(self) -> int:
        """Ids that can ever be allocated (``size - 1``)."""
        return self._size - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        return self.capacity - len(self._free)

    def is_allocated(self, id_: int) -> bool:
        return 0 <= id_ < self._size and bool(self._refs[id_] > 0)

    def refcount(self, id_: int) -> int:
        """Owners of ``id_`` (0 = free)."""
        return int(self._refs[id_]) if 0 <= id_ < self._size else 0

    def share(self, ids: Iterable[int]) -> None:
        """Add one owner to each of ``ids`` (all allocated; checked before any changes)."""
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 < i < self._size or self._refs[i] <= 0:
                raise ValueError(f"{self._kind} {i} cannot be shared: it is not allocated")
        np.add.at(self._refs, ids, 1)

    def can_allocate(self, n: int) -> AllocStatus:
        """Whether ``n`` ids can be allocated now (``OK``), after others are freed (``LATER``), or never."""
        n = _check_int(f"number of {self._kind}s requested", n, 0)
        if n > self.capacity:
            return AllocStatus.NEVER
        return AllocStatus.OK if n <= len(self._free) else AllocStatus.LATER

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` ids from the front of the free list; :class:`CacheExhaustedError` if fewer are free."""
        n = _check_int(f"number of {self._kind}s requested", n, 0)
        if n > len(self._free):
            raise CacheExhaustedError(
                f"cannot allocate {n} {self._kind}(s): {len(self._free)} of {self.capacity} are free"
            )
        ids = [self._free.popleft() for _ in range(n)]
        self._refs[ids] = 1
        return ids

    def allocate_one(self) -> int:
        return self.allocate(1)[0]

    def free(self, ids: Iterable[int]) -> None:
        """Drop one owner of each of ``ids``; those left without an owner go to the back of the free list (in
        the given order).

        Every id is checked before any is freed, so a bad call leaves the pool unchanged: the reserved id, an
        id outside the pool, an id that is not allocated, or one listed twice raises ``ValueError``.
        """
        ids = [int(i) for i in ids]
        seen: set[int] = set()
        for i in ids:
            if i == RESERVED_ID:
                raise ValueError(f"{self._kind} 0 is reserved and is never allocated; it cannot be freed")
            if not 0 < i < self._size:
                raise ValueError(f"{self._kind} {i} is outside the pool [1, {self._size})")
            if self._refs[i] <= 0 or i in seen:
                raise ValueError(f"{self._kind} {i} is freed twice (it is not allocated)")
            seen.add(i)
        self._refs[ids] -= 1
        for i in ids:
            if self._refs[i] == 0:
                self._unowned(i)

    def _unowned(self, id_: int) -> None:
        """Where an id goes when its last owner frees it: the back of the free list."""
        self._free.append(id_)

    def check_consistency(self) -> None:
        """Assert the free list and the ownership bitmap agree (tests and debug runs)."""
        free = list(self._free)
        if len(set(free)) != len(free):
            raise AssertionError(f"{self._kind} free list holds duplicates")
        if RESERVED_ID in free or self._allocated[RESERVED_ID]:
            raise AssertionError(f"reserved {self._kind} 0 is in circulation")
        expected = np.ones(self._size, dtype=bool)
        expected[RESERVED_ID] = False
        expected[free] = False
        if not np.array_equal(expected, self._allocated):
            raise AssertionError(f"{self._kind} free list and ownership bitmap disagree")


class BlockAllocator(IdPool):
    """The paged-cache page pool: ``num_blocks`` pages (page 0 reserved) of ``block_size`` token positions."""

    def __init__(self, num_blocks: int, block_size: int = 128) -> None:
        self.block_size = _check_int("block_size", block_size, 1)
        super().__init__(num_blocks, kind="block")

    def blocks_for(self, num_tokens: int) -> int:
        """Pages needed for ``num_tokens`` positions."""
        return blocks_for_tokens(num_tokens, self.block_size)

    @property
    def usage(self) -> float:
        """Fraction of allocatable pages in use."""
        return self.num_allocated / self.capacity


class StateSlotManager(IdPool):
    """The per-sequence state-slot pool: ``num_slots`` slots (slot 0 reserved); a sequence holds one slot while
    it has cache contents."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots, kind="state slot")
