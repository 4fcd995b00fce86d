"""Scenarios about how long state lives: retention pressure (a retention of seconds, with
work that waits and runs longer than it) and a flood of distinct queue names (idle queues are
removed, served ones stay), each ending with the key audit of :mod:`chaos_bounds`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from chaos_bounds import audit_keys
from chaos_checker import (
    SETTLE_S,
    TERMINAL_EVENT_STATUS,
    Report,
    TaskView,
    check,
    dup_unexplained,
    iso_ms,
    judge,
    read_execs,
    require_clean,
)
from chaos_harness import TERMINAL, Run, Scale, WorkerProc, running, settings_for
from chaos_load import LoadGen, Spec, all_task_ids, pending_entries, wait_quiet
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from dtq import connect, keys
from support import wait_until

# -- retention pressure ---------------------------------------------------------------------

RETENTION_S = 2  # the smallest retention worth a scenario: every wait below is longer
HELD = "held"  # paused while its tasks are submitted, resumed past the retention


class Snapshots:
    """The last state read of every task, kept from the moment it is terminal: with a
    retention of seconds, a finished task's keys are gone before the load is, so the checker
    judges what was read while they lived. A task whose keys vanished before it was terminal
    keeps its last non-terminal state (or none), and counts as lost."""

    def __init__(self, r: Redis) -> None:
        self.r = r
        self.hashes: dict[str, dict[str, str]] = {}
        self.histories: dict[str, list[str]] = {}
        self.done: set[str] = set()
        self.ttl_ms: dict[str, int] = {}  # the hash's TTL when it was first seen terminal

    async def poll(self, task_ids: Iterable[str]) -> None:
        todo = sorted(set(task_ids) - self.done)
        for i in range(0, len(todo), 500):
            chunk = todo[i : i + 500]
            pipe = self.r.pipeline(transaction=True)  # a hash and its history at one instant
            for tid in chunk:
                pipe.hgetall(keys.task(tid))
                pipe.lrange(keys.history(tid), 0, -1)
                pipe.pttl(keys.task(tid))
            flat = await pipe.execute()
            for tid, h, hist, pttl in zip(chunk, flat[::3], flat[1::3], flat[2::3], strict=True):
                if not h:
                    continue
                self.hashes[tid], self.histories[tid] = h, hist
                if h.get("status") in TERMINAL:
                    self.done.add(tid)
                    self.ttl_ms[tid] = pttl

    async def follow(self, task_ids: Iterable[str], stop: asyncio.Event) -> None:
        """Poll every 0.1 s until ``stop``; ``task_ids`` may grow meanwhile."""
        while not stop.is_set():
            await self.poll(task_ids)
            await asyncio.sleep(0.1)
        await self.poll(task_ids)

    def views(
        self, task_ids: Iterable[str], exec_dir: Path, events: Sequence[Mapping[str, Any]]
    ) -> dict[str, TaskView]:
        execs = read_execs(exec_dir)
        terminal: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for ev in events:
            if ev.get("type") in TERMINAL_EVENT_STATUS and ev.get("task_id"):
                terminal[ev["task_id"]].append(dict(ev))
        return {
            tid: TaskView(
                tid,
                self.hashes.get(tid, {}),
                [json.loads(x) for x in self.histories.get(tid, [])],
                execs.get(tid, []),
                terminal.get(tid, []),
            )
            for tid in set(task_ids)
        }


def _retention_specs(scale: Scale) -> list[Spec]:
    """Tasks that each outlive the retention in one way: on the paused queue, delayed, a long
    handler, or retries whose backoff is longer than the retention; the rest ordinary."""
    rng = scale.rng("retention")
    n = scale.pick(200, 5000)
    longs = scale.pick(8, 40)
    specs = []
    for i in range(n):
        payload: dict[str, Any] = {"seq": i, "ms": rng.randint(5, 30)}
        options: dict[str, Any] = {}
        kind = rng.random()
        if i < longs:
            payload["ms"] = rng.randint(3000, 4000)
        elif kind < 0.3:
            options["queue"] = HELD
        elif kind < 0.6:
            options["delay_seconds"] = round(rng.uniform(2.5, 4.5), 3)
        if i >= longs and rng.random() < 0.25:
            payload["fail"] = f"retry:{rng.randint(1, 2)}"
        specs.append(Spec(i, "chaos_work", payload, options))
    return specs


async def retention_pressure(root: Path, scale: Scale) -> list[Report]:
    """A task retention of 2 s, and work that waits or runs longer: a queue paused for 4 s
    while its tasks are submitted, delayed tasks (2.5-4.5 s), long handlers (3-4 s), retries
    whose backoff is 3 s, and a worker killed -9 while it runs the long handlers (their
    redelivery comes after the visibility timeout, past the retention too). Every accepted
    task reaches exactly one terminal state (none vanishes), then every task's keys expire
    within the retention of its end and the key audit finds nothing unbounded."""
    specs = _retention_specs(scale)
    settings_ = {
        "TASK_RETENTION_S": str(RETENTION_S),
        "RESULT_RETENTION_S": str(RETENTION_S),
        "RETRY_BASE_DELAY": "3",
        "RETRY_MAX_DELAY": "3",
    }
    lowered = {k.lower(): v for k, v in settings_.items()}
    queues = ("default", HELD)
    serve = ["--queue", "default", "--queue", HELD]
    async with running(root, "retention_pressure", settings=settings_) as run:
        c = run.cluster
        sdk = await connect(settings=settings_for(c.url, **lowered))
        try:
            await sdk.pause_queue(HELD)
        finally:
            await sdk.close()
        await c.wait_workers([c.spawn_worker("ret", args=serve) for _ in range(3)])
        load = LoadGen(concurrency=64)
        accepted: set[str] = set()
        snaps = Snapshots(run.r)
        stop = asyncio.Event()
        following = asyncio.create_task(snaps.follow(accepted, stop))
        t0 = time.monotonic()
        try:
            await load.via_sdk(c.url, specs, rate=None, settings=settings_)
            accepted.update(load.accepted())
            by_seq = {r.seq: r.task_id for r in load.records if r.task_id}
            longs = {by_seq[s.seq] for s in specs if s.payload["ms"] >= 3000 and s.seq in by_seq}
            victim, held = await _kill_a_long_runner(run, list(c.workers), queues, longs)
            replacement = c.spawn_worker("ret", args=serve)
            await asyncio.sleep(max(0.0, t0 + 2 * RETENTION_S - time.monotonic()))
            sdk = await connect(settings=settings_for(c.url, **lowered))
            try:
                await sdk.resume_queue(HELD)
            finally:
                await sdk.close()
            await c.wait_workers([replacement])

            async def all_terminal() -> bool:
                return accepted <= snaps.done

            # What is not terminal by then counts as lost in the report.
            with contextlib.suppress(AssertionError):
                await wait_until(all_terminal, scale.pick(45, 180), "all terminal", every_s=0.2)
            await wait_quiet(run.r, [], 30, queues=queues)  # streams and schedule empty
            left = await _indexed(run.r, queues)
            await run.settle(SETTLE_S)
        finally:
            stop.set()
            await following
        quiet_s = time.monotonic() - t0
        views = snaps.views(accepted, c.exec_dir, run.events.events())
        rep = judge("retention pressure", load.records, views)
        rep.require(not left, f"{left} entries or schedule members left at quiescence")

        async def expired() -> bool:
            return not await all_task_ids(run.r)

        with contextlib.suppress(AssertionError):
            await wait_until(expired, 3 * RETENTION_S + 10, "every task expired", every_s=0.2)
        rep.require_zero("task hashes left past the retention", await all_task_ids(run.r))
        rep.require_zero("keys without a TTL or a documented bound", await audit_keys(run.r))
    require_clean(rep, dup=False)
    rep.require_zero("dup_exec not from the killed worker", dup_unexplained(rep, {victim}))
    rep.require(rep.statuses == {"succeeded": len(accepted)}, f"statuses {rep.statuses}")
    ttls = snaps.ttl_ms.values()
    rep.require_zero(
        "terminal tasks whose TTL is not the retention",
        [t for t, ms in snaps.ttl_ms.items() if not 0 < ms <= RETENTION_S * 1000],
    )
    waits, runs = _waits_and_runs(rep)
    past = sum(1 for w in waits if w > RETENTION_S)
    rep.require(past > 0, "no task waited longer than the retention")
    rep.require(max(runs, default=0.0) > RETENTION_S, "no handler ran longer than the retention")
    rep.notes.update(
        retention_s=RETENTION_S,
        waited_past_retention=past,
        longest_wait_s=round(max(waits, default=0.0), 2),
        longest_run_s=round(max(runs, default=0.0), 2),
        retried=sum(1 for v in rep.views.values() if v.retries),
        held_by_killed=len(held),
        quiet_s=round(quiet_s, 1),
        ttl_at_end_ms=f"{min(ttls, default=0)}-{max(ttls, default=0)}",
    )
    return [rep]


async def _indexed(r: Redis, queues: Sequence[str]) -> int:
    """Entries in the queues' streams plus members of the retry schedule and claimed set."""
    pipe = r.pipeline(transaction=False)
    for q in queues:
        for stream in keys.queue_streams(q):
            pipe.xlen(stream)
    pipe.zcard(keys.RETRY_SCHEDULE)
    pipe.zcard(keys.RETRY_CLAIMED)
    return int(sum(await pipe.execute()))


async def _kill_a_long_runner(
    run: Run, workers: Sequence[WorkerProc], queues: Sequence[str], longs: set[str]
) -> tuple[int, list[str]]:
    """``kill -9`` a worker that holds one of the long handlers' entries (within 10 s; else
    the first that holds any); returns its pid and the task ids it held."""
    found: list[tuple[WorkerProc, list[str]]] = []

    async def a_long_one_held() -> bool:
        found.clear()
        for w in workers:
            held = [tid for _, _, tid in await pending_entries(run.r, w.worker_id, queues)]
            if held:
                found.append((w, held))
        return any(longs & set(held) for _, held in found)

    with contextlib.suppress(AssertionError):
        await wait_until(a_long_one_held, 10, "a worker holding a long task", every_s=0.1)
    assert found, "no worker holds an entry"
    victim, held = max(found, key=lambda f: len(longs & set(f[1])))
    victim.proc.kill9()
    run.cluster.retire(victim)
    return victim.pid, held


def _waits_and_runs(rep: Report) -> tuple[list[float], list[float]]:
    """Seconds from a task's submit (or its last retry) to its start, and each handler run."""
    waits: list[float] = []
    for v in rep.views.values():
        since = float(v.hash.get("created_ms") or 0)
        for h in v.history:
            ts = iso_ms(h["ts"])
            if h.get("to") == "running" and since:
                waits.append((ts - since) / 1000)
            if h.get("to") in {"retrying", "running"}:
                since = ts
    runs = [
        (e.end_ns - e.start_ns) / 1e9
        for v in rep.views.values()
        for e in v.execs
        if e.end_ns is not None
    ]
    return waits, runs


# -- a flood of distinct queue names --------------------------------------------------------

IDLE_TTL_S = 2


async def _queue_state(r: Redis, queues: Sequence[str]) -> dict[str, dict[str, bool]]:
    """Which of each queue's keys exist: its ``dtq:queues`` member, any of its ten streams,
    the consumer group (on its p5 stream, where every submit here goes), its last-submit time."""
    out: dict[str, dict[str, bool]] = {}
    for i in range(0, len(queues), 200):
        chunk = queues[i : i + 200]
        pipe = r.pipeline(transaction=False)
        for q in chunk:
            pipe.sismember(keys.QUEUES, q)
            pipe.exists(*keys.queue_streams(q))
            pipe.exists(keys.queue_last_submit(q))
        flat = await pipe.execute()
        for j, q in enumerate(chunk):
            listed, streams, last = flat[3 * j : 3 * j + 3]
            out[q] = {"listed": bool(listed), "streams": streams > 0, "last": bool(last)}
        for q in chunk:
            group = False
            if out[q]["streams"]:
                with contextlib.suppress(ResponseError):  # removed since the EXISTS
                    groups = await r.xinfo_groups(keys.stream(q, 5))
                    group = any(g["name"] == keys.CONSUMER_GROUP for g in groups)
            out[q]["group"] = group
    return out


def _left_over(state: Mapping[str, Mapping[str, bool]]) -> list[str]:
    return [q for q, s in state.items() if any(s.values())]


def _incomplete(state: Mapping[str, Mapping[str, bool]]) -> list[str]:
    return [q for q, s in state.items() if not all(s.values())]


async def queue_flood(root: Path, scale: Scale) -> list[Report]:
    """Tasks on many distinct queue names with an idle TTL of 2 s: a few queues served by two
    workers, the rest never served; of those, the tasks are cancelled, expire (a 0.5 s TTL),
    or wait. Every task of a served queue ends terminal; after the idle TTL the unserved
    queues with nothing waiting are removed (streams, group, ``dtq:queues`` member,
    last-submit time), the ones with a waiting task stay until it is cancelled and are then
    removed too, the served ones stay, and the key audit finds nothing unbounded. Last, a new
    worker serves a few removed names and a task is submitted to each: they run, and those
    queues are whole again."""
    rng = scale.rng("queue_flood")
    n_served, n_unserved = scale.pick(8, 40), scale.pick(300, 3000)
    served = [f"served-{i:03d}" for i in range(n_served)]
    unserved = [f"flood-{i:05d}" for i in range(n_unserved)]
    fate = {q: rng.choice(("cancelled", "expiring", "expiring", "waiting")) for q in unserved}
    n_work = scale.pick(200, 4000)
    serve = [arg for q in served for arg in ("--queue", q)]
    settings_ = {"QUEUE_IDLE_TTL_S": str(IDLE_TTL_S)}
    async with running(root, "queue_flood", settings=settings_) as run:
        c = run.cluster
        await c.wait_workers([c.spawn_worker("flood", args=serve) for _ in range(2)])
        work = [
            Spec(
                i, "chaos_work", {"seq": i, "ms": rng.randint(5, 20)}, {"queue": rng.choice(served)}
            )
            for i in range(n_work)
        ]
        flood = [
            Spec(
                n_work + i,
                "chaos_work",
                {"seq": n_work + i, "ms": 5},
                {"queue": q, **({"ttl_seconds": 0.5} if fate[q] == "expiring" else {})},
            )
            for i, q in enumerate(unserved)
        ]
        t0 = time.monotonic()
        load = LoadGen(concurrency=64)
        await load.via_sdk(
            c.url, work, rate=None, settings=settings_
        )  # the served queues' last submits come first
        await load.via_sdk(c.url, flood, rate=None, settings=settings_)
        t_flood = time.monotonic()
        # The last queues submitted to are well within their idle TTL: none may be gone yet
        # (judged only if this read comes soon enough after their submits).
        fresh = await _queue_state(run.r, unserved[-50:])
        early = time.monotonic() - t_flood < IDLE_TTL_S / 2
        by_seq = {rec.seq: rec.task_id for rec in load.records if rec.outcome == "accepted"}
        task_of = {q: by_seq.get(n_work + i) for i, q in enumerate(unserved)}
        submit_s = time.monotonic() - t0
        sdk = await connect(settings=settings_for(c.url, queue_idle_ttl_s=str(IDLE_TTL_S)))
        try:
            for q in unserved:
                tid = task_of[q]
                if fate[q] == "cancelled" and tid:
                    await sdk.cancel(tid)
            work_ids = [tid for s in work if (tid := by_seq.get(s.seq))]
            left = await wait_quiet(run.r, work_ids, scale.pick(60, 180), queues=served)

            async def ended() -> bool:
                pipe = run.r.pipeline(transaction=False)
                for q in unserved:
                    if fate[q] != "waiting" and task_of[q]:
                        pipe.hget(keys.task(str(task_of[q])), "status")
                return all(s in TERMINAL for s in await pipe.execute())

            await wait_until(ended, 30, "cancelled and expiring tasks ended", every_s=0.2)
            idle = [q for q in unserved if fate[q] != "waiting"]
            waiting = [q for q in unserved if fate[q] == "waiting"]
            t_idle = time.monotonic()

            async def idle_removed() -> bool:
                return not _left_over(await _queue_state(run.r, idle))

            with contextlib.suppress(AssertionError):  # what is left is counted below
                await wait_until(idle_removed, scale.pick(30, 120), "idle gone", every_s=0.5)
            removed_s = time.monotonic() - t_idle
            removed_after_s = time.monotonic() - t_flood
            idle_left = _left_over(await _queue_state(run.r, idle))
            kept_waiting = _incomplete(await _queue_state(run.r, waiting))
            kept_served = _incomplete(await _queue_state(run.r, served))
            for q in waiting:
                tid = task_of[q]
                if tid:
                    await sdk.cancel(tid)

            async def waiting_removed() -> bool:
                return not _left_over(await _queue_state(run.r, waiting))

            with contextlib.suppress(AssertionError):
                await wait_until(waiting_removed, 60, "emptied queues gone", every_s=0.5)
            waiting_left = _left_over(await _queue_state(run.r, waiting))
            served_after = _incomplete(await _queue_state(run.r, served))
        finally:
            await sdk.close()
        await run.settle(SETTLE_S)
        rep = await check("queue flood", run.r, load.records, c.exec_dir, run.events.events())
        problems = await audit_keys(run.r)
        streams = [k for p in keys.queue_streams("*") async for k in run.r.scan_iter(match=p)]
        listed = await run.r.smembers(keys.QUEUES)
        cancelled_set = await run.r.scard(keys.CANCELLED)
        # Removed names serve again: a worker started on a few, then a submit to each.
        back = idle[:5]
        returner = c.spawn_worker("flood", args=[a for q in back for a in ("--queue", q)])
        await c.wait_workers([returner])
        again = LoadGen()
        returns = [
            Spec(10**6 + i, "chaos_work", {"seq": 10**6 + i, "ms": 5}, {"queue": q})
            for i, q in enumerate(back)
        ]
        await again.via_sdk(c.url, returns, rate=None, settings=settings_)
        back_left = await wait_quiet(run.r, list(again.accepted()), 30, queues=back)
        back_state = _incomplete(await _queue_state(run.r, back))
    rep.require(len(again.accepted()) == len(back), f"submits to removed queues: {again.counts()}")
    rep.require_zero("tasks of removed queues served again not terminal", back_left)
    rep.require_zero("removed queues not whole once used again", back_state)
    rep.require(not left, f"{len(left)} task(s) of served queues not terminal")
    require_clean(rep)
    if early:
        rep.require_zero("queues removed within their idle TTL", _incomplete(fresh))
    rep.require_zero("idle unserved queues with keys left", idle_left)
    rep.require_zero("waiting queues removed before their task ended", kept_waiting)
    rep.require_zero("emptied queues with keys left", waiting_left)
    rep.require_zero("served queues not whole after the idle TTL", kept_served)
    rep.require_zero("served queues not whole at the end", served_after)
    rep.require_zero("keys without a TTL or a documented bound", problems)
    extra = sorted({str(m) for m in listed} - set(served) - {"default"})
    rep.require_zero("dtq:queues members left of unserved queues", extra)
    stray = [s for s in streams if keys.stream_queue(s)[0] not in set(served) | {"default"}]
    rep.require_zero("streams left of unserved queues", stray)
    rep.require(cancelled_set == 0, f"{keys.CANCELLED} holds {cancelled_set} members")
    rep.notes.update(
        queues=n_served + n_unserved,
        served=n_served,
        removed=len(idle) + len(waiting),
        submit_s=round(submit_s, 1),
        idle_removed_s=round(removed_s, 1),
        all_idle_gone_after_s=round(removed_after_s, 1),
        fresh_checked=early,
        idle_ttl_s=IDLE_TTL_S,
        streams_left=len(streams),
    )
    return [rep]
