"""Runs a worker script as the two processes of a localhost ``jax.distributed`` test (tests/engine, tests/parallel)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["run_two_processes"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def run_two_processes(worker: Path, args: Callable[[int, int], Sequence[object]], *, timeout: float) -> None:
    """Start ``worker`` twice, as process 0 and 1, with ``args(process_id, coordinator_port)`` on the command
    line and without this process's ``JAX_PLATFORMS`` / ``XLA_FLAGS`` (the worker sets its own); wait for both
    and fail with a process's log tail when it does not exit cleanly. A process still running at the end is
    killed."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), *map(str, args(pid, port))],
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
            logs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for pid, (proc, log) in enumerate(zip(procs, logs, strict=True)):
        assert proc.returncode == 0, f"process {pid} exited with {proc.returncode}:\n{log[-4000:]}"
