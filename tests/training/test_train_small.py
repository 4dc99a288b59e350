"""Three training steps of each family on small shapes: the loss falls and the exported checkpoints load."""

from __future__ import annotations

import json

import numpy as np
import pytest
from small_recipes import small_corpus, small_v3_recipe, small_v41_recipe

from deepinfer_jax import load_model
from deepinfer_jax.checkpoint.reader import open_checkpoint
from deepinfer_jax.models.registry import get_family
from deepinfer_jax.training.recipe import run_recipe

pytest.importorskip("optax")


def _val(record: dict, phase: str, key: str) -> list[float]:
    return [entry["val"][key] for entry in record["phases"][phase]["history"]]


def _check_export(out, family: str) -> None:
    """Both folders load through load_model; the shipped one stores the real checkpoints' formats."""
    cfg_q = json.loads((out / "model" / "config.json").read_text())
    cfg_f = json.loads((out / "float32" / "config.json").read_text())
    assert "quantization_config" in cfg_q and "quantization_config" not in cfg_f
    with open_checkpoint(out / "model") as reader:  # the project's reader: it knows F8_E8M0
        stored = dict(reader.read_many(reader.names()))
    dtypes = {str(a.dtype) for a in stored.values()}
    assert "float8_e4m3fn" in dtypes and "bfloat16" in dtypes
    if family == "deepseek_v41":
        assert "float8_e8m0fnu" in dtypes  # UE8M0 block scales
        assert any(
            n.endswith("experts.0.w1.weight") and a.dtype == np.uint8 for n, a in stored.items()
        )  # MXFP4
        assert (
            stored["layers.0.engram.embed.scale"].shape[1]
            == stored["layers.0.engram.embed.weight"].shape[1] // 32
        )
    else:
        assert all(a.dtype == np.float32 for n, a in stored.items() if n.endswith("weight_scale_inv"))
    ids = np.array([[0, 40, 41, 42, 43, 44]], np.int32)
    quantised = load_model(out / "model", "float32").logits(ids)
    master = load_model(out / "float32", "float32").logits(ids)
    assert np.isfinite(quantised).all() and np.isfinite(master).all()
    # FP8 / MXFP4 weights move the logits a little, not a lot (the same trained tensors underneath).
    assert np.corrcoef(quantised.ravel(), master.ravel())[0, 1] > 0.9
    assert get_family(family).name == cfg_q["model_type"]


@pytest.fixture(scope="module")
def v41_run(tmp_path_factory):
    """Three backbone and three drafter steps of the small V4.1 recipe: ``(record, out folder)``."""
    out = tmp_path_factory.mktemp("v41")
    record = run_recipe(
        small_v41_recipe(), out, corpus=small_corpus(), steps=3, drafter_steps=3, progress=False
    )
    return record, out


def test_v41_three_backbone_and_drafter_steps(v41_run):
    record, tmp_path = v41_run
    ce = _val(record, "backbone", "ce")
    assert len(ce) == 3 and ce[-1] < ce[0], ce
    kl = _val(record, "backbone", "indexer_kl")
    assert kl[-1] < kl[0], kl  # the indexer learns from its distillation term
    draft = _val(record, "drafter", "kl")
    assert draft[-1] < draft[0], draft
    assert record["steps_overridden"] and record["phases"]["drafter"]["step"] == 3
    _check_export(tmp_path, "deepseek_v41")


def test_v3_three_steps_with_mtp(tmp_path):
    record = run_recipe(small_v3_recipe(), tmp_path, corpus=small_corpus(), steps=3, progress=False)
    ce, mtp = _val(record, "backbone", "ce"), _val(record, "backbone", "mtp_ce")
    assert ce[-1] < ce[0] and mtp[-1] < mtp[0], (ce, mtp)
    assert "drafter" not in record["phases"]
    _check_export(tmp_path, "deepseek_v3")


def test_v41_drafter_against_an_exported_backbone(v41_run, tmp_path):
    """backbone_from: no backbone phase; the drafter trains against the earlier export's backbone, which the new
    folder stores byte for byte; the record keeps that backbone's phase and names its file's digest."""
    import hashlib

    first = v41_run[1]
    second = tmp_path / "second"
    record = run_recipe(
        small_v41_recipe(),
        second,
        corpus=small_corpus(),
        drafter_steps=3,
        backbone_from=first / "model",
        progress=False,
    )
    source = json.loads((first / "model" / "training.json").read_text())
    assert record["phases"]["backbone"] == source["phases"]["backbone"]
    digest = hashlib.sha256((first / "model" / "model.safetensors").read_bytes()).hexdigest()
    assert record["backbone_from"]["model_sha256"] == digest and record["steps_overridden"]
    draft = _val(record, "drafter", "kl")
    assert len(draft) == 3 and draft[-1] < draft[0], draft
    with open_checkpoint(first / "model") as a, open_checkpoint(second / "model") as b:
        assert a.names() == b.names()
        old, new = dict(a.read_many(a.names())), dict(b.read_many(b.names()))
    backbone = [n for n in old if not n.startswith("mtp.")]
    assert backbone and all(
        old[n].dtype == new[n].dtype and old[n].tobytes() == new[n].tobytes() for n in backbone
    )
    drafter = [n for n in old if n.startswith("mtp.") and n.endswith(".weight")]
    assert any(old[n].tobytes() != new[n].tobytes() for n in drafter)  # a drafter trained anew
    _check_export(second, "deepseek_v41")
    with pytest.raises(ValueError, match="steps overrides the backbone phase"):
        run_recipe(
            small_v41_recipe(), tmp_path / "x", corpus=small_corpus(), steps=1, backbone_from=first / "model"
        )
    with pytest.raises(ValueError, match=r"only a V4\.1 recipe"):
        run_recipe(small_v3_recipe(), tmp_path / "y", corpus=small_corpus(), backbone_from=first / "model")
