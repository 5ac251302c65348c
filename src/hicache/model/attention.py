"""Attention kernels over a paged KV cache.

A sequence's new tokens attend to two kinds of key block: its cached prefix (every key visible
to every new token) and its own new tokens (causal). The blocks are joined: concatenated in
position order into one key axis and attended by one SDPA call whose causal mask is aligned to
the lower right (query i sees every cached key and new keys up to its own). A query row's
arithmetic then does not depend on where its prompt was split (a cached prefix, a prefill
chunk): it is the row a cold prompt's one causal call computes, bit for bit on a CPU (issue 57:
greedy hits keep the cold reply). Attending each block on its own and merging the partial
results by log-sum-exp is exact too, but rounds differently per split. The concatenation is one
copy of the context's keys and values per layer in a prefill.

On a CPU the call is torch's flash kernel with a materialised mask (float32, a block of up to
``MASKED_QUERY_BLOCK`` rows at a time over the keys up to its last row), the KV heads grouped
(``enable_gqa``); the query rows are padded so that no row is computed in a short query block
(:func:`cpu_query_rows`), the keys so that no row's key block is ragged (:func:`cpu_key_count`).
On a GPU the mask is ``causal_lower_right`` and the KV
heads are expanded, so torch runs its flash kernel (bf16/fp16) or its memory-efficient one
(float32) and no score matrix is materialised. (Partial attentions merged by log-sum-exp remain
for context-parallel ranks, each of which holds only some of the keys: :func:`keys_attention`.)

A lone decode token needs no causal block: its context (itself included) is one set of keys.
On a CPU with the native kernels (float32, the KV float32 or float16), decode batches read every
key by its slot straight from the buffers (:func:`native_decode_attention`). Elsewhere a decode batch of several
sequences takes one padded path: every context gathered to ``[B, K]`` slots, one SDPA call with
a per-key bias ``[B, 1, 1, K]`` for the padding.

Units: ``q`` rows are tokens, heads are query heads (``H``) or KV heads (``KvH``); a query head
``h`` reads KV head ``h // (H // KvH)`` unless a ``kv_map`` (uneven TP split) says otherwise.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from hicache.kernels import cpu_kernels

KVBlock = tuple[torch.Tensor, torch.Tensor]  # K and V, each [L, KvH, D]


def attended(k: torch.Tensor, v: torch.Tensor, latent: bool) -> KVBlock:
    """Stored K/V rows ``[L, KvH, D]`` as attention's keys and values: as they are, or, for an
    MLA latent stored in two halves (``latent``), the latent ``[L, 1, 2D]`` as key and value at once."""
    if not latent:
        return k, v
    joined = torch.cat((k, v), dim=-1)
    return joined, joined


def expand_heads(x: torch.Tensor, num_heads: int, kv_map: Optional[torch.Tensor]) -> torch.Tensor:
    """``[L, KvH, D]`` -> ``[L, H, D]``: the KV head each query head reads."""
    if kv_map is not None:
        return x.index_select(1, kv_map)
    return x.repeat_interleave(num_heads // x.shape[1], dim=1)


def _flash_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``q``/``k``/``v``: ``[N, L, D]`` with equal head counts N. Output ``[N, Lq, D]`` and
    log-sum-exp ``[N, Lq]`` (float32) from torch's CPU flash kernel."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q[None], k[None], v[None], 0.0, causal)
    return out[0], lse[0]


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`_flash_cpu`, in plain matmuls (any device)."""
    acc = torch.promote_types(q.dtype, torch.float32)  # softmax statistics in float32 at least
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(1, 2)) * q.shape[-1] ** -0.5
    if causal:
        n = q.shape[1]
        scores.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = scores.logsumexp(-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), v.to(acc))
    return out.to(q.dtype), lse


def merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Combine partial attentions over disjoint key blocks by their log-sum-exp."""
    if len(parts) == 1:
        return parts[0][0]
    lses = torch.stack([lse for _, lse in parts])  # [P, H, n]
    weights = torch.softmax(lses, dim=0)[..., None]  # each block's share of the probability mass
    acc = torch.promote_types(parts[0][0].dtype, torch.float32)
    return sum(w.to(acc) * o.to(acc) for w, (o, _) in zip(weights, parts)).to(parts[0][0].dtype)


def keys_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   kv_map: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` ``[n, H, D]`` attending to every key of ``k``/``v`` ``[L, KvH, D]`` (L may be 0):
    output ``[n, H, D]`` and log-sum-exp ``[n, H]`` (float32; -inf and a zero output for no keys),
    ready for :func:`merge_partials` with other key blocks.

    With equal head groups each group's queries are stacked along the query axis
    (``[KvH, G*n, D]``), so keys are never copied per query head."""
    n, heads, dim = q.shape
    if k.shape[0] == 0:
        return torch.zeros_like(q), torch.full((n, heads), float("-inf"), device=q.device)
    k, v = k.to(q.dtype), v.to(q.dtype)
    if kv_map is not None:  # an uneven TP split: each query head's KV head, expanded
        k, v = expand_heads(k, heads, kv_map), expand_heads(v, heads, kv_map)
    kv_heads = k.shape[1]
    stacked = q.transpose(0, 1).reshape(kv_heads, (heads // kv_heads) * n, dim)
    kernel = _flash_cpu if q.device.type == "cpu" else _math
    out, lse = kernel(stacked, k.transpose(0, 1), v.transpose(0, 1), False)
    return out.reshape(heads, n, dim).transpose(0, 1), lse.reshape(heads, n).transpose(0, 1).float()


# A span over cached keys attends this many query rows per call (a multiple of every query block
# of torch's CPU flash kernel below 768 rows), each block over the keys up to its last row.
MASKED_QUERY_BLOCK = 512


def cpu_query_rows(n: int, head_dim: int) -> int:
    """How many query rows to hand torch's CPU flash kernel for ``n`` real ones (float32 keys of
    ``head_dim``), so that every real row takes the arithmetic of a row in a full query block.

    The kernel splits the query axis into blocks (256 rows from 768 queries, 64 from 192, else
    32) and multiplies each block by the keys with one GEMM; a block of at most about
    ``head_dim / 24`` rows takes a different GEMM kernel and rounds differently (measured with
    torch 2.13 on Intel AVX-512: head size 64 from 3 rows on, 128 from 6, 256 from 11 agree with a
    full block). On an AMD AVX-512 CPU (Zen 4, where MKL takes other GEMM kernels) blocks of 1-3
    rows and the last 3 row counts below a full block differ too (head size 32; 64 and 128 agreed).
    So a short last block is padded -- with copies of the last row, dropped after -- to
    ``head_dim // 16 + 1`` rows and at least 4 (a full block where that is less), and one within 3
    rows of a full block to the full block. The padding rows attend like the last one, so they
    cost that row's attention each and change no real row."""
    split = 256 if n >= 768 else 64 if n >= 192 else 32
    tail = n % split
    least = min(split, max(head_dim // 16 + 1, 4))
    if tail == 0 or least <= tail <= split - 4:
        return n
    return n - tail + (least if tail < least else split)


def cpu_key_count(length: int) -> int:
    """How many keys to hand torch's CPU flash kernel for ``length`` real ones (zero keys, masked,
    after them), so that a row's bits do not depend on how many keys the call has.

    The kernel reads keys in blocks of 512; a row's scores are reduced in vector lanes (a ragged
    tail of the block is summed apart) and its weighted values by a GEMM over the block's keys,
    which splits a reduction of 320-448 keys unlike one of 512 (measured with torch 2.13 on
    AVX-512), and on an AMD AVX-512 CPU (Zen 4) one of 256 too. So the last block is made a multiple
    of 64 keys, and 512 where it would be over 192."""
    keys = -(-length // 64) * 64
    return -(-keys // 512) * 512 if keys % 512 > 192 else keys


def _padded_rows(x: torch.Tensor, rows: int, fill: Optional[float] = None) -> torch.Tensor:
    """``x`` ``[n, ...]`` padded to ``rows`` rows: ``fill`` rows, or copies of its last row."""
    n = x.shape[0]
    if rows == n:
        return x
    pad = x[-1:].expand(rows - n, *x.shape[1:]) if fill is None else x.new_full((rows - n, *x.shape[1:]), fill)
    return torch.cat((x, pad))


def _joined(dtype: torch.dtype, full: list[KVBlock], new: Optional[KVBlock]) -> KVBlock:
    """The key blocks (``full`` in ``dtype``, then ``new``) concatenated along the key axis."""
    blocks = [(k.to(dtype), v.to(dtype)) for k, v in full] + ([new] if new is not None else [])
    return blocks[0] if len(blocks) == 1 else tuple(torch.cat(part) for part in zip(*blocks))


def sequence_attention(q: torch.Tensor, full: list[KVBlock], new: Optional[KVBlock],
                       kv_map: Optional[torch.Tensor], joined: Optional[bool] = None) -> torch.Tensor:
    """One sequence: ``q`` ``[n, H, D]`` for its new tokens, the last n positions of its context;
    ``full`` key blocks every new token sees (its cached prefix, in position order); ``new`` its
    new tokens' K/V, attended causally (None when the new token is a lone token already included
    in ``full``). Returns ``[n, H, D]``. A row's result is the one a cold prompt's causal call
    gives it (bit for bit on a CPU, see :func:`cpu_query_rows`), wherever the prompt was split.
    ``joined``: the GPU's form of the call (default: off the CPU; see the module doc)."""
    if full and (q.device.type != "cpu" if joined is None else joined):
        return joined_attention(q, full, new, kv_map)
    n, heads, dim = q.shape
    k, v = _joined(q.dtype, full, new)
    if kv_map is not None:
        k, v = expand_heads(k, heads, kv_map), expand_heads(v, heads, kv_map)
    length = k.shape[0]
    cpu = q.device.type == "cpu"
    rows = cpu_query_rows(n, dim) if cpu else n
    kh, vh = (_padded_rows(x, cpu_key_count(length) if cpu else length, 0.0).transpose(0, 1)[None] for x in (k, v))
    # A cold prompt of 192-767 rows attends with the mask: the kernel's causal call would stop each
    # block of 64 rows at its last key, leaving a block of 320-448 keys (see cpu_key_count).
    if not full and not (cpu and 192 <= rows < 768):  # one causal call: padding keys meet padding rows only
        qh = _padded_rows(q, rows).transpose(0, 1)[None]  # [1, H, rows, D]: 4-D, so the CPU flash kernel takes it
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=kv_map is None)
        return out[0, :, :n].transpose(0, 1)
    # The query rows are the context's last n positions, attended a block of rows at a time over the
    # keys up to the block's last (padding rows: the last one's): the masked keys a block reads, and
    # its mask, stay under a block's worth of rows.
    out = torch.empty_like(q)
    for r0 in range(0, n, MASKED_QUERY_BLOCK):
        r1 = min(n, r0 + MASKED_QUERY_BLOCK)
        block_rows = cpu_query_rows(r1 - r0, dim) if cpu else r1 - r0
        keys = min(kh.shape[2], cpu_key_count(length - n + r1)) if cpu else length - n + r1
        positions = torch.arange(length - n + r0, length - n + r0 + block_rows, device=q.device).clamp_(max=length - 1)
        mask = positions[:, None] >= torch.arange(keys, device=q.device)[None, :]
        qh = _padded_rows(q[r0:r1], block_rows).transpose(0, 1)[None]
        part = F.scaled_dot_product_attention(qh, kh[:, :, :keys], vh[:, :, :keys], attn_mask=mask,
                                              enable_gqa=kv_map is None)
        out[r0:r1] = part[0, :, :r1 - r0].transpose(0, 1)
    return out


def joined_attention(q: torch.Tensor, full: list[KVBlock], new: Optional[KVBlock],
                     kv_map: Optional[torch.Tensor]) -> torch.Tensor:
    """:func:`sequence_attention` as one SDPA call: the blocks concatenated, the new tokens last,
    causal to the lower right when there are new tokens. KV heads are expanded to the query heads (an SDPA mask object and
    grouped heads do not combine on every torch version). A lone decode token (no new block) takes
    :func:`decode_attention` over the joined keys: grouped, no expansion, and the same call however
    many runs its context is stored in."""
    k, v = _joined(q.dtype, full, new)
    if new is None and q.shape[0] == 1:
        return decode_attention(q, k[None], v[None], None, kv_map)
    heads = q.shape[1]
    if k.shape[1] != heads or kv_map is not None:
        k, v = expand_heads(k, heads, kv_map), expand_heads(v, heads, kv_map)
    mask = None
    if new is not None:
        # Imported here: torch.nn.attention.bias pulls in torch._dynamo (1.4 s of every process's start).
        from torch.nn.attention.bias import causal_lower_right
        mask = causal_lower_right(q.shape[0], k.shape[0])
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask)
    return out[0].transpose(0, 1)


def decode_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, key_bias: Optional[torch.Tensor],
                     kv_map: Optional[torch.Tensor]) -> torch.Tensor:
    """B sequences, one new token each: ``q`` ``[B, H, D]``, contexts ``[B, K, KvH, D]`` (the new
    token's K/V included, padded to K), ``key_bias`` ``[B, 1, 1, K]`` (0 for a real key, -inf for
    padding; None: no padding). Returns ``[B, H, D]``.

    Each KV head's query heads ride along the query axis (``[B, KvH, G, D]``), so the keys are
    read once per KV head, not once per query head."""
    bsz, heads, dim = q.shape
    k, v = k_ctx.to(q.dtype), v_ctx.to(q.dtype)
    if kv_map is not None:
        k, v = k.index_select(2, kv_map), v.index_select(2, kv_map)
    kv_heads = k.shape[2]
    qg = q.view(bsz, kv_heads, heads // kv_heads, dim)
    bias = None if key_bias is None else key_bias.to(q.dtype)
    out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias)
    return out.reshape(bsz, heads, dim)


NATIVE_HEAD_DIMS = (32, 64, 96, 128, 256)
NATIVE_KV_DTYPES = (torch.float32, torch.float16)  # what the native decode kernel reads


def native_decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_slots: torch.Tensor,
                            lengths: torch.Tensor, kv_map: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """B decode tokens ``q`` ``[B, H, D]`` over keys read by slot from the ``[S, KvH, D]``
    buffers (``kv_slots`` ``[B, K]``, the first ``lengths[b]`` of row b real), through the native
    CPU kernel: no gather, no padding mask. None where it does not apply (not float32 queries
    over float32 or float16 KV on a CPU with the kernels, an uneven TP head map, an unusual head
    size): use :func:`decode_attention`."""
    if (q.device.type != "cpu" or q.dtype != torch.float32 or k_buf.dtype not in NATIVE_KV_DTYPES
            or kv_map is not None or q.shape[-1] not in NATIVE_HEAD_DIMS or cpu_kernels() is None):
        return None
    return cpu_kernels().paged_decode_attention(q.contiguous(), k_buf, v_buf, kv_slots, lengths)
