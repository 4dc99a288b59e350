"""The README's main job (`scripts/demo`) runs end to end on the trained V4.1 and reports real model output."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_demo_continues_a_play_with_shakespeare_v41_the_engine_and_chat():
    # The checkout's own package first (the script's folder, not the root, heads its sys.path).
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path)
    env.pop("DEEPINFER_USE_NEXTN_DECODE", None)  # as a user runs it: the suite's pin off, the drafter on
    env.pop("DEEPINFER_ENABLE_PREFIX_CACHING", None)  # and the prefix cache on
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "demo.py"), "--max_tokens", "12"],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "model shakespeare-v41: small DeepSeek-V4.1 trained on Shakespeare" in out
    assert "random weights" not in out
    # The model's own greedy tokens: 12 ids in its vocabulary (fewer only if it produced EOS), decoding to words.
    greedy = re.search(r"shakespeare-v41 greedy by full forward \(trained weights\): \[([0-9, ]*)\]", out)
    assert greedy is not None, out
    ids = [int(x) for x in greedy.group(1).split(",") if x.strip()]
    assert 1 <= len(ids) <= 12 and all(0 <= i < 2048 for i in ids)
    # The text is printed as its repr: in double quotes when it holds an apostrophe.
    text = re.search(r"\[demo\]   text (['\"])(.*)\1\n", out).group(2)
    assert sum(c.isalpha() for c in text) >= len(text) // 2, text
    # The engine on the same model: three requests in one batch, the greedy one equal to the full forward's.
    assert len(re.findall(r"engine \((greedy|sample 1|sample 2)\) -> \d+ tokens", out)) == 3, out
    assert "engine greedy tokens equal the full-forward greedy tokens" in out, out
    # The trained DSpark drafter drafted and its drafts were accepted: more than one token per decode step.
    spec = re.search(
        r"speculative: [0-9.]+ drafts verified per decode row, mean accepted length ([0-9.]+)", out
    )
    assert spec is not None and float(spec.group(1)) > 1.0, out
    assert re.search(r"LLM\.chat -> \d+ tokens, finish_reason=\w+: ", out), out
