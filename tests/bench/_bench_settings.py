"""Shared settings of the bench tests: one tiny engine shape, so every test reuses the same compiled steps."""

from __future__ import annotations

# The engine settings of tests/engine/test_engine_llm_cli.py (same buckets, so the compilation cache is shared).
KV_CACHE_MEMORY = 24 * 4 * 16 * 96 * 4 + 17 * 4 * 513
ENGINE_FIELDS = {
    "model": "tiny-v3",
    "dtype": "float32",
    "max_num_seqs": 16,
    "max_num_batched_tokens": 64,
    "kv_cache_memory": KV_CACHE_MEMORY,
    "engine_overrides": {"cache.block_size": 16},
}
