"""The `deepinfer-jax` / `python -m deepinfer_jax` command line.

absl has no notion of subcommands, so this module provides one: the first argument names the subcommand, which
is imported lazily and defines its flags on a *fresh* `absl.flags.FlagValues` (never the global `FLAGS`), so
subcommands cannot clash with each other or with flags defined by libraries, and tests can drive the command
line in-process. Unknown subcommands and unknown flags are refused with exit code 2 and a message that says what
is available.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import sys
from collections.abc import Sequence

from absl import flags, logging

import deepinfer_jax

PROG = "deepinfer-jax"


@dataclasses.dataclass(frozen=True)
class Subcommand:
    """A registered subcommand: `module` defines `define_flags(fv)` and `main(argv, fv) -> int`."""

    name: str
    module: str
    summary: str


_SUBCOMMANDS: dict[str, Subcommand] = {}


def register_subcommand(name: str, module: str, summary: str) -> None:
    """Register a subcommand implemented by `module` (imported only when the subcommand runs)."""
    if name in _SUBCOMMANDS and _SUBCOMMANDS[name].module != module:
        raise ValueError(f"subcommand {name!r} is already registered by {_SUBCOMMANDS[name].module}")
    _SUBCOMMANDS[name] = Subcommand(name, module, summary)


def subcommands() -> dict[str, Subcommand]:
    return dict(_SUBCOMMANDS)


register_subcommand(
    "info",
    "deepinfer_jax.cli.info",
    "print a model's parsed config, its KV cache record sizes and the resolved engine config",
)
register_subcommand(
    "convert",
    "deepinfer_jax.cli.convert",
    "convert a checkpoint between an HF safetensors folder and orbax, tensor for tensor, byte for byte",
)
register_subcommand(
    "generate",
    "deepinfer_jax.cli.generate",
    "generate completions for prompts with the engine (continuous batching over a paged cache)",
)
register_subcommand("chat", "deepinfer_jax.cli.chat", "chat with a model: reasoning, answer, tool calls")
register_subcommand("bench", "deepinfer_jax.cli.bench", "time a workload through the engine (and a baseline)")
register_subcommand("sweep", "deepinfer_jax.cli.sweep", "run a benchmark grid from a yaml or gin sweep file")
register_subcommand(
    "serve", "deepinfer_jax.cli.serve", "an OpenAI- and Anthropic-compatible HTTP server over the engine"
)
register_subcommand(
    "eval",
    "deepinfer_jax.cli.eval",
    "score a text through the engine: bits per character, perplexity, tokens/s",
)
# Further subcommands are registered here by the issue that implements them.


def usage() -> str:
    width = max(len(n) for n in _SUBCOMMANDS)
    lines = [
        f"usage: {PROG} SUBCOMMAND [flags]",
        "",
        f"deepinfer_jax {deepinfer_jax.__version__}: a JAX/XLA inference engine for DeepSeek models.",
        "",
        "subcommands:",
    ]
    lines += [
        f"  {s.name.ljust(width)}  {s.summary}" for s in sorted(_SUBCOMMANDS.values(), key=lambda s: s.name)
    ]
    lines += ["", f"Run '{PROG} SUBCOMMAND --help' for the flags of one subcommand."]
    return "\n".join(lines)


def _error(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def flag_help(f: flags.Flag) -> str:
    """``--name: help (default: value)``; a flag without a default says so (``default: unset``)."""
    if f.default is None or f.default == []:
        default = "unset"
    elif isinstance(f.default, bool):
        default = "true" if f.default else "false"
    else:
        default = f.default_as_str or repr(f.default)
        default = default.strip("'")
    required = " (required)" if getattr(f, "required", False) else ""
    return f"--{f.name}: {f.help} (default: {default}){required}"


def _subcommand_help(sub: Subcommand, fv: flags.FlagValues) -> str:
    own = fv.get_flags_for_module(sub.module)
    common = [f for f in fv.flags_by_module_dict().items() if f[0] != sub.module]
    out = [f"usage: {PROG} {sub.name} [flags]", "", sub.summary, ""]
    if own:
        out.append("flags:")
        out += ["  " + line for f in own for line in flag_help(f).splitlines()]
    for module, module_flags in common:
        out.append(f"flags from {module}:")
        out += ["  " + line for f in module_flags for line in flag_help(f).splitlines()]
    return "\n".join(out)


def main(argv: Sequence[str]) -> int:
    """Run the command line; returns the process exit code."""
    args = list(argv[1:])
    if not args:
        print(usage(), file=sys.stderr)
        return 2
    head = args[0]
    if head in ("-h", "--help", "help") and len(args) == 1:
        print(usage())
        return 0
    if head == "help":
        head, args = args[1], [args[1], "--help"]
    if head == "--version":
        print(f"deepinfer_jax {deepinfer_jax.__version__}")
        return 0
    if head.startswith("-"):
        return _error(f"expected a subcommand before the flag {head!r}\n\n{usage()}")
    sub = _SUBCOMMANDS.get(head)
    if sub is None:
        close = difflib.get_close_matches(head, list(_SUBCOMMANDS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return _error(f"unknown subcommand {head!r}{hint}; available: {', '.join(sorted(_SUBCOMMANDS))}")

    module = importlib.import_module(sub.module)
    fv = flags.FlagValues()
    module.define_flags(fv)
    rest = args[1:]
    if any(a in ("-h", "--help", "--helpfull") for a in rest):
        print(_subcommand_help(sub, fv))
        return 0
    try:
        positional = fv([f"{PROG} {sub.name}", *rest])
    except flags.Error as e:
        return _error(f"{sub.name}: {e}\nRun '{PROG} {sub.name} --help' for its flags.")
    logging.use_absl_handler()
    return int(module.main(positional, fv) or 0)


def run() -> None:
    """Console-script entry point."""
    try:
        code = main(sys.argv)
    except BrokenPipeError:  # output piped into `head` and friends: not an error of ours
        code = 0
        sys.stderr.close()
    sys.exit(code)
