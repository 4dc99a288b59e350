"""Flags shared by the subcommands that build an engine config (`--model`, `--config`, gin, overrides).

Flag values are the highest-priority config source (ARCHITECTURE.md §6); a flag left unset is `None` and lets a
lower source (yaml, gin, `DEEPINFER_*` environment, HF config, defaults) apply.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from pathlib import Path
from typing import Any

from absl import flags

from deepinfer_jax import config as config_lib


def define_config_flags(fv: flags.FlagValues, *, model_required: bool = False) -> None:
    flags.DEFINE_string(
        "model",
        None,
        "a built-in model name (tiny-v3, tiny-v4, tiny-v41, shakespeare-v41, shakespeare-v3), a model folder "
        "with config.json, a config.json, or a yaml config file",
        flag_values=fv,
        required=model_required,
    )
    flags.DEFINE_string("config", None, "a yaml config file (model: and engine sections)", flag_values=fv)
    flags.DEFINE_multi_string("gin_file", [], "gin files binding config fields (repeatable)", flag_values=fv)
    flags.DEFINE_multi_string(
        "gin_binding", [], "a gin binding, e.g. 'cache.block_size = 64' (repeatable)", flag_values=fv
    )
    flags.DEFINE_multi_string(
        "set",
        [],
        "override one config field: --set scheduler.max_num_seqs=8 (value parsed as yaml; repeatable)",
        flag_values=fv,
    )


def resolve_model(name_or_path: str | None) -> tuple[str | None, str | None]:
    """Map a built-in model name to its yaml config; returns (path, builtin name or None)."""
    if name_or_path is None:
        return None, None
    from deepinfer_jax.models import builtin

    if builtin.is_builtin(name_or_path):
        return str(builtin.get_builtin(name_or_path).yaml_path), name_or_path
    if not Path(name_or_path).exists():
        known = ", ".join(builtin.list_builtin())
        raise ValueError(
            f"--model: {name_or_path!r} is neither a built-in model ({known}) nor an existing path"
        )
    return name_or_path, None


def config_from_flags(fv: flags.FlagValues, **extra_overrides: Any) -> config_lib.EngineConfig:
    model_path, _ = resolve_model(fv.model)
    overrides = config_lib.parse_overrides(fv.set)
    overrides.update({k: v for k, v in extra_overrides.items() if v is not None})
    return config_lib.load_config(
        model_path,
        yaml_path=fv.config,
        gin_files=tuple(fv.gin_file),
        gin_bindings=tuple(fv.gin_binding),
        overrides=overrides,
    )


DEFAULT_DTYPE = "bfloat16"
"""The precision mode of every command that runs the engine (`generate`, `chat`, `bench`, `sweep`) and of `LLM`.

bfloat16, the precision the DeepSeek checkpoints are published in and served at: what a command prints (tokens,
throughput, the cache plan) describes the model as it is deployed. float32 is the parity mode, for comparisons
against the reference forward; ask for it with `--dtype=float32`. The same default everywhere means one prompt
gives the same tokens from `generate`, `chat`, `bench` and `LLM(...)`."""

DTYPE_HELP = (
    "precision mode: bfloat16 (the checkpoints' own precision; the default of every command and of LLM) or "
    "float32 (parity with the reference forward); generate and chat also take auto (the checkpoint's torch_dtype: "
    "float32 gives parity mode, anything else bfloat16)"
)

# One line of help per SamplingParams argument; a new argument without an entry here is an error at flag
# definition time (tests define the flags), so no field can be missing from the command line.
_SAMPLING_HELP: dict[str, str] = {
    "temperature": "sampling temperature; 0 = greedy (exact argmax)",
    "top_p": "nucleus sampling: keep the smallest set of tokens with this much probability, in (0, 1]",
    "top_k": "keep the k most probable tokens; -1 or 0 = off",
    "min_p": "drop tokens less probable than min_p times the most probable one, in [0, 1]",
    "repetition_penalty": "vLLM's repetition penalty over prompt and output tokens, > 0 (1 = off)",
    "presence_penalty": "subtracted from the logit of every token already generated, in [-2, 2]",
    "frequency_penalty": "subtracted per earlier occurrence of a generated token, in [-2, 2]",
    "max_tokens": "most tokens to generate per sample",
    "min_tokens": "tokens generated before EOS or a stop may end the sample",
    "stop": "a stop string, matched on the text (repeatable)",
    "stop_token_ids": "token ids that end a sample, as a JSON list '[5, 7]' or '5,7'",
    "ignore_eos": "keep generating after EOS",
    "logprobs": "report the chosen token's logprob and this many alternatives (0..20)",
    "top_logprobs": "alternatives per token with logprobs (DeepInfer's spelling; same as --logprobs)",
    "prompt_logprobs": "report each prompt token's logprob and this many alternatives (0..20)",
    "seed": "the sampling seed of every request (sample i of --n uses a seed derived from it and i); "
    "unset = derived from --engine_seed and the request's index",
    "golden_token_ids": "teacher forcing: the output tokens to force, as a JSON list or comma-separated ids",
    "first_n_token_no_eos": "EOS cannot be sampled as one of the first n output tokens",
    "n": "samples per prompt (the prompt is prefilled once and shared)",
    "include_stop_str_in_output": "keep the matched stop string at the end of the text",
    "skip_special_tokens": "leave special tokens out of the text",
    "spaces_between_special_tokens": "put spaces between special tokens in the text",
    "detokenize": "decode the text (--nodetokenize: token ids only)",
    "logit_bias": 'added to the logits of token ids, as a JSON object \'{"5": -100, "7": 2.5}\'',
    "allowed_token_ids": "sample only these token ids, as a JSON list or comma-separated ids",
    "bad_words": "a word that is never generated (repeatable)",
    "thinking_token_budget": "after this many reasoning tokens the end of the reasoning (</think>) is forced",
}
# SamplingParams arguments the command line does not take, and why.
_SAMPLING_SKIPPED = {
    "seq_seed": "an alias of seed (--seed)",
    "so_args": "DeepInfer's structured-output dict; the command line takes --json_schema / --regex / --choice / "
    "--grammar / --json_object instead",
    "structured_outputs": "given by --json_schema / --regex / --choice / --grammar / --json_object",
    "output_kind": "what AsyncLLM streams hold (deepinfer-jax serve chooses it per protocol); commands print final outputs",
}


@dataclasses.dataclass(frozen=True)
class SamplingFlag:
    """One SamplingParams argument on the command line: its flag name and how the flag's text is read."""

    field: str
    kind: str  # "float", "int", "optional_int", "bool", "strings", "ids", "bias"


def sampling_flags() -> list[SamplingFlag]:
    """The SamplingParams arguments the command line takes, derived from `SamplingParams.__init__`."""
    from deepinfer_jax.engine.params import SamplingParams

    kinds = {
        "float": "float",
        "int": "int",
        "bool": "bool",
        "int | None": "optional_int",
        "str | Sequence[str] | None": "strings",
        "Sequence[str] | None": "strings",
        "Sequence[int] | None": "ids",
        "Mapping[int, float] | None": "bias",
    }
    out = []
    for name, param in inspect.signature(SamplingParams.__init__).parameters.items():
        if name == "self" or param.kind is inspect.Parameter.VAR_KEYWORD or name in _SAMPLING_SKIPPED:
            continue
        annotation = str(param.annotation)
        if annotation not in kinds or name not in _SAMPLING_HELP:
            raise TypeError(
                f"SamplingParams.{name} ({annotation}) has no command-line flag; add it to "
                "deepinfer_jax.cli.common"
            )
        out.append(SamplingFlag(name, kinds[annotation]))
    return out


def define_sampling_flags(fv: flags.FlagValues, *, max_tokens: int) -> None:
    """A flag per SamplingParams argument, with SamplingParams' default (`max_tokens`: the command's)."""
    from deepinfer_jax.engine.params import SamplingParams

    defaults = {n: p.default for n, p in inspect.signature(SamplingParams.__init__).parameters.items()}
    defaults["max_tokens"] = max_tokens
    for f in sampling_flags():
        default, help_text = defaults[f.field], _SAMPLING_HELP[f.field]
        if f.kind == "float":
            flags.DEFINE_float(f.field, default, help_text, flag_values=fv)
        elif f.kind in ("int", "optional_int"):
            flags.DEFINE_integer(f.field, default, help_text, flag_values=fv)
        elif f.kind == "bool":
            flags.DEFINE_boolean(f.field, default, help_text, flag_values=fv)
        elif f.kind == "strings":
            flags.DEFINE_multi_string(f.field, [], help_text, flag_values=fv)
        else:
            flags.DEFINE_string(f.field, None, help_text, flag_values=fv)


def _parse_json(flag: str, text: str, kind: str) -> Any:
    text = text.strip()
    if kind == "ids" and not text.startswith("["):
        try:
            return [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise ValueError(
                f"--{flag}={text!r}: expected a JSON list of token ids such as '[5, 7]' or '5,7'"
            ) from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        want = "a JSON object such as '{\"5\": -100}'" if kind == "bias" else "a JSON list such as '[5, 7]'"
        raise ValueError(f"--{flag}={text!r} is not JSON ({exc.msg}); expected {want}") from None
    if kind == "bias" and not isinstance(value, dict):
        raise ValueError(f"--{flag}={text!r}: expected a JSON object {{token_id: bias}}")
    if kind == "ids" and not isinstance(value, list):
        raise ValueError(f"--{flag}={text!r}: expected a JSON list of token ids")
    return value


_FIELD = re.compile(r"SamplingParams\.(\w+)")


def sampling_params_from_flags(fv: flags.FlagValues) -> Any:
    """The `SamplingParams` the sampling flags describe, validated (before any model is loaded).

    Raises `ValueError` / `TypeError` naming the flag (``--top_p=2.0: SamplingParams.top_p = 2.0 must be ...``).
    """
    from deepinfer_jax.engine.params import SamplingParams

    kwargs: dict[str, Any] = {}
    for f in sampling_flags():
        value = fv[f.field].value
        if f.kind == "strings":
            value = list(value) or None
        elif f.kind in ("ids", "bias") and value is not None:
            value = _parse_json(f.field, value, f.kind)
        kwargs[f.field] = value
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as err:
        match = _FIELD.search(str(err))
        name = match.group(1) if match else None
        if name in kwargs:
            shown = fv[name].value
            raise type(err)(f"--{name}={shown!r}: {err}") from None
        raise


def define_engine_flags(fv: flags.FlagValues, *, max_tokens: int | None, sampling: bool = True) -> None:
    """The engine and sampling flags shared by the subcommands that run `LLM` (`generate`, `chat`, `serve`).

    ``sampling=False`` leaves out the sampling flags (`serve`: each request brings its own) and the progress bar,
    and adds `--batch_invariant`.
    """
    flags.DEFINE_enum("dtype", DEFAULT_DTYPE, ["auto", "float32", "bfloat16"], DTYPE_HELP, flag_values=fv)
    flags.DEFINE_string(
        "kv_cache_dtype", "auto", "cache storage: auto, float32, bfloat16 or quantized", flag_values=fv
    )
    flags.DEFINE_string(
        "kv_cache_memory",
        None,
        "cache budget, e.g. 512MiB (unset: on an accelerator, cache.memory_utilization of its memory; on the "
        "CPU, what max_num_seqs sequences of max_model_len tokens need, at most 2GiB per device)",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "max_model_len",
        None,
        "most tokens per request (unset: the model's, as far as the cache holds)",
        flag_values=fv,
    )
    flags.DEFINE_integer("max_num_seqs", 256, "most sequences per step", flag_values=fv)
    flags.DEFINE_integer("max_num_batched_tokens", 2048, "most tokens per step", flag_values=fv)
    flags.DEFINE_integer(
        "engine_seed",
        0,
        "the engine's seed: each request's sampling seed when --seed is unset",
        flag_values=fv,
    )
    if sampling:
        assert max_tokens is not None
        define_sampling_flags(fv, max_tokens=max_tokens)
    else:
        flags.DEFINE_boolean(
            "batch_invariant",
            None,
            "a request's tokens do not depend on the rest of its batch (default: the config's, else off)",
            flag_values=fv,
        )
    flags.DEFINE_integer(
        "data_parallel_size",
        1,
        "engine mesh: replicas of the expert-parallel group (the mesh has dp * ep devices, each an attention rank)",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "expert_parallel_size", 1, "engine mesh: devices the routed experts are sharded over", flag_values=fv
    )
    define_speculative_flags(fv)
    flags.DEFINE_multi_string(
        "set",
        [],
        "an engine config override, e.g. --set cache.block_size=16 or --set parallel.eplb_interval_steps=64 "
        "(repeatable)",
        flag_values=fv,
    )
    flags.DEFINE_boolean(
        "enable_prefix_caching",
        None,
        "reuse the cached blocks of earlier prompts' prefixes (unset: the config's, else on; docs/prefix_cache.md)",
        flag_values=fv,
    )
    if sampling:
        flags.DEFINE_boolean("progress", True, "show a progress bar", flag_values=fv)
    flags.DEFINE_boolean(
        "verbose", False, "print the KV cache plan (LLM also logs it at absl INFO)", flag_values=fv
    )


def define_speculative_flags(fv: flags.FlagValues) -> None:
    """`--num_draft_tokens` and `--speculative_variable_length` (LLM's keywords of the same names)."""
    flags.DEFINE_integer(
        "num_draft_tokens",
        None,
        "speculative decoding: draft tokens per decode step, 0 = off (unset: the config's, else the model's "
        "natural length: 1 per MTP layer for deepseek_v3, 0 where the family cannot draft yet)",
        lower_bound=0,
        flag_values=fv,
    )
    flags.DEFINE_boolean(
        "speculative_variable_length",
        None,
        "speculative decoding: confidence-scheduled variable verification length (unset: the config's, else off)",
        flag_values=fv,
    )


_ARGUMENT_FLAGS = {"seed": "engine_seed"}  # LLM arguments whose flag has another name


def flag_message(err: BaseException) -> str:
    """An engine error as the command line's user sees it: the sources it names are flags (``LLM argument
    max_num_seqs`` -> ``--max_num_seqs``, ``override cache.block_size`` -> ``--set cache.block_size``)."""
    text = str(err)
    text = re.sub(
        r"\bLLM argument '?(\w+)'?", lambda m: "--" + _ARGUMENT_FLAGS.get(m.group(1), m.group(1)), text
    )
    text = re.sub(r"\[set by override ([\w.]+)\]", r"[set by --set \1]", text)
    text = re.sub(r"\(set by override ([\w.]+)\)", r"(set by --set \1)", text)
    return re.sub(r"\bengine_overrides: ", "--set: ", text)


def llm_from_flags(fv: flags.FlagValues) -> Any:
    """`LLM(...)` from the flags of :func:`define_engine_flags` (and `--model`)."""
    from deepinfer_jax.engine.llm import LLM

    return LLM(
        fv.model,
        dtype=fv.dtype,
        kv_cache_dtype=fv.kv_cache_dtype,
        max_model_len=fv.max_model_len,
        max_num_seqs=fv.max_num_seqs,
        max_num_batched_tokens=fv.max_num_batched_tokens,
        kv_cache_memory=fv.kv_cache_memory,
        seed=fv.engine_seed,
        data_parallel_size=fv.data_parallel_size,
        expert_parallel_size=fv.expert_parallel_size,
        batch_invariant=fv["batch_invariant"].value if "batch_invariant" in fv else None,
        num_draft_tokens=fv.num_draft_tokens,
        speculative_variable_length=fv.speculative_variable_length,
        enable_prefix_caching=fv.enable_prefix_caching,
        **config_lib.parse_overrides(fv.set),
    )
