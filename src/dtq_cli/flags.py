"""Building blocks of the argparse tree (:mod:`dtq_cli.parser`, :mod:`dtq_cli.schedule_args`):
a subcommand with its summary and example, and the flags several commands share."""

from __future__ import annotations

import argparse
from textwrap import dedent

from dtq_cli import inputs

__all__ = [
    "DEFAULT_WAIT_S",
    "FMT",
    "json_flag",
    "sub",
    "task_id_flag",
    "template_flags",
    "wait_timeout_flag",
    "yes_flag",
]

FMT = argparse.RawDescriptionHelpFormatter
DEFAULT_WAIT_S = 60.0  # the SDK's (dtq.waits.DEFAULT_WAIT_S); a test keeps the two equal


def sub(
    subs: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    summary: str,
    example: str,
    description: str = "",
) -> argparse.ArgumentParser:
    desc = summary + (".\n\n" + dedent(description).strip() if description else ".")
    return subs.add_parser(
        name,
        help=summary,
        description=desc,
        epilog="example:\n" + dedent(example).rstrip(),
        formatter_class=FMT,
    )


def json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON document (for scripts)")


def task_id_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("task_id", type=inputs.task_id, help="the task id (32 hex characters)")


def wait_timeout_flag(p: argparse.ArgumentParser, *, default: float | None, when: str = "") -> None:
    """``--timeout S`` of a wait; ``when`` says what the flag needs (``with --wait: ``)."""
    p.add_argument(
        "--timeout",
        type=inputs.wait_seconds,
        default=default,
        metavar="S",
        help=f"{when}give up after S seconds, at most 86400 (default {DEFAULT_WAIT_S:g})",
    )


def yes_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--yes",
        action="store_true",
        help="do it without asking; without --yes you are asked to confirm on a terminal, "
        "and refused when stdin is not a terminal",
    )


def template_flags(p: argparse.ArgumentParser, *, defaults: bool, short: bool = False) -> None:
    """The flags of what a task is (payload, queue, priority, attempts, timeout, metadata),
    shared by ``submit`` and the schedule commands, each ``dest`` named after the field it sets.
    Without ``defaults`` an absent flag is None: a schedule update keeps the stored value."""

    def default(value: object) -> object:
        return value if defaults else None

    names = ("--payload", "-p") if short else ("--payload",)
    p.add_argument(
        *names,
        type=inputs.json_object,
        default=default({}),
        metavar="JSON",
        help="the payload, a JSON object: inline, @file to read a file, - to read stdin "
        "(default {})",
    )
    p.add_argument("--queue", type=inputs.queue_name, default=default("default"),
                   help="default: default")  # fmt: skip
    p.add_argument("--max-attempts", type=inputs.positive_int, default=default(5), metavar="N")
    p.add_argument("--priority", type=int, default=default(5), metavar="P",
                   help="0..9, 9 first (default 5)")  # fmt: skip
    p.add_argument("--timeout-ms", type=inputs.positive_int, metavar="MS")
    p.add_argument(
        "--metadata", type=inputs.json_object, metavar="JSON", help="a JSON object (max 4 KB)"
    )
