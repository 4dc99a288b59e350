"""deepinfer_jax.cache.record_bytes: per-kind record sizes and whole-model bytes per token, on duck-typed configs."""

from __future__ import annotations

import enum
from fractions import Fraction
from types import SimpleNamespace

import pytest

from deepinfer_jax.cache import describe_record_formats, kv_bytes_per_block, kv_bytes_per_token, record_bytes


def _v41(**overrides) -> SimpleNamespace:
    # The inferred V4.1-Flash layout (spec/model.md §2.9): 40 layers, ratios [0, 0, 2 x 18, 1 x 20] + 3 draft.
    cfg = dict(
        family="deepseek_v41",
        head_dim=512,
        index_head_dim=128,
        use_fp4_sparse_kv=True,
        num_hidden_layers=40,
        compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        kv_source_layer_ids=[2, 8, 14, 20],
        index_k_source_layer_ids=None,
    )
    cfg.update(overrides)
    return SimpleNamespace(**cfg)


def _v3(**overrides) -> SimpleNamespace:
    cfg = dict(family="deepseek_v3", kv_lora_rank=512, qk_rope_head_dim=64, num_hidden_layers=61)
    cfg.update(overrides)
    return SimpleNamespace(**cfg)


def test_v41_flash_record_sizes():
    assert record_bytes(_v41()) == {"window": 528, "compressed": 288, "indexer": 68}


def test_mxfp8_compressed_cache_when_fp4_is_off():
    assert record_bytes(_v41(use_fp4_sparse_kv=False))["compressed"] == 528


def test_v4_without_the_flag_uses_fp4():
    cfg = SimpleNamespace(family="deepseek_v4", head_dim=512, index_head_dim=128)
    assert record_bytes(cfg) == {"window": 528, "compressed": 288, "indexer": 68}


def test_v3_latent_record():
    assert record_bytes(_v3()) == {"latent": 1152}


def test_sizes_follow_the_dimensions():
    # A tiny model: head_dim 64 -> MXFP8 64 + 2, FP4 32 + 4; index_head_dim 32 -> 16 + 1.
    assert record_bytes(_v41(head_dim=64, index_head_dim=32)) == {
        "window": 66,
        "compressed": 36,
        "indexer": 17,
    }
    assert record_bytes(_v3(kv_lora_rank=32, qk_rope_head_dim=16)) == {"latent": 96}


def test_family_may_be_an_enum():
    class Family(enum.Enum):
        V41 = "deepseek_v41"

    assert record_bytes(_v41(family=Family.V41))["window"] == 528


def test_v41_bytes_per_token_by_hand():
    # 40 window records; KV sources 2, 8, 14 (ratio 2) and 20 (ratio 1) add compressed records at 1/r and,
    # being the index-K sources too (None -> KV sources), indexer records at 1/r.
    want = 40 * 528 + 3 * Fraction(288, 2) + 288 + 3 * Fraction(68, 2) + 68
    got = kv_bytes_per_token(_v41())
    assert got == want == 21120 + 432 + 288 + 102 + 68
    assert isinstance(got, Fraction)
    assert kv_bytes_per_token(_v41(), num_draft_layers=3) == want + 3 * 528
    assert kv_bytes_per_block(_v41()) == 128 * want


def test_v41_index_k_sources_may_differ_from_kv_sources():
    got = kv_bytes_per_token(_v41(index_k_source_layer_ids=[2, 20]))
    assert got == 40 * 528 + 3 * 144 + 288 + 34 + 68


def test_v4_csa_layers_carry_indexer_keys_and_give_fractional_bytes():
    ratios = [0, 4, 128, 4, 128]
    cfg = SimpleNamespace(
        family="deepseek_v4", head_dim=512, index_head_dim=128, num_hidden_layers=5, compress_ratios=ratios
    )
    want = 5 * 528 + 2 * Fraction(288, 4) + 2 * Fraction(288, 128) + 2 * Fraction(68, 4)
    assert kv_bytes_per_token(cfg) == want and want.denominator == 2  # 288/128 = 2.25 bytes per token
    assert kv_bytes_per_block(cfg) == 128 * want
    # The CSA ratio may be given explicitly; here it selects the 128-layers (an unusual but legal reading).
    cfg.compress_rate_csa = 128
    assert kv_bytes_per_token(cfg) == 5 * 528 + 2 * 72 + 2 * Fraction(288, 128) + 2 * Fraction(68, 128)
    with pytest.raises(ValueError, match="block_tokens=3 does not hold a whole number of records"):
        kv_bytes_per_block(cfg, block_tokens=3)


def test_v3_bytes_per_token():
    assert kv_bytes_per_token(_v3()) == 61 * 1152
    assert kv_bytes_per_token(_v3(), num_draft_layers=1) == 62 * 1152


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"model_config.family must be one of .* got 'llama'"):
        record_bytes(SimpleNamespace(family="llama"))
    with pytest.raises(TypeError, match=r"model_config.head_dim must be an int, got NoneType"):
        record_bytes(SimpleNamespace(family="deepseek_v41"))
    with pytest.raises(
        ValueError, match=r"model_config.kv_source_layer_ids names layer 0, whose compress_ratios entry is 0"
    ):
        kv_bytes_per_token(_v41(kv_source_layer_ids=[0]))
    with pytest.raises(ValueError, match=r"kv_source_layer_ids entry 40 is not a layer id in \[0, 40\)"):
        kv_bytes_per_token(_v41(kv_source_layer_ids=[40]))
    with pytest.raises(
        ValueError, match="compress_ratios must have at least num_hidden_layers=40 entries, got 3"
    ):
        kv_bytes_per_token(_v41(compress_ratios=[0, 1, 2]))
    with pytest.raises(ValueError, match=r"model_config.index_head_dim is required"):
        kv_bytes_per_token(_v41(index_head_dim=None))
    with pytest.raises(ValueError, match="num_draft_layers must be an int >= 0, got -1"):
        kv_bytes_per_token(_v41(), num_draft_layers=-1)


def test_describe_record_formats_says_what_the_bytes_are():
    """Each production record's size, split into codes and scales, so a quantised record that is larger than an
    unquantised one at small head dims (scales included) is not read as a smaller format."""
    got = describe_record_formats(_v41())
    assert got["window"] == "528 B: 512 B of FP8 E4M3 codes + 16 B of UE8M0 scales (one per 32)"
    assert got["compressed"] == "288 B: 256 B of FP4 E2M1 codes + 32 B of E4M3 scales (one per 16)"
    assert got["indexer"] == "68 B: 64 B of FP4 E2M1 codes + 4 B of UE8M0 scales (one per 32)"
    assert describe_record_formats(_v3()) == {"latent": "1152 B: 576 bf16 values, unquantised"}
