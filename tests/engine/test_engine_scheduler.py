"""Scheduler scenarios checked step by step against plans worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest
from one_device import OneDevice, Step  # tests/engine/one_device.py

from deepinfer_jax.engine.params import SamplingParams
from deepinfer_jax.engine.plan import DRAFT_TOKEN, PENDING_TOKEN
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
    }
    kwargs.update(overrides)
    return OneDevice(**kwargs)


def step(sched: OneDevice, tokens: dict[str, int] | int = 7, **kw) -> tuple[Step, list]:
    """Schedule one step and feed back ``tokens`` (per request id, or one id for every row)."""
    plan = sched.schedule()
    assert plan is not None
    plan.validate(block_size=sched.block_size)
    out = np.zeros(plan.padded_seqs, np.int32)
    for i, rid in enumerate(plan.request_ids):
        out[i] = tokens if isinstance(tokens, int) else tokens.get(rid, 7)
    return plan, sched.process_outputs(plan, out, **kw)


def rows(plan: Step) -> list[tuple[str, list[int], list[int], bool]]:
    """(request, token ids, positions, sample) of each real row."""
    out = []
    for i, rid in enumerate(plan.request_ids):
        lo, hi = plan.query_start[i], plan.query_start[i + 1]
        out.append(
            (rid, plan.token_ids[lo:hi].tolist(), plan.positions[lo:hi].tolist(), bool(plan.sample[i]))
        )
    return out


def test_prefill_then_decode_with_known_tokens() -> None:
    sched = make()
    sched.add_request("a", [10, 11, 12, 13, 14], SamplingParams(max_tokens=3, ignore_eos=True), seed=0)
    plan, out = step(sched, 20)
    assert rows(plan) == [("a", [10, 11, 12, 13, 14], [0, 1, 2, 3, 4], True)]
    assert plan.context_lens[0] == 5 and plan.block_tables[0, :2].tolist() == [1, 2]
    assert plan.block_tables[0, 2] == -1 and plan.seq_slots[0] == 1 and out == []
    plan, _ = step(sched, 21)
    # The token sampled last step is known on the host (processed synchronously), so it is given explicitly.
    assert rows(plan) == [("a", [20], [5], True)] and plan.context_lens[0] == 6
    plan, out = step(sched, 22)
    assert rows(plan) == [("a", [21], [6], True)]
    assert len(out) == 1 and out[0].finished
    completion = out[0].outputs[0]
    assert completion.token_ids == [20, 21, 22] and completion.finish_reason == "length"
    assert completion.text == "" and completion.stop_reason is None
    assert sched.blocks.num_free == sched.blocks.capacity and sched.slots.num_free == sched.slots.capacity
    assert not sched.has_unfinished_requests() and sched.schedule() is None


def test_chunked_prefill_under_a_tiny_budget_and_mixing_with_decode() -> None:
    sched = make(max_num_batched_tokens=3)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    sched.add_request("a", [10, 11], params, seed=0)
    sched.add_request("b", [30, 31, 32, 33, 34], params, seed=0)
    plan, _ = step(sched, 40)
    # a's whole prompt (2 tokens) and one token of b fill the budget of 3.
    assert rows(plan) == [("a", [10, 11], [0, 1], True), ("b", [30], [0], False)]
    plan, _ = step(sched, 41)
    assert rows(plan) == [("a", [40], [2], True), ("b", [31, 32], [1, 2], False)]
    plan, _ = step(sched, 42)
    assert rows(plan) == [("a", [41], [3], True), ("b", [33, 34], [3, 4], True)]
    assert plan.num_tokens == 3 and plan.context_lens[:2].tolist() == [4, 5]


def test_budget_of_one_token_still_finishes_everything() -> None:
    sched = make(max_num_batched_tokens=1)
    sched.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True), seed=0)
    sched.add_request("b", [8], SamplingParams(max_tokens=1, ignore_eos=True), seed=0)
    seen = []
    finished = {}
    for _ in range(20):
        if not sched.has_unfinished_requests():
            break
        plan, out = step(sched, 9)
        assert plan.num_tokens == 1 and plan.padded_tokens == 1
        seen.append(rows(plan)[0][0])
        finished.update({o.request_id: o.outputs[0].token_ids for o in out})
    assert finished == {"a": [9, 9], "b": [9]}
    assert seen == ["a", "a", "a", "a", "b"]


def test_max_num_seqs_caps_admission() -> None:
    sched = make(max_num_seqs=2)
    for rid in "abc":
        sched.add_request(rid, [5], SamplingParams(max_tokens=2, ignore_eos=True), seed=0)
    plan, _ = step(sched)
    assert plan.request_ids == ("a", "b") and sched.num_waiting == 1
    plan, out = step(sched)
    assert plan.request_ids == ("a", "b") and {o.request_id for o in out} == {"a", "b"}
    plan, _ = step(sched)
    assert plan.request_ids == ("c",)


def test_bucket_padding() -> None:
    sched = make(buckets=[(4, 2), (8, 4), (16, 4)])
    sched.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2), seed=0)
    plan, _ = step(sched)
    assert plan.bucket == (4, 2) and plan.num_tokens == 3
    assert plan.token_ids.tolist() == [5, 6, 7, 0] and plan.token_seq.tolist() == [0, 0, 0, 2]
    assert plan.seq_slots.tolist() == [1, -1] and plan.query_start.tolist() == [0, 3, 3]
    assert plan.block_tables[1].tolist() == [-1] * sched.max_blocks_per_seq and not plan.sample[1]
    sched.add_request("b", list(range(10, 16)), SamplingParams(max_tokens=2), seed=0)
    plan, _ = step(sched)
    assert plan.num_tokens == 7 and plan.bucket == (8, 4)


def test_eos_stop_ids_min_tokens_and_ignore_eos() -> None:
    sched = make()
    sched.add_request("eos", [5], SamplingParams(max_tokens=5), seed=0)
    sched.add_request("stopid", [5], SamplingParams(max_tokens=5, stop_token_ids=[9]), seed=0)
    sched.add_request("min", [5], SamplingParams(max_tokens=5, min_tokens=2), seed=0)
    sched.add_request("ignore", [5], SamplingParams(max_tokens=2, ignore_eos=True), seed=0)
    _, out = step(sched, {"eos": EOS, "stopid": 9, "min": EOS, "ignore": EOS})
    done = {o.request_id: o.outputs[0] for o in out}
    assert set(done) == {"eos", "stopid"}
    assert (done["eos"].finish_reason, done["eos"].stop_reason, done["eos"].token_ids) == (
        "stop",
        None,
        [EOS],
    )
    assert (done["stopid"].finish_reason, done["stopid"].stop_reason) == ("stop", 9)
    _, out = step(sched, {"min": EOS, "ignore": EOS})
    done = {o.request_id: o.outputs[0] for o in out}
    assert done["min"].token_ids == [EOS, EOS] and done["min"].finish_reason == "stop"
    assert done["ignore"].token_ids == [EOS, EOS] and done["ignore"].finish_reason == "length"


def test_preemption_recomputes_longest_output_first() -> None:
    # 3 usable blocks of 2 tokens. a and b each hold one block after prefill; decodes then need more.
    sched = make(num_blocks=4, block_size=2, max_model_len=6)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    sched.add_request("a", [10, 11], params, seed=0)
    plan, _ = step(sched, 50)  # a: prompt in block 1; output 50
    sched.add_request("b", [20, 21], params, seed=0)
    plan, _ = step(sched, {"a": 51, "b": 60})
    # a decodes position 2 (new block 2), b is admitted (block 3).
    assert rows(plan) == [("a", [50], [2], True), ("b", [20, 21], [0, 1], True)]
    assert sched.blocks.num_free == 0
    plan, _ = step(sched, {"a": 52, "b": 61})
    # a needs no new block (position 3 is in block 2); b needs one, none is free: a has the longest output
    # (2 tokens against 1) and is preempted, its blocks go to b.
    assert rows(plan) == [("b", [60], [2], True)]
    a = sched.get_request("a")
    assert (
        a.status is RequestStatus.WAITING
        and a.output_token_ids == [50, 51]
        and a.metrics.num_preemptions == 1
    )
    plan, _ = step(sched, {"b": 62})
    assert rows(plan) == [("b", [61], [3], True)]
    plan, out = step(sched, {"b": 63})
    assert rows(plan) == [("b", [62], [4], True)] and out[0].outputs[0].token_ids == [60, 61, 62, 63]
    # a is recomputed: its prompt and its outputs so far are prefilled again, then it continues.
    plan, _ = step(sched, {"a": 52})
    assert rows(plan) == [("a", [10, 11, 50, 51], [0, 1, 2, 3], True)]
    plan, out = step(sched, {"a": 53})
    assert out[0].outputs[0].token_ids == [50, 51, 52, 53] and out[0].metrics.num_preemptions == 1
    assert sched.blocks.num_free == sched.blocks.capacity and sched.stats.num_preemptions == 1


def test_a_recompute_under_drafts_resumes_at_its_last_output() -> None:
    """With drafts, a recomputed request feeds every known token but its last output, and that row emits the
    last output again (golden) without appending it; the next step decodes it with drafts, as the run without
    preemption would have (the device's drafts after it are the ones that run held)."""
    sched = make(num_draft_tokens=1)
    sched.add_request("a", [10, 11, 12], SamplingParams(max_tokens=6, ignore_eos=True), seed=0)

    def spec_step(emitted: list[int], accepted: int) -> Step:
        plan = sched.schedule()
        assert plan is not None
        plan.validate(block_size=sched.block_size)
        out = np.zeros((plan.padded_seqs, 2), np.int32)
        out[0, : len(emitted)] = emitted
        acc = np.zeros(plan.padded_seqs, np.int32)
        acc[0] = accepted
        sched.process_outputs(plan, out, num_accepted=acc)
        return plan

    spec_step([50], 0)  # the prefill samples 50
    plan = spec_step([51, 52], 1)  # its draft accepted, then 52
    assert rows(plan) == [("a", [50, DRAFT_TOKEN], [3, 4], True)]
    a = sched.get_request("a")
    assert a.output_token_ids == [50, 51, 52] and a.num_computed == 5
    sched.device._preempt(a)
    plan = spec_step([52], 0)
    # The recompute stops before 52; its sampling row emits the known 52 (golden), which is not appended again.
    assert rows(plan) == [("a", [10, 11, 12, 50, 51], [0, 1, 2, 3, 4], True)]
    assert plan.plan.inputs.sampling.golden[0, 0] == 52
    assert a.output_token_ids == [50, 51, 52] and a.pending == 0 and a.resuming == 0 and not a.resume
    plan = spec_step([53, 54], 1)
    assert rows(plan) == [("a", [52, DRAFT_TOKEN], [5, 6], True)]
    assert plan.plan.inputs.sampling.golden[0, 0] == -1
    assert a.output_token_ids == [50, 51, 52, 53, 54] and a.metrics.num_preemptions == 1
    # Without drafts the recompute feeds every known token and samples the next one, as before.
    plain = make()
    plain.add_request("b", [10, 11, 12], SamplingParams(max_tokens=6, ignore_eos=True), seed=0)
    step(plain, 50)
    step(plain, 51)
    b = plain.get_request("b")
    plain.device._preempt(b)
    plan, _ = step(plain, 52)
    assert rows(plan) == [("b", [10, 11, 12, 50, 51], [0, 1, 2, 3, 4], True)]
    assert b.output_token_ids == [50, 51, 52] and plan.plan.inputs.sampling.golden[0, 0] == -1


@pytest.mark.parametrize("whole", [False, True])
def test_whole_drafts_wait_instead_of_verifying_fewer(whole: bool) -> None:
    """Four decode rows of 1 + 4 tokens under a 16-token budget: the fourth has one token left. By default it
    verifies no drafts; with ``whole_drafts`` (batch-invariant mode) it waits for a step with room for all four."""
    sched = make(num_draft_tokens=4, max_num_batched_tokens=16, max_num_seqs=4)
    sched.engine.whole_drafts = whole
    for rid in "abcd":
        sched.add_request(rid, [10], SamplingParams(max_tokens=8, ignore_eos=True), seed=0)
    plan = sched.schedule()
    assert [r[0] for r in rows(plan)] == ["a", "b", "c", "d"]
    sched.process_outputs(
        plan, np.full((plan.padded_seqs, 5), 20, np.int32), num_accepted=np.zeros(plan.padded_seqs, np.int32)
    )
    plan = sched.schedule()
    got = [(rid, toks.count(DRAFT_TOKEN)) for rid, toks, _, _ in rows(plan)]
    if whole:
        assert got == [("a", 4), ("b", 4), ("c", 4)]
    else:
        assert got == [("a", 4), ("b", 4), ("c", 4), ("d", 0)]


def test_request_that_can_never_fit_ends_alone_with_an_error() -> None:
    sched = make(num_blocks=3, block_size=4, max_model_len=64)
    sched.add_request("big", list(range(10, 20)), SamplingParams(max_tokens=4), seed=0)
    sched.add_request("ok", [5], SamplingParams(max_tokens=2, ignore_eos=True), seed=0)
    ready = sched.take_ready_outputs()
    assert len(ready) == 1 and ready[0].request_id == "big" and ready[0].finished
    completion = ready[0].outputs[0]
    assert completion.finish_reason == "error" and "can never fit the cache" in completion.error
    assert "13 cached tokens need 4 blocks" in completion.error
    _, out = step(sched)
    _, out = step(sched)
    assert out[0].outputs[0].finish_reason == "length"


def test_add_request_refuses_bad_input_before_queuing() -> None:
    sched = make(max_model_len=8)
    with pytest.raises(ValueError, match="empty"):
        sched.add_request("a", [], SamplingParams(), seed=0)
    with pytest.raises(ValueError, match="exceeds max_model_len = 8"):
        sched.add_request("a", [1, 2], SamplingParams(max_tokens=7), seed=0)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        sched.add_request("a", [1], SamplingParams(max_tokens=2, stop="x"), seed=0)
    with pytest.raises(ValueError, match=r"seed = -1 must be in \[0, 2\*\*64\)"):
        sched.add_request("a", [1], SamplingParams(max_tokens=2), seed=-1)
    with pytest.raises(TypeError, match="seed must be an int, got float"):
        sched.add_request("a", [1], SamplingParams(max_tokens=2), seed=1.0)  # type: ignore[arg-type]
    assert not sched.has_unfinished_requests()
    sched.add_request("a", [1], SamplingParams(max_tokens=2), seed=0)
    with pytest.raises(ValueError, match="already queued"):
        sched.add_request("a", [1], SamplingParams(max_tokens=2), seed=0)


def test_scheduler_arguments_are_validated() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens = 0 must be >= 1"):
        make(max_num_batched_tokens=0)
    with pytest.raises(TypeError, match="buckets\\[0\\]"):
        make(buckets=[(4,)])
    with pytest.raises(ValueError, match="no bucket holds"):
        make(buckets=[(16, 1), (1, 4)])
    with pytest.raises(ValueError, match="eos_token_ids: 999"):
        make(eos_token_ids=(999,))


def test_async_scheduling_uses_pending_tokens_and_wastes_at_most_one_step() -> None:
    sched = make()
    sched.add_request("a", [5, 6], SamplingParams(max_tokens=8), seed=0)
    sched.add_request("b", [7], SamplingParams(max_tokens=2, ignore_eos=True), seed=0)
    p1 = sched.schedule()
    p2 = sched.schedule()  # step 2 before step 1's tokens are known
    assert p1 is not None and p2 is not None
    p2.validate(block_size=sched.block_size)
    assert rows(p2) == [("a", [PENDING_TOKEN], [2], True), ("b", [PENDING_TOKEN], [1], True)]
    # b will have 2 tokens once p1 and p2 arrive: that is max_tokens, so a third step leaves it out.
    p3 = sched.schedule()
    assert p3 is not None and p3.request_ids == ("a",)
    with pytest.raises(ValueError, match="in the order they were scheduled"):
        sched.process_outputs(p2, np.zeros(p2.padded_seqs, np.int32))
    out = sched.process_outputs(p1, np.array([EOS, 20, 0, 0], np.int32)[: p1.padded_seqs])
    assert [o.request_id for o in out] == ["a"] and out[0].outputs[0].token_ids == [EOS]
    # a stopped on EOS while p2 and p3 were in flight: their samples for a are discarded.
    out = sched.process_outputs(p2, np.array([99, 21, 0, 0], np.int32)[: p2.padded_seqs])
    assert [o.request_id for o in out] == ["b"] and out[0].outputs[0].token_ids == [20, 21]
    assert sched.process_outputs(p3, np.zeros(p3.padded_seqs, np.int32)) == []
    assert sched.stats.num_wasted_samples == 2
    assert not sched.has_unfinished_requests() and sched.blocks.num_free == sched.blocks.capacity


def test_logprobs_are_collected_in_vllm_shape() -> None:
    sched = make()
    sched.add_request("a", [5], SamplingParams(max_tokens=2, logprobs=2, ignore_eos=True), seed=0)
    sched.add_request("b", [5], SamplingParams(max_tokens=2, ignore_eos=True), seed=0)
    outs = []
    for chosen, alt in ((7, 8), (9, 7)):
        plan = sched.schedule()
        assert plan is not None
        s = plan.padded_seqs
        outs = sched.process_outputs(
            plan,
            np.full(s, chosen, np.int32),
            logprob=np.full(s, -0.5, np.float32),
            rank=np.full(s, 2, np.int32),
            top_ids=np.tile(np.array([alt, chosen], np.int32), (s, 1)),
            top_logprobs=np.tile(np.array([-0.25, -0.5], np.float32), (s, 1)),
        )
    a = next(o for o in outs if o.request_id == "a").outputs[0]
    assert a.logprobs == [
        {7: _lp(-0.5, 2), 8: _lp(-0.25, 1)},
        {9: _lp(-0.5, 2), 7: _lp(-0.25, 1)},
    ]
    assert a.cumulative_logprob == -1.0
    b = next(o for o in outs if o.request_id == "b").outputs[0]
    assert b.logprobs is None and b.cumulative_logprob is None


def _lp(value: float, rank: int):
    from deepinfer_jax.engine.params import Logprob

    return Logprob(value, rank, None)


def test_out_of_vocabulary_sample_ends_only_that_request() -> None:
    sched = make()
    sched.add_request("a", [5], SamplingParams(max_tokens=3, ignore_eos=True), seed=0)
    sched.add_request("b", [5], SamplingParams(max_tokens=1, ignore_eos=True), seed=0)
    _, out = step(sched, {"a": -1, "b": 4})
    by_id = {o.request_id: o.outputs[0] for o in out}
    assert by_id["a"].finish_reason == "error" and "outside the vocabulary" in by_id["a"].error
    assert by_id["b"].finish_reason == "length" and by_id["b"].token_ids == [4]


@pytest.fixture(scope="module")
def byte_tokenizer() -> Tokenizer:
    """No merges: every non-special id is one byte (id = byte + 10), so text splits across tokens freely."""
    return Tokenizer.from_str(build_synthetic_tokenizer(266), source="synthetic-266")


def _ids(text: str) -> list[int]:
    return [b + 10 for b in text.encode()]


def test_stop_strings_across_token_boundaries_are_cut_from_text(byte_tokenizer: Tokenizer) -> None:
    sched = make(tokenizer=byte_tokenizer, vocab_size=266, max_model_len=64)
    reply = _ids("hello wor") + _ids("ld, more")
    sched.add_request("a", [20], SamplingParams(max_tokens=30, stop=["xyz", "o w", "ld"]), seed=0)
    sched.add_request("b", [20], SamplingParams(max_tokens=30, stop=["world"]), seed=0)
    sched.add_request("c", [20], SamplingParams(max_tokens=len(reply), stop=["hello"], min_tokens=6), seed=0)
    done = {}
    for token in reply:
        if not sched.has_unfinished_requests():
            break
        _, out = step(sched, token)
        done.update({o.request_id: o.outputs[0] for o in out})
    # "o w" ends at token 7: the earliest stop string wins, text stops before it.
    assert (done["a"].text, done["a"].stop_reason, len(done["a"].token_ids)) == ("hell", "o w", 7)
    assert (done["b"].text, done["b"].stop_reason, done["b"].token_ids) == (
        "hello ",
        "world",
        _ids("hello world"),
    )
    # "hello" is complete after 5 tokens, before min_tokens = 6: it does not stop c.
    assert done["c"].finish_reason == "length" and done["c"].text == "hello world, more"


def test_multibyte_text_and_special_tokens(byte_tokenizer: Tokenizer) -> None:
    sched = make(tokenizer=byte_tokenizer, vocab_size=266)
    reply = [*_ids("é"), 2, *_ids("€")]  # id 2 is the special pad token: skipped in text
    sched.add_request("a", [20], SamplingParams(max_tokens=len(reply), stop="\u20ac"), seed=0)
    out = []
    for token in reply:
        _, out = step(sched, token)
    assert out[0].outputs[0].text == "é" and out[0].outputs[0].stop_reason == "€"


def test_state_slots_and_block_table_width_limit_admission() -> None:
    sched = make(num_state_slots=2, max_blocks_per_seq=2)  # one usable slot; tables of 2 blocks of 4 tokens
    sched.add_request("a", [5], SamplingParams(max_tokens=2, ignore_eos=True), seed=0)
    sched.add_request("b", [6], SamplingParams(max_tokens=2, ignore_eos=True), seed=0)
    sched.add_request("long", [7] * 6, SamplingParams(max_tokens=4, ignore_eos=True), seed=0)
    (ready,) = sched.take_ready_outputs()
    assert ready.request_id == "long" and "block table 2" in ready.outputs[0].error
    plan, _ = step(sched)
    assert plan.request_ids == ("a",) and plan.block_tables.shape[1] == 2
    plan, out = step(sched)
    assert plan.request_ids == ("a",) and out[0].request_id == "a"
    plan, _ = step(sched)
    assert plan.request_ids == ("b",) and plan.seq_slots[0] == 1
