"""Run a :class:`~deepinfer_jax.bench.workload.Workload` through the engine, optionally alternating with a
baseline process, and collect the metrics.

**Host vs device time.** The engine's runner does not report per-step timings itself, so the harness measures
them from outside while a run is timed: it wraps the runner's schedule, dispatch and output-processing calls of
the :class:`~deepinfer_jax.engine.LLM` under test (instance attributes only, removed afterwards). *Host* time is
scheduling, building and dispatching a step and processing its tokens; *wait* is the time the host spends
blocked until a step's sampled tokens are ready, i.e. device time the host could not overlap. With the
runner's one-step-in-flight loop, device time proper is hidden behind host work and is not observable without
a profiler; "wait" is its visible part. If the runner lacks those calls (a different engine loop), the report
says ``"available": false``.

**Online workloads.** A workload with a ``request_rate`` is not run through ``generate``: its requests enter
the running engine at their arrival times (:mod:`deepinfer_jax.bench.online`), and each run also reports the
drawn and achieved request rates and how long arrivals waited for the host loop.

**A server** (``url``): :class:`HTTPBench` sends the same requests, with the same seeds and arrival times, to a
running server's ``/v1/completions`` as streaming requests (:mod:`deepinfer_jax.bench.http`) and measures them on
the client; the report has the same metrics (steps come from the server's ``/metrics`` when it has them; host and
device times and compile counts are not visible from outside).
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax

from deepinfer_jax import cache as cache_lib
from deepinfer_jax.bench.baseline import DEFAULT_SCRIPT, BaselineProcess, baseline_setup
from deepinfer_jax.bench.http import HTTPRequest, online_summary, run_requests, server_info
from deepinfer_jax.bench.metrics import RequestTiming, distribution, run_metrics
from deepinfer_jax.bench.online import run_online
from deepinfer_jax.bench.workload import Request, Workload
from deepinfer_jax.engine.llm import LLM, derive_seed
from deepinfer_jax.engine.params import RequestOutput, SamplingParams
from deepinfer_jax.engine.runner import RunStats, SpecCounters
from deepinfer_jax.models import builtin

__all__ = ["EngineBench", "HTTPBench", "ModelNotSupportedError", "StepTimer", "machine_info", "run_benchmark"]


class ModelNotSupportedError(RuntimeError):
    """The engine cannot serve this model, or this model on this mesh (yet); the message says which and why."""


class StepTimer:
    """Accumulates host and wait time of the runner's steps (see the module docstring).

    A decode-loop call (``scheduler.num_decode_steps > 1``) is one step of several decode iterations: the time
    its host thread spends blocked for the next iteration's outputs (a host callback's payload, or the finished
    call's) is wait, the rest host. ``iterations`` counts model steps (a one-token step is one, a loop call its
    iterations), so ``*_ms_per_iteration`` compares the one-token and the loop engine per token step."""

    def __init__(self) -> None:
        self.host_s = 0.0
        self.wait_s = 0.0
        self.steps = 0
        self.iterations = 0
        self.available = True

    @contextlib.contextmanager
    def attach(self, llm: LLM) -> Iterator[StepTimer]:
        runner = llm.runner
        names = ("_dispatch", "_process", "_finish")
        scheduler = llm.scheduler
        if not all(callable(getattr(runner, n, None)) for n in names) or not hasattr(scheduler, "schedule"):
            self.available = False
            yield self
            return
        originals = {n: getattr(runner, n) for n in names}
        loops = (getattr(runner, "loop_steps", 0), getattr(runner, "loop_iterations", 0))

        def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.host_s += time.perf_counter() - start

            return wrapper

        executor = getattr(runner, "executor", None)

        def dispatch(plan: Any) -> Any:
            self.steps += 1
            # A dispatch that waits for the decode loop still running (the executor's worker thread) waits for
            # the device: wait, not host.
            before = getattr(executor, "settle_seconds", 0.0)
            try:
                return timed(originals["_dispatch"])(plan)
            finally:
                blocked = getattr(executor, "settle_seconds", 0.0) - before
                self.wait_s += blocked
                self.host_s -= blocked

        def waited(items: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
            # A decode loop's iterations: every wait for the next one is device time the host could not hide.
            def wrapper(*args: Any, **kwargs: Any) -> Iterator[Any]:
                it = items(*args, **kwargs)
                while True:
                    start = time.perf_counter()
                    try:
                        item = next(it)
                    except StopIteration:
                        return
                    finally:
                        blocked = time.perf_counter() - start
                        self.wait_s += blocked
                        self.host_s -= blocked  # inside the timed _process
                    yield item

            return wrapper

        def process(plan: Any, out: Any) -> Any:
            looped = getattr(getattr(plan, "inputs", None), "loop", None) is not None
            if looped and callable(getattr(out, "items", None)):
                out.items = waited(out.items)  # a loop's iterations: waits for them are wait
            else:
                start = time.perf_counter()
                jax.block_until_ready(
                    out.tokens
                )  # the original reads the tokens first anyway: no change of order
                self.wait_s += time.perf_counter() - start
            return timed(originals["_process"])(plan, out)

        runner._dispatch, runner._process = dispatch, process
        runner._finish = timed(originals["_finish"])  # a split step's masks and sample half: host time
        scheduler.schedule = timed(scheduler.schedule)
        try:
            yield self
        finally:
            del runner._dispatch, runner._process, runner._finish
            del scheduler.schedule
            calls = getattr(runner, "loop_steps", 0) - loops[0]
            self.iterations = self.steps - calls + getattr(runner, "loop_iterations", 0) - loops[1]

    def to_dict(self) -> dict[str, Any]:
        if not self.available:
            return {
                "available": False,
                "reason": "the engine runner exposes no schedule/dispatch/process calls",
            }
        n = max(self.steps, 1)
        m = max(self.iterations, 1)
        return {
            "available": True,
            "steps": self.steps,
            "iterations": self.iterations,
            "host_ms_per_step": 1e3 * self.host_s / n,
            "wait_ms_per_step": 1e3 * self.wait_s / n,
            "host_ms_per_iteration": 1e3 * self.host_s / m,
            "wait_ms_per_iteration": 1e3 * self.wait_s / m,
            "host_seconds": self.host_s,
            "wait_seconds": self.wait_s,
        }


def machine_info() -> dict[str, Any]:
    """Where the numbers were measured."""
    dev = jax.devices()[0]
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "device": f"{dev.platform}:{getattr(dev, 'device_kind', '')}",
        "num_devices": jax.device_count(),
    }


class EngineBench:
    """An engine built for one workload; :meth:`run` times one pass over the workload's requests."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        w = workload
        try:
            self.llm = LLM(
                w.model,
                dtype=w.dtype,
                max_num_seqs=w.max_num_seqs,
                max_num_batched_tokens=w.max_num_batched_tokens,
                kv_cache_memory=w.kv_cache_memory,
                kv_cache_dtype=w.kv_cache_dtype,
                max_model_len=w.max_model_len,
                batch_invariant=w.batch_invariant,
                seed=w.seed,
                data_parallel_size=w.data_parallel_size,
                expert_parallel_size=w.expert_parallel_size,
                num_draft_tokens=w.num_draft_tokens,
                speculative_variable_length=w.speculative_variable_length,
                **w.engine_overrides,
            )
        except NotImplementedError as err:
            mesh = ""
            if w.data_parallel_size * w.expert_parallel_size > 1:
                mesh = (
                    f" on a mesh of data_parallel_size={w.data_parallel_size} x "
                    f"expert_parallel_size={w.expert_parallel_size}"
                )
            raise ModelNotSupportedError(
                f"model {w.model!r}{mesh} is not supported by the engine yet: {err}"
            ) from err
        cfg = self.llm.model.config
        self.requests: list[Request] = w.requests(cfg.vocab_size)
        self.compile_count = 0
        self.compile_seconds = 0.0
        self.compile_cache_hits = 0

    def model_dir(self) -> str:
        """The model folder (what a baseline loads)."""
        w = self.workload.model
        return str(builtin.materialize(w) if builtin.is_builtin(w) else w)

    def kv_bytes(self) -> dict[str, float]:
        """KV bytes per token: the production formats (FP8 / FP4 records with their scales, or V3's bf16 latent;
        all layers, and with MTP/draft layers) and, apart, what this run's paged cache stores per cached token in
        its precision mode (per-sequence state slots, e.g. V4's sliding window, counted per sequence instead)."""
        cfg = self.llm.model.config
        spec = self.llm.memory_plan.spec
        return {
            "production_format": float(cache_lib.kv_bytes_per_token(cfg)),
            "production_format_with_draft_layers": float(
                cache_lib.kv_bytes_per_token(cfg, num_draft_layers=cfg.num_nextn_predict_layers or 0)
            ),
            "production_record_formats": cache_lib.describe_record_formats(cfg),
            "engine_cache": float(spec.bytes_per_token),
            "engine_cache_dtype": spec.dtype,
            "engine_state_bytes_per_seq": float(spec.layout.bytes_per_slot),
        }

    def _params(self, max_tokens: int) -> SamplingParams:
        w = self.workload
        return SamplingParams(
            temperature=w.temperature,
            top_p=w.top_p,
            top_k=w.top_k,
            max_tokens=max_tokens,
            ignore_eos=w.ignore_eos,
        )

    def run(self, *, measure_steps: bool = True) -> dict[str, Any]:
        """One pass over the workload's requests: every batch through ``generate`` or, for an online workload,
        every request entering the running engine at its arrival time. Returns metrics, step timing, compile
        counts and the generated tokens (in request order), and for an online run its request rates."""
        timer = StepTimer()
        outputs: list[RequestOutput] = []
        steps = compiles = hits = 0
        compile_s = 0.0
        wall = 0.0
        online: dict[str, Any] | None = None
        w = self.workload
        balancer = self.llm.expert_balancer
        if balancer is not None:
            moe_start = (balancer.total_peak, balancer.total_mean, balancer.rearrangements)
        spec_start = self.llm.runner.spec_counters()
        loop_start = (self.llm.runner.loop_steps, self.llm.runner.loop_iterations)
        ctx = timer.attach(self.llm) if measure_steps else contextlib.nullcontext(timer)
        with ctx:
            if w.online:
                result = run_online(
                    self.llm,
                    [list(r.prompt_token_ids) for r in self.requests],
                    [self._params(r.max_tokens) for r in self.requests],
                    w.arrival_times(),
                )
                outputs = result.outputs
                wall = result.wall_seconds
                steps, compiles, compile_s, hits = (
                    result.stats.steps,
                    result.stats.compile_count,
                    result.stats.compile_seconds,
                    result.stats.compile_cache_hits,
                )
                online = result.summary(w.request_rate, w.burstiness)
            else:
                for batch in w.batches(self.requests):
                    params = [self._params(r.max_tokens) for r in batch]
                    start = time.perf_counter()
                    outputs += self.llm.generate(
                        prompt_token_ids=[list(r.prompt_token_ids) for r in batch],
                        sampling_params=params,
                        use_tqdm=False,
                    )
                    wall += time.perf_counter() - start
                    stats = self.llm.last_stats
                    assert stats is not None
                    steps += stats.steps
                    compiles += stats.compile_count
                    compile_s += stats.compile_seconds
                    hits += stats.compile_cache_hits
        for o in outputs:
            if o.outputs[0].finish_reason == "error":
                # A failed request would make every number of the run meaningless: stop here.
                raise RuntimeError(f"request {o.request_id} failed: {o.outputs[0].error}")
        self.compile_count += compiles
        self.compile_seconds += compile_s
        self.compile_cache_hits += hits
        metrics = run_metrics([RequestTiming.from_output(o) for o in outputs], wall)
        run: dict[str, Any] = {
            "metrics": metrics.to_dict(),
            "steps": steps,
            "compile_count": compiles,
            "compile_seconds": compile_s,
            "compile_cache_hits": hits,
            "step_timing": timer.to_dict()
            if measure_steps
            else {"available": False, "reason": "not measured"},
        }
        if online is not None:
            run["online"] = online
        if balancer is not None:
            peak, mean = balancer.total_peak - moe_start[0], balancer.total_mean - moe_start[1]
            run["moe"] = {
                "moe_lb": peak / mean if mean > 0 else None,
                "eplb_rearrangements": balancer.rearrangements - moe_start[2],
            }
        run["decode_loop"] = {
            "num_decode_steps": getattr(self.llm, "num_decode_steps", 1),
            "calls": self.llm.runner.loop_steps - loop_start[0],
            "iterations": self.llm.runner.loop_iterations - loop_start[1],
        }
        run["speculative"] = _spec_summary(
            self.llm.num_draft_tokens, self.llm.runner.spec_counters().since(spec_start)
        )
        run["token_ids"] = [list(o.outputs[0].token_ids) for o in outputs]
        return run


def _spec_summary(num_draft_tokens: int, counts: SpecCounters) -> dict[str, Any]:
    """A run's speculative-decoding metrics (docs/speculative.md, "metrics"): ``RunStats``'s, from the
    scheduler's counters over the run."""
    st = counts.record(RunStats())
    return {
        "num_draft_tokens": num_draft_tokens,
        "decode_rows": st.spec_rows,
        "verified_at": list(st.verified_at),
        "accepted_at": list(st.accepted_at),
        "acceptance_rates": list(st.acceptance_rates),
        "verified_per_step": st.verified_per_step,
        "mean_accepted_length": st.mean_accepted_length,
        "confidence_error": st.confidence_error,
    }


def _server_steps(url: str, api_key: str | None) -> float | None:
    """The server's ``deepinfer_engine_steps_total`` (``None`` when it does not report it)."""
    import httpx2

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        text = httpx2.get(f"{url}/metrics", headers=headers, timeout=10.0).text
    except httpx2.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("deepinfer_engine_steps_total "):
            return float(line.split()[1])
    return None


class HTTPBench:
    """A workload sent to a running server (``bench --url``); :meth:`run` times one pass, like
    :meth:`EngineBench.run`.

    Request ``i`` carries the seed an in-process run gives it (``derive_seed(workload.seed, i)``), so a server
    running the same model samples the same tokens.
    """

    def __init__(self, workload: Workload, url: str, api_key: str | None = None) -> None:
        self.workload = workload
        self.url = url.rstrip("/")
        self.api_key = api_key
        info = server_info(self.url, api_key)
        self.served_model = str(info["id"])
        vocab = info.get("vocab_size")
        if not isinstance(vocab, int):
            raise ValueError(
                f"{url}: the server does not report its vocab_size in /v1/models, which the workload's random "
                "prompts need (a deepinfer-jax server does)"
            )
        self.vocab_size = vocab
        self.requests: list[Request] = workload.requests(vocab)
        self.compile_count = 0
        self.compile_seconds = 0.0
        self.compile_cache_hits = 0

    def run(self, *, measure_steps: bool = True) -> dict[str, Any]:
        w = self.workload
        requests = [
            HTTPRequest(
                r.prompt_token_ids,
                r.max_tokens,
                seed=derive_seed(w.seed, i),
                temperature=w.temperature,
                top_p=w.top_p,
                top_k=w.top_k,
                ignore_eos=w.ignore_eos,
            )
            for i, r in enumerate(self.requests)
        ]
        steps_before = _server_steps(self.url, self.api_key)
        results, start, end = run_requests(
            self.url, self.served_model, requests, arrivals=w.arrival_times(), api_key=self.api_key
        )
        steps_after = _server_steps(self.url, self.api_key)
        for r in results:
            if not r.complete or r.first_token is None or r.finished is None:
                raise RuntimeError(f"request {r.index} failed: {r.error or r.finish_reason or 'no finish'}")
        timings = [
            RequestTiming(
                r.due,
                r.first_token,
                r.finished,
                len(self.requests[r.index].prompt_token_ids),
                len(r.token_ids),
            )
            for r in results
        ]
        metrics = run_metrics(timings, end - start)
        steps = None if steps_before is None or steps_after is None else steps_after - steps_before
        run: dict[str, Any] = {
            "metrics": metrics.to_dict(),
            "steps": steps,
            "compile_count": 0,
            "compile_seconds": 0.0,
            "compile_cache_hits": 0,
            "step_timing": {
                "available": False,
                "reason": "a server run: its steps are not visible to the client",
            },
            "token_ids": [r.token_ids for r in results],
        }
        if w.online:
            run["online"] = online_summary(results, start, end, w.request_rate, w.burstiness)
        return run


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def run_benchmark(
    workload: Workload,
    *,
    baseline_python: str | None = None,
    baseline_script: str | os.PathLike[str] | None = None,
    baseline_threads: int = 2,
    log: Callable[[str], None] | None = None,
    url: str | None = None,
    api_key: str | None = None,
) -> dict[str, Any]:
    """Warm up, then ``workload.repeats`` measured engine runs, each followed by a baseline run when
    ``baseline_python`` is given; returns the JSON-able report.

    Raises :class:`ModelNotSupportedError` for a model (or mesh) the engine does not serve yet, and
    ``ValueError`` for a baseline with an online workload (the baseline runs offline batches only).
    """
    if baseline_python is not None and workload.online:
        raise ValueError(
            f"baseline_python: the baseline runs offline batches and cannot be paced; it cannot be compared with "
            f"an online workload (request_rate = {workload.request_rate} requests/s); drop one of them"
        )
    if baseline_python is not None and url is not None:
        raise ValueError(
            "baseline_python: a baseline runs beside the in-process engine, not beside a server (url)"
        )
    say = log or (lambda _msg: None)
    bench: EngineBench | HTTPBench
    if url is not None:
        bench = HTTPBench(workload, url, api_key)
        report: dict[str, Any] = {
            "workload": workload.to_dict(),
            "machine": machine_info(),
            "server": {"url": bench.url, "model": bench.served_model},
            "kv_bytes_per_token": None,
        }
    else:
        bench = EngineBench(workload)
        report = {
            "workload": workload.to_dict(),
            "machine": machine_info(),
            "kv_bytes_per_token": bench.kv_bytes(),
        }
    warm_start = time.perf_counter()
    for i in range(workload.warmup):
        bench.run(measure_steps=False)
        say(f"engine warm-up {i + 1}/{workload.warmup} done")
    report["warmup"] = {
        "runs": workload.warmup,
        "seconds": time.perf_counter() - warm_start,
        "compile_count": bench.compile_count,
        "compile_seconds": bench.compile_seconds,
        "compile_cache_hits": bench.compile_cache_hits,
        "compile_cache_dir": getattr(getattr(bench, "llm", None), "compile_cache_dir", None),
    }
    baseline = None
    if baseline_python is not None:
        assert isinstance(bench, EngineBench)
        say(f"starting baseline {baseline_script or DEFAULT_SCRIPT} with {baseline_python}")
        setup = baseline_setup(
            bench.model_dir(),
            [r.prompt_token_ids for r in bench.requests],
            [r.max_tokens for r in bench.requests],
            batch_size=workload.batch_size,
            dtype=workload.dtype,
            threads=baseline_threads,
            warmup=workload.warmup,
        )
        baseline = BaselineProcess(baseline_python, setup, script=baseline_script or DEFAULT_SCRIPT)
    engine_runs: list[dict[str, Any]] = []
    baseline_runs: list[dict[str, Any]] = []
    try:
        for i in range(workload.repeats):
            run = bench.run()
            engine_runs.append(run)
            m = run["metrics"]
            say(f"engine run {i + 1}/{workload.repeats}: {m['output_tokens_per_s']:.1f} output tokens/s")
            if baseline is not None:
                b = baseline.run()
                baseline_runs.append(
                    {
                        "seconds": b.seconds,
                        "input_tokens": b.input_tokens,
                        "output_tokens": b.output_tokens,
                        "output_tokens_per_s": b.output_tokens_per_s,
                        "input_tokens_per_s": b.input_tokens / b.seconds,
                        "token_ids": b.token_ids,
                    }
                )
                say(f"baseline run {i + 1}/{workload.repeats}: {b.output_tokens_per_s:.1f} output tokens/s")
    finally:
        if baseline is not None:
            baseline.close()
    tokens = engine_runs[-1]["token_ids"]
    for run in engine_runs:
        run.pop("token_ids")
    report["engine"] = {"runs": engine_runs, "summary": _engine_summary(engine_runs)}
    if baseline is not None:
        last = baseline_runs[-1]["token_ids"]
        for run in baseline_runs:
            run.pop("token_ids")
        ratios = [
            e["metrics"]["output_tokens_per_s"] / b["output_tokens_per_s"]
            for e, b in zip(engine_runs, baseline_runs)
        ]
        report["baseline"] = {
            "info": baseline.info,
            "runs": baseline_runs,
            "summary": {
                "output_tokens_per_s": _median([b["output_tokens_per_s"] for b in baseline_runs]),
                "best_output_tokens_per_s": max(b["output_tokens_per_s"] for b in baseline_runs),
                "input_tokens_per_s": _median([b["input_tokens_per_s"] for b in baseline_runs]),
                "seconds": _median([b["seconds"] for b in baseline_runs]),
            },
        }
        best_engine = max(e["metrics"]["output_tokens_per_s"] for e in engine_runs)
        best_baseline = max(b["output_tokens_per_s"] for b in baseline_runs)
        report["ratio"] = {
            "output_tokens_per_s": _median(ratios),
            "per_pair": ratios,
            "best_runs": best_engine / best_baseline,
            "definition": "engine / baseline output tokens/s: the median over alternated pairs, and the ratio of "
            "the fastest run of each side (the least disturbed by other load on the machine)",
        }
        report["token_agreement"] = _agreement(tokens, last)
    return report


def _engine_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str, sub: str | None = None) -> float | None:
        vals = []
        for r in runs:
            v = r["metrics"][key]
            if sub is not None:
                v = None if v is None else v[sub]
            if v is not None:
                vals.append(v)
        return _median(vals)

    out: dict[str, Any] = {
        "output_tokens_per_s": med("output_tokens_per_s"),
        "best_output_tokens_per_s": max(r["metrics"]["output_tokens_per_s"] for r in runs),
        "input_tokens_per_s": med("input_tokens_per_s"),
        "wall_seconds": med("wall_seconds"),
        "ttft_p50_s": med("ttft", "p50"),
        "ttft_p99_s": med("ttft", "p99"),
        "tpot_p50_s": med("tpot", "p50"),
        "tpot_p99_s": med("tpot", "p99"),
        "seq_tokens_per_s_p50": med("seq_tokens_per_s", "p50"),
        "steps": _median([r["steps"] for r in runs if r["steps"] is not None]),
        "compile_count": sum(r["compile_count"] for r in runs),
        "compile_seconds": sum(r["compile_seconds"] for r in runs),
        "compile_cache_hits": sum(r.get("compile_cache_hits", 0) for r in runs),
    }
    online = [r["online"] for r in runs if "online" in r]
    if online:
        for key in ("request_rate", "burstiness", "drawn_request_rate"):
            out[key] = online[0][key]  # the same draw in every run
        for key in ("achieved_request_rate", "request_throughput"):
            out[key] = _median([o[key] for o in online if o[key] is not None])
        out["admission_delay_p99_s"] = _median(
            [o["admission_delay"]["p99"] for o in online if o["admission_delay"] is not None]
        )
    timing = [r["step_timing"] for r in runs if r["step_timing"].get("available")]
    if timing:
        for key in ("host_ms_per_step", "wait_ms_per_step", "host_ms_per_iteration", "wait_ms_per_iteration"):
            values = [t[key] for t in timing if key in t]
            if values:
                out[key] = _median(values)
        out["iterations"] = _median([t.get("iterations", t["steps"]) for t in timing])
    return out


def _agreement(engine: list[list[int]], baseline: list[list[int]]) -> dict[str, Any]:
    """How many sequences agree token for token, and the mean length of the common prefix (greedy float32
    runs of the same weights should agree up to floating-point near-ties)."""
    same = sum(1 for a, b in zip(engine, baseline) if a == b)
    prefixes = []
    for a, b in zip(engine, baseline):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        prefixes.append(k)
    d = distribution(prefixes)
    return {
        "identical_sequences": same,
        "sequences": min(len(engine), len(baseline)),
        "common_prefix_mean": d.mean if d else 0.0,
    }
