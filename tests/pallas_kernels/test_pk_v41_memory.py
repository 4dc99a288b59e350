"""Real-scale temporaries of the attention-side ops with the kernels selected, compiled (never run).

Shapes: a DeepSeek-V4.1-Flash decode step of 64 sequences at 128K context (``configs/deepseek_v41_flash.yaml``:
64 heads of 512, window 128, top-512 selection, 32 indexer heads of 128, 128-token blocks holding 64 ratio-2
entries). The caches alone are 1.2 GB of FP4 compressed records and 0.3 GB of MXFP4 indexer records for one layer,
so a path that decodes or gathers a context shows up at once.

The kernels are selected the way the engine selects them -- ``ops.resolve_selection`` with ``ops.backend =
pallas_gpu`` -- and, with no GPU here, compiled for the CPU in Pallas interpret mode (``ops.interpret``): what XLA
reports is the interpreted program's temporary memory, which holds the kernels' outputs and per-step tiles, never a
copy of the pages. (On a GPU a Pallas kernel's temporaries are its outputs; its tiles live in registers.) The
bounds are the engine's own (tests/engine/test_engine_paged_v41_memory.py: 256 MiB for a layer's attention) and,
tighter, what the kernels need: a few MiB.
"""

from __future__ import annotations

import types
import warnings

import jax
import jax.numpy as jnp
import pytest

from deepinfer_jax import ops
from deepinfer_jax.cache import paged

S = jax.ShapeDtypeStruct
MIB = 1 << 20
B, CTX, BLK, R = 64, 128 * 1024, 128, 2
NB = B * CTX // BLK + 1
HEADS, DIM, WINDOW, TOPK, IH, ID = 64, 512, 128, 512, 32, 128


def _temp(fn, *args) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        compiled = jax.jit(fn).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes / MIB


@pytest.fixture(scope="module")
def selections():
    def sel(backend):
        cfg = types.SimpleNamespace(
            backend=backend, overrides={}, strict=True, interpret=backend == "pallas_gpu"
        )
        return ops.resolve_selection(cfg, platform="cpu")

    return {"reference": sel("reference"), "kernels": sel("pallas_gpu")}


def _decode_attention(q, window, mask, sinks, pages, qi, wi, ik_pages, tables, rows, limit):
    """A V4.1 index-source layer's decode attention through the registry: select, then attend."""
    index = ops.select("v4_indexer_topk")(
        qi, wi, ik_pages, tables, rows, limit, k=TOPK, key_format="mxfp4", score_dtype=jnp.bfloat16
    )
    from deepinfer_jax.ops.sparse_attention import entry_slots

    slots = entry_slots(index, tables, rows, entries_per_block=BLK // R)
    return ops.select("v4_sparse_attention")(
        q, window, mask, sinks, pages, slots, scale=DIM**-0.5, window_format="mxfp8", compressed_format="fp4"
    )


def test_v41_flash_decode_attention_temporaries(selections):
    i32 = jnp.int32
    args = (
        S((B, HEADS, DIM), jnp.bfloat16),
        S((B, WINDOW, 528), jnp.uint8),
        S((B, WINDOW), jnp.bool_),
        S((HEADS,), jnp.float32),
        S((NB, BLK // R, 288), jnp.uint8),
        S((B, IH, ID), jnp.bfloat16),
        S((B, IH), jnp.float32),
        S((NB, BLK // R, 68), jnp.uint8),
        S((B, CTX // BLK), i32),
        S((B,), i32),
        S((B,), i32),
    )
    temps = {}
    for name, sel in selections.items():
        assert sel.backends()["v4_sparse_attention"] == ("pallas_gpu" if name == "kernels" else "reference")
        temps[name] = _temp(ops.bind_selection(_decode_attention, sel), *args)
    print(f"V4.1-Flash decode attention temporaries: {temps}")
    assert temps["reference"] < 256, temps  # the engine's bound for a layer's attention
    assert temps["kernels"] < 16, temps  # indexer top-k buffers, one scored chunk, the output
    assert temps["kernels"] < temps["reference"] / 4, temps


def test_compress_store_and_mla_temporaries(selections):
    f32, i32 = jnp.float32, jnp.int32
    entries = B  # one emitted entry per sequence at most in a decode step of ratio-2 layers
    store = (
        S((NB, BLK // R, 288), jnp.uint8),
        S((entries, R, DIM), f32),
        S((entries, R, DIM), f32),
        S((DIM,), f32),
        S((entries, 32), f32),
        S((entries, 32), f32),
        S((entries,), i32),
    )

    def compress(*a):
        return ops.select("v4_compress_store")(*a, eps=1e-20, rope_dim=64, key_format="fp4")

    # V3: 128 heads over the 512 + 64 latent, 64-token blocks, an FP8 latent cache of 61 layers
    mla = (
        S((B, 128, 512), jnp.bfloat16),
        S((B, 128, 64), jnp.bfloat16),
        S((2, B * CTX // 64 + 1, 64, paged.fp8_latent_record_bytes(512, 64)), jnp.uint8),
        S((B,), i32),
        S((B,), i32),
        S((B, CTX // 64), i32),
        S((B,), i32),
    )

    def attend(ql, qp, cache, ts, pos, bt, ctx):
        return ops.select("paged_mla_attention")(ql, qp, cache, 1, ts, pos, bt, ctx, scale=0.1)

    for name, sel in selections.items():
        t_store = _temp(ops.bind_selection(compress, sel), *store)
        t_mla = _temp(ops.bind_selection(attend, sel), *mla)
        print(f"{name}: compress-and-store {t_store:.1f} MiB, paged MLA over FP8 {t_mla:.1f} MiB")
        # a copy of the page array would be 1.2 GB; the MLA cache 5.5 GB
        assert t_store < 16 and t_mla < 256, (name, t_store, t_mla)
