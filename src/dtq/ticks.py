"""When a periodic schedule fires: pure functions over epoch milliseconds (UTC).

Nothing here reads a clock, the environment or Redis: every "now" is a parameter, so the
scheduler passes the Redis clock and the tests pass fixed instants.

Two kinds of spec:

- :class:`Cron`: a cron expression (5 fields, or 6 with the seconds field first) evaluated in an
  IANA time zone (UTC unless given; never the host's zone). Parsing is cronsim's, and so are the
  DST rules, which follow Debian cron. When neither the minute nor the hour field starts with
  ``*`` (a fixed time of day: ``30 2 * * *``, ``0 30 2 * * *``), a local time that does not exist
  (spring forward) fires once, at the first instant after the jump, and a local time that exists
  twice (fall back) fires once, at its first occurrence. cronsim applies this to 5-field
  expressions only; dtq applies it to 6-field ones too. Other expressions (``0 * * * *``,
  ``*/15 * * * *``, ``0 */2 * * *``) fire at every matching elapsed instant: both 02:00s of a
  fall-back night fire, and no hour is invented in a spring-forward gap.
- :class:`Every`: a fixed interval; ticks are ``anchor_ms + k * seconds * 1000`` for every integer
  ``k`` (aligned to the epoch by default). Intervals know nothing of time zones, so DST cannot move
  them.

:func:`plan` decides which ticks fire now. ``cursor_ms`` is the earliest tick not decided yet.
The *due* ticks are those in ``[cursor_ms, now_ms]`` that are also ``>= start_ms`` and
``<= end_ms``:

- a due tick no older than ``grace_ms`` (``tick >= now_ms - grace_ms``) is *late*, not missed: it
  always fires, whatever the catch-up policy (a standby taking over two seconds late fires every
  tick);
- the older due ticks are *missed* (downtime, a pause). ``skip`` fires none of them; ``latest``
  fires only the most recent one, and only when no late tick fires (one gap never fires twice);
  ``all`` fires every missed tick within ``window_ms`` before now (``tick >= now_ms - window_ms``),
  at most the ``cap`` most recent of them. Missed ticks that do not fire are counted (exactly up
  to :data:`MISSED_COUNT_CAP`, then ``missed_capped``);
- ``fire`` is ascending and at most ``max_fire`` long. When more would fire, the earliest
  ``max_fire`` of them fire, ``more`` is True and ``cursor`` is the first tick not decided yet:
  calling :func:`plan` again with it (and the same ``now_ms``) fires the rest, and the missed ticks
  before the first fired one are counted in the first call only;
- otherwise ``cursor`` is the first tick after ``now_ms`` (and ``None`` once no tick is left before
  ``end_ms``). A cursor before ``start_ms`` starts at the first tick ``>= start_ms``; a cursor after
  ``now_ms`` means nothing is due and comes back unchanged (rounded up to a tick if it is not one).

The usual call (one tick due) costs two cron evaluations; interval specs are plain arithmetic.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from itertools import chain
from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from dtq.errors import ScheduleSpecError

__all__ = [
    "MAX_EVERY_S",
    "MISSED_COUNT_CAP",
    "Catchup",
    "Cron",
    "Every",
    "Plan",
    "Spec",
    "format_every",
    "latest_at_or_before",
    "next_after",
    "parse_cron",
    "parse_every",
    "plan",
    "preview",
]

MISSED_COUNT_CAP = 10_000
MAX_EVERY_S = 366 * 86_400

Catchup = Literal["skip", "latest", "all"]
CATCHUP_POLICIES: tuple[Catchup, ...] = ("skip", "latest", "all")

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)

_CRON_ALLOWED = (
    "5 fields (minute 0-59, hour 0-23, day-of-month 1-31 or L or LW, month 1-12 or JAN-DEC, "
    "day-of-week 0-7 or SUN-SAT, with dow L and #n) or 6 with a seconds field (0-59) first; "
    "each field *, a value, a-b, a,b or a step /n"
)
_EVERY_ALLOWED = (
    "a whole number of seconds (90) or units d h m s in that order (45s, 5m, 1h30m, 2d), "
    f"from 1 s to {MAX_EVERY_S // 86_400} days"
)
_EVERY_RE = re.compile(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", re.ASCII)
_UNITS_S = (86_400, 3_600, 60, 1)


@dataclass(frozen=True, slots=True)
class Cron:
    """A cron expression in an IANA zone; build it with :func:`parse_cron` to validate it."""

    expr: str
    tz: str = "UTC"


@dataclass(frozen=True, slots=True)
class Every:
    """A tick every ``seconds``, at ``anchor_ms + k * seconds * 1000``."""

    seconds: int
    anchor_ms: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.seconds, bool) or not isinstance(self.seconds, int):
            raise ScheduleSpecError(f"every must be {_EVERY_ALLOWED}", field="every")
        if not 1 <= self.seconds <= MAX_EVERY_S:
            raise ScheduleSpecError(
                f"every is {self.seconds} s; it must be {_EVERY_ALLOWED}", field="every"
            )
        if isinstance(self.anchor_ms, bool) or not isinstance(self.anchor_ms, int):
            raise ScheduleSpecError("anchor must be epoch milliseconds (an int)", field="anchor")


Spec = Cron | Every


@dataclass(frozen=True, slots=True)
class Plan:
    """What :func:`plan` decided; the module docstring gives the rules."""

    fire: list[int]
    missed: int
    missed_capped: bool
    first_missed: int | None
    last_missed: int | None
    cursor: int | None
    more: bool


# ---------------------------------------------------------------- parsing


def _zone(tz: str) -> tzinfo:
    # cronsim applies no DST rule to UTC; the ZoneInfo object for "UTC" would take its slower
    # local-time path for the same ticks.
    return UTC if tz == "UTC" else ZoneInfo(tz)


def _check_tz(tz: object) -> str:
    if not isinstance(tz, str) or not tz.strip():
        raise ScheduleSpecError("tz must be an IANA time zone name such as UTC", field="tz")
    tz = tz.strip()
    # "localtime" is the host's zone in disguise: a schedule must not depend on the machine.
    if tz.lower() == "localtime":
        raise ScheduleSpecError(
            "tz 'localtime' is the host's zone; give an IANA name such as Europe/Paris", field="tz"
        )
    try:
        ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ScheduleSpecError(
            f"unknown time zone {tz!r}; give an IANA name such as UTC or Europe/Paris", field="tz"
        ) from None
    return tz


def parse_cron(expr: str, tz: str = "UTC") -> Cron:
    """Validate a cron expression and its zone; the expression comes back with single spaces."""
    if not isinstance(expr, str):
        raise ScheduleSpecError(f"cron must be a string: {_CRON_ALLOWED}", field="cron")
    parts = expr.split()
    if len(parts) not in (5, 6):
        raise ScheduleSpecError(
            f"cron {expr!r} has {len(parts)} fields; expected {_CRON_ALLOWED}", field="cron"
        )
    norm = " ".join(parts)
    zone = _check_tz(tz)
    try:
        CronSim(norm, _EPOCH)
    except CronSimError as exc:
        raise ScheduleSpecError(
            f"cron {norm!r}: {str(exc).lower()}; expected {_CRON_ALLOWED}", field="cron"
        ) from None
    return Cron(norm, zone)


def parse_every(text: str | int | float) -> int:
    """Seconds of an interval: ``90``, ``"90"``, ``"45s"``, ``"5m"``, ``"1h30m"``, ``"2d"``."""
    if isinstance(text, bool):
        raise ScheduleSpecError(f"every must be {_EVERY_ALLOWED}", field="every")
    if isinstance(text, float):
        if not text.is_integer():
            raise ScheduleSpecError(
                f"every {text!r} is not a whole number of seconds; it must be {_EVERY_ALLOWED}",
                field="every",
            )
        seconds = int(text)
    elif isinstance(text, int):
        seconds = text
    elif isinstance(text, str):
        raw = text.strip().lower()
        match = _EVERY_RE.fullmatch(raw)
        if raw.isascii() and raw.isdigit():  # str.isdigit alone takes any script's digits
            seconds = int(raw)
        elif raw and match is not None:
            counts = zip(match.groups(), _UNITS_S, strict=True)
            seconds = sum(int(n) * unit for n, unit in counts if n)
        else:
            raise ScheduleSpecError(f"every {text!r}: it must be {_EVERY_ALLOWED}", field="every")
    else:
        raise ScheduleSpecError(f"every must be {_EVERY_ALLOWED}", field="every")
    if not 1 <= seconds <= MAX_EVERY_S:
        raise ScheduleSpecError(f"every {text!r}: it must be {_EVERY_ALLOWED}", field="every")
    return seconds


def format_every(seconds: int) -> str:
    """The shortest unit string :func:`parse_every` reads back as ``seconds`` (5400 -> "1h30m")."""
    if seconds < 1:
        raise ScheduleSpecError(f"every must be {_EVERY_ALLOWED}", field="every")
    out = []
    for unit, name in zip(_UNITS_S, "dhms", strict=True):
        n, seconds = divmod(seconds, unit)
        if n:
            out.append(f"{n}{name}")
    return "".join(out)


# ---------------------------------------------------------------- cron evaluation


def _to_ms(dt: datetime) -> int:
    return (dt - _EPOCH) // _MS


def _cronsim(spec: Cron, t_ms: int, *, reverse: bool = False) -> CronSim:
    """A cronsim iterator from the whole second at or before ``t_ms``, in the spec's zone."""
    start = (_EPOCH + timedelta(milliseconds=t_ms - t_ms % 1000)).astimezone(_zone(spec.tz))
    if reverse:
        # With microseconds, cronsim's reverse iteration considers the start second itself.
        start = start.replace(microsecond=1)
    it = CronSim(spec.expr, start, reverse=reverse)
    parts = spec.expr.split()
    # cronsim gives Debian cron's DST rules (a fixed local time fires once when skipped or
    # repeated) to 5-field expressions only; a 6-field one with a fixed minute and hour would
    # skip its tick on a spring-forward day and fire twice on a fall-back day. The same
    # local-time walk cronsim uses for 5 fields gives it the same rules.
    if (
        it.fixup_tz is None
        and start.tzinfo is not UTC
        and len(parts) == 6
        and not parts[1].startswith("*")
        and not parts[2].startswith("*")
    ):
        it.fixup_tz = it.dt.tzinfo
        it.dt = it.dt.replace(tzinfo=None)
    return it


def _cron_after(spec: Cron, t_ms: int) -> Iterator[int]:
    """Cron ticks strictly after ``t_ms``, ascending; ends when none comes within 50 years."""
    # cronsim ticks one second forward before it matches, so its first result is after the
    # whole second at or before t_ms, and so strictly after t_ms.
    it = _cronsim(spec, t_ms)
    last = t_ms
    for dt in it:
        ms = _to_ms(dt)
        # Started inside a fall-back fold, cronsim walks local time and may name the first
        # occurrence of a wall time already passed: those are not after t_ms.
        if ms > last:
            last = ms
            yield ms


def _cron_reverse_once(spec: Cron, t_ms: int) -> int | None:
    dt = next(_cronsim(spec, t_ms, reverse=True), None)
    return None if dt is None else _to_ms(dt)


def _cron_latest(spec: Cron, t_ms: int) -> int | None:
    """The last cron tick at or before ``t_ms``."""
    probe, step = t_ms, 1000
    found = _cron_reverse_once(spec, probe)
    while found is not None and found > t_ms:
        # A skipped local time is named by the instant after the jump: should that instant lie
        # after t_ms, look again from further back (a safety net; starting at t_ms's own
        # second, as _cronsim does, keeps cronsim's answer at or before t_ms in every zone
        # the tests cover).
        probe -= step
        step *= 2
        found = _cron_reverse_once(spec, probe)
    if found is None:
        return None
    # Reverse iteration walks local time: inside a fall-back fold it can miss a tick of the
    # first pass of the repeated hour. Walking forward from its answer finds the true last one.
    for later in _cron_after(spec, found):
        if later > t_ms:
            break
        found = later
    return found


# ---------------------------------------------------------------- spec-independent helpers


def _every_first_at_or_after(spec: Every, t_ms: int) -> int:
    period = spec.seconds * 1000
    return spec.anchor_ms - ((spec.anchor_ms - t_ms) // period) * period


def _every_last_at_or_before(spec: Every, t_ms: int) -> int:
    period = spec.seconds * 1000
    return spec.anchor_ms + ((t_ms - spec.anchor_ms) // period) * period


def _ticks_from(spec: Spec, lo_ms: int) -> Iterator[int]:
    """Ticks at or after ``lo_ms``, ascending."""
    if isinstance(spec, Cron):
        return _cron_after(spec, lo_ms - 1)
    return _every_from(spec, lo_ms)


def _every_from(spec: Every, lo_ms: int) -> Iterator[int]:
    tick, period = _every_first_at_or_after(spec, lo_ms), spec.seconds * 1000
    while True:
        yield tick
        tick += period


def _first_at_or_after(spec: Spec, t_ms: int) -> int | None:
    if isinstance(spec, Every):
        return _every_first_at_or_after(spec, t_ms)
    return next(_cron_after(spec, t_ms - 1), None)


def _last_at_or_before(spec: Spec, t_ms: int) -> int | None:
    if isinstance(spec, Every):
        return _every_last_at_or_before(spec, t_ms)
    return _cron_latest(spec, t_ms)


def _count(spec: Spec, lo_ms: int, hi_ms: int, limit: int) -> int:
    """How many ticks lie in ``[lo_ms, hi_ms]``, counting no further than ``limit``."""
    if hi_ms < lo_ms:
        return 0
    if isinstance(spec, Every):
        period = spec.seconds * 1000
        first = _every_first_at_or_after(spec, lo_ms)
        return min(limit, max(0, (hi_ms - first) // period + 1))
    n = 0
    for tick in _ticks_from(spec, lo_ms):
        if tick > hi_ms or n >= limit:
            break
        n += 1
    return n


def _earliest_of_latest(spec: Spec, lo_ms: int, hi_ms: int, n: int) -> int | None:
    """The earliest of the ``n`` most recent ticks in ``[lo_ms, hi_ms]`` (None if there is none)."""
    if n < 1 or hi_ms < lo_ms:
        return None
    last = _last_at_or_before(spec, hi_ms)
    if last is None or last < lo_ms:
        return None
    if isinstance(spec, Every):
        first = _every_first_at_or_after(spec, lo_ms)
        return max(first, last - (n - 1) * spec.seconds * 1000)
    for _ in range(n - 1):
        before = _cron_latest(spec, last - 1)
        if before is None or before < lo_ms:
            break
        last = before
    return last


# ---------------------------------------------------------------- public queries


def next_after(spec: Spec, t_ms: int, *, end_ms: int | None = None) -> int | None:
    """The first tick strictly after ``t_ms``; None if none comes by ``end_ms`` (or ever)."""
    tick = _first_at_or_after(spec, t_ms + 1)
    if tick is None or (end_ms is not None and tick > end_ms):
        return None
    return tick


def latest_at_or_before(spec: Spec, t_ms: int, *, start_ms: int | None = None) -> int | None:
    """The last tick at or before ``t_ms``; None if none is at or after ``start_ms``."""
    tick = _last_at_or_before(spec, t_ms)
    if tick is None or (start_ms is not None and tick < start_ms):
        return None
    return tick


def preview(spec: Spec, after_ms: int, n: int, *, end_ms: int | None = None) -> list[int]:
    """The next ``n`` ticks strictly after ``after_ms`` (fewer if ``end_ms`` comes first)."""
    out: list[int] = []
    if n < 1:
        return out
    for tick in _ticks_from(spec, after_ms + 1):
        if end_ms is not None and tick > end_ms:
            break
        out.append(tick)
        if len(out) == n:
            break
    return out


def plan(
    spec: Spec,
    cursor_ms: int,
    now_ms: int,
    *,
    catchup: Catchup,
    grace_ms: int,
    window_ms: int,
    cap: int,
    max_fire: int = 32,
    start_ms: int | None = None,
    end_ms: int | None = None,
) -> Plan:
    """Decide the due ticks in ``[cursor_ms, now_ms]``: the module docstring gives the rules."""
    if catchup not in CATCHUP_POLICIES:
        raise ScheduleSpecError(
            f"catch-up policy {catchup!r}: expected one of skip, latest, all", field="catchup"
        )
    if grace_ms < 0 or window_ms < 0 or cap < 0 or max_fire < 1:
        raise ValueError("grace_ms, window_ms and cap must be >= 0 and max_fire >= 1")

    lo = cursor_ms if start_ms is None else max(cursor_ms, start_ms)
    hi = now_ms if end_ms is None else min(now_ms, end_ms)
    ticks = _ticks_from(spec, lo)
    first = next(ticks, None)
    if first is None or (end_ms is not None and first > end_ms):
        return Plan([], 0, False, None, None, None, False)
    if first > hi:
        return Plan([], 0, False, None, None, first, False)

    late_lo = now_ms - grace_ms
    fire_from: int | None
    if first >= late_lo:
        # The usual case: nothing is missed and the iterator already stands on the first tick.
        fire_from = first
        fire_iter: Iterator[int] = chain((first,), ticks)
    else:
        missed_hi = min(hi, late_lo - 1)
        first_late = _first_at_or_after(spec, late_lo)
        if first_late is not None and first_late > hi:
            first_late = None
        if catchup == "all":
            fire_from = _earliest_of_latest(spec, max(first, now_ms - window_ms), missed_hi, cap)
            if fire_from is None:
                fire_from = first_late
        elif catchup == "latest" and first_late is None:
            fire_from = _last_at_or_before(spec, missed_hi)
        else:
            fire_from = first_late
        fire_iter = _ticks_from(spec, fire_from) if fire_from is not None else iter(())

    # Every tick before the first fired one (or every due tick, when none fires) is missed.
    missed_hi_incl = (fire_from - 1) if fire_from is not None else hi
    counted = _count(spec, first, missed_hi_incl, MISSED_COUNT_CAP + 1)
    missed = min(counted, MISSED_COUNT_CAP)
    last_missed = _last_at_or_before(spec, missed_hi_incl) if counted else None

    fire: list[int] = []
    cursor: int | None = None
    more = False
    for tick in fire_iter:
        if tick > hi:
            cursor = tick
            break
        if len(fire) == max_fire:
            cursor, more = tick, True
            break
        fire.append(tick)
    if fire_from is None:
        cursor = _first_at_or_after(spec, hi + 1)
    if cursor is not None and end_ms is not None and cursor > end_ms:
        cursor = None
    return Plan(
        fire=fire,
        missed=missed,
        missed_capped=counted > MISSED_COUNT_CAP,
        first_missed=first if counted else None,
        last_missed=last_missed,
        cursor=cursor,
        more=more,
    )
