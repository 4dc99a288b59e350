"""PNG plots of benchmark points (matplotlib, the ``[bench]`` extra; imported only when plots are asked for).

* ``throughput_vs_per_user.png``: output tokens/s of the whole engine against the tokens/s one sequence sees
  (``1 / TPOT``, median) -- the Pareto view of batching: more concurrency buys throughput with per-user speed.
  The Pareto front (:func:`pareto_front`: the points no other point beats on both axes) is drawn as a line
  through its points, the dominated points in grey.
* ``prefill_vs_latency.png``: input (prefill) tokens/s against the median time to first token.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["PLOT_FILES", "pareto_front", "write_plots"]

PLOT_FILES = ("throughput_vs_per_user.png", "prefill_vs_latency.png")


def pareto_front(points: Sequence[dict[str, Any]], x: str, y: str) -> list[dict[str, Any]]:
    """The points of ``points`` on the Pareto front when both ``x`` and ``y`` are to be maximised, sorted by
    ``x`` (then by ``y`` descending), so the front reads left to right as a falling staircase.

    A point is on the front when no other point is at least as good on both axes and better on one; points
    missing either value (``None``) are left out. Equal points are all kept: neither beats the other.
    """
    usable = [p for p in points if p.get(x) is not None and p.get(y) is not None]
    front = [
        p
        for p in usable
        if not any(
            q[x] >= p[x] and q[y] >= p[y] and (q[x] > p[x] or q[y] > p[y]) for q in usable if q is not p
        )
    ]
    return sorted(front, key=lambda p: (p[x], -p[y]))


def _scatter(
    points: Sequence[dict[str, Any]],
    x: str,
    y: str,
    xlabel: str,
    ylabel: str,
    title: str,
    path: Path,
    front: bool = False,
) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.8), dpi=100)
    usable = [p for p in points if p.get(x) is not None and p.get(y) is not None]
    # Markers only: sweep points are a grid, not a curve, and joining them would draw a false trend. The Pareto
    # front is the one line drawn: the best trade-offs the sweep found.
    on_front = pareto_front(usable, x, y) if front else usable
    ids = {id(p) for p in on_front}
    rest = [p for p in usable if id(p) not in ids]
    if rest:
        ax.plot(
            [p[x] for p in rest], [p[y] for p in rest], "o", color="tab:gray", alpha=0.6, label="dominated"
        )
    ax.plot(
        [p[x] for p in on_front],
        [p[y] for p in on_front],
        "o-" if front else "o",
        color="tab:blue",
        label="Pareto front" if front else None,
    )
    if front:
        ax.legend(loc="best", fontsize=8)
    ax.margins(0.2)
    for p in usable:
        ax.annotate(str(p["label"]), (p[x], p[y]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def write_plots(points: Sequence[dict[str, Any]], plot_dir: str | os.PathLike[str]) -> list[Path]:
    """Write both plots for ``points`` (dicts from :func:`deepinfer_jax.bench.report.plot_point`) into
    ``plot_dir`` (created if needed); returns the files written."""
    if not points:
        raise ValueError("write_plots: no points to plot")
    out = Path(plot_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / name for name in PLOT_FILES]
    _scatter(
        sorted(points, key=lambda p: p.get("seq_tokens_per_s") or 0.0),
        "seq_tokens_per_s",
        "output_tokens_per_s",
        "tokens/s per sequence (1 / TPOT, median)",
        "output tokens/s",
        "Output throughput vs per-user speed",
        paths[0],
        front=True,
    )
    _scatter(
        sorted(points, key=lambda p: p.get("ttft_s") or 0.0),
        "ttft_s",
        "input_tokens_per_s",
        "time to first token, median (s)",
        "input (prefill) tokens/s",
        "Prefill throughput vs latency",
        paths[1],
    )
    return paths
