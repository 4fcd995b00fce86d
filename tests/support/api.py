"""API helpers: the API tests' task types (this module is their task module) and settings,
the app with its lifespan running and a client on it, and the shape every error has.

The API is driven through its ASGI app (httpx.AsyncClient + ASGITransport) with the app's
lifespan running, against the real redis-server of tests/conftest.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel, Field
from websockets.asyncio.client import ClientConnection

from dtq.api import create_app
from dtq.config import Settings
from dtq.devserver import free_port
from dtq_tasks import PermanentError, TaskContext, task

API_KEY = "s3cret-test-key"
MODULE = __name__


class TypedPayload(BaseModel):
    n: int = Field(ge=0)


@task("api_echo")
async def api_echo(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    return payload


@task("api_typed", payload_model=TypedPayload)
async def api_typed(payload: dict[str, Any], ctx: TaskContext) -> int:
    return int(payload["n"]) * 2


@task("api_fail")
async def api_fail(payload: dict[str, Any], ctx: TaskContext) -> None:
    raise PermanentError(str(payload.get("why", "boom")))


@task("api_sleep")
async def api_sleep(payload: dict[str, Any], ctx: TaskContext) -> None:
    await asyncio.sleep(float(payload.get("s", 30)))


def api_settings(settings: Settings, **overrides: Any) -> Settings:
    """The test settings with this module as the task module (its types are registered), and
    the worker's intervals shrunk."""
    fast = {
        "task_modules": MODULE,
        "heartbeat_interval_s": 0.5,
        "visibility_timeout_s": 5,
        "drain_timeout_s": 2,
        "scheduler_interval_s": 0.1,
    }
    return settings.model_copy(update={**fast, **overrides})


class Api:
    """An app with its lifespan running and an HTTP client on it."""

    def __init__(self, app: FastAPI, client: httpx.AsyncClient) -> None:
        self.app = app
        self.client = client

    async def submit(self, status: int = 202, **body: Any) -> dict[str, Any]:
        body.setdefault("task_type", "api_echo")
        body.setdefault("payload", {})
        resp = await self.client.post("/api/v1/tasks", json=body)
        assert resp.status_code == status, resp.text
        data: dict[str, Any] = resp.json()
        return data


@contextlib.asynccontextmanager
async def running_api(settings: Settings) -> AsyncIterator[Api]:
    """The app built from ``settings``, its lifespan running, with a client on it."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://dtq.test") as client:
            yield Api(app, client)


def error_of(resp: httpx.Response) -> dict[str, Any]:
    """The error object of an error response, checking the one shape every error has."""
    body = resp.json()
    assert set(body) == {"error"}, body
    err: dict[str, Any] = body["error"]
    assert set(err) == {"code", "message", "details"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["details"], dict)
    assert resp.headers.get("x-request-id"), "every response carries X-Request-ID"
    return err


class ApiServer:
    """uvicorn serving the dtq app on 127.0.0.1 in a thread of its own (its own event loop)."""

    def __init__(self, settings: Settings, port: int | None = None) -> None:
        self.app = create_app(settings)
        self.port = port or free_port()
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-dash", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            assert self.thread.is_alive(), "uvicorn exited at start"
            assert time.monotonic() < deadline, "uvicorn did not start within 15 s"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        assert not self.thread.is_alive(), "uvicorn did not stop"


@contextlib.asynccontextmanager
async def api_server(settings: Settings, port: int | None = None) -> AsyncIterator[ApiServer]:
    """A started :class:`ApiServer`, always stopped (start and stop off the event loop)."""
    server = ApiServer(settings, port)
    await asyncio.to_thread(server.start)
    try:
        yield server
    finally:
        await asyncio.to_thread(server.stop)


async def recv_until(
    ws: ClientConnection, done: Callable[[list[dict[str, Any]]], bool], within_s: float = 15.0
) -> list[dict[str, Any]]:
    """The events a WebSocket client receives until ``done`` says they are enough (a deadline,
    never a bare wait)."""
    events: list[dict[str, Any]] = []
    async with asyncio.timeout(within_s):
        while not done(events):
            events.append(json.loads(await ws.recv()))
    return events


def wait_healthy(proc: subprocess.Popen[bytes], base: str, timeout_s: float = 20) -> None:
    """Wait until an API process at ``base`` answers ``/health`` with 200 (it must not exit)."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"the API exited with {proc.returncode}"
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"the API did not answer within {timeout_s:g} s"
        time.sleep(0.05)
