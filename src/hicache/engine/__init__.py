from .engine import Engine
from .request import GenerateResult
from .sampling import SamplingParams

__all__ = ["Engine", "GenerateResult", "SamplingParams"]
