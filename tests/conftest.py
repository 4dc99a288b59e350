"""Test-suite wide set-up.

JAX reads its platform and XLA flags when it first initialises a backend, so they are forced here, before
any test module imports jax: every test runs on the CPU with 8 virtual devices (sharding tests need them).
"""

import os
import time

os.environ["JAX_PLATFORMS"] = "cpu"
_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
# A persistent compilation cache shared by test runs (scripts/test points it at .jax_cache/).
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".jax_cache")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
# Built-in tiny models are materialised once per checkout, shared by all xdist workers (file-locked).
os.environ.setdefault(
    "DEEPINFER_JAX_CACHE",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".cache", "deepinfer_jax"),
)


_START = time.monotonic()


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"deepinfer_jax suite wall time: {time.monotonic() - _START:.1f} s")
