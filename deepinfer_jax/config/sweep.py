"""Config sweeps: a base configuration plus a grid of overrides, one :class:`EngineConfig` per grid point.

A sweep file is a small yaml (``configs/sweeps/*.yaml``) that the ``sweep`` command and notebooks expand:

.. code-block:: yaml

    name: tiny_v41_batching
    model: ../tiny_v41.yaml          # paths are relative to the sweep file
    gin_files: [cpu_parity.gin]
    overrides: {max_model_len: 512}  # applied to every point
    grid:                            # cartesian product; the first key varies slowest
      speculative.num_draft_tokens: [0, 2, 4]
      scheduler.max_num_seqs: [1, 8]

Every point is loaded through :func:`~deepinfer_jax.config.loaders.load_config`, so it gets exactly the
validation and source priority of any other load; the grid values act as keyword overrides.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer_jax.config.errors import ConfigTypeError, ConfigValueError, describe_value
from deepinfer_jax.config.frozen import FrozenMapping, thaw
from deepinfer_jax.config.loaders import _Settings, load_config, read_yaml_file
from deepinfer_jax.config.tree import EngineConfig

__all__ = ["SWEEP_KEYS", "SweepPoint", "SweepSpec", "load_sweep"]

SWEEP_KEYS: tuple[str, ...] = ("name", "model", "yaml", "gin_files", "gin_bindings", "overrides", "grid")
"""Top-level keys a sweep file may have."""


@dataclass(frozen=True)
class SweepPoint:
    """One grid point: a readable name and the overrides that define it."""

    name: str
    overrides: Mapping[str, Any]


@dataclass(frozen=True)
class SweepSpec:
    """A parsed sweep file (paths already resolved against the file's directory)."""

    name: str
    model: str | None
    yaml: str | None = None
    gin_files: tuple[str, ...] = ()
    gin_bindings: tuple[str, ...] = ()
    overrides: Mapping[str, Any] = field(default_factory=FrozenMapping)
    grid: Mapping[str, tuple[Any, ...]] = field(default_factory=FrozenMapping)

    def points(self) -> tuple[SweepPoint, ...]:
        """The grid's points in order (a sweep without a grid has one point, the base)."""
        keys = list(self.grid)
        out = []
        for values in itertools.product(*(self.grid[k] for k in keys)):
            point = dict(zip(keys, values))
            name = ",".join(f"{k}={v}" for k, v in point.items()) or "base"
            out.append(SweepPoint(name, FrozenMapping(point)))
        return tuple(out)

    def load_point(self, point: SweepPoint, *, env: Mapping[str, str] | None = None) -> EngineConfig:
        """The config of one point (base overrides, then the point's)."""
        return load_config(
            self.model,
            yaml_path=self.yaml,
            gin_files=self.gin_files,
            gin_bindings=self.gin_bindings,
            env=env,
            overrides={**thaw(self.overrides), **thaw(point.overrides)},
        )


def load_sweep(path: str | Path) -> SweepSpec:
    """Read a sweep file, refusing unknown keys, unknown override names and empty grid axes."""
    path = Path(path)
    data = read_yaml_file(path)
    if not isinstance(data, Mapping):
        raise ConfigTypeError(f"{path}: a sweep file must be a mapping, got {describe_value(data)}")
    for key in data:
        if key not in SWEEP_KEYS:
            raise ConfigValueError(
                f"unknown key {key!r} in sweep file {path}; allowed: {', '.join(SWEEP_KEYS)}"
            )

    def relative(value: Any, key: str) -> str:
        if not isinstance(value, str):
            raise ConfigTypeError(
                f"{key} in sweep file {path}: expected a path string, got {describe_value(value)}"
            )
        p = Path(value)
        return str(p if p.is_absolute() else path.parent / p)

    def mapping(key: str) -> dict[str, Any]:
        value = data.get(key) or {}
        if not isinstance(value, Mapping):
            raise ConfigTypeError(
                f"{key} in sweep file {path}: expected a mapping, got {describe_value(value)}"
            )
        return dict(value)

    def strings(key: str) -> tuple[str, ...]:
        value = data.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigTypeError(
                f"{key} in sweep file {path}: expected a list of strings, got {describe_value(value)}"
            )
        return tuple(value)

    if data.get("model") is None and data.get("yaml") is None:
        raise ConfigValueError(f"sweep file {path}: give 'model' or 'yaml' (the base configuration)")
    checker = _Settings()
    overrides = mapping("overrides")
    grid = mapping("grid")
    for key in (*overrides, *grid):
        checker.target(str(key), f"sweep file {path}")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigValueError(
                f"grid axis {key!r} in sweep file {path}: expected a non-empty list of values, got "
                f"{describe_value(values)}"
            )
    name = data.get("name", path.stem)
    if not isinstance(name, str):
        raise ConfigTypeError(f"name in sweep file {path}: expected a string, got {describe_value(name)}")
    return SweepSpec(
        name=name,
        model=relative(data["model"], "model") if data.get("model") is not None else None,
        yaml=relative(data["yaml"], "yaml") if data.get("yaml") is not None else None,
        gin_files=tuple(relative(f, "gin_files") for f in strings("gin_files")),
        gin_bindings=strings("gin_bindings"),
        overrides=FrozenMapping(overrides),
        grid=FrozenMapping({k: tuple(v) for k, v in grid.items()}),
    )
