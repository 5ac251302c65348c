"""Cutting a loaded model into one rank's part: a pipeline stage's layers, a tensor-parallel
slice of its heads and MLP.

Tensor parallelism (Megatron style): q/k/v and gate/up are split by output rows (heads,
intermediate units), o_proj and down_proj by input columns, and each rank's partial output of
those two is summed over the TP group (``tp_reduce``). Embedding, norms and the LM head stay
whole on every rank that needs them. Splits need not be even: query heads go out as evenly as
possible, and each rank holds (replicates) every KV head one of its query heads reads -- so
TP may exceed the KV head count, and SmolLM2 (9 heads, 3 KV heads) runs at TP2 as well as TP3.

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
from hicache.model.spec import ModelSpec


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

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def describe(self) -> str:
        """Names the slice for storage keys and logs, e.g. ``layers0-14,kvh0-1``."""
        return (f"layers{self.layers.start}-{self.layers.stop - 1},"
                f"kvh{self.kv_heads.start}-{self.kv_heads.stop - 1}")


def check_parallel(spec: ModelSpec, tp_size: int, pp_size: int) -> None:
    """Raise :class:`ConfigError` (one sentence) when the model cannot be split this way (the sizes are
    at least 1: the config checks)."""
    if tp_size > spec.num_heads:
        raise ConfigError(f"--tp-size {tp_size} exceeds the model's {spec.num_heads} attention heads.")
    if pp_size > spec.num_layers:
        raise ConfigError(f"--pp-size {pp_size} exceeds the model's {spec.num_layers} layers.")
    if tp_size > 1 and spec.recurrent_layers:
        raise ConfigError(f"--tp-size {tp_size} is not supported for models with recurrent layers (LFM2's short "
                          "convolutions, gated DeltaNet, Mamba2) yet; use --tp-size 1.")


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
    return ModelShard(tp_rank, tp_size, pp_rank, pp_size, stage_layers(spec.num_layers, pp_rank, pp_size),
                      q_heads, kv_heads)


def _keep(linear: nn.Linear, rows: slice = slice(None), cols: Optional[slice] = None) -> None:
    """Keep rows ``rows`` of ``linear`` (its bias's too), or its columns ``cols`` (its bias whole)."""
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


def shard_model(model: LlamaForCausalLM, shard: ModelShard, tp_reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
    """Cut ``model`` (loaded whole) down to ``shard`` in place. ``tp_reduce`` sums a tensor over
    the TP group (None when ``tp_size == 1``). The stage's attention layers read this rank's KV
    buffers in order (the i-th of them buffer ``i``), its recurrent layers its state buffers."""
    spec = model.spec
    d = spec.head_dim
    q = slice(shard.q_heads.start * d, shard.q_heads.stop * d)
    kv = slice(shard.kv_heads.start * d, shard.kv_heads.stop * d)
    units = split(spec.intermediate_size, shard.tp_size, shard.tp_rank)
    mlp = slice(units.start, units.stop)
    # Which local KV head each local query head reads. SDPA's GQA mode assumes equal
    # contiguous groups; an uneven split needs the explicit map.
    group = spec.num_heads // spec.num_kv_heads
    kv_of_q = [h // group - shard.kv_heads.start for h in shard.q_heads]
    nq, nkv = len(shard.q_heads), len(shard.kv_heads)
    even = nq % nkv == 0 and kv_of_q == [j // (nq // nkv) for j in range(nq)]
    kv_map = None if even else torch.tensor(kv_of_q, dtype=torch.long, device=model.device)
    layers = [model.model.layers[i] for i in shard.layers]
    recurrent = [layer for layer in layers if layer.recurrent]
    for local, layer in enumerate(recurrent):
        layer.state_mixer.state_index = local
        layer.state_mixer.tp_reduce = layer.mlp.tp_reduce = tp_reduce  # (TP 1 only: check_parallel)
    for local, layer in enumerate(layer for layer in layers if not layer.recurrent):
        attn = layer.self_attn
        attn.layer = local
        if shard.tp_size > 1 and spec.is_mla:
            _keep_mla_heads(attn, spec, shard.q_heads)
        elif shard.tp_size > 1:
            for linear, rows in ((attn.q_proj, q), (attn.k_proj, kv), (attn.v_proj, kv)):
                _keep(linear, rows)
            _keep(attn.o_proj, cols=q)
            attn.num_heads, attn.num_kv_heads, attn.kv_map = nq, nkv, kv_map
        if shard.tp_size > 1:
            _keep(layer.mlp.gate_proj, mlp)
            _keep(layer.mlp.up_proj, mlp)
            _keep(layer.mlp.down_proj, cols=mlp)
        attn.tp_reduce = layer.mlp.tp_reduce = tp_reduce
    model.model.layers = nn.ModuleList(layers)
    model.first_stage, model.last_stage = shard.first_stage, shard.last_stage
    if not shard.last_stage:  # the head's part (the LM head or the tied embedding) is freed with it
        model.model.norm = model.lm_head = model.head = None
    if not (shard.first_stage or (shard.last_stage and model.lm_head is None)):  # no stage of its needs the embedding
        model.model.embed_tokens = None
    model.prepare_projections()  # the sliced parts, fused before this rank sizes its KV pool
