"""The engine config tree: section validation, derived quantities of spec/engine.md §2.3, immutability."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_jax.config import (
    BLOCK_SIZES,
    CacheConfig,
    ConfigTypeError,
    ConfigValueError,
    EngineConfig,
    FrozenMapping,
    OpsConfig,
    ParallelConfig,
    SamplingConfig,
    SchedulerConfig,
    SpeculativeConfig,
    config_to_dict,
    load_model_config,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(scope="module")
def models():
    return {
        name: load_model_config(CONFIGS / f"{name}.yaml")
        for name in ("tiny_v3", "tiny_v41", "deepseek_v41_flash")
    }


# ------------------------------------------------------------------------------------------- sections

SECTION_VIOLATIONS = [
    (CacheConfig, "block_size", 100, "128 or a divisor of 128 that is a multiple of 8"),
    (CacheConfig, "block_size", 4, "(8, 16, 32, 64, 128)"),
    (CacheConfig, "memory_utilization", 1.5, "cache.memory_utilization = 1.5: must be <= 1.0"),
    (CacheConfig, "memory_utilization", 0.0, "must be > 0.0"),
    (CacheConfig, "num_blocks", 1, "cache.num_blocks = 1: must be >= 2"),
    (CacheConfig, "state_slots_ratio", 0.5, ">= 1.0"),
    (ParallelConfig, "expert_parallel_size", 0, "parallel.expert_parallel_size = 0: must be >= 1"),
    (ParallelConfig, "moe_force_imbalance_ratio", 0.5, "0 (off) or >= 1"),
    (ParallelConfig, "eplb_window_steps", 0, ">= 1"),
    (SchedulerConfig, "max_num_seqs", 0, "scheduler.max_num_seqs = 0: must be >= 1"),
    (SchedulerConfig, "yoco_truncation", "on", "must be one of 'off', 'mask', 'compact'"),
    (SchedulerConfig, "decode_bucket_interval", 0, ">= 1"),
    (SpeculativeConfig, "num_draft_tokens", -1, "speculative.num_draft_tokens = -1: must be >= 0"),
    (SpeculativeConfig, "confidence_temperature", 0.0, "must be > 0"),
    (SpeculativeConfig, "confidence_temperature", (1.0, -2.0), "confidence_temperature[1] = -2.0"),
    (SamplingConfig, "top_p", 0.0, "sampling.top_p = 0.0: must be > 0.0"),
    (SamplingConfig, "top_k", 0, "sampling.top_k = 0: must be >= 1"),
    (SamplingConfig, "temperature", -0.5, ">= 0.0"),
    (SamplingConfig, "banned_token_ids", (3, 2), "sorted and unique"),
    (OpsConfig, "backend", "cuda", "'auto', 'reference', 'pallas_gpu', 'cutedsl_sm100', 'ascend'"),
    (OpsConfig, "overrides", {"rope": "triton"}, "ops.overrides['rope'] = 'triton'"),
]


@pytest.mark.parametrize(
    ("cls", "name", "value", "expected"),
    SECTION_VIOLATIONS,
    ids=[f"{c.__name__}.{n}={v}" for c, n, v, _ in SECTION_VIOLATIONS],
)
def test_section_range_errors_name_field_value_and_limit(cls, name, value, expected):
    with pytest.raises(ValueError) as info:
        cls(**{name: value})
    assert expected in str(info.value)
    assert isinstance(info.value, ConfigValueError) and info.value.field.split("[")[0].endswith(name)


@pytest.mark.parametrize("size", BLOCK_SIZES)
def test_allowed_block_sizes(size):
    assert CacheConfig(block_size=size).block_size == size
    assert 128 % size == 0 and size % 8 == 0


@pytest.mark.parametrize(
    ("cls", "name", "value", "expected"),
    [
        (CacheConfig, "block_size", "64", "cache.block_size: expected int, got str '64'"),
        (CacheConfig, "block_size", 64.0, "expected int, got float"),
        (SchedulerConfig, "chunked_prefill", 1, "scheduler.chunked_prefill: expected bool, got int"),
        (SamplingConfig, "banned_token_ids", [1, "2"], "sampling.banned_token_ids[1]: expected int"),
        (OpsConfig, "overrides", ["rope"], "ops.overrides: expected mapping"),
    ],
)
def test_section_type_errors(cls, name, value, expected):
    with pytest.raises(ConfigTypeError) as info:
        cls(**{name: value})
    assert expected in str(info.value)


def test_sections_are_frozen_hashable_and_normalised():
    ops = OpsConfig(overrides={"rope": "reference"})
    assert isinstance(ops.overrides, FrozenMapping)
    assert hash(ops) == hash(OpsConfig(overrides={"rope": "reference"}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ops.backend = "reference"  # type: ignore[misc]
    with pytest.raises(TypeError):
        ops.overrides["rms_norm"] = "reference"  # type: ignore[index]
    sampling = SamplingConfig(banned_token_ids=[1, 2, 3])
    assert sampling.banned_token_ids == (1, 2, 3)
    assert SamplingConfig(temperature=1).temperature == 1.0 and isinstance(
        SamplingConfig(temperature=1).temperature, float
    )


def test_replace_revalidates_sections():
    cache = CacheConfig()
    assert dataclasses.replace(cache, block_size=64).block_size == 64
    with pytest.raises(ValueError, match=r"cache.block_size = 96"):
        dataclasses.replace(cache, block_size=96)


# ------------------------------------------------------------------------------------- engine config


def test_engine_defaults_match_the_reference_derivation(models):
    # V4.1-Flash shape: dspark_block_size is unknown, so nextn falls back to the reference default 5 and
    # spec/engine.md §2.3's default numbers apply.
    cfg = EngineConfig(model=models["deepseek_v41_flash"])
    assert cfg.num_draft_tokens == 5
    assert cfg.runtime_max_model_len == 4096 + 16
    assert cfg.max_num_decoding_tokens == 1536
    assert cfg.max_num_batched_tokens == 4096
    assert cfg.prompt_limit == 4096
    assert cfg.prefill_max_sum_seqlen_k == 2**30
    assert cfg.backtracking_tokens == 6
    assert cfg.num_state_slots == 769  # int(256 * 3.0) + 1: V4.1 with prefix caching keeps snapshot slots
    assert (
        dataclasses.replace(
            cfg, cache=dataclasses.replace(cfg.cache, enable_prefix_caching=False)
        ).num_state_slots
        == 257
    )
    assert cfg.max_blocks_per_seq == 64  # ceil(4112 / 128) = 33 -> rounded up to 64
    assert cfg.resolved_kv_cache_dtype == "quantized"
    assert dataclasses.replace(cfg, dtype="float32").resolved_kv_cache_dtype == "float32"


def test_draft_length_defaults_per_family(models):
    assert EngineConfig(model=models["tiny_v41"]).num_draft_tokens == 4  # dspark_block_size
    assert EngineConfig(model=models["tiny_v3"]).num_draft_tokens == 1  # one MTP layer
    no_draft = models["tiny_v3"].with_hf_overrides({"num_nextn_predict_layers": 0})
    assert EngineConfig(model=no_draft).num_draft_tokens == 0
    with pytest.raises(ValueError, match=r"speculative.num_draft_tokens = 2: the model has no draft layers"):
        EngineConfig(model=no_draft, speculative=SpeculativeConfig(num_draft_tokens=2))


def test_budget_checks(models):
    model = models["tiny_v41"]
    chunked = EngineConfig(
        model=model, scheduler=SchedulerConfig(max_num_batched_tokens=2048, chunked_prefill=True)
    )
    assert chunked.prompt_limit == 4096 and chunked.max_num_batched_tokens == 2048
    with pytest.raises(
        ValueError, match=r"prefill_max_sum_seqlen_k = 1000: must be >= the prompt limit 4096"
    ):
        EngineConfig(model=model, scheduler=SchedulerConfig(prefill_max_sum_seqlen_k=1000))
    with pytest.raises(ValueError, match=r"banned_token_ids\[0\] = 600: must be < 512"):
        EngineConfig(model=model, sampling=SamplingConfig(banned_token_ids=(600,)))
    with pytest.raises(ValueError, match=r"confidence_temperature has 2 values but num_draft_tokens = 4"):
        EngineConfig(model=model, speculative=SpeculativeConfig(confidence_temperature=(1.0, 2.0)))
    with pytest.raises(ValueError, match=r"max_model_len = 0: must be >= 1"):
        EngineConfig(model=model, max_model_len=0)
    with pytest.raises(ValueError, match=r"dtype = 'float16': must be one of 'auto', 'float32', 'bfloat16'"):
        EngineConfig(model=model, dtype="float16")
    with pytest.raises(ValueError, match=r"load_format = 'pt'"):
        EngineConfig(model=model, load_format="pt")


def test_yoco_truncation_checks(models):
    model = models["tiny_v41"]
    # K defaults to 140; B is the DSpark block (4) when drafting, else the backtracking tokens.
    assert (
        EngineConfig(
            model=model, scheduler=SchedulerConfig(yoco_truncation="mask")
        ).scheduler.yoco_keep_tokens
        == 140
    )
    with pytest.raises(
        ValueError, match=r"yoco_keep_tokens = 19: .* >= sliding_window \+ dspark_block_size = 16 \+ 4 = 20"
    ):
        EngineConfig(model=model, scheduler=SchedulerConfig(yoco_truncation="mask", yoco_keep_tokens=19))
    with pytest.raises(
        ValueError, match=r"yoco_keep_tokens = 16: .* >= sliding_window \+ backtracking tokens = 16 \+ 1"
    ):
        EngineConfig(
            model=model,
            scheduler=SchedulerConfig(yoco_truncation="mask", yoco_keep_tokens=16),
            speculative=SpeculativeConfig(num_draft_tokens=0),
        )
    ok = EngineConfig(model=model, scheduler=SchedulerConfig(yoco_truncation="mask", yoco_keep_tokens=20))
    assert ok.scheduler.yoco_truncation == "mask"
    # tiny_v41's draft targets 4, 5, 6 all lie in the consumer half, so compact mode is allowed ...
    EngineConfig(model=model, scheduler=SchedulerConfig(yoco_truncation="compact", yoco_keep_tokens=21))
    # ... but not when they straddle n_prefill_layer = 3.
    straddling = model.with_hf_overrides({"dspark_target_layer_ids": [2, 4, 5]})
    with pytest.raises(ValueError, match=r"must all lie on one side of n_prefill_layer = 3"):
        EngineConfig(
            model=straddling, scheduler=SchedulerConfig(yoco_truncation="compact", yoco_keep_tokens=21)
        )
    with pytest.raises(ValueError, match=r"YOCO exists only in deepseek_v41 models, not deepseek_v3"):
        EngineConfig(
            model=models["tiny_v3"], scheduler=SchedulerConfig(yoco_truncation="mask", yoco_keep_tokens=99)
        )


def test_engine_config_is_frozen_hashable_and_serialisable(models):
    cfg = EngineConfig(model=models["tiny_v41"], ops=OpsConfig(overrides={"rope": "reference"}))
    assert hash(cfg) == hash(
        EngineConfig(model=models["tiny_v41"], ops=OpsConfig(overrides={"rope": "reference"}))
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dtype = "float32"  # type: ignore[misc]
    data = config_to_dict(cfg)
    text = json.dumps(data)  # plain JSON types only
    assert json.loads(text) == data
    assert data["cache"]["block_size"] == 128 and data["ops"]["overrides"] == {"rope": "reference"}
    assert data["model"]["family"] == "deepseek_v41"
    assert (
        data["model"]["derived"]["n_prefill_layer"] == 3 and data["model"]["derived"]["nope_head_dim"] == 64
    )
    assert data["model"]["hf"]["text_config"]["compress_ratios"] == [0, 2, 2, 1, 1, 1, 1, 0, 0]
    assert data["derived"]["runtime_max_model_len"] == 4096 + 4 + 5 + 4


def test_sections_must_be_config_objects(models):
    with pytest.raises(TypeError, match=r"cache: expected CacheConfig, got dict"):
        EngineConfig(model=models["tiny_v41"], cache={"block_size": 64})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"model: expected ModelConfig or null, got dict"):
        EngineConfig(model={"model_type": "deepseek_v41"})  # type: ignore[arg-type]


@settings(max_examples=40, deadline=None)
@given(
    max_model_len=st.integers(1, 1 << 20),
    max_num_seqs=st.integers(1, 512),
    nextn=st.integers(0, 8),
    async_scheduling=st.booleans(),
    block_size=st.sampled_from(BLOCK_SIZES),
)
def test_derived_quantities_follow_their_formulas(
    models, max_model_len, max_num_seqs, nextn, async_scheduling, block_size
):
    cfg = EngineConfig(
        model=models["tiny_v41"],
        max_model_len=max_model_len,
        cache=CacheConfig(block_size=block_size),
        speculative=SpeculativeConfig(num_draft_tokens=nextn),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs, chunked_prefill=True, async_scheduling=async_scheduling
        ),
    )
    assert cfg.runtime_max_model_len == max_model_len + 2 * nextn + (nextn + 1 if async_scheduling else 0)
    assert cfg.max_num_batched_tokens == max(max_model_len, 4096, max_num_seqs * (1 + nextn))
    assert cfg.max_num_batched_tokens >= cfg.max_num_decoding_tokens
    assert cfg.prompt_limit == max_model_len
    blocks = cfg.max_blocks_per_seq
    assert blocks % 64 == 0 and blocks * block_size >= cfg.runtime_max_model_len
    assert (blocks - 64) * block_size < cfg.runtime_max_model_len  # the smallest such multiple of 64
    assert cfg.backtracking_tokens == nextn + 1
    # state_slots_ratio unset: 3.0 with V4.1's snapshots (prefix caching is on by default), else 1.0
    ratio = 3.0 if cfg.cache.enable_prefix_caching else 1.0
    assert cfg.num_state_slots - 1 == int(max_num_seqs * ratio)
