"""A stand-in for the transformers baseline (CI has no torch): it speaks the same JSON-lines protocol.

Each run reports ``FAKE_BASELINE_SECONDS`` seconds (default 0.5) and, per request, ``max_new_tokens`` copies of
the request's first prompt id, so tests can check the ratio and the token agreement exactly.
``FAKE_BASELINE_FAIL=setup|run`` makes it fail at that stage; ``FAKE_BASELINE_FAIL=exit`` exits silently.
"""

import json
import os
import sys


def main() -> int:
    setup = json.loads(sys.stdin.readline())
    fail = os.environ.get("FAKE_BASELINE_FAIL", "")
    if fail == "setup":
        print(json.dumps({"event": "error", "message": "cannot load the model"}), flush=True)
        return 1
    if fail == "exit":
        print("dying", file=sys.stderr, flush=True)
        return 3
    print("a library talking on stdout", flush=True)
    print(
        json.dumps({"event": "ready", "name": "fake", "threads": setup["threads"], "setup": setup}),
        flush=True,
    )
    seconds = float(os.environ.get("FAKE_BASELINE_SECONDS", "0.5"))
    for line in sys.stdin:
        cmd = json.loads(line)["cmd"]
        if cmd == "exit":
            return 0
        if fail == "run":
            print(json.dumps({"event": "error", "message": "out of memory"}), flush=True)
            return 1
        tokens = [[p[0]] * n for p, n in zip(setup["prompts"], setup["max_new_tokens"])]
        answer = {
            "event": "run",
            "seconds": seconds,
            "input_tokens": sum(len(p) for p in setup["prompts"]),
            "output_tokens": sum(setup["max_new_tokens"]),
            "token_ids": tokens,
        }
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
