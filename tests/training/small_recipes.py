"""Small recipes and a small corpus for the training tests (no download: the corpus is built-in prose)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

from deepinfer_jax.models.deepseek_v4.engram import engram_table_sizes
from deepinfer_jax.text.synthetic import CORPUS
from deepinfer_jax.training.corpus import Corpus
from deepinfer_jax.training.recipe import Recipe, load_recipe

ROOT = Path(__file__).resolve().parents[2]
SMALL = {
    "batch_size": 2,
    "seq_len": 48,
    "eval_windows": 2,
    "eval_every": 1,
    "checkpoint_every": 1,
    "warmup_steps": 0,
    "learning_rate": 3e-3,
}


def small_corpus() -> Corpus:
    """The synthetic tokenizer's training prose, in paragraphs as "works" (each twice, so that the BPE trainer's
    pairs occur often enough for 1,024 ids); two held out.

    The held-out works repeat two training paragraphs: three steps at these shapes cannot move the loss on
    unseen prose reliably (measured: V3's MTP loss on it rose by 0.002 after step 1), so the tests' validation
    loss measures what three steps can do, fit the text they train on. The shipped models' held-out works are
    real unseen plays (`deepinfer_jax.training.corpus`)."""
    paragraphs = [p for p in CORPUS.split("\n\n") if p.strip()]
    works = {f"w{i:02d}": f"{p}\n\n{p}" for i, p in enumerate(paragraphs)}
    works["w03"], works["w09"] = works["w02"], works["w08"]
    return Corpus(works=works, held_out=("w03", "w09"))


def small_v41_recipe() -> Recipe:
    """The shipped V4.1 recipe shrunk: 4 layers (ratios 0, 2, 1, 1; KV sources 1 and 2, the YOCO layer 2 a
    candidate source for layer 3), Engram on layer 0, one draft layer (holding main_proj and the heads)."""
    recipe = load_recipe(ROOT / "configs" / "train" / "shakespeare_v41.yaml")
    model = copy.deepcopy(recipe.model)
    tc = model["text_config"]
    tc.update(
        vocab_size=1024,
        dspark_noise_token_id=1023,
        hidden_size=64,
        num_hidden_layers=4,
        num_nextn_predict_layers=1,
        compress_ratios=[0, 2, 1, 1, 0],
        kv_source_layer_ids=[1, 2],
        index_source_layer_ids=[1, 2, 3],
        index_k_source_layer_ids=[1, 2],
        candidate_source_layer_id=2,
        dspark_target_layer_ids=[2, 3],
        engram_layer_ids=[0],
        engram_vocab_size=64,
        engram_num_embeddings=[sum(sum(o) for o in engram_table_sizes((0,), 3, 2, 64)[0])],
        q_lora_rank=32,
        o_lora_rank=32,
        moe_intermediate_size=32,
        sliding_window=16,
        index_topk=8,
        hc_sinkhorn_iters=3,
    )
    return dataclasses.replace(
        recipe,
        model=model,
        backbone=dataclasses.replace(recipe.backbone, **SMALL),
        drafter=dataclasses.replace(recipe.drafter, **SMALL),
        drafter_anchors=2,
    )


def small_v3_recipe() -> Recipe:
    """The shipped V3 recipe shrunk: 2 layers (one dense, one MoE), the MTP layer, small MLA."""
    recipe = load_recipe(ROOT / "configs" / "train" / "shakespeare_v3.yaml")
    model = copy.deepcopy(recipe.model)
    model.update(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
    )
    return dataclasses.replace(recipe, model=model, backbone=dataclasses.replace(recipe.backbone, **SMALL))
