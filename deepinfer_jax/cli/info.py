"""`deepinfer-jax info`: what a model and an engine config resolve to, without loading any weights.

Works on real-shape configs with unknown (`null`) values too: sizing needs only the shapes, and every value that
is still missing is listed rather than guessed.
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any

import yaml
from absl import flags

from deepinfer_jax import config as config_lib
from deepinfer_jax.cli import common


def define_flags(fv: flags.FlagValues) -> None:
    common.define_config_flags(fv)
    flags.DEFINE_enum("format", "text", ["text", "json"], "output format", flag_values=fv)
    flags.DEFINE_string(
        "ops_platform",
        None,
        "resolve the op selection for this platform (cpu, gpu/cuda, tpu, ascend) instead of the current one",
        flag_values=fv,
    )


def _builtin_table() -> list[dict[str, str]]:
    from deepinfer_jax.models import builtin

    return [
        {
            "name": n,
            "family": builtin.get_builtin(n).family,
            "description": builtin.get_builtin(n).description,
            "weights": "random" if builtin.get_builtin(n).random_weights else "trained",
        }
        for n in builtin.list_builtin()
    ]


def collect(fv: flags.FlagValues) -> dict[str, Any]:
    """Everything `info` reports, as a json-able dict (tests read this)."""
    from deepinfer_jax import cache
    from deepinfer_jax.models import builtin

    _, builtin_name = common.resolve_model(fv.model)
    cfg = common.config_from_flags(fv)
    out: dict[str, Any] = {}
    if cfg.model is None:
        out["builtin_models"] = _builtin_table()
        out["engine"] = config_lib.config_to_dict(cfg)
        return out
    model = cfg.model
    out["model"] = {
        "source": fv.model or fv.config,
        "builtin": builtin_name,
        "weights": (
            "random (built-in test model)"
            if builtin_name and builtin.get_builtin(builtin_name).random_weights
            else "trained (built-in model shipped in the package)"
            if builtin_name
            else "none (a config file only)"
            if str(fv.model or "").endswith((".yaml", ".yml", ".json"))
            else "from the checkpoint"
        ),
        "family": model.family,
        "missing_fields": list(model.missing_fields()),
    }
    if model.family == "deepseek_v41":
        from deepinfer_jax.models.deepseek_v4.plan_v41 import build_v41_plan, describe_plan

        out["layer_plan"] = describe_plan(build_v41_plan(model))
    # The production cache formats (FP8 / FP4 records with their scales; V3's bf16 latent), not what the engine
    # stores on this machine (float32 or bfloat16 values: `generate --verbose` prints that plan).
    out["cache_sizes"] = (
        "record_bytes_per_token and kv_bytes_per_token are the production cache formats (record_formats says "
        "what each record holds, scales included); the engine's cache in a float32 or bfloat16 run stores "
        "unquantised values instead: `deepinfer-jax generate --verbose` prints its plan"
    )
    out["record_formats"] = cache.describe_record_formats(model)
    out["record_bytes_per_token"] = dict(cache.record_bytes(model))
    # Exact rationals (a ratio-128 layer adds 2.25 B/token); shown as floats.
    out["kv_bytes_per_token"] = {
        "backbone": float(cache.kv_bytes_per_token(model)),
        "with_draft_layers": float(
            cache.kv_bytes_per_token(model, num_draft_layers=model.num_nextn_predict_layers or 0)
        ),
    }
    out["engine"] = config_lib.config_to_dict(cfg)
    out["ops"] = _ops_report(cfg, getattr(fv, "ops_platform", None))
    return out


def _ops_report(cfg: config_lib.EngineConfig, platform: str | None = None) -> dict[str, Any]:
    """The op selection the engine makes under ``cfg.ops`` (``ops.resolve_selection``), as a dict."""
    from deepinfer_jax import ops
    from deepinfer_jax.engine import llm  # noqa: F401  (registers every op the engine's step can call: `sample`, ...)

    if cfg.model is not None:
        # Model families register their own hot ops (attention cores, MoE experts) when imported.
        from deepinfer_jax.models import registry

        with contextlib.suppress(NotImplementedError):  # a family whose model is not built yet
            registry.get_family(cfg.model.family)
    return ops.resolve_selection(cfg.ops, platform=platform).as_dict()


def main(argv: list[str], fv: flags.FlagValues) -> int:
    if len(argv) > 1:
        print(f"deepinfer-jax info: unexpected arguments {argv[1:]!r}", file=sys.stderr)
        return 2
    from deepinfer_jax.ops.registry import BackendUnavailableError  # deferred: keeps --help free of jax

    try:
        report = collect(fv)
    except (ValueError, TypeError, FileNotFoundError, BackendUnavailableError) as e:
        print(f"deepinfer-jax info: error: {e}", file=sys.stderr)
        return 2
    if fv.format == "json":
        print(json.dumps(report, indent=2, sort_keys=True, default=str))
    else:
        print(yaml.safe_dump(report, sort_keys=False, default_flow_style=None, width=110).rstrip())
    return 0
