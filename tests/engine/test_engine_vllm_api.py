"""vLLM's offline API with vLLM's semantics: ``n`` samples forked from one prefill, the stop / detokenize options,
``logit_bias`` / ``allowed_token_ids`` / ``bad_words``, ``max_tokens=None``, ``PromptType`` inputs and prompt
truncation, ``dtype="auto"``, ``get_tokenizer()``, ``chat()``'s template options and ``close()``.

The token-level checks compare with greedy decoding by repeated full forwards (``Model.logits``) with the same
logit transform applied in numpy: an independent reference. tiny-v3 in float32 through one small engine
(``max_model_len=64``) shared by the module.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import deepinfer_jax
from deepinfer_jax.engine.llm import LLM
from deepinfer_jax.engine.params import SamplingParams, derive_seed

SMALL = {
    "dtype": "float32",
    "max_num_seqs": 4,
    "max_num_batched_tokens": 16,
    "kv_cache_memory": "4MiB",
    "max_model_len": 64,
}
PROMPT = [(7 * i) % 400 + 3 for i in range(20)]
REF_LEN = 64


@functools.cache
def _llm() -> LLM:
    return LLM("tiny-v3", **SMALL)


@functools.cache
def _model():
    return deepinfer_jax.load_model("tiny-v3", "float32")


def _last_logits(seq: list[int]) -> np.ndarray:
    ids = np.zeros((1, REF_LEN), np.int32)
    ids[0, : len(seq)] = seq
    return np.asarray(_model().logits(ids), np.float64)[0, len(seq) - 1]


def _greedy(prompt: list[int], n: int, transform=lambda row, out: row) -> list[int]:
    """Greedy decoding by full forwards; ``transform(logits, output_so_far)`` edits each step's logits."""
    out: list[int] = []
    for _ in range(n):
        row = transform(_last_logits(prompt + out).copy(), out)
        out.append(int(np.argmax(row)))
    return out


def _gen(params: SamplingParams, prompt=PROMPT, **kwargs):
    return _llm().generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False, **kwargs)[0]


def _all_free(llm: LLM) -> bool:
    return all(
        d.blocks.num_free == d.blocks.capacity and d.slots.num_free == d.slots.capacity
        for d in llm.scheduler.devices
    )


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_n_samples_are_forks_of_one_prefill_with_derived_seeds():
    llm = _llm()
    stats = llm.scheduler.devices[0].stats
    p = SamplingParams(temperature=0.8, max_tokens=5, ignore_eos=True, n=3, seed=7, logprobs=1)
    before = stats.num_prefill_tokens
    out = _gen(p)
    forked_prefill = stats.num_prefill_tokens - before
    assert [c.index for c in out.outputs] == [0, 1, 2]
    got = [c.token_ids for c in out.outputs]
    # vLLM: sample i of a seeded request is the request alone with seed derive_seed(seed, i).
    alone = []
    before = stats.num_prefill_tokens
    for i in range(3):
        alone.append(_gen(p.replace(n=1, seed=derive_seed(7, i))).outputs[0].token_ids)
    single_prefill = (stats.num_prefill_tokens - before) / 3
    assert got == alone
    assert len({tuple(t) for t in got}) > 1  # the samples are not copies of one another
    # The prompt but its last token is prefilled once for the group; then each sample feeds the last prompt
    # token itself (its own first sample). Alone, each sample prefills the whole prompt.
    assert single_prefill == len(PROMPT)
    assert forked_prefill == len(PROMPT) - 1 + 3
    assert out.metrics.num_generated_tokens == 15
    assert _all_free(llm)


def test_n_with_greedy_gives_n_equal_completions_and_is_refused_beyond_max_num_seqs():
    out = _gen(GREEDY.replace(n=2))
    assert out.outputs[0].token_ids == out.outputs[1].token_ids == _greedy(PROMPT, 6)
    with pytest.raises(ValueError, match="n"):
        _gen(GREEDY.replace(n=5))  # max_num_seqs = 4
    assert _all_free(_llm())


def test_removed_fields_point_to_their_replacements():
    with pytest.raises(TypeError, match="n"):
        SamplingParams(best_of=2)
    with pytest.raises(TypeError, match="tokenization_kwargs"):
        SamplingParams(truncate_prompt_tokens=4)


def test_include_stop_str_in_output():
    full = _gen(GREEDY.replace(max_tokens=12))
    text = full.outputs[0].text
    assert len(text) > 4
    stop = text[2:4]
    start = text.index(stop)
    cut = _gen(GREEDY.replace(max_tokens=12, stop=[stop])).outputs[0]
    kept = _gen(GREEDY.replace(max_tokens=12, stop=[stop], include_stop_str_in_output=True)).outputs[0]
    assert cut.finish_reason == kept.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[:start]
    assert kept.text == text[: start + len(stop)]


def test_skip_special_tokens_and_detokenize():
    tok = _llm().get_tokenizer()
    bos = tok.bos_id
    forced = GREEDY.replace(max_tokens=3, logit_bias={bos: 100.0})
    skipped = _gen(forced).outputs[0]
    shown = _gen(forced.replace(skip_special_tokens=False)).outputs[0]
    assert skipped.token_ids == shown.token_ids == [bos] * 3
    assert skipped.text == ""
    # Byte-level decoding writes special tokens without separators, as tokenizer.decode does (vLLM's fast path);
    # spaces_between_special_tokens has nothing to insert for such a tokenizer.
    assert shown.text == tok.decode([bos] * 3, skip_special_tokens=False) == tok.id_to_token(bos) * 3
    with_text = _gen(GREEDY.replace(logprobs=1)).outputs[0]
    ids_only = _gen(GREEDY.replace(logprobs=1, detokenize=False)).outputs[0]
    assert ids_only.token_ids == with_text.token_ids
    assert ids_only.text == "" and with_text.text
    assert all(lp.decoded_token is None for step in ids_only.logprobs for lp in step.values())
    assert all(lp.decoded_token is not None for step in with_text.logprobs for lp in step.values())
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_logit_bias_allowed_token_ids_and_bad_words_match_the_transformed_full_forward():
    plain = _greedy(PROMPT, 6)
    bias = {plain[0]: -30.0, 17: 4.0, 300: 2.5}

    def biased(row, out):
        for t, b in bias.items():
            row[t] += b
        return row

    # JSON-style string keys are accepted, as vLLM's server gives them.
    got = _gen(GREEDY.replace(logit_bias={str(k): v for k, v in bias.items()})).outputs[0].token_ids
    assert got == _greedy(PROMPT, 6, biased) != plain

    allowed = [11, 57, 300, 301, 450]

    def only(row, out):
        keep = np.full_like(row, -np.inf)
        keep[allowed] = row[allowed]
        return keep

    got = _gen(GREEDY.replace(allowed_token_ids=allowed)).outputs[0].token_ids
    assert got == _greedy(PROMPT, 6, only) and set(got) <= set(allowed)

    tok = _llm().get_tokenizer()
    # Words the greedy output would write: a one-token word and a two-token word (tokens that survive a
    # decode / encode round trip, so the word names exactly those tokens).
    longer = _greedy(PROMPT, 12)
    k1 = next(k for k in range(1, 12) if tok.encode(tok.decode([longer[k]])) == [longer[k]])
    k2 = next(
        k for k in range(12 - 1) if k != k1 and tok.encode(tok.decode(longer[k : k + 2])) == longer[k : k + 2]
    )
    words = [tok.decode([longer[k1]]), tok.decode(longer[k2 : k2 + 2])]

    # vLLM's rule, restated: each word's ids (leading spaces stripped), and those of " " + word when that is another sequence of the same
    # length; a word's last id is masked when the output ends with its other ids.
    sequences = []
    for w in words:
        plain_ids, spaced = tok.encode(w.lstrip()), tok.encode(" " + w.lstrip())
        sequences.append(plain_ids)
        if spaced[0] != plain_ids[0] and len(spaced) == len(plain_ids):
            sequences.append(spaced)

    def banned(row, out):
        for ids in sequences:
            if len(ids) == 1 or out[len(out) - len(ids) + 1 :] == ids[:-1]:
                row[ids[-1]] = -np.inf
        return row

    got = _gen(GREEDY.replace(max_tokens=12, bad_words=words)).outputs[0].token_ids
    assert got == _greedy(PROMPT, 12, banned) != longer
    assert longer[k1] not in got
    with pytest.raises(ValueError, match="allowed_token_ids"):
        _gen(GREEDY.replace(allowed_token_ids=[1 << 20]))
    with pytest.raises(ValueError, match="logit_bias"):
        _gen(GREEDY.replace(logit_bias={1 << 20: 1.0}))


def test_max_tokens_none_runs_to_max_model_len():
    out = _gen(SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True), prompt=PROMPT[:10]).outputs[
        0
    ]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 64 - 10


def test_prompt_types_and_truncation():
    llm = _llm()
    tok = llm.get_tokenizer()
    assert tok is llm.tokenizer
    text = "hello world"
    ids = tok.encode(text, add_bos=True)  # a text prompt starts with BOS, as vLLM's DeepSeek tokenizer does
    outs = llm.generate(
        [text, {"prompt": text}, {"prompt_token_ids": ids}, {"prompt_token_ids": ids, "prompt": "shown"}],
        GREEDY,
        use_tqdm=False,
    )
    assert [o.prompt for o in outs] == [text, text, None, "shown"]
    assert all(o.prompt_token_ids == ids for o in outs)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert outs[0].outputs[0].token_ids == _greedy(ids, 6)
    no_bos = llm.generate(text, GREEDY, use_tqdm=False, tokenization_kwargs={"add_special_tokens": False})[0]
    assert no_bos.prompt_token_ids == tok.encode(text) == ids[1:]
    left = _gen(GREEDY, tokenization_kwargs={"truncate_prompt_tokens": 5})
    assert left.prompt_token_ids == PROMPT[-5:]
    assert left.outputs[0].token_ids == _greedy(PROMPT[-5:], 6)
    right = _gen(GREEDY, tokenization_kwargs={"truncate_prompt_tokens": 5, "truncation_side": "right"})
    assert right.prompt_token_ids == PROMPT[:5]
    long = [3 + i % 300 for i in range(80)]
    most = _gen(GREEDY.replace(max_tokens=1), prompt=long, tokenization_kwargs={"truncate_prompt_tokens": -1})
    assert most.prompt_token_ids == long[-63:]  # max_model_len - 1: room for one generated token
    with pytest.raises(ValueError, match="unsupported key"):
        llm.generate([{"text": "x"}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="truncation_side"):
        _gen(GREEDY, tokenization_kwargs={"truncate_prompt_tokens": 2, "truncation_side": "middle"})
    assert _all_free(llm)


def test_chat_template_options_and_outputs():
    llm = _llm()
    p = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1, ignore_eos=True)
    user = [{"role": "user", "content": "hi"}]
    markers = deepinfer_jax.text.ChatEncoder(llm.tokenizer, "v4").marker_ids
    opening = (markers["<｜Assistant｜>"], markers["</think>"])
    a = llm.chat(user, p, use_tqdm=False)[0]
    assert a.prompt_token_ids[-2:] == opening
    alone = llm.generate(prompt_token_ids=[list(a.prompt_token_ids)], sampling_params=p, use_tqdm=False)[0]
    assert list(a.token_ids) == alone.outputs[0].token_ids
    assert len(a.logprobs) == 4 and all(t in lp for t, lp in zip(a.token_ids, a.logprobs))
    b = llm.chat(user, p, use_tqdm=False, add_generation_prompt=False)[0]
    assert b.prompt_token_ids == a.prompt_token_ids[:-2]
    partial = [*user, {"role": "assistant", "content": "Hel"}]
    c = llm.chat(partial, p, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    hel = llm.tokenizer.encode("Hel")
    assert c.prompt_token_ids == (*a.prompt_token_ids, *hel)  # the reply continues the open message
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(partial, p, use_tqdm=False, continue_final_message=True)
    with pytest.raises(ValueError, match="assistant"):
        llm.chat(user, p, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)


def test_dtype_auto_follows_the_checkpoint():
    # The built-in random model declares no torch_dtype: production mode, as vLLM's "auto" gives bfloat16.
    with LLM("tiny-v3", **{**SMALL, "dtype": "auto"}) as llm:
        assert llm.config.dtype == "bfloat16"
    with pytest.raises(ValueError, match="dtype"):
        LLM("tiny-v3", **{**SMALL, "dtype": "float16"})


def test_close_and_context_manager_release_the_engine():
    with LLM("tiny-v3", **SMALL) as llm:
        first = llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY, use_tqdm=False)[0]
        executor = llm.executor
    assert first.outputs[0].token_ids == _greedy(PROMPT, 6)
    assert executor.cache is None and executor.state is None
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY, use_tqdm=False)
    llm.close()  # closing twice is harmless
