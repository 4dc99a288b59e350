"""The scenario benchmarks (`deepinfer_jax.bench.scenarios`, `deepinfer-jax bench --workload multi_turn|long_prompts`
and the scripts wrapping them) on tiny settings: the library and the command line share one set of engines per
workload, so each engine compiles once."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from deepinfer_jax.bench import scenarios
from deepinfer_jax.cli import main as cli

SCRIPTS = Path(__file__).parents[2] / "scripts"

# Multi-turn: 3 conversations x 2 turns, one per generate call, 8-token messages and replies, 16-token blocks.
# A turn-2 prompt is 8 + 8 + 8 + 8 = 32 tokens: its first block (system prompt + first user message) is cached.
# The small device cache (4 blocks, 3 usable) cannot keep the first conversation's block while the other two
# run their first turn, so it goes to the host tier and comes back from it.
MT_ENGINE = dict(
    dtype="float32",
    block_size=16,
    small_blocks=4,
    host_memory=16 << 20,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    num_draft_tokens=0,
)
MT_VARIANTS = ("off", "on", "host")
MT_RUN = dict(conversations=3, turns=2, system_tokens=8, user_tokens=8, reply_tokens=8, group=1)
MT_FLAGS = [
    "--workload=multi_turn",
    "--model=tiny-v3",
    "--conversations=3",
    "--turns=2",
    "--system_tokens=8",
    "--user_tokens=8",
    "--reply_tokens=8",
    "--batch_size=1",
    "--small_blocks=4",
    "--host_memory=16MiB",
    "--variants=off,on,host",
    "--max_num_seqs=4",
    "--max_num_batched_tokens=64",
    "--set=cache.block_size=16",
]
# Long prompts: tiny-v41 (sliding window 16), 64-token chunks, K = 20: compact runs the consumer layers on
# min(64, 1 * 20) = 20 rows per step instead of 64.
LP_ENGINE = dict(chunk=64, keep_tokens=20, dtype="float32", max_num_seqs=1, num_draft_tokens=0)
LP_LENS = (48, 96)
LP_FLAGS = [
    "--workload=long_prompts",
    "--prompt_lens=48,96",
    "--keep_tokens=20",
    "--max_num_batched_tokens=64",
]


@pytest.fixture(scope="module")
def mt_engines():
    engines = scenarios.multi_turn_engines("tiny-v3", MT_VARIANTS, **MT_ENGINE)
    yield engines
    for llm in engines.values():
        llm.close()


@pytest.fixture(scope="module")
def lp_engines():
    engines = scenarios.long_prompt_engines("tiny-v41", ("off", "compact"), **LP_ENGINE)
    yield engines
    for llm in engines.values():
        llm.close()


def _reuse(monkeypatch, name, engines, seen):
    """The command line builds its engines through ``scenarios.<name>``: record the arguments it passes and hand
    it the fixture's engines (built with the arguments the test expects), so nothing compiles twice."""

    def build(model, variants, **kwargs):
        seen.update(kwargs, model=model, variants=list(variants))
        return {v: engines[v] for v in variants}

    monkeypatch.setattr(scenarios, name, build)


def test_multi_turn_cache_computes_less_and_replies_agree(mt_engines):
    report = scenarios.run_multi_turn("tiny-v3", **MT_RUN, repeats=2, warmup=1, engines=mt_engines)
    assert report["identical"] and report["mismatch"] is None
    v = report["variants"]
    # Without the cache every prompt token is computed: 3 x 16 on turn 1, 3 x 32 on turn 2.
    assert v["off"]["prefill_tokens_by_turn"] == [48, 96] and v["off"]["cached_tokens"] == 0
    # With it, each turn-2 prompt finds its first block cached.
    assert v["on"]["prefill_tokens"] < v["off"]["prefill_tokens"]
    assert v["on"]["cached_tokens_by_turn"][0] == 0 and v["on"]["cached_tokens_by_turn"][1] > 0
    assert v["on"]["prefill_tokens"] + v["on"]["cached_tokens"] == v["off"]["prefill_tokens"]
    # The small device cache evicted a block to the host tier, and it came back from there.
    assert v["host"]["host_hits"] > 0 and v["host"]["cached_tokens_by_turn"][1] > 0
    assert v["host"]["prefill_tokens"] < v["off"]["prefill_tokens"]
    assert all(len(report["runs"][n]) == 2 for n in MT_VARIANTS)
    assert set(report["warmup_compiles"]) == set(MT_VARIANTS)
    assert len(report["load_average"]["before"]) == 3 and report["machine"]["cpu_count"]
    table = scenarios.format_multi_turn(report)
    assert "replies identical in every variant: True" in table and "| host |" in table
    assert "turns >= 2 TTFT p50, off / on" in table


def test_multi_turn_through_the_command_line(mt_engines, monkeypatch, tmp_path, capsys):
    seen: dict = {}
    _reuse(monkeypatch, "multi_turn_engines", mt_engines, seen)
    out_json = tmp_path / "mt.json"
    rc = cli.main(["deepinfer-jax", "bench", *MT_FLAGS, "--repeats=1", "--warmup=0", f"--output={out_json}"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    # Flags not given take the recorded benchmark's values (float32, no drafts), given ones reach the engines.
    assert seen == {"model": "tiny-v3", "variants": list(MT_VARIANTS), "overrides": {}, **MT_ENGINE} | {
        "speculative_variable_length": None
    }
    assert "| on |" in out and f"report written to {out_json}" in out
    report = json.loads(out_json.read_text())
    assert report["workload"] == "multi_turn" and report["identical"]
    assert report["settings"]["group"] == 1 and report["settings"]["repeats"] == 1
    assert report["variants"]["on"]["prefill_tokens"] < report["variants"]["off"]["prefill_tokens"]

    # Replies that differ between the variants are an error (exit status 1), after the table.
    real = scenarios.run_conversations

    def altered(llm, *args):
        res = real(llm, *args)
        if llm is mt_engines["host"]:
            res["replies"][-1] = (*res["replies"][-1][:-1], -1)
        return res

    monkeypatch.setattr(scenarios, "run_conversations", altered)
    rc = cli.main(["deepinfer-jax", "bench", *MT_FLAGS, "--repeats=1", "--warmup=0"])
    out, err = capsys.readouterr()
    assert rc == 1 and "replies identical in every variant: False" in out
    assert "the replies differ between the variants: reply 5 of variant 'host' run 1" in err


def test_long_prompts_compact_computes_fewer_consumer_rows(lp_engines):
    report = scenarios.run_long_prompts(
        "tiny-v41", prompt_lens=LP_LENS, repeats=2, warmup=1, engines=lp_engines, **LP_ENGINE
    )
    assert report["consumer_cost_flops_per_row"] > 0
    assert report["compiles"] == {"off": 0, "compact": 0}  # the warm-up compiled every step
    rows = {(r["prompt_len"], r["mode"]): r for r in report["results"]}
    for n in LP_LENS:
        off, compact = rows[n, "off"], rows[n, "compact"]
        steps = -(-n // 64)
        assert off["steps"] == compact["steps"] == steps
        assert off["prefill_tokens"] == compact["prefill_tokens"] == n  # no prefix cache: all of it, each run
        assert off["consumer_rows"] == 64 * steps and compact["consumer_rows"] == 20 * steps
        assert compact["consumer_gflops"] < off["consumer_gflops"]
        assert off["speedup"] == 1.0 and off["prefill_tokens_per_s"] > 0 and len(off["seconds"]) == 2
    table = scenarios.format_long_prompts(report)
    assert "| 96 | compact |" in table and "consumer cost" in table


def test_long_prompts_through_the_command_line(lp_engines, monkeypatch, tmp_path, capsys):
    seen: dict = {}
    _reuse(monkeypatch, "long_prompt_engines", lp_engines, seen)
    out_json = tmp_path / "lp.json"
    rc = cli.main(["deepinfer-jax", "bench", *LP_FLAGS, "--repeats=1", f"--output={out_json}"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    # --model unset: tiny-v41; --max_num_batched_tokens is the chunk.
    assert seen == {"model": "tiny-v41", "variants": ["off", "compact"], "overrides": {}, **LP_ENGINE} | {
        "speculative_variable_length": None
    }
    report = json.loads(out_json.read_text())
    assert report["workload"] == "long_prompts" and report["settings"]["prompt_lens"] == [48, 96]
    rows = {(r["prompt_len"], r["mode"]): r["consumer_rows"] for r in report["results"]}
    assert rows[96, "compact"] < rows[96, "off"]
    assert "| 48 | off |" in out


@pytest.mark.parametrize(
    "args, named",
    [
        (["--workload=multi_turn", "--baseline_python=python"], "--baseline_python"),
        (["--workload=multi_turn", "--url=http://127.0.0.1:1"], "--url"),
        (["--workload=multi_turn", "--request_rate=2"], "--request_rate"),
        (
            ["--workload=multi_turn", "--output_len=8"],
            "--output_len does not apply to --workload multi_turn; use --reply_tokens",
        ),
        (["--workload=multi_turn", "--plot_dir=p"], "--plot_dir"),
        (["--workload=multi_turn", "--prompt_lens=48"], "--prompt_lens"),
        (["--workload=long_prompts", "--batch_size=2"], "--batch_size"),
        (
            ["--workload=long_prompts", "--prompt_len=48"],
            "--prompt_len does not apply to --workload long_prompts; use --prompt_lens",
        ),
        (["--workload=long_prompts", "--conversations=2"], "--conversations"),
        (["--model=tiny-v3", "--conversations=2"], "--conversations applies to --workload multi_turn only"),
        (["--model=tiny-v3", "--keep_tokens=20"], "--keep_tokens"),
        (["--workload=multi_turn", "--set=cache.host_memory=1"], "--set cache.host_memory"),
        (["--workload=long_prompts", "--set=scheduler.yoco_keep_tokens=20"], "use --keep_tokens"),
        (["--workload=multi_turn", "--variants=off,bogus"], "--variants"),
        (["--workload=multi_turn", "--host_memory=lots"], "--host_memory"),
        (["--workload=long_prompts", "--prompt_lens=1k"], "--prompt_lens"),
        (["--workload=long_prompts", "--small_blocks=1"], "small_blocks"),  # absl's bound, before anything
    ],
)
def test_flags_that_do_not_apply_are_refused(args, named, capsys, monkeypatch):
    def no_engines(*a, **k):
        raise AssertionError("a refused command built an engine")

    monkeypatch.setattr(scenarios, "multi_turn_engines", no_engines)
    monkeypatch.setattr(scenarios, "long_prompt_engines", no_engines)
    rc = cli.main(["deepinfer-jax", "bench", *args])
    assert rc == 2 and named in capsys.readouterr().err


def _script(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_scripts_are_wrappers_with_their_flags(monkeypatch, tmp_path, capsys):
    calls: dict = {}
    report = {"identical": False, "variants": {}}
    mt = _script("bench_prefix_cache")
    monkeypatch.setattr(mt, "run_multi_turn", lambda model, **kw: calls.update(kw, model=model) or report)
    monkeypatch.setattr(mt, "format_multi_turn", lambda r: "TABLE")
    out_json = tmp_path / "r.json"
    argv = ["x", "--model=tiny-v41", "--turns=3", "--group=2", "--block_size=32", "--variants=off,on"]
    monkeypatch.setattr(sys, "argv", [*argv, f"--json={out_json}"])
    assert mt.main() == 1  # the replies differ
    assert calls["model"] == "tiny-v41" and calls["turns"] == 3 and calls["group"] == 2
    assert calls["block_size"] == 32 and calls["variants"] == ["off", "on"] and calls["conversations"] == 16
    assert json.loads(out_json.read_text())["args"]["turns"] == 3
    lp = _script("bench_bounded_replay")
    monkeypatch.setattr(lp, "run_long_prompts", lambda model, **kw: calls.update(kw, model=model))
    monkeypatch.setattr(lp, "format_long_prompts", lambda r: "TABLE")
    monkeypatch.setattr(sys, "argv", ["x", "--runs", "3"])
    lp.main()
    assert calls["model"] == "tiny-v41" and calls["repeats"] == 3
    assert "TABLE" in capsys.readouterr().out
