"""The contract between the engine and the model: one forward pass over a paged KV cache.

The model never sees the radix tree or the allocator. It sees a flat batch of new tokens,
where to write their K/V (slots), and which slots hold each sequence's whole context.
Units: a *slot* is one token's row in a per-layer KV buffer (slot = page * page_size + offset);
slot 0 is padding and never holds real data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Protocol, Sequence

import torch

if TYPE_CHECKING:
    from hicache.model.context_parallel import CPLayout


class KVView(Protocol):
    """Per-layer KV buffers plus a ready-waiter, as the model sees them.

    ``k_buffers[i]`` / ``v_buffers[i]``: ``[num_slots, num_kv_heads, head_dim]`` for layer i.
    ``wait_layer(i)`` blocks until layer i's cached prefix is ready to read (layer-wise
    load-back from a lower tier); it is a no-op when nothing is being loaded.
    """

    k_buffers: Sequence[torch.Tensor]
    v_buffers: Sequence[torch.Tensor]

    def wait_layer(self, layer: int) -> None: ...

    def layer_ready(self, layer: int) -> bool:
        """Whether ``wait_layer(layer)`` would return at once."""
        ...


# Keys stored in at most this many runs of consecutive slots are read as views of the KV
# buffers; more scattered ones are gathered once per layer (one copy beats many small kernels).
MAX_VIEW_RUNS = 8


@dataclass(frozen=True)
class SeqSpan:
    """One sequence of a batch. Its new tokens are rows ``[start, start + length)`` of T.

    The keys every new token sees -- the cached prefix, plus the token itself when it is a lone
    decode token (its K/V is written before attention) -- are either ``full_runs``
    (``(first slot, count)`` runs of consecutive slots) or, when too scattered, ``full_slots`` to
    gather. ``causal``: the new tokens attend to each other causally (more than one new token)."""

    start: int
    length: int
    full_runs: tuple[tuple[int, int], ...]
    full_slots: Optional[torch.Tensor]
    causal: bool


@dataclass(frozen=True)
class DecodeLayout:
    """A decode batch (B sequences, one new token each): every context's slots in one block."""

    kv_slots: torch.Tensor  # [B, K] long: each context's slots in position order, 0-padded
    lengths: torch.Tensor  # [B] long (CPU): each context's length, the new token included
    key_bias: Optional[torch.Tensor]  # [B, 1, 1, K] float32: 0 real key, -inf padding; None if B == 1


@dataclass
class ForwardBatch:
    """One forward pass. T = total new tokens, B = sequences, K = max context length (cached
    prefix + new tokens) of a sequence.

    Built once per step by :func:`make_forward_batch`; every layer reuses the same metadata.
    """

    input_ids: torch.Tensor  # [T] long: the new tokens, sequence after sequence
    positions: torch.Tensor  # [T] long: absolute position of each new token in its sequence
    out_slots: torch.Tensor  # [T] long: slot where each new token's K/V is written
    spans: list[SeqSpan]  # [B]: where each sequence's rows and cached prefix are (not for B>1 decode)
    decode: Optional[DecodeLayout]  # set when every sequence has one new token
    logits_index: torch.Tensor  # [R] long: rows of T whose logits the caller wants
    single: bool  # one sequence with no cached prefix: plain causal attention on its tokens
    # Context parallelism (model/context_parallel.py): T is this rank's share of the new tokens,
    # out_slots / spans / logits_index are unused, the layout says where everything else is.
    cp: Optional["CPLayout"] = None


def slot_runs(slots: torch.Tensor) -> list[tuple[int, int]]:
    """``(first slot, count)`` of each run of consecutive slots in ``slots`` (CPU, in order)."""
    if slots.numel() == 0:
        return []
    starts = [0] + ((slots[1:] - slots[:-1]) != 1).nonzero().flatten().add(1).tolist() + [int(slots.numel())]
    return [(int(slots[a]), b - a) for a, b in zip(starts[:-1], starts[1:])]


def _span(start: int, length: int, context: torch.Tensor, device: torch.device) -> SeqSpan:
    causal = length > 1
    full = context[: context.numel() - length] if causal else context
    runs = slot_runs(full)
    if len(runs) <= MAX_VIEW_RUNS:
        return SeqSpan(start, length, tuple(runs), None, causal)
    return SeqSpan(start, length, (), full.to(device), causal)


def _decode_layout(context_slots: Sequence[torch.Tensor], device: torch.device) -> DecodeLayout:
    lens = torch.tensor([int(c.numel()) for c in context_slots])
    if len(context_slots) == 1:
        return DecodeLayout(context_slots[0].view(1, -1).to(device), lens, None)
    kv_slots = torch.zeros(len(lens), int(lens.max()), dtype=torch.long)
    for b, slots in enumerate(context_slots):
        kv_slots[b, : slots.numel()] = slots
    padding = torch.arange(kv_slots.shape[1]).view(1, -1) >= lens.view(-1, 1)
    key_bias = torch.zeros(padding.shape).masked_fill_(padding, float("-inf"))
    return DecodeLayout(kv_slots.to(device), lens, key_bias[:, None, None, :].to(device))


def make_forward_batch(
    input_ids: Sequence[Sequence[int]],
    prefix_lens: Sequence[int],
    context_slots: Sequence[torch.Tensor],
    logits: str = "last",
    device: torch.device | str = "cpu",
) -> ForwardBatch:
    """Build a batch for B sequences.

    ``input_ids[b]``: sequence b's new tokens; ``prefix_lens[b]``: how many tokens of context
    precede them (already in the cache); ``context_slots[b]``: long tensor of
    ``prefix_lens[b] + len(input_ids[b])`` slots, the whole context in position order (the new
    tokens' slots are its tail). ``logits``: ``"last"`` (one row per sequence) or ``"all"``.
    """
    lens = [len(ids) for ids in input_ids]
    if not lens or min(lens) <= 0:
        raise ValueError("every sequence in a forward batch needs at least one new token")
    bsz = len(lens)
    context_slots = [torch.as_tensor(c).long().cpu() for c in context_slots]
    for b in range(bsz):
        if int(context_slots[b].numel()) != prefix_lens[b] + lens[b]:
            raise ValueError(f"sequence {b}: {context_slots[b].numel()} context slots for "
                             f"{prefix_lens[b] + lens[b]} tokens")
    dev = torch.device(device)

    flat_ids = torch.tensor([t for ids in input_ids for t in ids], dtype=torch.long)
    positions = torch.cat([torch.arange(p, p + n, dtype=torch.long) for p, n in zip(prefix_lens, lens)])
    out_slots = torch.cat([context_slots[b][prefix_lens[b]:] for b in range(bsz)])
    ends = torch.tensor(lens).cumsum(0)
    starts = (ends - torch.tensor(lens)).tolist()
    decode = _decode_layout(context_slots, dev) if max(lens) == 1 else None
    # A lone sequence keeps its span too: without the native kernel it reads its keys as views.
    spans = [] if decode is not None and bsz > 1 else [
        _span(starts[b], lens[b], context_slots[b], dev) for b in range(bsz)]
    logits_index = ends - 1 if logits == "last" else torch.arange(int(ends[-1]))
    return ForwardBatch(
        input_ids=flat_ids.to(dev),
        positions=positions.to(dev),
        out_slots=out_slots.to(dev),
        spans=spans,
        decode=decode,
        logits_index=logits_index.to(dev),
        single=bsz == 1 and prefix_lens[0] == 0,
    )
