"""The installed ``dtq`` executable, schedule commands: add, update, list, show, pause, resume,
remove, trigger, next; tables and --json; bad input and unknown schedules with their exit
codes; audit entries; a schedule the CLI stores is the one the SDK reads."""

from __future__ import annotations

import getpass
import itertools
import re
import socket
from datetime import UTC, datetime, timedelta

import pytest

from dtq import Queue, keys
from dtq.admin.schedules import put_schedule
from dtq.config import Settings
from dtq.connection import sync_client
from dtq.schedules import ScheduleDef
from dtq_cli.parser import build_parser
from dtq_cli.schedule_args import DEFINITION_FIELDS
from support.cli import Cli

pytestmark = pytest.mark.backends("single", "cluster")

ACTOR = f"cli:{getpass.getuser()}@{socket.gethostname()}"


@pytest.fixture
def cli(settings: Settings) -> Cli:
    # Task types of the tests' own (no module registers them): no registry check.
    return Cli(settings.redis_url, cluster=settings.redis_cluster, DTQ_TASK_MODULES="")


def audit_actions(settings: Settings, queue: str = "default") -> list[tuple[str, str]]:
    """(action, actor) of every audit entry of operations on ``queue``, oldest first."""
    client = sync_client(settings, socket_timeout=5)
    try:
        rows = client.xrange(keys.audit(queue))
    finally:
        client.close()
    return [(f["action"], f["actor"]) for _, f in rows]


def iso(text: str) -> datetime:
    return datetime.fromisoformat(text)


@pytest.mark.backends("single", reason="parses arguments only")
def test_every_definition_field_has_a_flag_of_add_and_update() -> None:
    """add and update pass every parsed value named like a ScheduleDef field."""
    assert set(DEFINITION_FIELDS) == set(ScheduleDef.model_fields)
    parser = build_parser()
    for command in ("add", "update"):
        args = parser.parse_args(["schedule", command, "s", "--every", "5m", "--task-type", "t"])
        assert set(DEFINITION_FIELDS) <= set(vars(args)), command


async def test_add_stores_what_the_sdk_reads_back(cli: Cli, queue: Queue) -> None:
    run = cli.ok(
        "schedule", "add", "report",
        "--cron", "0  7 * * 1-5", "--tz", "Europe/Paris", "--task-type", "report",
        "-p", '{"kind": "daily"}', "--queue", "emails", "--priority", "7",
        "--max-attempts", "3", "--timeout-ms", "60000", "--metadata", '{"team": "ops"}',
        "--ttl", "1h", "--overlap", "allow", "--catchup", "all", "--catchup-window", "2h",
        "--grace", "30s", "--start", "2030-01-01T00:00:00Z", "--end", "2031-01-01T00:00:00Z",
    )  # fmt: skip
    lines = run.out.splitlines()
    assert lines[0] == "Created schedule report."
    assert "spec: 0 7 * * 1-5 (Europe/Paris)" in run.out
    assert "task: report on queue emails" in run.out
    assert "next_fire_at: 2030-01-01T06:00:00Z" in run.out  # the first weekday 07:00 in Paris

    s = await queue.get_schedule("report")
    assert s.origin == "api" and s.state == "active"
    assert s.definition == ScheduleDef(
        cron="0 7 * * 1-5", tz="Europe/Paris", task_type="report", payload={"kind": "daily"},
        queue="emails", priority=7, max_attempts=3, timeout_ms=60_000,
        metadata={"team": "ops"}, ttl_seconds=3600, overlap="allow", catchup="all",
        catchup_window_s=7200, grace_s=30, start_at=datetime(2030, 1, 1, tzinfo=UTC),
        end_at=datetime(2031, 1, 1, tzinfo=UTC), paused=False,
    )  # fmt: skip

    doc = cli.ok("schedule", "add", "poll", "--every", "90s", "--task-type", "poll",
                 "--paused", "--json").json()  # fmt: skip
    assert doc["name"] == "poll" and doc["outcome"] == "created"
    assert doc["schedule"]["state"] == "paused"
    assert doc["schedule"]["definition"]["every"] == 90
    assert (await queue.get_schedule("poll")).definition.paused is True

    run = cli.fails(1, "schedule", "add", "poll", "--every", "5m", "--task-type", "other")
    assert run.err.startswith("dtq: error: schedule 'poll' exists")
    assert "dtq schedule update poll" in run.err and run.out == ""
    assert (await queue.get_schedule("poll")).definition.task_type == "poll"
    assert audit_actions(settings=queue.store.settings, queue="emails")[0] == (
        "schedule_put",
        ACTOR,
    )


async def test_update_keeps_what_it_is_not_given(cli: Cli, queue: Queue) -> None:
    cli.ok("schedule", "add", "poll", "--every", "5m", "--task-type", "poll",
           "--payload", '{"a": 1}', "--priority", "8", "--overlap", "buffer_one")  # fmt: skip
    run = cli.ok("schedule", "update", "poll", "--max-attempts", "2")
    assert run.out.splitlines()[0] == "Updated schedule poll."
    d = (await queue.get_schedule("poll")).definition
    assert (d.every, d.payload, d.priority, d.overlap, d.max_attempts) == (
        300,
        {"a": 1},
        8,
        "buffer_one",
        2,
    )
    assert cli.ok("schedule", "update", "poll", "--max-attempts", "2").out.startswith(
        "Schedule poll unchanged."
    )
    doc = cli.ok("schedule", "update", "poll", "--cron", "*/5 * * * *", "--tz",
                 "America/New_York", "--json").json()  # fmt: skip
    assert doc["outcome"] == "updated"
    d = (await queue.get_schedule("poll")).definition
    assert (d.cron, d.tz, d.every, d.payload, d.priority) == (
        "*/5 * * * *",
        "America/New_York",
        None,
        {"a": 1},
        8,
    )
    cli.ok("schedule", "update", "poll", "--every", "1h", "--anchor", "2026-01-01T00:30:00Z")
    d = (await queue.get_schedule("poll")).definition
    assert (d.cron, d.tz, d.every) == (None, "UTC", 3600)
    assert d.anchor == datetime(2026, 1, 1, 0, 30, tzinfo=UTC)

    cli.ok("schedule", "update", "poll", "--paused")
    assert (await queue.get_schedule("poll")).state == "paused"
    cli.ok("schedule", "update", "poll", "--priority", "1")  # no --paused: the state stays
    s = await queue.get_schedule("poll")
    assert s.state == "paused" and s.definition.priority == 1

    # A schedule from code: changed, with a note that a starting worker puts the code's back.
    await put_schedule(queue.store, "coded", {"every": 60, "task_type": "t"}, source="code")
    run = cli.ok("schedule", "update", "coded", "--priority", "2")
    assert "is declared in code" in run.err and run.out.startswith("Updated schedule coded.")
    assert (await queue.get_schedule("coded")).definition.priority == 2

    run = cli.fails(1, "schedule", "update", "nope", "--priority", "1")
    assert run.err.strip() == "dtq: error: schedule 'nope' not found"
    # A tz on an interval schedule: refused by the core, nothing changed.
    assert "tz goes with cron" in cli.fails(2, "schedule", "update", "poll", "--tz", "UTC+1").err
    assert (await queue.get_schedule("poll")).definition.tz == "UTC"


@pytest.mark.backends("single", reason="refused before any key is written")
def test_bad_input_is_one_line_and_exit_2(cli: Cli) -> None:
    add = ("schedule", "add", "s", "--task-type", "t")
    cases = {
        ("--cron", "61 * * * *"): "cron '61 * * * *'",
        ("--cron", "* * *"): "has 3 fields",
        ("--cron", "0 7 * * *", "--tz", "Mars/Olympus"): "Mars/Olympus",
        ("--every", "5x"): "every '5x'",
        ("--every", "0"): "every '0'",
        ("--every", "5m", "--overlap", "never"): "overlap",
        ("--every", "5m", "--catchup", "some"): "catchup",
        ("--every", "5m", "--ttl", "0"): "ttl_seconds",
        ("--every", "5m", "--start", "2030-01-02T00:00:00Z", "--end", "2030-01-01T00:00:00Z"):
            "end_at must be after start_at",
        ("--every", "5m", "--metadata", '{"schedule": "x"}'): "metadata.schedule",
    }  # fmt: skip
    for extra, text in cases.items():
        run = cli.fails(2, *add, *extra)
        assert run.err.startswith("dtq: error: "), run.err
        assert len(run.err.strip().splitlines()) == 1, run.err
        assert text in run.err, (extra, run.err)
        assert run.out == ""
    # argparse's usage errors: both specs, neither, a naive time, a bad name.
    assert (
        "not allowed with argument"
        in cli.fails(2, *add, "--cron", "* * * * *", "--every", "5m").err
    )
    assert "one of the arguments --cron --every is required" in cli.fails(2, *add).err
    assert "has no UTC offset" in cli.fails(2, *add, "--every", "5m", "--start", "2030-01-01").err
    assert (
        "is not a valid schedule name"
        in cli.fails(2, "schedule", "add", "Bad Name", "--every", "5m", "--task-type", "t").err
    )
    assert "is not a duration" in cli.fails(2, *add, "--every", "5m", "--grace", "soon").err
    assert cli.ok("schedule", "list", "--json").json() == {"count": 0, "schedules": []}


@pytest.mark.backends("single", reason="the registry check runs before any key is written")
def test_add_checks_the_task_type_against_the_task_modules(cli: Cli) -> None:
    run = cli.fails(2, "schedule", "add", "s", "--every", "5m", "--task-type", "no_such_type",
                    env={"DTQ_TASK_MODULES": "examples.tasks"})  # fmt: skip
    assert "task_type 'no_such_type' is not registered" in run.err
    cli.ok("schedule", "add", "s", "--every", "5m", "--task-type", "echo_task",
           env={"DTQ_TASK_MODULES": "examples.tasks"})  # fmt: skip


async def test_list_and_show(cli: Cli, queue: Queue) -> None:
    assert cli.ok("schedule", "list").out.strip() == "No schedules."
    cli.ok("schedule", "add", "soon", "--every", "1h", "--task-type", "hourly")
    cli.ok("schedule", "add", "later", "--cron", "0 3 * * *", "--tz", "Europe/Paris",
           "--task-type", "nightly", "--queue", "emails")  # fmt: skip
    cli.ok("schedule", "add", "held", "--every", "5m", "--task-type", "t", "--paused")
    cli.ok("schedule", "trigger", "soon")

    table = cli.ok("schedule", "list").out.splitlines()
    assert table[0].split() == [
        "NAME", "SPEC", "QUEUE", "TASK_TYPE", "STATE", "NEXT", "LAST_FIRED",
        "FIRED/SKIPPED/MISSED",
    ]  # fmt: skip
    rows = {line.split()[0]: line for line in table[1:]}
    assert set(rows) == {"soon", "later", "held"}
    assert table[-1].startswith("held")  # paused ones last
    assert "every 1h" in rows["soon"] and " hourly " in rows["soon"]
    assert rows["soon"].split()[-1] == "1/0/0"
    # LAST_FIRED is relative to the CLI's clock: "now" within a second, "1s ago" on a slow run
    assert re.search(r" (now|\d+s ago) +1/0/0$", rows["soon"]), rows["soon"]
    assert "0 3 * * * (Europe/Paris)" in rows["later"] and " emails " in rows["later"]
    assert " paused " in rows["held"]

    doc = cli.ok("schedule", "list", "--json").json()
    assert doc["count"] == 3
    by_name = {s["name"]: s for s in doc["schedules"]}
    assert by_name["soon"]["fired"] == 1 and by_name["soon"]["last_task_id"]
    assert by_name["later"]["definition"]["tz"] == "Europe/Paris"
    assert "history" not in by_name["soon"]
    assert cli.ok("schedule", "list", "--limit", "1", "--json").json()["count"] == 1

    out = cli.ok("schedule", "show", "later").out
    assert "spec: 0 3 * * * (Europe/Paris)" in out
    assert "queue: emails (priority 5)" in out
    assert "catchup: latest (window 1h)" in out
    lines = out.splitlines()
    at = lines.index("next 5 fire times:")
    times = lines[at + 1 : at + 6]
    assert all(line.startswith("  20") for line in times) and lines[at + 6] == ""
    assert all("03:00:00 CE" in line for line in times)  # local time in the zone, CET or CEST
    assert "last firings: none in the history" in out
    assert "history (newest first):" in out and "  created" in out

    soon = await queue.get_schedule("soon")
    out = cli.ok("schedule", "show", "soon").out
    assert f"task {soon.last_task_id} (manual)" in out
    assert "triggered" in out and f"task_id: {soon.last_task_id}" in out

    doc = cli.ok("schedule", "show", "later", "--json").json()
    assert doc["name"] == "later" and doc["state"] == "active"
    assert [iso(t) for t in doc["next_fire_times"]] == await queue.next_fire_times("later", 5)
    assert [e["decision"] for e in doc["history"]] == ["created"]
    doc = cli.ok("schedule", "show", "held", "--json").json()
    assert doc["state"] == "paused" and doc["next_fire_times"] == []
    assert (
        cli.ok("schedule", "show", "soon", "--history", "1", "--json").json()["history"][0][
            "decision"
        ]
        == "triggered"
    )

    assert cli.fails(1, "schedule", "show", "nope").err.strip() == (
        "dtq: error: schedule 'nope' not found"
    )


async def test_pause_resume_remove_and_audit(cli: Cli, queue: Queue, settings: Settings) -> None:
    cli.ok("schedule", "add", "poll", "--every", "5m", "--task-type", "poll")
    assert cli.ok("schedule", "pause", "poll").out.strip() == "Schedule poll paused."
    assert cli.ok("schedule", "pause", "poll").out.strip() == "Schedule poll was already paused."
    assert (await queue.get_schedule("poll")).state == "paused"
    doc = cli.ok("schedule", "resume", "poll", "--json").json()
    assert doc == {"name": "poll", "paused": False, "changed": True}
    assert cli.ok("schedule", "resume", "poll").out.strip() == "Schedule poll was already active."
    assert (await queue.get_schedule("poll")).state == "active"
    # An unknown schedule: refused before remove asks (or refuses to ask) for a confirmation.
    for action in ("pause", "resume", "remove", "trigger"):
        run = cli.fails(1, "schedule", action, "nope")
        assert run.err.strip() == "dtq: error: schedule 'nope' not found", action

    run = cli.fails(2, "schedule", "remove", "poll")  # stdin is not a terminal, no --yes
    assert "without --yes" in run.err
    run = cli.tty("schedule", "remove", "poll", typed="yes\n")
    assert run.code == 1 and "Type 'poll' to confirm" in run.err and "not confirmed" in run.err
    await queue.get_schedule("poll")  # still there
    run = cli.tty("schedule", "remove", "poll", typed="poll\n")
    assert run.code == 0, run.err
    assert run.out.strip() == "Deleted schedule poll (the tasks it fired stay)."
    assert cli.ok("schedule", "list", "--json").json()["count"] == 0

    cli.ok("schedule", "add", "poll", "--every", "5m", "--task-type", "poll")
    doc = cli.ok("schedule", "remove", "poll", "--yes", "--json").json()
    assert doc == {"name": "poll", "outcome": "deleted"}
    assert audit_actions(settings) == [
        ("schedule_put", ACTOR),
        ("schedule_pause", ACTOR),
        ("schedule_resume", ACTOR),
        ("schedule_delete", ACTOR),
        ("schedule_put", ACTOR),
        ("schedule_delete", ACTOR),
    ]


async def test_trigger_prints_the_task_once_per_key(cli: Cli, queue: Queue) -> None:
    cli.ok("schedule", "add", "report", "--cron", "0 7 * * *", "--task-type", "report",
           "--payload", '{"kind": "daily"}', "--paused")  # fmt: skip
    run = cli.ok("schedule", "trigger", "report")
    assert run.out.startswith("Triggered schedule report: task ") and "(queued)" in run.out
    task_id = run.out.split("task ")[1].split()[0]
    task = await queue.get(task_id)
    assert task.payload == {"kind": "daily"}
    assert task.metadata["schedule"] == "report" and task.metadata["trigger"] == "manual"

    doc = cli.ok("schedule", "trigger", "report", "--key", "rerun-1", "--json").json()
    assert doc["outcome"] == "triggered" and doc["name"] == "report"
    first = doc["task"]["task_id"]
    assert first != task_id and doc["task"]["task_type"] == "report"
    doc = cli.ok("schedule", "trigger", "report", "--key", "rerun-1", "--json").json()
    assert doc["outcome"] == "duplicate" and doc["task"]["task_id"] == first
    run = cli.ok("schedule", "trigger", "report", "--key", "rerun-1")
    assert run.out.strip() == (
        f"Duplicate: key 'rerun-1' of schedule report already fired task {first}; "
        "nothing new was submitted."
    )
    assert (await queue.get_schedule("report")).fired == 2


async def test_next_of_a_schedule_and_of_a_spec(cli: Cli, queue: Queue) -> None:
    cli.ok("schedule", "add", "poll", "--every", "90s", "--task-type", "poll")
    doc = cli.ok("schedule", "next", "poll", "-n", "3", "--json").json()
    assert doc["name"] == "poll"
    times = [iso(t) for t in doc["fire_times"]]
    assert times == await queue.next_fire_times("poll", 3)
    assert [b - a for a, b in itertools.pairwise(times)] == [timedelta(seconds=90)] * 2
    lines = cli.ok("schedule", "next", "poll", "-n", "2").out.splitlines()
    assert len(lines) == 2 and lines[0].startswith(times[0].strftime("%Y-%m-%dT%H:%M"))
    assert "(in " in lines[1]

    # Spring forward in Paris: 02:30 does not exist on 2030-03-31; it fires once, at 03:00.
    doc = cli.ok("schedule", "next", "--cron", "30 2 * * *", "--tz", "Europe/Paris", "-n",
                 "400", "--json").json()  # fmt: skip
    assert doc["name"] is None
    fires = [iso(t) for t in doc["fire_times"]]
    assert fires == await queue.preview_schedule(
        {"cron": "30 2 * * *", "tz": "Europe/Paris", "task_type": "x"}, 400
    )
    spring = [t for t in fires if t.date() == datetime(2030, 3, 31).date()]
    if spring:  # within the next 400 days of the test's clock
        assert spring == [datetime(2030, 3, 31, 1, 0, tzinfo=UTC)]
    out = cli.ok("schedule", "next", "--cron", "30 2 * * *", "--tz", "Europe/Paris", "-n", "1").out
    assert " 02:30:00 CE" in out or " 03:00:00 CEST" in out

    every = cli.ok("schedule", "next", "--every", "1h", "-n", "2", "--json").json()["fire_times"]
    assert [iso(t).minute for t in every] == [0, 0]  # aligned to the epoch
    assert cli.ok("schedule", "list", "--json").json()["count"] == 1  # nothing stored

    assert "not both" in cli.fails(2, "schedule", "next", "poll", "--every", "5m").err
    assert "give a schedule name" in cli.fails(2, "schedule", "next").err
    assert "every '5x'" in cli.fails(2, "schedule", "next", "--every", "5x").err
    assert (
        "Mars/Olympus"
        in cli.fails(2, "schedule", "next", "--cron", "* * * * *", "--tz", "Mars/Olympus").err
    )
    assert cli.fails(1, "schedule", "next", "nope").err.strip() == (
        "dtq: error: schedule 'nope' not found"
    )
    cli.ok("schedule", "add", "over", "--every", "1h", "--task-type", "t",
           "--end", "2000-01-01T00:00:00Z", "--start", "1999-01-01T00:00:00Z")  # fmt: skip
    assert cli.ok("schedule", "next", "over").out.strip() == (
        "No fire time left (the schedule has ended)."
    )
