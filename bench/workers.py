"""Worker processes for the scenarios that need one, and the drain measurement they share.

Every worker is ``python -m dtq.worker --tasks bench.tasks`` (the same as ``dtq worker run``)
in the project root. A worker that exits is an error of the scenario, never a skip: the smoke
run (``tests/integration/test_bench_smoke.py``) fails when the worker cannot start.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from bench.harness import (
    Env,
    Managed,
    iso_ms,
    live_entries,
    redis_now_ms,
    statuses,
    wait_until,
)
from dtq.devserver import free_port
from dtq.models import TaskStatus

__all__ = ["DrainResult", "drain", "spawn_worker"]

DEFAULT_CONCURRENCY = 128
WORKER_ARGS = ("-m", "dtq.worker", "--tasks", "bench.tasks")


def spawn_worker(env: Env, *, concurrency: int, processes: int = 1, **extra_env: str) -> Managed:
    args = [*WORKER_ARGS, "--concurrency", str(concurrency)]
    if processes != 1:
        args += ["--processes", str(processes)]
    extra = {"DTQ_WORKER_METRICS_PORT": str(free_port()), **extra_env}
    return env.spawn(f"worker-p{processes}-c{concurrency}", args, **extra)


@dataclass
class DrainResult:
    n: int
    succeeded: int
    spawn_ms: int
    first_finish_ms: float
    last_finish_ms: float
    wall_s: float

    @property
    def rate(self) -> float:
        """Tasks/s from the first completion to the last (Redis clock, ms resolution)."""
        span = (self.last_finish_ms - self.first_finish_ms) / 1000
        return (self.n - 1) / span if span > 0 else float("nan")

    @property
    def rate_from_start(self) -> float:
        """Tasks/s from the worker process's spawn to the last completion."""
        return self.n / ((self.last_finish_ms - self.spawn_ms) / 1000)


async def drain(
    env: Env,
    ids: list[str],
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
    processes: int = 1,
    timeout_s: float = 300,
) -> DrainResult:
    """Start a worker on queued ``ids``, wait until every one SUCCEEDED, stop it."""
    r = await env.redis()
    try:
        spawn_ms = await redis_now_ms(r)
        t = time.monotonic()
        worker = spawn_worker(env, concurrency=concurrency, processes=processes)

        async def done() -> bool:
            return not worker.alive() or await live_entries(r) == 0

        await wait_until(done, timeout_s, interval_s=0.05)
        wall = time.monotonic() - t
        if not worker.alive():
            raise RuntimeError(f"the worker exited ({worker.proc.returncode}): {worker.tail()}")
        rows = await statuses(r, ids, "status", "finished_at")

        async def all_final() -> bool:
            nonlocal rows
            rows = await statuses(r, ids, "status", "finished_at")
            return all(st == TaskStatus.SUCCEEDED.value for st, _ in rows)

        await wait_until(all_final, 10, interval_s=0.2)
        worker.stop()
    finally:
        await r.aclose()
    ok = [iso_ms(fin) for st, fin in rows if st == TaskStatus.SUCCEEDED.value and fin]
    if len(ok) != len(ids):
        bad = {st for st, _ in rows if st != TaskStatus.SUCCEEDED.value}
        raise RuntimeError(f"{len(ids) - len(ok)} of {len(ids)} tasks did not succeed: {bad}")
    return DrainResult(len(ids), len(ok), spawn_ms, min(ok), max(ok), wall)
