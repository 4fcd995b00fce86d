"""The installed ``dtq`` executable, operator commands: dlq list, retry-dlq, discard-dlq,
purge-dlq, purge, queue pause/resume/stats; confirmations at a terminal; audit entries."""

from __future__ import annotations

import asyncio
import getpass
import socket
from typing import Any

import pytest

from dtq import Queue, keys
from dtq.config import Settings
from dtq.connection import sync_client
from dtq_tasks import Handler, PermanentError, TaskContext
from support import running_worker, wait_until
from support.cli import MISSING_ID, Cli, fast_settings

ACTOR = f"cli:{getpass.getuser()}@{socket.gethostname()}"


@pytest.fixture
def cli(settings: Settings) -> Cli:
    # The tests submit task types of their own (the seed's send_reminder, handlers run by an
    # in-process worker) that no module registers: no registry check, as DTQ_TASK_MODULES="".
    return Cli(settings.redis_url, cluster=settings.redis_cluster, DTQ_TASK_MODULES="")


def audit_actions(settings: Settings, queue: str = "default") -> list[tuple[str, str, str]]:
    """(action, task_id or queue, actor) of every audit entry of operations on ``queue`` (on a
    cluster; the flat layout has one audit stream), oldest first."""
    client = sync_client(settings, socket_timeout=5)
    try:
        rows = client.xrange(keys.audit(queue))
    finally:
        client.close()
    return [(f["action"], f.get("task_id") or f.get("queue", ""), f["actor"]) for _, f in rows]


async def dead_letter(cli: Cli, settings: Settings, queue: Queue, count: int) -> list[str]:
    """``count`` tasks dead-lettered by a real worker (a handler that fails permanently)."""

    async def boom(payload: dict[str, Any], ctx: TaskContext) -> None:
        raise PermanentError(f"cannot handle {payload}")

    ids = []
    async with running_worker(
        fast_settings(settings.redis_url, cluster=settings.redis_cluster),
        {"boom": Handler("boom", boom)},
        force_stop=True,
    ):
        for n in range(count):
            run = await asyncio.to_thread(
                cli.ok, "submit", "--type", "boom", "--payload", f'{{"n": {n}}}', "--json"
            )
            ids.append(run.json()["task_id"])

        async def all_dead() -> bool:
            tasks = [await queue.get(i) for i in ids]
            return all(t.status == "dead_lettered" for t in tasks)

        await wait_until(all_dead, what="the tasks dead-lettered")
    return ids


@pytest.mark.backends("single", "cluster")
async def test_dlq_list_retry_discard_purge(cli: Cli, settings: Settings, queue: Queue) -> None:
    a, b, c = await dead_letter(cli, settings, queue, 3)

    table = cli.ok("dlq", "list").out.splitlines()
    assert table[0].split() == ["TASK_ID", "TYPE", "QUEUE", "ATTEMPTS", "FAILED", "ERROR"]
    assert {row.split()[0] for row in table[1:]} == {a, b, c}
    assert "PermanentError: cannot handle" in table[1]
    doc = cli.ok("dlq", "list", "--json").json()
    assert doc["count"] == 3
    assert set(doc["entries"][0]) >= {"task_id", "task_type", "last_error", "failed_at", "queue"}
    assert cli.ok("dlq", "list", "--limit", "2", "--json").json()["count"] == 2

    run = cli.ok("retry-dlq", a)
    assert run.out.startswith(f"Requeued task {a} on queue default")
    task = cli.ok("get", a, "--json").json()
    assert task["status"] == "queued" and task["attempt"] == 0
    assert task["metadata"]["previous_attempts"]
    assert "not in the dead-letter queue" in cli.fails(1, "retry-dlq", a).err.replace("DLQ", "")

    doc = cli.ok("discard-dlq", b, "--json").json()
    assert doc["outcome"] == "discarded"
    task = cli.ok("get", b, "--json").json()
    assert task["status"] == "dead_lettered" and task["metadata"]["discarded"] is True
    cli.fails(1, "discard-dlq", b)
    cli.fails(1, "retry-dlq", MISSING_ID)
    cli.fails(1, "discard-dlq", MISSING_ID)
    assert [e["task_id"] for e in cli.ok("dlq", "list", "--json").json()["entries"]] == [c]

    run = cli.fails(2, "purge-dlq")  # stdin is not a terminal, no --yes
    assert "without --yes" in run.err
    assert cli.ok("dlq", "list", "--json").json()["count"] == 1
    assert cli.ok("purge-dlq", "--yes").out.strip() == (
        "Purged the dead-letter queue: 1 entries removed."
    )
    assert cli.ok("dlq", "list").out.strip() == "The dead-letter queue is empty."
    assert cli.ok("purge-dlq", "--yes", "--json").json() == {"outcome": "purged", "removed": 0}

    assert [(act, who) for act, _, who in audit_actions(settings)] == [
        ("dlq_requeue", ACTOR),
        ("dlq_discard", ACTOR),
        ("dlq_purge", ACTOR),
        ("dlq_purge", ACTOR),
    ]


def test_purge_cancels_the_waiting_tasks_of_one_queue(cli: Cli, settings: Settings) -> None:
    waiting = [cli.submit("--type", "echo_task", "--queue", "emails") for _ in range(2)]
    delayed = cli.submit("--type", "echo_task", "--queue", "emails", "--delay-seconds", "60")
    other = cli.submit("--type", "echo_task")

    assert "without --yes" in cli.fails(2, "purge", "--queue", "emails").err
    assert cli.fails(2, "purge", "--yes").code == 2  # --queue is required
    run = cli.ok("purge", "--queue", "emails", "--yes")
    assert run.out.strip() == "Purged queue emails: 3 tasks cancelled."
    for task_id in [*waiting, delayed]:
        task = cli.ok("get", task_id, "--json").json()
        assert task["status"] == "cancelled" and task["metadata"]["purged"] is True
    assert cli.ok("get", other, "--json").json()["status"] == "queued"
    doc = cli.ok("purge", "--queue", "emails", "--yes", "--json").json()
    assert doc == {"queue": "emails", "outcome": "purged", "cancelled": 0}
    assert audit_actions(settings) == [("purge", "emails", ACTOR), ("purge", "emails", ACTOR)]


def test_purges_ask_for_a_typed_confirmation_on_a_terminal(cli: Cli, settings: Settings) -> None:
    task_id = cli.submit("--type", "echo_task", "--queue", "emails")
    run = cli.tty("purge", "--queue", "emails", typed="yes\n")
    assert run.code == 1
    assert "Type 'emails' to confirm" in run.err and "not confirmed" in run.err
    assert cli.ok("get", task_id, "--json").json()["status"] == "queued"
    assert audit_actions(settings) == []

    run = cli.tty("purge", "--queue", "emails", typed="emails\n")
    assert run.code == 0, run.err
    assert run.out.strip() == "Purged queue emails: 1 tasks cancelled."
    assert cli.ok("get", task_id, "--json").json()["status"] == "cancelled"

    assert cli.tty("purge-dlq", typed="no\n").code == 1
    run = cli.tty("purge-dlq", typed="dead-letter\n")
    assert run.code == 0 and "0 entries removed" in run.out
    assert [a for a, _, _ in audit_actions(settings)] == ["purge", "dlq_purge"]


def test_queue_pause_resume_and_stats(cli: Cli, settings: Settings) -> None:
    assert cli.ok("queue", "stats").out.strip().startswith("No queues yet")
    assert cli.ok("queue", "stats", "--json").json() == {"queues": []}
    cli.submit("--type", "echo_task", "--queue", "emails")
    cli.submit("--type", "echo_task", "--queue", "emails", "--delay-seconds", "60")
    cli.submit("--type", "echo_task")

    assert cli.ok("queue", "pause", "emails").out.strip() == "Queue emails paused."
    assert cli.ok("queue", "pause", "emails").out.strip() == "Queue emails was already paused."
    table = cli.ok("queue", "stats").out.splitlines()
    assert table[0].split() == [
        "QUEUE", "DEPTH", "WAITING", "IN_FLIGHT", "DELAYED", "PAUSED", "WORKERS",
    ]  # fmt: skip
    assert table[1].split() == ["default", "1", "1", "0", "0", "no", "0"]
    assert table[2].split() == ["emails", "1", "1", "0", "1", "yes", "0"]
    assert table[3] == "dead-letter queue: 0 entries"

    one = cli.ok("queue", "stats", "emails", "--json").json()
    assert one == {
        "queue": "emails", "depth": 1, "pending": 0, "waiting": 1, "paused": True,
        "retry_scheduled": 1, "dlq_depth": 0, "workers_active": 0,
    }  # fmt: skip
    every = cli.ok("queue", "stats", "--json").json()
    assert [q["queue"] for q in every["queues"]] == ["default", "emails"]

    doc = cli.ok("queue", "resume", "emails", "--json").json()
    assert doc == {"queue": "emails", "paused": False, "changed": True}
    assert cli.ok("queue", "resume", "emails").out.strip() == "Queue emails was already running."
    assert cli.ok("queue", "stats", "emails", "--json").json()["paused"] is False
    assert [(a, q) for a, q, _ in audit_actions(settings)] == [
        ("queue_pause", "emails"),
        ("queue_pause", "emails"),
        ("queue_resume", "emails"),
        ("queue_resume", "emails"),
    ]
    assert "is not a valid queue name" in cli.fails(2, "queue", "pause", "Emails!").err
    assert "is not a valid queue name" in cli.fails(2, "queue", "stats", "_bad").err
