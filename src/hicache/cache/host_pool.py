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
