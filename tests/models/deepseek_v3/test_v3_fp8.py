"""FP8 DeepSeek-V3 checkpoints: the FP8 path against a NumPy dequantiser written here, and bf16 production mode.

The checkpoint uses V3's real 128x128 blocks on dimensions that are not multiples of 128 (160, 136, 144, ...),
so every weight has partial edge blocks on the ceil-div grid -- the case transformers' own FP8 path gets wrong
(spec/oracles.md). The reference is the same checkpoint with every FP8 weight dequantised by
:func:`np_dequantize` below (codes times the block's ``weight_scale_inv``) and stored as float32.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import deepinfer_jax
from deepinfer_jax.models.builtin import TensorRngFactory, write_safetensors
from deepinfer_jax.models.deepseek_v3 import model as v3_model
from deepinfer_jax.models.deepseek_v3 import weights as v3_weights
from deepinfer_jax.models.deepseek_v3.synthetic import generate_v3_weights

BLOCK = (128, 128)
CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "torch_dtype": "bfloat16",
    "vocab_size": 64,
    "hidden_size": 160,
    "intermediate_size": 136,
    "moe_intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_nextn_predict_layers": 0,
    "first_k_dense_replace": 1,
    "num_attention_heads": 2,
    "q_lora_rank": 144,
    "kv_lora_rank": 136,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    },
}
IDS = np.random.default_rng(0).integers(0, 64, (2, 10)).astype(np.int32)
# One jitted forward for the module: both precision modes and the modified-bias parameters reuse its compilations.
FORWARD = jax.jit(v3_model.forward_logits, static_argnums=1)


def np_dequantize(codes: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """``W[i, j] = e4m3(codes[i, j]) * scale_inv[i // b0, j // b1]`` on the ceil-div block grid."""
    rows, cols = codes.shape
    assert scale_inv.shape == (-(-rows // block[0]), -(-cols // block[1]))
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    r = np.arange(rows)[:, None] // block[0]
    c = np.arange(cols)[None, :] // block[1]
    return values * scale_inv[r, c]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("v3_fp8")
    tensors = generate_v3_weights(CONFIG, TensorRngFactory(11))
    fp8, deq = root / "fp8", root / "dequantised"
    for folder in (fp8, deq):
        folder.mkdir()
    (fp8 / "config.json").write_text(json.dumps(CONFIG))
    write_safetensors(fp8 / "model.safetensors", tensors)
    plain_cfg = {k: v for k, v in CONFIG.items() if k != "quantization_config"}
    (deq / "config.json").write_text(json.dumps(plain_cfg))
    plain = {}
    partial = 0
    for name, value in tensors.items():
        if name.endswith(".weight_scale_inv"):
            continue
        scale_name = name.removesuffix(".weight") + ".weight_scale_inv"
        if scale_name in tensors:
            assert value.dtype == ml_dtypes.float8_e4m3fn
            partial += value.shape[0] % BLOCK[0] != 0 or value.shape[1] % BLOCK[1] != 0
            plain[name] = np_dequantize(value, tensors[scale_name], BLOCK)
        else:
            plain[name] = value
    assert partial > 10  # most projections have partial edge blocks
    write_safetensors(deq / "model.safetensors", plain)
    return fp8, deq


@pytest.fixture(scope="module")
def fp8_f32(folders):
    return deepinfer_jax.load_model(folders[0], "float32")


def test_fp8_weights_stay_fp8(fp8_f32):
    q_a = fp8_f32.params["layers"][0]["attn"]["q_a_proj"]
    assert set(q_a) == {"weight", "scale"}
    assert q_a["weight"].dtype == jnp.uint8 and q_a["scale"].shape == (2, 2)
    experts = fp8_f32.params["layers"][1]["mlp"]["experts"]["gate"]
    assert experts["weight"].shape == (4, 48, 160) and experts["scale"].shape == (4, 1, 2)


def test_fp8_parity_mode_matches_numpy_dequantised_checkpoint(folders, fp8_f32):
    # Same float32 arithmetic on the same weight values (tile-wise dequantisation vs a dequantised file), so
    # only summation order differs: 1e-5 of the logit scale.
    want = deepinfer_jax.load_model(folders[1], "float32").logits(IDS)
    got = np.asarray(FORWARD(fp8_f32.params, fp8_f32.config, IDS))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_bf16_production_mode_tracks_float32(folders, fp8_f32):
    """Production numerics (bf16 activations, per-token-per-128 FP8 activation casts) against parity mode.

    Routing is made decisive first (correction bias +1 on one group: every token takes experts 2 and 3 in both
    modes), so the comparison measures rounding, not a near-tie flipping an expert. Error budget: every FP8
    GEMM input is rounded to E4M3 (3 mantissa bits: up to 2^-4 relative per element) on top of bf16 rounding
    (2^-9) at every layer boundary. Measured on this model: 7% of the largest |logit| at worst and 1.5% on
    average (bf16 alone, without the FP8 casts, gives 1% / 0.2%). Bounds of 15% / 3% leave headroom for other
    platforms' summation orders and still fail when a cast is misapplied or a weight misread (O(1) errors).
    """
    bf16 = deepinfer_jax.load_model(folders[0], "bfloat16")
    decisive = jnp.array([0.0, 0.0, 1.0, 1.0], jnp.float32)
    outs = []
    for model in (fp8_f32, bf16):
        params = jax.tree.map(lambda x: x, model.params)
        params["layers"][1]["mlp"]["bias"] = decisive
        outs.append(np.asarray(FORWARD(params, model.config, IDS)))
    want, got = outs
    scale = np.abs(want).max()
    err = np.abs(got - want)
    assert err.max() <= 0.15 * scale, err.max() / scale
    assert err.mean() <= 0.03 * scale, err.mean() / scale
    assert bf16.params["embed"].dtype == jnp.bfloat16
    assert bf16.params["layers"][1]["mlp"]["router"].dtype == jnp.float32
    assert v3_model.plan(bf16.config, "bfloat16").numerics.activation_cast == "fp8_token_block"
    assert v3_model.plan(bf16.config, "float32").numerics.activation_cast == "none"


def test_fp8_scales_share_their_weights_axes(fp8_f32):
    axes = v3_weights.logical_axes(fp8_f32.params)
    q_b = axes["layers"][0]["attn"]["q_b_proj"]
    assert q_b == {"weight": ("q_heads", "q_lora"), "scale": ("q_heads", "q_lora")}


def test_bf16_cached_path_tracks_the_bf16_full_forward(folders):
    """The absorbed-MLA cached path runs in production mode on XLA:CPU and agrees with the naive full forward.

    (XLA:CPU cannot execute some bf16 x bf16 -> f32 batched dots; the attention widens operands to float32,
    which is exact.) Routing is made decisive as above, so a near-tie cannot flip an expert between the two
    paths. The paths round differently (bf16 cache, bf16 absorbed query vs bf16 expanded keys), each within
    the production-mode budget of the test above: bounded at 15% of the largest |logit|; a wrong mask or a
    misread cache slot gives O(1) errors.
    """
    bf16 = deepinfer_jax.load_model(folders[0], "bfloat16")
    params = jax.tree.map(lambda x: x, bf16.params)
    params["layers"][1]["mlp"]["bias"] = jnp.array([0.0, 0.0, 1.0, 1.0], jnp.float32)
    full = np.asarray(FORWARD(params, bf16.config, IDS), np.float32)
    cache = v3_model.init_cache(bf16.config, IDS.shape[0], IDS.shape[1], "bfloat16")
    assert cache["latent"].dtype == jnp.bfloat16
    positions = np.broadcast_to(np.arange(IDS.shape[1], dtype=np.int32), IDS.shape)
    cached, _ = v3_model.forward(params, bf16.config, IDS, positions, cache)
    err = np.abs(np.asarray(cached, np.float32) - full)
    assert err.max() <= 0.15 * np.abs(full).max(), err.max() / np.abs(full).max()
