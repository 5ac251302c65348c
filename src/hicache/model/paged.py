"""The paged attention backend: every key of every context in this rank's own KV pool.

Per forward it lays the batch out once (:class:`PagedMetadata`); per layer it writes the new K/V
at their slots, then takes one of three paths, all exact:

- the native paged decode kernel: a pass of generated tokens (``ForwardBatch.generated``) where
  every sequence has at most ``ROWWISE_MAX_NEW`` new tokens (a decode batch; a verify pass of the
  last token + drafts), on a CPU with the
  kernels, float32 (the KV float32 or float16): each new token is a row attending to its own context -- the sequence's
  prefix and its new tokens up to itself, so the rows of one sequence are causal among
  themselves -- read by slot (no gather, no padding mask); a row's output is the one a decode
  step at its position gives;
- the SDPA fallback for such passes: several rows (or an MLA latent, which is gathered anyway)
  gather every row's context to ``[T, K]`` slots, one SDPA call with a per-key padding bias;
- spans: each sequence's new tokens attend to its cached prefix (read as views of the buffers
  when it lies in a few runs of slots, else gathered) and causally to each other, over one
  concatenated key axis, so a row computes as in the cold prompt's one causal call
  (:func:`~hicache.model.attention.sequence_attention`). Every prompt pass
  takes them, however few its new tokens (a hit that leaves one token to compute attends as the
  cold prompt's chunk did: issue 57), unless the backend is ``rowwise``.

A sliding-window layer (``layer.window`` > 0: a query at position p sees keys p - window + 1 .. p)
reads the same pool -- or buffers with a slot space of their own (``window_slots``: a window-sized
component, issue 48) -- through a windowed copy of the metadata, made once per forward and window
(:meth:`PagedMetadata.windowed`): decode rows read only their window's slots (the same kernels),
and a span longer than the window attends its keys with a mask made once per forward
(:func:`_windowed_span`). Every
layer keeps all its KV; the window only chooses what is read.

Units: rows of ``q`` are the batch's new tokens, sequence after sequence; slots as in
:mod:`hicache.model.batch`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from hicache.model.attention import (KVBlock, attended, decode_attention, expand_heads, native_decode_attention,
                                     sequence_attention)
from hicache.model.batch import AttentionLayer, DecodeLayout, ForwardBatch, KVView, StateSlots, window_group

# Keys stored in at most this many runs of consecutive slots are read as views of the KV
# buffers; more scattered ones are gathered once per layer (one copy beats many small kernels).
MAX_VIEW_RUNS = 8
# A pass whose sequences all have at most this many new tokens attends row by row (the decode
# layout): a verify pass of the last token + drafts reads the KV like a decode step. Longer runs
# of new tokens (prompt chunks) attend as spans: one causal block beats a row per token there.
ROWWISE_MAX_NEW = 16
# A windowed span attends in blocks of this many rows, each over the keys its rows see (a 1K prompt
# with a 512-token window: 0.64 of the square's scores instead of all of them).
WINDOW_QUERY_BLOCK = 128


@dataclass(frozen=True)
class SeqSpan:
    """One sequence of a batch. Its new tokens are rows ``[start, start + length)`` of T.

    The keys every new token sees -- the cached prefix, plus the token itself when it is a lone
    decode token (its K/V is written before attention) -- are either ``full_runs``
    (``(first slot, count)`` runs of consecutive slots) or, when too scattered, ``full_slots`` to
    gather. ``causal``: the new tokens attend to each other causally (more than one new token).
    ``window``: set (> 0) on a span of a sliding-window layer whose new tokens do not all see the
    same keys: the full runs / slots are then the cached keys some new token sees (positions
    ``first_position`` .. the prefix's end), the new tokens' own follow them (from position
    ``query_position``), and row i sees the keys of its window (causal)."""

    start: int
    length: int
    full_runs: tuple[tuple[int, int], ...]
    full_slots: Optional[torch.Tensor]
    causal: bool
    window: int = 0
    first_position: int = 0
    query_position: int = 0
    # (groups, dtype, device) -> the blocks' additive biases (made once per forward)
    biases: dict = field(default_factory=dict, compare=False, repr=False)

    def window_blocks(self, groups: int, dtype: torch.dtype,
                      device: torch.device) -> list[tuple[int, int, int, int, torch.Tensor]]:
        """The span's rows in blocks of ``WINDOW_QUERY_BLOCK``, each ``(first row, end row, first key,
        end key, bias)``: the keys some row of the block sees, and which each row sees as 0 / -inf
        ``[groups * rows, keys]`` (each of a KV head's ``groups`` query heads' rows stacked one head
        after the other, as :func:`_windowed_span` lays them). Blocks skip the keys no row of theirs
        sees: the work and the memory are the band's, not the whole square's."""
        key = (groups, dtype, device)
        if key not in self.biases:
            blocks = []
            for r0 in range(0, self.length, WINDOW_QUERY_BLOCK):
                r1 = min(self.length, r0 + WINDOW_QUERY_BLOCK)
                # key index j is position first_position + j; row i is position query_position + i
                k0 = max(0, self.query_position + r0 - self.window + 1 - self.first_position)
                k1 = self.query_position + r1 - self.first_position
                delta = (torch.arange(r0, r1, device=device)[:, None] + self.query_position
                         - torch.arange(k0, k1, device=device)[None, :] - self.first_position)
                bias = torch.zeros(delta.shape, dtype=dtype, device=device)
                bias.masked_fill_((delta < 0) | (delta >= self.window), float("-inf"))
                blocks.append((r0, r1, k0, k1, bias.repeat(groups, 1)))
            self.biases[key] = blocks
        return self.biases[key]


@dataclass(frozen=True)
class PagedMetadata:
    """One forward over this rank's pool. T = total new tokens, B = sequences."""

    out_slots: torch.Tensor  # [T] long: slot where each new token's K/V is written
    spans: list[SeqSpan]  # [B]: where each sequence's rows and cached prefix are (not for B>1 decode)
    decode: Optional[DecodeLayout]  # set when every sequence has few new tokens (row by row)
    logits_index: torch.Tensor  # [R] long: rows of T whose logits the caller wants
    contexts: list[torch.Tensor]  # [B] each sequence's context slots (CPU), for windowed copies
    lens: list[int]  # [B] new tokens of each sequence
    # [B] the context's slots in the sliding-window layers' own buffers (a slot space of their own; only the
    # positions some new token's window reaches are read), or None: those layers' buffers share `contexts`.
    # Each is [tokens], or [groups, tokens] where each sliding group of layers has slots of its own (a shared
    # pool, issue 56: the layer's KVView says its group).
    window_contexts: Optional[list[torch.Tensor]] = None
    _windows: dict = field(default_factory=dict, compare=False, repr=False)  # (window, group) -> its PagedMetadata
    _window_layouts: dict = field(default_factory=dict, compare=False, repr=False)  # window -> its decode layout

    def final_rows(self, h: torch.Tensor) -> torch.Tensor:
        return h[self.logits_index]

    def _reads_whole(self, window: int) -> bool:
        """Whether layers of ``window`` read this forward as it is: full layers (0), or windows that share
        the full layers' slots where no context is longer than the window."""
        return window <= 0 or (self.window_contexts is None and all(c.numel() <= window for c in self.contexts))

    def windowed(self, window: int, group: int = 0) -> "PagedMetadata":
        """This forward as a sliding-window layer of ``window`` positions (of sliding ``group``) reads
        and writes it (made once per window and group; itself where :meth:`_reads_whole`). A group's
        decode rows are its row of :meth:`window_decode`'s layout."""
        if self._reads_whole(window):
            return self
        if (window, group) not in self._windows:
            device = self.out_slots.device
            contexts = [c[group] if c.dim() == 2 else c for c in self.window_contexts or self.contexts]
            out_slots = torch.cat([c[c.numel() - n:] for c, n in zip(contexts, self.lens)]).to(device)
            every = self.window_decode(window)  # in a shared pool every group's rows, laid out once
            decode = every if every is None or every.out_slots.dim() == 1 else DecodeLayout(
                out_slots, every.kv_slots[group], every.lengths, every.key_bias)
            spans = [_span(span.start, n, c, device, window) for span, n, c in zip(self.spans, self.lens, contexts)]
            self._windows[window, group] = PagedMetadata(out_slots, spans, decode, self.logits_index, contexts, self.lens)
        return self._windows[window, group]

    def window_decode(self, window: int) -> Optional[DecodeLayout]:
        """The decode layout of this forward's sliding-window layers (None: not a row-by-row pass);
        in a shared pool every sliding group's at once -- ``out_slots`` ``[groups, T]``, ``kv_slots``
        ``[groups, T, K]``, group k's slots of the same positions (the rows' lengths and padding are
        the groups' alike) -- laid out once per forward and window, not once per group (issue 56:
        five groups' layouts were ~2 ms of a Gemma 3 270M decode step)."""
        if self.decode is None or self._reads_whole(window):
            return self.decode
        if window not in self._window_layouts:
            device, contexts = self.out_slots.device, self.window_contexts or self.contexts
            out_slots = torch.cat([c[..., c.shape[-1] - n:] for c, n in zip(contexts, self.lens)], dim=-1).to(device)
            self._window_layouts[window] = _decode_layout(out_slots, contexts, self.lens, device, window)
        return self._window_layouts[window]


def slot_runs(slots: torch.Tensor) -> list[tuple[int, int]]:
    """``(first slot, count)`` of each run of consecutive slots in ``slots`` (CPU, in order)."""
    if slots.numel() == 0:
        return []
    starts = [0] + ((slots[1:] - slots[:-1]) != 1).nonzero().flatten().add(1).tolist() + [int(slots.numel())]
    return [(int(slots[a]), b - a) for a, b in zip(starts[:-1], starts[1:])]


def _span(start: int, length: int, context: torch.Tensor, device: torch.device, window: int = 0) -> SeqSpan:
    causal = length > 1
    first, masked = 0, 0
    if window and context.numel() > window:
        if not causal:  # a lone token sees exactly the last `window` keys: a plain span over them
            context = context[-window:]
        else:  # from the first key the first new token sees; each row masked to its window (window_blocks)
            first, masked = max(0, context.numel() - length - window + 1), window
    full = context[first: context.numel() - length] if causal else context
    runs = slot_runs(full)
    where = dict(window=masked, first_position=first, query_position=context.numel() - length)
    if len(runs) <= MAX_VIEW_RUNS:
        return SeqSpan(start, length, tuple(runs), None, causal, **where)
    return SeqSpan(start, length, (), full.to(device), causal, **where)


def _decode_layout(out_slots: torch.Tensor, context_slots: Sequence[torch.Tensor], lens: Sequence[int],
                   device: torch.device, window: int = 0) -> DecodeLayout:
    """Every new token as a row over its own context: the sequence's slots up to and including
    its own (the new tokens' K/V are written before attention, so row i sees rows 0..i). A row's
    slots past its length are its sequence's later ones (read by nothing: masked by ``key_bias``).
    ``window`` > 0: a row's context is only its last ``window`` slots (its slots start there).
    Contexts ``[groups, tokens]`` (a shared pool's sliding groups: the same positions in each
    group's slots) give ``kv_slots`` ``[groups, T, K]``, each group's rows over the same positions."""
    sizes = [int(c.shape[-1]) for c in context_slots]
    ends = torch.cat([torch.arange(size - n + 1, size + 1) for size, n in zip(sizes, lens)])
    firsts = (ends - window).clamp_(min=0) if window else torch.zeros_like(ends)
    row_lens = ends - firsts
    if len(row_lens) == 1:
        return DecodeLayout(out_slots, context_slots[0][..., int(firsts[0]):].unsqueeze(-2).to(device), row_lens, None)
    lead = tuple(context_slots[0].shape[:-1])  # (groups,) or ()
    kv_slots = torch.zeros(*lead, len(row_lens), max(sizes), dtype=torch.long)
    row = 0
    for c, size, n in zip(context_slots, sizes, lens):
        if not window:
            kv_slots[..., row:row + n, :size] = c.unsqueeze(-2)  # each of the sequence's rows: its whole context
        for r in range(row, row + n) if window else ():  # each row: its window of the context onwards
            kv_slots[..., r, :size - int(firsts[r])] = c[..., int(firsts[r]):]
        row += n
    kv_slots = kv_slots[..., :int(row_lens.max())].contiguous() if window else kv_slots
    padding = torch.arange(kv_slots.shape[-1]).view(1, -1) >= row_lens.view(-1, 1)
    key_bias = torch.zeros(padding.shape).masked_fill_(padding, float("-inf"))
    return DecodeLayout(out_slots, kv_slots.to(device), row_lens, key_bias[:, None, None, :].to(device))


class PagedBackend:
    """Attention over this rank's own pool (see the module docstring); ``device``: where the
    batch's tensors go. ``rowwise`` (deterministic inference): every pass reads its keys row by
    row through the decode kernel, so a token's attention is the same whatever shares its pass
    and wherever its prompt was split (cached prefix, chunks)."""

    def __init__(self, device: torch.device | str, rowwise: bool = False) -> None:
        self.device = torch.device(device)
        self.rowwise = rowwise

    def prepare(self, input_ids: Sequence[Sequence[int]], prefix_lens: Sequence[int],
                context_slots: Sequence[torch.Tensor], logits: str = "last",
                window_slots: Optional[Sequence[torch.Tensor]] = None, generated: bool = False) -> ForwardBatch:
        """See :meth:`~hicache.model.batch.AttentionBackend.prepare`."""
        lens = [len(ids) for ids in input_ids]
        if not lens or min(lens) <= 0:
            raise ValueError("every sequence in a forward batch needs at least one new token")
        bsz = len(lens)
        context_slots = [torch.as_tensor(c).long().cpu() for c in context_slots]
        window_contexts = None if window_slots is None else [torch.as_tensor(c).long().cpu() for c in window_slots]
        for b in range(bsz):
            for slots in (context_slots, window_contexts or context_slots):
                if int(slots[b].shape[-1]) != prefix_lens[b] + lens[b]:
                    raise ValueError(f"sequence {b}: {slots[b].shape[-1]} context slots for "
                                     f"{prefix_lens[b] + lens[b]} tokens")
        dev = self.device
        flat_ids = torch.tensor([t for ids in input_ids for t in ids], dtype=torch.long)
        positions = torch.cat([torch.arange(p, p + n, dtype=torch.long) for p, n in zip(prefix_lens, lens)])
        out_slots = torch.cat([context_slots[b][prefix_lens[b]:] for b in range(bsz)]).to(dev)
        ends = torch.tensor(lens).cumsum(0)
        starts = (ends - torch.tensor(lens)).tolist()
        # Off the CPU no kernel reads keys by slot: rows gather their whole context each, so only a
        # decode pass (one new token a sequence) takes the row layout there. Prompt tokens never do.
        rowwise = self.rowwise or (generated and max(lens) <= (ROWWISE_MAX_NEW if dev.type == "cpu" else 1))
        decode = _decode_layout(out_slots, context_slots, lens, dev) if rowwise else None
        # A lone sequence keeps its span too: without the native kernel it reads its keys as views.
        spans = [] if decode is not None and bsz > 1 else [
            _span(starts[b], lens[b], context_slots[b], dev) for b in range(bsz)]
        logits_index = ends - 1 if logits == "last" else torch.arange(int(ends[-1]))
        meta = PagedMetadata(out_slots=out_slots, spans=spans, decode=decode, logits_index=logits_index.to(dev),
                             contexts=context_slots, lens=lens, window_contexts=window_contexts)
        return ForwardBatch(input_ids=flat_ids.to(dev), positions=positions.to(dev), attn=meta, backend=self,
                            generated=generated)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                batch: ForwardBatch, kv: KVView) -> torch.Tensor:
        """See :meth:`~hicache.model.batch.AttentionBackend.forward`."""
        meta: PagedMetadata = batch.attn.windowed(layer.window, window_group(kv, layer.layer))  # type: ignore[attr-defined]
        kv.wait_layer(layer.layer)
        k_buf, v_buf = kv.k_buffers[layer.layer], kv.v_buffers[layer.layer]
        k_stored, v_stored = k.to(k_buf.dtype), v.to(v_buf.dtype)  # rounded once (float16 KV): written, read below
        k_buf.index_copy_(0, meta.out_slots, k_stored)
        v_buf.index_copy_(0, meta.out_slots, v_stored)
        decode = meta.decode
        if decode is not None and not layer.latent:
            out = native_decode_attention(q, k_buf, v_buf, decode.kv_slots, decode.lengths, layer.kv_map)
            if out is not None:
                return out
        # A latent is gathered (its halves joined) whatever B: one MLA sequence takes this path too.
        if decode is not None and (decode.key_bias is not None or layer.latent):
            return _padded_decode(q, layer, decode, k_buf, v_buf)
        # A prompt's tokens attend to each other with the bits a later hit (or chunk) reads from the buffers.
        new = attended(k_stored.to(k.dtype), v_stored.to(v.dtype), layer.latent)
        return _spans(q, new, layer, meta.spans, k_buf, v_buf)


def make_forward_batch(input_ids: Sequence[Sequence[int]], prefix_lens: Sequence[int],
                       context_slots: Sequence[torch.Tensor], logits: str = "last",
                       device: torch.device | str = "cpu",
                       window_slots: Optional[Sequence[torch.Tensor]] = None, generated: bool = False,
                       state_slots: Optional[Sequence[tuple[int, int]]] = None) -> ForwardBatch:
    """A paged batch on ``device`` (:meth:`PagedBackend.prepare`): forwards without an engine.
    ``generated``: decode (or verify) rows, not prompt tokens. ``state_slots``: ``(source,
    running)`` state slots of each sequence (a model with recurrent layers: :class:`StateSlots`)."""
    batch = PagedBackend(device).prepare(input_ids, prefix_lens, context_slots, logits, window_slots, generated)
    if state_slots is not None:
        batch.state = StateSlots.of(state_slots, [len(ids) for ids in input_ids], batch.positions.device)
    return batch


def _padded_decode(q: torch.Tensor, layer: AttentionLayer, decode: DecodeLayout, k_buf: torch.Tensor,
                   v_buf: torch.Tensor) -> torch.Tensor:
    """B decode tokens ``q`` ``[B, H, D]``: one padded gather of every context, one SDPA call."""
    bsz, ctx = decode.kv_slots.shape
    flat = decode.kv_slots.view(-1)
    k, v = attended(k_buf.index_select(0, flat), v_buf.index_select(0, flat), layer.latent)
    shape = (bsz, ctx, *k.shape[1:])
    return decode_attention(q, k.view(shape), v.view(shape), decode.key_bias, layer.kv_map)


def _spans(q: torch.Tensor, new: KVBlock, layer: AttentionLayer, spans: list[SeqSpan], k_buf: torch.Tensor,
           v_buf: torch.Tensor) -> torch.Tensor:
    """Each sequence's attention ``[n, H, D]`` into its rows: the keys all its new tokens see read
    as views of the buffers (or gathered when scattered), ``new`` (its new tokens' K/V, as
    attended) causally."""
    out = torch.empty_like(q)
    for span in spans:
        rows = slice(span.start, span.start + span.length)
        if span.full_slots is not None:
            full = [attended(k_buf.index_select(0, span.full_slots), v_buf.index_select(0, span.full_slots),
                             layer.latent)]
        else:
            full = [attended(k_buf[s:s + n], v_buf[s:s + n], layer.latent) for s, n in span.full_runs]
        own = (new[0][rows], new[1][rows]) if span.causal else None
        out[rows] = (_windowed_span(q[rows], full, own, span, layer.kv_map) if span.window
                     else sequence_attention(q[rows], full, own, layer.kv_map))
    return out


def _windowed_span(q: torch.Tensor, cached: list[KVBlock], own: KVBlock, span: SeqSpan,
                   kv_map: Optional[torch.Tensor]) -> torch.Tensor:
    """A span's new tokens ``q`` ``[n, H, D]`` over the cached keys some of them see (``cached``
    blocks, in position order) and their own (``own``), each row masked to its window
    (``span.window``), a block of rows at a time over the keys it sees. A cold prompt's keys
    are its own: nothing is gathered; each KV head's query heads ride along the query axis
    (``[KvH, G*rows, D]``), so no key is copied per query head."""
    n, heads, dim = q.shape
    k, v = own if not cached else (torch.cat([b[i].to(q.dtype) for b in cached] + [own[i]]) for i in (0, 1))
    if kv_map is not None:  # an uneven TP split: each query head's KV head, expanded
        k, v = (expand_heads(x, heads, kv_map) for x in (k, v))
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    k, v = k.transpose(0, 1), v.transpose(0, 1)  # [KvH, L, D]
    out = torch.empty_like(q)
    for r0, r1, k0, k1, bias in span.window_blocks(groups, q.dtype, q.device):
        stacked = q[r0:r1].transpose(0, 1).reshape(kv_heads, groups * (r1 - r0), dim)
        part = F.scaled_dot_product_attention(stacked[None], k[None, :, k0:k1], v[None, :, k0:k1], attn_mask=bias)[0]
        out[r0:r1] = part.reshape(heads, r1 - r0, dim).transpose(0, 1)
    return out
