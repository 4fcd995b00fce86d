"""What the CLI prints: aligned tables, key/value blocks and relative times for people, one JSON
document for scripts, and colour only on a terminal and never with ``NO_COLOR``.

Relative times are computed against the Redis clock (``Queue.now()``), the one clock every dtq
decision uses, so "in 2h 30m" means the same thing on every machine.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

__all__ = [
    "STATUS_COLOUR",
    "Output",
    "fmt_dt",
    "human_duration",
    "json_dt",
    "relative",
    "use_colour",
]

_RESET = "\033[0m"
_COLOURS = {
    "red": "\033[31m",
    "green": "\033[32m",
    "yellow": "\033[33m",
    "blue": "\033[34m",
    "magenta": "\033[35m",
    "cyan": "\033[36m",
    "dim": "\033[2m",
    "bold": "\033[1m",
}
# By TaskStatus value (a test keeps the keys equal to the enum's values).
STATUS_COLOUR: dict[str, str] = {
    "pending": "blue",
    "queued": "cyan",
    "running": "magenta",
    "succeeded": "green",
    "retrying": "yellow",
    "failed": "red",
    "dead_lettered": "red",
    "cancelled": "dim",
    "expired": "dim",
}


def use_colour(stream: TextIO) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set (https://no-color.org)."""
    if os.environ.get("NO_COLOR"):
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def fmt_dt(value: datetime | None) -> str:
    """UTC ISO 8601 with ``Z``; milliseconds only when there are some."""
    if value is None:
        return "-"
    value = value.astimezone(UTC)
    if value.microsecond:
        return value.strftime("%Y-%m-%dT%H:%M:%S.") + f"{value.microsecond // 1000:03d}Z"
    return value.strftime("%Y-%m-%dT%H:%M:%SZ")


def json_dt(value: datetime) -> str:
    """A datetime as the task JSON writes it (pydantic's form): ISO 8601 UTC with ``Z``."""
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def human_duration(seconds: float) -> str:
    """The two largest units, the smaller one rounded: ``45s``, ``1m 30s``, ``2h 30m``,
    ``3d 4h``; a zero smaller unit is left out (``1h``)."""
    total = round(abs(seconds))
    for big, small, big_name, small_name in (
        (86_400, 3_600, "d", "h"),
        (3_600, 60, "h", "m"),
        (60, 1, "m", "s"),
    ):
        if total >= big:
            n_big, n_small = divmod(round(total / small), big // small)
            return f"{n_big}{big_name}" + (f" {n_small}{small_name}" if n_small else "")
    return f"{total}s"


def relative(value: datetime | None, now: datetime, *, past: str = "ago") -> str:
    """``in 2h 30m`` for the future, ``5m ago`` for the past, ``now`` within a second."""
    if value is None:
        return "-"
    delta = (value - now).total_seconds()
    if abs(delta) < 1:
        return "now"
    if delta > 0:
        return f"in {human_duration(delta)}"
    return f"{human_duration(delta)} {past}"


class Output:
    """Where and how one command prints. Errors go to stderr, everything else to stdout."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None) -> None:
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.colour = use_colour(self.out)
        self.err_colour = use_colour(self.err)

    # -- plain text -----------------------------------------------------------------------------

    def paint(self, text: str, colour: str | None, *, err: bool = False) -> str:
        on = self.err_colour if err else self.colour
        if not on or not colour:
            return text
        return f"{_COLOURS[colour]}{text}{_RESET}"

    def status(self, status: str) -> str:
        return self.paint(status, STATUS_COLOUR.get(status))

    def line(self, text: str = "") -> None:
        print(text, file=self.out)

    def note(self, text: str) -> None:
        """A remark for the person at the terminal: stderr, so stdout stays parseable."""
        print(text, file=self.err)

    def error(self, text: str) -> None:
        print(self.paint("dtq: error:", "red", err=True), text, file=self.err)

    def json(self, document: Any) -> None:
        """One JSON document (an object), keys as documented in docs/cli.md."""
        print(json.dumps(document, indent=2, ensure_ascii=False, default=str), file=self.out)

    # -- layouts --------------------------------------------------------------------------------

    def fields(self, pairs: Iterable[tuple[str, str]]) -> None:
        """``key: value`` lines with the keys right-aligned, so each colon lines up and
        ``expires_at: ...`` reads exactly as written."""
        rows = list(pairs)
        width = max((len(k) for k, _ in rows), default=0)
        for key, value in rows:
            self.line(f"{key.rjust(width)}: {value}")

    def table(
        self,
        headers: Sequence[str],
        rows: Sequence[Sequence[str]],
        *,
        colours: Sequence[Sequence[str | None]] | None = None,
    ) -> None:
        """Columns padded to their widest cell; colour is applied after padding so escape codes
        never break the alignment."""
        widths = [len(h) for h in headers]
        for row in rows:
            for i, cell in enumerate(row):
                widths[i] = max(widths[i], len(cell))
        last = len(headers) - 1

        def pad(text: str, i: int) -> str:
            return text if i == last else text.ljust(widths[i])

        self.line("  ".join(self.paint(pad(h, i), "bold") for i, h in enumerate(headers)))
        for r, row in enumerate(rows):
            cells = []
            for i, cell in enumerate(row):
                colour = colours[r][i] if colours is not None else None
                cells.append(self.paint(pad(cell, i), colour))
            self.line("  ".join(cells))
