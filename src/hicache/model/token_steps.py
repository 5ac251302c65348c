"""A pass of generated tokens through a recurrent layer, token by token with the layer's decode step.

A decode step advances each sequence's state by one token (``conv_step``, ``delta_rule_step``,
``ssd_step`` in model/scan.py). A speculative verify pass feeds a sequence several generated tokens
(its last token + its drafts) and must give each row exactly what the decode step at that position
would: so it runs the same step, row after row -- step ``j`` is one batched step over the sequences
that have a row ``j`` -- never the chunked scan (which equals the step only within float tolerance).

Besides the state after all its rows (the caller writes that to the running slot, as a decode step
does), a sequence's state after each of its earlier rows goes to the slots :attr:`StateSlots.rows`
names, and the state at each of its :attr:`StateSlots.emits` positions to that slot: after
acceptance the engine keeps the state at the last accepted row (runtime: ``DeviceStates.accept``),
and a snapshot is always the state at its own position.

Units: rows are the pass's new tokens, sequence after sequence (``StateSlots.lengths``); states are
``[B, ...]`` per sequence, in the dtypes the layer keeps them in (the buffers').
"""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

import torch

from hicache.model.batch import StateSlots

Tensor = torch.Tensor
# step(*row inputs [B', ...], *states [B', ...]) -> (outputs [B', ...], the states after the row)
StepFn = Callable[..., tuple[Tensor, tuple[Tensor, ...]]]


def step_tokens(step: StepFn, rows: Sequence[Tensor], states: Sequence[Tensor], slots: StateSlots,
                buffers: Sequence[Tensor], starts: Sequence[int]) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Every row of a pass through ``step``, in token order per sequence. ``rows``: the step's
    per-token inputs ``[T, ...]``; ``states``: each sequence's states before the pass ``[B, ...]``;
    ``buffers``: the layer's state buffers (one per state) that :attr:`StateSlots.rows` and
    :attr:`StateSlots.emits` name slots of; ``starts``: each sequence's first new position. Returns
    the outputs ``[T, ...]`` and each sequence's states after all its rows. One token a sequence is
    one batched step (a decode step)."""
    lengths = slots.lengths
    if max(lengths, default=0) == 1 and not slots.rows and not any(slots.emits):
        return step(*rows, *states)
    firsts = list(itertools.accumulate(lengths[:-1], initial=0))
    targets = _targets(slots, starts)
    states = [s.clone() for s in states]
    _write(states, [b for b, n in enumerate(lengths) if n], 0, targets, buffers)  # emits at a pass's first position
    out = None
    for j in range(max(lengths, default=0)):
        seqs = [b for b, n in enumerate(lengths) if n > j]
        where = torch.tensor(seqs, dtype=torch.long, device=states[0].device)
        picked = torch.tensor([firsts[b] + j for b in seqs], dtype=torch.long, device=rows[0].device)
        y, after = step(*(r.index_select(0, picked) for r in rows), *(s.index_select(0, where) for s in states))
        if out is None:
            out = y.new_empty((rows[0].shape[0], *y.shape[1:]))
        out.index_copy_(0, picked, y)
        for s, a in zip(states, after):
            s.index_copy_(0, where, a)
        _write(states, seqs, j + 1, targets, buffers)
    return out, tuple(states)


def _targets(slots: StateSlots, starts: Sequence[int]) -> dict[tuple[int, int], list[int]]:
    """``(sequence, rows stepped) -> slots`` that its state after that many of its rows goes to: its
    row slots, and its emits (an emit at position ``p`` is the state after ``p - start`` rows)."""
    out: dict[tuple[int, int], list[int]] = {}
    for b, n in enumerate(slots.lengths):
        for j, slot in enumerate(slots.rows[b] if slots.rows else ()):
            out.setdefault((b, j + 1), []).append(slot)
        for p, slot in slots.emits[b] if slots.emits else ():
            if not 0 <= p - starts[b] <= n:
                raise ValueError(f"cannot emit the state at position {p}: the pass's tokens of that sequence are "
                                 f"at [{starts[b]}, {starts[b] + n})")
            out.setdefault((b, p - starts[b]), []).append(slot)
    return out


def _write(states: Sequence[Tensor], seqs: Sequence[int], stepped: int, targets: dict, buffers: Sequence[Tensor]) -> None:
    """Write the states of ``seqs`` after ``stepped`` rows to their target slots (if any)."""
    for b in seqs:
        for slot in targets.get((b, stepped), ()):
            for buffer, s in zip(buffers, states):
                buffer[slot] = s[b].to(buffer.dtype)
