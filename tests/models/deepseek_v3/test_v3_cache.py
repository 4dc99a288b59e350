"""The cached path (absorbed MLA over a contiguous latent cache) against the naive full forward.

Both compute the same attention; the absorbed form multiplies ``q_nope`` into the latent space first, so the
float32 results differ by rounding only (measured ~1e-6 of the logit scale; bound 2e-5 of the largest |logit|).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer_jax.models.deepseek_v3 import model as v3_model

REL_TOL = 2e-5


def close(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=REL_TOL * np.abs(want).max())


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lags=st.tuples(st.integers(0, 6), st.integers(0, 6)))
def test_rows_at_different_positions_decode_independently(v3_fixture, lags):
    """Token-by-token decode of the whole sequence, each row starting ``lags[row]`` steps late.

    Until a row starts it re-writes its first token at position 0 (idempotent), so one ``[B, 1]`` call moves
    the rows through different positions: every row must reproduce the full forward's logits everywhere.
    """
    f = v3_fixture
    seq = f.ref["sequence"]
    want = f.ref["sequence_logits"]
    batch, length = seq.shape
    lag = np.asarray(lags, np.int32)
    cache = v3_model.init_cache(f.cfg, batch, length, "float32")
    got = np.zeros((batch, length, f.cfg.vocab_size), np.float32)
    for step in range(length + int(lag.max())):
        pos = np.clip(step - lag, 0, length - 1).astype(np.int32)
        tokens = seq[np.arange(batch), pos][:, None].astype(np.int32)
        logits, cache = f.forward(f.params, f.cfg, tokens, pos[:, None], cache)
        got[np.arange(batch), pos] = np.asarray(logits)[:, 0]
    close(got, want)


def test_cache_holds_latent_plus_rope_per_token(v3_fixture):
    cfg = v3_fixture.cfg
    cache = v3_model.init_cache(cfg, 3, 10, "bfloat16")
    assert cache["latent"].shape == (cfg.num_layers_total, 3, 10, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    assert cache["latent"].dtype.name == "bfloat16"


def test_cached_forward_refuses_bad_arguments(v3_fixture):
    f = v3_fixture
    cache = v3_model.init_cache(f.cfg, 2, 4)
    ids = np.zeros((2, 1), np.int32)
    with pytest.raises(ValueError, match=r"positions: values must be in \[0, max_len=4\)"):
        v3_model.forward(f.params, f.cfg, ids, np.full((2, 1), 4), cache)
    with pytest.raises(ValueError, match="positions: shape"):
        v3_model.forward(f.params, f.cfg, ids, np.zeros((2, 2), np.int32), cache)
    with pytest.raises(ValueError, match="cache"):
        v3_model.forward(f.params, f.cfg, np.zeros((3, 1), np.int32), np.zeros((3, 1), np.int32), cache)
    with pytest.raises(ValueError, match="vocab_size"):
        v3_model.forward(
            f.params, f.cfg, np.full((2, 1), f.cfg.vocab_size), np.zeros((2, 1), np.int32), cache
        )
    with pytest.raises(ValueError, match="max_len"):
        v3_model.init_cache(f.cfg, 2, 0)
    with pytest.raises(ValueError, match="depth"):
        v3_model.mtp_forward(f.params, f.cfg, np.zeros((2, 1, f.cfg.hidden_size), np.float32), ids, depth=1)
