"""The sampling a model's authors recommend, as SamplingParams field names: an HF folder's
``generation_config.json`` or a GGUF file's ``general.sampling.*`` keys (llama.cpp's names). The
server uses them for the fields a request leaves unset (``--sampling-defaults model``, SGLang's
default; vLLM's ``--generation-config auto``)."""

from __future__ import annotations

from typing import Any, Mapping

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
    """The numeric values, a missing or non-numeric one left out: ``top_k`` an int (0, HF's "off", is
    -1, ours), the others as written (a GGUF float32 0.7 read back as 0.7, not 0.699999988)."""
    out: dict[str, float] = {}
    for name, v in values.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[name] = (int(v) if v > 0 else -1) if name == "top_k" else float(f"{v:.7g}")
    return out
