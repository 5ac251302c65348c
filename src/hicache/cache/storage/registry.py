"""Backend names -> instances, for ``--hicache-storage-backend`` and its extra-config JSON.

Built in: ``file`` (default), ``valkey``, ``mooncake`` (Mooncake Store) and ``memory`` (this
process's memory: the simulator, tests). Anything of the
form ``package.module:Class`` is imported and constructed as ``Class(**extra_config)`` (or, when
it names an ``options_type``, as ``Class(options_type(**extra_config))``, as valkey and mooncake
are); it must subclass :class:`~.base.StorageBackend`.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect

from hicache.config import ConfigError

from .base import StorageBackend
from .file import FileBackend
from .memory import MemoryBackend
from .mooncake_backend import MooncakeBackend
from .valkey_backend import ValkeyBackend

# Built-ins by name (the modules import their clients, valkey and mooncake.store, lazily).
BUILTIN: dict[str, type[StorageBackend]] = {
    "file": FileBackend, "valkey": ValkeyBackend, "mooncake": MooncakeBackend, "memory": MemoryBackend,
}
CHOICES = "file, valkey, mooncake, memory, or package.module:Class"


def _check_options(name: str, cls: type[StorageBackend], config: dict) -> None:
    """Refuse unknown options with one sentence instead of a TypeError traceback. The options
    are the fields of ``cls.options_type``, else the constructor's keyword arguments."""
    if cls.options_type is not None:
        accepted = [f.name for f in dataclasses.fields(cls.options_type)]
    else:
        try:
            params = inspect.signature(cls.__init__).parameters
        except (TypeError, ValueError):
            return
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return
        accepted = [n for n, p in params.items() if n != "self" and p.kind is not p.VAR_POSITIONAL]
    unknown = sorted(set(config) - set(accepted))
    if unknown:
        raise ConfigError(f"storage backend {name!r} does not accept option(s) {', '.join(unknown)}; "
                          f"it accepts: {', '.join(accepted) or 'none'}.")


def _load_class(spec: str) -> type[StorageBackend]:
    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise ConfigError(f"unknown storage backend {spec!r}; choose {CHOICES}.")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"storage backend {spec!r}: cannot import {module_name!r} ({e}).") from e
    for part in class_name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ConfigError(f"storage backend {spec!r}: {module_name!r} has no {class_name!r}.")
    if not (isinstance(obj, type) and issubclass(obj, StorageBackend)):
        raise ConfigError(f"storage backend {spec!r} is not a subclass of hicache's StorageBackend.")
    return obj


def create_backend(name: str, extra_config: dict | None = None) -> StorageBackend:
    """A backend instance for ``name`` (``file``, ``valkey``, ``mooncake``, ``memory`` or ``module:Class``)
    built from ``extra_config``'s options. Raises ConfigError for an unknown name, an
    unimportable class or an unknown option; backend errors (StorageError) pass through."""
    config = dict(extra_config or {})
    if not isinstance(name, str) or not name:
        raise ConfigError(f"storage backend must be a name; choose {CHOICES}.")
    cls = BUILTIN.get(name) or _load_class(name)
    _check_options(name, cls, config)
    try:
        return cls(cls.options_type(**config)) if cls.options_type is not None else cls(**config)
    except (TypeError, ValueError) as e:
        if name not in BUILTIN:  # a user class's own errors pass through
            raise
        raise ConfigError(f"storage backend {name!r}: bad option value ({e}).") from e
