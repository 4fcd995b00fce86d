"""Task commands: submit (and ``--wait``), get, status, wait, list, history, cancel, expire.

Each returns its exit code; refusals by the system arrive as dtq errors and are mapped to exit
codes by :mod:`dtq_cli.cli`, except a cancel of a running task, which is accepted as a request,
and the end of a wait: 0 when the task succeeded, 1 when it ended otherwise or the timeout
passed.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from dtq.errors import TaskCancelled, TaskExpired, TaskFailed, TaskRunningError, WaitTimeout
from dtq.models import NOT_STARTED, SUBMIT_OPTIONS, HistoryEntry, Progress, Task, TaskStatus
from dtq_cli.cli import EXIT_OK, EXIT_REFUSED
from dtq_cli.context import Ctx, UsageError
from dtq_cli.flags import DEFAULT_WAIT_S
from dtq_cli.output import STATUS_COLOUR, fmt_dt, json_dt, relative

__all__ = [
    "cancel",
    "expire",
    "expires_text",
    "get",
    "history",
    "history_document",
    "history_line",
    "list_tasks",
    "progress_text",
    "status",
    "status_document",
    "submit",
    "wait",
]


def _when(value: datetime | None, now: datetime) -> str:
    if value is None:
        return "-"
    return f"{fmt_dt(value)} ({relative(value, now)})"


def expires_text(task: Task, now: datetime) -> str:
    """``2026-01-28T17:00:00Z (in 2h 30m)``, ``... (expired 5m ago)``, or ``never``.

    "expired" is said only of a task that expired or is about to be swept; a task that started
    before its deadline ran to completion, and its deadline just "passed".
    """
    if task.expires_at is None:
        return "never"
    exp = task.expires_at
    if exp > now:
        return f"{fmt_dt(exp)} ({relative(exp, now)})"
    if task.status == TaskStatus.EXPIRED or task.status in NOT_STARTED:
        return f"{fmt_dt(exp)} (expired {relative(exp, now)})"
    return f"{fmt_dt(exp)} (passed {relative(exp, now)})"


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)


PROGRESS_BAR_CELLS = 20
PROGRESS_DATA_CHARS = 60  # of the data's JSON, in the status view


def progress_text(progress: Progress, now: datetime) -> str:
    """``[##########..........] 50% {"step":"resize"} (updated 2s ago)``: a bar when the
    handler gave a fraction, the data's JSON (shortened) when it gave some."""
    parts = []
    if progress.fraction is not None:
        f = progress.fraction + 1e-9  # 0.29 * 100 is 28.999...: floored, it would say 28%
        filled = min(PROGRESS_BAR_CELLS, int(f * PROGRESS_BAR_CELLS))
        bar = "#" * filled + "." * (PROGRESS_BAR_CELLS - filled)
        parts.append(f"[{bar}] {min(100, int(f * 100))}%")
    if progress.data is not None:
        data = _compact(progress.data)
        if len(data) > PROGRESS_DATA_CHARS:
            data = data[: PROGRESS_DATA_CHARS - 3] + "..."
        parts.append(data)
    parts.append(f"(updated {relative(progress.updated_at, now)})")
    return " ".join(parts)


# -- submit --------------------------------------------------------------------------------------


async def submit(ctx: Ctx) -> int:
    """Each flag of ``dtq submit`` is named after the submit option it sets (its ``dest``)."""
    a = ctx.args
    if a.timeout is not None and not a.wait:
        raise UsageError("--timeout is how long --wait waits: give --wait too")
    options = {name: getattr(a, name) for name in SUBMIT_OPTIONS if hasattr(a, name)}
    task = await ctx.q.submit(a.task_type, a.payload, **options)
    if a.wait:
        return await _await_result(ctx, task, a.timeout or DEFAULT_WAIT_S)
    out = ctx.out
    if ctx.json:
        out.json(task.public_dict())
        return 0
    if a.quiet:
        out.line(task.task_id)
        return 0
    now = await ctx.q.now()
    if task.duplicate:
        out.line(
            f"Duplicate: idempotency key {task.idempotency_key!r} on queue {task.queue!r} "
            f"already belongs to task {task.task_id}; nothing new was submitted."
        )
    else:
        out.line(f"Submitted task {task.task_id}")
    rows = [
        ("status", out.status(task.status.value)),
        ("queue", f"{task.queue} (priority {task.priority})"),
    ]
    if task.status == TaskStatus.PENDING:
        rows.append(("available_at", _when(task.available_at, now)))
    rows.append(("expires_at", expires_text(task, now)))
    out.fields(rows)
    return 0


async def _await_result(ctx: Ctx, task: Task, timeout_s: float) -> int:
    """``submit --wait``: the result as JSON (with --json, the finished task), exit 0; a task
    that ended otherwise or a timeout: the error on stderr, exit 1."""
    out = ctx.out
    if not ctx.json and not ctx.args.quiet:
        out.note(f"Submitted task {task.task_id}; waiting up to {timeout_s:g} s")
    if ctx.json:
        try:
            ended = await ctx.q.wait(task.task_id, timeout=timeout_s)
        except WaitTimeout as exc:
            out.json((exc.task or task).public_dict())
            out.error(_timed_out(timeout_s, exc.task or task))
            return EXIT_REFUSED
        out.json(ended.public_dict())
        if ended.status != TaskStatus.SUCCEEDED:
            out.error(_ended_otherwise(ended))
            return EXIT_REFUSED
        return EXIT_OK
    try:
        result = await ctx.q.result(task.task_id, timeout=timeout_s)
    except WaitTimeout as exc:
        out.error(_timed_out(timeout_s, exc.task or task))
        return EXIT_REFUSED
    except (TaskFailed, TaskCancelled, TaskExpired) as exc:
        out.error(_ended_otherwise(exc.task))
        return EXIT_REFUSED
    out.line(json.dumps(result, indent=2, ensure_ascii=False, default=str))
    return EXIT_OK


def _timed_out(timeout_s: float, task: Task) -> str:
    return f"timed out after {timeout_s:g} s: task {task.task_id} is {task.status.value}"


def _ended_otherwise(task: Task) -> str:
    """``task <id> failed: ValueError: bad input`` and the like."""
    text = f"task {task.task_id} {task.status.value.replace('_', '-')}"
    if task.error_class or task.error_message:
        text += f": {task.error_class or 'Error'}: {task.error_message or ''}".rstrip()
    return text


# -- reads ---------------------------------------------------------------------------------------


async def get(ctx: Ctx) -> int:
    task = await ctx.q.get(ctx.args.task_id)
    if ctx.json:
        ctx.out.json(task.public_dict())
        return 0
    now = await ctx.q.now()
    t, out = task, ctx.out
    rows = [
        ("task_id", t.task_id),
        ("task_type", t.task_type),
        ("status", out.status(t.status.value)),
        ("queue", t.queue),
        ("priority", str(t.priority)),
        ("attempt", f"{t.attempt} of {t.max_attempts}"),
        ("idempotency_key", t.idempotency_key or "-"),
        ("timeout_ms", str(t.timeout_ms)),
        ("created_at", _when(t.created_at, now)),
        ("available_at", _when(t.available_at, now)),
        ("updated_at", _when(t.updated_at, now)),
        ("started_at", _when(t.started_at, now)),
        ("finished_at", _when(t.finished_at, now)),
        ("duration_ms", "-" if t.duration_ms is None else str(t.duration_ms)),
        ("worker_id", t.worker_id or "-"),
        ("expires_at", expires_text(t, now)),
        ("expired_at", _when(t.expired_at, now)),
        ("cancel_requested", "yes" if t.cancel_requested else "no"),
        ("error_class", t.error_class or "-"),
        ("error_message", t.error_message or "-"),
        ("retryable", "-" if t.retryable is None else ("yes" if t.retryable else "no")),
        ("retry_delay_ms", "-" if t.retry_delay_ms is None else str(t.retry_delay_ms)),
        ("payload", _compact(t.payload)),
        ("metadata", _compact(t.metadata)),
        ("result", "-" if t.result is None else _compact(t.result)),
        ("progress", "-" if t.progress is None else progress_text(t.progress, now)),
    ]
    if t.result_truncated:
        rows.append(("result_truncated", "yes (larger than DTQ_RESULT_MAX_BYTES, not stored)"))
    out.fields(rows)
    return 0


def status_document(task: Task, now: datetime) -> dict[str, Any]:
    full = task.public_dict()
    keys = (
        "task_id", "task_type", "status", "queue", "priority", "attempt", "max_attempts",
        "created_at", "available_at", "updated_at", "started_at", "finished_at", "worker_id",
        "expires_at", "expired_at", "cancel_requested", "error_class", "error_message",
        "progress",
    )  # fmt: skip
    doc = {k: full[k] for k in keys}
    doc["expires_in_s"] = (
        None if task.expires_at is None else round((task.expires_at - now).total_seconds(), 3)
    )
    doc["now"] = json_dt(now)
    return doc


async def status(ctx: Ctx) -> int:
    await _show_status(ctx, await ctx.q.get(ctx.args.task_id))
    return 0


async def wait(ctx: Ctx) -> int:
    """Show the task once it has ended (as ``status`` does): exit 0 when it succeeded, 1 when
    it ended otherwise; a timeout shows it as it is, says so on stderr, exit 1."""
    timeout_s: float = ctx.args.timeout
    try:
        task = await ctx.q.wait(ctx.args.task_id, timeout=timeout_s)
    except WaitTimeout as exc:
        task = exc.task if exc.task is not None else await ctx.q.get(ctx.args.task_id)
        await _show_status(ctx, task)
        ctx.out.error(_timed_out(timeout_s, task))
        return EXIT_REFUSED
    await _show_status(ctx, task)
    return EXIT_OK if task.status == TaskStatus.SUCCEEDED else EXIT_REFUSED


async def _show_status(ctx: Ctx, task: Task) -> None:
    now = await ctx.q.now()
    if ctx.json:
        ctx.out.json(status_document(task, now))
        return
    t, out = task, ctx.out
    rows = [
        ("task_id", t.task_id),
        ("type", t.task_type),
        ("status", out.status(t.status.value)),
        ("queue", f"{t.queue} (priority {t.priority})"),
        ("attempt", f"{t.attempt} of {t.max_attempts}"),
        ("created_at", _when(t.created_at, now)),
    ]
    if t.status in NOT_STARTED:
        rows.append(("available_at", _when(t.available_at, now)))
    if t.started_at is not None:
        rows.append(("started_at", _when(t.started_at, now)))
    if t.finished_at is not None:
        rows.append(("finished_at", _when(t.finished_at, now)))
    rows.append(("expires_at", expires_text(t, now)))
    if t.expired_at is not None:
        rows.append(("expired_at", _when(t.expired_at, now)))
    if t.worker_id:
        rows.append(("worker", t.worker_id))
    if t.progress is not None:
        rows.append(("progress", progress_text(t.progress, now)))
    if t.cancel_requested and t.status == TaskStatus.RUNNING:
        rows.append(("cancel", "requested, the worker is stopping it"))
    if t.error_class or t.error_message:
        rows.append(("error", f"{t.error_class or 'Error'}: {t.error_message or ''}".rstrip()))
    out.fields(rows)


def _list_row(t: Task, now: datetime) -> list[str]:
    return [
        t.task_id,
        t.task_type,
        t.queue,
        t.status.value,
        str(t.priority),
        f"{t.attempt}/{t.max_attempts}",
        relative(t.created_at, now),
        relative(t.expires_at, now),  # "in 1h", "5m ago" or "-"
    ]


async def list_tasks(ctx: Ctx) -> int:
    a = ctx.args
    tasks = await ctx.q.list(queue=a.queue, status=a.status, task_type=a.task_type, limit=a.limit)
    if ctx.json:
        ctx.out.json({"count": len(tasks), "tasks": [t.public_dict() for t in tasks]})
        return 0
    if not tasks:
        ctx.out.line("No tasks.")
        return 0
    now = await ctx.q.now()
    rows = [_list_row(t, now) for t in tasks]
    colours: list[list[str | None]] = [
        [None, None, None, STATUS_COLOUR.get(t.status), None, None, "dim", None] for t in tasks
    ]
    headers = ["TASK_ID", "TYPE", "QUEUE", "STATUS", "PRI", "ATTEMPT", "CREATED", "EXPIRES"]
    ctx.out.table(headers, rows, colours=colours)
    return 0


def history_line(version: int, entry: HistoryEntry) -> str:
    """``Version 1: pending (created, expires_at: 2026-01-28T17:00:00Z) at <ts>``, the seed's
    shape plus the attempt, worker and time of the change."""
    parts: list[str] = []
    if entry.reason:
        parts.append(entry.reason)
    if entry.attempt:
        parts.append(f"attempt {entry.attempt}")
    if entry.worker_id:
        parts.append(f"worker {entry.worker_id}")
    for key, value in entry.details.items():
        if value is None or value == "":
            continue
        parts.append(f"{key}: {value if isinstance(value, str) else _compact(value)}")
    inside = f" ({', '.join(parts)})" if parts else ""
    return f"Version {version}: {entry.to_status.value}{inside} at {fmt_dt(entry.ts)}"


def history_document(task_id: str, entries: list[HistoryEntry]) -> dict[str, Any]:
    versions = []
    for n, e in enumerate(entries, start=1):
        versions.append(
            {
                "version": n,
                "ts": json_dt(e.ts),
                "from": None if e.from_status is None else e.from_status.value,
                "to": e.to_status.value,
                "attempt": e.attempt,
                "worker_id": e.worker_id,
                "reason": e.reason,
                "details": e.details,
            }
        )
    return {"task_id": task_id, "versions": versions}


async def history(ctx: Ctx) -> int:
    entries = await ctx.q.history(ctx.args.task_id)
    if ctx.json:
        ctx.out.json(history_document(ctx.args.task_id, entries))
        return 0
    if not entries:
        ctx.out.line("No recorded history (it is kept as long as the task).")
    for n, entry in enumerate(entries, start=1):
        ctx.out.line(history_line(n, entry))
    return 0


# -- state changes -------------------------------------------------------------------------------


async def cancel(ctx: Ctx) -> int:
    """Not started: cancelled. Running: a cancellation request, accepted (exit 0)."""
    tid = ctx.args.task_id
    overdue = False
    try:
        task = await ctx.q.cancel(tid, audit=ctx.audit())
        outcome = "cancelled"
    except TaskRunningError as exc:
        task = await ctx.q.get(tid)
        outcome = "cancel_requested"
        overdue = "overdue_attempt" in exc.details
    if ctx.json:
        ctx.out.json({"task_id": tid, "outcome": outcome, "task": task.public_dict()})
    elif outcome == "cancelled":
        ctx.out.line(f"Cancelled task {tid}.")
    elif overdue:
        ctx.out.line(
            f"Task {tid} is running: cancellation requested, but its worker cannot stop it: "
            "the thread of its sync handler did not stop when interrupted; the task ends when "
            f"that thread returns or its worker restarts (check with: dtq status {tid})."
        )
    else:
        ctx.out.line(
            f"Task {tid} is running: cancellation requested; its worker stops it "
            f"(check with: dtq status {tid})."
        )
    return 0


async def expire(ctx: Ctx) -> int:
    tid = ctx.args.task_id
    task = await ctx.q.mark_expired(tid, audit=ctx.audit())
    if ctx.json:
        ctx.out.json({"task_id": tid, "outcome": "expired", "task": task.public_dict()})
    else:
        ctx.out.line(f"Marked task {tid} expired at {fmt_dt(task.expired_at)}.")
    return 0
