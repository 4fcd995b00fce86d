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
from dtq.config import Settings
from dtq.devserver import free_port
from dtq.events import TERMINAL_EVENTS
from dtq.models import TERMINAL
from support import running_worker
from support.api import API_KEY, ApiServer, api_server, api_settings, error_of
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
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, f"dtq api exited with {proc.returncode}"
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "dtq api did not answer within 20 s"
            time.sleep(0.05)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.slow
async def test_server_stop_ends_an_open_stream_cleanly(
    api_process: tuple[subprocess.Popen[bytes], str], queue: Queue
) -> None:
    proc, base = api_process
    task = await queue.submit("api_echo", {}, delay_seconds=600)
    async with (
        httpx.AsyncClient(base_url=base, timeout=15) as client,
        client.stream("GET", events_path(task.task_id)) as resp,
    ):
        assert resp.status_code == 200
        proc.send_signal(signal.SIGTERM)
        # The stream ends as a complete response (no transport error), with no event.
        assert await read_events(resp, within_s=10) == []
    _, err = await asyncio.to_thread(proc.communicate, timeout=15)
    assert proc.returncode in (0, -signal.SIGTERM), err
    assert b"Traceback" not in err and b"Application shutdown complete" in err
