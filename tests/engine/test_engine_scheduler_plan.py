"""StepPlan: build_plan over devices, the content validator, bucket choice; streaming outputs and metrics."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys

import numpy as np
import pytest

from deepinfer_jax.engine.params import SamplingParams
from deepinfer_jax.engine.plan import PlanView, choose_bucket
from deepinfer_jax.engine.scheduler import Scheduler


def hand_plan(**changes) -> PlanView:
    """One device's part: two real rows (a 3-token prefill chunk and a pending decode) padded to T=6, S=3."""
    fields = {
        "token_ids": np.array([5, 6, 7, -1, 0, 0], np.int32),
        "positions": np.array([0, 1, 2, 9, 0, 0], np.int32),
        "token_seq": np.array([0, 0, 0, 1, 3, 3], np.int32),
        "seq_slots": np.array([2, 1, -1], np.int32),
        "query_start": np.array([0, 3, 4, 4], np.int32),
        "context_lens": np.array([3, 10, 0], np.int32),
        "block_tables": np.array([[3, -1, -1], [1, 2, 4], [-1, -1, -1]], np.int32),
        "sample": np.array([False, True, False]),
        "prompt_lens": np.array([3, 5, 0], np.int32),
        "prompt_targets": None,
        "num_tokens": 4,
        "num_seqs": 2,
        "request_ids": ("a", "b"),
    }
    fields.update(changes)
    return PlanView(**fields)


def test_a_hand_built_plan_is_valid() -> None:
    plan = hand_plan()
    plan.validate(block_size=4)
    assert plan.bucket == (6, 3)


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"token_seq": np.array([0, 0, 0, 1, 2, 3], np.int32)}, "token_seq does not match"),
        ({"positions": np.array([0, 2, 3, 9, 0, 0], np.int32)}, "not consecutive"),
        ({"context_lens": np.array([4, 10, 0], np.int32)}, "context_lens - 1 = 3"),
        ({"token_ids": np.array([5, -1, 7, -1, 0, 0], np.int32)}, "only a row's first token may be pending"),
        ({"seq_slots": np.array([1, 1, -1], np.int32)}, "repeats a slot"),
        ({"seq_slots": np.array([2, 1, 0], np.int32)}, "padding rows must have seq_slots -1"),
        (
            {"block_tables": np.array([[3, -1, -1], [1, 2, -1], [-1] * 3], np.int32)},
            "does not cover 10 tokens",
        ),
        ({"sample": np.array([False, True, True])}, "sample nothing"),
        ({"prompt_lens": np.array([3, 5, 2], np.int32)}, "prompt_lens 0"),
        ({"query_start": np.array([0, 3, 4, 5], np.int32)}, "prefix sum"),
    ],
)
def test_validate_finds_each_broken_invariant(changes: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        hand_plan(**changes).validate(block_size=4)
    assert fragment in str(info.value)


def test_choose_bucket_takes_the_fewest_tokens_then_sequences() -> None:
    buckets = [(16, 8), (64, 8), (16, 32), (256, 128)]
    assert choose_bucket(1, 1, buckets) == (16, 8)
    assert choose_bucket(16, 9, buckets) == (16, 32)
    assert choose_bucket(17, 2, buckets) == (64, 8)
    assert choose_bucket(17, 9, buckets) == (256, 128)
    with pytest.raises(ValueError, match="no bucket holds 300 tokens and 1 sequences"):
        choose_bucket(300, 1, buckets)


def test_streaming_snapshots_and_metrics() -> None:
    ticks = itertools.count()
    sched = Scheduler(
        num_blocks=8,
        block_size=4,
        max_num_seqs=2,
        max_num_batched_tokens=8,
        max_model_len=16,
        vocab_size=50,
        stream=True,
        clock=lambda: float(next(ticks)),
    )
    sched.add_request("a", [3, 4], SamplingParams(max_tokens=2), seed=5)
    assert sched.get_request("a").metrics.arrival_time == 0.0
    plan = sched.schedule()
    assert plan is not None
    (first,) = sched.process_outputs(plan, np.array([[9, 0]], np.int32))
    assert not first.finished and first.outputs[0].token_ids == [9] and first.outputs[0].finish_reason is None
    plan = sched.schedule()
    assert plan is not None
    (last,) = sched.process_outputs(plan, np.array([[8, 0]], np.int32))
    assert last.finished and last.outputs[0].token_ids == [9, 8]
    assert first.outputs[0].token_ids == [9], "a snapshot must not change after it was returned"
    m = last.metrics
    assert (m.arrival_time, m.first_scheduled_time, m.first_token_time) == (0.0, 1.0, 2.0)
    assert m.finish_time is not None and m.finish_time > m.first_token_time
    assert (m.num_prompt_tokens, m.num_generated_tokens, m.num_preemptions) == (2, 2, 0)
    assert last.prompt_token_ids == [3, 4] and last.prompt is None
    assert dataclasses.asdict(sched.stats)["num_steps"] == 2


def test_the_host_side_never_imports_jax() -> None:
    """The scheduling loop is numpy only (ARCHITECTURE §4): importing it must not pull in jax."""
    code = (
        "import sys\n"
        "import deepinfer_jax.engine.scheduler, deepinfer_jax.engine.plan, deepinfer_jax.cache.blocks\n"
        "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith('jax'))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_one_plan_for_every_device_with_placeholders() -> None:
    """build_plan: three devices, two with work and one placeholder. The step's bucket holds the largest device;
    every array (sampling tensors and prompt-logprob targets included) carries the leading device axis; each
    device's rows sit in its own slice and the idle device is all padding."""
    sched = Scheduler(
        num_devices=3,
        num_blocks=16,
        block_size=4,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        max_model_len=32,
        vocab_size=50,
        buckets=[(4, 2), (16, 2)],
    )
    hot = SamplingParams(temperature=0.7, top_k=3, max_tokens=2, prompt_logprobs=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=2, logprobs=5)
    assert sched.add_request("a", list(range(1, 10)), hot, seed=11) == 0
    assert sched.add_request("b", [7, 8], greedy, seed=12) == 1
    plan = sched.schedule()
    assert plan is not None and plan.num_devices == 3 and plan.num_placeholders == 1
    plan.validate(block_size=4)
    # Device 0's 9 tokens need the 16-token bucket; device 1's 2 alone would not.
    assert plan.bucket == (16, 2)
    assert (plan.num_logprobs, plan.num_prompt_logprobs) == (5, 5)  # compiled widths 0, 5, 20
    x = plan.inputs
    assert x.token_ids.shape == (3, 16) and x.block_tables.shape == (3, 2, plan.max_blocks_per_seq)
    assert x.token_ids[0, :9].tolist() == list(range(1, 10)) and x.token_ids[1, :2].tolist() == [7, 8]
    assert x.prompt_lens.tolist() == [[9, 0], [2, 0], [0, 0]]
    assert x.sampling.temperature.shape == (3, 2)
    np.testing.assert_allclose(x.sampling.temperature, [[0.7, 0.0], [0.0, 0.0], [0.0, 0.0]])
    assert x.sampling.top_k.tolist() == [[3, 50], [50, 50], [50, 50]]
    assert x.sampling.position.tolist() == [[9, 0], [2, 0], [0, 0]]
    assert x.sampling.seed[0, 0].tolist() == [11, 0] and x.sampling.seed[1, 0].tolist() == [12, 0]
    # Prompt logprobs: request a's tokens predict its next prompt token; b and the placeholder have none.
    assert x.prompt_targets[0, :9].tolist() == [*range(2, 10), -1]
    assert (x.prompt_targets[1:] == -1).all()
    idle = plan.view(2)
    assert idle.num_seqs == 0 and not idle.sample.any() and (idle.seq_slots == -1).all()
    assert (idle.token_seq == 2).all() and (idle.query_start == 0).all()
    assert plan.view(1).request_ids == ("b",) and plan.is_prefill  # both rows are prompt chunks
