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
# No persistent compilation cache unless the caller asks for one (JAX_COMPILATION_CACHE_DIR): in full runs of
# this suite XLA:CPU segfaulted while serialising an executable for the cache (jax 0.12.0.1,
# ``compilation_cache.put_executable_and_time``), in three of three runs; see docs/foundation.md.
# Built-in tiny models are materialised once per checkout, shared by all xdist workers (file-locked).
os.environ.setdefault(
    "DEEPINFER_JAX_CACHE",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".cache", "deepinfer_jax"),
)


_START = time.monotonic()


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"deepinfer_jax suite wall time: {time.monotonic() - _START:.1f} s")
