"""The model families this engine runs, and what differs between them -- the one place the
loaders (GGUF and HF) look that up; nothing outside ``model/`` names a family.

Today every family is a Llama-shaped decoder (RMSNorm before attention and MLP, SiLU-and-multiply,
rotate-half RoPE); a family says where it departs from that: q/k/v biases, QK-norm, how llama.cpp's
converter wrote its q/k rows. Gemma 3 and Phi-3 join as the model learns their layers
(docs/progress.md, issue 47).
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache.model.errors import ModelFormatError


@dataclass(frozen=True)
class Family:
    """``gguf_architecture``: ``general.architecture`` in its GGUF files (None: none of its own);
    ``hf_architectures``: ``architectures`` in its config.json; ``gguf_qk_interleaved``: llama.cpp's
    converter reorders q/k rows so rotary pairs are adjacent (Llama; families whose llama.cpp rope is
    NEOX-style keep HF's rotate-half order); ``attention_bias``: q/k/v biases where a config does not
    say (Qwen2 always has them); ``qk_norm``: q and k RMS-normalized per head before RoPE (Qwen3)."""

    name: str
    gguf_architecture: str | None
    hf_architectures: tuple[str, ...]
    gguf_qk_interleaved: bool = True
    attention_bias: bool = False
    qk_norm: bool = False


LLAMA = Family("llama", "llama", ("LlamaForCausalLM",))
MISTRAL = Family("mistral", None, ("MistralForCausalLM",))  # its GGUF files say "llama"
QWEN2 = Family("qwen2", "qwen2", ("Qwen2ForCausalLM",), gguf_qk_interleaved=False, attention_bias=True)
QWEN3 = Family("qwen3", "qwen3", ("Qwen3ForCausalLM",), gguf_qk_interleaved=False, qk_norm=True)
DEEPSEEK = Family("deepseek", None, ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"))  # MLA, dense layers only
FAMILIES = (LLAMA, MISTRAL, QWEN2, QWEN3, DEEPSEEK)


def gguf_family(architecture: object) -> Family:
    """The family of a GGUF file's ``general.architecture``; ModelFormatError naming the ones supported."""
    family = next((f for f in FAMILIES if f.gguf_architecture == architecture), None)
    if family is None:
        known = ", ".join(repr(f.gguf_architecture) for f in FAMILIES if f.gguf_architecture)
        raise ModelFormatError(f"GGUF architecture {architecture!r} is not supported; supported: {known}.")
    return family


def hf_family(architectures: list[str], model_type: str) -> Family:
    """The family of a config.json (``architectures``, else ``model_type``); ModelFormatError otherwise."""
    family = next((f for f in FAMILIES for a in architectures if a in f.hf_architectures), None)
    if family is None and not architectures:
        family = next((f for f in FAMILIES if f.name == model_type), LLAMA)
    if family is None:
        known = ", ".join(a for f in FAMILIES for a in f.hf_architectures)
        raise ModelFormatError(f"model architecture {architectures[0]} is not supported; expected one of {known}.")
    return family
