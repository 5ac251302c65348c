"""User-facing model errors (each message is one sentence for the user)."""

from __future__ import annotations

from hicache.config import ConfigError


class ModelNotFoundError(ConfigError):
    """The requested model name, path or file does not exist or lacks required files."""


class ModelFormatError(ConfigError):
    """The model files exist but describe something this engine cannot run."""
