"""The Pareto front of the throughput plot: computed by hand on a small set, and drawn through exactly those
points."""

from __future__ import annotations

import itertools

import pytest

from deepinfer_jax.bench.plots import PLOT_FILES, pareto_front, write_plots

X, Y = "seq_tokens_per_s", "output_tokens_per_s"


def _p(label, x, y):
    return {"label": label, X: x, Y: y, "input_tokens_per_s": 1.0, "ttft_s": 0.1}


POINTS = [
    _p("a", 10.0, 100.0),
    _p("b", 20.0, 80.0),
    _p("c", 15.0, 70.0),  # beaten by b on both axes
    _p("d", 5.0, 100.0),  # as good as a on y, worse on x
    _p("e", 30.0, 40.0),
    _p("f", 30.0, 30.0),  # as good as e on x, worse on y
    _p("g", None, 500.0),  # no per-user speed: left out
    _p("h", 20.0, 80.0),  # equal to b: neither beats the other
]


def test_pareto_front_by_hand():
    # Maximising both: a (10, 100), b and h (20, 80), e (30, 40) are beaten by nothing; c by b, d by a, f by e.
    assert [p["label"] for p in pareto_front(POINTS, X, Y)] == ["a", "b", "h", "e"]
    assert [p["label"] for p in pareto_front(POINTS[:1], X, Y)] == ["a"]
    assert pareto_front([_p("g", None, 1.0)], X, Y) == []
    # Along the front x grows and y falls: the trade-off the plot shows.
    front = pareto_front(POINTS, X, Y)
    assert all(u[X] <= v[X] and u[Y] >= v[Y] for u, v in itertools.pairwise(front))


def test_throughput_plot_draws_the_front(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.axes import Axes

    drawn = []
    original = Axes.plot

    def spy(self, xs, ys, *args, **kwargs):
        drawn.append((self.get_title(), list(xs), list(ys), kwargs.get("label")))
        return original(self, xs, ys, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", spy)
    paths = write_plots(POINTS, tmp_path)
    assert [p.name for p in paths] == list(PLOT_FILES)
    # Titles are set after plotting, so the first plot's calls come first: dominated points, then the front.
    dominated, front = drawn[0], drawn[1]
    assert front[3] == "Pareto front" and (front[1], front[2]) == (
        [10.0, 20.0, 20.0, 30.0],
        [100.0, 80.0, 80.0, 40.0],
    )
    assert dominated[3] == "dominated" and sorted(zip(dominated[1], dominated[2])) == [
        (5.0, 100.0),
        (15.0, 70.0),
        (30.0, 30.0),
    ]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("points", [[], [_p("g", None, None)]])
def test_empty_front(points):
    assert pareto_front(points, X, Y) == []
