"""``load_model`` / ``init_random`` for DeepSeek-V3: built-in, HF folder, orbax; and refused bad checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

import deepinfer_jax
from deepinfer_jax.checkpoint import CheckpointError, open_checkpoint, save_checkpoint
from deepinfer_jax.config.errors import ConfigValueError
from deepinfer_jax.models import builtin, registry
from deepinfer_jax.models.builtin import write_safetensors
from deepinfer_jax.models.deepseek_v3 import weights as v3_weights

DATA = Path(__file__).resolve().parents[2] / "data" / "v3"


@pytest.fixture(scope="module")
def tiny():
    return deepinfer_jax.load_model("tiny-v3")


def test_builtin_tiny_v3_loads_and_compiles_once_per_shape(tiny):
    ids = np.array([[0, 5, 7, 9]], np.int32)
    a = tiny.logits(ids)
    b = tiny.logits(ids + 1)
    assert a.shape == (1, 4, tiny.config.vocab_size) and a.dtype == np.float32
    assert np.isfinite(a).all() and not np.array_equal(a, b)
    assert tiny.compiled_shapes == ((1, 4),)
    assert tiny.family.name == "deepseek_v3" and tiny.dtype == "float32"


def test_init_random_equals_the_builtin_checkpoint(tiny):
    # The built-in checkpoint is the synthetic generator's output for the model's seed.
    params = deepinfer_jax.init_random(tiny.config, builtin.get_builtin("tiny-v3").seed)
    leaves_a, tree_a = jax.tree.flatten(params)
    leaves_b, tree_b = jax.tree.flatten(tiny.params)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    other = deepinfer_jax.init_random(tiny.config.to_hf_dict(), 4, "bfloat16")
    assert other["embed"].dtype.name == "bfloat16"
    assert not np.array_equal(np.asarray(other["embed"], np.float32), np.asarray(params["embed"]))


def test_logits_input_is_validated(tiny):
    with pytest.raises(ValueError, match="vocab_size=512"):
        tiny.logits(np.array([[512]]))
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        tiny.logits(np.array([1, 2]))
    with pytest.raises(ValueError, match="dtype"):
        deepinfer_jax.load_model("tiny-v3", dtype="float16")


def test_registry():
    fam = registry.get_family("deepseek_v3")
    assert fam.name == "deepseek_v3" and fam.ignore == v3_weights.IGNORED_TENSORS
    with pytest.raises(ValueError, match="unknown model family 'llama'"):
        registry.get_family("llama")


def test_registry_family_without_module_is_not_implemented(monkeypatch):
    monkeypatch.setitem(
        registry.FAMILY_MODULES, "deepseek_v41", "deepinfer_jax.models.deepseek_v4.no_such_family"
    )
    with pytest.raises(NotImplementedError, match="'deepseek_v41' is not implemented"):
        registry.get_family("deepseek_v41")


def test_unknown_source_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="tiny-v9"):
        deepinfer_jax.load_model("tiny-v9")


# --------------------------------------------------------------------------------------------- bad checkpoints


def _copy_fixture(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    folder = tmp_path / "ckpt"
    shutil.copytree(DATA / "lora", folder)
    (folder / "reference.npz").unlink()
    with open_checkpoint(folder) as reader:
        tensors = {n: reader.read(n) for n in reader.names()}
    return folder, tensors


def test_missing_wrong_shape_and_wrong_dtype_are_reported_together(tmp_path):
    folder, tensors = _copy_fixture(tmp_path)
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    tensors[name] = tensors[name][:-1]
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int32)
    tensors["model.layers.0.extra.weight"] = np.zeros(3, np.float32)
    write_safetensors(folder / "model.safetensors", tensors)
    with pytest.raises(CheckpointError) as err:
        deepinfer_jax.load_model(folder)
    msg = str(err.value)
    assert "missing: 'model.layers.1.mlp.experts.3.up_proj.weight'" in msg
    assert f"shape: {name!r}: expected (64, 16), found (63, 16)" in msg
    assert "dtype: 'model.norm.weight'" in msg
    assert "unexpected: 'model.layers.0.extra.weight'" in msg


def test_nan_is_refused_only_when_validating(tmp_path):
    folder, tensors = _copy_fixture(tmp_path)
    name = "model.layers.2.mlp.experts.1.down_proj.weight"
    bad = tensors[name].astype(np.float32)
    bad[0, 0] = np.nan
    tensors[name] = bad.astype(tensors[name].dtype)
    write_safetensors(folder / "model.safetensors", tensors)
    assert np.isnan(
        np.asarray(deepinfer_jax.load_model(folder).params["layers"][2]["mlp"]["experts"]["down"]["weight"])
    ).any()
    with pytest.raises(CheckpointError, match=f"non-finite: {name!r}: 1 of"):
        deepinfer_jax.load_model(folder, validate=True)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("architectures", ["LlamaForCausalLM"], "architectures"),
        ("model_type", "deepseek_v2", "model_type = 'deepseek_v2': unsupported"),
        ("attention_bias", True, "attention_bias = True"),
    ],
)
def test_unknown_architecture_is_refused_before_reading_tensors(tmp_path, key, value, match):
    folder, _ = _copy_fixture(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        deepinfer_jax.load_model(folder)


def test_config_error_names_the_file(tmp_path):
    folder, _ = _copy_fixture(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["kv_lora_rank"] = "sixteen"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises((ConfigValueError, TypeError), match="kv_lora_rank"):
        deepinfer_jax.load_model(folder)


def test_orbax_checkpoint_loads_like_the_hf_folder(tmp_path):
    with open_checkpoint(DATA / "nolora") as reader:
        tensors = {n: reader.read(n) for n in reader.names()}
    config = json.loads((DATA / "nolora" / "config.json").read_text())
    orbax_dir = save_checkpoint(tmp_path / "orbax", tensors, config)
    a = deepinfer_jax.load_model(orbax_dir)
    b = deepinfer_jax.load_model(DATA / "nolora")
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_every_parameter_has_logical_axes(tiny):
    axes = v3_weights.logical_axes(tiny.params)
    flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    leaves = jax.tree.leaves(tiny.params)
    assert len(flat_axes) == len(leaves)
    assert all(len(a) == leaf.ndim for a, leaf in zip(flat_axes, leaves))
    assert axes["layers"][1]["mlp"]["experts"]["gate"]["weight"] == ("expert", "moe_mlp", "embed")
    assert axes["layers"][0]["attn"]["w_uk"] == ("heads", "qk_nope", "kv_lora")
    assert axes["mtp"][0]["head"] == ("vocab", "embed")
