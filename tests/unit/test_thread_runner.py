"""The sync handlers' thread pool: an interrupt reaches the job it was meant for, only while that
job runs, and never the pool's own code or the thread's next job."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from dtq.worker.threads import ThreadRunner, _set_async_exc
from dtq_tasks import TaskCancelled, TimeLimitExceeded


def _loop(entered: threading.Event, seconds: float) -> str:
    entered.set()
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        time.sleep(0.005)
    return "ran to its end"


async def test_interrupt_stops_a_python_loop_and_the_thread_serves_the_next_job() -> None:
    pool = ThreadRunner(1)
    try:
        entered = threading.Event()
        job = pool.submit(_loop, entered, 5.0)
        await asyncio.to_thread(entered.wait, 5)
        asked = time.monotonic()
        assert pool.interrupt(job, TimeLimitExceeded)
        with pytest.raises(TimeLimitExceeded):
            await asyncio.wait_for(job.future, 2)
        assert time.monotonic() - asked < 0.5
        assert not pool.interrupt(job, TimeLimitExceeded)  # ended: nothing to interrupt
        # The same thread (a pool of one) runs the next job undisturbed.
        again = pool.submit(_loop, threading.Event(), 0.1)
        assert await asyncio.wait_for(again.future, 2) == "ran to its end"
    finally:
        pool.shutdown()


async def test_a_job_interrupted_before_it_starts_never_runs() -> None:
    pool = ThreadRunner(1)
    try:
        entered = threading.Event()
        first = pool.submit(_loop, entered, 0.3)
        await asyncio.to_thread(entered.wait, 5)
        ran: list[int] = []
        queued = pool.submit(ran.append, 1)  # waits for the only thread
        assert pool.interrupt(queued, TaskCancelled)
        assert await asyncio.wait_for(first.future, 2) == "ran to its end"
        with pytest.raises(TaskCancelled):
            await asyncio.wait_for(queued.future, 2)
        assert ran == []
    finally:
        pool.shutdown()


async def test_an_interrupt_sent_as_its_job_ends_never_reaches_the_pool() -> None:
    """The interrupt is sent while the job's thread waits, its handler returned, to mark the
    job ended (the pool's lock held here, as :meth:`ThreadRunner.interrupt` holds it): the
    job ends with its result or the interrupt, its future settles, and the thread's next job
    runs to its end."""
    pool = ThreadRunner(1)
    try:
        entered = threading.Event()
        job = pool.submit(_loop, entered, 0.05)
        await asyncio.to_thread(entered.wait, 5)
        with pool._lock:
            await asyncio.sleep(0.3)  # the handler has returned: its thread waits for the lock
            job.interrupted_by = TimeLimitExceeded
            job._sent = _set_async_exc(job._ident, TimeLimitExceeded) == 1
        assert job._sent
        try:
            outcome: Any = await asyncio.wait_for(job.future, 2)
        except TimeLimitExceeded:
            outcome = "interrupted"
        assert outcome in {"ran to its end", "interrupted"}
        for _ in range(5):
            again = pool.submit(_loop, threading.Event(), 0.02)
            assert await asyncio.wait_for(again.future, 2) == "ran to its end"
    finally:
        pool.shutdown()
