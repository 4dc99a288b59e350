"""What the speculative-decoding engine tests share: the mixed batch of prompts, greedy parameters, a run."""

from __future__ import annotations

import numpy as np

from deepinfer_jax.engine.llm import LLM
from deepinfer_jax.engine.params import SamplingParams


def prompts(seed: int = 0) -> list[list[int]]:
    """Six prompts of 1 to 40 random ids (mixed lengths: a decode from the first step, chunked prefills)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, n).tolist() for n in (1, 5, 17, 40, 9, 23)]


def greedy(i: int, **kw) -> SamplingParams:
    """Greedy parameters of request ``i`` (8 to 16 tokens, 2 logprobs: one compiled step variant)."""
    args = {"temperature": 0.0, "max_tokens": 8 + (i * 3) % 9, "ignore_eos": True, "logprobs": 2, **kw}
    return SamplingParams(**args)


def run(llm: LLM, batch, params):
    return llm.generate(prompt_token_ids=batch, sampling_params=params, use_tqdm=False)


def logprobs(out) -> list[float]:
    """The logprob of each token the request emitted."""
    return [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
