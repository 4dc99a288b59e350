"""Tensor manifests of the synthetic checkpoint generators against the checkpoint contracts.

The expected names, shapes and dtypes below are written out by hand from `spec/model.md` §13 / §15.2 (V4.1), the
DeepSeek-native V4 names of `spec/oracles.md` with transformers 5.24's V4 module shapes, and the HF V3 names; they
are not computed by the code under test. Values are checked against an independent reconstruction: the test
redraws each tensor's source values from the documented per-tensor stream and dequantises the stored codes with
its own ml_dtypes / lookup-table decoder.
"""

from __future__ import annotations

import copy
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_jax.models.builtin import TensorRngFactory
from deepinfer_jax.models.deepseek_v3.synthetic import generate_v3_weights
from deepinfer_jax.models.deepseek_v4.synthetic import (
    engram_table_sizes,
    generate_v4_weights,
    generate_v41_weights,
)

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
F32 = np.dtype(np.float32)
U8 = np.dtype(np.uint8)
SEED = 1234

# spec/model.md §15.1, verbatim.
TINY_V41 = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "quantization_config": {
        "quant_method": "fp8",
        "expert_dtype": "fp4",
        "activation_scheme": "dynamic",
        "weight_block_size": [32, 32],
        "scale_fmt": "ue8m0",
    },
    "vision_config": {"hidden_size": 64, "downsample_ratio": 2},
    "text_config": {
        "vocab_size": 512,
        "hidden_size": 256,
        "num_hidden_layers": 7,
        "num_nextn_predict_layers": 2,
        "max_position_embeddings": 4096,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 128,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 128,
        "o_lora_rank": 64,
        "o_groups": 2,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": 1e-6,
        "swiglu_limit": 10.0,
        "tie_word_embeddings": False,
        "sliding_window": 16,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {
            "type": "yarn",
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 512,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "compress_ratios": [0, 2, 2, 1, 1, 1, 1, 0, 0],
        "use_fp4_sparse_kv": True,
        "index_topk": 16,
        "index_n_heads": 8,
        "index_head_dim": 128,
        "kv_source_layer_ids": [1, 3, 5],
        "index_source_layer_ids": [1, 3, 4, 5],
        "index_k_source_layer_ids": [1, 3, 5],
        "candidate_source_layer_id": 3,
        "candidate_topk_blocks": 8,
        "candidate_block_size": 8,
        "hc_mult": 4,
        "hc_shifted": True,
        "hc_eps": 1e-6,
        "hc_sinkhorn_iters": 20,
        "moe_intermediate_size": 128,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "topk_method": "noaux_tc",
        "dspark_block_size": 4,
        "dspark_target_layer_ids": [4, 5, 6],
        "dspark_target_attn_input": True,
        "dspark_markov_rank": 32,
        "dspark_noise_token_id": 511,
        "dspark_n_routed_experts": 4,
        "dspark_num_experts_per_tok": 2,
        "engram_layer_ids": [0, 2],
        "engram_max_ngram_size": 3,
        "engram_n_heads": 2,
        "engram_head_dim": 128,
        "engram_vocab_size": 1000,
        "engram_compressed_vocab_size": 512,
        "engram_num_embeddings": [4062, 4152],
        "engram_pad_token_id": 2,
    },
}

# A small DeepSeek-V4 config in transformers 5.24's spelling: one layer of each attention kind, hash + top-k MoE.
TINY_V4 = {
    "model_type": "deepseek_v4",
    "vocab_size": 96,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 48,
    "o_groups": 2,
    "o_lora_rank": 16,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 4,
    "sliding_window": 8,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "layer_types": [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 8},
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
}

# A small DeepSeek-V3 config: one dense layer, two MoE layers, one MTP layer.
TINY_V3 = {
    "model_type": "deepseek_v3",
    "vocab_size": 96,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 48,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 24,
    "intermediate_size": 96,
    "moe_intermediate_size": 40,
    "first_k_dense_replace": 1,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
}


@pytest.fixture(scope="module")
def v41() -> dict[str, np.ndarray]:
    return generate_v41_weights(TINY_V41, TensorRngFactory(SEED))


@pytest.fixture(scope="module")
def v4() -> dict[str, np.ndarray]:
    return generate_v4_weights(TINY_V4, TensorRngFactory(SEED))


# ---------------------------------------------------------------------------------------------------------------
# Independent decoders


def _source_bf16(name: str, out_dim: int, in_dim: int) -> np.ndarray:
    """The documented source values of a linear weight: N(0, 1) · in^(-1/2) from the tensor's stream, bf16."""
    w = TensorRngFactory(SEED)(name).standard_normal((out_dim, in_dim), dtype=np.float32) * np.float32(
        in_dim**-0.5
    )
    return w.astype(BF16).astype(np.float32)


def _dequant_fp8(q: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    values = q.astype(np.float32)
    factors = scale.astype(np.float32)
    full = np.repeat(np.repeat(factors, block[0], axis=0), block[1], axis=1)[: q.shape[0], : q.shape[1]]
    return values * full


_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _dequant_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    low = _E2M1[packed & 0x0F]  # element 2i sits in the low nibble
    high = _E2M1[packed >> 4]
    codes = np.stack([low, high], axis=-1).reshape(packed.shape[0], -1)
    return codes * np.repeat(scale.astype(np.float32), 32, axis=1)


def _assert_fp8_matches_source(tensors, prefix: str, out_dim: int, in_dim: int) -> None:
    q, s = tensors[f"{prefix}.weight"], tensors[f"{prefix}.scale"]
    assert q.dtype == E4M3 and q.shape == (out_dim, in_dim)
    assert s.dtype == E8M0 and s.shape == (math.ceil(out_dim / 32), math.ceil(in_dim / 32))
    src = _source_bf16(f"{prefix}.weight", out_dim, in_dim)
    deq = _dequant_fp8(q, s, (32, 32))
    # E4M3 keeps 3 mantissa bits: relative error <= 2^-4 for normal codes; values that fall to subnormals of
    # their block are off by at most half a subnormal step, 2^-10 · block scale (scale <= 2·amax/448).
    step = np.repeat(np.repeat(s.astype(np.float32), 32, 0), 32, 1)[:out_dim, :in_dim] * 2.0**-10
    assert np.all(np.abs(deq - src) <= 2.0**-4 * np.abs(src) + step)


# ---------------------------------------------------------------------------------------------------------------
# DeepSeek-V4.1


def _per_layer_base() -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Tensors every V4.1 block has (§13.3, without the FP8 `.scale` companions)."""
    return {
        "attn_norm.weight": ((256,), BF16),
        "ffn_norm.weight": ((256,), BF16),
        "hc_attn_fn": ((24, 1024), F32),
        "hc_attn_base": ((24,), F32),
        "hc_attn_scale": ((3,), F32),
        "hc_ffn_fn": ((24, 1024), F32),
        "hc_ffn_base": ((24,), F32),
        "hc_ffn_scale": ((3,), F32),
        "attn.wq_a.weight": ((128, 256), E4M3),
        "attn.q_norm.weight": ((128,), BF16),
        "attn.wq_b.weight": ((512, 128), E4M3),
        "attn.wkv.weight": ((128, 256), E4M3),
        "attn.kv_norm.weight": ((128,), BF16),
        "attn.wo_a.weight": ((128, 256), E4M3),
        "attn.wo_b.weight": ((256, 128), E4M3),
        "attn.attn_sink": ((4,), F32),
        "ffn.shared_experts.w1.weight": ((128, 256), E4M3),
        "ffn.shared_experts.w2.weight": ((256, 128), E4M3),
        "ffn.shared_experts.w3.weight": ((128, 256), E4M3),
    }


def _moe_entries(experts: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    out = {
        "ffn.gate.weight": ((experts, 256), BF16),
        "ffn.gate.bias": ((experts,), F32),
        "ffn.gate.bias_vl": ((experts,), F32),
    }
    for e in range(experts):
        out[f"ffn.experts.{e}.w1.weight"] = ((128, 128), U8)
        out[f"ffn.experts.{e}.w1.scale"] = ((128, 8), E8M0)
        out[f"ffn.experts.{e}.w3.weight"] = ((128, 128), U8)
        out[f"ffn.experts.{e}.w3.scale"] = ((128, 8), E8M0)
        out[f"ffn.experts.{e}.w2.weight"] = ((256, 64), U8)
        out[f"ffn.experts.{e}.w2.scale"] = ((256, 4), E8M0)
    return out


# §15.2 role table, written out per layer.
_COMPRESSOR_R1 = {
    "attn.compressor.wkv.weight": ((128, 256), BF16),
    "attn.compressor.norm.weight": ((128,), BF16),
}
_COMPRESSOR_R2 = {**_COMPRESSOR_R1, "attn.compressor.wgate.weight": ((128, 256), BF16)}
_INDEX = {
    "attn.indexer.wq_b.weight": ((1024, 128), E4M3),
    "attn.indexer.weights_proj.weight": ((8, 256), BF16),
}
_INDEX_K = {"attn.indexer.wk.weight": ((128, 128), BF16), "attn.indexer.k_norm.weight": ((128,), BF16)}


def _engram(rows: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    return {
        "engram.embed.weight": ((rows, 128), E4M3),
        "engram.embed.scale": ((rows, 4), E8M0),
        "engram.wkv.weight": ((1280, 512), E4M3),
        "engram.q_weight": ((4, 256), BF16),
        "engram.k_weight": ((4, 256), BF16),
    }


V41_LAYER_EXTRAS = {
    0: _engram(4062),
    1: {**_COMPRESSOR_R2, **_INDEX, **_INDEX_K},
    2: _engram(4152),
    3: {**_COMPRESSOR_R1, **_INDEX, **_INDEX_K},
    4: dict(_INDEX),
    5: {**_COMPRESSOR_R1, **_INDEX, **_INDEX_K},
    6: {},
}


def _expected_v41() -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    exp: dict[str, tuple[tuple[int, ...], np.dtype]] = {
        "embed.weight": ((512, 256), BF16),
        "head.weight": ((512, 256), BF16),
        "norm.weight": ((256,), BF16),
    }
    for layer in range(7):
        entries = {**_per_layer_base(), **_moe_entries(8), **V41_LAYER_EXTRAS[layer]}
        exp.update({f"layers.{layer}.{k}": v for k, v in entries.items()})
    draft = {
        0: {"main_proj.weight": ((256, 768), E4M3), "main_norm.weight": ((256,), BF16)},
        1: {
            "norm.weight": ((256,), BF16),
            "markov_head.embed.weight": ((512, 32), BF16),
            "markov_head.head.weight": ((512, 32), BF16),
            "confidence_head.proj.weight": ((1, 288), BF16),
        },
    }
    for i in range(2):
        entries = {**_per_layer_base(), **_moe_entries(4), **draft[i]}
        exp.update({f"mtp.{i}.{k}": v for k, v in entries.items()})
    # Every FP8 weight carries its 32x32 UE8M0 scale grid.
    for name, (shape, dtype) in list(exp.items()):
        if dtype == E4M3 and not name.endswith("engram.embed.weight"):
            exp[name.removesuffix(".weight") + ".scale"] = (
                (math.ceil(shape[0] / 32), math.ceil(shape[1] / 32)),
                E8M0,
            )
    return exp


def test_v41_manifest_is_exactly_the_checkpoint_contract(v41):
    expected = _expected_v41()
    assert sorted(v41) == sorted(expected)
    for name, (shape, dtype) in expected.items():
        assert v41[name].shape == shape, name
        assert v41[name].dtype == dtype, name
        assert v41[name].flags.c_contiguous, name


def test_v41_key_shapes_of_spec_15_2(v41):
    shapes = {
        "layers.0.hc_attn_fn": (24, 1024),
        "layers.6.hc_ffn_fn": (24, 1024),
        "layers.2.attn.wq_b.weight": (512, 128),
        "layers.1.attn.indexer.wq_b.weight": (1024, 128),
        "layers.4.attn.indexer.weights_proj.weight": (8, 256),
        "layers.3.attn.wo_a.weight": (128, 256),
        "layers.3.attn.wo_b.weight": (256, 128),
        "layers.5.ffn.experts.7.w1.weight": (128, 128),
        "layers.5.ffn.experts.7.w3.weight": (128, 128),
        "layers.5.ffn.experts.7.w2.weight": (256, 64),
        "layers.0.engram.wkv.weight": (1280, 512),
        "layers.0.engram.embed.weight": (4062, 128),
        "layers.2.engram.embed.weight": (4152, 128),
        "mtp.0.main_proj.weight": (256, 768),
        "mtp.1.markov_head.embed.weight": (512, 32),
        "mtp.1.markov_head.head.weight": (512, 32),
        "mtp.1.confidence_head.proj.weight": (1, 288),
    }
    for name, shape in shapes.items():
        assert v41[name].shape == shape, name


def test_v41_role_presence_table(v41):
    def layers_with(suffix: str) -> list[int]:
        return [layer for layer in range(7) if f"layers.{layer}.{suffix}" in v41]

    assert layers_with("attn.compressor.wgate.weight") == [1]  # the only ratio-2 KV source
    assert layers_with("attn.compressor.wkv.weight") == [1, 3, 5]
    assert layers_with("attn.indexer.wq_b.weight") == [1, 3, 4, 5]
    assert layers_with("attn.indexer.weights_proj.weight") == [1, 3, 4, 5]
    assert layers_with("attn.indexer.wk.weight") == [1, 3, 5]
    assert layers_with("engram.embed.weight") == [0, 2]
    assert not any(k.startswith("hc_head") or ".hc_head" in k for k in v41)  # shifted schedule
    assert not any(k.startswith(("mtp.0.norm", "mtp.1.main_proj", "mtp.0.markov")) for k in v41)
    assert not any(
        k.startswith("mtp.") and (".compressor." in k or ".indexer." in k or ".engram." in k) for k in v41
    )


def test_v41_engram_table_sizes_match_spec_primes():
    sizes = engram_table_sizes([0, 2], max_ngram=3, n_heads=2, vocab_size=1000)
    assert sizes == [[[1009, 1013], [1019, 1021]], [[1031, 1033], [1039, 1049]]]
    assert [sum(map(sum, layer)) for layer in sizes] == [4062, 4152]


def test_v41_fp8_weights_dequantise_to_their_source(v41):
    _assert_fp8_matches_source(v41, "layers.1.attn.wq_b", 512, 128)
    _assert_fp8_matches_source(v41, "layers.4.attn.indexer.wq_b", 1024, 128)
    _assert_fp8_matches_source(v41, "mtp.0.main_proj", 256, 768)
    _assert_fp8_matches_source(v41, "layers.0.engram.wkv", 1280, 512)


def test_v41_mxfp4_experts_dequantise_to_their_source(v41):
    for name, (out_dim, in_dim) in {
        "layers.2.ffn.experts.3.w1": (128, 256),
        "mtp.1.ffn.experts.0.w2": (256, 128),
    }.items():
        deq = _dequant_mxfp4(v41[f"{name}.weight"], v41[f"{name}.scale"])
        src = _source_bf16(f"{name}.weight", out_dim, in_dim)
        assert deq.shape == src.shape
        # E2M1 with a power-of-two per-32 scale >= amax/6: worst-case error is half the largest gap (2 -> at
        # magnitude 6, i.e. 1 code unit) times the scale, and the scale is at most 2·amax/6 of its group.
        scale = np.repeat(v41[f"{name}.scale"].astype(np.float32), 32, axis=1)
        assert np.all(np.abs(deq - src) <= scale * 1.0 + 1e-12)
        # ...and the codes are not degenerate: the dequantised matrix tracks the source closely on average.
        assert np.corrcoef(deq.ravel(), src.ravel())[0, 1] > 0.95


def test_v41_engram_table_is_fp8_per_row_32(v41):
    q, s = v41["layers.2.engram.embed.weight"], v41["layers.2.engram.embed.scale"]
    deq = _dequant_fp8(q, s, (1, 32))
    src = TensorRngFactory(SEED)("layers.2.engram.embed.weight").standard_normal(
        (4152, 128), dtype=np.float32
    )
    src = src.astype(BF16).astype(np.float32)
    step = np.repeat(s.astype(np.float32), 32, axis=1) * 2.0**-10
    assert np.all(np.abs(deq - src) <= 2.0**-4 * np.abs(src) + step)


def test_v41_value_recipes(v41):
    # Norm weights scatter around 1 (noise 0.1): over every norm of the model, mean within 0.02 of 1.
    norms = np.concatenate([v.astype(np.float32) for k, v in v41.items() if k.endswith("norm.weight")])
    assert abs(norms.mean() - 1.0) < 0.02 and 0.07 < norms.std() < 0.13
    # Sinks are N(0, 1): 9 blocks x 4 heads = 36 draws, std within a generous 0.5..1.6 band.
    sinks = np.concatenate([v for k, v in v41.items() if k.endswith("attn_sink")])
    assert sinks.size == 36 and 0.5 < sinks.std() < 1.6
    # Gate biases are small and not all zero.
    biases = np.concatenate([v for k, v in v41.items() if k.endswith(("gate.bias", "gate.bias_vl"))])
    assert np.all(np.abs(biases) < 0.6) and np.abs(biases).max() > 0.05
    # Linear weights are N(0, 1/in): the BF16 head ([512, 256]) has std 1/16 within 3 %.
    assert abs(v41["head.weight"].astype(np.float32).std() * 16 - 1) < 0.03
    # No parameter is left at a constant (identity-like) value; block scales may legitimately be uniform.
    for name, value in v41.items():
        if not name.endswith(".scale"):
            as_f32 = value.astype(np.float32) if value.dtype != U8 else value
            assert np.unique(as_f32).size > 1, f"{name} is constant"


def test_v41_hc_parameters_follow_the_training_init_pattern(v41):
    m = 4
    for prefix, ell in [("layers.0.", 0), ("layers.5.", 5), ("mtp.1.", 7 + 1 + 1)]:
        for sub in ("attn", "ffn"):
            base = v41[f"{prefix}hc_{sub}_base"]
            # §6.6: pre-mix -3 except +3 at stream ell mod m; post-mix 0; residual +3 diagonal / -3 off-diagonal;
            # the noise (std 0.5) cannot flip these signs except with negligible probability.
            pre = np.full(m, -1.0)
            pre[ell % m] = 1.0
            assert np.array_equal(np.sign(base[:m]), pre)
            assert np.all(np.abs(base[m : 2 * m]) < 2.5)
            assert np.array_equal(
                np.sign(base[2 * m :]).reshape(m, m), np.where(np.eye(m, dtype=bool), 1.0, -1.0)
            )
            scale = v41[f"{prefix}hc_{sub}_scale"]
            assert np.all(scale > 0) and np.all(scale < 1)
            fn = v41[f"{prefix}hc_{sub}_fn"]
            assert abs(fn.std() * math.sqrt(m * 256) - 1) < 0.05


def test_v41_non_shifted_variant_adds_hc_heads():
    cfg = copy.deepcopy(TINY_V41)
    cfg["text_config"]["hc_shifted"] = False
    t = generate_v41_weights(cfg, TensorRngFactory(SEED))
    for prefix in ("", "mtp.1."):
        assert t[f"{prefix}hc_head_fn"].shape == (4, 1024) and t[f"{prefix}hc_head_fn"].dtype == F32
        assert t[f"{prefix}hc_head_base"].shape == (4,) and t[f"{prefix}hc_head_scale"].shape == (1,)
    assert "mtp.0.hc_head_fn" not in t
    # Backbone head: +3 at L mod m = 7 mod 4 = 3; draft head: at (L + M) mod m = 9 mod 4 = 1.
    assert int(np.argmax(t["hc_head_base"])) == 3 and int(np.argmax(t["mtp.1.hc_head_base"])) == 1


def test_v41_bringup_variant_has_no_engram_and_no_draft():
    cfg = copy.deepcopy(TINY_V41)
    tc = cfg["text_config"]
    tc.update(engram_layer_ids=[], num_nextn_predict_layers=0, compress_ratios=tc["compress_ratios"][:7])
    t = generate_v41_weights(cfg, TensorRngFactory(SEED))
    assert not any(".engram." in k or k.startswith("mtp.") for k in t)


def test_v41_index_k_sources_default_to_kv_sources():
    cfg = copy.deepcopy(TINY_V41)
    del cfg["text_config"]["index_k_source_layer_ids"]
    t = generate_v41_weights(cfg, TensorRngFactory(SEED))
    assert [layer for layer in range(7) if f"layers.{layer}.attn.indexer.wk.weight" in t] == [1, 3, 5]


def test_v41_unquantised_variant_stores_bf16_linears():
    cfg = copy.deepcopy(TINY_V41)
    del cfg["quantization_config"]
    t = generate_v41_weights(cfg, TensorRngFactory(SEED))
    assert not any(k.endswith(".scale") for k in t)
    assert t["layers.0.engram.embed.weight"].dtype == BF16
    assert t["layers.1.attn.wq_b.weight"].dtype == BF16
    assert t["layers.1.ffn.experts.0.w1.weight"].shape == (128, 256)
    np.testing.assert_array_equal(
        t["layers.1.attn.wq_b.weight"].astype(np.float32), _source_bf16("layers.1.attn.wq_b.weight", 512, 128)
    )


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda tc: tc.update(compress_ratios=[0, 2, 2, 1, 1, 1, 1]), "compress_ratios: has 7 entries"),
        (lambda tc: tc.update(compress_ratios=[0, 4, 2, 1, 1, 1, 1, 0, 0]), "ratio 4"),
        (lambda tc: tc.update(engram_num_embeddings=[4062, 4000]), "engram_num_embeddings"),
        (lambda tc: tc.update(kv_source_layer_ids=[1, 9]), "layer id 9"),
        (lambda tc: tc.update(hidden_size="256"), "text_config.hidden_size: expected an int"),
        (lambda tc: tc.pop("q_lora_rank"), "text_config.q_lora_rank: required"),
        (lambda tc: tc.update(o_groups=3), "o_groups"),
        (lambda tc: tc.update(moe_intermediate_size=48), "divisible by 32"),
    ],
)
def test_v41_bad_configs_are_refused_with_the_field_named(edit, message):
    cfg = copy.deepcopy(TINY_V41)
    edit(cfg["text_config"])
    with pytest.raises((ValueError, TypeError), match=message):
        generate_v41_weights(cfg, TensorRngFactory(SEED))


def test_v41_refuses_unsupported_quantisation():
    cfg = copy.deepcopy(TINY_V41)
    cfg["quantization_config"]["scale_fmt"] = "float32"
    with pytest.raises(ValueError, match=r"quantization_config\.scale_fmt"):
        generate_v41_weights(cfg, TensorRngFactory(SEED))


# ---------------------------------------------------------------------------------------------------------------
# DeepSeek-V4


def _expected_v4() -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    block = {
        "attn_norm.weight": ((64,), F32),
        "ffn_norm.weight": ((64,), F32),
        "hc_attn_fn": ((24, 256), F32),
        "hc_attn_base": ((24,), F32),
        "hc_attn_scale": ((3,), F32),
        "hc_ffn_fn": ((24, 256), F32),
        "hc_ffn_base": ((24,), F32),
        "hc_ffn_scale": ((3,), F32),
        "attn.wq_a.weight": ((48, 64), BF16),
        "attn.q_norm.weight": ((48,), F32),
        "attn.wq_b.weight": ((128, 48), BF16),
        "attn.wkv.weight": ((32, 64), BF16),
        "attn.kv_norm.weight": ((32,), F32),
        "attn.wo_a.weight": ((32, 64), BF16),
        "attn.wo_b.weight": ((64, 32), BF16),
        "attn.attn_sink": ((4,), F32),
        "ffn.gate.weight": ((4, 64), BF16),
        "ffn.shared_experts.w1.weight": ((32, 64), BF16),
        "ffn.shared_experts.w2.weight": ((64, 32), BF16),
        "ffn.shared_experts.w3.weight": ((32, 64), BF16),
    }
    for e in range(4):
        block[f"ffn.experts.{e}.w1.weight"] = ((32, 64), BF16)
        block[f"ffn.experts.{e}.w2.weight"] = ((64, 32), BF16)
        block[f"ffn.experts.{e}.w3.weight"] = ((32, 64), BF16)
    csa = {  # overlapping windows: two series per token, width 2·D (and 2·Di for the indexer's compressor)
        "attn.compressor.wkv.weight": ((64, 64), BF16),
        "attn.compressor.wgate.weight": ((64, 64), BF16),
        "attn.compressor.ape": ((2, 64), F32),
        "attn.compressor.norm.weight": ((32,), F32),
        "attn.indexer.compressor.wkv.weight": ((64, 64), BF16),
        "attn.indexer.compressor.wgate.weight": ((64, 64), BF16),
        "attn.indexer.compressor.ape": ((2, 64), F32),
        "attn.indexer.compressor.norm.weight": ((32,), F32),
        "attn.indexer.wq_b.weight": ((128, 48), BF16),
        "attn.indexer.weights_proj.weight": ((4, 64), BF16),
    }
    hca = {
        "attn.compressor.wkv.weight": ((32, 64), BF16),
        "attn.compressor.wgate.weight": ((32, 64), BF16),
        "attn.compressor.ape": ((8, 32), F32),
        "attn.compressor.norm.weight": ((32,), F32),
    }
    extras = {0: {}, 1: csa, 2: hca, 3: csa}
    exp = {
        "embed.weight": ((96, 64), BF16),
        "head.weight": ((96, 64), BF16),
        "norm.weight": ((64,), F32),
        "hc_head_fn": ((4, 256), F32),
        "hc_head_base": ((4,), F32),
        "hc_head_scale": ((1,), F32),
    }
    for layer in range(4):
        routing = (
            {"ffn.gate.tid2eid": ((96, 2), np.dtype(np.int64))}
            if layer == 0
            else {"ffn.gate.bias": ((4,), F32)}
        )
        exp.update({f"layers.{layer}.{k}": v for k, v in {**block, **extras[layer], **routing}.items()})
    return exp


def test_v4_manifest_matches_deepseek_native_names(v4):
    expected = _expected_v4()
    assert sorted(v4) == sorted(expected)
    for name, (shape, dtype) in expected.items():
        assert (v4[name].shape, v4[name].dtype) == (shape, dtype), name


def test_v4_randomises_what_default_init_leaves_constant(v4):
    # transformers initialises sinks, ape and the router bias to zeros, HC scale to ones: all must vary here.
    for name in (
        "layers.1.attn.attn_sink",
        "layers.1.attn.compressor.ape",
        "layers.3.ffn.gate.bias",
        "hc_head_base",
    ):
        assert np.unique(v4[name]).size == v4[name].size, name
    assert np.all(v4["layers.2.hc_attn_scale"] != 1.0)
    tid2eid = v4["layers.0.ffn.gate.tid2eid"]
    assert tid2eid.min() >= 0 and tid2eid.max() < 4
    assert np.all(tid2eid[:, 0] != tid2eid[:, 1])  # two distinct experts per token
    assert np.unique(tid2eid[:, 0]).size == 4  # ...and the table uses every expert


def test_v4_legacy_spellings_give_the_same_manifest(v4):
    legacy = {
        k: v for k, v in TINY_V4.items() if k not in ("layer_types", "mlp_layer_types", "compress_rates")
    }
    legacy.update(
        compress_ratios=[0, 2, 8, 2, 0], compress_rate_csa=2, compress_rate_hca=8, num_hash_layers=1
    )
    t = generate_v4_weights(legacy, TensorRngFactory(SEED))
    assert sorted(t) == sorted(v4)
    for name in v4:
        assert t[name].tobytes() == v4[name].tobytes(), name


def test_v4_defaults_follow_transformers():
    # No layer_types / compress_ratios: two HCA layers then CSA/HCA alternating; three hash layers.
    cfg = {k: v for k, v in TINY_V4.items() if k not in ("layer_types", "mlp_layer_types", "compress_rates")}
    cfg["num_hidden_layers"] = 5
    t = generate_v4_weights(cfg, TensorRngFactory(SEED))
    indexer = [layer for layer in range(5) if f"layers.{layer}.attn.indexer.wq_b.weight" in t]
    assert indexer == [3]
    assert t["layers.0.attn.compressor.ape"].shape == (128, 32)  # default HCA rate 128
    assert t["layers.3.attn.compressor.ape"].shape == (4, 64)  # default CSA rate 4
    assert [layer for layer in range(5) if f"layers.{layer}.ffn.gate.tid2eid" in t] == [0, 1, 2]


def test_v4_quantised_variant_uses_the_v41_formats():
    cfg = dict(
        TINY_V4,
        quantization_config={
            "quant_method": "fp8",
            "expert_dtype": "fp4",
            "weight_block_size": [32, 32],
            "scale_fmt": "ue8m0",
        },
    )
    t = generate_v4_weights(cfg, TensorRngFactory(SEED))
    assert t["layers.1.attn.wq_b.weight"].dtype == E4M3 and t["layers.1.attn.wq_b.scale"].shape == (4, 2)
    assert (
        t["layers.1.ffn.experts.0.w1.weight"].shape == (32, 32)
        and t["layers.1.ffn.experts.0.w1.weight"].dtype == U8
    )
    assert t["layers.1.attn.compressor.wkv.weight"].dtype == BF16  # compressors stay BF16


def test_v4_refuses_unknown_layer_kinds():
    cfg = dict(
        TINY_V4, layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
    )
    with pytest.raises(ValueError, match=r"layer_types\[1\]: 'full_attention'"):
        generate_v4_weights(cfg, TensorRngFactory(SEED))
    cfg = {k: v for k, v in TINY_V4.items() if k != "layer_types"}
    cfg["compress_ratios"] = [0, 2, 3, 0]
    with pytest.raises(ValueError, match=r"compress_ratios\[2\]: ratio 3"):
        generate_v4_weights(cfg, TensorRngFactory(SEED))


# ---------------------------------------------------------------------------------------------------------------
# DeepSeek-V3


def _expected_v3(q_lora: bool = True) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    attn = {
        "self_attn.kv_a_proj_with_mqa.weight": ((56, 64), BF16),
        "self_attn.kv_a_layernorm.weight": ((48,), BF16),
        "self_attn.kv_b_proj.weight": ((160, 48), BF16),  # 4 heads x (16 nope + 24 v)
        "self_attn.o_proj.weight": ((64, 96), BF16),
        "input_layernorm.weight": ((64,), BF16),
        "post_attention_layernorm.weight": ((64,), BF16),
    }
    if q_lora:
        attn.update(
            {
                "self_attn.q_a_proj.weight": ((32, 64), BF16),
                "self_attn.q_a_layernorm.weight": ((32,), BF16),
                "self_attn.q_b_proj.weight": ((96, 32), BF16),  # 4 heads x (16 + 8)
            }
        )
    else:
        attn["self_attn.q_proj.weight"] = ((96, 64), BF16)
    dense = {
        "mlp.gate_proj.weight": ((96, 64), BF16),
        "mlp.up_proj.weight": ((96, 64), BF16),
        "mlp.down_proj.weight": ((64, 96), BF16),
    }
    moe = {
        "mlp.gate.weight": ((4, 64), BF16),
        "mlp.gate.e_score_correction_bias": ((4,), F32),
        "mlp.shared_experts.gate_proj.weight": ((40, 64), BF16),
        "mlp.shared_experts.up_proj.weight": ((40, 64), BF16),
        "mlp.shared_experts.down_proj.weight": ((64, 40), BF16),
    }
    for e in range(4):
        moe[f"mlp.experts.{e}.gate_proj.weight"] = ((40, 64), BF16)
        moe[f"mlp.experts.{e}.up_proj.weight"] = ((40, 64), BF16)
        moe[f"mlp.experts.{e}.down_proj.weight"] = ((64, 40), BF16)
    mtp = {
        "embed_tokens.weight": ((96, 64), BF16),
        "enorm.weight": ((64,), BF16),
        "hnorm.weight": ((64,), BF16),
        "eh_proj.weight": ((64, 128), BF16),
        "shared_head.norm.weight": ((64,), BF16),
        "shared_head.head.weight": ((96, 64), BF16),
    }
    exp = {
        "model.embed_tokens.weight": ((96, 64), BF16),
        "model.norm.weight": ((64,), BF16),
        "lm_head.weight": ((96, 64), BF16),
    }
    for layer, parts in {0: [attn, dense], 1: [attn, moe], 2: [attn, moe], 3: [attn, moe, mtp]}.items():
        for part in parts:
            exp.update({f"model.layers.{layer}.{k}": v for k, v in part.items()})
    return exp


def test_v3_bf16_manifest():
    t = generate_v3_weights(TINY_V3, TensorRngFactory(SEED))
    expected = _expected_v3()
    assert sorted(t) == sorted(expected)
    for name, (shape, dtype) in expected.items():
        assert (t[name].shape, t[name].dtype) == (shape, dtype), name
    np.testing.assert_array_equal(
        t["model.layers.1.self_attn.o_proj.weight"].astype(np.float32),
        _source_bf16("model.layers.1.self_attn.o_proj.weight", 64, 96),
    )
    assert np.unique(t["model.layers.2.mlp.gate.e_score_correction_bias"]).size == 4


def test_v3_without_q_lora_uses_q_proj():
    t = generate_v3_weights(dict(TINY_V3, q_lora_rank=None), TensorRngFactory(SEED))
    expected = _expected_v3(q_lora=False)
    assert sorted(t) == sorted(expected)


def test_v3_fp8_variant_uses_128_blocks_with_float32_scale_inv():
    cfg = dict(
        TINY_V3,
        hidden_size=160,
        quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    )
    t = generate_v3_weights(cfg, TensorRngFactory(SEED))
    name = "model.layers.1.self_attn.o_proj"
    q, scale_inv = t[f"{name}.weight"], t[f"{name}.weight_scale_inv"]
    assert q.dtype == E4M3 and q.shape == (160, 96)
    assert scale_inv.dtype == F32 and scale_inv.shape == (2, 1)  # ceil(160/128) x ceil(96/128)
    deq = _dequant_fp8(q, scale_inv, (128, 128))
    src = _source_bf16(f"{name}.weight", 160, 96)
    step = np.repeat(np.repeat(scale_inv, 128, 0), 128, 1)[:160, :96] * 2.0**-9
    assert np.all(np.abs(deq - src) <= 2.0**-4 * np.abs(src) + step)
    # Embeddings, heads, norms, the router and the MTP projection stay BF16 without scales.
    for kept in ("model.embed_tokens", "lm_head", "model.layers.1.mlp.gate", "model.layers.3.eh_proj"):
        assert t[f"{kept}.weight"].dtype == BF16 and f"{kept}.weight_scale_inv" not in t
    assert t["model.layers.2.mlp.experts.3.down_proj.weight_scale_inv"].shape == (2, 1)


def test_v3_bad_config_is_refused():
    with pytest.raises(TypeError, match="kv_lora_rank: expected an int"):
        generate_v3_weights(dict(TINY_V3, kv_lora_rank=48.0), TensorRngFactory(SEED))
    with pytest.raises(ValueError, match=r"quantization_config\.weight_block_size"):
        generate_v3_weights(
            dict(TINY_V3, quantization_config={"quant_method": "fp8", "weight_block_size": [128]}),
            TensorRngFactory(SEED),
        )


# ---------------------------------------------------------------------------------------------------------------
# Stream independence


def test_adding_layers_leaves_existing_tensors_unchanged():
    small = generate_v3_weights(dict(TINY_V3, num_nextn_predict_layers=0), TensorRngFactory(SEED))
    large = generate_v3_weights(dict(TINY_V3, num_hidden_layers=4), TensorRngFactory(SEED))
    assert set(small) < set(large)
    for name, value in small.items():
        assert large[name].tobytes() == value.tobytes(), name


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    names=st.lists(st.text(min_size=1, max_size=20), min_size=2, max_size=5, unique=True),
)
def test_tensor_streams_depend_only_on_seed_and_name(seed, names):
    first = TensorRngFactory(seed)
    draws = {n: first(n).standard_normal(4) for n in names}
    second = TensorRngFactory(seed)
    for n in reversed(names):  # order of requests does not matter
        np.testing.assert_array_equal(second(n).standard_normal(4), draws[n])
    assert len({d.tobytes() for d in draws.values()}) == len(names)
    other = TensorRngFactory(seed + 1)
    assert all(other(n).standard_normal(4).tobytes() != draws[n].tobytes() for n in names)
