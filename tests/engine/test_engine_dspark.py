"""V4.1's DSpark drafter in the engine step (docs/speculative.md): tiny-v41 drafts a block, the step verifies.

Every check compares with an independent reference:

* the drafts the step leaves in a slot's pool equal :func:`~deepinfer_jax.models.deepseek_v4.dspark.draft_after_prefix`
  (the full-prefix drafter, itself checked against a float64 NumPy re-derivation in
  tests/models/deepseek_v41/test_v41_dspark.py) over the same tokens -- after a prefill and after decode steps
  whose drafts were rejected, so the context-key rings, their ``W + B`` margin and the positions of the block are
  right;
* greedy tokens and logprobs with drafts equal the same engine without drafts (float32: verification's 1 + k rows
  and plain decoding's one row give the same logits), in a mixed batch whose small cache forces preemption;
* the ``speculative.force_draft_tokens`` hook reaches every acceptance pattern (random weights accept almost
  nothing): drafts equal to the plain tokens are all accepted, wrong ones are rejected from the first wrong one.

tiny-v41: ``W = 16``, ``B = dspark_block_size = 4``, two draft layers. Budgets: 2 sequences and 16 tokens per step
(two buckets, ``(16, 1)`` and ``(16, 2)``: a V4.1 step program takes tens of seconds to compile on two cores),
16-token blocks, 6 blocks (5 usable: two long requests do not fit together, so the mixed batch preempts).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from spec_common import greedy as _greedy  # tests/engine/spec_common.py
from spec_common import logprobs as _logprobs
from spec_common import prompts as _prompts
from spec_common import run as _run

from deepinfer_jax.engine.llm import LLM
from deepinfer_jax.engine.params import SamplingParams

BLOCKS = 6


@functools.cache
def _llm(k: int) -> LLM:
    return LLM(
        "tiny-v41",
        dtype="float32",
        num_draft_tokens=k,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        kv_cache_memory="64MiB",
        **{"cache.block_size": 16, "cache.num_blocks": BLOCKS, "speculative.force_draft_tokens": True},
    )


@functools.cache
def _reference() -> tuple[list[list[int]], list[list[float]]]:
    """The plain engine's greedy tokens and logprobs of the mixed batch."""
    prompts = _prompts()
    outs = _run(_llm(0), prompts, [_greedy(i) for i in range(len(prompts))])
    return [list(o.outputs[0].token_ids) for o in outs], [_logprobs(o) for o in outs]


def test_natural_draft_length_is_the_block_size(monkeypatch):
    """``None`` = ``dspark_block_size`` (4) for tiny-v41; above it is refused naming the field."""
    small = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "kv_cache_memory": "4MiB"}
    monkeypatch.delenv("DEEPINFER_USE_NEXTN_DECODE")  # the suite's pin (tests/conftest.py)
    assert LLM("tiny-v41", **small).num_draft_tokens == 4
    with pytest.raises(ValueError, match=r"speculative\.num_draft_tokens = 5 .*dspark_block_size = 4"):
        LLM("tiny-v41", num_draft_tokens=5, **small)
    with pytest.raises(ValueError, match=r"num_draft_tokens = 1 .*deepseek_v4 .*not built yet"):
        LLM("tiny-v4", num_draft_tokens=1, **small)


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_with_drafts_equals_without(k):
    """Mixed prompt lengths (1 to 40 tokens, W = 16), a cache that forces preemption: the plain engine's tokens
    and logprobs; every decode row verified its drafts; the second run compiles nothing."""
    tokens, logprobs = _reference()
    prompts = _prompts()
    llm = _llm(k)
    outs = _run(llm, prompts, [_greedy(i) for i in range(len(prompts))])
    assert [list(o.outputs[0].token_ids) for o in outs] == tokens
    for o, ref in zip(outs, logprobs, strict=True):
        np.testing.assert_allclose(_logprobs(o), ref, atol=1e-4)
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the small cache must force preemption"
    stats = llm.last_stats
    assert stats.spec_rows > 0 and len(stats.verified_at) == k
    assert stats.verified_at[0] >= 0.8 * stats.spec_rows
    assert 0.0 <= stats.confidence_error <= 1.0
    again = _run(llm, prompts, [_greedy(i) for i in range(len(prompts))])
    assert [list(o.outputs[0].token_ids) for o in again] == tokens
    assert llm.last_stats.compile_count == 0


def test_forced_drafts_reach_every_acceptance_pattern():
    """Drafts equal to the plain tokens are all accepted (5 tokens per decode row), drafts with wrong tokens are
    rejected from the first wrong one; the output and its logprobs are the plain engine's either way."""
    tokens, logprobs = _reference()
    prompts = _prompts()
    llm = _llm(4)
    outs = _run(llm, prompts, [_greedy(i, golden_token_ids=t) for i, t in enumerate(tokens)])
    assert [list(o.outputs[0].token_ids) for o in outs] == tokens
    assert llm.last_stats.acceptance_rates == (1.0, 1.0, 1.0, 1.0)
    for o, ref in zip(outs, logprobs, strict=True):
        np.testing.assert_allclose(_logprobs(o), ref, atol=1e-4)
    rng = np.random.default_rng(5)
    wrong = [[t if rng.random() > 0.3 else (t + 1) % 500 for t in seq] for seq in tokens]
    outs = _run(llm, prompts, [_greedy(i, golden_token_ids=t) for i, t in enumerate(wrong)])
    assert [list(o.outputs[0].token_ids) for o in outs] == tokens
    mixed = llm.last_stats
    assert 0 < sum(mixed.accepted_at) < sum(mixed.verified_at)
    assert all(a >= b for a, b in zip(mixed.accepted_at, mixed.accepted_at[1:]))


def test_stops_inside_an_accepted_run():
    """A stop id, max_tokens and a stop string hit inside a run of accepted drafts end the request where the
    plain engine ends it (tokens, text, finish reason): the tokens after the stop are dropped."""
    tokens, _ = _reference()
    first = _prompts()
    seq = tokens[3]
    stop_at = next(j for j in range(2, len(seq)) if seq[j] not in seq[:j])
    plain, spec = _llm(0), _llm(4)
    text = _run(plain, [first[3]], [_greedy(3, max_tokens=12)])[0].outputs[0].text

    def cases(golden: bool) -> list[SamplingParams]:
        # logprobs=2 as every request of this file: the step compiled for it serves them all.
        g = {"golden_token_ids": seq, "logprobs": 2} if golden else {"logprobs": 2}
        return [
            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[seq[stop_at]], **g),
            SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, **g),
            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[text[3:6]], **g),
        ]

    prompts = [first[3]] * 3
    want = [
        (list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason)
        for o in _run(plain, prompts, cases(False))
    ]
    assert [w[2] for w in want] == ["stop", "length", "stop"]
    for golden in (False, True):
        outs = _run(spec, prompts, cases(golden))
        got = [(list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]
        assert got == want
        assert spec.last_stats.compile_count == 0


def test_pool_drafts_equal_the_full_prefix_drafter():
    """One request at a time: after its prefill (1 output token) and after 6 decode steps whose random drafts
    were rejected, its slot's pool holds the drafts and confidences that the full-prefix drafter computes over
    the prompt and outputs (``draft_after_prefix``: backbone, target features, context keys, block pass, Markov
    heads; greedy argmax drafts). Prompts of 5, 23 and 40 tokens put the draft window inside the prompt, across
    steps and past ring wrap-around (W = 16)."""
    from deepinfer_jax.models.deepseek_v4.dspark import DSparkStatic, draft_after_prefix

    llm = _llm(4)
    static = DSparkStatic.from_config(llm.model.config, llm.paged_model.static)
    draft = jax.jit(draft_after_prefix, static_argnames="static")
    prompts = _prompts(3)
    width = 48  # one padded length for every reference call (one compilation)
    checked = 0
    for prompt in (prompts[1], prompts[5], prompts[3]):
        for max_tokens in (1, 7):
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
            out = _run(llm, [prompt], [params])
            ids = prompt + list(out[0].outputs[0].token_ids)
            known = ids[:-1]
            padded = jnp.asarray([known + [0] * (width - len(known))], jnp.int32)
            ref = draft(llm.model.params, padded, static=static, lengths=jnp.asarray([len(known)], jnp.int32))
            assert int(ref.golden[0]) == ids[-1]  # the full forward's argmax is the engine's last token
            state = llm.executor.state
            pools = np.asarray(state.drafts[0])  # [slots, k] of the one device
            want = np.asarray(ref.drafts.tokens[0])
            slots = [s for s in range(1, pools.shape[0]) if (pools[s] == want).all()]
            assert slots, (pools, want)
            assert llm.last_stats.compile_count == 0
            conf = np.asarray(state.draft_conf[0])[slots[0]]
            np.testing.assert_allclose(conf, np.asarray(ref.drafts.confidences[0]), rtol=1e-4, atol=1e-6)
            checked += 1
    assert checked == 6
