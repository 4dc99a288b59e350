"""What the engine does with every setting: each config field and each ``DEEPINFER_*`` variable, honoured or not.

Every field of the config tree has one entry in :data:`FIELDS`:

* ``honoured``: the engine reads it and it changes what the engine does (the ``note`` says how; a test shows the
  change through ``LLM``). Some honoured fields have conditions under which a non-default value has no effect;
  those warn (``warn_if``).
* ``warns``: the engine does not use it; setting it to a value other than its default warns once, naming the
  field, the source of the value and why it has no effect here (``not built yet`` for features that later work
  adds, or the reason it has no counterpart in this engine).
* ``refused``: some or all non-default values are an error naming the field, the value, its source and why.

Each ``DEEPINFER_*`` variable of :data:`~deepinfer_jax.config.env.ENV_VARS` either sets a field (and then has
that field's status) or warns, with its reason, when it is set. :func:`check_settings` applies the entries to a
loaded config (``LLM`` calls it before reading any weight); :func:`env_report` is what ``LLM`` logs about each
variable it read; :func:`settings_table` renders the table of docs/config.md, which a test keeps equal to it.

Run ``python -m deepinfer_jax.config.status --write docs/config.md`` after changing an entry.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from deepinfer_jax.config import env as env_module
from deepinfer_jax.config.errors import ConfigValueError, ConfigWarning
from deepinfer_jax.config.tree import SECTIONS, EngineConfig

__all__ = [
    "FIELDS",
    "Setting",
    "check_settings",
    "env_report",
    "field_default",
    "field_value",
    "settings_table",
]

Status = Literal["honoured", "warns", "refused"]

NOT_BUILT = "not built yet"


@dataclass(frozen=True)
class Setting:
    """What the engine does with one config field (module docstring).

    Attributes:
      status: ``"honoured"``, ``"warns"`` or ``"refused"``.
      note: what it does (honoured) or why it has no effect / is refused.
      when: for a refused or warning field, which values are refused or warned about (default: any value
        other than the default).
      warn_if: for an honoured field, a function of the config giving the reason a value has no effect there
        (``None`` when it has one).
    """

    status: Status
    note: str
    when: Callable[[Any], bool] | None = None
    warn_if: Callable[[EngineConfig], str | None] | None = None


def _honoured(note: str, warn_if: Callable[[EngineConfig], str | None] | None = None) -> Setting:
    return Setting("honoured", note, warn_if=warn_if)


def _not_built(feature: str) -> Setting:
    return Setting("warns", f"{NOT_BUILT}: {feature}")


def _no_effect(reason: str) -> Setting:
    return Setting("warns", reason)


def _without_expert_parallelism(cfg: EngineConfig) -> str | None:
    if cfg.parallel.expert_parallel_size > 1:
        return None
    return (
        "EPLB and the MoE load statistics need an expert-parallel group (parallel.expert_parallel_size > 1)"
    )


def _extra_slots_unused(cfg: EngineConfig) -> str | None:
    ratio = cfg.cache.state_slots_ratio
    if ratio is None or ratio <= 1.0:
        return None
    if not cfg.cache.enable_prefix_caching:
        return "extra state slots hold prefix-cache snapshots, and cache.enable_prefix_caching is off"
    model = cfg.model
    if model is not None and str(getattr(model.family, "value", model.family)) == "deepseek_v3":
        return "deepseek_v3 keeps no per-sequence state, so prefix caching needs no snapshot slots"
    return None


_SPEC = "speculative decoding in the engine (DSpark / MTP drafts and their verification)"
_RINGS = (
    "no effect: prefix caching's window-state snapshots are written by the step that passes each block boundary "
    "(docs/prefix_cache.md), so the rings need no extra positions"
)
_BUCKETS = "the step buckets are fixed: 16 / 64 / 256 / the budget tokens against 8 / 32 / 128 / the budget sequences"

FIELDS: dict[str, Setting] = {
    # ------------------------------------------------------------------------------------------ cache
    "cache.block_size": _honoured("tokens per cache block"),
    "cache.memory_utilization": _honoured(
        "on an accelerator, the default kv_cache_memory is this fraction of the device's memory minus the weights",
        warn_if=lambda cfg: (
            "on the CPU the default cache is sized from the model instead" if _platform() == "cpu" else None
        ),
    ),
    "cache.num_blocks": _honoured("cache blocks per device, instead of sizing them from kv_cache_memory"),
    "cache.state_slots_ratio": _honoured(
        "the slots beyond max_num_seqs hold prefix caching's window-state snapshots (None: 3.0 when snapshots "
        "are kept, else 1.0)",
        warn_if=lambda cfg: _extra_slots_unused(cfg),
    ),
    "cache.enable_prefix_caching": _honoured(
        "reuse cached prefix blocks of earlier requests (LLM(enable_prefix_caching=))"
    ),
    "cache.host_memory": _honoured(
        "host-memory tier of blocks and snapshots evicted from the device (bytes for the whole engine)",
        warn_if=lambda cfg: (
            "it holds prefix-cache entries, and cache.enable_prefix_caching is off"
            if cfg.cache.host_memory and not cfg.cache.enable_prefix_caching
            else None
        ),
    ),
    "cache.host_ttl_s": _honoured("lifetime of a host-tier entry after it was stored or last used"),
    "cache.max_backtracking_tokens": _no_effect(
        "no effect: the engine gives every V4.1 per-slot ring the DSpark block size B as its rollback margin "
        "(the most a speculative step can reject, docs/speculative.md); a larger margin has no use yet"
    ),
    "cache.store_extra_window_state": _no_effect(_RINGS),
    "cache.extra_window_tokens": _no_effect(_RINGS),
    # ------------------------------------------------------------------------------------------ parallel
    "parallel.data_parallel_size": _honoured("the mesh's dp axis (LLM(data_parallel_size=))"),
    "parallel.expert_parallel_size": _honoured("the mesh's ep axis: routed experts sharded over it"),
    "parallel.context_parallel_size": Setting(
        "refused", "context-parallel prefill is not implemented; only 1 is supported"
    ),
    "parallel.coordinator_address": _honoured("jax.distributed.initialize of a multi-process run"),
    "parallel.num_processes": _honoured("jax.distributed.initialize of a multi-process run"),
    "parallel.process_id": _honoured("jax.distributed.initialize of a multi-process run"),
    "parallel.initialization_timeout_s": _honoured("jax.distributed.initialize's timeout"),
    "parallel.eplb_interval_steps": _honoured(
        "EPLB re-places experts every this many steps (0 = off)", warn_if=_without_expert_parallelism
    ),
    "parallel.eplb_window_steps": _honoured("EPLB's load window", warn_if=_without_expert_parallelism),
    "parallel.eplb_num_redundant_experts": _honoured(
        "redundant expert slots per MoE layer", warn_if=_without_expert_parallelism
    ),
    "parallel.eplb_after_prefill": _honoured(
        "prefill steps count towards EPLB's window", warn_if=_without_expert_parallelism
    ),
    "parallel.eplb_log_detail": _honoured(
        "log every layer's new placement", warn_if=_without_expert_parallelism
    ),
    "parallel.moe_load_stats_interval_steps": _honoured(
        "steps between moe_lb log lines", warn_if=_without_expert_parallelism
    ),
    "parallel.moe_force_imbalance_ratio": Setting(
        "refused", "synthetic MoE routing is not implemented; only 0 (the model's own routing) is supported"
    ),
    "parallel.moe_force_uniform_routing": Setting(
        "refused", "synthetic MoE routing is not implemented; only False is supported"
    ),
    "parallel.engram_on_device": Setting(
        "refused",
        "Engram tables in host memory are not implemented; they live in device memory (None or True)",
        when=lambda value: value is False,
    ),
    # ------------------------------------------------------------------------------------------ scheduler
    "scheduler.max_num_seqs": _honoured(
        "most sequences per step and holding cache at once (LLM(max_num_seqs=))"
    ),
    "scheduler.max_num_batched_tokens": _honoured("most tokens per step (LLM(max_num_batched_tokens=))"),
    "scheduler.chunked_prefill": Setting(
        "refused",
        "chunked prefill is always on: a prompt longer than the step budget is prefilled over several steps",
        when=lambda value: value is False,
    ),
    "scheduler.lookahead_tokens": _no_effect(
        "no minimum prefill chunk: a chunk takes whatever the step's token budget leaves"
    ),
    "scheduler.async_scheduling": _honoured(
        "True: step N+1 is dispatched before step N's tokens reach the host; False: every step is processed "
        "before the next is scheduled"
    ),
    "scheduler.decode_bucket_interval": _no_effect(_BUCKETS),
    "scheduler.draft_bucket_interval": _not_built(_SPEC),
    "scheduler.prefill_max_sum_seqlen_k": _no_effect(
        "prefill steps are bounded by the token budget alone (each prompt's chunk, not its full length)"
    ),
    "scheduler.prefill_all_vote_interval": _no_effect(
        "there is no step-type vote: every step mixes prefill chunks and decode tokens"
    ),
    "scheduler.prefill_any_vote_interval": _no_effect(
        "there is no step-type vote: every step mixes prefill chunks and decode tokens"
    ),
    "scheduler.yoco_truncation": _honoured(
        "SWA bounded replay of deepseek_v41 (docs/models_v41.md): 'mask' narrows the YOCO consumer layers' windows "
        "to the last yoco_keep_tokens positions of each prompt, 'compact' also runs those layers on the kept rows "
        "only; prompt logprobs are refused; prefix-cache hits restore a snapshot only where its bound allows "
        "(docs/prefix_cache.md)"
    ),
    "scheduler.yoco_keep_tokens": _honoured(
        "K of SWA bounded replay: consumer layers see positions >= L - K of a prompt of L tokens (K >= "
        "sliding_window + ring margin)",
        warn_if=lambda cfg: (
            "scheduler.yoco_truncation is off" if cfg.scheduler.yoco_truncation == "off" else None
        ),
    ),
    "scheduler.min_bucket_fill": _honoured("cut prefill chunks to fill a smaller bucket below this fill"),
    "scheduler.num_decode_steps": _honoured(
        "up to this many decode iterations per device call while nothing waits and every running request decodes "
        "plainly (no grammar, multi-token bad word or golden tokens); with drafts one iteration is one "
        "speculative step; tokens stream to the host through an io_callback; a multi-process engine warns and "
        "runs one token per step"
    ),
    "scheduler.decode_stream_interval": _honoured(
        "a decode loop hands its tokens to the host through a host callback every this many iterations (and after "
        "its last; values above num_decode_steps act as num_decode_steps); 0: no callback, the host reads the "
        "call's tokens when it is done",
        warn_if=lambda cfg: (
            "scheduler.num_decode_steps is 1 (no decode loop)"
            if cfg.scheduler.num_decode_steps <= 1
            else None
        ),
    ),
    # ------------------------------------------------------------------------------------------ speculative
    "speculative.num_draft_tokens": _honoured(
        "drafts per decode row (deepseek_v3: its MTP layer, run k times for k > 1; deepseek_v41: the first k of "
        "the DSpark block, k <= dspark_block_size); None = the model's natural length; deepseek_v4 refuses k > 0 "
        "(its MTP drafter in the step is not built yet) and runs without"
    ),
    "speculative.force_draft_tokens": _honoured(
        "test hook: golden_token_ids become the requests' draft tokens instead of forced outputs"
    ),
    "speculative.variable_length": _honoured(
        "confidence-scheduled verify lengths over the decode latency curve measured at start-up (with drafts)",
        warn_if=lambda cfg: (
            None if cfg.num_draft_tokens else "there are no drafts to verify (num_draft_tokens = 0)"
        ),
    ),
    "speculative.confidence_temperature": _honoured(
        "temperature of the draft confidences (V4.1: the DSpark confidence head's logit; V3 MTP: the draft "
        "probability's log-odds; through a sigmoid)"
    ),
    "speculative.latency_cache_dir": _honoured("where the measured decode latency curve is cached"),
    "speculative.latency_cache_ttl_s": _honoured("how long a cached decode latency curve is read"),
    # ------------------------------------------------------------------------------------------ sampling
    "sampling.temperature": _honoured("default of requests given no SamplingParams"),
    "sampling.top_p": _honoured("default of requests given no SamplingParams"),
    "sampling.top_k": _honoured("default of requests given no SamplingParams"),
    "sampling.max_tokens": _honoured("default of requests given no SamplingParams"),
    "sampling.force_top_k": _honoured(
        "every row samples among its top-k raw logits (the ids outside are -inf)"
    ),
    "sampling.banned_token_ids": _honoured("ids never sampled, also under greedy decoding"),
    "sampling.compute_sum_smaller_probs": _honoured(
        "each reported Logprob carries sum_smaller_probs, the probability mass of the tokens ranked below it"
    ),
    "sampling.grammar_compile_timeout_s": _honoured(
        "a structured-output request whose grammar is not compiled this many seconds after it was queued ends "
        "alone with finish_reason='error'"
    ),
    "sampling.grammar_cache": _honoured("compiled grammars are kept, keyed by the grammar text"),
    "sampling.grammar_cache_limit_bytes": _honoured(
        "the grammar cache holds grammars whose texts total at most this many bytes, least recently used out "
        "(<= 0: unbounded; llguidance does not report a compiled grammar's size)"
    ),
    "sampling.grammar_threads": _honoured("threads of the grammar compile pool"),
    # ------------------------------------------------------------------------------------------ ops
    "ops.backend": _honoured("the op backend of the step (docs/ops.md)"),
    "ops.overrides": _honoured("per-op backends"),
    "ops.strict": _honoured("a requested backend that cannot run is an error, not a fallback"),
    "ops.interpret": _honoured("Pallas kernels run in interpret mode"),
    "ops.batch_invariant": _honoured(
        "a request's results do not depend on its batch (LLM(batch_invariant=))"
    ),
    "ops.indexer_workspace_bytes": _no_effect(
        "the indexer scores one page at a time and keeps a streaming top-k, so its workspace is bounded by the "
        "step's shape, not by a setting"
    ),
    "ops.compile_cache": _honoured(
        "compiled programs are kept in JAX's persistent compilation cache (off: the engine configures none)"
    ),
    "ops.kernel_cache_dir": _honoured(
        "the persistent compilation cache's folder (default: JAX's own setting, else $DEEPINFER_JAX_CACHE/jit)"
    ),
    "ops.scan_layers": _honoured(
        "runs of at least this many same-structure decoder layers are stacked and run with lax.scan (one "
        "compilation per run); 0: every layer unrolled; None: 3 on a CPU, 0 on an accelerator; deepseek_v3 "
        "only (V4 / V4.1 layers stay unrolled: no scan layout yet), and not with expert-parallel slot layouts "
        "(expert_parallel_size > 1)",
        warn_if=lambda cfg: (
            "parallel.expert_parallel_size > 1 keeps per-layer expert slots"
            if cfg.ops.scan_layers and cfg.parallel.expert_parallel_size > 1
            else None
        ),
    ),
    # ------------------------------------------------------------------------------------------ server
    "server.host": _honoured("the address deepinfer-jax serve binds"),
    "server.port": _honoured("the port deepinfer-jax serve binds (0: any free port)"),
    "server.max_queued_requests": _honoured(
        "accepted requests not yet running beyond which the server answers 429 with Retry-After"
    ),
    "server.max_request_body_bytes": _honoured("larger request bodies get 413"),
    "server.drain_timeout_s": _honoured(
        "how long a shutdown waits for running requests before aborting them"
    ),
    "server.default_thinking": _honoured("the thinking mode of a request that does not choose one"),
    # ------------------------------------------------------------------------------------------ root
    "model_path": _honoured("the model folder (LLM's model argument)"),
    "tokenizer": _honoured("the tokenizer when LLM(tokenizer=) is not given"),
    "revision": Setting("refused", "models are read from local folders only; there are no hub downloads"),
    "tokenizer_revision": Setting(
        "refused", "tokenizers are read from local folders only; there are no hub downloads"
    ),
    "dtype": _honoured("the precision mode (LLM(dtype=))"),
    "kv_cache_dtype": _honoured("the cache format (LLM(kv_cache_dtype=))"),
    "seed": _honoured("derives the seed of every request without seq_seed (LLM(seed=))"),
    "max_model_len": _honoured("most tokens per request (LLM(max_model_len=))"),
    "load_format": _honoured("'dummy': random weights at the config's shapes, no checkpoint read"),
    "served_model_name": _honoured(
        "the model name deepinfer-jax serve reports and accepts (None: the --model value)"
    ),
    "disable_log_stats": _honoured("no periodic statistics log lines"),
    "stats_log_interval_steps": _honoured("steps between statistics log lines (<= 0: none)"),
    "gc_interval_steps": _honoured(
        "> 0: Python's automatic garbage collection is off while the engine runs, and it collects every this "
        "many steps"
    ),
    "transfer_guard": _honoured("implicit host<->device transfers in the engine loop are errors"),
    "profile_dir": _honoured("a jax.profiler trace of every generate call is written there"),
}
"""Every config field (dotted; root fields bare) and what the engine does with it."""


def _platform() -> str:
    import jax

    return jax.default_backend()


def _all_fields() -> list[str]:
    names = [f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    return names + list(EngineConfig.ROOT_FIELDS)


def field_value(cfg: EngineConfig, name: str) -> Any:
    """The value of a dotted field of ``cfg``."""
    node: Any = cfg
    for part in name.split("."):
        node = getattr(node, part)
    return node


def field_default(name: str) -> Any:
    """The dataclass default of a dotted field."""
    if "." in name:
        section, field = name.split(".")
        cls: Any = SECTIONS[section]
    else:
        cls, field = EngineConfig, name
    f = next(f for f in dataclasses.fields(cls) if f.name == field)
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return dict(a) == dict(b)
    return bool(a == b)


def check_settings(cfg: EngineConfig, sources: Mapping[str, str] | None = None) -> list[str]:
    """Apply :data:`FIELDS` to ``cfg``: raise for a refused value, warn once for a value without effect.

    ``sources`` maps dotted fields to where their values came from (``"environment variable DEEPINFER_X"``,
    ``"yaml file f.yaml"``, ...; :func:`~deepinfer_jax.config.load_config_with_sources`), so each message
    names it. Returns the warnings given.

    Raises:
      ConfigValueError: every refused value at once, each naming its field, value, source and reason.
    """
    sources = sources or {}
    refused: list[str] = []
    warned: list[str] = []
    for name, setting in FIELDS.items():
        value = field_value(cfg, name)
        default = field_default(name)
        if _same(value, default) and setting.warn_if is None:
            continue
        where = f" (set by {sources[name]})" if name in sources else ""
        hit = setting.when(value) if setting.when is not None else not _same(value, default)
        if setting.status == "refused" and hit:
            refused.append(f"{name} = {value!r}{where}: {setting.note}")
        elif setting.status == "warns" and hit:
            warned.append(f"{name} = {value!r}{where} has no effect in deepinfer_jax: {setting.note}")
        elif setting.warn_if is not None and not _same(value, default):
            reason = setting.warn_if(cfg)
            if reason is not None:
                warned.append(f"{name} = {value!r}{where} has no effect here: {reason}")
    if refused:
        raise ConfigValueError("; ".join(refused), field=refused[0].split(" ", 1)[0])
    for message in warned:
        warnings.warn(message, ConfigWarning, stacklevel=3)
    return warned


def env_report(environ: Mapping[str, str] | None = None) -> list[str]:
    """One line per ``DEEPINFER_*`` variable of ``environ`` (default ``os.environ``): what the engine does with
    it (the field it sets and that field's status, or why it has no effect)."""
    import os

    env = os.environ if environ is None else environ
    lines = []
    for name in sorted(env):
        if not name.startswith(env_module.PREFIX):
            continue
        if name in env_module.PROJECT_ENV_VARS:
            lines.append(f"{name} = {env[name]!r}: {env_module.PROJECT_ENV_VARS[name]}")
            continue
        var = env_module.ENV_VARS.get(name)
        if var is None:
            lines.append(f"{name} = {env[name]!r}: not a deepinfer_jax setting; ignored")
        elif var.target is None:
            lines.append(f"{name} = {env[name]!r}: no effect ({var.reason})")
        else:
            setting = FIELDS[var.target]
            what = "honoured" if setting.status == "honoured" else f"{setting.status}: {setting.note}"
            lines.append(f"{name} = {env[name]!r}: sets {var.target} ({what})")
    return lines


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def settings_table() -> str:
    """The markdown table of docs/config.md: every field and variable with its status."""
    by_field: dict[str, list[str]] = {}
    for var in env_module.ENV_VARS.values():
        if var.target is not None:
            by_field.setdefault(var.target, []).append(var.name)
    lines = ["| setting | `DEEPINFER_*` variable | status | what the engine does |", "|---|---|---|---|"]
    for name, setting in FIELDS.items():
        variables = ", ".join(f"`{v}`" for v in sorted(by_field.get(name, ())))
        status = setting.status
        if setting.warn_if is not None:
            status = "honoured (warns where it has no effect)"
        note = setting.note
        if setting.status == "warns" and note.startswith(NOT_BUILT):
            status, note = "warns: not built yet", note[len(NOT_BUILT) + 2 :]
        elif setting.status == "warns":
            status = "warns: no effect"
        lines.append(f"| `{name}` | {variables} | {status} | {_cell(note)} |")
    for var in sorted(env_module.ENV_VARS.values(), key=lambda v: v.name):
        if var.target is None:
            lines.append(
                f"| — | `{var.name}` | warns: no effect | {_cell(var.meaning)}: {_cell(var.reason)} |"
            )
    return "\n".join(lines)


_START = (
    "<!-- settings table: generated by `python -m deepinfer_jax.config.status --write docs/config.md` -->"
)
_END = "<!-- end of settings table -->"


def write_table(path: str | Path) -> None:
    """Replace the generated table between its markers in ``path`` (docs/config.md)."""
    p = Path(path)
    text = p.read_text()
    pattern = re.compile(re.escape(_START) + r".*?" + re.escape(_END), re.S)
    if not pattern.search(text):
        raise ValueError(f"{path}: no settings table markers ({_START!r} ... {_END!r})")
    p.write_text(pattern.sub(lambda _: f"{_START}\n\n{settings_table()}\n\n{_END}", text))


def table_in(path: str | Path) -> str | None:
    """The generated table currently in ``path`` (between the markers), or ``None``."""
    text = Path(path).read_text()
    m = re.search(re.escape(_START) + r"\n\n(.*?)\n\n" + re.escape(_END), text, re.S)
    return None if m is None else m.group(1)


def _unclassified() -> list[str]:
    return sorted(set(_all_fields()) ^ set(FIELDS))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--write":
        write_table(sys.argv[2])
    else:
        print(settings_table())
