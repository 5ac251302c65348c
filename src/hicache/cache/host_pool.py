"""L2: the host KV pool and its page layouts.

Units: host pages hold ``page_size`` tokens of every layer's K and V, like device pages.
Page 0 is reserved here too, so host and device page ids obey the same rules.

Layouts (``--hicache-mem-layout``):

* ``layer_first``: ``[layer, K/V, page, token_in_page, kv_head, head_dim]`` - a layer of many
  pages is contiguous, like the device pool.
* ``page_first``: ``[page, layer, K/V, token_in_page, kv_head, head_dim]`` - one page of all
  layers is contiguous, which is what storage objects are cut from.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from ..config import ConfigError
from ..device import available_host_memory
from .pools import DeviceKVPool

logger = logging.getLogger(__name__)

LAYOUTS = ("layer_first", "page_first")


class HostKVPool:
    def __init__(self, device_pool: DeviceKVPool, num_pages: int, layout: str = "layer_first",
                 pin_memory: bool | None = None) -> None:
        if layout not in LAYOUTS:
            raise ConfigError(f"--hicache-mem-layout must be one of {', '.join(LAYOUTS)}.")
        k0 = device_pool.k_buffers[0]
        self.layout = layout
        self.page_size = device_pool.page_size
        self.num_layers = len(device_pool.k_buffers)
        self.num_pages = num_pages
        self.dtype = k0.dtype
        self.bytes_per_page = device_pool.bytes_per_page
        needed = self.bytes_per_page * num_pages
        available = available_host_memory()
        if needed > 0.9 * available:
            raise ConfigError(
                f"the host KV pool needs {needed / 2**30:.2f} GiB but only {available / 2**30:.2f} GiB of host "
                "memory is available; lower --hicache-ratio or --hicache-size."
            )
        row = (self.page_size,) + tuple(k0.shape[1:])
        shape = ((self.num_layers, 2, num_pages) if layout == "layer_first" else (num_pages, self.num_layers, 2)) + row
        # Pinned memory makes CUDA copies asynchronous; the CPU build of torch cannot pin.
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.buffer = torch.empty(shape, dtype=self.dtype, pin_memory=pin)
        self.pinned = pin
        logger.info("host KV pool: %d pages x %d tokens, %s, %.1f MiB%s", num_pages - 1, self.page_size, layout,
                    needed / 2**20, " pinned" if pin else "")

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_page * self.num_pages

    def page_view(self, layer: int, kv: int) -> torch.Tensor:
        """``[num_pages, page_size, kv_heads, head_dim]`` view of one layer's K (0) or V (1)."""
        if self.layout == "layer_first":
            return self.buffer[layer, kv]
        return self.buffer[:, layer, kv]


def device_page_view(buf: torch.Tensor, page_size: int) -> torch.Tensor:
    """A device layer buffer ``[slots, heads, dim]`` seen as ``[pages, page_size, heads, dim]``."""
    return buf.view(-1, page_size, *buf.shape[1:])


def page_runs(src_pages: np.ndarray, dst_pages: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs ``(src_start, dst_start, length)`` where both page lists are consecutive."""
    src, dst = np.asarray(src_pages, dtype=np.int64), np.asarray(dst_pages, dtype=np.int64)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(src)]])
    return [(int(src[a]), int(dst[a]), int(b - a)) for a, b in zip(starts, ends)]


def copy_pages(src: torch.Tensor, src_pages: torch.Tensor, dst: torch.Tensor, dst_pages: torch.Tensor,
               staging: torch.Tensor | None = None, runs: list[tuple[int, int, int]] | None = None) -> None:
    """``dst[dst_pages] = src[src_pages]`` over page-shaped views.

    With ``runs`` (few consecutive spans, as the allocators usually hand out) each span is one
    direct copy; otherwise one gather into ``staging`` (a reusable buffer on the source device;
    fresh memory when None) and one scatter.
    """
    if runs is not None:
        for s, d, n in runs:
            dst[d : d + n].copy_(src[s : s + n])
        return
    n = len(src_pages)
    rows = torch.index_select(src, 0, src_pages, out=staging[:n]) if staging is not None \
        else src.index_select(0, src_pages)
    if src.device != dst.device:  # one blocking transfer between the gather and the scatter
        rows = rows.to(dst.device)
    dst.index_copy_(0, dst_pages, rows)


def as_index(pages: np.ndarray) -> torch.Tensor:
    return torch.as_tensor(np.asarray(pages, dtype=np.int64))
