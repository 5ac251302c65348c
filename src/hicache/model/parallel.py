"""Cutting a loaded model into one rank's part: a pipeline stage's layers, a tensor-parallel
slice of its heads and MLP.

Tensor parallelism (Megatron style): q/k/v and gate/up are split by output rows (heads,
intermediate units), o_proj and down_proj by input columns, and each rank's partial output of
those two is summed over the TP group (``tp_reduce``). Embedding, norms and the LM head stay
whole on every rank that needs them. Splits need not be even: query heads go out as evenly as
possible, and each rank holds (replicates) every KV head one of its query heads reads -- so
TP may exceed the KV head count, and SmolLM2 (9 heads, 3 KV heads) runs at TP2 as well as TP3.

Recurrent layers split the same way, by the units their state is made of, so each rank's state
pool holds its shard of every state tensor (:meth:`ModelShard.state_shapes`): LFM2's short
convolution by channels (the B, C and x rows of ``in_proj``, the conv's rows, ``out_proj``'s input
columns); a gated DeltaNet by key heads, each with the value heads that read it (value head ``h``
reads key head ``h // (Hv / Hk)``): their q, k and v rows of ``in_proj_qkv`` and of the conv, their
``z``, ``b``, ``a`` rows, ``A_log`` and ``dt_bias`` entries and ``out_proj`` columns (the gated norm
is over one value head's dims: whole); Mamba2 by heads (an equal share each): their z, x and dt
rows of ``in_proj``, x's conv channels, ``A_log`` / ``D`` / ``dt_bias`` entries, ``out_proj``
columns, with the B and C groups those heads read (rows of ``in_proj`` and of the conv): whole groups
where the groups divide by TP, else (TP a multiple of the groups: Granite 4.0-H's one group) the one
group a rank's heads read, replicated on the ranks that share it -- whose gated norm, over a group's
``d_inner / groups`` channels, then sums its squares over the TP group
(:class:`~hicache.model.recurrent.GroupGatedRMSNorm`). The mixers' outputs are summed over the TP
group, as o_proj's are. Key heads split unevenly where they do not divide (3 over TP2: 2 + 1); TP
beyond the key heads, and Mamba2 heads or groups that do not split so, are refused.

Pipeline parallelism: stage ``p`` keeps layers ``stage_layers(...)``; the first stage embeds,
the last one applies the final norm and the head; the others pass hidden states along.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from hicache.config import ConfigError
from hicache.model.llama import LlamaForCausalLM
from hicache.model.spec import LayerKind, ModelSpec


@dataclass(frozen=True)
class ModelShard:
    """Which part of the model one rank holds. Head and layer indices are global."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    layers: range  # this stage's layers
    q_heads: range  # this rank's query heads
    kv_heads: range  # the KV heads its query heads read (its KV pool holds exactly these)
    conv_channels: range = range(0)  # LFM2's short convolutions: this rank's channels (range(0): none)
    gdn_key_heads: range = range(0)  # gated DeltaNet: this rank's key heads (range(0): none)
    gdn_value_heads: range = range(0)  # and the value heads that read them
    mamba_heads: range = range(0)  # Mamba2: this rank's heads (range(0): none)
    mamba_groups: range = range(0)  # and the B / C groups they read

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def describe(self) -> str:
        """Names the slice for storage keys and logs, e.g. ``layers0-14,kvh0-1``; a model with
        recurrent layers adds its state's slice (``,ch0-31``; ``,gdnk0-0``; ``,mh0-1``), so two ranks that
        hold the same KV heads but other state channels never share a ``-state`` object."""
        out = f"layers{self.layers.start}-{self.layers.stop - 1},kvh{self.kv_heads.start}-{self.kv_heads.stop - 1}"
        for name, part in (("ch", self.conv_channels), ("gdnk", self.gdn_key_heads), ("mh", self.mamba_heads)):
            out += f",{name}{part.start}-{part.stop - 1}" if part else ""
        return out

    def state_shapes(self, spec: ModelSpec, layer: int) -> tuple[tuple[int, ...], ...]:
        """:meth:`ModelSpec.state_shapes` of recurrent layer ``layer`` as this rank holds it: its
        channels of the conv state (LFM2), its key and value heads' (gated DeltaNet: q, k, v channels
        of the conv; the recurrent matrix of its value heads), its heads' and groups' (Mamba2: x, B, C
        channels of the conv; the SSM state of its heads)."""
        whole = spec.state_shapes(layer)
        if spec.layer_kinds[layer] == LayerKind.CONV:
            return ((len(self.conv_channels), whole[0][1]),)
        if spec.layer_kinds[layer] == LayerKind.MAMBA2:
            heads, groups = len(self.mamba_heads), len(self.mamba_groups)
            conv = heads * spec.mamba_head_dim + 2 * groups * spec.mamba_state
            return ((conv, whole[0][1]), (heads, *whole[1][1:]))
        keys, values = len(self.gdn_key_heads), len(self.gdn_value_heads)
        conv = 2 * keys * spec.gdn_key_dim + values * spec.gdn_value_dim
        return ((conv, whole[0][1]), (values, *whole[1][1:]))

    def state_units(self, spec: ModelSpec, layer: int) -> range:
        """The units of :func:`state_axis` this rank holds of recurrent layer ``layer``."""
        kind = spec.layer_kinds[layer]
        return self.conv_channels if kind == LayerKind.CONV else self.gdn_key_heads if kind == LayerKind.GDN \
            else range(1)


def state_axis(spec: ModelSpec, layer: int) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """How TP cuts recurrent layer ``layer``'s state tensors along their first axis: ``(units, blocks)``.
    A rank holds a contiguous range of the ``units`` (LFM2: channels; gated DeltaNet: key heads, each with
    the value heads that read it; Mamba2: one, not split); ``blocks[t]``: state tensor ``t``'s first axis as
    blocks of rows per unit, in order -- a holder of ``n`` units keeps each block's ``rows * n`` rows of its
    units, block after block (a gated DeltaNet's conv: its q, then k, then v channels)."""
    kind = spec.layer_kinds[layer]
    if kind == LayerKind.CONV:
        return spec.hidden_size, ((1,),)
    if kind == LayerKind.GDN:
        ratio = spec.gdn_value_heads // spec.gdn_key_heads
        return spec.gdn_key_heads, ((spec.gdn_key_dim, spec.gdn_key_dim, ratio * spec.gdn_value_dim), (ratio,))
    return 1, ((spec.mamba_conv_dim,), (spec.mamba_heads,))


def check_parallel(spec: ModelSpec, tp_size: int, pp_size: int) -> None:
    """Raise :class:`ConfigError` (one sentence) when the model cannot be split this way (the sizes are
    at least 1: the config checks)."""
    if tp_size > spec.num_heads:
        raise ConfigError(f"--tp-size {tp_size} exceeds the model's {spec.num_heads} attention heads.")
    if pp_size > spec.num_layers:
        raise ConfigError(f"--pp-size {pp_size} exceeds the model's {spec.num_layers} layers.")
    if LayerKind.GDN in spec.layer_kinds and tp_size > spec.gdn_key_heads:
        raise ConfigError(f"--tp-size {tp_size} exceeds the model's {spec.gdn_key_heads} gated DeltaNet key heads "
                          "(each rank holds whole key heads with the value heads that read them).")
    heads, groups = spec.mamba_heads, spec.mamba_groups
    if LayerKind.MAMBA2 in spec.layer_kinds and (heads % tp_size or groups % tp_size and tp_size % groups):
        raise ConfigError(f"--tp-size {tp_size} does not split the model's {heads} Mamba2 heads in {groups} groups "
                          "(each rank holds an equal share of the heads, and the groups must divide by --tp-size or "
                          "it by them).")


def split(n: int, parts: int, index: int) -> range:
    """Part ``index`` of ``range(n)`` cut into ``parts`` contiguous pieces; the first
    ``n % parts`` pieces are one longer."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> range:
    return split(num_layers, pp_size, pp_rank)


def model_shard(spec: ModelSpec, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int) -> ModelShard:
    """Query heads are split as evenly as possible (9 heads over TP2: 5 + 4); a rank holds the
    KV heads its query heads read, so a KV head whose group straddles two ranks is held by
    both (SmolLM2 at TP2: KV head 1 on both ranks)."""
    check_parallel(spec, tp_size, pp_size)
    q_heads = split(spec.num_heads, tp_size, tp_rank)
    group = spec.num_heads // spec.num_kv_heads
    kv_heads = range(q_heads.start // group, (q_heads.stop - 1) // group + 1)
    kinds = set(spec.layer_kinds)
    channels = split(spec.hidden_size, tp_size, tp_rank) if LayerKind.CONV in kinds else range(0)
    keys = split(spec.gdn_key_heads, tp_size, tp_rank) if LayerKind.GDN in kinds else range(0)
    ratio = spec.gdn_value_heads // spec.gdn_key_heads if keys else 0
    mamba = split(spec.mamba_heads, tp_size, tp_rank) if LayerKind.MAMBA2 in kinds else range(0)
    per_group = spec.mamba_heads // spec.mamba_groups if mamba else 1  # head h reads group h // per_group
    groups = range(mamba.start // per_group, (mamba.stop - 1) // per_group + 1) if mamba else range(0)
    return ModelShard(tp_rank, tp_size, pp_rank, pp_size, stage_layers(spec.num_layers, pp_rank, pp_size),
                      q_heads, kv_heads, channels, keys, range(keys.start * ratio, keys.stop * ratio), mamba, groups)


def _keep(linear: nn.Linear, rows: slice | torch.Tensor = slice(None), cols: Optional[slice] = None) -> None:
    """Keep rows ``rows`` (a slice or an index tensor) of ``linear`` (its bias's too), or its columns
    ``cols`` (its bias whole)."""
    linear.weight = nn.Parameter(linear.weight[rows if cols is None else (rows, cols)].clone(), requires_grad=False)
    if linear.bias is not None and cols is None:
        linear.bias = nn.Parameter(linear.bias[rows].clone(), requires_grad=False)


def _keep_mla_heads(attn: nn.Module, spec: ModelSpec, heads: range) -> None:
    """MLA: this rank's query heads of q, kv_b (each head's k_nope and value rows) and o_proj;
    the latent projections (kv_a, q_a) stay whole: every rank computes the same latent."""
    qk, kv = spec.qk_nope_head_dim + spec.qk_rope_head_dim, spec.qk_nope_head_dim + spec.v_head_dim
    _keep(attn.q_b_proj if attn.q_lora else attn.q_proj, slice(heads.start * qk, heads.stop * qk))
    _keep(attn.kv_b_proj, slice(heads.start * kv, heads.stop * kv))
    _keep(attn.o_proj, cols=slice(heads.start * spec.v_head_dim, heads.stop * spec.v_head_dim))
    attn.num_heads = len(heads)


def _rows(*parts: range) -> torch.Tensor:
    """The row indices of ``parts``, one after the other (a fused projection's pieces of one rank)."""
    return torch.cat([torch.arange(part.start, part.stop) for part in parts])


def _keep_short_conv(conv: nn.Module, spec: ModelSpec, shard: ModelShard) -> None:
    """LFM2: this rank's channels of B, C and x (``in_proj``'s three row blocks), of the conv taps,
    and ``out_proj``'s input columns; ``out_proj``'s bias is added once over the group's sum (rank 0's)."""
    ch, hidden = shard.conv_channels, spec.hidden_size
    _keep(conv.in_proj, _rows(*(range(part * hidden + ch.start, part * hidden + ch.stop) for part in range(3))))
    conv.conv.weight = nn.Parameter(conv.conv.weight[ch.start:ch.stop].clone(), requires_grad=False)
    if conv.conv.bias is not None:
        conv.conv.bias = nn.Parameter(conv.conv.bias[ch.start:ch.stop].clone(), requires_grad=False)
    _keep(conv.out_proj, cols=slice(ch.start, ch.stop))
    if conv.out_proj.bias is not None and shard.tp_rank:
        conv.out_proj.bias = nn.Parameter(torch.zeros_like(conv.out_proj.bias), requires_grad=False)


def _keep_gated_deltanet(gdn: nn.Module, spec: ModelSpec, shard: ModelShard) -> None:
    """Gated DeltaNet: this rank's key heads and the value heads that read them -- their q, k and v
    channels (rows of ``in_proj_qkv`` and of the conv alike), z/b/a rows, ``A_log`` and ``dt_bias``
    entries, ``out_proj`` columns. The gated norm (one value head's dims) stays whole."""
    kh, vh, dk, dv = shard.gdn_key_heads, shard.gdn_value_heads, spec.gdn_key_dim, spec.gdn_value_dim
    keys = spec.gdn_key_heads * dk
    qkv = _rows(range(kh.start * dk, kh.stop * dk), range(keys + kh.start * dk, keys + kh.stop * dk),
                range(2 * keys + vh.start * dv, 2 * keys + vh.stop * dv))
    _keep(gdn.in_proj_qkv, qkv)
    gdn.conv1d.weight = nn.Parameter(gdn.conv1d.weight[qkv].clone(), requires_grad=False)
    _keep(gdn.in_proj_z, slice(vh.start * dv, vh.stop * dv))
    for linear in (gdn.in_proj_b, gdn.in_proj_a):
        _keep(linear, slice(vh.start, vh.stop))
    for name in ("A_log", "dt_bias"):
        setattr(gdn, name, nn.Parameter(getattr(gdn, name)[vh.start:vh.stop].clone(), requires_grad=False))
    _keep(gdn.out_proj, cols=slice(vh.start * dv, vh.stop * dv))
    gdn.key_heads, gdn.value_heads = len(kh), len(vh)
    gdn.widths = (2 * len(kh) * dk + len(vh) * dv, len(vh) * dv, len(vh), len(vh))


def _keep_mamba2(mixer: nn.Module, spec: ModelSpec, shard: ModelShard,
                 tp_reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
    """Mamba2: this rank's heads -- their z, x and dt rows of ``in_proj``, x's conv channels, ``A_log``
    / ``D`` / ``dt_bias`` entries and ``out_proj`` columns -- and the groups they read (B and C rows of
    ``in_proj`` and of the conv); ``out_proj``'s bias added once (rank 0's). Where a group spans ranks,
    the gated norm sums its squares over the TP group with ``tp_reduce``."""
    hs, gs, p, n = shard.mamba_heads, shard.mamba_groups, spec.mamba_head_dim, spec.mamba_state
    inner, groups = spec.mamba_heads * p, spec.mamba_groups * n
    # in_proj's rows: z (inner), the conv's channels x|B|C (inner + 2 G N), dt (one a head)
    x, b, c = (range(hs.start * p, hs.stop * p), range(inner + gs.start * n, inner + gs.stop * n),
               range(inner + groups + gs.start * n, inner + groups + gs.stop * n))  # of the conv's channels
    conv, z = _rows(x, b, c), x  # (z's rows are x's channels: both come first, inner wide)
    dt = range(inner + spec.mamba_conv_dim + hs.start, inner + spec.mamba_conv_dim + hs.stop)
    _keep(mixer.in_proj, torch.cat([_rows(z), inner + conv, _rows(dt)]))
    mixer.conv1d.weight = nn.Parameter(mixer.conv1d.weight[conv].clone(), requires_grad=False)
    if mixer.conv1d.bias is not None:
        mixer.conv1d.bias = nn.Parameter(mixer.conv1d.bias[conv].clone(), requires_grad=False)
    for name in ("A_log", "D", "dt_bias"):
        setattr(mixer, name, nn.Parameter(getattr(mixer, name)[hs.start:hs.stop].clone(), requires_grad=False))
    mixer.norm.weight = nn.Parameter(mixer.norm.weight[x.start:x.stop].clone(), requires_grad=False)
    _keep(mixer.out_proj, cols=slice(x.start, x.stop))
    if mixer.out_proj.bias is not None and shard.tp_rank:
        mixer.out_proj.bias = nn.Parameter(torch.zeros_like(mixer.out_proj.bias), requires_grad=False)
    mixer.heads, mixer.groups = len(hs), len(gs)
    mixer.widths = (len(x), len(conv), len(hs))
    spans = spec.mamba_groups < shard.tp_size  # (else each rank holds whole groups: its norm is its own)
    mixer.norm.shard(len(gs), gs.start if spans else None, spec.mamba_groups, tp_reduce if spans else None)


def _keep_attention(attn: nn.Module, spec: ModelSpec, shard: ModelShard) -> None:
    """This rank's query heads of q_proj (a gated head's query and gate rows together) and o_proj,
    and the KV heads they read of k_proj and v_proj."""
    if spec.is_mla:
        _keep_mla_heads(attn, spec, shard.q_heads)
        return
    d, rows = spec.head_dim, (2 if attn.gated else 1) * spec.head_dim  # a gated head: [q_h | gate_h]
    kv = slice(shard.kv_heads.start * d, shard.kv_heads.stop * d)
    _keep(attn.q_proj, slice(shard.q_heads.start * rows, shard.q_heads.stop * rows))
    _keep(attn.k_proj, kv)
    _keep(attn.v_proj, kv)
    _keep(attn.o_proj, cols=slice(shard.q_heads.start * d, shard.q_heads.stop * d))
    # Which local KV head each local query head reads. SDPA's GQA mode assumes equal
    # contiguous groups; an uneven split needs the explicit map.
    group = spec.num_heads // spec.num_kv_heads
    kv_of_q = [h // group - shard.kv_heads.start for h in shard.q_heads]
    nq, nkv = len(shard.q_heads), len(shard.kv_heads)
    even = nq % nkv == 0 and kv_of_q == [j // (nq // nkv) for j in range(nq)]
    attn.num_heads, attn.num_kv_heads = nq, nkv
    attn.kv_map = None if even else torch.tensor(kv_of_q, dtype=torch.long, device=attn.o_proj.weight.device)


def _keep_layer(layer: nn.Module, spec: ModelSpec, shard: ModelShard,
                tp_reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
    """A layer's TP slice: its mixer's (attention, short conv, gated DeltaNet or Mamba2) and its MLP's units."""
    if not layer.recurrent:
        _keep_attention(layer.self_attn, spec, shard)
    elif "conv" in layer._modules:
        _keep_short_conv(layer.conv, spec, shard)
    elif "mamba" in layer._modules:
        _keep_mamba2(layer.mamba, spec, shard, tp_reduce)
    else:
        _keep_gated_deltanet(layer.linear_attn, spec, shard)
    units = split(spec.intermediate_size, shard.tp_size, shard.tp_rank)
    mlp = slice(units.start, units.stop)
    _keep(layer.mlp.gate_proj, mlp)
    _keep(layer.mlp.up_proj, mlp)
    _keep(layer.mlp.down_proj, cols=mlp)


def shard_model(model: LlamaForCausalLM, shard: ModelShard, tp_reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
    """Cut ``model`` (loaded whole) down to ``shard`` in place. ``tp_reduce`` sums a tensor over
    the TP group (None when ``tp_size == 1``). The stage's attention layers read this rank's KV
    buffers in order (the i-th of them buffer ``i``), its recurrent layers its state buffers."""
    layers = [model.model.layers[i] for i in shard.layers]
    for local, layer in enumerate(layer for layer in layers if layer.recurrent):
        layer.state_mixer.state_index = local
    for local, layer in enumerate(layer for layer in layers if not layer.recurrent):
        layer.self_attn.layer = local
    for layer in layers:
        if shard.tp_size > 1:
            _keep_layer(layer, model.spec, shard, tp_reduce)
        mixer = layer.state_mixer if layer.recurrent else layer.self_attn
        mixer.tp_reduce = layer.mlp.tp_reduce = tp_reduce
    model.model.layers = nn.ModuleList(layers)
    model.first_stage, model.last_stage = shard.first_stage, shard.last_stage
    if not shard.last_stage:  # the head's part (the LM head or the tied embedding) is freed with it
        model.model.norm = model.lm_head = model.head = None
    if not (shard.first_stage or (shard.last_stage and model.lm_head is None)):  # no stage of its needs the embedding
        model.model.embed_tokens = None
    model.prepare_projections()  # the sliced parts, fused before this rank sizes its KV pool
