"""Waiting for tasks (docs/sdk.md, "Waiting for a task"): q.wait / q.result / wait_many /
as_completed and the sync facade, against real servers. The end is pushed by the script that
makes a task terminal (finish, cancel, expire), so a waiter returns at the terminal state and
Redis sees one check and one blocking read per wait; unknown or expired ids, failed, cancelled
and expired tasks raise their typed errors; a wait survives a Redis restart; a dead letter
sent back is waited for again, not answered by its old end."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from dtq import (
    Queue,
    ResultExpired,
    SyncQueue,
    TaskCancelled,
    TaskExpired,
    TaskFailed,
    TaskNotFound,
    TaskStatus,
    WaitTimeout,
    connect,
    keys,
)
from dtq.config import Settings
from dtq.devserver import start_redis
from dtq.errors import InvalidTaskError
from dtq_tasks import Handler, PermanentError, TaskContext
from support import running_worker, wait_until

pytestmark = pytest.mark.backends("single", "cluster")


async def echo(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    return {"echo": payload.get("v"), "attempt": ctx.attempt}


async def boom(payload: dict[str, Any], ctx: TaskContext) -> None:
    raise PermanentError("no thumbnail for you")


async def slow(payload: dict[str, Any], ctx: TaskContext) -> str:
    await asyncio.sleep(float(payload.get("s", 0.2)))
    return "slept"


HANDLERS: Mapping[str, Handler] = {
    "echo": Handler("echo", echo),
    "boom": Handler("boom", boom),
    "slow": Handler("slow", slow),
}


async def test_wait_and_result_return_when_the_worker_ends_the_task(
    queue: Queue, settings: Settings
) -> None:
    task = await queue.submit("echo", {"v": 7})
    waiter = asyncio.create_task(queue.result(task.task_id, timeout=30))
    await asyncio.sleep(0)  # the waiter is blocked before a worker exists
    assert not waiter.done()
    async with running_worker(settings, HANDLERS):
        assert await waiter == {"echo": 7, "attempt": 1}
        ended = await queue.wait(task.task_id, timeout=5)  # terminal already: at once
    assert ended.status == TaskStatus.SUCCEEDED and ended.result == {"echo": 7, "attempt": 1}


async def test_typed_errors_for_each_end(queue: Queue, settings: Settings) -> None:
    failed = await queue.submit("boom", {}, max_attempts=1)
    cancelled = await queue.submit("echo", {}, delay_seconds=3600)
    expired = await queue.submit("echo", {}, delay_seconds=3600, ttl_seconds=60)
    waits = [
        asyncio.create_task(queue.result(t.task_id, timeout=30))
        for t in (failed, cancelled, expired)
    ]
    await queue.cancel(cancelled.task_id)  # cancel.lua pushes the end
    await queue.mark_expired(expired.task_id)  # expire.lua pushes the end
    async with running_worker(settings, HANDLERS):  # finish.lua pushes the end
        results = await asyncio.gather(*waits, return_exceptions=True)
    err_failed, err_cancelled, err_expired = results
    assert isinstance(err_failed, TaskFailed), err_failed
    assert err_failed.error_class == "PermanentError"
    assert err_failed.error_message == "no thumbnail for you"
    assert err_failed.task.status == TaskStatus.DEAD_LETTERED and err_failed.code == "TASK_FAILED"
    assert isinstance(err_cancelled, TaskCancelled) and err_cancelled.task.status == "cancelled"
    assert isinstance(err_expired, TaskExpired) and err_expired.task.status == "expired"


async def test_unknown_id_and_expired_task_raise_not_found_at_once(queue: Queue, r: Redis) -> None:
    with pytest.raises(TaskNotFound):
        await queue.wait("0" * 32, timeout=60)
    task = await queue.submit("echo", {})
    await r.delete(keys.task(task.task_id))  # what the retention's TTL does
    with pytest.raises(TaskNotFound):
        await queue.result(task.task_id, timeout=60)


async def test_an_expired_result_raises_result_expired_at_once(
    settings: Settings, r: Redis
) -> None:
    short = settings.model_copy(update={"result_retention_s": 1})
    q = await connect(settings=short)
    try:
        task = await q.submit("echo", {"v": 1})
        async with running_worker(short, HANDLERS):
            assert await q.result(task.task_id, timeout=30) == {"echo": 1, "attempt": 1}

        async def result_gone() -> bool:
            return not await r.exists(keys.result(task.task_id))

        await wait_until(result_gone, 10, "the result key's TTL")
        with pytest.raises(ResultExpired) as err:
            await q.result(task.task_id, timeout=60)
        assert isinstance(err.value, TaskNotFound) and err.value.code == "RESULT_EXPIRED"
        assert (await q.get(task.task_id)).result_expired
    finally:
        await q.close()


async def test_a_none_result_is_not_an_expired_one(queue: Queue, settings: Settings) -> None:
    async def nothing(payload: dict[str, Any], ctx: TaskContext) -> None:
        return None

    task = await queue.submit("nothing", {})
    async with running_worker(settings, {"nothing": Handler("nothing", nothing)}):
        assert await queue.result(task.task_id, timeout=30) is None


async def test_timeout_raises_wait_timeout_with_the_task_as_it_is(queue: Queue) -> None:
    task = await queue.submit("echo", {})
    with pytest.raises(WaitTimeout) as err:
        await queue.wait(task.task_id, timeout=0.3)
    assert err.value.pending == [task.task_id] and err.value.code == "WAIT_TIMEOUT"
    assert err.value.task is not None and err.value.task.status == TaskStatus.QUEUED
    for bad in (0, -1, 10**6, "5"):
        with pytest.raises(InvalidTaskError):
            await queue.wait(task.task_id, timeout=bad)  # type: ignore[arg-type]


async def test_wait_many_and_as_completed(queue: Queue, settings: Settings) -> None:
    tasks = [await queue.submit("slow", {"s": s}) for s in (0.6, 0.05, 0.3)]
    ids = [t.task_id for t in tasks]
    async with running_worker(settings, HANDLERS, concurrency=3):
        order = [t.task_id async for t in queue.as_completed(ids, timeout=30)]
        assert sorted(order) == sorted(ids) and order[0] == ids[1] and order[-1] == ids[0]
        ended = await queue.wait_many([*ids, ids[0]], timeout=30)
    assert [t.task_id for t in ended] == ids  # the order given, each id once
    assert all(t.status == TaskStatus.SUCCEEDED for t in ended)

    late = await queue.submit("echo", {})
    with pytest.raises(WaitTimeout) as err:
        await queue.wait_many([ids[0], late.task_id], timeout=0.3)
    assert err.value.pending == [late.task_id]
    with pytest.raises(TaskNotFound):
        async for _ in queue.as_completed([ids[0], "f" * 32], timeout=5):
            pass


async def test_sync_facade_waits_too(settings: Settings) -> None:
    def produce() -> tuple[Any, list[str]]:
        with SyncQueue(settings=settings) as sq:
            t = sq.submit("echo", {"v": "sync"})
            others = [sq.submit("echo", {"v": i}).task_id for i in range(3)]
            result = sq.result(t.task_id, timeout=30)
            done = [x.task_id for x in sq.as_completed(others, timeout=30)]
            return result, done

    async with running_worker(settings, HANDLERS):
        result, done = await asyncio.to_thread(produce)
    assert result == {"echo": "sync", "attempt": 1} and len(done) == 3


async def test_a_dead_letter_sent_back_is_waited_for_again(
    queue: Queue, settings: Settings, r: Redis, backend: str
) -> None:
    task = await queue.submit("boom", {}, max_attempts=1)
    async with running_worker(settings, HANDLERS):
        ended = await queue.wait(task.task_id, timeout=30)
    assert ended.status == TaskStatus.DEAD_LETTERED
    await queue.requeue_dead_letter(task.task_id)
    if backend == "single":
        await r.config_resetstat()
    with pytest.raises(WaitTimeout) as err:  # its old end must not answer the new wait
        await queue.wait(task.task_id, timeout=0.5)
    assert err.value.task is not None and not err.value.task.is_terminal
    if backend == "single":  # nor wake it again and again
        stats = await r.info("commandstats")  # a read still blocked is not counted yet on Valkey
        assert int(stats.get("cmdstat_xread", {}).get("calls", 0)) <= 2


@pytest.mark.backends("single", reason="counts one server's commands")
async def test_a_thousand_waiters_return_and_redis_sees_no_polling(
    queue: Queue, settings: Settings, r: Redis
) -> None:
    n = 1000
    submitted = await queue.submit_many(
        [{"task_type": "echo", "payload": {"v": i}} for i in range(n)]
    )
    ids = [t.task_id for t in submitted if not isinstance(t, Exception)]
    assert len(ids) == n
    await r.config_resetstat()
    waiters = [asyncio.create_task(queue.result(tid, timeout=120)) for tid in ids]

    async def all_blocked() -> bool:
        # a thousand waiters share two blocked reads (500 done streams each) and a connection
        info = await r.info("clients")
        return int(info["blocked_clients"]) == 2 and int(info["connected_clients"]) <= 5

    await wait_until(all_blocked, 60, "the waiters blocked on their done streams")
    async with running_worker(settings, HANDLERS, concurrency=32):
        results = await asyncio.gather(*waiters)
    assert [res["echo"] for res in results] == list(range(n))
    stats = await r.info("commandstats")
    # Each read returns every done stream written since the last: far fewer reads than tasks,
    # and each ended task read once: nothing repeats per waiter while it waits.
    reads = int(stats["cmdstat_xread"]["calls"])
    assert reads < n / 4, reads
    assert int(stats["cmdstat_hgetall"]["calls"]) <= n + 10

    more = await queue.submit_many([{"task_type": "echo", "payload": {"v": i}} for i in range(n)])
    more_ids = [t.task_id for t in more if not isinstance(t, Exception)]
    await r.config_resetstat()
    many = asyncio.create_task(queue.wait_many(more_ids, timeout=120))
    async with running_worker(settings, HANDLERS, concurrency=32):
        ended = await many
    assert len(ended) == n and all(t.status == TaskStatus.SUCCEEDED for t in ended)
    reads = int((await r.info("commandstats"))["cmdstat_xread"]["calls"])
    assert reads < n / 4, reads


@pytest.mark.backends("single", reason="restarts its own server")
async def test_a_wait_survives_a_redis_restart(tmp_path: Path) -> None:
    server = start_redis(tmp_path / "redis", persistent=True)
    port = server.port
    settings = Settings(redis_url=server.url)
    q = await connect(settings=settings)
    try:
        task = await q.submit("echo", {"v": "restart"})
        waiter = asyncio.create_task(q.result(task.task_id, timeout=60))

        async def marked() -> bool:
            return bool(await q.redis.hget(keys.task(task.task_id), "waited"))

        await wait_until(marked, 10, "the wait registered")
        server.stop()  # a clean shutdown writes the AOF
        server = start_redis(tmp_path / "redis", port=port, persistent=True)
        async with running_worker(settings, HANDLERS):
            assert await waiter == {"echo": "restart", "attempt": 1}
    finally:
        await q.close()
        server.stop()


async def test_waiting_in_a_handler_on_its_own_queue_logs_a_warning(
    queue: Queue, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    async def parent(payload: dict[str, Any], ctx: TaskContext) -> Any:
        return await queue.result(payload["child"], timeout=30)

    child = await queue.submit("echo", {"v": "child"})
    parent_task = await queue.submit("parent", {"child": child.task_id})
    handlers = {**HANDLERS, "parent": Handler("parent", parent)}
    with caplog.at_level(logging.WARNING, logger="dtq.wait"):
        async with running_worker(settings, handlers, concurrency=2):
            assert await queue.result(parent_task.task_id, timeout=30) == {
                "echo": "child",
                "attempt": 1,
            }
    warned = [r.getMessage() for r in caplog.records if r.name == "dtq.wait"]
    assert len(warned) == 1 and "queue default, which its own worker serves" in warned[0]
