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


def test_v41_three_backbone_and_drafter_steps(tmp_path):
    record = run_recipe(
        small_v41_recipe(), tmp_path, corpus=small_corpus(), steps=3, drafter_steps=3, progress=False
    )
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
