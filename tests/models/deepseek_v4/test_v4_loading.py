"""Loading DeepSeek-V4 checkpoints: both name spellings, the shared loader and ``load_model``, FP8/MXFP4 weights,
and refusals of bad checkpoints and configs."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.checkpoint.model_loading import load_model
from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models import builtin
from deepinfer_jax.models.deepseek_v4 import model as v4_model
from deepinfer_jax.models.deepseek_v4.attention import attention_layer, init_attention_state
from deepinfer_jax.models.deepseek_v4.family import FAMILY, init_params
from deepinfer_jax.models.deepseek_v4.params import TRANSFORMERS_ALIASES, assemble_params, canonical_name
from deepinfer_jax.models.deepseek_v4.synthetic import generate_v4_weights
from deepinfer_jax.models.registry import get_family
from deepinfer_jax.numerics import host

ATOL = 1e-4  # see test_v4_model.py


def _transformers_spelling(name: str) -> str:
    """The name transformers 5.24's ``save_pretrained`` writes for a native V4 name (spec/oracles.md table)."""
    native_to_hf = {native: hf for hf, native in TRANSFORMERS_ALIASES.items()}
    if name in native_to_hf:
        return native_to_hf[name] if name == "lm_head.weight" else "model." + native_to_hf[name]
    return "model." + name if name.startswith("layers.") or name == "norm.weight" else name


def _same_tree(a, b) -> None:
    leaves_a, tree_a = jax.tree_util.tree_flatten(a)
    leaves_b, tree_b = jax.tree_util.tree_flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_v4_family_is_registered():
    assert get_family("deepseek_v4") is FAMILY


def test_v4_canonical_names():
    assert canonical_name("model.embed_tokens.weight") == "embed.weight"
    assert canonical_name("model.hc_head.hc_fn") == "hc_head_fn"
    assert canonical_name("model.layers.3.attn.wq_a.weight") == "layers.3.attn.wq_a.weight"
    assert canonical_name("head.weight") == "head.weight"
    assert canonical_name("layers.0.ffn.gate.tid2eid") == "layers.0.ffn.gate.tid2eid"
    assert canonical_name("model.layers.2.attn.norm.weight") == "layers.2.attn.kv_norm.weight"
    assert canonical_name("layers.2.attn.compressor.norm.weight") == "layers.2.attn.compressor.norm.weight"


def test_v4_transformers_spelling_assembles_the_same_params(v4):
    renamed = {_transformers_spelling(k): v for k, v in v4.tensors.items()}
    assert "model.embed_tokens.weight" in renamed and "model.layers.1.attn.compressor.ape" in renamed
    _same_tree(assemble_params(v4.config, renamed), v4.params)


def test_v4_init_params_equals_the_builtin_checkpoint(v4):
    _same_tree(init_params(v4.config, builtin.get_builtin("tiny-v4").seed), v4.params)


def test_v4_load_model_builtin_matches_transformers(v4_logits):
    model = load_model("tiny-v4")
    assert model.family.name == "deepseek_v4"
    seq = v4_logits["sequence_a"]
    np.testing.assert_allclose(model.logits(seq[None])[0], v4_logits["full_logits_a"], atol=ATOL, rtol=0)


def test_v4_load_model_reads_transformers_spelling_and_skips_mtp(v4, tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text((v4.path / "config.json").read_text())
    tensors = {_transformers_spelling(k): v for k, v in v4.tensors.items()}
    tensors["mtp.0.norm.weight"] = np.ones(v4.config.hidden_size, np.float32)  # dropped, as transformers does
    tensors["model.layers.0.attn.norm.weight"] = tensors.pop("model.layers.0.attn.kv_norm.weight")
    builtin.write_safetensors(folder / "model.safetensors", tensors)
    model = load_model(folder)
    _same_tree(model.params, v4.params)


def test_v4_assemble_refuses_bad_tensors(v4):
    bad = dict(v4.tensors)
    del bad["layers.1.attn.compressor.ape"]
    with pytest.raises(ValueError, match=r"layers\.1\.attn\.compressor\.ape"):
        assemble_params(v4.config, bad)
    bad = dict(v4.tensors)
    bad["layers.2.attn.attn_sink"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match=r"layers\.2\.attn\.attn_sink.*shape \(3,\).*\(4,\)"):
        assemble_params(v4.config, bad)
    bad = dict(v4.tensors)
    bad["model.embed_tokens.weight"] = bad["embed.weight"]
    with pytest.raises(ValueError, match="one spelling"):
        assemble_params(v4.config, bad)
    bad = dict(v4.tensors)
    bad["layers.0.ffn.gate.tid2eid"] = np.full_like(bad["layers.0.ffn.gate.tid2eid"], 8)
    with pytest.raises(ValueError, match=r"tid2eid.*\[0, 8\)"):
        assemble_params(v4.config, bad)


@pytest.mark.parametrize("rate", [3, 256])
def test_v4_compression_ratio_must_divide_the_cache_block(rate):
    hf = builtin.hf_config("tiny-v4")
    hf["compress_rates"] = dict(hf["compress_rates"], heavily_compressed_attention=rate)
    with pytest.raises(ValueError, match="128"):
        ModelConfig.from_hf(hf)


def test_v4_legacy_config_spelling_gives_the_same_plan():
    """Real checkpoints' ``compress_ratios`` / ``num_hash_layers`` / ``compress_rate_*`` describe the same model."""
    hf = builtin.hf_config("tiny-v4")
    legacy = {k: v for k, v in hf.items() if k not in ("layer_types", "mlp_layer_types", "compress_rates")}
    legacy.update(
        compress_ratios=[0, 4, 16, 4, 16],
        num_hash_layers=2,
        compress_rate_csa=4,
        compress_rate_hca=16,
    )
    plan = v4_model.V4Plan.from_config(ModelConfig.from_hf(json.loads(json.dumps(legacy))))
    assert plan == v4_model.V4Plan.from_config(ModelConfig.from_hf(hf))


def test_v4_fp8_and_mxfp4_checkpoint_runs_through_the_numerics_library(v4, v4_modules):
    """An FP8 (32x32 UE8M0 blocks) checkpoint with MXFP4 routed experts: a CSA attention layer (every FP8
    projection, including the grouped ``wo_a`` blocks and the indexer's ``wq_b``) and an MoE layer (MXFP4 experts,
    FP8 shared experts) give what the same weights give when dequantised on the host by the NumPy codecs and run
    unquantised. In float32 parity mode the quantised linears decode tile by tile, so only summation order
    differs (a few ulps on O(1) values; 1e-4 as elsewhere)."""
    hf = builtin.hf_config("tiny-v4")
    hf["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": [32, 32],
        "scale_fmt": "ue8m0",
        "expert_dtype": "fp4",
    }
    cfg = ModelConfig.from_hf(hf)
    tensors = generate_v4_weights(hf, builtin.TensorRngFactory(0))
    assert tensors["layers.1.attn.wq_a.weight"].dtype.name == "float8_e4m3fn"
    assert tensors["layers.1.attn.wq_a.scale"].dtype.name == "float8_e8m0fnu"
    assert tensors["layers.2.ffn.experts.0.w1.weight"].dtype == np.uint8  # packed E2M1 pairs
    quantised = assemble_params(cfg, tensors)
    assert set(quantised["layers"][2]["ffn"]["experts"]["gate"]) == {"packed", "scale"}

    dense = {}
    for name, value in tensors.items():
        if name.endswith(".scale"):
            continue
        scale = tensors.get(name[: -len(".weight")] + ".scale") if name.endswith(".weight") else None
        if scale is None:
            dense[name] = value
        elif ".experts." in name:
            dense[name] = host.dequantize_mxfp4(value, scale)
        else:
            dense[name] = host.dequantize_fp8_blockwise(value, scale, (32, 32))
    reference = assemble_params(v4.config, dense)
    q_numerics = v4_model.numerics_for(cfg)
    assert v4_model.V4Plan.from_config(cfg) == v4.plan

    spec = v4.plan.attention[1]
    attn = jax.jit(attention_layer, static_argnames=("spec", "numerics"))
    x = jnp.asarray(v4_modules["attn1.input"])[None]
    state = init_attention_state(spec, 1, x.shape[1])
    out, _ = attn(quantised["layers"][1]["attn"], x, 0, state, spec=spec, numerics=q_numerics)
    ref, _ = attn(reference["layers"][1]["attn"], x, 0, state, spec=spec, numerics=v4.numerics)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=ATOL, rtol=0)

    moe = jax.jit(v4_model.moe_layer, static_argnames=("plan", "numerics", "hashed"))
    x = jnp.asarray(v4_modules["moe2.input"])[None]
    ids = jnp.asarray(v4_modules["input_ids"][v4_modules["rows"]])[None]
    out = moe(quantised["layers"][2]["ffn"], x, ids, plan=v4.plan, numerics=q_numerics, hashed=False)
    ref = moe(reference["layers"][2]["ffn"], x, ids, plan=v4.plan, numerics=v4.numerics, hashed=False)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=ATOL, rtol=0)
