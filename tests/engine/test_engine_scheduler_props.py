"""Scheduler properties over random scenarios, driven by a fake device that really uses the paged cache.

The fake device keeps a token-id "KV cache" of ``num_blocks x block_size`` entries and a last-sampled-token
register per state slot, exactly the state the real step keeps. For each step it resolves pending (-1) inputs
from the slot registers, writes every token id into its block-table position, and samples each ``sample`` row
with a deterministic function of the *whole context read back through the block table* and the request's seed.
So any scheduling bug that corrupts the cache (a block shared by two live requests, a wrong table, a lost token
in a recompute, a stale pending token) changes the generated tokens, which are compared with an independent
reference that simply generates each request alone.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from one_device import OneDevice, Step  # tests/engine/one_device.py

from deepinfer_jax.cache.blocks import blocks_for_tokens
from deepinfer_jax.engine.params import RequestOutput, SamplingParams
from deepinfer_jax.engine.plan import PENDING_TOKEN

VOCAB = 12
EOS = 1
STEP_LIMIT = 3000


def next_token(context: np.ndarray, seed: int) -> int:
    """A deterministic stand-in for the model: depends on every context token, its length and the seed."""
    weights = np.arange(1, len(context) + 1, dtype=np.int64) * 2654435761 % 1000003
    h = (int(np.dot(context.astype(np.int64), weights)) + seed * 97 + len(context) * 31) % 1000003
    return int(h % VOCAB)


class FakeDevice:
    def __init__(self, num_blocks: int, block_size: int, num_slots: int) -> None:
        self.block_size = block_size
        self.cache = np.full((num_blocks, block_size), -1, np.int64)
        self.last = np.full(num_slots, -1, np.int64)

    def run(self, plan: Step, seeds: list[int]) -> np.ndarray:
        self.write(plan)
        return self.sample(plan, seeds)

    def write(self, plan: Step) -> tuple[np.ndarray, np.ndarray]:
        """Resolve pending inputs and write every token id into its block; returns ``(ids, positions)``."""
        n, bs = plan.num_tokens, self.block_size
        seq = plan.token_seq[:n]
        ids = plan.token_ids[:n].astype(np.int64)
        pending = ids == PENDING_TOKEN
        ids[pending] = self.last[plan.seq_slots[seq[pending]]]
        assert (ids >= 0).all(), "a pending input had no sampled token in its slot"
        pos = plan.positions[:n]
        blocks = plan.block_tables[seq, pos // bs]
        assert (blocks > 0).all(), "a token was written outside its block table"
        self.cache[blocks, pos % bs] = ids
        return ids, pos

    def sample(self, plan: Step, seeds: list[int]) -> np.ndarray:
        """Each sampling row's token from its whole context read back through its block table."""
        bs = self.block_size
        out = np.zeros(plan.padded_seqs, np.int32)
        for s in range(plan.num_seqs):
            if not plan.sample[s]:
                continue
            p = np.arange(plan.context_lens[s])
            context = self.cache[plan.block_tables[s, p // bs], p % bs]
            assert (context >= 0).all(), "the context reads a cache entry no step wrote"
            out[s] = next_token(context, seeds[s])
            self.last[plan.seq_slots[s]] = out[s]
        return out


@dataclasses.dataclass
class Spec:
    prompt: list[int]
    params: SamplingParams
    seed: int
    arrival: int


def reference(
    spec: Spec, *, max_model_len: int, capacity_blocks: int, block_size: int
) -> tuple[str, list[int]]:
    """(finish reason, tokens) of a request generated alone, straight from the issue's stop rules."""
    p = spec.params
    longest = min(len(spec.prompt) + p.max_tokens, max_model_len)
    if blocks_for_tokens(longest - 1, block_size) > capacity_blocks:
        return "error", []
    tokens, out = list(spec.prompt), []
    while True:
        t = next_token(np.array(tokens), spec.seed)
        out.append(t)
        tokens.append(t)
        n = len(out)
        if n >= p.min_tokens and ((not p.ignore_eos and t == EOS) or t in p.stop_token_ids):
            return "stop", out
        if n >= p.max_tokens or len(tokens) >= max_model_len:
            return "length", out


@st.composite
def scenarios(draw: st.DrawFn) -> dict:
    max_model_len = draw(st.integers(4, 24))
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_num_seqs = draw(st.integers(1, 6))
    budget = draw(st.integers(1, 12))
    config = {
        # A cache of about 0.5x to 2x one request's longest context: most requests fit alone, a few never
        # do, and several at once run it dry (preemption).
        "num_blocks": 1 + max(1, -(-max_model_len * draw(st.integers(5, 20)) // (10 * block_size))),
        "block_size": block_size,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": budget,
        "max_model_len": max_model_len,
        "vocab_size": VOCAB,
        "eos_token_ids": (EOS,),
        "num_state_slots": draw(st.none() | st.integers(2, 6)),
    }
    if draw(st.booleans()):
        config["buckets"] = [(1, 1), (4, 2), (budget, min(max_num_seqs, budget))]
        if draw(st.booleans()):
            config["buckets"] += [(2, 2), (8, min(max_num_seqs, 8))]
            config["buckets"] = [(t, s) for t, s in config["buckets"] if t <= budget]
    # 0 never shortens a step for its bucket; 1 shortens every step that does not fill its bucket exactly.
    config["min_bucket_fill"] = draw(st.sampled_from([0.0, 0.5, 1.0]))
    # Under pressure every request runs to its longest length, all at once: the cache runs dry.
    pressure = draw(st.booleans())
    specs = []
    for _ in range(draw(st.integers(1, 10))):
        prompt_len = draw(st.integers(1, max_model_len - 1))
        most = max_model_len - prompt_len
        max_tokens = most if pressure else draw(st.integers(1, most))
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=draw(st.integers(0, max_tokens)),
            ignore_eos=pressure or draw(st.booleans()),
            stop_token_ids=[] if pressure else draw(st.lists(st.integers(0, VOCAB - 1), max_size=2)),
        )
        prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=prompt_len, max_size=prompt_len))
        arrival = 0 if pressure else draw(st.integers(0, 4))
        specs.append(Spec(prompt, params, draw(st.integers(0, 2**64 - 1)), arrival))
    return {"config": config, "specs": specs, "depth": draw(st.sampled_from([0, 1, 2]))}


def check_invariants(sched: OneDevice, plan: Step, num_decodes: int) -> None:
    plan.validate(block_size=sched.block_size)
    assert plan.num_tokens <= sched.max_num_batched_tokens and plan.num_seqs <= sched.max_num_seqs
    assert plan.bucket in sched.buckets
    # The bucket is well filled, unless no smaller bucket holding these rows could have been filled by cutting
    # prefill tokens (decode tokens are never cut, and one prefill token at least stays).
    if plan.num_tokens < sched.min_bucket_fill * plan.bucket[0]:
        assert not any(num_decodes < t < plan.num_tokens and s >= plan.num_seqs for t, s in sched.buckets), (
            "a step was padded although a smaller bucket could have been filled"
        )
    running = list(sched._running)
    assert len(running) <= sched.max_num_seqs
    owned = [b for r in running for b in r.block_ids]
    assert len(owned) == len(set(owned)) == sched.blocks.num_allocated, "a block is leaked or shared"
    slots = [r.slot for r in running]
    assert len(slots) == len(set(slots)) == sched.slots.num_allocated and min(slots, default=1) >= 1
    assert all(not r.block_ids and r.slot == -1 for r in sched._waiting)
    sched.blocks.check_consistency()
    sched.slots.check_consistency()
    for i, req in enumerate(plan.requests):
        table = plan.block_tables[i]
        assert (
            table[: len(req.block_ids)].tolist() == req.block_ids
            and (table[len(req.block_ids) :] == -1).all()
        )


def drive(config: dict, specs: list[Spec], depth: int) -> tuple[OneDevice, dict[str, RequestOutput]]:
    """Run every request to the end with up to ``depth`` steps in flight beyond the one being processed."""
    sched = OneDevice(**config)
    device = FakeDevice(config["num_blocks"], config["block_size"], sched.slots.size)
    arrivals = sorted(range(len(specs)), key=lambda i: specs[i].arrival)
    in_flight: collections.deque[tuple[Step, np.ndarray]] = collections.deque()
    results: dict[str, RequestOutput] = {}

    def collect(outputs: list[RequestOutput]) -> None:
        for out in outputs:
            assert out.finished and out.request_id not in results, "a request finished twice"
            results[out.request_id] = out

    step = 0
    while arrivals or sched.has_unfinished_requests() or in_flight:
        assert step < STEP_LIMIT, "the scheduler made no progress"
        while arrivals and specs[arrivals[0]].arrival <= step:
            i = arrivals.pop(0)
            sched.add_request(str(i), specs[i].prompt, specs[i].params, seed=specs[i].seed)
        decodes = sched.stats.num_decode_tokens
        plan = sched.schedule()
        if plan is not None:
            check_invariants(sched, plan, sched.stats.num_decode_tokens - decodes)
            in_flight.append((plan, device.run(plan, [r.seed for r in plan.requests])))
        if in_flight and (len(in_flight) > depth or plan is None):
            done, tokens = in_flight.popleft()
            collect(sched.process_outputs(done, tokens))
        else:
            if plan is None and not arrivals:
                assert not sched.num_running and not sched.num_waiting, "work is left but nothing runs"
            collect(sched.take_ready_outputs())
        step += 1
    return sched, results


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_every_request_finishes_with_its_solo_tokens_and_nothing_leaks(scenario: dict) -> None:
    config, specs = scenario["config"], scenario["specs"]
    sched, results = drive(config, specs, scenario["depth"])
    assert sorted(results, key=int) == [str(i) for i in range(len(specs))]
    capacity = min(config["num_blocks"] - 1, sched.max_blocks_per_seq)
    for i, spec in enumerate(specs):
        reason, tokens = reference(
            spec,
            max_model_len=config["max_model_len"],
            capacity_blocks=capacity,
            block_size=config["block_size"],
        )
        completion = results[str(i)].outputs[0]
        assert (completion.finish_reason, completion.token_ids) == (reason, tokens), (i, spec)
        assert (completion.error is not None) == (reason == "error")
        assert results[str(i)].metrics.num_generated_tokens == len(tokens)
    assert sched.blocks.num_free == sched.blocks.capacity and sched.slots.num_free == sched.slots.capacity
    assert sched.num_in_flight == 0 and not sched.has_unfinished_requests()


def test_forced_preemption_and_async_steps_keep_every_token() -> None:
    """A fixed hard case: a cache of 5 two-token blocks for 6 long requests, two steps in flight."""
    config = {
        "num_blocks": 6,
        "block_size": 2,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 5,
        "max_model_len": 12,
        "vocab_size": VOCAB,
        "eos_token_ids": (EOS,),
    }
    specs = [
        Spec([2 + i % 5] * (1 + i % 3), SamplingParams(max_tokens=8, ignore_eos=True), seed=i, arrival=i // 2)
        for i in range(6)
    ]
    sched, results = drive(config, specs, depth=2)
    assert sched.stats.num_preemptions > 0
    for i, spec in enumerate(specs):
        expected = reference(spec, max_model_len=12, capacity_blocks=5, block_size=2)
        assert (results[str(i)].outputs[0].finish_reason, results[str(i)].outputs[0].token_ids) == expected
    assert sched.blocks.num_free == sched.blocks.capacity
