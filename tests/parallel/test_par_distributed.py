"""Multi-process start-up from ``ParallelConfig``, and tiny-v3 expert-parallel across 2 processes x 4 devices.

Tolerance of the 2-process run against one device: the same as the single-process sharded forward
(``test_par_models.py``): identical greedy tokens, logits within ``atol = 5e-5`` (about ten times the largest
difference measured, which comes from XLA:CPU's GEMM blocking for a different number of rows per expert). The
two processes hold the same replicated logits, bit for bit (one computation, broadcast by XLA).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from two_processes import run_two_processes  # tests/two_processes.py

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


def test_two_processes_match_one_device(tmp_path):
    model = load_model("tiny-v3")  # also materialises the checkpoint before the workers read it
    ids = np.random.default_rng(3).integers(0, model.config.vocab_size, (2, 3)).astype(np.int32)
    want = model.logits(ids)
    ids_path = tmp_path / "ids.npy"
    np.save(ids_path, ids)

    run_two_processes(WORKER, lambda pid, port: (pid, port, tmp_path, ids_path), timeout=240)

    got = [np.load(tmp_path / f"logits_{pid}.npy") for pid in range(2)]
    np.testing.assert_array_equal(got[0], got[1])
    for logits in got:
        np.testing.assert_array_equal(logits.argmax(-1), want.argmax(-1))
        np.testing.assert_allclose(logits, want, **TOL)
