"""Errors a user can cause. Each message is one clear sentence; the CLI and server print it
instead of a traceback, and the engine keeps serving other requests."""


class HicacheError(ValueError):
    """Base of the errors hicache raises with a one-sentence message for the user."""


class ConfigError(HicacheError):
    """A bad option or option combination; the message is one sentence for the user."""


class InvalidRequestError(HicacheError):
    """A request the engine cannot serve (bad sampling values, prompt too long, ...)."""


class ContextLengthError(InvalidRequestError):
    """The prompt leaves no room for output within the context length."""


class EngineDeadError(HicacheError):
    """The engine can no longer serve (its loop crashed, a rank died): not the caller's fault.
    A server answers 503 and exits so that its supervisor restarts it."""
