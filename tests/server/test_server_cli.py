"""`deepinfer-jax serve` as a user runs it, in its own process: start-up prints the model and the URL (on
127.0.0.1 unless told otherwise), the API key comes from ``DEEPINFER_API_KEY``, and Ctrl-C (SIGINT) lets the
running request finish, refuses new connections and exits with status 0."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx2

KV_CACHE_MEMORY = 24 * 4 * 16 * 96 * 4 + 17 * 4 * 513  # tests/cli/test_cli_bench.py's engine shape
SERVE = [
    sys.executable,
    "-c",
    "from deepinfer_jax.cli.main import run; run()",
    "serve",
    "--model=tiny-v3",
    "--dtype=float32",
    "--max_num_seqs=16",
    "--max_num_batched_tokens=64",
    f"--kv_cache_memory={KV_CACHE_MEMORY}",
    "--set=cache.block_size=16",
    "--port=0",
    "--drain_timeout_s=120",
]


def test_serve_prints_its_url_and_drains_on_ctrl_c():
    env = {**os.environ, "DEEPINFER_API_KEY": "sk-cli", "JAX_PLATFORMS": "cpu"}
    root = Path(__file__).parents[2]
    proc = subprocess.Popen(
        SERVE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=root
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            match = re.search(
                r"model 'tiny-v3' at (http://127\.0\.0\.1:\d+)/v1 \(an API key is required", line
            )
            if match:
                url = match.group(1)
                break
        else:
            raise AssertionError("serve exited before it was ready:\n" + "".join(lines))
        headers = {"Authorization": "Bearer sk-cli"}
        assert httpx2.get(f"{url}/v1/models").status_code == 401
        body = {"model": "tiny-v3", "prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True, "stream": True}
        first = threading.Event()
        got: dict = {"finish": None}

        def client() -> None:
            with httpx2.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=300) as r:
                for raw in r.iter_lines():
                    if not raw.startswith("data: {"):
                        continue
                    for choice in json.loads(raw[6:])["choices"]:
                        got["finish"] = choice["finish_reason"] or got["finish"]
                        first.set()

        thread = threading.Thread(target=client)
        thread.start()
        assert first.wait(300)
        proc.send_signal(signal.SIGINT)  # Ctrl-C while the request runs
        thread.join(300)
        assert got["finish"] == "length"  # it finished: drained, not cut
        assert proc.wait(120) == 0
        rest = proc.stdout.read()
        assert "deepinfer-jax serve: stopped" in rest
        try:
            httpx2.get(f"{url}/health", timeout=5)
            raise AssertionError("the server still answers after it stopped")
        except httpx2.ConnectError:
            pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
