"""StepPlan: construction checks, the content validator, bucket choice; streaming outputs and metrics."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys

import numpy as np
import pytest

from deepinfer_jax.engine.params import SamplingParams
from deepinfer_jax.engine.plan import StepPlan, choose_bucket
from deepinfer_jax.engine.scheduler import Scheduler


def hand_plan(**changes) -> StepPlan:
    """Two real rows (a 3-token prefill chunk and a pending decode) padded to T=6, S=3, by hand."""
    fields = {
        "token_ids": np.array([5, 6, 7, -1, 0, 0], np.int32),
        "positions": np.array([0, 1, 2, 9, 0, 0], np.int32),
        "token_seq": np.array([0, 0, 0, 1, 3, 3], np.int32),
        "seq_slots": np.array([2, 1, -1], np.int32),
        "query_start": np.array([0, 3, 4, 4], np.int32),
        "context_lens": np.array([3, 10, 0], np.int32),
        "block_tables": np.array([[3, -1, -1], [1, 2, 4], [-1, -1, -1]], np.int32),
        "sample": np.array([False, True, False]),
        "num_tokens": 4,
        "num_seqs": 2,
        "request_ids": ("a", "b"),
    }
    fields.update(changes)
    return StepPlan(**fields)


def test_a_hand_built_plan_is_valid() -> None:
    plan = hand_plan()
    plan.validate(block_size=4)
    assert plan.bucket == (6, 3) and plan.max_blocks_per_seq == 3


@pytest.mark.parametrize(
    ("changes", "error", "fragment"),
    [
        ({"positions": np.zeros(6, np.int64)}, TypeError, "positions must have dtype int32"),
        ({"sample": np.zeros(2, bool)}, ValueError, "sample has shape (2,), expected (3,)"),
        ({"query_start": np.zeros(3, np.int32)}, ValueError, "query_start has shape"),
        ({"num_seqs": 4}, ValueError, "num_seqs = 4 must be in [0, 3]"),
        ({"request_ids": ("a",)}, ValueError, "request_ids has 1 entries"),
        ({"token_ids": [5, 6]}, TypeError, "token_ids must be a 1-D numpy array"),
    ],
)
def test_construction_refuses_wrong_shapes_and_types(changes: dict, error: type, fragment: str) -> None:
    with pytest.raises(error) as info:
        hand_plan(**changes)
    assert fragment in str(info.value)


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
        ({"query_start": np.array([0, 3, 4, 5], np.int32)}, "prefix sum"),
    ],
)
def test_validate_finds_each_broken_invariant(changes: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match="StepPlan") as info:
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
    (first,) = sched.process_outputs(plan, np.array([9, 0], np.int32))
    assert not first.finished and first.outputs[0].token_ids == [9] and first.outputs[0].finish_reason is None
    plan = sched.schedule()
    assert plan is not None
    (last,) = sched.process_outputs(plan, np.array([8, 0], np.int32))
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
