"""The README's main job (`scripts/demo`) runs end to end and reports real model output."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_demo_generates_with_tiny_v41_and_the_engine():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "demo.py"), "Hello", "--max_tokens", "3"],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "random weights" in out
    # The V4.1 model's own greedy tokens: up to 3 ids in its vocabulary (fewer only if it produced EOS).
    v41 = re.search(r"tiny-v41 greedy by full forward .*: \[([0-9, ]*)\]", out)
    assert v41 is not None, out
    ids = [int(x) for x in v41.group(1).split(",") if x.strip()]
    assert 1 <= len(ids) <= 3 and all(0 <= i < 512 for i in ids)
    # The engine on the same model: three prompts in one batch, the greedy one equal to the full forward's.
    assert len(re.findall(r"engine, '.*' -> \d+ tokens", out)) == 3, out
    assert "engine greedy tokens equal the full-forward greedy tokens" in out, out
