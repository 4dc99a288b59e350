"""`deepinfer-jax sweep`: benchmark every point of a grid and write one JSON line per point, plus the plots.

    deepinfer-jax sweep --sweep_file configs/sweeps/tiny_v3_bench.yaml --output sweep.jsonl --plot_dir plots/
    deepinfer-jax sweep --sweep_file configs/sweeps/cpu_parity.gin --model tiny-v3 \\
        --grid 'scheduler.max_num_seqs=[1, 4]' --grid 'bench.prompt_len=[16, 64]'

The sweep file format is described in :mod:`deepinfer_jax.bench.sweep`. Workload flags (``--num_requests``,
``--prompt_len``, ...) are the defaults of every point; the file's ``bench:`` section overrides them, flags
given explicitly override the file, and grid values override everything. Every point is validated before the
first one runs.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from absl import flags

from deepinfer_jax import config as config_lib
from deepinfer_jax.cli.bench import define_workload_flags, workload_from_flags

_WORKLOAD_FLAGS = (
    "dtype",
    "num_requests",
    "prompt_len",
    "output_len",
    "batch_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_cache_memory",
    "temperature",
    "top_p",
    "top_k",
    "ignore_eos",
    "seed",
    "warmup",
    "repeats",
    "request_rate",
    "burstiness",
    "data_parallel_size",
    "expert_parallel_size",
)


def _json_value(value: Any) -> Any:
    """A grid value as strict JSON has it: ``.inf`` (a request rate) becomes the string ``"inf"``."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("sweep_file", None, "a yaml sweep file or a gin file", flag_values=fv, required=True)
    define_workload_flags(fv)
    flags.DEFINE_multi_string(
        "grid",
        [],
        "an extra grid axis NAME=[v1, v2] (engine config name or bench.<field>; repeatable)",
        flag_values=fv,
    )
    flags.DEFINE_string("output", None, "write the JSON lines here (default: stdout)", flag_values=fv)


def main(argv: list[str], fv: flags.FlagValues) -> int:
    if len(argv) > 1:
        print(f"sweep: unexpected arguments {argv[1:]}", file=sys.stderr)
        return 2
    from deepinfer_jax.bench import ModelNotSupportedError, run_benchmark
    from deepinfer_jax.bench.report import plot_point
    from deepinfer_jax.bench.sweep import load_bench_sweep

    try:
        grid = config_lib.parse_overrides(fv.grid)
        for key, values in grid.items():
            if not isinstance(values, list) or not values:
                raise ValueError(f"--grid {key}: expected a non-empty list such as [1, 4], got {values!r}")
        explicit = {name: fv[name].value for name in _WORKLOAD_FLAGS if fv[name].present}
        base = workload_from_flags(fv, model=fv.model or "tiny-v3")
        sweep = load_bench_sweep(fv.sweep_file, base=base, model=fv.model, extra_grid=grid, explicit=explicit)
    except (ValueError, TypeError) as err:
        print(f"sweep: error: {err}", file=sys.stderr)
        return 2
    if fv.output:
        Path(fv.output).parent.mkdir(parents=True, exist_ok=True)
    out = open(fv.output, "w") if fv.output else sys.stdout  # noqa: SIM115 -- stdout must not be closed
    points: list[dict[str, Any]] = []
    try:
        for i, point in enumerate(sweep.points):
            print(f"sweep: point {i + 1}/{len(sweep.points)}: {point.name}", file=sys.stderr)
            try:
                report = run_benchmark(point.workload)
            except ModelNotSupportedError as err:
                print(f"sweep: {err}", file=sys.stderr)
                return 2
            except (ValueError, TypeError, RuntimeError) as err:
                print(f"sweep: error at point {point.name}: {err}", file=sys.stderr)
                return 2
            line = {
                "sweep": sweep.name,
                "point": point.name,
                "values": {k: _json_value(v) for k, v in point.values.items()},
                "workload": report["workload"],
                "summary": report["engine"]["summary"],
                "kv_bytes_per_token": report["kv_bytes_per_token"],
                "warmup": report["warmup"],
                "machine": report["machine"],
            }
            out.write(json.dumps(line) + "\n")
            out.flush()
            # Short labels for the plots: the last part of each axis name and its value.
            label = ",".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in point.values.items()) or point.name
            points.append(plot_point(report, label))
    finally:
        if out is not sys.stdout:
            out.close()
    if fv.output:
        print(f"{len(points)} points written to {fv.output}", file=sys.stderr)
    if fv.plot_dir:
        from deepinfer_jax.bench.plots import write_plots

        for path in write_plots(points, Path(fv.plot_dir)):
            print(f"plot written to {path}", file=sys.stderr)
    return 0
