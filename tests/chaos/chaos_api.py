"""Scenarios against the API process (uvicorn): a WebSocket client that stops reading while
events flow, and a flood of bad input. Same shape as the other scenario modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import time
from collections import Counter
from pathlib import Path

import httpx
import schemathesis
from chaos_checker import Report, iso_ms, percentile
from chaos_harness import Cluster, Scale, now_ns, running
from chaos_load import LoadGen, work_specs
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hyp_settings
from schemathesis import checks as st_checks
from schemathesis.config import SchemathesisConfig
from websockets.asyncio.client import ClientConnection, connect
from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.protocol import State
from websockets.uri import parse_uri

from support import wait_until

MB = 1 << 20
API_KEY = "chaos-key-0123456789"


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


# -- 9. a WebSocket client that never reads ------------------------------------------------


class SlowClient:
    """A WebSocket client on a plain socket with a tiny receive buffer that completes the
    handshake and then reads nothing until :meth:`drain`."""

    def __init__(self, url: str, port: int) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect(("127.0.0.1", port))
        self.sock.settimeout(10)
        self.proto = ClientProtocol(parse_uri(url), max_size=None)
        self.proto.send_request(self.proto.connect())
        for data in self.proto.data_to_send():
            self.sock.sendall(data)
        while self.proto.state is State.CONNECTING:
            self._read()
        assert self.proto.state is State.OPEN, self.proto.handshake_exc

    def _read(self) -> bool:
        data = self.sock.recv(1 << 16)
        if data:
            self.proto.receive_data(data)
        else:
            self.proto.receive_eof()
        return bool(data)

    def drain(self, within_s: float) -> tuple[int, int | None]:
        """Read what the server sent until it closes the connection: (events, close code)."""
        events = 0
        deadline = time.monotonic() + within_s
        self.sock.settimeout(1.0)  # the server has had its say when nothing came for 1 s
        while time.monotonic() < deadline:
            try:
                more = self._read()
            except TimeoutError:
                break
            for ev in self.proto.events_received():
                if isinstance(ev, Frame) and ev.opcode is Opcode.TEXT:
                    events += 1
            if not more or self.proto.state is State.CLOSED:
                break
        code = self.proto.close_rcvd.code if self.proto.close_rcvd is not None else None
        return events, code

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


async def _listen(ws: ClientConnection, lat_ms: list[float], stop: asyncio.Event) -> None:
    """Record each event's delay from its Redis timestamp to its arrival here."""
    while not stop.is_set():
        try:
            raw = await asyncio.wait_for(ws.recv(), 0.5)
        except TimeoutError:
            continue
        ev = json.loads(raw)
        lat_ms.append(now_ns() / 1e6 - iso_ms(ev["ts"]))


async def _phase(
    c: Cluster, clients: list[ClientConnection], n: int, start_seq: int, scale: Scale, rate: int
) -> list[float]:
    """``n`` tasks through the workers while every normal client listens; their latencies."""
    lat: list[list[float]] = [[] for _ in clients]
    stop = asyncio.Event()
    listeners = [asyncio.create_task(_listen(ws, lat[i], stop)) for i, ws in enumerate(clients)]
    try:
        load = LoadGen(concurrency=64)
        specs = work_specs(scale.rng(f"ws{start_seq}"), n, start_seq=start_seq, ms=1)
        await load.via_sdk(c.url, specs, rate=rate)

        async def all_heard() -> bool:
            return all(len(x) >= n for x in lat)

        await wait_until(all_heard, scale.pick(60, 300), "every client heard every task")
    finally:
        stop.set()
        await asyncio.gather(*listeners)
    return [v for x in lat for v in x]


async def ws_slow_client(root: Path, scale: Scale) -> list[Report]:
    """Normal WebSocket clients (filtered to TASK_SUCCEEDED) measure event latency at the same
    task rate without, then with a client that completed the handshake and never reads
    (unfiltered, with a tiny receive buffer). The API's memory grows by less than 50 MB; in the
    full run (10,000 tasks, 30,000 events, more than the sockets hold) the slow client is
    closed (1013 by dtq's slow-consumer policy, or 1011 by uvicorn's keepalive: it answers no
    ping)."""
    n_clients = scale.pick(10, 50)
    quiet, flood = scale.pick(400, 2000), scale.pick(400, 10_000)
    rate = scale.pick(200, 100)  # tasks/s: below what the API fans out to 50 clients
    rep = Report("WebSocket slow client")
    async with running(root, "ws_slow") as run:
        c = run.cluster
        workers = [c.spawn_worker("ws") for _ in range(4)]
        api = c.spawn_api()
        await asyncio.gather(c.wait_workers(workers), c.wait_api())
        url = f"ws://127.0.0.1:{c.api_port}/ws/events"
        async with contextlib.AsyncExitStack() as stack:
            clients = [
                await stack.enter_async_context(connect(f"{url}?type=TASK_SUCCEEDED"))
                for _ in range(n_clients)
            ]
            without = await _phase(c, clients, quiet, 0, scale, rate)
            rss_before = rss_bytes(api.pid)
            slow = SlowClient(url, c.api_port)
            try:
                with_slow = await _phase(c, clients, flood, quiet, scale, rate)
                rss_after = rss_bytes(api.pid)
                events, code = await asyncio.to_thread(slow.drain, 30)
            finally:
                slow.close()
        closed_line = "closed a slow WebSocket client" in api.output()
    p99_without, p99_with = percentile(without, 0.99), percentile(with_slow, 0.99)
    growth = rss_after - rss_before
    # Closed by dtq's slow-consumer policy (1013, and a log line), or earlier by uvicorn's
    # keepalive (1011: a client that reads nothing never answers a ping, 20 + 20 s).
    by = "dtq 1013" if code == 1013 and closed_line else "keepalive 1011" if code == 1011 else ""
    if scale.full:  # the reduced flood (about 1 MB of events) fits in the sockets' buffers
        rep.require(bool(by), f"slow client not closed (close code {code})")
    rep.require(growth < 50 * MB, f"API memory grew by {growth / MB:.1f} MB")
    rep.accepted = quiet + flood
    rep.p50_ms, rep.p99_ms = percentile(with_slow, 0.5), p99_with
    rep.notes.update(
        clients=n_clients,
        p99_ms_without_slow=round(p99_without, 1),
        p99_ratio=round(p99_with / p99_without, 2) if p99_without else math.nan,
        api_rss_growth_mb=round(growth / MB, 1),
        slow_client_got=events,
        slow_closed_by=by or "-",
    )
    return [rep]


# -- 10. a flood of bad input -----------------------------------------------------------------

MARKER = "INJECTED-LOG-LINE"
SCHEMA_GAP = "RejectedPositiveData"  # a schema-valid request refused by a business rule
# positive_data_acceptance: the answers that do not refuse a valid request. 410 is the
# contract's answer to a cancel of a task that has already finished (section 11): the request
# is valid, the task's state refuses it, like 404 and 409 already in schemathesis's defaults.
ACCEPTING_STATUSES = ["2xx", "3xx", "401", "403", "404", "409", "410", "429", "5xx"]


def _raw(port: int, head: bytes, body: bytes = b"", read_s: float = 5.0) -> tuple[int, float]:
    """Send raw bytes; (status of the first response or 0 if none, seconds to answer)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=read_s) as sock:
        sock.sendall(head + body)
        data = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while b"\r\n" not in data:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
    elapsed = time.monotonic() - t0
    parts = data.split(b" ", 2)
    return (int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0), elapsed


def _chunked_flood(port: int, total: int) -> int:
    """A chunked body (no Content-Length) far over the limit; the status the API answered."""
    head = (
        b"POST /api/v1/tasks HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    chunk = b'{"a":"' + b"x" * 65_000 + b'"}'
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        sent = 0
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            while sent < total:
                sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                sent += len(chunk)
        data = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while b"\r\n" not in data:
                more = sock.recv(4096)
                if not more:
                    break
                data += more
    parts = data.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def _hostile(port: int, max_payload: int) -> list[tuple[str, int, float]]:
    """(what, status, seconds) of each hand-made hostile request."""
    out: list[tuple[str, int, float]] = []

    def post(what: str, body: bytes, extra: bytes = b"", length: int | None = None) -> None:
        cl = len(body) if length is None else length
        head = (
            b"POST /api/v1/tasks HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + extra
            + f"Content-Length: {cl}\r\nConnection: close\r\n\r\n".encode()
        )
        status, secs = _raw(port, head, body)
        out.append((what, status, secs))

    depth = 50_000
    nested = b"[" * depth + b"]" * depth
    post("deep nesting", b'{"task_type":"chaos_work","payload":{"a":' + nested + b"}}")
    huge = {"task_type": "chaos_work", "payload": {"s": "x" * max_payload}}
    post("huge string", json.dumps(huge).encode())
    post("NaN", b'{"task_type":"chaos_work","payload":{"x":NaN}}')
    post("Infinity", b'{"task_type":"chaos_work","payload":{"x":-Infinity}}')
    post("CR/LF task_type", json.dumps({"task_type": f"t\r\n{MARKER} x"}).encode())
    post("ANSI task_type", json.dumps({"task_type": "t\x1b[31mred\x1b[0m"}).encode())
    post("CR/LF queue", json.dumps({"task_type": "chaos_work", "queue": f"q\n{MARKER}"}).encode())
    post("invalid UTF-8", b'{"task_type":"\xff\xfe\xc3\x28"}')
    post("not JSON", b"\x00\x01\x02 garbage")
    post("true oversize Content-Length", b"", length=64 * MB)
    post("lying Content-Length (short)", b'{"task_type":"chaos_work"}' + b" " * 100_000, length=10)
    for path in (f"/api/v1/tasks/x%0d%0a{MARKER}", f"/api/v1/tasks/%1b[31m{MARKER}/history"):
        request = f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        status, secs = _raw(port, request.encode())
        out.append((f"GET {path[:24]}", status, secs))
    status, secs = _raw(
        port,
        b"GET /api/v1/tasks HTTP/1.1\r\nHost: x\r\nX-Request-ID: "
        + f"{MARKER}\x1b[2J".encode()
        + b"\r\nConnection: close\r\n\r\n",
    )
    out.append(("ANSI X-Request-ID", status, secs))
    t0 = time.monotonic()
    out.append(("chunked, no Content-Length", _chunked_flood(port, 8 * MB), time.monotonic() - t0))
    return out


def _schemathesis(base: str, examples: int, headers: dict[str, str]) -> tuple[list[str], list[str]]:
    """Every operation of the live API's schema with every schemathesis check: (failures, schema
    gaps). A gap is a schema-valid request that a business rule refused (reported, not a
    failure: the schema does not state every rule)."""
    st_checks.load_all_checks()
    all_checks = st_checks.CHECKS.get_all()
    config = SchemathesisConfig.from_dict(
        {"checks": {"positive_data_acceptance": {"expected-statuses": ACCEPTING_STATUSES}}}
    )
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json", config=config)
    failures: list[str] = []
    gaps: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @hyp_settings(
            max_examples=examples,
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        def exercise(case: schemathesis.Case) -> None:
            case.call_and_validate(checks=all_checks, headers=headers)

        try:
            exercise()
        except (Exception, BaseExceptionGroup) as exc:
            found = list(exc.exceptions) if isinstance(exc, BaseExceptionGroup) else [exc]
            names = {type(e).__name__ for e in found}
            label = f"{operation.method.upper()} {operation.path}"
            if names == {SCHEMA_GAP}:
                gaps.append(label)
            else:
                failures.append(f"{label}: {sorted(names)}: {str(exc)[:400]}")
    return failures, gaps


async def bad_input(root: Path, scale: Scale) -> list[Report]:
    """schemathesis with every check, with and without the API key, then hand-made hostile
    requests: no answer >= 500, 413 before the body is read, no raw CR/LF/ESC from input in
    any log line, the API's memory bounded."""
    rep = Report("bad input flood")
    examples = scale.pick(5, 50)
    async with running(root, "bad_input") as run:
        c = run.cluster
        api = c.spawn_api({"DTQ_API_KEY": API_KEY})
        await c.wait_api()
        rss_before = rss_bytes(api.pid)
        failures, gaps = [], []
        for headers in ({"X-API-Key": API_KEY}, {}):
            f, g = await asyncio.to_thread(_schemathesis, c.api_base, examples, headers)
            failures += f
            gaps += g
        max_payload = int(c.settings.get("MAX_PAYLOAD_BYTES", "262144"))
        hostile = await asyncio.to_thread(_hostile, c.api_port, max_payload)
        async with httpx.AsyncClient(base_url=c.api_base, timeout=10) as client:
            assert (await client.get("/health")).status_code == 200, "the API survived"
        rss_after = rss_bytes(api.pid)
        log = api.output()
    statuses = Counter(status for _, status, _ in hostile)
    rep.require_zero("schemathesis failures", failures)
    rep.require_zero("answers >= 500", [f"{w}: {s}" for w, s, _ in hostile if s >= 500])
    rep.require_zero("requests without an answer", [w for w, s, _ in hostile if s == 0])
    oversize = {w: s for w, s, _ in hostile if "oversize" in w or "chunked" in w}
    rep.require(all(s == 413 for s in oversize.values()), f"oversize bodies got {oversize}")
    injected = [
        ln for ln in log.splitlines() if ln.startswith(MARKER) or "\x1b" in ln or "\r" in ln
    ]
    rep.require_zero("log lines with raw CR/LF/ESC from input", injected)
    growth = rss_after - rss_before
    rep.require(growth < 50 * MB, f"API memory grew by {growth / MB:.1f} MB")
    validation = [s for w, st, s in hostile if st in (400, 404) and "chunked" not in w]
    rep.notes.update(
        hostile_requests=len(hostile),
        answers="/".join(f"{k}:{v}" for k, v in sorted(statuses.items())),
        worst_validation_ms=round(1000 * max(validation), 1),
        schema_gaps=len(gaps),
        schema_gap_ops=",".join(sorted(set(gaps))),
        api_rss_growth_mb=round(growth / MB, 1),
        schemathesis_examples_per_op=examples,
    )
    return [rep]
