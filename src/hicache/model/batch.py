"""The contract between the engine and the model: one forward pass over a paged KV cache.

The model never sees the radix tree or the allocator. It sees a flat batch of new tokens, their
positions, and the metadata of the attention backend the engine chose once when it built its
runner (:class:`AttentionBackend`): the backend prepares that metadata once per forward, and
every attention layer hands its new q/k/v to the backend, which stores the K/V and attends.
Units: a *slot* is one token's row in a per-layer KV buffer (slot = page * page_size + offset);
slot 0 is padding and never holds real data. A *state slot* is one sequence's state in a recurrent
layer's state buffers (LFM2's conv); state slot 0 is the zero state, read by a sequence from
position 0 and never written.

Layer indices: the KV buffers hold the attention layers only, in order (a *compact attention
index*, ``Attention.layer``), the state buffers the recurrent layers (a *compact state index*,
``ShortConv.state_index``); in a model without recurrent layers the attention index is the layer's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch

from hicache.model.spec import ModelSpec


class KVView(Protocol):
    """Per-layer KV buffers plus a ready-waiter, as the model sees them.

    ``k_buffers[i]`` / ``v_buffers[i]``: ``[num_slots, num_kv_heads, head_dim]`` for attention layer i
    (compact index). ``state_buffers[j]``: recurrent layer j's state tensors (compact index), each
    ``[state_slots, *shape]`` (``ModelSpec.state_shapes``); empty without recurrent layers.
    ``wait_layer(i)`` blocks until attention layer i's cached prefix is ready to read (layer-wise
    load-back from a lower tier); it is a no-op when nothing is being loaded.
    """

    k_buffers: Sequence[torch.Tensor]
    v_buffers: Sequence[torch.Tensor]
    state_buffers: Sequence[tuple[torch.Tensor, ...]]

    def wait_layer(self, layer: int) -> None: ...

    def layer_ready(self, layer: int) -> bool:
        """Whether ``wait_layer(layer)`` would return at once."""
        ...


class DenseKV:
    """A plain in-memory :class:`KVView` for forwards without an engine (tests, debugging): per
    attention layer ``[num_slots, num_kv_heads, head_dim]`` K/V buffers, per recurrent layer its
    state tensors ``[state_slots, *shape]`` (zeros: the conv state in ``dtype``, a recurrent matrix
    in float32, as the engine's state pool keeps them), with nothing to wait for.

    Slot 0 is the padding slot (never holds real data), so usable slots are ``1..num_slots-1``;
    state slot 0 is the zero state, so usable state slots are ``1..state_slots-1``.
    """

    def __init__(self, spec: ModelSpec, num_slots: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 state_slots: int = 2):
        shape = (num_slots, spec.num_kv_heads, spec.head_dim)
        attention = spec.attention_layers
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in attention]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in attention]
        self.state_buffers = [tuple(torch.zeros((state_slots, *one), dtype=dtype if i == 0 else torch.float32,
                                                device=device) for i, one in enumerate(spec.state_shapes(layer)))
                              for layer in spec.recurrent_layers]

    def wait_layer(self, layer: int) -> None:
        """Nothing is ever loaded in the background here."""

    def layer_ready(self, layer: int) -> bool:
        return True


def window_group(kv: KVView, layer: int) -> int:
    """The sliding group whose window slots ``layer`` reads: 0, but in a shared pool (issue 56) whose
    view says (``kv.window_group(layer)``)."""
    group = getattr(kv, "window_group", None)
    return group(layer) if group is not None else 0


@dataclass(frozen=True)
class DecodeLayout:
    """A pass read row by row on this rank's pool (a decode batch, one new token per sequence; a
    verify pass, the last token + drafts): T rows, each new token over its own context (its
    sequence's keys up to and including its own), every row's slots in one block -- what the
    native decode kernels read by slot."""

    out_slots: torch.Tensor  # [T] long: where each new token's K/V is written
    kv_slots: torch.Tensor  # [T, K] long: each row's context slots in position order, 0-padded
    lengths: torch.Tensor  # [T] long (CPU): each row's context length, its own token included
    key_bias: Optional[torch.Tensor]  # [T, 1, 1, K] float32: 0 real key, -inf padding; None if T == 1


class AttentionMetadata(Protocol):
    """What a backend prepared for one forward; every layer reuses it."""

    # Set when the pass is a decode batch over this rank's own pool (the fused native decode
    # layer takes it); None otherwise.
    decode: Optional[DecodeLayout]

    def final_rows(self, h: torch.Tensor) -> torch.Tensor:
        """The rows of ``h`` ``[T, hidden]`` whose logits the caller wants, in order."""
        ...


class AttentionLayer(Protocol):
    """What a backend needs of one attention layer."""

    layer: int  # index of its K/V buffers in the KV view (compact: among the attention layers)
    window: int  # positions a query sees, its own included (a sliding-window layer); 0: every earlier one
    kv_map: Optional[torch.Tensor]  # local KV head of each query head (uneven TP split); None: equal groups
    # The K and V buffers hold the two halves of one latent per token (MLA), attended as key and
    # value at once; False: they hold the keys and values themselves.
    latent: bool


class AttentionBackend(Protocol):
    """How attention runs in one engine, chosen once when its runner is built: paged attention
    over this rank's pool (:class:`~hicache.model.paged.PagedBackend`) or context parallel over
    a CP group (:class:`~hicache.model.context_parallel.CPBackend`)."""

    def prepare(self, input_ids: Sequence[Sequence[int]], prefix_lens: Sequence[int],
                context_slots: Sequence[torch.Tensor], logits: str = "last",
                window_slots: Optional[Sequence[torch.Tensor]] = None, generated: bool = False) -> ForwardBatch:
        """The batch of B sequences for one forward, with this backend's metadata (once per
        forward). ``input_ids[b]``: sequence b's new tokens; ``prefix_lens[b]``: tokens of
        context already cached before them; ``context_slots[b]``: the slots of its whole
        context in position order (the new tokens' are its tail). ``logits``: ``"last"`` (one
        row per sequence) or ``"all"`` (every new token). ``window_slots[b]`` (sliding-window
        layers with buffers of their own): the same positions' slots in those buffers; only the
        positions some new token's window reaches are read (the others may be anything).
        ``generated``: the new tokens are generated ones (see :attr:`ForwardBatch.generated`)."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                batch: ForwardBatch, kv: KVView) -> torch.Tensor:
        """One layer (once per layer): waits for the layer's cached KV, stores the new ``k``/``v``
        ``[T, KvH, D]`` (as the pool holds them), returns the attention output ``[T, H, Dq]`` of
        ``q`` ``[T, H, Dq]`` over each sequence's context (causal over its new tokens)."""
        ...


@dataclass(frozen=True)
class StateSlots:
    """Where each sequence of a pass reads and writes its recurrent layers' state (state slots of
    :attr:`KVView.state_buffers`). A layer reads every ``source`` before it writes any ``running``
    slot, so a sequence may read and write one slot (a decode step: ``source == running``)."""

    source: torch.Tensor  # [B] long: the slot each sequence's state before this pass is read from; 0: from position 0
    running: torch.Tensor  # [B] long: the slot its state after this pass's tokens is written to (0: warm-up only)
    lengths: tuple[int, ...]  # [B] new tokens of each sequence, in the pass's row order (sum = T)
    # per sequence, its snapshots: (absolute position p, slot) pairs, p ascending -- also write its state after its
    # tokens before p (p inside this pass's span: start <= p <= its end) to that slot (the prefix tree keeps it)
    emits: tuple[tuple[tuple[int, int], ...], ...] = ()
    # per sequence of a pass of generated tokens (a speculative verify pass: the last token + drafts), the slots
    # its state after each of its new tokens but the last is also written to, in row order (empty: none), so the
    # state at the accepted row can replace the running slot's (runtime: DeviceStates.accept)
    rows: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of(cls, slots: Sequence[tuple], lengths: Sequence[int], device: torch.device | str) -> StateSlots:
        """From each sequence's ``(source, running[, emits[, rows]])`` slots and new-token count."""
        if len(slots) != len(lengths):
            raise ValueError(f"{len(slots)} state slot pairs for {len(lengths)} sequences")
        source, running = (torch.tensor([one[i] for one in slots], dtype=torch.long, device=device) for i in (0, 1))
        emits, rows = (tuple(tuple(one[i]) if len(one) > i else () for one in slots) for i in (2, 3))
        for n, r in zip(lengths, rows):
            if r and len(r) != n - 1:
                raise ValueError(f"{len(r)} row state slots for a sequence of {n} new tokens (one per token but the last)")
        return cls(source, running, tuple(lengths), emits, rows if any(rows) else ())


@dataclass
class ForwardBatch:
    """One forward pass. T = new tokens this rank computes, sequence after sequence.

    Built once per step by its backend's ``prepare``; every layer reuses the same metadata.
    """

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long: absolute position of each new token in its sequence
    attn: AttentionMetadata  # the backend's metadata for this forward
    backend: AttentionBackend  # the backend that prepared it and runs every layer's attention
    # What the rows are (issue 57). True: generated tokens -- a decode step, a speculative verify pass
    # (the last token + drafts), a draft model's proposals -- which may take the decode arithmetic
    # (GGUF blocks with 8-bit inputs, the row-by-row attention, the fused native decode layer).
    # False: prompt tokens (a prefill chunk, however short: a hit may leave one token to compute),
    # which always take the prefill's, so a hit's KV and first logits differ from a cold run's only
    # as chunking does. A pass is one or the other: the scheduler never mixes them.
    generated: bool = False
    # The recurrent layers' state slots of each sequence (set by whoever runs a model with recurrent
    # layers: make_forward_batch, or the engine after its backend's prepare); None: no recurrent layers.
    state: Optional[StateSlots] = None
