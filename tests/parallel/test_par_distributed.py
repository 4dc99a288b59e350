"""Multi-process start-up from ``ParallelConfig``, and tiny-v3 expert-parallel across 2 processes x 4 devices.

Tolerance of the 2-process run against one device: the same as the single-process sharded forward
(``test_par_models.py``): identical greedy tokens, logits within ``atol = 5e-5`` (about ten times the largest
difference measured, which comes from XLA:CPU's GEMM blocking for a different number of rows per expert). The
two processes hold the same replicated logits, bit for bit (one computation, broadcast by XLA).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from deepinfer_jax.checkpoint.model_loading import load_model
from deepinfer_jax.config.tree import ParallelConfig
from deepinfer_jax.parallel import distributed

TOL = {"rtol": 1e-5, "atol": 5e-5}
WORKER = Path(__file__).with_name("distributed_worker.py")


def test_single_process_is_a_no_op():
    assert distributed.initialize(ParallelConfig()) is False
    assert distributed.initialize(ParallelConfig(num_processes=1, process_id=0)) is False
    assert distributed.is_multi_process(ParallelConfig(num_processes=2, process_id=1))
    assert not distributed.is_multi_process(ParallelConfig(data_parallel_size=2))


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"coordinator_address": "localhost:1234"}, ValueError, "num_processes is not"),
        ({"num_processes": 2, "process_id": 0}, ValueError, "needs parallel.coordinator_address"),
        (
            {"num_processes": 2, "coordinator_address": "localhost:1234"},
            ValueError,
            "needs parallel.process_id",
        ),
        (
            {"num_processes": 2, "process_id": 1, "coordinator_address": "localhost"},
            ValueError,
            "'host:port'",
        ),
        (
            {"num_processes": 2, "process_id": 1, "coordinator_address": "h:70000"},
            ValueError,
            r"\[1, 65535\]",
        ),
    ],
)
def test_bad_settings_are_refused_before_anything_starts(kwargs, error, match):
    with pytest.raises(error, match=match):
        distributed.initialize(ParallelConfig(**kwargs))


def test_refuses_other_types():
    with pytest.raises(TypeError, match="expected a ParallelConfig"):
        distributed.initialize({"num_processes": 2})


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def test_two_processes_match_one_device(tmp_path):
    model = load_model("tiny-v3")  # also materialises the checkpoint before the workers read it
    ids = np.random.default_rng(3).integers(0, model.config.vocab_size, (2, 3)).astype(np.int32)
    want = model.logits(ids)
    ids_path = tmp_path / "ids.npy"
    np.save(ids_path, ids)

    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(pid), str(port), str(tmp_path), str(ids_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in range(2)
    ]
    logs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=240)
            logs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for pid, (proc, log) in enumerate(zip(procs, logs, strict=True)):
        assert proc.returncode == 0, f"process {pid} exited with {proc.returncode}:\n{log[-4000:]}"

    got = [np.load(tmp_path / f"logits_{pid}.npy") for pid in range(2)]
    np.testing.assert_array_equal(got[0], got[1])
    for logits in got:
        np.testing.assert_array_equal(logits.argmax(-1), want.argmax(-1))
        np.testing.assert_allclose(logits, want, **TOL)
