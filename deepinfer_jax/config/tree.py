"""The engine's config tree: one frozen dataclass per concern under :class:`EngineConfig`.

Field names follow the reference engine's ``EngineArgs`` and ``DEEPINFER_*`` settings (spec/engine.md §2.2,
§14), renamed where the original names a CUDA mechanism that has a different JAX counterpart
(``gpu_memory_utilization`` -> ``cache.memory_utilization``, the CUDA-graph batch-size interval ->
``scheduler.decode_bucket_interval``, ``tokens_per_block`` -> ``cache.block_size``). docs/config.md maps every
original name to its field, or says why it has none.

Every section validates its ranges in ``__post_init__`` (so ``dataclasses.replace`` re-validates), and
:class:`EngineConfig` adds the checks that need several sections or the model (spec/engine.md §2.3).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from deepinfer_jax.config.base import Checked, check_range
from deepinfer_jax.config.errors import ConfigValueError
from deepinfer_jax.config.frozen import FrozenMapping, thaw
from deepinfer_jax.config.model import ModelConfig

__all__ = [
    "BLOCK_SIZES",
    "KV_CACHE_DTYPES",
    "OPS_BACKENDS",
    "SECTIONS",
    "CacheConfig",
    "EngineConfig",
    "OpsConfig",
    "ParallelConfig",
    "SamplingConfig",
    "SchedulerConfig",
    "ServerConfig",
    "SpeculativeConfig",
    "config_to_dict",
]

_GIB = 1 << 30

BLOCK_SIZES: tuple[int, ...] = (8, 16, 32, 64, 128)
"""Allowed ``cache.block_size`` values: 128 or a divisor of 128 that is a multiple of 8.

Compressed-KV entries (ratio 1/2/4/.../128) and the FP8/FP4 scale groups must tile a block exactly, and 8 keeps
block rows aligned to the sublane tiling of the kernels."""

OPS_BACKENDS: tuple[str, ...] = ("reference", "pallas_gpu", "cutedsl_sm100", "ascend")
"""Op implementation backends (ARCHITECTURE §3); ``ops.backend`` is one of these or ``"auto"``."""

KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "quantized")
"""``"auto"`` follows the precision mode (ARCHITECTURE §8); ``"float32"``/``"bfloat16"`` store unquantised
caches; ``"quantized"`` stores the family's production record formats (V4/V4.1: MXFP8 window, FP4 or MXFP8
compressed, MXFP4 indexer keys; V3: FP8 latent with float32 scales) in either mode."""

_MAX_MODEL_LEN_LIMIT = 1 << 30  # positions are int32 and buffers are sized from runtime_max_model_len
_DEFAULT_PREFILL_MAX_SUM_SEQLEN_K = 1 << 30
_REFERENCE_NEXTN = 5  # the reference runtime's default draft length (DEEPINFER_USE_NEXTN_DECODE)


SNAPSHOT_SLOTS_RATIO = 3.0
"""``cache.state_slots_ratio`` when unset and the engine keeps window-state snapshots (prefix caching of a V4 /
V4.1 model): two snapshot slots per sequence, so every conversation keeps its newest snapshot while the running
ones write theirs (docs/prefix_cache.md)."""


@dataclass(frozen=True, kw_only=True)
class CacheConfig(Checked):
    """Paged KV cache and per-sequence state slots.

    Attributes:
        block_size: tokens per cache block (one of :data:`BLOCK_SIZES`; the reference fixes 128).
        memory_utilization: fraction of device memory the engine may use (weights, activations, caches).
        num_blocks: fixed number of cache blocks, overriding memory profiling (``None`` = profile).
        state_slots_ratio: state slots = ``int(max_num_seqs * ratio) + 1`` (slot 0 is reserved): one per running
            sequence, the rest hold prefix caching's window-state snapshots (V4 / V4.1). ``None`` =
            :data:`SNAPSHOT_SLOTS_RATIO` when the
            engine keeps snapshots, else 1.0 (docs/prefix_cache.md).
        enable_prefix_caching: reuse the cached blocks of earlier requests' prefixes (docs/prefix_cache.md).
        host_memory: bytes of host memory (the whole engine's, split over its devices) for cached blocks and
            snapshots evicted from device memory (0 = no host tier).
        host_ttl_s: seconds a host-tier entry lives after it was stored or last used.
        max_backtracking_tokens: rollback margin of the window/compression rings; the effective value is
            ``max(this, num_draft_tokens + 1)`` (:attr:`EngineConfig.backtracking_tokens`).
        store_extra_window_state / extra_window_tokens: enlarge the sliding-window rings by this many tokens so
            that prefix state can be persisted at 128-token granularity.
    """

    _PREFIX: ClassVar[str] = "cache"

    block_size: int = 128
    memory_utilization: float = 0.9
    num_blocks: int | None = None
    state_slots_ratio: float | None = None
    enable_prefix_caching: bool = True
    host_memory: int = 0
    host_ttl_s: float = 7 * 86400.0
    max_backtracking_tokens: int = 0
    store_extra_window_state: bool = False
    extra_window_tokens: int = 128

    def _validate(self) -> None:
        if self.block_size not in BLOCK_SIZES:
            raise ConfigValueError(
                f"cache.block_size = {self.block_size}: must be 128 or a divisor of 128 that is a multiple of 8 "
                f"({', '.join(map(str, BLOCK_SIZES))})",
                field="cache.block_size",
            )
        check_range("cache.memory_utilization", self.memory_utilization, gt=0.0, le=1.0)
        check_range("cache.num_blocks", self.num_blocks, ge=2)  # block 0 is the reserved null block
        check_range("cache.state_slots_ratio", self.state_slots_ratio, ge=1.0)
        check_range("cache.max_backtracking_tokens", self.max_backtracking_tokens, ge=0)
        check_range("cache.host_memory", self.host_memory, ge=0)
        check_range("cache.host_ttl_s", self.host_ttl_s, gt=0.0)
        check_range("cache.extra_window_tokens", self.extra_window_tokens, ge=0)


@dataclass(frozen=True, kw_only=True)
class ParallelConfig(Checked):
    """Device mesh, multi-host set-up, expert placement (EPLB) and MoE load statistics.

    The mesh is ``(dp, ep)`` (optionally ``cp``) over ``dp * ep * cp`` devices (ARCHITECTURE §5): attention is
    data parallel over every device, experts are sharded over ``ep``.

    Attributes:
        coordinator_address, num_processes, process_id: arguments of ``jax.distributed.initialize`` for a
            multi-host run (all ``None`` = single process).
        initialization_timeout_s: how long processes wait for each other at start-up (the default is
            ``jax.distributed.initialize``'s).
        eplb_interval_steps: re-place experts every this many steps (0 = EPLB off).
        eplb_window_steps: expert-load statistics window.
        eplb_num_redundant_experts: minimum redundant expert replicas (rounded up so that ``ep`` divides the
            total).
        eplb_after_prefill: also count prefill steps and re-place right after prefill.
        moe_load_stats_interval_steps: steps between MoE load-balance metric flushes.
        moe_force_imbalance_ratio: > 0 routes tokens with a synthetic imbalance of this ratio (>= 1); benchmarking.
        moe_force_uniform_routing: route every token uniformly at random; benchmarking.
        engram_on_device: keep Engram tables in device memory (``None`` and ``True``: device memory, where the
            engine keeps them; ``False``, host memory, is refused: not implemented).
    """

    _PREFIX: ClassVar[str] = "parallel"

    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    context_parallel_size: int = 1
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    initialization_timeout_s: float = 300.0
    eplb_interval_steps: int = 0
    eplb_window_steps: int = 100
    eplb_num_redundant_experts: int = 0
    eplb_after_prefill: bool = False
    eplb_log_detail: bool = False
    moe_load_stats_interval_steps: int = 128
    moe_force_imbalance_ratio: float = 0.0
    moe_force_uniform_routing: bool = False
    engram_on_device: bool | None = None

    def _validate(self) -> None:
        for name in ("data_parallel_size", "expert_parallel_size", "context_parallel_size"):
            check_range(f"parallel.{name}", getattr(self, name), ge=1)
        check_range("parallel.num_processes", self.num_processes, ge=1)
        if self.process_id is not None:
            check_range("parallel.process_id", self.process_id, ge=0, lt=self.num_processes)
            if self.num_processes is None:
                raise ConfigValueError(
                    "parallel.process_id is set but parallel.num_processes is not",
                    field="parallel.process_id",
                )
        check_range("parallel.initialization_timeout_s", self.initialization_timeout_s, gt=0)
        check_range("parallel.eplb_interval_steps", self.eplb_interval_steps, ge=0)
        check_range("parallel.eplb_window_steps", self.eplb_window_steps, ge=1)
        check_range("parallel.eplb_num_redundant_experts", self.eplb_num_redundant_experts, ge=0)
        check_range("parallel.moe_load_stats_interval_steps", self.moe_load_stats_interval_steps, ge=1)
        ratio = self.moe_force_imbalance_ratio
        if ratio != 0.0 and not ratio >= 1.0:
            raise ConfigValueError(
                f"parallel.moe_force_imbalance_ratio = {ratio!r}: must be 0 (off) or >= 1",
                field="parallel.moe_force_imbalance_ratio",
            )

    @property
    def num_devices(self) -> int:
        """Devices of the mesh, ``dp * ep * cp``."""
        return self.data_parallel_size * self.expert_parallel_size * self.context_parallel_size


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig(Checked):
    """Host-side scheduling: budgets, prefill policy, compiled shape buckets, YOCO prefill truncation.

    Attributes:
        max_num_seqs: concurrently running sequences.
        max_num_batched_tokens: per-step token budget (``None`` = derived, :attr:`EngineConfig.max_num_batched_tokens`).
        chunked_prefill: split long prompts over several steps (always on in this engine; False is refused).
        lookahead_tokens: minimum prefill chunk length.
        async_scheduling: dispatch step N+1 before step N's tokens reach the host; False processes every step
            before scheduling the next.
        decode_bucket_interval: spacing of the compiled decode token buckets (powers of two below it, then its
            multiples).
        draft_bucket_interval: the same for draft-model request buckets.
        prefill_max_sum_seqlen_k: cap on the summed full lengths of the prompts in one prefill step
            (``None`` = 2**30, i.e. no cap).
        prefill_all_vote_interval / prefill_any_vote_interval: decode steps between data-parallel prefill
            attempts that need all ranks / any rank to have prompts waiting.
        yoco_truncation: V4.1 prefill truncation of the YOCO consumer half: ``"off"`` (exact model),
            ``"mask"`` or ``"compact"`` (spec/engine.md §7).
        yoco_keep_tokens: trailing tokens kept when truncation is on (default 140; must be >= sliding_window + the
            ring margin: ``dspark_block_size`` when drafting, else the backtracking tokens).
        min_bucket_fill: when a step's tokens fill less than this fraction of the compiled bucket they would be
            padded to, its prefill chunks are cut to fill the next smaller bucket (0 = never cut; docs/engine.md).
        num_decode_steps: the decode loop (docs/engine.md "Decode loop"): when nothing waits for admission and
            every running request decodes plainly, one step runs up to this many decode iterations in one device
            call, streaming each iteration's tokens to the host through a host callback; 1 = one token per step.
        decode_stream_interval: a decode loop hands its tokens to the host through a host callback every this
            many iterations (and after its last): 1 streams every token as it is sampled, larger values spread the
            callbacks' cost over more tokens, 0 makes no callback (the host reads the call's tokens when it is
            done). On XLA:CPU a program with a host callback runs about 10% slower (docs/benchmarks.md).
    """

    _PREFIX: ClassVar[str] = "scheduler"

    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    chunked_prefill: bool = True
    lookahead_tokens: int = 0
    async_scheduling: bool = True
    decode_bucket_interval: int = 8
    draft_bucket_interval: int = 8
    prefill_max_sum_seqlen_k: int | None = None
    prefill_all_vote_interval: int = 70
    prefill_any_vote_interval: int = 100
    yoco_truncation: Literal["off", "mask", "compact"] = "off"
    yoco_keep_tokens: int = 140
    min_bucket_fill: float = 0.5
    num_decode_steps: int = 1
    decode_stream_interval: int = 1

    def _validate(self) -> None:
        check_range("scheduler.max_num_seqs", self.max_num_seqs, ge=1)
        check_range("scheduler.num_decode_steps", self.num_decode_steps, ge=1)
        check_range("scheduler.decode_stream_interval", self.decode_stream_interval, ge=0)
        check_range("scheduler.min_bucket_fill", self.min_bucket_fill, ge=0.0, le=1.0)
        check_range("scheduler.max_num_batched_tokens", self.max_num_batched_tokens, ge=1)
        check_range("scheduler.lookahead_tokens", self.lookahead_tokens, ge=0)
        check_range("scheduler.decode_bucket_interval", self.decode_bucket_interval, ge=1)
        check_range("scheduler.draft_bucket_interval", self.draft_bucket_interval, ge=1)
        check_range("scheduler.prefill_max_sum_seqlen_k", self.prefill_max_sum_seqlen_k, ge=1)
        check_range("scheduler.prefill_all_vote_interval", self.prefill_all_vote_interval, ge=1)
        check_range("scheduler.prefill_any_vote_interval", self.prefill_any_vote_interval, ge=1)
        check_range("scheduler.yoco_keep_tokens", self.yoco_keep_tokens, ge=0)


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig(Checked):
    """Speculative decoding (V4.1 DSpark block drafts, V3/V4 MTP).

    Attributes:
        num_draft_tokens: draft tokens per decode step (``nextn``); 0 disables speculation; ``None`` = the
            model's natural draft length (:attr:`EngineConfig.num_draft_tokens`).
        variable_length: confidence-scheduled variable verification length (spec/engine.md §8.6).
        confidence_temperature: temperature of the confidence head's sigmoid; one value, or one per draft
            position (then exactly ``num_draft_tokens`` values).
        latency_cache_dir / latency_cache_ttl_s: where and for how long the measured decode latency curve
            (used by ``variable_length``) is cached; ``None`` = not cached.
        force_draft_tokens: test hook: a request's ``golden_token_ids`` are its draft tokens (verified as any
            draft) instead of teacher-forced outputs, so tests reach any acceptance pattern with random weights.
    """

    _PREFIX: ClassVar[str] = "speculative"

    num_draft_tokens: int | None = None
    variable_length: bool = False
    confidence_temperature: float | tuple[float, ...] = 1.0
    latency_cache_dir: str | None = None
    latency_cache_ttl_s: int = 3600
    force_draft_tokens: bool = False

    def _validate(self) -> None:
        check_range("speculative.num_draft_tokens", self.num_draft_tokens, ge=0)
        temps = self.confidence_temperature
        for i, t in enumerate(temps if isinstance(temps, tuple) else (temps,)):
            name = (
                f"speculative.confidence_temperature[{i}]"
                if isinstance(temps, tuple)
                else ("speculative.confidence_temperature")
            )
            check_range(name, t, gt=0)
        if isinstance(temps, tuple) and not temps:
            raise ConfigValueError(
                "speculative.confidence_temperature = []: give one value or one per draft token",
                field="speculative.confidence_temperature",
            )
        check_range("speculative.latency_cache_ttl_s", self.latency_cache_ttl_s, ge=0)


@dataclass(frozen=True, kw_only=True)
class SamplingConfig(Checked):
    """Engine-wide sampling settings and the defaults of a ``SamplingParams`` built without arguments.

    Attributes:
        temperature, top_p, top_k, max_tokens: defaults of the per-request parameters (same ranges as
            ``SamplingParams``; ``top_k = -1`` disables top-k).
        force_top_k: > 0 restricts every row to its top-k raw logits before everything else (spec §9.8).
        banned_token_ids: token ids whose logits are always -inf (sorted, unique).
        compute_sum_smaller_probs: also report the emitted token's inclusive CDF (spec §9.6).
        grammar_compile_timeout_s, grammar_cache, grammar_cache_limit_bytes, grammar_threads: structured-output
            grammar compilation (``grammar_cache_limit_bytes <= 0`` = unbounded).
    """

    _PREFIX: ClassVar[str] = "sampling"

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    force_top_k: int = 0
    banned_token_ids: tuple[int, ...] = ()
    compute_sum_smaller_probs: bool = False
    grammar_compile_timeout_s: int = 20
    grammar_cache: bool = True
    grammar_cache_limit_bytes: int = 10 * _GIB
    grammar_threads: int = 4

    def _validate(self) -> None:
        check_range("sampling.temperature", self.temperature, ge=0.0)
        check_range("sampling.top_p", self.top_p, gt=0.0, le=1.0)
        if self.top_k != -1:
            check_range("sampling.top_k", self.top_k, ge=1, le=2**31 - 1)
        check_range("sampling.max_tokens", self.max_tokens, ge=1, le=2**31 - 1)
        check_range("sampling.force_top_k", self.force_top_k, ge=0)
        ids = self.banned_token_ids
        for i, token in enumerate(ids):
            check_range(f"sampling.banned_token_ids[{i}]", token, ge=0)
            if i and token <= ids[i - 1]:
                raise ConfigValueError(
                    f"sampling.banned_token_ids: must be sorted and unique, got {ids[i - 1]} before {token}",
                    field="sampling.banned_token_ids",
                )
        check_range("sampling.grammar_compile_timeout_s", self.grammar_compile_timeout_s, ge=1)
        check_range("sampling.grammar_threads", self.grammar_threads, ge=1)


@dataclass(frozen=True, kw_only=True)
class OpsConfig(Checked):
    """Op implementation selection (ARCHITECTURE §3).

    Attributes:
        backend: ``"auto"`` (best available for the platform, else the reference) or one of
            :data:`OPS_BACKENDS`.
        overrides: per-op backend, ``{op_name: backend}``.
        strict: raise instead of falling back to the reference when a requested backend cannot run.
        interpret: run the ``pallas_gpu`` kernels with the Pallas interpreter on any platform (CPU tests of a
            model with the kernels selected; slow).
        batch_invariant: a request's numerics do not depend on the rest of the batch (fixed reduction orders).
        indexer_workspace_bytes: temporary-memory bound for chunking the sparse indexer's attention.
        compile_cache: keep compiled programs in JAX's persistent compilation cache, so a second start of the
            same model and buckets compiles nothing (``deepinfer_jax/ops/compile_cache.py``).
        kernel_cache_dir: the persistent cache's folder (``DEEPINFER_JIT_CACHE_DIR``); ``None`` = JAX's own
            ``jax_compilation_cache_dir`` when set, else ``$DEEPINFER_JAX_CACHE/jit``.
        scan_layers: scanned layers (``deepinfer_jax/models/common/layer_runs.py``): the engine stacks each run of
            at least this many consecutive decoder layers of one structure and runs it with ``lax.scan``, so the
            run compiles once; ``0`` keeps every layer unrolled; ``None`` = 3 on a CPU, 0 on an accelerator (a
            scanned layer's experts are copied out of the stack every step, docs/engine.md). Families with a
            scan layout only (deepseek_v3), and not with expert-parallel slot layouts
            (``expert_parallel_size > 1``).
    """

    _PREFIX: ClassVar[str] = "ops"

    backend: str = "auto"
    overrides: Mapping[str, str] = field(default_factory=FrozenMapping)
    strict: bool = False
    interpret: bool = False
    batch_invariant: bool = False
    indexer_workspace_bytes: int = 10 * _GIB
    compile_cache: bool = True
    kernel_cache_dir: str | None = None
    scan_layers: int | None = None

    def _validate(self) -> None:
        allowed = ("auto", *OPS_BACKENDS)
        if self.backend not in allowed:
            raise ConfigValueError(
                f"ops.backend = {self.backend!r}: must be one of {', '.join(map(repr, allowed))}",
                field="ops.backend",
            )
        for op, backend in self.overrides.items():
            if backend not in OPS_BACKENDS:
                raise ConfigValueError(
                    f"ops.overrides[{op!r}] = {backend!r}: must be one of {', '.join(map(repr, OPS_BACKENDS))}",
                    field="ops.overrides",
                )
        check_range("ops.indexer_workspace_bytes", self.indexer_workspace_bytes, ge=1)
        check_range("ops.scan_layers", self.scan_layers, ge=0)
        if self.scan_layers == 1:
            raise ConfigValueError(
                "ops.scan_layers = 1: a run of one layer is not stacked; use 0 (no scanned layers) or a run "
                "length >= 2",
                field="ops.scan_layers",
            )


@dataclass(frozen=True, kw_only=True)
class ServerConfig(Checked):
    """The HTTP server of ``deepinfer-jax serve`` (docs/serving.md).

    The API key is not a config field (a config is printed and logged); it comes from ``--api_key`` or the
    ``DEEPINFER_API_KEY`` variable.

    Attributes:
        host: the address the server binds (``127.0.0.1``: reachable from this machine only).
        port: its TCP port (0 = any free port, printed at start-up).
        max_queued_requests: requests accepted and not yet running beyond which a new one is refused with 429
            and a ``Retry-After`` header.
        max_request_body_bytes: a larger request body is refused with 413 before it is parsed.
        drain_timeout_s: on shutdown (Ctrl-C), how long running requests may take to finish before the rest
            are aborted.
        default_thinking: the thinking mode of a request that does not choose one.
    """

    _PREFIX: ClassVar[str] = "server"

    host: str = "127.0.0.1"
    port: int = 8000
    max_queued_requests: int = 256
    max_request_body_bytes: int = 16 << 20
    drain_timeout_s: float = 30.0
    default_thinking: bool = False

    def _validate(self) -> None:
        if not self.host:
            raise ConfigValueError("server.host = '': give an address such as 127.0.0.1", field="server.host")
        check_range("server.port", self.port, ge=0, le=65535)
        check_range("server.max_queued_requests", self.max_queued_requests, ge=0)
        check_range("server.max_request_body_bytes", self.max_request_body_bytes, ge=1)
        check_range("server.drain_timeout_s", self.drain_timeout_s, ge=0.0)


SECTIONS: dict[str, type[Checked]] = {
    "cache": CacheConfig,
    "parallel": ParallelConfig,
    "scheduler": SchedulerConfig,
    "speculative": SpeculativeConfig,
    "sampling": SamplingConfig,
    "ops": OpsConfig,
    "server": ServerConfig,
}
"""The tree's sections other than ``model`` (which is parsed from an HF dict) and the root's own fields."""


@dataclass(frozen=True, kw_only=True)
class EngineConfig(Checked):
    """The root of the config tree.

    Attributes:
        model: the parsed HF model config; ``None`` for an engine-settings-only tree (e.g. ``info`` without a
            model). Checks and derived values that need the model are skipped or use the reference defaults
            then; code that builds a model calls :meth:`require_model`.
        model_path: checkpoint directory (``None`` when only the config is known, e.g. for sizing).
        tokenizer: tokenizer path or name; ``None`` = ``model_path``.
        revision, tokenizer_revision: hub revisions when ``model_path`` / ``tokenizer`` name a hub repository.
        dtype: ``"float32"`` = parity mode (float32 arithmetic, weight-only dequantisation, unquantised caches);
            ``"bfloat16"`` = production mode (the rounding points and FP8/FP4 GEMMs of the model spec);
            ``"auto"`` = the checkpoint's ``torch_dtype`` (``float32`` gives parity mode, anything else and no
            declared dtype give production mode), as vLLM's ``dtype="auto"``.
        kv_cache_dtype: ``"auto"`` (follow ``dtype``) or one of :data:`KV_CACHE_DTYPES`.
        seed: device RNG seed (token sampling is keyed by each request's own seed, not by this).
        max_model_len: maximum prompt + output length of a request.
        load_format: ``"auto"`` (safetensors from ``model_path``) or ``"dummy"`` (synthetic weights).
        served_model_name: the model name the server reports and accepts (``None`` = the ``--model`` value).
        disable_log_stats: no periodic statistics logging.
        stats_log_interval_steps: steps between statistics log lines (<= 0 disables them).
        gc_interval_steps: > 0: automatic garbage collection is off while the engine runs and it collects every
            this many steps; <= 0 leaves it to Python.
        transfer_guard: forbid implicit host<->device transfers inside the step (a debugging aid to switch off).
        profile_dir: where profiler traces are written (``None`` = profiling off).
    """

    model: ModelConfig | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    ops: OpsConfig = field(default_factory=OpsConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    model_path: str | None = None
    tokenizer: str | None = None
    revision: str | None = None
    tokenizer_revision: str | None = None
    dtype: Literal["auto", "float32", "bfloat16"] = "bfloat16"
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "quantized"] = "auto"
    seed: int = 0
    max_model_len: int = 4096
    load_format: Literal["auto", "dummy"] = "auto"
    served_model_name: str | None = None
    disable_log_stats: bool = False
    stats_log_interval_steps: int = 100
    gc_interval_steps: int = 0
    transfer_guard: bool = True
    profile_dir: str | None = None

    ROOT_FIELDS: ClassVar[tuple[str, ...]]
    """Names of the root's own fields (everything but ``model`` and the sections); set below the class."""

    # ------------------------------------------------------------------------------------- validation

    def _validate(self) -> None:
        check_range("seed", self.seed, ge=0, lt=2**64)
        check_range("max_model_len", self.max_model_len, ge=1, le=_MAX_MODEL_LEN_LIMIT)
        model = self.model
        nextn = self.num_draft_tokens
        spec = self.speculative
        if spec.num_draft_tokens and model is not None and not model.num_nextn_predict_layers:
            raise ConfigValueError(
                f"speculative.num_draft_tokens = {spec.num_draft_tokens}: the model has no draft layers "
                "(num_nextn_predict_layers = 0); use 0",
                field="speculative.num_draft_tokens",
            )
        temps = spec.confidence_temperature
        if isinstance(temps, tuple) and len(temps) > 1 and len(temps) != nextn:
            raise ConfigValueError(
                f"speculative.confidence_temperature has {len(temps)} values but num_draft_tokens = {nextn}",
                field="speculative.confidence_temperature",
            )
        if self.prefill_max_sum_seqlen_k < self.prompt_limit:
            raise ConfigValueError(
                f"scheduler.prefill_max_sum_seqlen_k = {self.prefill_max_sum_seqlen_k}: must be >= the prompt "
                f"limit {self.prompt_limit}",
                field="scheduler.prefill_max_sum_seqlen_k",
            )
        if model is not None:
            for i, token in enumerate(self.sampling.banned_token_ids):
                check_range(f"sampling.banned_token_ids[{i}]", token, lt=model.vocab_size)
        self._validate_yoco()

    def _validate_yoco(self) -> None:
        sched = self.scheduler
        model = self.model
        if sched.yoco_truncation == "off" or model is None:
            return
        if model.family != "deepseek_v41":
            raise ConfigValueError(
                f"scheduler.yoco_truncation = {sched.yoco_truncation!r}: YOCO exists only in deepseek_v41 models, "
                f"not {model.family}",
                field="scheduler.yoco_truncation",
            )
        window = model.sliding_window  # type: ignore[attr-defined]
        # B, the rings' rollback margin: the DSpark block when the engine drafts, else the backtracking tokens.
        block = getattr(model, "dspark_block_size", None)
        if self.num_draft_tokens and block:
            margin, what = int(block), "dspark_block_size"
        else:
            margin, what = self.backtracking_tokens, "backtracking tokens"
        needed = window + margin
        if sched.yoco_keep_tokens < needed:
            raise ConfigValueError(
                f"scheduler.yoco_keep_tokens = {sched.yoco_keep_tokens}: with yoco_truncation = "
                f"{sched.yoco_truncation!r} it must be >= sliding_window + {what} = {window} + "
                f"{margin} = {needed} (140 is the reference's recommendation for V4.1-Flash)",
                field="scheduler.yoco_keep_tokens",
            )
        if sched.yoco_truncation == "compact":
            targets = model.dspark_target_layer_ids or ()  # type: ignore[attr-defined]
            npl = model.n_prefill_layer  # type: ignore[attr-defined]
            if targets and len({t < npl for t in targets}) > 1:
                raise ConfigValueError(
                    f"scheduler.yoco_truncation = 'compact': the draft target layers {list(targets)} must all lie on "
                    f"one side of n_prefill_layer = {npl}",
                    field="scheduler.yoco_truncation",
                )

    # ------------------------------------------------------------------------ derived (engine.md §2.3)

    @property
    def num_draft_tokens(self) -> int:
        """Effective draft length ``nextn``.

        ``speculative.num_draft_tokens`` when set; otherwise the model's natural length: 0 without draft
        layers; for V4.1 ``dspark_block_size`` (falling back to 5, the reference runtime's default, when the
        config does not know it); for V3/V4 one token per MTP layer. Without a model: 5.
        """
        if self.speculative.num_draft_tokens is not None:
            return self.speculative.num_draft_tokens
        model = self.model
        if model is None:
            return _REFERENCE_NEXTN
        if not model.num_nextn_predict_layers:
            return 0
        if model.family == "deepseek_v41":
            block = model.dspark_block_size  # type: ignore[attr-defined]
            return _REFERENCE_NEXTN if block is None else block
        return model.num_nextn_predict_layers

    @property
    def runtime_max_model_len(self) -> int:
        """Exclusive bound of any position the runtime touches; position-indexed buffers have this many rows.

        ``max_model_len + nextn`` (scheduler slack) ``+ (nextn + 1 if async scheduling)`` (in-flight
        optimistic tokens) ``+ nextn`` (the draft block).
        """
        nextn = self.num_draft_tokens
        in_flight = nextn + 1 if self.scheduler.async_scheduling else 0
        return self.max_model_len + nextn + in_flight + nextn

    @property
    def max_num_decoding_tokens(self) -> int:
        """Tokens of a full decode step, ``max_num_seqs * (1 + nextn)``."""
        return self.scheduler.max_num_seqs * (1 + self.num_draft_tokens)

    @property
    def max_num_batched_tokens(self) -> int:
        """Per-step token budget: the configured value, else ``max(max_model_len, 4096, max_num_decoding_tokens)``."""
        if self.scheduler.max_num_batched_tokens is not None:
            return self.scheduler.max_num_batched_tokens
        return max(self.max_model_len, 4096, self.max_num_decoding_tokens)

    @property
    def max_num_prefilling_tokens(self) -> int:
        """Prefill tokens per context-parallel rank, ``max_num_batched_tokens // cp``."""
        return self.max_num_batched_tokens // self.parallel.context_parallel_size

    @property
    def prompt_limit(self) -> int:
        """Longest accepted prompt: ``max_model_len`` with chunked prefill, else also bounded by the step budget."""
        if self.scheduler.chunked_prefill:
            return self.max_model_len
        return min(self.max_model_len, self.max_num_batched_tokens)

    @property
    def prefill_max_sum_seqlen_k(self) -> int:
        value = self.scheduler.prefill_max_sum_seqlen_k
        return _DEFAULT_PREFILL_MAX_SUM_SEQLEN_K if value is None else value

    @property
    def backtracking_tokens(self) -> int:
        """Rollback margin of the window/compression rings, ``max(cache.max_backtracking_tokens, nextn + 1)``."""
        return max(self.cache.max_backtracking_tokens, self.num_draft_tokens + 1)

    @property
    def max_blocks_per_seq(self) -> int:
        """Block-table width: ``ceil(runtime_max_model_len / block_size)`` rounded up to a multiple of 64."""
        blocks = math.ceil(self.runtime_max_model_len / self.cache.block_size)
        return -(-blocks // 64) * 64

    @property
    def num_state_slots(self) -> int:
        """State slots, ``int(max_num_seqs * cache.state_slots_ratio) + 1`` (slot 0 reserved); an unset ratio is
        :data:`SNAPSHOT_SLOTS_RATIO` where the engine keeps window-state snapshots (prefix caching of a V4 / V4.1 model), else 1.0."""
        ratio = self.cache.state_slots_ratio
        if ratio is None:
            family = (
                None if self.model is None else str(getattr(self.model.family, "value", self.model.family))
            )
            ratio = (
                SNAPSHOT_SLOTS_RATIO
                if self.cache.enable_prefix_caching and family not in (None, "deepseek_v3")
                else 1.0
            )
        return int(self.scheduler.max_num_seqs * ratio) + 1

    @property
    def resolved_tokenizer(self) -> str | None:
        return self.tokenizer if self.tokenizer is not None else self.model_path

    @property
    def resolved_kv_cache_dtype(self) -> str:
        """The cache format in effect: ``kv_cache_dtype``, or for ``"auto"`` the precision mode's default.

        Parity mode stores float32; production mode stores the quantised formats for V4/V4.1 and bf16 for V3
        (still ``"auto"`` without a model, since the format depends on the family).
        """
        if self.kv_cache_dtype != "auto":
            return self.kv_cache_dtype
        declared = None if self.model is None else self.model.checkpoint_dtype
        if self.dtype == "float32" or (self.dtype == "auto" and declared == "float32"):
            return "float32"
        if self.model is None:
            return "auto"
        return "bfloat16" if self.model.family == "deepseek_v3" else "quantized"

    def require_model(self, purpose: str) -> ModelConfig:
        """The model config, or a ``ValueError`` saying that ``purpose`` needs one."""
        if self.model is None:
            raise ConfigValueError(
                f"model: {purpose} needs a model config; load one with load_config(model=...) or a yaml 'model:' "
                "section",
                field="model",
            )
        return self.model

    def derived(self) -> dict[str, Any]:
        """All derived quantities, by name."""
        return {
            name: getattr(self, name)
            for name in (
                "num_draft_tokens",
                "runtime_max_model_len",
                "max_num_batched_tokens",
                "max_num_decoding_tokens",
                "max_num_prefilling_tokens",
                "prompt_limit",
                "prefill_max_sum_seqlen_k",
                "backtracking_tokens",
                "max_blocks_per_seq",
                "num_state_slots",
                "resolved_tokenizer",
                "resolved_kv_cache_dtype",
            )
        }


EngineConfig.ROOT_FIELDS = tuple(
    f.name for f in dataclasses.fields(EngineConfig) if f.name != "model" and f.name not in SECTIONS
)


def _section_dict(section: Any) -> dict[str, Any]:
    return {f.name: thaw(getattr(section, f.name)) for f in dataclasses.fields(section)}


def config_to_dict(cfg: EngineConfig) -> dict[str, Any]:
    """A plain, JSON-able dict of the whole tree: root fields, every section, the model and derived values.

    The model entry holds its parsed fields, family, derived values and missing keys, and (under ``"hf"``) the
    original ``config.json`` dict.
    """
    out: dict[str, Any] = {name: getattr(cfg, name) for name in EngineConfig.ROOT_FIELDS}
    if cfg.model is None:
        out["model"] = None
    else:
        model = cfg.model.to_dict()
        model["hf"] = cfg.model.to_hf_dict()
        out["model"] = model
    for name in SECTIONS:
        out[name] = _section_dict(getattr(cfg, name))
    out["derived"] = cfg.derived()
    return out
