"""Errors the server answers with: OpenAI's error body, the status code, the field at fault.

Every refusal is an :class:`APIError`; its body is ``{"error": {"message", "type", "param", "code"}}`` (what the
OpenAI and Anthropic clients parse into their ``APIStatusError``), with ``param`` naming the request field when
one is at fault. The recipe's own refusals (``deepseek_recipe.ConversionError``, and the ``ValueError`` its JSON
reader raises for a wrong type) become the same shape, with the field recovered from the message where it names
one.
"""

from __future__ import annotations

import json
import re
from typing import Any

import deepseek_recipe as recipe

__all__ = [
    "APIError",
    "check_fields",
    "from_conversion_error",
    "from_recipe_value_error",
    "param_of",
    "with_value",
]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """A refusal: ``status`` with OpenAI's error body; ``headers`` go on the response (``Retry-After``)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.code = code or self.type
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_PARAM_PATTERNS = (
    re.compile(r"Invalid ([a-z_]+)(?: and [a-z_]+)? value"),
    re.compile(r"field `([A-Za-z_]+)`"),
    re.compile(r"^'?([a-z_]+)'? (?:must|is)"),
    re.compile(r"SamplingParams\.([a-z_]+)"),
    re.compile(r"sampling_params\.([a-z_]+)"),
    re.compile(r"to use '([a-z_]+)'"),
)


def param_of(message: str) -> str | None:
    """The request field a refusal's message names, when it names one."""
    for pattern in _PARAM_PATTERNS:
        match = pattern.search(message)
        if match:
            return match.group(1)
    return None


def from_conversion_error(exc: recipe.ConversionError) -> APIError:
    """The recipe's refusal, status and message kept, ``param`` filled in when the message names the field."""
    try:
        error = json.loads(exc.body)["error"]
        message = str(error.get("message") or exc)
        param = error.get("param") or param_of(message)
    except (ValueError, KeyError, TypeError):
        message, param = str(exc), None
    return APIError(int(getattr(exc, "status_code", 400) or 400), message, param=param)


def with_value(error: APIError, body: Any) -> APIError:
    """Add the offending value to a refusal that names its field but not the value (the recipe's range checks
    say "the valid range of temperature is [0, 2]" without what was sent)."""
    if error.param is None or not isinstance(body, dict) or body.get(error.param) is None:
        return error
    shown = json.dumps(body[error.param])
    if len(shown) > 60:
        shown = shown[:57] + "..."
    if shown not in error.message:
        error.message = f"{error.message.rstrip('.')}; got {error.param} = {shown}"
    return error


def from_recipe_value_error(exc: ValueError) -> APIError:
    """The recipe's JSON reader refused the body (a missing field, a wrong type, an unknown enum value)."""
    message = str(exc)
    return APIError(400, message, param=param_of(message))


# ------------------------------------------------------------------------------------------- field types

_NUMBER = "a number"
_INT = "an integer"
_BOOL = "a boolean"


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_CHECKS: dict[str, tuple[str, Any]] = {
    "temperature": (_NUMBER, _is_number),
    "top_p": (_NUMBER, _is_number),
    "min_p": (_NUMBER, _is_number),
    "presence_penalty": (_NUMBER, _is_number),
    "frequency_penalty": (_NUMBER, _is_number),
    "repetition_penalty": (_NUMBER, _is_number),
    "max_tokens": (_INT, _is_int),
    "max_completion_tokens": (_INT, _is_int),
    "max_output_tokens": (_INT, _is_int),
    "n": (_INT, _is_int),
    "top_logprobs": (_INT, _is_int),
    "top_k": (_INT, _is_int),
    "min_tokens": (_INT, _is_int),
    "seed": ("an integer >= 0", lambda v: _is_int(v) and v >= 0),
    "stream": (_BOOL, lambda v: isinstance(v, bool)),
    "ignore_eos": (_BOOL, lambda v: isinstance(v, bool)),
    "echo": (_BOOL, lambda v: isinstance(v, bool)),
    "return_token_ids": (_BOOL, lambda v: isinstance(v, bool)),
    "model": ("a string", lambda v: isinstance(v, str)),
    "stop": (
        "a string or a list of strings",
        lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)),
    ),
    "stop_sequences": (
        "a list of strings",
        lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
    ),
    "stop_token_ids": ("a list of integers", lambda v: isinstance(v, list) and all(_is_int(t) for t in v)),
    "golden_token_ids": ("a list of integers", lambda v: isinstance(v, list) and all(_is_int(t) for t in v)),
    "allowed_token_ids": ("a list of integers", lambda v: isinstance(v, list) and all(_is_int(t) for t in v)),
    "bad_words": ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v)),
    "logit_bias": (
        "an object of token id: bias, each bias a number in [-100, 100]",
        lambda v: isinstance(v, dict) and all(_is_number(b) and -100 <= b <= 100 for b in v.values()),
    ),
}


def check_fields(body: dict[str, Any], names: tuple[str, ...]) -> None:
    """Refuse a top-level field of the wrong JSON type, naming it (``null`` means "not set" and passes)."""
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        what, ok = _CHECKS[name]
        if not ok(value):
            shown = json.dumps(value)
            if len(shown) > 60:
                shown = shown[:57] + "..."
            raise APIError(400, f"'{name}' must be {what}, got {type(value).__name__} ({shown})", param=name)
