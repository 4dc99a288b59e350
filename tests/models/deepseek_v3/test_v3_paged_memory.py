"""Real-shape bounds: one DeepSeek-V3 decode layer over a paged cache is lowered and compiled (never run).

Batch 64 at 32K context: the latent cache of one layer is 64 · 32768 · 576 bf16 values (2.25 GiB), the expert
set of a MoE layer 256 experts · 3 FP8 matrices (5.6 GB). XLA's reported temporary memory must stay far below
both, which it does only if decode never gathers the whole context densely and never dequantises all experts
at once.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.cache.paged import fp8_latent_record_bytes, paged_mla_attention
from deepinfer_jax.config import load_model_config
from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.models.deepseek_v3 import model as v3_model
from deepinfer_jax.models.deepseek_v3.paged import PagedMeta, paged_decoder_layer
from deepinfer_jax.models.deepseek_v3.weights import assemble_params, expected_tensors

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
BATCH, CONTEXT, BLOCK = 64, 32768, 128
MIB = 1 << 20


@pytest.fixture(scope="module")
def real_cfg():
    full = load_model_config(CONFIGS / "deepseek_v3.yaml")
    # The same shapes with 4 layers (3 dense + 1 MoE) and no MTP: only layer 3 is compiled below.
    hf = {**full.hf, "num_hidden_layers": 4, "num_nextn_predict_layers": 0}
    return ModelConfig.from_hf(hf)


def _abstract_layer(cfg, index: int):
    structs = {
        name: jax.ShapeDtypeStruct(
            shape, jnp.dtype(dtypes[0] if "float8_e4m3fn" not in dtypes else "float8_e4m3fn")
        )
        for name, (shape, dtypes) in expected_tensors(cfg).items()
    }
    params = jax.eval_shape(lambda t: assemble_params(cfg, t, "bfloat16"), structs)
    return params["layers"][index]


def _memory(fn, *args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def _cache_struct(kind: str = "bfloat16"):
    """One layer's latent cache: bf16 records of 512 + 64 values, or the FP8 latent records (656 B)."""
    num_blocks = BATCH * CONTEXT // BLOCK + 1
    if kind == "fp8":
        return jax.ShapeDtypeStruct((1, num_blocks, BLOCK, fp8_latent_record_bytes(512, 64)), jnp.uint8)
    return jax.ShapeDtypeStruct((1, num_blocks, BLOCK, 576), jnp.bfloat16)


def _meta_structs():
    i32 = jnp.int32
    t = jax.ShapeDtypeStruct((BATCH,), i32)
    return (
        t,
        t,
        t,
        t,
        jax.ShapeDtypeStruct((BATCH, CONTEXT // BLOCK), i32),
        jax.ShapeDtypeStruct((BATCH,), i32),
    )


def test_real_shape_paged_attention_temp_memory():
    q_lat = jax.ShapeDtypeStruct((BATCH, 128, 512), jnp.bfloat16)
    q_pe = jax.ShapeDtypeStruct((BATCH, 128, 64), jnp.bfloat16)
    t = jax.ShapeDtypeStruct((BATCH,), jnp.int32)
    tables = jax.ShapeDtypeStruct((BATCH, CONTEXT // BLOCK), jnp.int32)

    def attend(q_lat, q_pe, cache, token_seq, positions, tables, lens):
        return paged_mla_attention(q_lat, q_pe, cache, 0, token_seq, positions, tables, lens, scale=0.1)

    temp = _memory(attend, q_lat, q_pe, _cache_struct(), t, t, tables, t)
    print(f"paged attention temporaries: {temp / MIB:.1f} MiB")
    assert temp < 256 * MIB, f"paged attention needs {temp / MIB:.0f} MiB of temporaries"


@pytest.mark.parametrize("cache_kind", ["bfloat16", "fp8"])
def test_real_shape_decode_layer_temp_memory(real_cfg, cache_kind):
    """The FP8 latent cache at V3's real shape: its 656-byte records could hold 512 or 516 latent values, so the
    layer writes them with ``kv_rank`` (``write_tokens`` refuses to guess)."""
    layer = _abstract_layer(real_cfg, 3)
    assert "router" in layer["mlp"] and layer["mlp"]["experts"]["gate"]["weight"].dtype == np.uint8
    pl = v3_model.plan(real_cfg, "bfloat16")
    x = jax.ShapeDtypeStruct((BATCH, real_cfg.hidden_size), jnp.bfloat16)

    def decode(x, p, cache, blocks, offsets, token_seq, positions, tables, lens):
        meta = PagedMeta(blocks, offsets, token_seq, positions, tables, lens)
        cos, sin = pl.cos_sin(positions)
        out, cache = paged_decoder_layer(x, p, pl, cos, sin, cache, 0, meta)
        return out, cache

    fn = jax.jit(decode, donate_argnums=(2,))
    compiled = fn.lower(x, layer, _cache_struct(cache_kind), *_meta_structs()).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    print(f"decode layer temporaries ({cache_kind} cache): {temp / MIB:.1f} MiB")
    assert temp < 2048 * MIB, f"one decode layer needs {temp / MIB:.0f} MiB of temporaries"


def test_bounds_would_catch_a_dense_gather():
    """The attention bound is meaningful: gathering each sequence's whole context densely breaks it."""

    def dense(q_lat, cache, tables):
        ctx = cache[0, jnp.maximum(tables, 0)].reshape(BATCH, -1, 576)  # [B, 32K, 576]
        return jnp.einsum("bhc,bkc->bhk", q_lat, ctx[..., :512], preferred_element_type=jnp.float32)

    q_lat = jax.ShapeDtypeStruct((BATCH, 128, 512), jnp.bfloat16)
    tables = jax.ShapeDtypeStruct((BATCH, CONTEXT // BLOCK), jnp.int32)
    assert _memory(dense, q_lat, _cache_struct(), tables) > 256 * MIB
