"""Errors a user can cause. Each message is one clear sentence; the CLI and server print it
instead of a traceback, and the engine keeps serving other requests."""


class HicacheError(ValueError):
    """Base of user-facing errors."""


class InvalidRequestError(HicacheError):
    """A request the engine cannot serve (bad sampling values, prompt too long, ...)."""


class ContextLengthError(InvalidRequestError):
    """The prompt leaves no room for output within the context length."""
