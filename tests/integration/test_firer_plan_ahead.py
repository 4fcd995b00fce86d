"""The scheduler leader's firer plans the firings of the next fire time ahead of it and sends
them when it comes (dtq.worker.firer, "plans ahead"). A planned firing is checked like any other
when it is sent: a schedule changed meanwhile is planned again from what it is now, a paused
one does not fire, and a tick fires once."""

from __future__ import annotations

import asyncio
import time

from dtq import Queue
from dtq.clock import redis_time_ms
from dtq.worker.firer import Firer
from support import wait_until

QUEUE = "planned"


async def _put(queue: Queue, name: str, **fields: object) -> None:
    await queue.put_schedule(
        name, every=1, task_type="report", queue=QUEUE, overlap="allow", **fields
    )


async def _until_planned(firer: Firer, timeout_s: float = 5) -> int:
    """Pass after pass until the firer holds a plan; its fire time."""
    deadline = time.monotonic() + timeout_s
    while firer.planned_for is None:
        assert time.monotonic() < deadline, "the firer never planned ahead"
        delay = await firer.step()
        if firer.planned_for is None:
            await asyncio.sleep(min(delay, 0.05))
    return firer.planned_for


async def _send_at(firer: Firer, queue: Queue, at_ms: int) -> None:
    """Pass after pass until the planned firings went out (their time came)."""
    deadline = time.monotonic() + 5
    while firer.planned_for == at_ms:
        assert time.monotonic() < deadline, "the planned firings were never sent"
        left_ms = at_ms - await redis_time_ms(queue.store.redis)
        if left_ms > 0:
            await asyncio.sleep(left_ms / 1000)
        await firer.step()


async def _fired(queue: Queue, name: str) -> dict[str, str]:
    """tick (ISO) -> task id of every firing in the schedule's history."""
    s = await queue.get_schedule(name)
    out: dict[str, str] = {}
    for e in s.history:
        if e.get("decision") == "fired":
            assert e["tick"] not in out, f"tick {e['tick']} fired twice"
            out[e["tick"]] = e["task_id"]
    return out


async def test_planned_firing_fires_its_tick_once(queue: Queue) -> None:
    await _put(queue, "plain")
    firer = Firer(queue.store, lambda: True)
    at = await _until_planned(firer)
    await _send_at(firer, queue, at)
    fired = await _fired(queue, "plain")
    assert len(fired) == 1
    task = await queue.get(next(iter(fired.values())))
    assert task.idempotency_key == f"schedule:plain:{at}"
    assert task.metadata["schedule"] == "plain"


async def test_schedule_changed_after_the_plan_fires_as_it_is_now(queue: Queue) -> None:
    await _put(queue, "changed", payload={"v": 1})
    firer = Firer(queue.store, lambda: True)
    at = await _until_planned(firer)
    await _put(queue, "changed", payload={"v": 2})  # moves rev: the planned call is stale
    await _send_at(firer, queue, at)
    fired = await _fired(queue, "changed")
    assert len(fired) == 1
    task = await queue.get(next(iter(fired.values())))
    assert task.payload == {"v": 2}
    assert task.idempotency_key == f"schedule:changed:{at}"


async def test_schedule_paused_after_the_plan_does_not_fire(queue: Queue) -> None:
    await _put(queue, "paused")
    firer = Firer(queue.store, lambda: True)
    at = await _until_planned(firer)
    assert await queue.pause_schedule("paused")
    await _send_at(firer, queue, at)
    assert await _fired(queue, "paused") == {}


async def test_a_plan_is_dropped_when_leadership_is_lost(queue: Queue) -> None:
    await _put(queue, "follower")
    leader = True
    firer = Firer(queue.store, lambda: leader)
    at = await _until_planned(firer)
    leader = False

    async def time_came() -> bool:
        return await redis_time_ms(queue.store.redis) >= at + 50

    await wait_until(time_came, 5, "the planned fire time")
    await firer.step()  # a follower fires only TAKEOVER_MS late: nothing yet
    assert firer.planned_for is None
    assert await _fired(queue, "follower") == {}
