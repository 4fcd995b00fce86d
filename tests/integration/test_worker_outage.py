"""A Redis outage as a worker's log shows it (docs/operations.md): Redis is killed for about
3 s under a worker subprocess and started again, empty, on the same port. The worker writes the
first failure at once, then at most a line a second, then one line when Redis answers; it
recreates its consumer groups and runs the tasks submitted after the restart."""

from __future__ import annotations

import re
import time
from datetime import datetime
from pathlib import Path

import pytest
from redis.asyncio import Redis

from dtq import connect, keys
from dtq.config import Settings
from dtq.devserver import free_port, start_redis
from support import wait_until
from support.worker import WorkerProcess, wait_status, wait_worker_ready, write_task_module

pytestmark = pytest.mark.slow

OUTAGE_S = 3.0
LINE_TS = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z) ")


def lines_between(text: str, t0: float, t1: float) -> list[str]:
    """The log lines stamped between ``t0`` and ``t1`` (epoch seconds; a stamp is truncated to
    the millisecond)."""
    out = []
    for line in text.splitlines():
        m = LINE_TS.match(line)
        if not m:
            continue
        stamp = datetime.fromisoformat(m.group(1).replace("Z", "+00:00")).timestamp()
        if t0 - 0.001 <= stamp <= t1:
            out.append(line)
    return out


async def test_an_outage_is_a_few_lines_and_the_worker_resumes(tmp_path: Path) -> None:
    port = free_port()
    server = start_redis(tmp_path / "redis", port=port)
    url = server.url
    worker: WorkerProcess | None = None
    write_task_module(tmp_path)
    try:
        worker = WorkerProcess(url, tmp_path, worker_id="worker-out00001")
        queue = await connect(settings=Settings(redis_url=url))
        r = Redis.from_url(url, decode_responses=True)
        try:
            await wait_worker_ready(r, "worker-out00001")
            before = await queue.submit("sp_sleep", {"s": 0})
            await wait_status(r, before.task_id, "succeeded")

            # The worker logs a task's end after its finish script has answered: wait for
            # that line, so that it is not stamped inside the outage.
            async def logged() -> bool:
                return f"task {before.task_id} attempt 1: succeeded" in worker.output()

            await wait_until(logged, 10, "the worker's line for the task before the outage")
        finally:
            await queue.close()
            await r.aclose()

        t_down = time.time()
        server.process.kill()  # by PID: no save, no goodbye
        server.process.wait(10)

        async def outage_passed() -> bool:
            return time.time() - t_down >= OUTAGE_S and "Redis unavailable" in worker.output()

        await wait_until(outage_passed, OUTAGE_S + 10, "outage of 3 s, seen by the worker")
        server = start_redis(tmp_path / "redis", port=port)  # empty: no stream, no group
        t_up = time.time()

        queue = await connect(settings=Settings(redis_url=url))
        r = Redis.from_url(url, decode_responses=True)
        try:
            after = await queue.submit("sp_sleep", {"s": 0})
            await wait_status(r, after.task_id, "succeeded", timeout_s=20)
            groups = await r.xinfo_groups(keys.stream("default", 5))
            assert [g["name"] for g in groups] == [keys.CONSUMER_GROUP]

            async def recovered() -> bool:
                return "Redis answers again" in worker.output()

            await wait_until(recovered, 10, "the worker's line that Redis answers again")
        finally:
            await queue.close()
            await r.aclose()
    finally:
        if worker is not None:
            worker.stop()
        server.stop()

    log = worker.log_path.read_text(errors="replace")
    during = lines_between(log, t_down, t_up)
    outage_s = t_up - t_down
    assert 1 <= len(during) <= outage_s + 2, "\n".join(during)
    assert "Redis unavailable: " in during[0] and "Connection" in during[0], during[0]
    assert all("Redis" in line for line in during), "\n".join(during)
    # One reporter for the whole process: the heartbeat thread's failures are counted in it.
    assert any("heartbeat" in line for line in during[1:]), "\n".join(during)
    (back,) = [line for line in log.splitlines() if "Redis answers again" in line]
    seconds = float(re.search(r"after (\d+\.\d)s unavailable", back).group(1))  # type: ignore[union-attr]
    assert OUTAGE_S - 0.5 <= seconds <= outage_s + 5, back
    assert "Traceback" not in log and "  | " not in log, log
