"""Recurrent mixers: layers that keep a fixed-size state per sequence instead of KV.

``ShortConv`` is LFM2's: ``in_proj`` (hidden -> 3 hidden: B, C, x, in that order), a depthwise
causal convolution of ``conv_kernel`` taps over ``B * x``, ``y = C * conv``, ``out_proj``.
Parameter names are transformers' (``conv.in_proj``, ``conv.conv.weight`` ``[hidden, 1, K]``,
``conv.out_proj``). The state of a sequence is the last ``K - 1`` conv inputs, ``[hidden, K-1]``
per state slot (channels first, as transformers keeps it), in ``kv.state_buffers[state_index][0]``.

Each pass reads every sequence's state from its ``batch.state.source`` slot before it writes any
``running`` slot, and computes every token with the taps of model/scan.py: a prompt in one pass,
in chunks, or token by token gives the same state bits. A pass of one new token per sequence (a
decode step) is one batched step; otherwise one span per sequence (never a loop over tokens).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from hicache.model.batch import ForwardBatch, KVView, StateSlots
from hicache.model.projection import Projection
from hicache.model.scan import ScanSpan, causal_conv, conv_step
from hicache.model.spec import ModelSpec


def sequence_spans(batch: ForwardBatch, chunk: int = 1) -> list[ScanSpan]:
    """Each sequence's scan span in a pass: its first new token's absolute position, the scan chunk,
    and the positions of its emits (``batch.state.emits``)."""
    slots, spans, row = batch.state, [], 0
    for n, emits in zip(slots.lengths, slots.emits):
        spans.append(ScanSpan(int(batch.positions[row]) if n else 0, chunk, tuple(p for p, _ in emits)))
        row += n
    return spans


def write_emitted(slots: StateSlots, emitted: list[list], buffers: tuple[torch.Tensor, ...]) -> None:
    """Write each sequence's emitted states (``emitted[b][i]``: a tensor per buffer, or a lone tensor
    for a one-buffer layer) to the slots its emits name."""
    for emits, states in zip(slots.emits, emitted):
        for (_, slot), state in zip(emits, states):
            for buffer, part in zip(buffers, state if isinstance(state, (tuple, list)) else (state,)):
                buffer[slot] = part.to(buffer.dtype)


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
        self.tp_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # sum over TP ranks (not sharded yet)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: KVView) -> torch.Tensor:
        """``x``: ``[T, hidden]`` (the batch's sequences one after the other); returns ``[T, hidden]``
        and leaves each sequence's state after its tokens in its running slot."""
        slots = batch.state
        if slots is None:
            raise ValueError("a pass of a model with recurrent layers needs batch.state (its sequences' state slots)")
        b, c, u = self.inp.whole(x, batch.generated).chunk(3, dim=-1)
        bx = b * u
        buffer = kv.state_buffers[self.state_index][0]  # [slots, hidden, K-1]
        states = buffer.index_select(0, slots.source)  # [B, hidden, K-1]: all read before any write
        weight, bias = self.conv.weight[:, 0, :], self.conv.bias
        if max(slots.lengths) == 1 and not any(slots.emits):  # one token a sequence (decode): one batched step
            conv, after = conv_step(bx, weight, bias, states)
        else:
            spans = [causal_conv(rows, weight, bias, state, span) for state, rows, span in
                     zip(states, bx.split(slots.lengths), sequence_spans(batch))]
            conv, after = torch.cat([s.out for s in spans]), torch.stack([s.state for s in spans])
            write_emitted(slots, [s.emitted for s in spans], (buffer,))
        buffer.index_copy_(0, slots.running, after.to(buffer.dtype))
        out = self.out(c * conv, batch.generated)
        return out if self.tp_reduce is None else self.tp_reduce(out)
