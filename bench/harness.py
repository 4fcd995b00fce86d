"""What every scenario shares: the run's environment, results, subprocesses and small helpers.

A scenario is an ``async def run(env) -> list[Result]``; each Result becomes one JSON line and one
Markdown table row. Figures are rates (per second), times (ms) or bytes; ``ratios`` relate a
figure to another one measured in the same run (the raw-Streams baseline, a ceiling, one process).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from dtq import Queue, connect, keys
from dtq.config import Settings
from dtq.models import TaskStatus, parse_ts

__all__ = [
    "ROOT",
    "Env",
    "Managed",
    "Result",
    "percentile",
    "redis_now_ms",
    "wait_until",
]

ROOT = Path(__file__).resolve().parent.parent
"""The project root: subprocesses run here so ``bench.tasks`` and ``examples`` import."""

NOOP_TASK = "bench.noop"
RPUSH_TASK = "bench.rpush"
RPUSH_KEY = "bench:rpush"  # the list the RPUSH handler appends to (not a dtq key)
SLEEP_TASK, SLEEP_MS = "bench.sleep", 10  # a handler that sleeps 10 ms
# The reference machine (2 cores, Redis 7.0) of the absolute targets: its raw-Streams loops.
# An absolute target becomes a ratio to the same loop measured in the same run.
REFERENCE = {"xadd": 120_000.0, "consume_ack": 104_000.0, "consume_ack_hset": 66_000.0}
PAYLOAD_100B = {"data": "x" * 89}  # compact JSON is exactly 100 bytes
assert len(json.dumps(PAYLOAD_100B, separators=(",", ":"))) == 100


@dataclass
class Result:
    """One line of the report."""

    scenario: str
    status: str = "ok"  # ok | error
    figure: str = ""  # the headline figure's name, a key of ``values``
    unit: str = ""
    values: dict[str, Any] = field(default_factory=dict)
    ratios: dict[str, float] = field(default_factory=dict)
    target: str = ""
    met: bool | None = None
    note: str = ""

    def as_json(self) -> str:
        doc: dict[str, Any] = {"scenario": self.scenario, "status": self.status}
        if self.figure:
            doc["figure"] = self.figure
            doc["unit"] = self.unit
        doc.update(_rounded(self.values))
        if self.ratios:
            doc["ratios"] = _rounded(self.ratios)
        if self.target:
            doc["target"] = self.target
            doc["met"] = self.met
        if self.note:
            doc["note"] = self.note
        return json.dumps(doc, separators=(", ", ": "), allow_nan=False)

    def headline(self) -> str:
        if self.status != "ok":
            return f"{self.status}: {self.note}"
        v = self.values.get(self.figure)
        return f"{_fmt(v)} {self.unit}".strip()

    def as_row(self) -> str:
        ratios = ", ".join(f"{_fmt(v)}x {k}" for k, v in self.ratios.items())
        met = "" if self.met is None else ("yes" if self.met else "**no**")
        note = self.note if self.status == "ok" else ""
        return (
            f"| {self.scenario} | {self.headline()} | {ratios} | {self.target} | {met} | {note} |"
        )


def _rounded(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _round(v) for k, v in d.items()}


def _round(v: Any) -> Any:
    if isinstance(v, float):
        if not math.isfinite(v):
            return None  # JSON has no NaN
        return round(v, 4 if abs(v) < 10 else 1)
    if isinstance(v, dict):
        return _rounded(v)
    if isinstance(v, list | tuple):
        return [_round(x) for x in v]
    return v


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v >= 100:
            return f"{v:,.0f}"
        return f"{v:.3g}" if v < 10 else f"{v:.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of a non-empty sequence."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(p / 100 * len(s)) - 1))
    return float(s[k])


async def wait_until(
    predicate: Callable[[], Awaitable[bool]], timeout_s: float, interval_s: float = 0.02
) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(interval_s)
    return await predicate()


async def redis_now_ms(r: Redis) -> int:
    sec, usec = await r.time()
    return int(sec) * 1000 + int(usec) // 1000


def iso_ms(value: str) -> float:
    """An ISO timestamp of the hash (Redis clock) as epoch ms."""
    dt = parse_ts(value)
    if dt is None:
        raise ValueError("empty timestamp")
    return dt.timestamp() * 1000


@dataclass
class Managed:
    """A subprocess this run started (worker, uvicorn); stopped by its PID, always."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 1500) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 15) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
            return
        except subprocess.TimeoutExpired:
            pass
        # Its own process group (start_new_session): children of a supervisor go too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout_s)


@dataclass
class Env:
    """One benchmark run: the private Redis, the settings, the mode and what was measured."""

    redis_url: str
    quick: bool
    work_dir: Path
    baseline: dict[str, float] = field(default_factory=dict)
    drain_rate: dict[str, float] = field(default_factory=dict)
    concurrency: int = 128  # the worker's --concurrency; the drain scenario picks the best
    enqueue_rate: float = 5_000.0  # submit_many tasks/s, to size waits (measured when known)
    launcher: tuple[str, ...] = ()  # a prefix of every child's command (bench.callgrind)
    _children: list[Managed] = field(default_factory=list)

    @property
    def settings(self) -> Settings:
        return Settings(redis_url=self.redis_url, max_queue_depth=1_000_000)

    def n(self, full: int, quick: int) -> int:
        return quick if self.quick else full

    def child_env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            DTQ_REDIS_URL=self.redis_url,
            DTQ_MAX_QUEUE_DEPTH="1000000",
            DTQ_TASK_MODULES="bench.tasks",
            DTQ_LOG_LEVEL="WARNING",
            PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
        )
        env.update(extra)
        return env

    def spawn(self, name: str, args: Sequence[str], **extra_env: str) -> Managed:
        log = self.work_dir / f"{name}-{len(self._children)}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [*self.launcher, sys.executable, *args],
                cwd=ROOT,
                env=self.child_env(**extra_env),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        child = Managed(name, proc, log)
        self._children.append(child)
        return child

    def stop_children(self) -> None:
        for child in self._children:
            child.stop()
        self._children.clear()

    async def redis(self) -> Redis:
        return Redis.from_url(self.redis_url, decode_responses=True)

    async def queue(self) -> Queue:
        return await connect(settings=self.settings)

    async def flush(self) -> None:
        r = await self.redis()
        try:
            await r.flushall()
            await r.script_flush()
        finally:
            await r.aclose()

    async def fill(self, q: Queue, n: int, task_type: str, **options: Any) -> list[str]:
        """Queue ``n`` tasks of ``task_type`` in batches of 1,000; returns their ids."""
        ids: list[str] = []
        item = {"task_type": task_type, "payload": PAYLOAD_100B, **options}
        while len(ids) < n:
            batch = min(1000, n - len(ids))
            for t in await q.submit_many([item] * batch):
                if isinstance(t, Exception):
                    raise t
                ids.append(t.task_id)
        return ids


async def statuses(r: Redis, ids: Sequence[str], *fields: str) -> list[list[str | None]]:
    """HMGET of ``fields`` on every task hash, pipelined in chunks."""
    out: list[list[str | None]] = []
    for i in range(0, len(ids), 2000):
        pipe = r.pipeline(transaction=False)
        for tid in ids[i : i + 2000]:
            pipe.hmget(keys.task(tid), *fields)
        out.extend(await pipe.execute())
    return out


async def count_status(r: Redis, ids: Sequence[str], status: TaskStatus) -> int:
    return sum(1 for (st,) in await statuses(r, ids, "status") if st == status.value)


async def live_entries(r: Redis, queue: str = "default") -> int:
    """Entries still in the queue's streams (waiting or in flight): 0 when all are done."""
    pipe = r.pipeline(transaction=False)
    for key in keys.queue_streams(queue):
        pipe.xlen(key)
    return sum(int(x) for x in await pipe.execute())
