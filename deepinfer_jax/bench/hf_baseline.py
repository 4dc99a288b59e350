"""The transformers baseline of ``deepinfer-jax bench``: ``generate`` on the same weights and prompt ids.

Run as a script by another interpreter (a venv with torch and transformers; it imports nothing from this
package), it speaks JSON lines on stdin/stdout so that the harness can alternate engine and baseline runs
without paying the model load each time:

1. the harness sends one setup object: ``{"model_dir", "prompts": [[ids], ...], "max_new_tokens": [n, ...],
   "batch_size", "dtype", "threads", "warmup"}``;
2. the script loads the model, runs ``warmup`` unmeasured passes and answers ``{"event": "ready", ...}`` with
   the versions, the thread count in force and the load time;
3. each ``{"cmd": "run"}`` runs every batch once and answers ``{"event": "run", "seconds", "input_tokens",
   "output_tokens", "token_ids"}``; ``{"cmd": "exit"}`` ends it.

Failures answer ``{"event": "error", "message"}`` and exit with status 1. Batches are static, as transformers
batches: prompts of one batch are left-padded to the longest, and the batch generates the longest
``max_new_tokens`` of its requests (each request's own count is what is reported). Decoding is greedy
(``do_sample=False``) with ``min_new_tokens`` equal to ``max_new_tokens``, so EOS never ends a row early --
the engine side ignores EOS too.

Padding changes results for some models: transformers' DeepSeek-V4 does not give a left-padded row the result
of the same prompt run alone (its compressors pool hidden states without the attention mask, so pad positions
enter the compressed entries), so token agreement with the engine is only meaningful for batches of
equal-length prompts on V4.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _batches(setup: dict[str, Any]) -> list[tuple[list[list[int]], list[int]]]:
    prompts, news = setup["prompts"], setup["max_new_tokens"]
    size = int(setup.get("batch_size") or len(prompts))
    return [(prompts[i : i + size], news[i : i + size]) for i in range(0, len(prompts), size)]


def _run_batches(model: Any, torch: Any, batches: list[tuple[list[list[int]], list[int]]]) -> list[list[int]]:
    out: list[list[int]] = []
    for prompts, news in batches:
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[row, width - len(p) :] = 1
        n = max(news)
        with torch.inference_mode():
            gen = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        for row, k in enumerate(news):
            out.append([int(t) for t in gen[row, width : width + k]])
    return out


def main() -> int:
    try:
        setup = json.loads(sys.stdin.readline())
        import torch
        import transformers

        threads = int(setup.get("threads", 2))
        torch.set_num_threads(threads)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[setup.get("dtype", "float32")]
        start = time.perf_counter()
        model = transformers.AutoModelForCausalLM.from_pretrained(setup["model_dir"], dtype=dtype)
        model.eval()
        load_seconds = time.perf_counter() - start
        batches = _batches(setup)
        start = time.perf_counter()
        for _ in range(int(setup.get("warmup", 1))):
            _run_batches(model, torch, batches)
        _emit(
            {
                "event": "ready",
                "name": "transformers",
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "threads": torch.get_num_threads(),
                "python": sys.version.split()[0],
                "load_seconds": load_seconds,
                "warmup_seconds": time.perf_counter() - start,
            }
        )
        for line in sys.stdin:
            cmd = json.loads(line).get("cmd")
            if cmd == "exit":
                return 0
            if cmd != "run":
                raise ValueError(f"unknown command {cmd!r}; expected 'run' or 'exit'")
            start = time.perf_counter()
            tokens = _run_batches(model, torch, batches)
            seconds = time.perf_counter() - start
            _emit(
                {
                    "event": "run",
                    "seconds": seconds,
                    "input_tokens": sum(len(p) for p in setup["prompts"]),
                    "output_tokens": sum(len(t) for t in tokens),
                    "token_ids": tokens,
                }
            )
        return 0
    except Exception as err:  # reported to the harness, which shows it with the stderr tail
        _emit({"event": "error", "message": f"{type(err).__name__}: {err}"})
        return 1


if __name__ == "__main__":
    sys.exit(main())
