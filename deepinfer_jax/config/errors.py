"""Error and warning types of the config tree.

Every bad value is refused with a ``ValueError`` or ``TypeError`` whose message names the field (its dotted
path in the tree, or the HF key), the value, and the limit or the expected type, plus the file when one is
involved. The subclasses below keep the dotted field name as an attribute so that the loaders can say which
source (yaml file, gin binding, environment variable, keyword override) supplied the offending value without
parsing messages.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ConfigTypeError",
    "ConfigValueError",
    "ConfigWarning",
    "describe_value",
]


class ConfigValueError(ValueError):
    """A config value is out of range, inconsistent with another value, or unknown.

    Attributes:
        field: the dotted name of the offending field (``"cache.block_size"``, ``"model.text_config.o_groups"``),
            or ``None`` when the error is about a whole source (e.g. a file that cannot be read).
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ConfigTypeError(TypeError):
    """A config value has the wrong type (e.g. a string where an int is expected).

    Attributes:
        field: the dotted name of the offending field, as for :class:`ConfigValueError`.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ConfigWarning(UserWarning):
    """A config source contains something that has no effect (an unknown or not-yet-used setting).

    It is a warning, not an error, because environment variables are shared with other tools and a stale
    variable must not stop the engine; a typo still becomes visible.
    """


def describe_value(value: Any) -> str:
    """Render a value for an error message: its type name and a short ``repr``.

    Long values (a 43-entry layer list, a whole dict) are cut so that the message stays readable.
    """
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    if value is None:
        return "null"
    return f"{type(value).__name__} {text}"
