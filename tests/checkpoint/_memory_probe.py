"""Run in a fresh process: load every tensor of a checkpoint and report resident-memory figures as JSON.

Usage: ``python _memory_probe.py CHECKPOINT_DIR``. The kernel's high-water mark (``VmHWM``) is reset through
``/proc/self/clear_refs`` just before loading, so the peak reflects the load alone, not the imports.
"""

from __future__ import annotations

import json
import sys


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def main() -> None:
    import jax
    import numpy as np

    from deepinfer_jax.checkpoint import load_tensors, open_checkpoint

    reader = open_checkpoint(sys.argv[1])
    expected = {n: (reader.info(n).shape, reader.info(n).dtype_names) for n in reader.names()}
    warm = jax.device_put(
        np.ones(1 << 20, np.float32)
    ).block_until_ready()  # runtime set-up, outside the window
    del warm
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_kib("VmRSS")
    loaded = load_tensors(reader, expected)
    peak = _status_kib("VmHWM")
    final = _status_kib("VmRSS")
    total = sum(a.nbytes for a in loaded.values())
    print(json.dumps({"base": base * 1024, "peak": peak * 1024, "final": final * 1024, "loaded": total}))


if __name__ == "__main__":
    main()
