"""SamplingParams validation (issue 7's table), request validation and the output records."""

from __future__ import annotations

import copy
import math
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_jax.engine.params import (
    MAX_LOGPROBS,
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    seed_words,
    validate_request,
)


def test_defaults_match_the_issue_table() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, -1, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (16, 0, (), ())
    assert (p.ignore_eos, p.logprobs, p.prompt_logprobs, p.seq_seed, p.so_args) == (
        False,
        None,
        None,
        None,
        None,
    )
    assert not p.greedy and SamplingParams(temperature=0).greedy


@pytest.mark.parametrize(
    ("kwargs", "error", "fragments"),
    [
        ({"temperature": -0.1}, ValueError, ["temperature", "-0.1", ">= 0"]),
        ({"temperature": math.inf}, ValueError, ["temperature", "inf", "finite"]),
        ({"temperature": math.nan}, ValueError, ["temperature", "nan", "finite"]),
        ({"temperature": "1"}, TypeError, ["temperature", "str"]),
        ({"temperature": True}, TypeError, ["temperature", "bool"]),
        ({"top_p": 0.0}, ValueError, ["top_p", "0.0", "(0, 1]"]),
        ({"top_p": 1.5}, ValueError, ["top_p", "1.5", "(0, 1]"]),
        ({"top_k": -2}, ValueError, ["top_k", "-2", "-1 or 0"]),
        ({"top_k": 2.0}, TypeError, ["top_k", "float"]),
        ({"min_p": -0.01}, ValueError, ["min_p", "-0.01", "[0, 1]"]),
        ({"min_p": 1.01}, ValueError, ["min_p", "1.01", "[0, 1]"]),
        ({"repetition_penalty": 0.0}, ValueError, ["repetition_penalty", "0.0", "> 0"]),
        ({"presence_penalty": 2.5}, ValueError, ["presence_penalty", "2.5", "[-2, 2]"]),
        ({"frequency_penalty": -2.01}, ValueError, ["frequency_penalty", "-2.01", "[-2, 2]"]),
        ({"max_tokens": 0}, ValueError, ["max_tokens", "0", "[1, "]),
        ({"max_tokens": 1.0}, TypeError, ["max_tokens", "float"]),
        ({"min_tokens": -1}, ValueError, ["min_tokens", "-1", "max_tokens = 16"]),
        ({"min_tokens": 17}, ValueError, ["min_tokens", "17", "max_tokens = 16"]),
        ({"stop": 3}, TypeError, ["stop", "int"]),
        ({"stop": ["ok", 3]}, TypeError, ["stop[1]", "int"]),
        ({"stop": ["ok", ""]}, ValueError, ["stop[1]", "non-empty"]),
        ({"stop_token_ids": [1, -1]}, ValueError, ["stop_token_ids[1]", "-1", ">= 0"]),
        ({"stop_token_ids": [1, "2"]}, TypeError, ["stop_token_ids[1]", "str"]),
        ({"stop_token_ids": 5}, TypeError, ["stop_token_ids", "int"]),
        ({"ignore_eos": 1}, TypeError, ["ignore_eos", "bool", "int"]),
        ({"logprobs": 21}, ValueError, ["logprobs", "21", "[0, 20]"]),
        ({"logprobs": -1}, ValueError, ["logprobs", "-1", "[0, 20]"]),
        ({"logprobs": 2.0}, TypeError, ["logprobs", "float"]),
        ({"top_logprobs": 21}, ValueError, ["top_logprobs", "21", "[0, 20]"]),
        ({"logprobs": False, "top_logprobs": 2}, ValueError, ["top_logprobs = 2", "logprobs=False"]),
        ({"logprobs": 3, "top_logprobs": 2}, ValueError, ["logprobs = 3", "top_logprobs = 2", "differ"]),
        ({"golden_token_ids": [1, -2]}, ValueError, ["golden_token_ids[1]", "-2", ">= 0"]),
        ({"first_n_token_no_eos": -1}, ValueError, ["first_n_token_no_eos", "-1", ">= 0"]),
        ({"prompt_logprobs": 21}, ValueError, ["prompt_logprobs", "21", "[0, 20]"]),
        ({"seq_seed": -1}, ValueError, ["seq_seed", "-1", "2**64"]),
        ({"seq_seed": 2**64}, ValueError, ["seq_seed", str(2**64), "2**64"]),
        ({"seed": 2**64}, ValueError, ["seed", str(2**64), "2**64"]),
        ({"seq_seed": 1.5}, TypeError, ["seq_seed", "float"]),
        ({"seed": 1, "seq_seed": 2}, ValueError, ["seed = 1", "seq_seed = 2", "alias"]),
        ({"so_args": {"json": {}}}, ValueError, ["so_args", "structured outputs", "later"]),
        ({"so_args": "json"}, TypeError, ["so_args", "str"]),
    ],
)
def test_every_bad_value_names_the_field_the_value_and_the_range(
    kwargs: dict, error: type[Exception], fragments: list[str]
) -> None:
    with pytest.raises(error) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_boundaries_of_the_valid_ranges_are_accepted() -> None:
    SamplingParams(temperature=0, top_p=1, top_k=0, min_p=1, presence_penalty=-2, frequency_penalty=2)
    SamplingParams(top_k=1, min_p=0, max_tokens=1, min_tokens=1, logprobs=0, prompt_logprobs=MAX_LOGPROBS)
    SamplingParams(seq_seed=0)
    SamplingParams(seq_seed=2**64 - 1)
    SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), max_tokens=np.int32(4))


def test_seed_is_an_alias_of_seq_seed() -> None:
    assert SamplingParams(seed=7).seq_seed == 7
    assert SamplingParams(seq_seed=7).seed == 7
    assert SamplingParams(seed=7, seq_seed=7).seq_seed == 7
    assert SamplingParams(seed=7) == SamplingParams(seq_seed=7)


def test_stop_is_normalised_to_immutable_tuples() -> None:
    stops = ["a", "bc"]
    p = SamplingParams(stop=stops, stop_token_ids=np.array([3, 4]))
    stops.append("d")
    assert p.stop == ("a", "bc") and p.stop_token_ids == (3, 4)
    assert SamplingParams(stop="x").stop == ("x",)
    assert all(type(t) is int for t in p.stop_token_ids)


def test_replace_revalidates_and_accepts_the_seed_alias() -> None:
    p = SamplingParams(temperature=0.5, stop="x")
    q = p.replace(seed=3, max_tokens=4)
    assert (q.seq_seed, q.max_tokens, q.temperature, q.stop) == (3, 4, 0.5, ("x",))
    assert p.seq_seed is None  # frozen original untouched
    with pytest.raises(ValueError, match="max_tokens"):
        p.replace(max_tokens=0)
    with pytest.raises(TypeError, match="no field"):
        p.replace(beam_width=2)
    with pytest.raises(AttributeError):
        p.temperature = 2.0  # type: ignore[misc]


@settings(max_examples=60, deadline=None)
@given(
    temperature=st.floats(0, 100),
    top_p=st.floats(0, 1, exclude_min=True),
    top_k=st.integers(-1, 1000),
    max_tokens=st.integers(1, 10_000),
    data=st.data(),
)
def test_valid_values_are_kept_exactly(
    temperature: float, top_p: float, top_k: int, max_tokens: int, data: st.DataObject
) -> None:
    min_tokens = data.draw(st.integers(0, max_tokens))
    seed = data.draw(st.none() | st.integers(0, 2**64 - 1))
    p = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        seed=seed,
    )
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.min_tokens, p.seq_seed) == (
        temperature,
        top_p,
        top_k,
        max_tokens,
        min_tokens,
        seed,
    )


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**64 - 1))
def test_seed_words_split_a_64_bit_seed(seed: int) -> None:
    lo, hi = seed_words(seed)
    assert 0 <= lo < 2**32 and 0 <= hi < 2**32
    assert lo + (hi << 32) == seed


def test_seed_words_refuses_out_of_range() -> None:
    with pytest.raises(ValueError, match="2\\*\\*64"):
        seed_words(2**64)


def test_validate_request_returns_int32_and_refuses_bad_prompts() -> None:
    p = SamplingParams(max_tokens=4)
    out = validate_request([1, 2, 3], p, vocab_size=10, max_model_len=8)
    assert out.dtype == np.int32 and out.tolist() == [1, 2, 3]
    cases = [
        ([], ValueError, "empty"),
        ([1, 10], ValueError, "prompt_token_ids[1] = 10 is outside the vocabulary [0, 10)"),
        ([-1], ValueError, "prompt_token_ids[0] = -1"),
        ([1, 2.0], TypeError, "prompt_token_ids[1]"),
        ("abc", TypeError, "prompt_token_ids"),
        (np.zeros((2, 2), np.int32), ValueError, "1-D"),
        (np.zeros(3, np.float32), TypeError, "dtype float32"),
        ([1] * 8, ValueError, "max_model_len = 8"),
        ([1] * 5, ValueError, "5 + sampling_params.max_tokens 4 = 9 exceeds max_model_len = 8"),
    ]
    for prompt, error, fragment in cases:
        with pytest.raises(error) as info:
            validate_request(prompt, p, vocab_size=10, max_model_len=8, index=3)
        assert fragment in str(info.value) and "request 3" in str(info.value), str(info.value)
    with pytest.raises(ValueError, match=r"stop_token_ids\[0\] = 12 is outside"):
        validate_request(
            [1], SamplingParams(stop_token_ids=[12], max_tokens=1), vocab_size=10, max_model_len=8
        )
    with pytest.raises(TypeError, match="SamplingParams"):
        validate_request([1], {"max_tokens": 1}, vocab_size=10, max_model_len=8)  # type: ignore[arg-type]


def test_output_records_have_vllm_shapes() -> None:
    lp = Logprob(-0.5, 1, "a")
    completion = CompletionOutput(0, "a", [5], -0.5, [{5: lp}], "stop", None)
    assert completion.finished() and completion.error is None
    out = RequestOutput(
        "0", None, [1, 2], [completion], None, RequestMetrics(arrival_time=0.0), finished=True
    )
    assert out.outputs[0].logprobs == [{5: Logprob(logprob=-0.5, rank=1, decoded_token="a")}]
    assert not CompletionOutput(0, "", [], None, None).finished()


def test_params_survive_copy_and_pickle_and_are_hashable() -> None:
    p = SamplingParams(temperature=0.3, stop=["a"], stop_token_ids=[4], seed=2**63, logprobs=3)
    assert copy.deepcopy(p) == p and pickle.loads(pickle.dumps(p)) == p
    assert hash(p) == hash(p.replace()) and p != p.replace(seed=1)
    assert "temperature=0.3" in repr(p)
