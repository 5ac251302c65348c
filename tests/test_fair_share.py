"""Fair shares (issue 56, S5): one request's ``n`` choices, or one long prompt, cannot keep a new
request from being scheduled. The engine's scheduler and cache over a small pool geometry, its
forward a no-op (``tests/cache_only.py``): steps are what is counted."""

from __future__ import annotations

import pytest

from cache_only import CacheOnly, Geometry
from hicache.runtime.fair_share import headroom
from hicache.runtime.request import Status

pytestmark = pytest.mark.engine

SMALL = Geometry(head_dim=8)


def engine(max_running: int = 32, pool_tokens: int = 200_000, chunk: int = 2048) -> CacheOnly:
    page_bytes = SMALL.full_page_bytes + SMALL.window_page_bytes
    return CacheOnly(pool_tokens // SMALL.page * page_bytes, None, SMALL, chunk=chunk, max_running_requests=max_running)


def n_choices(e: CacheOnly, n: int, prompt: list[int], max_new_tokens: int) -> list:
    """A request with ``n`` choices, as Engine.generate makes them: the first, then siblings waiting for it."""
    first = e.add(prompt, max_new_tokens)
    siblings = []
    for _ in range(n - 1):
        siblings.append(e.add(prompt, max_new_tokens))
        siblings[-1].waits_for = first.rid
    return [first, *siblings]


def steps_until_running(e: CacheOnly, req, limit: int = 10) -> int:
    for step in range(1, limit + 1):
        e.driver.step()
        if req.status is not Status.WAITING:
            return step
    raise AssertionError(f"request still queued after {limit} steps")


@pytest.mark.parametrize("max_running", [4, 32])
def test_a_request_with_many_choices_leaves_room_for_a_new_one(max_running) -> None:
    """S5: ``n: 64, max_tokens: 1500, ignore_eos`` took every running slot; a chat sent after it was
    admitted only when its choices finished (92.5 s on 2 cores). Its group now holds all but a quarter
    of the slots, and the chat runs in the next step."""
    e = engine(max_running)
    group = n_choices(e, 64, list(range(10, 60)), 1500)
    for _ in range(5):
        e.driver.step()
    assert sum(r.status is not Status.WAITING for r in group) == max_running - headroom(max_running)
    chat = e.add(list(range(100, 108)), 8)
    assert steps_until_running(e, chat) == 1
    assert e.run([chat], max_steps=20) <= 9  # its prefill, then 7 decode steps beside the group's
    assert len(chat.output_ids) == 8


def test_a_request_with_many_choices_cannot_hold_the_whole_pool() -> None:
    """The same with a pool that holds 40 choices' reservations: the group stops at three quarters of
    the pool while another waits, so the chat's pages are there."""
    e = engine(max_running=64, pool_tokens=40 * 1600)
    group = n_choices(e, 64, list(range(10, 60)), 1500)
    for _ in range(3):
        e.driver.step()
    chat = e.add(list(range(100, 108)), 8)
    assert steps_until_running(e, chat) <= 2
    e.run([chat], max_steps=50)
    held = sum(len(r.kv.pages) for r in group if r.kv is not None and r.status is not Status.FINISHED)
    assert held <= 0.75 * e.cache.capacity_pages + 1600 // SMALL.page


def test_a_long_prompt_leaves_a_share_of_each_prefill_step_to_new_requests() -> None:
    """A 40K-token prompt computes in 2K chunks for 20 steps; a request arriving meanwhile used to wait
    for all of them (the running prompt took every step's budget). Now its first chunk goes in the next
    step, and the long prompt still takes most of each step."""
    e = engine(max_running=8, chunk=2048)
    long = e.add(list(range(10, 40_010)), 4)
    e.driver.step()
    e.driver.step()
    short = e.add(list(range(100, 160)), 4)
    assert steps_until_running(e, short) == 1
    computed_before = long.computed
    e.driver.step()
    assert long.computed - computed_before >= 2048 * 3 // 4
    e.run([short, long])
