"""Worker processes for the scenarios that need one, and the drain measurement they share.

Every worker is ``python -m dtq.worker --tasks bench.tasks`` (the same as ``dtq worker run``)
in the project root. A worker that exits is an error of the scenario, never a skip: the smoke
run (``tests/integration/test_bench_smoke.py``) fails when the worker cannot start.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from redis.asyncio import Redis

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


def spawn_worker(
    env: Env,
    *,
    concurrency: int,
    processes: int = 1,
    queues: Sequence[str] = (),
    **extra_env: str,
) -> Managed:
    """A worker of ``queues`` (none given: the worker's default queue); ``extra_env`` is added
    to its environment (``DTQ_REDIS_URL`` and ``DTQ_REDIS_CLUSTER`` for a cluster)."""
    args = [*WORKER_ARGS, "--concurrency", str(concurrency)]
    if processes != 1:
        args += ["--processes", str(processes)]
    for queue in queues:
        args += ["--queue", queue]
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
    queues: Sequence[str] = (),
    client: Redis | None = None,
    worker_env: dict[str, str] | None = None,
    drained: Callable[[], Awaitable[None]] | None = None,
) -> DrainResult:
    """Start a worker of ``queues`` (none: the default queue) on queued ``ids``, wait until
    every one SUCCEEDED, stop it.

    ``client`` is the Redis the tasks are on (default: the run's own; a client given is left
    open), ``worker_env`` goes to the worker's environment, and ``drained`` is awaited as soon
    as every stream is empty, before the tasks are read back (to sample Redis's CPU time without
    the cost of that read)."""
    r = client if client is not None else await env.redis()
    try:
        spawn_ms = await redis_now_ms(r)
        t = time.monotonic()
        worker = spawn_worker(
            env,
            concurrency=concurrency,
            processes=processes,
            queues=queues,
            **(worker_env or {}),
        )

        async def done() -> bool:
            if not worker.alive():
                return True
            for queue in queues or ("default",):
                if await live_entries(r, queue):
                    return False
            return True

        await wait_until(done, timeout_s, interval_s=0.05)
        wall = time.monotonic() - t
        if not worker.alive():
            raise RuntimeError(f"the worker exited ({worker.proc.returncode}): {worker.tail()}")
        if drained is not None:
            await drained()
        rows = await statuses(r, ids, "status", "finished_at")

        async def all_final() -> bool:
            nonlocal rows
            rows = await statuses(r, ids, "status", "finished_at")
            return all(st == TaskStatus.SUCCEEDED.value for st, _ in rows)

        await wait_until(all_final, 10, interval_s=0.2)
        worker.stop()
    finally:
        if client is None:
            await r.aclose()
    ok = [iso_ms(fin) for st, fin in rows if st == TaskStatus.SUCCEEDED.value and fin]
    if len(ok) != len(ids):
        bad = {st for st, _ in rows if st != TaskStatus.SUCCEEDED.value}
        raise RuntimeError(f"{len(ids) - len(ok)} of {len(ids)} tasks did not succeed: {bad}")
    return DrainResult(len(ids), len(ok), spawn_ms, min(ok), max(ok), wall)
