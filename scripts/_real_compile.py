"""What `compile_real_v3.py` and `compile_real_v41.py` share: the abstract decode inputs and the timed stages."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def decode_meta_structs(batch: int, context: int, block: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Abstract arguments of ``make_meta`` for ``batch`` decode rows of one token at ``context`` tokens."""
    i32 = jnp.int32
    return (
        jax.ShapeDtypeStruct((batch,), i32),  # token_seq
        jax.ShapeDtypeStruct((batch,), i32),  # positions
        jax.ShapeDtypeStruct((batch + 1,), i32),  # query_start
        jax.ShapeDtypeStruct((batch,), i32),  # context_lens
        jax.ShapeDtypeStruct((batch,), i32),  # seq_slots
        jax.ShapeDtypeStruct((batch, context // block), i32),  # block_tables
    )


def compile_stages(fn: Callable[..., Any], *args: Any) -> dict[str, float]:
    """Trace, lower and compile ``jax.jit(fn)`` (the cache, argument 1, donated) over abstract ``args``: the
    seconds of each stage, XLA's reported temporaries and the StableHLO text's size."""
    jitted = jax.jit(fn, donate_argnums=(1,))
    t0 = time.perf_counter()
    traced = jitted.trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    return {
        "trace_s": round(t1 - t0, 1),
        "lower_s": round(t2 - t1, 1),
        "compile_s": round(t3 - t2, 1),
        "temp_mib": round(compiled.memory_analysis().temp_size_in_bytes / (1 << 20), 1),
        "hlo_chars": len(lowered.as_text()),
    }
