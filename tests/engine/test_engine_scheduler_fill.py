"""Steps fill their bucket: prefill chunks are cut to a smaller bucket instead of padding a large one.

The plans below are worked out by hand; the engine test at the end checks that cutting steps this way leaves
greedy tokens of the real model unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest
from one_device import OneDevice, Step  # tests/engine/one_device.py

from deepinfer_jax.engine.llm import LLM
from deepinfer_jax.engine.params import SamplingParams

PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)


def make(**overrides) -> OneDevice:
    kwargs = {
        "num_blocks": 64,
        "block_size": 4,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 16,
        "max_model_len": 64,
        "vocab_size": 300,
        "buckets": [(4, 4), (16, 4)],
    }
    kwargs.update(overrides)
    return OneDevice(**kwargs)


def step(sched: OneDevice, token: int = 7) -> Step:
    plan = sched.schedule()
    assert plan is not None
    plan.validate(block_size=sched.block_size)
    sched.process_outputs(plan, np.full(plan.padded_seqs, token, np.int32))
    return plan


def rows(plan: Step) -> list[tuple[str, list[int], bool]]:
    """(request, positions, sample) of each real row."""
    return [
        (rid, plan.positions[plan.query_start[i] : plan.query_start[i + 1]].tolist(), bool(plan.sample[i]))
        for i, rid in enumerate(plan.request_ids)
    ]


def test_a_mostly_empty_bucket_is_replaced_by_a_full_smaller_one() -> None:
    sched = make()
    sched.add_request("a", [10, 11, 12], PARAMS, seed=0)
    sched.add_request("b", [20, 21, 22], PARAMS, seed=0)
    # 6 tokens fill 6/16 of the 16 bucket: cut to the 4 bucket, b keeps one prefill token and samples nothing.
    plan = step(sched)
    assert plan.bucket == (4, 4) and plan.num_tokens == 4
    assert rows(plan) == [("a", [0, 1, 2], True), ("b", [0], False)]
    assert plan.token_ids.tolist() == [10, 11, 12, 20]
    # a's decode and the rest of b's prompt: 3 tokens fill 3/4 of the 4 bucket.
    plan = step(sched)
    assert rows(plan) == [("a", [3], True), ("b", [1, 2], True)] and plan.bucket == (4, 4)
    assert sched.stats.num_padding_tokens == 1


def test_well_filled_buckets_and_a_zero_threshold_are_left_alone() -> None:
    sched = make()
    sched.add_request("a", list(range(10, 19)), PARAMS, seed=0)
    plan = step(sched)  # 9 of 16 tokens: more than half
    assert plan.bucket == (16, 4) and rows(plan) == [("a", list(range(9)), True)]
    sched = make(min_bucket_fill=0.0)
    sched.add_request("a", [10, 11, 12], PARAMS, seed=0)
    sched.add_request("b", [20, 21, 22], PARAMS, seed=0)
    plan = step(sched)
    assert plan.bucket == (16, 4) and plan.num_tokens == 6


def test_dropped_rows_keep_their_admission_and_decodes_are_never_cut() -> None:
    sched = make(min_bucket_fill=1.0)
    for name in "abc":
        sched.add_request(name, [10, 11, 12], PARAMS, seed=0)
    plan = step(sched)
    # 9 tokens: a whole, one token of b; c's row is dropped, but c stays admitted with its blocks and slot.
    assert rows(plan) == [("a", [0, 1, 2], True), ("b", [0], False)]
    c = sched.get_request("c")
    assert sched.num_running == 3 and c.num_computed == 0 and c.slot > 0 and len(c.block_ids) == 1
    # a's decode is kept whole; the prefill of b and then c fills the rest.
    plan = step(sched)
    assert rows(plan) == [("a", [3], True), ("b", [1, 2], True), ("c", [0], False)]
    plan = step(sched)
    # Decodes of a and b, and c's last 2 prompt tokens: exactly the 4 bucket.
    assert rows(plan) == [("a", [4], True), ("b", [3], True), ("c", [1, 2], True)]


def test_decodes_are_never_cut_and_a_prefill_always_progresses() -> None:
    sched = make(buckets=[(2, 2), (16, 4)], min_bucket_fill=1.0)
    for name in "abc":
        sched.add_request(name, [10], SamplingParams(max_tokens=4, ignore_eos=True), seed=0)
    plan = step(sched)  # three 1-token prompts: the 2 bucket is filled, c waits
    assert rows(plan) == [("a", [0], True), ("b", [0], True)]
    # Two decodes and c's prompt: cutting to the 2 bucket would keep no prefill token, so c would wait for as
    # long as a and b decode. The step is padded instead.
    plan = step(sched)
    assert rows(plan) == [("a", [1], True), ("b", [1], True), ("c", [0], True)] and plan.bucket == (16, 4)
    plan = step(sched)  # three decodes
    assert rows(plan) == [("a", [2], True), ("b", [2], True), ("c", [1], True)] and plan.bucket == (16, 4)


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan")])
def test_min_bucket_fill_is_validated(value: float) -> None:
    with pytest.raises(ValueError, match="min_bucket_fill"):
        make(min_bucket_fill=value)
    with pytest.raises(TypeError, match="min_bucket_fill"):
        make(min_bucket_fill="0.5")


def test_greedy_tokens_are_unchanged_when_steps_are_cut_to_fill_their_bucket() -> None:
    """One engine, the same requests with and without cutting: 3 prompts of 9 tokens fill 27/64 of the 64
    bucket, so with a threshold of one half the prefill runs as a full 16-token step and an 11-token one."""
    llm = LLM(
        "tiny-v3",
        dtype="float32",
        max_num_seqs=8,
        max_num_batched_tokens=64,
        kv_cache_memory="8MiB",
        **{"cache.block_size": 16},
    )
    rng = np.random.default_rng(5)
    prompts = [rng.integers(2, 512, 9).tolist() for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    tokens = {}
    for fill in (0.0, 0.5):
        for device in llm.scheduler.devices:
            device.min_bucket_fill = fill
        steps = llm.scheduler.stats.num_steps
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        tokens[fill] = [o.outputs[0].token_ids for o in outs]
        # Uncut: one prefill step and 4 decode steps. Cut: 16 + 11 prefill tokens, then the decodes.
        assert llm.scheduler.stats.num_steps - steps == (5 if fill == 0.0 else 6)
    # Both runs do the same arithmetic per token; only step shapes differ (float32 reductions may be ordered
    # differently), and greedy argmax on random tiny weights is far from near-ties at this length.
    assert tokens[0.0] == tokens[0.5]
    assert all(len(t) == 5 for t in tokens[0.0])
