"""``scripts/bench_kernels.py --smoke`` runs on the CPU (kernels interpreted) and reports every kernel."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_kernels.py"


def test_bench_smoke_runs_and_checks_every_kernel():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--cases", "decode"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("decode")]
    assert [line.split()[1] for line in lines] == [
        "mxfp4_grouped_swiglu",
        "mxfp4_grouped_linear",
        "swiglu",
        "fp8_block_linear",
        "v4_sparse_attention",
        "v4_indexer_topk",
        "v4_compress_store",
        "paged_mla[bf16]",
        "paged_mla[fp8]",
        "mhc_sinkhorn",
        "sample_tokens",
        "verify_tokens",
        "draft_tokens",
    ]
    # decode attention lines report the bytes moved and the achieved bandwidth
    assert all(
        "bw=" in line for line in lines if line.split()[1].startswith(("v4_sparse", "v4_indexer", "paged"))
    )
    assert all("xla/kernel=" in line for line in lines)
    assert "all kernels match their references" in done.stdout


def test_bench_full_refuses_without_a_gpu():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert done.returncode == 2 and "needs a GPU" in done.stderr
