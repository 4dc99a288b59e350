"""The static V4.1 layer plan: spec/model.md §15.2's derived structure, the §15.3 variants, invalid topologies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer_jax.config import load_model_config
from deepinfer_jax.config.errors import ConfigValueError
from deepinfer_jax.models.deepseek_v4.plan_v41 import build_v41_plan, describe_plan, source_map

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


@pytest.fixture(scope="module")
def tiny():
    return load_model_config(CONFIGS / "tiny_v41.yaml")


@pytest.fixture(scope="module")
def plan(tiny):
    return build_v41_plan(tiny)


def test_source_map_by_hand():
    assert source_map((1, 3, 5), 7) == (0, 1, 1, 3, 3, 5, 5)
    assert source_map((2,), 4) == (0, 1, 2, 2)
    assert source_map((), 3) == (0, 1, 2)


def test_spec_15_2_boundaries_and_maps(plan):
    assert plan.num_layers == 7 and plan.num_draft_layers == 2
    assert plan.n_prefill_layer == 3
    assert plan.yoco_layer_ids == (3, 4, 5, 6)
    assert plan.shared_hidden_layer == 3
    assert plan.src_kv == (0, 1, 1, 3, 3, 5, 5)
    assert plan.src_ik == (0, 1, 1, 3, 3, 5, 5)
    assert plan.src_idx == (0, 1, 1, 3, 4, 5, 5)
    assert plan.candidate_source == 3
    assert plan.candidate_group == (3, 4, 5, 6)
    assert plan.candidate_consumers == (4, 5)
    assert (plan.candidate_topk_blocks, plan.candidate_block_size) == (8, 8)
    assert plan.engram_layer_ids == (0, 2)
    assert plan.draft_target_layer_ids == (4, 5, 6)
    assert plan.layers_with("draft_target") == (4, 5, 6)
    assert plan.layers_with("engram") == (0, 2)


# The role table of spec §15.2, written out by hand: (ratio, rope base, YaRN, roles).
ROLE_TABLE = {
    0: (0, 1e4, False, ("swa_only", "engram")),
    1: (2, 1.6e5, True, ("kv_source", "index_source", "index_k_source")),
    2: (2, 1.6e5, True, ("kv_consumer", "index_consumer", "index_k_consumer", "engram")),
    3: (1, 1.6e5, True, ("yoco_first", "kv_source", "index_source", "index_k_source", "candidate_source")),
    4: (
        1,
        1.6e5,
        True,
        ("kv_consumer", "index_source", "index_k_consumer", "candidate_consumer", "draft_target"),
    ),
    5: (
        1,
        1.6e5,
        True,
        (
            "kv_source",
            "kv_from_shared_hidden",
            "index_source",
            "index_k_source",
            "candidate_consumer",
            "draft_target",
        ),
    ),
    6: (1, 1.6e5, True, ("kv_consumer", "index_consumer", "index_k_consumer", "draft_target")),
}


@pytest.mark.parametrize("layer", sorted(ROLE_TABLE))
def test_spec_15_2_role_table(plan, layer):
    ratio, theta, yarn, roles = ROLE_TABLE[layer]
    lp = plan.layers[layer]
    assert (lp.ratio, lp.rope_theta, lp.rope_yarn, lp.roles) == (ratio, theta, yarn, roles)
    assert lp.kind == {0: "swa", 1: "c1", 2: "c2"}[ratio]


def test_compressor_inputs_follow_yoco(plan):
    # Layer 3 is the first YOCO layer: a KV source fed by its own hidden (which *is* the shared hidden);
    # layer 5 is a later KV source and reads the shared hidden; consumers have no compressor.
    assert [lp.compressor_input for lp in plan.layers] == [None, "own", None, "own", None, "shared", None]
    assert [lp.captures_shared_hidden for lp in plan.layers] == [False] * 3 + [True] + [False] * 3


def test_draft_layers(plan):
    d0, d1 = plan.draft_layers
    assert (d0.runtime_layer, d0.holds_main_proj, d0.holds_heads, d0.holds_hc_head) == (7, True, False, False)
    assert (d1.runtime_layer, d1.holds_main_proj, d1.holds_heads, d1.holds_hc_head) == (8, False, True, False)


def test_describe_plan_is_json_and_complete(plan):
    desc = json.loads(json.dumps(describe_plan(plan)))
    assert desc["src_idx"] == [0, 1, 1, 3, 4, 5, 5]
    assert desc["candidate"] == {
        "source": 3,
        "group": [3, 4, 5, 6],
        "consumers": [4, 5],
        "topk_blocks": 8,
        "block_size": 8,
    }
    assert desc["layers"][5]["roles"] == list(ROLE_TABLE[5][3])
    assert desc["draft_layers"][0]["holds"] == ["main_proj", "main_norm"]
    assert desc["draft_layers"][1]["holds"] == ["norm", "markov_head", "confidence_head"]
    assert desc["compressed_kv_format"] == "fp4"


def test_plan_is_cached_and_hashable(tiny, plan):
    # A static argument of jax.jit must be hashable; equal configs give the very same plan object.
    assert build_v41_plan(tiny) is plan
    hash(plan)


# ------------------------------------------------------------------------------------------- variants


def test_variant_nonshifted(tiny):
    plan = build_v41_plan(tiny.with_hf_overrides({"hc_shifted": False}))
    assert not plan.hc_shifted
    assert [d.holds_hc_head for d in plan.draft_layers] == [False, True]
    assert describe_plan(plan)["draft_layers"][1]["holds"][-1] == "hc_head"


def test_variant_fp8kv(tiny):
    assert (
        build_v41_plan(tiny.with_hf_overrides({"use_fp4_sparse_kv": False})).compressed_kv_format == "mxfp8"
    )


def test_variant_dense_compressed(tiny):
    plan = build_v41_plan(tiny.with_hf_overrides({"index_topk": 0, "candidate_source_layer_id": None}))
    assert plan.candidate_source is None and plan.candidate_group == () and plan.candidate_consumers == ()
    assert not any(lp.uses_indexer for lp in plan.layers)
    # KV sharing is unchanged; no layer has an indexer role any more.
    assert plan.src_kv == (0, 1, 1, 3, 3, 5, 5)
    assert plan.layers_with("kv_source") == (1, 3, 5)
    assert not any(role.startswith(("index", "candidate")) for lp in plan.layers for role in lp.roles)
    assert describe_plan(plan)["candidate"] is None


def test_variant_bringup(tiny):
    cfg = tiny.with_hf_overrides(
        {"engram_layer_ids": [], "num_nextn_predict_layers": 0, "compress_ratios": [0, 2, 2, 1, 1, 1, 1]}
    )
    plan = build_v41_plan(cfg)
    assert plan.draft_layers == () and plan.engram_layer_ids == ()
    assert plan.draft_target_layer_ids == () and plan.layers_with("draft_target") == ()
    assert plan.n_prefill_layer == 3
    assert plan.src_idx == (0, 1, 1, 3, 4, 5, 5)


def test_variant_xcheck(tiny):
    cfg = tiny.with_hf_overrides(
        {"engram_layer_ids": [1, 2], "kv_source_layer_ids": [1, 3], "index_k_source_layer_ids": None}
    )
    plan = build_v41_plan(cfg)
    assert plan.src_kv == plan.src_ik == (0, 1, 1, 3, 3, 3, 3)
    assert plan.src_idx == (0, 1, 1, 3, 4, 5, 5)
    assert plan.layers_with("kv_from_shared_hidden") == ()
    assert plan.layers_with("engram") == (1, 2)
    # The candidate source is now the last KV source.
    assert plan.candidate_source == max(plan.layers_with("kv_source")) == 3


def test_no_ratio_one_means_no_yoco(tiny):
    cfg = tiny.with_hf_overrides(
        {
            "compress_ratios": [0, 2, 2, 2, 2, 2, 2, 0, 0],
            "candidate_source_layer_id": None,
        }
    )
    plan = build_v41_plan(cfg)
    assert plan.n_prefill_layer == 7 and not plan.has_yoco and plan.shared_hidden_layer is None
    assert all(lp.compressor_input in (None, "own") for lp in plan.layers)


def test_real_flash_plan():
    plan = build_v41_plan(load_model_config(CONFIGS / "deepseek_v41_flash.yaml"))
    assert plan.n_prefill_layer == 20 and plan.shared_hidden_layer == 20
    assert plan.layers_with("kv_source") == (2, 8, 14, 20)
    assert plan.layers_with("index_source") == (2, 8, 14, 20, 24, 28, 32, 36)
    assert plan.candidate_group == tuple(range(20, 40))
    assert plan.candidate_consumers == (24, 28, 32, 36)
    assert plan.layers_with("kv_from_shared_hidden") == ()
    assert plan.layers_with("swa_only") == (0, 1)
    assert plan.engram_layer_ids == (1, 14)
    assert plan.draft_target_layer_ids is None  # not known for the real model
    assert [d.runtime_layer for d in plan.draft_layers] == [40, 41, 42]
    json.dumps(describe_plan(plan))


# ------------------------------------------------------------------------------------ invalid topologies

INVALID = {
    "swa-only consumer": (
        {"compress_ratios": [0, 2, 2, 1, 1, 1, 0, 0, 0]},
        "kv_source_layer_ids",
        "layer 6 is sliding-window only",
    ),
    "consumer of an swa-only source": (
        {"index_source_layer_ids": [0, 3, 4, 5]},
        "index_source_layer_ids",
        "layer 1 (ratio 2) a consumer of layer 0 (ratio 0)",
    ),
    "consumer with another ratio": (
        {"index_source_layer_ids": [1, 4, 5]},
        "index_source_layer_ids",
        "layer 3 (ratio 1) a consumer of layer 1 (ratio 2)",
    ),
    "top-k segment across index-K segments": (
        {"index_source_layer_ids": [1, 3, 5], "index_k_source_layer_ids": [1, 3, 4, 5]},
        "index_source_layer_ids",
        "rule 3",
    ),
    "index-K segment across KV segments": (
        {"kv_source_layer_ids": [1, 3, 4, 5]},
        "index_k_source_layer_ids",
        "rule 3",
    ),
    "default index-K list across KV segments": (
        {
            "kv_source_layer_ids": [1, 3, 5],
            "index_k_source_layer_ids": None,
            "index_source_layer_ids": [1, 3, 6],
        },
        "index_source_layer_ids",
        "rule 3",
    ),
    "candidate source reusing another top-k": (
        {"candidate_source_layer_id": 4, "index_source_layer_ids": [1, 3, 5]},
        "candidate_source_layer_id",
        "must be an index source",
    ),
    "candidate group with mixed ratios": (
        {"candidate_source_layer_id": 2, "index_source_layer_ids": [1, 2, 3, 4, 5]},
        "candidate_source_layer_id",
        "layer 3 has compress ratio 1",
    ),
    "candidate source without an indexer": (
        {"index_topk": 0},
        "candidate_source_layer_id",
        "index_topk = 0",
    ),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_topologies_are_refused(tiny, case):
    overrides, key, rule = INVALID[case]
    cfg = tiny.with_hf_overrides(overrides)
    with pytest.raises(ConfigValueError) as info:
        build_v41_plan(cfg)
    message = str(info.value)
    assert info.value.field == f"text_config.{key}"
    assert message.startswith(f"text_config.{key} = ")
    assert rule in message
    assert "tiny_v41.yaml" in message  # the file is named


def test_yoco_compaction_needs_targets_on_one_side(tiny, plan):
    plan.check_yoco_compaction()  # targets 4, 5, 6 are all in the consumer half
    mixed = build_v41_plan(tiny.with_hf_overrides({"dspark_target_layer_ids": [2, 4]}))
    with pytest.raises(ConfigValueError, match=r"dspark_target_layer_ids = \[2, 4\].*n_prefill_layer = 3"):
        mixed.check_yoco_compaction()
