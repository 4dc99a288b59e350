"""DeepSeek-V3 against transformers 5.24.0 (fixtures from scripts/reference_fixtures/v3.py).

Tolerance: both sides compute in float32 from the same bf16-representable weights, in different orders
(fused vs separate matmuls, absorbed vs expanded attention), so logits differ by float32 rounding that grows
with depth: ~1e-6 of the logit scale was measured. The bound used, 2e-5 of the largest |logit| (logits here
are O(5)), keeps a 10x margin and still fails on any real mistake (a wrong YaRN factor, norm, routing weight or
a flipped expert changes logits by 1e-3 or more). Greedy tokens must match exactly: the fixture generator
guarantees a top-1 margin of >= 1e-2 at every step.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from deepinfer_jax.models.deepseek_v3 import model as v3_model

REL_TOL = 2e-5


def assert_logits_close(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=REL_TOL * np.abs(want).max())


def test_yarn_factors_match_transformers(v3_fixture):
    # The cos/sin magnitude (mscale / mscale_all_dim ratio) and the softmax scale (qk_head_dim^-1/2 · mscale²)
    # as transformers derived them for the same config (recorded by the generator).
    pl = v3_model.plan(v3_fixture.cfg, "float32")
    np.testing.assert_allclose(pl.rope_magnitude, v3_fixture.meta["rope_attention_scaling"], rtol=1e-12)
    np.testing.assert_allclose(pl.softmax_scale, v3_fixture.meta["softmax_scale"], rtol=1e-12)
    assert pl.rope_magnitude != 1.0  # the fixtures exercise the magnitude factor


def test_full_forward_logits_match(v3_fixture):
    # One compiled shape: the prompt's logits are the causal prefix of the whole sequence's.
    ref = v3_fixture.ref
    logits = v3_fixture.model.logits(ref["sequence"])
    assert_logits_close(logits, ref["sequence_logits"])
    assert_logits_close(logits[:, : ref["input_ids"].shape[1]], ref["logits"])


def test_incremental_decode_and_greedy_generation_match(v3_fixture):
    f, ref = v3_fixture, v3_fixture.ref
    prompt = ref["input_ids"]
    batch, prompt_len = prompt.shape
    steps = ref["generated"].shape[1]
    cache = v3_model.init_cache(f.cfg, batch, prompt_len + steps, "float32")
    positions = np.broadcast_to(np.arange(prompt_len, dtype=np.int32), prompt.shape).copy()
    logits, cache = f.forward(f.params, f.cfg, prompt, positions, cache)
    assert_logits_close(logits, ref["logits"])
    step_logits, tokens = [], []
    last = np.asarray(logits)[:, -1]
    for i in range(steps):
        step_logits.append(last)
        token = last.argmax(-1).astype(np.int32)[:, None]
        tokens.append(token)
        pos = np.full((batch, 1), prompt_len + i, np.int32)
        logits, cache = f.forward(f.params, f.cfg, token, pos, cache)
        last = np.asarray(logits)[:, -1]
    np.testing.assert_array_equal(np.concatenate(tokens, 1), ref["generated"])
    assert_logits_close(np.stack(step_logits, 1), ref["decode_logits"])


def _mtp_inputs(f):
    seq = f.ref["sequence"]
    _, hidden = f.hidden(f.params, f.cfg, seq)
    return hidden[:, :-1], seq[:, 1:]


def test_mtp_head_matches(v3_fixture):
    f = v3_fixture
    hidden, nxt = _mtp_inputs(f)
    logits, draft_hidden, _ = f.mtp(f.params, f.cfg, hidden, nxt)
    assert_logits_close(logits, f.ref["mtp_logits"])
    assert draft_hidden.shape == (*nxt.shape, f.cfg.hidden_size)


def test_mtp_one_token_drafting_with_cache_matches_full(v3_fixture):
    # The draft head run one token per call over its cache slot equals its no-cache run over the sequence.
    f = v3_fixture
    hidden, nxt = _mtp_inputs(f)
    full, _, _ = f.mtp(f.params, f.cfg, hidden, nxt)
    steps_to_check = 6
    cache = v3_model.init_cache(f.cfg, nxt.shape[0], nxt.shape[1], "float32")
    steps = []
    for i in range(steps_to_check):
        pos = np.full((nxt.shape[0], 1), i, np.int32)
        out, _, cache = f.mtp(f.params, f.cfg, hidden[:, i : i + 1], nxt[:, i : i + 1], pos, cache)
        steps.append(np.asarray(out))
    assert_logits_close(np.concatenate(steps, 1), np.asarray(full)[:, :steps_to_check])
    # Only the MTP slot of the cache was written.
    lat = np.asarray(cache["latent"])
    assert not lat[: f.cfg.num_hidden_layers].any()
    assert lat[f.cfg.num_hidden_layers, :, :steps_to_check].any()
    assert not lat[f.cfg.num_hidden_layers, :, steps_to_check:].any()


def test_fixture_weights_are_not_identities(v3_fixture):
    # The generator randomised every norm and router bias: a model that ignored them could not pass above.
    p = v3_fixture.params
    assert not np.allclose(np.asarray(p["norm"]), 1.0)
    moe = [layer["mlp"] for layer in p["layers"] if "router" in layer["mlp"]]
    assert moe and all(np.abs(np.asarray(m["bias"])).max() > 0 for m in moe)
    assert jnp.dtype(p["embed"].dtype) == jnp.float32
