"""Operational surface through the ASGI app: /health, /ready (and its 503s), /metrics, the
body limit before parsing (a 50 MB streamed body), request ids, FastAPI's own errors in our
shape, the start-up warnings, and Redis going away."""

from __future__ import annotations

import logging
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from dtq import keys
from dtq.api.limits import ENVELOPE_BYTES
from dtq.config import Settings
from dtq.devserver import start_redis
from support.api import Api, api_settings, error_of, running_api

pytestmark = pytest.mark.asyncio


MB = 1024 * 1024


# -- health, ready, metrics -----------------------------------------------------------------------


async def test_health_and_ready(api: Api) -> None:
    health = await api.client.get("/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    ready = await api.client.get("/ready")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ready", "checks": {"redis": "ok", "consumer_groups": "ok"}}


async def test_ready_is_503_naming_missing_consumer_groups(api: Api, r: Redis) -> None:
    await r.delete(keys.stream("default", 0))
    resp = await api.client.get("/ready")
    assert resp.status_code == 503
    err = error_of(resp)
    assert err["code"] == "NOT_READY"
    assert err["details"]["dependency"] == "consumer_groups"
    assert keys.stream("default", 0) in err["details"]["checks"]["consumer_groups"]


async def test_redis_gone_is_503_on_ready_and_on_routes(settings: Settings, tmp_path: Path) -> None:
    server = start_redis(tmp_path / "redis")
    try:
        async with running_api(api_settings(settings, redis_url=server.url)) as api:
            assert (await api.client.get("/ready")).status_code == 200
            server.stop()
            ready = await api.client.get("/ready")
            assert ready.status_code == 503
            err = error_of(ready)
            assert err["code"] == "NOT_READY"
            assert err["details"]["dependency"] == "redis"
            listed = await api.client.get("/api/v1/tasks")
            assert listed.status_code == 503
            assert error_of(listed)["code"] == "REDIS_UNAVAILABLE"
            submitted = await api.client.post("/api/v1/tasks", json={"task_type": "api_echo"})
            assert submitted.status_code == 503
            assert (await api.client.get("/health")).status_code == 200
    finally:
        server.stop()


async def test_metrics_is_prometheus_text(api: Api) -> None:
    resp = await api.client.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    assert "# TYPE" in resp.text


async def test_startup_warns_when_auth_is_off(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="dtq.api")
    async with running_api(api_settings(settings)) as api:
        assert (await api.client.get("/health")).status_code == 200
    assert any("DTQ_API_KEY is not set" in rec.getMessage() for rec in caplog.records)


# -- body limit before parsing --------------------------------------------------------------------


async def test_content_length_over_the_limit_is_refused_unread(api: Api) -> None:
    pulled = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal pulled
        for _ in range(50):
            pulled += MB
            yield b"x" * MB

    resp = await api.client.post(
        "/api/v1/tasks",
        content=body(),
        headers={"content-type": "application/json", "content-length": str(50 * MB)},
    )
    assert resp.status_code == 413
    err = error_of(resp)
    assert err["code"] == "PAYLOAD_TOO_LARGE"
    assert err["details"]["content_length"] == 50 * MB
    assert resp.headers["connection"] == "close"
    assert pulled == 0, "not a byte of the body was read"


async def test_streamed_50mb_chunked_body_is_refused_with_flat_memory(api: Api, r: Redis) -> None:
    limit = api.app.state.dtq.settings.max_payload_bytes + ENVELOPE_BYTES
    chunk = b"x" * (64 * 1024)
    total = 50 * MB
    pulled = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal pulled
        yield b'{"task_type": "api_echo", "payload": {"blob": "'
        while pulled < total:
            pulled += len(chunk)
            yield chunk
        yield b'"}}'

    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        resp = await api.client.post(
            "/api/v1/tasks", content=body(), headers={"content-type": "application/json"}
        )
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert "content-length" not in resp.request.headers, "the body went out chunked"
    assert resp.status_code == 413
    assert error_of(resp)["code"] == "PAYLOAD_TOO_LARGE"
    assert pulled <= limit + len(chunk), f"read {pulled} bytes of a {total}-byte body"
    assert peak < 4 * MB, f"memory peak {peak} bytes while refusing a 50 MB body"
    assert await r.zcard(keys.RECENT) == 0


async def test_a_body_just_under_the_limit_is_parsed(settings: Settings) -> None:
    async with running_api(api_settings(settings, max_payload_bytes=1000)) as api:
        padding = " " * (1000 + ENVELOPE_BYTES - 100)
        body = '{"task_type": "api_echo",' + padding + '"payload": {}}'
        assert len(body) <= 1000 + ENVELOPE_BYTES
        resp = await api.client.post(
            "/api/v1/tasks", content=body, headers={"content-type": "application/json"}
        )
        assert resp.status_code == 202, resp.text
        too_big = body.replace(padding, padding + " " * 200)
        resp = await api.client.post(
            "/api/v1/tasks", content=too_big, headers={"content-type": "application/json"}
        )
        assert resp.status_code == 413


# -- request ids, FastAPI's own errors ------------------------------------------------------------


async def test_request_id_is_echoed_or_generated(api: Api) -> None:
    given = await api.client.get("/health", headers={"X-Request-ID": "req-42 abc"})
    assert given.headers["x-request-id"] == "req-42 abc"

    made = await api.client.get("/health")
    assert len(made.headers["x-request-id"]) == 32

    for bad in ("x" * 129, "tab\there", ""):
        resp = await api.client.get("/health", headers={"X-Request-ID": bad})
        rid = resp.headers["x-request-id"]
        assert rid != bad and len(rid) == 32

    err = await api.client.get(f"/api/v1/tasks/{'0' * 32}", headers={"X-Request-ID": "abc"})
    assert err.status_code == 404 and err.headers["x-request-id"] == "abc"


async def test_unknown_route_and_wrong_method_use_the_error_shape(api: Api) -> None:
    missing = await api.client.get("/api/v1/nothing-here")
    assert missing.status_code == 404
    assert error_of(missing)["code"] == "NOT_FOUND"

    wrong = await api.client.get(f"/api/v1/tasks/{'0' * 32}/cancel")
    assert wrong.status_code == 405
    assert error_of(wrong)["code"] == "METHOD_NOT_ALLOWED"

    delete = await api.client.delete("/api/v1/tasks")
    assert delete.status_code == 405
    assert error_of(delete)["code"] == "METHOD_NOT_ALLOWED"
    # /api/v1/tasks has two routes (GET list, POST submit): Allow names both
    assert delete.headers["allow"] == "GET, POST"
    assert wrong.headers["allow"] == "POST"


async def test_openapi_documents_400_not_422(api: Api) -> None:
    schema = (await api.client.get("/openapi.json")).json()
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            assert "422" not in op["responses"], f"{method} {path}"
    submit = schema["paths"]["/api/v1/tasks"]["post"]
    assert {"200", "202", "400", "409", "413", "429"} <= set(submit["responses"])
    body = submit["requestBody"]["content"]["application/json"]["schema"]
    assert body["additionalProperties"] is False
    assert {"task_type", "payload", "ttl_seconds", "expires_at", "schedule_at"} <= set(
        body["properties"]
    )


async def test_client_errors_do_not_leak_as_500(api: Api) -> None:
    transport = httpx.ASGITransport(app=api.app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://dtq.test") as client:
        for path in ("/api/v1/tasks/%00", "/api/v1/workers/%0A", "/api/v1/dlq/..%2F.."):
            resp = await client.get(path)
            assert resp.status_code == 404, (path, resp.text)


async def test_a_bug_is_500_internal_error_without_internals(api: Api) -> None:
    async def boom() -> None:
        raise RuntimeError("secret internals")

    api.app.add_api_route("/boom", boom)
    transport = httpx.ASGITransport(app=api.app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://dtq.test") as client:
        resp = await client.get("/boom", headers={"X-Request-ID": "bug-1"})
    assert resp.status_code == 500
    err = error_of(resp)
    assert err["code"] == "INTERNAL_ERROR"
    assert "secret" not in resp.text
    assert resp.headers["x-request-id"] == "bug-1"
