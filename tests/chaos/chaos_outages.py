"""Scenarios that take something away from the processes: Redis restarted under load (four
ways), connections killed by Redis (``CLIENT KILL``), and the API process killed during
submits. Same shape as :mod:`chaos_faults`: ``async def name(root, scale) -> list[Report]``.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections import Counter
from datetime import datetime
from pathlib import Path

import httpx
from chaos_checker import Report, finish, require_clean
from chaos_harness import Run, Scale, now_ns, running
from chaos_load import LoadGen, work_specs

from dtq import keys

# name, AOF on, appendfsync, how Redis goes down
RESTARTS = (
    ("SHUTDOWN, AOF everysec", True, "everysec", "shutdown"),
    ("kill -9, AOF always", True, "always", "kill"),
    ("kill -9, AOF everysec", True, "everysec", "kill"),
    ("kill -9, no persistence", False, "", "kill"),
)
OUTAGE_S = 1.0
LOG_TS = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z) ")
PROBLEM = re.compile(r"^\S+ (WARNING|ERROR|CRITICAL) ")


def _first_terminal_after(rep: Report, after_ms: float) -> float:
    times = [t for v in rep.views.values() if (t := v.terminal_ms) and t >= after_ms]
    return (min(times) - after_ms) / 1000 if times else math.nan


def _stamps(text: str, t0_ns: int, t1_ns: int, *, problems_only: bool = False) -> list[float]:
    """The times (epoch s) of the log lines stamped between ``t0_ns`` and ``t1_ns`` (a stamp is
    truncated to the millisecond); ``problems_only``: WARNING and ERROR lines only."""
    out = []
    for line in text.splitlines():
        m = LOG_TS.match(line)
        if not m or (problems_only and not PROBLEM.match(line)):
            continue
        t = datetime.fromisoformat(m.group(1).replace("Z", "+00:00")).timestamp()
        if t0_ns / 1e9 - 0.001 <= t <= t1_ns / 1e9:
            out.append(t)
    return out


def _lines_per_second(logs: list[str], t0_ns: int, t1_ns: int) -> int:
    """The most lines one process logged in one second between ``t0_ns`` and ``t1_ns``."""
    most = 0
    for text in logs:
        per_second = Counter(int(t) for t in _stamps(text, t0_ns, t1_ns))
        most = max(most, max(per_second.values(), default=0))
    return most


def _most_lines(logs: list[str], t0_ns: int, t1_ns: int) -> int:
    """The most WARNING/ERROR lines one process logged between ``t0_ns`` and ``t1_ns`` (the
    INFO line of each task that succeeds once Redis is back, before ``t1_ns`` is stamped, is
    not about the outage)."""
    return max((len(_stamps(text, t0_ns, t1_ns, problems_only=True)) for text in logs), default=0)


class Answers:
    """What the API answered during a phase: every status, and each 503's Retry-After."""

    def __init__(self) -> None:
        self.statuses: Counter[int] = Counter()
        self.no_retry_after = 0

    def __call__(self, resp: httpx.Response) -> None:
        self.statuses[resp.status_code] += 1
        if resp.status_code == 503 and not resp.headers.get("retry-after"):
            self.no_retry_after += 1


async def redis_restart(root: Path, scale: Scale) -> list[Report]:
    """Redis goes down mid-load four ways and comes back on the same port after 1 s. Workers
    and the API stay up: the API answers 503 with Retry-After meanwhile (never a 500, never a
    hang), the workers reconnect and resume. No accepted task is lost where persistence
    promises it (SHUTDOWN; kill -9 with AOF always)."""
    rng = scale.rng("redis_restart")
    n, duration_s = scale.pick(100, 2500), scale.pick(3, 12)
    reports: list[Report] = []
    async with running(root, "redis_restart", persistent=True) as run:
        c = run.cluster
        workers = [c.spawn_worker("rr") for _ in range(3)]
        c.spawn_api()
        await asyncio.gather(c.wait_workers(workers), c.wait_api())
        seen: set[str] = set()
        for i, (name, aof, fsync, how) in enumerate(RESTARTS):
            if aof:
                await run.r.config_set("appendfsync", fsync)
            answers = Answers()
            load = LoadGen(concurrency=16)
            specs = work_specs(rng, n, start_seq=i * n)
            loading = asyncio.create_task(
                load.via_http(c.api_base, specs, n / duration_s, on_response=answers)
            )
            await asyncio.sleep(duration_s / 2)
            t_down = now_ns()
            if how == "shutdown":
                c.shutdown_redis()
            else:
                c.kill_redis()
            await asyncio.sleep(OUTAGE_S)
            c.start_redis(persistent=aof, fsync=fsync or "everysec")
            t_up = now_ns()
            await loading
            gone = await _gone(run, load, t_down) if not aof else set()
            rep = await finish(run, f"Redis {name}", load, skip=seen, gone=gone)
            seen |= set(rep.views) | set(load.accepted())
            promised = how == "shutdown" or fsync == "always"
            _judge_restart(rep, load, answers, t_down, t_up, promised=promised)
            logs = [w.proc.output() for w in workers]
            rep.notes["worker_lines_per_s"] = _lines_per_second(logs, t_down, t_up + int(3e9))
            # A worker logs the first failure, then at most a line a
            # second until Redis answers (docs/operations.md, "When Redis is unavailable").
            outage_lines = _most_lines(logs, t_down, t_up)
            limit = (t_up - t_down) / 1e9 + 2
            rep.require(
                outage_lines <= limit,
                f"a worker logged {outage_lines} lines in a {(t_up - t_down) / 1e9:.1f}s outage",
            )
            rep.notes["worker_outage_lines"] = outage_lines
            reports.append(rep)
            if not aof:
                break
    return reports


async def _gone(run: Run, load: LoadGen, t_down: int) -> set[str]:
    """Tasks accepted before Redis went down whose hash is gone (no persistence)."""
    before = [tid for tid, rec in load.accepted().items() if rec.invoked_ns < t_down]
    pipe = run.r.pipeline(transaction=False)
    for tid in before:
        pipe.exists(keys.task(tid))
    return {tid for tid, n in zip(before, await pipe.execute(), strict=True) if not n}


def _judge_restart(
    rep: Report,
    load: LoadGen,
    answers: Answers,
    t_down: int,
    t_up: int,
    *,
    promised: bool,
) -> None:
    before = {tid for tid, rec in load.accepted().items() if rec.invoked_ns < t_down}
    lost_before = [tid for tid in rep.lost if tid in before]
    lost_after = [tid for tid in rep.lost if tid not in before]
    rep.require_zero("lost (accepted after Redis came back)", lost_after)
    if promised:
        rep.require_zero("lost (accepted before the restart)", lost_before)
        rep.require_zero("terminal_conflicts", rep.terminal_conflicts)
    rep.require_zero("late_exec", rep.late_exec)
    server_errors = {s: k for s, k in answers.statuses.items() if s >= 500 and s != 503}
    rep.require(not server_errors, f"API answered {server_errors} during the outage")
    rep.require_zero("503 without Retry-After", answers.no_retry_after)
    # No answer: a timeout is a hang (the API must answer, 503 at worst); a connection closed
    # without a response (a keep-alive connection the server closed as the request left) is
    # an unknown outcome, reported.
    unknown = Counter(rec.detail.split(":")[0] for rec in load.records if rec.outcome == "unknown")
    hung = sum(n for kind, n in unknown.items() if kind.endswith("Timeout"))
    rep.require_zero("submits that hung (no answer within 10 s)", hung)
    if unknown:
        rep.notes["unknown_kinds"] = "/".join(f"{k}:{v}" for k, v in sorted(unknown.items()))
    rep.recovery_s = _first_terminal_after(rep, t_up / 1e6)
    rep.notes.update(
        lost_before_restart=len(lost_before),
        answers="/".join(f"{s}:{k}" for s, k in sorted(answers.statuses.items())),
    )
    rep.lost = lost_after + (lost_before if promised else [])


# -- connection drops ---------------------------------------------------------------------------


async def conn_drops(root: Path, scale: Scale) -> list[Report]:
    """Redis closes every client connection (CLIENT KILL TYPE normal) every 0.3-1 s under load:
    workers, heartbeats and producers reconnect. Nothing is lost or finished twice; a finish
    whose reply was lost is retried (fenced and atomic: at most once)."""
    rng = scale.rng("conn_drops")
    n, duration_s = scale.pick(300, 10_000), scale.pick(5, 25)
    async with running(root, "conn_drops") as run:
        c = run.cluster
        await c.wait_workers([c.spawn_worker("cd") for _ in range(4)])
        load = LoadGen()
        loading = asyncio.create_task(load.via_sdk(c.url, work_specs(rng, n), n / duration_s))
        killed, rounds = 0, 0
        while not loading.done():
            await asyncio.wait({loading}, timeout=rng.uniform(0.3, 1.0))
            killed += await _kill_clients(run)
            rounds += 1
        await loading
        rep = await finish(run, "connection drops", load)
    require_clean(rep, dup=False)
    rep.notes.update(kill_rounds=rounds, connections_killed=killed)
    return [rep]


async def _kill_clients(run: Run) -> int:
    killed = await run.r.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    return int(killed)


# -- API process killed -------------------------------------------------------------------------


async def api_kill(root: Path, scale: Scale) -> list[Report]:
    """The API process is SIGKILLed every 3-5 s while producers submit through it, and started
    again at once. A submit that got 202 is never lost; one that got no answer (unknown) may
    or may not have created its task, and a task that exists is never lost either."""
    rng = scale.rng("api_kill")
    n, duration_s = scale.pick(300, 10_000), scale.pick(7, 30)
    async with running(root, "api_kill") as run:
        c = run.cluster
        workers = [c.spawn_worker("ak") for _ in range(3)]
        c.spawn_api()
        await asyncio.gather(c.wait_workers(workers), c.wait_api())
        load = LoadGen(concurrency=16)
        loading = asyncio.create_task(
            load.via_http(c.api_base, work_specs(rng, n), n / duration_s, timeout_s=5)
        )
        kills = 0
        while not loading.done():
            await asyncio.wait({loading}, timeout=rng.uniform(3.0, 5.0))
            if loading.done():
                break
            assert c.api is not None
            c.api.kill9()
            kills += 1
            c.spawn_api()
        await loading
        rep = await finish(run, "API kill -9", load)
    require_clean(rep)
    rep.notes.update(api_kills=kills, orphans=rep.orphans)
    return [rep]
