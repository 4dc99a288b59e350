"""Settings through ``LLM``: each honoured setting changes what the engine does, the others warn or are refused.

docs/config.md lists every setting with its status (tests/config/test_config_status.py keeps the list complete);
this file shows the behaviour through the engine itself, on tiny-v3 with one small bucket.
"""

from __future__ import annotations

import gc
import logging
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from deepinfer_jax.config import ConfigValueError, ConfigWarning
from deepinfer_jax.engine import llm as llm_module
from deepinfer_jax.engine.llm import LLM, default_cache_memory
from deepinfer_jax.engine.params import SamplingParams
from deepinfer_jax.engine.plan import PENDING_TOKEN
from deepinfer_jax.models import builtin

SMALL = {"dtype": "float32", "max_num_seqs": 4, "max_num_batched_tokens": 16, "kv_cache_memory": "4MiB"}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]


def _tokens(llm: LLM, params=GREEDY) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return _tokens(LLM("tiny-v3", **SMALL))


def test_refused_settings_stop_before_any_weight_is_read(monkeypatch):
    monkeypatch.setenv("DEEPINFER_FORCE_IMBALANCE_RATIO", "2")

    def no_load(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(llm_module, "load_model", no_load)
    with pytest.raises(
        ConfigValueError, match=r"moe_force_imbalance_ratio = 2.0 \(set by environment variable"
    ):
        LLM("tiny-v3", **SMALL)
    monkeypatch.delenv("DEEPINFER_FORCE_IMBALANCE_RATIO")
    with pytest.raises(ConfigValueError, match=r"revision = 'v1' .*local folders only"):
        LLM("tiny-v3", revision="v1", **SMALL)


def test_variables_are_logged_and_those_without_effect_warn(monkeypatch, caplog, reference):
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "200")
    monkeypatch.setenv("DEEPINFER_ENFORCE_EAGER", "1")
    with caplog.at_level(logging.INFO), pytest.warns(ConfigWarning) as record:
        llm = LLM("tiny-v3", **SMALL)
    messages = [str(w.message) for w in record]
    assert any(
        "yoco_keep_tokens = 200 (set by environment variable DEEPINFER_YOCO_PREFILL_KEEP_TOKENS)" in m
        for m in messages
    )
    assert any("DEEPINFER_ENFORCE_EAGER" in m for m in messages)
    assert (
        "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS = '200': sets scheduler.yoco_keep_tokens (honoured)"
        in caplog.text
    )
    assert "DEEPINFER_ENFORCE_EAGER = '1': no effect" in caplog.text
    assert _tokens(llm) == reference  # warned settings change nothing


def test_a_variable_sets_an_argument_left_at_none_and_an_argument_wins(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    assert LLM("tiny-v3", **SMALL).batch_invariant is True
    assert LLM("tiny-v3", batch_invariant=False, **SMALL).batch_invariant is False


def test_sampling_defaults_apply_to_requests_without_params():
    llm = LLM("tiny-v3", **SMALL, **{"sampling.max_tokens": 3, "sampling.temperature": 0.0})
    outs = llm.generate(prompt_token_ids=PROMPTS, use_tqdm=False)
    want = _tokens(llm, SamplingParams(temperature=0.0, max_tokens=3))
    assert [o.outputs[0].token_ids for o in outs] == want and all(len(t) == 3 for t in want)
    assert llm.default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=3)


def test_synchronous_scheduling_gives_the_same_tokens_without_pending_inputs(reference):
    llm = LLM("tiny-v3", **SMALL, **{"scheduler.async_scheduling": False})
    pending = []
    schedule = llm.scheduler.schedule

    def recording():
        plan = schedule()
        if plan is not None:
            pending.append(int((plan.inputs.token_ids == PENDING_TOKEN).sum()))
        return plan

    llm.scheduler.schedule = recording
    assert _tokens(llm) == reference
    assert pending and sum(pending) == 0  # every input token was known on the host
    asynchronous = LLM("tiny-v3", **SMALL)
    pending.clear()
    schedule = asynchronous.scheduler.schedule
    asynchronous.scheduler.schedule = recording
    assert _tokens(asynchronous) == reference and sum(pending) > 0


def test_statistics_lines_every_n_steps(caplog):
    llm = LLM("tiny-v3", **SMALL, **{"stats_log_interval_steps": 2})
    with caplog.at_level(logging.INFO):
        _tokens(llm)
    steps = llm.last_stats.steps
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine: ")]
    assert len(lines) == steps // 2 and lines[0].startswith("engine: 2 steps,")
    quiet = LLM("tiny-v3", **SMALL, **{"stats_log_interval_steps": 2, "disable_log_stats": True})
    caplog.clear()
    with caplog.at_level(logging.INFO):
        _tokens(quiet)
    assert not [r for r in caplog.records if r.getMessage().startswith("engine: ")]


def test_manual_garbage_collection():
    llm = LLM("tiny-v3", **SMALL, **{"gc_interval_steps": 2})
    collections = []

    def count(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    seen = []
    llm.scheduler.add_request("gc", [5, 6, 7], GREEDY, seed=0)
    gc.callbacks.append(count)
    try:
        _, stats = llm.runner.run(poll=lambda: seen.append(gc.isenabled()) or False)
    finally:
        gc.callbacks.remove(count)
    assert seen and not any(seen)  # automatic collection is off while the engine runs
    assert gc.isenabled()  # and restored afterwards
    assert stats.steps >= 2 and collections.count(2) >= stats.steps // 2  # full collections every 2 steps


def test_the_transfer_guard_catches_an_implicit_transfer_in_the_loop():
    x = jnp.ones(3)

    def sneaky() -> bool:
        np.asarray(x + 1)  # an implicit device-to-host copy
        return False

    guarded = LLM("tiny-v3", **SMALL)
    guarded.scheduler.add_request("t", [5, 6], GREEDY, seed=0)
    with pytest.raises(Exception, match=r"[Dd]isallowed"):
        guarded.runner.run(poll=sneaky)
    relaxed = LLM("tiny-v3", **SMALL, **{"transfer_guard": False})
    relaxed.scheduler.add_request("t", [5, 6], GREEDY, seed=0)
    outputs, _ = relaxed.runner.run(poll=sneaky)
    assert len(outputs) == 1


def test_profile_dir_and_kernel_cache_dir(tmp_path, reference):
    profile, cache = tmp_path / "profile", tmp_path / "jit"
    before = jax.config.jax_compilation_cache_dir
    min_time = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # whatever the step's compile time
    try:
        # Blocks of 8 tokens: a program no other test compiled in this process (a program compiled before is
        # served from memory and never reaches the new directory).
        overrides = {"profile_dir": str(profile), "ops.kernel_cache_dir": str(cache), "cache.block_size": 8}
        llm = LLM("tiny-v3", **SMALL, **overrides)
        assert jax.config.jax_compilation_cache_dir == str(cache)
        assert _tokens(llm) == reference
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)
        compilation_cache.reset_cache()
    assert list(profile.rglob("*.xplane.pb")), "a profiler trace of the generate call"
    assert any(cache.iterdir()), "the step's compiled program in the persistent cache"


def test_dummy_weights_need_no_checkpoint(tmp_path):
    folder = tmp_path / "shapes-only"
    source = builtin.materialize("tiny-v3")
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    with pytest.raises(Exception, match="safetensors"):
        LLM(str(folder), **SMALL)
    a = LLM(str(folder), **SMALL, **{"load_format": "dummy"})
    assert a.model.path is None
    assert _tokens(a) == _tokens(LLM(str(folder), **SMALL, **{"load_format": "dummy"}))  # seeded


def test_tokenizer_from_the_config(tmp_path):
    folder = tmp_path / "no-tokenizer"
    shutil.copytree(builtin.materialize("tiny-v3"), folder)
    (folder / "tokenizer.json").unlink()
    assert LLM(str(folder), **SMALL).tokenizer is None
    llm = LLM(str(folder), **SMALL, **{"tokenizer": str(builtin.materialize("tiny-v3"))})
    assert llm.tokenizer is not None and llm.generate(["hello"], GREEDY, use_tqdm=False)[0].outputs[0].text


def test_default_cache_is_sized_from_the_model_on_the_cpu():
    """No ``kv_cache_memory``: what max_num_seqs sequences of max_model_len tokens need, not a flat 2 GiB."""
    llm = LLM("tiny-v3", dtype="float32", max_num_seqs=2, max_num_batched_tokens=16, max_model_len=100)
    layout = llm.paged_model.layout()
    blocks = 2 * -(-100 // layout.block_size) + 1
    want = blocks * layout.bytes_per_block + 3 * layout.bytes_per_slot + 3 * 4 * (1 + 512)
    assert llm.memory_plan.budget_bytes == want < 2 << 20
    with pytest.warns(ConfigWarning, match="memory_utilization = 0.5 .*on the CPU"):
        LLM("tiny-v3", **SMALL, **{"cache.memory_utilization": 0.5})


def test_accelerator_default_uses_memory_utilization():
    class Layout:
        block_size, bytes_per_block, bytes_per_slot = 16, 100, 10

    common = {"params": {}, "max_num_seqs": 4, "num_slots": 5, "reserved_bytes": 0, "tokens_per_seq": 64}
    stats = {"bytes_limit": 1000, "bytes_in_use": 100}
    got = default_cache_memory(Layout, num_devices=2, memory_utilization=0.5, memory_stats=stats, **common)
    assert got == (500 - 100) * 2
    cpu = default_cache_memory(Layout, num_devices=1, memory_utilization=0.5, memory_stats=None, **common)
    assert cpu == (4 * 4 + 1) * 100 + 5 * 10
    # On the CPU the need is capped at 2 GiB per device, however long the sequences.
    long = {**common, "tokens_per_seq": 1 << 40}
    got = default_cache_memory(Layout, num_devices=2, memory_utilization=0.5, memory_stats=None, **long)
    assert got == 2 * (2 << 30)


def test_settings_without_warnings_by_default():
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        LLM("tiny-v3", **SMALL)
