"""Each DeepSeek-V4 module against the matching transformers intermediate (captured with forward hooks).

The fixture script ran transformers' full forward over the first 40 tokens of a fixture sequence and recorded
module inputs and outputs (``tests/data/v4/modules.npz``). Here each module is fed transformers' own input, so
a failure points at that module rather than at everything upstream. Tolerance: float32 evaluation of the same
expressions in a different order; observed differences are ~1e-6 on values of order 1, 1e-4 leaves headroom.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.models.common.linear import linear
from deepinfer_jax.models.common.moe import route
from deepinfer_jax.models.deepseek_v4 import attention as v4_attention
from deepinfer_jax.models.deepseek_v4 import mhc
from deepinfer_jax.models.deepseek_v4.compressor import indexer_scores, visible_entries
from deepinfer_jax.models.deepseek_v4.model import moe_layer
from deepinfer_jax.ops import apply_rope, rms_norm, rope_cos_sin

ATOL = 1e-4


def test_v4_mhc_mixes_match_transformers(v4, v4_meta, v4_modules):
    layer = v4.params["layers"][v4_meta["hc_layer"]]
    streams = jnp.asarray(v4_modules["hc.input"])
    mix = mhc.hc_mixes(
        streams,
        **layer["hc_attn"],
        hc_eps=v4.plan.hc_eps,
        sinkhorn_iters=v4.plan.hc_sinkhorn_iters,
        norm_eps=v4.plan.eps,
    )
    np.testing.assert_allclose(mix.post, v4_modules["hc.post"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(mix.comb, v4_modules["hc.comb"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(
        mhc.hc_collapse(streams, mix.pre), v4_modules["hc.collapsed"], atol=ATOL, rtol=0
    )


def test_v4_hc_head_matches_transformers(v4, v4_modules):
    out = mhc.hc_head(
        jnp.asarray(v4_modules["hc_head.input"]),
        **v4.params["hc_head"],
        hc_eps=v4.plan.hc_eps,
        norm_eps=v4.plan.eps,
    )
    np.testing.assert_allclose(out, v4_modules["hc_head.output"], atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def attention_runs(v4, v4_meta, v4_modules):
    """Every recorded attention layer run once on transformers' input: ``{layer: (output, state)}``."""
    layer_fn = jax.jit(v4_attention.attention_layer, static_argnames=("spec", "numerics"))
    runs = {}
    for i in v4_meta["attention_layers"]:
        x = jnp.asarray(v4_modules[f"attn{i}.input"])[None]
        spec = v4.plan.attention[i]
        state = v4_attention.init_attention_state(spec, 1, x.shape[1])
        runs[i] = layer_fn(v4.params["layers"][i]["attn"], x, 0, state, spec=spec, numerics=v4.numerics)
    return runs


KINDS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]


@pytest.mark.parametrize("layer", [0, 1, 2], ids=["sliding", "csa", "hca"])
def test_v4_attention_layer_matches_transformers(attention_runs, v4, v4_modules, layer):
    assert v4.plan.attention[layer].kind == KINDS[layer]
    out, _ = attention_runs[layer]
    rows = v4_modules["rows"]
    np.testing.assert_allclose(np.asarray(out)[0, rows], v4_modules[f"attn{layer}.output"], atol=ATOL, rtol=0)


@pytest.mark.parametrize("layer", [1, 2], ids=["csa", "hca"])
def test_v4_compressed_entries_match_transformers(attention_runs, v4_modules, layer):
    """The compressor's emitted keys (pooled, normalised, rotated to their window's first position)."""
    _, state = attention_runs[layer]
    ref = v4_modules[f"compressor{layer}.kv"]
    entries = np.asarray(state.compressor.entries)[0]
    np.testing.assert_allclose(entries[: len(ref)], ref, atol=ATOL, rtol=0)
    assert not entries[len(ref) :].any(), "an incomplete window must not be emitted"


def test_v4_indexer_matches_transformers(attention_runs, v4, v4_modules):
    """The indexer compressor's keys and the top-k sets (order inside a set is irrelevant to attention)."""
    _, state = attention_runs[1]
    ref_keys = v4_modules["indexer1.kv"]
    keys = np.asarray(state.indexer.entries)[0, : len(ref_keys)]
    np.testing.assert_allclose(keys, ref_keys, atol=ATOL, rtol=0)

    # Recompute the scores from transformers' keys and our query path, then compare the chosen sets.
    spec = v4.plan.attention[1]
    p = v4.params["layers"][1]["attn"]
    x = jnp.asarray(v4_modules["attn1.input"])[None]
    positions = jnp.arange(x.shape[1])
    cos, sin = rope_cos_sin(positions, spec.freqs())
    q_res = rms_norm(linear(x, p["wq_a"], v4.numerics), p["q_norm"], eps=spec.eps)
    qi = linear(q_res, p["indexer"]["wq_b"], v4.numerics).reshape(
        1, x.shape[1], spec.index_heads, spec.index_dim
    )
    qi = apply_rope(qi, cos[None], sin[None], rope_dim=spec.rope_dim)
    weights = linear(x, p["indexer"]["weights_proj"], v4.numerics)
    scores = np.asarray(indexer_scores(qi, jnp.asarray(ref_keys)[None], weights))[0]
    visible = np.asarray(visible_entries(positions, spec.ratio, len(ref_keys)))
    for row, (picks, vis) in enumerate(zip(v4_modules["indexer1.topk"], visible, strict=True)):
        expected = {int(j) for j in picks if j >= 0}
        candidates = np.flatnonzero(vis)
        ours = set(
            candidates[np.argsort(-scores[row, candidates], kind="stable")][: spec.index_topk].tolist()
        )
        assert ours == expected, f"query {row}"


@pytest.mark.parametrize("layer", [0, 2], ids=["hash", "scored"])
def test_v4_moe_matches_transformers(v4, v4_modules, layer):
    rows = v4_modules["rows"]
    x = jnp.asarray(v4_modules[f"moe{layer}.input"])[None]
    ids = jnp.asarray(v4_modules["input_ids"][rows])[None]
    hashed = v4.plan.mlp_types[layer] == "hash_moe"
    assert hashed == (layer == 0)
    ffn = v4.params["layers"][layer]["ffn"]
    out = moe_layer(ffn, x, ids, v4.plan, v4.numerics, hashed=hashed)
    np.testing.assert_allclose(np.asarray(out)[0], v4_modules[f"moe{layer}.output"], atol=ATOL, rtol=0)

    # The routing itself (experts sorted by id per token, as the fixture stores them).
    routing = route(
        linear(x[0], ffn["gate"], v4.numerics, out_dtype=jnp.float32),
        scoring=v4.plan.scoring,
        top_k=v4.plan.top_k,
        bias=None if hashed else ffn["bias"],
        norm_topk_prob=v4.plan.norm_topk_prob,
        routed_scaling_factor=v4.plan.routed_scaling_factor,
        expert_ids=jnp.take(ffn["tid2eid"], ids[0], axis=0) if hashed else None,
    )
    order = np.argsort(np.asarray(routing.ids), axis=-1)
    np.testing.assert_array_equal(
        np.take_along_axis(np.asarray(routing.ids), order, -1), v4_modules[f"moe{layer}.experts"]
    )
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(routing.weights), order, -1),
        v4_modules[f"moe{layer}.weights"],
        atol=ATOL,
    )
