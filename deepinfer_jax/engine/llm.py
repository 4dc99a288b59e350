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
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
from absl import logging
from jax.experimental.compilation_cache import compilation_cache
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from deepinfer_jax.cache.paged import parse_bytes
from deepinfer_jax.cache.plan import plan_memory
from deepinfer_jax.checkpoint.model_loading import DTYPES, Model, init_random, load_model
from deepinfer_jax.config import load_config_with_sources
from deepinfer_jax.config.status import check_settings, env_report, field_value
from deepinfer_jax.engine import chat as _chat
from deepinfer_jax.engine.buckets import step_buckets
from deepinfer_jax.engine.mesh_eplb import MeshExpertBalancer
from deepinfer_jax.engine.params import RequestOutput, SamplingParams, validate_request
from deepinfer_jax.engine.runner import EngineRunner, RunnerOptions, RunStats
from deepinfer_jax.engine.scheduler import Scheduler
from deepinfer_jax.engine.step import SamplerOptions, StepExecutor, state_bytes
from deepinfer_jax.models import builtin
from deepinfer_jax.models.registry import get_family
from deepinfer_jax.ops.selection import resolve_selection
from deepinfer_jax.parallel import distributed, mesh_from_config, shard_model_params, slot_expert_layers
from deepinfer_jax.parallel.mesh import mesh_sizes
from deepinfer_jax.parallel.model_parallel import place_on_mesh
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
}
"""What each of LLM's keyword arguments is when neither the call nor a config source sets it."""
_MASK64 = (1 << 64) - 1


def derive_seed(seed: int, index: int) -> int:
    """The sampling seed of request ``index`` of a ``generate`` call when it gives no ``seq_seed``.

    A SplitMix64 finaliser over ``(seed, index)``: distinct requests get unrelated 64-bit seeds, and the same
    ``LLM(seed=)`` and batch reproduce them exactly.
    """
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


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
        if dtype not in DTYPES:
            raise ValueError(f"dtype: {dtype!r} is not a precision mode; expected one of {DTYPES}")
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
        family = get_family(str(getattr(config.require_model("LLM").family, "value", config.model.family)))
        cache_storage, _ = family.engine_support()
        cache_storage(dtype, kv_cache_dtype)  # before any weight is read
        # A multi-process run joins its peers before anything touches a JAX backend; then the mesh, before any
        # weight is read (more devices than exist is a ValueError naming both sizes).
        distributed.initialize(config.parallel)
        mesh = mesh_from_config(config.parallel)
        if num_devices == 1 and distributed.is_multi_process(config.parallel):
            raise ValueError(
                f"parallel.num_processes = {config.parallel.num_processes}: a multi-process run needs a mesh over "
                "the devices of every process; set data_parallel_size * expert_parallel_size to their number"
            )
        if config.ops.kernel_cache_dir is not None:
            # Process-wide: JAX keeps one persistent compilation cache per process.
            jax.config.update("jax_compilation_cache_dir", str(config.ops.kernel_cache_dir))
            compilation_cache.reset_cache()
        if tokenizer is None and config.tokenizer is not None:
            tokenizer = config.tokenizer
        self.config = config
        self.mesh = mesh
        # Before any weight is read: ops.strict refuses a backend that cannot run here.
        self.op_selection = resolve_selection(config.ops, platform=mesh.devices.flat[0].platform)
        """Which implementation every op of the step runs (``ops.backend`` / ``ops.overrides`` / ``ops.strict``)."""
        self.op_selection.log()
        self.model = _lay_out(
            _load_for(model_dir, dtype, mesh, config), mesh, extra=config.parallel.eplb_num_redundant_experts
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

        num_slots = max_num_seqs + 1
        _, paged_model = self.model.family.engine_support()
        self.paged_model = paged_model(
            self.model, block_size=config.cache.block_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype
        )
        if budget is None:
            device = mesh.devices.flat[0]
            stats = device.memory_stats() if device.platform != "cpu" else None
            budget = default_cache_memory(
                self.paged_model.layout(),
                params=self.model.params,
                num_devices=num_devices,
                max_num_seqs=max_num_seqs,
                num_slots=num_slots,
                reserved_bytes=state_bytes(num_slots, cfg.vocab_size),
                tokens_per_seq=max_model_len or cfg.max_position_embeddings or 4096,
                memory_utilization=config.cache.memory_utilization,
                memory_stats=stats,
            )
        try:
            plan = plan_memory(
                self.paged_model.layout(),
                budget // num_devices,
                num_slots=num_slots,
                reserved_bytes=state_bytes(num_slots, cfg.vocab_size),
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
        self.scheduler = Scheduler(
            num_devices=num_devices,
            num_blocks=spec.num_blocks,
            block_size=spec.block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            vocab_size=cfg.vocab_size,
            eos_token_ids=self.eos_token_ids,
            num_state_slots=num_slots,
            max_blocks_per_seq=max_blocks,
            buckets=step_buckets(max_num_batched_tokens, max_num_seqs),
            tokenizer=self.tokenizer,
            min_bucket_fill=config.scheduler.min_bucket_fill,
            banned_token_ids=config.sampling.banned_token_ids,
        )
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
        )
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

    # -------------------------------------------------------------------------------------- inputs

    def _prompts(self, prompts: Any, prompt_token_ids: Any) -> tuple[list[str | None], list[Any]]:
        if prompts is not None and prompt_token_ids is not None:
            raise ValueError("generate: give prompts or prompt_token_ids, not both")
        if prompts is None and prompt_token_ids is None:
            raise ValueError("generate: prompts and prompt_token_ids are both None; give one of them")
        if prompts is not None:
            items = [prompts] if isinstance(prompts, str) else prompts
            if not isinstance(items, Sequence) or isinstance(items, bytes | bytearray):
                raise TypeError(f"prompts: expected a str or a list of str, got {type(prompts).__name__}")
            texts: list[str | None] = []
            for i, text in enumerate(items):
                if not isinstance(text, str):
                    raise TypeError(f"prompts[{i}]: expected a str, got {type(text).__name__}")
                if not text:
                    raise ValueError(f"prompts[{i}]: the prompt is empty")
                texts.append(text)
            if self.tokenizer is None:
                raise ValueError(
                    "prompts: this model has no tokenizer (no tokenizer.json in its folder and none given as "
                    "LLM(tokenizer=...)); pass prompt_token_ids instead"
                )
            # Like vLLM with a DeepSeek tokenizer (add_bos_token): a text prompt starts with BOS. Chat prompts
            # arrive as token ids, already holding their own BOS.
            return texts, [self.tokenizer.encode(t, add_bos=True) for t in texts]
        ids = prompt_token_ids
        if not isinstance(ids, Sequence) and not hasattr(ids, "ndim"):
            raise TypeError(
                f"prompt_token_ids: expected a list of ints or a list of lists of ints, got {type(ids).__name__}"
            )
        if len(ids) and all(not isinstance(x, Sequence) and not hasattr(x, "ndim") for x in ids):
            ids = [ids]  # one prompt given as a flat list of ids
        if not len(ids):
            raise ValueError("prompt_token_ids: the list of prompts is empty")
        return [None] * len(ids), list(ids)

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

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one :class:`RequestOutput` per prompt, in input order.

        Every request is validated before any is queued: bad input raises and leaves the engine untouched.
        ``use_tqdm`` shows a progress bar over finished requests and then a one-line summary (requests,
        tokens, tokens/s, compilations and their time) on stderr; :attr:`last_stats` holds the same numbers.
        """
        texts, id_lists = self._prompts(prompts, prompt_token_ids)
        params = self._sampling_params(sampling_params, len(id_lists))
        cfg = self.model.config
        checked = []
        for i, (ids, p) in enumerate(zip(id_lists, params)):
            arr = validate_request(
                ids, p, vocab_size=cfg.vocab_size, max_model_len=self.max_model_len, index=i
            )
            if p.stop and self.tokenizer is None:
                raise ValueError(f"request {i}: sampling_params.stop needs a tokenizer; this model has none")
            checked.append(arr)
        request_ids = []
        for i, (arr, p, text) in enumerate(zip(checked, params, texts)):
            rid = f"req-{self._next_id}"
            self._next_id += 1
            seed = p.seq_seed if p.seq_seed is not None else derive_seed(self.seed, i)
            self.scheduler.add_request(rid, arr, p, seed=seed, prompt=text)
            request_ids.append(rid)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(request_ids), desc="generate", unit="req", dynamic_ncols=True)
        profile = self.config.profile_dir
        trace = jax.profiler.trace(profile) if profile is not None else contextlib.nullcontext()
        try:
            with trace:
                outputs, stats = self.runner.run(
                    on_finished=(lambda _: bar.update(1)) if bar is not None else None
                )
        finally:
            if bar is not None:
                bar.close()
        self.last_stats = stats
        if use_tqdm:
            print(stats.summary(len(request_ids)), file=sys.stderr)
        by_id = {o.request_id: o for o in outputs}
        return [by_id[rid] for rid in request_ids]

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
    ) -> list[ChatOutput]:
        """Answer one conversation (a list of OpenAI-style message dicts) or a list of conversations.

        Returns one :class:`~deepinfer_jax.text.ChatOutput` per conversation, in order: reasoning and answer
        apart, tool calls, finish reason and usage, parsed from the generated token ids. ``sampling_params`` is
        one for all or a list with one per conversation; ``tools``, ``thinking`` and ``reasoning_effort`` apply
        to all. ``chat_version`` picks the template (``None``: ``"v41"`` for DeepSeek-V4.1, else ``"v4"``).
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
        )

    def __repr__(self) -> str:
        return f"LLM({self.model!r}, max_model_len={self.max_model_len}, blocks={self.memory_plan.spec.num_blocks})"
