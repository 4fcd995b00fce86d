"""Metrics (contract section 9, docs/operations.md): every family with its type, label
discipline after a real workload, the values the workload must produce, the Redis gauges read
at scrape time, and the worker's own endpoint (one per process with ``--processes``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from redis.asyncio import Redis

from dtq import connect, keys
from dtq.api import create_app
from dtq.config import Settings
from dtq.devserver import free_port
from dtq.metrics import LABEL_NAMES, OTHER, Metrics, MetricsServer
from dtq.worker import Worker
from dtq.worker.telemetry import WorkerTelemetry
from dtq_tasks import RetryableError, TaskContext, registry, task
from support import started, wait_until

REPO = Path(__file__).resolve().parents[2]
MODULE = __name__
MARKER = "PAYLOAD-MARKER-5f3a"
EXC_MARKER = "EXCEPTION-TEXT-9c1d"
API_KEY = "metrics-test-key-77"
TASK_ID_RE = re.compile(r"[0-9a-f]{32}")

# Every metric of contract section 9 and the expiration metrics (docs/expiration.md), with its
# type (the exposition's name: a counter's family is named without ``_total``).
CONTRACT_METRICS = {
    "dtq_tasks_submitted": "counter",
    "dtq_tasks_started": "counter",
    "dtq_tasks_succeeded": "counter",
    "dtq_tasks_failed": "counter",
    "dtq_tasks_retried": "counter",
    "dtq_tasks_dead_lettered": "counter",
    "dtq_tasks_completed": "counter",
    "dtq_task_attempts": "counter",
    "dtq_queue_depth": "gauge",
    "dtq_queue_pending": "gauge",
    "dtq_retry_scheduled": "gauge",
    "dtq_dlq_depth": "gauge",
    "dtq_workers_active": "gauge",
    "dtq_worker_inflight": "gauge",
    "dtq_worker_tasks": "counter",
    "dtq_task_duration_seconds": "histogram",
    "dtq_task_execution_seconds": "histogram",
    "dtq_task_wait_seconds": "histogram",
    "dtq_retry_delay_seconds": "histogram",
    "dtq_redis_operations": "counter",
    "dtq_ingest_rejected": "counter",
    "dtq_tasks_expired": "counter",
    "dtq_task_ttl_seconds": "histogram",
    "dtq_tasks_near_expiration": "gauge",
}
CONTRACT_LABELS = {
    "dtq_tasks_completed": {"queue", "task_type", "status"},
    "dtq_task_attempts": {"queue", "task_type", "result"},
    "dtq_queue_depth": {"queue"},
    "dtq_queue_pending": {"queue"},
    "dtq_tasks_near_expiration": {"queue"},
    "dtq_retry_scheduled": set(),
    "dtq_dlq_depth": set(),
    "dtq_workers_active": set(),
    "dtq_worker_inflight": {"worker_id"},
    "dtq_worker_tasks": {"worker_id", "task_type", "result"},
    "dtq_redis_operations": {"operation", "result"},
    "dtq_ingest_rejected": {"queue", "reason"},
}


# -- task types of this module (the API loads it as its task module) ---------------------------


@task("m_ok")
async def m_ok(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    return {"echo": payload}


@task("m_flaky")
async def m_flaky(payload: dict[str, Any], ctx: TaskContext) -> int:
    if ctx.attempt == 1:
        raise RetryableError(f"{EXC_MARKER}: first attempt fails with {payload}")
    return ctx.attempt


@task("m_fail")
async def m_fail(payload: dict[str, Any], ctx: TaskContext) -> None:
    raise RetryableError(f"{EXC_MARKER} {payload}\nwith a second line")


@task("m_slow")
async def m_slow(payload: dict[str, Any], ctx: TaskContext) -> None:
    await asyncio.sleep(5)


TYPES = ("m_ok", "m_flaky", "m_fail", "m_slow")


def fast(settings: Settings, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "task_modules": MODULE,
        "heartbeat_interval_s": 1.0,  # stale after 3 s: a loaded machine still counts it alive
        "visibility_timeout_s": 3,
        "reaper_interval_s": 0.5,
        "scheduler_interval_s": 0.05,
        "drain_timeout_s": 2,
        "retry_base_delay": 0.05,
        "retry_max_delay": 0.2,
        "max_payload_bytes": 4096,
        "api_key": API_KEY,
    }
    return settings.model_copy(update={**values, **overrides})


# -- helpers -----------------------------------------------------------------------------------


class Scrape:
    """A parsed ``/metrics`` text."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}

    def samples(self, name: str) -> list[Sample]:
        return [s for f in self.families.values() for s in f.samples if s.name == name]

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels`` (0 when none)."""
        return sum(
            s.value
            for s in self.samples(name)
            if all(s.labels.get(k) == v for k, v in labels.items())
        )


def check_labels(scrape: Scrape, forbidden: Iterable[str]) -> None:
    """Label names only as the contract allows; no value that is a task id, a payload or an
    exception text."""
    for family in scrape.families.values():
        for sample in family.samples:
            allowed = LABEL_NAMES | ({"le"} if sample.name.endswith("_bucket") else set())
            bad = set(sample.labels) - allowed
            if family.name.startswith("dtq_") or sample.labels:
                assert not bad, f"{sample.name} has label(s) {bad}"
            for name, value in sample.labels.items():
                assert not TASK_ID_RE.search(value), f"{sample.name}{{{name}={value!r}}}"
                for text in forbidden:
                    assert text not in value, f"{sample.name}{{{name}={value!r}}}"
                assert "\n" not in value and len(value) <= 128, f"{sample.name} {name}={value!r}"


def check_contract_families(*scrapes: Scrape) -> None:
    found: dict[str, str] = {}
    for s in scrapes:
        found.update({name: f.type for name, f in s.families.items()})
    for name, mtype in CONTRACT_METRICS.items():
        assert name in found, f"{name} missing from the scrapes"
        assert found[name] == mtype, f"{name} is a {found[name]}, not a {mtype}"
    for name, labels in CONTRACT_LABELS.items():
        for s in scrapes:
            for sample in s.families[name].samples if name in s.families else []:
                if sample.name.endswith("_created"):
                    continue
                assert set(sample.labels) == labels, (sample.name, sample.labels)


@contextlib.asynccontextmanager
async def running_stack(settings: Settings) -> AsyncIterator[tuple[httpx.AsyncClient, str, Any]]:
    """The API (ASGI, lifespan running) and a real worker in this event loop whose telemetry
    serves /metrics on 127.0.0.1; yields (API client, worker metrics URL, worker)."""
    app = create_app(settings)
    handlers = {n: h for n, h in registry().items() if n in TYPES}
    telemetry = WorkerTelemetry(handlers)
    worker = Worker(
        settings,
        queues=("default",),
        concurrency=4,
        handlers=handlers,
        worker_id="worker-metrics1",
        observers=telemetry.observers("worker-metrics1"),
        on_redis_op=telemetry.metrics.script_call,
    )
    telemetry.watch(worker)
    server = MetricsServer(telemetry.metrics.registry, "127.0.0.1", 0)
    try:
        async with started(worker), app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://dtq.test") as c:
                yield c, f"http://127.0.0.1:{server.port}/metrics", worker
    finally:
        server.stop()


async def scrape_url(url: str) -> Scrape:
    async with httpx.AsyncClient() as c:
        resp = await c.get(url, timeout=5)
    assert resp.status_code == 200
    return Scrape(resp.text)


async def status_of(r: Redis, task_id: str) -> str | None:
    return await r.hget(keys.task(task_id), "status")


# -- the workload --------------------------------------------------------------------------------


@pytest.mark.backends("single", "cluster")
async def test_metrics_after_a_workload(settings: Settings, r: Redis) -> None:
    s = fast(settings)
    async with running_stack(s) as (api, worker_url, worker):

        async def submit(status: int = 202, **body: Any) -> dict[str, Any]:
            body.setdefault("payload", {"marker": MARKER})
            resp = await api.post("/api/v1/tasks", json=body)
            assert resp.status_code == status, resp.text
            data: dict[str, Any] = resp.json()
            return data

        ok = await submit(task_type="m_ok", ttl_seconds=600)
        flaky = await submit(task_type="m_flaky", max_attempts=3)
        dead = await submit(task_type="m_fail", max_attempts=2)
        slow = await submit(task_type="m_slow", max_attempts=1, timeout_ms=100)
        swept = await submit(task_type="m_ok", delay_seconds=5, ttl_seconds=0.3)
        at_ingest = await submit(task_type="m_ok", ttl_seconds=0)
        cancelled = await submit(task_type="m_ok", delay_seconds=60)
        near_a = await submit(task_type="m_ok", queue="alpha", delay_seconds=300, ttl_seconds=30)
        await submit(task_type="m_ok", queue="alpha", delay_seconds=300, ttl_seconds=3000)
        await submit(task_type="m_ok", queue="beta", ttl_seconds=40)
        await submit(400, task_type="no_such_type")
        await submit(413, task_type="m_ok", payload={"marker": MARKER, "big": "x" * 5000})
        big = await api.post(
            "/api/v1/tasks", content=b'{"task_type":"m_ok","payload":{"x":"' + b"y" * 80_000
        )
        assert big.status_code == 413
        resp = await api.post(
            f"/api/v1/tasks/{cancelled['task_id']}/cancel", headers={"X-API-Key": API_KEY}
        )
        assert resp.status_code == 202
        # A type no process registered, submitted past the API (the SDK): counted as (other).
        q = await connect(settings=s)
        try:
            stray = await q.submit("stray_type", {"marker": MARKER}, max_attempts=1)
        finally:
            await q.close()

        async def done() -> bool:
            want = {
                ok["task_id"]: "succeeded",
                flaky["task_id"]: "succeeded",
                dead["task_id"]: "dead_lettered",
                slow["task_id"]: "dead_lettered",
                swept["task_id"]: "expired",
                stray.task_id: "dead_lettered",
            }
            return all([await status_of(r, t) == st for t, st in want.items()])

        await wait_until(done, 20, "the workload")

        async def scheduler_counted() -> bool:
            # The scheduler counts after its tick's writes: a moment after Redis shows them.
            w = await scrape_url(worker_url)
            return (
                w.value("dtq_tasks_expired_total") == 1 and w.value("dtq_tasks_retried_total") == 2
            )

        await wait_until(scheduler_counted, 5, "the scheduler's counts")
        assert at_ingest["status"] == "expired"
        assert near_a["status"] == "pending"
        w = await scrape_url(worker_url)
        resp = await api.get("/metrics")
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
        a = Scrape(resp.text)

    # Label discipline on both endpoints.
    forbidden = [MARKER, EXC_MARKER, API_KEY, "Traceback", "first attempt fails"]
    for task_id in (ok["task_id"], dead["task_id"], stray.task_id):
        forbidden.append(task_id)
    check_labels(w, forbidden)
    check_labels(a, forbidden)
    check_contract_families(w, a)

    d = {"queue": "default"}
    # The API: ingest.
    assert a.value("dtq_tasks_submitted_total", **d, task_type="m_ok") == 4
    assert a.value("dtq_tasks_submitted_total", task_type="m_ok") == 7
    assert a.value("dtq_task_ttl_seconds_count", **d, task_type="m_ok") == 3
    assert a.value("dtq_task_ttl_seconds_count", queue="alpha") == 2
    assert a.value("dtq_task_ttl_seconds_bucket", **d, task_type="m_ok", le="0.0") == 1
    assert a.value("dtq_ingest_rejected_total", **d, reason="unknown_task_type") == 1
    assert a.value("dtq_ingest_rejected_total", **d, reason="payload_too_large") == 1
    assert a.value("dtq_ingest_rejected_total", queue="(unknown)", reason="payload_too_large") == 1
    assert a.value("dtq_tasks_expired_total", **d, task_type="m_ok") == 1  # ttl 0, at ingest
    assert a.value("dtq_tasks_completed_total", **d, task_type="m_ok", status="cancelled") == 1
    assert a.value("dtq_redis_operations_total", operation="script:submit", result="ok") >= 10
    # The API: the Redis gauges of this scrape.
    assert a.value("dtq_queue_depth", queue="beta") == 1
    assert a.value("dtq_queue_depth", queue="alpha") == 0
    assert a.value("dtq_queue_pending", queue="default") == 0
    assert a.value("dtq_retry_scheduled") == 2  # the two delayed tasks of alpha
    assert a.value("dtq_dlq_depth") == 3
    assert a.value("dtq_workers_active") == 1
    assert a.value("dtq_tasks_near_expiration", queue="alpha") == 1
    assert a.value("dtq_tasks_near_expiration", queue="beta") == 1
    assert a.value("dtq_tasks_near_expiration", queue="default") == 0

    # The worker: execution.
    wid = worker.worker_id
    assert w.value("dtq_tasks_started_total", **d, task_type="m_flaky") == 2
    assert w.value("dtq_tasks_succeeded_total", **d, task_type="m_ok") == 1
    assert w.value("dtq_tasks_succeeded_total", **d, task_type="m_flaky") == 1
    assert w.value("dtq_tasks_retried_total", **d, task_type="m_flaky") == 1  # by the scheduler
    assert w.value("dtq_tasks_retried_total", **d, task_type="m_fail") == 1
    assert w.value("dtq_tasks_dead_lettered_total", **d, task_type="m_fail") == 1
    assert w.value("dtq_tasks_dead_lettered_total", **d, task_type=OTHER) == 1
    assert w.value("dtq_tasks_completed_total", **d, status="succeeded") == 2
    assert w.value("dtq_tasks_completed_total", **d, status="dead_lettered") == 3
    assert w.value("dtq_tasks_expired_total", **d, task_type="m_ok") == 1  # by the sweep
    assert w.value("dtq_tasks_completed_total", **d, task_type="m_ok", status="expired") == 1
    assert w.value("dtq_task_attempts_total", task_type="m_flaky", result="failure") == 1
    assert w.value("dtq_task_attempts_total", task_type="m_flaky", result="success") == 1
    assert w.value("dtq_task_attempts_total", task_type="m_slow", result="timeout") == 1
    assert w.value("dtq_task_attempts_total", task_type=OTHER, result="error") == 1
    assert w.value("dtq_worker_tasks_total", worker_id=wid, result="success") == 2
    assert w.value("dtq_worker_inflight", worker_id=wid) == 0
    assert w.value("dtq_task_wait_seconds_count", task_type="m_flaky") == 1  # first start only
    assert w.value("dtq_task_execution_seconds_count", task_type="m_flaky") == 2
    assert w.value("dtq_task_execution_seconds_count", task_type=OTHER) == 0  # never ran
    assert w.value("dtq_task_duration_seconds_count", task_type="m_flaky") == 1
    assert w.value("dtq_retry_delay_seconds_count", task_type="m_fail") == 1
    assert w.value("dtq_redis_operations_total", operation="script:start", result="ok") >= 6
    assert w.value("dtq_redis_operations_total", operation="script:finish", result="ok") >= 6
    assert w.value("dtq_redis_operations_total", operation="script:read", result="ok") >= 1
    assert w.value("dtq_redis_operations_total", operation="script:promote", result="ok") >= 2


@pytest.mark.backends("single", "cluster")
async def test_inflight_gauge_follows_running_tasks(settings: Settings, r: Redis) -> None:
    s = fast(settings)
    async with running_stack(s) as (api, worker_url, worker):
        resp = await api.post(
            "/api/v1/tasks", json={"task_type": "m_slow", "payload": {}, "timeout_ms": 20_000}
        )
        task_id = resp.json()["task_id"]

        async def running() -> bool:
            return await status_of(r, task_id) == "running"

        await wait_until(running, 10, "m_slow running")
        w = await scrape_url(worker_url)
        assert w.value("dtq_worker_inflight", worker_id=worker.worker_id) == 1
        a = Scrape((await api.get("/metrics")).text)
        assert a.value("dtq_queue_depth", queue="default") == 1
        assert a.value("dtq_queue_pending", queue="default") == 1
        cancel = await api.post(f"/api/v1/tasks/{task_id}/cancel", headers={"X-API-Key": API_KEY})
        assert cancel.status_code == 409  # running: the worker stops it

        async def cancelled() -> bool:
            return await status_of(r, task_id) == "cancelled"

        await wait_until(cancelled, 10, "cancelled")
        await wait_until(
            lambda: _inflight_zero(worker_url, worker.worker_id), 5, "in-flight back to 0"
        )
        w = await scrape_url(worker_url)
        assert w.value("dtq_tasks_completed_total", status="cancelled", task_type="m_slow") == 1
        assert w.value("dtq_task_attempts_total", task_type="m_slow", result="error") == 1


async def _inflight_zero(url: str, worker_id: str) -> bool:
    return (await scrape_url(url)).value("dtq_worker_inflight", worker_id=worker_id) == 0


# -- the Redis gauges ------------------------------------------------------------------------------


class CountingPipelines:
    """Counts the pipelines a client executes (a spy on the real client, not a fake)."""

    def __init__(self, redis: Redis) -> None:
        self.count = 0
        original = redis.pipeline

        def pipeline(*args: Any, **kwargs: Any) -> Any:
            pipe = original(*args, **kwargs)
            execute = pipe.execute

            async def counted(*a: Any, **k: Any) -> Any:
                self.count += 1
                return await execute(*a, **k)

            pipe.execute = counted  # type: ignore[method-assign]
            return pipe

        redis.pipeline = pipeline  # type: ignore[method-assign]


def gauges_text(metrics: Metrics) -> Scrape:
    from prometheus_client import generate_latest

    return Scrape(generate_latest(metrics.registry).decode())


async def test_redis_gauges_one_round_trip_and_near_expiration_per_queue(
    settings: Settings, r: Redis
) -> None:
    s = fast(settings, near_expiration_s=60)
    q = await connect(settings=s)
    try:
        for queue in ("alpha", "alpha", "beta"):
            await q.submit("m_ok", {}, queue=queue, delay_seconds=600, ttl_seconds=20)
        await q.submit("m_ok", {}, queue="beta", ttl_seconds=5000)  # far away
        await q.submit("m_ok", {}, queue="gamma")  # no deadline
        metrics = Metrics(known_types=TYPES)
        metrics.add_redis_gauges(s)
        client = Redis.from_url(s.redis_url, decode_responses=True)
        spy = CountingPipelines(client)
        try:
            await metrics.refresh(client)  # first scrape: discovers queues and tasks
            first = gauges_text(metrics)
            spy.count = 0
            await metrics.refresh(client)  # nothing new: one round trip
            assert spy.count == 1
            assert metrics.redis_gauges is not None and metrics.redis_gauges.round_trips == 1
            second = gauges_text(metrics)
            # A new queue and a new expiring task: found in one more round trip.
            await q.submit("m_ok", {}, queue="delta", ttl_seconds=10)
            spy.count = 0
            await metrics.refresh(client)
            assert spy.count == 2
            third = gauges_text(metrics)
        finally:
            await client.aclose()
    finally:
        await q.close()
    for scrape in (first, second):
        assert scrape.value("dtq_tasks_near_expiration", queue="alpha") == 2
        assert scrape.value("dtq_tasks_near_expiration", queue="beta") == 1
        assert scrape.value("dtq_tasks_near_expiration", queue="gamma") == 0
        assert scrape.value("dtq_queue_depth", queue="beta") == 1
        assert scrape.value("dtq_queue_depth", queue="gamma") == 1
        assert scrape.value("dtq_retry_scheduled") == 3
        assert scrape.value("dtq_queue_max_depth") == s.max_queue_depth
    assert third.value("dtq_tasks_near_expiration", queue="delta") == 1
    assert third.value("dtq_queue_depth", queue="delta") == 1


@pytest.mark.backends("single", "cluster")
async def test_redis_gauges_count_live_and_stale_workers(settings: Settings, r: Redis) -> None:
    """The liveness rule of the admin views and the scheduler: a worker that has not written
    its first heartbeat yet is active; an old heartbeat or a hash gone is stale."""
    s = fast(settings)
    now_ms = int(time.time() * 1000)
    listed = ["worker-live0001", "worker-old00002", "worker-gone0003", "worker-new00004"]
    await r.sadd(keys.WORKERS, *listed)
    await r.hset(keys.worker("worker-live0001"), mapping={"last_heartbeat_ms": now_ms})
    await r.hset(keys.worker("worker-old00002"), mapping={"last_heartbeat_ms": now_ms - 60_000})
    await r.hset(keys.worker("worker-new00004"), mapping={"status": "starting"})
    metrics = Metrics()
    metrics.add_redis_gauges(s)
    await metrics.refresh(r)
    scrape = gauges_text(metrics)
    assert scrape.value("dtq_workers_active") == 2
    assert scrape.value("dtq_workers_stale") == 2


async def test_redis_gauges_are_left_out_when_redis_fails(settings: Settings) -> None:
    metrics = Metrics()
    gauges = metrics.add_redis_gauges(settings)
    gauges.timeout_s = 2
    dead = Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.5)
    try:
        await metrics.refresh(dead)
    finally:
        await dead.aclose()
    scrape = gauges_text(metrics)
    assert "dtq_queue_depth" not in scrape.families or not scrape.samples("dtq_queue_depth")
    assert scrape.value("dtq_redis_operations_total", operation="collect", result="error") == 1
    assert "dtq_tasks_submitted" in scrape.families  # the process's own metrics are served


def test_worker_metrics_port_in_use_is_logged_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        telemetry = WorkerTelemetry()
        assert telemetry.serve("127.0.0.1", port) is None
    assert "worker metrics not served" in caplog.text
    assert WorkerTelemetry().serve("127.0.0.1", 0) is None  # 0 disables


# -- a real worker process per port ------------------------------------------------------------

PROCESS_TASKS = """
from dtq_tasks import task


@task("mp_echo")
async def mp_echo(payload, ctx):
    return payload
"""


def _two_free_ports() -> int:
    for _ in range(50):
        base = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
            return base
    raise AssertionError("no two consecutive free ports")


def spawn(argv: list[str], cwd: Path, env: dict[str, str], out: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)


@pytest.mark.slow
async def test_each_worker_process_serves_its_own_metrics(
    settings: Settings, r: Redis, tmp_path: Path
) -> None:
    (tmp_path / "mp_tasks.py").write_text(PROCESS_TASKS)
    base = _two_free_ports()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTQ_")}
    env.update(
        {
            "DTQ_REDIS_URL": settings.redis_url,
            "DTQ_WORKER_METRICS_HOST": "127.0.0.1",
            "DTQ_WORKER_METRICS_PORT": str(base),
            "DTQ_HEARTBEAT_INTERVAL_S": "0.3",
            "DTQ_SCHEDULER_INTERVAL_S": "0.05",
            "DTQ_DRAIN_TIMEOUT_S": "3",
            "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "src")]),
        }
    )
    log_path = tmp_path / "supervisor.log"
    with log_path.open("wb") as out:
        proc = spawn(
            [sys.executable, "-m", "dtq.worker", "--processes", "2", "--tasks", "mp_tasks"],
            tmp_path,
            env,
            out,
        )
        try:
            urls = [f"http://127.0.0.1:{base + i}/metrics" for i in (0, 1)]

            async def both_answer() -> bool:
                try:
                    for url in urls:
                        await scrape_url(url)
                except httpx.HTTPError:
                    return False
                return True

            await wait_until(both_answer, 30, "both worker endpoints")
            q = await connect(settings=settings)
            try:
                tasks = [await q.submit("mp_echo", {"marker": MARKER}) for _ in range(6)]
            finally:
                await q.close()

            async def all_done() -> bool:
                return all([await status_of(r, t.task_id) == "succeeded" for t in tasks])

            await wait_until(all_done, 20, "the tasks")
            scrapes: list[Scrape] = []

            async def all_counted() -> bool:
                # A worker counts a task just after its finish script: a moment after Redis.
                scrapes[:] = [await scrape_url(url) for url in urls]
                return sum(x.value("dtq_tasks_succeeded_total") for x in scrapes) == 6

            await wait_until(all_counted, 5, "the tasks counted")
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
    ids = set()
    for scrape in scrapes:
        check_labels(scrape, [MARKER, *(t.task_id for t in tasks)])
        [inflight] = scrape.samples("dtq_worker_inflight")
        ids.add(inflight.labels["worker_id"])
    assert len(ids) == 2, "each process reports its own worker id"
    total = sum(s.value("dtq_tasks_succeeded_total", task_type="mp_echo") for s in scrapes)
    assert total == 6
    assert sum(s.value("dtq_tasks_started_total", task_type="mp_echo") for s in scrapes) == 6
    assert proc.returncode == 0, log_path.read_text()
