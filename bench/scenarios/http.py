"""HTTP enqueue: ``POST /api/v1/tasks`` from 32 concurrent keep-alive clients against one uvicorn
process, beside a no-op POST route of the same app in the same process as its ceiling.

The ceiling is measured before and after the submit run and averaged, so drift on a shared
machine shows in both.
"""

from __future__ import annotations

import json

from bench.harness import NOOP_TASK, PAYLOAD_100B, Env, Result
from bench.http_app import NOOP_PATH
from bench.http_load import LoadResult, post_load, wait_ready
from dtq.devserver import free_port

HOST = "127.0.0.1"
SUBMIT_PATH = "/api/v1/tasks"
CLIENTS = 32


def _ok(res: LoadResult) -> int:
    return sum(n for status, n in res.statuses.items() if 200 <= status < 300)


def _bad(res: LoadResult) -> str:
    bad = {s: n for s, n in res.statuses.items() if not 200 <= s < 300}
    return f"non-2xx {bad}: {res.sample_body[:200]!r}" if bad else ""


async def run(env: Env) -> list[Result]:
    await env.flush()
    port = free_port()
    server = env.spawn(
        "uvicorn",
        ["-m", "uvicorn", "bench.http_app:create", "--factory", "--host", HOST,
         "--port", str(port), "--log-level", "warning", "--no-access-log"],
    )  # fmt: skip
    body = json.dumps({"task_type": NOOP_TASK, "payload": PAYLOAD_100B}).encode()
    duration = 0.3 if env.quick else 4.0
    warm = 0.1 if env.quick else 0.3
    try:
        try:
            await wait_ready(HOST, port, NOOP_PATH, body, timeout_s=30)
        except TimeoutError:
            return [Result("enqueue.http_noop", status="error", note=server.tail(400))]
        await post_load(HOST, port, NOOP_PATH, body, concurrency=CLIENTS, duration_s=warm)
        noop1 = await post_load(
            HOST, port, NOOP_PATH, body, concurrency=CLIENTS, duration_s=duration
        )
        await post_load(HOST, port, SUBMIT_PATH, body, concurrency=CLIENTS, duration_s=warm)
        sub = await post_load(
            HOST, port, SUBMIT_PATH, body, concurrency=CLIENTS, duration_s=duration
        )
        noop2 = await post_load(
            HOST, port, NOOP_PATH, body, concurrency=CLIENTS, duration_s=duration
        )
    finally:
        server.stop()
        await env.flush()
    ceiling = (noop1.rate + noop2.rate) / 2
    out = [
        Result(
            "enqueue.http_noop",
            status="ok" if not _bad(noop1) else "error",
            figure="rate",
            unit="req/s",
            values={"rate": ceiling, "first": noop1.rate, "second": noop2.rate},
            note=_bad(noop1)
            or f"ceiling: no-op POST route of the same app, {CLIENTS} keep-alive clients, "
            "one uvicorn process, measured before and after the submit run",
        )
    ]
    rate = _ok(sub) / sub.elapsed_s
    xadd = env.baseline.get("xadd")
    out.append(
        Result(
            "enqueue.http_submit",
            status="ok" if not _bad(sub) else "error",
            figure="rate",
            unit="tasks/s",
            values={"rate": rate, "requests": sub.requests},
            ratios={"noop_endpoint": rate / ceiling, **({"xadd": rate / xadd} if xadd else {})},
            target=">= 50% of the no-op endpoint",
            met=rate >= 0.5 * ceiling,
            note=_bad(sub) or f"POST {SUBMIT_PATH}, {CLIENTS} keep-alive clients",
        )
    )
    return out
