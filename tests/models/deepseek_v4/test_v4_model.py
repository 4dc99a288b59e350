"""End-to-end parity of the DeepSeek-V4 forward with transformers 5.24 (float32, eager), on tiny-v4.

Tolerance: the JAX and torch forwards compute the same float32 expressions in different orders (einsum vs
bmm, fused vs separate softmax), which moves logits of magnitude ~5 by a few ulps per layer; the measured
difference is ~5e-6, and 1e-4 leaves room for other BLAS builds while staying far below the greedy margins
(>= 6e-2, checked by the fixture script) and any indexer or router top-k gap.
"""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer_jax.models.deepseek_v4 import model as v4_model

ATOL = 1e-4


def test_v4_fixture_margins(v4_meta):
    """The fixture script only writes prompts whose selections cannot flip under float32 noise (~5e-6 here):
    indexer and router top-k boundaries and greedy choices all have a clear gap."""
    assert v4_meta["transformers"] == "5.24.0" and v4_meta["dtype"] == "float32"
    assert v4_meta["min_indexer_topk_gap"] > 1e-3
    assert v4_meta["min_router_topk_gap"] > 1e-3
    assert v4_meta["min_greedy_margin"] > 1e-2


def test_v4_full_forward_matches_transformers(v4, v4_logits):
    """Both fixture sequences in one batch (their first 53 tokens: a causal model's rows do not see later
    tokens), so the test also shows that batch rows do not interact."""
    length = len(v4_logits["sequence_a"])
    batch = np.stack([v4_logits["sequence_a"], v4_logits["sequence_b"][:length]])
    out = v4.full(batch)
    np.testing.assert_allclose(out[0], v4_logits["full_logits_a"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(out[1], v4_logits["full_logits_b"][:length], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["a", "b"])
def test_v4_incremental_decode_matches_transformers_generate(v4, v4_logits, v4_meta, name):
    """Prefill the prompt (ending inside / at the edge of a compression window), then decode one token at a time
    through the compressor state; every step's logits and the greedy tokens match transformers' ``generate``."""
    prompt, seq = v4_logits[f"prompt_{name}"], v4_logits[f"sequence_{name}"]
    assert len(prompt) in v4_meta["prompt_lengths"]
    logits, state = v4.chunk(prompt[None], 0, v4.fresh_state())
    steps, tokens = [logits[0, -1]], [int(logits[0, -1].argmax())]
    for pos in range(len(prompt), len(seq) - 1):
        logits, state = v4.chunk(np.asarray([[tokens[-1]]]), pos, state)
        steps.append(logits[0, -1])
        tokens.append(int(logits[0, -1].argmax()))
    np.testing.assert_allclose(np.stack(steps), v4_logits[f"step_logits_{name}"], atol=ATOL, rtol=0)
    assert tokens == list(seq[len(prompt) :])


def test_v4_token_by_token_equals_full_forward(v4, v4_logits):
    """Decoding every position one token at a time (windows completing at every 4th / 16th step) reproduces the
    full forward; float32 reassociation only (see the module tolerance)."""
    seq = v4_logits["sequence_b"]
    full = v4.full(seq[None])[0]
    state = v4.fresh_state()
    rows = []
    for pos, tok in enumerate(seq):
        logits, state = v4.chunk(np.asarray([[tok]]), pos, state)
        rows.append(logits[0, -1])
    np.testing.assert_allclose(np.stack(rows), full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["a", "b"])
def test_v4_chunked_prefill_equals_full_forward(v4, v4_logits, name):
    """A prompt chunk ending inside (45) or at the edge (48) of the 4- and 16-token windows, then a chunk of 8
    tokens that completes and opens windows, gives transformers' full-forward logits."""
    prompt, seq = v4_logits[f"prompt_{name}"], v4_logits[f"sequence_{name}"]
    first, state = v4.chunk(prompt[None], 0, v4.fresh_state())
    second, _ = v4.chunk(seq[None, len(prompt) :], len(prompt), state)
    rows = np.concatenate([first[0], second[0]])
    np.testing.assert_allclose(rows, v4_logits[f"full_logits_{name}"], atol=ATOL, rtol=0)


def test_v4_chunk_beyond_the_state_capacity_is_refused(v4):
    state = v4_model.init_state(v4.plan, 1, 16)  # room for 16 // 4 + 1 = 5 CSA entries
    with pytest.raises(ValueError, match=r"positions up to 24 need 6 compressed entries in layer 1.*max_len"):
        v4_model.forward_chunk(
            v4.params, np.zeros((1, 1), np.int32), 23, state, plan=v4.plan, numerics=v4.numerics
        )
    with pytest.raises(ValueError, match="start = -1"):
        v4_model.forward_chunk(
            v4.params, np.zeros((1, 1), np.int32), -1, state, plan=v4.plan, numerics=v4.numerics
        )
    with pytest.raises(ValueError, match="max_len"):
        v4_model.init_state(v4.plan, 1, 0)
