"""The ranges of the sampling options a server may give requests by default (standard library
only: ``hicache serve`` checks ``--preferred-sampling-params`` before torch is imported, and
:class:`~hicache.runtime.sampling.SamplingParams` checks every request by the same rules)."""

from __future__ import annotations

import math

# (low, high, shown): an interval shown open, "(", excludes its low end
_INTERVALS = {"top_p": (0.0, 1.0, "(0, 1]"), "presence_penalty": (-2.0, 2.0, "[-2, 2]"),
              "frequency_penalty": (-2.0, 2.0, "[-2, 2]"), "repetition_penalty": (0.0, 2.0, "(0, 2]"),
              "min_p": (0.0, 1.0, "[0, 1]")}
DEFAULTABLE = ("temperature", "top_p", "top_k", *(n for n in _INTERVALS if n != "top_p"))


def is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def range_error(name: str, value: object) -> str | None:
    """The sentence refusing ``value`` for the option ``name`` (one of :data:`DEFAULTABLE`), or None."""
    if name == "temperature":
        if not is_real(value) or not math.isfinite(value) or value < 0:  # type: ignore[arg-type, operator]
            return f"temperature must be a finite number >= 0, got {value!r}."
    elif name == "top_k":
        if not is_int(value) or (value != -1 and value < 1):  # type: ignore[operator]
            return f"top_k must be -1 (off) or >= 1, got {value!r}."
    else:
        low, high, shown = _INTERVALS[name]
        if not is_real(value) or not low <= value <= high or (shown[0] == "(" and value == low):  # type: ignore[operator]
            return f"{name} must be in {shown}, got {value!r}."
    return None
