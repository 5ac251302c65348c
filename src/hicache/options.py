"""How an option is declared: a dataclass field with its help text, choices and least value, which
the CLI turns into a flag (``--max-total-tokens`` <-> ``max_total_tokens``). :class:`EngineConfig`'s
fields and ``hicache serve``'s (server/options.py) are declared so."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import field
from typing import Any, get_args, get_origin, get_type_hints

from .errors import ConfigError


def opt(default: Any, help: str, choices: tuple | None = None, at_least: float | None = None,
        above: float | None = None) -> Any:
    """A field whose value (when not None) must be ``>= at_least`` / ``> above`` (:func:`check_bounds`)."""
    return field(default=default, metadata={"help": help, "choices": choices, "at_least": at_least, "above": above})


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_bounds(options: Any) -> None:
    """ConfigError for the first field of ``options`` below its ``at_least`` or not above its ``above``."""
    for f in dataclasses.fields(options):
        value, least, above = getattr(options, f.name), f.metadata.get("at_least"), f.metadata.get("above")
        if value is not None and least is not None and not value >= least:
            raise ConfigError(f"{flag(f.name)} must be at least {least}, got {value}.")
        if value is not None and above is not None and not value > above:
            raise ConfigError(f"{flag(f.name)} must be > {above}, got {value}.")


def json_object(value: str, name: str) -> dict[str, Any]:
    """The JSON object a flag (``name``, e.g. ``--preferred-sampling-params``) holds; ConfigError otherwise."""
    try:
        given = json.loads(value)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{name} is not valid JSON ({e.msg}).") from None
    if not isinstance(given, dict):
        raise ConfigError(f"{name} must be a JSON object.")
    return given


def add_cli_args(cls: type, parser: argparse.ArgumentParser, title: str) -> None:
    """A flag per field of the dataclass ``cls`` (a bool: ``store_true``), in a group named ``title``."""
    hints = get_type_hints(cls)
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        typ = hints[f.name]
        if get_origin(typ) is not None:  # Optional[X]
            typ = next(a for a in get_args(typ) if a is not type(None))
        how = {"action": "store_true"} if typ is bool else {"type": typ, "choices": f.metadata.get("choices")}
        group.add_argument(flag(f.name), default=f.default, help=f.metadata["help"], **how)


def from_cli_args(cls: type, args: argparse.Namespace, **given: Any) -> Any:
    """``cls`` from its flags' values in ``args``, but for the fields ``given`` sets."""
    return cls(**{**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}, **given})

