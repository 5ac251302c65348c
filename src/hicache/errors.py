"""Errors a user can cause. Each message is one clear sentence; the CLI and server print it
instead of a traceback, and the engine keeps serving other requests."""

from __future__ import annotations


class HicacheError(ValueError):
    """Base of the errors hicache raises with a one-sentence message for the user."""


class ConfigError(HicacheError):
    """A bad option or option combination; the message is one sentence for the user."""


class InvalidRequestError(HicacheError):
    """A request the engine cannot serve (bad sampling values, prompt too long, ...).
    ``param``: the request field at fault, by its :class:`~hicache.runtime.sampling.SamplingParams`
    name (``stop_token_ids``, ``logit_bias``...) or ``prompt``; a server maps it to its own field
    names (OpenAI errors carry it as ``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """The prompt leaves no room for output within the context length."""


class EngineDeadError(HicacheError):
    """The engine can no longer serve (its loop crashed, a rank died): not the caller's fault.
    A server answers 503 and exits so that its supervisor restarts it."""


class OverloadedError(HicacheError):
    """The engine is too busy to take this request now (a server answers 503): retry later."""
