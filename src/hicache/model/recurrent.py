"""Recurrent mixers: layers that keep a fixed-size state per sequence instead of KV (LFM2's short
convolution, Qwen3.5's gated DeltaNet, Granite 4.0-H's Mamba2).

``ShortConv`` is LFM2's: ``in_proj`` (hidden -> 3 hidden: B, C, x, in that order), a depthwise
causal convolution of ``conv_kernel`` taps over ``B * x``, ``y = C * conv``, ``out_proj``.
Parameter names are transformers' (``conv.in_proj``, ``conv.conv.weight`` ``[hidden, 1, K]``,
``conv.out_proj``). The state of a sequence is the last ``K - 1`` conv inputs, ``[hidden, K-1]``
per state slot (channels first, as transformers keeps it), in ``kv.state_buffers[state_index][0]``.

Each pass reads every sequence's state from its ``batch.state.source`` slot before it writes any
``running`` slot, and computes every token with the taps of model/scan.py: a prompt in one pass,
in chunks, or token by token gives the same state bits. A pass of one new token per sequence (a
decode step) is one batched step; a prompt pass one span per sequence (never a loop over tokens); a
pass of several generated tokens a sequence (a speculative verify pass) the decode step token by token
(model/token_steps.py), which also writes each sequence's state after each of its rows but the last to
the slots ``batch.state.rows`` names (the engine keeps the accepted row's).

``GatedDeltaNet`` is Qwen3.5's "linear_attention" layer, under transformers' names
(``linear_attn.in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``, ``conv1d.weight``
``[conv_dim, 1, K]`` without bias, ``dt_bias``, ``A_log``, ``norm`` (a gated RMSNorm over each value
head), ``out_proj``): q|k|v (the conv's channels in that order) through the causal conv and SiLU;
q and k L2-normalised, q scaled by ``dk ** -0.5``; ``g = -exp(A_log) * softplus(a + dt_bias)``,
``beta = sigmoid(b)``; the gated delta rule (model/scan.py, float32 whatever the model's dtype); the
output normalised per value head, times ``silu(z)``; ``out_proj``. Its state: the conv's last
``K - 1`` inputs ``[conv_dim, K-1]`` (``state_buffers[i][0]``) and the recurrent matrix
``[Hv, dk, dv]`` float32 (``state_buffers[i][1]``). A prompt pass scans each sequence on the
absolute chunk grid (``ScanSpan(start=<its first new position>, chunk=SCAN_CHUNK)``); a pass of
generated tokens is :func:`~hicache.model.scan.delta_rule_step` (batched; token by token in a verify pass).

``Mamba2Mixer`` is Granite 4.0-H's "mamba" layer, under transformers' names (``mamba.in_proj``,
``conv1d.weight`` ``[conv_dim, 1, K]`` and its bias, ``dt_bias``, ``A_log``, ``D``, ``norm``,
``out_proj``): ``in_proj`` emits the gate z (d_inner), x|B|C (the conv's channels in that order:
d_inner, then groups x N twice) and dt (one per head); x|B|C through the causal conv and SiLU;
``dt = clamp(softplus(dt + dt_bias), dt_min, dt_max)``, ``A = -exp(A_log)``; the SSD recurrence
with the D skip (model/scan.py, float32); :class:`GroupGatedRMSNorm` of ``y * silu(z)``;
``out_proj``. Its state: the conv's last ``K - 1`` inputs ``[conv_dim, K-1]`` and the SSM state
``[H, P, N]`` float32 (transformers' ``ssm_states`` layout), prompt passes scanned per sequence on
the absolute chunk grid, a pass of generated tokens :func:`~hicache.model.scan.ssd_step` as the gated DeltaNet's.
The clamp applies to both (transformers' token step skips it: the same while ``time_step_limit`` is
Granite's ``(0, inf)``), so a token's arithmetic does not depend on the path that computes it.

Under TP (model/parallel.py) a mixer holds this rank's channels (ShortConv), key heads with their
value heads (GatedDeltaNet) or heads with the groups they read (Mamba2), its state buffers the
matching shard, and ``tp_reduce`` sums its output.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from hicache.model.batch import ForwardBatch, KVView, StateSlots
from hicache.model.projection import Projection
from hicache.model.scan import (ScanSpan, causal_conv, conv_step, delta_rule_qk, delta_rule_scan, delta_rule_step,
                                row_sigmoid, row_softplus, ssd_scan, ssd_step)
from hicache.model.spec import SCAN_CHUNK, ModelSpec
from hicache.model.token_steps import step_tokens


def sequence_spans(batch: ForwardBatch, chunk: int = 1) -> list[ScanSpan]:
    """Each sequence's scan span in a pass: its first new token's absolute position, the scan chunk,
    and the positions of its emits (``batch.state.emits``)."""
    slots, spans, row = batch.state, [], 0
    for n, emits in zip(slots.lengths, slots.emits):
        spans.append(ScanSpan(int(batch.positions[row]) if n else 0, chunk, tuple(p for p, _ in emits)))
        row += n
    return spans


def sequence_starts(batch: ForwardBatch) -> list[int]:
    """Each sequence's first new position in a pass (0 for a sequence without new tokens)."""
    return [span.start for span in sequence_spans(batch)]


def write_emitted(slots: StateSlots, emitted: list[list], buffers: tuple[torch.Tensor, ...]) -> None:
    """Write each sequence's emitted states (``emitted[b][i]``: a tensor per buffer of the layer) to the
    slots its emits name."""
    for emits, states in zip(slots.emits, emitted):
        for (_, slot), state in zip(emits, states):
            for buffer, part in zip(buffers, state):
                buffer[slot] = part.to(buffer.dtype)


def _state_slots(batch: ForwardBatch) -> StateSlots:
    """The pass's state slots; every mixer's pass needs them (a batch built without ``state_slots`` is a bug)."""
    if batch.state is None:
        raise ValueError("a pass of a model with recurrent layers needs batch.state (its sequences' state slots)")
    return batch.state


class ConvTaps(nn.Module):
    """The depthwise convolution's parameters as transformers stores them (``nn.Conv1d`` with
    ``groups = channels``): ``weight`` ``[channels, 1, K]``, ``bias`` ``[channels]`` or None."""

    def __init__(self, channels: int, taps: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, taps))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None


class ShortConv(nn.Module):
    """LFM2's short-convolution mixer of layer ``layer`` (see the module docstring)."""

    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.state_index = spec.recurrent_layers.index(layer)  # its state buffers in the KV view
        self.taps = spec.conv_kernel
        hidden = spec.hidden_size
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=spec.conv_bias)
        self.conv = ConvTaps(hidden, spec.conv_kernel, spec.conv_bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=spec.conv_bias)
        self.inp, self.out = Projection(self.in_proj), Projection(self.out_proj)
        self.tp_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # sum over TP ranks (model/parallel.py)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: KVView) -> torch.Tensor:
        """``x``: ``[T, hidden]`` (the batch's sequences one after the other); returns ``[T, hidden]``
        and leaves each sequence's state after its tokens in its running slot."""
        slots = _state_slots(batch)
        b, c, u = self.inp.whole(x, batch.generated).chunk(3, dim=-1)
        bx = b * u
        buffer = kv.state_buffers[self.state_index][0]  # [slots, hidden, K-1]
        states = buffer.index_select(0, slots.source)  # [B, hidden, K-1]: all read before any write
        weight, bias = self.conv.weight[:, 0, :], self.conv.bias
        if max(slots.lengths) == 1 and not any(slots.emits):  # one token a sequence (decode): one batched step
            conv, after = conv_step(bx, weight, bias, states)
        elif batch.generated:  # a verify pass: the decode step token by token, each row's state kept
            conv, (after,) = step_tokens(partial(self._step, weight, bias), (bx,), (states,), slots, (buffer,),
                                         sequence_starts(batch))
        else:
            spans = [causal_conv(rows, weight, bias, state, span) for state, rows, span in
                     zip(states, bx.split(slots.lengths), sequence_spans(batch))]
            conv, after = torch.cat([s.out for s in spans]), torch.stack([s.state for s in spans])
            write_emitted(slots, [[(state,) for state in s.emitted] for s in spans], (buffer,))
        buffer.index_copy_(0, slots.running, after.to(buffer.dtype))
        out = self.out(c * conv, batch.generated)
        return out if self.tp_reduce is None else self.tp_reduce(out)

    @staticmethod
    def _step(weight: torch.Tensor, bias: Optional[torch.Tensor], bx: torch.Tensor,
              state: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor]]:
        """One token of each sequence (model/token_steps.py's step): the conv's output and state."""
        conv, after = conv_step(bx, weight, bias, state)
        return conv, (after,)


class GatedRMSNorm(nn.Module):
    """``weight * (x / rms(x)) * silu(gate)`` over the last axis; the statistics and the gate in
    float32, the normalised ``x`` rounded to its dtype before the weight (as transformers'
    ``Qwen3_5RMSNormGated``). Its weight is stored as is (no zero-centred ``1 + w``)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's gated DeltaNet mixer of layer ``layer`` (see the module docstring)."""

    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.state_index = spec.recurrent_layers.index(layer)
        self.key_heads, self.value_heads = spec.gdn_key_heads, spec.gdn_value_heads
        self.key_dim, self.value_dim = spec.gdn_key_dim, spec.gdn_value_dim
        keys, values, hidden = self.key_heads * self.key_dim, self.value_heads * self.value_dim, spec.hidden_size
        self.widths = (2 * keys + values, values, self.value_heads, self.value_heads)  # qkv, z, b, a
        self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a = (
            nn.Linear(hidden, width, bias=False) for width in self.widths)
        self.conv1d = ConvTaps(self.widths[0], spec.conv_kernel, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.value_heads))
        self.A_log = nn.Parameter(torch.empty(self.value_heads))
        self.norm = GatedRMSNorm(self.value_dim, spec.rms_norm_eps)
        self.out_proj = nn.Linear(values, hidden, bias=False)
        self.inp = Projection(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        self.out = Projection(self.out_proj)
        self.tp_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # sum over TP ranks (model/parallel.py)

    def _qkv(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output ``[T, conv_dim]`` as SiLU'd heads: q, k ``[T, Hk, dk]`` (normalised, q
        scaled; float32) and v ``[T, Hv, dv]``."""
        keys = self.key_heads * self.key_dim
        q, k, v = F.silu(conv).split([keys, keys, self.value_heads * self.value_dim], -1)
        q, k = delta_rule_qk(q.unflatten(-1, (self.key_heads, self.key_dim)),
                             k.unflatten(-1, (self.key_heads, self.key_dim)))
        return q, k, v.unflatten(-1, (self.value_heads, self.value_dim))

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: KVView) -> torch.Tensor:
        """``x``: ``[T, hidden]`` (the batch's sequences one after the other); returns ``[T, hidden]``
        and leaves each sequence's conv and recurrent states after its tokens in its running slot."""
        slots = _state_slots(batch)
        mixed, z, b, a = self.inp.whole(x, batch.generated).split(self.widths, dim=-1)
        beta = row_sigmoid(b)
        g = -self.A_log.float().exp() * row_softplus(a.float() + self.dt_bias.float())  # [T, Hv] log decay, float32
        conv_buffer, rec_buffer = kv.state_buffers[self.state_index]
        conv_states = conv_buffer.index_select(0, slots.source)  # all read before any write
        rec_states = rec_buffer.index_select(0, slots.source).float()
        if batch.generated:  # decode steps, token by token over a verify pass's rows
            out, (conv_after, rec_after) = step_tokens(self._step, (mixed, g, beta), (conv_states, rec_states), slots,
                                                       (conv_buffer, rec_buffer), sequence_starts(batch))
        else:
            out, conv_after, rec_after = self._scan(mixed, g, beta, (conv_states, rec_states), batch,
                                                    (conv_buffer, rec_buffer))
        conv_buffer.index_copy_(0, slots.running, conv_after.to(conv_buffer.dtype))
        rec_buffer.index_copy_(0, slots.running, rec_after.to(rec_buffer.dtype))
        out = self.norm(out.to(x.dtype), z.unflatten(-1, (self.value_heads, self.value_dim))).flatten(1)
        out = self.out(out, batch.generated)
        return out if self.tp_reduce is None else self.tp_reduce(out)

    def _step(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_state: torch.Tensor,
              rec_state: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One generated token of each sequence: the outputs ``[B, Hv, dv]``, the conv and recurrent states after it."""
        conv, conv_after = conv_step(mixed, self.conv1d.weight[:, 0, :], None, conv_state)
        out, rec_after = delta_rule_step(*self._qkv(conv), g, beta, rec_state)
        return out, (conv_after, rec_after)

    def _scan(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, states: tuple[torch.Tensor, torch.Tensor],
              batch: ForwardBatch, buffers: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Each sequence's rows on their own: the conv over ``[state; rows]``, the delta rule on the
        absolute grid from the sequence's first new position; the states its emits ask for written
        to their slots. Returns the outputs ``[T, Hv, dv]`` and the conv and recurrent states after
        each sequence ``[B, ...]``."""
        lengths = batch.state.lengths
        weight = self.conv1d.weight[:, 0, :]
        outs, convs, recs, emitted = [], [], [], []
        pieces = zip(mixed.split(lengths), g.split(lengths), beta.split(lengths), *states, sequence_spans(batch, SCAN_CHUNK))
        for rows, g_rows, beta_rows, conv_state, rec_state, span in pieces:
            conv = causal_conv(rows, weight, None, conv_state, span)
            scan = delta_rule_scan(*self._qkv(conv.out), g_rows, beta_rows, rec_state, span)
            outs.append(scan.out), convs.append(conv.state), recs.append(scan.state)
            emitted.append(list(zip(conv.emitted, scan.emitted)))
        write_emitted(batch.state, emitted, buffers)
        return torch.cat(outs), torch.stack(convs), torch.stack(recs)


class GroupGatedRMSNorm(nn.Module):
    """Mamba2's gated norm (transformers' ``GraniteMoeHybridRMSNormGated``; the gate before the
    norm): ``h = x * silu(gate)``, each group of ``size / groups`` channels of h divided by its rms,
    in float32, rounded to x's dtype before the weight. Under TP (:meth:`shard`) a rank holds whole
    groups, or part of one group whose mean square then sums over the TP group."""

    def __init__(self, size: int, groups: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.groups, self.eps = groups, eps
        self.width = size // groups  # a group's channels, on every rank together
        self.spread: tuple[int, int] | None = None  # (this rank's group, the model's groups) where it spans ranks
        self.tp_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    def shard(self, groups: int, group: int | None, total: int,
              tp_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]]) -> None:
        """This rank holds ``groups`` whole groups (``group`` None), or a part of group ``group`` of the
        model's ``total``, whose squares ``tp_reduce`` sums over the TP group (each rank adds its own
        group's entry of a ``total``-wide vector: ranks of another group add nothing to it)."""
        self.groups, self.spread, self.tp_reduce = groups, None if group is None else (group, total), tp_reduce

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float() * F.silu(gate.float())
        if self.spread is None:
            h = h.unflatten(-1, (self.groups, -1))
            return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2).to(x.dtype)
        group, total = self.spread
        squares = h.new_zeros(*h.shape[:-1], total)
        squares[..., group] = h.pow(2).sum(-1)
        mean = self.tp_reduce(squares)[..., group:group + 1] / self.width
        return self.weight * (h * torch.rsqrt(mean + self.eps)).to(x.dtype)


class Mamba2Mixer(nn.Module):
    """Granite 4.0-H's Mamba2 mixer of layer ``layer`` (see the module docstring)."""

    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.state_index = spec.recurrent_layers.index(layer)
        self.heads, self.head_dim = spec.mamba_heads, spec.mamba_head_dim
        self.groups, self.state = spec.mamba_groups, spec.mamba_state
        inner, hidden = self.heads * self.head_dim, spec.hidden_size
        self.widths = (inner, spec.mamba_conv_dim, self.heads)  # z, x|B|C, dt
        self.in_proj = nn.Linear(hidden, sum(self.widths), bias=spec.mamba_proj_bias)
        self.conv1d = ConvTaps(spec.mamba_conv_dim, spec.conv_kernel, spec.conv_bias)
        self.dt_bias, self.A_log, self.D = (nn.Parameter(torch.empty(self.heads)) for _ in range(3))
        self.norm = GroupGatedRMSNorm(inner, self.groups, spec.rms_norm_eps)
        self.out_proj = nn.Linear(inner, hidden, bias=spec.mamba_proj_bias)
        self.inp, self.out = Projection(self.in_proj), Projection(self.out_proj)
        self.dt_limits = (spec.dt_min, spec.dt_max)  # (max None: no upper bound)
        self.tp_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # sum over TP ranks (model/parallel.py)

    def _heads(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output ``[T, conv_dim]`` SiLU'd and split: x ``[T, H, P]``, B and C ``[T, G, N]``."""
        x, b, c = F.silu(conv).split([self.heads * self.head_dim, self.groups * self.state,
                                      self.groups * self.state], -1)
        return (x.unflatten(-1, (self.heads, self.head_dim)), b.unflatten(-1, (self.groups, self.state)),
                c.unflatten(-1, (self.groups, self.state)))

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: KVView) -> torch.Tensor:
        """``x``: ``[T, hidden]`` (the batch's sequences one after the other); returns ``[T, hidden]``
        and leaves each sequence's conv and SSM states after its tokens in its running slot."""
        slots = _state_slots(batch)
        z, xbc, dt = self.inp.whole(x, batch.generated).split(self.widths, dim=-1)
        dt = row_softplus(dt.float() + self.dt_bias.float()).clamp(*self.dt_limits)  # [T, H] float32
        a = -self.A_log.float().exp()
        conv_buffer, ssm_buffer = kv.state_buffers[self.state_index]
        conv_states = conv_buffer.index_select(0, slots.source)  # all read before any write
        ssm_states = ssm_buffer.index_select(0, slots.source).float()
        if batch.generated:  # decode steps, token by token over a verify pass's rows
            out, (conv_after, ssm_after) = step_tokens(partial(self._step, a), (xbc, dt), (conv_states, ssm_states),
                                                       slots, (conv_buffer, ssm_buffer), sequence_starts(batch))
        else:
            out, conv_after, ssm_after = self._scan(xbc, dt, a, (conv_states, ssm_states), batch,
                                                    (conv_buffer, ssm_buffer))
        conv_buffer.index_copy_(0, slots.running, conv_after.to(conv_buffer.dtype))
        ssm_buffer.index_copy_(0, slots.running, ssm_after.to(ssm_buffer.dtype))
        out = self.out(self.norm(out.flatten(1), z), batch.generated)
        return out if self.tp_reduce is None else self.tp_reduce(out)

    def _step(self, a: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor, conv_state: torch.Tensor,
              ssm_state: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One generated token of each sequence: the outputs ``[B, H, P]``, the conv and SSM states after it."""
        conv, conv_after = conv_step(xbc, self.conv1d.weight[:, 0, :], self.conv1d.bias, conv_state)
        u, b, c = self._heads(conv)
        out, ssm_after = ssd_step(u, dt, a, b, c, self.D, ssm_state)
        return out, (conv_after, ssm_after)

    def _scan(self, xbc: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, states: tuple[torch.Tensor, torch.Tensor],
              batch: ForwardBatch, buffers: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Each sequence's rows on their own: the conv over ``[state; rows]``, the SSD scan on the
        absolute grid from the sequence's first new position; the states its emits ask for written
        to their slots. Returns the outputs ``[T, H, P]`` and the conv and SSM states after each
        sequence ``[B, ...]``."""
        lengths = batch.state.lengths
        weight, bias = self.conv1d.weight[:, 0, :], self.conv1d.bias
        outs, convs, ssms, emitted = [], [], [], []
        for rows, dt_rows, conv_state, ssm_state, span in zip(xbc.split(lengths), dt.split(lengths), *states,
                                                              sequence_spans(batch, SCAN_CHUNK)):
            conv = causal_conv(rows, weight, bias, conv_state, span)
            u, b, c = self._heads(conv.out)
            scan = ssd_scan(u, dt_rows, a, b, c, self.D, ssm_state, span)
            outs.append(scan.out), convs.append(conv.state), ssms.append(scan.state)
            emitted.append(list(zip(conv.emitted, scan.emitted)))
        write_emitted(batch.state, emitted, buffers)
        return torch.cat(outs), torch.stack(convs), torch.stack(ssms)
