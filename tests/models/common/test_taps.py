"""Taps: no-ops outside a collect block; inside one, every MoE layer's routing in layer order."""

from __future__ import annotations

import jax
import numpy as np

from deepinfer_jax import load_model
from deepinfer_jax.models.common import taps
from deepinfer_jax.models.deepseek_v4 import v41_model
from deepinfer_jax.models.deepseek_v4.attention import sink_attention, sink_attention_weights
from deepinfer_jax.models.deepseek_v4.family_v41 import static_for


def test_record_outside_collect_does_nothing_and_blocks_nest():
    taps.record("x", a=1)  # nowhere to go: ignored
    with taps.collect() as outer:
        taps.record("x", a=1)
        with taps.collect() as inner:
            taps.record("y", b=2)
        taps.record("z", c=3)
    assert outer == [("x", {"a": 1}), ("z", {"c": 3})] and inner == [("y", {"b": 2})]
    taps.record("x", a=4)
    assert len(outer) == 2


def test_v41_forward_offers_routing_and_compressed_attention_when_traced():
    model = load_model("tiny-v41")
    static = static_for(model.config, "float32")
    ids = jax.ShapeDtypeStruct((1, 9), np.int32)
    with taps.collect() as tapped:
        jax.eval_shape(lambda p, i: v41_model.forward_logits(p, i, static=static), model.params, ids)
    kinds = [kind for kind, _ in tapped]
    assert kinds.count("moe_routing") == model.config.num_hidden_layers
    compressed = [v["layer"] for kind, v in tapped if kind == "v41_attention"]
    assert compressed == [i for i, r in enumerate(model.config.compress_ratios) if r > 0]
    first = next(v for kind, v in tapped if kind == "moe_routing")
    assert first["ids"].shape == (9, model.config.num_experts_per_tok) and first["num_experts"] == 8


def test_v41_attention_taps_give_the_layer_attention_pattern():
    """The tapped keys, mask and sinks of a compressed layer reproduce its attention: the weights of
    ``sink_attention_weights`` applied to the keys equal ``sink_attention``; the mask is the sliding window over
    the window keys, then the selected compressed keys."""
    model = load_model("tiny-v41")
    static = static_for(model.config, "float32")
    s = 24
    ids = np.random.default_rng(0).integers(3, model.config.vocab_size, (1, s)).astype(np.int32)
    with taps.collect() as tapped:
        v41_model.forward_logits(model.params, ids, static=static)
    by_layer = {v["layer"]: v for kind, v in tapped if kind == "v41_attention"}
    assert by_layer, "no compressed layer tapped"
    window = model.config.sliding_window
    t = np.arange(s)
    for layer, tap in by_layer.items():
        keys, mask = np.asarray(tap["keys"]), np.asarray(tap["mask"])
        ratio = model.config.compress_ratios[layer]
        assert keys.shape[1] == s + tap["compressed_keys"].shape[1] and mask.shape == (1, s, keys.shape[1])
        in_window = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - window)
        np.testing.assert_array_equal(mask[0, :, :s], in_window)
        # A query sees only compressed entries that are complete before it (entry j covers ratio tokens).
        visible = (np.arange(mask.shape[2] - s)[None, :] + 1) * ratio <= t[:, None] + 1
        assert not np.any(mask[0, :, s:] & ~visible), f"layer {layer}: a selected entry is not visible yet"
        weights = sink_attention_weights(tap["queries"], keys, mask, tap["sinks"], scale=tap["scale"])
        w = np.asarray(weights)
        assert np.all(w[~np.broadcast_to(mask[:, :, None, :], w.shape)] == 0)
        assert np.all(w.sum(-1) < 1.0) and np.all(w.sum(-1) > 0.0)  # the sink keeps a share
        out = sink_attention(tap["queries"], keys, mask, tap["sinks"], scale=tap["scale"])
        np.testing.assert_allclose(
            np.einsum("bsht,btd->bshd", w, keys), np.asarray(out), rtol=1e-5, atol=1e-6
        )
