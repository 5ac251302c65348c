"""The prefix tree's recurrent-state component (issue 59): which cached boundaries hold a snapshot
of every recurrent layer's state.

A recurrent layer's state at a position summarises every token before it, so a prefix hit must
resume from a snapshot taken exactly at the hit's boundary: there is nothing to recompute "just
the window" from. A node holds at most one snapshot, the state at its *end* (a slot of the device
state pool, :mod:`.state_pool`); a match is cut back to the deepest node end whose snapshot is held
(:meth:`TreeStates.usable`), and the KV pages below it are still shared for what follows.

Eviction (deterministic keys, as every tree decision: DESIGN invariant 3): KV eviction takes
*dead* leaves first (no snapshot: no hit can end in them); a snapshot goes with its node's device
copy; when the snapshot slots run out, :meth:`TreeStates.evict` frees snapshots of unlocked nodes,
spare ones first (a deeper snapshot below them serves the same conversation further), least
recently used first.

Units: tokens unless named pages; slots are state-pool slot ids (0: none).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np

from ..consensus_record import consensus_check
from .state_pool import SlotRange
from .tree_node import TreeNode

if TYPE_CHECKING:
    from .radix import RadixCache


class HostCopies(Protocol):
    """The host tier's snapshots as the tree uses them (:class:`~.host_state.HostStates`)."""

    held: int

    def backup(self, node: TreeNode) -> bool: ...

    def free(self, node: TreeNode) -> None: ...


@dataclass(slots=True)
class StatePart:
    """A node's handle on the state component: the snapshot of the state at its end, as a slot of the
    device state pool and of the host's (0: none)."""

    device: int = 0
    host: int = 0


class TreeStates:
    """The recurrent-state component of a :class:`~.radix.RadixCache` (a
    :class:`~.tree_node.TreeComponent`): one snapshot slot per node end at most."""

    name = "recurrent_state"

    def __init__(self, tree: "RadixCache", slots: SlotRange) -> None:
        self.tree, self.page_size = tree, tree.page_size
        self.index = -1  # set when the tree registers it (PageTree.add_component)
        self.slots = slots
        self.held = 0  # snapshots the tree holds on the device
        self.evicted = 0  # device snapshots freed to make room (not with their node's pages)
        self.host: HostCopies | None = None  # the host tier's copies (set by it; None without one)

    def of(self, node: TreeNode) -> StatePart:
        return node.parts[self.index]

    def new_part(self) -> StatePart:
        return StatePart()

    # ---- the tree's hooks ----------------------------------------------------------------
    def split(self, upper: TreeNode, node: TreeNode, pages: int) -> None:
        """The upper part ends inside the old node: no state was taken there."""

    def usable(self, path: list[TreeNode], device_tokens: int, host_tokens: int) -> int:
        """The deepest end of a node matched in full (each but possibly the last) that holds a
        snapshot: on the device or in its host copy within the device run (a host one is copied to
        the request's running slot at admission), in its host copy after it; 0 when none does."""
        best, pos = 0, 0
        for node in path:
            pos += len(node.key)
            if pos > device_tokens + host_tokens:
                break
            part = self.of(node)
            if part.host or (part.device and pos <= device_tokens):
                best = pos
        return best

    def adopt(self, node: TreeNode, offered: np.ndarray, fresh: bool) -> None:
        """Snapshots come with :meth:`attach`, not with an insert's pages."""

    def hit_pages(self, nodes: list[TreeNode]) -> np.ndarray:
        return np.zeros(0, dtype=np.int64)

    def device_attached(self, node: TreeNode) -> None:
        """A host copy's pages came back; its state does not (the host tier keeps none yet)."""

    def host_attached(self, node: TreeNode) -> None:
        """The node's pages got a host copy: its snapshot gets one too."""
        if self.host is not None:
            self.host.backup(node)

    def drop_device(self, node: TreeNode) -> None:
        """The node's device copy goes: its snapshot with it."""
        self._free(node)

    def drop_host(self, node: TreeNode) -> None:
        """The node's host copy goes: its host snapshot with it."""
        if self.host is not None:
            self.host.free(node)

    def victim_rank(self, node: TreeNode) -> tuple:
        """Device eviction takes dead leaves first: without a snapshot at its end no hit ends in one."""
        return (self.of(node).device != 0,)

    def check(self, nodes: list[TreeNode]) -> None:
        """A snapshot only beside its tier's pages, none shared within a tier, the counts right."""
        seen: dict[str, set[int]] = {"device": set(), "host": set()}
        for node in nodes:
            part = self.of(node)
            for tier, slot, pages in (("device", part.device, node.device_pages), ("host", part.host, node.host_pages)):
                if slot:
                    assert pages is not None, f"{node}: a {tier} snapshot without {tier} pages"
                    assert slot not in seen[tier], f"{node}: {tier} snapshot slot {slot} shared"
                    seen[tier].add(slot)
        assert len(seen["device"]) == self.held, (len(seen["device"]), self.held)
        assert len(seen["host"]) == (self.host.held if self.host is not None else 0)

    # ---- snapshots -------------------------------------------------------------------------
    def attach(self, node: TreeNode, slot: int) -> bool:
        """``node`` (ending at the snapshot's position, on the device) takes snapshot ``slot`` (and a
        host copy where the node has one); False (the caller frees it) when it holds one already or is
        the root."""
        if node.is_root or node.device_pages is None or self.of(node).device:
            return False
        self.of(node).device = slot
        self.held += 1
        if self.host is not None and node.host_pages is not None:
            self.host.backup(node)
        return True

    def alloc(self) -> int | None:
        """A free snapshot slot, freeing one of the tree's (:meth:`evict`) when none is; None when
        every snapshot is locked."""
        slot = self.slots.alloc()
        if slot is None and self.evict(1):
            slot = self.slots.alloc()
        return slot

    @consensus_check("tree.evict_states", args=lambda self, count: count, result=lambda freed: freed)
    def evict(self, count: int) -> int:
        """Free up to ``count`` device snapshots of unlocked nodes (:func:`eviction_order`). Returns how many."""
        victims = eviction_order(self.tree, lambda node: self.of(node).device, lambda node: node.lock_ref == 0, count)
        for node in victims:
            self._free(node)
        self.evicted += len(victims)
        return len(victims)

    def _free(self, node: TreeNode) -> None:
        part = self.of(node)
        if part.device:
            self.slots.free(part.device)
            part.device = 0
            self.held -= 1


def eviction_order(tree: "RadixCache", slot_of: Callable[[TreeNode], int], may_go: Callable[[TreeNode], bool],
                   count: int) -> list[TreeNode]:
    """Up to ``count`` nodes whose snapshot (``slot_of``: in one tier) ``may_go``, *spare* ones first (a
    deeper snapshot of the tier on their path serves the same conversation further: a superseded turn,
    a chunk end), then each path's deepest; least recently used first (the node id breaks ties)."""
    nodes = [node for node in tree.all_nodes() if not node.is_root and slot_of(node)]
    spare: set[int] = set()  # ids of nodes with a snapshot somewhere below them
    for node in nodes:
        for above in itertools.islice(node.lineage(), 1, None):
            if above.id in spare:
                break
            spare.add(above.id)
    keyed = [((node.id not in spare, node.last_access, node.id), node) for node in nodes if may_go(node)]
    return [node for _, node in heapq.nsmallest(count, keyed)]
