"""The offline facade: ``LLM(model, ...)`` and ``LLM.generate(...)`` (vLLM's shape, the issue's contract).

Construction loads the model, sizes the paged cache from ``kv_cache_memory`` (logging the breakdown), and
builds the scheduler, the step executor and the runner. :meth:`LLM.generate` validates every request first
(tier 1 of ARCHITECTURE §7: any bad argument raises ``ValueError``/``TypeError`` naming the field and the
request index, before anything is queued), then runs them all to completion with continuous batching and
returns one :class:`~deepinfer_jax.engine.params.RequestOutput` per request, in input order. A request that
fails at run time (it can never fit the cache, or its logits are unusable) ends alone with
``finish_reason="error"``.

Each model family runs through its :class:`~deepinfer_jax.models.paged.PagedModel`, built by its
:class:`~deepinfer_jax.models.registry.ModelFamily`. The engine always runs on a ``(dp, ep)`` mesh; one device is
the ``(1, 1)`` mesh, with the same scheduler, plan, executor, step and runner.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from deepinfer_jax.cache.paged import parse_bytes
from deepinfer_jax.cache.plan import plan_memory
from deepinfer_jax.cache.prefix import prefix_salt
from deepinfer_jax.checkpoint.model_loading import DTYPES, Model, init_random, load_model
from deepinfer_jax.config import load_config_with_sources
from deepinfer_jax.config.errors import ConfigWarning
from deepinfer_jax.config.status import check_settings, env_report, field_value
from deepinfer_jax.config.tree import SNAPSHOT_SLOTS_RATIO
from deepinfer_jax.engine import chat as _chat
from deepinfer_jax.engine.buckets import step_buckets
from deepinfer_jax.engine.grammar import GrammarCompiler
from deepinfer_jax.engine.mesh_eplb import MeshExpertBalancer
from deepinfer_jax.engine.params import RequestOutput, SamplingParams, derive_seed, validate_request
from deepinfer_jax.engine.plan import build_plan
from deepinfer_jax.engine.runner import EngineRunner, RunnerOptions, RunStats
from deepinfer_jax.engine.scheduler import PrefixCacheOptions, Scheduler
from deepinfer_jax.engine.spec_budget import (
    LatencyCurve,
    curve_cache_key,
    load_curve,
    measure_curve,
    save_curve,
)
from deepinfer_jax.engine.spec_varlen import VerifyLengthPlanner, probe_batch
from deepinfer_jax.engine.step import SamplerOptions, StepExecutor, state_bytes
from deepinfer_jax.models import builtin
from deepinfer_jax.models.common.layer_runs import LayerStack
from deepinfer_jax.models.registry import get_family
from deepinfer_jax.ops import compile_cache
from deepinfer_jax.ops.selection import resolve_selection
from deepinfer_jax.parallel import distributed, mesh_from_config, shard_model_params, slot_expert_layers
from deepinfer_jax.parallel.mesh import mesh_sizes
from deepinfer_jax.parallel.model_parallel import place_on_mesh
from deepinfer_jax.sampling import speculative as _speculative  # noqa: F401  (registers draft_sample, verify)
from deepinfer_jax.sampling.pipeline import LOGPROBS_MODES
from deepinfer_jax.text.output_parser import ChatOutput
from deepinfer_jax.text.tokenizer import Tokenizer

__all__ = ["DEFAULT_CPU_CACHE_MEMORY", "LLM", "default_cache_memory", "derive_seed", "device_share"]

DEFAULT_CPU_CACHE_MEMORY = 2 << 30
"""The most the default ``kv_cache_memory`` takes per device on the CPU (2 GiB; see :func:`default_cache_memory`)."""

ARGUMENT_CONFIG_KEYS = {
    "dtype": "dtype",
    "kv_cache_dtype": "kv_cache_dtype",
    "max_model_len": "max_model_len",
    "seed": "seed",
    "scheduler.max_num_seqs": "max_num_seqs",
    "scheduler.max_num_batched_tokens": "max_num_batched_tokens",
    "ops.batch_invariant": "batch_invariant",
    "parallel.data_parallel_size": "data_parallel_size",
    "parallel.expert_parallel_size": "expert_parallel_size",
    "speculative.num_draft_tokens": "num_draft_tokens",
    "speculative.variable_length": "speculative_variable_length",
    "cache.enable_prefix_caching": "enable_prefix_caching",
}
"""Config names that LLM's own keyword arguments set (config name -> argument); giving them as overrides too
would be ambiguous. An argument left at ``None`` takes the config's value when a yaml, gin or ``DEEPINFER_*``
source set it, else :data:`LLM_DEFAULTS`."""

LLM_DEFAULTS: dict[str, Any] = {
    "dtype": "bfloat16",
    "kv_cache_dtype": "auto",
    "max_model_len": None,  # the model's max_position_embeddings, capped by what one request can cache
    "max_num_seqs": 256,
    "max_num_batched_tokens": 2048,
    "seed": 0,
    "batch_invariant": False,
    "data_parallel_size": 1,
    "expert_parallel_size": 1,
    "num_draft_tokens": None,  # the model's natural draft length (V3: 1 per MTP layer; V4.1: dspark_block_size)
    "speculative_variable_length": False,
    "enable_prefix_caching": True,
}
"""What each of LLM's keyword arguments is when neither the call nor a config source sets it."""
_MASK64 = (1 << 64) - 1


def _show_compile(bar: Any, tokens: int | None, seqs: int | None) -> None:
    """The progress bar says which step bucket is compiling while it compiles (``StepExecutor.on_compile``)."""
    with contextlib.suppress(Exception):
        bar.set_description_str(f"compiling step {tokens}×{seqs} …" if tokens is not None else "generate")


def device_share(total: int, num_devices: int) -> int:
    """One device's share of a per-step budget of the whole ``LLM``: ``ceil(total / num_devices)``.

    Rounding up keeps every device's budget at least 1 and the mesh's combined budget at least ``total``.
    """
    return -(-total // num_devices)


def config_replace(config: Any, values: dict[str, Any]) -> Any:
    """``config`` with dotted fields set (root fields bare), each section re-validated."""
    sections: dict[str, dict[str, Any]] = {}
    root: dict[str, Any] = {}
    for name, value in values.items():
        if "." in name:
            section, field = name.split(".")
            sections.setdefault(section, {})[field] = value
        else:
            root[name] = value
    changes = {k: dataclasses.replace(getattr(config, k), **v) for k, v in sections.items()}
    return dataclasses.replace(config, **changes, **root)


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} ({value!r})")
    if value < low:
        raise ValueError(f"{name}: must be >= {low}, got {value}")
    return value


def _tokenization_options(kwargs: Mapping[str, Any] | None, max_model_len: int) -> dict[str, Any]:
    """vLLM's ``tokenization_kwargs`` that apply here, checked (unknown keys are refused, naming them)."""
    options: dict[str, Any] = {
        "truncate_prompt_tokens": None,
        "truncation_side": "left",
        "add_special_tokens": True,
    }
    if kwargs is None:
        return options
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"tokenization_kwargs: expected a dict, got {type(kwargs).__name__}")
    unknown = set(kwargs) - set(options)
    if unknown:
        raise ValueError(
            f"tokenization_kwargs: unsupported key(s) {sorted(unknown)}; supported: {sorted(options)}"
        )
    options.update(kwargs)
    k = options["truncate_prompt_tokens"]
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, int):
            raise TypeError(f"tokenization_kwargs['truncate_prompt_tokens']: expected an int, got {k!r}")
        if k == -1:
            k = max_model_len - 1
        if k < 1:
            raise ValueError(f"tokenization_kwargs['truncate_prompt_tokens'] = {k} must be -1 or >= 1")
        options["truncate_prompt_tokens"] = k
    if options["truncation_side"] not in ("left", "right"):
        raise ValueError(
            f"tokenization_kwargs['truncation_side'] = {options['truncation_side']!r} must be 'left' or 'right'"
        )
    if not isinstance(options["add_special_tokens"], bool):
        raise TypeError("tokenization_kwargs['add_special_tokens']: expected a bool")
    return options


def _truncate(ids: list[Any], options: Mapping[str, Any]) -> list[Any]:
    k = options["truncate_prompt_tokens"]
    if k is None or len(ids) <= k:
        return ids
    return ids[-k:] if options["truncation_side"] == "left" else ids[:k]


def _resolve_model(model: Any) -> Path:
    if not isinstance(model, str | os.PathLike):
        raise TypeError(
            f"model: expected a model folder or a built-in name (str), got {type(model).__name__}"
        )
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model: folder {str(path)!r} has no config.json")
        return path
    if isinstance(model, str) and builtin.is_builtin(model):
        return builtin.materialize(model)
    raise ValueError(
        f"model: {str(model)!r} is neither an existing model folder nor a built-in model "
        f"(built-in: {', '.join(builtin.list_builtin())})"
    )


def _resolve_tokenizer(tokenizer: Any, model_dir: Path) -> Tokenizer | None:
    if tokenizer is None:
        candidate = model_dir / "tokenizer.json"
        return Tokenizer.from_file(candidate) if candidate.is_file() else None
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if not isinstance(tokenizer, str | os.PathLike):
        raise TypeError(f"tokenizer: expected a path or a Tokenizer, got {type(tokenizer).__name__}")
    path = Path(tokenizer)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(
            f"tokenizer: {str(tokenizer)!r} is not a tokenizer.json file or a folder holding one"
        )
    return Tokenizer.from_file(path)


def default_cache_memory(
    layout: Any,
    *,
    params: Any,
    num_devices: int,
    max_num_seqs: int,
    num_slots: int,
    reserved_bytes: int,
    tokens_per_seq: int,
    memory_utilization: float,
    memory_stats: dict[str, int] | None = None,
) -> int:
    """The default ``kv_cache_memory`` of the whole ``LLM``.

    On an accelerator (``memory_stats`` reports a ``bytes_limit``): ``memory_utilization`` of the first device's
    memory minus what is in use after the weights, once per device of the mesh. Elsewhere (the CPU): what one
    device needs for ``max_num_seqs`` sequences of ``tokens_per_seq`` tokens each -- their blocks, the reserved
    block, the state slots and the sampling state -- capped at :data:`DEFAULT_CPU_CACHE_MEMORY`, once per device.
    """
    limit = (memory_stats or {}).get("bytes_limit")
    if limit:
        used = (memory_stats or {}).get("bytes_in_use", sum(x.nbytes for x in jax.tree.leaves(params)))
        return max(int(memory_utilization * limit - used), 1) * num_devices
    blocks = max_num_seqs * -(-tokens_per_seq // layout.block_size) + 1
    need = blocks * layout.bytes_per_block + num_slots * layout.bytes_per_slot + reserved_bytes
    return min(need, DEFAULT_CPU_CACHE_MEMORY) * num_devices


def host_device() -> jax.Device | None:
    """This process's CPU device (host memory), or ``None`` when the CPU backend is not enabled."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return None


def _draft_length(config: Any, sources: Mapping[str, str]) -> int:
    """The engine's draft length: ``speculative.num_draft_tokens`` when set (a model that cannot draft it is a
    ``ValueError`` naming the field), else the model's natural length where the engine can draft for the family,
    else 0 (logged)."""
    field = "speculative.num_draft_tokens"
    where = sources.get(field, "the default")
    asked = config.speculative.num_draft_tokens
    layers = int(getattr(config.model, "num_nextn_predict_layers", 0) or 0)
    family = str(getattr(config.model.family, "value", config.model.family))
    # The families whose paged model runs its draft layers in the step: V3's MTP layers, V4.1's DSpark drafter.
    drafts_here = family in ("deepseek_v3", "deepseek_v41")
    if asked is not None:
        k = int(asked)
        if k and not layers:
            raise ValueError(
                f"{field} = {k} (from {where}): the model has no draft layers (num_nextn_predict_layers = 0); use 0"
            )
        if k and not drafts_here:
            raise ValueError(
                f"{field} = {k} (from {where}): speculative decoding of {family} (its MTP drafter in the engine "
                "step) is not built yet; deepseek_v3's MTP layers and deepseek_v41's DSpark drafter draft. Use 0"
            )
        block = getattr(config.model, "dspark_block_size", None) if family == "deepseek_v41" else None
        if k and block is not None and k > block:
            raise ValueError(
                f"{field} = {k} (from {where}): the DSpark drafter proposes dspark_block_size = {block} tokens "
                f"per step; use at most {block}"
            )
        if k and config.sampling.compute_sum_smaller_probs:
            raise ValueError(
                f"{field} = {k} (from {where}) with sampling.compute_sum_smaller_probs: verification rows report "
                "no sum of smaller probabilities; set num_draft_tokens = 0"
            )
        return k
    if not layers:
        return 0
    if not drafts_here:
        logging.info("speculative decoding of %s is not built yet: decoding without drafts", family)
        return 0
    if config.sampling.compute_sum_smaller_probs:
        logging.warning(
            "sampling.compute_sum_smaller_probs is set: decoding without drafts (verification rows report no sum "
            "of smaller probabilities)"
        )
        return 0
    return int(config.num_draft_tokens)


PREFIX_SNAPSHOTS_PER_STEP = 4
"""Most window-state snapshots one step writes per device (prefix caching; docs/prefix_cache.md)."""
PREFIX_COPIES_PER_STEP = 8
"""Slot copies of a step with snapshots: the snapshots' own and the hits' restores."""


def _prefix_options(
    config: Any,
    paged: Any,
    max_num_seqs: int,
    model_dir: Path,
    dtype: str,
    kv_cache_dtype: str,
    num_draft_tokens: int,
    num_devices: int = 1,
    multi_process: bool = False,
) -> PrefixCacheOptions | None:
    """Prefix caching's options for this engine, or ``None`` when ``cache.enable_prefix_caching`` is off."""
    cache = config.cache
    if not cache.enable_prefix_caching:
        return None
    layout = paged.layout()
    snapshots = layout.bytes_per_slot > 0  # per-sequence state outside the blocks (V4, V4.1)
    ratio = cache.state_slots_ratio
    if ratio is None:
        ratio = SNAPSHOT_SLOTS_RATIO if snapshots else 1.0
    slots = max(int(max_num_seqs * ratio) - max_num_seqs, 0) if snapshots else 0
    if snapshots and not slots:
        logging.warning(
            "cache.state_slots_ratio = %s leaves no state slot for window-state snapshots: prefix caching of this "
            "model finds no hit (raise the ratio above 1)",
            ratio,
        )
    lookahead = 1 if num_draft_tokens and paged.draft_kind == "mtp" else 0
    salt = prefix_salt(
        model=str(model_dir.resolve()),
        config=repr(config.model),
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        block_size=cache.block_size,
        layout=(layout.bytes_per_block, layout.bytes_per_slot, layout.dtype),
        draft_tokens=num_draft_tokens,
        replay=(config.scheduler.yoco_truncation, config.scheduler.yoco_keep_tokens),
        lookahead=lookahead,
    )
    host = cache.host_memory // num_devices
    if host and multi_process:
        raise ValueError(
            f"cache.host_memory = {cache.host_memory}: the host-memory tier needs a mesh in one process (each "
            "process would hold only its own devices' blocks); set it to 0 for a multi-process run"
        )
    return PrefixCacheOptions(
        salt=salt,
        lookahead=lookahead,
        snapshots=snapshots,
        snapshot_slots=slots,
        snapshots_per_step=PREFIX_SNAPSHOTS_PER_STEP,
        copies_per_step=PREFIX_COPIES_PER_STEP,
        host_memory=host,
        host_ttl_s=cache.host_ttl_s,
        block_bytes=layout.bytes_per_block,
        slot_bytes=layout.bytes_per_slot if snapshots else 0,
        replay_keep=0 if config.scheduler.yoco_truncation == "off" else config.scheduler.yoco_keep_tokens,
    )


def _confidence_temperatures(config: Any, k: int) -> tuple[float, ...]:
    """``speculative.confidence_temperature`` as one value per draft position (a scalar repeated). The config
    checks a list against its draft length, which is the engine's whenever the engine drafts."""
    temps = config.speculative.confidence_temperature
    values = tuple(float(t) for t in (temps if isinstance(temps, tuple) else (temps,)))
    if not k:
        return (1.0,)  # no drafts: unused
    return values * k if len(values) == 1 else values


def _auto_dtype(config: Any, sources: Mapping[str, str]) -> str:
    """``dtype="auto"``: the checkpoint's declared ``torch_dtype`` decides the precision mode (as in vLLM).

    ``float32`` checkpoints run in parity mode; ``bfloat16`` / ``float16`` checkpoints and checkpoints that declare
    no dtype (built-in random models included) run in production mode (bfloat16: the engine has no float16 mode).
    """
    declared = getattr(config.model, "checkpoint_dtype", None) if config.model is not None else None
    dtype = "float32" if declared == "float32" else "bfloat16"
    logging.info(
        "dtype='auto' (from %s): %s, since the checkpoint declares %s",
        sources.get("dtype", "LLM argument dtype"),
        dtype,
        f"torch_dtype {declared!r}" if declared else "no torch_dtype",
    )
    return dtype


def _load_for(model_dir: Path, dtype: str, mesh: Mesh, config: Any) -> Model:
    """The model's parameters, read where the engine lays them out from.

    On one device they go straight to that device. On a mesh of several devices they are read and assembled in
    host memory (the CPU device), with the routed experts deferred when they will be sharded over ``ep > 1``
    (:mod:`deepinfer_jax.checkpoint.deferred`): :func:`_lay_out` then reads the experts of this process's slots
    and copies to each device only what it holds. No accelerator holds the whole model, and no process reads the
    experts of other processes' devices. Without a CPU backend (``JAX_PLATFORMS`` naming only an accelerator)
    the default device is used, with a warning. With ``load_format = "dummy"`` no checkpoint is read: the
    parameters are the family's random parameters at the config's shapes (seeded by ``seed``).
    """
    if config.load_format == "dummy":
        cfg = config.require_model("load_format='dummy'")
        family = get_family(str(getattr(cfg.family, "value", cfg.family)))
        device = mesh.devices.flat[0] if mesh.devices.size == 1 else host_device() or mesh.devices.flat[0]
        with jax.default_device(device):
            return Model(cfg, init_random(cfg, config.seed % (1 << 32), dtype), family, dtype, None)
    if mesh.devices.size == 1:
        with jax.default_device(mesh.devices.flat[0]):
            return load_model(model_dir, dtype)
    host = host_device()
    if host is None:
        logging.warning(
            "no CPU backend (JAX_PLATFORMS = %r): the parameters are read onto the default device before they "
            "are laid out on the mesh; add 'cpu' to JAX_PLATFORMS to read them into host memory instead",
            os.environ.get("JAX_PLATFORMS"),
        )
        return load_model(model_dir, dtype)
    _, ep = mesh_sizes(mesh)
    with jax.default_device(host):
        return load_model(
            model_dir, dtype, sharding=jax.sharding.SingleDeviceSharding(host), defer_experts=ep > 1
        )


def _lay_out(model: Model, mesh: Mesh, *, extra: int = 0) -> Model:
    """``model`` with its parameters on ``mesh``: with ``ep > 1`` the routed experts in ``ep``-sharded slots
    (``extra`` redundant ones per layer, :func:`~deepinfer_jax.parallel.shard_model_params`), everything else
    replicated. One device needs no layout; with ``ep = 1`` every device holds every expert, so the MoE layers
    run locally, without a collective."""
    dp, ep = mesh_sizes(mesh)
    if dp * ep == 1:
        return model
    if ep == 1:
        replicated = NamedSharding(mesh, PartitionSpec())
        params = jax.tree.map(lambda a: place_on_mesh(a, replicated), model.params)
    elif model.family.logical_axes is None:
        raise NotImplementedError(
            f"expert_parallel_size: model family {model.family.name!r} has no logical parameter axes, so its "
            "experts cannot be sharded over a mesh; use 1"
        )
    else:
        params = shard_model_params(model.params, model.family.logical_axes(model.params), mesh, extra=extra)
    return Model(model.config, params, model.family, model.dtype, model.path)


SCAN_LAYERS_CPU = 3
"""``ops.scan_layers = None`` on a CPU: runs of two compile slower scanned than unrolled on XLA:CPU."""


def _scan_layout(model: Model, setting: int | None, platform: str) -> Model:
    """``model`` with runs of same-structure layers stacked for ``lax.scan`` (``ops.scan_layers``:
    :mod:`deepinfer_jax.models.common.layer_runs`; ``None``: :data:`SCAN_LAYERS_CPU` on a CPU, none on an
    accelerator, where a scanned layer's experts would be copied out of the stack every step), where its family
    has a scan layout and its experts are not in expert-parallel slots (those stay per layer: EPLB moves each
    layer's slots)."""
    min_run = (SCAN_LAYERS_CPU if platform == "cpu" else 0) if setting is None else setting
    if not min_run:
        return model
    if model.family.scan_layout is None:
        if setting is not None:
            warnings.warn(
                f"ops.scan_layers = {min_run} has no effect here: model family {model.family.name!r} has no scan "
                "layout yet, its layers run unrolled",
                ConfigWarning,
                stacklevel=3,
            )
        return model
    if slot_expert_layers(model.params):
        return model
    params = model.family.scan_layout(model.params, model.config, min_run=min_run)
    stacks = [seg for seg in params["layers"] if isinstance(seg, LayerStack)]
    if not stacks:
        return model
    logging.info(
        "scanned layers: %s",
        ", ".join(f"{s.start}-{s.start + s.count - 1}" for s in stacks),
    )
    return Model(model.config, params, model.family, model.dtype, model.path)


class LLM:
    """Offline inference over a DeepSeek model: ``LLM("tiny-v3").generate(["Hello"])``.

    Args:
      model: an HF model folder, an orbax checkpoint folder (with its ``config.json``) or a built-in name.
      tokenizer: a ``tokenizer.json`` path (or folder), a :class:`Tokenizer`, or ``None`` for the model
      folder's
        own; a folder without one still runs token-id prompts (``text`` stays ``""``).
      dtype: ``"float32"`` (parity mode) or ``"bfloat16"`` (production mode).
      kv_cache_dtype: ``"auto"`` (follow ``dtype``: float32 in parity mode; in production mode bf16 latents for
        V3 and the record formats for V4/V4.1), ``"float32"`` / ``"bfloat16"`` (unquantised caches of that dtype)
        or ``"quantized"`` (V3: the FP8 latent record; V4/V4.1: MXFP8 window, FP4 compressed, MXFP4 indexer keys).
      max_model_len: most tokens (prompt + output) per request; default the model's
        ``max_position_embeddings``, capped by what the cache holds for one request (logged when capped).
      max_num_seqs: most sequences per step and holding cache at once.
      max_num_batched_tokens: most tokens per step (chunked prefill splits longer prompts).
      kv_cache_memory: bytes (int) or a string such as ``"2GiB"`` for the cache and per-sequence state; default
        :func:`default_cache_memory`.
      seed: derives the seed of every request without ``seq_seed`` (with the request's index).
      batch_invariant: a request's results do not depend on the rest of its batch.
      data_parallel_size, expert_parallel_size: the ``(dp, ep)`` mesh over ``dp * ep`` devices: each device runs
        its own sequences, routed experts are sharded over ``ep``. On a mesh, ``kv_cache_memory``,
        ``max_num_seqs`` and ``max_num_batched_tokens`` are still those of the whole ``LLM``; each device gets
        its share (:func:`device_share`). One device is the ``(1, 1)`` mesh: the same engine (docs/engine.md,
        "One engine path").

      Every keyword argument left at ``None`` takes the value a ``DEEPINFER_*`` variable set (the same config
      field), else :data:`LLM_DEFAULTS`. Settings are checked before any weight is read
      (:func:`~deepinfer_jax.config.status.check_settings`: refused values raise, values without effect warn).
      logprobs_mode: what every reported logprob is (vLLM's engine argument): ``"raw_logprobs"`` (default: the
        log-softmax of the model's logits, before penalties, masks, temperature and top-k/top-p),
        ``"raw_logits"`` (those logits), ``"processed_logprobs"`` (after penalties, masks, temperature and
        top-k/top-p; tokens those remove read -9999) or ``"processed_logits"`` (the logits after the same).
      **engine_overrides: dotted config names (``{"cache.block_size": 16}``), as :func:`load_config` takes.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        tokenizer: str | os.PathLike[str] | Tokenizer | None = None,
        dtype: str | None = None,
        kv_cache_dtype: str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        kv_cache_memory: int | str | None = None,
        seed: int | None = None,
        batch_invariant: bool | None = None,
        data_parallel_size: int | None = None,
        expert_parallel_size: int | None = None,
        logprobs_mode: str = "raw_logprobs",
        num_draft_tokens: int | None = None,
        speculative_variable_length: bool | None = None,
        enable_prefix_caching: bool | None = None,
        **engine_overrides: Any,
    ) -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode: {logprobs_mode!r} is not one of {LOGPROBS_MODES}")
        for key in engine_overrides:
            if key.startswith("model."):
                raise ValueError(
                    f"engine_overrides: {key!r} changes the model; edit the model's config.json instead"
                )
            if key in ARGUMENT_CONFIG_KEYS:
                raise ValueError(
                    f"engine_overrides: {key!r} is the LLM argument {ARGUMENT_CONFIG_KEYS[key]!r}; pass it as that"
                )
        budget = None if kv_cache_memory is None else parse_bytes(kv_cache_memory)
        model_dir = _resolve_model(model)
        config, sources = load_config_with_sources(model_dir, overrides=engine_overrides)
        # A keyword argument wins; else a value set by yaml / gin / DEEPINFER_*; else LLM's own default.
        args = {
            "dtype": dtype,
            "kv_cache_dtype": kv_cache_dtype,
            "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "seed": seed,
            "batch_invariant": batch_invariant,
            "data_parallel_size": data_parallel_size,
            "expert_parallel_size": expert_parallel_size,
            "num_draft_tokens": num_draft_tokens,
            "speculative_variable_length": speculative_variable_length,
            "enable_prefix_caching": enable_prefix_caching,
        }
        given = {}
        for field, name in ARGUMENT_CONFIG_KEYS.items():
            if args[name] is not None:
                given[field] = args[name]
            elif field in sources:
                args[name] = field_value(config, field)
            else:
                args[name] = LLM_DEFAULTS[name]
        dtype, kv_cache_dtype, max_model_len = args["dtype"], args["kv_cache_dtype"], args["max_model_len"]
        if dtype == "auto":
            dtype = args["dtype"] = _auto_dtype(config, sources)
        if dtype not in DTYPES:
            where = sources.get("dtype", "LLM argument dtype" if "dtype" in given else "the default")
            raise ValueError(
                f"dtype: {dtype!r} (from {where}) is not a precision mode; expected 'auto' or one of {DTYPES}"
            )
        max_num_seqs = _check_int("max_num_seqs", args["max_num_seqs"], 1)
        max_num_batched_tokens = _check_int("max_num_batched_tokens", args["max_num_batched_tokens"], 1)
        seed = _check_int("seed", args["seed"], 0)
        if seed >= 1 << 64:
            raise ValueError(f"seed: must be < 2**64, got {seed}")
        if max_model_len is not None:
            max_model_len = _check_int("max_model_len", max_model_len, 2)
        if not isinstance(args["batch_invariant"], bool):
            raise TypeError(f"batch_invariant: expected a bool, got {type(args['batch_invariant']).__name__}")
        for name in ("data_parallel_size", "expert_parallel_size"):
            _check_int(name, args[name], 1)
        if args["num_draft_tokens"] is not None:
            _check_int("num_draft_tokens", args["num_draft_tokens"], 0)
        if not isinstance(args["enable_prefix_caching"], bool):
            raise TypeError(
                f"enable_prefix_caching: expected a bool, got {type(args['enable_prefix_caching']).__name__}"
            )
        if not isinstance(args["speculative_variable_length"], bool):
            raise TypeError(
                "speculative_variable_length: expected a bool, got "
                f"{type(args['speculative_variable_length']).__name__}"
            )
        num_devices = args["data_parallel_size"] * args["expert_parallel_size"]
        resolved = {
            **{f: args[n] for f, n in ARGUMENT_CONFIG_KEYS.items() if f != "max_model_len"},
            "scheduler.max_num_seqs": min(max_num_seqs, max_num_batched_tokens),
        }
        if max_model_len is not None:
            resolved["max_model_len"] = max_model_len
        config = config_replace(config, resolved)
        sources = {**sources, **{f: f"LLM argument {ARGUMENT_CONFIG_KEYS[f]}" for f in given}}
        for line in env_report():
            logging.info("%s", line)
        check_settings(config, sources)  # refused values raise, values without effect warn
        positions = getattr(config.model, "max_position_embeddings", None)
        if max_model_len is not None and positions and max_model_len > positions:
            raise ValueError(
                f"max_model_len: {max_model_len} tokens exceed the model's max_position_embeddings = {positions}; "
                f"lower max_model_len to at most {positions}"
            )
        family = get_family(str(getattr(config.require_model("LLM").family, "value", config.model.family)))
        cache_storage, _ = family.engine_support()
        cache_storage(dtype, kv_cache_dtype)  # before any weight is read
        self.num_draft_tokens = _draft_length(config, sources)
        """Draft tokens each decode row verifies (0: no speculative decoding; ``docs/speculative.md``)."""
        if self.num_draft_tokens and config.speculative.variable_length and config.ops.batch_invariant:
            raise ValueError(
                "speculative.variable_length with ops.batch_invariant: a row's verify length would depend on the "
                f"rest of its batch; turn one of them off (or num_draft_tokens = 0; it is {self.num_draft_tokens})"
            )
        # A multi-process run joins its peers before anything touches a JAX backend; then the mesh, before any
        # weight is read (more devices than exist is a ValueError naming both sizes).
        distributed.initialize(config.parallel)
        mesh = mesh_from_config(config.parallel)
        if num_devices == 1 and distributed.is_multi_process(config.parallel):
            raise ValueError(
                f"parallel.num_processes = {config.parallel.num_processes}: a multi-process run needs a mesh over "
                "the devices of every process; set data_parallel_size * expert_parallel_size to their number"
            )
        # Process-wide: JAX keeps one persistent compilation cache per process (ops/compile_cache.py).
        self.compile_cache_dir = compile_cache.configure(
            config.ops.compile_cache, config.ops.kernel_cache_dir
        )
        """The folder compiled programs are cached in (``None``: no persistent cache)."""
        if tokenizer is None and config.tokenizer is not None:
            tokenizer = config.tokenizer
        self.config = config
        self.mesh = mesh
        # Before any weight is read: ops.strict refuses a backend that cannot run here.
        self.op_selection = resolve_selection(config.ops, platform=mesh.devices.flat[0].platform)
        """Which implementation every op of the step runs (``ops.backend`` / ``ops.overrides`` / ``ops.strict``)."""
        self.op_selection.log()
        self.model = _scan_layout(
            _lay_out(
                _load_for(model_dir, dtype, mesh, config),
                mesh,
                extra=config.parallel.eplb_num_redundant_experts,
            ),
            config.ops.scan_layers,
            mesh.devices.flat[0].platform,
        )
        cfg = self.model.config
        self.tokenizer = _resolve_tokenizer(tokenizer, model_dir)
        eos = cfg.eos_token_id
        self.eos_token_ids: tuple[int, ...] = (
            () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
        )
        self.seed = seed
        self.batch_invariant = bool(config.ops.batch_invariant)
        # From here on the budgets are one device's (docs/engine.md, "budgets on a mesh").
        max_num_seqs = device_share(max_num_seqs, num_devices)
        max_num_batched_tokens = device_share(max_num_batched_tokens, num_devices)

        _, paged_model = self.model.family.engine_support()
        self.replay = config.scheduler.yoco_truncation
        """SWA bounded replay's mode (``scheduler.yoco_truncation``; docs/models_v41.md)."""
        replay = (
            {}
            if self.replay == "off"
            else {"replay": self.replay, "replay_keep": config.scheduler.yoco_keep_tokens}
        )
        self.paged_model = paged_model(
            self.model,
            block_size=config.cache.block_size,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            draft_tokens=self.num_draft_tokens,
            **replay,
        )
        self.prefix_cache = _prefix_options(
            config,
            self.paged_model,
            max_num_seqs,
            model_dir,
            dtype,
            kv_cache_dtype,
            self.num_draft_tokens,
            num_devices,
            distributed.is_multi_process(config.parallel),
        )
        """Prefix caching's settings (``None``: off; docs/prefix_cache.md)."""
        snapshot_slots = 0 if self.prefix_cache is None else self.prefix_cache.snapshot_slots
        num_slots = max_num_seqs + 1 + snapshot_slots
        if budget is None:
            device = mesh.devices.flat[0]
            stats = device.memory_stats() if device.platform != "cpu" else None
            budget = default_cache_memory(
                self.paged_model.layout(),
                params=self.model.params,
                num_devices=num_devices,
                max_num_seqs=max_num_seqs,
                num_slots=num_slots,
                reserved_bytes=state_bytes(num_slots, cfg.vocab_size, self.num_draft_tokens),
                tokens_per_seq=max_model_len or cfg.max_position_embeddings or 4096,
                memory_utilization=config.cache.memory_utilization,
                memory_stats=stats,
            )
        try:
            plan = plan_memory(
                self.paged_model.layout(),
                budget // num_devices,
                num_slots=num_slots,
                reserved_bytes=state_bytes(num_slots, cfg.vocab_size, self.num_draft_tokens),
                num_blocks=config.cache.num_blocks,
            )
        except ValueError as err:
            if num_devices == 1:
                raise
            raise ValueError(
                f"{err} (on the mesh, kv_cache_memory = {budget} B is split over {num_devices} devices: "
                f"{budget // num_devices} B each)"
            ) from None
        dp, ep = mesh_sizes(mesh)
        self.memory_plan = dataclasses.replace(
            plan,
            dp=dp,
            ep=ep,
            total_budget_bytes=budget,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            expert_slots=tuple(
                (path, layer.num_experts, layer.num_slots)
                for path, layer in slot_expert_layers(self.model.params).items()
            ),
        )
        spec = self.memory_plan.spec
        logging.info("%s", self.memory_plan.describe())
        capacity = spec.usable_tokens + 1  # the last sampled token never enters the cache
        natural = cfg.max_position_embeddings or capacity
        if max_model_len is None:
            max_model_len = min(natural, capacity)
            if natural > capacity:
                logging.warning(
                    "max_model_len capped to %d tokens (the cache holds %d tokens for one request; the model "
                    "allows %d)",
                    max_model_len,
                    spec.usable_tokens,
                    natural,
                )
        elif max_model_len > capacity:
            raise ValueError(
                f"max_model_len: {max_model_len} tokens do not fit the cache for one request ({spec.usable_tokens} "
                f"cached tokens in {spec.num_blocks - 1} blocks of {spec.block_size}); raise kv_cache_memory or "
                "lower max_model_len"
            )
        self.max_model_len = max_model_len
        max_blocks = -(-(max_model_len - 1) // spec.block_size)
        sampling = config.sampling
        self.grammar_compiler: GrammarCompiler | None = None
        """Compiles structured-output grammars off the step's path (``None`` without a tokenizer)."""
        if self.tokenizer is not None:
            self.grammar_compiler = GrammarCompiler(
                self.tokenizer,
                cfg.vocab_size,
                self.eos_token_ids,
                threads=sampling.grammar_threads,
                timeout_s=sampling.grammar_compile_timeout_s,
                cache=sampling.grammar_cache,
                cache_limit_bytes=sampling.grammar_cache_limit_bytes,
            )
        num_decode_steps = config.scheduler.num_decode_steps
        if num_decode_steps > 1 and distributed.is_multi_process(config.parallel):
            logging.warning(
                "scheduler.num_decode_steps = %d: the decode loop's host callbacks are not built for a mesh over "
                "several processes; it runs one step per call",
                num_decode_steps,
            )
            num_decode_steps = 1
        self.num_decode_steps = num_decode_steps
        """The decode loop's bound in use (``scheduler.num_decode_steps``, or 1 where the loop cannot run)."""
        self.scheduler = Scheduler(
            num_devices=num_devices,
            num_decode_steps=num_decode_steps,
            num_blocks=spec.num_blocks,
            block_size=spec.block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            vocab_size=cfg.vocab_size,
            eos_token_ids=self.eos_token_ids,
            num_state_slots=num_slots,
            max_blocks_per_seq=max_blocks,
            buckets=step_buckets(max_num_batched_tokens, max_num_seqs, 1 + self.num_draft_tokens),
            tokenizer=self.tokenizer,
            min_bucket_fill=config.scheduler.min_bucket_fill,
            banned_token_ids=config.sampling.banned_token_ids,
            grammar_compiler=self.grammar_compiler,
            num_draft_tokens=self.num_draft_tokens,
            force_drafts=config.speculative.force_draft_tokens,
            prefix_cache=self.prefix_cache,
        )
        if self.replay != "off":
            self.scheduler.replay_keep = config.scheduler.yoco_keep_tokens
        # The runner dispatches a step with deferred grammar masks in two halves (docs/structured_outputs.md).
        self.scheduler.defer_masks = True
        # Batch invariance: a row's verified drafts (and so its random streams) must not depend on its batch.
        self.scheduler.whole_drafts = self.batch_invariant
        self.last_stats: RunStats | None = None
        self.expert_balancer: MeshExpertBalancer | None = None
        """EPLB of a mesh with ``expert_parallel_size > 1`` (:mod:`deepinfer_jax.engine.mesh_eplb`), else None."""
        self._next_id = 0
        # EPLB and the moe_lb statistics need an expert-parallel group (ep > 1) with slot-layout MoE layers.
        parallel = config.parallel
        if ep > 1 and slot_expert_layers(self.model.params):
            self.expert_balancer = MeshExpertBalancer(parallel, self.model.params, mesh)
        elif parallel.eplb_interval_steps:
            logging.info("parallel.eplb_interval_steps is set but expert_parallel_size = 1: EPLB stays off")
        self.executor = StepExecutor(
            self.model.params,
            self.paged_model,
            mesh,
            num_blocks=spec.num_blocks,
            num_slots=num_slots,
            max_blocks_per_seq=max_blocks,
            batch_invariant=self.batch_invariant,
            expert_counts=self.expert_balancer is not None,
            selection=self.op_selection,
            sampler=SamplerOptions(
                logprobs_mode=logprobs_mode,
                force_top_k=config.sampling.force_top_k,
                sum_smaller=config.sampling.compute_sum_smaller_probs,
            ),
            num_draft_tokens=self.num_draft_tokens,
            confidence_temperature=_confidence_temperatures(config, self.num_draft_tokens),
            stream_interval=config.scheduler.decode_stream_interval,
        )
        self.latency_curve: LatencyCurve | None = None
        """Variable-length verification: the measured decode latency of each token bucket (``None``: off)."""
        if self.num_draft_tokens and config.speculative.variable_length:
            self.latency_curve = self._latency_curve(config, model_dir, dtype, (dp, ep))
            planner = VerifyLengthPlanner(self.latency_curve)
            for device in self.scheduler.devices:
                device.verify_planner = planner
        self.logprobs_mode = logprobs_mode
        """What reported logprobs are (:data:`~deepinfer_jax.sampling.LOGPROBS_MODES`)."""
        options = RunnerOptions(
            async_scheduling=config.scheduler.async_scheduling,
            stats_log_interval_steps=0 if config.disable_log_stats else config.stats_log_interval_steps,
            gc_interval_steps=config.gc_interval_steps,
            transfer_guard=config.transfer_guard,
        )
        self.runner = EngineRunner(
            self.scheduler, self.executor, balancer=self.expert_balancer, options=options
        )

    def _latency_curve(self, config: Any, model_dir: Path, dtype: str, mesh: tuple[int, int]) -> LatencyCurve:
        """The decode latency of every token bucket (docs/speculative.md, "variable length"): read from
        ``speculative.latency_cache_dir`` when a fresh entry exists, else measured now (each bucket compiles
        first, as it would at its first use) and cached there."""
        spec = config.speculative
        buckets = self.scheduler.buckets
        sizes = sorted({t for t, _ in buckets})
        k = self.num_draft_tokens
        key = curve_cache_key(
            f"{model_dir.resolve()}|{dtype}|{config.kv_cache_dtype}|k={k}",
            sizes,
            (*mesh, self.executor.num_slots),
        )
        if spec.latency_cache_dir is not None:
            cached = load_curve(spec.latency_cache_dir, key, ttl_s=spec.latency_cache_ttl_s)
            if cached is not None:
                logging.info("decode latency curve read from %s: %s", spec.latency_cache_dir, cached.points)
                return cached
        params = SamplingParams(temperature=0.0, max_tokens=1)
        plans = {}
        for size in sizes:
            seqs = max(s for t, s in buckets if t == size)
            batch = probe_batch(size, seqs, k, self.scheduler.max_blocks_per_seq, params)
            plans[size] = build_plan(
                [batch] * self.executor.num_devices,
                buckets=buckets,
                max_blocks_per_seq=self.scheduler.max_blocks_per_seq,
                vocab_size=self.executor.vocab_size,
                num_draft_tokens=k,
                replay_keep=self.scheduler.replay_keep,
            )

        def run(size: int) -> None:
            jax.block_until_ready(self.executor.run(plans[size]).tokens)

        curve = measure_curve(run, sizes)
        logging.info("decode latency curve measured: %s", curve.points)
        if spec.latency_cache_dir is not None:
            save_curve(spec.latency_cache_dir, key, curve)
        return curve

    # -------------------------------------------------------------------------------------- inputs

    def _prompts(
        self, prompts: Any, prompt_token_ids: Any, tokenization: Mapping[str, Any] | None = None
    ) -> tuple[list[str | None], list[Any]]:
        """Each prompt's text (``None`` for token prompts) and token ids.

        ``prompts`` takes vLLM's ``PromptType``: a str, a ``TextPrompt`` (``{"prompt": str}``), a ``TokensPrompt``
        (``{"prompt_token_ids": [...]}``, optionally with its ``"prompt"`` text), or a list mixing them.
        ``prompt_token_ids`` (a list of ids, or a list of such lists) is the older spelling of token prompts.
        """
        options = _tokenization_options(tokenization, self.max_model_len)
        if prompts is not None and prompt_token_ids is not None:
            raise ValueError("generate: give prompts or prompt_token_ids, not both")
        if prompts is None and prompt_token_ids is None:
            raise ValueError("generate: prompts and prompt_token_ids are both None; give one of them")
        if prompts is None:
            ids = prompt_token_ids
            if not isinstance(ids, Sequence) and not hasattr(ids, "ndim"):
                raise TypeError(
                    f"prompt_token_ids: expected a list of ints or a list of lists of ints, got {type(ids).__name__}"
                )
            if len(ids) and all(not isinstance(x, Sequence) and not hasattr(x, "ndim") for x in ids):
                ids = [ids]  # one prompt given as a flat list of ids
            if not len(ids):
                raise ValueError("prompt_token_ids: the list of prompts is empty")
            return [None] * len(ids), [_truncate(list(x), options) for x in ids]
        items = [prompts] if isinstance(prompts, str | Mapping) else prompts
        if not isinstance(items, Sequence) or isinstance(items, bytes | bytearray):
            raise TypeError(
                f"prompts: expected a str, a {{'prompt': ...}} or {{'prompt_token_ids': ...}} dict, or a list of "
                f"them, got {type(prompts).__name__}"
            )
        if not items:
            raise ValueError("prompts: the list of prompts is empty")
        texts: list[str | None] = []
        id_lists: list[Any] = []
        for i, item in enumerate(items):
            if isinstance(item, Mapping):
                unknown = set(item) - {"prompt", "prompt_token_ids"}
                if unknown:
                    raise ValueError(
                        f"prompts[{i}]: unsupported key(s) {sorted(unknown)}; a prompt dict holds 'prompt' "
                        "(TextPrompt) or 'prompt_token_ids' (TokensPrompt)"
                    )
                if "prompt_token_ids" in item:
                    text = item.get("prompt")
                    if text is not None and not isinstance(text, str):
                        raise TypeError(f"prompts[{i}]['prompt']: expected a str, got {type(text).__name__}")
                    texts.append(text)
                    tokens = item["prompt_token_ids"]
                    if isinstance(tokens, str | bytes) or not (
                        isinstance(tokens, Sequence) or hasattr(tokens, "ndim")
                    ):
                        raise TypeError(
                            f"prompts[{i}]['prompt_token_ids']: expected a list of ints, got {type(tokens).__name__}"
                        )
                    id_lists.append(_truncate(list(tokens), options))
                    continue
                if "prompt" not in item:
                    raise ValueError(f"prompts[{i}]: a prompt dict needs 'prompt' or 'prompt_token_ids'")
                item = item["prompt"]
                where = f"prompts[{i}]['prompt']"
            else:
                where = f"prompts[{i}]"
            if not isinstance(item, str):
                raise TypeError(
                    f"{where}: expected a str, got {type(item).__name__} (token ids go in "
                    "{'prompt_token_ids': [...]} or generate(prompt_token_ids=...))"
                )
            if not item:
                raise ValueError(f"{where}: the prompt is empty")
            if self.tokenizer is None:
                raise ValueError(
                    f"{where}: this model has no tokenizer (no tokenizer.json in its folder and none given as "
                    "LLM(tokenizer=...)); pass token ids instead"
                )
            texts.append(item)
            # Like vLLM with a DeepSeek tokenizer (add_bos_token): a text prompt starts with BOS unless
            # tokenization_kwargs says add_special_tokens=False. Chat prompts arrive as token ids.
            id_lists.append(
                _truncate(self.tokenizer.encode(item, add_bos=options["add_special_tokens"]), options)
            )
        return texts, id_lists

    def default_sampling_params(self) -> SamplingParams:
        """What a request given no ``SamplingParams`` uses: the config's ``sampling.temperature``, ``top_p``,
        ``top_k`` and ``max_tokens`` (the defaults of ``SamplingParams()`` unless a source changed them)."""
        s = self.config.sampling
        return SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens
        )

    def _sampling_params(self, sampling_params: Any, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if not isinstance(sampling_params, Sequence):
            raise TypeError(
                f"sampling_params: expected a SamplingParams or a list of them, got {type(sampling_params).__name__}"
            )
        if len(sampling_params) != n:
            raise ValueError(
                f"sampling_params: {len(sampling_params)} entries for {n} prompts; give one per prompt"
            )
        for i, p in enumerate(sampling_params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params[{i}]: expected a SamplingParams, got {type(p).__name__}")
        return list(sampling_params)

    # -------------------------------------------------------------------------------------- generate

    def check_replay(self, params: SamplingParams, index: int | None = None) -> None:
        """Refuse what SWA bounded replay cannot compute: prompt logprobs (the consumer layers do not see the
        prompt's rows before ``L - K``). ``ValueError`` naming both settings."""
        if self.replay != "off" and params.prompt_logprobs is not None:
            where = "" if index is None else f"request {index}: "
            raise ValueError(
                f"{where}sampling_params.prompt_logprobs = {params.prompt_logprobs} is impossible with "
                f"scheduler.yoco_truncation = {self.replay!r} (the YOCO consumer layers skip the prompt's rows "
                "before L - yoco_keep_tokens); turn one of them off"
            )

    def generate(
        self,
        prompts: Any = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        *,
        tokenization_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one :class:`RequestOutput` per prompt, in input order.

        ``prompts`` is vLLM's ``PromptType`` (a str, ``{"prompt": ...}``, ``{"prompt_token_ids": [...]}``, or a
        list of them); ``prompt_token_ids`` the older spelling of token prompts. ``tokenization_kwargs`` takes
        ``truncate_prompt_tokens`` (keep the last k tokens of each prompt; -1 = the most that fit
        ``max_model_len``), ``truncation_side`` (``"left"``, the default: keep the end; or ``"right"``) and
        ``add_special_tokens`` (False: no BOS before a text prompt).

        Every request is validated before any is queued: bad input raises and leaves the engine untouched. If
        anything fails while the requests run (an error on the device, a bug, ``KeyboardInterrupt``, an
        exception from a progress callback), every request of the call is aborted and its blocks and slots are
        freed, the device state is re-created if the failure consumed it, and the exception propagates: the
        next call works as on a fresh ``LLM``.

        ``use_tqdm`` shows a progress bar over finished requests and then a one-line summary (requests,
        tokens, tokens/s, compilations and their time) on stderr; a callable is used to make the bar (vLLM's
        ``functools.partial(tqdm, leave=False)``). :attr:`last_stats` holds the same numbers.
        """
        self._check_open()
        texts, id_lists = self._prompts(prompts, prompt_token_ids, tokenization_kwargs)
        params = self._sampling_params(sampling_params, len(id_lists))
        cfg = self.model.config
        checked = []
        for i, (ids, p) in enumerate(zip(id_lists, params)):
            arr = validate_request(
                ids, p, vocab_size=cfg.vocab_size, max_model_len=self.max_model_len, index=i
            )
            self.check_replay(p, index=i)
            if (p.stop or p.bad_words or p.structured_outputs) and self.tokenizer is None:
                name = "stop" if p.stop else "bad_words" if p.bad_words else "structured_outputs"
                raise ValueError(
                    f"request {i}: sampling_params.{name} needs a tokenizer; this model has none"
                )
            so = p.structured_outputs
            needs_end = p.thinking_token_budget is not None and (so is None or so.trigger_token_ids is None)
            if needs_end and (self.tokenizer is None or self.tokenizer.token_to_id("</think>") is None):
                raise ValueError(
                    f"request {i}: sampling_params.thinking_token_budget needs the end of the reasoning: a "
                    "tokenizer with a </think> token, or structured_outputs.trigger_token_ids"
                )
            if p.n > self.scheduler.devices[0].max_num_seqs:
                raise ValueError(
                    f"request {i}: sampling_params.n = {p.n} exceeds max_num_seqs = "
                    f"{self.scheduler.devices[0].max_num_seqs} per device (the n samples of a prompt run together)"
                )
            checked.append(arr)
        request_ids = []
        bar = None
        try:
            for i, (arr, p, text) in enumerate(zip(checked, params, texts)):
                rid = f"req-{self._next_id}"
                self._next_id += 1
                seed = p.seq_seed if p.seq_seed is not None else derive_seed(self.seed, i)
                self.scheduler.add_request(rid, arr, p, seed=seed, prompt=text)
                request_ids.append(rid)
            if use_tqdm:
                if callable(use_tqdm):
                    bar = use_tqdm(total=len(request_ids), desc="generate", unit="req")
                else:
                    from tqdm.auto import tqdm

                    bar = tqdm(total=len(request_ids), desc="generate", unit="req", dynamic_ncols=True)
            if bar is not None and hasattr(bar, "set_description_str"):
                self.executor.on_compile = functools.partial(_show_compile, bar)
            profile = self.config.profile_dir
            trace = jax.profiler.trace(profile) if profile is not None else contextlib.nullcontext()
            with trace:
                outputs, stats = self.runner.run(
                    on_finished=(lambda _: bar.update(1)) if bar is not None else None
                )
        except BaseException as err:
            self._recover(err)
            raise
        finally:
            self.executor.on_compile = None
            if bar is not None:
                with contextlib.suppress(Exception):
                    bar.close()
        self.last_stats = stats
        if use_tqdm:
            print(stats.summary(len(request_ids)), file=sys.stderr)
        by_id = {o.request_id: o for o in outputs}
        return [by_id[rid] for rid in request_ids]

    def _recover(self, err: BaseException) -> None:
        """After a failed run: abort every request, free every block and slot, make the device state usable."""
        dropped = self.scheduler.abort_all()
        rebuilt = self.executor.recover()
        logging.warning(
            "generate: %s stopped the run; %d request(s) aborted and freed%s",
            type(err).__name__,
            len(dropped),
            "; the device cache and state were re-created" if rebuilt else "",
        )

    # -------------------------------------------------------------------------------------- lifetime

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block and window-state snapshot (vLLM's ``reset_prefix_cache``): later
        requests compute their prompts from the start until new blocks are cached. Blocks that running requests
        hold stay theirs. Returns False when prefix caching is off."""
        self._check_open()
        return self.scheduler.reset_prefix_cache()

    def get_tokenizer(self) -> Tokenizer | None:
        """The tokenizer requests are encoded and decoded with (``None`` for a model without one)."""
        return self.tokenizer

    def close(self) -> None:
        """Release the device cache, the per-slot state, the compiled steps and the weights; the ``LLM`` cannot
        generate afterwards (a second call does nothing). ``with LLM(...) as llm:`` closes on exit."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self.scheduler.abort_all()
        if self.grammar_compiler is not None:
            self.grammar_compiler.close()
        self.executor.release()
        for leaf in jax.tree.leaves((self.executor.params, self.model.params)):
            if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                leaf.delete()
        self.executor.params = None
        self.model.params = None
        self.model._compiled.clear()

    def _check_open(self) -> None:
        if getattr(self, "_closed", False):
            raise RuntimeError(
                "this LLM is closed (LLM.close() released its device memory); create a new one"
            )

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------------------------------- chat

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        thinking: bool = False,
        reasoning_effort: str | None = None,
        use_tqdm: bool = True,
        *,
        chat_version: _chat.ChatVersion | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tool_choice: str | Mapping[str, Any] | None = None,
    ) -> list[ChatOutput]:
        """Answer one conversation (a list of OpenAI-style message dicts) or a list of conversations.

        Returns one :class:`~deepinfer_jax.text.ChatOutput` per conversation, in order: reasoning and answer
        apart, tool calls, finish reason and usage, parsed from the generated token ids. ``sampling_params`` is
        one for all or a list with one per conversation; ``tools``, ``thinking`` and ``reasoning_effort`` apply
        to all. ``chat_version`` picks the template (``None``: ``"v41"`` for DeepSeek-V4.1, else ``"v4"``).
        As in vLLM, ``add_generation_prompt=False`` ends the prompt after the last message (no
        ``<｜Assistant｜>`` opening), and ``continue_final_message=True`` (with ``add_generation_prompt=False``)
        continues the last message, which must be the assistant's. Each output also carries the prompt ids, the
        generated ids and, when ``logprobs`` was asked for, their logprobs.
        ``tool_choice`` (with ``tools``): ``None`` / ``"auto"`` leaves the reply free; ``"required"`` constrains it
        to one or more DSML tool calls of the given tools, ``{"type": "function", "function": {"name": ...}}`` to
        one call of that tool, their parameters following the tools' schemas (docs/structured_outputs.md).
        Bad input raises before anything runs. See :mod:`deepinfer_jax.engine.chat`.
        """
        return _chat.chat(
            self,
            messages,
            sampling_params,
            tools=tools,
            thinking=thinking,
            reasoning_effort=reasoning_effort,
            use_tqdm=use_tqdm,
            chat_version=chat_version,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tool_choice=tool_choice,
        )

    def __repr__(self) -> str:
        return f"LLM({self.model!r}, max_model_len={self.max_model_len}, blocks={self.memory_plan.spec.num_blocks})"
