"""Flags shared by the subcommands that build an engine config (`--model`, `--config`, gin, overrides).

Flag values are the highest-priority config source (ARCHITECTURE.md §6); a flag left unset is `None` and lets a
lower source (yaml, gin, `DEEPINFER_*` environment, HF config, defaults) apply.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from absl import flags

from deepinfer_jax import config as config_lib


def define_config_flags(fv: flags.FlagValues, *, model_required: bool = False) -> None:
    flags.DEFINE_string(
        "model",
        None,
        "a built-in model name (tiny-v3, tiny-v4, tiny-v41, shakespeare-v41, shakespeare-v3), a model folder "
        "with config.json, a config.json, or a yaml config file",
        flag_values=fv,
        required=model_required,
    )
    flags.DEFINE_string("config", None, "a yaml config file (model: and engine sections)", flag_values=fv)
    flags.DEFINE_multi_string("gin_file", [], "gin files binding config fields (repeatable)", flag_values=fv)
    flags.DEFINE_multi_string(
        "gin_binding", [], "a gin binding, e.g. 'cache.block_size = 64' (repeatable)", flag_values=fv
    )
    flags.DEFINE_multi_string(
        "set",
        [],
        "override one config field: --set scheduler.max_num_seqs=8 (value parsed as yaml; repeatable)",
        flag_values=fv,
    )


def resolve_model(name_or_path: str | None) -> tuple[str | None, str | None]:
    """Map a built-in model name to its yaml config; returns (path, builtin name or None)."""
    if name_or_path is None:
        return None, None
    from deepinfer_jax.models import builtin

    if builtin.is_builtin(name_or_path):
        return str(builtin.get_builtin(name_or_path).yaml_path), name_or_path
    if not Path(name_or_path).exists():
        known = ", ".join(builtin.list_builtin())
        raise ValueError(
            f"--model: {name_or_path!r} is neither a built-in model ({known}) nor an existing path"
        )
    return name_or_path, None


def config_from_flags(fv: flags.FlagValues, **extra_overrides: Any) -> config_lib.EngineConfig:
    model_path, _ = resolve_model(fv.model)
    overrides = config_lib.parse_overrides(fv.set)
    overrides.update({k: v for k, v in extra_overrides.items() if v is not None})
    return config_lib.load_config(
        model_path,
        yaml_path=fv.config,
        gin_files=tuple(fv.gin_file),
        gin_bindings=tuple(fv.gin_binding),
        overrides=overrides,
    )


def define_engine_flags(fv: flags.FlagValues, *, max_tokens: int, max_tokens_help: str) -> None:
    """The engine and sampling flags shared by the subcommands that run `LLM` (`generate`, `chat`)."""
    flags.DEFINE_enum(
        "dtype",
        "bfloat16",
        ["float32", "bfloat16"],
        "precision mode: float32 (parity) or bfloat16 (production)",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "kv_cache_dtype", "auto", "cache storage: auto, float32, bfloat16 or quantized", flag_values=fv
    )
    flags.DEFINE_string(
        "kv_cache_memory", None, "cache budget, e.g. 512MiB (default: 2GiB on CPU)", flag_values=fv
    )
    flags.DEFINE_integer(
        "max_model_len", None, "most tokens per request (default: the model's)", flag_values=fv
    )
    flags.DEFINE_integer("max_num_seqs", 256, "most sequences per step", flag_values=fv)
    flags.DEFINE_integer("max_num_batched_tokens", 2048, "most tokens per step", flag_values=fv)
    flags.DEFINE_integer("max_tokens", max_tokens, max_tokens_help, flag_values=fv)
    flags.DEFINE_float("temperature", 1.0, "sampling temperature; 0 = greedy", flag_values=fv)
    flags.DEFINE_float("top_p", 1.0, "nucleus sampling threshold", flag_values=fv)
    flags.DEFINE_integer("top_k", -1, "top-k sampling (-1 = off)", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "engine seed (derives each request's sampling seed)", flag_values=fv)
    flags.DEFINE_integer(
        "data_parallel_size",
        1,
        "engine mesh: replicas of the expert-parallel group (the mesh has dp * ep devices, each an attention rank)",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "expert_parallel_size", 1, "engine mesh: devices the routed experts are sharded over", flag_values=fv
    )
    flags.DEFINE_multi_string(
        "set",
        [],
        "an engine config override, e.g. --set cache.block_size=16 or --set parallel.eplb_interval_steps=64 "
        "(repeatable)",
        flag_values=fv,
    )
    flags.DEFINE_boolean("progress", True, "show a progress bar", flag_values=fv)


def llm_from_flags(fv: flags.FlagValues) -> Any:
    """`LLM(...)` from the flags of :func:`define_engine_flags` (and `--model`)."""
    from deepinfer_jax.engine.llm import LLM

    return LLM(
        fv.model,
        dtype=fv.dtype,
        kv_cache_dtype=fv.kv_cache_dtype,
        max_model_len=fv.max_model_len,
        max_num_seqs=fv.max_num_seqs,
        max_num_batched_tokens=fv.max_num_batched_tokens,
        kv_cache_memory=fv.kv_cache_memory,
        seed=fv.seed,
        data_parallel_size=fv.data_parallel_size,
        expert_parallel_size=fv.expert_parallel_size,
        **config_lib.parse_overrides(fv.set),
    )
