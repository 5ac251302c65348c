"""The user-facing layer: the in-process ``Engine`` API over one backend (this process's runtime,
or a rank group that runs it in rank processes), the loop that drives it for a server, the demo.

It sits above ``hicache.parallel``; the rank processes import only the runtime below it."""

from ..runtime.request import GenerateResult
from ..runtime.sampling import SamplingParams
from .engine import Engine

__all__ = ["Engine", "GenerateResult", "SamplingParams"]
