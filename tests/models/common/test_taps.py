"""Taps: no-ops outside a collect block; inside one, every MoE layer's routing in layer order."""

from __future__ import annotations

import jax
import numpy as np

from deepinfer_jax import load_model
from deepinfer_jax.models.common import taps
from deepinfer_jax.models.deepseek_v4 import v41_model
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
