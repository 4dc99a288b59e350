"""Prefix caching in the scheduler over random scenarios, driven by a fake device with blocks *and* state rings.

The fake device of ``test_engine_scheduler_props.py`` keeps a token-id "KV cache" in the planned blocks; this one
also keeps, per state slot, a ring of the last ``R`` token ids (position ``q`` at ``q % R``), the per-sequence
state V4 / V4.1 keep outside the blocks. It applies each step's slot copies and snapshot writes as the real step
does, and every token asserts that the ring entries it would read (positions ``q - R + 1 .. q - 1`` before its
row's first token) hold the sequence's tokens: a hit that restored no snapshot, or a wrong one, fails there.
Sampling reads the whole context back through the block table, so a hit that shares a wrong block changes the
tokens, which are compared with each request generated alone (cache off). Prompts share prefixes so that hits
happen, also while the source request is still running and after its blocks were evicted or preempted.
"""

from __future__ import annotations

import collections

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from one_device import OneDevice, Step  # tests/engine/one_device.py
from test_engine_scheduler_props import EOS, VOCAB, FakeDevice, Spec, reference

from deepinfer_jax.cache.prefix import block_keys
from deepinfer_jax.engine.params import RequestOutput, SamplingParams
from deepinfer_jax.engine.scheduler import PrefixCacheOptions

STEP_LIMIT = 3000
SALT = b"test-salt"


class RingDevice(FakeDevice):
    def __init__(self, num_blocks: int, block_size: int, num_slots: int, ring: int) -> None:
        super().__init__(num_blocks, block_size, num_slots)
        self.ring = ring
        self.rings = np.full((num_slots, ring), -1, np.int64)
        self.ring_pos = np.full((num_slots, ring), -1, np.int64)  # which position each entry holds

    def run(self, plan: Step, seeds: list[int]) -> np.ndarray:
        inputs = plan.plan.inputs
        batch = plan.plan.batches[0]
        # The host tier's transfers come first: saves read the device before anything writes, then loads.
        for entry, block, slot in batch.host_saves:
            if block >= 0:
                entry.store(self.cache[block].copy())
            else:
                entry.store((self.rings[slot].copy(), self.ring_pos[slot].copy()))
        for entry, block, slot in batch.host_loads:
            if block >= 0:
                self.cache[block] = entry.numpy()
            else:
                self.rings[slot], self.ring_pos[slot] = entry.numpy()
        if inputs.copies is not None:
            src, dst = inputs.copies.block_src[0], inputs.copies.block_dst[0]
            for a, b in zip(src, dst, strict=True):
                if b >= 0:
                    self.cache[b] = self.cache[a]
            src, dst = inputs.copies.slot_src[0], inputs.copies.slot_dst[0]
            pairs = [(a, b) for a, b in zip(src, dst, strict=True) if b >= 0]
            assert len({b for _, b in pairs}) == len(pairs), "two copies share a destination"
            assert not {b for _, b in pairs} & {a for a, _ in pairs}, "a copy destination is also a source"
            for a, b in pairs:
                self.rings[b], self.ring_pos[b], self.last[b] = self.rings[a], self.ring_pos[a], self.last[a]
        bs, r = self.block_size, self.ring
        ids, pos = self.write(plan)
        starts = plan.query_start
        for s in range(plan.num_seqs):
            lo, hi = int(starts[s]), int(starts[s + 1])
            first = int(pos[lo])
            slot = int(plan.seq_slots[s])
            # What the row's tokens read from the slot's ring: the positions before the row, within R.
            for q in range(max(first - r + 1, 0), first):
                assert self.ring_pos[slot, q % r] == q, f"row {s}: the ring lost position {q}"
                expect = self.cache[plan.block_tables[s, q // bs], q % bs]
                assert self.rings[slot, q % r] == expect, f"row {s}: the ring holds a wrong token at {q}"
        snaps = inputs.snapshots
        if snaps is not None:
            for row, h, slot in snaps[0].T:
                if slot < 0:
                    continue
                lo, hi = int(starts[row]), int(starts[row + 1])
                first = int(pos[lo])
                assert first < h <= int(pos[hi - 1]) + 1, "a snapshot boundary outside its row"
                for q in range(max(h - r, first), h):
                    self.rings[slot, q % r] = ids[lo + q - first]
                    self.ring_pos[slot, q % r] = q
        for s in range(plan.num_seqs):
            lo, hi = int(starts[s]), int(starts[s + 1])
            slot = int(plan.seq_slots[s])
            for t in range(max(lo, hi - r), hi):
                self.rings[slot, pos[t] % r] = ids[t]
                self.ring_pos[slot, pos[t] % r] = pos[t]
        return self.sample(plan, seeds)


def check_invariants(
    sched: OneDevice, plan: Step, device: RingDevice, truth: dict[bytes, np.ndarray]
) -> None:
    plan.validate(block_size=sched.block_size)
    pool = sched.blocks
    pool.check_consistency()  # no block both free and cached, no negative refcount, nothing lost
    sched.slots.check_consistency()
    running = list(sched._running)
    owners = collections.Counter(b for r in running for b in r.block_ids)
    for b, count in owners.items():
        assert pool.refcount(b) == count, f"block {b}: refcount {pool.refcount(b)}, {count} owners"
    assert sum(owners.values()) == sum(pool.refcount(b) for b in range(pool.size))
    if sched.snapshots is not None:
        pending = [s for r in sched._requests.values() for s in r.snapshots.values()]
        sched.snapshots.check_consistency(pending)
    # Every cached block holds what its key says (the device has run every step planned so far).
    for key, block in pool._block_of.items():
        assert (device.cache[block] == truth[key]).all(), "a cached block's content differs from its key"


@st.composite
def scenarios(draw: st.DrawFn) -> dict:
    block_size = draw(st.sampled_from([2, 4]))
    max_model_len = draw(st.integers(10, 28))
    max_num_seqs = draw(st.integers(1, 5))
    budget = draw(st.integers(2, 12))
    config = {
        "num_blocks": 1 + max(2, -(-max_model_len * draw(st.integers(6, 30)) // (10 * block_size))),
        "block_size": block_size,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": budget,
        "max_model_len": max_model_len,
        "vocab_size": VOCAB,
        "eos_token_ids": (EOS,),
        "min_bucket_fill": draw(st.sampled_from([0.0, 0.5])),
    }
    snapshots = draw(st.booleans())
    snap_slots = draw(st.integers(1, 4)) if snapshots else 0
    config["num_state_slots"] = max_num_seqs + 1 + snap_slots
    config["prefix_cache"] = PrefixCacheOptions(
        salt=SALT,
        snapshots=snapshots,
        snapshot_slots=snap_slots,
        snapshots_per_step=draw(st.integers(1, 3)),
        copies_per_step=4,
        # A host tier of a few entries (each block or snapshot counts 1 here) that expire after some steps.
        host_memory=draw(st.sampled_from([0, 3, 12, 40])),
        host_ttl_s=draw(st.sampled_from([5.0, 1e9])),
        block_bytes=1,
        slot_bytes=1,
    )
    # A few shared stems, each request one of them plus its own tail.
    stems = [
        draw(st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=max_model_len - 2)) for _ in range(2)
    ]
    specs = []
    for _ in range(draw(st.integers(2, 9))):
        stem = draw(st.sampled_from(stems))
        tail = draw(st.lists(st.integers(0, VOCAB - 1), max_size=4))
        prompt = (stem + tail)[: max_model_len - 1]
        most = max_model_len - len(prompt)
        params = SamplingParams(max_tokens=draw(st.integers(1, most)), ignore_eos=draw(st.booleans()))
        specs.append(Spec(prompt, params, draw(st.integers(0, 2**32)), draw(st.integers(0, 6))))
    ring = draw(st.integers(1, 2 * block_size + 1)) if snapshots else 1
    return {"config": config, "specs": specs, "depth": draw(st.sampled_from([0, 1])), "ring": ring}


def drive(scenario: dict) -> tuple[OneDevice, dict[str, RequestOutput]]:
    config, specs, depth = scenario["config"], scenario["specs"], scenario["depth"]
    clock = [0.0]
    sched = OneDevice(**config, clock=lambda: clock[0])
    device = RingDevice(
        config["num_blocks"], config["block_size"], config["num_state_slots"], scenario["ring"]
    )
    arrivals = sorted(range(len(specs)), key=lambda i: specs[i].arrival)
    in_flight: collections.deque[tuple[Step, np.ndarray]] = collections.deque()
    results: dict[str, RequestOutput] = {}
    truth: dict[bytes, np.ndarray] = {}
    bs = config["block_size"]

    def learn(tokens: list[int]) -> None:
        for i, key in enumerate(block_keys(np.array(tokens), bs, salt=SALT)):
            truth[key] = np.array(tokens[i * bs : (i + 1) * bs])

    step = 0
    while arrivals or sched.has_unfinished_requests() or in_flight:
        assert step < STEP_LIMIT, "the scheduler made no progress"
        while arrivals and specs[arrivals[0]].arrival <= step:
            i = arrivals.pop(0)
            sched.add_request(str(i), specs[i].prompt, specs[i].params, seed=specs[i].seed)
        for req in sched._requests.values():
            learn(list(req.all_token_ids()))
        plan = sched.schedule()
        if plan is not None:
            in_flight.append((plan, device.run(plan, [r.seed for r in plan.requests])))
            check_invariants(sched, plan, device, truth)
        if in_flight and (len(in_flight) > depth or plan is None):
            done, tokens = in_flight.popleft()
            for out in sched.process_outputs(done, tokens):
                results[out.request_id] = out
                learn(out.prompt_token_ids + out.outputs[0].token_ids)
            for req in sched._requests.values():
                learn(list(req.all_token_ids()))
        else:
            for out in sched.take_ready_outputs():
                results[out.request_id] = out
        step += 1
        clock[0] = float(step)
    return sched, results


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_prefix_hits_keep_every_request_its_solo_tokens(scenario: dict) -> None:
    config, specs = scenario["config"], scenario["specs"]
    sched, results = drive(scenario)
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
    # Nothing is owned once every request ended; cached blocks stay resident (free to allocate).
    assert sched.blocks.num_free == sched.blocks.capacity and sched.slots.num_free == sched.slots.capacity
    assert all(sched.blocks.refcount(b) == 0 for b in range(sched.blocks.size))
    sched.blocks.check_consistency()


def _hits_scenario(snapshots: bool, **host: float) -> dict:
    config = {
        "num_blocks": 40,
        "block_size": 4,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 8,
        "max_model_len": 40,
        "vocab_size": VOCAB,
        "eos_token_ids": (EOS,),
        "num_state_slots": 4 + 1 + 8,
        "prefix_cache": PrefixCacheOptions(
            salt=SALT,
            snapshots=snapshots,
            snapshot_slots=8,
            snapshots_per_step=2,
            copies_per_step=4,
            block_bytes=1,
            slot_bytes=1,
            **host,
        ),
    }
    stem = [3, 4, 5, 6, 7, 8, 9, 10, 11, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # 4.5 blocks
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    specs = [
        Spec([*stem, 2], params, 1, 0),
        Spec([*stem, 3, 4], params, 2, 3),
        Spec(stem[:16], params, 3, 30),
    ]
    return {"config": config, "specs": specs, "depth": 1, "ring": 5 if snapshots else 1}


def test_hits_are_counted_and_skip_the_cached_prefill() -> None:
    """A hit while the first request still runs, at the last boundary with a snapshot (or block, for V3's
    caches), and a prompt of exactly four blocks that recomputes its last block (the last token must be
    computed to sample)."""
    for snapshots in (False, True):
        scenario = _hits_scenario(snapshots)
        sched, results = drive(scenario)
        cached = [results[str(i)].num_cached_tokens for i in range(3)]
        # Request 1 arrives while request 0 runs: 16 of its 18 shared tokens sit in full blocks of request 0.
        assert cached[0] == 0 and cached[1] == 16, cached
        assert cached[2] == 12, cached  # a 16-token prompt: its last block is computed again
        st = sched.stats
        assert st.prefix_cache_hits == 28 and st.prefix_cache_queries == 19 + 20 + 16
        assert (st.num_snapshot_restores > 0) == snapshots
        for i, spec in enumerate(scenario["specs"]):
            expected = reference(spec, max_model_len=40, capacity_blocks=39, block_size=4)
            assert (
                results[str(i)].outputs[0].finish_reason,
                results[str(i)].outputs[0].token_ids,
            ) == expected


def test_reset_prefix_cache_forgets_everything() -> None:
    scenario = _hits_scenario(True)
    sched, _ = drive(scenario)
    assert sched.blocks.num_cached > 0 and sched.snapshots.num_cached > 0
    assert sched.engine.reset_prefix_cache()
    assert sched.blocks.num_cached == 0 and sched.snapshots.num_cached == 0
    sched.blocks.check_consistency()
    sched.snapshots.check_consistency()


def test_blocks_and_snapshots_come_back_from_the_host_tier() -> None:
    """A device cache of 11 blocks: fillers evict the stem's blocks (and snapshots) to the host tier; a later
    request of the stem loads them back (counted), and every request still gets its solo tokens. With a TTL
    shorter than the fillers take, the entries expire and nothing comes back."""
    for snapshots in (False, True):
        for ttl, back in ((1e9, True), (3.0, False)):
            scenario = _hits_scenario(snapshots, host_memory=64, host_ttl_s=ttl)
            config = scenario["config"]
            config["num_blocks"] = 12
            stem = scenario["specs"][0].prompt[:-1]
            params = SamplingParams(max_tokens=3, ignore_eos=True)
            fillers = [
                Spec([2 + (i + j) % 9 for j in range(13)], params, 10 + i, 1 + 2 * i) for i in range(6)
            ]
            scenario["specs"] = [Spec([*stem, 2], params, 1, 0), *fillers, Spec([*stem, 5, 6], params, 2, 60)]
            sched, results = drive(scenario)
            last = results[str(len(scenario["specs"]) - 1)]
            assert (sched.stats.prefix_cache_host_hits > 0) == back, (snapshots, ttl)
            assert (last.num_cached_tokens == 16) == back, last.num_cached_tokens
            for i, spec in enumerate(scenario["specs"]):
                expected = reference(spec, max_model_len=40, capacity_blocks=11, block_size=4)
                got = results[str(i)].outputs[0]
                assert (got.finish_reason, got.token_ids) == expected
