"""`deepinfer-jax serve`: an OpenAI- and Anthropic-compatible HTTP server over the engine (docs/serving.md).

    deepinfer-jax serve --model tiny-v3 --dtype float32 --port 8000
    deepinfer-jax serve --model /models/DeepSeek-V4-Flash --host 0.0.0.0 --api_key "$KEY" --max_queued_requests 512

Binds 127.0.0.1 unless `--host` says otherwise. With `--api_key` (or the `DEEPINFER_API_KEY` variable) every
route but `/health` needs the key. Every engine flag of `generate` works here too (`--set` for the rest, including
the `server.*` section); a flag left unset takes the config's value. Start-up prints the URL and the model;
Ctrl-C (or SIGTERM) stops accepting requests, lets the running ones finish for up to `--drain_timeout_s`, aborts
what is left and exits; a second Ctrl-C exits at once. Needs the `serve` extra.
"""

from __future__ import annotations

import os
import sys

from absl import flags

from deepinfer_jax.cli import common


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string(
        "model", None, "a built-in model name (tiny-v3, ...) or a model folder", flag_values=fv, required=True
    )
    common.define_engine_flags(fv, max_tokens=None, sampling=False)
    flags.DEFINE_string("host", None, "address to bind (default: server.host, 127.0.0.1)", flag_values=fv)
    flags.DEFINE_integer(
        "port", None, "port to bind, 0 = any free port (default: server.port, 8000)", flag_values=fv
    )
    flags.DEFINE_string(
        "api_key",
        None,
        "require this key on every route but /health (Authorization: Bearer KEY or x-api-key: KEY); default: the "
        "DEEPINFER_API_KEY variable, else no key",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "max_queued_requests",
        None,
        "waiting requests allowed beyond max_num_seqs running ones; more get 429 (default: server.max_queued_requests)",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "served_model_name", None, "the model name clients use (default: the --model value)", flag_values=fv
    )
    flags.DEFINE_integer(
        "max_request_body_bytes", None, "larger request bodies get 413 (default: 16 MiB)", flag_values=fv
    )
    flags.DEFINE_float(
        "drain_timeout_s",
        None,
        "on Ctrl-C, seconds running requests may take before they are aborted (default: 30)",
        flag_values=fv,
    )
    flags.DEFINE_boolean(
        "default_thinking",
        None,
        "thinking mode for requests that do not choose (default: off)",
        flag_values=fv,
    )
    flags.DEFINE_enum(
        "log_level",
        "warning",
        ["critical", "error", "warning", "info", "debug"],
        "uvicorn's log level",
        flag_values=fv,
    )


def main(argv: list[str], fv: flags.FlagValues) -> int:
    if len(argv) > 1:
        print(f"serve: unexpected arguments {argv[1:]}", file=sys.stderr)
        return 2
    try:
        from deepinfer_jax.server import Server
    except ImportError as err:
        print(
            f"serve: the server needs the 'serve' extra (pip install 'deepinfer_jax[serve]'): {err}",
            file=sys.stderr,
        )
        return 2
    from deepinfer_jax.models import builtin

    api_key = fv.api_key if fv.api_key is not None else os.environ.get("DEEPINFER_API_KEY") or None
    try:
        llm = common.llm_from_flags(fv)
        server = Server(
            llm,
            served_model_name=fv.served_model_name,
            model_name=fv.model,
            host=fv.host,
            port=fv.port,
            api_key=api_key,
            max_queued_requests=fv.max_queued_requests,
            max_request_body_bytes=fv.max_request_body_bytes,
            drain_timeout_s=fv.drain_timeout_s,
            default_thinking=fv.default_thinking,
            log_level=fv.log_level,
        )
    except (ValueError, TypeError, NotImplementedError, OSError) as err:
        print(f"serve: error: {err}", file=sys.stderr)
        return 2
    if builtin.is_builtin(fv.model):
        print(f"{fv.model} is a built-in test model with random weights: its completions are noise.")
    auth = "an API key is required" if api_key else "no API key"

    def ready() -> None:
        print(
            f"deepinfer-jax serve: model {server.served_model_name!r} at {server.url}/v1 ({auth}; Ctrl-C drains "
            "and stops)",
            flush=True,
        )

    server.serve_forever(on_ready=ready)
    print("deepinfer-jax serve: stopped", flush=True)
    return 0
