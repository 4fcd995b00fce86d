"""The installed ``dtq`` executable, task commands: submit (every flag, the expiration flags),
get, status, list, history, cancel, expire; both output modes and every exit code."""

from __future__ import annotations

import asyncio
import getpass
import re
import socket
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from dtq import keys
from dtq.config import Settings
from dtq.connection import sync_client
from dtq_tasks import Handler, TaskContext
from support import running_worker, wait_until
from support.cli import MISSING_ID, Cli, fast_settings, task_count

pytestmark = pytest.mark.backends("single", "cluster")

ACTOR = f"cli:{getpass.getuser()}@{socket.gethostname()}"


@pytest.fixture
def cli(settings: Settings) -> Cli:
    # The tests submit task types of their own (the seed's send_reminder, handlers run by an
    # in-process worker) that no module registers: no registry check, as DTQ_TASK_MODULES="".
    return Cli(settings.redis_url, cluster=settings.redis_cluster, DTQ_TASK_MODULES="")


def audit_entries(settings: Settings) -> list[dict[str, str]]:
    """The audit entries of the default queue's tasks, oldest first."""
    client = sync_client(settings, socket_timeout=5)
    try:
        return [fields for _, fields in client.xrange(keys.audit("default"))]
    finally:
        client.close()


def parse(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


# -- submit ---------------------------------------------------------------------------------------


def test_submit_prints_id_and_status_for_people_and_the_task_for_scripts(cli: Cli) -> None:
    run = cli.ok("submit", "--type", "echo_task", "--payload", '{"message": "hi"}')
    first = run.out.splitlines()[0]
    assert first.startswith("Submitted task ")
    task_id = first.split()[-1]
    assert "status: queued" in run.out
    assert "queue: default (priority 5)" in run.out
    assert "expires_at: never" in run.out

    doc = cli.ok("submit", "--type", "echo_task", "--payload", '{"n": 1}', "--json").json()
    assert doc["status"] == "queued" and doc["payload"] == {"n": 1} and doc["duplicate"] is False
    assert len(doc["task_id"]) == 32 and doc["task_id"] != task_id

    quiet = cli.ok("submit", "--type", "echo_task", "-q").out.strip()
    assert cli.ok("get", quiet, "--json").json()["status"] == "queued"


def test_submit_takes_every_flag_of_the_contract(cli: Cli) -> None:
    task_id = cli.submit(
        "--type", "echo_task", "--payload", '{"a": [1, 2]}', "--queue", "emails",
        "--idempotency-key", "order-7", "--max-attempts", "3", "--priority", "9",
        "--timeout-ms", "1500", "--metadata", '{"source": "cli"}',
    )  # fmt: skip
    task = cli.ok("get", task_id, "--json").json()
    assert task["queue"] == "emails"
    assert task["idempotency_key"] == "order-7"
    assert task["max_attempts"] == 3
    assert task["priority"] == 9
    assert task["timeout_ms"] == 1500
    assert task["metadata"] == {"source": "cli"}
    assert task["payload"] == {"a": [1, 2]}


@pytest.mark.backends("single", reason="where the payload is read from: no backend difference")
def test_payload_from_a_file_and_from_stdin(cli: Cli, tmp_path: Any) -> None:
    path = tmp_path / "payload.json"
    path.write_text('{"from": "file"}')
    from_file = cli.submit("--type", "echo_task", "--payload", f"@{path}")
    assert cli.ok("get", from_file, "--json").json()["payload"] == {"from": "file"}
    run = cli.ok("submit", "--type", "echo_task", "--payload", "-", "--json", stdin='{"s": 1}')
    assert run.json()["payload"] == {"s": 1}


def test_delay_and_schedule_make_a_pending_task(cli: Cli) -> None:
    delayed = cli.ok("submit", "--type", "echo_task", "--delay-seconds", "60")
    assert "status: pending" in delayed.out
    assert "available_at: " in delayed.out and "(in 1m)" in delayed.out

    at = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=2)
    until = at + timedelta(hours=1)
    doc = cli.ok(
        "submit", "--type", "meeting_reminder", "--schedule-at", at.isoformat(),
        "--expires-at", until.isoformat(), "--json",
    ).json()  # fmt: skip
    assert doc["status"] == "pending"
    assert parse(doc["available_at"]) == at
    assert parse(doc["expires_at"]) == until


@pytest.mark.backends("single", reason="parsing the --ttl forms: no backend difference")
@pytest.mark.parametrize(
    ("ttl", "seconds"),
    [("90s", 90), ("30m", 1800), ("1h", 3600), ("7d", 604800), ("1h30m", 5400), ("300", 300)],
)
def test_ttl_forms(cli: Cli, ttl: str, seconds: int) -> None:
    doc = cli.ok("submit", "--type", "echo_task", "--ttl", ttl, "--json").json()
    delta = parse(doc["expires_at"]) - parse(doc["created_at"])
    assert delta == timedelta(seconds=seconds)


@pytest.mark.backends("single", reason="formatting the deadline: no backend difference")
def test_status_shows_time_left_and_time_since_expiry(cli: Cli) -> None:
    soon = cli.submit("--type", "send_reminder", "--ttl", "2h30m")
    run = cli.ok("status", soon)
    assert "status: queued" in run.out
    line = next(ln for ln in run.out.splitlines() if "expires_at:" in ln)
    assert line.strip().startswith("expires_at: 20") and line.endswith("(in 2h 30m)")

    past = (datetime.now(UTC) - timedelta(minutes=5)).isoformat()
    gone = cli.submit("--type", "send_reminder", "--expires-at", past)
    run = cli.ok("status", gone)
    assert "status: expired" in run.out
    assert re.search(r"expires_at: 20\S+ \(expired 5m( \d+s)? ago\)", run.out), run.out
    assert "expired_at: " in run.out

    doc = cli.ok("status", soon, "--json").json()
    assert doc["status"] == "queued"
    assert 8900 < doc["expires_in_s"] <= 9000
    assert set(doc) >= {"task_id", "expires_at", "expired_at", "attempt", "now"}


def test_ttl_zero_is_accepted_and_never_runs(cli: Cli) -> None:
    doc = cli.ok("submit", "--type", "echo_task", "--ttl", "0", "--json").json()
    assert doc["status"] == "expired"
    assert cli.ok("list", "--status", "expired", "--json").json()["count"] == 1


def test_idempotency_in_progress_then_replay(cli: Cli) -> None:
    first = cli.submit("--type", "echo_task", "--idempotency-key", "k1")
    run = cli.fails(1, "submit", "--type", "echo_task", "--idempotency-key", "k1")
    assert "in progress" in run.err and first in run.err
    cli.ok("cancel", first)  # terminal: the key's record becomes "failed"
    replay = cli.ok("submit", "--type", "echo_task", "--idempotency-key", "k1")
    assert replay.out.startswith("Duplicate:") and first in replay.out
    doc = cli.ok("submit", "--type", "echo_task", "--idempotency-key", "k1", "--json").json()
    assert doc["duplicate"] is True and doc["task_id"] == first


def test_queue_full_is_refused_with_exit_1(cli: Cli) -> None:
    env = {"DTQ_MAX_QUEUE_DEPTH": "1"}
    cli.ok("submit", "--type", "echo_task", env=env)
    run = cli.fails(1, "submit", "--type", "echo_task", env=env)
    assert "full" in run.err


# -- invalid input: exit 2, nothing written --------------------------------------------------------


@pytest.mark.backends("single", reason="refused before any command reaches Redis")
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--payload", "{not json"], "not valid JSON"),
        (["--payload", "[1, 2]"], "must be a JSON object"),
        (["--payload", '"text"'], "must be a JSON object"),
        (["--payload", "@/nonexistent/payload.json"], "cannot read"),
        (["--ttl", "1x"], "not a duration"),
        (["--ttl", "h"], "not a duration"),
        (["--ttl=-5m"], "not a duration"),
        (["--ttl", "1.5h"], "not a duration"),
        (["--ttl", "30m1h"], "not a duration"),
        (["--ttl", ""], "not a duration"),
        (["--expires-at", "2026-01-28T17:00:00"], "has no UTC offset"),
        (["--expires-at", "tomorrow"], "not an ISO 8601"),
        (["--schedule-at", "2026-01-28T17:00:00"], "has no UTC offset"),
        (["--ttl", "1h", "--expires-at", "2030-01-01T00:00:00Z"], "not allowed with"),
        (["--delay-seconds", "5", "--schedule-at", "2030-01-01T00:00:00Z"], "not allowed with"),
        (["--delay-seconds", "-1"], "0 or more"),
        (["--priority", "10"], "priority"),
        (["--max-attempts", "0"], "at least 1"),
        (["--max-attempts", "11"], "DTQ_MAX_ATTEMPTS"),
        (["--queue", "Bad Queue"], "'Bad Queue' is not a valid queue name"),
        (["--metadata", '{"ttl_seconds": 5}', "--ttl", "5m"], "only one of"),
    ],
)
def test_invalid_submit_input_exits_2_and_writes_nothing(
    cli: Cli, settings: Settings, args: list[str], message: str
) -> None:
    run = cli.fails(2, "submit", "--type", "echo_task", *args)
    assert message in run.err
    assert task_count(settings) == 0


@pytest.mark.backends("single", reason="a size rule checked before Redis (test_submit: both)")
def test_payload_too_large_exits_2(cli: Cli, settings: Settings, tmp_path: Any) -> None:
    big = tmp_path / "big.json"
    big.write_text('{"blob": "' + "x" * 262_144 + '"}')  # over the default 262144 bytes
    run = cli.fails(2, "submit", "--type", "echo_task", "--payload", f"@{big}")
    assert "limit is 262144" in run.err
    small_limit = {"DTQ_MAX_PAYLOAD_BYTES": "16"}
    exact = '{"a":"12345678"}'
    assert len(exact.encode()) == 16
    cli.ok("submit", "--type", "echo_task", "--payload", exact, env=small_limit)
    run = cli.fails(2, "submit", "--type", "echo_task", "--payload", '{"a":"123456789"}',
                    env=small_limit)  # fmt: skip
    assert "17 bytes" in run.err
    assert task_count(settings) == 1


@pytest.mark.backends("single", reason="usage errors: refused before connecting")
def test_missing_type_and_bad_ids_are_usage_errors(cli: Cli) -> None:
    assert "--type" in cli.fails(2, "submit").err
    for command in ("get", "status", "history", "cancel", "expire"):
        assert "not a task id" in cli.fails(2, command, "not-an-id").err
    assert "status 'done' is not one of" in cli.fails(2, "list", "--status", "done").err
    assert "at least 1" in cli.fails(2, "list", "--limit", "0").err
    assert "--json" in cli.fails(2, "--json", "list").err  # --json goes after the command


# -- reads -----------------------------------------------------------------------------------------


def test_get_shows_every_field(cli: Cli) -> None:
    task_id = cli.submit("--type", "echo_task", "--payload", '{"k": "v"}', "--ttl", "1h")
    run = cli.ok("get", task_id)
    for key in ("task_id", "task_type", "status", "attempt", "created_at", "expires_at",
                "expired_at", "worker_id", "error_message", "payload", "result"):  # fmt: skip
        assert f"{key}: " in run.out
    assert '{"k":"v"}' in run.out
    doc = cli.ok("get", task_id, "--json").json()
    assert doc["task_id"] == task_id and doc["expired_at"] is None and doc["result"] is None


def test_reads_of_a_missing_task_exit_1(cli: Cli) -> None:
    for command in ("get", "status", "history", "cancel", "expire"):
        run = cli.fails(1, command, MISSING_ID)
        assert f"task {MISSING_ID} not found" in run.err
    assert cli.fails(1, "get", MISSING_ID, "--json").out == ""


def test_list_filters_and_both_modes(cli: Cli) -> None:
    a = cli.submit("--type", "echo_task", "--queue", "alpha")
    b = cli.submit("--type", "sleep_task", "--queue", "beta", "--ttl", "1h")
    c = cli.submit("--type", "echo_task", "--queue", "alpha", "--ttl", "0")
    table = cli.ok("list").out.splitlines()
    assert table[0].split() == [
        "TASK_ID", "TYPE", "QUEUE", "STATUS", "PRI", "ATTEMPT", "CREATED", "EXPIRES",
    ]  # fmt: skip
    assert [row.split()[0] for row in table[1:]] == [c, b, a]  # newest first
    assert table[0].index("STATUS") == table[1].index("expired")  # columns aligned

    def ids(*args: str) -> list[str]:
        return [t["task_id"] for t in cli.ok("list", *args, "--json").json()["tasks"]]

    assert ids("--queue", "alpha") == [c, a]
    assert ids("--status", "expired") == [c]
    assert ids("--type", "sleep_task") == [b]
    assert ids("--queue", "alpha", "--status", "queued") == [a]
    assert ids("--limit", "2") == [c, b]
    assert cli.ok("list", "--queue", "gamma").out.strip() == "No tasks."
    assert cli.ok("list", "--queue", "gamma", "--json").json() == {"count": 0, "tasks": []}


def test_history_one_line_per_version_like_the_seed(cli: Cli) -> None:
    task_id = cli.submit("--type", "send_reminder", "--delay-seconds", "60",
                         "--expires-at", "2030-01-28T17:00:00Z")  # fmt: skip
    cli.ok("expire", task_id)
    lines = cli.ok("history", task_id).out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(
        "Version 1: pending (created, expires_at: 2030-01-28T17:00:00.000Z) at 20"
    )
    assert lines[1].startswith("Version 2: expired (mark_expired, expired_at: 20")
    doc = cli.ok("history", task_id, "--json").json()
    assert doc["task_id"] == task_id
    assert [(v["version"], v["from"], v["to"]) for v in doc["versions"]] == [
        (1, None, "pending"),
        (2, "pending", "expired"),
    ]
    assert doc["versions"][0]["details"] == {"expires_at": "2030-01-28T17:00:00.000Z"}


# -- cancel and expire ----------------------------------------------------------------------------


def test_cancel_not_started_then_terminal(cli: Cli, settings: Settings) -> None:
    task_id = cli.submit("--type", "echo_task")
    assert cli.ok("cancel", task_id).out.strip() == f"Cancelled task {task_id}."
    assert cli.ok("get", task_id, "--json").json()["status"] == "cancelled"
    run = cli.fails(1, "cancel", task_id)
    assert "already cancelled" in run.err
    delayed = cli.submit("--type", "echo_task", "--delay-seconds", "30")
    doc = cli.ok("cancel", delayed, "--json").json()
    assert doc["outcome"] == "cancelled" and doc["task"]["status"] == "cancelled"
    entries = audit_entries(settings)
    assert [(e["action"], e["task_id"], e["actor"]) for e in entries] == [
        ("cancel", task_id, ACTOR),
        ("cancel", delayed, ACTOR),
    ]
    assert all(e["request_id"] for e in entries)


async def test_cancel_of_a_running_task_is_accepted_as_a_request(
    cli: Cli, settings: Settings
) -> None:
    started = asyncio.Event()

    async def hold(payload: dict[str, Any], ctx: TaskContext) -> None:
        started.set()
        await asyncio.sleep(30)

    async with running_worker(
        fast_settings(settings.redis_url, cluster=settings.redis_cluster),
        {"hold": Handler("hold", hold)},
        force_stop=True,
    ):
        task_id = cli.submit("--type", "hold")
        await asyncio.wait_for(started.wait(), 10)
        run = await asyncio.to_thread(cli.ok, "cancel", task_id)
        assert "is running: cancellation requested" in run.out

        async def cancelled() -> bool:
            doc = (await asyncio.to_thread(cli.ok, "get", task_id, "--json")).json()
            return bool(doc["status"] == "cancelled")

        await wait_until(cancelled, what="the running task cancelled by its worker")
    assert audit_entries(settings)[0]["action"] == "cancel"


def test_expire_marks_a_not_started_task_and_refuses_others(cli: Cli, settings: Settings) -> None:
    queued = cli.submit("--type", "echo_task")
    run = cli.ok("expire", queued)
    assert run.out.startswith(f"Marked task {queued} expired at 20")
    assert cli.ok("status", queued, "--json").json()["status"] == "expired"
    doc = cli.ok("expire", cli.submit("--type", "echo_task", "--delay-seconds", "9"), "--json")
    assert doc.json()["outcome"] == "expired"
    run = cli.fails(1, "expire", queued)
    assert "is expired" in run.err and "has not started" in run.err
    assert [e["action"] for e in audit_entries(settings)] == ["expire", "expire"]
    assert cli.ok("list", "--status", "expired", "--json").json()["count"] == 2
