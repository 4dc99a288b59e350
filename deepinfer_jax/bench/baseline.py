"""The harness side of a baseline process (see :mod:`deepinfer_jax.bench.hf_baseline` for the protocol).

The baseline runs in its own interpreter (``--baseline_python``: a venv with torch), started once; each
:meth:`BaselineProcess.run` asks it for one measured pass and waits for the answer, so the harness can
alternate engine and baseline runs and machine noise falls on both. Its stderr goes to a temporary file and its
tail is quoted when something fails.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_SCRIPT", "BaselineError", "BaselineProcess", "BaselineRun", "baseline_setup"]

DEFAULT_SCRIPT = Path(__file__).with_name("hf_baseline.py")
"""The shipped transformers baseline."""


class BaselineError(RuntimeError):
    """The baseline process failed, answered out of protocol, or timed out."""


class BaselineRun:
    """One measured baseline pass."""

    def __init__(
        self, seconds: float, input_tokens: int, output_tokens: int, token_ids: list[list[int]]
    ) -> None:
        self.seconds = seconds
        self.input_tokens = input_tokens
        self.output_tokens = output_tokens
        self.token_ids = token_ids

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


class BaselineProcess:
    """A running baseline: ``with BaselineProcess(python, setup) as b: b.run()``.

    Args:
      python: the interpreter to run the script with.
      setup: the setup object of the protocol (model folder, prompts, lengths, dtype, threads, warmup).
      script: the baseline script (default: the shipped transformers baseline).
      timeout_s: longest wait for any answer (the setup answer includes the model load and the warm-up).
    """

    def __init__(
        self,
        python: str | os.PathLike[str],
        setup: dict[str, Any],
        *,
        script: str | os.PathLike[str] = DEFAULT_SCRIPT,
        timeout_s: float = 900.0,
    ) -> None:
        python, script = Path(python), Path(script)
        if not python.is_file():
            raise ValueError(f"baseline_python: {str(python)!r} is not an interpreter file")
        if not script.is_file():
            raise ValueError(f"baseline_script: {str(script)!r} does not exist")
        self.timeout_s = float(timeout_s)
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 -- lives as long as the process
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
        self._proc = subprocess.Popen(
            [str(python), str(script)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=env,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._send(setup)
        self.info = self._expect("ready")

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _stderr_tail(self, n: int = 2000) -> str:
        self._stderr.seek(0)
        text = self._stderr.read()
        return text[-n:].strip()

    def _send(self, obj: dict[str, Any]) -> None:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps(obj) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            raise BaselineError(
                f"baseline exited early; its stderr ends with:\n{self._stderr_tail()}"
            ) from None

    def _expect(self, event: str) -> dict[str, Any]:
        while True:
            try:
                line = self._lines.get(timeout=self.timeout_s)
            except queue.Empty:
                self.close()
                raise BaselineError(f"baseline gave no answer within {self.timeout_s:.0f} s") from None
            if line is None:
                self._proc.wait()
                raise BaselineError(
                    f"baseline exited with status {self._proc.returncode} before answering {event!r}; its stderr "
                    f"ends with:\n{self._stderr_tail()}"
                )
            line = line.strip()
            if not line.startswith("{"):
                continue  # a library printed to stdout; the protocol lines are JSON objects
            msg = json.loads(line)
            if msg.get("event") == "error":
                raise BaselineError(f"baseline failed: {msg.get('message')}\n{self._stderr_tail()}")
            if msg.get("event") != event:
                raise BaselineError(f"baseline answered {msg.get('event')!r}, expected {event!r}")
            return msg

    def run(self) -> BaselineRun:
        """One measured pass over every batch."""
        self._send({"cmd": "run"})
        msg = self._expect("run")
        for key in ("seconds", "input_tokens", "output_tokens", "token_ids"):
            if key not in msg:
                raise BaselineError(f"baseline run answer lacks {key!r}: {sorted(msg)}")
        if not msg["seconds"] > 0:
            raise BaselineError(f"baseline run answer: seconds must be > 0, got {msg['seconds']!r}")
        return BaselineRun(
            float(msg["seconds"]), int(msg["input_tokens"]), int(msg["output_tokens"]), msg["token_ids"]
        )

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._send({"cmd": "exit"})
                self._proc.wait(timeout=30)
            except (BaselineError, subprocess.TimeoutExpired, OSError):
                self._proc.kill()
                self._proc.wait()
        self._stderr.close()

    def __enter__(self) -> BaselineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def baseline_setup(
    model_dir: str | os.PathLike[str],
    prompts: Sequence[Sequence[int]],
    max_new_tokens: Sequence[int],
    *,
    batch_size: int | None,
    dtype: str,
    threads: int,
    warmup: int,
) -> dict[str, Any]:
    """The protocol's setup object."""
    return {
        "model_dir": str(model_dir),
        "prompts": [list(map(int, p)) for p in prompts],
        "max_new_tokens": [int(n) for n in max_new_tokens],
        "batch_size": batch_size,
        "dtype": dtype,
        "threads": int(threads),
        "warmup": int(warmup),
    }
