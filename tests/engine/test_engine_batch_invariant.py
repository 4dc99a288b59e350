"""Batch-invariant mode through ``LLM`` for DeepSeek-V3, V4 and V4.1: a request's log-probabilities are bitwise
the same alone and in any batch.

On XLA:CPU a float32 matmul row depends on how many rows share the matmul, so without the mode a request's
logits move in the last bits with the batch (and a near-tie can flip a token). With ``batch_invariant=True``
every per-token computation of the paged forward runs in fixed tiles, so the reported log-probabilities (the
log-softmax of the row's logits) must be *equal*, not close. The request is seeded (temperature 0.8), so its
tokens are checked too. Without the mode this test fails for all three families (checked: the first logprob
already differs in its last bits). Alone the request runs in the 16-token bucket, in the batches in the 64-token one: a
row's matmuls then see other shapes. Each case compiles two step buckets.
"""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer_jax.engine.llm import LLM
from deepinfer_jax.engine.params import SamplingParams

pytestmark = pytest.mark.parametrize("name", ["tiny-v3", "tiny-v4", "tiny-v41"])


def _engine(name: str) -> LLM:
    return LLM(
        name,
        dtype="float32",
        batch_invariant=True,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        kv_cache_memory="32MiB",
        **{"cache.block_size": 16},
    )


def _flatten(output) -> list[tuple[int, int, float, int | None]]:
    """Every reported (position, token id, logprob, rank), in order: what must match bit for bit."""
    rows = []
    for k, entry in enumerate(output.outputs[0].logprobs):
        for token, lp in sorted(entry.items()):
            rows.append((k, token, lp.logprob, lp.rank))
    return rows


def test_logprobs_are_bitwise_independent_of_the_batch(name):
    llm = _engine(name)
    rng = np.random.default_rng(7)
    target = rng.integers(3, 500, 21).tolist()
    params = SamplingParams(temperature=0.8, max_tokens=6, seq_seed=12345, logprobs=5, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=[target], sampling_params=params, use_tqdm=False)[0]
    others = [rng.integers(3, 500, n).tolist() for n in (3, 30, 9, 17, 1)]
    other_params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    # The target sits at different rows and beside prefill chunks of different lengths in the two batches.
    for batch in ([*others[:2], target, *others[2:]], [target, *others[::-1]]):
        index = batch.index(target)
        sampling = [params if i == index else other_params for i in range(len(batch))]
        got = llm.generate(prompt_token_ids=batch, sampling_params=sampling, use_tqdm=False)[index]
        assert got.outputs[0].token_ids == alone.outputs[0].token_ids
        assert _flatten(got) == _flatten(alone)  # exact float equality
