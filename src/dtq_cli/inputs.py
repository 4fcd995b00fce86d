"""Parsing of command-line values: durations, datetimes, JSON objects, ids and names.

Each parser is an argparse ``type=``: a bad value raises ``argparse.ArgumentTypeError`` whose
text names the rule, and argparse turns it into a usage error (exit 2). Limits that depend on
settings (payload size, max attempts) are checked once, by the SDK, like for every other caller.

The core (pydantic models, redis) is imported only where a value needs it, so ``--help`` and a
usage error answer without loading it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dtq.models import TaskStatus

__all__ = [
    "duration_s",
    "json_object",
    "nonneg_float",
    "nonneg_int",
    "port",
    "positive_int",
    "queue_name",
    "schedule_name",
    "status_name",
    "task_id",
    "ttl",
    "wait_seconds",
    "when",
]

_DURATION_RE = re.compile(r"^(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")
_UNITS_S = (86_400, 3_600, 60, 1)
MAX_DURATION_S = 10 * 365 * 86_400


def duration_s(text: str) -> int:
    """``90s``, ``30m``, ``1h``, ``7d``, ``1h30m`` (units in the order d h m s) or plain seconds.

    Returns whole seconds; ``0`` is allowed (a task submitted already expired).
    """
    value = text.strip().lower()
    if value.isdigit():
        seconds = int(value)
    else:
        match = _DURATION_RE.match(value)
        if not value or match is None:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a duration: use whole numbers with units d, h, m, s in that "
                "order, e.g. 90s, 30m, 1h, 7d, 1h30m (or plain seconds, e.g. 300)"
            )
        seconds = sum(int(n) * unit for n, unit in zip(match.groups(), _UNITS_S, strict=True) if n)
    if seconds > MAX_DURATION_S:
        raise argparse.ArgumentTypeError(f"{text!r} is longer than 10 years")
    return seconds


def when(text: str) -> datetime:
    """An ISO 8601 date-time with a UTC offset (``Z`` or ``+02:00``); a naive one is refused,
    because it would mean a different instant on every machine."""
    try:
        value = datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an ISO 8601 date-time, e.g. 2026-01-28T17:00:00Z"
        ) from None
    if value.utcoffset() is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} has no UTC offset: add Z or +HH:MM (e.g. {text.strip()}Z), "
            "a time without one means something different on every machine"
        )
    return value


def json_object(text: str) -> dict[str, Any]:
    """A JSON object given inline, as ``@path`` (read from a file) or ``-`` (read from stdin)."""
    source = "the value"
    if text == "-":
        text, source = sys.stdin.read(), "stdin"
    elif text.startswith("@"):
        path = Path(text[1:])
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise argparse.ArgumentTypeError(f"cannot read {path}: {exc}") from None
        source = str(path)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{source} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"{source} must be a JSON object ({{...}}), not {type(value).__name__}"
        )
    return value


def _hex_id(text: str, what: str) -> str:
    """A task or workflow id: 32 hexadecimal characters (both are made the same way)."""
    from dtq.models import TASK_ID_RE

    value = text.strip().lower()
    if not TASK_ID_RE.fullmatch(value):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a {what} id (32 hexadecimal characters, as submit prints)"
        )
    return value


def task_id(text: str) -> str:
    return _hex_id(text, "task")


def workflow_id(text: str) -> str:
    return _hex_id(text, "workflow")


def queue_name(text: str) -> str:
    """The core's queue-name rule, with its message (:func:`dtq.models.check_queue_name`)."""
    from dtq.errors import InvalidTaskError
    from dtq.models import check_queue_name

    try:
        return check_queue_name(text)
    except InvalidTaskError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def schedule_name(text: str) -> str:
    """The core's schedule-name rule (the queue-name one), with its message."""
    from dtq.errors import InvalidTaskError
    from dtq.schedules import check_schedule_name

    try:
        return check_schedule_name(text)
    except InvalidTaskError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def ttl(text: str) -> timedelta:
    """A :func:`duration_s` as the SDK's ``ttl`` option."""
    return timedelta(seconds=duration_s(text))


def status_name(text: str) -> TaskStatus:
    """The core's status rule, with its message (:func:`dtq.models.check_status`)."""
    from dtq.errors import InvalidTaskError
    from dtq.models import check_status

    try:
        return check_status(text.strip().lower())
    except InvalidTaskError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def limit_name(text: str) -> str:
    """The core's limit-name rule, with its message."""
    from dtq.limits import LimitSpecError, check_limit_name

    try:
        return check_limit_name(text)
    except LimitSpecError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more")
    return value


def nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number, 0 or more")
    return value


def wait_seconds(text: str) -> float:
    """How long a wait may last: seconds, more than 0 and at most the SDK's bound
    (:data:`dtq.waits.MAX_WAIT_S`, a day)."""
    from dtq.waits import MAX_WAIT_S

    value = nonneg_float(text)
    if not 0 < value <= MAX_WAIT_S:
        raise argparse.ArgumentTypeError(
            f"{text!r} must be more than 0 and at most {MAX_WAIT_S:g} seconds"
        )
    return value


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (1-65535)")
    return value
