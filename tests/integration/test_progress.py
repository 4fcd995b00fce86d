"""ctx.progress() (docs/handlers.md, "Progress"): what a handler reports reaches ``get()``, the
task's events, the API (its task body and the WebSocket) and ``dtq status``, from async and
sync handlers alike; a chatty handler is throttled; a stale worker's progress never lands; a
bad argument is the handler's ValueError; a retry's next attempt starts without progress."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis
from websockets.asyncio.client import connect

from dtq import Queue, calls, keys
from dtq.config import Settings
from dtq.models import PROGRESS_DATA_MAX_BYTES, compact_json
from dtq.worker.progress import PROGRESS_INTERVAL_S
from dtq_tasks import RetryableError, TaskContext
from support import Events, running_worker, wait_until
from support.api import Api, ApiServer, api_settings, recv_until
from support.cli import Cli
from support.worker import backend, fast, handlers, read_as, start_as, wait_status

pytestmark = pytest.mark.backends("single", "cluster")


async def progress_of(queue: Queue, task_id: str) -> tuple[float | None, Any] | None:
    progress = (await queue.get(task_id)).progress
    return None if progress is None else (progress.fraction, progress.data)


async def reaches(queue: Queue, task_id: str, fraction: float | None, data: Any) -> None:
    async def there() -> bool:
        return await progress_of(queue, task_id) == (fraction, data)

    await wait_until(there, what=f"progress {fraction} {data} of task {task_id}")


# -- every surface, async and sync handlers -------------------------------------------------------


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_progress_reaches_get_and_the_events_and_is_kept_at_the_end(
    settings: Settings, r: Redis, queue: Queue, kind: str
) -> None:
    halfway = threading.Event()  # set by the test once it has seen the first report

    async def async_steps(payload: dict[str, Any], ctx: TaskContext) -> str:
        ctx.progress(0.5, {"step": "half"})
        assert await asyncio.to_thread(halfway.wait, 10)
        ctx.progress(None, "no fraction")
        ctx.progress(1, {"step": "done"})  # within the interval: written before the finish
        return "ok"

    def sync_steps(payload: dict[str, Any], ctx: TaskContext) -> str:
        ctx.progress(0.5, {"step": "half"})
        assert halfway.wait(10)
        ctx.progress(None, "no fraction")
        ctx.progress(1, {"step": "done"})
        return "ok"

    fn = async_steps if kind == "async" else sync_steps
    async with Events(r) as events, running_worker(fast(settings), handlers(pg_steps=fn)):
        task = await queue.submit("pg_steps", {})
        await reaches(queue, task.task_id, 0.5, {"step": "half"})
        running = await queue.get(task.task_id)
        assert running.status == "running" and running.progress is not None
        assert running.started_at is not None and running.progress.updated_at >= running.started_at
        [first] = await events.wait_for("TASK_PROGRESS", task.task_id)
        assert first.metadata == {"fraction": 0.5, "data": {"step": "half"}}
        assert first.attempt == 1 and first.worker_id == running.worker_id
        assert first.queue == "default" and first.task_type == "pg_steps"
        halfway.set()
        await wait_status(r, task.task_id, "succeeded")
        await events.sync()
    done = await queue.get(task.task_id)
    assert done.progress is not None and (done.progress.fraction, done.progress.data) == (
        1.0,
        {"step": "done"},
    ), "the last report is kept with the terminal state"
    mine = [e for e in events.items if e.task_id == task.task_id]
    kinds = [e.type for e in mine]
    assert kinds[-1] == "TASK_SUCCEEDED" and kinds[-2] == "TASK_PROGRESS"
    assert mine[-2].metadata == {"fraction": 1.0, "data": {"step": "done"}}
    # The middle report was coalesced into the trailing one (one write per interval).
    assert 2 <= kinds.count("TASK_PROGRESS") <= 3


async def test_the_api_task_body_and_the_websocket_show_progress(
    settings: Settings, queue: Queue, api: Api
) -> None:
    go_on = asyncio.Event()

    async def hold(payload: dict[str, Any], ctx: TaskContext) -> None:
        ctx.progress(0.25, {"rows": 250})
        await go_on.wait()

    server = ApiServer(api_settings(settings))
    server.start()
    try:
        url = f"ws://127.0.0.1:{server.port}/ws/events?type=TASK_PROGRESS"
        async with (
            connect(url) as ws,
            running_worker(fast(settings), handlers(pg_hold=hold)),
        ):
            task = await queue.submit("pg_hold", {})
            [event] = await recv_until(ws, lambda evs: len(evs) == 1)
            assert event["type"] == "TASK_PROGRESS" and event["task_id"] == task.task_id
            assert event["metadata"] == {"fraction": 0.25, "data": {"rows": 250}}
            resp = await api.client.get(f"/api/v1/tasks/{task.task_id}")
            assert resp.status_code == 200
            body = resp.json()["progress"]
            assert {k: body[k] for k in ("fraction", "data")} == {
                "fraction": 0.25,
                "data": {"rows": 250},
            }
            assert body["updated_at"].endswith("Z")
            go_on.set()
    finally:
        server.stop()
    plain = (await api.client.get(f"/api/v1/tasks/{(await queue.submit('x', {})).task_id}")).json()
    assert plain["progress"] is None


async def test_the_tasks_event_stream_carries_its_progress(
    settings: Settings, queue: Queue
) -> None:
    """GET /api/v1/tasks/{id}/events (server-sent events): a real handler's progress events,
    in order between its start and its end, and the stream ends at the end."""

    async def steps(payload: dict[str, Any], ctx: TaskContext) -> str:
        ctx.progress(0.5, {"step": 1})
        await asyncio.sleep(PROGRESS_INTERVAL_S + 0.1)
        ctx.progress(1.0, {"step": 2})
        return "done"

    task = await queue.submit("pg_steps", {})
    server = ApiServer(api_settings(settings))
    server.start()
    try:
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=15) as client,
            client.stream("GET", f"/api/v1/tasks/{task.task_id}/events") as resp,
        ):
            assert resp.status_code == 200
            async with running_worker(fast(settings), handlers(pg_steps=steps)):
                seen: list[dict[str, Any]] = []
                async with asyncio.timeout(15):
                    async for line in resp.aiter_lines():
                        if line.startswith("data:"):
                            seen.append(json.loads(line.removeprefix("data:")))
    finally:
        server.stop()
    assert [e["type"] for e in seen] == [
        "TASK_STARTED",
        "TASK_PROGRESS",
        "TASK_PROGRESS",
        "TASK_SUCCEEDED",
    ]
    assert [e["metadata"] for e in seen[1:3]] == [
        {"fraction": 0.5, "data": {"step": 1}},
        {"fraction": 1.0, "data": {"step": 2}},
    ]


async def test_a_producers_wait_returns_the_last_progress(settings: Settings, queue: Queue) -> None:
    """The last report is written before the finish, so the task a wait returns has it."""
    first_seen = threading.Event()

    def two_steps(payload: dict[str, Any], ctx: TaskContext) -> None:
        ctx.progress(0.5)
        assert first_seen.wait(10)
        ctx.progress(1, {"i": 100})  # within the interval of the first: a trailing write

    async with running_worker(fast(settings), handlers(pg_two=two_steps)):
        task = await queue.submit("pg_two", {})
        await reaches(queue, task.task_id, 0.5, None)
        first_seen.set()
        done = await queue.wait(task.task_id, timeout=15)
    assert done.status == "succeeded"
    assert done.progress is not None and (done.progress.fraction, done.progress.data) == (
        1.0,
        {"i": 100},
    )


# -- throttling -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_chatty_handler_is_throttled(
    settings: Settings, r: Redis, queue: Queue, kind: str
) -> None:
    """10,000 reports in about a second: a handful of writes, the last report kept."""
    n = 10_000
    spent: list[float] = []

    def report(ctx: TaskContext, i: int) -> float:
        t0 = time.perf_counter()
        ctx.progress((i + 1) / n, {"i": i})
        return time.perf_counter() - t0

    async def chatty_async(payload: dict[str, Any], ctx: TaskContext) -> None:
        total = 0.0
        for i in range(n):
            total += report(ctx, i)
            if i % 100 == 99:
                await asyncio.sleep(0.01)
        spent.append(total)

    def chatty_sync(payload: dict[str, Any], ctx: TaskContext) -> None:
        total = 0.0
        for i in range(n):
            total += report(ctx, i)
            if i % 100 == 99:
                time.sleep(0.01)
        spent.append(total)

    fn = chatty_async if kind == "async" else chatty_sync
    async with Events(r) as events, running_worker(fast(settings), handlers(pg_chatty=fn)):
        task = await queue.submit("pg_chatty", {})
        await wait_status(r, task.task_id, "succeeded", timeout_s=30)
        started = await queue.get(task.task_id)
        await events.sync()
    written = events.of("TASK_PROGRESS", task.task_id)
    assert started.duration_ms is not None
    most = started.duration_ms / 1000 / PROGRESS_INTERVAL_S + 2  # one per interval, the first
    assert 2 <= len(written) <= most, (len(written), started.duration_ms)
    assert written[-1].metadata == {"fraction": 1.0, "data": {"i": n - 1}}
    assert await progress_of(queue, task.task_id) == (1.0, {"i": n - 1})
    assert spent[0] < 1.0, f"{n} reports took {spent[0]:.3f} s of the handler's time"


# -- fencing --------------------------------------------------------------------------------------


async def test_a_stale_workers_progress_does_not_land(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    task = await queue.submit("pg_x", {})
    entry = await read_as(r, "worker-zombie00")
    await start_as(r, entry, "worker-zombie00", settings)
    db = backend(r, settings)
    assert (await calls.progress(db, entry, 1, "worker-zombie00", 0.1, "null")).written
    # The entry is reclaimed by worker-other000 (its start not run yet: the hash still names
    # the zombie's attempt, the pending list does not), then started again (attempt 2).
    await r.xclaim(entry.stream, keys.CONSUMER_GROUP, "worker-other000", 0, [entry.entry_id])
    reply = await calls.progress(db, entry, 1, "worker-zombie00", 0.8, '"claimed"')
    assert not reply.written and reply.detail == "owner:worker-other000", reply
    assert (await start_as(r, entry, "worker-other000", settings)).attempt == 2
    before = await r.hgetall(keys.task(task.task_id))
    async with Events(r) as events:
        for worker_id, attempt in (
            ("worker-zombie00", 1),
            ("worker-zombie00", 2),
            ("worker-other000", 1),
        ):
            reply = await calls.progress(db, entry, attempt, worker_id, 0.9, '"stale"')
            assert not reply.written, (worker_id, attempt, reply)
        assert await r.hgetall(keys.task(task.task_id)) == before
        assert (await queue.get(task.task_id)).progress is None, "attempt 1's is not shown"
        assert events.of("TASK_PROGRESS") == []
        exact = '{"n":12345678901234567,"list":[],"s":"\u00e9\\""}'
        reply = await calls.progress(db, entry, 2, "worker-other000", 0.3, exact)
        assert reply.written
        [event] = await events.wait_for("TASK_PROGRESS", task.task_id)
    assert await progress_of(queue, task.task_id) == (0.3, json.loads(exact)), "kept exactly"
    assert event.metadata["fraction"] == 0.3 and event.metadata["data"]["s"] == 'é"'


async def test_no_progress_lands_once_the_task_has_ended(
    settings: Settings, r: Redis, queue: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sync handler's thread that reports after its attempt ended writes nothing."""
    ended = threading.Event()
    reported = threading.Event()
    contexts: list[TaskContext] = []

    def quick(payload: dict[str, Any], ctx: TaskContext) -> None:
        contexts.append(ctx)
        ctx.progress(0.5)

    async with running_worker(fast(settings), handlers(pg_quick=quick)):
        task = await queue.submit("pg_quick", {})
        await wait_status(r, task.task_id, "succeeded")
        before = await r.hget(keys.task(task.task_id), "progress")
        sent = count_sends(monkeypatch)
        async with Events(r) as events:

            def late() -> None:
                assert ended.wait(5)
                contexts[0].progress(0.99, "late")
                reported.set()

            thread = threading.Thread(target=late)
            thread.start()
            ended.set()
            await asyncio.to_thread(reported.wait, 5)
            thread.join(5)
            await asyncio.sleep(PROGRESS_INTERVAL_S)  # a write, were one scheduled, is sent
        assert events.of("TASK_PROGRESS") == []
        assert sent == [], "the worker sent nothing for an attempt that has ended"
    assert await r.hget(keys.task(task.task_id), "progress") == before


def count_sends(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The task ids of the progress writes the worker sends from now (progress.lua would fence
    a late one anyway: this sees that the worker does not even send it)."""
    sent: list[str] = []
    real = calls.progress

    async def spy(db: Any, entry: Any, *args: Any) -> calls.ProgressReply:
        sent.append(entry.task_id)
        return await real(db, entry, *args)

    monkeypatch.setattr(calls, "progress", spy)
    return sent


# -- arguments ------------------------------------------------------------------------------------


async def test_a_bad_argument_is_the_handlers_value_error(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    bad: list[tuple[Any, Any]] = [
        (1.5, None),
        (-0.1, None),
        (float("nan"), None),
        (float("inf"), None),
        (True, None),
        ("0.5", None),
        (0.5, {"blob": "x" * PROGRESS_DATA_MAX_BYTES}),
        (0.5, {"obj": object()}),
        (0.5, float("nan")),
    ]

    async def picky(payload: dict[str, Any], ctx: TaskContext) -> list[str]:
        seen = []
        for fraction, data in bad:
            try:
                ctx.progress(fraction, data)
            except ValueError as exc:
                seen.append(str(exc))
            else:
                seen.append("accepted")
        at_limit = "x" * (PROGRESS_DATA_MAX_BYTES - len(compact_json("")))
        ctx.progress(0, at_limit)  # exactly the limit is accepted
        return seen

    async with running_worker(fast(settings), handlers(pg_picky=picky)):
        task = await queue.submit("pg_picky", {})
        await wait_status(r, task.task_id, "succeeded")
    done = await queue.get(task.task_id)
    assert "accepted" not in done.result, done.result
    assert "from 0 to 1" in done.result[0] and "not JSON-serialisable" in done.result[7]
    assert f"more than {PROGRESS_DATA_MAX_BYTES}" in done.result[6]
    assert done.progress is not None and done.progress.fraction == 0.0


# -- attempts -------------------------------------------------------------------------------------


async def test_a_retry_starts_without_the_earlier_attempts_progress(
    settings: Settings, r: Redis, queue: Queue
) -> None:
    second = asyncio.Event()  # set by the test once it has read the second attempt's progress

    async def flaky(payload: dict[str, Any], ctx: TaskContext) -> int:
        if ctx.attempt == 1:
            ctx.progress(0.7, "first")
            raise RetryableError("once")
        await second.wait()
        ctx.progress(0.2, "second")
        return ctx.attempt

    async with running_worker(fast(settings), handlers(pg_flaky=flaky)):
        task = await queue.submit("pg_flaky", {}, max_attempts=2)

        async def second_running() -> bool:
            t = await queue.get(task.task_id)
            return t.status == "running" and t.attempt == 2

        await wait_until(second_running, what="the second attempt running")
        assert (await queue.get(task.task_id)).progress is None
        second.set()
        await wait_status(r, task.task_id, "succeeded")
    assert await progress_of(queue, task.task_id) == (0.2, "second")


# -- the CLI --------------------------------------------------------------------------------------


async def test_dtq_status_shows_a_bar_and_the_data(settings: Settings, queue: Queue) -> None:
    go_on = asyncio.Event()

    async def hold(payload: dict[str, Any], ctx: TaskContext) -> None:
        ctx.progress(0.5, {"file": "b.csv"})
        await go_on.wait()

    cli = Cli(settings.redis_url, cluster=settings.redis_cluster, DTQ_TASK_MODULES="")
    async with running_worker(fast(settings), handlers(pg_cli=hold)):
        task = await queue.submit("pg_cli", {})
        await reaches(queue, task.task_id, 0.5, {"file": "b.csv"})
        run = await asyncio.to_thread(cli.ok, "status", task.task_id)
        assert 'progress: [##########..........] 50% {"file":"b.csv"} (updated ' in run.out
        doc = (await asyncio.to_thread(cli.ok, "status", task.task_id, "--json")).json()
        assert doc["progress"]["fraction"] == 0.5 and doc["progress"]["data"] == {"file": "b.csv"}
        go_on.set()
    plain = await queue.submit("pg_cli_none", {})
    assert "progress" not in (await asyncio.to_thread(cli.ok, "status", plain.task_id)).out
    doc = (await asyncio.to_thread(cli.ok, "status", plain.task_id, "--json")).json()
    assert doc["progress"] is None
