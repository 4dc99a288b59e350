"""Prefix caching on the host: block keys, a block pool that keeps freed full blocks for reuse, and window-state
snapshots (numpy and hashlib only; docs/prefix_cache.md).

* **Keys.** Full block ``i`` of a sequence (positions ``[i·B, (i+1)·B)``) is keyed by a chained hash: the key of
  block ``i - 1`` (the *salt* for block 0), the block's token ids and, when the model's cache at a position
  depends on the next token (V3's MTP layer pairs every token with its successor), the ``lookahead`` tokens after
  it. The salt holds everything else that changes a block's content: the model, the precision mode, the cache
  format, the bounded-replay mode and its ``K``, the ring sizes. Seeds and sampling parameters never change a
  cache entry, so they are not in it.
* **Blocks.** :class:`PrefixBlockPool` is a :class:`~deepinfer_jax.cache.blocks.BlockAllocator` whose full blocks
  can be *registered* under their key. A registered block whose last owner frees it stays resident and
  *evictable*; it is reused when a later sequence's prefix has the same key (:meth:`PrefixBlockPool.acquire`
  adds an owner), and it is evicted, least recently freed first, only when an allocation finds the free list
  empty. ``num_free`` counts free and evictable blocks: both can be handed out.
* **Snapshots.** DeepSeek-V4 and V4.1 keep per-sequence state outside the blocks (window rings, compression
  state, Engram ids, the drafter's rings). :class:`SnapshotPool` holds copies of a sequence's state slot taken
  right after a block boundary ``h``, keyed by the key of the block that ends at ``h``, in extra state slots
  (LRU among themselves). A hit at ``h`` copies the snapshot into the new sequence's slot.
"""

from __future__ import annotations

import collections
import hashlib
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from deepinfer_jax.cache.blocks import BlockAllocator, CacheExhaustedError, _check_int

__all__ = [
    "Gathered",
    "HostEntry",
    "HostTier",
    "PrefixBlockPool",
    "SnapshotPool",
    "block_keys",
    "prefix_salt",
]


def prefix_salt(**fields: object) -> bytes:
    """The key of "block -1": a digest of every setting that changes cache contents (sorted by name)."""
    text = repr(sorted((k, repr(v)) for k, v in fields.items()))
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def block_keys(
    tokens: np.ndarray,
    block_size: int,
    *,
    salt: bytes,
    first: int = 0,
    previous: bytes | None = None,
    lookahead: int = 0,
    count: int | None = None,
) -> list[bytes]:
    """Chained keys of full blocks ``first, first + 1, ...`` of ``tokens`` (the whole sequence so far).

    ``previous`` is the key of block ``first - 1`` (``None`` when ``first == 0``). Block ``i`` needs tokens up to
    ``(i + 1)·block_size + lookahead``; keys are made while the tokens last, at most ``count``.
    """
    tokens = np.asarray(tokens, dtype=np.int32)
    key = salt if first == 0 else previous
    if key is None:
        raise ValueError("block_keys: previous must be the key of block first - 1")
    out: list[bytes] = []
    i = first
    while (i + 1) * block_size + lookahead <= len(tokens) and (count is None or len(out) < count):
        h = hashlib.blake2b(key, digest_size=16)
        h.update(tokens[i * block_size : (i + 1) * block_size + lookahead].tobytes())
        key = h.digest()
        out.append(key)
        i += 1
    return out


class PrefixBlockPool(BlockAllocator):
    """A block pool with a prefix cache: registered full blocks outlive their owners until evicted (LRU).

    Invariants (:meth:`check_consistency`): a block is exactly one of free, owned (refcount > 0) or evictable
    (registered with refcount 0); the key map and the block map are inverse; no refcount is negative.
    """

    def __init__(self, num_blocks: int, block_size: int = 128) -> None:
        super().__init__(num_blocks, block_size)
        self._block_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.evicted: list[tuple[bytes, int]] = []
        """``(key, block)`` evicted since the caller last cleared this list (the scheduler drops their snapshots
        or saves both to the host tier, before the step that reuses the block)."""
        self.num_evictions = 0

    # ---------------------------------------------------------------- pool

    def reset(self) -> None:
        super().reset()
        self._block_of.clear()
        self._key_of.clear()
        self._evictable.clear()
        self.evicted.clear()

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Registered blocks (owned or evictable)."""
        return len(self._key_of)

    def allocate(self, n: int) -> list[int]:
        n = _check_int("number of blocks requested", n, 0)
        if n > self.num_free:
            raise CacheExhaustedError(
                f"cannot allocate {n} block(s): {self.num_free} of {self.capacity} are free"
            )
        ids = [self._free.popleft() for _ in range(min(n, len(self._free)))]
        while len(ids) < n:  # evict the least recently freed cached block
            block, _ = self._evictable.popitem(last=False)
            self.evicted.append((self._unregister(block), block))
            self.num_evictions += 1
            ids.append(block)
        self._refs[ids] = 1
        return ids

    def _unowned(self, id_: int) -> None:
        # A registered block left without an owner stays resident, most recently freed last.
        if id_ in self._key_of:
            self._evictable[id_] = None
        else:
            self._free.append(id_)

    # ---------------------------------------------------------------- cache

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """Blocks of the longest prefix of ``keys`` that is cached (no owner added)."""
        out = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            out.append(block)
        return out

    def acquire(self, blocks: Iterable[int]) -> None:
        """Add one owner to each cached block (an evictable one leaves the LRU)."""
        for b in blocks:
            if b not in self._key_of:
                raise ValueError(f"block {b} cannot be acquired: it is not cached")
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def register(self, block: int, key: bytes) -> bool:
        """Cache an owned full ``block`` under ``key``; False (nothing changes) when the key is cached already or
        the block is registered under another key."""
        if not self.is_allocated(block):
            raise ValueError(f"block {block} cannot be registered: it is not allocated")
        if key in self._block_of or block in self._key_of:
            return False
        self._block_of[key] = block
        self._key_of[block] = key
        return True

    def key_of(self, block: int) -> bytes | None:
        return self._key_of.get(block)

    def cached_block(self, key: bytes) -> int | None:
        return self._block_of.get(key)

    def _unregister(self, block: int) -> bytes:
        key = self._key_of.pop(block)
        del self._block_of[key]
        return key

    def clear_cache(self) -> int:
        """Forget every key (``LLM.reset_prefix_cache``): evictable blocks return to the free list, owned ones
        stay with their owners. Returns the blocks forgotten."""
        n = len(self._key_of)
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._key_of.clear()
        self._block_of.clear()
        return n

    def check_consistency(self) -> None:
        free = list(self._free)
        if len(set(free)) != len(free):
            raise AssertionError("block free list holds duplicates")
        if (self._refs < 0).any():
            raise AssertionError("a block refcount is negative")
        free_set, evictable = set(free), set(self._evictable)
        if free_set & evictable:
            raise AssertionError(f"blocks {sorted(free_set & evictable)} are both free and cached")
        if free_set & set(self._key_of):
            raise AssertionError("a free block is still registered")
        for b in evictable:
            if b not in self._key_of or self._refs[b] != 0:
                raise AssertionError(f"evictable block {b} is not an unowned cached block")
        owned = set(np.flatnonzero(self._refs > 0).tolist())
        if owned & (free_set | evictable):
            raise AssertionError("an owned block is free or evictable")
        if 0 in free_set | evictable | owned:
            raise AssertionError("reserved block 0 is in circulation")
        if len(free_set) + len(evictable) + len(owned) != self.capacity:
            raise AssertionError("blocks are lost: free + evictable + owned != capacity")
        for key, b in self._block_of.items():
            if self._key_of.get(b) != key:
                raise AssertionError("the key map and the block map disagree")
        if len(self._block_of) != len(self._key_of):
            raise AssertionError("the key map and the block map disagree")


class SnapshotPool:
    """State-slot snapshots at block boundaries, in the state slots ``first .. first + size - 1`` (LRU).

    A snapshot is *pending* from the step that writes it until its key is known (:meth:`commit`), then cached
    under that key. Slots restored by the step being planned are never evicted by it (:meth:`begin_step`), so a
    step never both reads and overwrites one slot.
    """

    def __init__(self, first: int, size: int) -> None:
        self.first, self.size = int(first), int(size)
        self._free: collections.deque[int] = collections.deque(range(first, first + size))
        self._slot_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._lru: collections.OrderedDict[int, None] = (
            collections.OrderedDict()
        )  # cached slots, oldest first
        self._pinned: set[int] = set()
        self.num_evictions = 0
        self.evicted: list[tuple[bytes, int]] = []
        """``(key, slot)`` of snapshots evicted by :meth:`take` since the caller last cleared this list."""

    def reset(self) -> None:
        self.__init__(self.first, self.size)  # type: ignore[misc]

    def begin_step(self) -> None:
        self._pinned.clear()

    def get(self, key: bytes) -> int | None:
        """The snapshot slot cached under ``key`` (``None``: none)."""
        return self._slot_of.get(key)

    def restore(self, key: bytes) -> int:
        """The slot of ``key``'s snapshot, marked as used now and pinned for the step being planned."""
        slot = self._slot_of[key]
        self._lru.move_to_end(slot)
        self._pinned.add(slot)
        return slot

    def take(self) -> int | None:
        """A slot for a new snapshot: a free one, else the least recently used unpinned one (``None``: all
        pinned)."""
        if self._free:
            return self._free.popleft()
        for slot in self._lru:
            if slot not in self._pinned:
                self.evicted.append((self._key_of[slot], slot))
                self._drop(slot)
                self.num_evictions += 1
                self._free.popleft()
                return slot
        return None

    def commit(self, slot: int, key: bytes) -> bool:
        """Cache the snapshot written into ``slot`` (from :meth:`take`) under ``key``; an existing snapshot of the
        same key wins and ``slot`` is freed (False)."""
        if key in self._slot_of:
            self._free.append(slot)
            return False
        self._slot_of[key] = slot
        self._key_of[slot] = key
        self._lru[slot] = None
        return True

    def demote(self, key: bytes) -> None:
        """Make ``key``'s snapshot the first to be evicted (a later snapshot of the same sequence supersedes it:
        a request that extends the sequence hits the later one)."""
        slot = self._slot_of.get(key)
        if slot is not None:
            self._lru.move_to_end(slot, last=False)

    def release(self, slot: int) -> None:
        """Return an uncommitted slot from :meth:`take`."""
        self._free.append(slot)

    def discard(self, keys: Iterable[bytes]) -> list[tuple[bytes, int]]:
        """Drop the snapshots of ``keys`` (their blocks were evicted); returns the ``(key, slot)`` dropped."""
        out = []
        for key in keys:
            slot = self._slot_of.get(key)
            if slot is not None:
                out.append((key, slot))
                self._drop(slot)
        return out

    def clear(self) -> None:
        for slot in list(self._lru):
            self._drop(slot)

    def _drop(self, slot: int) -> None:
        key = self._key_of.pop(slot)
        del self._slot_of[key]
        del self._lru[slot]
        self._free.append(slot)

    @property
    def num_cached(self) -> int:
        return len(self._slot_of)

    def check_consistency(self, pending: Iterable[int] = ()) -> None:
        free, cached, pending = set(self._free), set(self._lru), set(pending)
        if len(free) != len(self._free):
            raise AssertionError("snapshot free list holds duplicates")
        if free & cached or free & pending or cached & pending:
            raise AssertionError("a snapshot slot is in two states")
        if len(free) + len(cached) + len(pending) != self.size:
            raise AssertionError("snapshot slots are lost")
        if set(self._key_of) != cached or len(self._slot_of) != len(cached):
            raise AssertionError("snapshot maps disagree")


class HostEntry:
    """One block's or one snapshot's contents in host memory.

    ``data`` is set by the executor when the step that saves it is dispatched: a lazy reference into the
    gathered device arrays (their copy to the host runs asynchronously), turned into numpy arrays the first time
    it is read (:meth:`numpy`). ``kind`` is ``"block"`` or ``"state"``.
    """

    __slots__ = ("_arrays", "_ref", "expires", "key", "kind", "nbytes")

    def __init__(self, key: bytes, kind: str, nbytes: int, expires: float) -> None:
        self.key, self.kind, self.nbytes, self.expires = key, kind, int(nbytes), float(expires)
        self._ref: tuple | None = None
        self._arrays: object | None = None

    @property
    def ready(self) -> bool:
        return self._ref is not None or self._arrays is not None

    def attach(self, tree: object, index: tuple[int, int], axis: object) -> None:
        """The gathered tree (leaves ``[D, ...]``), this entry's ``(device, position)`` in it, and the gathered
        axis of each leaf (a pytree of ints, or one int)."""
        self._ref = (tree, index, axis)

    def store(self, arrays: object) -> None:
        """Set the contents directly (host arrays)."""
        self._arrays, self._ref = arrays, None

    def numpy(self) -> object:
        if self._arrays is None:
            assert self._ref is not None, "a host entry was read before its save was dispatched"
            tree, (d, j), axis = self._ref
            host = tree.numpy() if isinstance(tree, Gathered) else tree
            if isinstance(axis, int):
                self._arrays = _map(lambda x: np.take(x[d], j, axis=axis).copy(), host)
            else:
                self._arrays = _map(lambda x, a: np.take(x[d], j, axis=a).copy(), host, axis)
            self._ref = None
        return self._arrays


def _map(fn: Callable[..., object], *trees: object) -> object:
    import jax

    return jax.tree.map(fn, *trees)


class Gathered:
    """The device arrays one save gathered (leaves ``[D, ...]``), shared by the entries cut from them: copied to
    the host once, the first time one of them is read."""

    __slots__ = ("_host", "_tree")

    def __init__(self, tree: object) -> None:
        self._tree, self._host = tree, None

    def numpy(self) -> object:
        if self._host is None:
            import jax

            self._host = _map(
                np.asarray, jax.device_get(self._tree)
            )  # explicit: the transfer guard allows it
            self._tree = None
        return self._host


class HostTier:
    """Prefix caching's host-memory tier: blocks and snapshots evicted from one device, LRU within
    ``capacity`` bytes, each expiring ``ttl_s`` seconds after it was stored (or last used)."""

    def __init__(self, capacity: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity, self.ttl_s, self._clock = int(capacity), float(ttl_s), clock
        self._entries: collections.OrderedDict[tuple[str, bytes], HostEntry] = collections.OrderedDict()
        self.nbytes = 0
        self.num_stored = self.num_loaded = self.num_expired = self.num_dropped = 0

    def __len__(self) -> int:
        return len(self._entries)

    def reset(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def get(self, kind: str, key: bytes) -> HostEntry | None:
        """The ready entry of ``(kind, key)`` (made most recently used), or ``None`` (absent, expired, or its save
        not dispatched yet)."""
        entry = self._entries.get((kind, key))
        if entry is None or not entry.ready:
            return None
        now = self._clock()
        if entry.expires <= now:
            self._remove((kind, key))
            self.num_expired += 1
            return None
        entry.expires = now + self.ttl_s
        self._entries.move_to_end((kind, key))
        return entry

    def contains(self, kind: str, key: bytes) -> bool:
        """Whether :meth:`get` would find a ready, unexpired entry (without using it)."""
        entry = self._entries.get((kind, key))
        return entry is not None and entry.ready and entry.expires > self._clock()

    def put(self, kind: str, key: bytes, nbytes: int) -> HostEntry | None:
        """A new entry for ``(kind, key)``, its data to be attached by the executor; ``None`` when it can never
        fit or is held already. Expired entries go first, then the least recently used ones."""
        if nbytes > self.capacity or (kind, key) in self._entries:
            return None
        self.expire()
        while self.nbytes + nbytes > self.capacity:
            self._remove(next(iter(self._entries)))
            self.num_dropped += 1
        entry = HostEntry(key, kind, nbytes, self._clock() + self.ttl_s)
        self._entries[(kind, key)] = entry
        self.nbytes += entry.nbytes
        self.num_stored += 1
        return entry

    def expire(self) -> None:
        now = self._clock()
        for k in [k for k, e in self._entries.items() if e.expires <= now]:
            self._remove(k)
            self.num_expired += 1

    def _remove(self, k: tuple[str, bytes]) -> None:
        self.nbytes -= self._entries.pop(k).nbytes
