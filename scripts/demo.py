"""The README's main job, run by `scripts/demo`.

Materialises the built-in tiny DeepSeek-V4.1 model (random weights, HF layout) and goes as far towards generation
as the project currently goes; it says plainly where it stops and never prints made-up model output.
"""

from __future__ import annotations

import argparse
import sys

from deepinfer_jax import cache
from deepinfer_jax import config as config_lib
from deepinfer_jax.models import builtin
from deepinfer_jax.text.detokenize import IncrementalDetokenizer
from deepinfer_jax.text.tokenizer import Tokenizer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("prompt", nargs="?", default="The capital of France is")
    parser.add_argument("--model", default="tiny-v41", choices=builtin.list_builtin())
    args = parser.parse_args()

    print(f"[demo] model {args.model}: {builtin.get_builtin(args.model).description}")
    path = builtin.materialize(args.model)
    print(f"[demo] checkpoint (HF layout) at {path}")
    model = config_lib.load_model_config(path)
    print(
        f"[demo] {model.family}: {model.num_hidden_layers} layers, hidden {model.hidden_size}, "
        f"vocab {model.vocab_size}"
    )
    print(f"[demo] KV record bytes per token: {dict(cache.record_bytes(model))}")

    tok = Tokenizer.from_file(path)
    ids = tok.encode(args.prompt, add_bos=True)
    print(f"[demo] prompt {args.prompt!r} -> {len(ids)} token ids: {ids}")
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.push(i) for i in ids) + detok.finish()
    print(f"[demo] streamed back: {text!r}")

    try:
        from deepinfer_jax.engine import LLM, SamplingParams  # type: ignore[attr-defined]
    except ImportError:
        print(
            "[demo] generation: not available yet - the V4.1 forward pass and the engine are not built. "
            "Nothing further is run, and no output is invented."
        )
        return 0
    llm = LLM(model=str(path))
    out = llm.generate([args.prompt], SamplingParams(max_tokens=16, temperature=0.0))
    print(f"[demo] generated (random weights): {out[0]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
