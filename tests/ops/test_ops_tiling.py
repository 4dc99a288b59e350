"""Batch-invariant tiling helpers (``ops/tiling.py``): ``rowwise_carry`` threads one array through fixed tiles."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.ops.tiling import rowwise_carry


def _write(table, values, rows):
    """A paged-write stand-in: rows' doubled values scattered into ``table`` (-1 skips), their sums returned."""
    target = jnp.where(rows >= 0, rows, table.shape[0])
    return table.at[target].set(2 * values, mode="drop"), values.sum(axis=1)


@pytest.mark.parametrize("n", [1, 7, 8, 13])
def test_rowwise_carry_equals_one_call_in_any_tile(n):
    rng = np.random.default_rng(n)
    values = jnp.asarray(rng.standard_normal((n, 3)), jnp.float32)
    rows = jnp.asarray(rng.permutation(20)[:n], jnp.int32).at[0].set(-1)
    table = jnp.zeros((20, 3), jnp.float32)
    want = _write(table, values, rows)
    for tile in (None, 1, 4, 8):
        got = rowwise_carry(_write, tile, table, values, rows, fills=(0, -1))
        np.testing.assert_array_equal(got[0], want[0])  # padding rows (slot -1) write nothing
        np.testing.assert_array_equal(got[1], want[1])
        assert got[1].shape == (n,)


def test_rowwise_carry_needs_one_fill_per_argument():
    with pytest.raises(ValueError, match="1 fills for 2 arguments"):
        rowwise_carry(_write, 4, jnp.zeros((4, 3)), jnp.zeros((2, 3)), jnp.zeros((2,), jnp.int32), fills=(0,))
