"""Waiting over HTTP (docs/api.md): the server-sent events of one task,
``GET /api/v1/tasks/{task_id}/events``, and what a long poll (``GET /api/v1/tasks/{id}?wait=S``)
races its wait against: the client leaving and the server stopping.

The stream is fed by the process's :class:`dtq.api.ws.EventHub`, as ``/ws/events`` is, with a
subscriber filtered on the task id; it ends after the task's terminal event
(``dtq.events.TERMINAL_EVENTS``). The order of the steps is what makes a terminal event
impossible to miss:

1. subscribe (every event published from now on reaches the subscriber's buffer);
2. read the task: unknown is 404 before the stream starts; already terminal is one event
   made from the stored task (``metadata.already_terminal = true``), then the end;
3. otherwise forward the buffered events in order, each as ``id: <event_id>``,
   ``event: <type>``, ``data: <the event JSON>``, until the terminal one.

With sharded events (the cluster layout) the hub's subscription to the task's queue is
awaited after step 2, and the task is read once more. While nothing arrives the task is read
again every ``RECHECK_S``, so a terminal event lost while the hub was reconnecting to Redis
still ends the stream (with the event made from the stored task). Comment lines
(``: ping``) every ``PING_S`` keep proxies from closing an idle stream.

When the server stops (uvicorn's exit signal, which sse-starlette records in
``AppStatus.should_exit``), a stream ends cleanly within ``SHUTDOWN_GRACE_S`` and a long poll
answers with the task as it is, both well before uvicorn's graceful-shutdown timeout (5 s
under ``dtq api``), after which it would cancel them with an error; a client reconnecting to a
task that has ended gets its terminal event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import weakref
from collections.abc import AsyncIterator
from datetime import datetime

import anyio
from sse_starlette import EventSourceResponse, ServerSentEvent
from sse_starlette.sse import AppStatus
from starlette.background import BackgroundTask
from starlette.requests import Request

from dtq import keys
from dtq.api.ws import EventFilter, EventHub, Subscriber
from dtq.client import Queue
from dtq.errors import TaskNotFoundError
from dtq.events import TERMINAL_EVENTS, make_event
from dtq.models import TERMINAL, Task

__all__ = [
    "PING_S",
    "RECHECK_S",
    "SHUTDOWN_GRACE_S",
    "STOP_CHECK_S",
    "TERMINAL_EVENT_OF",
    "client_gone",
    "open_task_stream",
    "server_stopping",
    "terminal_event",
]

PING_S = 15.0
RECHECK_S = 15.0
SHUTDOWN_GRACE_S = 1.0
STOP_CHECK_S = 0.25

# The event a script publishes when it makes a task terminal, by the status it writes.
TERMINAL_EVENT_OF = {status: f"TASK_{status.value.upper()}" for status in TERMINAL}


def terminal_event(task: Task) -> str:
    """The JSON of the terminal event of a task that has ended, made from the stored task (the
    published one is gone); ``metadata.already_terminal`` says so."""
    ended: datetime | None = task.expired_at or task.finished_at or task.updated_at
    return make_event(
        TERMINAL_EVENT_OF[task.status],
        task_id=task.task_id,
        queue=task.queue,
        task_type=task.task_type,
        attempt=task.attempt,
        worker_id=task.worker_id,
        metadata={"already_terminal": True},
        ts_ms=None if ended is None else int(ended.timestamp() * 1000),
    )


async def open_task_stream(hub: EventHub, q: Queue, task_id: str) -> EventSourceResponse:
    """Subscribe, read the task (TaskNotFoundError: nothing subscribed stays), and answer with
    the stream; the subscriber is removed when the stream ends, however it ends."""
    sub = hub.add(EventFilter(task_ids=frozenset({task_id})))
    try:
        task = await q.get(task_id)
        if keys.sharded_events() and not task.is_terminal:
            sub.filter = EventFilter(queues=frozenset({task.queue}), task_ids=sub.filter.task_ids)
            await hub.follow(sub)
            task = await q.get(task_id)  # what happened before the queue's channel was followed
    except BaseException:
        hub.remove(sub)
        raise
    stop = anyio.Event()
    return EventSourceResponse(
        _events(hub, sub, q, task, stop),
        ping=PING_S,
        shutdown_event=stop,
        shutdown_grace_period=SHUTDOWN_GRACE_S,
        # Also when the stream never started (the client left at once): the generator's
        # own cleanup runs only once it has.
        background=BackgroundTask(_unsubscribe, hub, sub),
    )


async def _unsubscribe(hub: EventHub, sub: Subscriber) -> None:
    """Async, so that it runs on the event loop (the hub is not thread-safe)."""
    hub.remove(sub)


def _sse(raw: str) -> ServerSentEvent:
    event = json.loads(raw)
    return ServerSentEvent(data=raw, event=str(event["type"]), id=str(event["event_id"]))


async def _events(
    hub: EventHub, sub: Subscriber, q: Queue, task: Task, stop: anyio.Event
) -> AsyncIterator[ServerSentEvent]:
    watcher = asyncio.create_task(_wake_on(stop, sub))
    try:
        if task.is_terminal:
            yield _sse(terminal_event(task))
            return
        while not stop.is_set():
            if not await _arrival(sub, stop, RECHECK_S):
                if sub.overflowed or stop.is_set():
                    return  # the hub dropped this subscriber; the buffer is sent
                try:
                    task = await q.get(task.task_id)
                except TaskNotFoundError:
                    return  # its retention passed: there is nothing left to report
                if task.is_terminal:
                    yield _sse(terminal_event(task))
                    return
                continue
            raw = sub.pop()
            if raw is None:
                continue
            event = _sse(raw)
            yield event
            if event.event in TERMINAL_EVENTS:
                return
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        hub.remove(sub)


async def _wake_on(stop: anyio.Event, sub: Subscriber) -> None:
    await stop.wait()
    sub.wakeup.set()


async def _arrival(sub: Subscriber, stop: anyio.Event, within_s: float) -> bool:
    """True once the buffer holds an event; False after ``within_s`` without one, when the
    server stops, or when the subscriber overflowed and its buffer is empty."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(within_s):
            while not sub.buffer and not sub.overflowed and not stop.is_set():
                sub.wakeup.clear()
                await sub.wakeup.wait()
    return bool(sub.buffer)


async def client_gone(request: Request) -> None:
    """Returns when the client has closed the connection (a request without a body: every
    message but the disconnect is the empty body)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _StopSignal:
    """sse-starlette's ``AppStatus.should_exit`` (a flag its patch of uvicorn's exit handler
    sets) as something to await: one task of the event loop checks it every ``STOP_CHECK_S``
    while at least one request waits, however many do."""

    def __init__(self) -> None:
        self.stopped = asyncio.Event()
        self.waiters = 0
        self.poller: asyncio.Task[None] | None = None

    async def wait(self) -> None:
        self.waiters += 1
        if self.poller is None:
            self.poller = asyncio.create_task(self._poll(), name="dtq-api-stop-signal")
        try:
            await self.stopped.wait()
        finally:
            self.waiters -= 1
            if not self.waiters and self.poller is not None:
                self.poller.cancel()
                self.poller = None

    async def _poll(self) -> None:
        while not AppStatus.should_exit:  # noqa: ASYNC110 - a flag, set from a signal handler
            await asyncio.sleep(STOP_CHECK_S)
        self.stopped.set()


_stop_signals: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _StopSignal] = (
    weakref.WeakKeyDictionary()
)


async def server_stopping() -> None:
    """Returns once the server has been told to stop."""
    loop = asyncio.get_running_loop()
    signal = _stop_signals.get(loop)
    if signal is None:
        signal = _stop_signals[loop] = _StopSignal()
    await signal.wait()
