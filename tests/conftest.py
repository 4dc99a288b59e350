"""Test-suite wide set-up.

JAX reads its platform and XLA flags when it first initialises a backend, so they are forced here, before
any test module imports jax: every test runs on the CPU with 8 virtual devices (sharding tests need them).
"""

import gc
import os
import time

import pytest

os.environ["JAX_PLATFORMS"] = "cpu"
_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
# A persistent compilation cache shared by test runs (scripts/test points it at .jax_cache/).
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".jax_cache")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
# Speculative decoding is on by default for models with draft layers (tiny-v3's MTP layer); tests that are not
# about it run without drafts, and those that are pass num_draft_tokens themselves.
os.environ.setdefault("DEEPINFER_USE_NEXTN_DECODE", "0")
# Prefix caching is on by default too; a hit prefills fewer rows (float32 results move by ~1e-6), so tests that
# are not about it run without, and those that are pass enable_prefix_caching themselves.
os.environ.setdefault("DEEPINFER_ENABLE_PREFIX_CACHING", "0")
# Built-in tiny models are materialised once per checkout, shared by all xdist workers (file-locked).
os.environ.setdefault(
    "DEEPINFER_JAX_CACHE",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".cache", "deepinfer_jax"),
)


_START = time.monotonic()


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"deepinfer_jax suite wall time: {time.monotonic() - _START:.1f} s")


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After a module's last test (its module fixtures are torn down by then), drop what keeps its compiled
    programs alive: the module's own ``functools.cache`` results (engines, models) and JAX's in-memory
    compilation caches.

    Without this one xdist worker accumulates every compiled executable of the run: XLA:CPU maps each one's code
    and constants separately, and near the end of a full run a worker held ~57,000 memory mappings against the
    kernel's default limit of 65,530 (``vm.max_map_count``); past it, an ``mmap`` inside XLA fails and the
    worker dies (a segfault serialising an executable, or an abort while compiling one)."""
    module = getattr(item, "module", None)
    if module is None or (nextitem is not None and getattr(nextitem, "module", None) is module):
        return
    for obj in list(vars(module).values()):
        if getattr(obj, "__module__", None) == module.__name__ and callable(
            getattr(obj, "cache_clear", None)
        ):
            obj.cache_clear()
    import jax  # here, not at the top: the environment above must be set before jax is imported

    jax.clear_caches()
    gc.collect()
