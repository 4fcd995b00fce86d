"""The limit routes (docs/api.md, docs/limits.md): create, update, unchanged, read with use,
list, delete; 400 INVALID_LIMIT for a bad definition, 400 INVALID_REQUEST for a bad name, 404
LIMIT_NOT_FOUND; the API key guards every change and each change is audited."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis

from dtq import keys
from dtq.api.auth import key_id
from support.api import API_KEY, Api, error_of

pytestmark = [pytest.mark.asyncio, pytest.mark.backends("single", "cluster")]

CHARGE = {"queue": "payments", "task_type": "charge", "rate": "100/s", "burst": 20}


async def put(api: Api, name: str, status: int, **body: Any) -> dict[str, Any]:
    resp = await api.client.put(f"/api/v1/limits/{name}", json=body)
    assert resp.status_code == status, resp.text
    assert resp.headers["location"] == f"/api/v1/limits/{name}"
    data: dict[str, Any] = resp.json()
    return data


async def test_put_get_list_delete(api: Api, r: Redis) -> None:
    created = await put(api, "charge", 201, **CHARGE)
    assert created == {
        "name": "charge", "queue": "payments", "task_type": "charge", "key": None,
        "rate": "100/s", "burst": 20, "concurrency": None, "source": "api",
        "use": {"running": 0, "waiting": 0, "keys": None, "capped": False},
        "outcome": "created",
    }  # fmt: skip
    assert (await put(api, "charge", 200, **CHARGE))["outcome"] == "unchanged"
    updated = await put(api, "charge", 200, **{**CHARGE, "concurrency": 5})
    assert updated["outcome"] == "updated" and updated["concurrency"] == 5

    await r.zadd(keys.limit_state("payments", "charge") + ":running", {"t1": 1, "t2": 2})
    got = await api.client.get("/api/v1/limits/charge")
    assert got.status_code == 200
    assert got.json()["use"] == {"running": 2, "waiting": 0, "keys": None, "capped": False}

    await put(api, "tenants", 201, key="payload.tenant", concurrency=2)
    listed = (await api.client.get("/api/v1/limits")).json()["limits"]
    assert [(x["name"], x["queue"]) for x in listed] == [
        ("charge", "payments"),
        ("tenants", "default"),
    ]
    assert listed[1]["use"]["keys"] == 0

    gone = await api.client.delete("/api/v1/limits/charge")
    assert gone.status_code == 204
    for method in ("GET", "DELETE"):
        missing = await api.client.request(method, "/api/v1/limits/charge")
        assert missing.status_code == 404 and error_of(missing)["code"] == "LIMIT_NOT_FOUND"


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({}, "a rate, a concurrency"),
        ({"rate": "lots"}, "COUNT/PERIOD"),
        ({"rate": "1/s", "burst": 0}, "burst"),
        ({"concurrency": 2, "burst": 2}, "burst needs a rate"),
        ({"concurrency": 2, "key": "tenant"}, "payload path"),
        ({"concurrency": 2, "colour": "red"}, "colour"),
    ],
)
async def test_a_bad_definition_is_400_invalid_limit(
    api: Api, body: dict[str, Any], words: str
) -> None:
    resp = await api.client.put("/api/v1/limits/bad", json=body)
    assert resp.status_code == 400, resp.text
    err = error_of(resp)
    assert err["code"] == "INVALID_LIMIT" and words in err["message"]
    assert (await api.client.get("/api/v1/limits")).json() == {"limits": []}


async def test_a_bad_name_or_body_is_400(api: Api) -> None:
    resp = await api.client.put("/api/v1/limits/no%20spaces", json={"concurrency": 1})
    assert resp.status_code == 400 and error_of(resp)["code"] == "INVALID_REQUEST"
    resp = await api.client.get("/api/v1/limits/" + "x" * 129)
    assert resp.status_code == 400 and error_of(resp)["code"] == "INVALID_REQUEST"
    resp = await api.client.put("/api/v1/limits/ok", content=b"[1, 2]")
    assert resp.status_code == 400 and error_of(resp)["code"] == "INVALID_TASK"


async def test_auth_guards_every_change_and_each_is_audited(api_auth: Api, r: Redis) -> None:
    api = api_auth
    for method in ("PUT", "DELETE"):
        missing = await api.client.request(method, "/api/v1/limits/guarded", json=CHARGE)
        assert missing.status_code == 401 and error_of(missing)["code"] == "UNAUTHORIZED"
        wrong = await api.client.request(
            method, "/api/v1/limits/guarded", json=CHARGE, headers={"X-API-Key": "no"}
        )
        assert wrong.status_code == 403 and error_of(wrong)["code"] == "FORBIDDEN"
    assert await r.exists(keys.limits("payments")) == 0, "nothing was done without the key"
    assert await r.xlen(keys.audit("payments")) == 0
    for path in ("/api/v1/limits", "/api/v1/limits/guarded"):  # reads stay open
        assert (await api.client.get(path)).status_code in (200, 404), path

    for n, method in enumerate(("PUT", "DELETE")):
        resp = await api.client.request(
            method,
            "/api/v1/limits/guarded",
            json=CHARGE,
            headers={"X-API-Key": API_KEY, "X-Request-ID": f"limit-{n}"},
        )
        assert resp.status_code in (201, 204), (method, resp.text)
    entries = (await api.client.get("/api/v1/audit", params={"limit": 100})).json()["entries"]
    assert [(e["action"], e["limit"], e["queue"]) for e in entries] == [
        ("limit_delete", "guarded", "payments"),
        ("limit_put", "guarded", "payments"),
    ]
    assert {e["actor"] for e in entries} == {f"api:{key_id(API_KEY)}"}
    assert [e["request_id"] for e in entries] == ["limit-1", "limit-0"]
