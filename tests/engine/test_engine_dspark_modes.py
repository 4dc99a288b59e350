"""V4.1's DSpark drafter in the engine's other modes: production precision with batch invariance, the
``(dp, ep)`` mesh, and variable-length verification (docs/speculative.md).

The float32 one-device checks (drafts equal to the full-prefix drafter, greedy equality with preemption,
acceptance patterns, stops) are in test_engine_dspark.py; this file compares with the same plain references:

* bfloat16, ``batch_invariant=True``, ``k = 4``: a seeded sampled request that the batch preempts and a greedy
  one give bitwise the same tokens and logprobs alone and in the batch; greedy tokens and logprobs are bitwise the
  plain batch-invariant bfloat16 engine's;
* ``dp = 2 x ep = 4`` with the natural draft length: the one-device plain engine's greedy tokens;
* variable length (``k = 4``): the latency curve is measured and cached, the planner chooses the verify
  lengths, the greedy tokens are the plain engine's.
"""

from __future__ import annotations

import functools

import pytest
from spec_common import greedy as _greedy  # tests/engine/spec_common.py
from spec_common import logprobs as _logprobs
from spec_common import prompts as _prompts
from spec_common import run as _run

from deepinfer_jax.engine.llm import LLM
from deepinfer_jax.engine.params import SamplingParams

BLOCKS = 6
_SMALL = {"cache.block_size": 16, "cache.num_blocks": BLOCKS}


def _engine(k: int, *, dtype: str = "float32", dp: int = 1, ep: int = 1, **kw) -> LLM:
    devices = dp * ep
    return LLM(
        "tiny-v41",
        dtype=dtype,
        num_draft_tokens=k,
        max_num_seqs=2 * devices,
        max_num_batched_tokens=16 * devices,
        data_parallel_size=dp,
        expert_parallel_size=ep,
        kv_cache_memory="64MiB",
        **{**_SMALL, "cache.num_blocks": BLOCKS * devices, **kw},
    )


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@functools.cache
def _plain_f32() -> list[list[int]]:
    prompts = _prompts()
    return _tokens(_run(_engine(0), prompts, [_greedy(i) for i in range(len(prompts))]))


def test_bfloat16_batch_invariant_drafts():
    """bfloat16 with batch invariance and 4 drafts: greedy tokens and logprobs bitwise the plain batch-invariant
    bfloat16 engine's (every token's computation runs in fixed tiles, so a verify row's logits are the plain
    decode row's); a seeded sampled request and a greedy one bitwise the same alone and in the batch, the
    sampled one preempted by the batch (its recompute resumes at its last output and drafts after it, so the
    next step verifies the drafts the run without preemption verified; without that it re-samples the token
    after its recomputed prefix and parts from the run alone, checked)."""
    prompts = _prompts()
    invariant = {"batch_invariant": True}
    greedy = [_greedy(i, logprobs=5) for i in range(len(prompts))]
    plain = _run(_engine(0, dtype="bfloat16", **invariant), prompts, greedy)
    llm = _engine(4, dtype="bfloat16", **invariant)
    spec = _run(llm, prompts, greedy)
    for a, b in zip(plain, spec, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert _logprobs(b) == _logprobs(a)
    assert llm.last_stats.spec_rows > 0
    params = list(greedy)
    # The longest output of the batch, so preemption (longest output first) takes it.
    params[2] = SamplingParams(
        temperature=0.9, top_k=50, max_tokens=24, seq_seed=7, logprobs=5, ignore_eos=True
    )
    batch = _run(llm, prompts, params)
    assert batch[2].metrics.num_preemptions > 0, "the small cache must preempt the sampled request"
    for i in (2, 3):
        alone = _run(llm, [prompts[i]], [params[i]])[0]
        assert alone.outputs[0].token_ids == batch[i].outputs[0].token_ids
        assert _logprobs(alone) == _logprobs(batch[i])


def test_mesh_natural_drafts_equal_one_device():
    """dp = 2 x ep = 4, the natural draft length (4): the one-device plain engine's greedy tokens."""
    prompts = _prompts()
    llm = _engine(4, dp=2, ep=4)
    outs = _run(llm, prompts, [_greedy(i) for i in range(len(prompts))])
    assert _tokens(outs) == _plain_f32()
    stats = llm.last_stats
    assert stats.spec_rows > 0 and len(stats.verified_at) == 4


def test_variable_length_verification(tmp_path):
    """Variable length with 4 drafts: the curve is measured and cached, the planner chooses each row's verify
    length, the greedy tokens are the plain engine's; batch invariance refuses it."""
    prompts = _prompts()
    llm = _engine(4, speculative_variable_length=True, **{"speculative.latency_cache_dir": str(tmp_path)})
    curve = llm.latency_curve
    assert curve is not None and all(ms > 0 for _, ms in curve.points)
    outs = _run(llm, prompts, [_greedy(i) for i in range(len(prompts))])
    assert _tokens(outs) == _plain_f32()
    stats = llm.last_stats
    # Two rows in a 16-token bucket: a verified draft costs no time on the measured curve, so the planner may
    # verify all of them (tests/engine/test_engine_speculative.py and the trained-model benchmark show it
    # verifying fewer where they cost time); what it chose was counted.
    assert stats.spec_rows > 0 and 0 < stats.verified_per_step <= 4
    assert llm.scheduler.devices[0].verify_planner is not None
    assert len(list(tmp_path.iterdir())) == 1
    with pytest.raises(ValueError, match=r"variable_length with ops\.batch_invariant"):
        LLM("tiny-v41", num_draft_tokens=4, batch_invariant=True, speculative_variable_length=True)
