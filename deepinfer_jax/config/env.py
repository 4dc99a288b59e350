"""The ``DEEPINFER_*`` environment variables of the reference engine (spec/engine.md §14), mapped into the tree.

This module is the only place in the project that reads the environment for engine settings: the loaders
call :func:`read_env` once per load and treat its result as one more source of overrides (above gin, below
keyword arguments). Nothing deeper reads ``os.environ``.

Parsing follows the reference: booleans are true unless the value is ``0``, empty, ``false`` or ``False``;
integers and floats use Python's conversions, and a value that does not parse is refused naming the variable.
Variables with a field in the tree map into it. The others are recognised and produce one warning saying why
they have no effect here (most select CUDA, NCCL or torch mechanisms that XLA replaces). An unrecognised
``DEEPINFER_*`` name also warns, with the closest known names, so that a typo does not silently do nothing.
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from deepinfer_jax.config.errors import ConfigValueError, ConfigWarning

__all__ = [
    "ADDED_ENV_VARS",
    "ENV_VARS",
    "PROJECT_ENV_VARS",
    "EnvVar",
    "parse_bool",
    "parse_token_ranges",
    "read_env",
]

PREFIX = "DEEPINFER_"

Kind = Literal["bool", "int", "float", "str", "choice", "token_ranges", "float_or_list"]


@dataclass(frozen=True)
class EnvVar:
    """One recognised variable.

    Attributes:
        name: the variable name.
        kind: how the value is parsed.
        meaning: what it controls (spec/engine.md §14).
        target: dotted tree field it sets (``"cache.block_size"``, or a root field such as ``"profile_dir"``);
            ``None`` when it has no effect in this engine.
        reason: for ``target is None``, why (shown in the warning).
        choices: allowed values of a ``"choice"`` variable.
        transform: applied to the parsed value before it is stored (e.g. a ``DISABLE_x`` flag inverted into
            an ``x`` field).
    """

    name: str
    kind: Kind
    meaning: str
    target: str | None = None
    reason: str = ""
    choices: tuple[str, ...] = ()
    transform: Callable[[Any], Any] | None = None


def _not(value: bool) -> bool:
    return not value


def _true_or_platform_default(value: bool) -> bool | None:
    # Unset/false means "the platform's default" (host memory, device memory on Ascend), not "never".
    return True if value else None


_XLA = "XLA compiles and schedules every step; there is no CUDA-graph or eager mode to choose"
_COLLECTIVES = "collectives are XLA's (NCCL/Gloo tuning does not apply)"

ENV_VARS: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar(
            "DEEPINFER_ACCELERATOR",
            "str",
            "platform (nvidia/ascend)",
            reason="the platform comes from JAX (JAX_PLATFORMS); op backends are chosen by ops.backend",
        ),
        EnvVar(
            "DEEPINFER_COMPUTE_SUM_SMALLER_PROBS",
            "bool",
            "report sum_smaller_probs",
            target="sampling.compute_sum_smaller_probs",
        ),
        EnvVar(
            "DEEPINFER_JIT_CACHE_DIR",
            "str",
            "root of kernel JIT caches (here: the persistent compilation cache's folder)",
            target="ops.kernel_cache_dir",
        ),
        EnvVar("DEEPINFER_NCCL_NUM_SMS", "int", "CTAs for NCCL collectives", reason=_COLLECTIVES),
        EnvVar("DEEPINFER_USERBUFFER_COMM_SMS", "int", "SMs for EP dispatch/combine", reason=_COLLECTIVES),
        EnvVar(
            "DEEPINFER_GLOO_TIMEOUT",
            "float",
            "CPU process group timeout (s)",
            target="parallel.initialization_timeout_s",
        ),
        EnvVar(
            "DEEPINFER_REARRANGE_P2P_GROUPS",
            "int",
            "P2P buckets for EPLB weight moves",
            reason="expert re-placement is an XLA collective; it has no P2P bucket setting",
        ),
        EnvVar(
            "DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS",
            "int",
            "minimum redundant experts",
            target="parallel.eplb_num_redundant_experts",
        ),
        EnvVar(
            "DEEPINFER_EXPERT_COUNT_WINDOW_SIZE",
            "int",
            "EPLB statistics window (steps)",
            target="parallel.eplb_window_steps",
        ),
        EnvVar(
            "DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL",
            "int",
            "EPLB rearrangement period (0 = off)",
            target="parallel.eplb_interval_steps",
        ),
        EnvVar(
            "DEEPINFER_REARRANGE_AFTER_PREFILL_IN_NORMAL_ENGINE",
            "bool",
            "rearrange right after prefill",
            target="parallel.eplb_after_prefill",
        ),
        EnvVar(
            "DEEPINFER_MOE_LB_STAT_INTERVAL",
            "int",
            "MoE load-balance metric flush period",
            target="parallel.moe_load_stats_interval_steps",
        ),
        EnvVar(
            "DEEPINFER_FORCE_IMBALANCE_RATIO",
            "float",
            "synthetic MoE imbalance",
            target="parallel.moe_force_imbalance_ratio",
        ),
        EnvVar(
            "DEEPINFER_FORCE_LOAD_BALANCE",
            "bool",
            "uniform random routing",
            target="parallel.moe_force_uniform_routing",
        ),
        EnvVar(
            "DEEPINFER_SHOW_EPLB_DETAIL",
            "bool",
            "log per-expert load on rearrangement",
            target="parallel.eplb_log_detail",
        ),
        EnvVar(
            "DEEPINFER_PREFILL_MAX_SUM_SEQLEN_K",
            "int",
            "cap on summed prompt lengths per prefill step",
            target="scheduler.prefill_max_sum_seqlen_k",
        ),
        EnvVar(
            "DEEPINFER_INDEX_ATTN_MEMORY_LIMIT",
            "int",
            "indexer attention workspace bound (bytes)",
            target="ops.indexer_workspace_bytes",
        ),
        EnvVar(
            "DEEPINFER_USE_NEXTN_DECODE",
            "int",
            "draft length nextn (0 = no speculation)",
            target="speculative.num_draft_tokens",
        ),
        EnvVar(
            "DEEPINFER_ENABLE_MTP_VARLEN",
            "bool",
            "confidence-scheduled verify length",
            target="speculative.variable_length",
        ),
        EnvVar(
            "DEEPINFER_MAX_BACKTRACKING_TOKENS",
            "int",
            "rollback margin of the window/compression rings",
            target="cache.max_backtracking_tokens",
        ),
        EnvVar(
            "DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE",
            "float_or_list",
            "confidence sigmoid temperature",
            target="speculative.confidence_temperature",
        ),
        EnvVar(
            "DEEPINFER_ENGRAM_PAD_TOKEN",
            "int",
            "Engram pad token",
            reason="the pad id is read from the model config (engram_pad_token_id); override that key instead",
        ),
        EnvVar(
            "DEEPINFER_ENGRAM_FORCE_GPU_STORAGE",
            "bool",
            "keep Engram tables on the device",
            target="parallel.engram_on_device",
            transform=_true_or_platform_default,
        ),
        EnvVar(
            "DEEPINFER_SAMPLER_FORCE_TOPK", "int", "force-top-k sampling space", target="sampling.force_top_k"
        ),
        EnvVar(
            "DEEPINFER_DECODE_TOKEN_BLACKLIST",
            "token_ranges",
            "banned token ids ('a..b,c')",
            target="sampling.banned_token_ids",
        ),
        EnvVar("DEEPINFER_ENFORCE_EAGER", "bool", "no decode graphs", reason=_XLA),
        EnvVar(
            "DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL",
            "int",
            "decode bucket spacing",
            target="scheduler.decode_bucket_interval",
        ),
        EnvVar("DEEPINFER_DFLASH_ENFORCE_EAGER", "bool", "no drafting graphs", reason=_XLA),
        EnvVar(
            "DEEPINFER_DFLASH_CUDAGRAPH_BATCH_SIZE_INTERVAL",
            "int",
            "drafting bucket spacing",
            target="scheduler.draft_bucket_interval",
        ),
        EnvVar(
            "DEEPINFER_DECODE_PERF_CACHE_DIR",
            "str",
            "decode latency curve cache dir",
            target="speculative.latency_cache_dir",
        ),
        EnvVar(
            "DEEPINFER_DECODE_PERF_CACHE_TTL_SEC",
            "int",
            "decode latency curve validity (s)",
            target="speculative.latency_cache_ttl_s",
        ),
        EnvVar(
            "DEEPINFER_NUM_STATE_SLOTS_RATIO",
            "float",
            "state slots per max_num_seqs",
            target="cache.state_slots_ratio",
        ),
        EnvVar(
            "DEEPINFER_ENABLE_PREFIX_CACHING",
            "bool",
            "reuse cached prefix blocks (and V4 / V4.1 window-state snapshots)",
            target="cache.enable_prefix_caching",
        ),
        EnvVar(
            "DEEPINFER_PREFILL_STORE_EXTRA_STATE",
            "bool",
            "enlarge SWA rings for 128-granular persistence",
            target="cache.store_extra_window_state",
        ),
        EnvVar(
            "DEEPINFER_PREFILL_STORE_EXTRA_SIZE",
            "int",
            "extra ring tokens",
            target="cache.extra_window_tokens",
        ),
        EnvVar(
            "DEEPINFER_XGRAMMAR_DEBUG",
            "bool",
            "verbose grammar matcher logging",
            reason="the grammar backend is llguidance, which has no such switch; use Python logging levels",
        ),
        EnvVar(
            "DEEPINFER_XGRAMMAR_TIMEOUT",
            "int",
            "grammar compile timeout (s)",
            target="sampling.grammar_compile_timeout_s",
        ),
        EnvVar(
            "DEEPINFER_XGRAMMAR_DISABLE_CACHE",
            "bool",
            "disable the compiled-grammar cache",
            target="sampling.grammar_cache",
            transform=_not,
        ),
        EnvVar(
            "DEEPINFER_XGRAMMAR_CACHE_LIMIT_BYTES",
            "int",
            "grammar cache limit (<= 0 = unbounded)",
            target="sampling.grammar_cache_limit_bytes",
        ),
        EnvVar(
            "DEEPINFER_SO_BUILDER_CPUS", "int", "grammar builder threads", target="sampling.grammar_threads"
        ),
        EnvVar(
            "DEEPINFER_PREFILL_ATTEMPT_INTERVAL",
            "int",
            "ALL-vote prefill attempt period",
            target="scheduler.prefill_all_vote_interval",
        ),
        EnvVar(
            "DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL",
            "int",
            "ANY-vote prefill attempt period",
            target="scheduler.prefill_any_vote_interval",
        ),
        EnvVar(
            "DEEPINFER_ZERO_OVERHEAD_SCHEDULING",
            "bool",
            "zero-overhead (asynchronous) scheduling",
            target="scheduler.async_scheduling",
        ),
        EnvVar(
            "DEEPINFER_LOGGING_INTERVAL_STEP",
            "int",
            "statistics log period",
            target="stats_log_interval_steps",
        ),
        EnvVar(
            "DEEPINFER_NCCL_MEMORY_SAMPLE_INTERVAL_STEPS",
            "int",
            "NCCL memory log period",
            reason=_COLLECTIVES,
        ),
        EnvVar(
            "DEEPINFER_RINGBUFFER_WARNING_INTERVAL",
            "int",
            "CP broadcast ring stall warnings",
            reason="there is no host broadcast ring; context-parallel inputs are sharded arrays",
        ),
        EnvVar("DEEPINFER_GC_INTERVAL_STEP", "int", "manual GC period", target="gc_interval_steps"),
        EnvVar(
            "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE",
            "choice",
            "YOCO prefill truncation",
            target="scheduler.yoco_truncation",
            choices=("off", "mask", "compact"),
        ),
        EnvVar(
            "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS",
            "int",
            "YOCO kept tokens",
            target="scheduler.yoco_keep_tokens",
        ),
        EnvVar("DEEPINFER_BATCH_INVARIANT", "bool", "batch-invariant numerics", target="ops.batch_invariant"),
        EnvVar(
            "DEEPINFER_DISABLE_SYNC_GUARD",
            "bool",
            "disable the no-host-sync guard",
            target="transfer_guard",
            transform=_not,
        ),
        EnvVar(
            "DEEPINFER_PROFILE_TORCH_CUDA_MEMORY",
            "str",
            "torch CUDA memory history",
            reason="torch-specific; use jax.profiler device memory profiles",
        ),
        EnvVar(
            "DEEPINFER_ENABLE_MEMORY_TRACING",
            "bool",
            "dump a memory snapshot of the profiling run",
            reason="torch-specific; XLA reports memory through compiled memory_analysis()",
        ),
        EnvVar(
            "DEEPINFER_PROFILE_HTTP_ENABLE",
            "bool",
            "per-engine HTTP profiling endpoint",
            reason="there is no profiling endpoint; set profile_dir to write jax.profiler traces",
        ),
        EnvVar(
            "DEEPINFER_PROFILE_HTTP_PORT_BASE",
            "int",
            "profiling endpoint port base",
            reason="there is no profiling endpoint",
        ),
        EnvVar(
            "DEEPINFER_TORCH_PROFILER_DIR",
            "str",
            "torch profiler trace directory",
            reason="torch-specific; set profile_dir for jax.profiler traces",
        ),
        EnvVar(
            "DEEPINFER_USE_MULTIMODAL_POOL",
            "bool",
            "multimodal shared pool",
            reason="the engine is text-only",
        ),
        EnvVar(
            "DEEPINFER_MULTIMODAL_POOL_SIZE_GB",
            "int",
            "multimodal pool size",
            reason="the engine is text-only",
        ),
        EnvVar(
            "DEEPINFER_MULTI_MODAL_BUFFER_SIZE",
            "int",
            "multimodal output queue",
            reason="the engine is text-only",
        ),
        EnvVar(
            "DEEPINFER_MULTI_MODAL_WORKER_TIMEOUT",
            "float",
            "multimodal worker timeout",
            reason="the engine is text-only",
        ),
        EnvVar(
            "DEEPINFER_CPP_LOG_LEVEL",
            "str",
            "native log level",
            reason="there is no native runtime; use Python/absl logging levels",
        ),
        EnvVar(
            "DEEPINFER_HF_MODEL_DIR",
            "str",
            "local checkpoint for the examples",
            reason="pass the checkpoint directory as the model argument",
        ),
        EnvVar(
            "DEEPINFER_FUSED_SAMPLE_STRESS_TEST",
            "str",
            "sampler distribution test scaling",
            reason="a test-only switch of the reference's fused sampler",
        ),
        EnvVar(
            "DEEPINFER_FUSED_SAMPLE_DETAIL_LOG",
            "str",
            "sampler distribution test logging",
            reason="a test-only switch of the reference's fused sampler",
        ),
    )
}
"""Every ``DEEPINFER_*`` variable of spec/engine.md §14."""

ADDED_ENV_VARS: tuple[str, ...] = ("DEEPINFER_ENABLE_PREFIX_CACHING",)
"""Engine settings of :data:`ENV_VARS` that this project adds to the reference's variables (features DeepInfer's
engine lacks); every other entry is one of the reference's."""

PROJECT_ENV_VARS: dict[str, str] = {
    "DEEPINFER_JAX_CACHE": "cache directory of materialised built-in models (read by deepinfer_jax.models.builtin)",
    "DEEPINFER_API_KEY": "the API key of deepinfer-jax serve when --api_key is not given (read by its command)",
}
"""This project's own ``DEEPINFER_*`` variables: not engine settings, read by their owners, never warned about."""


def parse_bool(raw: str) -> bool:
    """The reference's boolean rule: true unless ``0``, empty, ``false`` or ``False``."""
    return raw not in ("0", "", "false", "False")


def parse_token_ranges(raw: str, *, name: str = "value") -> tuple[int, ...]:
    """Parse ``"0..3,7,10..12"`` (inclusive ranges and single ids, strictly increasing) into sorted ids.

    An empty string means "no ids".
    """
    if not raw.strip():
        return ()
    out: list[int] = []
    previous: int | None = None
    for part in raw.split(","):
        part = part.strip()
        try:
            if ".." in part:
                start_s, end_s = part.split("..", 1)
                start, end = int(start_s), int(end_s)
            else:
                start = end = int(part)
        except ValueError:
            raise ConfigValueError(
                f"{name} = {raw!r}: cannot parse {part!r}; expected ids and inclusive ranges like '0..3,7,10..12'",
                field=name,
            ) from None
        if start < 0 or start > end:
            raise ConfigValueError(
                f"{name} = {raw!r}: range {part!r} must satisfy 0 <= start <= end", field=name
            )
        if previous is not None and start <= previous:
            raise ConfigValueError(
                f"{name} = {raw!r}: {part!r} starts at {start}, not after the previous end {previous} "
                "(ranges must be strictly increasing)",
                field=name,
            )
        out.extend(range(start, end + 1))
        previous = end
    return tuple(out)


def _parse(var: EnvVar, raw: str) -> Any:
    def fail(expected: str) -> ConfigValueError:
        return ConfigValueError(
            f"environment variable {var.name} = {raw!r}: expected {expected}", field=var.target or var.name
        )

    if var.kind == "bool":
        return parse_bool(raw)
    if var.kind == "int":
        try:
            return int(raw)
        except ValueError:
            raise fail("an integer") from None
    if var.kind == "float":
        try:
            return float(raw)
        except ValueError:
            raise fail("a number") from None
    if var.kind == "choice":
        if raw not in var.choices:
            raise fail("one of " + ", ".join(repr(c) for c in var.choices))
        return raw
    if var.kind == "token_ranges":
        return parse_token_ranges(raw, name=f"environment variable {var.name}")
    if var.kind == "float_or_list":
        try:
            if "," in raw:
                return tuple(float(x) for x in raw.split(","))
            return float(raw)
        except ValueError:
            raise fail("a number or a comma-separated list of numbers") from None
    return raw


def read_env(environ: Mapping[str, str] | None = None) -> dict[str, tuple[Any, str]]:
    """Parse the ``DEEPINFER_*`` variables of ``environ`` (default: ``os.environ``).

    Returns:
        ``{dotted_field: (value, "environment variable NAME")}`` for every set variable that maps into the
        tree; the loaders apply these above gin bindings and below keyword overrides.

    Raises:
        ConfigValueError: a value does not parse (the message names the variable and the expected form).

    Warns:
        ConfigWarning: for a recognised variable with no effect here, and for an unknown ``DEEPINFER_*`` name.
    """
    env = os.environ if environ is None else environ
    out: dict[str, tuple[Any, str]] = {}
    for name in sorted(env):
        if not name.startswith(PREFIX) or name in PROJECT_ENV_VARS:
            continue
        var = ENV_VARS.get(name)
        if var is None:
            close = difflib.get_close_matches(name, [*ENV_VARS, *PROJECT_ENV_VARS], n=3, cutoff=0.75)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            warnings.warn(
                f"environment variable {name} is not a deepinfer_jax setting and is ignored{hint}",
                ConfigWarning,
                stacklevel=2,
            )
            continue
        if var.target is None:
            warnings.warn(
                f"environment variable {name} ({var.meaning}) has no effect in deepinfer_jax: {var.reason}",
                ConfigWarning,
                stacklevel=2,
            )
            continue
        value = _parse(var, env[name])
        if name == "DEEPINFER_XGRAMMAR_CACHE_LIMIT_BYTES" and value <= 0:
            warnings.warn(
                f"environment variable {name} = {value}: the grammar cache is unbounded",
                ConfigWarning,
                stacklevel=2,
            )
        if var.transform is not None:
            value = var.transform(value)
        if value is None:
            continue  # e.g. an unset-equivalent flag: leave the field to lower sources
        out[var.target] = (value, f"environment variable {name}")
    return out
