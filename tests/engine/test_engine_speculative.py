"""Speculative decoding in the engine (docs/speculative.md): tiny-v3's MTP layer drafts, the step verifies.

Every check compares with the same engine without drafts (``num_draft_tokens=0``): greedy tokens must be
identical (float32, where verification's 1 + k rows and plain decoding's one row give the same logits), the stop
rules must cut an accepted run where plain decoding stops, penalties must see the accepted tokens only.

Random weights accept almost nothing (tiny-v3's MTP layer is random), so the acceptance paths are reached with
the ``speculative.force_draft_tokens`` test hook: a request's ``golden_token_ids`` become its drafts. Drafts equal
to the plain engine's tokens are all accepted; drafts with wrong tokens put the rejection anywhere in a run.

Budgets: 4 sequences and 32 tokens per step (one bucket), 16-token blocks; the engines' cache of 9 blocks
forces preemption by recompute in the mixed batch.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
from spec_common import greedy as _greedy  # tests/engine/spec_common.py
from spec_common import prompts as _prompts
from spec_common import run as _run

from deepinfer_jax.engine.llm import LLM
from deepinfer_jax.engine.params import SamplingParams

BLOCKS = 9


@functools.cache
def _llm(k: int, dp: int = 1, ep: int = 1, batch_invariant: bool = False) -> LLM:
    devices = dp * ep
    return LLM(
        "tiny-v3",
        dtype="float32",
        num_draft_tokens=k,
        max_num_seqs=4 * devices,
        max_num_batched_tokens=32 * devices,
        data_parallel_size=dp,
        expert_parallel_size=ep,
        batch_invariant=batch_invariant,
        kv_cache_memory="64MiB",
        **{"cache.block_size": 16, "cache.num_blocks": BLOCKS, "speculative.force_draft_tokens": True},
    )


@functools.cache
def _reference() -> tuple[list[list[int]], list[list[float]]]:
    """The plain engine's greedy tokens and logprobs of the mixed batch."""
    prompts = _prompts()
    outs = _run(_llm(0), prompts, [_greedy(i) for i in range(len(prompts))])
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return tokens, logprobs


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_drafts_equals_without(k):
    """Mixed prompt lengths, a cache that forces preemption: the tokens are the plain engine's, every decode
    row verified k drafts, and the run's statistics say so."""
    tokens, logprobs = _reference()
    prompts = _prompts()
    llm = _llm(k)
    outs = _run(llm, prompts, [_greedy(i) for i in range(len(prompts))])
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == tokens
    for o, ref in zip(outs, logprobs, strict=True):
        lps = [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        np.testing.assert_allclose(lps, ref, atol=1e-4)
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the small cache must force preemption"
    stats = llm.last_stats
    assert stats.spec_rows > 0 and len(stats.verified_at) == k
    # Fixed length: a decode row verifies k drafts unless the step's token budget is nearly spent.
    assert stats.verified_at[0] >= 0.8 * stats.spec_rows and all(
        v <= stats.spec_rows for v in stats.verified_at
    )
    assert stats.verified_per_step == pytest.approx(sum(stats.verified_at) / stats.spec_rows)
    assert stats.mean_accepted_length == pytest.approx(1 + sum(stats.accepted_at) / stats.spec_rows)
    assert "speculative" in stats.summary(len(prompts))
    assert 0.0 <= stats.confidence_error <= 1.0
    # The steady state compiles nothing new: the same batch again.
    again = _run(llm, prompts, [_greedy(i) for i in range(len(prompts))])
    assert [list(o.outputs[0].token_ids) for o in again] == tokens
    assert llm.last_stats.compile_count == 0


def test_forced_drafts_reach_every_acceptance_pattern():
    """Drafts equal to the plain tokens are all accepted (k + 1 tokens per decode row); drafts with wrong
    tokens are rejected from the first wrong one; the output is the plain engine's either way, logprobs too."""
    tokens, logprobs = _reference()
    prompts = _prompts()
    llm = _llm(3)
    outs = _run(llm, prompts, [_greedy(i, golden_token_ids=t) for i, t in enumerate(tokens)])
    assert [list(o.outputs[0].token_ids) for o in outs] == tokens
    perfect = llm.last_stats
    assert perfect.accepted_at == perfect.verified_at and perfect.spec_rows > 0
    assert perfect.acceptance_rates == (1.0, 1.0, 1.0)
    for o, ref in zip(outs, logprobs, strict=True):
        lps = [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        np.testing.assert_allclose(lps, ref, atol=1e-4)

    rng = np.random.default_rng(5)
    wrong = [[t if rng.random() > 0.3 else (t + 1) % 500 for t in seq] for seq in tokens]
    outs = _run(llm, prompts, [_greedy(i, golden_token_ids=t) for i, t in enumerate(wrong)])
    assert [list(o.outputs[0].token_ids) for o in outs] == tokens
    mixed = llm.last_stats
    assert 0 < sum(mixed.accepted_at) < sum(mixed.verified_at)
    # Acceptance at position i + 1 needs acceptance at i (the prefix rule).
    assert all(a >= b for a, b in zip(mixed.accepted_at, mixed.accepted_at[1:]))


def test_stops_inside_an_accepted_run():
    """Stop ids, max_tokens, min_tokens and stop strings hit in the middle of a run of accepted drafts end the
    request exactly where the plain engine ends it: the tokens after the stop are dropped."""
    tokens, _ = _reference()
    first = _prompts()
    prompts = [first[0], first[1], first[2], first[0]]
    plain, spec = _llm(0), _llm(3)
    text = _run(plain, first[:1], [_greedy(0, max_tokens=12)])[0].outputs[0].text

    def cases(golden: bool) -> list[SamplingParams]:
        def g(i):
            return {"golden_token_ids": tokens[i]} if golden else {}

        seq = tokens[0]
        stop_at = next(j for j in range(2, len(seq)) if seq[j] not in seq[:j])
        return [
            SamplingParams(
                temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[seq[stop_at]], **g(0)
            ),
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, **g(1)),
            SamplingParams(
                temperature=0,
                max_tokens=16,
                min_tokens=5,
                ignore_eos=True,
                stop_token_ids=[tokens[2][1]],
                **g(2),
            ),
            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[text[3:6]], **g(0)),
        ]

    ref = _run(plain, prompts, cases(False))
    want = [(list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason) for o in ref]
    assert want[0][2] == "stop" and want[1][2] == "length" and want[3][2] == "stop"
    for golden in (False, True):  # the MTP layer's own drafts, then drafts that are all accepted
        outs = _run(spec, prompts, cases(golden))
        got = [(list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]
        assert got == want


def test_penalties_see_accepted_tokens_only():
    """Repetition, presence and frequency penalties with drafts: the plain engine's tokens, with the MTP
    layer's drafts (mostly rejected) and with drafts that are all accepted (the counts of verify row j include
    the j drafts before it)."""
    prompts = _prompts(1)[:4]

    def params(golden=None):
        return [
            SamplingParams(
                temperature=0,
                max_tokens=12,
                ignore_eos=True,
                repetition_penalty=1.5,
                presence_penalty=0.7,
                frequency_penalty=0.4,
                golden_token_ids=None if golden is None else golden[i],
            )
            for i in range(len(prompts))
        ]

    ref = [list(o.outputs[0].token_ids) for o in _run(_llm(0), prompts, params())]
    spec = _llm(3)
    assert [list(o.outputs[0].token_ids) for o in _run(spec, prompts, params())] == ref
    assert [list(o.outputs[0].token_ids) for o in _run(spec, prompts, params(ref))] == ref
    assert spec.last_stats.acceptance_rates == (1.0, 1.0, 1.0)


def test_seeded_sampling_reproducible_and_batch_invariant():
    """Batch-invariant mode with drafts: a seeded sampled request and a greedy one give bitwise the same tokens
    and logprobs alone and in a batch; greedy tokens equal the plain engine's."""
    tokens, _ = _reference()
    prompts = _prompts()
    llm = _llm(1, batch_invariant=True)
    sampled = SamplingParams(
        temperature=0.9, top_k=50, max_tokens=10, seq_seed=7, logprobs=1, ignore_eos=True
    )
    params = [_greedy(i) for i in range(len(prompts))]
    params[2] = sampled
    batch = _run(llm, prompts, params)
    for i in (2, 3):
        alone = _run(llm, [prompts[i]], [params[i]])[0].outputs[0]
        assert alone.token_ids == batch[i].outputs[0].token_ids
        assert [d[t].logprob for d, t in zip(alone.logprobs, alone.token_ids)] == [
            d[t].logprob for d, t in zip(batch[i].outputs[0].logprobs, batch[i].outputs[0].token_ids)
        ]
    for i in (0, 1, 3, 4, 5):
        assert list(batch[i].outputs[0].token_ids) == tokens[i]


def test_mesh_greedy_equals_one_device():
    """dp=2 x ep=4 with the natural draft length (1): the one-device plain engine's tokens."""
    tokens, _ = _reference()
    prompts = _prompts()
    outs = _run(_llm(1, 2, 4), prompts, [_greedy(i) for i in range(len(prompts))])
    assert [list(o.outputs[0].token_ids) for o in outs] == tokens
    assert _llm(1, 2, 4).last_stats.spec_rows > 0


def test_draft_length_settings(monkeypatch):
    """None = the natural length (tiny-v3: one MTP layer -> 1; tiny-v41's DSpark block: tests/engine/
    test_engine_dspark.py), DEEPINFER_USE_NEXTN_DECODE sets it, refusals name the field and the value."""
    small = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "kv_cache_memory": "4MiB"}
    monkeypatch.delenv("DEEPINFER_USE_NEXTN_DECODE")  # the suite's pin (tests/conftest.py)
    assert LLM("tiny-v3", **small).num_draft_tokens == 1
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "2")
    assert LLM("tiny-v3", **small).num_draft_tokens == 2
    assert LLM("tiny-v3", num_draft_tokens=0, **small).num_draft_tokens == 0  # the keyword wins
    with pytest.raises(ValueError, match="num_draft_tokens"):
        LLM("tiny-v3", num_draft_tokens=-1)
    with pytest.raises(ValueError, match="compute_sum_smaller_probs"):
        LLM("tiny-v3", num_draft_tokens=2, **{"sampling.compute_sum_smaller_probs": True})
    with pytest.raises(ValueError, match=r"speculative\.num_draft_tokens = 2 .*not built yet"):
        LLM("tiny-v4", num_draft_tokens=2)


def test_variable_length_verification(tmp_path):
    """speculative.variable_length: the engine measures its decode latency curve at start-up (cached on disk:
    a second engine reads it), the planner verifies fewer drafts than k when the confidences are low (random
    MTP weights), and greedy tokens stay the plain engine's. Batch-invariant mode refuses it."""
    tokens, _ = _reference()
    prompts = _prompts()
    overrides = {
        "cache.block_size": 16,
        "cache.num_blocks": BLOCKS,
        "speculative.latency_cache_dir": str(tmp_path),
    }
    args = {"dtype": "float32", "num_draft_tokens": 3, "speculative_variable_length": True}
    llm = LLM("tiny-v3", max_num_seqs=4, max_num_batched_tokens=32, **args, **overrides)
    curve = llm.latency_curve
    assert curve is not None and curve.sizes == (16, 32) and all(ms > 0 for _, ms in curve.points)
    # What the planner chooses follows the measured times (a loaded machine makes the 32-token step relatively
    # cheaper or dearer); a fixed steep curve makes its choice depend on the confidences alone: a step that
    # would spill into the 32-token bucket verifies fewer drafts (the device re-splits the same total).
    from deepinfer_jax.engine.spec_budget import LatencyCurve
    from deepinfer_jax.engine.spec_varlen import VerifyLengthPlanner

    steep = VerifyLengthPlanner(LatencyCurve(((16, 1.0), (32, 1000.0))))
    for device in llm.scheduler.devices:
        device.verify_planner = steep
    outs = _run(llm, prompts, [_greedy(i) for i in range(len(prompts))])
    assert [list(o.outputs[0].token_ids) for o in outs] == tokens
    stats = llm.last_stats
    assert stats.spec_rows > 0 and stats.verified_per_step < 3
    assert len(list(tmp_path.iterdir())) == 1
    again = LLM("tiny-v3", max_num_seqs=4, max_num_batched_tokens=32, **args, **overrides)
    assert again.latency_curve == curve  # read back, not measured again
    with pytest.raises(ValueError, match=r"variable_length with ops\.batch_invariant"):
        LLM("tiny-v3", num_draft_tokens=1, batch_invariant=True, speculative_variable_length=True)


def test_bfloat16_greedy_with_drafts_tracks_without():
    """Production precision: greedy tokens with drafts equal those without except where verification's 1 + k
    rows and plain decoding's one row round differently at a near-tie; the test reports the logit margin of the
    plain engine's choice at the first difference of every sequence and bounds it."""
    prompts = _prompts()

    def engine(k: int) -> LLM:
        return LLM(
            "tiny-v3",
            dtype="bfloat16",
            num_draft_tokens=k,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            **{"cache.block_size": 16, "cache.num_blocks": BLOCKS},
        )

    params = [_greedy(i, logprobs=5) for i in range(len(prompts))]
    plain = _run(engine(0), prompts, params)
    spec = _run(engine(3), prompts, params)
    same = 0
    for a, b in zip(plain, spec, strict=True):
        ta, tb = list(a.outputs[0].token_ids), list(b.outputs[0].token_ids)
        if ta == tb:
            same += 1
            continue
        j = next(i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y)
        top = a.outputs[0].logprobs[j]
        margin = top[ta[j]].logprob - top.get(tb[j], min(top.values(), key=lambda v: v.logprob)).logprob
        print(f"first difference at output {j}: plain {ta[j]} vs drafts {tb[j]}, logprob margin {margin:.4f}")
        # bf16 logits carry ~3 significant digits: only a near-tie may flip.
        assert margin < 0.1, (j, margin)
    assert same >= len(prompts) // 2


def test_structured_outputs_with_drafts():
    """Constrained requests verify their drafts under one grammar mask per verify row (built on the host from
    the drafts the previous step left): greedy constrained output equals the engine without drafts, free
    requests of the same batch too, and drafts were verified for the constrained rows."""
    from deepinfer_jax.engine.structured import StructuredOutputsParams as SO

    prompts = _prompts(2)[:4]
    schema = {
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["x"],
    }
    params = [
        SamplingParams(temperature=0, max_tokens=24, structured_outputs=SO(json=schema)),
        SamplingParams(temperature=0, max_tokens=16, structured_outputs=SO(regex=r"[a-c]{3}-[0-9]{2}")),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(
            temperature=0, max_tokens=12, structured_outputs=SO(choice=["alpha", "beta", "gamma"])
        ),
    ]
    plain = [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in _run(_llm(0), prompts, params)]
    spec = _llm(3)
    outs = _run(spec, prompts, params)
    assert [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs] == plain
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", outs[1].outputs[0].text)
    assert outs[3].outputs[0].text in ("alpha", "beta", "gamma")
    constrained = [0, 1, 3]
    again = _run(spec, [prompts[i] for i in constrained], [params[i] for i in constrained])
    assert [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in again] == [
        plain[i] for i in constrained
    ]
    assert sum(spec.last_stats.verified_at) > 0  # the constrained rows verified drafts
    # The test hook: drafts equal to the constrained output are all accepted; a draft the grammar forbids
    # (a letter where the regex wants a digit) is rejected by its verify row's mask, whatever the logits say.
    golden = [plain[i][0] for i in constrained]
    hooked = [params[i].replace(golden_token_ids=g) for i, g in zip(constrained, golden, strict=True)]
    outs = _run(spec, [prompts[i] for i in constrained], hooked)
    assert [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs] == [
        plain[i] for i in constrained
    ]
    assert spec.last_stats.accepted_at == spec.last_stats.verified_at
    tok = spec.get_tokenizer()
    letter = next(t for t in range(512) if tok.decode([t]) == "a")
    bad = list(golden[1])
    # The last digit: output 5 of "xxx-dd" is a draft of the second decode row (outputs 1-3 are the first's
    # drafts, output 4 its bonus token).
    digit_at = max(j for j, t in enumerate(bad) if tok.decode([t]).isdigit())
    bad[digit_at] = letter
    outs = _run(spec, [prompts[1]], [params[1].replace(golden_token_ids=bad)])
    assert (list(outs[0].outputs[0].token_ids), outs[0].outputs[0].text) == plain[1]
    assert sum(spec.last_stats.accepted_at) < sum(spec.last_stats.verified_at)
