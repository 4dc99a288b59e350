"""DeepInfer's sampler options and vLLM's ``logprobs_mode``, through ``LLM`` on tiny-v3 (float32).

The reference is the model's own full forward (``Model.logits``, checked against transformers), evaluated on
each request's prompt followed by the tokens the engine emitted; every expectation below is computed from those
logits with numpy, independently of the engine's sampler. Tolerances: the paged path's logits differ from the
full forward by float32 reassociation (about 1e-6 of the largest logit, tests/models/*/test_*_paged.py), so
logprobs, logits and probabilities agree to ``TOL = 1e-4``.

Each option has its own engine (the options are static arguments of the compiled step); one small bucket each.
"""

from __future__ import annotations

import functools
import json
import shutil

import numpy as np
import pytest

import deepinfer_jax
from deepinfer_jax.engine.llm import LLM
from deepinfer_jax.engine.params import SamplingParams
from deepinfer_jax.models import builtin
from deepinfer_jax.sampling import LOGPROBS_MODES

SMALL = {"dtype": "float32", "max_num_seqs": 4, "max_num_batched_tokens": 16, "kv_cache_memory": "4MiB"}
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [40, 41, 42, 43]]
TOL = 1e-4
REF_LEN = 32
FLOOR = -9999.0


@functools.cache
def _model():
    return deepinfer_jax.load_model("tiny-v3", "float32")


def _logits(sequences: list[list[int]]) -> list[np.ndarray]:
    """Full-forward float64 logits of every position of each sequence (right-padded: causal)."""
    ids = np.zeros((len(sequences), REF_LEN), np.int32)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = s
    logits = np.asarray(_model().logits(ids), np.float64)
    return [logits[i, : len(s)] for i, s in enumerate(sequences)]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _greedy_reference(prompt: list[int], n: int, banned: tuple[int, ...] = ()) -> list[int]:
    """Greedy decoding by repeated full forwards, ``banned`` ids masked."""
    seq = list(prompt)
    for _ in range(n):
        row = _logits([seq])[0][-1].copy()
        row[list(banned)] = -np.inf
        seq.append(int(np.argmax(row)))
    return seq[len(prompt) :]


def _positions(prompt, out):
    """The reference logits row of each output token of ``out`` (a ``CompletionOutput``)."""
    ref = _logits([prompt + out.token_ids])[0]
    return [ref[len(prompt) - 1 + k] for k in range(len(out.token_ids))]


def _generate(llm, params, prompts=PROMPTS):
    return [
        o.outputs[0] for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    ]


@functools.cache
def _eos_folder(tmp: str) -> tuple[str, int]:
    """tiny-v3 with its EOS id set to the greedy first token of ``PROMPTS[0]`` (same weights)."""
    eos = int(np.argmax(_logits([PROMPTS[0]])[0][-1]))
    folder = f"{tmp}/tiny-v3-eos"
    shutil.copytree(builtin.materialize("tiny-v3"), folder)
    with open(f"{folder}/config.json") as f:
        config = json.load(f)
    config["eos_token_id"] = eos
    with open(f"{folder}/config.json", "w") as f:
        json.dump(config, f)
    return folder, eos


@pytest.fixture(scope="module")
def eos_llm(tmp_path_factory):
    folder, eos = _eos_folder(str(tmp_path_factory.mktemp("eos")))
    return LLM(folder, **SMALL), eos


@pytest.fixture(scope="module")
def llm(eos_llm):
    """The default engine (``logprobs_mode="raw_logprobs"``, no engine-wide sampler option)."""
    return eos_llm[0]


# ------------------------------------------------------------------------------------ logprobs spellings


def test_logprobs_true_reports_the_chosen_token_only(llm):
    greedy = dict(temperature=0.0, max_tokens=4, ignore_eos=True)
    chosen = _generate(llm, SamplingParams(logprobs=True, **greedy))
    with_top = _generate(llm, SamplingParams(logprobs=True, top_logprobs=2, **greedy))
    vllm_int = _generate(llm, SamplingParams(logprobs=2, **greedy))
    none = _generate(llm, SamplingParams(logprobs=False, **greedy))
    for prompt, a, b, c, d in zip(PROMPTS, chosen, with_top, vllm_int, none, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids == d.token_ids
        assert d.logprobs is None
        for k, (token, row) in enumerate(zip(a.token_ids, _positions(prompt, a), strict=True)):
            assert list(a.logprobs[k]) == [token]
            assert abs(a.logprobs[k][token].logprob - _log_softmax(row)[token]) < TOL
            assert a.logprobs[k][token].rank == 1  # greedy
            # DeepInfer's logprobs=True + top_logprobs=2 is vLLM's logprobs=2.
            assert b.logprobs[k].keys() == c.logprobs[k].keys()
            top2 = set(np.argsort(-row, kind="stable")[:2].tolist())
            assert set(b.logprobs[k]) == top2 | {token}


def test_prompt_logprobs_true_reports_each_prompt_token(llm):
    out = llm.generate(
        prompt_token_ids=PROMPTS[:2],
        sampling_params=SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=True, ignore_eos=True),
        use_tqdm=False,
    )
    for prompt, o in zip(PROMPTS, out, strict=False):
        ref = _log_softmax(_logits([prompt])[0])
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(prompt)
        for i in range(1, len(prompt)):
            entry = o.prompt_logprobs[i]
            assert list(entry) == [prompt[i]]
            assert abs(entry[prompt[i]].logprob - ref[i - 1, prompt[i]]) < TOL


def test_golden_token_ids_force_the_output_and_report_its_logprobs(llm):
    """Teacher forcing: the first three outputs are the given ids (whatever the sampler draws), their logprobs
    are the model's for those ids; after the list the request samples on (greedy here) from the forced
    context."""
    golden = [100, 200, 300]
    for temperature in (0.0, 1.0):
        params = SamplingParams(
            temperature=temperature,
            max_tokens=5,
            ignore_eos=True,
            logprobs=True,
            golden_token_ids=golden,
            seq_seed=7,
        )
        for prompt, out in zip(PROMPTS, _generate(llm, params), strict=True):
            assert out.token_ids[:3] == golden
            rows = _positions(prompt, out)
            for k, token in enumerate(out.token_ids[:3]):
                assert abs(out.logprobs[k][token].logprob - _log_softmax(rows[k])[token]) < TOL
            if temperature == 0.0:
                assert out.token_ids[3:] == _greedy_reference(prompt + golden, 2)
    plain = _generate(llm, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert all(o.token_ids != golden for o in plain)  # the forcing is what made them equal


def test_first_n_token_no_eos(eos_llm):
    """The folder's EOS is PROMPTS[0]'s greedy first token: it stops the request at once, unless EOS is
    masked for the first n tokens (then the first token is the runner-up)."""
    llm, eos = eos_llm
    prompt = [PROMPTS[0]]
    stopped = _generate(llm, SamplingParams(temperature=0.0, max_tokens=4), prompt)[0]
    assert stopped.token_ids == [eos] and stopped.finish_reason == "stop"
    held = _generate(llm, SamplingParams(temperature=0.0, max_tokens=4, first_n_token_no_eos=2), prompt)[0]
    assert held.token_ids[:2] == _greedy_reference(PROMPTS[0], 2, banned=(eos,))
    assert eos not in held.token_ids[:2]


# ------------------------------------------------------------------------------- engine-wide sampler options


@pytest.fixture(scope="module")
def banned_llm(llm, monkeypatch_module):
    """``DEEPINFER_DECODE_TOKEN_BLACKLIST`` = the greedy first tokens of PROMPTS[1] and [2], and
    ``DEEPINFER_SAMPLER_FORCE_TOPK`` = 2."""
    firsts = sorted({int(np.argmax(_logits([p])[0][-1])) for p in PROMPTS[1:3]})
    monkeypatch_module.setenv("DEEPINFER_DECODE_TOKEN_BLACKLIST", ",".join(map(str, firsts)))
    monkeypatch_module.setenv("DEEPINFER_SAMPLER_FORCE_TOPK", "2")
    engine = LLM("tiny-v3", **SMALL)
    monkeypatch_module.delenv("DEEPINFER_DECODE_TOKEN_BLACKLIST")
    monkeypatch_module.delenv("DEEPINFER_SAMPLER_FORCE_TOPK")
    return engine, tuple(firsts)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_blacklisted_ids_are_never_emitted_even_greedy(banned_llm, llm):
    engine, banned = banned_llm
    assert engine.config.sampling.banned_token_ids == banned
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    plain = _generate(llm, greedy)
    assert any(set(o.token_ids) & set(banned) for o in plain)  # the default engine emits them
    for prompt, out in zip(PROMPTS, _generate(engine, greedy), strict=True):
        assert not set(out.token_ids) & set(banned)
        assert out.token_ids == _greedy_reference(prompt, 5, banned)


def test_force_top_k_samples_among_each_rows_top_k(banned_llm, llm):
    """Temperature 3 spreads the draws: without the option some tokens fall outside the top two; with
    ``force_top_k = 2`` every token is one of the two most probable ids that are not banned."""
    engine, banned = banned_llm
    hot = [SamplingParams(temperature=3.0, max_tokens=8, ignore_eos=True, seq_seed=s) for s in range(4)]

    def outside(outs) -> int:
        count = 0
        for prompt, out in zip(PROMPTS, outs, strict=True):
            for token, row in zip(out.token_ids, _positions(prompt, out), strict=True):
                row = row.copy()
                row[list(banned)] = -np.inf
                count += token not in np.argsort(-row, kind="stable")[:2]
        return count

    assert outside(_generate(llm, hot)) > 0
    assert outside(_generate(engine, hot)) == 0


# --------------------------------------------------------------------- sum_smaller_probs and logprobs_mode

T, K = 0.7, 5


def _processed(row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(processed logits, processed logprobs) of a row sampled with temperature T and top-k K."""
    scaled = (row - row.max()) / T
    keep = np.zeros(row.shape, bool)
    keep[np.argsort(-scaled, kind="stable")[:K]] = True
    logits = np.where(keep, scaled, -np.inf)
    return logits, np.where(keep, _log_softmax(logits), FLOOR)


@functools.cache
def _mode_llm(mode: str, sum_smaller: bool = False) -> LLM:
    overrides = {"sampling.compute_sum_smaller_probs": True} if sum_smaller else {}
    return LLM("tiny-v3", logprobs_mode=mode, **SMALL, **overrides)


SAMPLED = SamplingParams(temperature=T, top_k=K, max_tokens=4, ignore_eos=True, logprobs=2, seq_seed=11)


def test_sum_smaller_probs_is_the_inclusive_cdf(llm):
    """Ids in ascending probability under the processed distribution (temperature, top-k): the chosen token's
    entry is the probability mass of every id up to and including it; the default engine reports None."""
    assert all(
        e.sum_smaller_probs is None for o in _generate(llm, SAMPLED) for d in o.logprobs for e in d.values()
    )
    outs = _generate(_mode_llm("processed_logprobs", sum_smaller=True), SAMPLED)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        for k, row in enumerate(_positions(prompt, out)):
            p = np.exp(_processed(row)[1])
            for token, entry in out.logprobs[k].items():
                assert abs(entry.sum_smaller_probs - p[p <= p[token]].sum()) < TOL


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_logprobs_mode(mode, llm):
    """Each of vLLM's four values reports its own quantity for the chosen token and the top-2 alternatives,
    which are ranked in the same values."""
    engine = llm if mode == "raw_logprobs" else _mode_llm(mode, sum_smaller=mode == "processed_logprobs")
    assert engine.logprobs_mode == mode
    for prompt, out in zip(PROMPTS, _generate(engine, SAMPLED), strict=True):
        for k, row in enumerate(_positions(prompt, out)):
            logits, logprobs = _processed(row)
            want = {
                "raw_logprobs": _log_softmax(row),
                "raw_logits": row,
                "processed_logprobs": logprobs,
                "processed_logits": logits,
            }[mode]
            order = np.argsort(-want, kind="stable")
            assert set(out.logprobs[k]) == set(order[:2].tolist()) | {out.token_ids[k]}
            for token, entry in out.logprobs[k].items():
                assert abs(entry.logprob - want[token]) < TOL, (mode, k, token)
                assert entry.rank == int(np.flatnonzero(order == token)[0]) + 1


def test_logprobs_mode_is_checked_before_loading():
    with pytest.raises(ValueError, match=r"logprobs_mode: 'processed' is not one of"):
        LLM("tiny-v3", logprobs_mode="processed", **SMALL)
