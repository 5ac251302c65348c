"""Context parallelism inside one forward pass: the batch as one CP rank sees it, and attention
over a context whose K/V is spread over the CP group.

Prefill: each CP rank computes a share of every sequence's new tokens (``--cp-strategy``
zigzag: 2N pieces, rank r takes pieces r and 2N-1-r; interleave: the page-sized blocks of page
position j go to rank j mod N). Per layer the ranks all-gather the chunk's new K/V (every rank
then holds all of it), each rank stores the new tokens it owns in its pool, and a rank's query
piece at offset ``a`` of the new tokens attends to the cached prefix, the new tokens before
``a`` (all visible), and its own piece (causal) -- the blocks merged by log-sum-exp.

The cached prefix: with replicated KV every rank reads it from its own pool. With page-sharded
KV each rank contributes the prefix pages it owns to a per-layer all-gather into one of two
alternating scratch buffers (:class:`PrefixGather`; the gather of the next (layer, sequence)
runs while this one's attention computes), and a page table says where each logical page
landed, so the prefix is read in logical order without moving pages in the pools.

Decode with sharded KV: every rank computes every decode token (weights are replicated across
CP), attends to the keys it owns, and the partial outputs are merged across the group by their
log-sum-exp -- a [B, H, D+1] all-gather per layer instead of gathering every context. With
replicated KV a decode batch is a plain batch: every rank holds every key.

All of it runs behind the attention backend protocol (:class:`CPBackend`, chosen once per
engine). The model knows nothing of the radix tree or the placement: the engine's runner
translates logical slots into (owner, local row) at the pool's copy boundary
(:meth:`CPSetup.contexts`) and the backend gets :class:`ShardedContext` per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch

from hicache.model.attention import attended, keys_attention, merge_partials, sequence_attention
from hicache.model.batch import AttentionLayer, ForwardBatch, KVView
from hicache.model.paged import PagedBackend
from hicache.model.parallel import split
from hicache.model.prefix_gather import CPGroup, PrefixGather


def split_new_tokens(first_position: int, n: int, size: int, strategy: str, page_size: int) -> list[list[tuple[int, int]]]:
    """Per CP rank, the ``(offset, length)`` pieces of a sequence's ``n`` new tokens (offsets
    from its first new token, at absolute position ``first_position``); adjacent pieces merged.
    ``strategy``: one of :data:`hicache.config.CP_STRATEGIES` (``--cp-strategy`` checks it)."""
    if strategy == "zigzag":  # 2N near-equal pieces; rank r gets the r-th and the (2N-1-r)-th
        cuts = [(min(i, 2 * size - 1 - i), split(n, 2 * size, i)) for i in range(2 * size)]
    else:  # interleave: page-aligned blocks (s: a page's start, as an offset) dealt round-robin by page position
        cuts = [((first_position + s) // page_size % size, range(max(s, 0), min(s + page_size, n)))
                for s in range(-(first_position % page_size), n, page_size)]
    pieces: list[list[tuple[int, int]]] = [[] for _ in range(size)]
    for rank, cut in cuts:  # each rank's cuts in order, adjacent ones merged
        mine = pieces[rank]
        if mine and sum(mine[-1]) == cut.start:
            mine[-1] = (mine[-1][0], mine[-1][1] + len(cut))
        elif cut:
            mine.append((cut.start, len(cut)))
    return pieces


@dataclass(frozen=True)
class ShardedContext:
    """Where one sequence's context lives among the CP ranks (built by the engine's runner).

    ``owners[i]`` holds context position i at row ``rows[i]`` of its buffers. ``gather_pages``:
    this rank's local pages of the cached prefix's pages, padded with its padding page 0 to the
    width every rank sends; ``page_table[j]``: where prefix page j lands in the gathered pages
    (owner-major, ``owner * width + index``)."""

    owners: torch.Tensor
    rows: torch.Tensor
    gather_pages: Optional[torch.Tensor]  # None: no prefix gather (a decode batch merging partials)
    page_table: Optional[torch.Tensor]


@dataclass(frozen=True)
class CPSequence:
    """One sequence of a CP prefill batch, as this rank computes it."""

    pieces: tuple[tuple[int, int, int], ...]  # (local row, offset in its new tokens, length)
    new_start: int  # its first new token's index in the batch's (global) new tokens
    new_len: int
    prefix_rows: Optional[torch.Tensor]  # cached prefix rows: local pool (replicated) or gathered K rows
    gather_pages: Optional[torch.Tensor]  # sharded: this rank's contribution to the prefix gather


@dataclass
class CPLayout:
    """The CP backend's metadata: what every layer of one forward needs (see the module docstring)."""

    group: CPGroup
    seqs: list[CPSequence]  # prefill
    # [T] each global new token's K row in the gathered chunk; None: every rank has every token
    chunk_k_rows: Optional[torch.Tensor]
    max_local: int  # new-token rows every rank sends in the chunk gather (its own, padded)
    write_index: torch.Tensor  # global new tokens whose K/V this rank stores
    write_rows: torch.Tensor  # ... at these rows of its pool
    logits_rows: torch.Tensor  # local rows holding one of the wanted logits rows ...
    logits_slots: torch.Tensor  # ... and which of the ``num_logits`` rows each is
    num_logits: int
    page_size: int
    decode_rows: Optional[list[torch.Tensor]] = None  # sharded decode: each context's keys on this rank
    gather: Optional[PrefixGather] = None
    # (not a field) Never a decode over this rank's pool alone: the fused native decode layer never serves it.
    decode = None

    @property
    def prefill(self) -> bool:
        return self.decode_rows is None

    def final_rows(self, h: torch.Tensor) -> torch.Tensor:
        """The wanted logits rows ``[num_logits, hidden]`` on every rank: each row's holder puts
        it in, the rest add zeros (an exact sum)."""
        if not self.prefill or self.chunk_k_rows is None:  # every rank holds every row
            return h[self.logits_rows]
        out = h.new_zeros(self.num_logits, h.shape[-1])
        out[self.logits_slots] = h[self.logits_rows]
        return self.group.all_reduce_sum(out)


def _pieces_rows(pieces_per_seq: list[list[tuple[int, int]]], new_starts: list[int]) -> tuple[list[tuple], list[int]]:
    """Local rows for this rank's pieces, in sequence order; and each local row's global token."""
    local: list[tuple] = []
    order: list[int] = []  # (its length: the next local row)
    for pieces, start in zip(pieces_per_seq, new_starts):
        mine = []
        for off, length in pieces:
            mine.append((len(order), off, length))
            order.extend(range(start + off, start + off + length))
        local.append(tuple(mine))
    return local, order


class CPSetup(Protocol):
    """An engine's place in a CP group, as the runtime builds it (``runtime/runner.py``)."""

    group: CPGroup
    strategy: str  # one of hicache.config.CP_STRATEGIES
    page_size: int
    gather: Optional[PrefixGather]  # sharded KV: the prefix-gather scratch; None: replicated
    split_tokens: bool  # False: the group's ranks hold other heads of the same tokens (MLA attention-TP)

    def contexts(self, prefix_lens: list[int], context_slots: list[torch.Tensor],
                 gathered: bool) -> list[torch.Tensor | ShardedContext]:
        """Each context as this rank reads it: local slots (replicated KV) or its
        :class:`ShardedContext` (with the prefix gather's pages when ``gathered``)."""
        ...


class CPBackend:
    """Attention over a context spread over a CP group (see the module docstring).
    ``num_layers``: KV layers of this rank's pool (the prefix gathers are planned over them)."""

    def __init__(self, setup: CPSetup, device: torch.device, num_layers: int) -> None:
        self.setup = setup
        self.device = device
        self.num_layers = num_layers
        self.paged = PagedBackend(device)  # replicated KV: a decode batch is a plain batch

    def prepare(self, input_ids: Sequence[Sequence[int]], prefix_lens: Sequence[int],
                context_slots: Sequence[torch.Tensor], logits: str = "last",
                window_slots: Optional[Sequence[torch.Tensor]] = None, generated: bool = False) -> ForwardBatch:
        """This CP rank's batch of B sequences (its share of the new tokens). ``split_tokens``
        False: the group's ranks are attention-TP ranks over one MLA latent (different heads, the
        same tokens): every rank computes every token and only the KV is sharded, so decode reads
        its context through the prefix gather too (a rank cannot merge partials of heads it lacks).
        ``generated`` chooses the projections' arithmetic (:attr:`ForwardBatch.generated`); the
        attention's layout here follows the new tokens' count alone (one a sequence: partials
        merged as a decode step's, float32 either way)."""
        assert logits == "last", "context parallelism returns each sequence's last logits only"
        assert window_slots is None, "context parallelism runs no sliding-window layers (the engine refuses them)"
        setup, device = self.setup, self.device
        lens = [len(ids) for ids in input_ids]
        # A decode batch split over CP ranks merges partial attention: no prefix gather.
        contexts = setup.contexts(list(prefix_lens), list(context_slots), not (setup.split_tokens and max(lens) == 1))
        sharded = isinstance(contexts[0], ShardedContext)
        for b, (context, prefix_len) in enumerate(zip(contexts, prefix_lens)):
            size = len(context.rows) if sharded else len(context)
            if size != prefix_len + lens[b]:
                raise ValueError(f"sequence {b}: {size} context slots for {prefix_len + lens[b]} tokens")
        if max(lens) == 1 and not sharded:  # every rank holds every key: a plain decode batch
            return self.paged.prepare(input_ids, prefix_lens, contexts, generated=generated)
        starts = torch.tensor([0] + lens).cumsum(0).tolist()
        if max(lens) == 1 and setup.split_tokens:  # sharded decode: every rank computes every token over its own keys
            layout, local = self._sharded_decode(prefix_lens, contexts), torch.arange(starts[-1])
        else:
            layout, local = self._prefill(lens, prefix_lens, contexts, starts, sharded)
        if setup.gather is not None:
            setup.gather.begin(layout.seqs, self.num_layers, setup.page_size)
        flat_ids = torch.tensor([t for ids in input_ids for t in ids], dtype=torch.long)
        positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, lens)])
        return ForwardBatch(input_ids=flat_ids[local].to(device), positions=positions[local].to(device),
                            attn=layout, backend=self, generated=generated)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                batch: ForwardBatch, kv: KVView) -> torch.Tensor:
        """See :meth:`~hicache.model.batch.AttentionBackend.forward` (``T``: this rank's tokens)."""
        kv.wait_layer(layer.layer)
        return cp_attention(q, k, v, batch.attn, layer, kv)  # type: ignore[arg-type]  # this backend prepared it

    def _writes(self, prefix_lens: Sequence[int], contexts: list, sharded: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The global new tokens whose K/V this rank stores, and the rows of its pool they go to."""
        rows = [c.rows if sharded else torch.as_tensor(c).long() for c in contexts]
        new_rows = torch.cat([r[p:] for r, p in zip(rows, prefix_lens)])
        owners = torch.cat([c.owners[p:] for c, p in zip(contexts, prefix_lens)]) if sharded else None
        write_index = (owners == self.setup.group.rank).nonzero().flatten() if sharded else torch.arange(len(new_rows))
        return write_index.to(self.device), new_rows[write_index].to(self.device)

    def _sharded_decode(self, prefix_lens: Sequence[int], contexts: list[ShardedContext]) -> CPLayout:
        group, device, bsz = self.setup.group, self.device, len(contexts)
        decode_rows = [c.rows[c.owners == group.rank].to(device) for c in contexts]
        rows = torch.arange(bsz, device=device)  # one new token per sequence: row b is sequence b's last
        return CPLayout(group, [], None, bsz, *self._writes(prefix_lens, contexts, True), rows, rows, bsz,
                        self.setup.page_size, decode_rows=decode_rows)

    def _prefill(self, lens: list[int], prefix_lens: Sequence[int], contexts: list, starts: list[int],
                 sharded: bool) -> tuple[CPLayout, torch.Tensor]:
        """The layout of a prefill (or an MLA attention-TP decode), and the global new tokens this
        rank computes, in its row order."""
        setup, device, total = self.setup, self.device, starts[-1]
        group, page_size = setup.group, setup.page_size
        split = [split_new_tokens(p, n, group.size, setup.strategy, page_size) if setup.split_tokens
                 else [[(0, n)]] * group.size for p, n in zip(prefix_lens, lens)]
        every = [_pieces_rows([s[r] for s in split], starts[:-1]) for r in range(group.size)]
        max_local = max(max(len(order) for _, order in every), 1)
        chunk_k_rows = torch.empty(total, dtype=torch.long)
        for r, (_, order) in enumerate(every):  # K of rank r's row j sits at (2r) * max_local + j
            chunk_k_rows[torch.tensor(order, dtype=torch.long)] = 2 * r * max_local + torch.arange(len(order))
        pieces, order = every[group.rank]
        local = torch.tensor(order, dtype=torch.long)
        seqs = [_cp_sequence(pieces[b], starts[b], lens[b], prefix_lens[b], contexts[b], sharded, page_size, device)
                for b in range(len(lens))]
        ends = torch.tensor(starts[1:]) - 1
        held = torch.isin(ends, local)
        slot_of = {int(g): i for i, g in enumerate(order)}
        logits_rows = torch.tensor([slot_of[int(e)] for e in ends[held]], dtype=torch.long)
        return CPLayout(group, seqs, chunk_k_rows.to(device) if setup.split_tokens else None, max_local,
                        *self._writes(prefix_lens, contexts, sharded), logits_rows.to(device),
                        held.nonzero().flatten().to(device), len(lens), page_size, gather=setup.gather), local


def _cp_sequence(pieces: tuple, new_start: int, new_len: int, prefix_len: int, context, sharded: bool,
                 page_size: int, device: torch.device) -> CPSequence:
    if prefix_len == 0:
        return CPSequence(pieces, new_start, new_len, None, None)
    if not sharded:
        return CPSequence(pieces, new_start, new_len, torch.as_tensor(context).long()[:prefix_len].to(device), None)
    # Gathered layout per rank: [K rows of its W pages | V rows of its W pages], ranks one after another.
    width = len(context.gather_pages)
    page_rows = width * page_size
    positions = torch.arange(prefix_len)
    gathered_page = context.page_table[positions // page_size]
    owner, index = gathered_page // width, gathered_page % width
    k_rows = owner * 2 * page_rows + index * page_size + positions % page_size
    return CPSequence(pieces, new_start, new_len, k_rows.to(device), context.gather_pages.to(device))


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: CPLayout, layer: AttentionLayer,
                 kv: KVView) -> torch.Tensor:
    """This rank's attention output ``[T_local, H, D]`` for its new tokens ``q``/``k``/``v``
    (see the module docstring); stores the new K/V this rank owns. ``k``/``v`` are as the pool
    stores them; :func:`~hicache.model.attention.attended` turns stored rows into attention's keys
    and values (MLA: the latent's two halves into the latent, as key and value)."""
    k_buf, v_buf = kv.k_buffers[layer.layer], kv.v_buffers[layer.layer]
    kv_map, latent = layer.kv_map, layer.latent
    if layout.chunk_k_rows is None:  # every rank computed every new token
        k_all, v_all = k, v
    else:  # all-gather the chunk's new K/V (rank r sends [K rows | V rows], padded to max_local)
        local = k.shape[0]
        mine = k.new_zeros(2 * layout.max_local, *k.shape[1:])
        mine[:local], mine[layout.max_local:layout.max_local + local] = k, v
        rows = layout.group.all_gather(mine).view(-1, *k.shape[1:])
        k_all, v_all = (rows.index_select(0, layout.chunk_k_rows + shift) for shift in (0, layout.max_local))
    k_stored, v_stored = k_all.to(k_buf.dtype), v_all.to(v_buf.dtype)  # rounded once (float16 KV)
    k_buf.index_copy_(0, layout.write_rows, k_stored[layout.write_index])
    v_buf.index_copy_(0, layout.write_rows, v_stored[layout.write_index])
    if not layout.prefill:  # sharded decode: every token here, keys split, partials merged
        # Partials in float32 (whatever the pool dtype), rounded once after the merge, as one rank would.
        q32 = q.float()
        outs, lses = zip(*(keys_attention(q32[b:b + 1], *(x.float() for x in attended(
            k_buf.index_select(0, rows), v_buf.index_select(0, rows), latent)), kv_map)
                           for b, rows in enumerate(layout.decode_rows)))
        mine = torch.cat([torch.cat(outs), torch.cat(lses)[..., None]], dim=-1)  # [B, H, D + 1]
        every = layout.group.all_gather(mine)
        return merge_partials([(part[..., :-1], part[..., -1]) for part in every]).to(q.dtype)
    k_all, v_all = k_stored.to(k.dtype), v_stored.to(v.dtype)  # attended as a later hit reads them
    out = torch.empty_like(q)
    for b, seq in enumerate(layout.seqs):
        prefix: list = []
        if seq.gather_pages is not None:  # even with no pieces here: every rank joins every gather, in order
            prefix = [attended(*layout.gather.prefix(layer.layer, b, kv), latent)]
        elif seq.prefix_rows is not None:
            prefix = [attended(k_buf.index_select(0, seq.prefix_rows), v_buf.index_select(0, seq.prefix_rows), latent)]
        k_new, v_new = attended(k_all[seq.new_start:seq.new_start + seq.new_len],
                                v_all[seq.new_start:seq.new_start + seq.new_len], latent)
        for row, off, n in seq.pieces:
            full = prefix + ([(k_new[:off], v_new[:off])] if off else [])
            out[row:row + n] = sequence_attention(q[row:row + n], full, (k_new[off:off + n], v_new[off:off + n]), kv_map)
    return out
