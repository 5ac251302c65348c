"""A transformers model written as an F32 GGUF file the way llama.cpp's ``convert_hf_to_gguf.py``
writes its family (tensor names, metadata keys, Llama's q/k row interleave, Gemma's norms with their
1 folded in), with the gguf
package's writer, so the GGUF loader can be checked against transformers on the same weights.
The tokenizer fields are the committed tiny file's (a 320-token byte-level BPE).

The recurrent families (``lfm2``, ``qwen35``, ``granitehybrid``: :func:`recurrent_to_gguf`) follow llama.cpp's
converter as of ggml-org/llama.cpp commit 0024aa7417efd50a7c2a79e049dfbbbceb0beaaf
(``convert_hf_to_gguf.py``: ``TextModel.set_gguf_parameters``, ``Qwen3NextModel``,
``_LinearAttentionVReorderBase``, ``Qwen3_5TextModel``) and 7bca1fd9ca2a681b0182e16f24f832b7be1942af
(``conversion/lfm2.py``: ``LFM2Model``), plus what the later ``conversion/qwen.py`` adds for Qwen3.5
(``_Qwen35MRopeMixin``: ``rope.dimension_sections`` always, [11, 11, 10, 0] by default;
``_Qwen35MtpMixin``: ``nextn_predict_layers`` MTP blocks after the model's). Tensor names come from
the gguf package's own ``TensorNameMap`` (what the converter's ``map_tensor_name`` uses), so only
the transforms below are this module's reading of the converter:

- LFM2: per-layer ``attention.head_count_kv`` (0 for a conv layer), ``shortconv.l_cache``,
  ``vocab_size``, ``norm_eps`` as the RMS eps, the MLP width as ``Lfm2MLP`` derives it; the conv
  weight ``[hidden, 1, K]`` squeezed to ``[hidden, K]``; nothing else changed.
- Qwen3.5: ``ssm.conv_kernel`` / ``state_size`` / ``group_count`` / ``time_step_rank`` /
  ``inner_size``, ``full_attention_interval`` (the config's, else 4: a layout the interval cannot
  say is refused here, as llama.cpp could not express it), ``rope.dimension_count`` = head_dim x
  partial_rotary_factor; value heads regrouped from grouped-by-key-head to tiled where the value
  heads outnumber the key heads (the V rows of ``in_proj_qkv`` and ``conv1d``, ``in_proj_z`` /
  ``_b`` / ``_a`` rows, ``A_log`` / ``dt_bias``, ``out_proj``'s columns), then ``A_log`` ->
  ``-exp(A_log)``, ``dt_bias`` -> ``dt_proj.bias``, ``conv1d`` squeezed, ``1 +`` every norm but
  ``linear_attn.norm``.
- Granite 4.0-H (``GraniteHybridModel`` over ``Mamba2Model``, ``GraniteMoeModel``, ``GraniteModel``,
  ``LlamaModel``; ``conversion/granite.py`` and ``mamba.py`` of the split converter): the multipliers as
  ``embedding_scale`` / ``attention.scale`` / ``residual_scale`` / ``logit_scale``, the ``ssm.*`` sizes
  (``time_step_rank`` the Mamba2 heads), per-layer ``attention.head_count_kv`` (0 for a Mamba2 layer),
  ``rope.scaling.finetuned`` false and a 2**20 context for any GraniteMoeHybrid; ``input_linear`` split
  into ``ffn_gate`` / ``ffn_up``, q/k rows interleaved (``undo_permute``), ``dt_bias`` -> ``ssm_dt.bias``,
  the conv squeezed, ``A_log`` -> ``-exp(A_log)`` and ``D`` as ``[heads, 1]``, the gated norm as
  ``[groups, d_inner / groups]``.

``q8_0``: the layers' matrices as Q8_0 blocks, where their rows are whole blocks, but the depthwise
convs and the norms (llama.cpp's quantizer keeps those in F32); the rest F32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from gguf_edit import TINY

# HF parameter (after "model.layers.{i}.") -> GGUF tensor (after "blk.{i}.")
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}  # the last two: Phi-3's fused ones
GEMMA_LAYER = {**LAYER, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}


def interleave(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permute of Llama q/k rows: within a head, HF rows j and j + d/2 become 2j and 2j + 1."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def hf_to_gguf(model, path: Path, arch: str, pre: str = "gpt-2", q8_0: bool = False) -> Path:
    """Write ``model`` (a transformers Llama, Mistral, Qwen2, Qwen3, Gemma 3 or Phi-3 causal LM) to ``path`` as GGUF
    ``arch``. ``q8_0``: the layers' matrices as Q8_0 blocks (the gguf package's quantizer), the rest F32."""
    import gguf

    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}
    writer.add_rope_freq_base(float(rope.get("full_attention", rope)["rope_theta"]))  # Gemma 3: the full layers'

    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if rope.get("rope_type") == "yarn":  # as llama.cpp's converter writes Qwen2's
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if getattr(cfg, "sliding_window", None):  # Gemma 3; Mistral (llama.cpp keeps it in a llama file)
        writer.add_sliding_window(cfg.sliding_window)
    if arch in ("llama", "phi3"):
        writer.add_rope_dimension_count(head_dim)
    elif head_dim != cfg.hidden_size // heads or arch == "gemma3":  # Qwen3: heads narrower or wider than hidden / heads
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    copy_tokenizer(writer, pre)
    layer_names = GEMMA_LAYER if arch == "gemma3" else LAYER
    for name, p in model.state_dict().items():
        value = p.detach().float().numpy()
        if arch == "gemma3" and name.endswith("norm.weight"):
            value = value + 1.0  # Gemma computes 1 + w: llama.cpp's converter folds the 1 in
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            gguf_name = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{layer_names[module]}.{kind}"
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                value = interleave(value, heads if "q_proj" in module else kv_heads)
        add_tensor(writer, gguf_name, value, q8_0 and gguf_name.startswith("blk.") and value.ndim == 2)
    return finish(writer, path)


def copy_tokenizer(writer, pre: str) -> None:
    """The committed tiny file's tokenizer fields, ``tokenizer.ggml.pre`` set to ``pre``."""
    import gguf

    reader = gguf.GGUFReader(TINY)
    for field in reader.fields.values():
        if field.name.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            value = pre if field.name == "tokenizer.ggml.pre" else field.contents()
            writer.add_key_value(field.name, value, field.types[0], sub_type=sub)


def add_tensor(writer, name: str, value: np.ndarray, q8_0: bool) -> None:
    """``value`` as tensor ``name``: Q8_0 blocks (the gguf package's quantizer) where ``q8_0``, else F32."""
    import gguf

    value = np.ascontiguousarray(value, dtype=np.float32)
    if q8_0:
        kind = gguf.GGMLQuantizationType.Q8_0
        writer.add_tensor(name, gguf.quants.quantize(value, kind), raw_dtype=kind)
    else:
        writer.add_tensor(name, value)


def finish(writer, path: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


RECURRENT_ARCHS = {"lfm2": "LFM2", "qwen35": "QWEN35", "granitehybrid": "GRANITE_HYBRID"}  # -> gguf.MODEL_ARCH member
QWEN35_MROPE_SECTIONS = [11, 11, 10, 0]  # what the converter writes where the config gives none


def recurrent_to_gguf(model, path: Path, arch: str, q8_0: bool = False, mtp: int = 0, pre: str = "gpt-2") -> Path:
    """Write transformers' ``Lfm2ForCausalLM`` (``arch`` "lfm2"), ``Qwen3_5ForCausalLM`` ("qwen35") or
    ``GraniteMoeHybridForCausalLM`` with dense MLPs ("granitehybrid") to ``path`` as llama.cpp's converter
    does (module docstring). ``mtp``: that many multi-token-prediction blocks appended after the model's
    (random weights of a Qwen3.5 MTP layer's shapes), as a newer converter writes the checkpoint's ``mtp.*``."""
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(path, arch)
    _text_model_metadata(writer, cfg, cfg.num_hidden_layers + mtp)
    if arch == "lfm2":
        _lfm2_metadata(writer, model)
    elif arch == "qwen35":
        _qwen35_metadata(writer, cfg, mtp)
    else:
        _granite_metadata(writer, cfg)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8_0 else gguf.LlamaFileType.ALL_F32)
    copy_tokenizer(writer, pre)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[RECURRENT_ARCHS[arch]], cfg.num_hidden_layers)
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # (the checkpoint holds no tied head)
        for name, value in TENSORS[arch](name, p.detach().float(), cfg):
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if gguf_name is None:
                raise ValueError(f"the gguf package maps no {arch} tensor to {name}")
            add_tensor(writer, gguf_name, value.numpy(), q8_0 and _quantized(gguf_name, value))
    gen = torch.Generator().manual_seed(11)
    for block in range(cfg.num_hidden_layers, cfg.num_hidden_layers + mtp):
        for name, shape in _mtp_block(cfg, block).items():
            add_tensor(writer, name, (0.1 * torch.randn(shape, generator=gen)).numpy(), False)
    return finish(writer, path)


def _quantized(gguf_name: str, value) -> bool:
    """Whether Q8_0 takes the tensor: a layer's matrix of whole 32-value blocks a row, not a depthwise conv nor
    a norm (the converter keeps ``*_norm.weight`` in F32: Granite's ``ssm_norm`` is a matrix)."""
    return (gguf_name.startswith("blk.") and value.dim() == 2 and value.shape[1] % 32 == 0
            and not gguf_name.endswith(("ssm_conv1d.weight", "shortconv.conv.weight", "_norm.weight")))


def _text_model_metadata(writer, cfg, blocks: int) -> None:
    """``TextModel.set_gguf_parameters``' keys (the family's own overwrite some)."""
    writer.add_block_count(blocks)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    if getattr(cfg, "rms_norm_eps", None) is not None:
        writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if getattr(cfg, "head_dim", None) is not None:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)


def _lfm2_metadata(writer, model) -> None:
    """``LFM2Model.set_gguf_parameters``: KV heads per layer (0: conv), the conv's taps, the MLP's width."""
    cfg = model.config
    writer.add_head_count_kv([cfg.num_key_value_heads if t == "full_attention" else 0 for t in cfg.layer_types])
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_shortconv_l_cache(cfg.conv_L_cache)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_feed_forward_length(model.model.layers[0].feed_forward.w1.out_features)


def _qwen35_metadata(writer, cfg, mtp: int) -> None:
    """``Qwen3NextModel.set_gguf_parameters`` (the DeltaNet's sizes, the attention interval, rotary
    dims), ``_Qwen35MRopeMixin``'s sections, ``_Qwen35MtpMixin``'s MTP layer count."""
    interval = getattr(cfg, "full_attention_interval", None) or 4
    if list(cfg.layer_types) != ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                 for i in range(cfg.num_hidden_layers)]:
        raise ValueError(f"layer_types {cfg.layer_types} are not every {interval}th layer full: llama.cpp's "
                         "qwen35 files cannot say so")
    writer.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    writer.add_ssm_state_size(cfg.linear_key_head_dim)
    writer.add_ssm_group_count(cfg.linear_num_key_heads)
    writer.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    writer.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    writer.add_full_attention_interval(interval)
    writer.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor", 0.25)))
    sections = cfg.rope_parameters.get("mrope_section")
    writer.add_rope_dimension_sections(list(sections) + [0] * (4 - len(sections)) if sections else QWEN35_MROPE_SECTIONS)
    if mtp:
        writer.add_nextn_predict_layers(mtp)


def _lfm2_tensor(name: str, value, cfg) -> list[tuple[str, object]]:
    """``LFM2Model.modify_tensors``: the conv's ``[hidden, 1, K]`` squeezed."""
    return [(name, value.squeeze(1) if "conv.conv.weight" in name else value)]  # (published LFM2s have no conv bias)


def tiled(value, dim: int, key_heads: int, width: int):
    """Value heads along ``dim`` (``width`` rows each) from grouped by key head to tiled."""
    shape = value.shape
    grouped = value.reshape(*shape[:dim], key_heads, -1, width, *shape[dim + 1:])
    return grouped.transpose(dim, dim + 1).reshape(shape)


def _qwen35_tensor(name: str, value, cfg) -> list[tuple[str, object]]:
    """``_LinearAttentionVReorderBase.modify_tensors`` then ``Qwen3NextModel.modify_tensors``."""
    k_heads, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    if k_heads != cfg.linear_num_value_heads and "linear_attn." in name:
        keys = 2 * k_heads * dk
        if ".in_proj_qkv." in name or ".conv1d." in name:
            value = value.squeeze() if ".conv1d." in name else value
            value = torch.cat([value[:keys], tiled(value[keys:], 0, k_heads, dv)])
        elif ".in_proj_z." in name:
            value = tiled(value, 0, k_heads, dv)
        elif ".in_proj_b." in name or ".in_proj_a." in name or name.endswith((".A_log", ".dt_bias")):
            value = tiled(value, 0, k_heads, 1)
        elif ".out_proj." in name:
            value = tiled(value, 1, k_heads, dv)
    if name.endswith(".A_log"):
        value = -value.exp()
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in name:
        value = value.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        value = value + 1
    return [(name, value)]


def _granite_metadata(writer, cfg) -> None:
    """``GraniteHybridModel.set_gguf_parameters`` after ``GraniteMoeModel`` / ``GraniteModel`` /
    ``LlamaModel``'s: the multipliers (where non-zero), the shared MLP's width, the Mamba2 sizes, KV
    heads per layer (0: Mamba2), ``rope.scaling.finetuned`` false and a 2**20 context for every
    GraniteMoeHybrid (its RoPE is Bamba's only), no experts."""
    heads = cfg.num_attention_heads
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_dimension_count(cfg.hidden_size // heads)
    writer.add_expert_count(cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    for key, add in (("attention_multiplier", writer.add_attention_scale), ("embedding_multiplier",
                     writer.add_embedding_scale), ("residual_multiplier", writer.add_residual_scale),
                     ("logits_scaling", writer.add_logit_scale)):
        if getattr(cfg, key):
            add(getattr(cfg, key))
    writer.add_expert_shared_feed_forward_length(cfg.shared_intermediate_size)
    writer.add_ssm_conv_kernel(cfg.mamba_d_conv)
    writer.add_ssm_state_size(cfg.mamba_d_state)
    writer.add_ssm_group_count(cfg.mamba_n_groups)
    writer.add_ssm_inner_size(cfg.mamba_expand * cfg.hidden_size)
    writer.add_ssm_time_step_rank(cfg.mamba_n_heads)
    writer.add_head_count_kv([cfg.num_key_value_heads if t in ("attention", "full_attention") else 0
                             for t in cfg.layer_types])
    writer.add_rope_scaling_finetuned(False)
    writer.add_context_length(2 ** 20)


def _granite_tensor(name: str, value, cfg) -> list[tuple[str, object]]:
    """``GraniteHybridModel.modify_tensors``: the shared MLP's ``input_linear`` split into gate and up
    (``GraniteMoeModel``'s), q/k rows interleaved (``LlamaModel``'s ``undo_permute``), and Mamba2's
    (``Mamba2Model``'s): ``dt_bias`` as ``dt_proj.bias``, the conv squeezed, ``A_log`` -> ``-exp(A_log)``
    and ``D`` as ``[heads, 1]``, the norm as ``[groups, d_inner / groups]``."""
    layer = name.split(".")[2] if name.startswith("model.layers.") else None
    if name.endswith("shared_mlp.input_linear.weight"):
        gate, up = value.split(cfg.shared_intermediate_size)
        return [(f"model.layers.{layer}.mlp.gate_proj.weight", gate), (f"model.layers.{layer}.mlp.up_proj.weight", up)]
    if name.endswith("shared_mlp.output_linear.weight"):
        return [(f"model.layers.{layer}.mlp.down_proj.weight", value)]
    if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
        heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
        return [(name, interleave(value, heads))]
    if name.endswith(".dt_bias"):
        return [(name.removesuffix(".dt_bias") + ".dt_proj.bias", value)]
    if ".conv1d." in name:
        value = value.squeeze()
    elif name.endswith((".A_log", ".D")):
        value = (-value.exp() if name.endswith(".A_log") else value).reshape(-1, 1)
    elif name.endswith("mamba.norm.weight"):
        value = value.reshape(cfg.mamba_n_groups, -1)
    return [(name, value)]


TENSORS = {"lfm2": _lfm2_tensor, "qwen35": _qwen35_tensor, "granitehybrid": _granite_tensor}  # by architecture


def _mtp_block(cfg, block: int) -> dict[str, tuple[int, ...]]:
    """The tensors (GGUF names, torch shapes) of one Qwen3.5 MTP block as the newer converter writes
    ``mtp.*``: a gated-attention decoder layer, ``fc`` (``nextn.eh_proj``) and its three norms."""
    hidden, heads, kv, dim = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    shapes = {"attn_norm.weight": (hidden,), "attn_q.weight": (2 * heads * dim, hidden), "attn_k.weight": (kv * dim, hidden),
              "attn_v.weight": (kv * dim, hidden), "attn_output.weight": (hidden, heads * dim),
              "attn_q_norm.weight": (dim,), "attn_k_norm.weight": (dim,), "post_attention_norm.weight": (hidden,),
              "ffn_gate.weight": (cfg.intermediate_size, hidden), "ffn_up.weight": (cfg.intermediate_size, hidden),
              "ffn_down.weight": (hidden, cfg.intermediate_size), "nextn.eh_proj.weight": (hidden, 2 * hidden),
              "nextn.enorm.weight": (hidden,), "nextn.hnorm.weight": (hidden,), "nextn.shared_head_norm.weight": (hidden,)}
    return {f"blk.{block}.{name}": shape for name, shape in shapes.items()}
