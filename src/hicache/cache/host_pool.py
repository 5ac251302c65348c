"""L2: the host KV pool and its page layouts.

Units: host pages hold ``page_size`` tokens of every layer's K and V, like device pages.
Page 0 is reserved here too, so host and device page ids obey the same rules.

Layouts (``--hicache-mem-layout``):

* ``layer_first``: ``[layer, K/V, page, token_in_page, kv_head, head_dim]`` - a layer of many
  pages is contiguous, like the device pool.
* ``page_first``: ``[page, layer, K/V, token_in_page, kv_head, head_dim]`` - one page of all
  layers is contiguous, which is what rank-suffix storage objects are.
* ``page_unified`` (chosen by the unified key scheme, :mod:`.storage.unified`): a page's unified
  storage objects are contiguous slices of it, so they are written and read in place.
  MHA ``[page, head_group, layer, K/V, token_in_page, head_in_group, head_dim]`` (``cell_heads``
  heads per group); MLA (``cell_heads=0``) ``[page, layer, token_in_page, K/V, 1, head_dim]``,
  the latent's two halves side by side per token. A layer's K or V page is then strided.

A hybrid device pool's host tier (issue 48, docs/hybrid_kv.md) is either two pools (the full
layers' for every host page, ``window_pool`` the window layers' for checkpoints, each with page ids
of its own) or, over a shared device pool (issue 56), one pool of *blocks* like the device's: a
block is one page of the device pool's G tensors; a host full page is one block, a host window page
one block per sliding group (``windows.blocks[w, k]``), both drawn from one allocator
(:class:`~.pools.SharedWindowAllocator`), so the host byte budget goes where demand is.
"""

from __future__ import annotations

import logging
import math
import weakref
from dataclasses import replace

import numpy as np
import torch

from ..config import ConfigError
from ..device import available_host_memory
from .pools import NO_WINDOWS, DeviceKVPool, WindowLayout

logger = logging.getLogger(__name__)

LAYOUTS = ("layer_first", "page_first", "page_unified")


class HostKVPool:
    def __init__(self, device_pool: DeviceKVPool, num_pages: int, layout: str = "layer_first",
                 pin_memory: bool | None = None, cell_heads: int | None = None,
                 layers: tuple[int, ...] | None = None, window_ids: int = 0) -> None:
        """``cell_heads``: page_unified only -- KV heads per storage object (0: an MLA latent).
        ``layers``: the device pool's layers this pool holds, in order (default: all); a hybrid
        pool's full layers and its window layers each have a host pool of their own.
        ``window_ids``: a shared device pool's host pool of ``num_pages`` blocks (+ block 0) with
        this many window page ids (+ id 0); it holds every layer (``layers``: the full ones)."""
        if layout not in LAYOUTS:
            raise ConfigError(f"--hicache-mem-layout must be one of {', '.join(LAYOUTS)}.")
        self.layout = layout
        self.page_size = device_pool.page_size
        self.layers = tuple(range(len(device_pool.k_buffers))) if layers is None else tuple(layers)
        self.num_pages = num_pages
        self.dtype = device_pool.dtype
        layer_page = 2 * self.page_size * math.prod(device_pool.row) * self.dtype.itemsize  # one layer's K + V of a page
        self.shared = bool(window_ids)  # full pages and window pages are blocks of this one pool
        # Its window part (``windows``): shared, the device's with ``window_ids`` ids over its blocks; else its
        # own pages (what a window pool of its own holds). The host layer (row) of each device layer held; a
        # shared pool's rows are the device pool's tensors.
        if window_ids:
            windows = device_pool.windows  # (of shared blocks: core.py asks for window ids only then)
            tensors = sorted({t for t, _ in windows.shared.values()})
            self.rows = {i: tensors.index(t) for i, (t, _) in windows.shared.items()}
            self.num_layers = len(tensors)
            blocks = np.zeros((window_ids, windows.groups), dtype=np.int64)
            self.windows: WindowLayout = replace(windows, pages=window_ids, blocks=blocks)
        else:
            self.rows = {i: j for j, i in enumerate(self.layers)}
            self.num_layers = len(self.layers)
            self.windows = replace(NO_WINDOWS, pages=num_pages, bytes_per_page=layer_page * self.num_layers)
        self.bytes_per_page = layer_page * self.num_layers  # a shared pool's: a block's
        # A hybrid device pool's host pool of its window layers (checkpoints only): another pool of its
        # own page ids (two pools), this one (shared blocks), None (no window layers).
        self.window_pool: HostKVPool | None = self if window_ids else None
        self.total_bytes = self.bytes_per_page * num_pages
        available = available_host_memory()
        if self.total_bytes > 0.9 * available:
            raise ConfigError(f"the host KV pool needs {self.total_bytes / 2**30:.2f} GiB but only "
                              f"{available / 2**30:.2f} GiB of host memory is available; lower --hicache-ratio or "
                              "--hicache-size.")
        self.cell_heads = cell_heads
        shape = self._shape(layout, num_pages, self.num_layers, self.page_size, *device_pool.row)
        # Pinned memory makes CUDA copies asynchronous; the CPU build of torch cannot pin.
        self.pinned = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.buffer = pinned_empty(shape, self.dtype) if self.pinned else torch.empty(shape, dtype=self.dtype)
        if window_ids:
            logger.info("host KV pool: %d blocks x %d tokens shared by full pages and window pages (%d tensors, %d "
                        "sliding groups), %s, %.1f MiB%s", num_pages - 1, self.page_size, self.num_layers,
                        device_pool.windows.groups, layout, self.total_bytes / 2**20, " pinned" if self.pinned else "")
        else:
            logger.info("host KV pool: %d pages x %d tokens, %s, %.1f MiB%s", num_pages - 1, self.page_size, layout,
                        self.total_bytes / 2**20, " pinned" if self.pinned else "")

    def _shape(self, layout: str, pages: int, layers: int, tokens: int, heads: int, dim: int) -> tuple[int, ...]:
        if layout == "layer_first":
            return layers, 2, pages, tokens, heads, dim
        if layout == "page_first":
            return pages, layers, 2, tokens, heads, dim
        if self.cell_heads is None or (self.cell_heads and heads % self.cell_heads) or (not self.cell_heads
                                                                                         and heads != 1):
            raise ValueError(f"page_unified needs the KV heads per object dividing the pool's {heads} "
                             f"(0 for one MLA latent), got {self.cell_heads}")
        if self.cell_heads == 0:
            return pages, layers, tokens, 2, 1, dim
        return pages, heads // self.cell_heads, layers, 2, tokens, self.cell_heads, dim

    def page_view(self, layer: int, kv: int) -> torch.Tensor:
        """One layer's K (0) or V (1) pages, ``[num_pages, page_size, kv_heads, head_dim]``; with
        several head groups per page_unified page ``[num_pages, page_size, group, head_in_group,
        head_dim]`` (a device page viewed so has the same elements in the same order)."""
        if self.layout == "layer_first":
            return self.buffer[layer, kv]
        if self.layout == "page_first":
            return self.buffer[:, layer, kv]
        if self.cell_heads == 0:
            return self.buffer[:, layer, :, kv]
        if self.buffer.shape[1] == 1:  # one group: rows contiguous, as page_first
            return self.buffer[:, 0, layer, kv]
        return self.buffer[:, :, layer, kv].permute(0, 2, 1, 3, 4)

    def cell(self, host_page: int, layers: slice, group: int | None) -> torch.Tensor:
        """page_unified: layers ``layers`` of head group ``group`` (None: the MLA latent) of one
        page -- one unified storage object's bytes, contiguous (a view)."""
        assert self.layout == "page_unified"
        page = self.buffer[host_page]
        return page[layers] if group is None else page[group, layers]


def device_page_view(buf: torch.Tensor, page_size: int) -> torch.Tensor:
    """A device layer buffer ``[slots, heads, dim]`` seen as ``[pages, page_size, heads, dim]``."""
    return buf.view(-1, page_size, *buf.shape[1:])


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Page-locked host memory of exactly ``shape``: ordinary memory registered with the CUDA
    driver (as SGLang's host pool does) and unregistered when the tensor is collected. torch's own
    pinned allocator rounds a request up to a power of two (a 40 GiB pool would pin 64 GiB); it
    is the fallback where registering fails."""
    buf = torch.empty(shape, dtype=dtype)
    try:
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(buf.data_ptr(), buf.numel() * buf.element_size(), 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister returned {err}")
    except Exception as e:  # noqa: BLE001 - any failure: torch's allocator still pins
        logger.warning("host KV pool: registering %.1f MiB with CUDA failed (%s); pinning through torch's "
                       "allocator (rounded up to a power of two)", buf.numel() * buf.element_size() / 2**20, e)
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    unregister = weakref.finalize(buf, cudart.cudaHostUnregister, buf.data_ptr())
    unregister.atexit = False  # at exit the process's memory and CUDA context go anyway
    return buf
