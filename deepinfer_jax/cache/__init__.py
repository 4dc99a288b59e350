"""Device KV-cache layouts and host-side cache bookkeeping.

:mod:`~deepinfer_jax.cache.record_bytes` sizes the per-token records of every cache kind from the numerics
record formats, so page and slot sizes follow the formats instead of repeating their byte counts.
"""

from deepinfer_jax.cache.record_bytes import (
    cache_record_formats,
    describe_record_formats,
    kv_bytes_per_block,
    kv_bytes_per_token,
    record_bytes,
)

__all__ = [
    "cache_record_formats",
    "describe_record_formats",
    "kv_bytes_per_block",
    "kv_bytes_per_token",
    "record_bytes",
]
