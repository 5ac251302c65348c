"""The window component's part of a P/D transfer (a hybrid pool, docs/hybrid_kv.md): its sliding
layers' rows cross from the first token of the prompt's fresh SWA tail on (the window its first
decode step and its prompt's checkpoint read), whatever ``decode_prefix_len`` is (the full layers
may hold more prefix than the windows). The only code that knows it: the disagg modules loop over
the parts of a job, an ask, a Mooncake target and an answer (by component name).

On the wire, the fields of the previous version byte for byte: an ask's ``window_start`` and
``window_layers``; its Mooncake target's ``window_pages`` (the tail's pages, one list per sliding
group: one list with two pools) and ``window_groups`` (each asked layer's group); the answer
header echoes ``window_start``.

Units: tokens of the prompt; pages of ``page_size`` tokens; layers are the pool's indices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..cache.pools import DeviceKVPool
from .fields import MAX_TOKENS, WireError, int_list, integer

WINDOW = "window"

Rows = tuple[int, torch.Tensor]  # a layer's rows: (first token, the slot of every token of the prompt)


@dataclass(frozen=True)
class Tail:
    """A job's window rows: the prompt's tokens from ``start`` on (prefill: held from there; decode:
    asked from there) at ``slots`` (per token; ``[groups, tokens]`` on shared blocks: a row per
    sliding group)."""

    start: int
    slots: torch.Tensor


@dataclass(frozen=True)
class TailPages:
    """A Mooncake target's window part: the decode pool's pages of the tail per sliding group, and
    each asked layer's group (in the ask's order)."""

    pages: list[list[int]]
    groups: list[int]

    def to_wire(self) -> dict:
        return {"window_pages": self.pages, "window_groups": self.groups}


@dataclass(frozen=True)
class TailAsk:
    """An ask's window part: ``layers`` (the decode pool's window layers) from token ``start`` on."""

    name = WINDOW
    start: int
    layers: tuple[int, ...]

    def to_wire(self) -> dict:
        return {"window_start": self.start, "window_layers": list(self.layers)}

    def echo(self) -> dict:
        """What the answer header repeats of it."""
        return {"window_start": self.start}

    @classmethod
    def parse(cls, msg: dict, layers: int, prompt_len: int) -> Optional["TailAsk"]:
        """``layers``: the prefill pool's; None: the ask has no window part."""
        if "window_start" not in msg:
            return None
        start = integer(msg, "window_start", 0, prompt_len)
        asked = msg.get("window_layers")
        if not isinstance(asked, list) or len(asked) > layers or not all(
                type(i) is int and 0 <= i < layers for i in asked) or len(set(asked)) != len(asked):
            raise WireError(f"'window_layers' must list distinct layers below {layers}")
        return cls(start, tuple(asked))

    @staticmethod
    def parse_echo(msg: dict, end: int) -> Optional[int]:
        return integer(msg, "window_start", 0, end) if "window_start" in msg else None

    def parse_pages(self, msg: dict, page_size: int, prompt_len: int) -> TailPages:
        """Its Mooncake target's part, from the target's message."""
        most = max(len(self.layers), 1)
        lists = msg.get("window_pages")
        if not isinstance(lists, list) or not 1 <= len(lists) <= most:
            raise WireError(f"'window_pages' must list 1 to {most} lists of pages")
        tail = -(-(prompt_len - self.start) // page_size)
        pages = [int_list({"window_pages": p}, "window_pages", tail, 0, MAX_TOKENS) for p in lists]
        return TailPages(pages, int_list(msg, "window_groups", len(self.layers), 0, len(pages) - 1))

    def destinations(self, target: TailPages) -> dict[int, list[int]]:
        """Each asked layer's pages in the decode pool (its sliding group's)."""
        return {layer: target.pages[group] for layer, group in zip(self.layers, target.groups)}


class WindowTail:
    """A pool's window component as P/D moves it, on either side."""

    name = WINDOW

    def __init__(self, pool: DeviceKVPool) -> None:
        self.pool = pool

    # ---- the decode side ----
    def ask(self, tail: Tail) -> TailAsk:
        return TailAsk(tail.start, tuple(sorted(self.pool.windows.layers)))

    def pages(self, tail: Tail, end: int) -> TailPages:
        """Mooncake: where the prefill rank writes the tail's tokens up to ``end``."""
        part, ps = self.pool.windows, self.pool.page_size
        rows = tail.slots.view(-1, tail.slots.shape[-1])
        return TailPages([[int(row[t]) // ps for t in range(tail.start, end, ps)] for row in rows],
                         [part.group(i) for i in sorted(part.layers)])  # (the ask's order)

    def targets(self, tail: Tail) -> dict[int, Rows]:
        """Each window layer's rows here (a shared pool: its sliding group's)."""
        return {i: (tail.start, self.pool.windows.layer_slots(tail.slots, i)) for i in self.pool.windows.layers}

    # ---- the prefill side ----
    def sources(self, want: Optional[TailAsk], held: Optional[Tail], slots: torch.Tensor) -> dict[int, Rows]:
        """Each asked window layer's rows here: this pool's window component for its own window
        layers (a shared pool: the row of the layer's sliding group; one object per group), the
        prompt's ``slots`` for the others. Raises ValueError for rows this pool no longer holds."""
        pool, part = self.pool, self.pool.windows
        if pool.hybrid and (want is None or not part.layers <= set(want.layers)):
            raise ValueError("this prefill server keeps its sliding-window layers' KV for the last window only; the "
                             "decode server must ask for them as a window (run both with the same "
                             "--disable-hybrid-swa-memory setting)")
        if want is None:
            return {}
        if not pool.hybrid:
            return {i: (want.start, slots) for i in want.layers}
        if want.start < held.start:
            raise ValueError(f"the decode server asked for window rows from token {want.start}; this prefill "
                             f"server holds them from {held.start}")
        groups = {part.group(i): part.layer_slots(held.slots, i) for i in part.layers}  # one row per group
        return {i: (want.start, groups[part.group(i)] if i in part.layers else slots)
                for i in want.layers}
