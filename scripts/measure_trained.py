"""Measure a trained model on the held-out works: bits/char per weight format and precision mode, drafter quality.

    python scripts/measure_trained.py --run .cache/train/shakespeare-v41 --out .cache/train/shakespeare-v41/quality.json

`--run` is a `scripts/train_tiny.py --out` folder (its `model/` is the shipped checkpoint, `float32/` the master).
Every figure is measured through the engine (`deepinfer_jax.evaluation.evaluate_text`, prompt log-probabilities of
the held-out text in chunks of `--chunk_tokens` after BOS):

* float32 master weights in the float32 parity mode: the reference;
* the same weights in the bfloat16 production mode: bf16 rounding points and (V4.1) the production caches,
  MXFP8 window / FP4 compressed / MXFP4 indexer keys, and again with an MXFP8 compressed cache
  (`use_fp4_sparse_kv: false`) to isolate FP4;
* the shipped FP8 / MXFP4 weights in both modes (bfloat16 adds the MXFP8 activation casts in front of every FP8 /
  MXFP4 GEMM).

Then the drafter's teacher-forced quality on held-out windows (`deepinfer_jax.training.drafter`): DSpark
per-position agreement, the greedy round's acceptance, mean accepted length and §8.7 confidence error (V4.1); the
MTP layer's agreement and acceptance (V3). The result is one JSON file.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _variant(folder: Path, tmp: Path, name: str, **text_config) -> Path:
    """A copy of ``folder`` whose config.json changes ``text_config`` keys (weights linked, not copied)."""
    out = tmp / name
    out.mkdir()
    for item in folder.iterdir():
        (out / item.name).symlink_to(item.resolve())
    (out / "config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    config["text_config"].update(text_config)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out


def _head(text: str, chars: int) -> str:
    """The first ``chars`` characters of ``text``, cut after the last line end in them."""
    if len(text) <= chars:
        return text
    cut = text.rfind("\n", 0, chars)
    return text[: cut + 1] if cut >= 0 else text[:chars]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", required=True, help="a scripts/train_tiny.py --out folder")
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--corpus_dir", default=str(ROOT / ".cache" / "corpus"))
    parser.add_argument(
        "--chunk_tokens", type=int, default=255, help="text tokens per chunk (the training length - 1)"
    )
    parser.add_argument(
        "--drafter_windows", type=int, default=64, help="held-out windows for the drafter figures"
    )
    parser.add_argument(
        "--format_chars",
        type=int,
        default=0,
        help="score the format rows on the first N characters of each held-out work, cut at a line end "
        "(0: the whole text); the reference row is scored on the same text",
    )
    parser.add_argument("--skip_formats", action="store_true", help="only the drafter figures")
    args = parser.parse_args()

    import jax

    from deepinfer_jax import LLM, load_model
    from deepinfer_jax.config import load_model_config
    from deepinfer_jax.evaluation import evaluate_text
    from deepinfer_jax.training import drafter
    from deepinfer_jax.training.corpus import fetch_corpus
    from deepinfer_jax.training.loop import eval_windows
    from deepinfer_jax.training.recipe import tokenize

    run = Path(args.run)
    shipped, master = run / "model", run / "float32"
    family = load_model_config(shipped).family
    family = str(getattr(family, "value", family))
    corpus = fetch_corpus(args.corpus_dir)
    text = corpus.validation_text()
    if args.format_chars:
        text = "".join(_head(work, args.format_chars) for work in corpus.validation_texts())
    result: dict = {
        "held_out": list(corpus.held_out),
        "format_chars_per_work": args.format_chars,
        "characters": len(text),
        "chunk_tokens": args.chunk_tokens,
    }
    max_len = args.chunk_tokens + 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        runs = [
            ("float32 weights, float32 mode (reference)", master, "float32"),
            ("float32 weights, bfloat16 mode", master, "bfloat16"),
            ("FP8/MXFP4 weights, float32 mode", shipped, "float32"),
            ("FP8/MXFP4 weights, bfloat16 mode (production)", shipped, "bfloat16"),
        ]
        if family == "deepseek_v41":
            runs.insert(
                2,
                (
                    "float32 weights, bfloat16 mode, MXFP8 compressed cache",
                    _variant(master, tmp, "m8", use_fp4_sparse_kv=False),
                    "bfloat16",
                ),
            )
            runs.append(
                (
                    "FP8/MXFP4 weights, bfloat16 mode, MXFP8 compressed cache",
                    _variant(shipped, tmp, "s8", use_fp4_sparse_kv=False),
                    "bfloat16",
                )
            )
        for label, folder, dtype in [] if args.skip_formats else runs:
            llm = LLM(
                folder, dtype=dtype, max_model_len=max_len, max_num_seqs=16, max_num_batched_tokens=2048
            )
            score = evaluate_text(llm, text, chunk_tokens=args.chunk_tokens, batch=64)
            rows.append({"format": label, "dtype": dtype, **score.as_dict()})
            print(json.dumps(rows[-1]), flush=True)
            del llm
            jax.clear_caches()
    if rows:
        reference = rows[0]["bits_per_char"]
        for row in rows:
            row["delta_bits_per_char"] = row["bits_per_char"] - reference
    result["formats"] = rows

    tokenizer_text = (shipped / "tokenizer.json").read_text()
    val = tokenize(tokenizer_text, corpus.validation_texts())
    cfg = load_model_config(shipped)
    seq = 256
    windows = eval_windows(val, args.drafter_windows, seq, bos_id=0)
    model = load_model(shipped, "float32")
    if family == "deepseek_v41":
        result["dspark"] = drafter.dspark_quality(model.params, cfg, windows, per_window=4)
    else:
        result["mtp"] = drafter.mtp_quality(model.params, cfg, windows, per_window=4)
    print(json.dumps({k: v for k, v in result.items() if k != "formats"}), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
