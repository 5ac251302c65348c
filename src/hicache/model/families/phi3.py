"""Phi-3 (mini / medium, 4K and 128K contexts without longrope): a Llama layer whose q/k/v and
gate/up projections are stored fused (``qkv_proj`` / ``gate_up_proj``; GGUF ``attn_qkv`` /
``ffn_up``): the loaders split them by rows into the model's parts (q, k, v; gate, up), which the
engine fuses again its own way. Rotary pairs in HF order (llama.cpp's rope is NEOX-style); a
``sliding_window`` covers every layer (Phi-3 mini 4K: 2047)."""

from hicache.model.families.base import Family

PHI3 = Family(
    "phi3", "phi3", ("Phi3ForCausalLM",), gguf_qk_interleaved=False,
    gguf_tensors={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    fused={"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")},
    gguf_keys=frozenset({"attention.sliding_window"}),
)
