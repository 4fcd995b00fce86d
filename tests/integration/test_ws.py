"""WebSocket events against a real uvicorn server (in a thread, on 127.0.0.1) with real
WebSocket clients: a task's lifecycle events in order (driven by the SDK and a real worker),
filters, and the slow-client policy (terminal events kept, non-terminal dropped first, the
client closed with 1013 past the cap, server memory bounded)."""

from __future__ import annotations

import contextlib
import itertools
import json
import socket
import time
import tracemalloc
from collections.abc import Callable, Iterable, Iterator

import pytest
import redis as sync_redis
from websockets.asyncio.client import connect
from websockets.client import ClientProtocol
from websockets.exceptions import ConnectionClosed
from websockets.frames import Frame, Opcode
from websockets.protocol import State
from websockets.uri import parse_uri

from dtq import Queue, keys
from dtq.api.deps import ApiState
from dtq.api.ws import BUFFER_SIZE, EventHub
from dtq.config import Settings
from support import running_worker
from support.api import ApiServer, api_settings, recv_until

MB = 1024 * 1024


class Server(ApiServer):
    """The dtq app under uvicorn (:class:`support.api.ApiServer`), with its event hub and the
    WebSocket URL at hand."""

    @property
    def hub(self) -> EventHub:
        state: ApiState = self.app.state.dtq
        assert state.hub is not None
        return state.hub

    def ws_url(self, query: str = "") -> str:
        return f"ws://127.0.0.1:{self.port}/ws/events{query}"


@pytest.fixture
def server(settings: Settings) -> Iterator[Server]:
    srv = Server(api_settings(settings))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def wait_for(predicate: Callable[[], bool], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {within_s} s")
        time.sleep(0.01)


# -- lifecycle ------------------------------------------------------------------------------------


@pytest.mark.backends("single", "cluster")
async def test_lifecycle_events_in_order(server: Server, queue: Queue) -> None:
    async with (
        connect(server.ws_url("?queue=wsq")) as every,
        connect(server.ws_url("?type=TASK_CANCELLED,TASK_EXPIRED&queue=wsq")) as ends,
    ):
        a = await queue.submit("api_echo", {"n": 1}, queue="wsq")
        await queue.cancel(a.task_id)
        b = await queue.submit("api_echo", {"n": 2}, queue="wsq")
        await queue.mark_expired(b.task_id)
        c = await queue.submit("api_echo", {"n": 3}, queue="wsq", delay_seconds=60)
        await queue.cancel(c.task_id)
        async with running_worker(api_settings(queue.settings), queues=("wsq",)):
            d = await queue.submit("api_echo", {"n": 4}, queue="wsq")
            seen = await recv_until(
                every, lambda evs: any(e["type"] == "TASK_SUCCEEDED" for e in evs)
            )

        got = [(e["task_id"], e["type"]) for e in seen]
        assert got == [
            (a.task_id, "TASK_QUEUED"),
            (a.task_id, "TASK_CANCELLED"),
            (b.task_id, "TASK_QUEUED"),
            (b.task_id, "TASK_EXPIRED"),
            (c.task_id, "TASK_QUEUED"),
            (c.task_id, "TASK_CANCELLED"),
            (d.task_id, "TASK_QUEUED"),
            (d.task_id, "TASK_STARTED"),
            (d.task_id, "TASK_SUCCEEDED"),
        ]
        assert seen[4]["metadata"]["status"] == "pending", "a delayed task is queued as pending"
        started = seen[7]
        assert started["attempt"] == 1 and started["worker_id"].startswith("worker-")
        for e in seen:
            assert {"event_id", "ts", "type", "task_id", "queue", "task_type", "attempt"} <= set(e)
            assert e["queue"] == "wsq" and e["task_type"] == "api_echo"

        filtered = await recv_until(ends, lambda evs: len(evs) == 3)
        assert [(e["task_id"], e["type"]) for e in filtered] == [
            (a.task_id, "TASK_CANCELLED"),
            (b.task_id, "TASK_EXPIRED"),
            (c.task_id, "TASK_CANCELLED"),
        ]


@pytest.mark.backends("single", "cluster")
async def test_task_id_filter_and_a_bad_filter(server: Server, queue: Queue) -> None:
    other = await queue.submit("api_echo", {}, queue="wsq")
    target = await queue.submit("api_echo", {}, queue="wsq")
    async with connect(server.ws_url(f"?task_id={target.task_id}")) as ws:
        await queue.cancel(other.task_id)
        await queue.cancel(target.task_id)
        events = await recv_until(ws, lambda evs: len(evs) == 1)
        assert [(e["task_id"], e["type"]) for e in events] == [(target.task_id, "TASK_CANCELLED")]

    async with connect(server.ws_url(), additional_headers={"X-Request-ID": "ws-1"}) as plain:
        assert plain.response is not None
        assert plain.response.headers["X-Request-ID"] == "ws-1"

    async with connect(server.ws_url("?type=TASK_QUEUED,NOPE")) as bad:
        with pytest.raises(ConnectionClosed) as closed:
            await bad.recv()
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 1008
    assert "NOPE" in closed.value.rcvd.reason


# -- the slow-client policy ------------------------------------------------------------------------


class RawClient:
    """A WebSocket client on a plain socket with a tiny receive buffer, which reads only when
    told to: the slow consumer."""

    def __init__(self, url: str, port: int) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect(("127.0.0.1", port))
        self.sock.settimeout(10)
        self.proto = ClientProtocol(parse_uri(url), max_size=None)
        self.proto.send_request(self.proto.connect())
        self._flush()
        self.pending: list[Frame] = []
        while self.proto.state is State.CONNECTING:
            self._read()
        assert self.proto.state is State.OPEN, self.proto.handshake_exc

    def _flush(self) -> None:
        for data in self.proto.data_to_send():
            if data:
                self.sock.sendall(data)

    def _read(self) -> bool:
        data = self.sock.recv(1 << 16)
        if data:
            self.proto.receive_data(data)
        else:
            self.proto.receive_eof()
        self.pending.extend(e for e in self.proto.events_received() if isinstance(e, Frame))
        return bool(data)

    def read_until(
        self, done: Callable[[list[tuple[str, str]]], bool], within_s: float = 15.0
    ) -> list[tuple[str, str]]:
        """(type, task_id) of each event read, until ``done`` or the connection closes."""
        got: list[tuple[str, str]] = []
        deadline = time.monotonic() + within_s
        while True:
            for frame in self.pending:
                if frame.opcode is Opcode.TEXT:
                    ev = json.loads(frame.data)
                    got.append((ev["type"], ev["task_id"]))
            self.pending.clear()
            if done(got) or self.proto.close_rcvd is not None:
                return got
            assert time.monotonic() < deadline, f"read {len(got)} events, then nothing"
            if not self._read():
                return got

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def event(etype: str, task_id: str, pad: int = 1000) -> str:
    return json.dumps(
        {
            "event_id": task_id,
            "ts": "2026-01-01T00:00:00.000Z",
            "type": etype,
            "task_id": task_id,
            "queue": "slow",
            "task_type": "api_echo",
            "attempt": 1,
            "worker_id": None,
            "metadata": {"pad": "x" * pad},
        }
    )


def publish(
    r: sync_redis.Redis,
    hub: EventHub,
    events: Iterable[str],
    batch: int = 200,
    stop: Callable[[], bool] = lambda: False,
) -> int:
    """Publish with flow control (Redis never holds much for the hub's subscription), built
    lazily so the test itself holds one batch at a time; returns how many were published."""
    sent = 0
    it = iter(events)
    while chunk := list(itertools.islice(it, batch)):
        target = hub.stats.events + len(chunk)
        pipe = r.pipeline(transaction=False)
        for raw in chunk:
            pipe.publish(keys.EVENTS, raw)
        pipe.execute()
        sent += len(chunk)
        wait_for(lambda t=target: hub.stats.events >= t)
        if stop():
            break
    return sent


def test_slow_client_keeps_terminal_events_then_is_closed(server: Server, redis_url: str) -> None:
    hub = server.hub
    client = RawClient(server.ws_url("?queue=slow"), server.port)
    r = sync_redis.Redis.from_url(redis_url)
    try:
        assert hub.stats.clients == 1
        (sub,) = hub.subscribers
        # Phase 1: the client reads nothing while non-terminal events of ~1 KB arrive, until
        # well over its buffer and what the sockets hold have been dropped (about 12 MB here),
        # then 200 terminal ones.
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            flood = publish(
                r,
                hub,
                (event("TASK_STARTED", f"n-{i}") for i in range(100_000)),
                stop=lambda: sub.dropped >= 8_000,
            )
            publish(r, hub, (event("TASK_SUCCEEDED", f"t-{i}") for i in range(200)))
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        assert len(sub.buffer) == BUFFER_SIZE and hub.stats.max_buffered == BUFFER_SIZE
        dropped = sub.dropped
        assert dropped >= 8_000, "most of the flood was dropped, not held"
        assert peak < 6 * MB, f"server memory grew by {peak} bytes for a client that stopped"

        # It reads again: every terminal event is there, in order; most others were dropped.
        got = client.read_until(lambda evs: ("TASK_SUCCEEDED", "t-199") in evs)
        terminal = [tid for etype, tid in got if etype == "TASK_SUCCEEDED"]
        assert terminal == [f"t-{i}" for i in range(200)]
        # Each non-terminal event was either delivered or dropped (counted), none held back.
        assert sum(1 for etype, _ in got if etype == "TASK_STARTED") + dropped == flood
        assert client.proto.close_rcvd is None, "still connected"

        # Phase 2: it stops again while terminal events keep coming: past the cap it is
        # disconnected, after it gets the terminal events its buffer holds.
        total = 100_000
        publish(
            r,
            hub,
            (event("TASK_FAILED", f"f-{i}") for i in range(total)),
            batch=100,
            stop=lambda: hub.stats.disconnected_slow > 0,
        )
        assert hub.stats.disconnected_slow == 1
        got = client.read_until(lambda evs: False)
        assert client.proto.close_rcvd is not None, "closed with a close frame"
        assert client.proto.close_rcvd.code == 1013
        assert "slow consumer" in client.proto.close_rcvd.reason
        ids = [tid for etype, tid in got]
        assert all(etype == "TASK_FAILED" for etype, _ in got)
        assert ids == [f"f-{i}" for i in range(len(ids))], "a gap-free prefix, in order"
        assert BUFFER_SIZE <= len(ids) < total
        wait_for(lambda: hub.stats.clients == 0)
        # Events after the disconnect are not buffered anywhere for it.
        publish(r, hub, [event("TASK_FAILED", "after")])
        assert not hub.subscribers
    finally:
        client.close()
        r.close()
