"""The engine on a (dp, ep) mesh of the 8 virtual CPU devices against the one-device engine.

``LLM(data_parallel_size=dp, expert_parallel_size=ep)`` runs a scheduler per device behind a router and one
global step under ``shard_map`` (engine/multi_device.py). The one-device ``LLM`` of the same model is the
reference: greedy tokens must be identical, and so must seeded samples (their random numbers are keyed by the
request's seed and the token's position, never by the device). Logprobs may differ in the last bits: the
expert-parallel MoE runs the same float32 arithmetic per row, but XLA:CPU blocks a GEMM differently for a
different number of rows per expert (tests/parallel/test_par_models.py measured 4.6e-6 on logits up to 4 in
magnitude), so logprobs are compared with ``atol = 1e-4``, twenty times that.

Budgets: ``max_num_seqs = 16`` and ``max_num_batched_tokens = 256`` of the whole LLM give each of 8 devices 2
sequences and 32 tokens per step, two compiled buckets ``(16, 2)`` and ``(32, 2)``; prompts up to 40 tokens
are prefilled over several steps, and devices whose plans need different buckets meet in one global step.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec
from two_processes import run_two_processes  # tests/two_processes.py

from deepinfer_jax.engine.llm import LLM
from deepinfer_jax.engine.multi_device import (
    MeshRunner,
    MeshScheduler,
    MeshStepExecutor,
    device_inputs,
    device_share,
    mesh_step,
    route,
)
from deepinfer_jax.engine.params import SamplingParams
from deepinfer_jax.engine.plan import StepPlan
from deepinfer_jax.engine.scheduler import Scheduler
from deepinfer_jax.engine.step import StepExecutor
from deepinfer_jax.parallel import slot_expert_layers
from deepinfer_jax.sampling import SamplingTensors

LOGPROB_TOL = {"rtol": 0.0, "atol": 1e-4}
COMMON = {"dtype": "float32", "kv_cache_memory": "8MiB", "cache.block_size": 16}
MESHES = [(2, 4), (1, 8)]


@functools.cache
def _llm(dp: int, ep: int) -> LLM:
    if dp * ep == 1:
        # One bucket (16, 4): the reference compiles once.
        return LLM("tiny-v3", max_num_seqs=4, max_num_batched_tokens=16, **COMMON)
    return LLM(
        "tiny-v3",
        data_parallel_size=dp,
        expert_parallel_size=ep,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        **COMMON,
    )


def _batch(n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(2, 512, int(rng.integers(1, 41))).tolist() for _ in range(n)]
    params = []
    for i in range(n):
        if i % 4 == 3:  # a seeded sampled row among greedy ones
            p = SamplingParams(temperature=0.8, top_k=40, max_tokens=5, seq_seed=1000 + i, logprobs=2)
        else:
            p = SamplingParams(temperature=0.0, max_tokens=3 + i % 5, ignore_eos=True, logprobs=2)
        params.append(p)
    return prompts, params


# Eleven requests: more than the 8 devices (three devices run two). Three: fewer (five devices idle).
BATCHES = {"11-requests": (11, 5), "3-requests": (3, 6)}


@functools.cache
def _generate(dp: int, ep: int, batch: str):
    prompts, params = _batch(*BATCHES[batch])
    llm = _llm(dp, ep)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return outputs, llm.last_stats


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("dp,ep", MESHES, ids=[f"dp{dp}-ep{ep}" for dp, ep in MESHES])
def test_mesh_generates_what_one_device_generates(dp, ep, batch):
    want, _ = _generate(1, 1, batch)
    got, stats = _generate(dp, ep, batch)
    assert [o.request_id for o in got] != [] and len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        gc, wc = g.outputs[0], w.outputs[0]
        assert g.prompt_token_ids == w.prompt_token_ids, i
        assert gc.token_ids == wc.token_ids, f"request {i}"
        assert gc.finish_reason == wc.finish_reason, i
        assert [sorted(e) for e in gc.logprobs] == [sorted(e) for e in wc.logprobs], i
        got_lp = [e[t].logprob for t, e in zip(gc.token_ids, gc.logprobs)]
        want_lp = [e[t].logprob for t, e in zip(wc.token_ids, wc.logprobs)]
        np.testing.assert_allclose(got_lp, want_lp, **LOGPROB_TOL)
    assert stats.dp == dp and stats.ep == ep
    if batch == "3-requests":
        # Five devices had nothing to run: each step gave them an all-padding placeholder plan.
        assert stats.placeholder_plans >= 5 * stats.steps
    assert f"on 8 devices (dp={dp} x ep={ep}" in stats.summary(len(got))


V4_KW = {"dtype": "float32", "kv_cache_memory": "32MiB"}


@functools.cache
def _one_device_greedy(name: str) -> tuple[list[list[int]], list[list[int]]]:
    prompts, _ = _batch(5, 9)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    one = LLM(name, max_num_seqs=4, max_num_batched_tokens=16, **V4_KW)
    outs = one.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("dp,ep", MESHES, ids=[f"dp{dp}-ep{ep}" for dp, ep in MESHES])
@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
def test_v4_families_on_the_mesh(name, dp, ep):
    """The mesh step is family-agnostic: V4 and V4.1 (window rings and compression state in state slots, hash
    and score routing, V4.1's drafter layers with their own 4-expert placement) give the one-device tokens on
    dp=2, ep=4 and dp=1, ep=8, five requests on eight devices, with EPLB re-placing the experts (hash-routed
    layers included) every other step. One bucket each ((16, 4) and, per device, (16, 2)): a compile of
    V4/V4.1 takes tens of seconds on 2 cores, hence slow."""
    prompts, want = _one_device_greedy(name)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    eplb = {
        "parallel.eplb_interval_steps": 2,
        "parallel.eplb_window_steps": 2,
        "parallel.eplb_num_redundant_experts": ep,
    }
    mesh = LLM(
        name,
        data_parallel_size=dp,
        expert_parallel_size=ep,
        max_num_seqs=16,
        max_num_batched_tokens=128,
        **eplb,
        **V4_KW,
    )
    got = mesh.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    stats = mesh.last_stats
    assert stats.placeholder_plans > 0 and stats.eplb_rearrangements >= 1
    assert stats.compile_count == len(mesh.executor.compiled_buckets)


def test_prompt_logprobs_on_the_mesh():
    """Prompt logprobs come back from each device's slice of the step: two requests on two devices (the other
    six run placeholders with no targets) match the one-device engine."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(2, 512, n).tolist() for n in (9, 14)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    want = _llm(1, 1).generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    got = _llm(1, 8).generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for g, w, prompt in zip(got, want, prompts):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.prompt_logprobs[0] is None and len(g.prompt_logprobs) == len(prompt)
        for pos, (ge, we) in enumerate(zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]), start=1):
            assert prompt[pos] in ge and sorted(ge) == sorted(we), pos
            assert [ge[t].rank for t in sorted(ge)] == [we[t].rank for t in sorted(we)], pos
            np.testing.assert_allclose(
                [ge[t].logprob for t in sorted(ge)], [we[t].logprob for t in sorted(we)], **LOGPROB_TOL
            )


def _expected_assignment(prompts: list[list[int]], devices: int) -> list[int]:
    """The routing rule, replayed independently: all requests are added before any step, so a device's load
    is (requests so far, their prompt tokens)."""
    seqs, tokens, owner = [0] * devices, [0] * devices, []
    for prompt in prompts:
        best = sorted(range(devices), key=lambda d: (seqs[d], tokens[d], d))[0]
        seqs[best] += 1
        tokens[best] += len(prompt)
        owner.append(best)
    return owner


def test_router_spreads_a_batch_over_every_device():
    llm = _llm(2, 4)
    schedulers = llm.scheduler.schedulers
    prompts, params = _batch(13, 8)
    before = [s.stats.num_prefill_tokens for s in schedulers]
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    prefilled = [s.stats.num_prefill_tokens - b for s, b in zip(schedulers, before)]
    owner = _expected_assignment(prompts, 8)
    want = [sum(len(p) for p, d in zip(prompts, owner) if d == dev) for dev in range(8)]
    assert sorted(np.bincount(owner, minlength=8).tolist()) == [1, 1, 1, 2, 2, 2, 2, 2]
    # No preemption happens at these sizes, so each device prefilled exactly the prompts routed to it.
    assert prefilled == want
    assert llm.scheduler.loads() == [(0, 0)] * 8  # finished requests no longer load their devices


def test_steady_state_does_not_recompile():
    llm = _llm(2, 4)
    prompts, params = _batch(11, 5)
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)  # every bucket compiled
    compiled = llm.executor.compile_count
    assert llm.executor.compiled_buckets == ((16, 2), (32, 2))
    for seed in (21, 22):
        prompts, params = _batch(9, seed)
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert llm.last_stats.compile_count == 0
    assert llm.executor.compile_count == compiled


def test_layout_and_memory_plan():
    llm = _llm(2, 4)
    assert isinstance(llm.executor, MeshStepExecutor) and isinstance(llm.runner, MeshRunner)
    layers = slot_expert_layers(llm.model.params)
    assert len(layers) == 3  # the two MoE layers of the backbone and the MTP layer's
    for layer in layers.values():
        for leaf in jax.tree.leaves(layer.experts):
            assert leaf.sharding.spec == PartitionSpec("ep", None, None)
            assert leaf.addressable_shards[0].data.shape[0] == layer.num_slots // 4
    embed = llm.model.params["embed"]
    assert embed.sharding.is_fully_replicated and len(embed.sharding.device_set) == 8
    plan = llm.memory_plan
    # The whole LLM's budgets, split over 8 devices: 8 MiB of cache, 16 sequences, 256 tokens per step.
    assert plan.total_budget_bytes == 8 << 20 and plan.budget_bytes == (8 << 20) // 8
    assert (plan.max_num_seqs, plan.max_num_batched_tokens) == (2, 32)
    assert plan.spec.num_slots == 3
    text = plan.describe()
    assert "dp=2 x ep=4 = 8 devices" in text and "8 experts in 8 slots (2 per device)" in text
    assert "KV cache plan: budget 1.0 MiB" in text
    # Each device holds its own cache: the stacked cache's leading axis is spread over the mesh.
    cache = jax.tree.leaves(llm.executor.cache)[0]
    assert cache.shape[0] == 8 and cache.addressable_shards[0].data.shape[0] == 1


def _placeholder_step(ex: MeshStepExecutor) -> tuple:
    """Inputs, sampling and prompt lengths of a (16, 2) step in which every device runs a placeholder."""
    placeholder = device_inputs(None, 16, 2, ex.max_blocks_per_seq)
    greedy = SamplingTensors.build([], [], [], ex.vocab_size, num_rows=2)
    stack = functools.partial(jax.tree.map, lambda *xs: np.stack(xs))
    return stack(*[placeholder] * 8), stack(*[greedy] * 8), np.zeros((8, 2), np.int32)


def test_moe_layers_talk_only_within_their_ep_group():
    """The global step's only collectives are the MoE dispatch/combine all_to_alls, each over the ``ep`` axis:
    attention, norms and heads run on each device's own tokens, and no parameter is gathered."""
    ex = _llm(2, 4).executor
    lowered = jax.jit(mesh_step, static_argnames=("mesh", "model")).lower(
        ex.params, ex.cache, ex.state, *_placeholder_step(ex), mesh=ex.mesh, model=ex.model
    )
    text = lowered.as_text()
    exchanges = [line for line in text.splitlines() if "stablehlo.all_to_all" in line]
    assert exchanges
    assert all('axes = [#stablehlo.axis_ref<name = "ep">]' in line for line in exchanges)
    for other in ("all_gather", "all_reduce", "collective_permute", "reduce_scatter"):
        assert other not in text, other


def test_mismatched_pieces_are_refused():
    mesh_llm, other = _llm(2, 4), _llm(1, 8)
    with pytest.raises(ValueError, match="2 schedulers for a mesh of 8 devices"):
        MeshRunner(MeshScheduler([_scheduler(), _scheduler()]), mesh_llm.executor, vocab_size=512)
    ex = mesh_llm.executor
    step = jax.jit(mesh_step, static_argnames=("mesh", "model"))
    with pytest.raises(ValueError, match=r"laid out for mesh \{'dp': 1, 'ep': 8\}"):
        step.lower(
            other.executor.params, ex.cache, ex.state, *_placeholder_step(ex), mesh=ex.mesh, model=ex.model
        )


def test_one_device_stays_the_single_device_engine():
    llm = _llm(1, 1)
    assert llm.mesh is None
    assert isinstance(llm.executor, StepExecutor) and isinstance(llm.scheduler, Scheduler)
    assert not slot_expert_layers(llm.model.params)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"data_parallel_size": 4, "expert_parallel_size": 4},
            ValueError,
            r"4 \* 4 = 16 devices, but only 8",
        ),
        ({"data_parallel_size": 9}, ValueError, r"9 \* 1 = 9 devices"),
        ({"expert_parallel_size": 0}, ValueError, "expert_parallel_size: must be >= 1, got 0"),
        ({"data_parallel_size": 2.0}, TypeError, "data_parallel_size: expected an int"),
        (
            {"data_parallel_size": 2, "expert_parallel_size": 4, "kv_cache_memory": 300_000},
            ValueError,
            "kv_cache_memory = 300000 B is split over 8 devices: 37500 B each",
        ),
    ],
)
def test_bad_sizes_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        LLM("tiny-v3", dtype="float32", **kwargs)


# ------------------------------------------------------------------------------------------ host-only pieces


def _scheduler(**kw) -> Scheduler:
    args = {
        "num_blocks": 64,
        "block_size": 4,
        "max_num_seqs": 2,
        "max_num_batched_tokens": 32,
        "max_model_len": 64,
        "vocab_size": 100,
        "buckets": [(16, 2), (32, 2)],
    }
    return Scheduler(**{**args, **kw})


def test_device_share():
    assert [device_share(t, 8) for t in (256, 16, 17, 3, 1)] == [32, 2, 3, 1, 1]


def test_route_order():
    assert route([(1, 50), (0, 9), (0, 3), (0, 3)]) == 2  # fewest sequences, then tokens, then index
    assert route([(2, 0), (1, 90), (1, 91)]) == 1
    with pytest.raises(ValueError, match="loads is empty"):
        route([])


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=24),
    devices=st.integers(1, 8),
)
def test_router_keeps_sequences_balanced(lengths, devices):
    mesh = MeshScheduler([_scheduler() for _ in range(devices)])
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    for i, n in enumerate(lengths):
        loads = mesh.loads()
        device = mesh.add_request(f"r{i}", list(range(1, n + 1)), greedy, seed=i)
        # The chosen device had the fewest sequences, and the fewest tokens among those.
        assert loads[device][0] == min(s for s, _ in loads)
        assert loads[device][1] == min(t for s, t in loads if s == loads[device][0])
        assert mesh.device_of(f"r{i}") == device
    counts = [s for s, _ in mesh.loads()]
    assert max(counts) - min(counts) <= 1 and sum(counts) == len(lengths)
    assert sum(t for _, t in mesh.loads()) == sum(lengths)


def test_mesh_scheduler_refuses_mismatched_devices():
    with pytest.raises(ValueError, match="schedulers is empty"):
        MeshScheduler([])
    with pytest.raises(TypeError, match=r"schedulers\[1\] is a str"):
        MeshScheduler([_scheduler(), "s"])
    with pytest.raises(ValueError, match=r"schedulers\[1\]\.buckets"):
        MeshScheduler([_scheduler(), _scheduler(buckets=[(32, 2)])])
    mesh = MeshScheduler([_scheduler(), _scheduler()])
    mesh.add_request("a", [1, 2], SamplingParams(max_tokens=2), seed=0)
    with pytest.raises(ValueError, match="'a' is already queued"):
        mesh.add_request("a", [1, 2], SamplingParams(max_tokens=2), seed=0)


def _as_plan(inputs, num_tokens: int, num_seqs: int, request_ids: tuple[str, ...]) -> StepPlan:
    return StepPlan(*inputs, num_tokens=num_tokens, num_seqs=num_seqs, request_ids=request_ids)


def test_device_inputs_pad_a_plan_and_build_the_placeholder():
    sched = _scheduler()
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    sched.add_request("a", list(range(1, 6)), greedy, seed=0)
    sched.add_request("b", list(range(1, 4)), greedy, seed=1)
    plan = sched.schedule()
    assert plan.bucket == (16, 2) and plan.num_tokens == 8
    padded = device_inputs(plan, 32, 4, 20)
    big = _as_plan(padded, plan.num_tokens, plan.num_seqs, plan.request_ids)
    big.validate(block_size=4)  # every invariant of a plan holds for the padded one
    assert big.bucket == (32, 4) and big.max_blocks_per_seq == 20
    np.testing.assert_array_equal(big.token_ids[:8], plan.token_ids[:8])
    np.testing.assert_array_equal(big.token_seq[8:], 4)  # the plan's own padding moved to the new sentinel
    np.testing.assert_array_equal(big.block_tables[:2, : plan.max_blocks_per_seq], plan.block_tables)

    placeholder = _as_plan(device_inputs(None, 16, 2, 20), 0, 0, ())
    placeholder.validate(block_size=4)
    assert not placeholder.sample.any() and (placeholder.seq_slots == -1).all()
    with pytest.raises(ValueError, match=r"bucket \(16, 2\) does not fit the step's \(16, 1\)"):
        device_inputs(plan, 16, 1, 20)


# ------------------------------------------------------------------------------------------ two processes

WORKER = Path(__file__).with_name("mesh_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize(
    "dp,ep,extra,reads",
    [
        # Each process holds a whole EP group (4 ranks, 12 slots): it needs every expert.
        (2, 4, 4, [set(range(8)), set(range(8))]),
        # One EP group over both processes, one slot per device: process 0 holds experts 0-3 and process 1
        # experts 4-7 (and reads expert 0 once for the stacks' shapes).
        (1, 8, 0, [{0, 1, 2, 3}, {0, 4, 5, 6, 7}]),
    ],
    ids=["dp2-ep4", "dp1-ep8"],
)
def test_two_processes_run_the_mesh_engine(tmp_path, dp, ep, extra, reads):
    """A mesh over 2 processes x 4 devices: each process runs every device's scheduler (the same decisions from
    the same gathered tokens) and the same EPLB re-placements (the same gathered expert counts), reads from the
    checkpoint only the routed experts of its own devices' slots, and both return the one-device engine's
    greedy tokens. On dp=1, ep=8 the MoE's all_to_all crosses the processes."""
    prompts, _ = _batch(*BATCHES["11-requests"])
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = [
        o.outputs[0].token_ids
        for o in _llm(1, 1).generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
    ]
    prompts_path = tmp_path / "prompts.json"
    prompts_path.write_text(json.dumps(prompts))
    outs = [tmp_path / f"out_{pid}.json" for pid in range(2)]
    run_two_processes(
        WORKER, lambda pid, port: (pid, port, dp, ep, extra, prompts_path, outs[pid]), timeout=400
    )
    got = [json.loads(path.read_text()) for path in outs]
    for pid, out in enumerate(got):
        # Each of layer 1's expert tensors (gate, up, down) is read for exactly those experts.
        read = out.pop("experts_read")
        assert len(read) == 3 and all(set(v) == reads[pid] for v in read.values()), (pid, read)
    assert got[0] == got[1]  # tokens, steps, and every EPLB decision
    assert got[0]["tokens"] == want
    assert got[0]["rearrangements"] >= 1
    # The re-placement moved experts (slot weights sent between the processes' devices) and the step ran it.
    initial = [i % 8 for i in range(-(-(8 + extra) // ep) * ep)]
    assert got[0]["placements"]["layers.1.mlp.experts"] != initial
    assert got[0]["laid_out"] == got[0]["placements"]["layers.1.mlp.experts"]
