"""The model families this engine runs, and what differs between them -- the one place the loaders
(GGUF and HF) look that up; nothing outside ``model/`` names a family. One module per family
states its data (:class:`~hicache.model.families.base.Family`); ``base`` maps files onto
ModelSpec fields."""

from __future__ import annotations

from hicache.model.errors import ModelFormatError, quoted
from hicache.model.families.base import Family, config_int, gguf_layer_fields, hf_layer_fields, hf_text_config
from hicache.model.families.deepseek import DEEPSEEK
from hicache.model.families.gemma3 import GEMMA3
from hicache.model.families.granite_hybrid import GRANITE_HYBRID
from hicache.model.families.lfm2 import LFM2
from hicache.model.families.llama import LLAMA, MISTRAL
from hicache.model.families.phi3 import PHI3
from hicache.model.families.qwen import QWEN2, QWEN3
from hicache.model.families.qwen35 import QWEN35

FAMILIES = (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA3, PHI3, DEEPSEEK, LFM2, QWEN35, GRANITE_HYBRID)
__all__ = ["Family", "FAMILIES", "LLAMA", "MISTRAL", "QWEN2", "QWEN3", "GEMMA3", "PHI3", "DEEPSEEK", "LFM2", "QWEN35",
           "GRANITE_HYBRID", "gguf_family", "hf_family", "gguf_layer_fields", "hf_layer_fields", "hf_text_config",
           "config_int"]


def gguf_family(architecture: object) -> Family:
    """The family of a GGUF file's ``general.architecture``; ModelFormatError naming the ones supported,
    or what a variant a family refuses (Qwen3-Next, the MoE variants) is."""
    refusal = next((f.gguf_refused[architecture] for f in FAMILIES if isinstance(architecture, str)
                    and architecture in f.gguf_refused), None)
    if refusal is not None:
        raise ModelFormatError(f"GGUF architecture {quoted(architecture)}: {refusal}.")
    family = next((f for f in FAMILIES if f.gguf_architecture == architecture), None)
    if family is None:
        known = ", ".join(repr(f.gguf_architecture) for f in FAMILIES if f.gguf_architecture)
        raise ModelFormatError(f"GGUF architecture {quoted(architecture)} is not supported; supported: {known}.")
    return family


def hf_family(architectures: list[str], model_type: str) -> Family:
    """The family of a config.json (``architectures``, else ``model_type``); ModelFormatError otherwise,
    and for a variant a family refuses (LFM2's MoE) whichever of the two names it."""
    for name in (*architectures, model_type):
        refusal = next((f.hf_refused[name] for f in FAMILIES if name in f.hf_refused), None)
        if refusal is not None:
            raise ModelFormatError(f"model {quoted(name)}: {refusal}.")
    family = next((f for f in FAMILIES for a in architectures if a in f.hf_architectures), None)
    if family is None and not architectures:
        family = next((f for f in FAMILIES if f.name == model_type.removesuffix("_text")), LLAMA)
    if family is None:
        known = ", ".join(a for f in FAMILIES for a in f.hf_architectures)
        raise ModelFormatError(f"model architecture {quoted(architectures[0])} is not supported; expected one of {known}.")
    return family
