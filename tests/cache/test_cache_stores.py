"""Key stores (``cache/stores.py``) as the attention-side ops see them: format names and what the store ops take."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.cache.stores import key_store
from deepinfer_jax.ops.kv_store import kv_store_records

CASES = [
    ("window", True, "mxfp8"),
    ("compressed", True, "fp4"),
    ("compressed", False, "mxfp8"),
    ("indexer", True, "mxfp4"),
]


@pytest.mark.parametrize(("kind", "use_fp4", "name"), CASES)
def test_record_stores_write_through_kv_store_records_as_encode_does(kind, use_fp4, name):
    store = key_store(kind, 64, "quantized", use_fp4=use_fp4)
    assert store.op_format == name and store.encodes_in_ops
    keys = jnp.asarray(np.random.default_rng(0).standard_normal((5, 64)) * 3, jnp.float32)
    pages = store.zeros(4, 2)
    slots = jnp.asarray([6, 0, -1, 3, 5], jnp.int32)
    got = kv_store_records(pages, store.op_values(keys), slots, key_format=store.op_format)
    flat = np.asarray(got).reshape(8, -1)
    want = np.asarray(store.encode(keys))
    for n, slot in enumerate(np.asarray(slots)):
        if slot >= 0:
            np.testing.assert_array_equal(flat[slot], want[n])
    assert not flat[[1, 2, 4, 7]].any()  # untouched rows, and the skipped key went nowhere


@pytest.mark.parametrize("cast", ["none", "mxfp8", "fp4_e4m3", "mxfp4"])
def test_plain_stores_take_the_cast_values(cast):
    store = key_store("window", 64, "float32", cast=cast)
    assert store.op_format is None and store.encodes_in_ops == (cast == "none")
    keys = jnp.asarray(np.random.default_rng(1).standard_normal((3, 64)), jnp.float32)
    got = kv_store_records(store.zeros(2, 2), store.op_values(keys), jnp.asarray([3, 0, 1]), key_format=None)
    np.testing.assert_array_equal(np.asarray(got).reshape(4, 64)[[3, 0, 1]], np.asarray(store.encode(keys)))
