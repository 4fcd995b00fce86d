"""The argparse tree of ``dtq``: every command and flag of contract section 12 (DESIGN 1, 9), the
expiration flags of task-expiration.md, and a help text with an example for each command.

Each subcommand sets ``cmd`` (a dotted name the CLI dispatches on); nothing here does I/O.
"""

from __future__ import annotations

import argparse

from dtq_cli import inputs, limit_cmd, schedule_args, workflow_cmd
from dtq_cli.flags import (
    DEFAULT_WAIT_S,
    FMT,
    json_flag,
    sub,
    task_id_flag,
    template_flags,
    wait_timeout_flag,
    yes_flag,
)

__all__ = ["build_parser"]

MAIN_EPILOG = """\
examples:
  dtq submit --type echo_task --payload '{"message": "hi"}' --ttl 1h30m
  dtq submit --type echo_task --payload '{"message": "hi"}' --wait
  dtq status 3f2a9c0d5e6f47a8b9c0d1e2f3a4b5c6
  dtq wait 3f2a9c0d5e6f47a8b9c0d1e2f3a4b5c6 --timeout 300
  dtq list --status expired
  dtq history 3f2a9c0d5e6f47a8b9c0d1e2f3a4b5c6
  dtq cancel 3f2a9c0d5e6f47a8b9c0d1e2f3a4b5c6
  dtq dlq list
  dtq queue stats --json
  dtq schedule add nightly --cron '0 3 * * *' --tz Europe/Paris --task-type cleanup
  dtq schedule list
  dtq limit set charge --task-type charge --rate 100/s --concurrency 20
  dtq workflow submit pipeline.json
  dtq worker run --queue default --concurrency 8
  dtq dev

Each command has its own help with an example: dtq <command> --help.
Read commands print tables for people; add --json after the command for one JSON document.
Colour is used only on a terminal, never when NO_COLOR is set.

exit codes:
  0  success (a cancel of a running task is accepted as a request: 0 too)
  1  refused by the system's state (not found, already finished, queue full, conflict)
     or Redis unreachable; wait and submit --wait: the task did not succeed, or the
     timeout passed
  2  invalid input (flags, payload, duration, date-time, a workflow file) or invalid
     DTQ_* configuration

environment: DTQ_REDIS_URL (default redis://localhost:6379/0) and the other DTQ_* settings.
Full reference: docs/cli.md
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dtq",
        description="dtq: a distributed task queue on Redis Streams. "
        "This command talks to Redis directly (DTQ_REDIS_URL).",
        epilog=MAIN_EPILOG,
        formatter_class=FMT,
    )
    parser.add_argument("--version", action="version", version="%(prog)s 0.1.0")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an unexpected error"
    )
    subs = parser.add_subparsers(dest="command", metavar="<command>", required=True)
    _task_commands(subs)
    _dlq_commands(subs)
    _queue_commands(subs)
    schedule_args.add_commands(subs)
    limit_cmd.add_commands(subs)
    workflow_cmd.add_commands(subs)
    _process_commands(subs)
    return parser


def _task_commands(subs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub(
        subs,
        "submit",
        "Submit a task",
        """\
          dtq submit --type echo_task --payload '{"message": "hi"}'
          dtq submit --type send_reminder --payload @reminder.json --ttl 1h30m
          dtq submit --type meeting_reminder --schedule-at 2026-01-28T17:00:00Z \\
                     --expires-at 2026-01-28T18:00:00Z --json
          dtq submit --type echo_task --payload '{"message": "hi"}' --wait --timeout 30
        """,
        """\
        Prints the new task's id and status. A replay of an idempotency key prints the task it
        already belongs to (exit 0). --ttl counts from ingest on the Redis clock; --ttl 0 submits
        a task that is already expired and never runs.

        With --wait it then waits for the task to end and prints the handler's result (JSON;
        with --json the finished task): exit 0 when it succeeded; 1 when it failed, was
        dead-lettered, cancelled or expired (the error on stderr) or --timeout passed.
        """,
    )
    p.set_defaults(cmd="submit")
    p.add_argument("--type", dest="task_type", required=True, help="registered task type")
    template_flags(p, defaults=True)
    p.add_argument("--idempotency-key", metavar="KEY", help="one logical task per (queue, key)")
    start = p.add_mutually_exclusive_group()
    start.add_argument(
        "--delay-seconds", type=inputs.nonneg_float, default=0, metavar="S", help="run after S s"
    )
    start.add_argument(
        "--schedule-at", type=inputs.when, metavar="TIME", help="run at TIME (ISO 8601, offset)"
    )
    deadline = p.add_mutually_exclusive_group()
    deadline.add_argument(
        "--ttl",
        type=inputs.ttl,
        metavar="DURATION",
        help="expire if not started within DURATION: 90s, 30m, 1h, 7d, 1h30m",
    )
    deadline.add_argument(
        "--expires-at",
        type=inputs.when,
        metavar="TIME",
        help="expire if not started by TIME, ISO 8601 with an offset: 2026-01-28T17:00:00Z",
    )
    json_flag(p)
    p.add_argument("-q", "--quiet", action="store_true", help="print only the task id")
    p.add_argument("--wait", action="store_true", help="wait for the task to end, print its result")
    wait_timeout_flag(p, default=None, when="with --wait: ")

    p = sub(subs, "get", "Show a task in full, with its execution metadata and result",
             "  dtq get 3f2a9c0d5e6f47a8b9c0d1e2f3a4b5c6 --json")  # fmt: skip
    p.set_defaults(cmd="get")
    task_id_flag(p)
    json_flag(p)

    p = sub(
        subs,
        "status",
        "Show a task's state, attempts and deadlines, with times relative to now",
        "  dtq status 3f2a9c0d5e6f47a8b9c0d1e2f3a4b5c6\n"
        "  # ...  expires_at: 2026-01-28T17:00:00Z (in 2h 30m)",
    )
    p.set_defaults(cmd="status")
    task_id_flag(p)
    json_flag(p)

    p = sub(
        subs,
        "wait",
        "Wait until a task has ended, then show it as dtq status does",
        "  dtq wait 3f2a9c0d5e6f47a8b9c0d1e2f3a4b5c6 --timeout 300",
        """\
        Exit 0 when the task succeeded; 1 when it failed, was dead-lettered, cancelled or
        expired, or when --timeout passed first ("timed out after S s" on stderr, the task as
        it is on stdout); 1 for an unknown task. The wake-up is pushed by Redis: nothing polls.
        """,
    )
    p.set_defaults(cmd="wait")
    task_id_flag(p)
    wait_timeout_flag(p, default=DEFAULT_WAIT_S)
    json_flag(p)

    p = sub(
        subs,
        "list",
        "List recent tasks, newest first",
        """\
          dtq list --status expired
          dtq list --queue emails --type send_reminder --limit 100 --json
        """,
    )
    p.set_defaults(cmd="list")
    p.add_argument("--queue", type=inputs.queue_name)
    p.add_argument("--status", type=inputs.status_name, help="pending, queued, ..., expired")
    p.add_argument("--type", dest="task_type", help="task type")
    p.add_argument("--limit", type=inputs.positive_int, default=50, metavar="N", help="default 50")
    json_flag(p)

    p = sub(
        subs,
        "history",
        "Print every state change of a task, oldest first, one line per version",
        "  dtq history 3f2a9c0d5e6f47a8b9c0d1e2f3a4b5c6\n"
        "  # Version 1: pending (created, expires_at: 2026-01-28T17:00:00Z) at ...\n"
        "  # Version 2: expired (ttl, expired_at: 2026-01-28T17:00:05Z) at ...",
    )
    p.set_defaults(cmd="history")
    task_id_flag(p)
    json_flag(p)

    p = sub(
        subs,
        "cancel",
        "Cancel a task",
        "  dtq cancel 3f2a9c0d5e6f47a8b9c0d1e2f3a4b5c6",
        """\
        A task that has not started is cancelled at once. A running task gets a cancellation
        request that its worker acts on (exit 0, the output says so). A finished task is
        refused (exit 1). Audited as cli:<user>@<host>.
        """,
    )
    p.set_defaults(cmd="cancel")
    task_id_flag(p)
    json_flag(p)

    p = sub(
        subs,
        "expire",
        "Mark a task that has not started (pending, queued, retrying) expired now",
        "  dtq expire 3f2a9c0d5e6f47a8b9c0d1e2f3a4b5c6",
        "Any other status is refused (exit 1) with the status named. Audited.",
    )
    p.set_defaults(cmd="expire")
    task_id_flag(p)
    json_flag(p)


def _dlq_commands(subs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub(subs, "dlq", "Dead-letter queue", "  dtq dlq list --limit 20")
    dlq = p.add_subparsers(dest="dlq_command", metavar="<dlq command>", required=True)
    p = sub(dlq, "list", "List dead-lettered tasks, newest first", "  dtq dlq list --json")
    p.set_defaults(cmd="dlq.list")
    p.add_argument("--limit", type=inputs.positive_int, default=50, metavar="N", help="default 50")
    json_flag(p)

    p = sub(
        subs,
        "retry-dlq",
        "Requeue a dead-lettered task: attempt back to 0, earlier attempts kept in "
        "metadata.previous_attempts",
        "  dtq retry-dlq 3f2a9c0d5e6f47a8b9c0d1e2f3a4b5c6",
        "Audited as cli:<user>@<host>.",
    )
    p.set_defaults(cmd="dlq.retry")
    task_id_flag(p)
    json_flag(p)

    p = sub(
        subs,
        "discard-dlq",
        "Remove a task from the dead-letter queue (its record stays, marked discarded)",
        "  dtq discard-dlq 3f2a9c0d5e6f47a8b9c0d1e2f3a4b5c6",
        "Audited as cli:<user>@<host>.",
    )
    p.set_defaults(cmd="dlq.discard")
    task_id_flag(p)
    json_flag(p)

    p = sub(
        subs,
        "purge-dlq",
        "Delete every entry of the dead-letter queue",
        "  dtq purge-dlq --yes",
        "Task records stay. Asks you to type 'dead-letter' unless --yes. Audited.",
    )
    p.set_defaults(cmd="dlq.purge")
    yes_flag(p)
    json_flag(p)

    p = sub(
        subs,
        "purge",
        "Cancel every task of a queue that has not started (waiting and delayed)",
        "  dtq purge --queue emails --yes",
        """\
        Running tasks are left alone. The cancelled tasks are marked metadata.purged = true.
        Asks you to type the queue name unless --yes. Audited.
        """,
    )
    p.set_defaults(cmd="purge")
    p.add_argument("--queue", type=inputs.queue_name, required=True)
    yes_flag(p)
    json_flag(p)


def _queue_commands(subs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub(
        subs,
        "queue",
        "Pause or resume a queue, or show queue statistics",
        "  dtq queue pause emails\n  dtq queue stats",
    )
    qs = p.add_subparsers(dest="queue_command", metavar="<queue command>", required=True)
    for action, text in (("pause", "Stop workers taking tasks from"), ("resume", "Resume")):
        p = sub(
            qs,
            action,
            f"{text} a queue (tasks can still be submitted)",
            f"  dtq queue {action} emails",
            "Audited as cli:<user>@<host>.",
        )
        p.set_defaults(cmd=f"queue.{action}")
        p.add_argument("queue", type=inputs.queue_name)
        json_flag(p)
    p = sub(
        qs,
        "stats",
        "Depth, in-flight, delayed and paused state of one queue or of all",
        "  dtq queue stats\n  dtq queue stats emails --json",
    )
    p.set_defaults(cmd="queue.stats")
    p.add_argument("queue", type=inputs.queue_name, nargs="?")
    json_flag(p)


def _process_commands(subs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub(subs, "worker", "Run workers", "  dtq worker run --concurrency 8")
    ws = p.add_subparsers(dest="worker_command", metavar="<worker command>", required=True)
    p = sub(
        ws,
        "run",
        "Run a worker until SIGTERM or Ctrl-C (then it drains in-flight tasks)",
        """\
          dtq worker run
          dtq worker run --queue emails --queue default --concurrency 16 --tasks myapp.tasks
        """,
        """\
        Serves the queue 'default' unless --queue is given (repeatable). Handlers are imported
        from --tasks modules (repeatable), else DTQ_TASK_MODULES (default examples.tasks); the
        current directory is on sys.path first.
        """,
    )
    p.set_defaults(cmd="worker.run")
    p.add_argument("--concurrency", type=inputs.positive_int, metavar="N",
                   help="tasks in flight per process (default DTQ_WORKER_CONCURRENCY)")  # fmt: skip
    p.add_argument("--queue", dest="queues", action="append", type=inputs.queue_name,
                   metavar="Q", help="queue to serve (repeatable; default: default)")  # fmt: skip
    p.add_argument("--tasks", dest="task_modules", action="append", metavar="MODULE",
                   help="module with @task handlers (repeatable)")  # fmt: skip
    p.add_argument("--processes", type=inputs.positive_int, default=1, metavar="N",
                   help="worker processes (default 1)")  # fmt: skip

    p = sub(
        subs,
        "api",
        "Run the HTTP API (uvicorn) until Ctrl-C",
        "  dtq api --host 127.0.0.1 --port 8000",
    )
    p.set_defaults(cmd="api")
    p.add_argument("--host", help="default DTQ_API_HOST (0.0.0.0)")
    p.add_argument("--port", type=inputs.port, help="default DTQ_API_PORT (8000)")

    p = sub(
        subs,
        "dev",
        "Run a local stack: a private Redis (data in .dtq/), the API and one worker with the "
        "demo tasks",
        "  dtq dev\n  dtq dev --port 8080",
        """\
        Uses the Redis at DTQ_REDIS_URL (default redis://localhost:6379/0) when it answers;
        else starts a private one, on that URL's port when it is free, so dtq commands in
        another terminal reach it with the same settings. Handlers come from DTQ_TASK_MODULES
        (default examples.tasks). Prints one line with the URLs (API, docs, metrics,
        WebSocket, Redis); Ctrl-C stops the worker (it drains), then the API, then Redis.
        """,
    )
    p.set_defaults(cmd="dev")
    p.add_argument("--host", default="127.0.0.1", help="API host (default 127.0.0.1)")
    p.add_argument("--port", type=inputs.port, help="API port (default DTQ_API_PORT, 8000)")
