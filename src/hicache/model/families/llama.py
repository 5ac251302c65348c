"""Llama (Llama 2, Llama 3.x with its llama3 rope, SmolLM) and Mistral: the plain layer every other
family departs from. Mistral's GGUF files say "llama"; a window (``sliding_window`` in config.json,
``llama.attention.sliding_window`` in a GGUF file) makes every layer sliding."""

from hicache.model.families.base import Family

LLAMA = Family("llama", "llama", ("LlamaForCausalLM",), gguf_keys=frozenset({"attention.sliding_window"}))
MISTRAL = Family("mistral", None, ("MistralForCausalLM",))
