"""The ``ascend`` lowering platform: a name JAX accepts in ``jax.export(platforms=[...])`` and lowering rules.

JAX has no Ascend runtime (no public PJRT plugin exists), so the platform is registered with a backend factory
that always fails, quietly: :func:`register_ascend_platform` makes ``"ascend"`` a *known* platform, which is what
``mlir.register_lowering(..., platform="ascend")`` and ``jax.export(..., platforms=["ascend"])`` need, while
``jax.devices()`` and every computation keep running on the real backends. Exported StableHLO whose custom calls
an Ascend toolchain implements is the hand-off format; nothing here executes on Ascend hardware.

The registration uses ``jax._src.xla_bridge.register_backend_factory``, a private API; it is the only way to add
a platform name on jax 0.12 and is isolated here.
"""

from __future__ import annotations

import threading

PLATFORM = "ascend"

_lock = threading.Lock()
_registered = False


class AscendRuntimeUnavailableError(RuntimeError):
    """Raised (and swallowed by JAX's quiet backend initialisation) when something asks for an Ascend client."""


def _no_client() -> None:
    raise AscendRuntimeUnavailableError(
        "the 'ascend' platform is a lowering target only: there is no public PJRT plugin for Ascend; export "
        "with jax.export(..., platforms=['ascend']) and hand the StableHLO to an Ascend toolchain"
    )


def register_ascend_platform() -> None:
    """Make ``"ascend"`` a known JAX platform (idempotent; safe after other backends have initialised)."""
    global _registered
    with _lock:
        if _registered:
            return
        from jax._src import xla_bridge

        if not xla_bridge.is_known_platform(PLATFORM):
            xla_bridge.register_backend_factory(
                PLATFORM, _no_client, priority=-100, fail_quietly=True, experimental=False
            )
        _registered = True
