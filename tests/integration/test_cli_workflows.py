"""``dtq workflow submit|show|cancel`` against a real Redis (docs/cli.md, "Workflows"): what the
CLI submits is what the SDK reads, tables and JSON, exit codes, one-line errors, audit."""

from __future__ import annotations

import getpass
import json
import socket
from pathlib import Path
from typing import Any

import pytest

from dtq import Queue, keys
from dtq.config import Settings
from dtq.connection import sync_client
from support.cli import Cli

pytestmark = pytest.mark.backends("single", "cluster")

ACTOR = f"cli:{getpass.getuser()}@{socket.gethostname()}"
DEMO = "examples.tasks"  # the demo modules: sleep_task declares a payload model


@pytest.fixture
def cli(settings: Settings) -> Cli:
    return Cli(settings.redis_url, cluster=settings.redis_cluster, DTQ_TASK_MODULES=DEMO)


def pipeline() -> dict[str, Any]:
    return {
        "nodes": [
            {"name": "fetch", "task_type": "echo_task", "payload": {"message": "hi"}},
            {"name": "parse", "task_type": "echo_task", "after": ["fetch"]},
            {
                "name": "report",
                "task_type": "echo_task",
                "after": ["parse", {"node": "fetch", "policy": "continue"}],
            },
        ],
        "metadata": {"team": "data"},
    }


def write(tmp_path: Path, data: Any, name: str = "wf.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return str(path)


def row_of(out: str, node: str) -> list[str]:
    """The cells of ``node``'s row in show's table (cells are separated by two spaces)."""
    for line in out.splitlines():
        if line.startswith(node + " "):
            return [c.strip() for c in line.split("  ") if c.strip()]
    raise AssertionError(f"no row for {node} in\n{out}")


async def test_submit_a_file_then_show(cli: Cli, queue: Queue, tmp_path: Path) -> None:
    run = cli.ok("workflow", "submit", write(tmp_path, pipeline()))
    first = run.out.splitlines()[0]
    assert first.startswith("Submitted workflow ") and "(3 nodes)" in first
    wid = first.split()[2]
    wf = await queue.get_workflow(wid)
    assert wf.metadata == {"team": "data"}
    assert [n.name for n in wf.nodes] == ["fetch", "parse", "report"]
    assert row_of(run.out, "fetch")[:2] == ["fetch", "queued"]

    shown = cli.ok("workflow", "show", wid)
    assert "NODE" in shown.out and "AFTER" in shown.out
    report = row_of(shown.out, "report")
    assert report[1] == "waiting"
    assert "parse, fetch(continue)" in report
    parse = row_of(shown.out, "parse")
    assert parse[2] == next(n.task_id for n in wf.nodes if n.name == "parse")

    doc = cli.ok("workflow", "show", wid, "--json").json()
    assert doc["workflow_id"] == wid and doc["status"] == "running"
    assert doc["nodes"][2]["after"] == [
        {"node": "parse", "policy": "fail"},
        {"node": "fetch", "policy": "continue"},
    ]


async def test_submit_from_stdin_with_json(cli: Cli, queue: Queue) -> None:
    doc = cli.ok("workflow", "submit", "-", "--json", stdin=json.dumps(pipeline())).json()
    wf = await queue.get_workflow(doc["workflow_id"])
    assert wf.model_dump(mode="json") == doc


async def test_cancel_is_audited_and_cancels_the_nodes(
    cli: Cli, queue: Queue, settings: Settings, tmp_path: Path
) -> None:
    wid = cli.ok("workflow", "submit", write(tmp_path, pipeline()), "--json").json()["workflow_id"]
    run = cli.ok("workflow", "cancel", wid)
    assert f"Workflow {wid} is cancelled." in run.out
    wf = await queue.get_workflow(wid)
    assert wf.status == "cancelled"
    assert {n.status for n in wf.nodes} == {"cancelled"}
    client = sync_client(settings, socket_timeout=5)
    try:
        entries = client.xrange(keys.audit("default"))
    finally:
        client.close()
    rows = [(f["action"], f["actor"]) for _, f in entries]
    assert rows[0] == ("workflow_submit", ACTOR), rows
    assert ("workflow_cancel", ACTOR) in rows, rows
    again = cli.ok("workflow", "cancel", wid, "--json").json()
    assert again["status"] == "cancelled"


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("{nodes", "is not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        (
            {
                "nodes": [
                    {"name": "a", "task_type": "echo_task", "after": ["b"]},
                    {"name": "b", "task_type": "echo_task", "after": ["a"]},
                ]
            },
            "cycle",
        ),
        ({"nodes": [{"name": "a", "task_type": "echo_task", "after": ["zz"]}]}, "'zz'"),
        ({"nodes": [{"name": "a", "task_type": "no_such_task"}]}, "no_such_task"),
        (
            {"nodes": [{"name": "a", "task_type": "sleep_task", "payload": {"seconds": 99}}]},
            "'a'",
        ),
    ],
    ids=["bad-json", "not-object", "cycle", "unknown-ref", "unknown-type", "bad-payload"],
)
async def test_a_bad_file_exits_2_with_one_line(
    cli: Cli, queue: Queue, tmp_path: Path, content: Any, expected: str
) -> None:
    run = cli.fails(2, "workflow", "submit", write(tmp_path, content))
    assert len(run.err.strip().splitlines()) == 1, run.err
    assert run.err.startswith("dtq: error: ") and expected in run.err
    assert run.out == ""


async def test_a_missing_file_exits_2(cli: Cli, tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    run = cli.fails(2, "workflow", "submit", str(missing))
    assert run.err.strip() == f"dtq: error: cannot read {missing}: No such file or directory"


async def test_unknown_or_malformed_ids(cli: Cli) -> None:
    for command in ("show", "cancel"):
        run = cli.fails(1, "workflow", command, "f" * 32)
        assert "not found" in run.err and len(run.err.strip().splitlines()) == 1
        bad = cli.fails(2, "workflow", command, "not-an-id")
        assert "is not a workflow id" in bad.err
