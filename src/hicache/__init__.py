"""hicache: an LLM inference engine built around a hierarchical prefix KV cache."""

from .config import EngineConfig
from .engine import Engine, GenerateResult, SamplingParams
from .errors import HicacheError, InvalidRequestError

__all__ = ["Engine", "EngineConfig", "GenerateResult", "HicacheError", "InvalidRequestError", "SamplingParams"]
__version__ = "0.1.0"
