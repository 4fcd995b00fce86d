"""dtq.testing's drain and running_worker (docs/testing.md): the real worker runs the registered
handlers until the queues are drained; what "drained" means for delayed and retrying tasks;
failures and handler exceptions reach the test; a drain that cannot finish says why, on time."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from dtq import Queue, TaskStatus, connect
from dtq.config import Settings
from dtq.errors import InvalidTaskError
from dtq.testing import FAST_SETTINGS, DrainTimeout, TaskFailures, drain, running_worker
from dtq_tasks import PermanentError, RetryableError, TaskContext, task
from support import wait_until

RELEASE = threading.Event()  # lets tt_block's thread end when a test is over


@task("tt_echo")
async def tt_echo(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    return payload


@task("tt_flaky")
async def tt_flaky(payload: dict[str, Any], ctx: TaskContext) -> dict[str, int]:
    if ctx.attempt <= payload["fail_times"]:
        raise RetryableError(f"flaky on attempt {ctx.attempt}")
    return {"attempt": ctx.attempt}


@task("tt_permanent")
async def tt_permanent(payload: dict[str, Any], ctx: TaskContext) -> None:
    raise PermanentError(f"bad input: {payload.get('why')}")


@task("tt_sync_fail")
def tt_sync_fail(payload: dict[str, Any], ctx: TaskContext) -> None:
    raise ValueError("a sync handler's own error")


@task("tt_sleep")
async def tt_sleep(payload: dict[str, Any], ctx: TaskContext) -> None:
    await asyncio.sleep(payload["s"])


@task("tt_block")
def tt_block(payload: dict[str, Any], ctx: TaskContext) -> None:
    RELEASE.wait(payload["s"])


@pytest.fixture
async def q(settings: Settings) -> AsyncIterator[Queue]:
    """A queue on the test's emptied database with dtq.testing's fast settings."""
    queue = await connect(settings=settings.model_copy(update=FAST_SETTINGS))
    yield queue
    await queue.close()


async def test_drain_runs_the_registered_handlers_to_their_end(q: Queue) -> None:
    ids = [(await q.submit("tt_echo", {"n": i})).task_id for i in range(3)]
    result = await drain(q)
    assert result.counts == {"succeeded": 3}
    assert [t.task_id for t in result.tasks] == ids  # the order they ran in: one queue, FIFO
    assert [t.result for t in result.tasks] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert (await q.get(ids[0])).status is TaskStatus.SUCCEEDED
    assert result.errors == {} and result.failed == []
    result.raise_failures()  # nothing failed: no error


async def test_a_failure_is_visible_with_its_exception(q: Queue) -> None:
    bad = await q.submit("tt_permanent", {"why": "no size"})
    sync_bad = await q.submit("tt_sync_fail", {})
    good = await q.submit("tt_echo", {})
    result = await drain(q)
    assert result.counts == {"dead_lettered": 2, "succeeded": 1}
    failed = {t.task_id: t for t in result.failed}
    assert set(failed) == {bad.task_id, sync_bad.task_id}
    assert failed[bad.task_id].error_class == "PermanentError"
    assert failed[bad.task_id].error_message == "bad input: no size"
    [exc] = result.errors[bad.task_id]
    assert isinstance(exc, PermanentError) and exc.__traceback__ is not None
    [sync_exc] = result.errors[sync_bad.task_id]  # raised on a worker thread
    assert isinstance(sync_exc, ValueError)
    assert result.task(good.task_id).status is TaskStatus.SUCCEEDED

    with pytest.raises(TaskFailures) as caught:
        result.raise_failures()
    assert caught.value.__cause__ is exc  # pytest prints the handler's traceback
    assert "PermanentError: bad input: no size" in str(caught.value)
    assert {t.task_id for t in caught.value.tasks} == set(failed)


async def test_raise_failures_option(q: Queue) -> None:
    await q.submit("tt_permanent", {"why": "x"})
    with pytest.raises(TaskFailures, match="1 task"):
        await drain(q, raise_failures=True)


async def test_retries_with_backoff_run_to_their_end(q: Queue) -> None:
    """By default a drain waits for retries due within its timeout: every attempt runs."""
    t = await q.submit("tt_flaky", {"fail_times": 2}, max_attempts=5)
    result = await drain(q)
    assert result.counts == {"succeeded": 1}
    assert result.task(t.task_id).result == {"attempt": 3}
    assert [str(e) for e in result.errors[t.task_id]] == [
        "flaky on attempt 1",
        "flaky on attempt 2",
    ]


async def test_wait_scheduled_false_leaves_a_retry_not_yet_due(settings: Settings) -> None:
    slow_retries = {**FAST_SETTINGS, "retry_base_delay": 30.0, "retry_max_delay": 30.0}
    async with await connect(settings=settings.model_copy(update=slow_retries)) as q:
        t = await q.submit("tt_flaky", {"fail_times": 1}, max_attempts=3)
        started = time.monotonic()
        result = await drain(q, wait_scheduled=False)
        assert time.monotonic() - started < 5  # did not wait for the retry
        assert result.counts == {"retrying": 1}
        assert [s.task_id for s in result.scheduled] == [t.task_id]
        assert (await q.get(t.task_id)).status is TaskStatus.RETRYING


async def test_delays_due_within_the_timeout_run_later_ones_are_left(q: Queue) -> None:
    soon = await q.submit("tt_echo", {"when": "soon"}, delay_seconds=0.3)
    later = await q.submit("tt_echo", {"when": "later"}, delay_seconds=3600)
    other = await q.submit("tt_echo", {}, queue="other", delay_seconds=0.1)  # not drained
    started = time.monotonic()
    result = await drain(q, timeout=5)
    assert time.monotonic() - started < 4  # returned once soon ran, not at the deadline
    assert [t.task_id for t in result.tasks] == [soon.task_id]
    assert result.counts == {"succeeded": 1}
    assert [t.task_id for t in result.scheduled] == [later.task_id]
    assert result.task(later.task_id).status is TaskStatus.PENDING
    # with wait_scheduled=False, a delay not yet due is left too
    soon2 = await q.submit("tt_echo", {}, delay_seconds=2)
    result = await drain(q, wait_scheduled=False)
    assert result.tasks == ()
    assert [t.task_id for t in result.scheduled] == [soon2.task_id, later.task_id]
    await wait_until(lambda: _status_is(q, other.task_id, TaskStatus.QUEUED), 5, "other promoted")


async def _status_is(q: Queue, task_id: str, status: TaskStatus) -> bool:
    return (await q.get(task_id)).status is status


async def test_only_the_given_queues_are_drained(q: Queue) -> None:
    mine = await q.submit("tt_echo", {}, queue="mine")
    theirs = await q.submit("tt_echo", {})  # default
    result = await drain(q, queues=["mine"])
    assert [t.task_id for t in result.tasks] == [mine.task_id]
    assert (await q.get(theirs.task_id)).status is TaskStatus.QUEUED


async def test_a_drain_that_cannot_finish_times_out_on_time(q: Queue) -> None:
    running = await q.submit("tt_sleep", {"s": 30})
    done = await q.submit("tt_echo", {})
    started = time.monotonic()
    with pytest.raises(DrainTimeout) as caught:
        await drain(q, timeout=1)
    assert time.monotonic() - started < 4  # the sleeping handler was not waited for
    assert caught.value.left == ["queue default: 1 running, 0 waiting"]
    assert "not drained within 1 s" in str(caught.value)
    assert caught.value.result.task(done.task_id).status is TaskStatus.SUCCEEDED
    assert caught.value.result.task(running.task_id).status is TaskStatus.RUNNING


async def test_a_sync_handler_still_running_at_the_timeout(q: Queue) -> None:
    RELEASE.clear()
    await q.submit("tt_block", {"s": 30})
    started = time.monotonic()
    try:
        with pytest.raises(DrainTimeout, match="1 running"):
            await drain(q, timeout=1)
        assert time.monotonic() - started < 8
    finally:
        RELEASE.set()


async def test_a_paused_queue_is_named_when_the_drain_times_out(q: Queue) -> None:
    await q.pause_queue("default")
    await q.submit("tt_echo", {})
    with pytest.raises(DrainTimeout) as caught:
        await drain(q, timeout=0.5)
    assert caught.value.left == ["queue default: 1 waiting (paused)"]


async def test_handlers_can_be_given(q: Queue) -> None:
    from dtq_tasks import Handler

    async def double(payload: dict[str, Any], ctx: TaskContext) -> int:
        return int(payload["n"]) * 2

    t = await q.submit("tt_double", {"n": 21})
    result = await drain(q, handlers={"tt_double": Handler("tt_double", double)})
    assert result.task(t.task_id).result == 42


async def test_bad_arguments_are_refused_before_a_worker_starts(q: Queue) -> None:
    with pytest.raises(ValueError, match="timeout"):
        await drain(q, timeout=0)
    with pytest.raises(TypeError, match=r"queues=\['emails'\]"):
        await drain(q, queues="emails")
    with pytest.raises(InvalidTaskError, match="not a valid queue name"):
        await drain(q, queues=["no spaces"])
    with pytest.raises(ValueError, match="no queue"):
        await drain(q, queues=[])


async def test_running_worker_serves_for_the_block(q: Queue) -> None:
    async with running_worker(q, queues=["default"]) as worker:
        assert worker.started.is_set()
        t = await q.submit("tt_echo", {"x": 1})
        assert await q.result(t.task_id, timeout=5) == {"x": 1}
    # stopped: a task submitted now waits
    late = await q.submit("tt_echo", {})
    assert (await q.get(late.task_id)).status is TaskStatus.QUEUED


async def test_a_stopping_drain_unblocks_only_its_own_reads(q: Queue, redis_url: str) -> None:
    """A drain ends its worker's blocking reads to stop at once; another client's blocking read
    (a producer waiting on a stream) is left to its own timeout."""
    from redis.asyncio import Redis

    other = Redis.from_url(redis_url, decode_responses=True)
    try:
        started = time.monotonic()
        read = asyncio.create_task(other.xread({"foreign": "$"}, block=1500))
        for _ in range(3):
            await drain(q)
        assert not read.done()
        assert await read in (None, [], {})
        assert time.monotonic() - started >= 1.4
    finally:
        await other.aclose()
