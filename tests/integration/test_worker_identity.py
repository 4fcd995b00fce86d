"""One worker per id (fencing is by consumer name): a worker refuses to start while a live worker
has its id (``dtq worker run`` exits 2, :class:`~dtq.worker.Worker` raises ConfigError); after a
clean stop, or once the old heartbeat is stale, the id is free; a supervised child that takes
its dead predecessor's id starts at once (docs/operations.md, "Worker ids")."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable

import pytest
from redis.asyncio import Redis

from dtq import keys
from dtq.clock import redis_time_ms
from dtq.config import Settings
from dtq.errors import ConfigError
from dtq.records import stale_after_ms
from support import running_worker, wait_until
from support.worker import WorkerProcess, fast, handlers, wait_worker_ready

pytestmark = pytest.mark.slow

WAITING = "waiting for its next beat"


async def noop(payload: object, ctx: object) -> None:
    return None


async def test_a_second_worker_with_a_live_workers_id_is_refused(
    spawn: Callable[..., WorkerProcess], settings: Settings, r: Redis
) -> None:
    a = spawn("worker-dupe0001")
    await wait_worker_ready(r, "worker-dupe0001")
    twin = spawn("worker-dupe0001")
    assert twin.wait(20) == 2, twin.output()
    assert (
        "dtq worker: worker id worker-dupe0001 is in use by a live worker "
        f"(host {os.uname().nodename}, pid {a.pid})"
    ) in twin.output()
    with pytest.raises(ConfigError, match="worker id worker-dupe0001 is in use by a live worker"):
        async with running_worker(fast(settings), handlers(noop=noop), worker_id="worker-dupe0001"):
            pass
    # The refused ones wrote nothing: the hash is still the first worker's, and it serves.
    assert a.process.poll() is None
    assert await r.hget(keys.worker("worker-dupe0001"), "pid") == str(a.pid)
    await wait_worker_ready(r, "worker-dupe0001")


async def test_a_restart_after_a_clean_stop_or_a_stale_heartbeat_is_accepted(
    settings: Settings, r: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    s = fast(settings, heartbeat_interval_s=1.0, visibility_timeout_s=5.0)
    caplog.set_level(logging.INFO, logger="dtq.worker.worker")
    hs = handlers(noop=noop)
    async with running_worker(s, hs, worker_id="worker-again001"):
        pass
    assert await r.hget(keys.worker("worker-again001"), "status") == "stopped"
    async with running_worker(s, hs, worker_id="worker-again001"):
        await wait_worker_ready(r, "worker-again001")
    # A hash left by a worker that died long ago (its beat is past the stale age, the TTL not
    # yet run out): not alive, so no wait either.
    old_ms = await redis_time_ms(r) - 2 * stale_after_ms(s.heartbeat_interval_s)
    await r.hset(
        keys.worker("worker-again001"), mapping={"status": "busy", "last_heartbeat_ms": old_ms}
    )
    async with running_worker(s, hs, worker_id="worker-again001"):
        pass
    assert not [rec for rec in caplog.records if WAITING in rec.getMessage()]


async def _beat_as(r: Redis, worker_id: str, heartbeat_interval_s: float) -> int:
    """One beat in a crashed worker's name, written as its heartbeat thread writes it (the
    time and the hash's TTL): a restart started right after meets a fresh beat, however long
    the processes before it took to start on a loaded machine. Returns the beat's time."""
    now_ms = await redis_time_ms(r)
    pipe = r.pipeline(transaction=False)
    pipe.hset(keys.worker(worker_id), "last_heartbeat_ms", now_ms)
    pipe.pexpire(keys.worker(worker_id), stale_after_ms(heartbeat_interval_s))
    await pipe.execute()
    return now_ms


async def test_a_restart_after_a_crash_waits_until_the_old_heartbeat_is_stale(
    spawn: Callable[..., WorkerProcess], r: Redis
) -> None:
    # A beat is stale after 3 intervals: 15 s, more than a worker's start-up on a loaded
    # machine, so that the restart started after a beat meets it fresh.
    interval_s = 5.0
    env = {"HEARTBEAT_INTERVAL_S": interval_s, "VISIBILITY_TIMEOUT_S": 20.0}
    a = spawn("worker-crash001", **env)
    await wait_worker_ready(r, "worker-crash001")
    a.signal(signal.SIGKILL)
    a.wait(5)
    # One stopped while it waits leaves as it came: exit 0, nothing written.
    await _beat_as(r, "worker-crash001", interval_s)
    early = spawn("worker-crash001", **env)
    await wait_until(lambda: _logged(early, WAITING), 14, "the first restart waits")
    early.signal(signal.SIGTERM)
    assert early.wait(10) == 0, early.output()
    assert await r.hget(keys.worker("worker-crash001"), "pid") == str(a.pid)
    beat_ms = await _beat_as(r, "worker-crash001", interval_s)
    b = spawn("worker-crash001", **env)

    async def b_ready() -> bool:
        h = await r.hgetall(keys.worker("worker-crash001"))
        return h.get("pid") == str(b.pid) and h.get("status") in {"ready", "busy"}

    await wait_until(b_ready, 40, "the restarted worker serves")
    # It started only once the crashed one's heartbeat was stale, not before.
    started_ms = int(await r.hget(keys.worker("worker-crash001"), "last_heartbeat_ms") or 0)
    assert started_ms - beat_ms >= stale_after_ms(interval_s) - 100
    out = b.output()
    assert WAITING in out and "the previous holder of this id is gone" in out, out


async def test_a_supervised_child_restarted_under_its_id_starts_at_once(
    spawn: Callable[..., WorkerProcess], r: Redis
) -> None:
    """With DTQ_WORKER_ID set, the supervisor gives a dead child's replacement the same id
    (``<id>-<slot>``): it is not refused, nor kept waiting for the old heartbeat to go stale."""
    sup = spawn("worker-sup", "--processes", "2", HEARTBEAT_INTERVAL_S=2.0, VISIBILITY_TIMEOUT_S=10)
    for wid in ("worker-sup-0", "worker-sup-1"):
        await wait_worker_ready(r, wid)
    victim = int(await r.hget(keys.worker("worker-sup-0"), "pid") or 0)
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()

    async def replaced() -> bool:
        h = await r.hgetall(keys.worker("worker-sup-0"))
        return h.get("pid") not in {None, str(victim)} and h.get("status") in {"ready", "busy"}

    await wait_until(replaced, 20, "slot 0 replaced")
    # The dead child's hash would be stale 6 s after its last beat: the replacement did not wait.
    assert time.monotonic() - killed_at < stale_after_ms(2.0) / 1000 - 2.0, sup.output()
    assert "in use" not in sup.output() and WAITING not in sup.output()
    assert sup.process.poll() is None
    sup.signal(signal.SIGTERM)
    assert sup.wait(20) == 0


async def _logged(proc: WorkerProcess, text: str) -> bool:
    return text in proc.output()
