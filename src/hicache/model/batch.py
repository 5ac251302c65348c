"""The contract between the engine and the model: one forward pass over a paged KV cache.

The model never sees the radix tree or the allocator. It sees a flat batch of new tokens,
where to write their K/V (slots), and which slots hold each sequence's whole context.
Units: a *slot* is one token's row in a per-layer KV buffer (slot = page * page_size + offset);
slot 0 is padding and never holds real data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


class KVView(Protocol):
    """Per-layer KV buffers plus a ready-waiter, as the model sees them.

    ``k_buffers[i]`` / ``v_buffers[i]``: ``[num_slots, num_kv_heads, head_dim]`` for layer i.
    ``wait_layer(i)`` blocks until layer i's cached prefix is ready to read (layer-wise
    load-back from a lower tier); it is a no-op when nothing is being loaded.
    """

    k_buffers: Sequence[torch.Tensor]
    v_buffers: Sequence[torch.Tensor]

    def wait_layer(self, layer: int) -> None: ...


@dataclass
class ForwardBatch:
    """One forward pass. T = total new tokens, B = sequences, Q = max new tokens of a sequence,
    K = max context length (cached prefix + new tokens) of a sequence.

    Built once per step by :func:`make_forward_batch`; every layer reuses the same metadata.
    """

    input_ids: torch.Tensor  # [T] long: the new tokens, sequence after sequence
    positions: torch.Tensor  # [T] long: absolute position of each new token in its sequence
    out_slots: torch.Tensor  # [T] long: slot where each new token's K/V is written
    kv_slots: torch.Tensor  # [B, K] long: slots of each sequence's context in position order, 0-padded
    q_index: torch.Tensor  # [B, Q] long: flat index (into T) of each sequence's new tokens, 0-padded
    q_valid: torch.Tensor  # [B, Q] bool: which q_index entries are real
    attn_mask: torch.Tensor  # [B, 1, Q, K] bool: True where query may attend (causal, in length)
    logits_index: torch.Tensor  # [R] long: rows of T whose logits the caller wants
    single: bool  # one sequence whose context is exactly its new tokens in slot order: no padding


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
    ctx_lens = [p + n for p, n in zip(prefix_lens, lens)]
    for b in range(bsz):
        if int(context_slots[b].numel()) != ctx_lens[b]:
            raise ValueError(f"sequence {b}: {context_slots[b].numel()} context slots for {ctx_lens[b]} tokens")
    max_q, max_k = max(lens), max(ctx_lens)

    flat_ids = torch.tensor([t for ids in input_ids for t in ids], dtype=torch.long)
    positions = torch.cat([torch.arange(p, p + n, dtype=torch.long) for p, n in zip(prefix_lens, lens)])
    out_slots = torch.cat([context_slots[b][prefix_lens[b]:] for b in range(bsz)]).long()

    kv_slots = torch.zeros(bsz, max_k, dtype=torch.long)
    q_index = torch.zeros(bsz, max_q, dtype=torch.long)
    q_valid = torch.zeros(bsz, max_q, dtype=torch.bool)
    q_pos = torch.zeros(bsz, max_q, dtype=torch.long)
    start = 0
    for b in range(bsz):
        kv_slots[b, : ctx_lens[b]] = context_slots[b]
        q_index[b, : lens[b]] = torch.arange(start, start + lens[b])
        q_valid[b, : lens[b]] = True
        q_pos[b, : lens[b]] = torch.arange(prefix_lens[b], ctx_lens[b])
        start += lens[b]
    kv_pos = torch.arange(max_k)
    kv_len = torch.tensor(ctx_lens).view(bsz, 1, 1)
    mask = (kv_pos.view(1, 1, max_k) <= q_pos.view(bsz, max_q, 1)) & (kv_pos.view(1, 1, max_k) < kv_len)
    # Padded query rows attend to slot 0 only, so softmax stays finite; their output is dropped.
    mask[:, :, 0] |= ~q_valid
    ends = torch.tensor(lens).cumsum(0)
    logits_index = ends - 1 if logits == "last" else torch.arange(int(ends[-1]))
    single = bsz == 1 and prefix_lens[0] == 0

    dev = torch.device(device)
    return ForwardBatch(
        input_ids=flat_ids.to(dev),
        positions=positions.to(dev),
        out_slots=out_slots.to(dev),
        kv_slots=kv_slots.to(dev),
        q_index=q_index.to(dev),
        q_valid=q_valid.to(dev),
        attn_mask=mask.unsqueeze(1).to(dev),
        logits_index=logits_index.to(dev),
        single=single,
    )
