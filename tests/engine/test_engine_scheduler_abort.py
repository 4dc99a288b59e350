"""``Scheduler.abort``: a request ends at once with ``finish_reason="abort"``, queued, running, preempted or with a
step in flight, and its blocks and state slot are free before the next step; the others are untouched; on a
mesh the router forgets it."""

from __future__ import annotations

import numpy as np
from one_device import OneDevice  # tests/engine/one_device.py

from deepinfer_jax.engine.params import SamplingParams
from deepinfer_jax.engine.scheduler import Scheduler


def make(**overrides) -> OneDevice:
    kwargs = {
        "num_blocks": 64,
        "block_size": 4,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 16,
        "max_model_len": 64,
        "vocab_size": 300,
        "eos_token_ids": (1,),
    }
    kwargs.update(overrides)
    return OneDevice(**kwargs)


LONG = SamplingParams(max_tokens=40, ignore_eos=True)


def _feed(sched: OneDevice, plan, token: int = 7) -> list:
    return sched.process_outputs(plan, np.full(plan.padded_seqs, token, np.int32))


def test_abort_of_a_running_request_with_a_step_in_flight() -> None:
    sched = make()
    sched.add_request("a", list(range(2, 12)), LONG, seed=0)  # 10 tokens: 3 blocks of 4
    sched.add_request("b", [5, 6, 7], LONG, seed=0)
    p1 = sched.schedule()
    _feed(sched, p1)
    p2 = sched.schedule()  # in flight: it samples a's 2nd token
    used = sched.blocks.capacity - sched.blocks.num_free
    a_blocks = len(sched.get_request("a").block_ids)
    out = sched.engine.abort("a")
    assert out is not None and out.finished and out.request_id == "a"
    c = out.outputs[0]
    assert (c.finish_reason, c.token_ids, c.stop_reason, c.error) == ("abort", [7], None, None)
    # Freed now, with p2 still in flight: blocks and the slot, nothing of b's.
    assert sched.blocks.capacity - sched.blocks.num_free == used - a_blocks
    assert sched.slots.num_free == sched.slots.capacity - 1
    assert sched.engine.abort("a") is None  # already finished: nothing to do
    # The step in flight delivers a's sample, which is dropped; b goes on alone.
    assert _feed(sched, p2) == []
    assert sched.stats.num_wasted_samples == 1
    p3 = sched.schedule()
    assert p3.request_ids == ("b",)
    assert sched.get_request("b").output_token_ids == [7, 7]


def test_abort_of_a_queued_and_of_a_preempted_request() -> None:
    # 8 usable blocks of 4 tokens: two 8-token prompts fit, their 12 decodes each do not (20 tokens = 5 blocks).
    sched = make(num_blocks=9)
    short = SamplingParams(max_tokens=12, ignore_eos=True)
    sched.add_request("a", list(range(2, 10)), short, seed=0)
    sched.add_request("b", list(range(20, 28)), short, seed=0)
    sched.add_request("c", [3, 4], short, seed=0)  # queued: not scheduled yet
    out = sched.engine.abort("c")
    assert out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids == []
    for _ in range(12):
        plan = sched.schedule()
        _feed(sched, plan)
        if sched.stats.num_preemptions:
            break
    assert sched.stats.num_preemptions == 1
    (preempted,) = [r for r in ("a", "b") if sched.get_request(r).block_ids == []]
    tokens = list(sched.get_request(preempted).output_token_ids)
    out = sched.engine.abort(preempted)
    assert out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids == tokens
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        _feed(sched, plan)
    assert sched.blocks.num_free == sched.blocks.capacity and sched.slots.num_free == sched.slots.capacity
    sched.blocks.check_consistency()


def test_abort_on_a_mesh_updates_the_router() -> None:
    sched = Scheduler(
        num_devices=2,
        num_blocks=16,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=64,
        vocab_size=300,
    )
    assert [sched.add_request(r, [2, 3, 4], LONG, seed=0) for r in ("a", "b", "c")] == [0, 1, 0]
    assert sched.loads() == [(2, 6), (1, 3)]
    assert sched.abort("a").outputs[0].finish_reason == "abort"
    assert sched.loads() == [(1, 3), (1, 3)]
    # The next request goes to the lowest index again, and "a" may be reused as an id.
    assert sched.add_request("a", [2], LONG, seed=0) == 0
    assert sched.abort("unknown") is None
