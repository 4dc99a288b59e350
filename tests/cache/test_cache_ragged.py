"""Ragged-batch addressing: position rings and paged compressed entries against direct per-sequence lookups."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ragged_meta import plan_meta  # tests/ragged_meta.py

from deepinfer_jax.cache import ragged


@settings(max_examples=12, deadline=None)
@given(
    data=st.data(),
    num_rows=st.integers(1, 4),
    ring_len=st.integers(3, 7),
    pad_tokens=st.integers(0, 3),
    pad_rows=st.integers(0, 2),
)
def test_history_and_ring_write_match_the_full_sequence(data, num_rows, ring_len, pad_tokens, pad_rows):
    depth = data.draw(st.integers(1, ring_len + 1))
    starts = [data.draw(st.integers(0, 20)) for _ in range(num_rows)]
    counts = [data.draw(st.integers(0, 9)) for _ in range(num_rows)]
    num_slots = num_rows + 2
    slots = list(np.random.default_rng(sum(starts)).permutation(num_slots)[:num_rows])
    # Every sequence's item at position q is 1000*slot + q + 1 (0 = "absent"); the ring holds the items of
    # the positions before this step, as earlier steps would have left them.
    ring = np.zeros((num_slots, ring_len, 2), np.float32)
    for s, a in zip(slots, starts):
        for q in range(max(0, a - ring_len), a):
            ring[s, q % ring_len] = [1000 * s + q + 1, -(1000 * s + q + 1)]
    meta = plan_meta(starts, counts, pad_tokens, pad_rows, slots, [[0]] * (num_rows + pad_rows))
    new = np.zeros((meta.num_tokens, 2), np.float32)
    for t in range(meta.num_tokens):
        if int(meta.token_seq[t]) < num_rows:
            s, q = slots[int(meta.token_seq[t])], int(meta.positions[t])
            new[t] = [1000 * s + q + 1, -(1000 * s + q + 1)]
    items, present = ragged.history(jnp.asarray(ring), jnp.asarray(new), meta, depth)
    items, present = np.asarray(items), np.asarray(present)
    for t in range(meta.num_tokens):
        row = int(meta.token_seq[t])
        for j in range(depth):
            q = int(meta.positions[t]) - depth + 1 + j
            if row >= num_rows or q < 0:
                assert not present[t, j]
                continue
            assert present[t, j]
            want = 1000 * slots[row] + q + 1
            np.testing.assert_array_equal(items[t, j], [want, -want])
    # After the write, the ring holds each row's last ring_len positions.
    after = np.asarray(ragged.ring_write(jnp.asarray(ring), jnp.asarray(new), meta))
    for s, a, n in zip(slots, starts, counts):
        for q in range(max(0, a + n - ring_len), a + n):
            assert after[s, q % ring_len, 0] == 1000 * s + q + 1


def test_history_refuses_a_ring_too_short():
    meta = plan_meta([0], [2], 0, 0, [0], [[0]])
    with pytest.raises(ValueError, match="ring holds 2 positions"):
        ragged.history(jnp.zeros((1, 2, 1)), jnp.zeros((2, 1)), meta, 4)


@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_compressed_entries_land_in_their_pages_and_read_back(ratio):
    block = 8
    # Row 0 prefills 0..12 (two pages), row 1 decodes position 15 (its second page), a padding row and token.
    meta = plan_meta([0, 15], [13, 1], 1, 1, [2, 0], [[5, 3], [1, 4]])
    num_blocks = 6
    emits, index, blocks, offsets = (
        np.asarray(a) for a in ragged.compressed_slots(meta, ratio, block, num_blocks)
    )
    pos = np.asarray(meta.positions)
    seq = np.asarray(meta.token_seq)
    tables = {0: [5, 3], 1: [1, 4]}
    for t in range(meta.num_tokens):
        real = seq[t] < 2
        want = real and (pos[t] + 1) % ratio == 0
        assert emits[t] == want
        if want:
            c = (pos[t] + 1) // ratio - 1
            assert index[t] == c
            assert blocks[t] == tables[int(seq[t])][c * ratio // block]
            assert offsets[t] == (c * ratio % block) // ratio
        else:
            assert blocks[t] == num_blocks
    pages = jnp.zeros((num_blocks, block // ratio, 3), jnp.float32)
    entries = jnp.asarray(np.stack([pos + 1, seq, pos * 2], axis=1).astype(np.float32))
    pages = ragged.write_entries(pages, entries, jnp.asarray(blocks), jnp.asarray(offsets))
    # The flat rows the store ops write name the same places (-1 where nothing is written).
    rows = np.asarray(ragged.page_rows(jnp.asarray(blocks), jnp.asarray(offsets), block // ratio, num_blocks))
    np.testing.assert_array_equal(rows, np.where(emits, blocks * (block // ratio) + offsets, -1))
    flat = jnp.zeros((num_blocks * (block // ratio), 3), jnp.float32).at[jnp.where(rows >= 0, rows, 10**6)]
    flat = flat.set(entries, mode="drop")
    np.testing.assert_array_equal(np.asarray(flat).reshape(pages.shape), np.asarray(pages))
    # Row 0 reads its entries 0..; row 1 reads the entry its token emitted (if any) and an absent one.
    last0 = 13 // ratio - 1
    idx = np.full((meta.num_tokens, 2), -1, np.int32)
    idx[0] = [0, last0]
    idx[13] = [(16 // ratio) - 1 if 16 % ratio == 0 else -1, -1]
    got = np.asarray(ragged.gather_entries(pages, meta, jnp.asarray(idx), ratio, block))
    np.testing.assert_array_equal(got[0, 0], [ratio, 0, 2 * (ratio - 1)])
    np.testing.assert_array_equal(got[0, 1], [(last0 + 1) * ratio, 0, 2 * ((last0 + 1) * ratio - 1)])
    if 16 % ratio == 0:
        np.testing.assert_array_equal(got[13, 0], [16, 1, 30])
    np.testing.assert_array_equal(got[13, 1], [0, 0, 0])
