"""`generate` / `chat`: a flag per SamplingParams argument, defaults in the help, every flag checked before the
model loads, one default dtype for every command and `LLM`."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from absl import flags

from deepinfer_jax.cli import chat as chat_cli
from deepinfer_jax.cli import common
from deepinfer_jax.cli import generate as generate_cli
from deepinfer_jax.cli import main as cli
from deepinfer_jax.engine.params import SamplingParams


def _flags(module, *args: str) -> flags.FlagValues:
    fv = flags.FlagValues()
    module.define_flags(fv)
    fv(["prog", "--model=tiny-v3", *args])
    return fv


@pytest.mark.parametrize("module", [generate_cli, chat_cli])
def test_every_sampling_params_field_is_a_flag(module):
    fv = _flags(module)
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    arguments = set(inspect.signature(SamplingParams.__init__).parameters) - {"self", "removed"}
    # seq_seed is spelled --seed (its alias); so_args (structured outputs) is refused by SamplingParams itself;
    # output_kind says what AsyncLLM streams hold (the commands print final outputs); structured_outputs is
    # given by --json_schema / --regex / --choice / --grammar / --json_object.
    skipped = {"seq_seed", "so_args", "output_kind", "structured_outputs"}
    missing = sorted(name for name in (fields | arguments) - skipped if name not in fv)
    assert not missing
    for name in ("stop", "logprobs", "min_p", "n", "seed", "logit_bias", "bad_words", "allowed_token_ids"):
        assert name in fv


def test_a_new_sampling_argument_without_a_flag_is_an_error(monkeypatch):
    """The flags are derived from SamplingParams.__init__: an argument the CLI does not know fails loudly."""
    original = SamplingParams.__init__

    def init(self, temperature: float = 1.0, *, new_knob: int = 0) -> None:
        original(self, temperature)

    monkeypatch.setattr(SamplingParams, "__init__", init)
    with pytest.raises(TypeError, match=r"SamplingParams\.new_knob .* has no command-line flag"):
        common.sampling_flags()


def test_flags_build_the_sampling_params_they_describe():
    fv = _flags(
        generate_cli,
        "--temperature=0.7",
        "--min_p=0.1",
        "--n=3",
        "--seed=7",
        "--stop=a",
        "--stop=bc",
        "--logprobs=2",
        "--stop_token_ids=[5, 6]",
        "--allowed_token_ids=9,3,4",
        '--logit_bias={"5": -100, "7": 2.5}',
        "--bad_words=foo",
        "--include_stop_str_in_output",
        "--noskip_special_tokens",
        "--max_tokens=9",
        "--min_tokens=2",
    )
    got = common.sampling_params_from_flags(fv)
    want = SamplingParams(
        temperature=0.7,
        min_p=0.1,
        n=3,
        seed=7,
        stop=["a", "bc"],
        logprobs=2,
        stop_token_ids=[5, 6],
        allowed_token_ids=[9, 3, 4],
        logit_bias={5: -100, 7: 2.5},
        bad_words=["foo"],
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        max_tokens=9,
        min_tokens=2,
    )
    assert got == want
    # Unset flags are SamplingParams' own defaults (max_tokens: the command's).
    assert common.sampling_params_from_flags(_flags(generate_cli)) == SamplingParams(max_tokens=16)
    assert common.sampling_params_from_flags(_flags(chat_cli)) == SamplingParams(max_tokens=256)


def test_help_shows_every_default(capsys):
    assert cli.main(["deepinfer-jax", "generate", "--help"]) == 0
    out = capsys.readouterr().out
    for line in (
        "--top_p: ",
        "--temperature: ",
        "--max_tokens: most tokens to generate per sample (default: 16)",
        "--n: samples per prompt",
        "--max_num_seqs: most sequences per step (default: 256)",
        "--verbose: ",
    ):
        assert line in out, line
    assert "(default: bfloat16)" in out and "(default: 1.0)" in out
    fv = flags.FlagValues()
    generate_cli.define_flags(fv)
    assert out.count("(default: ") == len(fv) > 40  # one per flag
    assert cli.main(["deepinfer-jax", "chat", "--help"]) == 0
    assert "--max_tokens: most tokens to generate per sample (default: 256)" in capsys.readouterr().out


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading a model is an error: the command must refuse bad flags before it gets there."""
    from deepinfer_jax.engine import llm

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(llm, "LLM", refuse)


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--top_p=2"], "--top_p=2.0: SamplingParams.top_p = 2.0 must be in (0, 1]"),
        (["--temperature=1e-40"], "--temperature=1e-40: SamplingParams.temperature"),
        (["--min_p=-0.5"], "--min_p=-0.5"),
        (["--n=0"], "--n=0: SamplingParams.n = 0 must be in [1,"),
        (["--logprobs=99"], "--logprobs=99"),
        (["--seed=-1"], "--seed=-1"),
        (["--max_tokens=2", "--min_tokens=5"], "--min_tokens=5: SamplingParams.min_tokens = 5"),
        (["--logit_bias={5: 1"], "--logit_bias='{5: 1' is not JSON"),
        (["--logit_bias=[1]"], "--logit_bias='[1]': expected a JSON object"),
        (['--logit_bias={"x": 1}'], "--logit_bias="),
        (["--allowed_token_ids=1,a"], "--allowed_token_ids='1,a'"),
        (["--stop_token_ids=[-3]"], "--stop_token_ids="),
        (["--bad_words= "], "--bad_words="),
        (["--stop=x", "--nodetokenize"], "--stop="),
    ],
)
def test_bad_flags_are_refused_before_the_model_loads(capsys, no_model_load, command, args, message):
    prompt = ["--prompt=hi"] if command == "generate" else ["--message=user: hi"]
    rc = cli.main(["deepinfer-jax", command, "--model=tiny-v3", *prompt, *args])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert message in err


def test_chat_refuses_several_samples_before_the_model_loads(capsys, no_model_load):
    rc = cli.main(["deepinfer-jax", "chat", "--model=tiny-v3", "--message=user: hi", "--n=2"])
    assert rc == 2 and "--n=2: chat prints one reply per conversation" in capsys.readouterr().err


def test_bad_prompts_and_models_are_refused_before_the_model_loads(capsys, no_model_load):
    rc = cli.main(["deepinfer-jax", "generate", "--model=tiny-v3", "--prompt_ids=5,x"])
    assert rc == 2 and "--prompt_ids[0]" in capsys.readouterr().err
    rc = cli.main(["deepinfer-jax", "generate", "--model=no-such-model", "--prompt=x"])
    assert rc == 2 and "--model: 'no-such-model'" in capsys.readouterr().err
    # Token ids against the model's config.json (tiny-v3: 512 tokens, 2048 positions), before any weight.
    rc = cli.main(["deepinfer-jax", "generate", "--model=tiny-v3", "--prompt_ids=5,512"])
    err = capsys.readouterr().err
    assert rc == 2 and "--prompt_ids[0]: prompt_token_ids[1] = 512 is outside the vocabulary [0, 512)" in err
    rc = cli.main(
        [
            "deepinfer-jax",
            "generate",
            "--model=tiny-v3",
            "--prompt_ids=5,6,7",
            "--max_model_len=8",
            "--max_tokens=6",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "--prompt_ids[0]: " in err and "max_model_len" in err
    rc = cli.main(["deepinfer-jax", "chat", "--model=no-such-model", "--message=user: x"])
    assert rc == 2 and "--model: 'no-such-model'" in capsys.readouterr().err


def test_one_default_dtype_everywhere():
    """generate, chat, bench (and sweep, through bench's flags) and LLM share one default precision mode."""
    from deepinfer_jax.bench import Workload
    from deepinfer_jax.cli import bench as bench_cli
    from deepinfer_jax.engine.llm import LLM_DEFAULTS

    defaults = {common.DEFAULT_DTYPE, LLM_DEFAULTS["dtype"], Workload().dtype}
    for module in (generate_cli, chat_cli, bench_cli):
        fv = flags.FlagValues()
        module.define_flags(fv)
        defaults.add(fv["dtype"].default)
    assert defaults == {"bfloat16"}


def test_engine_errors_name_flags(capsys):
    """Errors the engine raises about its arguments and overrides name the flags that set them."""
    assert common.flag_message(ValueError("max_num_seqs = 3 (set by LLM argument max_num_seqs): x")) == (
        "max_num_seqs = 3 (set by --max_num_seqs): x"
    )
    assert (
        common.flag_message(ValueError("seed: bad [set by LLM argument seed]"))
        == "seed: bad [set by --engine_seed]"
    )
    assert (
        common.flag_message(ValueError("y = 1: z [set by override cache.y]"))
        == "y = 1: z [set by --set cache.y]"
    )
    rc = cli.main(
        ["deepinfer-jax", "generate", "--model=tiny-v3", "--prompt=hi", "--set=scheduler.max_num_seqs=8"]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert "--set: 'scheduler.max_num_seqs' is the --max_num_seqs; pass it as that" in err
