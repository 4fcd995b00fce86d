"""The transition table against the Lua scripts (STYLE habit 4): every script path runs on a real
server, through the public SDK, in-process workers and a worker process that dies; then every
task's history (``dtq:task:<id>:history``) is read back and

- every step is allowed: the first entry's ``from`` is null and its ``to`` in ``INITIAL``, every
  later ``(from, to)`` in ``TRANSITIONS`` or ``HISTORY_EXTENSIONS``, each entry's ``from`` the
  previous entry's ``to``, and the last ``to`` the hash's status;
- every pair of both tables was written by some path, so a table entry no script produces is
  found too.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
from redis.asyncio import Redis

from dtq import Queue, keys
from dtq.config import Settings
from dtq.errors import TaskRunningError
from dtq.models import HISTORY_EXTENSIONS, INITIAL, TERMINAL, TRANSITIONS, TaskStatus
from dtq_tasks import PermanentError, RateLimited, RescheduleError, RetryableError, TaskContext
from support import running_worker, wait_until
from support.worker import WorkerProcess, fast, handlers, pushed_back_once, wait_status

Pair = tuple[str | None, str]


def table_pairs() -> set[Pair]:
    pairs: set[Pair] = {(None, s.value) for s in INITIAL}
    for table in (TRANSITIONS, HISTORY_EXTENSIONS):
        for src, dsts in table.items():
            pairs.update((src.value, dst.value) for dst in dsts)
    return pairs


# -- handlers of the in-process workers ---------------------------------------------------------


async def ok(payload: dict[str, Any], ctx: TaskContext) -> str:
    return "ok"


async def flaky(payload: dict[str, Any], ctx: TaskContext) -> int:
    if ctx.attempt == 1:
        raise RetryableError("first attempt fails")
    return ctx.attempt


async def permanent(payload: dict[str, Any], ctx: TaskContext) -> None:
    raise PermanentError("never")


async def hang(payload: dict[str, Any], ctx: TaskContext) -> None:
    await asyncio.sleep(60)  # until its cancel stops it


async def later(payload: dict[str, Any], ctx: TaskContext) -> None:
    """Reschedule (RETRYING, no error) payload["s"] seconds out, up to max_attempts."""
    raise RescheduleError(float(payload["s"]))


WORKER_HANDLERS = handlers(
    tr_ok=ok,
    tr_flaky=flaky,
    tr_perm=permanent,
    tr_hang=hang,
    tr_later=later,
    tr_pushed=pushed_back_once(RateLimited(0.1), then="ok"),
)


# -- the paths ----------------------------------------------------------------------------------


async def operator_paths(q: Queue, r: Redis) -> list[str]:
    """Scripts an operator or a client runs, with no worker: submit (queued, pending, expired at
    submit), cancel, mark_expired, purge_queue."""
    ids = []
    for options, act in [
        ({}, q.cancel),  # queued -> cancelled
        ({"delay_seconds": 600}, q.cancel),  # pending -> cancelled
        ({}, q.mark_expired),  # queued -> expired
        ({"delay_seconds": 600}, q.mark_expired),  # pending -> expired
    ]:
        task = await q.submit("tr_ok", **options)
        await act(task.task_id)
        ids.append(task.task_id)
    expired = await q.submit("tr_ok", ttl_seconds=0)  # expired at submit
    assert expired.status is TaskStatus.EXPIRED
    ids.append(expired.task_id)
    for options in [{}, {"delay_seconds": 600}]:
        ids.append((await q.submit("tr_ok", queue="tr-purge", **options)).task_id)
    assert await q.purge_queue("tr-purge") == 2
    return ids


async def worker_paths(q: Queue, r: Redis, settings: Settings) -> list[str]:
    """start (run, expired), finish (success, retry, reschedule, dead letter, reschedule limit,
    cancelled), promote (delayed, retry, expired), the expiry sweep of a waiting retry, cancel of
    a running and of a retrying task, DLQ requeue, discard and purge."""
    submit = q.submit
    plain = await submit("tr_ok")
    delayed = await submit("tr_ok", delay_seconds=0.2)
    retried = await submit("tr_flaky", max_attempts=3)
    dead = [(await submit("tr_perm")).task_id for _ in range(3)]
    limit = await submit("tr_later", {"s": 0}, max_attempts=2)  # RescheduleLimit
    hanging = await submit("tr_hang")
    parked = await submit("tr_later", {"s": 600})  # RETRYING for 10 minutes, then cancelled
    swept = await submit("tr_later", {"s": 600}, ttl_seconds=1.5)  # RETRYING, then swept
    # past its deadline when its reschedule is due: promote expires it (or start, or the sweep)
    promoted_late = await submit("tr_later", {"s": 0.6}, ttl_seconds=0.3)
    async with running_worker(fast(settings), WORKER_HANDLERS):
        for task in (plain, delayed, retried):
            await wait_status(r, task.task_id, "succeeded")
        for tid in dead:
            await wait_status(r, tid, "dead_lettered")
        await wait_status(r, limit.task_id, "dead_lettered")
        await wait_status(r, hanging.task_id, "running")
        with pytest.raises(TaskRunningError):  # running: cancel requested, the worker stops it
            await q.cancel(hanging.task_id)
        await wait_status(r, hanging.task_id, "cancelled")
        await wait_status(r, parked.task_id, "retrying")
        await q.cancel(parked.task_id)
        await wait_status(r, swept.task_id, "expired", timeout_s=15)
        await wait_status(r, promoted_late.task_id, "expired")

        requeued = await q.requeue_dead_letter(dead[0])  # dead_lettered -> queued, runs again
        assert requeued.status is TaskStatus.QUEUED
        await wait_until(
            lambda: attempt_started_again(r, dead[0]), 10, "the requeued task ran again"
        )
        await wait_status(r, dead[0], "dead_lettered")
    await q.discard_dead_letter(dead[1])  # dead_lettered -> dead_lettered
    assert await q.purge_dead_letters() >= 1  # dead[0], dead[2], limit: the same
    return [
        t.task_id for t in (plain, delayed, retried, limit, hanging, parked, swept, promoted_late)
    ] + dead


async def attempt_started_again(r: Redis, task_id: str) -> bool:
    entries = [json.loads(e) for e in await r.lrange(keys.history(task_id), 0, -1)]
    requeue = [i for i, e in enumerate(entries) if e["from"] == "dead_lettered"]
    return bool(requeue) and entries[-1]["to"] == "dead_lettered" and len(entries) > requeue[0] + 2


async def start_expired_path(q: Queue, r: Redis, settings: Settings) -> list[str]:
    """A queued task whose deadline passed before any worker read it: the start script (or, if
    it is first, the scheduler's sweep) expires it."""
    task = await q.submit("tr_ok", queue="tr-late", ttl_seconds=0.2)
    deadline = task.expires_at
    assert deadline is not None

    async def passed() -> bool:
        return await q.now() > deadline

    await wait_until(passed, 5, "deadline passed")
    async with running_worker(fast(settings), WORKER_HANDLERS, queues=("tr-late",)):
        await wait_status(r, task.task_id, "expired")
    return [task.task_id]


async def removed_entry_path(q: Queue, r: Redis, settings: Settings) -> list[str]:
    """A queued task whose entry was deleted by hand: the leader's pass gives it a new entry
    (QUEUED -> QUEUED), and it runs."""
    task = await q.submit("tr_ok", queue="tr-lost")
    entry_id = await r.hget(keys.task(task.task_id), "entry_id")
    await r.xdel(keys.stream("tr-lost", task.priority), entry_id)
    async with running_worker(fast(settings), WORKER_HANDLERS, queues=("tr-lost",)):
        await wait_status(r, task.task_id, "succeeded")
    return [task.task_id]


async def throttled_path(q: Queue, r: Redis, settings: Settings) -> list[str]:
    """A limit parks a queued task (QUEUED -> PENDING, docs/limits.md), which runs once due."""
    await r.hset(keys.limits("tr-limited"), "tr-slow", '{"queue":"tr-limited","rate":"1/500ms"}')
    tasks = [await q.submit("tr_ok", queue="tr-limited") for _ in range(2)]
    async with running_worker(fast(settings), WORKER_HANDLERS, queues=("tr-limited",)):
        for task in tasks:
            await wait_status(r, task.task_id, "succeeded")
    return [t.task_id for t in tasks]


async def rate_limited_path(q: Queue, r: Redis, settings: Settings) -> list[str]:
    """A handler pushed back by its upstream parks its task (RUNNING -> PENDING, docs/limits.md,
    "Back-pressure from a handler"), which runs once due."""
    task = await q.submit("tr_pushed", queue="tr-pushed", max_attempts=1)
    async with running_worker(fast(settings), WORKER_HANDLERS, queues=("tr-pushed",)):
        await wait_status(r, task.task_id, "succeeded")
    return [task.task_id]


async def no_dlq_path(q: Queue, r: Redis, settings: Settings) -> list[str]:
    """finish with the DLQ disabled: FAILED."""
    task = await q.submit("tr_perm", queue="tr-nodlq")
    async with running_worker(
        fast(settings, dlq_enabled=False), WORKER_HANDLERS, queues=("tr-nodlq",)
    ):
        await wait_status(r, task.task_id, "failed")
    return [task.task_id]


async def crash_paths(
    q: Queue, r: Redis, settings: Settings, spawn: Callable[..., WorkerProcess]
) -> list[str]:
    """A worker process dies running its tasks (``sp_crash`` exits the process); a peer's reaper
    claims them and the start script sees a crash redelivery: it runs again (running ->
    running), is dead-lettered with WorkerLost (attempts exhausted), or is cancelled (a cancel
    was requested while its worker was dead)."""
    again = await q.submit("sp_crash", queue="tr-crash", max_attempts=2)
    lost = await q.submit("sp_crash", queue="tr-crash", max_attempts=1)
    cancelled = await q.submit("sp_crash", queue="tr-crash", max_attempts=2)
    proc = spawn("worker-trcrash1", "--queue", "tr-crash", "--concurrency", "4")
    assert proc.wait(60) == 17, proc.output()  # the handler's os._exit(17)
    for task in (again, lost, cancelled):
        await wait_status(r, task.task_id, "running")
    with pytest.raises(TaskRunningError):  # its worker is dead: only cancel_requested is set
        await q.cancel(cancelled.task_id)
    async with running_worker(fast(settings), handlers(sp_crash=ok), queues=("tr-crash",)):
        await wait_status(r, again.task_id, "succeeded")
        await wait_status(r, lost.task_id, "dead_lettered")
        await wait_status(r, cancelled.task_id, "cancelled")
    return [again.task_id, lost.task_id, cancelled.task_id]


# -- the check ----------------------------------------------------------------------------------


async def histories(r: Redis) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    async for key in r.scan_iter(match=keys.history("*"), count=1000):
        task_id = key.split(":")[2]
        out[task_id] = [json.loads(e) for e in await r.lrange(key, 0, -1)]
    return out


async def test_every_history_step_is_in_the_table_and_every_pair_is_written(
    queue: Queue, r: Redis, settings: Settings, spawn: Callable[..., WorkerProcess]
) -> None:
    ids = await operator_paths(queue, r)
    ids += await worker_paths(queue, r, settings)
    ids += await start_expired_path(queue, r, settings)
    ids += await no_dlq_path(queue, r, settings)
    ids += await throttled_path(queue, r, settings)
    ids += await rate_limited_path(queue, r, settings)
    ids += await removed_entry_path(queue, r, settings)
    ids += await crash_paths(queue, r, settings, spawn)

    allowed = table_pairs()
    found = await histories(r)
    assert set(ids) <= set(found)
    written: dict[Pair, list[str]] = defaultdict(list)
    wrong: list[str] = []
    for task_id, entries in found.items():
        status = await r.hget(keys.task(task_id), "status")
        assert entries and entries[0]["from"] is None, (task_id, entries)
        previous = None
        for e in entries:
            pair = (e["from"], e["to"])
            written[pair].append(task_id)
            if pair not in allowed:
                wrong.append(f"{task_id}: {pair} ({e.get('reason')})")
            if e["from"] != previous:
                wrong.append(f"{task_id}: {pair} after {previous}")
            previous = e["to"]
        assert previous == status, (task_id, entries, status)
        assert status in TERMINAL, (task_id, status)  # every path ran to its end
    assert not wrong, f"history steps outside the table: {wrong}"
    never = sorted(allowed - set(written), key=str)
    assert not never, f"table pairs no script path wrote: {never}"
