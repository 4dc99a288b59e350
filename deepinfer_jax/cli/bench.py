"""`deepinfer-jax bench`: time an offline workload through the engine, optionally against a baseline.

    deepinfer-jax bench --model tiny-v3 --dtype float32 --num_requests 16 --prompt_len 32 --output_len 64 \\
        --baseline_python .venv-oracle/bin/python --baseline_threads 2 --output bench.json --plot_dir plots/

    deepinfer-jax bench --model tiny-v3 --num_requests 64 --request_rate 8 --burstiness 1   # online, Poisson

Prints a table (throughput, TTFT/TPOT percentiles, per-sequence tokens/s, KV bytes per token, compilations,
host vs device-wait time per step, request rates of an online run and, with a baseline, the ratio);
``--output`` writes the full JSON report. A model, or a ``--data_parallel_size`` x ``--expert_parallel_size``
mesh, that the engine does not serve yet is refused with exit status 2 and a message saying so.

    deepinfer-jax bench --workload multi_turn --model tiny-v3 --conversations 16 --turns 6
    deepinfer-jax bench --workload long_prompts --model tiny-v41 --prompt_lens 1024,2048,4095 --repeats 3

``--workload multi_turn`` (prefix caching: cache off / on / a small device cache without and with the host tier)
and ``--workload long_prompts`` (SWA bounded replay: truncation off / compact) run the scenario benchmarks of
:mod:`deepinfer_jax.bench.scenarios` instead of random requests; each prints its table and ``--output`` writes its
JSON report. A flag that does not apply to the chosen workload is refused with exit status 2, naming it; replies
that differ between the multi-turn variants end the run with exit status 1.
"""

from __future__ import annotations

import functools
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


WORKLOADS = ("random", "multi_turn", "long_prompts")

# The flags of the scenario workloads (bench only, not sweep), each with the workload it belongs to.
_SCENARIO_FLAGS = {
    "conversations": "multi_turn",
    "turns": "multi_turn",
    "system_tokens": "multi_turn",
    "user_tokens": "multi_turn",
    "reply_tokens": "multi_turn",
    "small_blocks": "multi_turn",
    "host_memory": "multi_turn",
    "prompt_lens": "long_prompts",
    "keep_tokens": "long_prompts",
    "variants": "multi_turn, long_prompts",
}
_SCENARIO_COMMON = {
    "workload",
    "model",
    "dtype",
    "max_num_seqs",
    "max_num_batched_tokens",
    "seed",
    "warmup",
    "repeats",
    "num_draft_tokens",
    "speculative_variable_length",
    "set",
    "output",
    "variants",
}
_APPLIES = {
    "multi_turn": _SCENARIO_COMMON
    | {"batch_size", "conversations", "turns", "system_tokens", "user_tokens", "reply_tokens"}
    | {"small_blocks", "host_memory"},
    "long_prompts": _SCENARIO_COMMON | {"prompt_lens", "keep_tokens"},
}
# Where a refused flag has a counterpart in the workload, the refusal names it.
_INSTEAD = {
    ("multi_turn", "output_len"): "--reply_tokens",
    ("multi_turn", "prompt_len"): "--system_tokens / --user_tokens",
    ("multi_turn", "num_requests"): "--conversations x --turns",
    ("multi_turn", "kv_cache_memory"): "--small_blocks for the small device cache",
    ("long_prompts", "prompt_len"): "--prompt_lens",
    ("long_prompts", "num_requests"): "--prompt_lens (one prompt per length)",
}
# Scenario defaults where a flag is not given: the recorded benchmarks' settings (docs/benchmarks.md).
_SCENARIO_DEFAULTS: dict[str, dict[str, Any]] = {
    "multi_turn": {
        "model": "tiny-v3",
        "dtype": "float32",
        "max_num_seqs": 16,
        "max_num_batched_tokens": 512,
        "repeats": 2,
        "num_draft_tokens": 0,
        "batch_size": 4,
        "conversations": 16,
        "turns": 6,
        "system_tokens": 64,
        "user_tokens": 32,
        "reply_tokens": 32,
        "small_blocks": 180,
        "host_memory": "1GiB",
        "variants": "off,on,small,host",
    },
    "long_prompts": {
        "model": "tiny-v41",
        "dtype": "float32",
        "max_num_seqs": 1,
        "max_num_batched_tokens": 1024,
        "repeats": 5,
        "num_draft_tokens": 0,
        "prompt_lens": "1024,2048,4095",
        "keep_tokens": 140,
        "variants": "off,compact",
    },
}
# Engine overrides the variants set themselves: --set may not change them.
_VARIANT_OVERRIDES = {
    "multi_turn": {
        "cache.enable_prefix_caching": "--variants",
        "cache.num_blocks": "--small_blocks",
        "cache.host_memory": "--host_memory",
    },
    "long_prompts": {
        "cache.enable_prefix_caching": "nothing: every mode runs without prefix caching",
        "scheduler.yoco_truncation": "--variants",
        "scheduler.yoco_keep_tokens": "--keep_tokens",
    },
}


def define_scenario_flags(fv: flags.FlagValues) -> None:
    """`--workload` and the flags of the scenario workloads (:mod:`deepinfer_jax.bench.scenarios`)."""
    flags.DEFINE_enum(
        "workload",
        "random",
        list(WORKLOADS),
        "random: the requests of --num_requests / --prompt_len / --output_len; multi_turn: multi-turn chat, each "
        "turn's prompt the whole conversation so far, prefix cache off / on / small / small with the host tier "
        "(TTFT, prefill tokens); long_prompts: long prompts with SWA bounded replay off / compact (prefill "
        "tokens/s, consumer-layer rows and FLOPs). multi_turn and long_prompts take --model, --dtype, "
        "--max_num_seqs, --max_num_batched_tokens (long_prompts: the prefill chunk), --seed, --warmup, --repeats, "
        "--num_draft_tokens, --speculative_variable_length, --set, --output, --variants and their own flags, and "
        "refuse the others; a flag they take that is not given has the recorded benchmark's value (multi_turn: "
        "tiny-v3, float32, 16 sequences, 512 tokens per step, 2 repeats, no drafts, block size 16; long_prompts: "
        "tiny-v41, float32, 1 sequence, 1024-token chunks, 5 repeats, no drafts)",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "conversations", None, "multi_turn: conversations (unset: 16)", lower_bound=1, flag_values=fv
    )
    flags.DEFINE_integer(
        "turns", None, "multi_turn: turns per conversation (unset: 6)", lower_bound=1, flag_values=fv
    )
    flags.DEFINE_integer(
        "system_tokens",
        None,
        "multi_turn: the shared system prompt's random ids, before the first user message (unset: 64)",
        lower_bound=0,
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "user_tokens",
        None,
        "multi_turn: random ids per user message (unset: 32)",
        lower_bound=1,
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "reply_tokens",
        None,
        "multi_turn: greedy tokens per reply, EOS ignored (unset: 32); --batch_size is the conversations sent "
        "per generate call (unset: 4)",
        lower_bound=1,
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "small_blocks",
        None,
        "multi_turn: cache blocks of the small and host variants, too few to keep every conversation between "
        "its turns (unset: 180)",
        lower_bound=2,
        flag_values=fv,
    )
    flags.DEFINE_string(
        "host_memory",
        None,
        "multi_turn: the host variant's host-memory tier, e.g. 1GiB (unset: 1GiB)",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "variants",
        None,
        "the engines compared, alternating between repeats: multi_turn: of off,on,small,host (unset: all "
        "four); long_prompts: scheduler.yoco_truncation modes of off,mask,compact (unset: off,compact)",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "prompt_lens",
        None,
        "long_prompts: the prompt lengths, comma-separated, one prompt each (unset: 1024,2048,4095)",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "keep_tokens",
        None,
        "long_prompts: scheduler.yoco_keep_tokens of the truncating modes (unset: 140)",
        lower_bound=1,
        flag_values=fv,
    )


def define_flags(fv: flags.FlagValues) -> None:
    define_workload_flags(fv)
    define_scenario_flags(fv)
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


def _refused_flag(fv: flags.FlagValues) -> str | None:
    """The refusal of the first given flag that does not apply to ``--workload``, or ``None``."""
    workload = fv.workload
    for name in fv:
        if not fv[name].present:
            continue
        if workload == "random":
            if name in _SCENARIO_FLAGS:
                return (
                    f"--{name} applies to --workload {_SCENARIO_FLAGS[name]} only, not to --workload random"
                )
        elif name not in _APPLIES[workload]:
            instead = _INSTEAD.get((workload, name))
            hint = f"; use {instead}" if instead else ""
            return f"--{name} does not apply to --workload {workload}{hint}"
    return None


def _scenario_value(fv: flags.FlagValues, name: str) -> Any:
    """A flag's value, or where it is not given the scenario workload's default."""
    if fv[name].present:
        return fv[name].value
    return _SCENARIO_DEFAULTS[fv.workload].get(name, fv[name].value)


def _names(flag: str, text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(f"--{flag}={text!r}: expected a comma-separated list")
    return names


def _scenario_message(err: BaseException) -> str:
    """An engine error naming the scenario flags that set the variants' overrides."""
    text = str(err)
    for key, flag in (
        ("scheduler.yoco_keep_tokens", "--keep_tokens"),
        ("scheduler.yoco_truncation", "--variants"),
        ("cache.num_blocks", "--small_blocks"),
        ("cache.host_memory", "--host_memory"),
    ):
        text = text.replace(f"[set by override {key}]", f"[set by {flag}]")
        text = text.replace(f"(set by override {key})", f"(set by {flag})")
    return common.flag_message(type(err)(text))


def scenario_main(fv: flags.FlagValues) -> int:
    """``bench --workload multi_turn|long_prompts`` (flags checked by :func:`main` first)."""
    from deepinfer_jax.bench import scenarios

    workload = fv.workload
    value = functools.partial(_scenario_value, fv)
    log = lambda msg: print(f"bench: {msg}", file=sys.stderr)  # noqa: E731
    try:
        overrides = config_lib.parse_overrides(fv.set)
        for key, flag in _VARIANT_OVERRIDES[workload].items():
            if key in overrides:
                raise ValueError(
                    f"--set {key}: the --workload {workload} variants set it; use {flag}"
                    if flag.startswith("--")
                    else f"--set {key}: the --workload {workload} variants set it ({flag})"
                )
        variants = _names("variants", value("variants"))
        engine = dict(
            dtype=value("dtype"),
            max_num_seqs=value("max_num_seqs"),
            num_draft_tokens=value("num_draft_tokens"),
            speculative_variable_length=fv.speculative_variable_length,
        )
        if workload == "multi_turn":
            from deepinfer_jax.cache.paged import parse_bytes

            block_size = overrides.pop("cache.block_size", 16)
            host_memory = parse_bytes(value("host_memory"), "--host_memory")
            engines = scenarios.multi_turn_engines(
                value("model"),
                scenarios.check_names("--variants", variants, scenarios.MULTI_TURN_VARIANTS),
                block_size=block_size,
                small_blocks=value("small_blocks"),
                host_memory=host_memory,
                max_num_batched_tokens=value("max_num_batched_tokens"),
                overrides=overrides,
                **engine,
            )
            report = scenarios.run_multi_turn(
                value("model"),
                conversations=value("conversations"),
                turns=value("turns"),
                system_tokens=value("system_tokens"),
                user_tokens=value("user_tokens"),
                reply_tokens=value("reply_tokens"),
                block_size=block_size,
                group=value("batch_size"),
                small_blocks=value("small_blocks"),
                host_memory=host_memory,
                repeats=value("repeats"),
                warmup=value("warmup"),
                variants=variants,
                max_num_batched_tokens=value("max_num_batched_tokens"),
                overrides=overrides,
                seed=value("seed"),
                engines=engines,
                log=log,
                **engine,
            )
            table = scenarios.format_multi_turn(report)
        else:
            try:
                lens = [int(n) for n in _names("prompt_lens", value("prompt_lens"))]
            except ValueError:
                raise ValueError(
                    f"--prompt_lens={value('prompt_lens')!r}: expected comma-separated lengths such as 1024,2048"
                ) from None
            engines = scenarios.long_prompt_engines(
                value("model"),
                scenarios.check_names("--variants", variants, scenarios.LONG_PROMPT_MODES),
                chunk=value("max_num_batched_tokens"),
                keep_tokens=value("keep_tokens"),
                overrides=overrides,
                **engine,
            )
            report = scenarios.run_long_prompts(
                value("model"),
                prompt_lens=lens,
                chunk=value("max_num_batched_tokens"),
                keep_tokens=value("keep_tokens"),
                repeats=value("repeats"),
                warmup=value("warmup"),
                modes=variants,
                overrides=overrides,
                seed=value("seed"),
                engines=engines,
                log=log,
                **engine,
            )
            table = scenarios.format_long_prompts(report)
    except NotImplementedError as err:
        print(f"bench: model {value('model')!r} is not supported by the engine yet: {err}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, RuntimeError, OSError) as err:
        print(f"bench: error: {_scenario_message(err)}", file=sys.stderr)
        return 2
    print(table)
    if fv.output:
        Path(fv.output).parent.mkdir(parents=True, exist_ok=True)
        Path(fv.output).write_text(json.dumps(report, indent=2) + "\n")
        print(f"report written to {fv.output}")
    if workload == "multi_turn" and not report["identical"]:
        print(f"bench: error: the replies differ between the variants: {report['mismatch']}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str], fv: flags.FlagValues) -> int:
    if len(argv) > 1:
        print(f"bench: unexpected arguments {argv[1:]}", file=sys.stderr)
        return 2
    refused = _refused_flag(fv)
    if refused is not None:
        print(f"bench: {refused}", file=sys.stderr)
        return 2
    if fv.workload != "random":
        return scenario_main(fv)
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
