"""The device tier's recurrent-state part (issue 59): each request's running slot, where its first
forward reads its state from, and the snapshots its prompt passes leave for the prefix tree.

Snapshots are taken on the grid (``grid`` tokens: a multiple of the page and of the layers' scan
chunk, runtime/state_plan.py): a prompt pass writes, besides its running slot, the state at

- the prompt's *checkpoint* ``floor((P - 1) / grid) * grid``, the deepest boundary a match of the
  same prompt can reach (a match leaves one token to compute), for every prompt however short;
- the boundary where the tree's path *branches* from the request's prompt past its hit (its
  shared system prompt, a sibling's turn), so the next request on that branch point hits it;

and the node that ends there takes it once the prompt's pages are inserted (:meth:`after_insert`).
Where replies are cached (:attr:`DeviceStates.turn_ends`), a decode step that ends on the grid writes
the state there too, the turn's latest such one kept: the next turn, which resends the reply, hits
it rather than the prompt's checkpoint.
A hit's first forward reads its snapshot and writes the request's running slot: the tree lock the
request holds on the hit's node keeps the snapshot until the request is done.

Units: tokens; slots are state-pool slot ids.
"""

from __future__ import annotations

import numpy as np

from ..consensus_record import consensus_check
from .radix import RadixCache
from .state_pool import StateHold, StatePool
from .state_tree import TreeStates
from .tree_node import TreeNode


class DeviceStates:
    """The device pool's state slots as the device tier hands them out (see the module docstring)."""

    def __init__(self, pool: StatePool, tree: RadixCache | None) -> None:
        self.pool, self.grid = pool, pool.grid
        self.tree = tree
        self.turn_ends = False  # snapshots at a turn's last grid boundary (replies cached: CachePolicy)
        self.snapshots = TreeStates(tree, pool.snapshots) if tree is not None else None
        if self.snapshots is not None:
            tree.add_component(self.snapshots)

    def hold(self) -> StateHold | None:
        """A running slot for a request being admitted; None when every one is held."""
        slot = self.pool.running.alloc()
        return None if slot is None else StateHold(slot)

    def on_admit(self, hold: StateHold, node: TreeNode | None, hit_tokens: int, kv_tokens: int,
                 arrives: bool = False) -> None:
        """The request hit ``hit_tokens`` ending at ``node`` (its match is cut to a snapshot there);
        its prompt's KV reaches ``kv_tokens`` in the tree (where its path branches, when further).
        ``arrives``: its prompt's state arrives whole (P/D decode, :meth:`arriving`): its hit counts
        attention rows only, no state is read or taken here."""
        if arrives:
            return
        if hit_tokens:  # (the match ends at a node with a device snapshot, or a host one: loaded into the running slot)
            device = self.snapshots.of(node).device
            if not device:
                self.snapshots.host.load(node, hold.slot)
            hold.source, hold.start = device or hold.slot, hit_tokens
        branch = kv_tokens // self.grid * self.grid
        hold.branch = branch if branch > hit_tokens else 0

    # (the positions snapshotted, not the slots: every rank's must agree, pipeline stages' without a state too)
    @consensus_check("states.step", args=lambda self, hold, computed, new, prompt: (computed, new, prompt),
                     result=lambda taken: [position for position, _ in taken])
    def step(self, hold: StateHold, computed: int, new_tokens: int, prompt_tokens: int) -> tuple[tuple[int, int], ...]:
        """Before a forward of ``new_tokens`` after ``computed``: the snapshots it writes (a prompt
        pass's: its checkpoint and branch point inside its span), each a snapshot slot (none when
        every slot is locked: the snapshot is not taken), returned as ``(position, slot)``; a verify pass's
        scratch slots (:meth:`accept`). A decode step's: the turn's end (:meth:`_turn_end`); a verify pass
        takes none (its drafts may be rejected)."""
        hold.forward = ()
        if computed >= prompt_tokens:
            self._verify_rows(hold, new_tokens)
            return self._turn_end(hold, computed, new_tokens, prompt_tokens)
        if self.snapshots is None:
            return ()
        end = min(computed + new_tokens, prompt_tokens - 1)
        wanted = sorted({p for p in (hold.branch, (prompt_tokens - 1) // self.grid * self.grid) if computed < p <= end})
        taken = []
        for position in wanted:
            slot = self.snapshots.alloc()
            if slot is not None:
                taken.append((position, slot))
        hold.forward = tuple(taken)
        hold.taken.extend(taken)
        return hold.forward

    def _turn_end(self, hold: StateHold, computed: int, new_tokens: int, prompt_tokens: int) -> tuple[tuple[int, int], ...]:
        """A decode step whose token ends on the grid snapshots the state after it, in place of the
        turn's earlier one (the reply's pages are inserted up to the last whole page at release)."""
        position = computed + new_tokens
        if not self.turn_ends or self.snapshots is None or new_tokens != 1 or position % self.grid:
            return ()
        for _, slot in [t for t in hold.taken if t[0] > prompt_tokens]:
            self.pool.snapshots.free(slot)
        hold.taken = [t for t in hold.taken if t[0] <= prompt_tokens]
        slot = self.snapshots.alloc()
        if slot is None:
            return ()
        hold.forward = ((position, slot),)
        hold.taken.append((position, slot))
        return hold.forward

    def _verify_rows(self, hold: StateHold, new_tokens: int) -> None:
        """A scratch slot for the state after each of a verify pass's rows but the last (held until
        :meth:`accept`). The scratch is sized for the most rows a verify pass has (runtime/state_plan.py)."""
        if hold.rows:
            raise RuntimeError("a request's verify pass was scheduled before its previous one was accepted")
        rows = []
        for _ in range(new_tokens - 1):
            slot = self.pool.scratch.alloc()
            if slot is None:
                hold.rows = tuple(rows)
                self._free_rows(hold)
                raise RuntimeError(f"a verify pass of {new_tokens} rows found too few of the state pool's "
                                   f"{self.pool.scratch.capacity} scratch slots free")
            rows.append(slot)
        hold.rows = tuple(rows)

    def accept(self, hold: StateHold, kept: int) -> None:
        """A verify pass's first ``kept`` rows are now the request's context: its running slot takes the
        state after them (the pass left the state after all its rows there), and its scratch is free."""
        if 0 < kept <= len(hold.rows):
            self.pool.copy_slot(hold.rows[kept - 1], hold.slot)
        self._free_rows(hold)

    def _free_rows(self, hold: StateHold) -> None:
        for slot in hold.rows:
            self.pool.scratch.free(slot)
        hold.rows = ()

    def checkpoint(self, prompt_tokens: int) -> int:
        """The prompt's checkpoint: the deepest grid boundary a match of the same prompt reaches."""
        return (prompt_tokens - 1) // self.grid * self.grid

    def held(self, namespace: str, tokens: np.ndarray, hold: StateHold, locked: TreeNode | None) -> dict[int, int]:
        """P/D prefill: the states of the computed prompt ``tokens`` there are to send, position ->
        slot: its running slot (the state at the prompt's end) and the device snapshot at its checkpoint
        where one is held -- taken by its own pass (held until release), or the tree's on the path the
        request keeps ``locked`` (no eviction frees it while the send reads it on another thread)."""
        states, at = {len(tokens): hold.slot}, self.checkpoint(len(tokens))
        slot = next((s for p, s in hold.taken if p == at), 0)
        if not slot and at and self.snapshots is not None and locked is not None:
            node = self.tree.node_at(namespace, tokens[:at])
            slot = self.snapshots.of(node).device if any(n is node for n in locked.lineage()) else 0
        if slot and at:
            states[at] = slot
        return states

    def arriving(self, namespace: str, tokens: np.ndarray, hold: StateHold) -> dict[int, int]:
        """P/D decode: where the states of the prompt ``tokens`` go, position -> slot (the prompt's end
        first): the end into the running slot (its first decode step reads it); the checkpoint into a
        snapshot slot taken for it (the node that ends there takes it at release), unless the tree
        holds one there already or every snapshot slot is locked."""
        states, at = {len(tokens): hold.slot}, self.checkpoint(len(tokens))
        if at and self.snapshots is not None:
            node = self.tree.node_at(namespace, tokens[:at])
            if (node is None or not self.snapshots.of(node).device) and (slot := self.snapshots.alloc()) is not None:
                hold.taken.append((at, slot))
                states[at] = slot
        return states

    def arrived(self, hold: StateHold, positions: tuple[int, ...]) -> None:
        """P/D decode: the snapshot slots taken for states that did not arrive (at other ``positions``:
        the prefill side did not hold its checkpoint, or the transfer failed) are free again."""
        for _, slot in [t for t in hold.taken if t[0] not in positions]:
            self.pool.snapshots.free(slot)
        hold.taken = [t for t in hold.taken if t[0] in positions]

    def after_insert(self, namespace: str, tokens: np.ndarray, hold: StateHold) -> None:
        """The tree now holds the whole pages of ``tokens``: the node ending at each snapshot taken
        within them takes it (split there as needed); a duplicate is freed."""
        inserted = len(tokens) // self.tree.page_size * self.tree.page_size
        for position, slot in [t for t in hold.taken if t[0] <= inserted]:
            node = self.tree.boundary_node(namespace, tokens[:position])
            if node is None or not self.snapshots.attach(node, slot):
                self.pool.snapshots.free(slot)
        hold.taken = [t for t in hold.taken if t[0] > inserted]

    def release(self, hold: StateHold) -> None:
        """The request is done: its running slot and the snapshots no insert took are free."""
        self.pool.running.free(hold.slot)
        self._free_rows(hold)
        for _, slot in hold.taken:
            self.pool.snapshots.free(slot)
        hold.taken.clear()

    def usage(self) -> dict:
        """``/stats``' ``device_pool.recurrent_state``: the pool's slots, the tree's snapshots."""
        snapshots = self.snapshots
        return {**self.pool.usage(), "grid_tokens": self.grid,
                "snapshots_cached": snapshots.held if snapshots else 0,
                "snapshots_evicted": snapshots.evicted if snapshots else 0}
