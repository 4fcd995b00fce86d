"""``dtq limit set|list|show|remove`` against a real Redis (docs/cli.md, "Limits"): what the
CLI stores is what the SDK reads, tables and JSON, exit codes, confirmation and audit."""

from __future__ import annotations

import getpass
import socket

import pytest

from dtq import Queue, keys
from dtq.config import Settings
from dtq.connection import sync_client
from dtq.limits import LimitDef
from dtq_cli.limit_cmd import DEFINITION_FLAGS
from dtq_cli.parser import build_parser
from support.cli import Cli

pytestmark = pytest.mark.backends("single", "cluster")

ACTOR = f"cli:{getpass.getuser()}@{socket.gethostname()}"


@pytest.fixture
def cli(settings: Settings) -> Cli:
    return Cli(settings.redis_url, cluster=settings.redis_cluster, DTQ_TASK_MODULES="")


def audit_rows(settings: Settings, queue: str) -> list[tuple[str, str, str]]:
    """(action, limit, actor) of every audit entry of ``queue``, oldest first."""
    client = sync_client(settings, socket_timeout=5)
    try:
        rows = client.xrange(keys.audit(queue))
    finally:
        client.close()
    return [(f["action"], f.get("limit", ""), f["actor"]) for _, f in rows]


@pytest.mark.backends("single", reason="parses arguments only")
def test_every_operator_field_has_a_flag_of_set() -> None:
    assert set(DEFINITION_FLAGS) == set(LimitDef.model_fields) - {"source"}
    args = build_parser().parse_args(["limit", "set", "x", "--rate", "1/s"])
    assert set(DEFINITION_FLAGS) <= set(vars(args))


async def test_set_list_show_remove(cli: Cli, queue: Queue, settings: Settings) -> None:
    run = cli.ok(
        "limit", "set", "charge", "--queue", "payments", "--task-type", "charge",
        "--rate", "100/s", "--burst", "20", "--concurrency", "5",
    )  # fmt: skip
    assert run.out.splitlines()[0] == "Created limit charge."
    assert "rate: 100/s (burst 20)" in run.out
    stored = await queue.get_limit("charge")
    assert stored.definition == LimitDef(
        queue="payments", task_type="charge", rate="100/s", burst=20, concurrency=5
    )
    again = cli.ok("limit", "set", "charge", "--queue", "payments", "--task-type", "charge",
                   "--rate", "100/s", "--burst", "20", "--concurrency", "5", "--json")  # fmt: skip
    assert again.json()["outcome"] == "unchanged"
    changed = cli.ok("limit", "set", "charge", "--queue", "payments", "--concurrency", "2")
    assert changed.out.splitlines()[0] == "Updated limit charge."
    assert (await queue.get_limit("charge")).definition == LimitDef(queue="payments", concurrency=2)

    cli.ok("limit", "set", "tenants", "--key", "payload.tenant", "--rate", "5/m")
    prefix = keys.limit_state("payments", "charge")
    await queue.redis.zadd(prefix + ":running", {"t1": 1})
    await queue.redis.zadd(prefix + ":waiting", {"t2": 1, "t3": 2})
    table = cli.ok("limit", "list").out.splitlines()
    assert table[0].split() == ["NAME", "QUEUE", "TASK_TYPE", "KEY", "RATE", "BURST",
                                "CONCURRENCY", "RUNNING", "WAITING"]  # fmt: skip
    assert table[1].split() == ["charge", "payments", "-", "-", "-", "-", "2", "1", "2"]
    assert table[2].split() == ["tenants", "default", "-", "payload.tenant", "5/m", "-", "-",
                                "0", "0"]  # fmt: skip
    doc = cli.ok("limit", "list", "--json").json()
    assert doc["count"] == 2 and [x["name"] for x in doc["limits"]] == ["charge", "tenants"]
    shown = cli.ok("limit", "show", "tenants", "--json").json()
    assert shown["key"] == "payload.tenant" and shown["use"]["keys"] == 0
    assert "keys: 0 with state" in cli.ok("limit", "show", "tenants").out

    refused = cli.fails(2, "limit", "remove", "charge")  # stdin is not a terminal
    assert "--yes" in refused.err
    assert cli.ok("limit", "remove", "charge", "--yes").out.strip() == "Deleted limit charge."
    assert "not found" in cli.fails(1, "limit", "show", "charge").err
    assert "not found" in cli.fails(1, "limit", "remove", "charge", "--yes").err
    assert [row for row in audit_rows(settings, "payments") if row[1] == "charge"] == [
        ("limit_put", "charge", ACTOR),
        ("limit_put", "charge", ACTOR),
        ("limit_put", "charge", ACTOR),
        ("limit_delete", "charge", ACTOR),
    ]


async def test_bad_definitions_exit_2_with_the_core_message(cli: Cli, queue: Queue) -> None:
    assert "a rate, a concurrency" in cli.fails(2, "limit", "set", "x").err
    assert "COUNT/PERIOD" in cli.fails(2, "limit", "set", "x", "--rate", "fast").err
    assert (
        "burst needs a rate"
        in cli.fails(2, "limit", "set", "x", "--concurrency", "1", "--burst", "3").err
    )
    assert "payload path" in cli.fails(2, "limit", "set", "x", "--rate", "1/s", "--key", "id").err
    assert "limit name" in cli.fails(2, "limit", "set", "a b", "--rate", "1/s").err
    assert "at least 1" in cli.fails(2, "limit", "set", "x", "--concurrency", "0").err
    assert cli.ok("limit", "list").out.strip() == "No limits."
    assert await queue.list_limits() == []
