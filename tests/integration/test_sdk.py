"""The Python SDK (DESIGN 9) against a real Redis: reads, batches, clock, lifecycle, facade."""

from __future__ import annotations

import time
from typing import Any

import pytest
from redis.asyncio import Redis

from dtq import Queue, SyncQueue, Task, TaskStatus, connect, connect_sync, keys
from dtq.config import Settings
from dtq.devserver import free_port
from dtq.errors import (
    ConfigError,
    IdempotencyInProgressError,
    InvalidTaskError,
    QueueFullError,
    RedisUnavailableError,
    TaskNotFoundError,
)
from support import wait_until

MISSING_ID = "f" * 32


async def redis_ms(r: Redis) -> int:
    sec, usec = await r.time()
    return int(sec) * 1000 + int(usec) // 1000


async def next_ms(r: Redis) -> None:
    """Wait until the Redis clock has moved to the next millisecond (distinct created_ms)."""
    start = await redis_ms(r)

    async def moved() -> bool:
        return await redis_ms(r) > start

    await wait_until(moved, what="the next Redis millisecond")


# -- get / history -----------------------------------------------------------------------------


async def test_get_full_task(queue: Queue, r: Redis) -> None:
    sub = await queue.submit(
        "echo_task", {"x": [1, "ü"]}, queue="mail", priority=8, metadata={"who": "me"}
    )
    got = await queue.get(sub.task_id)
    assert got.model_dump(exclude={"updated_at"}) == sub.model_dump(exclude={"updated_at"})
    assert got.status is TaskStatus.QUEUED and got.queue == "mail" and got.priority == 8
    assert got.payload == {"x": [1, "ü"]} and got.metadata == {"who": "me"}
    assert got.timeout_ms == 30_000 and got.max_attempts == 5 and got.attempt == 0
    # Execution metadata is there, empty until a worker runs the task.
    assert got.started_at is None and got.finished_at is None and got.worker_id is None
    assert got.error_class is None and got.retryable is None and got.result is None
    assert got.entry_id == (await r.xrange(keys.stream("mail", 8)))[0][0]
    body = got.public_dict()
    assert body["task_id"] == sub.task_id and body["status"] == "queued"
    assert body["created_at"].endswith("Z") or body["created_at"].endswith("+00:00")


async def test_get_and_history_not_found(queue: Queue) -> None:
    with pytest.raises(TaskNotFoundError) as exc:
        await queue.get(MISSING_ID)
    assert exc.value.code == "TASK_NOT_FOUND" and MISSING_ID in exc.value.message
    with pytest.raises(TaskNotFoundError):
        await queue.history(MISSING_ID)


async def test_history_after_cancel(queue: Queue) -> None:
    task = await queue.submit("echo_task")
    await queue.cancel(task.task_id)
    steps = [(e.from_status, e.to_status, e.reason) for e in await queue.history(task.task_id)]
    assert steps == [
        (None, TaskStatus.QUEUED, "created"),
        (TaskStatus.QUEUED, TaskStatus.CANCELLED, "cancel"),
    ]


# -- list --------------------------------------------------------------------------------------


async def test_list_recent_first_and_filters(queue: Queue, r: Redis) -> None:
    submitted: list[Task] = []
    for i in range(6):
        q = "alpha" if i % 2 == 0 else "beta"
        submitted.append(await queue.submit("echo_task" if i < 4 else "other_task", queue=q))
        await next_ms(r)
    await queue.cancel(submitted[0].task_id)
    await queue.cancel(submitted[3].task_id)
    newest_first = [t.task_id for t in reversed(submitted)]

    listed = await queue.list()
    assert [t.task_id for t in listed] == newest_first
    assert [t.task_id for t in await queue.list(limit=2)] == newest_first[:2]

    alpha = await queue.list(queue="alpha")
    assert [t.task_id for t in alpha] == [submitted[i].task_id for i in (4, 2, 0)]
    assert {t.queue for t in alpha} == {"alpha"}

    cancelled = await queue.list(status="cancelled")
    assert [t.task_id for t in cancelled] == [submitted[3].task_id, submitted[0].task_id]
    queued_beta = await queue.list(queue="beta", status=TaskStatus.QUEUED)
    assert [t.task_id for t in queued_beta] == [submitted[5].task_id, submitted[1].task_id]
    assert await queue.list(queue="alpha", status=TaskStatus.RUNNING) == []
    assert [t.task_id for t in await queue.list(task_type="other_task")] == newest_first[:2]
    assert [t.task_id for t in await queue.list(queue="alpha", limit=1)] == [submitted[4].task_id]


async def test_list_keeps_submit_order_within_a_millisecond(queue: Queue, r: Redis) -> None:
    """One submit_many batch shares one created_at; back-to-back submits often share a
    millisecond too. Newest first still means last submitted first."""
    batch = await queue.submit_many(
        [{"task_type": "echo_task", "payload": {"i": i}} for i in range(40)]
    )
    assert len({t.created_at for t in batch[:32]}) == 1, "one script call, one Redis TIME"
    singles = [await queue.submit("echo_task") for _ in range(5)]
    newest_first = [t.task_id for t in reversed([*batch, *singles])]
    assert [t.task_id for t in await queue.list(limit=45)] == newest_first
    scores = [s for _, s in await r.zrevrange(keys.RECENT, 0, -1, withscores=True)]
    assert scores == sorted(set(scores), reverse=True), "every task its own score"


async def test_list_skips_tasks_whose_hash_expired(queue: Queue, r: Redis) -> None:
    a = await queue.submit("echo_task")
    b = await queue.submit("echo_task")
    await r.delete(keys.task(a.task_id))  # as retention would
    assert [t.task_id for t in await queue.list()] == [b.task_id]
    assert [t.task_id for t in await queue.list(status="queued")] == [b.task_id]


async def test_list_filter_scans_past_first_chunk(queue: Queue, r: Redis) -> None:
    target = await queue.submit("echo_task", queue="rare")
    await next_ms(r)
    others = await queue.submit_many([{"task_type": "echo_task"}] * 1_200)
    assert all(isinstance(t, Task) for t in others)
    assert [t.task_id for t in await queue.list(queue="rare")] == [target.task_id]


# -- submit_many -------------------------------------------------------------------------------


async def test_submit_many_order_and_per_item_errors(
    queue: Queue, r: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = await queue.submit("echo_task", idempotency_key="busy", queue="batch")
    pipelines: list[int] = []  # script calls in each write to Redis
    conn_class = queue.redis.connection_pool.connection_class
    real_send = conn_class.send_packed_command

    async def counting_send(self: Any, command: Any, *args: Any, **kwargs: Any) -> Any:
        chunks = [command] if isinstance(command, bytes | str) else list(command)
        data = b"".join(c.encode() if isinstance(c, str) else bytes(c) for c in chunks)
        if b"EVALSHA" in data:
            pipelines.append(data.count(b"$7\r\nEVALSHA\r\n"))
        return await real_send(self, chunks, *args, **kwargs)

    monkeypatch.setattr(conn_class, "send_packed_command", counting_send)
    items = [
        {"task_type": "echo_task", "payload": {"i": 0}},
        {"task_type": "echo_task", "payload": {"i": 1}, "idempotency_key": "busy"},
        {"task_type": "echo_task", "payload": {"i": 2}, "priority": 9},
        {"task_type": "echo_task", "payload": {"i": 3}, "delay_seconds": 60},
        {"task_type": "echo_task", "payload": {"i": 4}, "queue": "side"},
    ]
    results = await queue.submit_many(items, queue="batch")
    assert pipelines == [1], "all items go out in one script call, in one write: one round trip"
    assert isinstance(results[1], IdempotencyInProgressError)
    assert results[1].details["task_id"] == blocker.task_id
    tasks = [results[i] for i in (0, 2, 3, 4)]
    assert all(isinstance(t, Task) for t in tasks)
    assert [t.payload["i"] for t in tasks if isinstance(t, Task)] == [0, 2, 3, 4]
    assert [t.queue for t in tasks if isinstance(t, Task)] == ["batch", "batch", "batch", "side"]
    assert [t.status for t in tasks if isinstance(t, Task)] == [
        TaskStatus.QUEUED,
        TaskStatus.QUEUED,
        TaskStatus.PENDING,
        TaskStatus.QUEUED,
    ]
    for t in tasks:
        assert isinstance(t, Task)
        stored = await queue.get(t.task_id)
        assert (stored.status, stored.queue, stored.priority) == (t.status, t.queue, t.priority)


async def test_submit_many_duplicates_and_full(settings: Settings, queue: Queue, r: Redis) -> None:
    done = await queue.submit("echo_task", idempotency_key="done")
    await queue.cancel(done.task_id)
    small = await connect(settings=Settings(**{**settings.model_dump(), "max_queue_depth": 2}))
    try:
        results = await small.submit_many(
            [
                {"task_type": "echo_task", "idempotency_key": "done"},
                {"task_type": "echo_task"},
                {"task_type": "echo_task"},
                {"task_type": "echo_task"},
                {"task_type": "echo_task", "idempotency_key": "done"},
            ]
        )
    finally:
        await small.close()
    first, a, b, full, again = results
    assert isinstance(first, Task) and first.duplicate and first.task_id == done.task_id
    assert isinstance(again, Task) and again.duplicate and again.status is TaskStatus.CANCELLED
    assert isinstance(a, Task) and isinstance(b, Task)
    assert isinstance(full, QueueFullError)


async def test_submit_many_validates_everything_first(queue: Queue, r: Redis) -> None:
    with pytest.raises(InvalidTaskError):
        await queue.submit_many(
            [{"task_type": "echo_task"}, {"task_type": "echo_task", "priority": 42}]
        )
    with pytest.raises(InvalidTaskError, match="task_type"):
        await queue.submit_many([{"payload": {}}])
    assert await r.dbsize() == 0
    assert await queue.submit_many([]) == []


async def test_unknown_submit_option(queue: Queue) -> None:
    with pytest.raises(InvalidTaskError, match="colour"):
        await queue.submit_many([{"task_type": "echo_task", "colour": "red"}])


# -- clock, lifecycle --------------------------------------------------------------------------


async def test_now_is_the_redis_clock(queue: Queue, r: Redis) -> None:
    before = await redis_ms(r)
    now = await queue.now()
    after = await redis_ms(r)
    assert now.tzinfo is not None
    assert before <= int(now.timestamp() * 1000) <= after + 1


async def _client_count(r: Redis) -> int:
    return len(await r.client_list())


async def test_close_and_context_manager(settings: Settings, r: Redis) -> None:
    baseline = await _client_count(r)
    q = await connect(settings=settings)
    await q.submit("echo_task")
    assert await _client_count(r) > baseline
    await q.close()

    async def back_to_baseline() -> bool:
        return await _client_count(r) == baseline

    await wait_until(back_to_baseline, what="the SDK's connection closed")

    async with await connect(settings.redis_url) as q2:
        task = await q2.submit("echo_task")
        assert (await q2.get(task.task_id)).status is TaskStatus.QUEUED
        assert await _client_count(r) > baseline
    await wait_until(back_to_baseline, what="the context manager's connection closed")


async def test_connect_url_overrides_settings(settings: Settings) -> None:
    other = Settings(**{**settings.model_dump(), "redis_url": "redis://127.0.0.1:1/0"})
    async with await connect(settings.redis_url, settings=other) as q:
        assert q.settings.redis_url == settings.redis_url
        await q.submit("echo_task")


# -- Redis unreachable -------------------------------------------------------------------------


async def test_unreachable_redis_names_the_url() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(RedisUnavailableError) as exc:
        await connect(url)
    assert url in exc.value.message and exc.value.code == "REDIS_UNAVAILABLE"
    assert exc.value.details["url"] == url


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("http://127.0.0.1:6379/0", "redis://, rediss:// or unix://"),
        ("redis://:pw@127.0.0.1:notaport/0", "notaport"),
    ],
)
async def test_malformed_url_is_a_config_error(url: str, words: str) -> None:
    with pytest.raises(ConfigError) as exc:
        await connect(url)
    assert "DTQ_REDIS_URL" in exc.value.message and words in exc.value.message
    assert "pw@" not in exc.value.message


async def test_unreachable_redis_hides_the_password() -> None:
    url = f"redis://user:s3cret@127.0.0.1:{free_port()}/0"
    with pytest.raises(RedisUnavailableError) as exc:
        await connect(url)
    assert "s3cret" not in exc.value.message and "127.0.0.1" in exc.value.message


async def test_lost_connection_is_redis_unavailable(settings: Settings) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    q = Queue(
        Redis.from_url(url, decode_responses=True, socket_connect_timeout=1),
        Settings(**{**settings.model_dump(), "redis_url": url}),
    )
    try:
        with pytest.raises(RedisUnavailableError, match=url):
            await q.submit("echo_task")
        with pytest.raises(RedisUnavailableError, match=url):
            await q.get(MISSING_ID)
    finally:
        await q.close()


# -- the synchronous facade ----------------------------------------------------------------------


def test_sync_queue(redis_url: str) -> None:
    with connect_sync(redis_url) as q:
        assert isinstance(q, SyncQueue)
        task = q.submit("echo_task", {"n": 1}, priority=4, idempotency_key="sync")
        assert task.status is TaskStatus.QUEUED
        with pytest.raises(IdempotencyInProgressError):
            q.submit("echo_task", {"n": 1}, idempotency_key="sync")
        assert q.get(task.task_id).payload == {"n": 1}
        later = q.submit("echo_task", delay_seconds=30)
        batch = q.submit_many([{"task_type": "echo_task"}, {"task_type": "echo_task"}])
        assert all(isinstance(t, Task) for t in batch)
        assert len(q.list(limit=10)) == 4
        assert q.cancel(task.task_id).status is TaskStatus.CANCELLED
        assert q.mark_expired(later.task_id).status is TaskStatus.EXPIRED
        assert [t.task_id for t in q.list(status="cancelled")] == [task.task_id]
        assert [e.to_status for e in q.history(later.task_id)][-1] is TaskStatus.EXPIRED
        assert abs(q.now().timestamp() - time.time()) < 5
        with pytest.raises(TaskNotFoundError):
            q.get(MISSING_ID)


def test_sync_queue_unreachable() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(RedisUnavailableError, match=url):
        connect_sync(url)


async def test_list_refuses_an_unknown_status_and_a_bad_limit(queue: Queue) -> None:
    with pytest.raises(InvalidTaskError, match="status 'bogus' is not one of"):
        await queue.list(status="bogus")
    for limit in (0, -1, 10_001):
        with pytest.raises(InvalidTaskError, match="limit must be between 1 and 10000"):
            await queue.list(limit=limit)
