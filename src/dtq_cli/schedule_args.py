"""The argparse tree of ``dtq schedule``: add, update, list, show, pause, resume, remove,
trigger and next (docs/cli.md, "Schedules"; the semantics are docs/schedules.md's).

The flags of add and update are named after the :class:`dtq.schedules.ScheduleDef` field they
set (their ``dest``), and default to None: the command passes the fields that were given, so
``add`` gets the core's defaults and ``update`` keeps the stored values. Values (cron
expressions, zones, intervals, policies) are checked by the core, once, for every caller.
"""

from __future__ import annotations

import argparse

from dtq_cli import inputs
from dtq_cli.flags import json_flag, sub, template_flags, yes_flag

__all__ = ["DEFINITION_FIELDS", "SPEC_FLAGS", "add_commands"]

# The dests of the flags that say when a schedule fires.
SPEC_FLAGS = ("cron", "tz", "every", "anchor", "start_at", "end_at")
# Every ScheduleDef field add and update set (a test keeps this equal to the model's fields).
DEFINITION_FIELDS = (
    *SPEC_FLAGS, "task_type", "payload", "queue", "priority", "max_attempts", "timeout_ms",
    "metadata", "ttl_seconds", "overlap", "catchup", "catchup_window_s", "grace_s", "paused",
)  # fmt: skip


def _name(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", type=inputs.schedule_name, help="the schedule's name")


def _spec_flags(p: argparse.ArgumentParser, *, required: bool) -> None:
    """--cron (with --tz) or --every (with --anchor); --start and --end."""
    spec = p.add_mutually_exclusive_group(required=required)
    spec.add_argument("--cron", metavar="EXPR",
                      help="5 fields, or 6 with the seconds first: '0 7 * * *'")  # fmt: skip
    spec.add_argument("--every", metavar="DURATION",
                      help="a fixed interval: 90s, 5m, 1h30m, 2d (or plain seconds)")  # fmt: skip
    p.add_argument("--tz", metavar="ZONE",
                   help="IANA time zone of --cron, e.g. Europe/Paris (default UTC)")  # fmt: skip
    p.add_argument("--anchor", type=inputs.when, metavar="TIME",
                   help="--every counts from TIME (ISO 8601) instead of the epoch")  # fmt: skip
    p.add_argument("--start", dest="start_at", type=inputs.when, metavar="TIME",
                   help="no tick before TIME (ISO 8601 with an offset)")  # fmt: skip
    p.add_argument("--end", dest="end_at", type=inputs.when, metavar="TIME",
                   help="no tick at or after TIME: the schedule ends")  # fmt: skip


def _definition_flags(p: argparse.ArgumentParser, *, create: bool) -> None:
    _name(p)
    _spec_flags(p, required=create)
    p.add_argument("--task-type", "--type", dest="task_type", required=create, metavar="T",
                   help="the task type each firing submits")  # fmt: skip
    template_flags(p, defaults=False, short=True)
    p.add_argument("--ttl", dest="ttl_seconds", type=inputs.duration_s, metavar="DURATION",
                   help="a firing expires if not started DURATION after its tick")  # fmt: skip
    p.add_argument("--overlap", metavar="POLICY",
                   help="previous firing not done: skip (default), allow, buffer_one")  # fmt: skip
    p.add_argument("--catchup", metavar="POLICY",
                   help="ticks missed while down: skip, latest (default), all")  # fmt: skip
    p.add_argument("--catchup-window", dest="catchup_window_s", type=inputs.duration_s,
                   metavar="DURATION", help="how far back 'all' fires (default 1h)")  # fmt: skip
    p.add_argument("--grace", dest="grace_s", type=inputs.duration_s, metavar="DURATION",
                   help="a tick at most this late still fires, whatever the catch-up policy "
                   "(default 10s)")  # fmt: skip
    p.add_argument("--paused", action="store_const", const=True, default=None,
                   help="create it paused" if create else "pause it (dtq schedule resume "
                   "resumes it)")  # fmt: skip
    json_flag(p)


def add_commands(subs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub(
        subs,
        "schedule",
        "Periodic schedules: cron or fixed intervals that submit a task per tick",
        "  dtq schedule add nightly --cron '0 3 * * *' --tz Europe/Paris --task-type cleanup\n"
        "  dtq schedule list",
    )
    ss = p.add_subparsers(dest="schedule_command", metavar="<schedule command>", required=True)

    p = sub(
        ss,
        "add",
        "Create a schedule (refused if it exists: use update)",
        """\
          dtq schedule add report --cron '0 7 * * 1-5' --tz Europe/Paris --task-type report \\
                           --payload '{"kind": "daily"}' --ttl 1h
          dtq schedule add poll --every 5m --task-type poll_feeds --overlap skip --json
        """,
        """\
        Give --cron EXPR (with --tz ZONE, default UTC) or --every DURATION (aligned to the
        epoch, or to --anchor). Each tick submits one task of the template (--task-type and
        the submit flags), with the idempotency key schedule:<name>:<tick ms>. Audited.
        """,
    )
    p.set_defaults(cmd="schedule.add")
    _definition_flags(p, create=True)

    p = sub(
        ss,
        "update",
        "Change a schedule: the flags given replace the stored values, the others stay",
        "  dtq schedule update report --cron '30 7 * * 1-5'\n"
        "  dtq schedule update poll --every 10m --priority 7",
        """\
        Refused if the schedule does not exist. --cron replaces an interval and --every a cron
        expression; a change of when it fires restarts it from now. --payload and --metadata
        replace the stored objects. Audited.
        """,
    )
    p.set_defaults(cmd="schedule.update")
    _definition_flags(p, create=False)

    p = sub(ss, "list", "List schedules, by next fire time (paused and ended last)",
            "  dtq schedule list\n  dtq schedule list --json")  # fmt: skip
    p.set_defaults(cmd="schedule.list")
    p.add_argument("--limit", type=inputs.positive_int, default=100, metavar="N",
                   help="default 100")  # fmt: skip
    json_flag(p)

    p = sub(ss, "show", "Show a schedule: definition, state, next fire times, last firings "
            "and history", "  dtq schedule show report --json")  # fmt: skip
    p.set_defaults(cmd="schedule.show")
    _name(p)
    p.add_argument("--history", type=inputs.nonneg_int, default=20, metavar="N",
                   help="history entries, newest first (default 20, at most 100)")  # fmt: skip
    json_flag(p)

    for action, text in (("pause", "Stop a schedule firing"),
                         ("resume", "Let a paused schedule fire again (its catch-up policy "
                          "decides which ticks of the pause fire)")):  # fmt: skip
        p = sub(ss, action, text, f"  dtq schedule {action} report", "Audited.")
        p.set_defaults(cmd=f"schedule.{action}")
        _name(p)
        json_flag(p)

    p = sub(
        ss,
        "remove",
        "Delete a schedule and its history (the tasks it fired stay)",
        "  dtq schedule remove report --yes",
        "Asks you to type the schedule's name unless --yes. Audited.",
    )
    p.set_defaults(cmd="schedule.remove")
    _name(p)
    yes_flag(p)
    json_flag(p)

    p = sub(
        ss,
        "trigger",
        "Fire a schedule now, once (whatever its next tick, pause or overlap policy)",
        "  dtq schedule trigger report --key rerun-2026-01-28",
        """\
        The task has metadata.trigger = manual. With --key, a second trigger with the same key
        prints the first one's task instead of submitting another. Audited.
        """,
    )
    p.set_defaults(cmd="schedule.trigger")
    _name(p)
    p.add_argument("--key", metavar="K", help="one manual firing per key")
    json_flag(p)

    p = sub(
        ss,
        "next",
        "Print the next fire times of a schedule, or of a spec (nothing is stored)",
        """\
          dtq schedule next report -n 3
          dtq schedule next --cron '30 2 * * *' --tz Europe/Paris -n 5
          dtq schedule next --every 90s
        """,
    )
    p.set_defaults(cmd="schedule.next")
    p.add_argument("name", type=inputs.schedule_name, nargs="?",
                   help="a stored schedule; or give a spec with --cron / --every")  # fmt: skip
    _spec_flags(p, required=False)
    p.add_argument("-n", type=inputs.positive_int, default=10, metavar="N",
                   help="how many (default 10)")  # fmt: skip
    json_flag(p)
