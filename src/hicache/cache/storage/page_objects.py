"""The storage objects one host page is cut into, and how each is cut out and put back.

* :class:`WholePage` -- the rank-suffix scheme: one object holds the page of every layer and
  KV head this rank's pool holds (``suffix``: a sidecar pool's objects, e.g. ``-sidecar1``).
* :class:`GridCell` -- the unified scheme (:mod:`.unified`): one object per grid cell, the
  cell's model-global layers and KV heads of this rank's host page laid out as the cell's object
  (MHA ``(layer, K/V, token, head_in_group, head_dim)``; MLA ``(layer, token, dim)``): in a
  ``page_unified`` host pool a contiguous slice of the page, written and read in place; in
  another layout cut out (one gathering copy) and scattered back.

Either way an object's bytes are produced by :meth:`page_bytes` and put back by :meth:`load`,
and its key is a function of the page hash (and, for grid cells, the namespace digest).
"""

from __future__ import annotations

import warnings
from typing import Sequence

import torch

from ..host_pool import HostKVPool
from .base import StorageBackend
from .keys import object_key
from .objects import decode_checked, encode
from .unified import Cell, StorageGrid

NAMESPACE_KEY_HEX = 16  # hex chars of the namespace digest in a unified key
DRAFT_PREFIX = "draft_"  # a speculative draft's cells: {page_hash}_{digest}_draft_L{a}-{b}[_H{g}]
WINDOW_SUFFIX = "_swa"  # a hybrid page's window layers of a cell: {page_hash}_{digest}_L{a}-{b}[_H{g}]_swa


def write_pages(backend: StorageBackend, objects: Sequence[PageObject], ns_digest: bytes, hashes: list[bytes],
                pages: Sequence[tuple[int, int]], batch_pages: int | None = None) -> tuple[int, int]:
    """Write ``pages`` ((index into ``hashes``, host page) pairs, each page's ``objects`` side by side),
    ``batch_pages`` pages a call (None: all in one), until a call stores short: (leading pages stored
    whole, their bytes). No objects (another rank writes them all): no call, every page counts as written."""
    n, step = len(objects), batch_pages or max(len(pages), 1)
    if not n:
        return len(pages), 0
    written = nbytes = 0
    for at in range(0, len(pages), step):
        batch = pages[at : at + step]
        blobs = [encode(ns_digest, hashes[i], obj.page_bytes(int(h))) for i, h in batch for obj in objects]
        stored = backend.batch_set([obj.key(hashes[i], ns_digest) for i, _ in batch for obj in objects], blobs) // n
        written += stored
        nbytes += sum(len(b) for b in blobs[: stored * n])
        if stored * n < len(blobs):
            break
    return written, nbytes


def read_pages(backend: StorageBackend, objects: Sequence[PageObject], ns_digest: bytes, hashes: list[bytes],
               pages: Sequence[tuple[int, int]]) -> tuple[int, str, int]:
    """Read ``pages`` ((index into ``hashes``, host page) pairs), each page's ``objects``, into their
    host pages in one call: (how many leading pages arrived intact, "" when all did, else why the
    next did not (``missing``, ``checksum``, ...: a :class:`~.objects.DecodeStatus`), bytes read)."""
    n = len(objects)
    blobs = backend.batch_get([obj.key(hashes[i], ns_digest) for i, _ in pages for obj in objects])
    for j, (i, host_page) in enumerate(pages):
        for obj, blob in zip(objects, blobs[j * n : (j + 1) * n]):
            payload, status = decode_checked(blob, ns_digest, hashes[i])
            if payload is None:
                return j, status.value, 0
            obj.load(int(host_page), payload)
    return len(pages), "", sum(len(b) for b in blobs)


def _page(host: HostKVPool, host_page: int) -> torch.Tensor:
    """One host page as ``[layers, K/V, token, kv_heads, head_dim]`` (a view; page_first or
    layer_first: page_unified pages are cut into grid cells only)."""
    if host.layout == "page_unified":
        raise ValueError("a page_unified host page is read and written as grid cells, not whole")
    return host.buffer[host_page] if host.layout == "page_first" else host.buffer[:, :, host_page]


class PageObject:
    """One storage object of every host page: its key, and its payload, views of the page laid side
    by side (:meth:`_views`), written from them (one gathering copy, none for one contiguous view)
    and read back into them."""

    host: HostKVPool

    def key(self, page_hash: bytes, ns_digest: bytes) -> str:
        raise NotImplementedError

    def _views(self, host_page: int) -> list[torch.Tensor]:
        raise NotImplementedError

    def page_bytes(self, host_page: int) -> memoryview:
        """The object's payload (a view: valid while the host page is held for the write): the
        views' bytes in their logical order, the one view itself when contiguous (the object
        encoder copies them once, into the object), else one gathering copy."""
        views = self._views(host_page)
        t = views[0] if len(views) == 1 else torch.stack(views)
        return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())

    def load(self, host_page: int, payload: memoryview) -> None:
        views = self._views(host_page)
        with warnings.catch_warnings():  # read-only source: torch warns, but we only read from it
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(payload, dtype=torch.uint8).view(self.host.dtype).view(len(views), *views[0].shape)
        for dst, rows in zip(views, src):
            dst.copy_(rows)


class WholePage(PageObject):
    """Every layer and head of one rank's host page in one object, ``<page hash hex><suffix>``."""

    def __init__(self, host: HostKVPool, suffix: str = "") -> None:
        self.host, self.suffix = host, suffix

    def key(self, page_hash: bytes, ns_digest: bytes) -> str:
        return object_key(page_hash) + self.suffix

    def _views(self, host_page: int) -> list[torch.Tensor]:
        return [_page(self.host, host_page)]


class WindowBlocks(WholePage):
    """A hybrid page's window layers from a host pool of shared blocks (issue 56), ``<page hash
    hex><suffix>``: each window layer's K and V from its sliding group's block of the host window
    page, laid out as :class:`WholePage` lays out a page of a window host pool of its own (the same
    bytes under the same key, whichever host pool wrote them); made by :func:`window_object`."""

    def _views(self, window_page: int) -> list[torch.Tensor]:
        """Each window layer's ``[K/V, token, kv_heads, head_dim]`` of ``window_page`` (views)."""
        host, windows = self.host, self.host.windows
        blocks = windows.blocks[window_page]
        return [_page(host, int(blocks[windows.group(i)]))[host.rows[i]] for i in sorted(windows.layers)]


def window_object(host: HostKVPool, suffix: str) -> PageObject:
    """The object of a checkpoint page's window layers in ``host`` (a hybrid pool's window host pool)."""
    return WindowBlocks(host, suffix) if host.shared else WholePage(host, suffix)


class GridCell(PageObject):
    """One cell of ``grid`` (the unified grid) of this rank's host pages. ``first_layer`` /
    ``first_head``: the model-global indices of the pool's first layer and KV head; with
    ``grid.mla`` the pool's one "head" is an MLA latent split over the K and V buffers;
    ``prefix``: :data:`DRAFT_PREFIX` for a speculative draft's cells (the pool's layers at
    ``first_layer``'s offset may then follow the target's: a negative ``first_layer``)."""

    def __init__(self, host: HostKVPool, cell: Cell, grid: StorageGrid, first_layer: int, first_head: int,
                 prefix: str = "", layers: slice | None = None, suffix: str = "") -> None:
        """``layers``: the cell's rows in ``host`` when not a plain offset (a hybrid pool's full or
        window layers, each a host pool of its own); ``suffix``: after the cell's (a hybrid page's
        window component: :data:`WINDOW_SUFFIX`)."""
        heads = grid.heads_of(cell)
        self.host, self.cell, self.mla, self.prefix, self.suffix = host, cell, grid.mla, prefix, suffix
        self.layers = layers if layers is not None else slice(cell.layer_start - first_layer, cell.layer_end - first_layer)
        self.heads = slice(heads.start - first_head, heads.stop - first_head)
        self.group: int | None = None  # the cell's head group in a page_unified host page
        if host.layout == "page_unified" and not self.mla:
            if self.heads.start % host.cell_heads or len(heads) != host.cell_heads:
                raise ValueError(f"cell {cell.suffix} is not one of the host pool's groups of {host.cell_heads} heads")
            self.group = self.heads.start // host.cell_heads

    def key(self, page_hash: bytes, ns_digest: bytes) -> str:
        return f"{object_key(page_hash)}_{ns_digest.hex()[:NAMESPACE_KEY_HEX]}_{self.prefix}{self.cell.suffix}{self.suffix}"

    def _views(self, host_page: int) -> list[torch.Tensor]:
        if self.host.layout == "page_unified":  # a contiguous slice of the page: written and read in place
            return [self.host.cell(host_page, self.layers, self.group)]
        view = _page(self.host, host_page)[self.layers, :, :, self.heads, :]  # [layer, K/V, token, head, dim]
        # MLA: (layer, token, [K half, V half]) = (layer, token, dim)
        return [view[:, :, :, 0, :].permute(0, 2, 1, 3) if self.mla else view]
