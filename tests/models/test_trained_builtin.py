"""The trained built-in models: shipped bytes, loading without training, engine greedy = full-forward greedy,
and the engine's text score (`deepinfer-jax eval`) against a full-forward reference."""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest
from greedy_reference import greedy_reference  # tests/greedy_reference.py

from deepinfer_jax import LLM, SamplingParams, load_model
from deepinfer_jax.checkpoint.reader import open_checkpoint
from deepinfer_jax.cli import main as cli
from deepinfer_jax.cli.common import resolve_model
from deepinfer_jax.evaluation import evaluate_text
from deepinfer_jax.models import builtin

TRAINED = ("shakespeare-v41", "shakespeare-v3")
FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "training.json"}
MAX_BYTES = 25 * 2**20

# sha256 of the shipped files (deepinfer_jax/models/trained/<name>/), written by scripts/train_tiny.py --ship with
# the command recorded in each folder's training.json. A change here means the shipped weights changed.
EXPECTED_SHA256 = {
    "shakespeare-v41": {
        "config.json": "d26cec14b6090df40d312b0803e10f927774a0649a6be12e40bc7a256bb94bb7",
        "model.safetensors": "00872b14e61de82ef3e8085f68640c80e920ef69522e6e45472be8caff9ec58d",
        "tokenizer.json": "4a98fb026d1cbcc42e7e05e00f6180b126eb72468987241915e1522b8f966ac9",
    },
    "shakespeare-v3": {
        "config.json": "1b64ae57c450c44c7d272bc4bf378aa9cd9a390c10a53093eb544a7498746a48",
        "model.safetensors": "00a8b5a2c01aba1b9b47589d39de80f63dc324dfc03a035cd85f9905c262dfd5",
        "tokenizer.json": "4a98fb026d1cbcc42e7e05e00f6180b126eb72468987241915e1522b8f966ac9",
    },
}

# sha256 over shakespeare-v41's backbone tensors (every stored tensor but the drafter's ``mtp.*``: name, dtype, bytes,
# in name order), as first shipped. The drafter was retrained since (``--drafter_only``) against this backbone,
# which the shipped folder must keep byte for byte.
V41_BACKBONE_SHA256 = "c1713a168c6fc9cb93d1e1fa53acf05dc05b845685470ccf2794664e7ac63892"

# Held-out text (Julius Caesar, III.2, public domain; the play is not in the training split).
HELD_OUT = """ANTONY.
Friends, Romans, countrymen, lend me your ears;
I come to bury Caesar, not to praise him.
The evil that men do lives after them,
The good is oft interred with their bones:
So let it be with Caesar. The noble Brutus
Hath told you Caesar was ambitious:
If it were so, it was a grievous fault,
And grievously hath Caesar answer'd it.
"""


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("name", TRAINED)
def test_shipped_folder_bytes_and_record(name):
    folder = builtin.materialize(name)
    assert folder == builtin.trained_folder(name) and folder.is_dir()
    assert {p.name for p in folder.iterdir()} == FILES
    for file, digest in EXPECTED_SHA256[name].items():
        assert _sha256(folder / file) == digest, f"{name}/{file}"
    assert all((folder / f).stat().st_size <= MAX_BYTES for f in FILES)
    record = json.loads((folder / "training.json").read_text())
    assert record["name"] == name and record["command"].startswith("python scripts/train_tiny.py --recipe ")
    assert not record["steps_overridden"] and record["corpus"]["held_out"] == ["julius_caesar", "tempest"]
    if name == "shakespeare-v41":
        assert "--drafter_only" in record["command"].split()
        assert record["backbone_from"]["command"].startswith("python scripts/train_tiny.py --recipe ")
        digest = hashlib.sha256()
        with open_checkpoint(folder) as reader:
            for tensor in reader.names():
                if not tensor.startswith("mtp."):
                    array = reader.read(tensor)
                    for part in (tensor.encode(), str(array.dtype).encode(), array.tobytes()):
                        digest.update(part)
        assert digest.hexdigest() == V41_BACKBONE_SHA256
    model = builtin.get_builtin(name)
    assert not model.random_weights and model.weight_generator is None
    assert model.yaml_path == folder / "config.json"
    assert resolve_model(name) == (str(folder / "config.json"), name)


def test_materialize_of_a_trained_model_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(builtin.CACHE_ENV_VAR, str(tmp_path))
    for name in TRAINED:
        builtin.materialize(name)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def engines():
    """One float32 engine per trained model, shared by the tests below (one compile each)."""
    return {
        name: LLM(name, dtype="float32", kv_cache_memory="64MiB", max_num_seqs=4, max_num_batched_tokens=128)
        for name in TRAINED
    }


@pytest.mark.parametrize("name", TRAINED)
def test_engine_greedy_equals_full_forward_greedy(engines, name):
    llm = engines[name]
    model = load_model(name, "float32")
    prompts = [llm.tokenizer.encode(text, add_bos=True) for text in ("ANTONY.\nFriends, Romans,", "O")]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == greedy_reference(model, prompt, 8, 32)
    text = outputs[0].outputs[0].text
    assert sum(c.isalpha() for c in text) >= len(text) // 2, text  # words, not byte noise


def _reference_nats(model, tok, text: str, chunk: int) -> tuple[float, int]:
    """The same chunks scored by full forwards (float64 log-softmax of the model's logits); every chunk is padded
    to one length (one compile; the forward is causal, so padding after a position never changes it)."""
    ids = tok.encode(text)
    nats, count = 0.0, 0
    for start in range(0, len(ids), chunk):
        seq = [tok.bos_id, *ids[start : start + chunk]]
        padded = np.full((1, chunk + 1), tok.pad_id, np.int32)
        padded[0, : len(seq)] = seq
        logits = np.asarray(model.logits(padded)[0, : len(seq)], np.float64)
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        nats -= sum(logp[i, t] for i, t in enumerate(seq[1:]))
        count += len(seq) - 1
    return nats, count


def test_engine_text_score_equals_a_full_forward_reference(engines):
    llm = engines["shakespeare-v41"]
    score = evaluate_text(llm, HELD_OUT, chunk_tokens=40)
    nats, count = _reference_nats(load_model("shakespeare-v41", "float32"), llm.tokenizer, HELD_OUT, 40)
    assert score.tokens == count and score.chunks == math.ceil(count / 40)
    assert score.characters == len(HELD_OUT)
    # The engine's cached prefill and the full forward differ by float32 reassociation only.
    assert abs(score.nats - nats) <= 1e-4 * count, (score.nats, nats)
    assert score.bits_per_char == pytest.approx(nats / math.log(2) / len(HELD_OUT), rel=1e-4)
    assert score.perplexity == pytest.approx(math.exp(nats / count), rel=1e-3)
    assert score.bits_per_char < 3.5  # a trained model on unseen Shakespeare (uniform bytes would be 8)
    with pytest.raises(ValueError, match=r"chunk_tokens: 0; must be an int in \[1, max_model_len - 2"):
        evaluate_text(llm, HELD_OUT, chunk_tokens=0)
    with pytest.raises(ValueError, match="text: expected a non-empty str"):
        evaluate_text(llm, "")


def test_eval_subcommand(engines, tmp_path, capsys, monkeypatch):
    """The command line's flags reach LLM and the printed figures are evaluate_text's. The engine it builds is
    the module's shared one (same settings; building another would only compile the same engine again)."""
    from deepinfer_jax.engine import llm as llm_module

    seen = []

    def shared_engine(model, **kwargs):
        seen.append((model, kwargs))
        return engines[model]

    monkeypatch.setattr(llm_module, "LLM", shared_engine)
    path = tmp_path / "held_out.txt"
    path.write_text(HELD_OUT)
    args = [
        "deepinfer-jax",
        "eval",
        "--model=shakespeare-v41",
        f"--text={path}",
        "--dtype=float32",
        "--chunk_tokens=40",
        "--kv_cache_memory=64MiB",
        "--max_num_seqs=4",
        "--max_num_batched_tokens=128",
    ]
    assert cli.main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    model, kwargs = seen[0]
    assert model == "shakespeare-v41" and kwargs["dtype"] == "float32"
    assert kwargs["kv_cache_memory"] == "64MiB" and kwargs["max_num_seqs"] == 4
    assert kwargs["max_num_batched_tokens"] == 128
    expected = evaluate_text(engines["shakespeare-v41"], HELD_OUT, chunk_tokens=40)
    assert result["nats"] == pytest.approx(expected.nats, rel=1e-9) and result["tokens"] == expected.tokens
    assert result["dtype"] == "float32" and result["characters"] == len(HELD_OUT)
    assert result["bits_per_char"] == pytest.approx(result["nats"] / math.log(2) / len(HELD_OUT))
    assert 0 < result["bits_per_char"] < 3.5 and result["tokens_per_s"] > 0
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "bits/char:" in out and "perplexity:" in out and "tokens/s:" in out
    assert (
        cli.main(["deepinfer-jax", "eval", "--model=shakespeare-v41", f"--text={tmp_path / 'none.txt'}"]) == 2
    )
    assert "--text" in capsys.readouterr().err
    assert cli.subcommands()["eval"].module == "deepinfer_jax.cli.eval"


def test_json_answers_of_a_trained_model_read_as_text(engines):
    """Structured outputs on a trained model: compact JSON (no free whitespace) that parses, validates, and whose
    strings are words -- the model's own text in the grammar's frame. (With free whitespace allowed this model,
    trained on verse, fills the object with spaces and newlines until max_tokens: docs/structured_outputs.md.)"""
    import re

    import jsonschema

    from deepinfer_jax import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {
            "speaker": {"type": "string", "maxLength": 20},
            "line": {"type": "string", "maxLength": 60},
        },
        "required": ["speaker", "line"],
        "additionalProperties": False,
    }
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    llm = engines["shakespeare-v3"]
    prompts = ["HAMLET.\nTo be, or not to be, that is the question:\n", "KING LEAR.\n", "O"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=so),
        SamplingParams(temperature=0.8, seed=1, max_tokens=60, structured_outputs=so),
    ]
    for p in params:
        for out in llm.generate(prompts, p, use_tqdm=False):
            c = out.outputs[0]
            assert c.finish_reason == "stop", (c.text, c.finish_reason)
            value = json.loads(c.text)
            jsonschema.validate(value, schema)
            text = " ".join(value.values())
            letters = sum(ch.isalpha() or ch == " " for ch in text)
            assert letters >= 0.75 * len(text), text  # text, not punctuation or byte noise
            assert len(re.findall(r"\b[A-Za-z']{2,}\b", text)) >= 4, text  # words
