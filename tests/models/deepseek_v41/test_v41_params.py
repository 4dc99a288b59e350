"""The DeepSeek-V4.1 checkpoint contract (spec/model.md §13) and parameter assembly.

The manifest is compared with the synthetic checkpoint writer (which follows the raw config lists, not the plan)
for the tiny config and its §15.3 variants; the assembled tree with the built-in checkpoint and with the raw
tensors (experts stacked in index order, the shared ``[w1; w3]`` fusion, FP8 bytes kept); bad checkpoints with
the names they must report.
"""

from __future__ import annotations

import copy
import logging

import jax
import ml_dtypes
import numpy as np
import pytest

from deepinfer_jax.checkpoint.model_loading import load_model
from deepinfer_jax.checkpoint.reader import CheckpointError, open_checkpoint
from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.models import builtin
from deepinfer_jax.models.builtin import TensorRngFactory, hf_config
from deepinfer_jax.models.deepseek_v4 import v41_params
from deepinfer_jax.models.deepseek_v4.synthetic import generate_v41_weights
from deepinfer_jax.models.registry import get_family

IGNORED_SUFFIX = ".ffn.gate.bias_vl"


def variant(**text_config):
    hf = copy.deepcopy(hf_config("tiny-v41"))
    hf["text_config"].update(text_config)
    return hf


VARIANTS = {
    "tiny": {},
    "nonshifted": {"hc_shifted": False},
    "fp8kv": {"use_fp4_sparse_kv": False},
    "dense_compressed": {
        "index_topk": 0,
        "candidate_source_layer_id": None,
        "candidate_topk_blocks": None,
        "candidate_block_size": None,
    },
    "bringup": {
        "engram_layer_ids": [],
        "engram_num_embeddings": None,
        "num_nextn_predict_layers": 0,
        "compress_ratios": [0, 2, 2, 1, 1, 1, 1],
        "dspark_target_layer_ids": None,
    },
}


@pytest.fixture(scope="module")
def tiny_path():
    return builtin.materialize("tiny-v41")


@pytest.fixture(scope="module")
def tiny_model():
    return load_model("tiny-v41")


@pytest.fixture(scope="module")
def tiny_tensors(tiny_path):
    with open_checkpoint(tiny_path) as reader:
        return dict(reader.read_many(list(reader.names())))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_manifest_equals_the_synthetic_writer(name):
    hf = variant(**VARIANTS[name])
    cfg = ModelConfig.from_hf(hf)
    expected = v41_params.expected_tensors(cfg)
    written = generate_v41_weights(hf, TensorRngFactory(0))
    kept = {n: a for n, a in written.items() if not n.endswith(IGNORED_SUFFIX)}
    required = {n for n, (_, _, optional) in expected.items() if not optional}
    assert required <= set(kept), sorted(required - set(kept))
    assert set(kept) <= set(expected), sorted(set(kept) - set(expected))
    for n, a in kept.items():
        shape, dtypes, _ = expected[n]
        assert tuple(a.shape) == shape, n
        assert np.dtype(a.dtype).name == dtypes[0], (n, a.dtype, dtypes)
    # Tensors the writer emits for listed sources that the plan gives no use: only the dense variant has them
    # (index sources with index_topk = 0 select nothing), and they are optional, not required.
    leftover = set(kept) - required
    if name == "dense_compressed":
        assert leftover and all(".attn.indexer." in n for n in leftover)
    else:
        assert leftover == set()


def test_manifest_shapes_of_spec_15_2():
    """Hand-copied from §15.2 / §13: the shapes that follow from the tiny config."""
    e = v41_params.expected_tensors(ModelConfig.from_hf(variant()))
    assert e["layers.0.hc_attn_fn"][:2] == ((24, 1024), ("float32",))
    assert e["layers.3.attn.wq_b.weight"][0] == (512, 128)
    assert e["layers.1.attn.indexer.wq_b.weight"][0] == (1024, 128)
    assert e["layers.1.attn.indexer.weights_proj.weight"][0] == (8, 256)
    assert e["layers.2.attn.wo_a.weight"][0] == (128, 256) and e["layers.2.attn.wo_b.weight"][0] == (256, 128)
    assert e["layers.4.ffn.experts.7.w1.weight"][0] == (128, 128)
    assert e["layers.4.ffn.experts.7.w2.weight"][0] == (256, 64)
    assert e["layers.4.ffn.experts.7.w2.scale"][0] == (256, 4)
    assert e["layers.0.engram.wkv.weight"][0] == (1280, 512)
    assert e["layers.0.engram.embed.weight"][0] == (4062, 128)
    assert e["layers.2.engram.embed.weight"][0] == (4152, 128)
    assert e["layers.2.engram.embed.scale"][0] == (4152, 4)
    assert e["mtp.0.main_proj.weight"][0] == (256, 768)
    assert e["mtp.1.markov_head.embed.weight"][0] == (512, 32)
    assert e["mtp.1.confidence_head.proj.weight"][0] == (1, 288)
    # Roles (§15.2): layer 2 consumes layer 1's KV and top-k; layer 4 owns an indexer query but no keys.
    assert e["layers.2.attn.compressor.wkv.weight"][2] and e["layers.2.attn.indexer.wq_b.weight"][2]
    assert not e["layers.4.attn.indexer.wq_b.weight"][2] and e["layers.4.attn.indexer.wk.weight"][2]
    assert not e["layers.5.attn.compressor.wkv.weight"][2] and e["layers.3.attn.compressor.wgate.weight"][2]
    assert e["hc_head_fn"][2]  # shifted schedule: the HC head is a tolerated leftover


def test_init_params_equals_the_checkpoint(tiny_model):
    """init_params with the built-in seed (config read from the built-in folder) equals loading tiny-v41."""
    params = v41_params.init_params(tiny_model.config, builtin.get_builtin("tiny-v41").seed)
    flat_a, tree_a = jax.tree.flatten_with_path(params)
    flat_b, tree_b = jax.tree.flatten_with_path(tiny_model.params)
    assert tree_a == tree_b
    for (path, a), (_, b) in zip(flat_a, flat_b, strict=True):
        assert a.dtype == b.dtype, path
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


def test_assembled_layout(tiny_model, tiny_tensors):
    p, t = tiny_model.params, tiny_tensors
    ffn = p["layers"][4]["ffn"]
    for e in (0, 5):  # experts stacked in index order, bytes unchanged
        np.testing.assert_array_equal(
            np.asarray(ffn["experts"]["gate"]["packed"][e]), t[f"layers.4.ffn.experts.{e}.w1.weight"]
        )
        np.testing.assert_array_equal(
            np.asarray(ffn["experts"]["down"]["scale"][e]),
            t[f"layers.4.ffn.experts.{e}.w2.scale"].view(np.uint8),
        )
    assert ffn["experts"]["up"]["packed"].shape == (8, 128, 128)
    w13 = np.asarray(ffn["shared"]["w13"]["weight"])
    np.testing.assert_array_equal(w13[:128], t["layers.4.ffn.shared_experts.w1.weight"].view(np.uint8))
    np.testing.assert_array_equal(w13[128:], t["layers.4.ffn.shared_experts.w3.weight"].view(np.uint8))
    assert ffn["shared"]["w13"]["scale"].shape == (8, 8)
    wq_a = p["layers"][0]["attn"]["wq_a"]
    assert wq_a["weight"].dtype == np.uint8 and wq_a["scale"].dtype == np.uint8
    # Roles decide what a layer owns.
    assert set(p["layers"][3]["attn"]["compressor"]) == {"wkv", "norm"}  # ratio 1: no gate
    assert set(p["layers"][1]["attn"]["compressor"]) == {"wkv", "wgate", "norm"}
    assert "compressor" not in p["layers"][2]["attn"] and "indexer" not in p["layers"][2]["attn"]
    assert set(p["layers"][4]["attn"]["indexer"]) == {"wq_b", "weights_proj"}
    assert "engram" in p["layers"][2] and "engram" not in p["layers"][1]
    assert "hc_head" not in p and len(p["mtp"]) == 2 and "main_proj" in p["mtp"][0]
    # The compression map of the synthetic tokenizer (docs/models_v41.md: Vc = 412).
    assert int(np.asarray(p["engram_compress"]).max()) + 1 == 412


@pytest.fixture(scope="module")
def tiny_cfg(tiny_model):
    return tiny_model.config


def test_missing_tensor_is_named(tiny_cfg, tiny_tensors):
    broken = {n: a for n, a in tiny_tensors.items() if n != "layers.3.attn.compressor.norm.weight"}
    with pytest.raises(ValueError, match=r"lacks 1 .*layers\.3\.attn\.compressor\.norm\.weight"):
        v41_params.assemble_params(tiny_cfg, broken)
    broken = {n: a for n, a in tiny_tensors.items() if n != "layers.6.ffn.experts.3.w2.scale"}
    with pytest.raises(ValueError, match=r"layers\.6\.ffn\.experts\.3\.w2\.scale"):
        v41_params.assemble_params(tiny_cfg, broken)


def test_wrong_shape_and_dtype_are_named(tiny_cfg, tiny_tensors):
    bad = dict(tiny_tensors)
    bad["layers.1.attn.wkv.weight"] = bad["layers.1.attn.wkv.weight"][:, :128]
    with pytest.raises(
        ValueError, match=r"layers\.1\.attn\.wkv\.weight.*shape \(128, 128\), expected \(128, 256\)"
    ):
        v41_params.assemble_params(tiny_cfg, bad)
    bad = dict(tiny_tensors)
    bad["layers.0.attn.attn_sink"] = bad["layers.0.attn.attn_sink"].astype(ml_dtypes.bfloat16)
    with pytest.raises(
        ValueError, match=r"layers\.0\.attn\.attn_sink.*dtype bfloat16, expected one of \('float32',\)"
    ):
        v41_params.assemble_params(tiny_cfg, bad)


def test_unexpected_and_duplicate_tensors_are_refused(tiny_cfg, tiny_tensors):
    extra = dict(tiny_tensors)
    extra["layers.0.attn.compressor.wkv.weight"] = np.zeros((128, 256), ml_dtypes.bfloat16)  # an SWA layer
    with pytest.raises(ValueError, match=r"does not have: \['layers\.0\.attn\.compressor\.wkv\.weight'\]"):
        v41_params.assemble_params(tiny_cfg, extra)
    dup = dict(tiny_tensors)
    dup["model.norm.weight"] = dup["norm.weight"]
    with pytest.raises(ValueError, match=r"'model\.norm\.weight'.*same DeepSeek-V4\.1 tensor"):
        v41_params.assemble_params(tiny_cfg, dup)


def test_prefixed_ignored_and_role_unused_tensors(tiny_cfg, tiny_tensors, tiny_model, caplog):
    """``model.`` names load; vision / image / bias_vl names are skipped; a layer's unused tensors are logged."""
    tensors = {f"model.{n}": a for n, a in tiny_tensors.items()}
    tensors["model.vision.patch_embed.weight"] = np.zeros((4, 4), np.float32)
    tensors["model.image_newline"] = np.zeros((256,), ml_dtypes.bfloat16)
    # Layer 2 reads layer 1's indexer keys: its own wk is a leftover the reference loader tolerates.
    tensors["layers.2.attn.indexer.wk.weight"] = np.zeros((128, 128), ml_dtypes.bfloat16)
    with caplog.at_level(logging.INFO, logger=v41_params.__name__):
        params = v41_params.assemble_params(tiny_cfg, tensors)
    assert "layers.2.attn.indexer.wk.weight" in caplog.text
    assert "indexer" not in params["layers"][2]["attn"]
    np.testing.assert_array_equal(np.asarray(params["embed"]), np.asarray(tiny_model.params["embed"]))


def test_load_model_reports_every_bad_tensor(tiny_path, tiny_tensors, tmp_path):
    """Through the shared loader: a missing and a misshapen tensor are both listed, with their names."""
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).write_bytes((tiny_path / name).read_bytes())
    tensors = {n: a for n, a in tiny_tensors.items() if n != "layers.5.attn.indexer.k_norm.weight"}
    tensors["mtp.1.markov_head.head.weight"] = tensors["mtp.1.markov_head.head.weight"][:, :16]
    builtin.write_safetensors(tmp_path / "model.safetensors", tensors)
    with pytest.raises(CheckpointError) as info:
        load_model(tmp_path)
    problems = "\n".join(info.value.problems)
    assert "missing: 'layers.5.attn.indexer.k_norm.weight'" in problems
    assert "'mtp.1.markov_head.head.weight': expected (512, 32), found (512, 16)" in problems


def test_a_dtype_that_is_no_precision_mode_is_refused(tiny_cfg, tiny_tensors):
    with pytest.raises(ValueError, match="float16"):
        v41_params.assemble_params(tiny_cfg, tiny_tensors, "float16")


def test_engram_without_tokenizer_needs_the_identity_size():
    """A config dict has no folder, hence no tokenizer.json: only Vc == vocab_size (the identity) works."""
    cfg = ModelConfig.from_hf(variant())  # engram_compressed_vocab_size: null
    with pytest.raises(
        ValueError, match=r"text_config\.engram_compressed_vocab_size = None.*= vocab_size = 512"
    ):
        v41_params.engram_compression(cfg)
    identity = v41_params.engram_compression(ModelConfig.from_hf(variant(engram_compressed_vocab_size=512)))
    assert identity is not None and identity.size == 512
    np.testing.assert_array_equal(identity.table, np.arange(512))


def test_engram_num_embeddings_must_match_the_primes():
    cfg = ModelConfig.from_hf(variant(engram_num_embeddings=[4062, 4150]))
    with pytest.raises(ValueError, match=r"engram_num_embeddings = \[4062, 4150\].*\[4062, 4152\]"):
        v41_params.expected_tensors(cfg)


def test_family_is_registered():
    family = get_family("deepseek_v41")
    assert family.name == "deepseek_v41" and family.expected_tensors is v41_params.expected_tensors
    assert "vision.*" in family.ignore and "*.ffn.gate.bias_vl" in family.ignore
