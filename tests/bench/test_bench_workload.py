"""Workload description: length distributions, deterministic requests, batching, refused values."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer_jax.bench.workload import LengthDist, Workload, parse_length_dist


def test_parse_length_dist_forms():
    assert parse_length_dist(32, "f") == LengthDist("constant", 32)
    assert parse_length_dist("32", "f") == LengthDist("constant", 32)
    assert parse_length_dist("16:64", "f") == LengthDist("uniform", 16, 64)
    assert parse_length_dist("8, 16,32", "f") == LengthDist("choice", values=(8, 16, 32))
    assert str(LengthDist("uniform", 16, 64)) == "16:64" and LengthDist("uniform", 16, 64).max == 64
    with pytest.raises(ValueError, match="prompt_len: 'x' is not a length distribution"):
        parse_length_dist("x", "prompt_len")
    with pytest.raises(ValueError, match="low <= high"):
        parse_length_dist("9:3", "f")
    with pytest.raises(ValueError, match="low <= high"):
        parse_length_dist("0", "f")
    with pytest.raises(TypeError, match="output_len: expected a length"):
        parse_length_dist(1.5, "output_len")


def test_sampled_lengths_stay_in_range():
    rng = np.random.default_rng(1)
    u = LengthDist("uniform", 3, 5).sample(rng, 200)
    assert set(u) == {3, 4, 5}
    c = LengthDist("choice", values=(8, 32)).sample(rng, 50)
    assert set(c) <= {8, 32}


def test_requests_are_deterministic_and_follow_the_workload():
    w = Workload(num_requests=5, prompt_len="4:9", output_len="2,3", seed=7)
    a, b = w.requests(100), w.requests(100)
    assert a == b
    assert all(4 <= len(r.prompt_token_ids) <= 9 and r.max_tokens in (2, 3) for r in a)
    assert all(0 <= t < 100 for r in a for t in r.prompt_token_ids)
    assert w.replace(seed=8).requests(100) != a
    assert [len(x) for x in w.replace(batch_size=2).batches(a)] == [2, 2, 1]
    assert [len(x) for x in w.batches(a)] == [5]
    d = w.to_dict()
    assert d["prompt_len"] == "4:9" and d["output_len"] == "2,3" and d["num_requests"] == 5


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"num_requests": 0}, ValueError, "Workload.num_requests: must be >= 1, got 0"),
        ({"repeats": 1.5}, TypeError, "Workload.repeats: expected an int"),
        ({"dtype": "float16"}, ValueError, "Workload.dtype: 'float16'"),
        ({"batch_size": 0}, ValueError, "Workload.batch_size"),
        ({"seed": -1}, ValueError, "Workload.seed"),
        ({"warmup": -1}, ValueError, "Workload.warmup: must be >= 0"),
    ],
)
def test_workload_refuses_bad_values(changes, error, match):
    with pytest.raises(error, match=match):
        Workload(**changes)


def test_replace_refuses_unknown_fields():
    with pytest.raises(ValueError, match="unknown field"):
        Workload().replace(prompt_length=3)
