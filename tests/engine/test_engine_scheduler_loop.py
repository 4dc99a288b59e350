"""The scheduler's decode loop (``num_decode_steps``), checked step by step against plans worked out by hand.

A decode-loop step gives every plain decode row the iterations it may run in one device call, allocates their
blocks ahead, and is processed one iteration at a time (docs/engine.md "Decode loop"). No device runs here: the
tests feed each iteration's tokens as the device's callbacks would.
"""

from __future__ import annotations

import numpy as np
from one_device import OneDevice  # tests/engine/one_device.py

from deepinfer_jax.engine.params import SamplingParams
from deepinfer_jax.engine.plan import PENDING_TOKEN
from deepinfer_jax.engine.scheduler import RequestStatus
from deepinfer_jax.text import Tokenizer, build_synthetic_tokenizer

EOS = 1


def make(**overrides) -> OneDevice:
    kwargs = {
        "num_blocks": 64,
        "block_size": 4,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 16,
        "max_model_len": 64,
        "vocab_size": 300,
        "eos_token_ids": (EOS,),
        "num_decode_steps": 4,
    }
    kwargs.update(overrides)
    return OneDevice(**kwargs)


def feed(sched: OneDevice, tokens: list[int]) -> list:
    """Schedule a plain step and feed one token per row."""
    plan = sched.schedule()
    assert plan is not None and plan.plan.inputs.loop is None
    out = np.zeros(plan.padded_seqs, np.int32)
    out[: len(tokens)] = tokens
    return sched.process_outputs(plan, out)


def iteration(sched: OneDevice, plan, j: int, tokens: list[int], alive: list[bool], last: bool) -> list:
    """Iteration ``j`` of a decode-loop step, as its callback delivers it."""
    s = plan.padded_seqs
    out = np.zeros((1, s), np.int32)
    out[0, : len(tokens)] = tokens
    live = np.zeros((1, s), np.bool_)
    live[0, : len(alive)] = alive
    return sched.engine.process_outputs(plan.plan, out, iteration=j, last=last, alive=live)


def test_loop_rows_get_their_iterations_blocks_and_stop_ids() -> None:
    sched = make()
    sched.add_request("a", [10, 11, 12, 13, 14], SamplingParams(max_tokens=10, stop_token_ids=[50]), seed=0)
    sched.add_request("b", [30, 31, 32], SamplingParams(max_tokens=3, ignore_eos=True), seed=0)
    feed(sched, [20, 30])  # both prompts: a plain step (they were waiting when it was planned)
    plan = sched.schedule()
    assert plan.plan.inputs.loop is not None and plan.plan.loop_steps == 4
    loop = plan.plan.inputs.loop
    # a: 4 iterations (its budget holds 9 more); b: the 2 tokens its max_tokens leaves.
    assert loop.iterations[0, :2].tolist() == [4, 2]
    assert loop.stop_ids[0, 0].tolist() == [EOS, 50, -1, -1]  # EOS, then its stop ids
    assert loop.stop_ids[0, 1].tolist() == [-1, -1, -1, -1]  # ignore_eos, no stop ids
    assert plan.token_ids[:2].tolist() == [20, 30] and plan.positions[:2].tolist() == [5, 3]
    assert plan.context_lens[:2].tolist() == [6, 4]
    # Blocks for every iteration's input: a writes positions 5..8 (3 blocks of 4), b positions 3..4 (2 blocks).
    a, b = sched.get_request("a"), sched.get_request("b")
    assert len(a.block_ids) == 3 and len(b.block_ids) == 2
    assert a.pending == 4 and b.pending == 2 and a.num_computed == 9 and b.num_computed == 5
    assert plan.plan.variant[-2:] == (4, 4)
    assert iteration(sched, plan, 0, [21, 31], [True, True], False) == []
    out = iteration(sched, plan, 1, [22, 32], [True, True], False)
    assert [o.request_id for o in out] == ["b"] and out[0].outputs[0].token_ids == [30, 31, 32]
    assert iteration(sched, plan, 2, [23, 0], [True, False], False) == []
    out = iteration(sched, plan, 3, [50, 0], [True, False], True)
    done = out[0].outputs[0]
    assert done.token_ids == [20, 21, 22, 23, 50] and done.finish_reason == "stop" and done.stop_reason == 50
    assert not sched.has_unfinished_requests() and sched.num_in_flight == 0
    assert sched.blocks.num_free == sched.blocks.capacity
    assert sched.stats.num_loop_steps == 1 and sched.stats.num_loop_iterations == 4
    assert sched.stats.num_decode_tokens == 6


def test_loops_pipeline_with_tokens_in_flight() -> None:
    """The next loop step is planned before the previous one's tokens arrive: it starts from the pending token
    at the position after the last iteration, and stops planning once the in-flight tokens complete a request."""
    sched = make()
    sched.add_request("a", [10, 11, 12], SamplingParams(max_tokens=7, ignore_eos=True), seed=0)
    feed(sched, [20])
    first = sched.schedule()
    second = sched.schedule()
    assert first.plan.inputs.loop.iterations[0, 0] == 4 and second.plan.inputs.loop.iterations[0, 0] == 2
    assert second.token_ids[0] == PENDING_TOKEN and second.positions[0] == 3 + 4
    assert sched.schedule() is None  # 1 + 4 + 2 tokens: max_tokens is reached by what is in flight
    for j in range(4):
        assert iteration(sched, first, j, [21 + j], [True], j == 3) == []
    assert iteration(sched, second, 0, [25], [True], False) == []
    out = iteration(sched, second, 1, [26], [True], True)
    assert out[0].outputs[0].token_ids == [20, 21, 22, 23, 24, 25, 26]


def test_waiting_requests_and_prefill_chunks_keep_one_token_steps() -> None:
    """A request waiting for admission (here: no sequence free) keeps every step plain, so it joins at the next
    step boundary; so does a prompt still being prefilled in chunks beside a decode."""
    sched = make(max_num_seqs=1)
    sched.add_request("a", [10, 11], SamplingParams(max_tokens=3, ignore_eos=True), seed=0)
    sched.add_request("b", [12, 13], SamplingParams(max_tokens=6, ignore_eos=True), seed=0)
    feed(sched, [20])
    feed(sched, [21])  # b waits: a plain decode
    feed(sched, [22])
    feed(sched, [30])  # b's prompt
    plan = sched.schedule()
    assert plan.plan.inputs.loop is not None and plan.plan.inputs.loop.iterations[0, 0] == 4
    chunked = make(max_num_batched_tokens=4)
    chunked.add_request("a", [10, 11, 12], SamplingParams(max_tokens=8, ignore_eos=True), seed=0)
    feed(chunked, [20])
    chunked.add_request("b", list(range(40, 50)), SamplingParams(max_tokens=2, ignore_eos=True), seed=0)
    feed(chunked, [21, 0])  # a decodes beside b's first chunk (b was waiting)
    plan = chunked.schedule()  # b's next chunk is a prefill: a still decodes one token
    assert plan.plan.inputs.loop is None and plan.request_ids == ("a", "b")


def test_iterations_stop_where_the_plans_masks_would_change() -> None:
    """``min_tokens`` masks the stop ids while fewer outputs exist: a row runs no further than that masking
    holds (its masks are built once for the call); the next window snapshot bounds it the same way."""
    sched = make()
    sched.add_request("a", [10, 11, 12], SamplingParams(max_tokens=20, min_tokens=3), seed=0)
    feed(sched, [20])
    plan = sched.schedule()
    assert plan.plan.inputs.loop.iterations[0, 0] == 2  # samples outputs 2 and 3 under the mask
    assert EOS in plan.plan.inputs.sampling.masked_ids[0, 0].tolist()
    req = sched.get_request("a")
    dev = sched.device
    dev.snapshots = object()  # as with prefix caching's window snapshots: boundaries every 4 positions
    try:
        # A row at position 9 samples position 10 in its first iteration; position 12 is the next boundary.
        assert dev._loop_iterations(req, 9, 8) == 2
        assert dev._loop_iterations(req, 11, 8) == 4  # its first iteration ends at the boundary (12)
    finally:
        dev.snapshots = None


def test_blocks_ahead_that_do_not_fit_give_one_iteration_not_a_preemption() -> None:
    """Two prompts of 5 fill the 4 usable blocks: a one-token decode at position 5 needs no new block, a loop
    would (positions 5..8). The step runs one iteration rather than preempt a request for its lookahead."""
    sched = make(num_blocks=5, block_size=4)
    for rid in ("a", "b"):
        sched.add_request(rid, [10, 11, 12, 13, 14], SamplingParams(max_tokens=6, ignore_eos=True), seed=0)
    feed(sched, [20, 30])
    assert sched.blocks.num_free == 0
    plan = sched.schedule()
    assert plan.plan.inputs.loop is None and plan.request_ids == ("a", "b")
    assert sched.stats.num_preemptions == 0


def test_a_device_stop_the_host_did_not_make_ends_the_request_with_an_error() -> None:
    """The device's stop checks mirror the host's; if they ever disagreed, the request ends with an error
    instead of silently missing the tokens the device did not sample."""
    sched = make()
    sched.add_request("a", [10, 11], SamplingParams(max_tokens=9, ignore_eos=True), seed=0)
    sched.add_request("b", [12, 13], SamplingParams(max_tokens=9, ignore_eos=True), seed=0)
    feed(sched, [20, 30])
    plan = sched.schedule()
    iteration(sched, plan, 0, [21, 31], [True, True], False)
    out = iteration(sched, plan, 1, [22, 0], [True, False], True)  # b "stopped" on the device; the loop ends
    by_id = {o.request_id: o.outputs[0] for o in out}
    assert by_id["b"].finish_reason == "error" and "decode loop stopped it" in by_id["b"].error
    assert by_id["b"].token_ids == [30, 31]  # nothing of the iteration it did not sample
    # a was planned for 4 iterations but the call ended after 2 while the host still ran it.
    assert by_id["a"].finish_reason == "error" and by_id["a"].token_ids == [20, 21, 22]
    assert not sched.has_unfinished_requests() and sched.blocks.num_free == sched.blocks.capacity
    assert all(r.status is RequestStatus.FINISHED for r in plan.requests)


def test_requests_whose_masks_need_the_host_keep_one_token_steps() -> None:
    """A multi-token bad word (its mask depends on the previous token, so the row waits for it on the host) and
    golden tokens (teacher forcing) keep every step of the engine plain while such a request runs; so would a
    grammar (structured outputs). Once it is done, the others loop."""
    tok = Tokenizer.from_str(build_synthetic_tokenizer(266), source="synthetic-266")
    for extra in ({"bad_words": ["ab"]}, {"golden_token_ids": [40, 41, 42]}):
        sched = make(tokenizer=tok, vocab_size=266)
        sched.add_request("a", [20, 21], SamplingParams(max_tokens=9, ignore_eos=True), seed=0)
        sched.add_request("b", [22, 23], SamplingParams(max_tokens=3, ignore_eos=True, **extra), seed=0)
        b = sched.get_request("b")
        feed(sched, [40, 40])
        assert not sched.device.loop_ready()
        plain = 0
        while b.status is not RequestStatus.FINISHED:
            plan = sched.schedule()
            assert plan.plan.inputs.loop is None
            sched.process_outputs(plan, np.full(plan.padded_seqs, 41, np.int32))
            plain += 1
        assert plain >= 2
        assert sched.device.loop_ready() and sched.schedule().plan.inputs.loop is not None


def test_a_stop_string_found_on_the_host_drops_the_later_iterations() -> None:
    """The device knows stop ids, not stop strings: it keeps sampling after one, and the host ends the request
    where the string completes and counts the rest of the call's samples as wasted."""
    tok = Tokenizer.from_str(build_synthetic_tokenizer(266), source="synthetic-266")
    sched = make(tokenizer=tok, vocab_size=266)
    ids = [b + 10 for b in b"xabcd"]
    sched.add_request("a", [20], SamplingParams(max_tokens=20, stop=["bc"]), seed=0)
    feed(sched, [ids[0]])
    plan = sched.schedule()
    assert plan.plan.inputs.loop.iterations[0, 0] == 4
    outs = [iteration(sched, plan, j, [ids[1 + j]], [True], j == 3) for j in range(4)]
    assert [len(o) for o in outs] == [0, 0, 1, 0]  # "bc" completes with the third iteration's token
    done = outs[2][0].outputs[0]
    assert (done.text, done.stop_reason, done.token_ids) == ("xa", "bc", ids[:4])
    assert sched.stats.num_wasted_samples == 1 and sched.num_in_flight == 0
