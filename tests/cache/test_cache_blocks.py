"""Block allocator and state-slot manager: reserved id 0, FIFO reuse, ownership checks, exhaustion."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_jax.cache.blocks import (
    AllocStatus,
    BlockAllocator,
    CacheExhaustedError,
    StateSlotManager,
    blocks_for_tokens,
)


def test_block_zero_is_reserved_and_reuse_is_fifo() -> None:
    pool = BlockAllocator(5, block_size=16)
    assert pool.capacity == 4 and pool.num_free == 4
    assert pool.allocate(3) == [1, 2, 3]
    pool.free([2, 1])
    # 4 was never used; then the freed ids in the order they were freed.
    assert pool.allocate(3) == [4, 2, 1]
    assert pool.num_free == 0 and pool.usage == 1.0
    pool.check_consistency()


def test_exhaustion_is_a_clear_error_and_changes_nothing() -> None:
    pool = BlockAllocator(3, block_size=8)
    pool.allocate(1)
    with pytest.raises(CacheExhaustedError, match=r"cannot allocate 2 block.*1 of 2 are free"):
        pool.allocate(2)
    assert pool.num_free == 1
    pool.check_consistency()


def test_double_free_reserved_and_foreign_ids_are_refused_atomically() -> None:
    pool = BlockAllocator(4)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(ValueError, match=f"block {a} is freed twice"):
        pool.free([b, a])
    assert pool.is_allocated(b)  # the bad call freed nothing
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([b, b])
    with pytest.raises(ValueError, match="block 0 is reserved"):
        pool.free([0])
    with pytest.raises(ValueError, match=r"block 9 is outside the pool \[1, 4\)"):
        pool.free([9])
    pool.free([b])
    pool.check_consistency()


def test_can_allocate_answers_ok_later_never() -> None:
    slots = StateSlotManager(3)
    assert slots.can_allocate(2) is AllocStatus.OK
    slots.allocate_one()
    assert slots.can_allocate(2) is AllocStatus.LATER
    assert slots.can_allocate(3) is AllocStatus.NEVER
    with pytest.raises(ValueError, match="state slot 0 is reserved"):
        slots.free([0])


def test_bad_construction_names_the_argument() -> None:
    with pytest.raises(ValueError, match="number of blocks = 1 must be >= 2"):
        BlockAllocator(1)
    with pytest.raises(TypeError, match="block_size must be an int"):
        BlockAllocator(4, block_size=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_tokens = -1"):
        blocks_for_tokens(-1, 8)


@pytest.mark.parametrize(("tokens", "blocks"), [(0, 0), (1, 1), (16, 1), (17, 2), (128, 8)])
def test_blocks_for_tokens(tokens: int, blocks: int) -> None:
    assert blocks_for_tokens(tokens, 16) == blocks


@settings(max_examples=60, deadline=None)
@given(size=st.integers(2, 12), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=40))
def test_random_alloc_free_never_leaks_or_double_frees(size: int, ops: list[tuple[bool, int]]) -> None:
    """Model check against a set of owned ids: every id is either free or owned by exactly one owner."""
    pool = BlockAllocator(size)
    owners: list[list[int]] = []
    for is_alloc, n in ops:
        if is_alloc:
            if n <= pool.num_free:
                ids = pool.allocate(n)
                assert 0 not in ids
                owners.append(ids)
            else:
                with pytest.raises(CacheExhaustedError):
                    pool.allocate(n)
        elif owners:
            ids = owners.pop(n % len(owners))
            pool.free(ids)
            if ids:
                with pytest.raises(ValueError, match="freed twice"):
                    pool.free(ids[:1])
        owned = [i for ids in owners for i in ids]
        assert len(owned) == len(set(owned))
        assert pool.num_allocated == len(owned)
        pool.check_consistency()
    for ids in owners:
        pool.free(ids)
    assert pool.num_free == pool.capacity
