"""HF config.json parsing: every family and spelling, derived values, constraints, completeness, immutability."""

from __future__ import annotations

import dataclasses
import json

import pytest

from deepinfer_jax.config import (
    ConfigTypeError,
    ConfigValueError,
    DeepseekV3Config,
    DeepseekV4Config,
    DeepseekV41Config,
    ModelConfig,
    QuantizationConfig,
    RopeConfig,
    load_config,
    load_model_config,
    parse_hf_config,
)
from deepinfer_jax.config.loaders import read_yaml_file


class _Delete:
    def __repr__(self) -> str:  # a stable test id on every xdist worker
        return "DELETE"


DELETE = _Delete()
"""Value for :func:`set_path` that removes the key instead of setting it."""


def set_path(d: dict, dotted: str, value: object) -> None:
    """``d[a][b]... = value`` for ``"a.b..."`` (``DELETE`` removes the key)."""
    *parents, last = dotted.split(".")
    for part in parents:
        d = d[part]
    if value is DELETE:
        del d[last]
    else:
        d[last] = value


ALL = ("tiny_v3", "tiny_v4", "tiny_v41", "deepseek_v3", "deepseek_v41_flash")


# --------------------------------------------------------------------------------------- shipped configs


@pytest.mark.parametrize("name", ALL)
def test_every_shipped_yaml_loads(configs_dir, name):
    path = configs_dir / f"{name}.yaml"
    model = load_model_config(path)
    engine = load_config(path, env={})
    assert engine.model == model
    assert model.source is not None and name in model.source
    # The original dict survives unchanged, so config.json can be written back byte-for-byte.
    assert model.to_hf_dict() == read_yaml_file(path)["model"]
    json.dumps(model.to_dict())


def test_tiny_v41_derived_values_of_spec_15_2(configs_dir):
    cfg = load_model_config(configs_dir / "tiny_v41.yaml")
    assert isinstance(cfg, DeepseekV41Config) and cfg.family == "deepseek_v41"
    assert cfg.nope_head_dim == 64  # Dc = 128 - 64
    assert cfg.n_prefill_layer == 3
    assert cfg.yoco_layer_ids == (3, 4, 5, 6)
    assert cfg.has_yoco
    assert cfg.vocab_size == 512
    assert cfg.compress_ratios == (0, 2, 2, 1, 1, 1, 1)
    assert cfg.draft_compress_ratios == (0, 0)
    assert cfg.kv_source_layer_ids == (1, 3, 5)
    assert cfg.index_source_layer_ids == (1, 3, 4, 5)
    assert cfg.index_k_source_layer_ids == (1, 3, 5)
    assert cfg.candidate_source_layer_id == 3
    assert cfg.engram_layer_ids == (0, 2)
    assert cfg.engram_compressed_vocab_size is None
    assert cfg.engram_num_embeddings == (4062, 4152)
    assert cfg.num_engram_orders == 2
    assert cfg.dspark_target_layer_ids == (4, 5, 6)
    assert cfg.missing_fields() == ()
    cfg.require_complete("building parameters")
    # RoPE per layer kind: SWA-only layers plain 1e4, compressed layers 1.6e5 + YaRN without magnitude scaling.
    assert cfg.layer_rope(0) == RopeConfig(theta=1e4)
    compress = cfg.layer_rope(3)
    assert (compress.theta, compress.rope_type, compress.factor) == (160000.0, "yarn", 4.0)
    assert (compress.original_max_position_embeddings, compress.beta_fast, compress.beta_slow) == (512, 32, 1)
    assert compress.attention_factor == 1.0 and compress.mscale is None
    assert cfg.quantization == QuantizationConfig(
        quant_method="fp8", weight_block_size=(32, 32), scale_fmt="ue8m0", expert_dtype="fp4"
    )


def test_real_v41_flash_shape_parses_for_sizing_but_is_incomplete(configs_dir):
    cfg = load_model_config(configs_dir / "deepseek_v41_flash.yaml")
    assert cfg.num_hidden_layers == 40 and cfg.num_nextn_predict_layers == 3
    assert cfg.n_prefill_layer == 20
    assert cfg.nope_head_dim == 448
    assert cfg.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20
    assert cfg.resolved_index_k_source_layer_ids == (2, 8, 14, 20)
    assert cfg.index_k_source_layer_ids is None
    missing = cfg.missing_fields()
    assert "text_config.rope_theta" in missing and "text_config.compress_rope_theta" in missing
    assert "text_config.rope_scaling.factor" in missing
    assert "text_config.engram_n_heads" in missing and "text_config.dspark_target_layer_ids" in missing
    with pytest.raises(ValueError) as info:
        cfg.require_complete("building parameters")
    message = str(info.value)
    assert "building parameters" in message and "deepseek_v41_flash.yaml" in message
    for key in missing:
        assert key in message


def test_real_v3_shape(configs_dir):
    cfg = load_model_config(configs_dir / "deepseek_v3.yaml")
    assert isinstance(cfg, DeepseekV3Config)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (61, 7168, 128)
    assert cfg.qk_head_dim == 192
    assert cfg.mlp_layer_types[:4] == ("dense", "dense", "dense", "moe")
    assert cfg.quantization == QuantizationConfig(quant_method="fp8", weight_block_size=(128, 128))
    assert cfg.quantization.scale_fmt == "float32" and cfg.quantization.expert_format == "fp8"
    assert cfg.rope == RopeConfig(
        theta=10000.0,
        rope_type="yarn",
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    )
    assert cfg.missing_fields() == ()


def test_tiny_v3_and_v4_shapes(configs_dir):
    v3 = load_model_config(configs_dir / "tiny_v3.yaml")
    assert isinstance(v3, DeepseekV3Config)
    assert (v3.q_lora_rank, v3.kv_lora_rank, v3.qk_rope_head_dim, v3.first_k_dense_replace) == (64, 64, 32, 1)
    assert v3.quantization is None and v3.rope.mscale_all_dim == 0.5
    v4 = load_model_config(configs_dir / "tiny_v4.yaml")
    assert isinstance(v4, DeepseekV4Config)
    assert v4.compress_ratios == (0, 4, 16, 4, 16)
    assert v4.hash_layer_ids == (0, 1) and v4.num_hash_layers == 2
    assert (v4.compress_rate_csa, v4.compress_rate_hca) == (4, 16)
    assert v4.compress_rope.attention_factor == 1.0 and v4.rope.theta == 1e4
    assert v4.nope_head_dim == 64


# --------------------------------------------------------------------------------------------- spellings


def test_v3_rope_parameters_spelling_equals_legacy(hf):
    legacy = hf("tiny_v3")
    modern = hf("tiny_v3")
    scaling = modern.pop("rope_scaling")
    scaling["rope_type"] = scaling.pop("type")
    modern["rope_parameters"] = {"rope_theta": modern.pop("rope_theta"), **scaling}
    modern["num_mtp_layers"] = modern.pop("num_nextn_predict_layers")
    del modern["scoring_func"], modern["topk_method"]  # transformers' V3 class has neither key
    a, b = parse_hf_config(legacy), parse_hf_config(modern)
    assert a.rope == b.rope and a.rope.theta == 10000.0
    assert b.rope.theta_key == "rope_parameters.rope_theta"
    assert dataclasses.replace(a, hf=b.hf) == b  # every parsed field is equal


def test_v3_null_q_lora_rank_means_plain_q_proj(hf):
    d = hf("tiny_v3")
    d["q_lora_rank"] = None
    assert parse_hf_config(d).q_lora_rank is None


def test_v4_legacy_spelling_equals_transformers_spelling(hf):
    new = hf("tiny_v4")
    old = hf("tiny_v4")
    for key in (
        "layer_types",
        "compress_rates",
        "mlp_layer_types",
        "rope_parameters",
        "partial_rotary_factor",
    ):
        del old[key]
    # Real checkpoints: per-layer ratios (here with the MTP layer's entry appended), scalar rates, a hash-layer
    # count and the flat rope keys.
    old.update(
        compress_ratios=[0, 4, 16, 4, 16, 0],
        compress_rate_csa=4,
        compress_rate_hca=16,
        num_hash_layers=2,
        rope_scaling={
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 512,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    )
    a, b = parse_hf_config(new), parse_hf_config(old)
    assert a.layer_types == b.layer_types
    assert a.mlp_layer_types == b.mlp_layer_types == ("hash_moe", "hash_moe", "moe", "moe", "moe")
    assert a.compress_ratios == b.compress_ratios == (0, 4, 16, 4, 16)
    assert a.rope == b.rope
    assert a.compress_rope == b.compress_rope  # attention_factor defaults to 1.0 for V4 YaRN
    assert dataclasses.replace(a, hf=b.hf) == b


def test_v4_qk_rope_head_dim_from_partial_rotary_factor(hf):
    d = hf("tiny_v4")
    del d["qk_rope_head_dim"]
    assert parse_hf_config(d).qk_rope_head_dim == 64  # 128 * 0.5


@pytest.mark.parametrize("none_spelling", [None, -1, DELETE])
def test_v41_no_candidate_source_spellings(hf, none_spelling):
    d = hf("tiny_v41")
    set_path(d, "text_config.candidate_source_layer_id", none_spelling)
    assert parse_hf_config(d).candidate_source_layer_id is None


def test_v41_rope_spellings(hf):
    base = parse_hf_config(hf("tiny_v41"))
    rope_type_only = hf("tiny_v41")
    del rope_type_only["text_config"]["rope_scaling"]["type"]
    nested = hf("tiny_v41")
    text = nested["text_config"]
    scaling = text.pop("rope_scaling")
    del scaling["type"]
    text["rope_parameters"] = {
        "main": {"rope_type": "default", "rope_theta": text.pop("rope_theta")},
        "compress": {**scaling, "rope_theta": text.pop("compress_rope_theta")},
    }
    for variant in (rope_type_only, nested):
        cfg = parse_hf_config(variant)
        assert (cfg.rope, cfg.compress_rope) == (base.rope, base.compress_rope)


def test_v41_index_k_sources_default_to_kv_sources(hf):
    d = hf("tiny_v41")
    del d["text_config"]["index_k_source_layer_ids"]
    cfg = parse_hf_config(d)
    assert cfg.index_k_source_layer_ids is None
    assert cfg.resolved_index_k_source_layer_ids == (1, 3, 5)


def test_v41_without_ratio_one_has_no_yoco(hf):
    d = hf("tiny_v41")
    text = d["text_config"]
    text["compress_ratios"] = [0, 2, 2, 2, 2, 2, 2, 1, 0]  # the first 1 is a draft entry
    text["kv_source_layer_ids"] = [1, 3, 5]
    cfg = parse_hf_config(d)
    assert cfg.n_prefill_layer == 7 and not cfg.has_yoco and cfg.yoco_layer_ids == ()


@pytest.mark.parametrize("name", ALL)
def test_unknown_hf_keys_are_ignored(hf, name):
    d = hf(name)
    noisy = hf(name)
    noisy["id2label"] = {"0": "LABEL_0"}
    noisy["some_future_key"] = [1, 2, 3]
    if "text_config" in noisy:
        noisy["text_config"]["yoco_swa_share_hidden"] = False
    a, b = parse_hf_config(d), parse_hf_config(noisy)
    assert dataclasses.replace(a, hf=b.hf) == b
    assert b.hf["some_future_key"] == (1, 2, 3)  # kept, frozen, for writing config.json back


# ------------------------------------------------------------------------------------------- bad input


def test_type_error_names_key_file_and_expected_type(configs_dir, tmp_path, hf):
    d = hf("tiny_v41")
    d["text_config"]["hidden_size"] = "256"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    with pytest.raises(TypeError) as info:
        load_model_config(path)
    message = str(info.value)
    assert "text_config.hidden_size" in message and str(path) in message and "expected int" in message


def test_bool_is_not_an_int(hf):
    d = hf("tiny_v3")
    d["num_hidden_layers"] = True
    with pytest.raises(ConfigTypeError, match=r"num_hidden_layers: expected int, got bool"):
        parse_hf_config(d)


def test_missing_required_key_is_named(hf):
    d = hf("tiny_v41")
    del d["text_config"]["o_groups"]
    with pytest.raises(ConfigValueError, match=r"text_config.o_groups is required but missing"):
        parse_hf_config(d, source="ckpt/config.json")


def test_unknown_model_type(hf):
    d = hf("tiny_v3")
    d["model_type"] = "deepseek_v32"
    with pytest.raises(ValueError, match=r"deepseek_v32.*supported: deepseek_v3, deepseek_v4, deepseek_v41"):
        parse_hf_config(d)


def test_family_class_checks_model_type(hf):
    with pytest.raises(ValueError, match=r"expected 'deepseek_v3'"):
        DeepseekV3Config.from_hf(hf("tiny_v4"))
    assert isinstance(DeepseekV4Config.from_hf(hf("tiny_v4")), DeepseekV4Config)


V41_VIOLATIONS = [
    ("text_config.num_key_value_heads", 2, "must be 1"),
    ("text_config.compress_ratios", [0, 2, 2, 1, 1, 1, 1, 0], "9"),
    ("text_config.compress_ratios", [0, 2, 3, 1, 1, 1, 1, 0, 0], "0, 1 or 2"),
    ("text_config.o_groups", 3, "must divide num_attention_heads"),
    ("text_config.scoring_func", "sigmoid", "sqrtsoftplus"),
    ("text_config.norm_topk_prob", False, "must be true"),
    ("text_config.topk_method", "greedy", "noaux_tc"),
    ("text_config.hidden_act", "gelu", "silu"),
    ("text_config.attention_bias", True, "must be false"),
    ("text_config.attention_dropout", 0.1, "must be 0.0"),
    ("text_config.num_experts_per_tok", 9, "<= 8"),
    ("text_config.q_lora_rank", None, "expected int"),
    ("text_config.qk_rope_head_dim", 62 + 1, "even"),
    ("text_config.swiglu_limit", 0.0, "> 0"),
    ("text_config.kv_source_layer_ids", [3, 1, 5], "sorted"),
    ("text_config.index_source_layer_ids", [1, 3, 4, 9], "< 7"),
    ("text_config.kv_source_layer_ids", [1, 5], "must contain n_prefill_layer = 3"),
    ("text_config.index_topk", DELETE, "index_topk is required"),
    ("text_config.candidate_source_layer_id", 0, "sliding-window only"),
    ("text_config.candidate_topk_blocks", 12, "multiple of 8"),
    ("text_config.candidate_topk_blocks", 8192, "<= 4096"),
    ("text_config.candidate_topk_blocks", None, "required when candidate_source_layer_id"),
    ("text_config.candidate_block_size", 32, "<= 16"),
    ("text_config.candidate_block_size", 1, "must be >= index_topk"),
    ("text_config.dspark_target_attn_input", False, "attention input"),
    ("text_config.dspark_num_experts_per_tok", 5, "<= 4"),
    ("text_config.dspark_noise_token_id", 512, "< 512"),
    ("text_config.dspark_target_layer_ids", [4, 9], "< 7"),
    ("text_config.dspark_markov_rank", DELETE, "dspark_markov_rank is required"),
    ("text_config.engram_max_ngram_size", 1, ">= 2"),
    ("text_config.engram_num_embeddings", [4062], "one entry per Engram layer"),
    ("text_config.engram_layer_ids", [0, 4], "before n_prefill_layer"),
    ("text_config.engram_compressed_vocab_size", 0, "tokenizer compression"),
    ("text_config.hc_mult", 1, "more than one hyper-connection stream"),
    ("text_config.rope_scaling", {"rope_type": "linear", "factor": 2.0}, "unsupported RoPE type"),
    ("text_config.rope_scaling.type", "default", "contradicts rope_type"),
    ("text_config.rope_scaling.attention_factor", 1.2, "no YaRN magnitude scaling"),
    ("text_config.compress_rope_theta", DELETE, "compress_rope_theta is required"),
    ("dtype", "float32", "'bfloat16'"),
    ("architectures", ["DeepseekV4ForCausalLM"], "DeepseekV41ForCausalLM"),
    ("quantization_config.weight_block_size", [128, 128], "must be (32, 32)"),
    ("quantization_config.scale_fmt", DELETE, "must be 'ue8m0'"),
    ("quantization_config.quant_method", "int8", "must be one of 'fp8'"),
    ("vision_config.hidden_size", DELETE, "vision_config.hidden_size is required"),
    ("pad_token_id", DELETE, "pad_token_id is required"),
]


@pytest.mark.parametrize(
    ("key", "value", "expected"), V41_VIOLATIONS, ids=[f"{k}={v}" for k, v, _ in V41_VIOLATIONS]
)
def test_v41_constraint_violations(hf, key, value, expected):
    d = hf("tiny_v41")
    set_path(d, key, value)
    with pytest.raises((ValueError, TypeError)) as info:
        parse_hf_config(d, source="configs/tiny_v41.yaml")
    message = str(info.value)
    assert expected in message
    # The message names the offending key and the file.
    assert key.split(".")[-1] in message or key.rsplit(".", 1)[0] in message
    assert "tiny_v41.yaml" in message


def test_v41_float_weights_without_quantization_config(hf):
    # No quantization_config: a float-weight V4.1 (every linear unquantised), stored in bfloat16 or float32.
    d = hf("tiny_v41")
    del d["quantization_config"]
    for dtype in ("bfloat16", "float32"):
        d["dtype"] = dtype
        cfg = parse_hf_config(d, source="configs/tiny_v41.yaml")
        assert cfg.quantization is None and cfg.checkpoint_dtype == dtype
    d["dtype"] = "float16"
    with pytest.raises(
        ValueError, match=r"dtype = 'float16' .*: a float-weight V4.1 .* 'bfloat16' or 'float32'"
    ):
        parse_hf_config(d, source="configs/tiny_v41.yaml")


V3_VIOLATIONS = [
    ("scoring_func", "softmax", "'sigmoid'"),
    ("n_group", 3, "must divide n_routed_experts"),
    ("topk_group", 5, "<= 4"),
    ("num_experts_per_tok", 5, "<= topk_group * experts per group = 4"),
    ("first_k_dense_replace", 4, "<= 3"),
    ("qk_rope_head_dim", 33, "even"),
    ("moe_layer_freq", 2, "only 1"),
    ("rope_scaling.type", "linear", "unsupported RoPE type"),
    ("n_group", None, "set both or neither"),
    ("rope_scaling.factor", 0.0, "> 0"),
]


@pytest.mark.parametrize(
    ("key", "value", "expected"), V3_VIOLATIONS, ids=[f"{k}={v}" for k, v, _ in V3_VIOLATIONS]
)
def test_v3_constraint_violations(hf, key, value, expected):
    d = hf("tiny_v3")
    set_path(d, key, value)
    with pytest.raises(ValueError, match=None) as info:
        parse_hf_config(d, source="configs/tiny_v3.yaml")
    assert expected in str(info.value) and "tiny_v3.yaml" in str(info.value)


def test_v3_mtp_spellings_must_agree(hf):
    d = hf("tiny_v3")
    d["num_mtp_layers"] = 2
    with pytest.raises(ValueError, match=r"num_mtp_layers = 2 contradicts num_nextn_predict_layers = 1"):
        parse_hf_config(d)


def test_v3_rope_spellings_must_agree(hf):
    d = hf("tiny_v3")
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    with pytest.raises(ValueError, match=r"rope_theta = 10000.0 contradicts rope_parameters.rope_theta"):
        parse_hf_config(d)


V4_VIOLATIONS = [
    ("compress_rates.compressed_sparse_attention", 3, "must divide 128"),
    ("compress_rates.other_attention", 8, "unknown key 'other_attention'"),
    ("layer_types", ["sliding_attention"] * 4, "4 entries"),
    ("layer_types", ["sliding_attention"] * 4 + ["full_attention"], "layer_types[4] = 'full_attention'"),
    ("mlp_layer_types", DELETE, "mlp_layer_types is required"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}, "nested {main"),
    ("rope_parameters.main.rope_type", "ntk", "unsupported RoPE type"),
    ("rope_parameters.main.rope_theta", 5e5, "contradicts rope_parameters.main.rope_theta"),
    ("o_groups", 3, "must divide num_attention_heads"),
    ("partial_rotary_factor", 0.25, "gives 32 RoPE dims, but qk_rope_head_dim = 64"),
    ("index_n_heads", None, "index_n_heads is required because layer 1"),
    ("scoring_func", "softmax", "'sqrtsoftplus', 'sigmoid'"),
]


@pytest.mark.parametrize(
    ("key", "value", "expected"), V4_VIOLATIONS, ids=[f"{k}={v}" for k, v, _ in V4_VIOLATIONS]
)
def test_v4_constraint_violations(hf, key, value, expected):
    d = hf("tiny_v4")
    set_path(d, key, value)
    with pytest.raises(ValueError) as info:
        parse_hf_config(d, source="configs/tiny_v4.yaml")
    assert expected in str(info.value)


def test_v4_main_rope_must_be_plain(hf):
    d = hf("tiny_v4")
    d["rope_parameters"]["main"] = dict(d["rope_parameters"]["compress"], rope_theta=1e4)
    with pytest.raises(ValueError, match=r"main RoPE must be plain"):
        parse_hf_config(d)


@pytest.mark.parametrize("ratio", [3, 5, 48])
def test_v4_legacy_ratio_that_does_not_divide_128(hf, ratio):
    d = hf("tiny_v4")
    for key in ("layer_types", "compress_rates"):
        del d[key]
    d.update(compress_ratios=[0, 4, ratio, 4, ratio], compress_rate_csa=4, compress_rate_hca=ratio)
    with pytest.raises(ValueError, match=f"compress_rate_hca = {ratio}: a compression ratio must divide 128"):
        parse_hf_config(d)


def test_v4_legacy_ratio_outside_the_rates(hf):
    d = hf("tiny_v4")
    for key in ("layer_types", "compress_rates"):
        del d[key]
    d["compress_ratios"] = [0, 4, 16, 8, 16]
    d.update(compress_rate_csa=4, compress_rate_hca=16)
    with pytest.raises(
        ValueError, match=r"compress_ratios\[3\] = 8: expected 0, the CSA rate 4 or the HCA rate 16"
    ):
        parse_hf_config(d)


# ---------------------------------------------------------------------------------- immutability, identity


def test_model_config_is_frozen_and_hashable(configs_dir):
    cfg = load_model_config(configs_dir / "tiny_v41.yaml")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.hf["model_type"] = "x"  # type: ignore[index]
    with pytest.raises(TypeError):
        cfg.hf["text_config"]["compress_ratios"][0] = 5  # type: ignore[index]
    again = load_model_config(configs_dir / "tiny_v41.yaml")
    assert cfg == again and hash(cfg) == hash(again)
    assert {cfg: 1}[again] == 1  # usable as a static (hashed) argument


def test_replace_revalidates(configs_dir):
    cfg = load_model_config(configs_dir / "tiny_v41.yaml")
    with pytest.raises(ValueError, match=r"text_config.o_groups = 3"):
        dataclasses.replace(cfg, o_groups=3)
    with pytest.raises(TypeError, match=r"text_config.hidden_size: expected int, got str"):
        dataclasses.replace(cfg, hidden_size="256")


def test_with_hf_overrides_keeps_hf_in_step(configs_dir):
    cfg = load_model_config(configs_dir / "tiny_v41.yaml")
    changed = cfg.with_hf_overrides({"rms_norm_eps": 1e-5, "rope_scaling.factor": 8.0, "pad_token_id": 3})
    assert changed.rms_norm_eps == 1e-5 and changed.hf["text_config"]["rms_norm_eps"] == 1e-5
    assert changed.compress_rope.factor == 8.0
    assert changed.pad_token_id == 3 and changed.hf["pad_token_id"] == 3  # a top-level key stays top-level
    assert cfg.rms_norm_eps == 1e-6  # the original is untouched


def test_missing_fields_for_a_null_v3_rope(hf):
    d = hf("tiny_v3")
    d["rope_theta"] = None
    d["rope_scaling"]["beta_fast"] = None
    cfg = parse_hf_config(d)
    assert cfg.missing_fields() == ("rope_theta", "rope_scaling.beta_fast")
    with pytest.raises(
        ValueError, match=r"incomplete for a test: rope_theta, rope_scaling.beta_fast are null"
    ):
        cfg.require_complete("a test")


def test_model_config_base_is_the_dispatcher(hf):
    cfg = ModelConfig.from_hf(hf("tiny_v41"))
    assert type(cfg) is DeepseekV41Config


# Variants of spec/model.md §15.3 and the tiny-xcheck variant of §15.4: each is a valid V4.1 config.
V41_VARIANTS = {
    "tiny-nonshifted": {"text_config.hc_shifted": False},
    "tiny-fp8kv": {"text_config.use_fp4_sparse_kv": False},
    "tiny-dense-compressed": {"text_config.index_topk": 0, "text_config.candidate_source_layer_id": None},
    "tiny-bringup": {
        "text_config.engram_layer_ids": [],
        "text_config.num_nextn_predict_layers": 0,
        "text_config.compress_ratios": [0, 2, 2, 1, 1, 1, 1],
    },
    "tiny-xcheck": {
        "text_config.engram_layer_ids": [1, 2],
        "text_config.kv_source_layer_ids": [1, 3],
        "text_config.index_k_source_layer_ids": DELETE,
        "text_config.candidate_source_layer_id": -1,
    },
}


@pytest.mark.parametrize("variant", sorted(V41_VARIANTS))
def test_spec_variants_parse(hf, variant):
    d = hf("tiny_v41")
    for key, value in V41_VARIANTS[variant].items():
        set_path(d, key, value)
    cfg = parse_hf_config(d)
    assert cfg.n_prefill_layer == 3 and cfg.missing_fields() == ()
    if variant == "tiny-bringup":
        assert (
            cfg.num_nextn_predict_layers == 0 and not cfg.engram_enabled and cfg.draft_compress_ratios == ()
        )
    if variant == "tiny-xcheck":
        assert cfg.resolved_index_k_source_layer_ids == (1, 3) and cfg.candidate_source_layer_id is None
