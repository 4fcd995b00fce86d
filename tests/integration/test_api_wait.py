"""Waiting over HTTP: the long poll ``GET /api/v1/tasks/{id}?wait=S`` and the server-sent
events of one task ``GET /api/v1/tasks/{id}/events``, against real servers: the app in process
(ASGI) for the long poll, uvicorn on 127.0.0.1 (a thread, or ``dtq api`` as a process) for the
streams, a real worker where a task has to run."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from dtq import Queue, keys
from dtq.api import sse
from dtq.api.routes_tasks import LONG_POLL_MAX_S
from dtq.config import Settings
from dtq.devserver import free_port
from dtq.events import TERMINAL_EVENTS
from dtq.models import TERMINAL
from support import running_worker, wait_until
from support.api import (
    API_KEY,
    Api,
    ApiServer,
    api_server,
    api_settings,
    error_of,
    wait_healthy,
)
from support.cli import MISSING_ID

pytestmark = pytest.mark.backends("single", "cluster")


@pytest.fixture
async def server(settings: Settings) -> AsyncIterator[ApiServer]:
    async with api_server(api_settings(settings)) as running:
        yield running


async def read_events(resp: httpx.Response, within_s: float = 15.0) -> list[dict[str, Any]]:
    """Every message of an event stream until the server ends it (within a deadline): its
    ``id``, ``event`` and ``data`` fields, the data parsed as JSON. Comments (pings) skipped."""
    events: list[dict[str, Any]] = []
    message: dict[str, Any] = {}
    async with asyncio.timeout(within_s):
        async for line in resp.aiter_lines():
            if not line:
                if message:
                    message["data"] = json.loads(message["data"])
                    events.append(message)
                    message = {}
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            message[name] = value.removeprefix(" ")
    assert not message, f"the stream ended inside a message: {message}"
    return events


def events_path(task_id: str) -> str:
    return f"/api/v1/tasks/{task_id}/events"


def task_path(task_id: str, wait: object) -> str:
    return f"/api/v1/tasks/{task_id}?wait={wait}"


# -- the long poll --------------------------------------------------------------------------------


async def test_long_poll_answers_when_the_task_ends(
    api: Api, queue: Queue, settings: Settings
) -> None:
    task = await queue.submit("api_echo", {"n": 7})
    begun = time.monotonic()
    async with running_worker(api_settings(settings)):
        resp = await api.client.get(task_path(task.task_id, 20))
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["status"] == "succeeded" and body["result"] == {"n": 7}
    assert time.monotonic() - begun < 15, "answered at the end, not when wait passed"


async def test_long_poll_answers_at_a_cancel_made_while_it_waits(api: Api, queue: Queue) -> None:
    task = await queue.submit("api_echo", {}, delay_seconds=60)
    poll = asyncio.create_task(api.client.get(task_path(task.task_id, 20)))
    await queue.cancel(task.task_id)
    resp = await asyncio.wait_for(poll, 15)
    assert resp.status_code == 200 and resp.json()["status"] == "cancelled"


async def test_long_poll_of_a_task_already_ended_answers_at_once(api: Api, queue: Queue) -> None:
    task = await queue.submit("api_echo", {})
    await queue.mark_expired(task.task_id)
    resp = await asyncio.wait_for(api.client.get(task_path(task.task_id, LONG_POLL_MAX_S)), 5)
    assert resp.status_code == 200 and resp.json()["status"] == "expired"


async def test_long_poll_answers_with_the_task_as_it_is_when_wait_passes(
    api: Api, queue: Queue
) -> None:
    task = await queue.submit("api_echo", {}, delay_seconds=60)
    begun = time.monotonic()
    resp = await api.client.get(task_path(task.task_id, 0.5))
    assert time.monotonic() - begun >= 0.5
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["task_id"] == task.task_id and body["status"] == "pending"


@pytest.mark.parametrize("wait", ["0", "-1", "30.001", "31", "abc", "nan", "inf", ""])
async def test_long_poll_refuses_a_wait_out_of_range(api: Api, queue: Queue, wait: str) -> None:
    task = await queue.submit("api_echo", {})
    resp = await api.client.get(task_path(task.task_id, wait))
    assert resp.status_code == 400, resp.text
    err = error_of(resp)
    assert err["code"] == "INVALID_REQUEST" and err["message"].startswith("query.wait: ")


async def test_long_poll_of_an_unknown_task_is_404_at_once(api: Api) -> None:
    for task_id in (MISSING_ID, "not-a-task-id"):
        resp = await asyncio.wait_for(api.client.get(task_path(task_id, 20)), 5)
        assert resp.status_code == 404, resp.text
        assert error_of(resp)["code"] == "TASK_NOT_FOUND"


async def test_long_poll_at_the_bound_is_accepted(api: Api, queue: Queue) -> None:
    task = await queue.submit("api_echo", {})
    await queue.cancel(task.task_id)
    resp = await api.client.get(task_path(task.task_id, "30"))
    assert resp.status_code == 200 and resp.json()["status"] == "cancelled"


async def waited(r: Redis, task_id: str) -> bool:
    """Whether a wait has started on the task (the wait script marks its hash)."""
    return await r.hget(keys.task(task_id), "waited") == "1"


async def test_a_long_poll_whose_client_leaves_stops_waiting(
    api: Api, queue: Queue, r: Redis
) -> None:
    """Driven at the ASGI level, where the client's leaving is a message the test sends."""
    task = await queue.submit("api_echo", {}, delay_seconds=60)
    leave = asyncio.Event()
    sent: list[dict[str, Any]] = []
    messages = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": f"/api/v1/tasks/{task.task_id}",
        "raw_path": f"/api/v1/tasks/{task.task_id}".encode(),
        "query_string": b"wait=25",
        "root_path": "",
        "headers": [(b"host", b"dtq.test")],
        "client": ("127.0.0.1", 50000),
        "server": ("dtq.test", 80),
    }
    call = asyncio.create_task(api.app(scope, receive, send))
    await wait_until(lambda: waited(r, task.task_id), 10, "the long poll waits")
    assert not call.done()
    leave.set()
    await asyncio.wait_for(call, 5)  # not the 25 s of its wait
    assert sent[0]["status"] == 499  # answered to nobody: the client closed the connection


def test_openapi_documents_the_wait_parameter(settings: Settings) -> None:
    from dtq.api import create_app

    op = create_app(api_settings(settings)).openapi()["paths"]["/api/v1/tasks/{task_id}"]["get"]
    [param] = [p for p in op["parameters"] if p["name"] == "wait"]
    assert param["in"] == "query" and not param.get("required", False)
    number = next(s for s in param["schema"]["anyOf"] if s.get("type") == "number")
    assert number["exclusiveMinimum"] == 0 and number["maximum"] == LONG_POLL_MAX_S
    assert "400" in op["responses"] and "404" in op["responses"]


# -- the event stream -----------------------------------------------------------------------------


def test_each_terminal_status_has_its_event() -> None:
    assert set(sse.TERMINAL_EVENT_OF) == TERMINAL
    assert set(sse.TERMINAL_EVENT_OF.values()) == TERMINAL_EVENTS


async def test_stream_carries_the_events_in_order_and_ends_at_the_terminal_one(
    server: ApiServer, queue: Queue, settings: Settings
) -> None:
    task = await queue.submit("api_echo", {"n": 1})
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=15) as client,
        client.stream("GET", events_path(task.task_id)) as resp,
    ):
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        # The response has started: the stream is subscribed. Now the task runs.
        async with running_worker(api_settings(settings)):
            events = await read_events(resp)
    assert [e["event"] for e in events] == ["TASK_STARTED", "TASK_SUCCEEDED"]
    for e in events:
        data = e["data"]
        assert e["id"] == data["event_id"] and e["event"] == data["type"]
        assert data["task_id"] == task.task_id and data["queue"] == "default"
    assert "already_terminal" not in events[-1]["data"].get("metadata", {})
    assert (await queue.get(task.task_id)).status == "succeeded"


async def test_stream_ends_when_the_task_is_cancelled_while_streaming(
    server: ApiServer, queue: Queue
) -> None:
    task = await queue.submit("api_echo", {}, queue="sseq", delay_seconds=60)
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=15) as client,
        client.stream("GET", events_path(task.task_id)) as resp,
    ):
        assert resp.status_code == 200
        await queue.cancel(task.task_id)
        events = await read_events(resp)
    assert [e["event"] for e in events] == ["TASK_CANCELLED"]
    assert events[0]["data"]["queue"] == "sseq"


async def test_stream_passes_every_event_type_on_progress_included(
    server: ApiServer, queue: Queue, r: Redis
) -> None:
    """An event type the stream does not know (as progress events are to it) is forwarded as
    it was published, in order with the others."""
    task = await queue.submit("api_echo", {}, queue="sseq", delay_seconds=60)
    progress = {
        "event_id": "e" * 32,
        "ts": "2026-12-02T05:00:00.000Z",
        "type": "TASK_PROGRESS",
        "task_id": task.task_id,
        "queue": "sseq",
        "task_type": "api_echo",
        "attempt": 1,
        "worker_id": "w-1",
        "metadata": {"progress": 0.5},
    }
    channel = keys.events("sseq")
    command = "SPUBLISH" if keys.sharded_events() else "PUBLISH"
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=15) as client,
        client.stream("GET", events_path(task.task_id)) as resp,
    ):
        assert resp.status_code == 200
        await r.execute_command(command, channel, json.dumps(progress))
        await queue.cancel(task.task_id)
        events = await read_events(resp)
    assert [e["event"] for e in events] == ["TASK_PROGRESS", "TASK_CANCELLED"]
    assert events[0]["data"] == progress and events[0]["id"] == progress["event_id"]


async def test_stream_of_a_task_already_ended_is_its_terminal_event(
    server: ApiServer, queue: Queue
) -> None:
    task = await queue.submit("api_echo", {})
    await queue.mark_expired(task.task_id)
    stored = await queue.get(task.task_id)
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=15) as client,
        client.stream("GET", events_path(task.task_id)) as resp,
    ):
        assert resp.status_code == 200
        events = await read_events(resp)
    [event] = events
    assert event["event"] == "TASK_EXPIRED" and event["id"] == event["data"]["event_id"]
    data = event["data"]
    assert data["task_id"] == task.task_id and data["task_type"] == "api_echo"
    assert data["metadata"] == {"already_terminal": True}
    assert stored.expired_at is not None
    assert data["ts"] == stored.expired_at.isoformat(timespec="milliseconds").replace("+00:00", "Z")


async def test_stream_gets_an_end_that_happens_right_after_its_read(
    server: ApiServer, queue: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The task is cancelled just after the stream read it (injected at the Queue seam, in
    the server's loop): the subscription made before the read has the published event."""
    task = await queue.submit("api_echo", {}, delay_seconds=60)
    served = server.app.state.dtq.q
    read = served.get

    async def read_then_cancel(task_id: str) -> Any:
        monkeypatch.setattr(served, "get", read)  # once
        seen = await read(task_id)
        await served.cancel(task_id)
        return seen

    monkeypatch.setattr(served, "get", read_then_cancel)
    monkeypatch.setattr(sse, "RECHECK_S", 30.0)  # a missed event would not end it in time
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=15) as client,
        client.stream("GET", events_path(task.task_id)) as resp,
    ):
        assert resp.status_code == 200
        events = await read_events(resp, within_s=10)
    assert [e["event"] for e in events] == ["TASK_CANCELLED"]
    if not keys.sharded_events():  # else the read made after following the queue has it
        assert "already_terminal" not in events[0]["data"].get("metadata", {})


async def test_stream_ends_on_a_terminal_state_whose_event_it_missed(
    server: ApiServer, queue: Queue, r: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A terminal event lost (here: none published, as when the hub was reconnecting) still
    ends the stream: the task is read again while nothing arrives."""
    monkeypatch.setattr(sse, "RECHECK_S", 0.2)
    task = await queue.submit("api_echo", {}, delay_seconds=60)
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=15) as client,
        client.stream("GET", events_path(task.task_id)) as resp,
    ):
        assert resp.status_code == 200
        await r.hset(keys.task(task.task_id), "status", "cancelled")
        events = await read_events(resp, within_s=10)
    assert [e["event"] for e in events] == ["TASK_CANCELLED"]
    assert events[0]["data"]["metadata"] == {"already_terminal": True}


async def test_an_idle_stream_gets_keep_alive_pings(
    server: ApiServer, queue: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sse, "PING_S", 0.2)
    task = await queue.submit("api_echo", {}, delay_seconds=60)
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=15) as client,
        client.stream("GET", events_path(task.task_id)) as resp,
    ):
        async with asyncio.timeout(10):
            lines = resp.aiter_lines()
            first = await anext(lines)
            while not first:
                first = await anext(lines)
    assert first.startswith(": ping")


async def test_stream_of_an_unknown_task_is_404_and_subscribes_nothing(
    server: ApiServer,
) -> None:
    hub = server.app.state.dtq.hub
    async with httpx.AsyncClient(base_url=server.url, timeout=15) as client:
        for task_id in (MISSING_ID, "not-a-task-id"):
            resp = await client.get(events_path(task_id))
            assert resp.status_code == 404, resp.text
            assert error_of(resp)["code"] == "TASK_NOT_FOUND"
    assert not hub.subscribers


async def test_stream_needs_no_key_like_every_read(settings: Settings, queue: Queue) -> None:
    task = await queue.submit("api_echo", {})
    await queue.cancel(task.task_id)
    async with (
        api_server(api_settings(settings, api_key=API_KEY)) as srv,
        httpx.AsyncClient(base_url=srv.url, timeout=15) as client,
        client.stream("GET", events_path(task.task_id)) as resp,
    ):
        assert resp.status_code == 200
        assert [e["event"] for e in await read_events(resp)] == ["TASK_CANCELLED"]


async def test_a_client_that_leaves_is_unsubscribed(server: ApiServer, queue: Queue) -> None:
    hub = server.app.state.dtq.hub
    task = await queue.submit("api_echo", {}, delay_seconds=60)
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=15) as client,
        client.stream("GET", events_path(task.task_id)) as resp,
    ):
        assert resp.status_code == 200
        assert len(hub.subscribers) == 1
    deadline = time.monotonic() + 10
    while hub.subscribers:
        assert time.monotonic() < deadline, "the stream's subscriber was not removed"
        await asyncio.sleep(0.02)


def test_openapi_documents_the_stream(settings: Settings) -> None:
    from dtq.api import create_app

    op = create_app(api_settings(settings)).openapi()["paths"]["/api/v1/tasks/{task_id}/events"]
    assert "text/event-stream" in op["get"]["responses"]["200"]["content"]
    assert "404" in op["get"]["responses"]


# -- the server stopping --------------------------------------------------------------------------


@pytest.fixture
def api_process(redis_url: str, backend: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``dtq api`` on a free port (the support.api task module registered), killed if a test
    leaves it running."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTQ_")}
    env.update(
        DTQ_REDIS_URL=redis_url,
        DTQ_TASK_MODULES="support.api",
        PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
    )
    if backend == "cluster":
        env["DTQ_REDIS_CLUSTER"] = "1"
    dtq = os.path.join(os.path.dirname(sys.executable), "dtq")
    proc = subprocess.Popen(
        [dtq, "api", "--host", "127.0.0.1", "--port", str(port)], env=env, stderr=subprocess.PIPE
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.slow
async def test_server_stop_ends_open_streams_and_long_polls_cleanly(
    api_process: tuple[subprocess.Popen[bytes], str], queue: Queue, r: Redis
) -> None:
    proc, base = api_process
    task = await queue.submit("api_echo", {}, delay_seconds=600)
    async with (
        httpx.AsyncClient(base_url=base, timeout=15) as client,
        client.stream("GET", events_path(task.task_id)) as resp,
    ):
        assert resp.status_code == 200
        poll = asyncio.create_task(client.get(task_path(task.task_id, LONG_POLL_MAX_S)))
        await wait_until(lambda: waited(r, task.task_id), 10, "the long poll waits")
        proc.send_signal(signal.SIGTERM)
        # The stream ends as a complete response (no transport error), with no event; the
        # long poll answers with the task as it is, well before its 30 s.
        assert await read_events(resp, within_s=10) == []
        answer = await asyncio.wait_for(poll, 10)
    assert answer.status_code == 200 and answer.json()["status"] == "pending"
    _, err = await asyncio.to_thread(proc.communicate, timeout=15)
    assert proc.returncode in (0, -signal.SIGTERM), err
    assert b"Traceback" not in err and b"Exception in ASGI application" not in err
    assert b"Application shutdown complete" in err
