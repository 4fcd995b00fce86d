"""Periodic schedules against a real Redis (docs/schedules.md): the guarantees a user trusts.

Catch-up after a downtime by each policy, the overlap policies with a handler slower than the
interval, a second firer and a replayed call never making a second task, schedules declared in
code across restarts, what a handler sees, events and metrics, pause / start / end, and the
cluster layout. Most tests drive the firer (:class:`dtq.worker.firer.Firer`) by hand, pass by
pass, so what is due is decided by the test; the ones that need handlers run one in-process
worker. Three worker processes and a stopped leader are in ``test_schedule_workers.py``."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from dtq import Queue, connect, keys
from dtq.admin.schedules import fire_due, plan_firing
from dtq.calls import Audit, fire
from dtq.clock import redis_time_ms
from dtq.config import Settings
from dtq.errors import ScheduleNotFoundError
from dtq.models import LIST_LIMIT_MAX, Task, format_ts, parse_ts
from dtq.schedules import BUFFER_POLL_MS, CATCHUP_CAP, HISTORY_CAP, ScheduleDef
from dtq.worker import Worker
from dtq.worker.firer import Firer
from dtq.worker.telemetry import WorkerTelemetry
from dtq_tasks import TaskContext
from support import Events, running_worker, started, wait_until
from support.worker import fast, handlers

MINUTE_MS = 60_000


# -- helpers --------------------------------------------------------------------------------------


async def fired_tasks(queue: Queue, task_type: str) -> list[Task]:
    """Every task of ``task_type``, oldest tick first."""
    tasks = await queue.list(task_type=task_type, limit=LIST_LIMIT_MAX)
    return sorted(tasks, key=lambda t: t.metadata["scheduled_for"])


def ticks_ms(tasks: Sequence[Task]) -> list[int]:
    """The ticks (epoch ms) the tasks were fired for, from their metadata."""
    return [round(parse_ts(t.metadata["scheduled_for"]).timestamp() * 1000) for t in tasks]


async def rewind(r: Redis, name: str, queue: str, cursor_ms: int) -> None:
    """Leave schedule ``name`` as a firer that stopped deciding at ``cursor_ms`` left it.

    Only fire.lua moves the cursor of a running schedule, together with its index score and a
    new rev; while no firer runs (every worker down) and nobody edits the schedule, nothing
    writes its hash at all. So a downtime that began at ``cursor_ms`` leaves exactly this:
    cursor = the first tick not decided, index score = that tick, and a rev no planned call
    holds. The Redis clock meanwhile goes on, which is what makes the ticks since then due:
    moving the cursor back by the downtime is the same state as waiting it out."""
    h = keys.schedule(name, queue)
    pipe = r.pipeline(transaction=False)
    pipe.hset(h, "cursor", cursor_ms)
    pipe.zadd(keys.schedules(queue), {name: cursor_ms})
    pipe.hincrby(h, "rev", 1)
    await pipe.execute()


async def fire_until_idle(queue: Queue, name: str, passes: int = 20) -> None:
    """Firer passes (as the leader) until schedule ``name`` has nothing due at the Redis time."""
    firer = Firer(queue.store, lambda: True)
    for _ in range(passes):
        await firer.step()
        s = await queue.get_schedule(name, history=0)
        now = await redis_time_ms(queue.redis)
        if s.next_fire_at is None or s.next_fire_at.timestamp() * 1000 > now:
            return
    raise AssertionError(f"schedule {name} still due after {passes} passes")


async def fire_until_due_and_fired(queue: Queue, name: str, n: int, timeout_s: float = 5) -> None:
    """Firer passes (as the leader), as often as the firer itself would, until schedule
    ``name`` has fired ``n`` ticks in all."""
    firer = Firer(queue.store, lambda: True)

    async def fired() -> bool:
        await firer.step()
        return (await queue.get_schedule(name, history=0)).fired >= n

    await wait_until(fired, timeout_s, f"{name} fired {n}", every_s=0.05)


async def clear_of(r: Redis, period_ms: int, margin_ms: int) -> int:
    """The Redis time once it is at least ``margin_ms`` past a multiple of ``period_ms`` and
    as far before the next one: which ticks are late (within grace) and which are missed, or
    which come due while a step runs, is then certain."""
    found = 0

    async def clear() -> bool:
        nonlocal found
        found = await redis_time_ms(r)
        return margin_ms <= found % period_ms <= period_ms - margin_ms

    await wait_until(clear, 2 * margin_ms / 1000 + 1, "a time clear of a tick")
    return found


def missed_entries(history: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in history if e["decision"] == "missed"]


# -- catch-up after a downtime ------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["skip", "latest", "all"])
async def test_cron_catchup_after_ten_minutes_down(queue: Queue, r: Redis, policy: str) -> None:
    """Every minute, down for 10 minutes: 10 ticks due at once, none within grace (3 s)."""
    await queue.put_schedule(
        "minutely",
        cron="* * * * *",
        task_type="report",
        catchup=policy,
        grace_s=3,
        overlap="allow",  # no worker runs: each fired tick's task stays queued
    )
    now = await clear_of(r, MINUTE_MS, 4_000)
    latest = now - now % MINUTE_MS
    down_from = latest - 9 * MINUTE_MS
    await rewind(r, "minutely", "", down_from)
    await fire_until_idle(queue, "minutely")

    due = [down_from + i * MINUTE_MS for i in range(10)]
    expected = {"skip": [], "latest": [latest], "all": due}[policy]
    tasks = await fired_tasks(queue, "report")
    assert ticks_ms(tasks) == expected
    s = await queue.get_schedule("minutely")
    assert s.fired == len(expected)
    assert s.missed == 10 - len(expected)
    assert s.next_fire_at is not None
    assert s.next_fire_at.timestamp() * 1000 == latest + MINUTE_MS
    missed = missed_entries(s.history)
    if policy == "all":
        assert missed == []
    else:
        assert len(missed) == 1
        assert missed[0]["count"] == 10 - len(expected)
        assert missed[0]["first"] == format_ts(down_from)
        last = latest if policy == "skip" else latest - MINUTE_MS
        assert missed[0]["last"] == format_ts(last)
    fired = [e for e in s.history if e["decision"] == "fired"]
    assert sorted(e["task_id"] for e in fired) == sorted(t.task_id for t in tasks)


async def test_catchup_all_keeps_to_its_window(queue: Queue, r: Redis) -> None:
    """``all`` with a 5-minute window after 10 minutes down: the ticks of the last 5 minutes
    fire, the older ones are counted missed."""
    await queue.put_schedule(
        "windowed",
        cron="* * * * *",
        task_type="report",
        catchup="all",
        catchup_window_s=300,
        grace_s=3,
        overlap="allow",
    )
    now = await clear_of(r, MINUTE_MS, 4_000)
    latest = now - now % MINUTE_MS
    await rewind(r, "windowed", "", latest - 9 * MINUTE_MS)
    await fire_until_idle(queue, "windowed")

    in_window = [
        latest - k * MINUTE_MS for k in range(5) if latest - k * MINUTE_MS >= now - 300_000
    ]
    assert ticks_ms(await fired_tasks(queue, "report")) == sorted(in_window)
    s = await queue.get_schedule("windowed")
    (missed,) = missed_entries(s.history)
    assert missed["count"] == 10 - len(in_window) == s.missed
    assert missed["last"] == format_ts(min(in_window) - MINUTE_MS)


async def test_catchup_all_is_capped(queue: Queue, r: Redis) -> None:
    """An every-second cron down for 10 minutes: ``all`` fires the latest CATCHUP_CAP missed
    ticks (over several calls: one call decides at most 32) and the ticks within grace, one
    task each, and counts the older ones missed."""
    await queue.put_schedule(
        "secondly",
        cron="* * * * * *",
        task_type="report",
        catchup="all",
        grace_s=3,
        overlap="allow",
    )
    now = await clear_of(r, 1000, 250)  # the first plan is made within the same second
    down_from = now - now % 1000 - 600_000
    await rewind(r, "secondly", "", down_from)
    async with Events(r) as events:
        await fire_until_idle(queue, "secondly", passes=40)

    fired = ticks_ms(await fired_tasks(queue, "report"))
    assert fired == list(range(fired[0], fired[-1] + 1, 1000)), "a gap or a duplicate"
    assert fired[-1] >= now - now % 1000  # up to the tick due when the downtime ended
    late = [t for t in fired if t >= now - 3_000]  # fired as late ticks, not catch-up ones
    assert len(fired) - len(late) == CATCHUP_CAP
    s = await queue.get_schedule("secondly")
    assert s.fired == len(fired)
    assert s.missed == (fired[0] - down_from) // 1000
    # The history keeps its 100 latest decisions, all firings here: the event tells the miss.
    (skipped,) = events.of("SCHEDULE_SKIPPED")
    assert skipped.metadata == {
        "schedule": "secondly",
        "reason": "missed",
        "count": s.missed,
        "first": format_ts(down_from),
        "last": format_ts(fired[0] - 1000),
    }
    assert len(s.history) == HISTORY_CAP


async def test_catchup_all_with_short_ttl_expires_old_ticks_at_once(queue: Queue, r: Redis) -> None:
    """ttl_seconds counts from each tick: the catch-up firings of ticks minutes old are
    expired as they are enqueued (no worker would ever start them); the schedule still
    counts them fired, one task per tick."""
    await queue.put_schedule(
        "stale-ok",
        cron="* * * * *",
        task_type="report",
        catchup="all",
        grace_s=3,
        ttl_seconds=2,
    )  # an expired task is terminal: the default overlap policy (skip) lets the next fire
    now = await clear_of(r, MINUTE_MS, 4_000)
    latest = now - now % MINUTE_MS
    await rewind(r, "stale-ok", "", latest - 2 * MINUTE_MS)
    await fire_until_idle(queue, "stale-ok")
    tasks = await fired_tasks(queue, "report")
    assert ticks_ms(tasks) == [latest - 2 * MINUTE_MS, latest - MINUTE_MS, latest]
    for t, tick in zip(tasks, ticks_ms(tasks), strict=True):
        assert t.status == "expired", t
        assert t.expires_at is not None
        assert t.expires_at.timestamp() * 1000 == tick + 2_000
    assert (await queue.get_schedule("stale-ok")).fired == 3


async def test_fresh_firing_has_deadline_from_its_tick(queue: Queue, r: Redis) -> None:
    await queue.put_schedule("ttl", every=1, task_type="report", ttl_seconds=30)
    await fire_until_due_and_fired(queue, "ttl", 1)
    (t,) = await fired_tasks(queue, "report")
    (tick,) = ticks_ms([t])
    assert t.status == "queued"
    assert t.expires_at is not None and t.expires_at.timestamp() * 1000 == tick + 30_000


# -- exactly once: racing firers, replays -------------------------------------------------------


async def test_two_leaders_racing_never_make_a_second_task(queue: Queue, r: Redis) -> None:
    """Two firers that both think they lead, passing at the same moments over an
    every-second schedule with catch-up ticks due: each tick has one task."""
    await queue.put_schedule(
        "raced", every=1, task_type="report", catchup="all", grace_s=3, overlap="allow"
    )
    now = await redis_time_ms(r)
    await rewind(r, "raced", "", now - now % 1000 - 20_000)  # 20 missed ticks to fight over
    a, b = Firer(queue.store, lambda: True), Firer(queue.store, lambda: True)
    end = now + 3_000
    while await redis_time_ms(r) < end:
        await asyncio.gather(a.step(), b.step())
    fired = ticks_ms(await fired_tasks(queue, "report"))
    assert fired == list(range(fired[0], fired[-1] + 1, 1000)), "a gap or a duplicate"
    assert len(fired) >= 22
    s = await queue.get_schedule("raced")
    assert s.fired == len(fired)
    assert len([e for e in s.history if e["decision"] == "fired"]) == len(fired)


async def test_replayed_fire_call_is_stale_and_a_tick_again_is_a_duplicate(
    queue: Queue, r: Redis
) -> None:
    """A firing planned from a rev is refused once the rev moved (a stalled leader's call that
    arrives late); a tick submitted again whatever the cursor says is its first task."""
    store = queue.store
    await queue.put_schedule("replayed", every=1, task_type="report", overlap="allow")
    await fire_until_due_and_fired(queue, "replayed", 1)
    before = await fired_tasks(queue, "report")
    (tick,) = ticks_ms(before)

    # Plan the tick again, from the hash as it is now but with the cursor back on it.
    h = await r.hgetall(keys.schedule("replayed", ""))
    d = ScheduleDef.model_validate_json(h["definition"])
    replanned = plan_firing("replayed", {**h, "cursor": str(tick)}, d, tick + 100, store)
    assert [c.tick_ms for c in replanned.candidates] == [tick]

    stale = dataclasses.replace(replanned, rev=str(int(h["rev"]) - 1))  # the rev before the firing
    (reply,) = await fire(store, [stale], HISTORY_CAP, BUFFER_POLL_MS)
    assert not isinstance(reply, Exception) and reply.kind == "stale"
    assert reply.rev == h["rev"]

    (reply,) = await fire(store, [replanned], HISTORY_CAP, BUFFER_POLL_MS)
    assert not isinstance(reply, Exception) and reply.kind == "ok"
    (decision,) = reply.decisions
    assert decision.decision == "duplicate"
    assert decision.task_id == before[0].task_id
    after = await fired_tasks(queue, "report")
    assert [t.task_id for t in after] == [before[0].task_id]
    assert (await queue.get_schedule("replayed")).fired == 1


async def test_fire_due_of_a_deleted_schedule_drops_its_index_member(
    queue: Queue, r: Redis
) -> None:
    await queue.put_schedule("gone", every=1, task_type="report")
    await r.delete(keys.schedule("gone", ""))
    (done,) = await fire_due(queue.store, [("gone", "")], {}, [])
    assert done[1].kind == "gone"
    assert await r.zscore(keys.schedules(""), "gone") is None


# -- pause, start and end -----------------------------------------------------------------------


async def firer_passes(queue: Queue, until_ms: int) -> None:
    """The firer's passes, as the leader, until the Redis time ``until_ms``."""
    firer = Firer(queue.store, lambda: True)
    stop = asyncio.Event()
    run = asyncio.create_task(firer.run(stop))

    async def passed() -> bool:
        return await redis_time_ms(queue.redis) >= until_ms

    try:
        await wait_until(passed, (until_ms - await redis_time_ms(queue.redis)) / 1000 + 5)
    finally:
        stop.set()
        await run


async def test_paused_never_fires_and_resumed_goes_on_from_now(queue: Queue, r: Redis) -> None:
    """Created paused, nothing fires however long the firer runs; resumed, the ticks of the
    pause are decided by the catch-up policy (skip: the ones older than grace are missed, not
    fired) and it fires again from the time of the resume."""
    s, outcome = await queue.put_schedule(
        "held",
        every=1,
        task_type="report",
        paused=True,
        catchup="skip",
        grace_s=3,
        overlap="allow",
    )
    assert outcome == "created" and s.state == "paused"
    assert await r.zscore(keys.schedules(""), "held") == float("inf")
    now = await clear_of(r, 1000, 200)
    await firer_passes(queue, now + 5_600)
    assert await fired_tasks(queue, "report") == []
    assert (await queue.get_schedule("held")).fired == 0

    assert await queue.resume_schedule("held") is True
    assert await queue.resume_schedule("held") is False  # resumed already: no change
    resumed = await redis_time_ms(r)
    await fire_until_due_and_fired(queue, "held", 2)
    fired = ticks_ms(await fired_tasks(queue, "report"))
    assert fired[0] >= resumed - 3_000, "a tick of the pause older than grace fired"
    assert fired == list(range(fired[0], fired[-1] + 1, 1000))
    s = await queue.get_schedule("held")
    assert s.missed >= 1
    assert [e["decision"] for e in s.history][-3:] == ["missed", "resumed", "created"]

    assert await queue.pause_schedule("held") is True
    paused_at = await redis_time_ms(r)
    await firer_passes(queue, paused_at + 1_500)
    again = ticks_ms(await fired_tasks(queue, "report"))
    assert all(t <= paused_at for t in again), "a paused schedule fired"
    # A firer that found it due just before the pause, and reads the hash after it: fire.lua
    # itself refuses to fire a paused schedule's ticks.
    due = (await queue.get_schedule("held")).next_fire_at
    assert due is not None and due <= await queue.now()
    ((_, reply),) = await fire_due(queue.store, [("held", "")], {}, [])
    assert reply.kind == "paused"
    assert ticks_ms(await fired_tasks(queue, "report")) == again


async def test_start_at_delays_the_first_tick_and_end_at_ends_it(queue: Queue, r: Redis) -> None:
    now = await clear_of(r, 1000, 100)
    start = now - now % 1000 + 2_000
    end = start + 2_000
    s, _ = await queue.put_schedule(
        "bounded",
        every=1,
        task_type="report",
        overlap="allow",
        start_at=format_ts(start),
        end_at=format_ts(end),
    )
    assert s.next_fire_at is not None and s.next_fire_at.timestamp() * 1000 == start
    assert [round(t.timestamp() * 1000) for t in await queue.next_fire_times("bounded")] == [
        start,
        start + 1_000,
        end,
    ]
    await firer_passes(queue, end + 1_100)
    assert ticks_ms(await fired_tasks(queue, "report")) == [start, start + 1_000, end]
    s = await queue.get_schedule("bounded")
    assert s.state == "ended" and s.next_fire_at is None and s.fired == 3
    assert await queue.next_fire_times("bounded") == []
    assert await r.zscore(keys.schedules(""), "bounded") == float("inf")


async def test_deleted_schedule_is_gone_with_its_keys(queue: Queue, r: Redis) -> None:
    await queue.put_schedule("doomed", every=1, task_type="report")
    await fire_until_due_and_fired(queue, "doomed", 1)
    (task,) = await fired_tasks(queue, "report")
    await queue.delete_schedule("doomed")
    assert not await r.exists(keys.schedule("doomed", ""), keys.schedule_history("doomed", ""))
    assert await r.zscore(keys.schedules(""), "doomed") is None
    with pytest.raises(ScheduleNotFoundError):
        await queue.get_schedule("doomed")
    with pytest.raises(ScheduleNotFoundError):
        await queue.trigger_schedule("doomed")
    assert (await queue.get(task.task_id)).task_id == task.task_id  # its tasks stay


# -- with a worker: overlap, what a handler sees, events, metrics ---------------------------------


SLOW_S = 2.5  # the handler of the overlap test: longer than two intervals of 1 s


async def test_overlap_policies_with_a_handler_slower_than_the_interval(
    queue: Queue, r: Redis, settings: Settings
) -> None:
    """Every second, a handler that takes 2.5 s: ``skip`` never runs two at once and records
    each tick it skips; ``allow`` runs them side by side; ``buffer_one`` holds one tick back
    (never two) and fires it once the running task has ended, for the held tick."""
    policies = ("skip", "allow", "buffer_one")
    running = dict.fromkeys(policies, 0)
    peak = dict.fromkeys(policies, 0)
    finished = dict.fromkeys(policies, 0)

    async def slow(payload: dict[str, Any], ctx: TaskContext) -> None:
        policy = payload["policy"]
        running[policy] += 1
        peak[policy] = max(peak[policy], running[policy])
        try:
            await asyncio.sleep(SLOW_S)
        finally:
            running[policy] -= 1
            finished[policy] += 1

    async with (
        Events(r) as events,
        running_worker(fast(settings), handlers(slow=slow), concurrency=12),
    ):
        for policy in policies:
            await queue.put_schedule(
                f"slow-{policy}",
                every=1,
                task_type="slow",
                payload={"policy": policy},
                overlap=policy,
            )

        async def buffered_one_done() -> bool:
            return finished["buffer_one"] >= 2 and finished["skip"] >= 2

        await wait_until(buffered_one_done, 15, "two slow tasks of skip and buffer_one ended")
        for policy in policies:
            await queue.pause_schedule(f"slow-{policy}")  # decisions end here
    tasks = {p: [t for t in await fired_tasks(queue, "slow") if t.payload["policy"] == p]
             for p in policies}  # fmt: skip

    # skip: one at a time; every tick is decided once, fired or skipped while one ran
    assert peak["skip"] == 1
    s = await queue.get_schedule("slow-skip")
    skipped = [e for e in s.history if e["decision"] == "skipped_overlap"]
    assert len(skipped) == s.skipped_overlap >= 2
    by_id = {t.task_id: t for t in tasks["skip"]}
    for e in skipped:
        holder = by_id[e["running_task_id"]]
        assert holder.metadata["scheduled_for"] < e["tick"]
        assert holder.finished_at is None or holder.finished_at > parse_ts(e["ts"])
    decided = sorted([parse_ms(e["tick"]) for e in skipped] + ticks_ms(tasks["skip"]))
    assert decided == list(range(decided[0], decided[-1] + 1, 1000)), (
        "a tick decided twice or never"
    )
    overlap_events = [e for e in events.of("SCHEDULE_SKIPPED")
                      if e.metadata["schedule"] == "slow-skip"]  # fmt: skip
    assert sorted(e.metadata["scheduled_for"] for e in overlap_events) == sorted(
        e["tick"] for e in skipped
    )
    assert {e.metadata["reason"] for e in overlap_events} == {"overlap"}

    # allow: side by side, nothing skipped
    assert peak["allow"] >= 2
    s = await queue.get_schedule("slow-allow")
    assert s.skipped_overlap == 0
    fired = ticks_ms(tasks["allow"])
    assert fired == list(range(fired[0], fired[-1] + 1, 1000))

    # buffer_one: one at a time, at most one held back, fired when the running one ended
    assert peak["buffer_one"] == 1
    s = await queue.get_schedule("slow-buffer_one")
    held: str | None = None
    held_ticks = []
    for e in reversed(s.history):  # oldest first
        if e["decision"] == "buffered":
            assert held is None, "a second tick held back while one was"
            held = e["tick"]
            held_ticks.append(held)
        elif e["decision"] == "fired" and e["tick"] == held:
            held = None
    assert held_ticks, "no tick was held back"
    by_tick = {t.metadata["scheduled_for"]: t for t in tasks["buffer_one"]}
    first_held = by_tick[held_ticks[0]]  # fired for the held tick, not for the time it fired
    before = max((t for t in tasks["buffer_one"] if t.created_at < first_held.created_at),
                 key=lambda t: t.created_at)  # fmt: skip
    assert before.finished_at is not None and before.finished_at <= first_held.created_at
    gap_ms = (first_held.created_at - before.finished_at).total_seconds() * 1000
    # at the firer's next pass after that end (the next tick's, a second at most), not later
    assert gap_ms <= 1_800, f"held tick fired {gap_ms:.0f} ms after the end"
    (fired_event,) = [e for e in events.of("SCHEDULE_FIRED", first_held.task_id)]
    assert fired_event.metadata["buffered"] is True
    assert fired_event.metadata["scheduled_for"] == held_ticks[0]


def parse_ms(iso: str) -> int:
    return round(parse_ts(iso).timestamp() * 1000)


async def test_handler_sees_its_firing_and_events_and_metrics_tell(
    queue: Queue, r: Redis, settings: Settings
) -> None:
    """ctx.schedule and ctx.scheduled_for match the task's metadata; a manual trigger is marked
    and deduplicated by its key; SCHEDULE_FIRED / SCHEDULE_SKIPPED tell each decision; the
    worker's metrics count the firings (with their lag) and the missed ticks."""
    seen: dict[str, tuple[str | None, datetime | None]] = {}

    async def probe(payload: dict[str, Any], ctx: TaskContext) -> None:
        seen[ctx.task_id] = (ctx.schedule, ctx.scheduled_for)

    hmap = handlers(probe=probe)
    telemetry = WorkerTelemetry(hmap)
    worker = Worker(
        fast(settings),
        handlers=hmap,
        worker_id="worker-probe001",
        observers=telemetry.observers("worker-probe001"),
    )
    hour_ms = 3_600_000
    now = await clear_of(r, hour_ms, 5_000)
    await queue.put_schedule(
        "behind", cron="0 * * * *", task_type="probe", catchup="skip", grace_s=3
    )
    await rewind(r, "behind", "", now - now % hour_ms - 9 * hour_ms)  # 10 hourly ticks due
    async with Events(r) as events, started(worker):

        async def leads() -> bool:
            return await r.get(keys.SCHEDULER_LOCK) == "worker-probe001"

        await wait_until(leads, 5, "the worker leads")  # so it fires on time, not as a backup
        await queue.put_schedule("probe", every=1, task_type="probe")

        async def two_ran() -> bool:
            return len(seen) >= 2

        await wait_until(two_ran, 5, "two firings ran")
        manual = await queue.trigger_schedule("probe", key="deploy-42")
        again = await queue.trigger_schedule("probe", key="deploy-42")
        assert again.duplicate and again.task_id == manual.task_id

        async def manual_ran() -> bool:
            return manual.task_id in seen

        await wait_until(manual_ran, 5, "the manual firing ran")
        await queue.pause_schedule("probe")
    tasks = await fired_tasks(queue, "probe")
    assert {t.task_id for t in tasks} == set(seen)
    assert manual.metadata.get("trigger") == "manual"
    assert [t.task_id for t in tasks if t.metadata.get("trigger")] == [manual.task_id]
    ticked = [t for t in tasks if "trigger" not in t.metadata]
    for t in tasks:
        assert t.metadata["schedule"] == "probe"
    for t in ticked:  # the tick, read by the worker from the firing's idempotency key
        assert seen[t.task_id] == ("probe", parse_ts(t.metadata["scheduled_for"]))
    # A manual firing's key has no tick: the handler is given the task's creation time, the
    # same moment as the metadata's trigger time give or take the script's own clock read.
    name, when = seen[manual.task_id]
    assert name == "probe" and when is not None
    lag = when - parse_ts(manual.metadata["scheduled_for"])
    assert 0 <= lag.total_seconds() < 1

    fired_events = {e.task_id: e for e in events.of("SCHEDULE_FIRED")}
    assert set(fired_events) == set(seen)
    for t in tasks:
        e = fired_events[t.task_id]
        assert (e.queue, e.task_type) == ("default", "probe")
        assert e.metadata["schedule"] == "probe"
        assert e.metadata["scheduled_for"] == t.metadata["scheduled_for"]
        assert e.metadata["lag_ms"] >= 0
        assert e.metadata.get("trigger") == t.metadata.get("trigger")
    for t in ticked:  # fired by the leader: within a second of the tick, on a loaded machine
        assert fired_events[t.task_id].metadata["lag_ms"] < 1_000
    (missed,) = events.of("SCHEDULE_SKIPPED")
    assert missed.metadata["schedule"] == "behind" and missed.metadata["reason"] == "missed"
    assert missed.metadata["count"] == 10

    scrape = generate_latest(telemetry.metrics.registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(scrape)}

    def value(name: str, **labels: str) -> float:
        return sum(
            s.value
            for f in families.values()
            for s in f.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    qt = {"queue": "default", "task_type": "probe"}
    assert value("dtq_schedule_firings_total", **qt, status="fired") == len(ticked)
    assert value("dtq_schedule_firings_total", **qt, status="missed") == 10
    assert value("dtq_schedule_firings_total", **qt, status="skipped_overlap") == 0
    assert value("dtq_schedule_lag_seconds_count", **qt) == len(ticked)
    lags = [fired_events[t.task_id].metadata["lag_ms"] / 1000 for t in ticked]
    assert value("dtq_schedule_lag_seconds_sum", **qt) == pytest.approx(sum(lags))


# -- the cluster layout ------------------------------------------------------------------------


@pytest.mark.backends("cluster", reason="the keys of a schedule in its queue's slot")
async def test_cluster_schedule_fires_and_is_managed_in_its_queue_slot(
    queue: Queue, r: Redis
) -> None:
    """On a Redis Cluster a schedule's keys are in its tasks' queue's slot (fire.lua enqueues a
    tick and moves the cursor in one call there): it fires, is read, listed, paused, triggered,
    moved to another queue with its cursor, and deleted with its keys."""
    s, outcome = await queue.put_schedule("cq", every=1, task_type="report", queue="reports")
    assert outcome == "created" and s.definition.queue == "reports"
    h = keys.schedule("cq", "reports")
    assert h.startswith("dtq:{reports}:")
    assert await r.zscore(keys.schedules("reports"), "cq") is not None
    await fire_until_due_and_fired(queue, "cq", 1)
    (task,) = await fired_tasks(queue, "report")
    assert task.queue == "reports" and task.metadata["schedule"] == "cq"
    assert [x.name for x in await queue.list_schedules()] == ["cq"]
    s = await queue.get_schedule("cq")
    assert s.fired == 1 and s.last_task_id == task.task_id

    assert await queue.pause_schedule("cq") is True
    assert (await queue.get_schedule("cq")).state == "paused"
    manual = await queue.trigger_schedule("cq", key="k")  # a manual firing ignores the pause
    assert manual.metadata["trigger"] == "manual" and manual.queue == "reports"
    assert (await queue.get_schedule("cq")).fired == 2

    cursor = await r.hget(h, "cursor")
    moved, outcome = await queue.put_schedule("cq", every=1, task_type="report", queue="elsewhere")
    assert outcome == "created" and moved.definition.queue == "elsewhere"
    assert not await r.exists(h, keys.schedule_history("cq", "reports"))
    assert await r.zscore(keys.schedules("reports"), "cq") is None
    assert await r.hget(keys.schedule("cq", "elsewhere"), "cursor") == cursor  # same spec

    await queue.delete_schedule("cq")
    assert not await r.exists(keys.schedule("cq", "elsewhere"))
    assert not await r.exists(keys.schedule_history("cq", "elsewhere"))
    assert await r.zscore(keys.schedules("elsewhere"), "cq") is None
    assert await queue.list_schedules() == []


# -- changes are announced and audited ------------------------------------------------------------


async def test_changes_are_announced_and_audited(queue: Queue, r: Redis) -> None:
    """Each change of a schedule publishes CONFIGURATION_CHANGED (metadata schedule, change)
    and, made with an actor, appends its audit entry in the same script; a call that changes
    nothing announces nothing."""
    who = Audit("cli:ops@host", "req-7")
    async with Events(r) as events:
        await queue.put_schedule("audited", every=60, task_type="report", audit=who)
        _, outcome = await queue.put_schedule("audited", every=60, task_type="report", audit=who)
        assert outcome == "unchanged"
        _, outcome = await queue.put_schedule(
            "audited", every=60, task_type="report", payload={"v": 2}, audit=who
        )
        assert outcome == "updated"
        assert await queue.pause_schedule("audited", audit=who) is True
        assert await queue.pause_schedule("audited", audit=who) is False
        assert await queue.resume_schedule("audited", audit=who) is True
        task = await queue.trigger_schedule("audited", audit=who)
        await queue.delete_schedule("audited", audit=who)
    changes = [e.metadata for e in events.of("CONFIGURATION_CHANGED")]
    assert changes == [
        {"schedule": "audited", "change": c}
        for c in ("created", "updated", "paused", "resumed", "deleted")
    ]
    (fired,) = events.of("SCHEDULE_FIRED")
    assert fired.task_id == task.task_id and fired.metadata["trigger"] == "manual"
    entries = list(reversed(await queue.audit_log()))  # oldest first
    assert [(e.action, e.actor, e.request_id) for e in entries] == [
        (action, "cli:ops@host", "req-7")
        for action in (
            "schedule_put",
            "schedule_put",
            "schedule_put",
            "schedule_pause",
            "schedule_resume",
            "schedule_trigger",
            "schedule_delete",
        )
    ]
    assert entries[5].task_id == task.task_id


async def test_a_full_queue_holds_the_tick_until_there_is_room(
    queue: Queue, r: Redis, settings: Settings
) -> None:
    """A tick the queue refuses (QUEUE_FULL) is not lost and not skipped: the cursor stays on
    it, the refusal is the schedule's last_error, and the tick fires once there is room."""
    full = await connect(settings=settings.model_copy(update={"max_queue_depth": 1}))
    try:
        await full.submit("filler", {})
        s, _ = await full.put_schedule("held-back", every=1, task_type="report", overlap="allow")
        assert s.next_fire_at is not None
        first = round(s.next_fire_at.timestamp() * 1000)
        await firer_passes(full, first + 1_500)
        s = await full.get_schedule("held-back")
        assert await fired_tasks(full, "report") == []
        assert s.fired == 0 and s.missed == 0
        assert s.last_error is not None and "QUEUE_FULL" in s.last_error
        assert s.next_fire_at is not None and s.next_fire_at.timestamp() * 1000 == first
    finally:
        await full.close()
    await fire_until_due_and_fired(queue, "held-back", 2)  # a firer with room in the queue
    fired = ticks_ms(await fired_tasks(queue, "report"))
    assert fired[:2] == [first, first + 1_000]
    assert (await queue.get_schedule("held-back")).last_error is None
