"""The engine: requests, the scheduler, and the in-process ``Engine`` API over a backend.

``Engine`` loads on first use: the rank processes build on ``engine.core`` (through
``hicache.parallel``) and must not need the Engine API, which picks their backend."""

from typing import TYPE_CHECKING, Any

from .request import GenerateResult
from .sampling import SamplingParams

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["Engine", "GenerateResult", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from .engine import Engine

        return Engine
    raise AttributeError(f"module 'hicache.engine' has no attribute {name!r}")
