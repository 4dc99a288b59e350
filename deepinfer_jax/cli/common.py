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
        "a built-in model name (tiny-v3, tiny-v4, tiny-v41), a model folder with config.json, a config.json, "
        "or a yaml config file",
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
