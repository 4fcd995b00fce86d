"""Schedule commands: add, update, list, show, pause, resume, remove, trigger, next.

Everything goes through the SDK's schedule methods (:class:`dtq.client.Queue`), which own the
rules: a bad cron expression, zone, interval or policy comes back as ScheduleSpecError or
InvalidTaskError (exit 2), an unknown schedule as ScheduleNotFoundError (exit 1). The changes
are audited as ``cli:<user>@<host>``; ``remove`` asks for the schedule's name unless --yes.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

from dtq.errors import ScheduleExistsError
from dtq.models import compact_json as compact
from dtq.schedules import Schedule, ScheduleDef
from dtq.ticks import format_every
from dtq_cli.admin_cmd import confirm
from dtq_cli.context import Ctx, UsageError
from dtq_cli.output import fmt_dt, human_duration, json_dt, relative
from dtq_cli.schedule_args import DEFINITION_FIELDS, SPEC_FLAGS

__all__ = [
    "add",
    "history_line",
    "list_schedules",
    "next_times",
    "pause",
    "remove",
    "resume",
    "show",
    "spec_text",
    "trigger",
    "update",
]

STATE_COLOUR = {"active": "green", "paused": "yellow", "ended": "dim"}
SHOW_NEXT = 5  # fire times ``show`` prints
SHOW_FIRINGS = 5  # latest firings ``show`` prints
# The details of a history entry that come first on its line; the others follow by name.
HISTORY_FIRST = {"tick": 0, "task_id": 1, "count": 2, "first": 3, "last": 4}
# ScheduleDef requires a task type; the fire times of a bare spec do not depend on one.
PREVIEW_TASK_TYPE = "preview"


def _given(ctx: Ctx) -> dict[str, Any]:
    """The definition fields whose flags were given (an absent flag is None)."""
    args = ctx.args
    return {f: getattr(args, f) for f in DEFINITION_FIELDS if getattr(args, f, None) is not None}


def spec_text(d: ScheduleDef) -> str:
    """``0 7 * * * (Europe/Paris)`` or ``every 5m`` (``from <anchor>`` when it has one)."""
    if d.cron is not None:
        return f"{d.cron} ({d.tz})"
    assert isinstance(d.every, int)  # stored definitions hold whole seconds
    text = f"every {format_every(d.every)}"
    return text + (f" from {fmt_dt(d.anchor)}" if d.anchor is not None else "")


def _when(value: datetime | None, now: datetime) -> str:
    return "-" if value is None else f"{fmt_dt(value)} ({relative(value, now)})"


def _fire_time(value: datetime, now: datetime, tz: str) -> str:
    """A fire time in UTC, with its local time in the cron's zone when that is not UTC."""
    local = ""
    if tz != "UTC":
        at = value.astimezone(ZoneInfo(tz))
        local = f"{at.strftime('%Y-%m-%d %H:%M:%S')} {at.tzname()}, "
    return f"{fmt_dt(value)} ({local}{relative(value, now)})"


def _state(s: Schedule) -> str:
    return f"{s.state} ({s.paused_reason})" if s.paused_reason and s.state == "paused" else s.state


def _summary(ctx: Ctx, s: Schedule, now: datetime) -> None:
    d = ctx.out
    d.fields(
        [
            ("spec", spec_text(s.definition)),
            ("task", f"{s.definition.task_type} on queue {s.definition.queue}"),
            ("state", ctx.out.paint(_state(s), STATE_COLOUR.get(s.state))),
            ("next_fire_at", _when(s.next_fire_at, now) if s.state == "active" else "-"),
        ]
    )


# -- create and change ---------------------------------------------------------------------------


async def add(ctx: Ctx) -> int:
    name = ctx.args.name
    try:
        s, outcome = await ctx.q.put_schedule(name, _given(ctx), audit=ctx.audit(), only="create")
    except ScheduleExistsError:
        raise ScheduleExistsError(
            f"schedule {name!r} exists; change it with: dtq schedule update {name} ...",
            schedule=name,
        ) from None
    return await _put_done(ctx, s, outcome)


async def update(ctx: Ctx) -> int:
    """Read, merge the given flags over the stored definition, put."""
    name = ctx.args.name
    stored = await ctx.q.get_schedule(name, history=0)
    fields = stored.definition.model_dump(exclude={"paused"})
    given = _given(ctx)
    if "cron" in given:  # a cron expression replaces an interval
        fields.update(every=None, anchor=None)
    if "every" in given:  # and an interval a cron expression (its zone too)
        fields.update(cron=None, tz="UTC")
    fields.update(given)
    s, outcome = await ctx.q.put_schedule(name, fields, audit=ctx.audit(), only="update")
    if stored.origin == "code" and outcome == "updated":
        ctx.out.note(
            f"note: schedule {name} is declared in code: the next worker that starts with that "
            "code puts the code's definition back"
        )
    return await _put_done(ctx, s, outcome)


async def _put_done(ctx: Ctx, s: Schedule, outcome: str) -> int:
    if ctx.json:
        ctx.out.json({"name": s.name, "outcome": outcome, "schedule": s.model_dump(mode="json")})
        return 0
    text = {"created": "Created", "updated": "Updated"}.get(outcome)
    ctx.out.line(f"{text} schedule {s.name}." if text else f"Schedule {s.name} unchanged.")
    _summary(ctx, s, await ctx.q.now())
    return 0


# -- reads ---------------------------------------------------------------------------------------


async def list_schedules(ctx: Ctx) -> int:
    schedules = await ctx.q.list_schedules(ctx.args.limit)
    if ctx.json:
        docs = [s.model_dump(mode="json", exclude={"history"}) for s in schedules]
        ctx.out.json({"count": len(docs), "schedules": docs})
        return 0
    if not schedules:
        ctx.out.line("No schedules.")
        return 0
    now = await ctx.q.now()
    rows = [
        [
            s.name,
            spec_text(s.definition),
            s.definition.queue,
            s.definition.task_type,
            s.state,
            relative(s.next_fire_at, now) if s.state == "active" else "-",
            relative(s.last_fired_at, now),
            f"{s.fired}/{s.skipped_overlap}/{s.missed}",
        ]
        for s in schedules
    ]
    colours: list[list[str | None]] = [
        [None, None, None, None, STATE_COLOUR.get(s.state), None, "dim", None] for s in schedules
    ]
    headers = ["NAME", "SPEC", "QUEUE", "TASK_TYPE", "STATE", "NEXT", "LAST_FIRED",
               "FIRED/SKIPPED/MISSED"]  # fmt: skip
    ctx.out.table(headers, rows, colours=colours)
    return 0


def history_line(entry: dict[str, Any]) -> str:
    """``2026-01-28T07:00:00.012Z  fired  tick: 2026-01-28T07:00:00Z, task_id: ..., lag_ms: 12``"""
    rest = [(k, v) for k, v in entry.items() if k not in ("ts", "decision") and v not in (None, "")]
    rest.sort(key=lambda kv: (HISTORY_FIRST.get(kv[0], len(HISTORY_FIRST)), kv[0]))
    parts = [f"{k}: {v if isinstance(v, str) else compact(v)}" for k, v in rest]
    return f"{entry.get('ts', '-')}  {entry.get('decision', '?')}" + (
        f"  {', '.join(parts)}" if parts else ""
    )


async def show(ctx: Ctx) -> int:
    name = ctx.args.name
    s = await ctx.q.get_schedule(name, history=ctx.args.history)
    upcoming = await ctx.q.next_fire_times(name, SHOW_NEXT) if s.state == "active" else []
    if ctx.json:
        doc = s.model_dump(mode="json")
        doc["next_fire_times"] = [json_dt(t) for t in upcoming]
        ctx.out.json(doc)
        return 0
    now = await ctx.q.now()
    d, out = s.definition, ctx.out
    ttl = "-" if d.ttl_seconds is None else f"{human_duration(d.ttl_seconds)} after each tick"
    counts = f"fired {s.fired}, skipped_overlap {s.skipped_overlap}, missed {s.missed}"
    out.fields(
        [
            ("name", s.name),
            ("state", out.paint(_state(s), STATE_COLOUR.get(s.state))),
            ("origin", s.origin),
            ("spec", spec_text(d)),
            ("start_at", fmt_dt(d.start_at)),
            ("end_at", fmt_dt(d.end_at)),
            ("task_type", d.task_type),
            ("queue", f"{d.queue} (priority {d.priority})"),
            ("max_attempts", str(d.max_attempts)),
            ("timeout_ms", "-" if d.timeout_ms is None else str(d.timeout_ms)),
            ("ttl", ttl),
            ("payload", compact(d.payload)),
            ("metadata", compact(d.metadata)),
            ("overlap", d.overlap),
            ("catchup", f"{d.catchup} (window {human_duration(d.catchup_window_s)})"),
            ("grace", human_duration(d.grace_s)),
            ("next_fire_at", _when(s.next_fire_at, now) if s.state == "active" else "-"),
            ("last_tick_at", _when(s.last_tick_at, now)),
            ("last_fired_at", _when(s.last_fired_at, now)),
            ("last_task_id", s.last_task_id or "-"),
            ("buffered_for", _when(s.buffered_for, now)),
            ("last_error", s.last_error or "-"),
            ("counts", counts),
            ("created_at", _when(s.created_at, now)),
            ("updated_at", _when(s.updated_at, now)),
        ]
    )
    out.line()
    out.line(f"next {SHOW_NEXT} fire times:" if upcoming else "next fire times: none")
    for t in upcoming:
        out.line(f"  {_fire_time(t, now, d.tz)}")
    firings = [e for e in s.history if e.get("decision") in ("fired", "triggered")]
    out.line()
    out.line("last firings:" if firings else "last firings: none in the history")
    for e in firings[:SHOW_FIRINGS]:
        trigger = " (manual)" if e.get("decision") == "triggered" else ""
        out.line(f"  {e.get('tick', '-')}  task {e.get('task_id', '-')}{trigger}")
    out.line()
    out.line("history (newest first):" if s.history else "history: empty")
    for e in s.history:
        out.line(f"  {history_line(e)}")
    return 0


async def next_times(ctx: Ctx) -> int:
    """Of a stored schedule (its cursor on), or of a spec given by flags (nothing stored)."""
    a = ctx.args
    spec = {f: getattr(a, f) for f in SPEC_FLAGS if getattr(a, f) is not None}
    if a.name is not None and spec:
        raise UsageError("give a schedule name or a spec (--cron / --every), not both")
    if a.name is not None:
        tz = (await ctx.q.get_schedule(a.name, history=0)).definition.tz
        times = await ctx.q.next_fire_times(a.name, a.n)
    elif spec:
        tz = spec.get("tz") or "UTC"
        times = await ctx.q.preview_schedule({**spec, "task_type": PREVIEW_TASK_TYPE}, a.n)
    else:
        raise UsageError("give a schedule name, or a spec: --cron EXPR [--tz ZONE] | --every D")
    if ctx.json:
        ctx.out.json({"name": a.name, "fire_times": [json_dt(t) for t in times]})
        return 0
    if not times:
        ctx.out.line("No fire time left (the schedule has ended).")
        return 0
    now = await ctx.q.now()
    for t in times:
        ctx.out.line(_fire_time(t, now, tz))
    return 0


# -- state changes -------------------------------------------------------------------------------


async def _set_paused(ctx: Ctx, paused: bool) -> int:
    name = ctx.args.name
    if paused:
        changed = await ctx.q.pause_schedule(name, audit=ctx.audit())
    else:
        changed = await ctx.q.resume_schedule(name, audit=ctx.audit())
    if ctx.json:
        ctx.out.json({"name": name, "paused": paused, "changed": changed})
    elif changed:
        ctx.out.line(f"Schedule {name} {'paused' if paused else 'resumed'}.")
    else:
        ctx.out.line(f"Schedule {name} was already {'paused' if paused else 'active'}.")
    return 0


async def pause(ctx: Ctx) -> int:
    return await _set_paused(ctx, True)


async def resume(ctx: Ctx) -> int:
    return await _set_paused(ctx, False)


async def remove(ctx: Ctx) -> int:
    name = ctx.args.name
    await ctx.q.get_schedule(name, history=0)  # not found: refused before asking
    confirm(ctx, f"delete schedule {name!r} and its history (the tasks it fired stay)", name)
    await ctx.q.delete_schedule(name, audit=ctx.audit())
    if ctx.json:
        ctx.out.json({"name": name, "outcome": "deleted"})
    else:
        ctx.out.line(f"Deleted schedule {name} (the tasks it fired stay).")
    return 0


async def trigger(ctx: Ctx) -> int:
    name, key = ctx.args.name, ctx.args.key
    task = await ctx.q.trigger_schedule(name, key=key, audit=ctx.audit())
    outcome = "duplicate" if task.duplicate else "triggered"
    if ctx.json:
        ctx.out.json({"name": name, "outcome": outcome, "task": task.public_dict()})
    elif task.duplicate:
        ctx.out.line(
            f"Duplicate: key {key!r} of schedule {name} already fired task {task.task_id}; "
            "nothing new was submitted."
        )
    else:
        ctx.out.line(f"Triggered schedule {name}: task {task.task_id} ({task.status.value}).")
    return 0
