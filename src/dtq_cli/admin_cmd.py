"""Operator commands: the dead-letter queue, purge, and queue pause/resume/stats.

Every destructive command passes the audit identity ``cli:<user>@<host>`` to the SDK, whose
script appends the audit entry atomically with the change. Purges ask for confirmation: typed
at a terminal, or ``--yes``; with neither and no terminal on stdin they are refused (exit 2).
"""

from __future__ import annotations

import sys

from dtq.records import DeadLetter
from dtq_cli.context import Ctx, NotConfirmedError, UsageError
from dtq_cli.output import relative

__all__ = [
    "confirm",
    "discard_dlq",
    "dlq_list",
    "pause",
    "purge_dlq",
    "purge_queue",
    "resume",
    "retry_dlq",
    "stats",
]

ERROR_COLUMN_MAX = 60


def confirm(ctx: Ctx, what: str, word: str) -> None:
    """Go ahead with --yes; else ask on a terminal for ``word``; else refuse (usage error)."""
    if ctx.args.yes:
        return
    if not sys.stdin.isatty():
        raise UsageError(f"refusing to {what} without --yes: stdin is not a terminal to confirm on")
    ctx.out.note(f"This will {what}. It cannot be undone.")
    sys.stderr.write(f"Type {word!r} to confirm: ")
    sys.stderr.flush()
    answer = sys.stdin.readline().strip()
    if answer != word:
        raise NotConfirmedError(f"not confirmed (expected {word!r}); nothing was changed")


# -- dead-letter queue ---------------------------------------------------------------------------


def _error_text(d: DeadLetter) -> str:
    text = f"{d.last_error_class}: {d.last_error}" if d.last_error_class else d.last_error
    text = " ".join(text.split())
    if len(text) > ERROR_COLUMN_MAX:
        text = text[: ERROR_COLUMN_MAX - 3] + "..."
    return text or "-"


async def dlq_list(ctx: Ctx) -> int:
    entries = await ctx.q.dlq_list(ctx.args.limit)
    if ctx.json:
        docs = [e.model_dump(mode="json") for e in entries]
        ctx.out.json({"count": len(docs), "entries": docs})
        return 0
    if not entries:
        ctx.out.line("The dead-letter queue is empty.")
        return 0
    now = await ctx.q.now()
    rows = [
        [
            d.task_id,
            d.task_type,
            d.original_queue,
            str(d.attempts_made or d.attempt),
            relative(d.failed_at, now),
            _error_text(d),
        ]
        for d in entries
    ]
    ctx.out.table(["TASK_ID", "TYPE", "QUEUE", "ATTEMPTS", "FAILED", "ERROR"], rows)
    return 0


async def retry_dlq(ctx: Ctx) -> int:
    tid = ctx.args.task_id
    task = await ctx.q.requeue_dead_letter(tid, audit=ctx.audit())
    if ctx.json:
        ctx.out.json({"task_id": tid, "outcome": "requeued", "task": task.public_dict()})
    else:
        ctx.out.line(
            f"Requeued task {tid} on queue {task.queue} ({task.status.value}, attempt reset "
            "to 0; earlier attempts kept in metadata.previous_attempts)."
        )
    return 0


async def discard_dlq(ctx: Ctx) -> int:
    tid = ctx.args.task_id
    task = await ctx.q.discard_dead_letter(tid, audit=ctx.audit())
    if ctx.json:
        ctx.out.json({"task_id": tid, "outcome": "discarded", "task": task.public_dict()})
    else:
        ctx.out.line(
            f"Discarded task {tid} from the dead-letter queue "
            "(its record stays, dead_lettered, with metadata.discarded = true)."
        )
    return 0


async def purge_dlq(ctx: Ctx) -> int:
    confirm(ctx, "delete every entry of the dead-letter queue", "dead-letter")
    removed = await ctx.q.purge_dead_letters(audit=ctx.audit())
    if ctx.json:
        ctx.out.json({"outcome": "purged", "removed": removed})
    else:
        ctx.out.line(f"Purged the dead-letter queue: {removed} entries removed.")
    return 0


# -- queues --------------------------------------------------------------------------------------


async def purge_queue(ctx: Ctx) -> int:
    queue = ctx.args.queue
    confirm(
        ctx,
        f"cancel every task of queue {queue!r} that has not started (running tasks stay)",
        queue,
    )
    cancelled = await ctx.q.purge_queue(queue, audit=ctx.audit())
    if ctx.json:
        ctx.out.json({"queue": queue, "outcome": "purged", "cancelled": cancelled})
    else:
        ctx.out.line(f"Purged queue {queue}: {cancelled} tasks cancelled.")
    return 0


async def _set_paused(ctx: Ctx, paused: bool) -> int:
    queue = ctx.args.queue
    if paused:
        changed = await ctx.q.pause_queue(queue, audit=ctx.audit())
    else:
        changed = await ctx.q.resume_queue(queue, audit=ctx.audit())
    if ctx.json:
        ctx.out.json({"queue": queue, "paused": paused, "changed": changed})
        return 0
    state = "paused" if paused else "resumed"
    if changed:
        ctx.out.line(f"Queue {queue} {state}.")
    else:
        ctx.out.line(f"Queue {queue} was already {'paused' if paused else 'running'}.")
    return 0


async def pause(ctx: Ctx) -> int:
    return await _set_paused(ctx, True)


async def resume(ctx: Ctx) -> int:
    return await _set_paused(ctx, False)


async def stats(ctx: Ctx) -> int:
    queue = ctx.args.queue
    all_stats = [await ctx.q.queue_stats(queue)] if queue else await ctx.q.all_queue_stats()
    if ctx.json:
        if queue:
            ctx.out.json(all_stats[0].model_dump(mode="json"))
        else:
            ctx.out.json({"queues": [s.model_dump(mode="json") for s in all_stats]})
        return 0
    if not all_stats:
        ctx.out.line("No queues yet (a queue appears with its first task).")
        return 0
    rows = [
        [
            s.queue,
            str(s.depth),
            str(s.waiting),
            str(s.pending),
            str(s.retry_scheduled),
            "yes" if s.paused else "no",
            str(s.workers_active),
        ]
        for s in all_stats
    ]
    colours: list[list[str | None]] = [
        [None, None, None, None, None, "yellow" if s.paused else None, None] for s in all_stats
    ]
    headers = ["QUEUE", "DEPTH", "WAITING", "IN_FLIGHT", "DELAYED", "PAUSED", "WORKERS"]
    ctx.out.table(headers, rows, colours=colours)
    ctx.out.line(f"dead-letter queue: {all_stats[0].dlq_depth} entries")
    return 0
