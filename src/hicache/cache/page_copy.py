"""Copies of whole pages between two page-shaped views, for every direction (device <-> host).

Units are **pages**, never slots (a slot is ``page * page_size + offset``). A *page-shaped view*
is a tensor ``[num_pages, ...]`` whose dim 0 is the page id and whose rows ``t[p]`` (one page of
one layer's K or V) are contiguous; the rows themselves may be strided (``page_first`` host
layout). Both sides of a copy have the same row shape and dtype.

Invariant: after ``copy_pages(src, dst, plan)``, ``dst[plan.dst_pages[i]]`` equals
``src[plan.src_pages[i]]`` bit for bit for every ``i``, and no other page of ``dst`` changed.

How: a :class:`PagePlan` (cut once per transfer, reused for every layer) splits the page lists
into runs that are consecutive on both sides, each copied as one slice, and the rest, moved by
one gather into a contiguous buffer and one scatter from it. On CPU the slices, gather and
scatter are numpy copies of opaque page-sized items: one ``memmove`` per page on one thread, GIL
released (torch's CPU ``index_copy_`` moves one element at a time and ran at ~0.2x memcpy; its
multi-threaded copies stall when the cores are busy). Between a GPU and host memory the device
side is always staged: a backup gathers its pages into a device staging buffer (one
``index_select``, at HBM speed) and copies it to the host in one DMA per run of consecutive host
pages; a load copies each host run into the staging buffer and scatters it with one
``index_copy_``. Host memory is read and written only in whole runs (pinned: asynchronous, at
the link's speed), whatever order the device pages are in. All of it is on the caller's current
stream.
"""

from __future__ import annotations

from typing import Union

import numpy as np
import torch

# Shorter runs go through the gather/scatter: a slice copy costs a few microseconds of Python
# (a launch on CUDA), more than moving a few pages with the batched copy.
MIN_RUN = 4

# A page-shaped view, or (CPU only) its page_items() array.
PageBuf = Union[torch.Tensor, np.ndarray]


class PagePlan:
    """``dst_pages[i] <- src_pages[i]`` cut into ``runs`` ``(src_start, dst_start, length)`` of at
    least ``min_run`` pages consecutive on both sides, and the remaining pages ``src_rest`` /
    ``dst_rest`` (same order as given). Destination pages must be distinct."""

    def __init__(self, src_pages: np.ndarray, dst_pages: np.ndarray, min_run: int = MIN_RUN) -> None:
        src = np.asarray(src_pages, dtype=np.int64).reshape(-1)
        dst = np.asarray(dst_pages, dtype=np.int64).reshape(-1)
        if len(src) != len(dst):
            raise ValueError(f"page lists differ in length: {len(src)} source vs {len(dst)} destination pages")
        if len(src) and (src.min() < 0 or dst.min() < 0):
            raise IndexError("negative page id")
        if len(np.unique(dst)) != len(dst):
            raise ValueError("destination pages repeat")
        self.num_pages = len(src)
        self.src_end = int(src.max()) + 1 if len(src) else 0  # one past the largest page touched
        self.dst_end = int(dst.max()) + 1 if len(dst) else 0
        breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
        starts = np.concatenate([[0], breaks]).astype(np.int64) if len(src) else np.zeros(0, np.int64)
        lengths = np.diff(np.concatenate([starts, [len(src)]]))
        long = lengths >= max(1, min_run)
        self.runs = [(int(src[a]), int(dst[a]), int(n)) for a, n in zip(starts[long], lengths[long])]
        rest = np.repeat(~long, lengths)
        self.src_rest, self.dst_rest = src[rest], dst[rest]
        self.src_pages, self.dst_pages = src, dst
        self._indices: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._side_runs: dict[tuple[bool, int | None], list[tuple[int, int, int]]] = {}

    def index(self, name: str, device: torch.device) -> torch.Tensor:
        """Page list ``name`` (``src_rest``, ``dst_pages``, ...) as an int64 tensor on ``device``, made once."""
        key = (name, device)
        if key not in self._indices:
            index = torch.as_tensor(getattr(self, name))
            if device.type == "cuda":  # from pinned memory the copy is queued, not a sync of the copy stream
                index = index.pin_memory()
            self._indices[key] = index.to(device, non_blocking=device.type == "cuda")
        return self._indices[key]

    def side_runs(self, dst_side: bool, chunk: int | None = None) -> list[tuple[int, int, int]]:
        """The pages cut into runs consecutive on one side only: ``(position, first page, length)``,
        covering every position in order (a run may be one page), also cut where a ``chunk`` of
        positions ends (a staging buffer of ``chunk`` pages); cut once, reused by every layer."""
        key = (dst_side, chunk)
        if key not in self._side_runs:
            pages = self.dst_pages if dst_side else self.src_pages
            breaks = np.diff(pages, prepend=pages[:1] - 2) != 1  # a run starts where +1 breaks
            if chunk:
                breaks[::chunk] = True
            starts = np.flatnonzero(breaks)
            lengths = np.diff(np.append(starts, len(pages)))
            self._side_runs[key] = [(int(a), int(pages[a]), int(n)) for a, n in zip(starts, lengths)]
        return self._side_runs[key]


def copy_pages(src: PageBuf, dst: PageBuf, plan: PagePlan, staging: torch.Tensor | None = None,
               non_blocking: bool = False) -> None:
    """``dst[plan.dst_pages] = src[plan.src_pages]`` over page-shaped views (see the module doc).

    CPU views may be given as their :func:`page_items` instead, made once by a caller that copies
    between the same buffers often (it saves ~10 us a call). ``staging``: an optional reusable
    buffer of page rows for the gather when a GPU is involved: ``[k, *row]`` on the device between
    a device and host memory (any k: the op goes through k pages at a time), ``[>= len(plan.src_rest),
    *row]`` between two views on one device (fresh memory when None). ``non_blocking``: CUDA slice copies may return early
    (the host side is pinned); the caller synchronizes its stream before anyone reads ``dst``.
    """
    if plan.num_pages == 0:
        return
    if plan.src_end > len(src) or plan.dst_end > len(dst):
        raise IndexError(f"pages out of range: {plan.src_end} > {len(src)} or {plan.dst_end} > {len(dst)}")
    if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and (
            src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype):
        raise ValueError(f"page rows differ: {tuple(src.shape[1:])} {src.dtype} vs {tuple(dst.shape[1:])} {dst.dtype}")
    if _on_cpu(src) and _on_cpu(dst):
        s, d = (b if isinstance(b, np.ndarray) else page_items(b) for b in (src, dst))
        if s.dtype != d.dtype:  # numpy would pad or cut items of another size
            raise ValueError(f"page rows differ: {s.dtype.itemsize} vs {d.dtype.itemsize} bytes")
        for a, b, k in plan.runs:
            d[b : b + k] = s[a : a + k]
        if len(plan.src_rest):
            d[plan.dst_rest] = s[plan.src_rest]  # gather into a temporary, scatter from it
        return
    assert isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)
    if src.device != dst.device:
        copy_staged(src, dst, plan, to_host=_on_cpu(dst), staging=staging, non_blocking=non_blocking)
        return
    for a, b, k in plan.runs:
        dst[b : b + k].copy_(src[a : a + k], non_blocking=non_blocking)
    n = len(plan.src_rest)
    if n == 0:
        return
    out = staging[:n] if staging is not None else None
    rows = torch.index_select(src, 0, plan.index("src_rest", src.device), out=out)
    dst.index_copy_(0, plan.index("dst_rest", dst.device), rows)


def copy_staged(src: torch.Tensor, dst: torch.Tensor, plan: PagePlan, to_host: bool,
                staging: torch.Tensor | None = None, non_blocking: bool = False) -> None:
    """Between a device and host memory (``to_host``: ``dst`` is the host side): the device side
    gathered into (or scattered from) ``staging`` in plan order, a buffer's worth of pages at a
    time, the host side moved in runs of consecutive host pages. Any two page-shaped views work
    (the tests run it CPU to CPU). Stream order keeps a chunk's gather behind the copies of the
    chunk before it in the same buffer."""
    device = src.device if to_host else dst.device
    n = plan.num_pages
    if n == 0:
        return
    if staging is None:
        staging = torch.empty((n, *src.shape[1:]), dtype=src.dtype, device=device)
    chunk = staging.shape[0]
    device_pages = plan.index("src_pages" if to_host else "dst_pages", device)
    runs = iter(plan.side_runs(to_host, chunk))
    for first in range(0, n, chunk):
        rows, index = staging[: min(chunk, n - first)], device_pages[first : first + chunk]
        if to_host:
            torch.index_select(src, 0, index, out=rows)
        for at, page, k in _runs_upto(runs, first + len(rows)):
            if to_host:
                dst[page : page + k].copy_(rows[at - first : at - first + k], non_blocking=non_blocking)
            else:
                rows[at - first : at - first + k].copy_(src[page : page + k], non_blocking=non_blocking)
        if not to_host:
            dst.index_copy_(0, index, rows)


def _runs_upto(runs, end: int):
    """The runs from ``runs`` (an iterator, cut at chunk ends) that start before position ``end``."""
    for run in runs:
        yield run
        if run[0] + run[2] >= end:
            return


def cpu_page_arrays(a: torch.Tensor, b: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Two CPU page-shaped views as the arrays :func:`copy_pages` moves fastest: their page
    items when both have contiguous rows; else both as strided numpy arrays of elements (a
    page_unified host layer with several head groups), which numpy copies a contiguous inner
    row at a time."""
    if all(len(t) == 0 or t[0].is_contiguous() for t in (a, b)):
        return page_items(a), page_items(b)
    # elements as integers of the same size (numpy has no bfloat16)
    return tuple(t.view(_BITS[t.element_size()]).numpy() for t in (a, b))


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def page_items(t: torch.Tensor) -> np.ndarray:
    """A CPU page-shaped view as a 1-D numpy array sharing its memory, one opaque item (the
    page's bytes) per page; raises if a page's row is not contiguous."""
    flat = t.view(t.shape[0], -1).view(torch.uint8).numpy()
    return flat.view(np.dtype((np.void, flat.shape[1])))[:, 0]


def _on_cpu(buf: PageBuf) -> bool:
    return isinstance(buf, np.ndarray) or buf.device.type == "cpu"
