"""User-facing model errors (each message is one sentence for the user) and :func:`quoted`, the one
way a message shows a value read from a model file: a hostile file's 1 MB string is cut, never
echoed whole; :func:`as_int` and :func:`as_float`, the way a loader reads a size or a float from
a file: the right type, in range and finite, or one sentence naming the key."""

from __future__ import annotations

import math
from typing import Any

from hicache.config import ConfigError

QUOTE_CHARS = 200  # the most characters of a file's value a message shows
MAX_SIZE = (1 << 31) - 1  # the largest size (layers, widths, vocabulary, positions) a file may declare


class ModelNotFoundError(ConfigError):
    """The requested model name, path or file does not exist or lacks required files."""


class ModelFormatError(ConfigError):
    """The model files exist but describe something this engine cannot run."""


def cut(text: str, limit: int = QUOTE_CHARS) -> str:
    """``text`` as it is (a key, a tensor name: shown unquoted) when at most ``limit`` characters,
    else its start and how long the whole was, ``limit`` characters in all, on one line."""
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    if len(text) <= limit and len(shown) <= limit:
        return shown
    suffix = f"... ({len(text)} characters)"
    return shown[:limit - len(suffix)] + suffix


def quoted(value: Any, limit: int = QUOTE_CHARS) -> str:
    """``repr(value)`` on one line, cut to at most ``limit`` characters (a cut string ends in ``...``
    and says how long the whole was). Built piece by piece: at most ``limit`` characters of a huge
    value, or of each of the first few items of a huge list, are ever copied."""
    if isinstance(value, int) and value.bit_length() > 600:  # (repr refuses past 4,300 digits)
        return f"<an integer of {value.bit_length()} bits>"
    if isinstance(value, str) and len(value) > limit:
        suffix = f"... ({len(value)} characters)"
        return repr(value[:limit]).replace("\n", "\\n")[:limit - len(suffix)] + suffix
    if isinstance(value, (list, tuple, dict)):
        text, parts, (left, right) = "", [], "{}" if isinstance(value, dict) else "()" if isinstance(value, tuple) else "[]"
        for item in value.items() if isinstance(value, dict) else value:
            parts.append(": ".join(quoted(v, limit) for v in item) if isinstance(value, dict) else quoted(item, limit))
            text = left + ", ".join(parts) + right
            if len(text) > limit:
                break
        text = text or left + right
        text = text[:-1] + ",)" if isinstance(value, tuple) and len(value) == 1 else text
    else:
        text = repr(value)
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def as_int(value: Any, what: str, least: int = 1, most: int = MAX_SIZE) -> int:
    """``value`` as an integer in ``[least, most]`` (an integral float such as 64.0 counts); else a
    ModelFormatError naming ``what``."""
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        value = int(value)
    if type(value) is not int or not least <= value <= most:
        raise ModelFormatError(f"{what} = {quoted(value)} is not an integer from {least} to {most}.")
    return value


def as_float(value: Any, what: str, positive: bool = True) -> float:
    """``value`` as a finite float (> 0 where ``positive``); else a ModelFormatError naming ``what``."""
    number = math.nan
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value) if abs(value) < 1e308 else math.inf  # (an int beyond a float's range)
    if not math.isfinite(number) or (positive and number <= 0):
        raise ModelFormatError(f"{what} = {quoted(value)} is not a finite{' positive' if positive else ''} number.")
    return number
