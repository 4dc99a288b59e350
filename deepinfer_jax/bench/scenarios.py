"""Scenario benchmarks behind ``deepinfer-jax bench --workload multi_turn|long_prompts`` (and the scripts
``scripts/bench_prefix_cache.py``, ``scripts/bench_bounded_replay.py``, thin wrappers of these functions).

**Multi-turn chat** (:func:`run_multi_turn`, prefix caching, docs/prefix_cache.md): ``conversations``
conversations of ``turns`` turns; a turn's prompt is the whole conversation so far (a shared system prompt of
``system_tokens`` random ids, then every user message of ``user_tokens`` random ids and every reply of
``reply_tokens`` greedy tokens, EOS ignored). Turn ``t`` is sent by ``group`` conversations at a time (one
``generate`` call each), so between two turns of a conversation the other groups run and fill the cache. Each
variant is its own ``LLM`` on the same weights:

* ``off``: ``enable_prefix_caching=False``;
* ``on``: the prefix cache in device memory (the default cache size, large enough for every conversation);
* ``small``: a device cache of ``small_blocks`` blocks, too few to keep every conversation between its turns;
* ``host``: the same small device cache with a host-memory tier of ``host_memory`` bytes: evicted blocks go to
  host memory and come back from it.

Reported per variant (medians over ``repeats`` runs, the variants alternating between repeats): TTFT p50 / p99 of
turn 1 and of turns >= 2 (from each request's metrics: first token time - arrival), prefill tokens computed,
tokens found cached (also per turn), tokens loaded from the host tier, the run's wall time and the compilations
during it. The replies must be identical in every variant and run (greedy): ``identical`` says whether they are
and ``mismatch`` where they are not first; callers turn a mismatch into a nonzero exit status.

**Long prompts** (:func:`run_long_prompts`, SWA bounded replay, ``scheduler.yoco_truncation``,
docs/models_v41.md): one prompt of each length in ``prompt_lens`` (random ids) through ``generate`` with
``max_tokens = 1`` (the prefill and its one sample), one sequence at a time, ``chunk``-token prefill chunks
(``max_num_batched_tokens``), every mode its own ``LLM`` with prefix caching off (each run prefills the whole
prompt): ``off`` (the exact model), ``mask`` and ``compact`` (truncation keeping ``keep_tokens`` tokens). After
``warmup`` unmeasured runs per engine and length (the compile), ``repeats`` runs alternate between the modes;
medians are reported. Consumer rows are counted from the steps that ran: a step of token bucket ``T`` and
sequence bucket ``S`` runs the YOCO consumer layers on ``T`` rows, or on ``min(T, S * keep_tokens)`` rows with
``compact``. Consumer-layer FLOPs are estimated as rows x :func:`consumer_cost` (2 x the parameters a row touches in
the consumer layers, routed experts scaled by ``k / E``, plus the window attention ``4 * W * heads * head_dim`` per
layer).

Both report the machine (:func:`~deepinfer_jax.bench.runner.machine_info`) and its load average before and after.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

__all__ = [
    "LONG_PROMPT_MODES",
    "MULTI_TURN_VARIANTS",
    "check_names",
    "consumer_cost",
    "draw_conversations",
    "format_long_prompts",
    "format_multi_turn",
    "long_prompt_engines",
    "multi_turn_engines",
    "run_conversations",
    "run_long_prompts",
    "run_multi_turn",
]

MULTI_TURN_VARIANTS = ("off", "on", "small", "host")
"""The multi-turn variants, in the order the table lists them."""
LONG_PROMPT_MODES = ("off", "mask", "compact")
"""``scheduler.yoco_truncation`` modes the long-prompt workload can compare."""

Log = Callable[[str], None]


def check_names(kind: str, names: Sequence[str], known: Sequence[str]) -> list[str]:
    """``names`` as a list, refused (``ValueError`` naming ``kind``) when empty, repeated or not all ``known``."""
    names = list(names)
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ValueError(f"{kind}: {names!r}; expected a non-empty list of {', '.join(known)}")
    if len(set(names)) != len(names):
        raise ValueError(f"{kind}: {names!r} names a variant twice")
    return names


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _machine() -> dict[str, Any]:
    from deepinfer_jax.bench.runner import machine_info

    return machine_info()


# ----------------------------------------------------------------------------------------- multi-turn chat


def draw_conversations(
    vocab: int, n: int, turns: int, system: int, user: int, seed: int
) -> list[list[list[int]]]:
    """Per conversation, per turn, the user message's ids (turn 0's starts with the shared system prompt)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, vocab, system).tolist()
    out = []
    for _ in range(n):
        msgs = [rng.integers(3, vocab, user).tolist() for _ in range(turns)]
        msgs[0] = shared + msgs[0]
        out.append(msgs)
    return out


def multi_turn_engines(
    model: str,
    variants: Sequence[str] = MULTI_TURN_VARIANTS,
    *,
    dtype: str = "float32",
    block_size: int = 16,
    small_blocks: int = 180,
    host_memory: int = 1 << 30,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 512,
    num_draft_tokens: int | None = 0,
    speculative_variable_length: bool | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One ``LLM`` per variant (module docstring), on the same weights."""
    from deepinfer_jax import LLM

    names = check_names("variants", variants, MULTI_TURN_VARIANTS)
    common: dict[str, Any] = dict(
        dtype=dtype,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        num_draft_tokens=num_draft_tokens,
        speculative_variable_length=speculative_variable_length,
        **dict(overrides or {}),
        **{"cache.block_size": block_size},
    )
    settings = {
        "off": dict(enable_prefix_caching=False),
        "on": dict(enable_prefix_caching=True),
        "small": dict(enable_prefix_caching=True, **{"cache.num_blocks": small_blocks}),
        "host": dict(
            enable_prefix_caching=True,
            **{"cache.num_blocks": small_blocks, "cache.host_memory": host_memory},
        ),
    }
    return {n: LLM(model, **common, **settings[n]) for n in names}


def run_conversations(llm: Any, convs: list[list[list[int]]], reply: int, group: int) -> dict[str, Any]:
    """One pass over the conversations (module docstring); ``replies`` holds every reply, in send order."""
    from deepinfer_jax import SamplingParams

    params = SamplingParams(max_tokens=reply, temperature=0.0, ignore_eos=True)
    turns = len(convs[0])
    history: list[list[int]] = [[] for _ in convs]
    ttft: dict[str, list[float]] = {"first": [], "later": []}
    prefill_by_turn = [0] * turns
    cached_by_turn = [0] * turns
    replies: list[tuple[int, ...]] = []
    sched = llm.scheduler
    host_before = sched.stats.prefix_cache_host_hits
    compiles = llm.executor.compile_count
    start = time.perf_counter()
    for t in range(turns):
        for g in range(0, len(convs), group):
            members = range(g, min(g + group, len(convs)))
            prompts = [history[i] + convs[i][t] for i in members]
            before = sched.stats.num_prefill_tokens
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            prefill_by_turn[t] += sched.stats.num_prefill_tokens - before
            for i, p, o in zip(members, prompts, outs, strict=True):
                if o.outputs[0].finish_reason == "error":
                    raise RuntimeError(f"request {o.request_id} failed: {o.outputs[0].error}")
                m = o.metrics
                ttft["first" if t == 0 else "later"].append(m.first_token_time - m.arrival_time)
                cached_by_turn[t] += o.num_cached_tokens
                history[i] = p + list(o.outputs[0].token_ids)
                replies.append(tuple(o.outputs[0].token_ids))
    wall = time.perf_counter() - start

    def pct(xs: list[float], q: float) -> float | None:
        return float(np.percentile(np.asarray(xs) * 1e3, q)) if xs else None

    return {
        "ttft_first_p50_ms": pct(ttft["first"], 50),
        "ttft_first_p99_ms": pct(ttft["first"], 99),
        "ttft_later_p50_ms": pct(ttft["later"], 50),
        "ttft_later_p99_ms": pct(ttft["later"], 99),
        "prefill_tokens": sum(prefill_by_turn),
        "cached_tokens": sum(cached_by_turn),
        "wall_s": wall,
        "host_hits": sched.stats.prefix_cache_host_hits - host_before,
        "compiles": llm.executor.compile_count - compiles,
        "prefill_tokens_by_turn": prefill_by_turn,
        "cached_tokens_by_turn": cached_by_turn,
        "replies": replies,
    }


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over runs: of each number, and element by element of each per-turn list."""
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if key == "replies":
            continue
        if isinstance(value, list):
            out[key] = [statistics.median(r[key][i] for r in runs) for i in range(len(value))]
        elif value is None:
            out[key] = None
        else:
            out[key] = statistics.median(r[key] for r in runs)
    return out


def _first_mismatch(results: dict[str, list[dict[str, Any]]]) -> str | None:
    ref_name, ref_run = next((n, 0) for n in results)
    ref = results[ref_name][ref_run]["replies"]
    for name, runs in results.items():
        for r, res in enumerate(runs):
            for i, (a, b) in enumerate(zip(ref, res["replies"], strict=True)):
                if a != b:
                    return (
                        f"reply {i} of variant {name!r} run {r + 1} differs from variant {ref_name!r} run "
                        f"{ref_run + 1}: {list(b)} vs {list(a)}"
                    )
    return None


def run_multi_turn(
    model: str = "tiny-v3",
    *,
    conversations: int = 16,
    turns: int = 6,
    system_tokens: int = 64,
    user_tokens: int = 32,
    reply_tokens: int = 32,
    block_size: int = 16,
    group: int = 4,
    small_blocks: int = 180,
    host_memory: int = 1 << 30,
    repeats: int = 2,
    warmup: int = 1,
    variants: Sequence[str] | None = None,
    dtype: str = "float32",
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 512,
    num_draft_tokens: int | None = 0,
    speculative_variable_length: bool | None = None,
    overrides: Mapping[str, Any] | None = None,
    seed: int = 0,
    engines: Mapping[str, Any] | None = None,
    log: Log | None = None,
) -> dict[str, Any]:
    """The multi-turn chat benchmark (module docstring); returns the JSON-able report.

    ``engines`` (variant name -> ``LLM``, e.g. from :func:`multi_turn_engines`) reuses engines built before;
    without it they are built here from ``model`` and the engine settings. ``variants`` unset: all four, or
    those of ``engines``. ``warmup`` unmeasured passes per
    engine over a shorter workload (``group`` conversations x 2 turns, 4-token replies) compile the steps first.
    """
    say = log or (lambda _msg: None)
    for name, value, low in (
        ("conversations", conversations, 1),
        ("turns", turns, 1),
        ("user_tokens", user_tokens, 1),
        ("reply_tokens", reply_tokens, 1),
        ("group", group, 1),
        ("repeats", repeats, 1),
        ("system_tokens", system_tokens, 0),
        ("warmup", warmup, 0),
    ):
        if value < low:
            raise ValueError(f"{name}: {value}; must be >= {low}")
    if variants is None:
        variants = (
            MULTI_TURN_VARIANTS if engines is None else [n for n in MULTI_TURN_VARIANTS if n in engines]
        )
    names = check_names("variants", variants, MULTI_TURN_VARIANTS)
    load_before = _load()
    if engines is None:
        engines = multi_turn_engines(
            model,
            names,
            dtype=dtype,
            block_size=block_size,
            small_blocks=small_blocks,
            host_memory=host_memory,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            num_draft_tokens=num_draft_tokens,
            speculative_variable_length=speculative_variable_length,
            overrides=overrides,
        )
    else:
        missing = [n for n in names if n not in engines]
        if missing:
            raise ValueError(f"engines: no engine for the variants {missing}")
    vocab = engines[names[0]].model.config.vocab_size
    convs = draw_conversations(vocab, conversations, turns, system_tokens, user_tokens, seed)
    warm_compiles = {}
    for n in names:  # compile every bucket once, outside the measurement
        before = engines[n].executor.compile_count
        for _ in range(warmup):
            run_conversations(
                engines[n],
                draw_conversations(vocab, group, 2, system_tokens, user_tokens, seed + 1),
                4,
                group,
            )
        warm_compiles[n] = engines[n].executor.compile_count - before
        say(f"{n}: warm-up done ({warm_compiles[n]} compilations)")
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(repeats):
        for n in names if r % 2 == 0 else names[::-1]:
            engines[n].reset_prefix_cache()
            results[n].append(run_conversations(engines[n], convs, reply_tokens, group))
            say(f"{n}: run {r + 1}/{repeats} in {results[n][-1]['wall_s']:.2f} s")
    mismatch = _first_mismatch(results)
    return {
        "workload": "multi_turn",
        "settings": {
            "model": model,
            "conversations": conversations,
            "turns": turns,
            "system_tokens": system_tokens,
            "user_tokens": user_tokens,
            "reply_tokens": reply_tokens,
            "block_size": block_size,
            "group": group,
            "small_blocks": small_blocks,
            "host_memory": host_memory,
            "repeats": repeats,
            "warmup": warmup,
            "variants": names,
            "dtype": dtype,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "num_draft_tokens": num_draft_tokens,
            "speculative_variable_length": speculative_variable_length,
            "overrides": dict(overrides or {}),
            "seed": seed,
        },
        "machine": _machine(),
        "load_average": {"before": load_before, "after": _load()},
        "identical": mismatch is None,
        "mismatch": mismatch,
        "warmup_compiles": warm_compiles,
        "variants": {n: _median_run(results[n]) for n in names},
        "runs": {n: [{k: v for k, v in res.items() if k != "replies"} for res in results[n]] for n in names},
    }


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def format_multi_turn(report: dict[str, Any]) -> str:
    """The report as the recorded table (docs/benchmarks.md, "Prefix caching: multi-turn chat")."""
    s = report["settings"]
    load = report["load_average"]
    lines = [
        f"{s['model']} ({s['dtype']}): {s['conversations']} conversations x {s['turns']} turns, load average "
        f"{load['before'][0]:.1f} before, {load['after'][0]:.1f} after; replies identical in every variant: "
        f"{report['identical']}",
        "| variant | TTFT turn 1 p50 (ms) | TTFT turns >= 2 p50 (ms) | p99 (ms) | prefill tokens | cached tokens "
        "| host-tier tokens | wall (s) | compiles |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    summary = report["variants"]
    for n, med in summary.items():
        lines.append(
            f"| {n} | {_f(med['ttft_first_p50_ms'])} | {_f(med['ttft_later_p50_ms'])} | "
            f"{_f(med['ttft_later_p99_ms'])} | {med['prefill_tokens']:.0f} | {med['cached_tokens']:.0f} | "
            f"{med['host_hits']:.0f} | {med['wall_s']:.2f} | {med['compiles']:.0f} |"
        )

    def ratio(a: str, b: str) -> float | None:
        x, y = summary[a]["ttft_later_p50_ms"], summary[b]["ttft_later_p50_ms"]
        return None if x is None or not y else x / y

    if "off" in summary and "on" in summary and ratio("off", "on") is not None:
        lines.append(f"turns >= 2 TTFT p50, off / on: {ratio('off', 'on'):.2f}x")
    if "small" in summary and "host" in summary and ratio("small", "host") is not None:
        lines.append(
            "turns >= 2 TTFT p50, small device cache without / with the host tier: "
            f"{ratio('small', 'host'):.2f}x"
        )
    lines.append(f"compilations in the warm-up: {report['warmup_compiles']}")
    if report["mismatch"] is not None:
        lines.append(f"MISMATCH: {report['mismatch']}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- long prompts


def consumer_cost(llm: Any) -> float:
    """Estimated FLOPs of one row through the YOCO consumer layers (0.0 for a model without them)."""
    import jax

    cfg = llm.model.config
    paged = llm.paged_model
    experts = getattr(cfg, "n_routed_experts", None)
    share = cfg.num_experts_per_tok / experts if experts else 1.0
    total = 0.0
    for lp, layer in zip(paged.layers, llm.model.params["layers"], strict=True):
        if not getattr(lp, "yoco_consumer", False):
            continue
        for path, leaf in jax.tree_util.tree_flatten_with_path(layer)[0]:
            name = jax.tree_util.keystr(path)
            size = float(np.prod(getattr(leaf, "shape", ()) or (1,)))
            total += 2 * size * (share if "experts" in name and "shared" not in name else 1.0)
        total += 4 * paged.window * cfg.num_attention_heads * cfg.head_dim
    return total


def long_prompt_engines(
    model: str = "tiny-v41",
    modes: Sequence[str] = ("off", "compact"),
    *,
    chunk: int = 1024,
    keep_tokens: int = 140,
    dtype: str = "float32",
    max_num_seqs: int = 1,
    num_draft_tokens: int | None = 0,
    speculative_variable_length: bool | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One ``LLM`` per truncation mode, prefix caching off (every run prefills its whole prompt)."""
    from deepinfer_jax import LLM

    names = check_names("modes", modes, LONG_PROMPT_MODES)
    common: dict[str, Any] = dict(
        dtype=dtype,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=chunk,
        num_draft_tokens=num_draft_tokens,
        speculative_variable_length=speculative_variable_length,
        enable_prefix_caching=False,
        **dict(overrides or {}),
    )
    engines = {}
    for n in names:
        truncation = {}
        if n != "off":
            truncation = {"scheduler.yoco_truncation": n, "scheduler.yoco_keep_tokens": keep_tokens}
        engines[n] = LLM(model, **common, **truncation)
    return engines


@contextmanager
def _count_consumer_rows(llm: Any, mode: str, keep: int) -> Iterator[list[int]]:
    """Counts, per dispatched step, the rows the consumer layers run on (``[rows, steps]``), from the step's
    buckets: ``T`` per device, ``min(T, S * keep)`` with ``compact`` (module docstring). Wraps the runner's
    ``_dispatch`` as an instance attribute, removed afterwards (as :class:`~deepinfer_jax.bench.runner.StepTimer`)."""
    runner = llm.runner
    original = runner._dispatch
    counts = [0, 0]

    def dispatch(plan: Any) -> Any:
        tokens, seqs = plan.bucket
        rows = min(tokens, seqs * keep) if mode == "compact" else tokens
        counts[0] += rows * plan.num_devices
        counts[1] += 1
        return original(plan)

    runner._dispatch = dispatch
    try:
        yield counts
    finally:
        del runner._dispatch


def run_long_prompts(
    model: str = "tiny-v41",
    *,
    prompt_lens: Sequence[int] = (1024, 2048, 4095),
    chunk: int = 1024,
    keep_tokens: int = 140,
    repeats: int = 5,
    warmup: int = 1,
    modes: Sequence[str] | None = None,
    dtype: str = "float32",
    max_num_seqs: int = 1,
    num_draft_tokens: int | None = 0,
    speculative_variable_length: bool | None = None,
    overrides: Mapping[str, Any] | None = None,
    seed: int = 0,
    engines: Mapping[str, Any] | None = None,
    log: Log | None = None,
) -> dict[str, Any]:
    """The long-prompt benchmark (module docstring); returns the JSON-able report.

    The default 4095 is tiny-v41's longest prompt with one sampled token (``max_position_embeddings`` 4096).
    ``engines`` (mode -> ``LLM``, e.g. from :func:`long_prompt_engines`) reuses engines built before. ``modes``
    unset: off and compact, or those of ``engines``.
    """
    from deepinfer_jax import SamplingParams

    say = log or (lambda _msg: None)
    lens = [int(n) for n in prompt_lens]
    if not lens or min(lens) < 1:
        raise ValueError(f"prompt_lens: {lens!r}; expected one or more positive lengths")
    for name, value, low in (("repeats", repeats, 1), ("warmup", warmup, 0), ("chunk", chunk, 1)):
        if value < low:
            raise ValueError(f"{name}: {value}; must be >= {low}")
    if modes is None:
        modes = ("off", "compact") if engines is None else [n for n in LONG_PROMPT_MODES if n in engines]
    names = check_names("modes", modes, LONG_PROMPT_MODES)
    load_before = _load()
    if engines is None:
        engines = long_prompt_engines(
            model,
            names,
            chunk=chunk,
            keep_tokens=keep_tokens,
            dtype=dtype,
            max_num_seqs=max_num_seqs,
            num_draft_tokens=num_draft_tokens,
            speculative_variable_length=speculative_variable_length,
            overrides=overrides,
        )
    else:
        missing = [n for n in names if n not in engines]
        if missing:
            raise ValueError(f"engines: no engine for the modes {missing}")
    cost = consumer_cost(engines[names[0]])
    vocab = engines[names[0]].model.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = np.random.default_rng(seed)
    base = "off" if "off" in names else names[0]
    rows_out: list[dict[str, Any]] = []
    compiles = dict.fromkeys(names, 0)
    warm_compiles = dict.fromkeys(names, 0)
    for length in lens:
        prompt = [{"prompt_token_ids": rng.integers(3, min(500, vocab), size=length).tolist()}]
        times: dict[str, list[float]] = {m: [] for m in names}
        measured: dict[str, dict[str, int]] = {}
        for m in names:
            before = engines[m].executor.compile_count
            for _ in range(warmup):
                engines[m].generate(prompt, params, use_tqdm=False)  # compile / warm up
            warm_compiles[m] += engines[m].executor.compile_count - before
        for r in range(repeats):
            for m in names if r % 2 == 0 else names[::-1]:
                llm = engines[m]
                before_compiles = llm.executor.compile_count
                before_prefill = llm.scheduler.stats.num_prefill_tokens
                with _count_consumer_rows(llm, m, keep_tokens) as counts:
                    start = time.perf_counter()
                    out = llm.generate(prompt, params, use_tqdm=False)
                    times[m].append(time.perf_counter() - start)
                if out[0].outputs[0].finish_reason == "error":
                    raise RuntimeError(f"prompt of {length} tokens ({m}): {out[0].outputs[0].error}")
                compiles[m] += llm.executor.compile_count - before_compiles
                measured[m] = {
                    "consumer_rows": counts[0] if cost > 0 else 0,
                    "steps": counts[1],
                    "prefill_tokens": llm.scheduler.stats.num_prefill_tokens - before_prefill,
                }
        base_s = statistics.median(times[base])
        for m in names:
            med = statistics.median(times[m])
            rows_out.append(
                {
                    "prompt_len": length,
                    "mode": m,
                    "seconds_median": med,
                    "seconds": times[m],
                    "prefill_tokens_per_s": length / med,
                    **measured[m],
                    "consumer_gflops": measured[m]["consumer_rows"] * cost / 1e9,
                    "speedup": base_s / med,
                }
            )
            say(f"{length} tokens, {m}: {length / med:.0f} prefill tokens/s")
    return {
        "workload": "long_prompts",
        "settings": {
            "model": model,
            "prompt_lens": lens,
            "chunk": chunk,
            "keep_tokens": keep_tokens,
            "repeats": repeats,
            "warmup": warmup,
            "modes": names,
            "dtype": dtype,
            "max_num_seqs": max_num_seqs,
            "num_draft_tokens": num_draft_tokens,
            "speculative_variable_length": speculative_variable_length,
            "overrides": dict(overrides or {}),
            "seed": seed,
        },
        "machine": _machine(),
        "load_average": {"before": load_before, "after": _load()},
        "consumer_cost_flops_per_row": cost,
        "speedup_base": base,
        "warmup_compiles": warm_compiles,
        "compiles": compiles,
        "results": rows_out,
    }


def format_long_prompts(report: dict[str, Any]) -> str:
    """The report as the recorded table (docs/benchmarks.md, "SWA bounded replay")."""
    s = report["settings"]
    load = report["load_average"]
    lines = [
        f"{s['model']} ({s['dtype']}), {s['chunk']}-token chunks, keep {s['keep_tokens']}: load average "
        f"{load['before']} before, {load['after']} after, cores {report['machine']['cpu_count']}, per-row "
        f"consumer cost {report['consumer_cost_flops_per_row']:.3e} FLOPs",
        f"| prompt | mode | prefill tok/s (median) | consumer rows | consumer GFLOPs (est.) | speedup vs "
        f"{report['speedup_base']} |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['prompt_len']} | {r['mode']} | {r['prefill_tokens_per_s']:.0f} | {r['consumer_rows']} | "
            f"{r['consumer_gflops']:.2f} | {r['speedup']:.2f}x |"
        )
    lines.append(
        f"compilations: {report['warmup_compiles']} in the warm-up, {report['compiles']} in the measured runs"
    )
    return "\n".join(lines)
