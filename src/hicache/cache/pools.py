"""Device KV pool and its page allocator.

Units: a *page* holds ``page_size`` consecutive token slots; slot = page * page_size + offset.
Page 0 is reserved: it contains slot 0, the padding slot that batches point at, so it is never
handed out and never counted as capacity.
"""

from __future__ import annotations

import logging
import math
import mmap
from dataclasses import dataclass, replace

import numpy as np
import torch

logger = logging.getLogger(__name__)


class PageAllocator:
    """Free list of device pages (page ids 1 .. num_pages-1; page 0 is reserved).

    Allocation order is a pure function of the alloc/free sequence, so ranks that apply the
    same operations hand out the same page ids (DESIGN invariant 3).
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError("a page allocator needs at least one usable page besides the reserved page 0")
        self.num_pages = num_pages
        self.capacity = num_pages - 1  # usable pages (excludes the reserved page 0)
        self._free = np.arange(1, num_pages, dtype=np.int64)

    @property
    def available(self) -> int:
        return len(self._free)

    def alloc(self, n: int, first_position: int = 0, anchor: int = 0) -> np.ndarray | None:
        """``n`` page ids, or None (and no change) when fewer than ``n`` are free. (Any page
        serves any position here; ``first_position`` and ``anchor`` matter to a sharded
        allocator only.)"""
        if n < 0:
            # Fix: a negative n used to slice ``_free[:n]`` and hand out all but |n| free pages.
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        pages, self._free = self._free[:n], self._free[n:]
        return pages

    def free(self, pages: np.ndarray) -> None:
        if len(pages):
            self._free = np.concatenate([self._free, np.asarray(pages, dtype=np.int64)])

    def reset(self) -> None:
        self._free = np.arange(1, self.num_pages, dtype=np.int64)


class SharedWindowAllocator:
    """Window page ids of a shared pool (issue 56): each id stands for one block of the block
    ``allocator`` (the full pages' own) per sliding group, through ``table[w, k]`` (row 0: the
    padding block 0). Has :class:`PageAllocator`'s interface: ``available`` is the window pages
    the free blocks (and ids) could hold. Order is a pure function of the alloc/free sequence."""

    def __init__(self, blocks: PageAllocator, table: np.ndarray) -> None:
        self.blocks, self.table, self.groups = blocks, table, table.shape[1]
        self.ids = PageAllocator(table.shape[0])
        self.capacity = self.ids.capacity

    @property
    def available(self) -> int:
        return min(self.ids.available, self.blocks.available // self.groups)

    def alloc(self, n: int, first_position: int = 0, anchor: int = 0) -> np.ndarray | None:
        if n > self.available:
            return None
        ids = self.ids.alloc(n)  # (raises for n < 0)
        self.table[ids] = self.blocks.alloc(n * self.groups).reshape(n, self.groups)
        return ids

    def free(self, pages: np.ndarray) -> None:
        if len(pages):
            pages = np.asarray(pages, dtype=np.int64)
            self.blocks.free(self.table[pages].reshape(-1))
            self.table[pages] = 0
            self.ids.free(pages)


def free_held(allocator: PageAllocator | SharedWindowAllocator, pages: np.ndarray,
              where: slice | np.ndarray = slice(None)) -> int:
    """Free the held (nonzero) entries of ``pages[where]`` and zero them (tombstones). Returns how many."""
    held = pages[where]
    held = held[held != 0]
    allocator.free(held)
    pages[where] = 0
    return len(held)


def pages_to_slots(pages: np.ndarray, page_size: int, num_tokens: int | None = None) -> torch.Tensor:
    """Slots of the first ``num_tokens`` tokens stored in ``pages`` (all of them by default)."""
    pages_t = torch.as_tensor(np.asarray(pages, dtype=np.int64))
    slots = (pages_t.view(-1, 1) * page_size + torch.arange(page_size).view(1, -1)).view(-1)
    return slots if num_tokens is None else slots[:num_tokens]


def zeroed_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.zeros(shape)``; on a CPU, memory of an anonymous mapping instead: the kernel hands out
    zero pages on first touch, so a pool sized for the whole budget costs neither start-up time nor
    resident memory until tokens land in it (a 2.2 GiB pool: ~1 s less to start)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, nbytes)  # private and anonymous: zero-filled by the kernel
    return torch.frombuffer(mapping, dtype=dtype).view(shape)  # the tensor keeps the mapping alive


@dataclass(frozen=True)
class WindowLayout:
    """A hybrid pool's sliding-window part: ``layers`` (this rank's indices) of ``window`` tokens in
    ``pages`` window pages (+ the reserved page 0; 0: the pool has no window part). ``shared``:
    ``(tensor, group)`` of each layer when window pages are blocks of the full pages' tensors (issue 56);
    ``groups``: the model's sliding groups (a pipeline stage sees only its own layers; 1 unshared). The pool fills
    in ``bytes_per_page`` (its window layers' K + V of one window page) and, shared, ``blocks``:
    ``blocks[w, k]`` is the block (page) of window page w for sliding group k (see
    :class:`SharedWindowAllocator`); without (None), window page ids are the pool's own pages."""

    layers: frozenset[int]
    pages: int
    window: int
    shared: dict[int, tuple[int, int]] | None = None
    groups: int = 1
    bytes_per_page: int = 0
    blocks: np.ndarray | None = None

    def page_ids(self, blocks: PageAllocator) -> PageAllocator | SharedWindowAllocator:
        """The allocator of the window page ids: the part's own ``pages``, or shared (issue 56) ids whose
        pages take ``groups`` blocks each of the full pages' allocator ``blocks``."""
        return PageAllocator(self.pages) if self.blocks is None else SharedWindowAllocator(blocks, self.blocks)

    def rows(self, window_pages: np.ndarray, group: int) -> np.ndarray:
        """The pages of the pool that hold ``window_pages`` for sliding ``group``."""
        pages = np.asarray(window_pages, dtype=np.int64)
        return pages if self.blocks is None else self.blocks[pages, group]

    def group(self, layer: int) -> int:
        """The sliding group whose slots ``layer`` (a window layer) reads: 0 but in a shared pool."""
        return self.shared[layer][1] - 1 if self.shared and layer in self.layers else 0

    def layer_slots(self, window_slots: torch.Tensor, layer: int) -> torch.Tensor:
        """Window layer ``layer``'s slots out of ``window_slots`` (a ``WindowHold``'s ``slots``' shape:
        ``[tokens]``, or ``[groups, tokens]`` shared: its sliding group's row)."""
        return window_slots[self.group(layer)] if window_slots.dim() == 2 else window_slots


NO_WINDOWS = WindowLayout(frozenset(), 0, 0)  # a device pool's window part where it has none


class DeviceKVPool:
    """Per-layer K and V buffers ``[slots, num_kv_heads, head_dim]`` (L1), in one or two components.

    Full-attention layers hold ``num_pages * page_size`` slots: every page's. A hybrid pool (its
    window part ``windows``: layers of ``window`` tokens in ``pages`` > 0 window pages) gives its
    sliding-window layers an allocation of their own, ``pages * page_size`` slots, addressed by window
    page ids from a second allocator: only pages inside some window still needed live there (issue 48).
    Satisfies the model's ``KVView``: ``k_buffers[i]`` is layer i's buffer in whichever component it
    belongs to.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device | str, windows: WindowLayout | None = None) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_slots = num_pages * page_size
        # (a pipeline stage without attention layers holds no buffer: these name its KV all the same;
        # the device as a tensor's, with its index: "cuda" is "cuda:<current>")
        self.dtype, self.row, self.device = dtype, (num_kv_heads, head_dim), torch.empty(0, device=device).device
        # Window pages are a deployment-wide decision: a pipeline stage without window layers keeps the
        # count (its allocator and tree decide as every other rank's) and holds no bytes for it.
        windows = windows if windows is not None and windows.pages else NO_WINDOWS
        if windows.pages and windows.window < 1:
            raise ValueError("a window component needs its window size")
        self.hybrid = windows.pages > 0  # the sliding-window layers have a component of their own
        row = (num_kv_heads, head_dim)
        layer_page = 2 * page_size * num_kv_heads * head_dim * dtype.itemsize  # one layer's K + V of one page
        self.bytes_per_page = layer_page * (num_layers - len(windows.layers))  # the full component's
        # A shared pool (issue 56): ``shared[i] = (tensor, group)`` of each layer; ``tensors`` (the model's
        # full-layer count) tensors of ``num_pages`` blocks each; a block is one page of one tensor per
        # layer of a group. Full layers are group 0 over full page ids (= block ids); sliding group k
        # reads window page w at block ``blocks[w, k - 1]``.
        shared = windows.shared
        self.windows = replace(windows, bytes_per_page=layer_page * len(windows.layers),
                               blocks=np.zeros((windows.pages, windows.groups), dtype=np.int64) if shared else None)
        if shared:
            used = sorted({t for t, _ in shared.values()})
            k = {t: zeroed_buffer((self.num_slots, *row), dtype, device) for t in used}
            v = {t: zeroed_buffer((self.num_slots, *row), dtype, device) for t in used}
            self.k_buffers = [k[shared[i][0]] for i in range(num_layers)]
            self.v_buffers = [v[shared[i][0]] for i in range(num_layers)]
            self.block_bytes = layer_page * len(used)
            logger.info("device KV pool: %d blocks x %d tokens shared by full pages and window pages (%d tensors, "
                        "%d sliding groups, %.1f MiB)", num_pages - 1, page_size, len(used), windows.groups,
                        self.block_bytes * num_pages / 2**20)
            return
        w = self.windows
        slots = [w.pages * page_size if i in w.layers else self.num_slots for i in range(num_layers)]
        self.k_buffers = [zeroed_buffer((n, *row), dtype, device) for n in slots]
        self.v_buffers = [zeroed_buffer((n, *row), dtype, device) for n in slots]
        if self.hybrid:
            logger.info("device KV pool: full layers %d pages x %d tokens (%d layers, %.1f MiB), window layers %d "
                        "pages (%d layers, %.1f MiB)", num_pages - 1, page_size, num_layers - len(w.layers),
                        self.bytes_per_page * num_pages / 2**20, w.pages - 1, len(w.layers),
                        w.bytes_per_page * w.pages / 2**20)
        else:
            logger.info("device KV pool: %d pages x %d tokens, %.1f MiB", num_pages - 1, page_size,
                        self.bytes_per_page * num_pages / 2**20)

    @property
    def total_bytes(self) -> int:
        if self.windows.shared:
            return self.block_bytes * self.num_pages
        return self.bytes_per_page * self.num_pages + self.windows.bytes_per_page * self.windows.pages

    def wait_layer(self, layer: int) -> None:
        """Nothing is ever in flight into the device pool by itself; loads wrap this view."""

    def layer_ready(self, layer: int) -> bool:
        return True
