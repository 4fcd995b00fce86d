"""Schedule routes through the ASGI app: create, update and read back, list, the next fire
times, pause, resume, trigger (deduplicated by a key), delete with its keys, auth and audit on
every change, and bad input as a clear 4xx. A real worker fires a schedule made over HTTP:
within 1 s of its first tick, nothing while paused, the catch-up policy on resume."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest
from redis.asyncio import Redis

from dtq import keys
from dtq.api.auth import key_id
from dtq.clock import redis_time_ms
from dtq.config import Settings
from support import running_worker, wait_until
from support.api import API_KEY, Api, api_settings, error_of

pytestmark = [pytest.mark.asyncio, pytest.mark.backends("single", "cluster")]

DAILY = {"cron": "0 7 * * *", "tz": "Europe/Paris", "task_type": "api_echo", "payload": {"n": 1}}


def ms(iso: str) -> int:
    return round(datetime.fromisoformat(iso).timestamp() * 1000)


async def put(api: Api, name: str, status: int, **body: Any) -> dict[str, Any]:
    resp = await api.client.put(f"/api/v1/schedules/{name}", json=body)
    assert resp.status_code == status, resp.text
    assert resp.headers["location"] == f"/api/v1/schedules/{name}"
    data: dict[str, Any] = resp.json()
    return data


async def schedule_keys(r: Redis, queue: str = "default") -> list[str]:
    """Every key of the schedules of ``queue``'s layout (the index, hashes, histories)."""
    prefix = keys.schedules(queue).removesuffix("s")
    return sorted(await r.keys(prefix + "*"))


# -- create, update, read -------------------------------------------------------------------------


async def test_put_creates_then_updates_and_get_shows_history_and_next_times(api: Api) -> None:
    created = await put(api, "daily-report", 201, **DAILY)
    assert created["outcome"] == "created"
    assert created["name"] == "daily-report" and created["state"] == "active"
    assert created["origin"] == "api"
    d = created["definition"]
    assert d["cron"] == "0 7 * * *" and d["tz"] == "Europe/Paris" and d["catchup"] == "latest"
    assert d["overlap"] == "skip" and d["queue"] == "default"
    assert created["next_fire_at"] is not None
    assert [e["decision"] for e in created["history"]] == ["created"]

    same = await put(api, "daily-report", 200, **DAILY)
    assert same["outcome"] == "unchanged" and same["rev"] == created["rev"]
    changed = await put(api, "daily-report", 200, **{**DAILY, "payload": {"n": 2}})
    assert changed["outcome"] == "updated" and changed["definition"]["payload"] == {"n": 2}
    assert changed["next_fire_at"] == created["next_fire_at"], "same spec: the cursor stays"

    got = await api.client.get("/api/v1/schedules/daily-report")
    assert got.status_code == 200
    body = got.json()
    assert [e["decision"] for e in body["history"]] == ["updated", "created"], "newest first"
    times = body["next_fire_times"]
    assert len(times) == 5
    assert ms(times[0]) == ms(created["next_fire_at"])
    assert [ms(t) for t in times] == sorted(ms(t) for t in times)
    three = (await api.client.get("/api/v1/schedules/daily-report", params={"next": 3})).json()
    assert three["next_fire_times"] == times[:3]
    for bad in (0, 101):
        resp = await api.client.get("/api/v1/schedules/daily-report", params={"next": bad})
        assert resp.status_code == 400 and error_of(resp)["code"] == "INVALID_REQUEST"

    await put(api, "every-minute", 201, every="1m", task_type="api_echo", paused=True)
    listed = await api.client.get("/api/v1/schedules")
    assert listed.status_code == 200
    by_name = {s["name"]: s for s in listed.json()["schedules"]}
    assert set(by_name) == {"daily-report", "every-minute"}
    assert by_name["every-minute"]["state"] == "paused"
    assert by_name["every-minute"]["definition"]["every"] == 60
    assert [s["name"] for s in listed.json()["schedules"]][-1] == "every-minute", "paused last"
    one = (await api.client.get("/api/v1/schedules", params={"limit": 1})).json()
    assert [s["name"] for s in one["schedules"]] == ["daily-report"]


@pytest.mark.parametrize(
    ("body", "code", "fragment"),
    [
        ({**DAILY, "cron": "61 * * * *"}, "INVALID_SCHEDULE", "cron"),
        ({**DAILY, "cron": "* * *"}, "INVALID_SCHEDULE", "cron"),
        ({**DAILY, "tz": "Mars/Olympus"}, "INVALID_SCHEDULE", "Mars/Olympus"),
        ({"every": "5x", "task_type": "api_echo"}, "INVALID_SCHEDULE", "5x"),
        ({"every": 0, "task_type": "api_echo"}, "INVALID_SCHEDULE", "every"),
        ({"every": "\u0663", "task_type": "api_echo"}, "INVALID_SCHEDULE", "every"),
        ({"every": True, "task_type": "api_echo"}, "INVALID_TASK", "every"),
        ({**DAILY, "every": "5m"}, "INVALID_SCHEDULE", "exactly one"),
        ({"task_type": "api_echo"}, "INVALID_SCHEDULE", "exactly one"),
        ({**DAILY, "bogus": 1}, "INVALID_TASK", "bogus"),
        ({**DAILY, "task_type": "nope_task"}, "UNKNOWN_TASK_TYPE", "nope_task"),
        ({**DAILY, "task_type": "api_typed", "payload": {"n": -1}}, "INVALID_TASK", "payload"),
        ({**DAILY, "queue": "Bad Queue"}, "INVALID_TASK", "queue"),
        ({**DAILY, "priority": 10}, "INVALID_TASK", "priority"),
        ({**DAILY, "catchup": "some"}, "INVALID_TASK", "catchup"),
        ({**DAILY, "metadata": {"schedule": "x"}}, "INVALID_TASK", "metadata.schedule"),
        ({**DAILY, "start_at": "2030-01-01T00:00:00"}, "INVALID_TASK", "timezone"),
        ({**DAILY, "end_at": "9999-12-31T23:59:59-14:00"}, "INVALID_TASK", "end_at"),
        (
            {"every": 60, "anchor": "0001-01-01T00:00:00+14:00", "task_type": "api_echo"},
            "INVALID_TASK",
            "anchor",
        ),
    ],
)
async def test_put_bad_definitions_are_400(
    api: Api, r: Redis, body: dict[str, Any], code: str, fragment: str
) -> None:
    resp = await api.client.put("/api/v1/schedules/bad-one", json=body)
    assert resp.status_code == 400, resp.text
    err = error_of(resp)
    assert err["code"] == code, err
    assert fragment in err["message"], err
    assert await schedule_keys(r) == [], "nothing was stored"


async def test_bad_bodies_names_and_unknown_schedules(api: Api) -> None:
    for raw in (b"{not json", b"[1]", b""):
        resp = await api.client.put(
            "/api/v1/schedules/x", content=raw, headers={"content-type": "application/json"}
        )
        assert resp.status_code == 400 and error_of(resp)["code"] == "INVALID_TASK"

    for method, suffix in [("PUT", ""), ("GET", ""), ("DELETE", ""), ("POST", "/pause"),
                           ("POST", "/trigger")]:  # fmt: skip
        resp = await api.client.request(method, f"/api/v1/schedules/Bad Name!{suffix}", json=DAILY)
        assert resp.status_code == 400, (method, suffix, resp.text)
        assert error_of(resp)["code"] == "INVALID_REQUEST"

    for method, suffix in [("GET", ""), ("DELETE", ""), ("POST", "/pause"),
                           ("POST", "/resume"), ("POST", "/trigger")]:  # fmt: skip
        resp = await api.client.request(method, f"/api/v1/schedules/nobody{suffix}")
        assert resp.status_code == 404, (method, suffix, resp.text)
        err = error_of(resp)
        assert err["code"] == "SCHEDULE_NOT_FOUND" and "nobody" in err["message"]


# -- pause, resume, trigger, delete ---------------------------------------------------------------


async def test_pause_resume_trigger_and_delete(api: Api, r: Redis) -> None:
    await put(api, "nightly", 201, **DAILY)
    paused = await api.client.post("/api/v1/schedules/nightly/pause")
    assert paused.status_code == 200
    assert paused.json()["changed"] is True and paused.json()["state"] == "paused"
    again = (await api.client.post("/api/v1/schedules/nightly/pause")).json()
    assert again["changed"] is False and again["state"] == "paused"
    resumed = (await api.client.post("/api/v1/schedules/nightly/resume")).json()
    assert resumed["changed"] is True and resumed["state"] == "active"
    assert [e["decision"] for e in resumed["history"]][:2] == ["resumed", "paused"]

    fired = await api.client.post("/api/v1/schedules/nightly/trigger")
    assert fired.status_code == 201, fired.text
    task = fired.json()
    assert fired.headers["location"] == f"/api/v1/tasks/{task['task_id']}"
    assert task["task_type"] == "api_echo" and task["payload"] == {"n": 1}
    assert task["status"] == "queued" and task["duplicate"] is False
    assert task["metadata"]["schedule"] == "nightly"
    assert task["metadata"]["trigger"] == "manual"
    assert task["metadata"]["scheduled_for"]

    keyed = await api.client.post(
        "/api/v1/schedules/nightly/trigger", headers={"Idempotency-Key": "deploy-42"}
    )
    assert keyed.status_code == 201
    replay = await api.client.post(
        "/api/v1/schedules/nightly/trigger", headers={"Idempotency-Key": "deploy-42"}
    )
    assert replay.status_code == 200, replay.text
    assert replay.json()["task_id"] == keyed.json()["task_id"]
    assert replay.json()["duplicate"] is True
    by_query = await api.client.post("/api/v1/schedules/nightly/trigger?key=deploy-42")
    assert by_query.status_code == 200 and by_query.json()["task_id"] == keyed.json()["task_id"]
    other = await api.client.post("/api/v1/schedules/nightly/trigger?key=deploy-43")
    assert other.status_code == 201 and other.json()["task_id"] != keyed.json()["task_id"]
    too_long = await api.client.post("/api/v1/schedules/nightly/trigger", params={"key": "k" * 161})
    assert too_long.status_code == 400 and error_of(too_long)["code"] == "INVALID_TASK"

    metrics = (await api.client.get("/metrics")).text
    submitted = 'dtq_tasks_submitted_total{queue="default",task_type="api_echo"} 3.0'
    assert submitted in metrics, "a trigger counts as a submit, a replay does not"

    shown = (await api.client.get("/api/v1/schedules/nightly")).json()
    assert shown["fired"] >= 3 and shown["last_task_id"] == other.json()["task_id"]
    assert [e["decision"] for e in shown["history"]].count("triggered") == 3

    gone = await api.client.delete("/api/v1/schedules/nightly")
    assert gone.status_code == 204 and gone.content == b""
    assert await schedule_keys(r) == []
    assert (await api.client.get("/api/v1/schedules/nightly")).status_code == 404
    assert (await api.client.delete("/api/v1/schedules/nightly")).status_code == 404
    kept = await api.client.get(f"/api/v1/tasks/{task['task_id']}")
    assert kept.status_code == 200, "the tasks it fired stay"


# -- auth and audit -------------------------------------------------------------------------------

CHANGES: list[tuple[str, str, str]] = [
    ("schedule_put", "PUT", ""),
    ("schedule_pause", "POST", "/pause"),
    ("schedule_resume", "POST", "/resume"),
    ("schedule_trigger", "POST", "/trigger"),
    ("schedule_delete", "DELETE", ""),
]


async def test_auth_guards_every_change_and_each_is_audited(api_auth: Api, r: Redis) -> None:
    api = api_auth
    for _, method, suffix in CHANGES:
        path = f"/api/v1/schedules/guarded{suffix}"
        missing = await api.client.request(method, path, json=DAILY)
        assert missing.status_code == 401, (method, suffix, missing.text)
        assert error_of(missing)["code"] == "UNAUTHORIZED"
        wrong = await api.client.request(method, path, json=DAILY, headers={"X-API-Key": "no"})
        assert wrong.status_code == 403 and error_of(wrong)["code"] == "FORBIDDEN"
    assert await schedule_keys(r) == [], "nothing was done without the key"
    assert await r.xlen(keys.audit("default")) == 0

    for n, (_, method, suffix) in enumerate(CHANGES):
        resp = await api.client.request(
            method,
            f"/api/v1/schedules/guarded{suffix}",
            json=DAILY,
            headers={"X-API-Key": API_KEY, "X-Request-ID": f"sched-{n}"},
        )
        assert resp.status_code in (200, 201, 204), (method, suffix, resp.text)

    entries = (await api.client.get("/api/v1/audit", params={"limit": 100})).json()["entries"]
    assert [e["action"] for e in entries] == [a for a, _, _ in reversed(CHANGES)]
    assert {e["actor"] for e in entries} == {f"api:{key_id(API_KEY)}"}
    assert [e["request_id"] for e in entries] == [f"sched-{n}" for n in reversed(range(5))]


async def test_reads_stay_open_with_auth_on(api_auth: Api) -> None:
    api = api_auth
    made = await api.client.put(
        "/api/v1/schedules/open-read", json=DAILY, headers={"X-API-Key": API_KEY}
    )
    assert made.status_code == 201
    for path in ("/api/v1/schedules", "/api/v1/schedules/open-read"):
        assert (await api.client.get(path)).status_code == 200, path


# -- a real worker fires what the API made --------------------------------------------------------


async def fired_tasks(api: Api, name: str) -> list[dict[str, Any]]:
    """The tasks schedule ``name`` fired, by tick."""
    resp = await api.client.get("/api/v1/tasks", params={"task_type": "api_echo", "limit": 500})
    tasks = [t for t in resp.json()["tasks"] if t["metadata"].get("schedule") == name]
    return sorted(tasks, key=lambda t: ms(t["metadata"]["scheduled_for"]))


async def test_http_schedule_fires_on_time_not_while_paused_and_resumes_by_its_policy(
    api: Api, r: Redis, settings: Settings
) -> None:
    # every 4 s, grace 3 s (the least there is): at resume the latest tick of the pause fires
    # (late, or the one "latest" keeps of the missed ones); the earlier ones are missed.
    async with running_worker(api_settings(settings)):
        created = await put(api, "pulse", 201, every=4, grace_s=3, task_type="api_echo")
        first_tick = ms(created["next_fire_at"])
        await wait_until(lambda: _has(api, "pulse", 1), 10, "the first firing")
        first = (await fired_tasks(api, "pulse"))[0]
        assert ms(first["metadata"]["scheduled_for"]) == first_tick
        lag_ms = ms(first["created_at"]) - first_tick
        assert 0 <= lag_ms <= 1000, f"fired {lag_ms} ms after its first tick"

        paused = await api.client.post("/api/v1/schedules/pulse/pause")
        assert paused.status_code == 200 and paused.json()["state"] == "paused"
        before = await fired_tasks(api, "pulse")
        last_before = ms(before[-1]["metadata"]["scheduled_for"])
        paused_at = await redis_time_ms(r)

        async def pause_long() -> bool:
            return await redis_time_ms(r) >= paused_at + 9_000

        await wait_until(pause_long, 15, "9 s of pause")
        assert await fired_tasks(api, "pulse") == before, "nothing fires while paused"

        resumed = await api.client.post("/api/v1/schedules/pulse/resume")
        assert resumed.status_code == 200 and resumed.json()["state"] == "active"
        resumed_entry = resumed.json()["history"][0]
        assert resumed_entry["decision"] == "resumed"
        resumed_at = ms(resumed_entry["ts"])

        async def goes_on() -> bool:
            after = await fired_tasks(api, "pulse")
            return any(ms(t["metadata"]["scheduled_for"]) > resumed_at for t in after)

        await wait_until(goes_on, 10, "a firing after the resume")
        after = await fired_tasks(api, "pulse")
        ticks = [ms(t["metadata"]["scheduled_for"]) for t in after]
        of_pause = [t for t in ticks if last_before < t <= resumed_at]
        latest = resumed_at - (resumed_at % 4000)
        assert of_pause == [latest], (of_pause, latest, resumed_at)
        assert len(ticks) == len(set(ticks)), "one task per tick"
        shown = (await api.client.get("/api/v1/schedules/pulse")).json()
        assert shown["missed"] >= 1
        assert "missed" in [e["decision"] for e in shown["history"]]

    gone = await api.client.delete("/api/v1/schedules/pulse")
    assert gone.status_code == 204
    assert await schedule_keys(r) == []
    if settings.redis_cluster is False:
        assert await r.keys("dtq:schedule*") == []


async def _has(api: Api, name: str, n: int) -> bool:
    return len(await fired_tasks(api, name)) >= n
