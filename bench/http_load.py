"""A minimal HTTP/1.1 keep-alive load generator on asyncio streams.

Lighter than any HTTP client library, so on a 2-core machine the server, not the client, is
what is measured. Each of ``concurrency`` connections sends one request, reads the whole
response (Content-Length framing), and sends the next, until the deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["LoadResult", "post_load", "wait_ready"]


@dataclass
class LoadResult:
    requests: int = 0
    elapsed_s: float = 0.0
    statuses: Counter[int] = field(default_factory=Counter)
    sample_body: bytes = b""

    @property
    def rate(self) -> float:
        return self.requests / self.elapsed_s if self.elapsed_s else 0.0


def _request(host: str, port: int, path: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    body = await reader.readexactly(length) if length else b""
    return status, body


async def post_load(
    host: str, port: int, path: str, body: bytes, *, concurrency: int, duration_s: float
) -> LoadResult:
    """POST ``body`` to ``path`` from ``concurrency`` keep-alive connections for ``duration_s``."""
    request = _request(host, port, path, body)
    result = LoadResult()
    conns = [await asyncio.open_connection(host, port) for _ in range(concurrency)]
    deadline = 0.0

    async def loop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while time.perf_counter() < deadline:
            writer.write(request)
            status, resp = await _read_response(reader)
            result.requests += 1
            result.statuses[status] += 1
            if not result.sample_body or status >= 300:
                result.sample_body = resp[:300]

    start = time.perf_counter()
    deadline = start + duration_s
    try:
        await asyncio.gather(*(loop(r, w) for r, w in conns))
    finally:
        result.elapsed_s = time.perf_counter() - start
        for _, w in conns:
            w.close()
    return result


async def wait_ready(host: str, port: int, path: str, body: bytes, timeout_s: float) -> int:
    """Wait until ``path`` answers a POST; returns its status."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {host}:{port}") from None
            await asyncio.sleep(0.1)
            continue
        try:
            writer.write(_request(host, port, path, body))
            status, _ = await _read_response(reader)
            return status
        finally:
            writer.close()
