"""The load test in its small form (the full one is scripts/load_test.py): 16 concurrent streaming clients, 48
requests of mixed lengths, a quarter of the clients hanging up mid-stream. Every request that was not disconnected
ends with exactly the offline engine's tokens for its seed (the served engine is batch invariant), a disconnected
one got a prefix of them; none is lost or duplicated (one finish per request in the engine's counters); the
cache ends empty. Bounded: the run is cancelled after 100 s.
"""

from __future__ import annotations

from server_helpers import assert_engine_empty, offline_generate  # tests/server/server_helpers.py

from deepinfer_jax.bench.load import LoadSpec, run_load_test

SPEC = LoadSpec(
    clients=16,
    requests=48,
    prompt_len=(3, 40),
    max_tokens=(2, 16),
    disconnect_fraction=0.25,
    seed=3,
    deadline_s=100,
)


def test_load_mixed_lengths_with_disconnects(server, engine):
    def offline(prompts, params):
        return [o.outputs[0].token_ids for o in offline_generate(engine, prompts, params)]

    before = engine.stats()
    check, summary, _ = run_load_test(server.url, "tiny-v3", SPEC, offline)
    assert check.ok, "\n".join(check.problems[:10])
    assert check.complete + check.disconnected == SPEC.requests
    assert check.disconnected >= 8  # the workload draws 15 disconnecting clients; a few may see the end first
    after = engine.stats()
    # Every request reached the engine once and finished once: none lost, none duplicated.
    assert after.accepted - before.accepted == SPEC.requests
    finished = {
        k: v - before.finished.get(k, 0) for k, v in after.finished.items() if v > before.finished.get(k, 0)
    }
    assert sum(finished.values()) == SPEC.requests
    assert finished.get("length", 0) >= check.complete
    assert finished.get("abort", 0) <= check.disconnected
    assert set(finished) <= {"length", "abort"}
    assert_engine_empty(engine)
    assert summary["completed"] == check.complete and summary["ttft_seconds"]["count"] == check.complete
    assert 0 < summary["ttft_seconds"]["p50"] <= summary["ttft_seconds"]["p99"]
