"""The sampling a model's authors recommend, as SamplingParams field names: an HF folder's
``generation_config.json`` or a GGUF file's ``general.sampling.*`` keys (llama.cpp's names). The
server uses them for the fields a request leaves unset (``--sampling-defaults model``, SGLang's
default; vLLM's ``--generation-config auto``)."""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping

from hicache.model.errors import cut

logger = logging.getLogger(__name__)

# generation_config.json's names are SamplingParams' own; GGUF's differ where llama.cpp's do
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}


def from_generation_config(gen: Mapping[str, Any]) -> dict[str, float]:
    return _numbers({k: gen.get(k) for k in GENERATION_CONFIG_KEYS})


def from_gguf(fields: Mapping[str, Any]) -> dict[str, float]:
    return _numbers({name: fields.get(key) for key, name in GGUF_KEYS.items()})


def _numbers(values: Mapping[str, Any]) -> dict[str, float]:
    """The numeric values, a missing or non-numeric one left out (a non-finite one too, logged):
    ``top_k`` an int (0, HF's "off", is -1, ours), the others as written (a GGUF float32 0.7 read back
    as 0.7, not 0.699999988). Ranges are the server's to check (server/state.py)."""
    out: dict[str, float] = {}
    for name, v in values.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        try:
            finite = math.isfinite(v)
        except OverflowError:  # an integer past float's range
            finite = False
        if not finite:
            logger.warning("the model's recommended %s = %s is not a finite number: not used", name, cut(str(v)))
            continue
        out[name] = (int(v) if v > 0 else -1) if name == "top_k" else float(f"{v:.7g}")
    return out
