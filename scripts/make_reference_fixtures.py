"""Write the parity fixtures of one model family from its transformers oracle (``spec/oracles.md``).

Dispatches to ``scripts/reference_fixtures/<family>.py`` (imported only when asked for, so that the other
families' requirements are never touched) and passes every other argument through::

    .venv-oracle/bin/python scripts/make_reference_fixtures.py --family v3 --out tests/data/v3
    .venv-oracle/bin/python scripts/make_reference_fixtures.py --family v4 --out tests/data/v4

The oracle environment (torch 2.13.0 CPU exists only for Python 3.11 on the development machines; it is a
fixture tool, never a project dependency)::

    python3.11 -m venv .venv-oracle && \\
        .venv-oracle/bin/pip install torch==2.13.0 transformers==5.24.0 safetensors numpy
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

FAMILIES: tuple[str, ...] = ("v3", "v4")
_HERE = Path(__file__).resolve().parent


def load_generator(family: str) -> ModuleType:
    """Import ``reference_fixtures/<family>.py`` as a module (it is a script folder, not a package)."""
    if family not in FAMILIES:
        raise ValueError(f"--family: {family!r} is not one of {', '.join(FAMILIES)}")
    path = _HERE / "reference_fixtures" / f"{family}.py"
    if not path.is_file():
        raise FileNotFoundError(
            f"--family {family}: generator {path.relative_to(_HERE.parent)} does not exist"
        )
    spec = importlib.util.spec_from_file_location(f"reference_fixtures_{family}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    if not callable(getattr(module, "main", None)):
        raise AttributeError(f"{path} defines no main(argv) function")
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=True)
    parser.add_argument(
        "--family", required=True, choices=FAMILIES, help="model family to build fixtures for"
    )
    args, rest = parser.parse_known_args(argv)
    return int(load_generator(args.family).main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
