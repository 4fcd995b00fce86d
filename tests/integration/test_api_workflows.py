"""Workflow routes through the ASGI app: submit (201, every kind of 400), get (404s), cancel
(auth, audit, the nodes' state after it)."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis

from dtq import keys
from support.api import API_KEY, Api, error_of

pytestmark = [pytest.mark.asyncio, pytest.mark.backends("single", "cluster")]


def diamond() -> dict[str, Any]:
    return {
        "nodes": [
            {"name": "a", "task_type": "api_echo", "payload": {"n": 1}},
            {"name": "b", "task_type": "api_echo", "after": ["a"]},
            {"name": "c", "task_type": "api_echo", "after": [{"node": "a", "policy": "skip"}]},
            {"name": "d", "task_type": "api_echo", "after": ["b", "c"]},
        ],
        "metadata": {"owner": "tests"},
    }


async def test_submit_is_201_with_the_workflow_and_get_reads_it(api: Api, r: Redis) -> None:
    resp = await api.client.post("/api/v1/workflows", json=diamond())
    assert resp.status_code == 201, resp.text
    body = resp.json()
    wid = body["workflow_id"]
    assert len(wid) == 32
    assert resp.headers["location"] == f"/api/v1/workflows/{wid}"
    assert body["status"] == "running"
    assert body["metadata"] == {"owner": "tests"}
    nodes = {n["name"]: n for n in body["nodes"]}
    assert nodes["a"]["status"] == "queued"
    assert {nodes[n]["status"] for n in "bcd"} == {"waiting"}
    assert nodes["c"]["after"] == [{"node": "a", "policy": "skip"}]
    assert nodes["d"]["after"] == [{"node": "b", "policy": "fail"}, {"node": "c", "policy": "fail"}]
    # The root is an ordinary task, readable through the task routes.
    task = await api.client.get(f"/api/v1/tasks/{nodes['a']['task_id']}")
    assert task.status_code == 200 and task.json()["payload"] == {"n": 1}
    assert await r.exists(keys.workflow(wid)) == 1

    got = await api.client.get(f"/api/v1/workflows/{wid}")
    assert got.status_code == 200, got.text
    assert got.json()["nodes"] == body["nodes"]
    audited = [f for _, f in await r.xrange(keys.audit("default"))]
    assert [(f["action"], f["actor"]) for f in audited] == [("workflow_submit", "api:anonymous")]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            {
                "nodes": [
                    {"name": "a", "task_type": "api_echo", "after": ["b"]},
                    {"name": "b", "task_type": "api_echo", "after": ["a"]},
                ]
            },
            "cycle",
        ),
        ({"nodes": [{"name": "a", "task_type": "api_echo", "after": ["zz"]}]}, "'zz'"),
        (
            {
                "nodes": [
                    {"name": "a", "task_type": "api_echo"},
                    {"name": "a", "task_type": "api_echo"},
                ]
            },
            "twice",
        ),
        ({"nodes": [{"name": "a b", "task_type": "api_echo"}]}, "name"),
        ({"nodes": [{"name": "a", "task_type": "api_echo", "colour": "red"}]}, "colour"),
        ({"nodes": [{"name": "a", "task_type": "no_such_type"}]}, "'a'"),
        ({"nodes": [{"name": "a", "task_type": "api_typed", "payload": {"n": -1}}]}, "'a'"),
        ({"nodes": []}, "at least one node"),
        ({"tasks": []}, "nodes"),
    ],
    ids=[
        "cycle",
        "unknown-ref",
        "duplicate",
        "bad-name",
        "extra-field",
        "unknown-type",
        "bad-payload",
        "empty",
        "no-nodes",
    ],
)
async def test_submit_refuses_an_invalid_workflow_with_400(
    api: Api, body: dict[str, Any], expected: str
) -> None:
    resp = await api.client.post("/api/v1/workflows", json=body)
    assert resp.status_code == 400, resp.text
    err = error_of(resp)
    assert err["code"] == "INVALID_WORKFLOW"
    assert expected in err["message"]


async def test_submit_refuses_a_body_that_is_not_json_or_not_an_object(api: Api) -> None:
    bad = await api.client.post(
        "/api/v1/workflows", content=b"{nodes", headers={"content-type": "application/json"}
    )
    assert bad.status_code == 400
    assert "not valid JSON" in error_of(bad)["message"]
    listed = await api.client.post("/api/v1/workflows", json=[1, 2])
    assert listed.status_code == 400
    assert "JSON object" in error_of(listed)["message"]


@pytest.mark.parametrize("wid", ["0" * 32, "not-an-id", "A" * 32])
async def test_get_and_cancel_of_an_unknown_workflow_are_404(api: Api, wid: str) -> None:
    for resp in (
        await api.client.get(f"/api/v1/workflows/{wid}"),
        await api.client.post(f"/api/v1/workflows/{wid}/cancel"),
    ):
        assert resp.status_code == 404, resp.text
        assert error_of(resp)["code"] == "WORKFLOW_NOT_FOUND"


async def test_cancel_needs_the_key_and_cancels_every_node(api_auth: Api, r: Redis) -> None:
    api = api_auth
    created = await api.client.post("/api/v1/workflows", json=diamond())
    assert created.status_code == 201, created.text  # submit is open, like a task submit
    wid = created.json()["workflow_id"]
    url = f"/api/v1/workflows/{wid}/cancel"

    missing = await api.client.post(url)
    assert missing.status_code == 401 and error_of(missing)["code"] == "UNAUTHORIZED"
    wrong = await api.client.post(url, headers={"X-API-Key": "nope"})
    assert wrong.status_code == 403 and error_of(wrong)["code"] == "FORBIDDEN"
    still = (await api.client.get(f"/api/v1/workflows/{wid}")).json()
    assert still["status"] == "running" and not still["cancel_requested"]

    resp = await api.client.post(url, headers={"X-API-Key": API_KEY})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["status"] == "cancelled" and body["cancel_requested"] is True
    assert {n["status"] for n in body["nodes"]} == {"cancelled"}
    root = next(n for n in body["nodes"] if n["name"] == "a")
    task = (await api.client.get(f"/api/v1/tasks/{root['task_id']}")).json()
    assert task["status"] == "cancelled"

    rows = [(f["action"], f["actor"]) for _, f in await r.xrange(keys.audit("default"))]
    # Submit needed no key and named nobody; the cancel names the key's holder.
    assert rows[0] == ("workflow_submit", "api:anonymous"), rows
    assert any(a == "workflow_cancel" and who.startswith("api:key-") for a, who in rows), rows

    again = await api.client.post(url, headers={"X-API-Key": API_KEY})
    assert again.status_code == 200 and again.json()["status"] == "cancelled"
