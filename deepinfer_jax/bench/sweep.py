"""Benchmark sweeps: a grid of workloads and engine settings, one benchmark per point.

A bench sweep file is a config sweep (:func:`deepinfer_jax.config.load_sweep`: ``model``, ``gin_files``,
``overrides``, ``grid`` over dotted engine config names) with two additions: a ``bench:`` section holding
:class:`~deepinfer_jax.bench.Workload` fields, and grid axes named ``bench.<field>``:

.. code-block:: yaml

    name: tiny_v3_batching
    model: tiny-v3                    # a built-in name, a model folder, or a built-in's yaml config
    gin_files: [cpu_parity.gin]       # relative to this file
    bench: {num_requests: 8, output_len: 16}
    grid:                             # cartesian product, the first axis varies slowest
      scheduler.max_num_seqs: [1, 8]
      bench.prompt_len: [16, 64]

The engine part is validated by ``load_sweep`` and every point's config is loaded before anything runs, so
a bad name or value fails at once with the file. A gin file can be swept too: its bindings are the base
config of a one-point sweep, to which axes are added by ``extra_grid`` (``deepinfer-jax sweep --grid``).

Each point's engine config is turned into the engine's arguments by comparing it with the model's plain
config: the fields the sweep changed (yaml, gin, overrides, grid) become ``LLM`` keyword arguments
(``dtype``, ``scheduler.max_num_seqs``, ...), workload sampling settings (``sampling.temperature``, ...) or
engine overrides (``cache.block_size``, ...).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from deepinfer_jax import config as config_lib
from deepinfer_jax.bench.workload import Workload
from deepinfer_jax.config.loaders import read_yaml_file
from deepinfer_jax.engine.llm import ARGUMENT_CONFIG_KEYS
from deepinfer_jax.models import builtin

__all__ = ["BenchPoint", "BenchSweep", "load_bench_sweep"]

_BENCH_PREFIX = "bench."
# Engine config fields that are Workload fields: the LLM arguments a workload sets (the mesh sizes included),
# plus the sampling settings.
_TO_WORKLOAD = {
    **ARGUMENT_CONFIG_KEYS,
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.top_k": "top_k",
    "sampling.max_tokens": "output_len",
}
_SKIPPED = {"model", "derived", "model_path", "tokenizer", "revision", "tokenizer_revision"}


@dataclasses.dataclass(frozen=True)
class BenchPoint:
    """One grid point: its name, its grid values and the workload it benchmarks."""

    name: str
    values: Mapping[str, Any]
    workload: Workload


@dataclasses.dataclass(frozen=True)
class BenchSweep:
    """A loaded bench sweep: the engine sweep spec, the model to serve and the points."""

    name: str
    spec: config_lib.SweepSpec
    points: tuple[BenchPoint, ...]


def _model_for_llm(model: str, where: str) -> tuple[str, str]:
    """(what LLM loads, what the config loader reads) for a sweep's ``model``."""
    if builtin.is_builtin(model):
        return model, str(builtin.get_builtin(model).yaml_path)
    path = Path(model)
    for name in builtin.list_builtin():
        if path.is_file() and path.resolve() == builtin.get_builtin(name).yaml_path.resolve():
            return name, str(path)
    if path.is_dir():
        return str(path), str(path)
    raise ValueError(
        f"model in {where}: {model!r} is neither a built-in model ({', '.join(builtin.list_builtin())}), the yaml "
        "config of one, nor a model folder"
    )


def _check_workload_fields(values: Mapping[str, Any], where: str) -> None:
    names = {f.name for f in dataclasses.fields(Workload)} - {"model"}
    for key in values:
        if key not in names:
            raise ValueError(f"{where}: {key!r} is not a workload field; allowed: {', '.join(sorted(names))}")


def _flatten(d: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        if key in _SKIPPED:
            continue
        if isinstance(value, Mapping) and key in config_lib.SECTIONS:
            for sub, v in value.items():
                out[f"{key}.{sub}"] = v
        else:
            out[key] = value
    return out


def _engine_changes(cfg: config_lib.EngineConfig, base: config_lib.EngineConfig) -> dict[str, Any]:
    new, old = _flatten(config_lib.config_to_dict(cfg)), _flatten(config_lib.config_to_dict(base))
    return {k: v for k, v in new.items() if old.get(k) != v}


def _split_grid(grid: Mapping[str, Any], where: str) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    engine, bench = {}, {}
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ValueError(
                f"grid axis {key!r} in {where}: expected a non-empty list of values, got {values!r}"
            )
        if key.startswith(_BENCH_PREFIX):
            bench[key[len(_BENCH_PREFIX) :]] = values
        else:
            engine[key] = values
    _check_workload_fields(bench, f"grid of {where}")
    return engine, bench


def load_bench_sweep(
    path: str | os.PathLike[str],
    *,
    base: Workload,
    model: str | None = None,
    extra_grid: Mapping[str, list[Any]] | None = None,
    explicit: Mapping[str, Any] | None = None,
) -> BenchSweep:
    """Load a bench sweep from a yaml sweep file or a gin file.

    Args:
      path: the sweep file (``.yaml``/``.yml``, or ``.gin`` for a one-point base plus ``extra_grid``).
      base: the workload defaults (the command's flags); the file's ``bench:`` section overrides them.
      model: overrides the file's ``model`` (required for a gin file).
      extra_grid: more axes (``{"bench.prompt_len": [16, 64]}``), after the file's.
      explicit: workload fields given explicitly (flags the user typed): they override the ``bench:`` section.
    """
    path = Path(path)
    where = f"sweep file {path}"
    if not path.is_file():
        raise ValueError(f"sweep_file: {str(path)!r} does not exist")
    extra = dict(extra_grid or {})
    if path.suffix == ".gin":
        if model is None:
            raise ValueError(f"{where}: a gin sweep needs --model (gin files bind engine settings only)")
        llm_model, config_model = _model_for_llm(model, where)
        engine_grid, bench_grid = _split_grid(extra, where)
        spec = config_lib.SweepSpec(
            name=path.stem,
            model=config_model,
            gin_files=(str(path),),
            grid=config_lib.FrozenMapping({k: tuple(v) for k, v in engine_grid.items()}),
        )
        bench_base: dict[str, Any] = {}
        order = list(extra)
    elif path.suffix in (".yaml", ".yml"):
        raw = read_yaml_file(path)
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where}: a sweep file must be a mapping, got {type(raw).__name__}")
        raw = dict(raw)
        bench_base = dict(raw.pop("bench", None) or {})
        _check_workload_fields(bench_base, f"bench section of {where}")
        grid = {**dict(raw.get("grid") or {}), **extra}
        engine_grid, bench_grid = _split_grid(grid, where)
        order = list(grid)
        file_model = model or raw.get("model")
        if file_model is None:
            raise ValueError(f"{where}: give 'model' (a built-in name or a model folder) or --model")
        resolved = (
            file_model
            if builtin.is_builtin(file_model) or Path(file_model).is_absolute()
            else str(path.parent / file_model)
        )
        llm_model, config_model = _model_for_llm(
            resolved if not builtin.is_builtin(file_model) else file_model, where
        )
        raw["model"] = str(Path(config_model).resolve())
        raw["grid"] = engine_grid
        for key in ("yaml",):
            if raw.get(key) is not None and not Path(raw[key]).is_absolute():
                raw[key] = str((path.parent / raw[key]).resolve())
        if raw.get("gin_files"):
            raw["gin_files"] = [str((path.parent / f).resolve()) for f in raw["gin_files"]]
        raw.setdefault("name", path.stem)
        with tempfile.TemporaryDirectory() as tmp:
            tmp_file = Path(tmp) / path.name
            tmp_file.write_text(yaml.safe_dump(raw, sort_keys=False))
            try:
                spec = config_lib.load_sweep(tmp_file)
            except (config_lib.ConfigValueError, config_lib.ConfigTypeError) as err:
                raise type(err)(str(err).replace(str(tmp_file), str(path))) from None
    else:
        raise ValueError(f"sweep_file: {str(path)!r} must be a .yaml, .yml or .gin file")

    # The engine always prefills in chunks (LLM turns it on), so points are validated with it on too.
    chunked = {} if "scheduler.chunked_prefill" in spec.overrides else {"scheduler.chunked_prefill": True}
    plain = config_lib.load_config(spec.model, overrides=chunked)
    fields = {**bench_base, **dict(explicit or {})}
    points = []
    for values in itertools.product(
        *(engine_grid.get(k) or bench_grid[k[len(_BENCH_PREFIX) :]] for k in order)
    ):
        point = dict(zip(order, values))
        engine_point = {k: v for k, v in point.items() if not k.startswith(_BENCH_PREFIX)}
        bench_point = {k[len(_BENCH_PREFIX) :]: v for k, v in point.items() if k.startswith(_BENCH_PREFIX)}
        try:
            cfg = spec.load_point(
                config_lib.SweepPoint("point", config_lib.FrozenMapping({**chunked, **engine_point}))
            )
        except (config_lib.ConfigValueError, config_lib.ConfigTypeError) as err:
            raise ValueError(f"{where}, point {point}: {err}") from None
        workload_fields: dict[str, Any] = {}
        overrides: dict[str, Any] = {}
        for key, value in _engine_changes(cfg, plain).items():
            if key in _TO_WORKLOAD:
                workload_fields[_TO_WORKLOAD[key]] = value
            elif not key.startswith("model."):
                overrides[key] = value
        name = ",".join(f"{k}={v}" for k, v in point.items()) or "base"
        try:
            workload = base.replace(
                **{
                    **workload_fields,
                    **fields,
                    **bench_point,
                    "model": llm_model,
                    "engine_overrides": {**dict(base.engine_overrides), **overrides},
                }
            )
        except (ValueError, TypeError) as err:
            raise type(err)(f"{where}, point {point}: {err}") from None
        points.append(BenchPoint(name, point, workload))
    return BenchSweep(spec.name, spec, tuple(points))
