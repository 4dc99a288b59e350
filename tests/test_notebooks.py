"""The notebooks under notebooks/: each runs top to bottom in a fresh kernel in the small setting
(``NOTEBOOK_SMALL=1``) without an error and draws its figures; the committed files hold no outputs.

The kernel is this interpreter (a kernelspec written for the test, found first through ``JUPYTER_PATH``), with
this checkout first on ``PYTHONPATH`` and the suite's environment (CPU platform, caches).
"""

from __future__ import annotations

import base64
import io
import json
import os
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
# Each notebook's figures (image/png outputs), at least. A new notebook needs an entry here.
FIGURES = {
    "01_quick_start.ipynb": 1,  # KV record sizes of V4.1-Flash
    "02_model_anatomy.ipynb": 4,  # layer plan, attention heat map, indexer top-k, cache-format errors
    "03_speculative_decoding.ipynb": 2,  # acceptance by draft position; verified / accepted / tokens/s vs concurrency
    "04_parallelism.ipynb": 1,  # expert load per device before and after EPLB, measured imbalance
    "05_structured_outputs_and_serving.ipynb": 1,  # a streamed answer's chunk arrivals
    "06_sweeps.ipynb": 1,  # the sweep's Pareto plot
}
CELL_TIMEOUT_S = 600
KERNEL = "deepinfer-notebook-test"


def test_every_notebook_is_listed():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(FIGURES)


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_committed_notebook_is_clean(name):
    """No stored outputs or execution counts; the first code cell is the Colab install cell, skipped elsewhere."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    for i, cell in enumerate(code):
        assert cell.outputs == [] and cell.execution_count is None, f"{name}: code cell {i} has stored output"
    assert '"google.colab" in sys.modules' in code[0].source and "pip" in code[0].source, (
        f"{name}: the first code cell must install the package in Colab only"
    )


def _png_is_drawn(data: str) -> bool:
    """A non-empty PNG with more than one colour (a figure, not a blank canvas)."""
    from PIL import Image

    raw = base64.b64decode(data)
    if not raw.startswith(b"\x89PNG\r\n\x1a\n"):
        return False
    img = Image.open(io.BytesIO(raw)).convert("RGB")
    return img.width > 50 and img.height > 50 and len(img.getcolors(maxcolors=1 << 20) or [0, 0]) > 1


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    """A kernelspec running this interpreter, and the environment the kernel starts with."""
    spec_root = tmp_path_factory.mktemp("jupyter")
    spec = spec_root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "deepinfer_jax (test)",
                "language": "python",
            }
        )
    )
    path = os.environ.get("PYTHONPATH")
    return {
        "JUPYTER_PATH": str(spec_root),
        "NOTEBOOK_SMALL": "1",
        "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else ""),
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
    }


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_notebook_runs_and_draws(name, kernel_env, monkeypatch):
    for key, value in kernel_env.items():
        monkeypatch.setenv(key, value)
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name=KERNEL, resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    start = time.monotonic()
    client.execute()  # raises CellExecutionError on the first cell that fails
    print(f"{name}: {time.monotonic() - start:.1f} s")
    images = [
        out["data"]["image/png"]
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if "image/png" in out.get("data", {})
    ]
    assert len(images) >= FIGURES[name], f"{name}: {len(images)} figures, expected {FIGURES[name]}"
    assert all(_png_is_drawn(data) for data in images), f"{name}: an empty figure"
    errors = [out for cell in nb.cells for out in cell.get("outputs", []) if out.output_type == "error"]
    assert not errors
