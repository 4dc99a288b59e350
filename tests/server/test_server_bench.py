"""The request-rate benchmark against the server (``deepinfer-jax bench --url``): the same requests and seeds as an
in-process run, so the tokens a server run reports are the offline engine's; the CLI writes the usual report."""

from __future__ import annotations

import json

from server_helpers import offline_generate  # tests/server/server_helpers.py

from deepinfer_jax.bench.runner import HTTPBench
from deepinfer_jax.bench.workload import LengthDist, Workload
from deepinfer_jax.cli import main as cli
from deepinfer_jax.engine.llm import derive_seed
from deepinfer_jax.engine.params import SamplingParams


def test_http_bench_sends_the_in_process_requests(server, engine):
    workload = Workload(
        num_requests=5,
        prompt_len=LengthDist("uniform", 4, 12),
        output_len=LengthDist("uniform", 2, 7),
        temperature=1.0,
        top_k=50,
        seed=9,
        request_rate=40.0,
    )
    bench = HTTPBench(workload, server.url)
    assert bench.served_model == "tiny-v3" and bench.vocab_size == engine.llm.model.config.vocab_size
    run = bench.run()
    params = [
        SamplingParams(
            temperature=1.0, top_k=50, max_tokens=r.max_tokens, seed=derive_seed(9, i), ignore_eos=True
        )
        for i, r in enumerate(bench.requests)
    ]
    ref = offline_generate(engine, [list(r.prompt_token_ids) for r in bench.requests], params)
    assert run["token_ids"] == [o.outputs[0].token_ids for o in ref]
    assert run["metrics"]["output_tokens"] == sum(r.max_tokens for r in bench.requests)
    assert run["online"]["request_rate"] == 40.0 and run["online"]["drawn_request_rate"] > 0
    assert run["steps"] > 0  # read from the server's /metrics


def test_bench_cli_with_url(server, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = cli.main(
        [
            "deepinfer-jax",
            "bench",
            f"--url={server.url}",
            "--num_requests=3",
            "--prompt_len=5",
            "--output_len=4",
            "--warmup=0",
            "--repeats=1",
            f"--output={out}",
        ]
    )
    text, err = capsys.readouterr()
    assert rc == 0, err
    assert "TTFT ms" in text
    report = json.loads(out.read_text())
    assert report["server"] == {"url": server.url, "model": "tiny-v3"}
    assert report["engine"]["runs"][0]["metrics"]["output_tokens"] == 12
