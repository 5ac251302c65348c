"""Fair shares of the scheduler's room (issue 56, S5): one request -- its ``n`` choices, or a long
prompt -- cannot take every running slot, every device page or every prefill step from the others.

A request's *group* is itself and its sibling choices (``n`` > 1: ``Request.waits_for`` names the
first). A group holds at most ``max_running_requests`` minus a headroom of a quarter (at least one)
of the running slots, and at most three quarters of the device pool's pages, so a request that
arrives while it runs finds a slot and pages at once (without preempting anyone: a running choice
is never stopped); its first choice is always admitted. Prompts that are still computing leave a
quarter of each prefill step's token budget to queued requests, so a new request's first chunk is
scheduled in the next step whatever else runs. Units: requests (slots), pages, tokens as named.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from .request import Request

POOL_SHARE = 0.75  # most of the device pool one group holds while another waits


def group_of(req: Request) -> int:
    """The request a choice belongs to (its own id for a plain request)."""
    return req.rid if req.waits_for is None else req.waits_for


def headroom(max_running: int) -> int:
    """Running slots a group leaves to others: a quarter, at least one (none when only one runs)."""
    return 0 if max_running <= 1 else max(1, max_running // 4)


def newcomer_budget(budget: int, others_waiting: bool, unit: int) -> int:
    """Tokens of a prefill step's ``budget`` that running prompts leave to queued requests: a quarter,
    in whole ``unit``s (a page; a recurrent model's snapshot grid, so the running prompts' share ends on
    it too), at least one."""
    return max(budget // 4 // unit * unit, unit) if others_waiting and budget > unit else 0


class GroupShares:
    """Running slots and device pages per group, for one scheduling pass."""

    def __init__(self, running: Iterable[Request], max_running: int, capacity_pages: int) -> None:
        self.slots: Counter[int] = Counter()
        self.pages: Counter[int] = Counter()
        for r in running:
            self.slots[group_of(r)] += 1
            self.pages[group_of(r)] += len(r.kv.pages) if r.kv is not None else 0
        self.max_running, self.capacity_pages = max_running, capacity_pages

    def over(self, req: Request, pages: int) -> bool:
        """Whether admitting ``req`` (needing ``pages``) would take its group past its share."""
        g = group_of(req)
        if not self.slots[g]:
            return False
        return (self.slots[g] >= self.max_running - headroom(self.max_running)
                or self.pages[g] + pages > POOL_SHARE * self.capacity_pages)

    def admitted(self, req: Request) -> None:
        g = group_of(req)
        self.slots[g] += 1
        self.pages[g] += len(req.kv.pages)
