"""Llama-family decoder (Llama, Qwen2, Qwen3's QK-norm, Mistral, SmolLM2; Gemma 3's four norms a
layer, GeGLU, scaled embeddings and sliding-window layers; MLA layers for DeepSeek-V2/V3) over a
paged KV cache.

Parameter names follow Hugging Face (``model.layers.0.self_attn.q_proj.weight``...) so a
safetensors checkpoint loads by name. RoPE uses the HF rotate-half convention: within a head,
dimension ``i`` pairs with ``i + head_dim / 2``; loaders of other layouts (GGUF) convert on load.
Attention runs through the batch's backend (:class:`~hicache.model.batch.AttentionBackend`): a
layer computes q/k/v and hands them over; it never branches on the kind of batch.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections import Counter
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from hicache.model.attention import NATIVE_HEAD_DIMS, NATIVE_KV_DTYPES
from hicache.model.batch import ForwardBatch, KVView, window_group
from hicache.model.decode_stack import DecodeStack
from hicache.model.layers import MLP, RMSNorm, RotaryEmbedding, native_ops, rotate_half
from hicache.model.mla import MLAAttention
from hicache.model.projection import DECODE_ROWS, Projection
from hicache.model.recurrent import GatedDeltaNet, Mamba2Mixer, ShortConv
from hicache.model.spec import LayerKind, ModelSpec


class Attention(nn.Module):
    """GQA self-attention: q/k/v and RoPE here, the K/V store and the attention in the batch's backend."""

    latent = False  # the pool holds this layer's keys and values as they are

    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.layer = spec.attention_layers.index(layer)  # its KV buffers: compact among the attention layers
        self.window = spec.layer_window(layer)  # 0: a full layer
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        # The backends scale q.k by head_dim ** -0.5; another scale (Gemma's query_pre_attn_scalar) is
        # folded into q. None: the default.
        scale = spec.attention_scale
        self.q_scale = None if scale is None or scale == spec.head_dim ** -0.5 else scale * spec.head_dim ** 0.5
        q_width, kv_width = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        # Gated attention (Qwen3.5): q_proj emits each head's query, then that head's gate
        self.gated = spec.attn_output_gate
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(spec.hidden_size, width, bias=spec.attention_bias)
                                                 for width in (q_width * (2 if self.gated else 1), kv_width, kv_width))
        self.rotary_dim = spec.rope_dim  # the first dims of each head RoPE turns (all but under partial rotary)
        self.nope = spec.nope  # no positional embedding at all (Granite 4.0-H)
        self.o_proj = nn.Linear(q_width, spec.hidden_size, bias=False)
        self.qkv = Projection(self.q_proj, self.k_proj, self.v_proj)
        self.out = Projection(self.o_proj)
        # Qwen3: each q and k head RMS-normalized before RoPE (HF names self_attn.q_norm / k_norm)
        self.q_norm, self.k_norm = [RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None for _ in "qk"]
        self.tp_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # sum over TP ranks (model/parallel.py)
        # Uneven TP split: the local KV head of each local query head (None: equal groups).
        self.kv_map: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                kv: KVView) -> torch.Tensor:
        """``x``: ``[T, hidden]``; ``cos``/``sin``: ``[T, 1, rotary_dim]`` in x's dtype. Returns
        ``[T, hidden]``."""
        t = x.shape[0]
        qkv = self.qkv.whole(x, batch.generated)
        gate = None
        if self.gated:  # [q_h | gate_h] per head: the gates aside, the queries joined to k and v as ungated
            width = self.num_heads * self.head_dim
            heads = qkv[:, :2 * width].view(t, self.num_heads, 2, self.head_dim)
            gate = heads[:, :, 1].reshape(t, width)
            qkv = torch.cat((heads[:, :, 0].reshape(t, width), qkv[:, 2 * width:]), dim=-1)
        # q and k sit side by side in the fused output: rotate both heads' sets in one pass.
        qk_heads = self.num_heads + self.num_kv_heads
        if self.q_norm is not None:  # per head, before RoPE; in place: the fused output is ours
            q_width, k_end = self.num_heads * self.head_dim, qk_heads * self.head_dim
            # (contiguous: the native norm then serves every pass, as it does in the fused decode layer)
            qkv[:, :q_width] = self.q_norm(qkv[:, :q_width].reshape(-1, self.head_dim).contiguous()).view(t, q_width)
            qkv[:, q_width:k_end] = self.k_norm(qkv[:, q_width:k_end].reshape(-1, self.head_dim).contiguous()).view(t, -1)
        qk = qkv[:, : qk_heads * self.head_dim].view(t, qk_heads, self.head_dim)
        ops = native_ops(qkv)
        if self.nope:  # no positional embedding: positions reach the layer through the causal mask alone
            pass
        elif self.rotary_dim < self.head_dim:  # partial rotary: the other dims pass as they are
            turned = qk[..., :self.rotary_dim]
            qk = torch.cat((turned * cos + rotate_half(turned) * sin, qk[..., self.rotary_dim:]), dim=-1)
        elif ops is not None and self.head_dim % 16 == 0:
            ops.rope_(qkv, cos.flatten(1), sin.flatten(1), qk_heads, self.head_dim)  # in place: qk sees it
        else:
            qk = qk * cos + rotate_half(qk) * sin
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        if self.q_scale is not None:
            q = q * self.q_scale
        v = qkv[:, qk_heads * self.head_dim:].view(t, self.num_kv_heads, self.head_dim)

        out = batch.backend.forward(q, k, v, self, batch, kv).flatten(1)  # [T, H * D]; T may be 0 on a CP rank
        if gate is not None:
            out = out * torch.sigmoid(gate)
        out = self.out(out, batch.generated)
        return out if self.tp_reduce is None else self.tp_reduce(out)


class DecoderLayer(nn.Module):
    """Pre-norm: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``, the second norm named
    ``post_attention_layernorm`` (HF's name). With ``sandwich_norms`` (Gemma, HF names too): the
    attention's output goes through ``post_attention_layernorm`` before its residual add, and the
    MLP has ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm`` around it.

    The mixer follows the layer's kind: ``self_attn`` (attention, MLA), or a recurrent one of
    :data:`MIXERS` under its HF name; ``recurrent`` says whether it keeps a state (:attr:`state_mixer`).
    ``spec.residual_scale`` (Granite) multiplies the mixer's and the MLP's outputs before their adds."""

    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.recurrent = spec.is_recurrent(layer)
        self.residual_scale = spec.residual_scale
        if self.recurrent:
            self._mixer_name, mixer = MIXERS[spec.layer_kinds[layer]]
            self.add_module(self._mixer_name, mixer(spec, layer))
        else:
            self.self_attn = MLAAttention(spec, layer) if spec.is_mla else Attention(spec, layer)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.sandwich = spec.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)
        # RoPE of a sliding-window layer with a base of its own (Gemma 3's local layers)
        self.local_rope = spec.local_rope_theta is not None and spec.layer_window(layer) > 0

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                kv: KVView) -> torch.Tensor:
        ops = self._fused_decode_ops(x, batch, kv)
        operands = None if ops is None else self._decode_operands()
        if operands is not None:
            return self._fused_decode(ops, operands, x, cos, sin, batch, kv)
        if self.recurrent:
            attn = self.state_mixer(self.input_layernorm(x), batch, kv)
        else:
            attn = self.self_attn(self.input_layernorm(x), cos, sin, batch, kv)
        x = x + self._scaled(self.post_attention_layernorm(attn) if self.sandwich else attn)
        mlp = self.mlp(self.pre_mlp_norm()(x), batch.generated)
        return x + self._scaled(self.post_feedforward_layernorm(mlp) if self.sandwich else mlp)

    def _scaled(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.residual_scale == 1 else out * self.residual_scale

    @property
    def state_mixer(self) -> nn.Module:
        """A recurrent layer's mixer (its ``conv``, ``linear_attn`` or ``mamba``)."""
        return self._modules[self._mixer_name]

    # A decode step's layer as one native call (kernels/decode_layer.cpp): the same kernels in the
    # same order as the modules above, bit for bit, without ~25 Python dispatches a layer.
    _decode_key: tuple = ()
    _decode_args: Optional[tuple] = None

    def _fused_decode_ops(self, x: torch.Tensor, batch: ForwardBatch, kv: KVView):
        """The native kernels when this pass is one the fused layer serves: a decode batch of at
        most DECODE_ROWS generated tokens on one rank (never prompt tokens: issue 57), float32 on
        the CPU, the heads as the kernels take them. Deterministic inference: every pass. Never a
        recurrent layer (the native layer attends), a gated one, one with partial rotary or none, or
        a residual scale (the kernel rotates whole heads, has no output gate and adds as Llama does)."""
        if self.recurrent or self.residual_scale != 1:
            return None
        attn = self.self_attn
        if not isinstance(attn, Attention) or attn.gated or attn.nope or attn.rotary_dim != attn.head_dim:
            return None
        invariant = attn.qkv.row_invariant
        rows = sys.maxsize if invariant else DECODE_ROWS
        if (not (batch.generated or invariant) or batch.attn.decode is None or not 0 < x.shape[0] <= rows
                or attn.tp_reduce is not None or self.mlp.tp_reduce is not None or attn.kv_map is not None
                or attn.head_dim not in NATIVE_HEAD_DIMS
                or kv.k_buffers[attn.layer].dtype not in NATIVE_KV_DTYPES or self.mlp.gate_proj.out_features % 8):
            return None
        return native_ops(x)

    def _decode_operands(self) -> Optional[tuple]:
        """``(parts, kinds, qtypes, weights, qkv bias)`` of the four projections' decode weights
        (see kernels/decode_layer.cpp), rebuilt when a projection re-fuses; None when one of them
        is not a native decode kernel."""
        projections = (self.self_attn.qkv, self.self_attn.out, self.mlp.gate_up, self.mlp.down)
        key = tuple(p.prepare() for p in projections)
        if key != self._decode_key:
            native = [p.native_decode() for p in projections]
            usable = None not in native and all(p.bias is None for p in projections[1:])
            parts = [part for one in native for part in one] if usable else []
            self._decode_args = (
                [len(one) for one in native], [kind for kind, _, _ in parts], [qtype for _, qtype, _ in parts],
                [t for _, _, tensors in parts for t in tensors], projections[0].bias,
            ) if usable else None
            self._decode_key = key
        return self._decode_args

    def pre_mlp_norm(self) -> RMSNorm:
        """The norm before the MLP (Llama names it post_attention_layernorm)."""
        return self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm

    def style(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Where this layer departs from Llama's, as the fused layer takes it: its QK-norm weights and
        its post norms' (each an empty list where it has none)."""
        attn = self.self_attn
        qk = [attn.q_norm.weight, attn.k_norm.weight] if attn.q_norm is not None else []
        post = [self.post_attention_layernorm.weight, self.post_feedforward_layernorm.weight] if self.sandwich else []
        return qk, post

    def _fused_decode(self, ops, operands: tuple, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      batch: ForwardBatch, kv: KVView) -> torch.Tensor:
        attn = self.self_attn
        layout = batch.attn.windowed(attn.window, window_group(kv, attn.layer)).decode  # type: ignore[attr-defined]
        kv.wait_layer(attn.layer)
        return ops.decode_layer(x, self.input_layernorm.weight, self.pre_mlp_norm().weight,
                                self.input_layernorm.eps, *operands, cos, sin,
                                attn.num_heads, attn.num_kv_heads, kv.k_buffers[attn.layer],
                                kv.v_buffers[attn.layer], layout.out_slots, layout.kv_slots, layout.lengths,
                                *self.style(), self.mlp.gelu, attn.q_scale or 1.0)


# A recurrent layer's mixer by its kind: its module's name (transformers') and class.
MIXERS: dict[LayerKind, tuple[str, type[nn.Module]]] = {
    LayerKind.CONV: ("conv", ShortConv), LayerKind.GDN: ("linear_attn", GatedDeltaNet),
    LayerKind.MAMBA2: ("mamba", Mamba2Mixer)}
_INIT_LOCK = threading.Lock()


@contextlib.contextmanager
def _made_on(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """New tensors on ``device``, floating ones in ``dtype`` (torch's defaults restored after)."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            yield
    finally:
        torch.set_default_dtype(saved)


@contextlib.contextmanager
def _no_default_init() -> Iterator[None]:
    """Build modules with their parameters allocated but not initialised: the default init of
    a 135M-parameter model costs ~1.2 s, and the meta-device route that also skips it costs
    ~2.4 s of one-time torch imports per process (paid again by every rank process)."""
    kinds = (nn.Linear, nn.Embedding)
    with _INIT_LOCK:
        saved = [kind.reset_parameters for kind in kinds]
        for kind in kinds:
            kind.reset_parameters = lambda self: None
        try:
            yield
        finally:
            for kind, reset in zip(kinds, saved):
                kind.reset_parameters = reset


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


def parameter_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every parameter of ``LlamaForCausalLM(spec)`` by name, with its shape, allocating none of
    them: one layer of each kind built on the meta device (~1 ms; the layers of a kind share their
    shapes), its names repeated for every layer of its kind. What the loaders check a file's
    tensor table against before they allocate the model (model/file_checks.py)."""
    import dataclasses

    kind_of = spec.layer_kinds or (LayerKind.FULL,) * spec.num_layers
    kinds = tuple(dict.fromkeys(kind_of))  # distinct, in order of first use: built layer i is of kinds[i]
    one = dataclasses.replace(spec, num_layers=len(kinds), layer_kinds=kinds if spec.layer_kinds else ())
    with _no_default_init(), _made_on(torch.device("meta"), torch.float32):
        model = LlamaModel(one)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, p in model.named_parameters():
        if not name.startswith("layers."):
            shapes[f"model.{name}"] = tuple(p.shape)
            continue
        built, _, rest = name.removeprefix("layers.").partition(".")
        shapes.update({f"model.layers.{i}.{rest}": tuple(p.shape) for i in range(spec.num_layers)
                       if kind_of[i] == kinds[int(built)]})
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, spec.hidden_size)
    return shapes


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head. Parameters are allocated uninitialized; a loader fills them.

    ``forward`` writes the batch's new K/V into ``kv`` and returns float32 logits
    ``[R, vocab_size]``, one row per wanted row (``batch.attn.final_rows``).
    """

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.spec = spec
        self.dtype = dtype
        self.device = torch.device(device)
        # Off the CPU the modules are made where they run, in their dtype: made on the CPU in float32
        # first, an 8B model would take 32 GB of host memory and a conversion pass.
        placed = contextlib.nullcontext() if self.device.type == "cpu" else _made_on(self.device, dtype)
        with _no_default_init(), placed:  # the loader overwrites every parameter
            self.model = LlamaModel(spec)
            self.lm_head = None if spec.tie_word_embeddings else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.to(dtype=dtype, device=self.device)
        self.requires_grad_(False)
        self.eval()
        self.rope = RotaryEmbedding(spec, self.device)
        self.local_rope = RotaryEmbedding(spec, self.device, local=True) if spec.local_rope_theta is not None else None
        # A pipeline stage (model/parallel.py) holds some layers: the first embeds, the last
        # returns logits, the others take and return hidden states.
        self.first_stage = self.last_stage = True
        self.deterministic = False  # set_deterministic
        self.head: Optional[Projection] = Projection(self.model.embed_tokens if self.lm_head is None else self.lm_head)
        # The fused stack runs attention layers only: a model with recurrent layers runs layer by layer.
        self.decode_stack = None if spec.recurrent_layers else DecodeStack(self.model)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings ``[T, hidden]``, times ``spec.embedding_scale`` (rounded to the weight
        dtype first, as the reference model does; a scale of 1 leaves every bit as it is)."""
        h = self.model.embed_tokens(input_ids)
        return h * torch.tensor(self.spec.embedding_scale, dtype=torch.float32).to(h.dtype)

    def projections(self) -> Iterator[Projection]:
        for module in self.modules():
            yield from (part for part in vars(module).values() if isinstance(part, Projection))

    def set_weights(self, prepare: bool = True, **modes: str | bool) -> None:
        """What passes read, by setting (each a :class:`Projection` attribute, its modes a tuple of
        model/projection.py): ``decode_weights`` (:data:`DECODE_WEIGHTS`), what decode steps read:
        exact blocks where a matrix has them ("auto"), the loaded weights ("same"), or a dtype copy
        (lossy unless the dtype holds every weight); ``decode_activations``
        (:data:`DECODE_ACTIVATIONS`), what decode passes multiply GGUF blocks with: float32 inputs
        (exact) or inputs quantized to 8 bits per 32 (lossy, faster); ``prefill_weights``
        (:data:`PREFILL_WEIGHTS`), what passes of more than ``DECODE_ROWS`` rows read: the loaded
        weights or a dtype copy; ``row_invariant`` (a bool: :meth:`set_deterministic`).
        ``prepare=False``: make the copies later (a rank packs only its shard, in shard_model)."""
        for phase, mode in modes.items():  # (validated by load_model)
            for projection in self.projections():
                setattr(projection, phase, mode)
        if prepare:
            self.prepare_projections()

    def set_deterministic(self, on: bool = True) -> None:
        """Deterministic inference: every pass computes a token's row on one path whatever its row
        count -- the decode weights (blocks, or dense GEMMs padded to 16 rows) and row-wise
        attention (``PagedBackend(rowwise=True)``, chosen by whoever builds the runner)."""
        self.deterministic = on
        self.set_weights(row_invariant=on)

    def weight_bytes(self) -> int:
        """Resident bytes of the weights: the parameters (each storage once) and every decode
        or prefill copy beside them (DESIGN invariant 6: they count against the memory budget)."""
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in self.parameters()}
        return sum(storages.values()) + sum(projection.copies_nbytes() for projection in self.projections())

    def decode_formats(self) -> dict[str, int]:
        """How many projections decode steps run in each format ("q4_1": 120, "q8_0": 1...)."""
        return dict(Counter(projection.decode_format for projection in self.projections()))

    def prepare_projections(self) -> None:
        """Fuse the projections (and make decode copies) now, not at the first forward: loaders
        and :func:`~hicache.model.parallel.shard_model` call it before the KV pool is sized."""
        for projection in self.projections():
            projection.prepare()

    def forward(self, batch: ForwardBatch, kv: KVView, hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits on the last stage; elsewhere the hidden states ``[T, hidden]`` for the next
        stage. ``hidden``: the previous stage's output (not on the first stage)."""
        h = self.embed(batch.input_ids) if self.first_stage else hidden
        cos, sin = self.rope(batch.positions, h.dtype)
        local = self.local_rope(batch.positions, h.dtype) if self.local_rope is not None else None
        stacked = None if self.decode_stack is None else self.decode_stack.forward(h, cos, sin, batch, kv, local)
        if stacked is not None:
            h = stacked
        else:
            for layer in self.model.layers:
                h = layer(h, *(local if layer.local_rope else (cos, sin)), batch, kv)
        if not self.last_stage:
            return h
        # Only the requested rows go through the final norm and the (vocab-wide) head.
        h = self.model.norm(batch.attn.final_rows(h))
        logits = self.head(h, batch.generated).float()
        return logits if self.spec.logits_scale == 1 else logits / self.spec.logits_scale  # (Granite divides)
