"""The paged V3 latent cache: sizes and planning, writes/reads against a dense copy, paged attention against
numpy."""

from __future__ import annotations

import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_jax.cache import paged
from deepinfer_jax.cache.plan import CacheLayout, plan_memory
from deepinfer_jax.config import load_model_config
from deepinfer_jax.ops.registry import select

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(scope="module")
def tiny_cfg():
    return load_model_config(CONFIGS / "tiny_v3.yaml")


# -------------------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2GiB", 2 << 30),
        ("512 MiB", 512 << 20),
        ("1.5GB", 1_500_000_000),
        ("4096", 4096),
        (123, 123),
        ("3kib", 3072),
    ],
)
def test_parse_bytes(text, expected):
    assert paged.parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "2 parsecs", "GiB", "0", "0.5", "-3GiB"])
def test_parse_bytes_refuses(bad):
    with pytest.raises(ValueError, match="kv_cache_memory"):
        paged.parse_bytes(bad)


@pytest.mark.parametrize("bad", [True, 1.5, None, [1]])
def test_parse_bytes_refuses_types(bad):
    with pytest.raises(TypeError, match="kv_cache_memory"):
        paged.parse_bytes(bad)


def test_latent_cache_dtype():
    assert paged.latent_cache_dtype("float32") == "float32"
    assert paged.latent_cache_dtype("bfloat16") == "bfloat16"
    assert paged.latent_cache_dtype("bfloat16", "float32") == "float32"
    assert paged.latent_cache_dtype("float32", "bfloat16") == "bfloat16"
    assert paged.latent_cache_dtype("float32", "quantized") == "fp8"  # the FP8 latent record
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        paged.latent_cache_dtype("float32", "float8_e4m3fn")
    with pytest.raises(ValueError, match="dtype"):
        paged.latent_cache_dtype("float16")


def _plan(cfg, budget, *, block_size, dtype, reserved_bytes=0, num_blocks=None):
    layout = paged.latent_cache_layout(cfg, block_size=block_size, dtype=dtype)
    return plan_memory(layout, budget, num_slots=1, reserved_bytes=reserved_bytes, num_blocks=num_blocks)


def test_plan_tiny_float32_by_hand(tiny_cfg):
    # tiny-v3: 3 layers + 1 MTP layer, latent 64 + rope 32 = 96 float32 values = 384 B per token and layer.
    plan = _plan(tiny_cfg, 1_000_000, block_size=16, dtype="float32", reserved_bytes=10_000)
    per_block = 4 * 16 * 384
    assert plan.spec.bytes_per_block == per_block and plan.spec.layout.bytes_per_slot == 0
    assert plan.spec.num_blocks == (1_000_000 - 10_000) // per_block
    assert plan.unused_bytes == 1_000_000 - 10_000 - plan.spec.num_blocks * per_block
    assert plan.spec.usable_tokens == (plan.spec.num_blocks - 1) * 16
    text = plan.describe()
    assert f"{per_block} B" in text and f"{plan.spec.num_blocks} (" in text and "384 B per token" in text


def test_plan_bf16_uses_the_record_size():
    # Real V3: 512 + 64 bf16 = 1152 B per token and layer (ARCHITECTURE §8); 62 cached layers (61 + MTP).
    cfg = types.SimpleNamespace(
        family="deepseek_v3", kv_lora_rank=512, qk_rope_head_dim=64, num_hidden_layers=61, num_layers_total=62
    )
    plan = _plan(cfg, 2 << 30, block_size=128, dtype="bfloat16")
    assert plan.spec.bytes_per_block == 1152 * 128 * 62
    assert plan.spec.num_blocks == (2 << 30) // (1152 * 128 * 62)


def test_plan_counts_state_slots():
    layout = CacheLayout(block_size=4, bytes_per_block=100, bytes_per_slot=30, dtype="float32")
    plan = plan_memory(layout, 1000, num_slots=5, reserved_bytes=50)
    assert plan.spec.num_blocks == (1000 - 50 - 150) // 100 and plan.spec.slot_bytes == 150
    with pytest.raises(ValueError, match=r"5 x 30 B"):
        plan_memory(layout, 340, num_slots=5)


def test_plan_refuses_small_budgets(tiny_cfg):
    with pytest.raises(ValueError, match="kv_cache_memory"):
        _plan(tiny_cfg, 4 * 16 * 384 + 5, block_size=16, dtype="float32")
    with pytest.raises(ValueError, match=r"cache\.num_blocks = 100"):
        _plan(tiny_cfg, 10 * 4 * 16 * 384, block_size=16, dtype="float32", num_blocks=100)
    fixed = _plan(tiny_cfg, 10 * 4 * 16 * 384, block_size=16, dtype="float32", num_blocks=5)
    assert fixed.spec.num_blocks == 5
    with pytest.raises(ValueError, match="num_blocks"):
        paged.LatentCacheSpec(
            num_layers=1, num_blocks=1, block_size=8, kv_rank=4, rope_dim=2, dtype="float32"
        )


# -------------------------------------------------------------------------------------- writes / reads


def _random_tables(
    rng: np.random.Generator, lengths: list[int], block_size: int, num_blocks: int, width: int
):
    """Disjoint random block tables (block 0 never used), padded with -1 to a common width."""
    needed = [-(-n // block_size) for n in lengths]
    blocks = rng.permutation(np.arange(1, num_blocks))[: sum(needed)]
    table = np.full((len(lengths), width), -1, np.int32)
    at = 0
    for i, k in enumerate(needed):
        table[i, :k] = blocks[at : at + k]
        at += k
    return table


_write = jax.jit(paged.write_tokens, static_argnums=1)
_slots = jax.jit(paged.slot_mapping, static_argnums=(3, 4))


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    pad=st.integers(10, 15),
    seed=st.integers(0, 2**16),
)
def test_write_then_read_matches_dense(lengths, pad, seed):
    rng = np.random.default_rng(seed)
    block_size, num_blocks, width, layers = 8, 32, 6, 2
    table = _random_tables(rng, lengths, block_size, num_blocks, width=6)
    pad += 170 - sum(lengths) - pad  # one token count for every example: a single compilation
    token_seq = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)] + [np.full(pad, len(lengths))])
    positions = np.concatenate([np.arange(n) for n in lengths] + [np.zeros(pad, int)]).astype(np.int32)
    entries = rng.standard_normal((len(token_seq), width)).astype(np.float32)
    cache = jnp.zeros((layers, num_blocks, block_size, width), jnp.float32)
    blocks, offsets = _slots(
        jnp.asarray(table), jnp.asarray(token_seq, jnp.int32), positions, block_size, num_blocks
    )
    cache = np.asarray(_write(cache, 1, jnp.asarray(entries), blocks, offsets))
    assert not cache[0].any(), "only layer 1 was written"
    assert not cache[1, 0].any(), "the reserved block 0 is never written"
    at = 0
    for i, n in enumerate(lengths):
        np.testing.assert_array_equal(paged.dense_context(cache, 1, table[i], n), entries[at : at + n])
        at += n
    got = np.asarray(paged.read_tokens(jnp.asarray(cache), 1, blocks, offsets))
    np.testing.assert_array_equal(got[:at], entries[:at])
    np.testing.assert_array_equal(got[at:], 0.0)  # padding reads the out-of-range fill


def test_dense_context_refuses_missing_blocks():
    cache = np.zeros((1, 4, 8, 2), np.float32)
    with pytest.raises(ValueError, match="block_table"):
        paged.dense_context(cache, 0, np.array([1, -1]), 10)


# -------------------------------------------------------------------------------------- attention


def _numpy_attention(q_lat, q_pe, context, position, scale):
    """Independent dense reference: one query token over its sequence's keys ``0..position``, float64."""
    c = context[: position + 1, : q_lat.shape[-1]].astype(np.float64)
    k = context[: position + 1, q_lat.shape[-1] :].astype(np.float64)
    s = (q_lat.astype(np.float64) @ c.T + q_pe.astype(np.float64) @ k.T) * scale  # [Nh, keys]
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return p @ c


def test_paged_attention_matches_dense_numpy():
    rng = np.random.default_rng(7)
    block_size, num_blocks, heads, kv_rank, rope = 8, 40, 3, 16, 4
    lengths = [1, 13, 30, 8]  # context lengths after this step
    new = [1, 5, 30, 2]  # tokens of each sequence in this step (decode, chunk, whole prompt, chunk)
    table = _random_tables(rng, lengths, block_size, num_blocks, width=5)
    cache = np.zeros((2, num_blocks, block_size, kv_rank + rope), np.float32)
    contexts = []
    for i, n in enumerate(lengths):
        ctx = rng.standard_normal((n, kv_rank + rope)).astype(np.float32)
        contexts.append(ctx)
        for p in range(n):
            cache[1, table[i, p // block_size], p % block_size] = ctx[p]
    cache[1, 0] = 1e3  # garbage in the reserved block must never leak into a result
    token_seq = np.concatenate([np.full(k, i) for i, k in enumerate(new)] + [np.full(3, len(new))]).astype(
        np.int32
    )
    positions = np.concatenate([np.arange(n - k, n) for n, k in zip(lengths, new)] + [np.zeros(3, int)])
    positions = positions.astype(np.int32)
    tokens = len(token_seq)
    q_lat = rng.standard_normal((tokens, heads, kv_rank)).astype(np.float32)
    q_pe = rng.standard_normal((tokens, heads, rope)).astype(np.float32)
    scale = 0.3
    op = select("paged_mla_attention")
    fn = jax.jit(lambda *a: op(*a[:3], 1, *a[3:], scale=scale))
    got = np.asarray(fn(q_lat, q_pe, cache, token_seq, positions, table, np.asarray(lengths, np.int32)))
    for t in range(tokens):
        s = token_seq[t]
        if s >= len(new):
            np.testing.assert_array_equal(got[t], 0.0)  # padding rows attend to nothing
            continue
        want = _numpy_attention(q_lat[t], q_pe[t], contexts[s], positions[t], scale)
        # float32 online softmax over <= 4 blocks vs a float64 two-pass softmax: rounding only (~1e-6
        # relative); 1e-5 absolute on O(1) values leaves room for that and nothing more.
        np.testing.assert_allclose(got[t], want, rtol=1e-5, atol=1e-5)
