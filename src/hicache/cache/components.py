"""KV components: the kinds of cached state one rank holds, and what each tier does with them.

A component is a named kind of per-token state over a set of this rank's layers: its row (KV
heads x head dim, K and V each), the page space its rows live in, which pages of a sequence it
retains, what the host (L2) and storage (L3) tiers keep of it, and what prefill/decode
disaggregation sends of it. The model (and the speculative draft config) declare which
components a rank has (:func:`hicache.runtime.rank_plan.rank_components`); the rank plan sizes
every pool from their bytes.

Read this module first: docs/architecture.md opens with the table of components x modes.

Units: a page is ``page_size`` tokens; rows are one token of one layer; bytes are this rank's.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Retention(str, Enum):
    """Which pages of a cached sequence a component keeps."""

    EVERY_PAGE = "every page"  # a hit may end at any page boundary
    WINDOW = "window"  # pages inside the window of a checkpoint or of a running request's tail
    CHECKPOINTS = "checkpoints"  # a state snapshot at some boundaries only: prompts' checkpoints, branch points


class PageSpace(str, Enum):
    """Where a component's rows live, and which ids address them."""

    PAGES = "pages"  # the device pool's own pages (the radix tree's page ids)
    WINDOW_PAGES = "window pages"  # a pool of its own, addressed by window page ids
    BLOCKS = "blocks"  # window page ids, one block of the shared pool per sliding group
    SIDECAR = "sidecar"  # a pool of its own, addressed by the tree's page ids
    STATE_SLOTS = "state slots"  # a pool of its own, one slot per sequence (not per page): recurrent layers


@dataclass(frozen=True)
class KVComponent:
    """One kind of cached state on this rank (see the module docstring)."""

    name: str  # "full", "window", "latent", "draft", "draft-sidecar", "recurrent_state"
    layers: int  # this rank's layers that hold it
    row: tuple[int, int]  # (KV heads, head dim) of one token of one layer, K and V each; (0, 0): no per-token rows
    space: PageSpace = PageSpace.PAGES
    retention: Retention = Retention.EVERY_PAGE
    window: int = 0  # tokens (Retention.WINDOW)
    host: str = "every page"  # what the host tier (L2) keeps of it
    storage: str = "its layers in each page's object"  # what storage (L3) keeps
    pd: str = "the prompt after decode_prefix_len"  # what a prefill server sends of it
    slot_bytes: int = 0  # PageSpace.STATE_SLOTS: one sequence's state over its layers

    def bytes_per_page(self, page_size: int, elem: int) -> int:
        """Bytes of one page of this component (K and V, every layer; 0 for a state: it costs per slot)."""
        return 2 * self.layers * self.row[0] * self.row[1] * elem * page_size

    def describe(self) -> str:
        kept = f"{self.retention.value} of {self.window} tokens" if self.retention is Retention.WINDOW \
            else self.retention.value
        shape = f"{self.slot_bytes / 2**10:.1f} KiB a slot" if self.space is PageSpace.STATE_SLOTS \
            else f"{self.row[0]}x{self.row[1]}"
        return f"{self.name} ({self.layers} layers x {shape}, {self.space.value}, {kept})"

    def summary(self) -> dict[str, object]:
        """What ``/stats`` shows of it."""
        return {"name": self.name, "layers": self.layers, "row": list(self.row), "space": self.space.value,
                "retention": self.retention.value, "window_tokens": self.window, "host": self.host,
                "storage": self.storage, "pd": self.pd, **({"slot_bytes": self.slot_bytes} if self.slot_bytes else {})}
