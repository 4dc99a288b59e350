"""`deepinfer-jax bench`: time an offline workload through the engine, optionally against a baseline.

    deepinfer-jax bench --model tiny-v3 --dtype float32 --num_requests 16 --prompt_len 32 --output_len 64 \\
        --baseline_python .venv-oracle/bin/python --baseline_threads 2 --output bench.json --plot_dir plots/

    deepinfer-jax bench --model tiny-v3 --num_requests 64 --request_rate 8 --burstiness 1   # online, Poisson

Prints a table (throughput, TTFT/TPOT percentiles, per-sequence tokens/s, KV bytes per token, compilations,
host vs device-wait time per step, request rates of an online run and, with a baseline, the ratio);
``--output`` writes the full JSON report. A model, or a ``--data_parallel_size`` x ``--expert_parallel_size``
mesh, that the engine does not serve yet is refused with exit status 2 and a message saying so.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from absl import flags

from deepinfer_jax import config as config_lib
from deepinfer_jax.cli import common


def define_workload_flags(fv: flags.FlagValues) -> None:
    """Flags that describe a :class:`~deepinfer_jax.bench.Workload` (shared with `sweep`)."""
    flags.DEFINE_string(
        "model", None, "a built-in model name (tiny-v3, ...) or a model folder", flag_values=fv
    )
    flags.DEFINE_enum(
        "dtype", common.DEFAULT_DTYPE, ["float32", "bfloat16"], common.DTYPE_HELP, flag_values=fv
    )
    flags.DEFINE_integer("num_requests", 16, "requests per measured run", flag_values=fv)
    flags.DEFINE_string(
        "prompt_len", "32", "prompt lengths: 32, 16:64 (uniform) or 8,16,32 (choice)", flag_values=fv
    )
    flags.DEFINE_string("output_len", "64", "output lengths, same forms as --prompt_len", flag_values=fv)
    flags.DEFINE_integer("batch_size", None, "requests per generate call (default: all)", flag_values=fv)
    flags.DEFINE_integer("max_num_seqs", 256, "engine concurrency: most sequences per step", flag_values=fv)
    flags.DEFINE_integer("max_num_batched_tokens", 2048, "engine token budget per step", flag_values=fv)
    flags.DEFINE_string("kv_cache_memory", None, "engine cache budget, e.g. 64MiB", flag_values=fv)
    flags.DEFINE_float("temperature", 0.0, "sampling temperature (0 = greedy)", flag_values=fv)
    flags.DEFINE_float("top_p", 1.0, "nucleus sampling threshold", flag_values=fv)
    flags.DEFINE_integer("top_k", -1, "top-k sampling (-1 = off)", flag_values=fv)
    flags.DEFINE_boolean("ignore_eos", True, "generate exactly the drawn output lengths", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "draws prompts and lengths; the engine seed", flag_values=fv)
    flags.DEFINE_integer("warmup", 1, "unmeasured runs first (compilation)", flag_values=fv)
    flags.DEFINE_integer("repeats", 3, "measured runs", flag_values=fv)
    flags.DEFINE_float(
        "request_rate",
        None,
        "requests/s arriving while the engine runs (Poisson, or gamma with --burstiness); default or inf: "
        "all requests at once",
        flag_values=fv,
    )
    flags.DEFINE_float(
        "burstiness",
        1.0,
        "gamma shape of the gaps between arrivals with --request_rate (1: Poisson; < 1 burstier)",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "data_parallel_size", 1, "engine mesh: data-parallel attention ranks", flag_values=fv
    )
    flags.DEFINE_integer(
        "expert_parallel_size", 1, "engine mesh: devices the routed experts are sharded over", flag_values=fv
    )
    common.define_speculative_flags(fv)
    flags.DEFINE_multi_string(
        "set", [], "an engine config override, e.g. --set cache.block_size=16 (repeatable)", flag_values=fv
    )
    flags.DEFINE_string("plot_dir", None, "write the PNG plots here", flag_values=fv)


def workload_from_flags(fv: flags.FlagValues, **changes: Any) -> Any:
    from deepinfer_jax.bench import Workload

    fields = dict(
        model=fv.model,
        dtype=fv.dtype,
        num_requests=fv.num_requests,
        prompt_len=fv.prompt_len,
        output_len=fv.output_len,
        batch_size=fv.batch_size,
        max_num_seqs=fv.max_num_seqs,
        max_num_batched_tokens=fv.max_num_batched_tokens,
        kv_cache_memory=fv.kv_cache_memory,
        temperature=fv.temperature,
        top_p=fv.top_p,
        top_k=fv.top_k,
        ignore_eos=fv.ignore_eos,
        seed=fv.seed,
        warmup=fv.warmup,
        repeats=fv.repeats,
        request_rate=fv.request_rate,
        burstiness=fv.burstiness,
        data_parallel_size=fv.data_parallel_size,
        expert_parallel_size=fv.expert_parallel_size,
        num_draft_tokens=fv.num_draft_tokens,
        speculative_variable_length=fv.speculative_variable_length,
        engine_overrides=config_lib.parse_overrides(fv.set),
    )
    fields.update(changes)
    return Workload(**fields)


def define_flags(fv: flags.FlagValues) -> None:
    define_workload_flags(fv)
    flags.DEFINE_string(
        "baseline_python",
        None,
        "an interpreter with torch + transformers: run the baseline with it",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "baseline_script",
        None,
        "the baseline script (default: the shipped transformers baseline)",
        flag_values=fv,
    )
    flags.DEFINE_integer("baseline_threads", 2, "torch.set_num_threads of the baseline", flag_values=fv)
    flags.DEFINE_string("output", None, "write the JSON report to this file", flag_values=fv)
    flags.DEFINE_string(
        "url",
        None,
        "benchmark a running server (deepinfer-jax serve) at this base URL, e.g. http://127.0.0.1:8000, instead "
        "of an in-process engine: the same requests, seeds and arrival times, measured on the client",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "api_key", None, "the server's API key (default: the DEEPINFER_API_KEY variable)", flag_values=fv
    )


def main(argv: list[str], fv: flags.FlagValues) -> int:
    if len(argv) > 1:
        print(f"bench: unexpected arguments {argv[1:]}", file=sys.stderr)
        return 2
    if fv.model is None and fv.url is None:
        print(
            "bench: --model is required (a built-in name such as tiny-v3, or a model folder), or --url of a server",
            file=sys.stderr,
        )
        return 2
    if fv.url is not None and fv.baseline_python is not None:
        print(
            "bench: --baseline_python runs beside the in-process engine; it cannot be combined with --url",
            file=sys.stderr,
        )
        return 2
    if fv.baseline_script is not None and fv.baseline_python is None:
        print("bench: --baseline_script needs --baseline_python (the interpreter to run it)", file=sys.stderr)
        return 2
    from deepinfer_jax.bench import ModelNotSupportedError, run_benchmark
    from deepinfer_jax.bench.report import format_report, plot_point

    api_key = fv.api_key if fv.api_key is not None else os.environ.get("DEEPINFER_API_KEY") or None
    try:
        changes = {}
        if fv.url is not None and fv.model is None:
            from deepinfer_jax.bench.http import server_info

            changes["model"] = str(server_info(fv.url, api_key)["id"])
        workload = workload_from_flags(fv, **changes)
        report = run_benchmark(
            workload,
            baseline_python=fv.baseline_python,
            baseline_script=fv.baseline_script,
            baseline_threads=fv.baseline_threads,
            log=lambda msg: print(f"bench: {msg}", file=sys.stderr),
            url=fv.url,
            api_key=api_key,
        )
    except ModelNotSupportedError as err:
        print(f"bench: {err}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, RuntimeError, OSError) as err:  # BaselineError is a RuntimeError
        print(f"bench: error: {err}", file=sys.stderr)
        return 2
    print(format_report(report))
    if fv.output:
        Path(fv.output).parent.mkdir(parents=True, exist_ok=True)
        Path(fv.output).write_text(json.dumps(report, indent=2) + "\n")
        print(f"report written to {fv.output}")
    if fv.plot_dir:
        from deepinfer_jax.bench.plots import write_plots

        points = [plot_point(report, "engine")]
        for path in write_plots(points, fv.plot_dir):
            print(f"plot written to {path}")
    return 0
