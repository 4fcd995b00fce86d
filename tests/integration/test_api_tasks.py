"""Task routes through the ASGI app: submit (every status and code), get, list, cancel,
history and expire (extensions), idempotency header vs body, request ids, error shape."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from redis.asyncio import Redis

from dtq import keys
from dtq.config import Settings
from support.api import Api, api_settings, error_of, running_api

pytestmark = [pytest.mark.asyncio, pytest.mark.backends("single", "cluster")]


# -- submit ---------------------------------------------------------------------------------------


async def test_submit_returns_202_with_the_new_task(api: Api, r: Redis) -> None:
    resp = await api.client.post(
        "/api/v1/tasks",
        json={"task_type": "api_echo", "payload": {"x": 1}, "priority": 7, "max_attempts": 3},
    )
    assert resp.status_code == 202, resp.text
    body = resp.json()
    assert body["status"] == "queued"
    assert body["duplicate"] is False
    assert len(body["task_id"]) == 32
    assert resp.headers["location"] == f"/api/v1/tasks/{body['task_id']}"
    stored = await r.hgetall(keys.task(body["task_id"]))
    assert stored["status"] == "queued" and stored["priority"] == "7"
    assert await r.xlen(keys.stream("default", 7)) == 1

    got = await api.client.get(f"/api/v1/tasks/{body['task_id']}")
    assert got.status_code == 200
    task = got.json()
    assert task["payload"] == {"x": 1}
    assert task["max_attempts"] == 3
    assert task["attempt"] == 0
    for field in ("started_at", "finished_at", "worker_id", "error_class", "expires_at"):
        assert field in task


async def test_submit_delay_schedule_and_expiration_fields(api: Api) -> None:
    delayed = await api.submit(delay_seconds=60)
    assert delayed["status"] == "pending"

    at = datetime.now(UTC) + timedelta(hours=1)
    until = at + timedelta(hours=1)
    scheduled = await api.submit(schedule_at=at.isoformat(), expires_at=until.isoformat())
    assert scheduled["status"] == "pending"
    assert abs(datetime.fromisoformat(scheduled["available_at"]) - at) < timedelta(seconds=1)
    assert abs(datetime.fromisoformat(scheduled["expires_at"]) - until) < timedelta(seconds=1)

    ttl = await api.submit(ttl_seconds=300)
    assert ttl["status"] == "queued" and ttl["expires_at"] is not None

    meta_ttl = await api.submit(metadata={"ttl_seconds": 300})
    assert meta_ttl["expires_at"] is not None

    zero = await api.submit(ttl_seconds=0)
    assert zero["status"] == "expired"
    got = (await api.client.get(f"/api/v1/tasks/{zero['task_id']}")).json()
    assert got["status"] == "expired" and got["expired_at"] is not None


@pytest.mark.parametrize(
    ("body", "code", "fragment"),
    [
        ("{not json", "INVALID_TASK", "not valid JSON"),
        ("[1, 2]", "INVALID_TASK", "JSON object"),
        ('{"task_type": "api_echo", "payload": {"x": NaN}}', "INVALID_TASK", "NaN"),
        ("[" * 50_000 + "]" * 50_000, "INVALID_TASK", "JSON"),
        ("", "INVALID_TASK", "not valid JSON"),
        ('{"payload": {}}', "INVALID_TASK", "task_type"),
        ('{"task_type": "api_echo", "bogus": 1}', "INVALID_TASK", "bogus"),
        ('{"task_type": "api_echo", "settings": 1}', "INVALID_TASK", "settings"),
        ('{"task_type": "api_echo", "priority": 10}', "INVALID_TASK", "priority"),
        ('{"task_type": "api_echo", "priority": true}', "INVALID_TASK", "priority"),
        ('{"task_type": "api_echo", "payload": [1]}', "INVALID_TASK", "payload"),
        ('{"task_type": "api_echo", "queue": "Bad Queue"}', "INVALID_TASK", "queue"),
        ('{"task_type": "api_echo", "max_attempts": 11}', "INVALID_TASK", "max_attempts"),
        ('{"task_type": "api_echo", "timeout_ms": 3600001}', "INVALID_TASK", "timeout_ms"),
        (
            '{"task_type": "api_echo", "expires_at": "2030-01-01T00:00:00"}',
            "INVALID_TASK",
            "timezone",
        ),
        (
            '{"task_type": "api_echo", "ttl_seconds": 5, "expires_at": "2030-01-01T00:00:00Z"}',
            "INVALID_TASK",
            "expires_at and ttl_seconds",
        ),
        (
            '{"task_type": "api_echo", "ttl_seconds": 5, "metadata": {"ttl_seconds": 5}}',
            "INVALID_TASK",
            "ttl_seconds and metadata.ttl_seconds",
        ),
        # found by schemathesis: a metadata TTL of 1e308 s overflowed to a 500
        ('{"task_type": "api_echo", "metadata": {"ttl_seconds": 1e308}}', "INVALID_TASK", "ttl"),
        # pydantic would read a number as a Unix time; the API takes ISO 8601 text only
        ('{"task_type": "api_echo", "schedule_at": 0}', "INVALID_TASK", "schedule_at"),
        ('{"task_type": "api_echo", "expires_at": 1.5e9}', "INVALID_TASK", "expires_at"),
        ('{"task_type": "nope_task"}', "UNKNOWN_TASK_TYPE", "nope_task"),
        ('{"task_type": "api_typed", "payload": {"n": -1}}', "INVALID_TASK", "payload.n"),
        ('{"task_type": "api_typed", "payload": {}}', "INVALID_TASK", "payload.n"),
    ],
)
async def test_submit_invalid_input_is_400_never_422(
    api: Api, r: Redis, body: str, code: str, fragment: str
) -> None:
    resp = await api.client.post(
        "/api/v1/tasks", content=body, headers={"content-type": "application/json"}
    )
    assert resp.status_code == 400, resp.text
    err = error_of(resp)
    assert err["code"] == code
    assert fragment in err["message"] or fragment in json.dumps(err["details"])
    assert await r.zcard(keys.recent("default")) == 0, "nothing was stored"


async def test_payload_model_accepts_a_valid_payload(api: Api) -> None:
    task = await api.submit(task_type="api_typed", payload={"n": 4})
    assert task["status"] == "queued"


async def test_payload_limit_is_exact_on_the_compact_json(settings: Settings) -> None:
    async with running_api(api_settings(settings, max_payload_bytes=1000)) as api:
        # {"s":"..."} is 8 bytes of JSON around the string.
        exact = await api.client.post(
            "/api/v1/tasks", json={"task_type": "api_echo", "payload": {"s": "x" * 992}}
        )
        assert exact.status_code == 202, exact.text
        over = await api.client.post(
            "/api/v1/tasks", json={"task_type": "api_echo", "payload": {"s": "x" * 993}}
        )
        assert over.status_code == 413
        err = error_of(over)
        assert err["code"] == "PAYLOAD_TOO_LARGE"
        assert err["details"] == {"size": 1001, "limit": 1000}


async def test_queue_full_is_429_with_retry_after(settings: Settings) -> None:
    async with running_api(api_settings(settings, max_queue_depth=2)) as api:
        await api.submit()
        await api.submit()
        resp = await api.client.post("/api/v1/tasks", json={"task_type": "api_echo"})
        assert resp.status_code == 429
        assert int(resp.headers["retry-after"]) >= 1
        err = error_of(resp)
        assert err["code"] == "QUEUE_FULL"
        assert err["details"]["queue"] == "default"
        # Another queue is not full.
        await api.submit(queue="other")


# -- idempotency ----------------------------------------------------------------------------------


async def test_idempotency_in_progress_then_replay(api: Api) -> None:
    first = await api.submit(idempotency_key="order-1")
    again = await api.client.post(
        "/api/v1/tasks", json={"task_type": "api_echo", "idempotency_key": "order-1"}
    )
    assert again.status_code == 409
    err = error_of(again)
    assert err["code"] == "IDEMPOTENCY_IN_PROGRESS"
    assert err["details"]["task_id"] == first["task_id"]

    cancelled = await api.client.post(f"/api/v1/tasks/{first['task_id']}/cancel")
    assert cancelled.status_code == 202

    replay = await api.client.post(
        "/api/v1/tasks", json={"task_type": "api_echo", "idempotency_key": "order-1"}
    )
    assert replay.status_code == 200
    body = replay.json()
    assert body["duplicate"] is True
    assert body["task_id"] == first["task_id"]
    assert body["status"] == "cancelled"
    # The scope is (queue, key): another queue gets a new task.
    other = await api.submit(idempotency_key="order-1", queue="other")
    assert other["task_id"] != first["task_id"]


async def test_idempotency_header_wins_over_the_body(api: Api, r: Redis) -> None:
    resp = await api.client.post(
        "/api/v1/tasks",
        json={"task_type": "api_echo", "idempotency_key": "from-body"},
        headers={"Idempotency-Key": "from-header"},
    )
    assert resp.status_code == 202
    task = resp.json()
    assert task["idempotency_key"] == "from-header"
    assert await r.exists(keys.idempotency("default", "from-header")) == 1
    assert await r.exists(keys.idempotency("default", "from-body")) == 0

    # The body's key alone is free; the header's key is taken.
    free = await api.submit(idempotency_key="from-body")
    assert free["task_id"] != task["task_id"]
    taken = await api.client.post(
        "/api/v1/tasks",
        json={"task_type": "api_echo", "idempotency_key": "another"},
        headers={"Idempotency-Key": "from-header"},
    )
    assert taken.status_code == 409
    assert error_of(taken)["code"] == "IDEMPOTENCY_IN_PROGRESS"

    bad = await api.client.post(
        "/api/v1/tasks", json={"task_type": "api_echo"}, headers={"Idempotency-Key": "x" * 300}
    )
    assert bad.status_code == 400
    assert "idempotency_key" in error_of(bad)["message"]

    # The header wins, but a body key that breaks the rules is still refused.
    both = await api.client.post(
        "/api/v1/tasks",
        json={"task_type": "api_echo", "idempotency_key": "tab\there"},
        headers={"Idempotency-Key": "fine"},
    )
    assert both.status_code == 400
    assert error_of(both)["code"] == "INVALID_TASK"
    assert await r.exists(keys.idempotency("default", "fine")) == 0


async def test_openapi_states_the_submit_rules(api: Api, settings: Settings) -> None:
    """What schemathesis checks at scale (tests/chaos: bad_input): a body valid by the schema
    is accepted, so the schema names the registry, the caps and the exclusive fields."""
    doc = (await api.client.get("/openapi.json")).json()
    op = doc["paths"]["/api/v1/tasks"]["post"]
    body = op["requestBody"]["content"]["application/json"]["schema"]
    props = body["properties"]
    assert (
        "api_echo" in props["task_type"]["enum"] and "nope_task" not in props["task_type"]["enum"]
    )
    assert props["max_attempts"]["maximum"] == settings.max_attempts
    assert props["queue"]["pattern"] == "^[a-z0-9][a-z0-9_-]{0,63}$"
    excluded = [sorted(rule["not"]["required"]) for rule in body["allOf"]]
    assert ["expires_at", "ttl_seconds"] in excluded
    assert ["delay_seconds", "schedule_at"] in excluded
    (header,) = [p for p in op["parameters"] if p["name"] == "Idempotency-Key"]
    assert header["schema"]["anyOf"][0]["maxLength"] == 256


# -- get, list ------------------------------------------------------------------------------------


@pytest.mark.parametrize("task_id", ["0" * 32, "not-a-task", "x:history", "A" * 32])
async def test_get_unknown_task_is_404(api: Api, task_id: str) -> None:
    resp = await api.client.get(f"/api/v1/tasks/{task_id}")
    assert resp.status_code == 404
    assert error_of(resp)["code"] == "TASK_NOT_FOUND"


async def test_list_recent_first_with_filters(api: Api) -> None:
    a = await api.submit(queue="alpha")
    b = await api.submit(queue="beta")
    c = await api.submit(queue="alpha", delay_seconds=60)

    every = (await api.client.get("/api/v1/tasks")).json()["tasks"]
    assert [t["task_id"] for t in every] == [c["task_id"], b["task_id"], a["task_id"]]

    alpha = (await api.client.get("/api/v1/tasks", params={"queue": "alpha"})).json()["tasks"]
    assert [t["task_id"] for t in alpha] == [c["task_id"], a["task_id"]]

    pending = (await api.client.get("/api/v1/tasks", params={"status": "pending"})).json()
    assert [t["task_id"] for t in pending["tasks"]] == [c["task_id"]]

    one = (await api.client.get("/api/v1/tasks", params={"limit": 1})).json()["tasks"]
    assert [t["task_id"] for t in one] == [c["task_id"]]

    typed = await api.client.get("/api/v1/tasks", params={"task_type": "api_typed"})
    assert typed.json()["tasks"] == []


@pytest.mark.parametrize(
    "params",
    [{"status": "bogus"}, {"limit": 0}, {"limit": "many"}, {"queue": "Not A Queue"}],
)
async def test_list_bad_parameters_are_400(api: Api, params: dict[str, Any]) -> None:
    resp = await api.client.get("/api/v1/tasks", params=params)
    assert resp.status_code == 400
    err = error_of(resp)
    assert err["code"] == "INVALID_REQUEST"
    assert err["details"]["errors"]


# -- cancel, history, expire ----------------------------------------------------------------------


async def test_cancel_queued_running_terminal_unknown(api: Api, r: Redis) -> None:
    queued = await api.submit()
    resp = await api.client.post(f"/api/v1/tasks/{queued['task_id']}/cancel")
    assert resp.status_code == 202
    assert resp.json() == {
        "task_id": queued["task_id"],
        "status": "cancelled",
        "previous_status": "queued",
    }
    assert await r.xlen(keys.stream("default", 5)) == 0, "the entry left the stream"

    again = await api.client.post(f"/api/v1/tasks/{queued['task_id']}/cancel")
    assert again.status_code == 410
    err = error_of(again)
    assert err["code"] == "TASK_TERMINAL" and err["details"]["status"] == "cancelled"

    # A worker has started this one (the start script's status, written directly here).
    running = await api.submit()
    await r.hset(keys.task(running["task_id"]), "status", "running")
    resp = await api.client.post(f"/api/v1/tasks/{running['task_id']}/cancel")
    assert resp.status_code == 409
    assert error_of(resp)["code"] == "TASK_RUNNING"
    assert await r.hget(keys.task(running["task_id"]), "cancel_requested") == "1"

    for unknown in ("f" * 32, "nope"):
        resp = await api.client.post(f"/api/v1/tasks/{unknown}/cancel")
        assert resp.status_code == 404
        assert error_of(resp)["code"] == "TASK_NOT_FOUND"


async def test_cancel_pending_and_history_extension(api: Api) -> None:
    task = await api.submit(delay_seconds=60)
    assert (await api.client.post(f"/api/v1/tasks/{task['task_id']}/cancel")).status_code == 202
    resp = await api.client.get(f"/api/v1/tasks/{task['task_id']}/history")
    assert resp.status_code == 200
    body = resp.json()
    assert body["task_id"] == task["task_id"]
    steps = [(h["from"], h["to"]) for h in body["history"]]
    assert steps == [(None, "pending"), ("pending", "cancelled")]
    assert all(h["ts"] for h in body["history"])

    missing = await api.client.get(f"/api/v1/tasks/{'e' * 32}/history")
    assert missing.status_code == 404
    assert error_of(missing)["code"] == "TASK_NOT_FOUND"


async def test_expire_extension(api: Api, r: Redis) -> None:
    task = await api.submit()
    resp = await api.client.post(f"/api/v1/tasks/{task['task_id']}/expire")
    assert resp.status_code == 200
    assert resp.json() == {
        "task_id": task["task_id"],
        "status": "expired",
        "previous_status": "queued",
    }
    got = (await api.client.get(f"/api/v1/tasks/{task['task_id']}")).json()
    assert got["status"] == "expired" and got["expired_at"]
    assert await r.xlen(keys.stream("default", 5)) == 0

    again = await api.client.post(f"/api/v1/tasks/{task['task_id']}/expire")
    assert again.status_code == 409
    err = error_of(again)
    assert err["code"] == "INVALID_TRANSITION" and err["details"]["status"] == "expired"

    missing = await api.client.post(f"/api/v1/tasks/{'d' * 32}/expire")
    assert missing.status_code == 404
    assert error_of(missing)["code"] == "TASK_NOT_FOUND"


async def test_replay_of_a_key_whose_task_record_expired_is_404(api: Api, r: Redis) -> None:
    task = await api.submit(idempotency_key="gone-1")
    assert (await api.client.post(f"/api/v1/tasks/{task['task_id']}/cancel")).status_code == 202
    await r.delete(keys.task(task["task_id"]))  # as its retention TTL would
    resp = await api.client.post(
        "/api/v1/tasks", json={"task_type": "api_echo", "idempotency_key": "gone-1"}
    )
    assert resp.status_code == 404
    err = error_of(resp)
    assert err["code"] == "TASK_NOT_FOUND" and err["details"]["task_id"] == task["task_id"]
