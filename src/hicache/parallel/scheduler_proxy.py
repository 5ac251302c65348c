"""The frontend's stand-in for the ranks' scheduler (``RankGroup.scheduler``).

It answers the calls the Engine and the EngineLoop make on a local scheduler (``add``,
``abort``, ``step``, ``has_work``, ``running``, ``waiting``): requests stay this process's
objects, the leader's updates fill them in, and a step is "read what the leader sent".
"""

from __future__ import annotations

import time
from typing import Callable

from ..runtime.request import Request, Status
from ..runtime.step import Abort, Add
from .messages import RequestSpec, RequestUpdate

POLL_S = 0.05  # how long a step waits for the leader's next updates


class SchedulerProxy:
    """The frontend's view of the ranks' scheduler: the same calls the Engine and EngineLoop
    make on a local one; it schedules nothing. Requests stay this process's objects; the
    leader's updates fill them. ``send``: a command to the leader; ``updates(timeout)``: the
    leader's request updates received within ``timeout`` seconds."""

    def __init__(self, send: Callable[[Add | Abort], None], updates: Callable[[float], list[RequestUpdate]]) -> None:
        self.send, self.updates = send, updates
        self.requests: dict[int, Request] = {}

    @property
    def waiting(self) -> list[Request]:
        return [r for r in self.requests.values() if r.cached is None]

    @property
    def running(self) -> list[Request]:
        return [r for r in self.requests.values() if r.cached is not None]

    def has_work(self) -> bool:
        return bool(self.requests)

    def add(self, *reqs: Request) -> None:
        """Queue ``reqs`` in one message: the leader takes them all at one step."""
        self.requests.update((req.rid, req) for req in reqs)
        self.send(Add(tuple(RequestSpec.of(req) for req in reqs)))

    def abort(self, rid: int) -> Request | None:
        """Finishes the request here at once (returned; None: not found); the ranks drop it at their next step."""
        req = self.requests.pop(rid, None)
        if req is None:
            return None
        req.status, req.finish_reason, req.finish_time = Status.FINISHED, "abort", time.perf_counter()
        self.send(Abort(rid))
        req.notify()
        return req

    def step(self) -> list[Request]:
        finished = []
        for upd in self.updates(POLL_S):
            req = self.requests.get(upd.rid)
            if req is None:  # aborted here already
                continue
            upd.apply(req)
            if upd.finished:
                del self.requests[upd.rid]
                finished.append(req)
            req.notify()
        return finished
