"""The checker: the final Redis state, the side-effect log and the events, against the
producer's records.

Definitions (``docs/reliability.md`` has them in prose):

- **lost**: an accepted task (the producer got its id) with no terminal state after quiescence.
  Tasks found in Redis that the producer never learned about (its submit was *unknown*) are
  **orphans**; an orphan without a terminal state counts as lost too.
- **dup_exec**: a task whose handler started more times than one plus the retries recorded in
  its history (a retry the handler asked for is not a duplicate).
- **terminal_conflicts**: a task with two terminal entries in its history, two terminal events,
  or a first terminal event that names another status than the final hash.
- **late_exec**: an execution that started after the task's terminal state was recorded (the
  history's ``ts`` is the Redis clock floored to the millisecond; the log's ``start_ns`` is
  ``CLOCK_REALTIME`` of the same host, so ``start_ms >= ts + 1`` is strictly after).
- latency: from the producer's call to the recorded terminal state; throughput: accepted tasks
  over the time from the first submit to the last terminal state.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from chaos_harness import REAPER_S, TERMINAL, VISIBILITY_S, Run
from chaos_load import LoadGen, SubmitRecord, all_task_ids, wait_quiet
from redis.asyncio import Redis

from dtq import keys

TERMINAL_EVENT_STATUS = {
    "TASK_SUCCEEDED": "succeeded",
    "TASK_FAILED": "failed",
    "TASK_DEAD_LETTERED": "dead_lettered",
    "TASK_CANCELLED": "cancelled",
    "TASK_EXPIRED": "expired",
}


@dataclass
class Exec:
    """One handler run from the side-effect log."""

    task_id: str
    attempt: int
    worker_id: str
    pid: int
    start_ns: int
    end_ns: int | None = None
    outcome: str | None = None

    @property
    def start_ms(self) -> float:
        return self.start_ns / 1e6


def read_execs(folder: Path) -> dict[str, list[Exec]]:
    """Every execution in the side-effect logs, by task id, in start order."""
    runs: dict[tuple[str, int, int], Exec] = {}
    for path in sorted(folder.glob("exec-*.jsonl")):
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            key = (rec["task_id"], rec["attempt"], rec["pid"])
            ex = runs.get(key)
            if ex is None:
                ex = runs[key] = Exec(
                    rec["task_id"], rec["attempt"], rec["worker_id"], rec["pid"], rec["start_ns"]
                )
            if rec["e"] == "end":
                ex.end_ns, ex.outcome = rec["end_ns"], rec.get("outcome")
    out: dict[str, list[Exec]] = defaultdict(list)
    for ex in sorted(runs.values(), key=lambda e: e.start_ns):
        out[ex.task_id].append(ex)
    return out


def iso_ms(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() * 1000


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass
class TaskView:
    """What the checker knows of one task at the end."""

    task_id: str
    hash: dict[str, str]
    history: list[dict[str, Any]]
    execs: list[Exec]
    terminal_events: list[dict[str, Any]]

    @property
    def payload(self) -> str | None:
        return self.hash.get("payload")

    @property
    def status(self) -> str | None:
        return self.hash.get("status")

    @property
    def terminal_entries(self) -> list[dict[str, Any]]:
        return [h for h in self.history if h.get("to") in TERMINAL]

    @property
    def terminal_ms(self) -> float | None:
        entries = self.terminal_entries
        if entries:
            return iso_ms(entries[0]["ts"])
        stamp = self.hash.get("finished_at") or self.hash.get("expired_at")
        return iso_ms(stamp) if stamp else None

    @property
    def retries(self) -> int:
        return sum(1 for h in self.history if h.get("to") == "retrying")

    @property
    def seq(self) -> int | None:
        try:
            value = json.loads(self.payload or "{}").get("seq")
        except ValueError:
            return None
        return value if isinstance(value, int) else None


@dataclass
class Report:
    """The figures and invariant counts of one scenario (or one phase of it)."""

    name: str
    counts: dict[str, int] = field(default_factory=dict)  # invoked/accepted/refused/unknown
    accepted: int = 0
    lost: list[str] = field(default_factory=list)
    orphans: int = 0
    dup_exec: list[str] = field(default_factory=list)
    terminal_conflicts: list[str] = field(default_factory=list)
    late_exec: list[str] = field(default_factory=list)
    late_runs: list[tuple[str, Exec]] = field(default_factory=list, repr=False)
    p50_ms: float = math.nan
    p99_ms: float = math.nan
    throughput: float = math.nan
    recovery_s: float = math.nan
    statuses: dict[str, int] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    views: dict[str, TaskView] = field(default_factory=dict, repr=False)

    def per_10k(self, n: int) -> float:
        return n * 10_000 / self.accepted if self.accepted else 0.0

    def require(self, ok: bool, message: str) -> None:
        """Record an invariant; a false one becomes a violation (the test fails on any)."""
        if not ok:
            self.violations.append(message)

    def require_zero(self, what: str, ids: Sequence[str] | int) -> None:
        n = ids if isinstance(ids, int) else len(ids)
        sample = "" if isinstance(ids, int) else f": {list(ids)[:5]}"
        self.require(n == 0, f"{what} = {n}{sample}")

    def summary(self) -> dict[str, Any]:
        return {
            **{k: v for k, v in self.counts.items() if k != "accepted"},
            "scenario": self.name,
            "accepted": self.accepted,
            "lost": len(self.lost),
            "dup_exec": len(self.dup_exec),
            "dup_per_10k": round(self.per_10k(len(self.dup_exec)), 1),
            "terminal_conflicts": len(self.terminal_conflicts),
            "late_exec": len(self.late_exec),
            "recovery_s": self.recovery_s,
            "p50_ms": self.p50_ms,
            "p99_ms": self.p99_ms,
            "throughput": self.throughput,
            **self.notes,
        }


async def load_views(
    r: Redis,
    task_ids: Iterable[str],
    execs: Mapping[str, list[Exec]],
    events: Sequence[Mapping[str, Any]],
) -> dict[str, TaskView]:
    ids = sorted(set(task_ids))
    terminal_events: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for ev in events:
        if ev.get("type") in TERMINAL_EVENT_STATUS and ev.get("task_id"):
            terminal_events[ev["task_id"]].append(dict(ev))
    views: dict[str, TaskView] = {}
    for i in range(0, len(ids), 1000):
        chunk = ids[i : i + 1000]
        pipe = r.pipeline(transaction=False)
        for tid in chunk:
            pipe.hgetall(keys.task(tid))
            pipe.lrange(keys.history(tid), 0, -1)
        flat = await pipe.execute()
        for tid, h, hist in zip(chunk, flat[::2], flat[1::2], strict=True):
            views[tid] = TaskView(
                tid,
                h,
                [json.loads(x) for x in hist],
                execs.get(tid, []),
                terminal_events.get(tid, []),
            )
    return views


async def check(
    name: str,
    r: Redis,
    records: Sequence[SubmitRecord],
    exec_dir: Path,
    events: Sequence[Mapping[str, Any]],
    *,
    skip: Iterable[str] = (),
) -> Report:
    """Build the report of the tasks the producer submitted (``records``) and of every other
    task in Redis (orphans) but those in ``skip`` (an earlier phase's)."""
    accepted = {rec.task_id: rec for rec in records if rec.outcome == "accepted" and rec.task_id}
    in_redis = set(await all_task_ids(r)) - set(skip)
    execs = read_execs(exec_dir)
    views = await load_views(r, in_redis | set(accepted), execs, events)
    return judge(name, records, views)


def judge(name: str, records: Sequence[SubmitRecord], views: dict[str, TaskView]) -> Report:
    """The report of ``views`` (every task to judge, the accepted ones of ``records`` among
    them): :func:`check` reads them from Redis at the end; a scenario whose finished tasks
    expire before its end builds them as it goes."""
    accepted = {rec.task_id: rec for rec in records if rec.outcome == "accepted" and rec.task_id}
    rep = Report(name, views=views)
    rep.counts = {"invoked": len(records), "accepted": 0, "refused": 0, "unknown": 0}
    for rec in records:
        rep.counts[rec.outcome] = rep.counts.get(rec.outcome, 0) + 1
    rep.accepted = len(accepted)
    rep.orphans = len(set(views) - set(accepted))
    latencies: list[float] = []
    last_ms = 0.0
    for tid, v in views.items():
        status = v.status or "missing"
        rep.statuses[status] = rep.statuses.get(status, 0) + 1
        if status not in TERMINAL:
            rep.lost.append(tid)
            continue
        term_ms = v.terminal_ms
        if len(v.terminal_entries) > 1:
            rep.terminal_conflicts.append(f"{tid}: history {[e['to'] for e in v.terminal_entries]}")
        elif len(v.terminal_events) > 1:
            rep.terminal_conflicts.append(f"{tid}: events {[e['type'] for e in v.terminal_events]}")
        elif v.terminal_events and TERMINAL_EVENT_STATUS[v.terminal_events[0]["type"]] != status:
            rep.terminal_conflicts.append(
                f"{tid}: event {v.terminal_events[0]['type']} but status {status}"
            )
        if term_ms is not None:
            late = [e for e in v.execs if e.start_ms >= term_ms + 1]
            rep.late_runs.extend((tid, e) for e in late)
            if late:
                rep.late_exec.append(
                    f"{tid}: {len(late)} run(s) started {late[0].start_ms - term_ms:.0f} ms "
                    f"after {status} (attempt {late[0].attempt} on {late[0].worker_id})"
                )
            last_ms = max(last_ms, term_ms)
            rec = accepted.get(tid)
            if rec is not None:
                latencies.append(term_ms - rec.invoked_ns / 1e6)
        if len(v.execs) > 1 + v.retries:
            rep.dup_exec.append(tid)
    if latencies:
        rep.p50_ms = percentile(latencies, 0.50)
        rep.p99_ms = percentile(latencies, 0.99)
        first_ms = min(rec.invoked_ns for rec in accepted.values()) / 1e6
        if last_ms > first_ms:
            rep.throughput = len(latencies) * 1000 / (last_ms - first_ms)
    return rep


def dup_unexplained(rep: Report, faulty_pids: set[int]) -> list[str]:
    """Duplicates not explained by a process that was killed, stopped or cut off: the runs on
    other processes must be no more than one per attempt the task was given (1 + retries).
    A faulty process's run may come last: a stopped worker resumed after a peer's run."""
    out = []
    for tid in rep.dup_exec:
        runs = rep.views[tid].execs
        healthy = [e for e in runs if e.pid not in faulty_pids]
        if len(healthy) > 1 + rep.views[tid].retries:
            out.append(f"{tid}: runs on pids {[e.pid for e in runs]}")
    return out


QUIET_S = 90.0  # the longest a scenario waits for quiescence before calling what is left lost
# After quiescence the workers run on this long: an entry left pending by mistake would be
# reclaimed (visibility timeout + a reaper pass, with its 20 % jitter) and run late meanwhile.
SETTLE_S = VISIBILITY_S + 1.2 * REAPER_S


async def finish(
    run: Run,
    name: str,
    load: LoadGen,
    settle_s: float = SETTLE_S,
    skip: set[str] | None = None,
    quiet_s: float = QUIET_S,
    gone: set[str] | None = None,
    queues: Sequence[str] = ("default",),
) -> Report:
    """Wait for quiescence of every task in Redis (but ``skip``) and of ``queues``' streams,
    let the workers run on for ``settle_s``, then check them all. ``gone``: accepted tasks
    known to be gone from Redis (not waited for; the report counts them lost)."""
    ids = (set(load.accepted()) | set(await all_task_ids(run.r))) - (skip or set())
    ids -= gone or set()
    left = await wait_quiet(run.r, ids, quiet_s, queues)
    await run.settle(settle_s)
    rep = await check(
        name, run.r, load.records, run.cluster.exec_dir, run.events.events(), skip=skip or ()
    )
    rep.require(not left, f"not quiet after {quiet_s:.0f}s: {len(left)} task(s) not terminal")
    return rep


def require_clean(rep: Report, *, dup: bool = True, late: bool = True) -> None:
    """lost = terminal_conflicts = 0; late_exec = 0 unless ``late`` is False (the scenario
    judges its late runs itself); dup_exec = 0 unless ``dup`` is False."""
    rep.require_zero("lost", rep.lost)
    rep.require_zero("terminal_conflicts", rep.terminal_conflicts)
    if late:
        rep.require_zero("late_exec", rep.late_exec)
    if dup:
        rep.require_zero("dup_exec", rep.dup_exec)
