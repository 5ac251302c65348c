"""hicache: an LLM inference engine built around a hierarchical prefix KV cache."""

from typing import Any

from .config import EngineConfig
from .errors import EngineDeadError, HicacheError, InvalidRequestError

__all__ = ["Engine", "EngineConfig", "GenerateResult", "EngineDeadError", "HicacheError", "InvalidRequestError", "SamplingParams"]
__version__ = "0.1.0"

_LAZY = {"Engine", "GenerateResult", "SamplingParams"}


def __getattr__(name: str) -> Any:
    # The engine (and torch) load on first use, so torch-free tools (`hicache bench`) start fast.
    if name in _LAZY:
        from . import frontend

        return getattr(frontend, name)
    raise AttributeError(f"module 'hicache' has no attribute {name!r}")
