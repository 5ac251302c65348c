"""How an engine option is declared: a dataclass field with its help text and choices, which
the CLI turns into a flag (``--max-total-tokens`` <-> ``max_total_tokens``)."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def opt(default: Any, help: str, choices: tuple | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})
