"""What a request's structured output must be: :class:`StructuredOutputsParams` (vLLM's shape) and DeepInfer's
``so_args`` dict, both turned into one llguidance grammar text.

A request gives at most one of: a JSON schema (``json``, a dict or its text), a regular expression (``regex``),
a list of strings one of which the output is (``choice``), a Lark-style EBNF grammar (``grammar``), or any JSON
value (``json_object=True``). :meth:`StructuredOutputsParams.grammar_text` is the llguidance grammar that the
engine compiles (:mod:`deepinfer_jax.engine.grammar`); the constructor checks it with llguidance's validator, so a
bad schema, regex or grammar is refused with a ``ValueError`` naming the field before anything runs.

``trigger_token_ids`` makes the grammar start only after the output has produced that exact id sequence (for a
reasoning model: the ``</think>`` id, so the reasoning stays free); ``bound_token_id`` (with a trigger) forces
the trigger token by token once that id appears. DeepInfer's ``so_args`` (``schema_type`` ``"json"`` /
``"regex"`` / ``"ebnf"``, ``schema``, ``trigger_token_ids``, ``bound_token_id``) maps onto the same object
(:func:`from_so_args`).

This module needs no JAX; llguidance is imported when a grammar is validated.
"""

from __future__ import annotations

import dataclasses
import json as _json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["StructuredOutputsParams", "from_so_args"]

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_SO_ARGS_KEYS = {"schema_type", "schema", "trigger_token_ids", "bound_token_id"}
_SO_ARGS_REFUSED = {
    "serialized": "so_args['serialized'] (a pre-compiled xgrammar grammar) is not supported; give the schema text",
    "bound_token_ids": "so_args['bound_token_ids'] is not supported; give one bound_token_id",
}


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as err:  # pragma: no cover - llguidance is a dependency of the structured extra
        raise ImportError(
            "structured outputs need llguidance (pip install 'deepinfer-jax[structured]')"
        ) from err
    return llguidance


def _ids(where: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Sequence):
        raise TypeError(f"{where} must be a list of token ids, got {type(value).__name__}")
    out = []
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int):
            raise TypeError(f"{where}[{i}] must be an int, got {type(t).__name__} ({t!r})")
        if t < 0:
            raise ValueError(f"{where}[{i}] = {t} must be a token id >= 0")
        out.append(int(t))
    return tuple(out)


@dataclasses.dataclass(frozen=True, init=False)
class StructuredOutputsParams:
    """One request's output constraint (vLLM's ``StructuredOutputsParams``). Exactly one of ``json``, ``regex``,
    ``choice``, ``grammar`` and ``json_object`` is set.

    Attributes:
      json: the JSON schema as canonical JSON text (given as a dict or a string).
      regex: a regular expression the whole output matches.
      choice: the strings the output may be, one of them exactly.
      grammar: a Lark-style EBNF grammar (llguidance's Lark dialect; ``start`` is the start rule).
      json_object: any JSON value.
      disable_any_whitespace: JSON without free whitespace between tokens (vLLM's name); default False.
      trigger_token_ids: the grammar applies only after the output has produced this id sequence.
      bound_token_id: once this id is produced (before the trigger), the trigger is forced token by token.
    """

    json: str | None
    regex: str | None
    choice: tuple[str, ...] | None
    grammar: str | None
    json_object: bool
    disable_any_whitespace: bool
    trigger_token_ids: tuple[int, ...] | None
    bound_token_id: int | None

    def __init__(
        self,
        json: Mapping[str, Any] | str | None = None,
        regex: str | None = None,
        choice: Sequence[str] | None = None,
        grammar: str | None = None,
        json_object: bool | None = None,
        *,
        disable_any_whitespace: bool = False,
        trigger_token_ids: Sequence[int] | None = None,
        bound_token_id: int | None = None,
    ) -> None:
        name = "StructuredOutputsParams"
        given = [
            k
            for k, v in (
                ("json", json),
                ("regex", regex),
                ("choice", choice),
                ("grammar", grammar),
                ("json_object", json_object or None),
            )
            if v is not None
        ]
        if len(given) != 1:
            raise ValueError(
                f"{name}: give exactly one of json, regex, choice, grammar, json_object; got "
                f"{given if given else 'none'}"
            )
        values: dict[str, Any] = dict.fromkeys(("json", "regex", "choice", "grammar"))
        values["json_object"] = False
        if json is not None:
            if isinstance(json, str):
                try:
                    parsed = _json.loads(json)
                except ValueError as err:
                    raise ValueError(f"{name}.json is not valid JSON text: {err}") from None
            elif isinstance(json, Mapping):
                parsed = json
            else:
                raise TypeError(f"{name}.json must be a dict or a str, got {type(json).__name__}")
            if not isinstance(parsed, Mapping | bool):
                raise ValueError(
                    f"{name}.json must be a JSON schema (an object), got {type(parsed).__name__}"
                )
            try:
                values["json"] = _json.dumps(parsed, sort_keys=True, separators=(",", ":"))
            except (TypeError, ValueError) as err:
                raise ValueError(f"{name}.json cannot be written as JSON: {err}") from None
        for field, value in (("regex", regex), ("grammar", grammar)):
            if value is not None:
                if not isinstance(value, str):
                    raise TypeError(f"{name}.{field} must be a str, got {type(value).__name__}")
                if not value:
                    raise ValueError(f"{name}.{field} is empty")
                values[field] = value
        if choice is not None:
            if isinstance(choice, str) or not isinstance(choice, Sequence):
                raise TypeError(f"{name}.choice must be a list of str, got {type(choice).__name__}")
            if not choice:
                raise ValueError(f"{name}.choice is empty; give at least one string")
            for i, c in enumerate(choice):
                if not isinstance(c, str):
                    raise TypeError(f"{name}.choice[{i}] must be a str, got {type(c).__name__} ({c!r})")
                if not c:
                    raise ValueError(f"{name}.choice[{i}] is empty")
            values["choice"] = tuple(choice)
        if json_object is not None and not isinstance(json_object, bool):
            raise TypeError(f"{name}.json_object must be a bool, got {type(json_object).__name__}")
        values["json_object"] = bool(json_object)
        if not isinstance(disable_any_whitespace, bool):
            raise TypeError(
                f"{name}.disable_any_whitespace must be a bool, got {type(disable_any_whitespace).__name__}"
            )
        values["disable_any_whitespace"] = disable_any_whitespace
        trigger = None if trigger_token_ids is None else _ids(f"{name}.trigger_token_ids", trigger_token_ids)
        if trigger is not None and not trigger:
            raise ValueError(
                f"{name}.trigger_token_ids is empty; give None for a grammar from the first token"
            )
        values["trigger_token_ids"] = trigger
        if bound_token_id is not None:
            if isinstance(bound_token_id, bool) or not isinstance(bound_token_id, int):
                raise TypeError(f"{name}.bound_token_id must be an int, got {type(bound_token_id).__name__}")
            if bound_token_id < 0:
                raise ValueError(f"{name}.bound_token_id = {bound_token_id} must be a token id >= 0")
            if trigger is None:
                raise ValueError(f"{name}.bound_token_id needs trigger_token_ids (the sequence it forces)")
        values["bound_token_id"] = bound_token_id
        for key, value in values.items():
            object.__setattr__(self, key, value)
        self._validate()

    @property
    def kind(self) -> str:
        """Which constraint it is: ``"json"``, ``"regex"``, ``"choice"``, ``"grammar"`` or ``"json_object"``."""
        for k in _KINDS:
            if getattr(self, k):
                return k
        raise AssertionError("no constraint set")  # unreachable: the constructor requires one

    def grammar_text(self) -> str:
        """The llguidance grammar (its JSON or Lark text) this constraint compiles to; also the key of the
        engine's compile cache."""
        m = _llguidance().LLMatcher
        options = {"whitespace_flexible": not self.disable_any_whitespace}
        if self.json is not None:
            return m.grammar_from_json_schema(self.json, overrides=options)
        if self.json_object:
            return m.grammar_from_json_schema("{}", overrides=options)
        if self.regex is not None:
            return m.grammar_from_regex(self.regex)
        if self.choice is not None:
            # Lark string literals take JSON's escapes, so json.dumps spells any choice exactly.
            return m.grammar_from_lark("start: " + " | ".join(_json.dumps(c) for c in self.choice))
        assert self.grammar is not None
        return m.grammar_from_lark(self.grammar)

    def _validate(self) -> None:
        kind = self.kind
        try:
            text = self.grammar_text()
        except Exception as err:  # llguidance raises on malformed schema JSON
            raise ValueError(f"StructuredOutputsParams.{kind} is not a valid {kind}: {err}") from None
        is_error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(text)
        if is_error:
            shown = getattr(self, kind)
            if isinstance(shown, str) and len(shown) > 200:
                shown = shown[:200] + "..."
            raise ValueError(
                f"StructuredOutputsParams.{kind} = {shown!r} is not a valid {kind}: {'; '.join(messages).strip()}"
            )

    def with_trigger(
        self, trigger_token_ids: Sequence[int], bound_token_id: int | None = None
    ) -> StructuredOutputsParams:
        """The same constraint, applied only after ``trigger_token_ids`` (what ``LLM.chat`` does in thinking
        mode with the ``</think>`` id)."""
        return dataclasses.replace(
            self, trigger_token_ids=tuple(trigger_token_ids), bound_token_id=bound_token_id
        )


def from_so_args(so_args: Mapping[str, Any]) -> StructuredOutputsParams:
    """DeepInfer's ``so_args`` dict as :class:`StructuredOutputsParams`: ``schema_type`` ``"json"`` (a JSON schema,
    with free whitespace off: DeepInfer's strict mode), ``"regex"`` or ``"ebnf"``; ``schema`` the text;
    optional ``trigger_token_ids`` and ``bound_token_id``. ``serialized`` and ``bound_token_ids`` are refused."""
    if not isinstance(so_args, Mapping):
        raise TypeError(f"SamplingParams.so_args must be a dict or None, got {type(so_args).__name__}")
    for key, why in _SO_ARGS_REFUSED.items():
        if key in so_args:
            raise ValueError(f"SamplingParams.so_args: {why}")
    unknown = set(so_args) - _SO_ARGS_KEYS
    if unknown:
        raise ValueError(
            f"SamplingParams.so_args has unknown key(s) {sorted(unknown)}; valid keys: {sorted(_SO_ARGS_KEYS)}"
        )
    kind = so_args.get("schema_type")
    if kind not in ("json", "regex", "ebnf"):
        raise ValueError(
            f"SamplingParams.so_args['schema_type'] = {kind!r} must be 'json', 'regex' or 'ebnf'"
        )
    schema = so_args.get("schema")
    if kind == "json" and isinstance(schema, Mapping):
        pass
    elif not isinstance(schema, str) or not schema:
        raise ValueError(
            f"SamplingParams.so_args['schema'] must be a non-empty str (the {kind} text), got {schema!r}"
        )
    extra = {
        "trigger_token_ids": so_args.get("trigger_token_ids"),
        "bound_token_id": so_args.get("bound_token_id"),
    }
    try:
        if kind == "json":
            return StructuredOutputsParams(json=schema, disable_any_whitespace=True, **extra)
        if kind == "regex":
            return StructuredOutputsParams(regex=schema, **extra)
        return StructuredOutputsParams(grammar=schema, **extra)
    except (TypeError, ValueError) as err:
        msg = str(err).replace("StructuredOutputsParams.", "SamplingParams.so_args: ")
        raise type(err)(msg) from None
