"""Schedules fired by real worker processes (``python -m dtq.worker``): exactly one task per
tick while three workers run and the scheduler leader is SIGSTOPped, and schedules declared in
code across worker restarts and a deploy that drops the declaration. Every process is stopped
by PID at the end, whatever happens."""

from __future__ import annotations

import contextlib
import signal
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from dtq import Queue, keys
from dtq.clock import redis_time_ms
from dtq.errors import ScheduleNotFoundError
from dtq.models import LIST_LIMIT_MAX, Task, parse_ts
from dtq.worker.firer import TAKEOVER_MS
from support import wait_until
from support.worker import WorkerProcess, terminal, wait_worker_ready

pytestmark = pytest.mark.slow

TASKS = '''
"""Task types of the schedule tests' worker processes."""
from dtq_tasks import every, task

SCHEDULE = {schedule}


@task("tick", schedule=SCHEDULE)
async def tick(payload, ctx):
    return {{"schedule": ctx.schedule, "scheduled_for": ctx.scheduled_for.isoformat()}}
'''


def task_module(folder: Path, name: str, schedule: str = "None") -> str:
    """A task module ``name`` with the handler ``tick``, declaring ``schedule`` (Python
    source: ``None`` or an ``every(...)`` call)."""
    (folder / f"{name}.py").write_text(textwrap.dedent(TASKS.format(schedule=schedule)))
    return name


@pytest.fixture
def spawn(tmp_path: Path, redis_url: str) -> Iterator[Callable[..., WorkerProcess]]:
    """``spawn(worker_id, tasks)``: a worker process on task module ``tasks``; every one is
    stopped at the end of the test."""
    started: list[WorkerProcess] = []

    def make(worker_id: str, tasks: str) -> WorkerProcess:
        proc = WorkerProcess(redis_url, tmp_path, worker_id=worker_id, tasks=tasks)
        started.append(proc)
        return proc

    yield make
    for proc in started:
        proc.stop()


async def tick_tasks(queue: Queue) -> list[Task]:
    tasks = await queue.list(task_type="tick", limit=LIST_LIMIT_MAX)
    return sorted(tasks, key=lambda t: t.metadata["scheduled_for"])


def ticks_ms(tasks: list[Task]) -> list[int]:
    return [round(parse_ts(t.metadata["scheduled_for"]).timestamp() * 1000) for t in tasks]


def ms(iso: str) -> int:
    return round(parse_ts(iso).timestamp() * 1000)


async def redis_time_past(r: Redis, when_ms: int) -> None:
    async def passed() -> bool:
        return await redis_time_ms(r) >= when_ms

    await wait_until(passed, (when_ms - await redis_time_ms(r)) / 1000 + 5, "time passed")


async def test_three_workers_one_task_per_tick_while_the_leader_is_stopped(
    spawn: Callable[..., WorkerProcess], r: Redis, queue: Queue, tmp_path: Path
) -> None:
    """An every-second schedule for 30 s over three worker processes; 10 s in, the scheduler
    leader is SIGSTOPped for 5 s. The others fire its ticks once they are TAKEOVER_MS late,
    and the leader, resumed, finds them decided: every second from the first tick to the
    last has exactly one task, and the schedule counts exactly those."""
    mod = task_module(tmp_path, "sched_plain")
    ids = ("worker-sched001", "worker-sched002", "worker-sched003")
    procs = {wid: spawn(wid, mod) for wid in ids}
    for wid in procs:
        await wait_worker_ready(r, wid)
    leader = ""

    async def led() -> bool:
        nonlocal leader
        leader = await r.get(keys.SCHEDULER_LOCK) or ""
        return leader in procs

    await wait_until(led, 10, "a scheduler leader among the three")
    # overlap allow: a task the stopped leader had taken stays running until it is reclaimed,
    # and that must not cost a tick
    await queue.put_schedule("each-second", every=1, task_type="tick", overlap="allow")
    t0 = await redis_time_ms(r)

    await redis_time_past(r, t0 + 10_000)
    procs[leader].signal(signal.SIGSTOP)
    stopped = await redis_time_ms(r)
    await redis_time_past(r, stopped + 5_000)
    procs[leader].signal(signal.SIGCONT)
    resumed = await redis_time_ms(r)
    await redis_time_past(r, t0 + 30_000)
    await queue.pause_schedule("each-second")  # the last decision: a pause moves the rev
    assert await r.get(keys.SCHEDULER_LOCK) == leader, "the lock moved: not the case tested"

    tasks = await tick_tasks(queue)
    fired = ticks_ms(tasks)
    assert len(fired) == len(set(fired)), "a tick fired twice"
    assert fired == list(range(fired[0], fired[-1] + 1, 1000)), "a tick was lost"
    assert fired[0] <= t0 + 1_000 and fired[-1] >= t0 + 29_000
    s = await queue.get_schedule("each-second")
    assert s.fired == len(tasks)
    assert s.skipped_overlap == 0 and s.missed == 0

    # The ticks due while the leader was stopped were fired by the others before it came
    # back; they waited for it TAKEOVER_MS first (then a firing takes every tick due, so
    # the ticks after the late one are fired with it, less late).
    lag = {ms(e["tick"]): e["lag_ms"] for e in s.history if e["decision"] == "fired"}
    during = [t for t in fired if stopped < t <= resumed - TAKEOVER_MS - 1_000]
    assert during
    for t in during:
        assert t + lag[t] < resumed, f"tick {t} waited for the stopped leader"
    assert max(lag[t] for t in during) >= TAKEOVER_MS - 100

    async def all_ran() -> bool:
        hashes = [await r.hgetall(keys.task(t.task_id)) for t in tasks]
        return all(terminal(h) for h in hashes)

    await wait_until(all_ran, 20, "every firing ran")
    for t in tasks:
        done = await queue.get(t.task_id)
        assert done.status == "succeeded", done
        assert done.result == {"schedule": "each-second", "scheduled_for": done_iso(t)}


def done_iso(t: Task) -> str:
    return parse_ts(t.metadata["scheduled_for"]).isoformat()


async def test_code_schedule_survives_restarts_and_is_paused_when_dropped(
    spawn: Callable[..., WorkerProcess], r: Redis, queue: Queue, tmp_path: Path
) -> None:
    """``@task("tick", schedule=every(1))``: a starting worker creates it (origin code); a
    restart with the same code changes nothing, and a deploy that changes only its template
    updates it, both leaving its cursor where it was (the ticks of the restart fire late, none
    twice, none lost); a worker whose code no longer declares it pauses it with reason
    "removed from code" and logs a warning."""
    v1 = task_module(tmp_path, "sched_v1", 'every(1, overlap="allow")')
    v1b = task_module(tmp_path, "sched_v1b", 'every(1, overlap="allow", payload={"v": 2})')

    async def fired_at_least(n: int) -> bool:
        return (await queue.get_schedule("tick", history=0)).fired >= n

    async def run_until_two_more(worker_id: str, mod: str) -> WorkerProcess:
        """Start a worker on ``mod``, let it fire two ticks, stop it; the schedule before its
        start must be where it goes on from."""
        before = None
        with contextlib.suppress(ScheduleNotFoundError):
            before = await queue.get_schedule("tick", history=0)
        proc = spawn(worker_id, mod)
        await wait_worker_ready(r, worker_id)
        n = 0 if before is None else before.fired
        await wait_until(lambda: fired_at_least(n + 2), 10, f"two firings by {worker_id}")
        proc.signal(signal.SIGTERM)
        proc.wait(15)
        fired = ticks_ms(await tick_tasks(queue))
        assert fired == list(range(fired[0], fired[-1] + 1, 1000)), "a gap or a duplicate"
        if before is not None:
            assert before.next_fire_at is not None
            first = fired[before.fired]  # this worker's first firing: the cursor it found
            assert first == round(before.next_fire_at.timestamp() * 1000), "the cursor moved"
        return proc

    a = await run_until_two_more("worker-code0001", v1)
    s = await queue.get_schedule("tick")
    assert s.origin == "code" and s.definition.every == 1 and s.definition.overlap == "allow"
    assert "schedule tick created from code" in a.output()

    b = await run_until_two_more("worker-code0002", v1)  # a restart: the same code
    assert "from code" not in b.output(), "the restart changed the schedule"
    after = await queue.get_schedule("tick")
    assert after.updated_at == s.updated_at
    assert [e["decision"] for e in after.history if e["decision"] != "fired"] == ["created"]

    c = await run_until_two_more("worker-code0003", v1b)  # a deploy: the template changed
    assert "schedule tick updated from code" in c.output()
    s = await queue.get_schedule("tick")
    assert s.definition.payload == {"v": 2}
    assert [e["decision"] for e in s.history if e["decision"] != "fired"] == [
        "updated",
        "created",
    ]

    v2 = task_module(tmp_path, "sched_v2")
    d = spawn("worker-code0004", v2)
    await wait_worker_ready(r, "worker-code0004")
    s = await queue.get_schedule("tick")
    assert s.state == "paused" and s.paused_reason == "removed from code"
    (warned,) = [line for line in d.output().splitlines() if "no longer declares it" in line]
    assert "WARNING" in warned
    assert "schedule tick was declared in code that no longer declares it: paused" in warned
    assert s.history[0]["decision"] == "paused"
    assert await r.zscore(keys.schedules(""), "tick") == float("inf")
