"""EPLB: greedy replication and placement checked by hand, and a skewed-routing run on a 2 x 4 mesh whose
imbalance falls after re-placement while the layer's output stays the same and nothing recompiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.config.tree import ParallelConfig
from deepinfer_jax.models.common.linear import LinearNumerics
from deepinfer_jax.models.common.moe import Routing, moe_experts
from deepinfer_jax.parallel import eplb
from deepinfer_jax.parallel import expert_parallel as epm
from deepinfer_jax.parallel.mesh import make_mesh


def test_replicate_by_hand():
    # Loads [10, 1, 1, 1], 6 slots: expert 0 takes both extra replicas (per-replica 5, then 3.33).
    np.testing.assert_array_equal(eplb.replicate([10, 1, 1, 1], 6), [3, 1, 1, 1])
    # Two steps: [9, 0] then [0, 6]; 3 slots. Giving expert 0 a replica costs 4.5 + 6 = 10.5 (steps' peaks),
    # expert 1: 9 + 3 = 12, so expert 0 wins.
    np.testing.assert_array_equal(eplb.replicate([[9, 0], [0, 6]], 3), [2, 1])
    # Equal loads: the 1e-4 · index tie-breaker makes the higher index the heavier, so it gets the replica.
    np.testing.assert_array_equal(eplb.replicate([4, 4], 3), [1, 2])
    with pytest.raises(ValueError, match="num_slots = 1 must be >= 2"):
        eplb.replicate([1, 1], 1)


def test_place_by_hand():
    # Six replicas of load 2 (expert 0 three times), two ranks of three slots. Greedy, ties to the lowest rank:
    # e0 -> r0; e0 -> r1 (peak 2 vs 4); e0 -> r0; e1 -> r1; e2 -> r0 (loads 4/4, tie); e3 -> r1.
    np.testing.assert_array_equal(eplb.place([6, 2, 2, 2], [3, 1, 1, 1], 2), [0, 0, 2, 0, 1, 3])
    with pytest.raises(ValueError, match="not a multiple of expert_parallel_size = 4"):
        eplb.place([1, 1], [2, 1], 4)


def test_imbalance_and_counts():
    assert eplb.imbalance([4, 0, 2, 2], 2) == 1.0
    assert eplb.imbalance([6, 2, 0, 0], 2) == 2.0
    assert eplb.imbalance([0, 0], 2) == 1.0
    pl = epm.initial_placement(3, 2, extra=1)  # slots -> experts [0, 1, 2, 0]
    np.testing.assert_array_equal(eplb.logical_counts([5, 1, 2, 3], pl), [8, 1, 2])


def test_window_and_schedule():
    window = eplb.ExpertLoadWindow(2, 1, 3)
    pl = epm.initial_placement(3, 1)
    for step in range(3):
        window.record([[step, 1, 0]], [pl])
    np.testing.assert_array_equal(window.loads(0), [[1, 1, 0], [2, 1, 0]])  # the two latest, oldest first
    sched = eplb.RearrangeSchedule(8, 4)
    assert [s + 1 for s in range(20) if sched.step()] == [2, 10, 18]
    assert not any(eplb.RearrangeSchedule(0, 4).step() for _ in range(5))
    with pytest.raises(
        ValueError, match=r"eplb_window_steps = 9 must be <= parallel\.eplb_interval_steps = 8"
    ):
        eplb.RearrangeSchedule(8, 9)


def test_skewed_routing_rebalances_without_recompiling():
    num_experts, hidden, inter, top_k, tokens, ep = 6, 16, 8, 2, 32, 4
    rng = np.random.default_rng(7)

    def w(*shape):
        return {"weight": jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[-1]), jnp.float32)}

    experts = {"gate": w(num_experts, inter, hidden), "up": w(num_experts, inter, hidden)}
    experts["down"] = w(num_experts, hidden, inter)
    mesh = make_mesh(2, ep)
    numerics = LinearNumerics()
    step = jax.jit(lambda x, r, se, pl: epm.ep_moe_experts(x, r, se, pl, numerics, mesh))

    # Skewed: every token picks expert 0, and most pick expert 1 as well.
    ids = np.stack([np.zeros(tokens), np.where(rng.random(tokens) < 0.8, 1, rng.integers(2, 6, tokens))], 1)
    routing = Routing(jnp.asarray(ids, jnp.int32), jnp.asarray(rng.random((tokens, top_k)), jnp.float32))
    x = jnp.asarray(rng.normal(size=(tokens, hidden)), jnp.float32)

    old = epm.initial_placement(num_experts, ep, extra=6)  # 12 slots, 3 per rank
    slot_experts = epm.place_experts(experts, old)
    before = step(x, routing, slot_experts, old)
    window = eplb.ExpertLoadWindow(4, 1, num_experts)
    window.record(np.asarray(before.slot_counts)[None], [old])
    new = eplb.rebalance(window.loads(0), old.num_slots, ep)
    moved = eplb.move_experts(slot_experts, old, new)
    after = step(x, routing, moved, new)

    # Moving copies whole expert weights: the result equals laying the logical experts out afresh.
    for leaf_moved, leaf_fresh in zip(
        jax.tree_util.tree_leaves(moved),
        jax.tree_util.tree_leaves(epm.place_experts(experts, new)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(leaf_moved), np.asarray(leaf_fresh))
    first, second = eplb.imbalance(before.slot_counts, ep), eplb.imbalance(after.slot_counts, ep)
    assert first > 1.5 and second < 1.2 and second < first, (first, second)
    # Same rows through the same expert weights, only on other devices: equal up to GEMM-kernel rounding (see
    # test_par_expert_parallel for the tolerance), and both equal the unsharded op.
    np.testing.assert_allclose(np.asarray(after.out), np.asarray(before.out), rtol=1e-5, atol=1e-5)
    want = moe_experts(x, routing, experts, numerics)
    np.testing.assert_allclose(np.asarray(after.out), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert step._cache_size() == 1  # the placement is data: re-placement compiled nothing new


def test_load_balancer_schedule_stats_and_rearrange():
    cfg = ParallelConfig(
        expert_parallel_size=4,
        eplb_interval_steps=4,
        eplb_window_steps=4,
        eplb_num_redundant_experts=2,
        moe_load_stats_interval_steps=2,
    )
    lb = eplb.ExpertLoadBalancer(cfg, num_layers=2, num_experts=6)
    assert lb.num_slots == 8
    skewed = np.array([[8, 0, 0, 0, 0, 0, 0, 0], [1] * 8])  # layer 0: rank 0 gets everything; layer 1: even
    # Prefill steps are not counted (eplb_after_prefill is off) but still enter moe_lb.
    assert lb.observe(skewed, prefill=True) is False and lb.window.steps_recorded == 0
    assert lb.observe(skewed) is True  # first re-placement after max(1, 4 // 4) = 1 counted step
    # moe_lb over 2 steps: per step Σ max = 8 + 2, Σ mean = 2 + 2 -> 20 / 8.
    assert lb.last_moe_lb == pytest.approx(2.5)
    assert [lb.observe(skewed) for _ in range(4)] == [False, False, False, True]  # then every 4 steps

    rng = np.random.default_rng(0)
    logical = [{"gate": {"weight": jnp.asarray(rng.normal(size=(6, 2, 3)), jnp.float32)}} for _ in range(2)]
    old = list(lb.placements)
    slot_experts = [epm.place_experts(w, p) for w, p in zip(logical, old, strict=True)]
    moved = lb.rearrange(slot_experts)
    window = lb.window.loads(0)
    before, after = (
        eplb.expected_imbalance(window, old[0], 4),
        eplb.expected_imbalance(window, lb.placements[0], 4),
    )
    # All load is expert 0's (8 rows per step). Old: 2 replicas (slots 0, 6 -> ranks 0, 3) share it, loads
    # [4, 0, 0, 4] -> 4 / 2. New: 3 replicas on 3 ranks, [8/3] * 3 + [0] -> (8/3) / 2.
    assert before == pytest.approx(2.0) and after == pytest.approx(4 / 3)
    assert int(np.asarray(lb.placements[0].replica_count)[0]) == 3  # both extra slots went to expert 0
    for w, m, p in zip(logical, moved, lb.placements, strict=True):
        np.testing.assert_array_equal(
            np.asarray(m["gate"]["weight"]), np.asarray(w["gate"]["weight"])[p.slot_to_expert]
        )
    with pytest.raises(ValueError, match="1 layers given, the balancer has 2"):
        lb.rearrange(slot_experts[:1])


def test_after_prefill_schedules_the_next_decode_step():
    cfg = ParallelConfig(
        expert_parallel_size=2, eplb_interval_steps=100, eplb_window_steps=10, eplb_after_prefill=True
    )
    lb = eplb.ExpertLoadBalancer(cfg, num_layers=1, num_experts=2)
    counts = np.array([[5, 1]])
    assert lb.observe(counts, prefill=True) is False and lb.window.steps_recorded == 1
    assert lb.observe(counts) is True  # the pending re-placement, although the schedule's first is at step 25
    assert lb.observe(counts) is False


def test_balancer_starts_from_given_placements_and_reads_counts_with_the_steps_own():
    cfg = ParallelConfig(expert_parallel_size=2, eplb_interval_steps=4, eplb_window_steps=4)
    start = epm.placement_from_slots(np.array([3, 2, 1, 0]), 4)  # not the initial placement
    lb = eplb.ExpertLoadBalancer(cfg, num_layers=2, num_experts=4, placements=[start, start])
    assert [p.slot_to_expert.tolist() for p in lb.placements] == [[3, 2, 1, 0]] * 2
    # Slot counts [5, 0, 0, 1] under `start` are expert 3 x5 and expert 0 x1; under the initial placement they
    # would be expert 0 x5: the window must follow the placement the step ran with.
    counts = np.array([[5, 0, 0, 1], [0, 0, 0, 0]])
    lb.observe(counts)
    np.testing.assert_array_equal(lb.window.loads(0)[-1], [1, 0, 0, 5])
    identity = epm.placement_from_slots(np.arange(4), 4)
    lb.observe(counts, placements=[identity, identity])
    np.testing.assert_array_equal(lb.window.loads(0)[-1], [5, 0, 0, 1])
    # Layer 1 routed nothing during the window: it keeps its placement (no evidence to move on).
    planned = lb.plan_rearrangement()
    assert np.asarray(planned[1].slot_to_expert).tolist() == [3, 2, 1, 0]
    assert np.asarray(planned[0].slot_to_expert).tolist() != [3, 2, 1, 0]
    with pytest.raises(ValueError, match="3 given for num_layers = 2"):
        eplb.ExpertLoadBalancer(cfg, num_layers=2, num_experts=4, placements=[start] * 3)
    with pytest.raises(ValueError, match="expected one shape with 6 experts"):
        eplb.ExpertLoadBalancer(cfg, num_layers=1, num_experts=6, placements=[start])


def test_moves_on_the_mesh_are_point_to_point():
    """A re-placement on a 2 x 4 mesh: every new slot holds its new expert's weights, each device only its own
    slots, and the move is ppermute rounds within each EP group, never a gather of the whole slot stack."""
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = make_mesh(2, 4)
    rng = np.random.default_rng(3)
    logical = {
        "gate": {"weight": rng.normal(size=(6, 3, 5)).astype(np.float32)},
        "down": {"weight": rng.integers(0, 255, size=(6, 5, 2)).astype(np.uint8)},
    }
    old = epm.initial_placement(6, 4, 2)  # 8 slots
    new = epm.placement_from_slots(np.array([3, 3, 0, 5, 1, 3, 2, 4]), 6)  # expert 3 thrice, across ranks
    sharded = jax.tree.map(
        lambda a: jax.device_put(a, NamedSharding(mesh, PartitionSpec("ep"))),
        epm.place_experts(jax.tree.map(jnp.asarray, logical), old),
    )
    moved = eplb.move_experts_on_mesh(sharded, old, new, mesh)
    for leaf, ref, src in zip(jax.tree.leaves(moved), jax.tree.leaves(logical), jax.tree.leaves(sharded)):
        np.testing.assert_array_equal(np.asarray(leaf), ref[np.asarray(new.slot_to_expert)])
        assert leaf.sharding.is_equivalent_to(src.sharding, leaf.ndim)
        assert {s.data.shape[0] for s in leaf.addressable_shards} == {2}
    source = np.asarray(old.expert_slots)[np.asarray(new.slot_to_expert), 0].astype(np.int32)
    hlo = eplb._mover(mesh, jax.tree_util.tree_structure(sharded)).lower(sharded, source).as_text()
    assert "collective_permute" in hlo and "all_gather" not in hlo and "all_to_all" not in hlo
