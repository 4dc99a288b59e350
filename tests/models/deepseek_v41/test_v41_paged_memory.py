"""Real-shape bounds: one DeepSeek-V4.1-Flash backbone layer in the engine's cached path, compiled (never run).

The shapes are those of ``configs/deepseek_v41_flash.yaml``; the values no source evidences (``null`` there) are
filled with the placeholders of :data:`PLACEHOLDERS`, none of which changes a shape layer 2 computes with except
the context itself. Layer 2 is a ratio-2 layer that owns its compressed keys, its indexer and its indexer keys
(roles ``kv_source``, ``index_source``, ``index_k_source``), so it runs alone with nothing shared from an earlier
layer. A decode step of 64 sequences at 128K context holds, per sequence, 64K compressed entries of FP4 records
(288 B) and 64K MXFP4 indexer keys (68 B) in its pages: 64 · 64K · 356 B = 1.4 GiB for this layer, and its 384
MXFP4 experts are 384 · 3 · 5120 · 2304 / 2 B = 6.8 GB. XLA's reported temporary memory must stay far below
both, which it does only if decode scores the indexer keys page by page, gathers only the 512 selected entries,
and never dequantises all experts at once.

The same layer is also compiled with the Pallas kernels selected the way the engine selects them
(``ops.resolve_selection`` with ``ops.backend = pallas_gpu``; with no GPU here they are compiled in Pallas
interpret mode, ``ops.interpret``): the attention side (sparse attention over the records, streaming indexer
top-k, compress-and-store, record stores, the mHC Sinkhorn) and the FP8 projections. The routed experts stay on
their reference there: their sorted dispatch over the *interpreted* grouped MXFP4 kernels compiles to 4.6 GiB of
temporaries, about the size of the gate and up expert weights (4.5 GiB), where the same dispatch over the
reference grouped GEMMs needs 30 MiB -- a property of the interpreted CPU program, not of the kernels on a GPU,
which read their operands in place.
"""

from __future__ import annotations

import types
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from deepinfer_jax import ops
from deepinfer_jax.cache.ragged import make_meta
from deepinfer_jax.config import load_model_config
from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.models.deepseek_v4 import family_v41
from deepinfer_jax.models.deepseek_v4.paged_v41 import V41PagedModel
from deepinfer_jax.models.deepseek_v4.v41_params import assemble_params, expected_tensors

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
BATCH, CONTEXT, BLOCK, LAYER = 64, 128 * 1024, 128, 2
MIB = 1 << 20

PLACEHOLDERS = {
    "max_position_embeddings": 1 << 20,  # at least the 128K tested
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,  # V4's value
    "rope_scaling": {
        "type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "dspark_block_size": 5,  # the reference runtime's draft length
    "dspark_target_layer_ids": [1, 19, 39],
    "dspark_noise_token_id": 128799,
    "engram_vocab_size": 1_000_000,  # Engram sits on layers 1 and 14, not on layer 2
    "engram_n_heads": 8,
    "engram_compressed_vocab_size": 129280,  # the identity map (no tokenizer)
}


def build_real() -> tuple[ModelConfig, V41PagedModel, object]:
    """V4.1-Flash's config (with :data:`PLACEHOLDERS`), its bf16 paged model with FP4 / MXFP4 records, and the
    abstract parameter tree (``jax.eval_shape`` over ``assemble_params``). Also used by
    ``scripts/compile_real_v41.py``, which compiles the whole decode step at these shapes."""
    full = load_model_config(CONFIGS / "deepseek_v41_flash.yaml")
    hf = dict(full.hf)
    hf["text_config"] = {**hf["text_config"], **PLACEHOLDERS}
    cfg = ModelConfig.from_hf(hf)
    static = family_v41.static_for(cfg, "bfloat16")
    model = V41PagedModel(
        static=static,
        block_size=BLOCK,
        dtype="bfloat16",
        cache_dtype="quantized",
        head_dim=cfg.head_dim,
        index_head_dim=cfg.index_head_dim,
        use_fp4=True,
    )
    structs = {
        name: jax.ShapeDtypeStruct(shape, jnp.dtype(dtypes[0]))
        for name, (shape, dtypes, optional) in expected_tensors(cfg).items()
        if not optional
    }
    params = jax.eval_shape(lambda t: assemble_params(cfg, t, "bfloat16"), structs)
    return cfg, model, params


@pytest.fixture(scope="module")
def real():
    return build_real()


def decode_inputs(cfg, model, batch: int = BATCH, context: int = CONTEXT):
    """Abstract arguments of one decode step: ``batch`` rows at position ``context - 1``, one token each: the
    cache, the ragged-metadata arguments of ``make_meta``, and one layer's mHC streams and pre-mix."""
    i32 = jnp.int32
    num_blocks = batch * context // BLOCK + 1
    cache = jax.eval_shape(lambda: model.init_cache(num_blocks, batch + 1))
    meta_args = (
        jax.ShapeDtypeStruct((batch,), i32),  # token_seq
        jax.ShapeDtypeStruct((batch,), i32),  # positions
        jax.ShapeDtypeStruct((batch + 1,), i32),  # query_start
        jax.ShapeDtypeStruct((batch,), i32),  # context_lens
        jax.ShapeDtypeStruct((batch,), i32),  # seq_slots
        jax.ShapeDtypeStruct((batch, context // BLOCK), i32),  # block_tables
    )
    streams = jax.ShapeDtypeStruct((batch, cfg.hc_mult, cfg.hidden_size), jnp.bfloat16)
    pre = jax.ShapeDtypeStruct((batch, cfg.hc_mult), jnp.float32)
    return cache, meta_args, streams, pre


def _temp(fn, *args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_layer_2_is_self_contained(real):
    _, model, _ = real
    assert model.layers[LAYER].roles == ("kv_source", "index_source", "index_k_source")
    assert model.static.attention[LAYER].ratio == 2 and not model.layers[LAYER].has_engram


def _layer_fns(model, p):
    lp, spec = model.layers[LAYER], model.static.attention[LAYER]

    def attention(p, streams, pre, cache, *meta_args):
        from deepinfer_jax.models.deepseek_v4.paged_v41 import _StepCross

        meta = make_meta(*meta_args)
        cache = {name: list(getattr(cache, name)) for name in ("window", "kv", "ik", "state")}
        out, pre, _, cache = model._attention_sublayer(
            p, lp, spec, streams, pre, _StepCross(), cache, meta, None
        )
        return out, pre, cache

    def layer(p, streams, pre, cache, *meta_args):
        streams, pre, cache = attention(p, streams, pre, cache, *meta_args)
        streams, pre = model._ffn_sublayer(p, streams, pre)
        return streams, pre, cache

    return attention, layer


def test_real_shape_decode_attention_and_layer_temp_memory(real):
    cfg, model, params = real
    cache, meta_args, streams, pre = decode_inputs(cfg, model)
    p = params["layers"][LAYER]
    attention, layer = _layer_fns(model, p)
    attn_temp = _temp(attention, p, streams, pre, cache, *meta_args)
    layer_temp = _temp(layer, p, streams, pre, cache, *meta_args)
    print(f"V4.1 layer {LAYER} decode: attention {attn_temp / MIB:.1f} MiB, layer {layer_temp / MIB:.1f} MiB")
    assert attn_temp < 256 * MIB, f"attention needs {attn_temp / MIB:.0f} MiB of temporaries"
    assert layer_temp < 2048 * MIB, f"the layer needs {layer_temp / MIB:.0f} MiB of temporaries"


#: The kernels of the layer that run (interpreted) in the kernel variant; the routed experts stay on the
#: reference (module docstring).
KERNEL_OPS = (
    "fp8_block_linear",
    "kv_store_records",
    "mhc_sinkhorn",
    "v4_compress_store",
    "v4_indexer_topk",
    "v4_sparse_attention",
)


def test_real_shape_layer_temp_memory_with_the_kernels_selected(real):
    """The layer with the kernels selected stays within the bounds the reference path meets (under the 256 MiB
    of a layer's attention, which the reference layer meets too: about 175 MiB measured, against about 210 MiB
    with the kernels)."""
    cfg, model, params = real
    cache, meta_args, streams, pre = decode_inputs(cfg, model)
    p = params["layers"][LAYER]
    settings = types.SimpleNamespace(
        backend="pallas_gpu", overrides={"moe_experts": "reference"}, strict=True, interpret=True
    )
    selection = ops.resolve_selection(settings, platform="cpu")
    chosen = selection.backends()
    assert all(chosen[op] == "pallas_gpu" for op in KERNEL_OPS), chosen
    _, layer = _layer_fns(model, p)
    with warnings.catch_warnings():
        # jax deprecates its Triton backend in favour of Mosaic GPU (docs/backends.md says why we use it)
        warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated", DeprecationWarning)
        temp = _temp(ops.bind_selection(layer, selection), p, streams, pre, cache, *meta_args)
    print(f"V4.1 layer {LAYER} decode with the kernels (interpreted): {temp / MIB:.1f} MiB")
    assert temp < 256 * MIB, f"the layer with the kernels needs {temp / MIB:.0f} MiB of temporaries"


def test_the_attention_bound_would_catch_a_dense_gather(real):
    """Reading every compressed entry of every sequence with its head dimension (dequantised) breaks the bound."""
    cfg, _, _ = real
    entries = CONTEXT // 2
    pages = jax.ShapeDtypeStruct((BATCH * CONTEXT // BLOCK + 1, BLOCK // 2, 288), jnp.uint8)
    tables = jax.ShapeDtypeStruct((BATCH, CONTEXT // BLOCK), jnp.int32)
    q = jax.ShapeDtypeStruct((BATCH, cfg.num_attention_heads, cfg.head_dim), jnp.bfloat16)

    def dense(q, pages, tables):
        keys = pages[jnp.maximum(tables, 0)].reshape(BATCH, entries, 288)[..., :256]
        values = keys.astype(jnp.bfloat16)
        values = jnp.concatenate([values, values], axis=-1)  # [B, 64K, 512] as if decoded
        return jnp.einsum("bhd,bkd->bhk", q, values, preferred_element_type=jnp.float32)

    assert _temp(dense, q, pages, tables) > 256 * MIB
