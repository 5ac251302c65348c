"""The host tier's recurrent-state part (issue 59): host copies of the snapshots the prefix tree keeps.

A node with a host copy of its pages keeps a host copy of the snapshot at its end too, so a prompt
whose KV comes back from the host tier resumes its recurrent layers from there: when the node's
device copy is evicted it is demoted to host-only with its snapshot, never pruned (SGLang #33713).
A snapshot is a few slots' worth of bytes (LFM2-350M: 80 KiB; Qwen3.5-0.8B: 19 MiB) next to a
node's pages, and immutable once taken, so it is copied at once, not queued with the pages: when
the node gets its host copy (or, taken later, when the snapshot is attached), and back into the
request's running slot at admission (its first forward reads it there).

Units: slots of the host state pool (a :class:`~.state_pool.StatePool` of snapshots only, in host
memory) and of the device's.
"""

from __future__ import annotations

import torch

from .state_pool import StatePool
from .state_tree import TreeStates, eviction_order
from .tree_node import TreeNode


class HostStates:
    """Host snapshots of ``tree_states``' nodes, copied from and to the ``device`` state pool (and
    read from and written to storage by :class:`~.storage.state_objects.StoredStates`)."""

    def __init__(self, pool: StatePool, device: StatePool, tree_states: TreeStates) -> None:
        self.pool, self.device, self.tree_states = pool, device, tree_states
        self.held = 0  # host snapshots the tree holds
        self.evicted = 0  # freed to make room (not with their node's host copy)
        tree_states.host = self

    def backup(self, node: TreeNode) -> bool:
        """Copy ``node``'s device snapshot to a host slot (freeing other host snapshots when none is free);
        False where it has none, already has a host one, or no slot can be had."""
        part = self.tree_states.of(node)
        if not part.device or part.host:
            return False
        slot = self.reserve()
        if slot is None:
            return False
        _copy(self.device, part.device, self.pool, slot)
        part.host = slot
        self.held += 1
        return True

    def load(self, node: TreeNode, slot: int) -> None:
        """Copy ``node``'s host snapshot into device slot ``slot`` (a request's running slot)."""
        _copy(self.pool, self.tree_states.of(node).host, self.device, slot)

    def free(self, node: TreeNode) -> None:
        part = self.tree_states.of(node)
        if part.host:
            self.pool.snapshots.free(part.host)
            part.host = 0
            self.held -= 1

    def adopt(self, node: TreeNode, slot: int) -> None:
        """``node`` (ending where a snapshot read from storage into host ``slot`` belongs, with a host
        copy of its pages) takes it; freed where it cannot (a duplicate)."""
        part = self.tree_states.of(node)
        if node.is_root or node.host_pages is None or part.host:
            self.pool.snapshots.free(slot)
            return
        part.host = slot
        self.held += 1

    def free_slots(self, slots) -> None:
        """Free host slots no node took (a stopped prefetch's)."""
        for slot in slots:
            self.pool.snapshots.free(int(slot))

    def reserve(self) -> int | None:
        """A free host snapshot slot, freeing a node's when none is (not one a storage write is
        reading: ``host_ref``); None when none can go."""
        slot = self.pool.snapshots.alloc()
        if slot is None:
            victims = eviction_order(self.tree_states.tree, lambda node: self.tree_states.of(node).host,
                                     lambda node: node.host_ref == 0, 1)
            for node in victims:
                self.free(node)
            self.evicted += len(victims)
            slot = self.pool.snapshots.alloc()
        return slot

    def usage(self) -> dict:
        """``/stats``' ``host_pool.recurrent_state``."""
        snaps = self.pool.snapshots
        return {"snapshot_slots": snaps.capacity, "snapshots_free": snaps.available, "snapshots_cached": self.held,
                "snapshots_evicted": self.evicted, "slot_bytes": self.pool.bytes_per_slot,
                "pool_bytes": self.pool.total_bytes}


def _copy(src: StatePool, src_slot: int, dst: StatePool, dst_slot: int) -> None:
    """One slot's every state tensor, from one pool to another (the pools' one definition of a slot)."""
    with torch.inference_mode():
        for src_layer, dst_layer in zip(src.buffers, dst.buffers):
            for a, b in zip(src_layer, dst_layer):
                b[dst_slot].copy_(a[src_slot])
