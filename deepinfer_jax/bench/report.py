"""Readable tables of benchmark reports (the JSON report is the record; this is for people)."""

from __future__ import annotations

from typing import Any

__all__ = ["format_report", "plot_point"]


def _fmt(v: Any, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def format_report(report: dict[str, Any]) -> str:
    """A few aligned lines: workload, throughput, latency distributions, KV bytes, compiles, host/wait, ratio."""
    w = report["workload"]
    e = report["engine"]["summary"]
    runs = report["engine"]["runs"]
    m = runs[-1]["metrics"]
    rows = [
        ("model", f"{w['model']} ({w['dtype']})"),
        (
            "workload",
            f"{w['num_requests']} requests, prompt {w['prompt_len']}, output {w['output_len']}, "
            f"batch {w['batch_size'] or 'all'}, max_num_seqs {w['max_num_seqs']}, temperature {w['temperature']}",
        ),
        (
            "mesh",
            f"data_parallel_size {w.get('data_parallel_size', 1)} x expert_parallel_size "
            f"{w.get('expert_parallel_size', 1)}",
        ),
        ("runs", f"{report['warmup']['runs']} warm-up + {len(runs)} measured (medians below)"),
        (
            "output tokens/s",
            f"{_fmt(e['output_tokens_per_s'])} (best run {_fmt(e['best_output_tokens_per_s'])})",
        ),
        ("input tokens/s", _fmt(e["input_tokens_per_s"])),
    ]
    if e.get("request_rate") is not None:
        rows.append(
            (
                "request rate",
                f"target {e['request_rate']:g}/s (burstiness {e['burstiness']:g}), drawn "
                f"{_fmt(e['drawn_request_rate'], digits=2)}/s, achieved {_fmt(e['achieved_request_rate'], digits=2)}/s; "
                f"{_fmt(e['request_throughput'], digits=2)} requests finished/s; admission delay p99 "
                f"{_fmt(e['admission_delay_p99_s'], 1e3, 2)} ms",
            )
        )
    else:
        rows.append(("request rate", "all requests at once (offline)"))
    for name, key in (("TTFT ms", "ttft"), ("TPOT ms", "tpot"), ("latency ms", "latency")):
        d = m[key]
        rows.append(
            (
                f"{name} (last run)",
                "-"
                if d is None
                else f"p50 {d['p50'] * 1e3:.2f}  p90 {d['p90'] * 1e3:.2f}  p99 {d['p99'] * 1e3:.2f}",
            )
        )
    d = m["seq_tokens_per_s"]
    rows.append(
        (
            "tokens/s per sequence",
            "-" if d is None else f"p50 {d['p50']:.1f}  p90 {d['p90']:.1f}  p99 {d['p99']:.1f}",
        )
    )
    kv = report["kv_bytes_per_token"]
    if "server" in report:
        rows.insert(0, ("server", f"{report['server']['url']} serving {report['server']['model']!r}"))
    if kv is None:
        rows.append(("KV cache", "- (a server run: not visible to the client)"))
    else:
        state = kv.get("engine_state_bytes_per_seq") or 0
        rows.append(
            (
                "KV cache, this run",
                f"{kv['engine_cache']:.0f} B per cached token in the paged cache ({kv['engine_cache_dtype']} "
                "values, unquantised)"
                + (
                    f" + {state:.0f} B of state per sequence (sliding window, compressor state)"
                    if state
                    else ""
                ),
            )
        )
        formats = kv.get("production_record_formats") or {}
        rows.append(
            (
                "KV cache, production",
                f"{kv['production_format']:g} B per token over all layers, every record counted per token "
                "(not this run's storage"
                + ("; records: " + "; ".join(f"{k} {v}" for k, v in formats.items()) if formats else "")
                + ")",
            )
        )
    wu = report["warmup"]
    rows.append(
        (
            "compilations",
            f"{wu['compile_count']} in warm-up ({wu['compile_seconds']:.2f} s, "
            f"{wu.get('compile_cache_hits', 0)} from the persistent cache), {e['compile_count']} while measured",
        )
    )
    if "server" in report:
        steps = e.get("steps")
        rows.append(
            ("per step", f"{'-' if steps is None else f'{steps:.0f}'} steps (from the server's /metrics)")
        )
    elif "host_ms_per_step" in e:
        rows.append(
            (
                "per step",
                f"{e['steps']:.0f} steps; host {e['host_ms_per_step']:.2f} ms, waiting on device "
                f"{e['wait_ms_per_step']:.2f} ms"
                + (
                    f"; per decode iteration ({e['iterations']:.0f}): host {e['host_ms_per_iteration']:.2f} ms, "
                    f"waiting {e['wait_ms_per_iteration']:.2f} ms"
                    if "host_ms_per_iteration" in e and e.get("iterations", e["steps"]) != e["steps"]
                    else ""
                ),
            )
        )
    else:
        rows.append(("per step", "host/device split not available from this engine runner"))
    spec = runs[-1].get("speculative")
    if spec and spec.get("decode_rows"):
        rates = "/".join(f"{r:.2f}" for r in spec["acceptance_rates"])
        rows.append(
            (
                "speculative",
                f"{spec['num_draft_tokens']} drafts: {spec['verified_per_step']:.2f} verified per decode row, mean "
                f"accepted length {spec['mean_accepted_length']:.2f}, acceptance per position {rates} (last run)",
            )
        )
    if "baseline" in report:
        b = report["baseline"]
        info = b["info"]
        rows.append(
            (
                "baseline",
                f"{info.get('name', 'baseline')} {info.get('transformers', '')} torch {info.get('torch', '')} "
                f"({info.get('threads')} threads): {_fmt(b['summary']['output_tokens_per_s'])} output tokens/s "
                f"(best run {_fmt(b['summary']['best_output_tokens_per_s'])})",
            )
        )
        r = report["ratio"]
        rows.append(
            (
                "ratio engine/baseline",
                f"{r['output_tokens_per_s']:.2f}x median of pairs ("
                + ", ".join(f"{x:.2f}" for x in r["per_pair"])
                + f"); {r['best_runs']:.2f}x best run vs best run",
            )
        )
        a = report["token_agreement"]
        rows.append(
            (
                "greedy token agreement",
                f"{a['identical_sequences']}/{a['sequences']} sequences identical, common prefix "
                f"{a['common_prefix_mean']:.1f} tokens on average",
            )
        )
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def plot_point(report: dict[str, Any], label: str) -> dict[str, Any]:
    """The numbers one report contributes to the plots."""
    e = report["engine"]["summary"]
    return {
        "label": label,
        "output_tokens_per_s": e["output_tokens_per_s"],
        "seq_tokens_per_s": e["seq_tokens_per_s_p50"],
        "input_tokens_per_s": e["input_tokens_per_s"],
        "ttft_s": e["ttft_p50_s"],
    }
