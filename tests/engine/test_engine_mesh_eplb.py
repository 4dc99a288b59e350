"""EPLB inside the engine loop (engine/mesh_eplb.py) on a dp=2 x ep=4 mesh of the 8 virtual CPU devices.

The routing is skewed by hand: tiny-v3's expert-score correction bias (it only chooses experts, it does not weigh
them) is raised by 10 for experts 0 and 1, so every token of every MoE layer picks exactly those two. With 4
redundant slots the initial placement (slot ``i`` holds expert ``i mod 8``, 3 slots per rank) puts both experts
on rank 0 and one more replica of each on ranks 2 and 3: rank loads ``[N, 0, N/2, N/2]``, imbalance
``max / mean = 2``. Greedy replication gives experts 0 and 1 three replicas each, and placement spreads the six
replicas 2-2-1-1 over the ranks: ``(2N/3) / (N/2) = 4/3`` if replicas shared rows evenly. The engine must
re-place during serving, without compiling anything new, while every request's tokens stay those of the
one-device engine on the same weights.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.config.tree import ParallelConfig
from deepinfer_jax.engine.llm import LLM
from deepinfer_jax.engine.mesh_eplb import MeshExpertBalancer, describe_placement
from deepinfer_jax.engine.params import SamplingParams
from deepinfer_jax.engine.runner import EngineRunner
from deepinfer_jax.engine.step import StepExecutor
from deepinfer_jax.parallel import eplb

COMMON = {"dtype": "float32", "kv_cache_memory": "8MiB", "cache.block_size": 16}
EPLB = {
    "parallel.eplb_interval_steps": 4,
    "parallel.eplb_window_steps": 4,
    "parallel.eplb_num_redundant_experts": 4,
}
LOGPROB_TOL = {"rtol": 0.0, "atol": 1e-4}  # tests/engine/test_engine_families.py says why
TOP_K = 2  # tiny-v3's num_experts_per_tok


def _skewed(params):
    """``params`` with every MoE layer's correction bias raised by 10 for experts 0 and 1."""

    def one(path, x):
        if jax.tree_util.keystr(path, simple=True, separator=".").endswith("mlp.bias"):
            return jax.device_put(
                x + jnp.asarray([10.0, 10.0] + [0.0] * (x.shape[0] - 2), x.dtype), x.sharding
            )
        return x

    return jax.tree_util.tree_map_with_path(one, params)


def _skewed_mesh_llm(**overrides) -> LLM:
    """tiny-v3 on dp=2 x ep=4 (2 sequences, 32 tokens per device and step) with the skewed routing."""
    llm = LLM(
        "tiny-v3",
        data_parallel_size=2,
        expert_parallel_size=4,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        **overrides,
        **COMMON,
    )
    llm.executor.params = _skewed(llm.executor.params)
    return llm


@functools.cache
def _llm(mesh: bool) -> LLM:
    if mesh:
        return _skewed_mesh_llm(**EPLB)
    llm = LLM("tiny-v3", max_num_seqs=4, max_num_batched_tokens=16, **COMMON)
    llm.executor.params = _skewed(llm.executor.params)
    return llm


def _requests(n: int, seed: int):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(2, 512, int(rng.integers(4, 24))).tolist() for _ in range(n)]
    return prompts, SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=1)


def test_eplb_rebalances_the_serving_engine_and_keeps_its_tokens():
    llm = _llm(True)
    balancer = llm.expert_balancer
    assert isinstance(balancer, MeshExpertBalancer) and llm.runner.balancer is balancer
    start = {path: p.slot_to_expert.tolist() for path, p in balancer.placements().items()}
    assert start["layers.1.mlp.experts"] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]

    # Record what every step routed, next to the real tokens of its plan and the placement it ran with.
    seen = []
    process = llm.runner._process

    def recording(plan, step):
        counts = {path: c.sum() for path, c in balancer.split(jax.device_get(step.out.expert_counts)).items()}
        initial = np.asarray(step.snapshot[0][0].slot_to_expert).tolist() == start["layers.1.mlp.experts"]
        tokens = sum(b.num_tokens for b in plan.batches if b is not None)
        seen.append((tokens, counts, plan.is_prefill, initial))
        return process(plan, step)

    llm.runner._process = recording
    try:
        prompts, params = _requests(12, 0)
        got = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    finally:
        del llm.runner._process
    stats = llm.last_stats

    # Counts: each real token sends exactly top-k rows through each backbone MoE layer; padding tokens none.
    # The MTP layer does not run without speculative decoding: zeros.
    assert len(seen) == stats.steps == len(balancer.imbalances)
    for tokens, counts, *_ in seen:
        assert counts == {
            "layers.1.mlp.experts": tokens * TOP_K,
            "layers.2.mlp.experts": tokens * TOP_K,
            "mtp.0.layer.mlp.experts": 0,
        }
    # Prefill-only steps stay out of the window (eplb_after_prefill is off).
    counted = sum(not prefill for _, _, prefill, _ in seen)
    assert 0 < counted < len(seen) and balancer.balancers[0].window.steps_recorded == counted

    # The measured imbalance: 2 with the initial placement; after re-placement at most 5/3 in every step with
    # 12 decode tokens. (The expected 4/3 assumes replicas share an expert's rows evenly; with one or two tokens
    # per device the replica choice of spec/engine.md §11.1, (ep_rank + row * 23333) mod 3, sends two of the
    # four EP ranks' rows to the same replica, and the busiest rank gets 10 of 24 rows.)
    assert stats.eplb_rearrangements >= 2 and balancer.rearrangements == stats.eplb_rearrangements
    before = [imb for (_, _, _, initial), imb in zip(seen, balancer.imbalances) if initial]
    after = [imb for (t, _, _, initial), imb in zip(seen, balancer.imbalances) if not initial and t >= 12]
    assert before and before == pytest.approx([2.0] * len(before), abs=0.15)
    assert len(after) >= 8 and max(after) <= 5 / 3 + 1e-9
    window = balancer.balancers[0].window.loads(0)
    now = balancer.placements()
    assert eplb.expected_imbalance(window, now["layers.1.mlp.experts"], 4) == pytest.approx(4 / 3)
    assert stats.moe_lb < 2.0 - 0.1
    assert f"moe_lb {stats.moe_lb:.3f}, {stats.eplb_rearrangements} expert re-placements" in stats.summary(12)
    for path in ("layers.1.mlp.experts", "layers.2.mlp.experts"):
        count = np.asarray(now[path].replica_count)
        assert count[:2].tolist() == [3, 3] and count[2:].tolist() == [1] * 6
        per_rank = np.isin(np.asarray(now[path].slot_to_expert).reshape(4, 3), [0, 1]).sum(axis=1)
        assert sorted(per_rank.tolist()) == [1, 1, 2, 2]
    assert now["mtp.0.layer.mlp.experts"].slot_to_expert.tolist() == start["mtp.0.layer.mlp.experts"]
    # The step's parameters hold the moved slots: each slot's weights are its new expert's.
    laid = llm.executor.params["layers"][1]["mlp"]["experts"]
    np.testing.assert_array_equal(
        np.asarray(laid.placement.slot_to_expert), now["layers.1.mlp.experts"].slot_to_expert
    )
    # Placement is data: every compilation was a bucket's first use.
    assert stats.compile_count == len(llm.executor.compiled_buckets)

    # The tokens are the one-device engine's on the same skewed weights.
    want = _llm(False).generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids, f"request {i}"
        got_lp = [e[t].logprob for t, e in zip(g.outputs[0].token_ids, g.outputs[0].logprobs)]
        want_lp = [e[t].logprob for t, e in zip(w.outputs[0].token_ids, w.outputs[0].logprobs)]
        np.testing.assert_allclose(got_lp, want_lp, **LOGPROB_TOL)


def test_eplb_off_measures_but_keeps_the_placement():
    """``eplb_interval_steps = 0`` (the default): the imbalance is measured and reported, nothing moves."""
    llm = _skewed_mesh_llm(**{"parallel.eplb_num_redundant_experts": 4})
    params_before = llm.executor.params
    prompts, params = _requests(6, 1)
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    stats = llm.last_stats
    assert stats.eplb_rearrangements == 0 and llm.executor.params is params_before
    assert stats.moe_lb == pytest.approx(2.0, abs=0.05)


def test_no_balancer_without_an_expert_parallel_group():
    llm = LLM(
        "tiny-v3",
        data_parallel_size=2,
        expert_parallel_size=1,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        **{"parallel.eplb_interval_steps": 4, "parallel.eplb_window_steps": 4},
        **COMMON,
    )
    assert llm.expert_balancer is None and not llm.executor.returns_expert_counts


def test_balancer_refuses_what_it_cannot_use():
    llm = _llm(True)
    cfg = llm.config.parallel
    balancer = MeshExpertBalancer(cfg, llm.executor.params, llm.mesh)
    assert balancer.paths == ("layers.1.mlp.experts", "layers.2.mlp.experts", "mtp.0.layer.mlp.experts")
    with pytest.raises(ValueError, match=r"counts: shape \(8, 6\), expected \(8, 9\)"):
        balancer.split(np.zeros((8, 6)))
    with pytest.raises(ValueError, match=r"counts: shape \(4, 9\), expected \(8, 9\)"):
        balancer.observe(np.zeros((4, 9)))
    split = balancer.split(np.arange(72).reshape(8, 9))
    assert list(split) == list(balancer.paths) and split["layers.2.mlp.experts"][1].tolist() == [12, 13, 14]
    with pytest.raises(ValueError, match="differs from the mesh's ep = 4"):
        MeshExpertBalancer(ParallelConfig(expert_parallel_size=2), llm.executor.params, llm.mesh)
    with pytest.raises(ValueError, match="no slot-layout MoE layer"):
        MeshExpertBalancer(cfg, {"w": np.zeros(2)}, llm.mesh)
    bare = StepExecutor(
        llm.executor.params, llm.paged_model, llm.mesh, num_blocks=2, num_slots=1, max_blocks_per_seq=1
    )
    assert not bare.returns_expert_counts and llm.executor.returns_expert_counts
    with pytest.raises(ValueError, match="a balancer needs an executor built with expert_counts=True"):
        EngineRunner(llm.scheduler, bare, balancer=balancer)
    with pytest.raises(
        ValueError, match=r"eplb_window_steps = 8 must be <= parallel\.eplb_interval_steps = 4"
    ):
        LLM(
            "tiny-v3",
            data_parallel_size=2,
            expert_parallel_size=4,
            **{"parallel.eplb_interval_steps": 4, "parallel.eplb_window_steps": 8},
            **COMMON,
        )


def test_placement_detail_is_logged_on_request(caplog):
    llm = _skewed_mesh_llm(**EPLB)  # the initial placements (construction compiles nothing)
    cfg = dataclasses.replace(llm.config.parallel, eplb_log_detail=True)
    detail = MeshExpertBalancer(cfg, llm.executor.params, llm.mesh)
    heavy = np.zeros((8, 9), np.int64)  # devices x (3 slots of each of the three MoE layers)
    heavy[[0, 4], 0] = 12  # both dp groups' rank 0 fill layer 1's slot 0 (expert 0)
    for _ in range(4):
        detail.observe(heavy)
    with caplog.at_level(logging.INFO, logger="absl"):
        detail.rearrange(llm.executor.params)
    # Expert 0 takes all 4 extra slots; layer 2 routed nothing and keeps the initial placement.
    assert "EPLB layers.1.mlp.experts: rank 0: [" in caplog.text and "replicas {0: 5}" in caplog.text
    assert describe_placement(detail.placements()["layers.2.mlp.experts"], 4) == (
        "rank 0: [0, 1, 2]; rank 1: [3, 4, 5]; rank 2: [6, 7, 0]; rank 3: [1, 2, 3]; "
        "replicas {0: 2, 1: 2, 2: 2, 3: 2}"
    )


@pytest.mark.parametrize(
    "override, match",
    [
        (
            {"parallel.moe_force_imbalance_ratio": 1.8},
            r"moe_force_imbalance_ratio = 1\.8 \(set by override .*\): synthetic MoE routing",
        ),
        ({"parallel.moe_force_uniform_routing": True}, "moe_force_uniform_routing = True"),
        ({"parallel.engram_on_device": False}, r"engram_on_device = False .*: Engram tables in host memory"),
        ({"parallel.context_parallel_size": 2}, r"context_parallel_size = 2 .*: context-parallel prefill"),
    ],
)
def test_parallel_settings_the_engine_would_ignore_are_refused(override, match):
    with pytest.raises(ValueError, match=match):
        LLM("tiny-v3", **override, **COMMON)
