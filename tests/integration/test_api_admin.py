"""Operator routes through the ASGI app: queue stats, pause/resume/purge, workers, dead letters
(list, get, requeue, discard, purge), the audit log, and auth on and off for every destructive
operation. A real worker (dtq.worker) dead-letters tasks and shows up in /workers."""

from __future__ import annotations

import logging

import pytest
from redis.asyncio import Redis

from dtq import keys
from dtq.api.auth import key_id
from support import running_worker, wait_until
from support.api import API_KEY, Api, error_of

pytestmark = [pytest.mark.asyncio, pytest.mark.backends("single", "cluster")]


async def status_of(api: Api, task_id: str) -> str:
    resp = await api.client.get(f"/api/v1/tasks/{task_id}")
    return str(resp.json()["status"])


async def dead_letter(api: Api, n: int) -> list[str]:
    """Submit ``n`` tasks that fail permanently and let a real worker dead-letter them."""
    ids = [(await api.submit(task_type="api_fail", payload={"why": f"bad {i}"}))["task_id"]
           for i in range(n)]  # fmt: skip
    async with running_worker(api.app.state.dtq.settings):

        async def all_dead() -> bool:
            return all([await status_of(api, t) == "dead_lettered" for t in ids])

        await wait_until(all_dead, 15)
    return ids


# -- queues ---------------------------------------------------------------------------------------


async def test_queue_stats(api: Api) -> None:
    await api.submit(queue="alpha")
    await api.submit(queue="alpha", priority=9)
    await api.submit(queue="alpha", delay_seconds=60)
    await api.submit(queue="beta")

    resp = await api.client.get("/api/v1/queues")
    assert resp.status_code == 200
    by_name = {q["queue"]: q for q in resp.json()["queues"]}
    assert {"alpha", "beta"} <= set(by_name)
    alpha = by_name["alpha"]
    assert alpha["depth"] == 2 and alpha["pending"] == 0 and alpha["waiting"] == 2
    assert alpha["paused"] is False and alpha["retry_scheduled"] == 1

    one = await api.client.get("/api/v1/queues/alpha")
    assert one.status_code == 200
    body = one.json()
    assert body["depth"] == 2 and body["dlq_depth"] == 0 and body["workers_active"] == 0

    never = (await api.client.get("/api/v1/queues/never-used")).json()
    assert never["depth"] == 0 and never["paused"] is False

    bad = await api.client.get("/api/v1/queues/Not_Valid!")
    assert bad.status_code == 400
    assert error_of(bad)["code"] == "INVALID_REQUEST"


async def test_pause_resume_and_purge_queue(api: Api, r: Redis) -> None:
    resp = await api.client.post("/api/v1/queue/alpha/pause")
    assert resp.status_code == 200
    assert resp.json() == {"queue": "alpha", "paused": True, "changed": True}
    assert await r.get(keys.queue_paused("alpha")) == "1"
    again = await api.client.post("/api/v1/queue/alpha/pause")
    assert again.json() == {"queue": "alpha", "paused": True, "changed": False}
    assert (await api.client.get("/api/v1/queues/alpha")).json()["paused"] is True

    resumed = await api.client.post("/api/v1/queue/alpha/resume")
    assert resumed.json() == {"queue": "alpha", "paused": False, "changed": True}
    assert await r.exists(keys.queue_paused("alpha")) == 0

    queued = await api.submit(queue="alpha")
    delayed = await api.submit(queue="alpha", delay_seconds=60)
    other = await api.submit(queue="beta")
    purged = await api.client.post("/api/v1/queue/alpha/purge")
    assert purged.status_code == 200
    assert purged.json() == {"queue": "alpha", "cancelled": 2}
    for t in (queued, delayed):
        task = (await api.client.get(f"/api/v1/tasks/{t['task_id']}")).json()
        assert task["status"] == "cancelled" and task["metadata"]["purged"] is True
    assert await status_of(api, other["task_id"]) == "queued"

    for path in ("pause", "resume", "purge"):
        bad = await api.client.post(f"/api/v1/queue/BAD QUEUE/{path}")
        assert bad.status_code == 400
        assert error_of(bad)["code"] == "INVALID_REQUEST"


# -- workers, dead letters, a running task ---------------------------------------------------------


async def test_workers_and_running_cancel_with_a_real_worker(api: Api) -> None:
    assert (await api.client.get("/api/v1/workers")).json() == {"workers": []}
    async with running_worker(api.app.state.dtq.settings) as worker:
        resp = await api.client.get("/api/v1/workers")
        assert resp.status_code == 200
        listed = {w["worker_id"]: w for w in resp.json()["workers"]}
        assert worker.worker_id in listed
        assert listed[worker.worker_id]["alive"] is True

        one = await api.client.get(f"/api/v1/workers/{worker.worker_id}")
        assert one.status_code == 200 and one.json()["queues"] == ["default"]
        stats = (await api.client.get("/api/v1/queues/default")).json()
        assert stats["workers_active"] == 1

        task = await api.submit(task_type="api_sleep", payload={"s": 30})

        async def running() -> bool:
            return await status_of(api, task["task_id"]) == "running"

        await wait_until(running, 10)
        resp = await api.client.post(f"/api/v1/tasks/{task['task_id']}/cancel")
        assert resp.status_code == 409
        assert error_of(resp)["code"] == "TASK_RUNNING"

        async def cancelled() -> bool:
            return await status_of(api, task["task_id"]) == "cancelled"

        await wait_until(cancelled, 10)
        expire = await api.client.post(f"/api/v1/tasks/{task['task_id']}/expire")
        assert expire.status_code == 409

    for unknown in ("worker-00000000", "bad:id", "x" * 65):
        resp = await api.client.get(f"/api/v1/workers/{unknown}")
        assert resp.status_code == 404
        assert error_of(resp)["code"] == "WORKER_NOT_FOUND"


async def test_dead_letters_list_get_requeue_discard_purge(api: Api, r: Redis) -> None:
    a, b, c = await dead_letter(api, 3)

    listed = await api.client.get("/api/v1/dlq")
    assert listed.status_code == 200
    letters = listed.json()["dead_letters"]
    assert [d["task_id"] for d in letters] == [c, b, a], "newest first"
    limited = (await api.client.get("/api/v1/dlq", params={"limit": 1})).json()
    assert [d["task_id"] for d in limited["dead_letters"]] == [c]
    bad_limit = await api.client.get("/api/v1/dlq", params={"limit": 0})
    assert bad_limit.status_code == 400

    got = await api.client.get(f"/api/v1/dlq/{a}")
    assert got.status_code == 200
    letter = got.json()
    assert letter["task_id"] == a and letter["original_queue"] == "default"
    assert letter["last_error"] == "bad 0" and letter["last_error_class"] == "PermanentError"
    assert letter["attempts_made"] == 1
    assert (await api.client.get("/api/v1/queues/default")).json()["dlq_depth"] == 3

    requeued = await api.client.post(f"/api/v1/dlq/{a}/requeue")
    assert requeued.status_code == 200, requeued.text
    task = requeued.json()
    assert task["status"] == "queued" and task["attempt"] == 0
    assert task["metadata"]["previous_attempts"][0]["attempts"] == 1
    gone = await api.client.get(f"/api/v1/dlq/{a}")
    assert gone.status_code == 404 and error_of(gone)["code"] == "NOT_IN_DLQ"
    twice = await api.client.post(f"/api/v1/dlq/{a}/requeue")
    assert twice.status_code == 404 and error_of(twice)["code"] == "NOT_IN_DLQ"

    discarded = await api.client.post(f"/api/v1/dlq/{b}/discard")
    assert discarded.status_code == 200
    assert discarded.json() == {"task_id": b, "discarded": True}
    kept = (await api.client.get(f"/api/v1/tasks/{b}")).json()
    assert kept["status"] == "dead_lettered" and kept["metadata"]["discarded"] is True
    again = await api.client.post(f"/api/v1/dlq/{b}/discard")
    assert again.status_code == 404 and error_of(again)["code"] == "NOT_IN_DLQ"

    purged = await api.client.post("/api/v1/dlq/purge")
    assert purged.status_code == 200 and purged.json() == {"purged": 1}
    assert await r.xlen(keys.dead_letter("default")) == 0
    assert (await api.client.get("/api/v1/dlq")).json() == {"dead_letters": []}

    for unknown in ("a" * 32, "nope"):
        resp = await api.client.get(f"/api/v1/dlq/{unknown}")
        assert resp.status_code == 404 and error_of(resp)["code"] == "NOT_IN_DLQ"
        for verb in ("requeue", "discard"):
            resp = await api.client.post(f"/api/v1/dlq/{unknown}/{verb}")
            assert resp.status_code == 404
            assert error_of(resp)["code"] == "TASK_NOT_FOUND"


# -- auth and audit -------------------------------------------------------------------------------

DESTRUCTIVE: list[tuple[str, str]] = [
    ("cancel", "/api/v1/tasks/{id}/cancel"),
    ("expire", "/api/v1/tasks/{id}/expire"),
    ("dlq_requeue", "/api/v1/dlq/{dead}/requeue"),
    ("dlq_discard", "/api/v1/dlq/{dead2}/discard"),
    ("dlq_purge", "/api/v1/dlq/purge"),
    ("pause", "/api/v1/queue/default/pause"),
    ("resume", "/api/v1/queue/default/resume"),
    ("purge_queue", "/api/v1/queue/default/purge"),
]


async def test_auth_on_guards_every_destructive_operation(api_auth: Api, r: Redis) -> None:
    api = api_auth
    dead, dead2 = await dead_letter(api, 2)
    ids = {
        "id": (await api.submit())["task_id"],
        "dead": dead,
        "dead2": dead2,
    }
    expire_target = (await api.submit())["task_id"]

    for action, template in DESTRUCTIVE:
        path = template.format(**{**ids, "id": expire_target if action == "expire" else ids["id"]})
        missing = await api.client.post(path)
        assert missing.status_code == 401, (action, missing.text)
        assert error_of(missing)["code"] == "UNAUTHORIZED"
        wrong = await api.client.post(path, headers={"X-API-Key": API_KEY + "x"})
        assert wrong.status_code == 403, action
        assert error_of(wrong)["code"] == "FORBIDDEN"
    assert await r.xlen(keys.audit("default")) == 0, "nothing was done without the key"

    for n, (action, template) in enumerate(DESTRUCTIVE):
        path = template.format(**{**ids, "id": expire_target if action == "expire" else ids["id"]})
        ok = await api.client.post(path, headers={"X-API-Key": API_KEY, "X-Request-ID": f"req-{n}"})
        assert ok.status_code in (200, 202), (action, ok.text)

    entries = (await api.client.get("/api/v1/audit", params={"limit": 100})).json()["entries"]
    assert len(entries) >= len(DESTRUCTIVE)
    actors = {e["actor"] for e in entries}
    assert actors == {f"api:{key_id(API_KEY)}"}
    assert {e["request_id"] for e in entries} >= {f"req-{n}" for n in range(len(DESTRUCTIVE))}
    raw = await r.xrange(keys.audit("default"))
    assert all(API_KEY not in str(fields) for _, fields in raw), "the key is never stored"


async def test_auth_on_leaves_reads_and_submit_open(api_auth: Api) -> None:
    api = api_auth
    task = await api.submit()
    for path in (
        "/api/v1/tasks",
        f"/api/v1/tasks/{task['task_id']}",
        f"/api/v1/tasks/{task['task_id']}/history",
        "/api/v1/queues",
        "/api/v1/queues/default",
        "/api/v1/workers",
        "/api/v1/dlq",
        "/api/v1/audit",
        "/health",
        "/ready",
        "/metrics",
    ):
        resp = await api.client.get(path)
        assert resp.status_code == 200, path


async def test_auth_off_everything_open_and_audited_as_anonymous(
    api: Api, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="dtq.api.audit")
    task = await api.submit()
    resp = await api.client.post(
        f"/api/v1/tasks/{task['task_id']}/cancel", headers={"X-Request-ID": "trace-7"}
    )
    assert resp.status_code == 202
    # A key sent while auth is off is ignored, not checked.
    paused = await api.client.post("/api/v1/queue/default/pause", headers={"X-API-Key": "any"})
    assert paused.status_code == 200
    entries = (await api.client.get("/api/v1/audit")).json()["entries"]
    assert [e["action"] for e in entries] == ["queue_pause", "cancel"], "newest first"
    assert {e["actor"] for e in entries} == {"api:anonymous"}
    assert entries[1]["task_id"] == task["task_id"] and entries[1]["request_id"] == "trace-7"
    logged = [rec.getMessage() for rec in caplog.records if rec.name == "dtq.api.audit"]
    assert any(
        "actor=api:anonymous action=cancel" in m and task["task_id"] in m and "trace-7" in m
        for m in logged
    ), logged
    assert any("action=queue_pause target=default" in m for m in logged), logged


async def test_audit_limit_is_validated(api: Api) -> None:
    resp = await api.client.get("/api/v1/audit", params={"limit": 100_000})
    assert resp.status_code == 400
    assert error_of(resp)["code"] == "INVALID_REQUEST"
