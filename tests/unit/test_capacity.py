"""A worker's execution slots (:class:`dtq.worker.execution.Capacity`): the reaper's urgent
reservations are served before the poll loops', and nothing is ever taken beyond the size."""

from __future__ import annotations

import asyncio

from dtq.worker.execution import Capacity


async def settle() -> None:
    """Let every task run until it waits: a reservation's wait is a task of its own, which
    needs loop turns of its own to start waiting."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_freed_slot_goes_to_the_urgent_waiter_first() -> None:
    cap = Capacity(2)
    stopping = asyncio.Event()
    assert cap.take(2) == 2
    order: list[str] = []

    async def reserve(name: str, urgent: bool) -> None:
        n = await cap.reserve(4, stopping, urgent=urgent)
        order.append(f"{name}:{n}")

    poll = asyncio.create_task(reserve("poll", False))  # waits first
    await settle()
    reaper = asyncio.create_task(reserve("reaper", True))
    await settle()
    cap.release(1)
    await asyncio.wait_for(reaper, 1)
    assert order == ["reaper:1"] and not poll.done() and cap.free == 0
    cap.release(1)
    await asyncio.wait_for(poll, 1)
    assert order == ["reaper:1", "poll:1"] and cap.free == 0 and cap.used == 2


async def test_poll_loops_go_on_once_no_urgent_reservation_waits() -> None:
    cap = Capacity(3)
    stopping = asyncio.Event()
    assert await cap.reserve(2, stopping, urgent=True) == 2
    assert await cap.reserve(5, stopping) == 1
    cap.release(3)
    assert await cap.reserve(5, stopping) == 3


async def test_stopping_ends_every_wait_with_nothing_taken() -> None:
    cap = Capacity(1)
    stopping = asyncio.Event()
    cap.take(1)
    waits = [asyncio.create_task(cap.reserve(1, stopping, urgent=u)) for u in (True, False)]
    await asyncio.sleep(0)
    stopping.set()
    assert await asyncio.wait_for(asyncio.gather(*waits), 1) == [0, 0]
    assert cap.free == 0
