"""Qwen2 / 2.5 (q/k/v biases) and Qwen3 (QK-norm, heads whose width is not hidden / heads). llama.cpp
runs both with NEOX-style rope, so its converter keeps HF's q/k row order."""

from hicache.model.families.base import Family

QWEN2 = Family("qwen2", "qwen2", ("Qwen2ForCausalLM",), gguf_qk_interleaved=False, attention_bias=True)
QWEN3 = Family("qwen3", "qwen3", ("Qwen3ForCausalLM",), gguf_qk_interleaved=False, qk_norm=True)
