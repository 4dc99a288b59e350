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


@functools.cache
def _engine(mode: str, dp: int = 1) -> LLM:
    extra = {"data_parallel_size": dp} if dp > 1 else {}
    if mode != "off":
        extra.update({"scheduler.yoco_truncation": mode, "scheduler.yoco_keep_tokens": K})
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
