"""The training loop: step-count based, seeded, resumable, with a progress bar and periodic validation.

* **Data.** The token stream of the training split; step ``n`` reads ``batch_size`` windows of ``seq_len`` tokens
  at offsets drawn from ``numpy.random.default_rng([seed, n])``, each prefixed with BOS (the prompts the engine
  sees start with BOS too). A step's batch depends only on the seed and the step number, so a resumed run reads
  exactly what an uninterrupted one would.
* **Optimiser** (``optax``): global-norm gradient clipping, then AdamW (``b1 = 0.9``, ``b2 = 0.95``) with a linear
  warm-up and a cosine decay to ``min_lr_ratio`` of the peak; weight decay on matrices only (not on norms,
  biases, sinks or mHC vectors). Router biases are outside the optimiser (:func:`.objectives.balance_biases`).
* **Checkpoints.** Every ``checkpoint_every`` steps and at the end, the trainable tensors, the router biases and
  the optimiser state are written with the project's safetensors writer (``<phase>.safetensors``, float32)
  beside ``<phase>.json`` (step, settings, the loss history). A run finds its checkpoint and continues from its
  step; a checkpoint written with other settings is refused.
* **Validation.** Every ``eval_every`` steps (and at the end) the mean loss over fixed, evenly spaced windows of
  the held-out split, with the mean wall and CPU seconds per step since the last one (the first step of a run,
  which compiles, is recorded apart as ``first_step_s``) and the 1-minute load average.

Everything runs in float32 on whatever backend JAX has (the CPU here); the step is one ``jax.jit`` program.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.models.builtin import write_safetensors

__all__ = ["PhaseResult", "TrainSettings", "eval_windows", "train_batch", "train_phase"]


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """One training phase's hyper-parameters (all of them enter the checkpoint's identity)."""

    steps: int
    batch_size: int
    seq_len: int
    learning_rate: float
    warmup_steps: int
    seed: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_windows: int = 32
    checkpoint_every: int = 100
    bias_update_rate: float = 1e-3

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "eval_every", "eval_windows", "checkpoint_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainSettings.{name} = {value!r}: must be an int >= 1")
        if (
            isinstance(self.warmup_steps, bool)
            or not isinstance(self.warmup_steps, int)
            or self.warmup_steps < 0
        ):
            raise ValueError(f"TrainSettings.warmup_steps = {self.warmup_steps!r}: must be an int >= 0")
        for name in ("learning_rate", "grad_clip"):
            if not getattr(self, name) > 0:
                raise ValueError(f"TrainSettings.{name} = {getattr(self, name)!r}: must be > 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"TrainSettings.min_lr_ratio = {self.min_lr_ratio!r}: must be in [0, 1]")
        if self.weight_decay < 0 or self.bias_update_rate < 0:
            raise ValueError("TrainSettings.weight_decay and bias_update_rate must be >= 0")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def train_batch(tokens: np.ndarray, step: int, settings: TrainSettings, bos_id: int) -> np.ndarray:
    """``[batch_size, seq_len + 1]`` int32: BOS, then ``seq_len`` consecutive tokens at seeded offsets."""
    span = settings.seq_len
    if tokens.shape[0] <= span:
        raise ValueError(f"tokens: {tokens.shape[0]} tokens, fewer than seq_len + 1 = {span + 1}")
    rng = np.random.default_rng([settings.seed, step])
    starts = rng.integers(0, tokens.shape[0] - span, settings.batch_size)
    out = np.empty((settings.batch_size, span + 1), np.int32)
    out[:, 0] = bos_id
    for row, start in enumerate(starts):
        out[row, 1:] = tokens[start : start + span]
    return out


def eval_windows(tokens: np.ndarray, count: int, seq_len: int, bos_id: int) -> np.ndarray:
    """``[count, seq_len + 1]``: BOS plus ``seq_len`` tokens at ``count`` evenly spaced offsets (fixed)."""
    if tokens.shape[0] <= seq_len:
        raise ValueError(f"tokens: {tokens.shape[0]} held-out tokens, fewer than seq_len + 1 = {seq_len + 1}")
    starts = np.linspace(0, tokens.shape[0] - seq_len, count).astype(np.int64)
    out = np.empty((count, seq_len + 1), np.int32)
    out[:, 0] = bos_id
    for row, start in enumerate(starts):
        out[row, 1:] = tokens[start : start + seq_len]
    return out


@dataclasses.dataclass
class PhaseResult:
    """What a phase ends with: the trained tensors and router biases, and its record."""

    trainable: dict[str, np.ndarray]
    biases: dict[str, np.ndarray]
    record: dict[str, Any]


def _decay_mask(trainable: Mapping[str, Any]) -> dict[str, bool]:
    return {name: (np.ndim(v) >= 2 and "hc_" not in name) for name, v in trainable.items()}


def _optimizer(settings: TrainSettings, trainable: Mapping[str, Any]) -> Any:
    """AdamW with warm-up and cosine decay (clipping is done per gradient group before it)."""
    import optax

    decay_steps = max(settings.steps - settings.warmup_steps, 1)
    schedule = optax.join_schedules(
        [
            optax.linear_schedule(0.0, settings.learning_rate, max(settings.warmup_steps, 1)),
            optax.cosine_decay_schedule(settings.learning_rate, decay_steps, alpha=settings.min_lr_ratio),
        ],
        [settings.warmup_steps],
    )
    return optax.adamw(
        schedule, b1=0.9, b2=0.95, weight_decay=settings.weight_decay, mask=_decay_mask(trainable)
    )


def _flat(tree: Any, prefix: str) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {f"{prefix}{jax.tree_util.keystr(path)}": np.asarray(leaf) for path, leaf in leaves}


def _unflat(template: Any, stored: Mapping[str, np.ndarray], prefix: str) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    out = []
    for path, leaf in leaves:
        key = f"{prefix}{jax.tree_util.keystr(path)}"
        if key not in stored:
            raise ValueError(f"checkpoint: {key!r} is missing")
        value = stored[key]
        if value.shape != np.shape(leaf):
            raise ValueError(f"checkpoint: {key!r} has shape {value.shape}, expected {np.shape(leaf)}")
        out.append(jnp.asarray(value, dtype=jnp.asarray(leaf).dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def _save(folder: Path, phase: str, state: dict[str, Any], record: dict[str, Any]) -> None:
    tensors = {
        **_flat(state["trainable"], "trainable"),
        **_flat(state["biases"], "biases"),
        **_flat(state["opt"], "opt"),
    }
    tmp = folder / f".{phase}.safetensors.tmp"
    write_safetensors(tmp, tensors)
    os.replace(tmp, folder / f"{phase}.safetensors")
    tmp_json = folder / f".{phase}.json.tmp"
    tmp_json.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    os.replace(tmp_json, folder / f"{phase}.json")


def _load(folder: Path, phase: str, template: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    if not (folder / f"{phase}.json").is_file():
        return None
    from safetensors.numpy import load_file

    record = json.loads((folder / f"{phase}.json").read_text())
    stored = load_file(str(folder / f"{phase}.safetensors"))
    state = {
        "trainable": _unflat(template["trainable"], stored, "trainable"),
        "biases": _unflat(template["biases"], stored, "biases"),
        "opt": _unflat(template["opt"], stored, "opt"),
    }
    return state, record


LossFn = Callable[..., tuple[jax.Array, dict[str, Any]]]
Batch = dict[str, np.ndarray]


def _grouped_clip(
    grads: Mapping[str, jax.Array], groups: Mapping[str, str], limit: float
) -> dict[str, jax.Array]:
    """Clip each group's gradients to global norm ``limit`` separately (groups keyed by tensor name)."""
    import optax

    out = dict(grads)
    for label in sorted(set(groups.values())):
        names = [n for n in grads if groups[n] == label]
        norm = optax.tree.norm([grads[n] for n in names])
        scale = jnp.minimum(1.0, limit / jnp.maximum(norm, 1e-12))
        for n in names:
            out[n] = grads[n] * scale
    return out


def train_phase(
    phase: str,
    loss_fn: LossFn,
    *,
    trainable: Mapping[str, np.ndarray],
    biases: Mapping[str, np.ndarray],
    fixed: Mapping[str, np.ndarray],
    bias_names: list[str],
    settings: TrainSettings,
    batch_fn: Callable[[int], Batch],
    eval_batches: list[Batch],
    folder: str | os.PathLike[str],
    clip_groups: Mapping[str, str] | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> PhaseResult:
    """Train ``trainable`` for ``settings.steps`` steps of ``loss_fn(trainable, biases, fixed, batch, step)``.

    ``batch_fn(step)`` gives the step's batch (a dict of arrays, e.g. :func:`train_batch`'s ids), ``eval_batches``
    the fixed validation batches. ``loss_fn`` returns ``(loss, aux)``; ``aux["expert_counts"]`` (one ``[E]`` array
    per MoE layer, in ``bias_names`` order) drives the router-bias balance, the other scalar entries are logged.
    ``clip_groups`` (tensor name -> group label, default one group) clips each group's gradient norm to
    ``grad_clip`` on its own. Resumes from the phase's checkpoint in ``folder`` when there is one.

    Raises:
        ValueError: the checkpoint in ``folder`` was written with other settings.
    """
    from deepinfer_jax.training.objectives import balance_biases

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fixed_j = {k: jnp.asarray(v, jnp.float32) for k, v in fixed.items()}
    optimizer = _optimizer(settings, trainable)
    trainable_j = {k: jnp.asarray(v, jnp.float32) for k, v in trainable.items()}
    state = {
        "trainable": trainable_j,
        "biases": {k: jnp.asarray(v, jnp.float32) for k, v in biases.items()},
        "opt": optimizer.init(trainable_j),
    }
    record: dict[str, Any] = {"phase": phase, "settings": settings.as_dict(), "step": 0, "history": []}
    loaded = _load(folder, phase, state)
    if loaded is not None:
        state, old = loaded
        if old.get("settings") != settings.as_dict():
            raise ValueError(
                f"{folder / (phase + '.json')}: written with settings {old.get('settings')}, this run has "
                f"{settings.as_dict()}; use another folder or the same settings"
            )
        record = old
        log(f"[{phase}] resuming from step {record['step']} ({folder / (phase + '.safetensors')})")

    groups = {name: "all" for name in trainable} if clip_groups is None else dict(clip_groups)

    def step_fn(
        state: dict[str, Any], batch: dict[str, jax.Array], step: jax.Array
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        import optax

        (loss, aux), grads = jax.value_and_grad(
            lambda t: loss_fn(t, state["biases"], fixed_j, batch, step), has_aux=True
        )(state["trainable"])
        grad_norm = optax.tree.norm(grads)
        grads = _grouped_clip(grads, groups, settings.grad_clip)
        updates, opt = optimizer.update(grads, state["opt"], state["trainable"])
        trained = optax.apply_updates(state["trainable"], updates)
        new_biases = balance_biases(
            state["biases"], aux.pop("expert_counts"), bias_names, settings.bias_update_rate
        )
        metrics = {"loss": loss, "grad_norm": grad_norm, **aux}
        return {"trainable": trained, "biases": new_biases, "opt": opt}, metrics

    def eval_fn(state: dict[str, Any], batch: dict[str, jax.Array], step: jax.Array) -> dict[str, Any]:
        loss, aux = loss_fn(state["trainable"], state["biases"], fixed_j, batch, step)
        aux.pop("expert_counts", None)
        return {"loss": loss, **aux}

    step_jit = jax.jit(step_fn, donate_argnums=0)
    eval_jit = jax.jit(eval_fn)

    def validate(step: int) -> dict[str, float]:
        sums: dict[str, float] = {}
        for batch in eval_batches:
            out = eval_jit(state, {k: jnp.asarray(v) for k, v in batch.items()}, jnp.int32(step))
            for k, v in out.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        return {k: v / len(eval_batches) for k, v in sums.items()}

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=settings.steps, initial=record["step"], desc=phase, unit="step", dynamic_ncols=True)
    tokens_per_step = settings.batch_size * settings.seq_len
    window: list[float] = []  # wall seconds of this window's steps (the first step of a run: its compile)
    cpu: list[float] = []  # CPU seconds (all threads of this process) of the same steps
    first = True
    while record["step"] < settings.steps:
        step = record["step"]
        t0, c0 = time.perf_counter(), time.process_time()
        batch = {k: jnp.asarray(v) for k, v in batch_fn(step).items()}
        state, metrics = step_jit(state, batch, jnp.int32(step))
        metrics = {k: float(v) for k, v in metrics.items()}
        if first:
            record.setdefault("first_step_s", []).append(time.perf_counter() - t0)  # compile + one step
            first = False
        else:
            window.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        record["step"] = step + 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}")
        last = record["step"] == settings.steps
        if record["step"] % settings.eval_every == 0 or last:
            step_s = float(np.mean(window)) if window else float("nan")
            entry = {
                "step": record["step"],
                "train": metrics,
                "val": validate(record["step"]),
                "step_s": step_s,
                "step_cpu_s": float(np.mean(cpu)) if cpu else float("nan"),
                "tokens_per_s": tokens_per_step / step_s if window else float("nan"),
                "load_avg_1m": os.getloadavg()[0],
                "time": time.time(),
            }
            record["history"].append(entry)
            log(f"[{phase}] {json.dumps(entry, sort_keys=True)}")
            window, cpu = [], []
        if record["step"] % settings.checkpoint_every == 0 or last:
            _save(folder, phase, state, record)
    if bar is not None:
        bar.close()
    return PhaseResult(
        trainable={k: np.asarray(v) for k, v in state["trainable"].items()},
        biases={k: np.asarray(v) for k, v in state["biases"].items()},
        record=record,
    )
