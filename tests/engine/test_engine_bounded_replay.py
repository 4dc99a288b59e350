"""SWA bounded replay (``scheduler.yoco_truncation``) in the engine, on tiny-v41 (random weights, float32, DSpark
drafts on: its draft target layers 4, 5, 6 lie in the consumer half).

``mask`` and ``compact`` compute the same model (the rectangle ``p >= L - K`` of the consumer layers), so their
greedy tokens must be equal; ``off`` is the exact model, which truncation changes on purpose: its agreement with
``compact`` is printed, not asserted. ``K = 20 = W + B`` (W = 16, DSpark block B = 4), so a 70-token prompt drops
50 consumer rows.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from deepinfer_jax import LLM, SamplingParams

K = 20
SMALL = {
    "dtype": "float32",
    "max_num_seqs": 2,
    "max_num_batched_tokens": 16,
    "seed": 0,
    "num_draft_tokens": 4,
}


BLOCK = 16


@functools.cache
def _engine(mode: str, dp: int = 1) -> LLM:
    extra = {"data_parallel_size": dp} if dp > 1 else {}
    if mode != "off":
        extra.update({"scheduler.yoco_truncation": mode, "scheduler.yoco_keep_tokens": K})
    if mode == "compact":  # prefix caching under truncation (snapshot slots for every boundary of the cases)
        extra.update(
            {
                "enable_prefix_caching": True,
                "cache.block_size": BLOCK,
                "cache.state_slots_ratio": 8.0,
                "cache.host_memory": 32 << 20,
            }
        )
    return LLM("tiny-v41", **SMALL, **extra)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(3, 500, size=n).tolist() for n in (70, 45)]


@functools.cache
def _tokens(mode: str, dp: int = 1) -> tuple[tuple[int, ...], ...]:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    out = _engine(mode, dp).generate(prompts, params, use_tqdm=False)
    return tuple(tuple(o.outputs[0].token_ids) for o in out)


def test_mask_equals_compact_and_compact_differs_from_off_by_design():
    mask, compact, off = _tokens("mask"), _tokens("compact"), _tokens("off")
    assert mask == compact
    same = sum(a == b for x, y in zip(compact, off, strict=True) for a, b in zip(x, y, strict=True))
    total = sum(len(x) for x in off)
    print(f"compact vs off: {same}/{total} greedy tokens agree ({100 * same / total:.0f}%)")
    assert all(len(x) == 16 for x in compact)


def test_the_mesh_gives_the_one_device_tokens():
    assert _tokens("compact", 2) == _tokens("compact")


def test_prompt_logprobs_and_a_small_keep_are_refused():
    llm = _engine("compact")
    with pytest.raises(ValueError, match=r"sampling_params.prompt_logprobs .*scheduler.yoco_truncation"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(prompt_logprobs=1), use_tqdm=False)
    with pytest.raises(ValueError, match=r"scheduler.yoco_keep_tokens = 19: .* = 16 \+ 4 = 20"):
        LLM("tiny-v41", **SMALL, **{"scheduler.yoco_truncation": "mask", "scheduler.yoco_keep_tokens": 19})


def test_prefix_hits_under_compact_replay_equal_cold_runs():
    """Prefix caching with bounded replay (docs/prefix_cache.md, "Bounded replay"). The source prompt ``S`` (70
    tokens, bound ``R_s = 70 - K = 50``) leaves snapshots at 16, 32, 48 and 64 whose consumer-layer window
    entries exist only from 50 on and depend on that bound. A hit at ``h`` restores one only when the new
    request's bound ``R'`` is at or past ``h`` (it reads no consumer entry before ``h``) or equals ``R_s``;
    otherwise it steps back a block. Each hit gives the tokens and logprobs of the same prompt computed cold
    (after ``reset_prefix_cache``) on the same engine; the tolerance is the prefix-cache tests' (1e-4: a hit
    prefills other chunks, float32 sums reassociate)."""
    llm = _engine("compact")
    rng = np.random.default_rng(7)
    stem = rng.integers(3, 500, size=70).tolist()
    tail = rng.integers(3, 500, size=30).tolist()
    cases = {  # prompt, expected cached tokens
        "the same prompt (R' = R_s = 50, h = 64)": (stem, 64),
        "3 shared blocks, a longer tail (R' = 58 >= h = 48)": (stem[:48] + tail, 48),
        "5 more tokens (R' = 55: h = 64 steps back to 48)": (stem + tail[:5], 48),
        "a shorter prompt (R' = 40: h = 48, before R_s, steps back to 32)": (stem[:60], 32),
        "a long continuation (R' = 80 >= h = 64)": (stem + tail, 64),
    }
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)

    def run(prompt):
        return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]

    def logprobs(out):
        c = out.outputs[0]
        return np.array([e[t].logprob for e, t in zip(c.logprobs, c.token_ids, strict=True)])

    cold = {}
    for name, (prompt, _) in cases.items():
        llm.reset_prefix_cache()
        cold[name] = run(prompt)
        assert cold[name].num_cached_tokens == 0
    llm.reset_prefix_cache()
    run(stem)
    for name, (prompt, cached) in cases.items():
        hot = run(prompt)
        assert hot.num_cached_tokens == cached, name
        assert hot.outputs[0].token_ids == cold[name].outputs[0].token_ids, name
        np.testing.assert_allclose(logprobs(hot), logprobs(cold[name]), atol=1e-4, rtol=0, err_msg=name)
    llm.scheduler.devices[0].blocks.check_consistency()
