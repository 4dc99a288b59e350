"""What only a mesh has: the router, the parameter layout, the collectives, and runs over two processes.

The engine runs one path on every mesh (tests/engine/test_engine_families.py checks every behaviour on one
device and on ``dp=2 x ep=4``). This file checks the parts a mesh adds: requests spread over the devices by the
deterministic router, routed experts sharded over ``ep`` while everything else is replicated, the step's only
collectives being the MoE exchanges within each EP group (and none at all on one device), the memory plan per
device, the refusals, and a mesh that spans two processes.

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

from deepinfer_jax.engine.llm import LLM, device_share
from deepinfer_jax.engine.params import SamplingParams
from deepinfer_jax.engine.plan import DeviceBatch, build_plan
from deepinfer_jax.engine.runner import EngineRunner
from deepinfer_jax.engine.scheduler import Scheduler, route
from deepinfer_jax.engine.step import step
from deepinfer_jax.parallel import slot_expert_layers

COMMON = {"dtype": "float32", "kv_cache_memory": "8MiB", "cache.block_size": 16}


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
    schedulers = llm.scheduler.devices
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


def _lowered_placeholder_step(llm: LLM, params=None):
    """The step of ``llm``'s executor lowered for a (16, S) plan in which every device runs a placeholder."""
    ex = llm.executor
    sched = llm.scheduler
    batches = [DeviceBatch(())] * sched.num_devices
    plan = build_plan(
        batches, buckets=sched.buckets, max_blocks_per_seq=sched.max_blocks_per_seq, vocab_size=ex.vocab_size
    )
    return jax.jit(step, static_argnames=("mesh", "model")).lower(
        ex.params if params is None else params, ex.cache, ex.state, plan.inputs, mesh=ex.mesh, model=ex.model
    )


def test_moe_layers_talk_only_within_their_ep_group():
    """The step's only collectives are the MoE dispatch/combine all_to_alls, each over the ``ep`` axis:
    attention, norms and heads run on each device's own tokens, and no parameter is gathered."""
    text = _lowered_placeholder_step(_llm(2, 4)).as_text()
    exchanges = [line for line in text.splitlines() if "stablehlo.all_to_all" in line]
    assert exchanges
    assert all('axes = [#stablehlo.axis_ref<name = "ep">]' in line for line in exchanges)
    for other in ("all_gather", "all_reduce", "collective_permute", "reduce_scatter"):
        assert other not in text, other


def test_one_device_is_the_mesh_of_one_without_collectives():
    """One device runs the same scheduler, plan, executor, step and runner on the (1, 1) mesh; its experts are
    not laid out in slots, so the lowered step has no collective at all."""
    llm = _llm(1, 1)
    assert dict(llm.mesh.shape) == {"dp": 1, "ep": 1} and llm.scheduler.num_devices == 1
    assert isinstance(llm.runner, EngineRunner) and llm.expert_balancer is None
    assert not slot_expert_layers(llm.model.params)
    text = _lowered_placeholder_step(llm).as_text()
    for op in ("all_to_all", "all_gather", "all_reduce", "collective_permute", "reduce_scatter"):
        assert op not in text, op


def test_mismatched_pieces_are_refused():
    mesh_llm, other = _llm(2, 4), _llm(1, 8)
    with pytest.raises(ValueError, match="a scheduler of 2 devices for a mesh of 8 devices"):
        EngineRunner(Scheduler(num_devices=2, **_SCHEDULER), mesh_llm.executor)
    with pytest.raises(ValueError, match=r"laid out for mesh \{'dp': 1, 'ep': 8\}"):
        _lowered_placeholder_step(mesh_llm, params=other.executor.params)


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

_SCHEDULER = {
    "num_blocks": 64,
    "block_size": 4,
    "max_num_seqs": 2,
    "max_num_batched_tokens": 32,
    "max_model_len": 64,
    "vocab_size": 100,
    "buckets": [(16, 2), (32, 2)],
}


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
    sched = Scheduler(num_devices=devices, **_SCHEDULER)
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    for i, n in enumerate(lengths):
        loads = sched.loads()
        device = sched.add_request(f"r{i}", list(range(1, n + 1)), greedy, seed=i)
        # The chosen device had the fewest sequences, and the fewest tokens among those.
        assert loads[device][0] == min(s for s, _ in loads)
        assert loads[device][1] == min(t for s, t in loads if s == loads[device][0])
        assert sched.device_of(f"r{i}") == device
    counts = [s for s, _ in sched.loads()]
    assert max(counts) - min(counts) <= 1 and sum(counts) == len(lengths)
    assert sum(t for _, t in sched.loads()) == sum(lengths)


def test_scheduler_refuses_a_repeated_request_id():
    sched = Scheduler(num_devices=2, **_SCHEDULER)
    sched.add_request("a", [1, 2], SamplingParams(max_tokens=2), seed=0)
    with pytest.raises(ValueError, match="'a' is already queued"):
        sched.add_request("a", [1, 2], SamplingParams(max_tokens=2), seed=0)
    with pytest.raises(ValueError, match="num_devices = 0 must be >= 1"):
        Scheduler(num_devices=0, **_SCHEDULER)


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


def test_structured_outputs_on_the_mesh_equal_one_device():
    """Constrained requests spread over the dp=2 x ep=4 mesh by the router (eight requests, eight devices; each
    device fills the masks of its own rows)
    give the one-device engine's tokens, greedy: a JSON schema, a regex, a choice, with a free request among
    them; every JSON answer that stops validates."""
    import jsonschema

    from deepinfer_jax import StructuredOutputsParams as SO

    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "c": {"enum": ["x", "y"]}},
        "required": ["n", "c"],
        "additionalProperties": False,
    }
    kinds = [SO(json=schema), SO(regex=r"[0-9]{3}-[a-z]{2}"), SO(choice=["alpha", "beta"]), None] * 2
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so) for so in kinds]
    prompts = [np.random.default_rng(40 + i).integers(2, 512, 5 + 3 * i).tolist() for i in range(len(kinds))]
    outs = {
        n: _llm(*mesh).generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        for n, mesh in (("mesh", (2, 4)), ("one", (1, 1)))
    }
    for so, a, b in zip(kinds, outs["mesh"], outs["one"], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        c = a.outputs[0]
        if so is not None and so.json is not None and c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), schema)
        elif so is not None and so.choice is not None:
            assert c.text in ("alpha", "beta")
