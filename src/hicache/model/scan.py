"""The recurrent mixers' sequence ops as pure functions: the depthwise causal conv, the chunked gated
delta rule (Qwen3.5 / Qwen3-Next "linear_attention" layers) and the chunked Mamba2 SSD scan
(Granite 4.0-H, Bamba, Nemotron-H), each with its one-token step batched over sequences.

Units: one call covers one sequence's rows ``[T, ...]``; row 0 sits at absolute position
``span.start``. Heads are batched; a state is that sequence's alone (rule 3 of
docs/recurrent_plan.md: no reduction is shared between sequences).

The invariant (issue 59, "hits equal to cold"): a call's outputs and states are bit for bit those
of the same rows computed by any split of the call at multiples of ``span.chunk``, so a prefix-cache
hit that resumes from a state emitted at a chunk boundary continues exactly as the cold run did.
It holds because
- the blocks lie on an ABSOLUTE grid: ``[start, next multiple of chunk)``, whole chunks, then
  the last partial block, however the call was split before it;
- the recurrence across blocks is SEQUENTIAL: a block's arithmetic reads only (the state at its
  start, its own rows) -- unlike transformers' SSD, whose all-pairs decay sum over the call's
  chunks gives each chunk's start state a value that depends on how many chunks the call held;
- every block is computed from fresh contiguous copies of its rows, so its kernels see the same
  shapes, strides and allocator alignment whatever the call's length (a precaution: BLAS
  libraries may pick paths by alignment).
The steps equal the scans within float tolerance, not bitwise (the conv step equals bitwise).
Decay weights below the dtype's smallest normal number are flushed to zero (:func:`_exp`).

The math is float32 (float64 when the inputs are float64): states are returned in the dtype they
came in (float32 for the recurrent matrices), outputs in the inputs' dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, NamedTuple, Sequence

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class ScanSpan:
    """Where a call's rows sit: row 0 is absolute position ``start``; blocks on the grid of
    ``chunk`` tokens from position 0; ``emit``: absolute positions (multiples of ``chunk`` in
    ``[start, start + T]``; any position for the conv) whose states the call also returns."""

    start: int = 0
    chunk: int = 64
    emit: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.start < 0 or self.chunk < 1:
            raise ValueError(f"a scan span needs start >= 0 and chunk >= 1, not {self.start} and {self.chunk}")


class ScanOut(NamedTuple):
    """A scan's outputs ``[T, H, width]``, its end state, and the states at ``span.emit`` in order."""

    out: Tensor
    state: Tensor
    emitted: list[Tensor]


def chunk_blocks(start: int, length: int, chunk: int) -> list[tuple[int, int]]:
    """Row ranges ``[a, b)`` (rows of the call, row 0 at absolute ``start``) of the blocks of a
    call of ``length`` rows on the absolute grid of ``chunk``: the first block ends at the next
    multiple of ``chunk``, the last is partial."""
    inner = range((start // chunk + 1) * chunk, start + length, chunk)
    edges = [start, *inner, start + length] if length else []
    return [(a - start, b - start) for a, b in zip(edges, edges[1:])]


def _check_emit(span: ScanSpan, length: int, grid: int) -> None:
    for p in span.emit:
        if p % grid or not span.start <= p <= span.start + length:
            raise ValueError(
                f"cannot emit the state at position {p}: emit positions are multiples of {grid} "
                f"within the call's positions [{span.start}, {span.start + length}]"
            )


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float32, or float64 when an input is float64."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _block(rows: Tensor, a: int, b: int, dtype: torch.dtype) -> Tensor:
    """Rows ``[a, b)`` of ``[T, H, ...]`` as a fresh contiguous ``[H, b - a, ...]`` tensor."""
    return rows[a:b].transpose(0, 1).to(dtype, memory_format=torch.contiguous_format, copy=True)


def _segment_sums(logs: Tensor) -> Tensor:
    """``[H, L]`` log decays -> ``[H, L, L]`` with ``[i, j] = sum(logs[j+1 .. i])`` for ``i >= j``
    (0 on the diagonal), ``-inf`` above it. Summed per segment, not as differences of cumulative
    sums, which would lose the small segments' precision to the large sums' rounding."""
    ones = torch.ones(logs.shape[-1], logs.shape[-1], dtype=torch.bool, device=logs.device)
    sums = torch.where(ones.tril(-1), logs[:, :, None], 0.0).cumsum(-2)  # [i, j]: rows k, j < k <= i
    return sums.masked_fill(ones.triu(1), float("-inf"))


# The gates of a recurrent layer ([T, heads]: a few values a row) computed so that a row's bits do not
# depend on where it sits in the batch: torch's CPU sigmoid and softplus take a SIMD path over whole
# vectors and a scalar one for the tail, which round differently (~4% of values differ by an ulp), and in
# a [T, 4] tensor which rows fall in the tail changes with T -- a batched run would not give a lone run's
# bits (deterministic inference). exp, log1p and IEEE arithmetic agree on both paths.
def row_sigmoid(x: Tensor) -> Tensor:
    """``sigmoid(x)``, the same bits for an element wherever it sits in ``x``."""
    return 1.0 / (1.0 + torch.exp(-x))


def row_softplus(x: Tensor) -> Tensor:
    """``softplus(x)`` (``x`` itself above 20, as torch's), the same bits wherever an element sits."""
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(x)))


def _exp(logs: Tensor) -> Tensor:
    """``exp(logs)`` with results below the dtype's smallest normal flushed to zero, as FTZ
    hardware would: torch's CPU exp takes a path ~50x slower for subnormal results (and ~5x for
    ``-inf``), which strong decays over a chunk produce in bulk."""
    keep = logs > math.log(torch.finfo(logs.dtype).tiny)
    return torch.where(keep, torch.where(keep, logs, 0.0).exp(), 0.0)


def _scan(block_fn: Callable[..., tuple[Tensor, Tensor]], rows: Sequence[Tensor], state: Tensor,
          span: ScanSpan, dtype: torch.dtype) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Run ``block_fn(*block_rows, state) -> (out [H, L, W], state)`` over the blocks in order;
    returns the outputs ``[T, H, W]`` (compute dtype), the end state and the emitted states."""
    length = rows[0].shape[0]
    _check_emit(span, length, span.chunk)
    s = state.to(dtype, memory_format=torch.contiguous_format, copy=True)
    kept = {span.start: state.clone()} if span.start in span.emit else {}
    outs = []
    for a, b in chunk_blocks(span.start, length, span.chunk):
        out, s = block_fn(*(_block(t, a, b, dtype) for t in rows), s)
        outs.append(out)
        if span.start + b in span.emit:
            kept[span.start + b] = s.to(state.dtype, copy=True)
    joined = torch.cat(outs, 1).transpose(0, 1) if outs else None
    return joined, s.to(state.dtype), [kept[p] for p in span.emit]


def _heads_ratio(key_heads: int, value_heads: int) -> int:
    if value_heads % key_heads:
        raise ValueError(f"{value_heads} value heads cannot share {key_heads} key heads evenly")
    return value_heads // key_heads


# ---- the depthwise causal conv --------------------------------------------------------------

def _taps(window: Tensor, weight: Tensor, bias: Tensor | None, rows: int) -> Tensor:
    """``sum_j window[j : j + rows] * weight[:, j]`` in tap order, then the bias: separate
    multiplies and adds (no fused op), each exactly rounded, so a row's value is the same
    whatever call or step computes it."""
    columns = weight.transpose(0, 1).contiguous()  # [K, C]: each tap's weights contiguous
    y = window[0:rows] * columns[0]
    product = torch.empty_like(y)
    for j in range(1, columns.shape[0]):
        y.add_(torch.mul(window[j:j + rows], columns[j], out=product))
    return y.add_(bias) if bias is not None else y


def causal_conv(x: Tensor, weight: Tensor, bias: Tensor | None, state: Tensor,
                span: ScanSpan = ScanSpan()) -> ScanOut:
    """Depthwise causal conv of one sequence: ``y[t, c] = sum_j weight[c, j] * in[t - K + 1 + j, c]
    (+ bias[c])`` over ``in = [state; x]``. No activation (the mixers apply SiLU after).

    x ``[T, C]``; weight ``[C, K]``; bias ``[C]`` or None; state ``[C, K-1]`` (the last K-1 inputs
    before row 0). Returns ``ScanOut(y [T, C], state [C, K-1], emitted)``, ``out`` in x's dtype
    and states in ``state``'s; ``span.emit`` may name any position in ``[start, start + T]`` (a conv
    has no blocks: ``span.chunk`` is unused)."""
    _check_emit(span, x.shape[0], 1)
    dtype = _compute_dtype(x, weight)
    window = torch.cat([state.transpose(0, 1).to(dtype), x.to(dtype)])  # [K-1+T, C]
    w, b = weight.to(dtype), bias.to(dtype) if bias is not None else None
    taps = state.shape[1]

    def state_at(p: int) -> Tensor:
        return window[p - span.start:p - span.start + taps].transpose(0, 1).to(state.dtype, copy=True)

    y = _taps(window, w, b, x.shape[0]).to(x.dtype)
    return ScanOut(y, state_at(span.start + x.shape[0]), [state_at(p) for p in span.emit])


def conv_step(x: Tensor, weight: Tensor, bias: Tensor | None, state: Tensor) -> tuple[Tensor, Tensor]:
    """One token of each of B sequences: x ``[B, C]``, state ``[B, C, K-1]`` -> (y ``[B, C]``, state).
    Bit for bit :func:`causal_conv`'s row for the same inputs."""
    dtype = _compute_dtype(x, weight)
    window = torch.cat([state.to(dtype), x.to(dtype)[..., None]], -1).movedim(-1, 0)  # [K, B, C]
    y = _taps(window, weight.to(dtype), bias.to(dtype) if bias is not None else None, 1)[0]
    return y.to(x.dtype), window[1:].movedim(0, -1).to(state.dtype)


# ---- the gated delta rule -------------------------------------------------------------------

def delta_rule_qk(q: Tensor, k: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Qwen3-Next's per-token prologue, kept out of the scans: q and k L2-normalised over their
    last axis (``x * rsqrt(sum x^2 + eps)``, float32), q also scaled by ``dk ** -0.5``."""
    dtype = _compute_dtype(q, k)
    q, k = q.to(dtype), k.to(dtype)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + eps)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + eps)
    return q * q.shape[-1] ** -0.5, k


def _delta_block(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                 repeat: int) -> tuple[Tensor, Tensor]:
    """One block: q, k ``[Hk, L, dk]``, v ``[H, L, dv]``, g, beta ``[H, L]``, state ``[H, dk, dv]``.
    The UT transform: the block's L delta updates as one unit-lower-triangular solve."""
    q, k = q.repeat_interleave(repeat, 0), k.repeat_interleave(repeat, 0)
    seg = _segment_sums(g)
    decay = _exp(seg)  # [H, L, L]: the decay from row j to row i, 0 above the diagonal
    from_start = g.cumsum(-1)  # log decay from the block's start through row i
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its diagonal is read as 1
    rhs = torch.cat([v * beta[..., None], k_beta * _exp(from_start)[..., None]], -1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved.split([v.shape[-1], k.shape[-1]], -1)
    v_new = u - w @ state  # what each row writes: beta (v - the state's prediction)
    out = (q * _exp(from_start)[..., None]) @ state + ((q @ k.transpose(-1, -2)) * decay) @ v_new
    to_end = _exp(seg[:, -1, :])[..., None]  # decay from row j (exclusive) to the block's end
    state = state * _exp(from_start[:, -1:])[..., None] + (k * to_end).transpose(-1, -2) @ v_new
    return out, state


def delta_rule_scan(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                    span: ScanSpan = ScanSpan()) -> ScanOut:
    """The gated delta rule over one sequence, chunked on the absolute grid. Per token:
    ``S = exp(g) S; S += k (beta (v - S^T k))^T; out = S^T q``.

    q, k ``[T, Hk, dk]`` as :func:`delta_rule_qk` returns them (normalised, q scaled); v
    ``[T, H, dv]``; g ``[T, H]`` log decay (<= 0); beta ``[T, H]``; state ``[H, dk, dv]`` (float32).
    Value head h reads key head ``h // (H // Hk)``. Returns ``ScanOut(out [T, H, dv], state,
    emitted)``."""
    dtype = _compute_dtype(q, k, v, state)
    block = partial(_delta_block, repeat=_heads_ratio(k.shape[1], v.shape[1]))
    out, end, emitted = _scan(block, (q, k, v, g, beta), state, span, dtype)
    out = out if out is not None else v.new_zeros(0, *v.shape[1:], dtype=dtype)
    return ScanOut(out.to(v.dtype), end, emitted)


def delta_rule_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                    state: Tensor) -> tuple[Tensor, Tensor]:
    """One token of each of B sequences: q, k ``[B, Hk, dk]``, v ``[B, H, dv]``, g, beta ``[B, H]``,
    state ``[B, H, dk, dv]`` -> (out ``[B, H, dv]``, state)."""
    dtype = _compute_dtype(q, k, v, state)
    repeat = _heads_ratio(k.shape[1], v.shape[1])
    q, k = (t.to(dtype).repeat_interleave(repeat, 1) for t in (q, k))
    s = state.to(dtype) * g.to(dtype).exp()[..., None, None]
    predicted = (k[..., None, :] @ s)[..., 0, :]  # S^T k: [B, H, dv]
    delta = (v.to(dtype) - predicted) * beta.to(dtype)[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    return (q[..., None, :] @ s)[..., 0, :].to(v.dtype), s.to(state.dtype)


# ---- the Mamba2 SSD scan --------------------------------------------------------------------

def _ssd_block(x: Tensor, dt: Tensor, b: Tensor, c: Tensor, state: Tensor, a: Tensor,
               d: Tensor) -> tuple[Tensor, Tensor]:
    """One block: x ``[H, L, P]``, dt ``[H, L]``, b, c ``[G, L, N]``, state ``[H, P, N]``, a, d ``[H]``."""
    repeat = x.shape[0] // b.shape[0]
    scores = (c @ b.transpose(-1, -2)).repeat_interleave(repeat, 0)  # [H, L, L]: per group, to heads
    b, c = b.repeat_interleave(repeat, 0), c.repeat_interleave(repeat, 0)
    logs = dt * a[:, None]  # [H, L]: log decay of each row
    seg = _segment_sums(logs)
    from_start = logs.cumsum(-1)
    xdt = x * dt[..., None]
    y = (scores * _exp(seg)) @ xdt  # within the block
    y = y + (c @ state.transpose(-1, -2)) * _exp(from_start)[..., None]  # from the start state
    to_end = _exp(seg[:, -1, :])[..., None]
    state = state * _exp(from_start[:, -1:])[..., None] + (xdt * to_end).transpose(-1, -2) @ b
    return y + d[:, None, None] * x, state


def ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, state: Tensor,
             span: ScanSpan = ScanSpan()) -> ScanOut:
    """The Mamba2 SSD scan over one sequence, chunked on the absolute grid. Per token:
    ``S = exp(dt A) S + (dt x) B^T; y = S C + D x``.

    x ``[T, H, P]``; dt ``[T, H]`` (softplus'd and clamped by the caller); A ``[H]`` (negative);
    B, C ``[T, G, N]`` (head h reads group ``h // (H // G)``); D ``[H]``; state ``[H, P, N]``
    (float32; transformers' ``ssm_states`` layout). Returns ``ScanOut(y [T, H, P], state, emitted)``."""
    dtype = _compute_dtype(x, B, C, state)
    _heads_ratio(B.shape[1], x.shape[1])
    block = partial(_ssd_block, a=A.to(dtype), d=D.to(dtype))
    out, end, emitted = _scan(block, (x, dt, B, C), state, span, dtype)
    out = out if out is not None else x.new_zeros(0, *x.shape[1:], dtype=dtype)
    return ScanOut(out.to(x.dtype), end, emitted)


def ssd_step(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
             state: Tensor) -> tuple[Tensor, Tensor]:
    """One token of each of B sequences: x ``[B, H, P]``, dt ``[B, H]``, A, D ``[H]``, B, C
    ``[B, G, N]``, state ``[B, H, P, N]`` -> (y ``[B, H, P]``, state)."""
    dtype = _compute_dtype(x, B, C, state)
    repeat = _heads_ratio(B.shape[1], x.shape[1])
    b, c = (t.to(dtype).repeat_interleave(repeat, 1) for t in (B, C))
    xd, dt = x.to(dtype), dt.to(dtype)
    decay = (dt * A.to(dtype)).exp()[..., None, None]
    s = state.to(dtype) * decay + (xd * dt[..., None])[..., :, None] * b[..., None, :]
    y = (s @ c[..., None])[..., 0] + D.to(dtype)[:, None] * xd
    return y.to(x.dtype), s.to(state.dtype)
