"""DEEPINFER_* environment variables: parsing rules of spec/engine.md §14, mapping, warnings."""

from __future__ import annotations

import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_jax.config import ENV_VARS, PROJECT_ENV_VARS, ConfigValueError, ConfigWarning, read_env
from deepinfer_jax.config.env import ADDED_ENV_VARS, parse_bool, parse_token_ranges
from deepinfer_jax.config.loaders import _Settings


def _spec_names() -> set[str]:
    # The table of spec/engine.md §14 as it was when the mapping was written (kept here, not read from the spec
    # folder, so the test runs in a checkout without it).
    names = """
    ACCELERATOR COMPUTE_SUM_SMALLER_PROBS JIT_CACHE_DIR NCCL_NUM_SMS USERBUFFER_COMM_SMS GLOO_TIMEOUT
    REARRANGE_P2P_GROUPS OVERRIDE_NUM_EXTRA_EXPERTS EXPERT_COUNT_WINDOW_SIZE EXPERT_REARRANGEMENT_STEP_INTERVAL
    REARRANGE_AFTER_PREFILL_IN_NORMAL_ENGINE MOE_LB_STAT_INTERVAL FORCE_IMBALANCE_RATIO FORCE_LOAD_BALANCE
    SHOW_EPLB_DETAIL PREFILL_MAX_SUM_SEQLEN_K INDEX_ATTN_MEMORY_LIMIT USE_NEXTN_DECODE ENABLE_MTP_VARLEN
    MAX_BACKTRACKING_TOKENS DFLASH_CONFIDENCE_HEAD_TEMPERATURE ENGRAM_PAD_TOKEN ENGRAM_FORCE_GPU_STORAGE
    SAMPLER_FORCE_TOPK DECODE_TOKEN_BLACKLIST ENFORCE_EAGER CUDAGRAPH_BATCH_SIZE_INTERVAL DFLASH_ENFORCE_EAGER
    DFLASH_CUDAGRAPH_BATCH_SIZE_INTERVAL DECODE_PERF_CACHE_DIR DECODE_PERF_CACHE_TTL_SEC NUM_STATE_SLOTS_RATIO
    PREFILL_STORE_EXTRA_STATE PREFILL_STORE_EXTRA_SIZE XGRAMMAR_DEBUG XGRAMMAR_TIMEOUT XGRAMMAR_DISABLE_CACHE
    XGRAMMAR_CACHE_LIMIT_BYTES SO_BUILDER_CPUS PREFILL_ATTEMPT_INTERVAL PREFILL_ANY_ATTEMPT_INTERVAL
    ZERO_OVERHEAD_SCHEDULING LOGGING_INTERVAL_STEP NCCL_MEMORY_SAMPLE_INTERVAL_STEPS RINGBUFFER_WARNING_INTERVAL
    GC_INTERVAL_STEP YOCO_PREFILL_TRUNCATION_MODE YOCO_PREFILL_KEEP_TOKENS BATCH_INVARIANT DISABLE_SYNC_GUARD
    PROFILE_TORCH_CUDA_MEMORY ENABLE_MEMORY_TRACING PROFILE_HTTP_ENABLE PROFILE_HTTP_PORT_BASE TORCH_PROFILER_DIR
    USE_MULTIMODAL_POOL MULTIMODAL_POOL_SIZE_GB MULTI_MODAL_BUFFER_SIZE MULTI_MODAL_WORKER_TIMEOUT CPP_LOG_LEVEL
    HF_MODEL_DIR FUSED_SAMPLE_STRESS_TEST FUSED_SAMPLE_DETAIL_LOG
    """
    return {"DEEPINFER_" + n for n in names.split()}


def test_every_variable_of_the_spec_is_recognised():
    assert set(ENV_VARS) - set(ADDED_ENV_VARS) == _spec_names()
    assert set(ADDED_ENV_VARS) <= set(ENV_VARS) and not set(ADDED_ENV_VARS) & _spec_names()


@pytest.mark.parametrize("name", sorted(v.name for v in ENV_VARS.values() if v.target is not None))
def test_every_target_is_a_real_tree_field(name):
    # The loader's name check raises for unknown sections/fields; model keys are not env targets.
    is_model, _ = _Settings().target(ENV_VARS[name].target, name)
    assert not is_model


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1", True),
        ("true", True),
        ("yes", True),
        ("anything", True),
        ("TRUE", True),
        ("False ", True),
        ("0", False),
        ("", False),
        ("false", False),
        ("False", False),
    ],
)
def test_boolean_rule(raw, expected):
    assert parse_bool(raw) is expected
    out = read_env({"DEEPINFER_BATCH_INVARIANT": raw})
    assert out["ops.batch_invariant"] == (expected, "environment variable DEEPINFER_BATCH_INVARIANT")


def test_values_map_into_the_tree_with_their_source():
    out = read_env(
        {
            "DEEPINFER_USE_NEXTN_DECODE": "3",
            "DEEPINFER_NUM_STATE_SLOTS_RATIO": "1.5",
            "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "mask",
            "DEEPINFER_DECODE_TOKEN_BLACKLIST": "0..3,7,10..12",
            "DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE": "1.0, 0.5,2",
            "DEEPINFER_XGRAMMAR_DISABLE_CACHE": "1",
            "DEEPINFER_DISABLE_SYNC_GUARD": "0",
            "DEEPINFER_LOGGING_INTERVAL_STEP": "-1",
            "PATH": "/usr/bin",  # not ours: ignored silently
        }
    )
    values = {k: v for k, (v, _) in out.items()}
    assert values == {
        "speculative.num_draft_tokens": 3,
        "cache.state_slots_ratio": 1.5,
        "scheduler.yoco_truncation": "mask",
        "sampling.banned_token_ids": (0, 1, 2, 3, 7, 10, 11, 12),
        "speculative.confidence_temperature": (1.0, 0.5, 2.0),
        "sampling.grammar_cache": False,  # DISABLE_CACHE=1 inverted
        "transfer_guard": True,  # DISABLE_SYNC_GUARD=0 inverted
        "stats_log_interval_steps": -1,
    }
    assert out["cache.state_slots_ratio"][1] == "environment variable DEEPINFER_NUM_STATE_SLOTS_RATIO"


def test_engram_storage_flag_false_means_platform_default():
    assert read_env({"DEEPINFER_ENGRAM_FORCE_GPU_STORAGE": "1"})["parallel.engram_on_device"][0] is True
    assert "parallel.engram_on_device" not in read_env({"DEEPINFER_ENGRAM_FORCE_GPU_STORAGE": "0"})


@pytest.mark.parametrize(
    ("name", "raw", "expected"),
    [
        ("DEEPINFER_USE_NEXTN_DECODE", "five", "DEEPINFER_USE_NEXTN_DECODE = 'five': expected an integer"),
        ("DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL", "8.0", "DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL = '8.0'"),
        ("DEEPINFER_NUM_STATE_SLOTS_RATIO", "x", "DEEPINFER_NUM_STATE_SLOTS_RATIO = 'x': expected a number"),
        ("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "on", "expected one of 'off', 'mask', 'compact'"),
        ("DEEPINFER_DECODE_TOKEN_BLACKLIST", "5..3", "DEEPINFER_DECODE_TOKEN_BLACKLIST"),
        ("DEEPINFER_DECODE_TOKEN_BLACKLIST", "3,3", "strictly increasing"),
        ("DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE", "1,,2", "comma-separated list of numbers"),
    ],
)
def test_bad_values_name_the_variable(name, raw, expected):
    with pytest.raises(ConfigValueError) as info:
        read_env({name: raw})
    assert expected in str(info.value)


def test_unknown_variable_warns_with_a_suggestion():
    with pytest.warns(
        ConfigWarning,
        match=r"DEEPINFER_USE_NEXTN_DECOD is not a deepinfer_jax setting.*"
        "did you mean DEEPINFER_USE_NEXTN_DECODE",
    ):
        out = read_env({"DEEPINFER_USE_NEXTN_DECOD": "3"})
    assert out == {}


def test_no_effect_variable_warns_why():
    with pytest.warns(ConfigWarning, match=r"DEEPINFER_ENFORCE_EAGER .* has no effect in deepinfer_jax: XLA"):
        assert read_env({"DEEPINFER_ENFORCE_EAGER": "1"}) == {}


def test_project_variables_are_silent():
    assert set(PROJECT_ENV_VARS) == {"DEEPINFER_JAX_CACHE", "DEEPINFER_API_KEY"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_env({"DEEPINFER_JAX_CACHE": "/somewhere", "DEEPINFER_API_KEY": "secret"}) == {}


def test_unbounded_grammar_cache_warns():
    with pytest.warns(ConfigWarning, match=r"unbounded"):
        out = read_env({"DEEPINFER_XGRAMMAR_CACHE_LIMIT_BYTES": "0"})
    assert out["sampling.grammar_cache_limit_bytes"][0] == 0


def test_default_environment_is_os_environ(monkeypatch):
    monkeypatch.setenv("DEEPINFER_SAMPLER_FORCE_TOPK", "20")
    assert read_env()["sampling.force_top_k"][0] == 20
    assert "sampling.force_top_k" not in read_env({})


def _format_ranges(ids: list[int]) -> str:
    parts, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}..{ids[j]}")
        i = j + 1
    return ",".join(parts)


@settings(max_examples=60, deadline=None)
@given(st.sets(st.integers(0, 300), max_size=40))
def test_token_ranges_round_trip(ids):
    ordered = sorted(ids)
    assert parse_token_ranges(_format_ranges(ordered)) == tuple(ordered)


def test_docs_name_every_variable_and_its_field():
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    for var in ENV_VARS.values():
        assert f"`{var.name}`" in docs
        if var.target is not None:  # the settings table's row of the field names the variable
            row = next(line for line in docs.splitlines() if line.startswith(f"| `{var.target}` |"))
            assert f"`{var.name}`" in row, var.name


def test_each_warning_is_given_once_under_the_default_filter():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):  # one call site, as in load_config: Python's registry shows each message once
            read_env({"DEEPINFER_ENFORCE_EAGER": "1", "DEEPINFER_NO_SUCH_THING": "1"})
    messages = sorted(str(w.message).split(" ")[2] for w in caught if issubclass(w.category, ConfigWarning))
    assert messages == ["DEEPINFER_ENFORCE_EAGER", "DEEPINFER_NO_SUCH_THING"]
