"""The FP8 latent record of the paged DeepSeek-V3 cache: layout, codec, token writes and reads, attention over it."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from deepinfer_jax.cache import paged
from deepinfer_jax.ops import select


def test_record_layout_and_sizes():
    assert paged.fp8_latent_record_bytes(512, 64) == 656  # 512 E4M3 + 4 float32 scales + 64 bf16 (spec §16)
    assert paged.fp8_latent_record_bytes(64, 32) == 64 + 4 + 64  # one (short) scale group
    spec = paged.LatentCacheSpec(
        num_layers=2, num_blocks=3, block_size=4, kv_rank=512, rope_dim=64, dtype="fp8"
    )
    assert spec.shape == (2, 3, 4, 656) and spec.bytes_per_token_layer == 656
    assert paged.init_latent_cache(spec).dtype == jnp.uint8

    class Cfg:
        kv_lora_rank, qk_rope_head_dim, num_layers_total = 512, 64, 62

    layout = paged.latent_cache_layout(Cfg, block_size=64, dtype="fp8")
    assert layout.bytes_per_block == 656 * 64 * 62 and "656 B per token" in layout.lines[0]


def _numpy_record(x: np.ndarray, c: int) -> np.ndarray:
    """The record of one vector by its definition: E4M3(x / s) with s = max(amax, 1e-4) / 448 per 128, bf16 rope."""
    lat, rope = x[:c].astype(np.float32), x[c:]
    codes, scales = [], []
    for g in range(0, c, 128):
        grp = lat[g : g + 128]
        s = np.float32(max(np.abs(grp).max(), np.float32(1e-4)) / np.float32(448))
        codes.append(np.clip(grp / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
        scales.append(np.frombuffer(np.float32(s).tobytes(), np.uint8))  # little-endian on every host we run
    rope_bytes = rope.astype(ml_dtypes.bfloat16).view(np.uint8)
    return np.concatenate([*codes, *scales, rope_bytes])


def test_codec_matches_the_format_definition():
    rng = np.random.default_rng(8)
    c, r = 200, 16  # two scale groups, the second one short (72 values)
    x = (rng.standard_normal((6, c + r)) * np.exp2(rng.integers(-8, 8, (6, 1)))).astype(np.float32)
    x[0, :128] = 0.0  # an all-zero group takes the 1e-4 floor
    rec = np.asarray(paged.encode_latent_fp8(jnp.asarray(x), c))
    want = np.stack([_numpy_record(v, c) for v in x])
    np.testing.assert_array_equal(rec, want)
    back = np.asarray(paged.decode_latent_fp8(jnp.asarray(rec), c, r))
    s = want[:, c : c + 8].copy().view(np.float32)  # [6, 2] scales
    lat = want[:, :c].view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.repeat(s, 128, axis=1)[:, :c]
    np.testing.assert_array_equal(back[:, :c], lat)
    np.testing.assert_array_equal(back[:, c:], x[:, c:].astype(ml_dtypes.bfloat16).astype(np.float32))


def test_write_and_read_tokens_through_records():
    rng = np.random.default_rng(9)
    c, r = 64, 32
    spec = paged.LatentCacheSpec(num_layers=2, num_blocks=5, block_size=4, kv_rank=c, rope_dim=r, dtype="fp8")
    cache = paged.init_latent_cache(spec)
    entries = rng.standard_normal((3, c + r)).astype(np.float32)
    blocks = jnp.array([2, 5, 4], jnp.int32)  # 5 = out of range: dropped
    offsets = jnp.array([1, 0, 3], jnp.int32)
    cache = paged.write_tokens(cache, 1, jnp.asarray(entries), blocks, offsets)
    got = np.asarray(paged.read_tokens(cache, 1, blocks, offsets, kv_rank=c, rope_dim=r))
    want = np.asarray(paged.decode_latent_fp8(paged.encode_latent_fp8(jnp.asarray(entries), c), c, r))
    np.testing.assert_array_equal(got[[0, 2]], want[[0, 2]])
    np.testing.assert_array_equal(got[1], 0.0)  # the dropped token reads zeros
    assert np.count_nonzero(np.asarray(cache)[0]) == 0  # other layers untouched
    with pytest.raises(ValueError, match="kv_rank"):
        paged.read_tokens(cache, 1, blocks, offsets)


def test_ambiguous_record_widths_need_the_latent_width():
    # DeepSeek-V3's 512 + 64 and 516 + 60 have the same entry width and the same record width (656 bytes)
    assert paged.fp8_latent_record_bytes(512, 64) == paged.fp8_latent_record_bytes(516, 60)
    cache = jnp.zeros((1, 2, 2, 656), jnp.uint8)
    entries = jnp.ones((1, 576))
    with pytest.raises(ValueError, match="pass kv_rank"):
        paged.write_tokens(cache, 0, entries, jnp.array([1]), jnp.array([0]))
    out = paged.write_tokens(cache, 0, entries, jnp.array([1]), jnp.array([0]), kv_rank=512)
    np.testing.assert_array_equal(
        np.asarray(paged.read_tokens(out, 0, jnp.array([1]), jnp.array([0]), kv_rank=512, rope_dim=64)), 1.0
    )
    with pytest.raises(ValueError, match="656"):
        paged.write_tokens(cache, 0, entries, jnp.array([1]), jnp.array([0]), kv_rank=500)


def test_paged_attention_over_the_fp8_cache_equals_attention_over_its_values():
    rng = np.random.default_rng(10)
    c, r, heads, bs = 128, 16, 3, 4
    spec = paged.LatentCacheSpec(
        num_layers=1, num_blocks=6, block_size=bs, kv_rank=c, rope_dim=r, dtype="fp8"
    )
    cache = paged.init_latent_cache(spec)
    tables = np.array([[1, 3, 5], [2, 4, -1]], np.int32)
    lengths = [10, 6]
    for s, n in enumerate(lengths):
        pos = np.arange(n)
        vals = rng.standard_normal((n, c + r)).astype(np.float32)
        blocks, offsets = jnp.asarray(tables[s, pos // bs]), jnp.asarray(pos % bs)
        cache = paged.write_tokens(cache, 0, jnp.asarray(vals), blocks, offsets, kv_rank=c)
    token_seq = np.array([0, 1, 1], np.int32)
    positions = np.array([9, 4, 5], np.int32)
    q_lat = jnp.asarray(rng.standard_normal((3, heads, c)), jnp.float32)
    q_pe = jnp.asarray(rng.standard_normal((3, heads, r)), jnp.float32)
    op = select("paged_mla_attention")
    args = (0, token_seq, positions, tables, np.array(lengths, np.int32))
    got = np.asarray(op(q_lat, q_pe, cache, *args, scale=0.1))
    decoded = paged.decode_latent_fp8(cache, c, r)  # float32 [1, NB, bs, C + R]
    want = np.asarray(op(q_lat, q_pe, decoded, *args, scale=0.1))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)  # same values, same loop: rounding only
