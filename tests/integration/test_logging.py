"""Logs (contract sections 10 and 13): JSON lines with the contract's fields, readable plain
lines, DTQ_LOG_LEVEL, escaped control characters, secrets replaced, and the captured logs of a
real API process and a real worker process after a workload holding neither a payload nor the
API key."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from dtq import connect, keys
from dtq.config import Settings
from dtq.devserver import free_port
from dtq.log import bound, configure_logging, set_process_fields
from dtq.worker import Worker
from dtq.worker.telemetry import WorkerTelemetry
from dtq_tasks import Handler, TaskContext
from support import started, wait_until

REPO = Path(__file__).resolve().parents[2]
MARKER = "PAYLOAD-MARKER-31e7"
API_KEY = "log-test-key-8c2f94"
PASSWORD = "redis-pass-55aa"
SENTINEL_PASSWORD = "sentinel-pass-77bb"
PLAIN_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR) +\S+ ")
CONTRACT = ("task_id", "task_type", "queue", "attempt", "status", "duration_ms", "event_type")


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    root.setLevel(level)
    logging.captureWarnings(False)


def capture(settings: Settings, service: str = "worker", **fields: Any) -> io.StringIO:
    buf = io.StringIO()
    configure_logging(settings, service, stream=buf, **fields)
    return buf


def lines(buf: io.StringIO) -> list[str]:
    return [line for line in buf.getvalue().split("\n") if line]


def records(buf: io.StringIO) -> list[dict[str, Any]]:
    out = []
    for line in lines(buf):
        value = json.loads(line)
        assert isinstance(value, dict), line
        out.append(value)
    return out


# -- the formats ---------------------------------------------------------------------------------


def test_json_lines_carry_the_contract_fields(settings: Settings) -> None:
    buf = capture(settings.model_copy(update={"log_json": True}), worker_id="worker-0a1b2c3d")
    log = logging.getLogger("dtq.test")
    log.info("plain message")
    with bound(task_id="ab" * 16, task_type="echo_task", queue="default", attempt=2):
        log.info("inside a task", extra={"status": "succeeded", "duration_ms": 12})
    log.warning("audit", extra={"actor": "api:anonymous", "action": "cancel", "request_id": "r1"})
    first, second, third = records(buf)
    assert set(first) == {"timestamp", "level", "service", "logger", "message", "worker_id"}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["timestamp"])
    assert first["level"] == "INFO" and first["service"] == "worker"
    assert first["logger"] == "dtq.test" and first["message"] == "plain message"
    assert second["task_id"] == "ab" * 16 and second["attempt"] == 2
    assert second["status"] == "succeeded" and second["duration_ms"] == 12
    assert second["worker_id"] == "worker-0a1b2c3d" and second["queue"] == "default"
    assert "task_id" not in third, "a bound context ends with its block"
    assert third["actor"] == "api:anonymous" and third["request_id"] == "r1"


def test_plain_lines_are_readable(settings: Settings) -> None:
    buf = capture(settings, "api")
    set_process_fields(worker_id="worker-99990000")
    logging.getLogger("dtq.test").info("task %s: %s", "t1", "ok", extra={"status": "succeeded"})
    [line] = lines(buf)
    assert PLAIN_RE.match(line), line
    assert " api[worker-99990000] dtq.test: task t1: ok  status=succeeded" in line


def test_log_level_is_honoured(settings: Settings) -> None:
    log = logging.getLogger("dtq.test")
    buf = capture(settings.model_copy(update={"log_level": "WARNING"}))
    log.info("hidden")
    log.warning("shown")
    assert [line.split(": ", 1)[1] for line in lines(buf)] == ["shown"]
    buf = capture(settings.model_copy(update={"log_level": "DEBUG"}))
    log.debug("debug shown")
    assert "debug shown" in buf.getvalue()
    assert len(logging.getLogger().handlers) >= 1
    assert sum(getattr(h, "_dtq_handler", False) for h in logging.getLogger().handlers) == 1


FORGED = "x\n2026-01-01T00:00:00.000Z INFO    api forged\r\x1b[31mred\u2028\x85end"


def test_control_characters_are_escaped_in_json(settings: Settings) -> None:
    buf = capture(settings.model_copy(update={"log_json": True}))
    logging.getLogger("dtq.test").info("value %s", FORGED, extra={"task_type": "t\nx"})
    [line] = lines(buf)
    assert "\u2028" not in line and "\x85" not in line and "\x1b" not in line
    [rec] = records(buf)
    assert rec["message"] == "value " + FORGED  # escaped, not lost
    assert rec["task_type"] == "t\nx"


def test_control_characters_are_escaped_in_plain(settings: Settings) -> None:
    buf = capture(settings)
    log = logging.getLogger("dtq.test")
    log.info("value %s", FORGED, extra={"queue": "q\nforged"})
    try:
        raise ValueError("boom\nINFO forged line")
    except ValueError:
        log.exception("failed")
    first, *rest = lines(buf)
    assert "\\n2026-01-01" in first and "\\r" in first and "\\x1b[31m" in first
    assert "\\u2028" in first and "\\x85" in first and "queue=q\\nforged" in first
    second, *trace = rest
    assert PLAIN_RE.match(second) and second.endswith("failed")
    assert trace and all(t.startswith("  | ") for t in trace), trace
    assert any("boom" in t for t in trace)


def test_secrets_are_replaced(settings: Settings) -> None:
    s = settings.model_copy(
        update={
            "api_key": API_KEY,
            "redis_url": f"redis://user:{PASSWORD}@127.0.0.1:1/0",
            "redis_sentinel_password": SENTINEL_PASSWORD,
        }
    )
    for json_mode in (False, True):
        buf = capture(s.model_copy(update={"log_json": json_mode}))
        logging.getLogger("dtq.test").warning(
            "key %s url %s sentinels %s",
            API_KEY,
            s.redis_url,
            SENTINEL_PASSWORD,
            extra={"actor": API_KEY},
        )
        text = buf.getvalue()
        assert API_KEY not in text and PASSWORD not in text and SENTINEL_PASSWORD not in text
        assert "***" in text


# -- a worker's lines ----------------------------------------------------------------------------


async def test_handler_and_lifecycle_lines_carry_the_task(settings: Settings, r: Redis) -> None:
    s = settings.model_copy(
        update={"log_json": True, "log_level": "DEBUG", "heartbeat_interval_s": 0.5}
    )
    buf = capture(s)

    async def chatty(payload: dict[str, Any], ctx: TaskContext) -> str:
        logging.getLogger("user.handler").info("working")
        return "done"

    handlers = {"chatty": Handler("chatty", chatty)}
    telemetry = WorkerTelemetry(handlers)
    worker = Worker(
        s,
        handlers=handlers,
        worker_id="worker-logs0001",
        observers=telemetry.observers("worker-logs0001"),
        on_redis_op=telemetry.metrics.script_call,
    )
    telemetry.watch(worker)
    set_process_fields(worker_id=worker.worker_id)
    async with started(worker):
        q = await connect(settings=s)
        try:
            task = await q.submit("chatty", {"marker": MARKER}, queue="default")
        finally:
            await q.close()
        await wait_until(lambda: _status(r, task.task_id, "succeeded"), 10)
    recs = records(buf)
    [mine] = [x for x in recs if x["logger"] == "user.handler"]
    assert mine["task_id"] == task.task_id and mine["task_type"] == "chatty"
    assert mine["queue"] == "default" and mine["attempt"] == 1
    assert mine["worker_id"] == worker.worker_id
    [done] = [x for x in recs if x.get("event_type") == "TASK_SUCCEEDED"]
    assert all(done.get(f) is not None for f in CONTRACT), done
    assert done["status"] == "succeeded" and isinstance(done["duration_ms"], int)
    assert any(x.get("event_type") == "TASK_STARTED" for x in recs)  # DEBUG
    assert MARKER not in buf.getvalue()


async def _status(r: Redis, task_id: str, status: str) -> bool:
    return await r.hget(keys.task(task_id), "status") == status


# -- real processes ----------------------------------------------------------------------------

TASKS = """
import logging

from dtq_tasks import PermanentError, task


@task("lg_ok")
async def lg_ok(payload, ctx):
    logging.getLogger("lg.tasks").info("handling attempt %d", ctx.attempt)
    return {"len": len(str(payload))}


@task("lg_fail")
async def lg_fail(payload, ctx):
    raise PermanentError(f"refusing {payload}")
"""


def _spawn(argv: list[str], cwd: Path, env: dict[str, str], out: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.mark.slow
async def test_logs_of_a_workload_hold_no_payload_and_no_key(
    settings: Settings, r: Redis, tmp_path: Path
) -> None:
    (tmp_path / "lg_tasks.py").write_text(TASKS)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTQ_")}
    env.update(
        {
            "DTQ_REDIS_URL": settings.redis_url,
            "DTQ_API_KEY": API_KEY,
            "DTQ_LOG_JSON": "true",
            "DTQ_LOG_LEVEL": "DEBUG",
            "DTQ_TASK_MODULES": "lg_tasks",
            "DTQ_HEARTBEAT_INTERVAL_S": "0.5",
            "DTQ_SCHEDULER_INTERVAL_S": "0.05",
            "DTQ_DRAIN_TIMEOUT_S": "3",
            "DTQ_WORKER_METRICS_PORT": "0",
            "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO), str(REPO / "src")]),
        }
    )
    api_log, worker_log = tmp_path / "api.log", tmp_path / "worker.log"
    with api_log.open("wb") as a_out, worker_log.open("wb") as w_out:
        api = _spawn(
            [sys.executable, "-m", "dtq_cli", "api", "--host", "127.0.0.1", "--port", str(port)],
            tmp_path,
            env,
            a_out,
        )
        worker = _spawn([sys.executable, "-m", "dtq.worker"], tmp_path, env, w_out)
        try:
            base = f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient(base_url=base, timeout=5) as c:

                async def api_up() -> bool:
                    try:
                        return (await c.get("/ready")).status_code == 200
                    except httpx.HTTPError:
                        return False

                await wait_until(api_up, 30)
                payload = {"marker": MARKER, "note": "line\nbreak"}
                ok = await c.post("/api/v1/tasks", json={"task_type": "lg_ok", "payload": payload})
                fail = await c.post(
                    "/api/v1/tasks",
                    json={"task_type": "lg_fail", "payload": payload, "max_attempts": 1},
                )
                gone = await c.post(
                    "/api/v1/tasks",
                    json={"task_type": "lg_ok", "payload": payload, "ttl_seconds": 0},
                )
                late = await c.post(
                    "/api/v1/tasks",
                    json={"task_type": "lg_ok", "payload": payload, "delay_seconds": 60},
                )
                bad = await c.post("/api/v1/tasks", json={"task_type": "nope", "payload": payload})
                assert [x.status_code for x in (ok, fail, gone, late, bad)] == [
                    202, 202, 202, 202, 400,
                ]  # fmt: skip
                late_id = late.json()["task_id"]
                wrong = await c.post(
                    f"/api/v1/tasks/{late_id}/cancel", headers={"X-API-Key": "wrong-" + API_KEY}
                )
                assert wrong.status_code == 403
                right = await c.post(
                    f"/api/v1/tasks/{late_id}/cancel", headers={"X-API-Key": API_KEY}
                )
                assert right.status_code == 202
                await wait_until(lambda: _status(r, ok.json()["task_id"], "succeeded"), 20)
                await wait_until(lambda: _status(r, fail.json()["task_id"], "dead_lettered"), 20)
                await c.get("/metrics")
        finally:
            _stop(worker)
            _stop(api)
    outputs = {"api": api_log.read_text(), "worker": worker_log.read_text()}
    for service, text in outputs.items():
        assert MARKER not in text, f"{service} logged a payload"
        assert API_KEY not in text, f"{service} logged the API key"
        recs = []
        for line in text.splitlines():
            rec = json.loads(line)  # every line is one JSON object
            assert isinstance(rec, dict), line
            assert {"timestamp", "level", "service", "logger", "message"} <= set(rec), rec
            assert rec["service"] == service
            recs.append(rec)
        assert recs, f"{service} logged nothing"
    worker_recs = [json.loads(line) for line in outputs["worker"].splitlines()]
    ok_id = ok.json()["task_id"]
    [handler_line] = [x for x in worker_recs if x["logger"] == "lg.tasks"]
    assert handler_line["task_id"] == ok_id and handler_line["attempt"] == 1
    finished = [x for x in worker_recs if x.get("event_type") == "TASK_SUCCEEDED"]
    assert finished and all(finished[0].get(f) is not None for f in CONTRACT)
    assert finished[0]["worker_id"].startswith("worker-")
    assert any(x.get("event_type") == "TASK_DEAD_LETTERED" for x in worker_recs)
    api_recs = [json.loads(line) for line in outputs["api"].splitlines()]
    assert any(x.get("action") == "cancel" for x in api_recs), "the audit line"
    assert any(x["logger"] == "uvicorn.access" for x in api_recs)
