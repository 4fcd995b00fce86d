"""Tick computation for periodic schedules (dtq.ticks): parsing, cron ticks across DST in fixed
instants, intervals, and plan()'s catch-up decisions. No clock is read: every instant is fixed."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from itertools import pairwise
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from dtq import ticks
from dtq.errors import InvalidTaskError, ScheduleSpecError
from dtq.ticks import (
    MISSED_COUNT_CAP,
    Cron,
    Every,
    Plan,
    Spec,
    format_every,
    latest_at_or_before,
    next_after,
    parse_cron,
    parse_every,
    plan,
    preview,
)

S = 1000
MIN = 60 * S
H = 60 * MIN
DAY = 24 * H


def ms(iso: str) -> int:
    """Epoch ms of an ISO 8601 instant with an explicit offset."""
    return int(datetime.fromisoformat(iso).timestamp() * 1000)


def local(t_ms: int, tz: str) -> str:
    """The wall time of ``t_ms`` in ``tz``, with its offset (``2025-03-30T03:00:00+02:00``)."""
    return datetime.fromtimestamp(t_ms / 1000, UTC).astimezone(ZoneInfo(tz)).isoformat()


T0 = ms("2025-06-01T10:00:00+00:00")


def between(spec: Spec, lo_iso: str, hi_iso: str) -> list[int]:
    """Every tick in ``(lo, hi]``."""
    return preview(spec, ms(lo_iso), 10_000, end_ms=ms(hi_iso))


# ---------------------------------------------------------------- parsing and errors


def test_parse_cron_normalises_whitespace_and_keeps_the_zone() -> None:
    assert parse_cron("  30   2 * *\t* ", "Europe/Paris") == Cron("30 2 * * *", "Europe/Paris")
    assert parse_cron("*/5 * * * * *") == Cron("*/5 * * * * *", "UTC")


@pytest.mark.parametrize(
    ("expr", "needle"),
    [
        ("* * * *", "4 fields"),
        ("* * * * * * *", "7 fields"),
        ("", "0 fields"),
        ("60 * * * *", "bad minute"),
        ("* 24 * * *", "bad hour"),
        ("0 0 32 * *", "bad day-of-month"),
        ("0 0 * 13 *", "bad month"),
        ("0 0 * * 8", "bad day-of-week"),
        ("61 * * * * *", "bad second"),
        ("0 0 30 2 *", "bad day-of-month"),  # a date that never exists is refused, not run never
        ("five * * * *", "bad minute"),
    ],
)
def test_parse_cron_rejects_bad_expressions(expr: str, needle: str) -> None:
    with pytest.raises(ScheduleSpecError) as info:
        parse_cron(expr)
    err = info.value
    assert err.field == "cron" and err.details["field"] == "cron"
    assert err.code == "INVALID_SCHEDULE" and isinstance(err, InvalidTaskError)
    assert needle in err.message
    assert "minute 0-59" in err.message  # says what is allowed


@pytest.mark.parametrize("tz", ["Mars/Base", "", "Europe", "../etc/passwd", "utc", "localtime"])
def test_parse_cron_rejects_unknown_zones(tz: str) -> None:
    with pytest.raises(ScheduleSpecError) as info:
        parse_cron("0 7 * * *", tz)
    assert info.value.field == "tz"
    assert "IANA" in info.value.message


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90),
        (90, 90),
        (90.0, 90),
        ("45s", 45),
        ("5m", 300),
        ("1h30m", 5400),
        ("2d", 172_800),
        ("1d2h3m4s", 93_784),
        (" 5M ", 300),
        ("366d", 366 * 86_400),
    ],
)
def test_parse_every_accepts(text: str | int | float, seconds: int) -> None:
    assert parse_every(text) == seconds


@pytest.mark.parametrize(
    "text", ["5x", 0, -5, "0", "0s", "-5m", "", "1.5", 1.5, True, "1m1h", "5 m", "367d", "h"]
)
def test_parse_every_rejects(text: str | int | float) -> None:
    with pytest.raises(ScheduleSpecError) as info:
        parse_every(text)
    assert info.value.field == "every"
    assert "45s, 5m, 1h30m, 2d" in info.value.message


@pytest.mark.parametrize(
    ("seconds", "text"), [(5400, "1h30m"), (45, "45s"), (300, "5m"), (86_400, "1d"), (90, "1m30s")]
)
def test_format_every(seconds: int, text: str) -> None:
    assert format_every(seconds) == text


@given(st.integers(min_value=1, max_value=366 * 86_400))
def test_format_every_is_the_inverse_of_parse_every(seconds: int) -> None:
    assert parse_every(format_every(seconds)) == seconds


@pytest.mark.parametrize("seconds", [0, -1, 366 * 86_400 + 1])
def test_every_refuses_an_impossible_interval(seconds: int) -> None:
    with pytest.raises(ScheduleSpecError) as info:
        Every(seconds)
    assert info.value.field == "every"


def test_plan_rejects_an_unknown_catchup_policy() -> None:
    with pytest.raises(ScheduleSpecError) as info:
        plan(Every(1), 0, 0, catchup="sometimes", grace_ms=0, window_ms=0, cap=0)  # type: ignore[arg-type]
    assert info.value.field == "catchup"


# ---------------------------------------------------------------- next / latest / preview


def test_next_after_is_strictly_after_and_latest_is_at_or_before() -> None:
    spec = parse_cron("*/15 * * * *")
    t = ms("2025-06-01T10:15:00+00:00")
    assert next_after(spec, t) == t + 15 * MIN
    assert next_after(spec, t - 1) == t
    assert next_after(spec, t + 500) == t + 15 * MIN  # a fraction of a second after a tick
    assert latest_at_or_before(spec, t) == t
    assert latest_at_or_before(spec, t - 1) == t - 15 * MIN
    assert latest_at_or_before(spec, t + 14 * MIN + 999) == t


def test_bounds_end_and_start() -> None:
    spec = parse_cron("0 * * * *")
    t = ms("2025-06-01T10:00:00+00:00")
    assert next_after(spec, t, end_ms=t + H) == t + H  # end is inclusive
    assert next_after(spec, t, end_ms=t + H - 1) is None
    assert latest_at_or_before(spec, t, start_ms=t) == t  # start is inclusive
    assert latest_at_or_before(spec, t, start_ms=t + 1) is None
    assert preview(spec, t, 5, end_ms=t + 2 * H) == [t + H, t + 2 * H]
    assert preview(spec, t, 0) == []


def test_a_cron_that_never_fires_has_no_tick() -> None:
    # cronsim accepts it (days 1 and 31 of February, each also the fifth Monday) and gives up
    # after 50 years of search: no tick, no endless loop.
    spec = parse_cron("0 0 */30 2 MON#5", "Europe/Paris")
    assert next_after(spec, T0) is None and latest_at_or_before(spec, T0) is None
    assert preview(spec, T0, 3) == []
    p = plan(spec, 0, T0, catchup="all", grace_ms=0, window_ms=DAY, cap=5)
    assert p == Plan([], 0, False, None, None, None, False)


def test_six_fields_put_seconds_first() -> None:
    spec = parse_cron("*/20 * * * * *")
    t = ms("2025-06-01T10:00:00+00:00")
    assert preview(spec, t, 4) == [t + 20 * S, t + 40 * S, t + 60 * S, t + 80 * S]


def test_every_is_aligned_to_the_epoch_unless_anchored() -> None:
    t = ms("2025-06-01T10:07:13.250+00:00")
    assert next_after(Every(300), t) == ms("2025-06-01T10:10:00+00:00")
    assert latest_at_or_before(Every(300), t) == ms("2025-06-01T10:05:00+00:00")
    anchored = Every(300, anchor_ms=ms("2025-06-01T10:01:30+00:00"))
    assert next_after(anchored, t) == ms("2025-06-01T10:11:30+00:00")
    assert latest_at_or_before(anchored, t) == ms("2025-06-01T10:06:30+00:00")
    # the anchor is a tick, and ticks exist before it too: the grid extends both ways
    assert latest_at_or_before(anchored, anchored.anchor_ms) == anchored.anchor_ms
    assert next_after(anchored, anchored.anchor_ms - 300 * S) == anchored.anchor_ms


# ---------------------------------------------------------------- DST and time zones


@pytest.mark.parametrize(
    ("tz", "before_spring", "shifted", "before_fall", "fall_tick"),
    [
        (
            "Europe/Paris",
            "2025-03-29T12:00:00+00:00",
            "2025-03-30T03:00:00+02:00",
            "2025-10-25T12:00:00+00:00",
            "2025-10-26T02:30:00+02:00",  # the first of the two 02:30s
        ),
        (
            "America/New_York",
            "2025-03-08T12:00:00+00:00",
            "2025-03-09T03:00:00-04:00",
            "2025-11-01T12:00:00+00:00",
            "2025-11-02T02:30:00-05:00",  # 02:30 exists once in New York (01:00-02:00 repeats)
        ),
    ],
)
@pytest.mark.parametrize("expr", ["30 2 * * *", "0 30 2 * * *"])
def test_fixed_local_time_across_dst(
    expr: str, tz: str, before_spring: str, shifted: str, before_fall: str, fall_tick: str
) -> None:
    spec = parse_cron(expr, tz)
    # Spring forward: 02:30 does not exist; it fires once at the shifted instant (03:00 local),
    # and the days around it fire at 02:30 as usual.
    spring = [local(t, tz) for t in preview(spec, ms(before_spring), 3)]
    assert spring[0] == shifted
    assert [s[11:19] for s in spring[1:]] == ["02:30:00", "02:30:00"]
    assert [s[:10] for s in spring] == sorted({s[:10] for s in spring})  # one a day
    # Fall back: once, on the first occurrence of the wall time; one tick a day.
    fall = [local(t, tz) for t in preview(spec, ms(before_fall), 3)]
    assert fall[0] == fall_tick
    assert [s[11:19] for s in fall] == ["02:30:00"] * 3
    assert len({s[:10] for s in fall}) == 3


@pytest.mark.parametrize(
    ("expr", "tz", "night", "once"),
    [
        ("30 2 * * *", "Europe/Paris", "2025-10-26T00:00:00+02:00", "2025-10-26T02:30:00+02:00"),
        (
            "30 1 * * *",
            "America/New_York",
            "2025-11-02T00:00:00-04:00",
            "2025-11-02T01:30:00-04:00",
        ),
    ],
)
def test_fixed_time_in_the_repeated_hour_fires_once(
    expr: str, tz: str, night: str, once: str
) -> None:
    # Bug class: a scheduler firing a fixed local time twice on a fall-back night (croniter 7.0
    # yields both the summer-time and the winter-time 02:30 for `30 2 * * *` in Paris).
    spec = parse_cron(expr, tz)
    start = ms(night)
    ticks_that_night = preview(spec, start, 10, end_ms=start + 12 * H)
    assert [local(t, tz) for t in ticks_that_night] == [once]
    # ... and a scheduler that calls plan() every minute through the night fires it once.
    assert _fired_by_minute_loop(spec, night_start=start) == ticks_that_night


def _fired_by_minute_loop(spec: Spec, *, night_start: int) -> list[int]:
    fired: list[int] = []
    cursor = next_after(spec, night_start)
    for now in range(night_start, night_start + 12 * H, MIN):
        assert cursor is not None
        p = plan(spec, cursor, now, catchup="latest", grace_ms=5 * S, window_ms=H, cap=10)
        fired += p.fire
        assert p.missed == 0 and not p.more
        cursor = p.cursor
    return fired


def test_hourly_cron_fires_every_elapsed_hour_across_dst() -> None:
    spec = parse_cron("0 * * * *", "Europe/Paris")
    fall = between(spec, "2025-10-26T00:30:00+02:00", "2025-10-26T04:30:00+01:00")
    assert [local(t, spec.tz) for t in fall] == [
        "2025-10-26T01:00:00+02:00",
        "2025-10-26T02:00:00+02:00",
        "2025-10-26T02:00:00+01:00",  # both 02:00s, one hour apart
        "2025-10-26T03:00:00+01:00",
        "2025-10-26T04:00:00+01:00",
    ]
    assert {b - a for a, b in pairwise(fall)} == {H}
    spring = between(spec, "2025-03-30T00:30:00+01:00", "2025-03-30T05:30:00+02:00")
    assert [local(t, spec.tz) for t in spring] == [
        "2025-03-30T01:00:00+01:00",
        "2025-03-30T03:00:00+02:00",  # no 02:00 invented in the gap, no hour fired twice
        "2025-03-30T04:00:00+02:00",
        "2025-03-30T05:00:00+02:00",
    ]
    assert {b - a for a, b in pairwise(spring)} == {H}


def test_intervals_are_immune_to_dst() -> None:
    spec = Every(3600)
    for lo, hi in [
        ("2025-03-29T20:00:00+00:00", "2025-03-30T06:00:00+00:00"),
        ("2025-10-25T20:00:00+00:00", "2025-10-26T06:00:00+00:00"),
        ("2025-11-01T20:00:00+00:00", "2025-11-02T12:00:00+00:00"),
    ]:
        got = between(spec, lo, hi)
        assert len(got) == (ms(hi) - ms(lo)) // H
        assert {b - a for a, b in pairwise(got)} == {H}


def test_the_day_after_a_dst_change_fires_at_the_same_wall_time() -> None:
    # Bug class: a scheduler that computes the time remaining until the next run in naive local
    # time (Celery beat's crontab with a timezone) fires an hour late or early on the days after
    # a DST change. 07:00 Paris must stay 07:00 local, so the UTC gaps are 23 h and 25 h.
    spec = parse_cron("0 7 * * *", "Europe/Paris")
    for before, offsets, gap in [
        ("2025-03-27T12:00:00+00:00", ["+01:00", "+01:00", "+02:00", "+02:00"], 23 * H),
        ("2025-10-23T12:00:00+00:00", ["+02:00", "+02:00", "+01:00", "+01:00"], 25 * H),
    ]:
        got = preview(spec, ms(before), 4)
        assert [local(t, spec.tz)[11:] for t in got] == [f"07:00:00{o}" for o in offsets]
        assert [b - a for a, b in pairwise(got)] == [DAY, gap, DAY]
        # computed from any instant of the day after the change, the next run is still 07:00
        for t in range(got[2] + S, got[3], 97 * MIN):
            assert next_after(spec, t) == got[3]


def test_a_day_without_midnight_still_fires() -> None:
    # Bug class: a scheduler that looks for the next run from local midnight skips the whole day
    # when midnight does not exist (Africa/Cairo 2025-04-25: 00:00 jumps to 01:00).
    tz = "Africa/Cairo"
    daily = parse_cron("0 0 * * *", tz)
    got = [
        local(t, tz)
        for t in between(daily, "2025-04-23T12:00:00+00:00", "2025-04-26T12:00:00+00:00")
    ]
    assert got == [
        "2025-04-24T00:00:00+02:00",
        "2025-04-25T01:00:00+03:00",  # the missing midnight fires once, right after the jump
        "2025-04-26T00:00:00+03:00",
    ]
    two_hourly = parse_cron("0 */2 * * *", tz)
    that_day = between(two_hourly, "2025-04-24T23:59:59+02:00", "2025-04-25T23:59:59+03:00")
    assert [local(t, tz)[11:13] for t in that_day] == [f"{h:02d}" for h in range(2, 24, 2)]


def test_a_thirty_minute_dst_shift() -> None:
    # Bug class: code assuming DST shifts by a whole hour. Lord Howe Island moves 30 minutes:
    # 2025-10-05 02:00 -> 02:30 (+10:30 -> +11), 2025-04-06 02:00 -> 01:30 (+11 -> +10:30).
    tz = "Australia/Lord_Howe"
    spring = parse_cron("15 2 * * *", tz)
    got = [local(t, tz) for t in preview(spring, ms("2025-10-03T12:00:00+00:00"), 3)]
    assert got == [
        "2025-10-04T02:15:00+10:30",
        "2025-10-05T02:30:00+11:00",  # 02:15 does not exist: once, right after the jump
        "2025-10-06T02:15:00+11:00",
    ]
    fall = parse_cron("45 1 * * *", tz)
    night = between(fall, "2025-04-05T12:00:00+00:00", "2025-04-06T12:00:00+00:00")
    assert [local(t, tz) for t in night] == ["2025-04-06T01:45:00+11:00"]  # once, not twice
    quarter = parse_cron("*/15 * * * *", tz)
    elapsed = between(quarter, "2025-04-06T01:00:00+11:00", "2025-04-06T02:30:00+10:30")
    assert len(elapsed) == 8  # two hours elapsed (01:00 to 02:00 at +11, 01:30 to 02:30 after)
    assert {b - a for a, b in pairwise(elapsed)} == {15 * MIN}


@pytest.fixture
def host_in_tokyo() -> Iterator[None]:
    saved = os.environ.get("TZ")
    os.environ["TZ"] = "Asia/Tokyo"
    time.tzset()
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = saved
        time.tzset()


def test_the_host_zone_never_leaks_in(request: pytest.FixtureRequest) -> None:
    # Bug class: a schedule without a zone silently evaluated in the host's zone.
    t = ms("2025-06-01T10:07:00+00:00")
    specs: list[Spec] = [parse_cron("0 7 * * *"), Cron("30 2 * * *", "Europe/Paris"), Every(3600)]
    before = [preview(s, t, 3) for s in specs]
    assert before[0][0] == ms("2025-06-02T07:00:00+00:00")  # 07:00 UTC, the default zone
    request.getfixturevalue("host_in_tokyo")
    assert time.localtime(0).tm_hour == 9  # the host really is in Tokyo now
    assert [preview(s, t, 3) for s in specs] == before


@given(
    expr=st.sampled_from(
        ["30 2 * * *", "0 * * * *", "*/20 1-3 * * *", "0 30 2 * * *", "15 1 * * 0"]
    ),
    tz=st.sampled_from(["Europe/Paris", "America/New_York", "Australia/Lord_Howe", "UTC"]),
    t=st.integers(
        min_value=ms("2025-03-01T00:00:00+00:00"), max_value=ms("2025-12-01T00:00:00+00:00")
    ),
)
@hsettings(max_examples=300, deadline=None)
def test_next_and_latest_agree_everywhere(expr: str, tz: str, t: int) -> None:
    spec = parse_cron(expr, tz)
    nxt, last = next_after(spec, t), latest_at_or_before(spec, t)
    assert nxt is not None and last is not None
    assert last <= t < nxt
    # no tick strictly between them, from either side
    assert next_after(spec, last) == nxt
    assert latest_at_or_before(spec, nxt - 1) == last


_TRANSITIONS = [
    ("Europe/Paris", "2025-03-30T01:00:00+00:00"),
    ("Europe/Paris", "2025-10-26T01:00:00+00:00"),
    ("Australia/Lord_Howe", "2025-10-04T15:30:00+00:00"),
    ("Australia/Lord_Howe", "2025-04-05T15:00:00+00:00"),
    ("Africa/Cairo", "2025-04-24T22:00:00+00:00"),
]


@pytest.mark.parametrize(("tz", "instant"), _TRANSITIONS)
@pytest.mark.parametrize("expr", ["30 2 * * *", "0 30 2 * * *", "*/20 0-3 * * *", "0 * * * *"])
def test_next_and_latest_agree_at_the_transitions(expr: str, tz: str, instant: str) -> None:
    spec = parse_cron(expr, tz)
    jump = ms(instant)
    near = [jump + d for d in (-S - 1, -S, -1, 0, 1, S, 30 * MIN - S, 30 * MIN, H - S, H)]
    for t in near + list(range(jump - 3 * H, jump + 3 * H, 7 * MIN + 13 * S)):
        nxt, last = next_after(spec, t), latest_at_or_before(spec, t)
        assert nxt is not None and last is not None
        assert last <= t < nxt, local(t, tz)
        assert next_after(spec, last) == nxt, local(t, tz)
        assert latest_at_or_before(spec, nxt - 1) == last, local(t, tz)


def test_latest_inside_the_repeated_hour() -> None:
    # At 02:15 CET (the second pass of 02:xx) the last 02:30 tick was 02:30 CEST, 45 minutes ago.
    spec = parse_cron("30 2 * * *", "Europe/Paris")
    t = ms("2025-10-26T02:15:00+01:00")
    assert latest_at_or_before(spec, t) == ms("2025-10-26T02:30:00+02:00")
    assert next_after(spec, t) == ms("2025-10-27T02:30:00+01:00")


# ---------------------------------------------------------------- plan


def _plan(spec: Spec, cursor: int, now: int, **kw: object) -> Plan:
    args: dict[str, object] = {
        "catchup": "latest",
        "grace_ms": 2 * S,
        "window_ms": H,
        "cap": 100,
    }
    args.update(kw)
    return plan(spec, cursor, now, **args)  # type: ignore[arg-type]


MINUTELY = parse_cron("* * * * *")
MINUTELY_SPECS = [MINUTELY, parse_cron("0 * * * * *", "Europe/Paris"), Every(60)]
"""Three specs with the same ticks (one a minute, on the minute): plan() answers alike."""


def test_plan_one_due_tick() -> None:
    p = _plan(MINUTELY, T0, T0 + 300)
    assert p == Plan([T0], 0, False, None, None, T0 + MIN, False)
    assert p.cursor == next_after(MINUTELY, T0 + 300)


def test_plan_nothing_due_keeps_the_cursor() -> None:
    assert _plan(MINUTELY, T0, T0 - 1) == Plan([], 0, False, None, None, T0, False)


@pytest.mark.parametrize("catchup", ["skip", "latest", "all"])
def test_late_ticks_always_fire(catchup: str) -> None:
    # a standby that takes over two seconds late fires every tick, whatever the policy
    spec = parse_cron("* * * * * *")
    p = _plan(spec, T0, T0 + 2 * S, catchup=catchup, grace_ms=2 * S)
    assert p.fire == [T0, T0 + S, T0 + 2 * S] and p.missed == 0
    assert p.cursor == T0 + 3 * S


@pytest.mark.parametrize("minutely", MINUTELY_SPECS)
def test_downtime_skip(minutely: Spec) -> None:
    now = T0 + 10 * MIN + 30 * S
    p = _plan(minutely, T0, now, catchup="skip")
    assert p.fire == [] and p.missed == 11
    assert (p.first_missed, p.last_missed) == (T0, T0 + 10 * MIN)
    assert p.cursor == T0 + 11 * MIN and not p.more and not p.missed_capped


@pytest.mark.parametrize("minutely", MINUTELY_SPECS)
def test_downtime_latest(minutely: Spec) -> None:
    now = T0 + 10 * MIN + 30 * S
    p = _plan(minutely, T0, now, catchup="latest")
    assert p.fire == [T0 + 10 * MIN] and p.missed == 10
    assert (p.first_missed, p.last_missed) == (T0, T0 + 9 * MIN)
    assert p.cursor == T0 + 11 * MIN


@pytest.mark.parametrize("minutely", MINUTELY_SPECS)
def test_latest_does_not_fire_a_missed_tick_when_a_late_one_fires(minutely: Spec) -> None:
    now = T0 + 10 * MIN + 1 * S  # the 10:10 tick is late (1 s), the others missed
    p = _plan(minutely, T0, now, catchup="latest")
    assert p.fire == [T0 + 10 * MIN] and p.missed == 10
    assert p.last_missed == T0 + 9 * MIN


@pytest.mark.parametrize("minutely", MINUTELY_SPECS)
def test_downtime_all_within_window_and_cap(minutely: Spec) -> None:
    now = T0 + 10 * MIN + 30 * S
    p = _plan(minutely, T0, now, catchup="all", window_ms=H, cap=100)
    assert p.fire == [T0 + k * MIN for k in range(11)] and p.missed == 0
    assert p.first_missed is None and p.last_missed is None
    window = _plan(minutely, T0, now, catchup="all", window_ms=5 * MIN, cap=100)
    assert window.fire == [T0 + k * MIN for k in range(6, 11)]  # tick >= now - 5 min
    assert (window.missed, window.first_missed, window.last_missed) == (6, T0, T0 + 5 * MIN)
    capped = _plan(minutely, T0, now, catchup="all", window_ms=H, cap=3)
    assert capped.fire == [T0 + k * MIN for k in (8, 9, 10)]  # the cap most recent
    assert (capped.missed, capped.last_missed) == (8, T0 + 7 * MIN)
    none = _plan(minutely, T0, now, catchup="all", window_ms=H, cap=0)
    assert none.fire == [] and none.missed == 11


@pytest.mark.parametrize("minutely", MINUTELY_SPECS)
def test_all_fires_missed_and_late_ticks_in_order(minutely: Spec) -> None:
    now = T0 + 5 * MIN + 1 * S  # 10:05 late, 10:00-10:04 missed
    p = _plan(minutely, T0, now, catchup="all", cap=2)
    assert p.fire == [T0 + 3 * MIN, T0 + 4 * MIN, T0 + 5 * MIN] and p.missed == 3


@pytest.mark.parametrize("catchup", ["skip", "latest", "all"])
@pytest.mark.parametrize("spec", [parse_cron("*/10 * * * * *", "Europe/Paris"), Every(7)])
def test_max_fire_continuation_gives_the_uncut_answer(catchup: str, spec: Spec) -> None:
    cursor, now = T0, T0 + 30 * MIN
    kw = {"catchup": catchup, "grace_ms": 3 * MIN, "window_ms": 20 * MIN, "cap": 50}
    whole = _plan(spec, cursor, now, max_fire=10_000, **kw)
    assert not whole.more
    fired: list[int] = []
    missed, calls = 0, 0
    p: Plan | None = None
    while p is None or p.more:
        assert p is None or p.cursor is not None
        p = _plan(spec, cursor if p is None else p.cursor, now, max_fire=7, **kw)
        assert len(p.fire) <= 7
        fired += p.fire
        missed += p.missed
        calls += 1
        if calls > 1:
            assert p.missed == 0  # missed ticks are counted in the first call only
    assert fired == whole.fire and missed == whole.missed and p.cursor == whole.cursor
    assert calls == max(1, -(-len(whole.fire) // 7))


def test_more_points_at_the_first_undecided_tick() -> None:
    spec = parse_cron("* * * * * *")
    p = _plan(spec, T0, T0 + 10 * S, grace_ms=MIN, max_fire=4)
    assert p.fire == [T0, T0 + S, T0 + 2 * S, T0 + 3 * S]
    assert p.more and p.cursor == T0 + 4 * S


@pytest.mark.parametrize("minutely", MINUTELY_SPECS)
def test_start_and_end(minutely: Spec) -> None:
    start, end = T0 + 3 * MIN, T0 + 5 * MIN
    # a cursor before start starts at the first tick >= start
    p = _plan(minutely, T0, T0 + 3 * MIN + 1, start_ms=start)
    assert p.fire == [start] and p.missed == 0 and p.cursor == start + MIN
    early = _plan(minutely, T0, T0 + MIN, start_ms=start)
    assert early == Plan([], 0, False, None, None, start, False)
    # ticks after end are not due; once past end, no tick is left
    p = _plan(minutely, T0 + 4 * MIN, T0 + 9 * MIN, catchup="all", end_ms=end)
    assert p.fire == [T0 + 4 * MIN, T0 + 5 * MIN] and p.cursor is None
    at_end = _plan(minutely, end - MIN, end - MIN + 1, end_ms=end)
    assert at_end.fire == [end - MIN] and at_end.cursor == end  # the end tick is still ahead
    last = _plan(minutely, end, end + 1, end_ms=end)
    assert last.fire == [end] and last.cursor is None
    assert _plan(minutely, end + MIN, end + 2 * MIN, end_ms=end).cursor is None


def test_missed_count_is_capped() -> None:
    spec = parse_cron("* * * * * *")
    p = _plan(spec, T0, T0 + DAY + 500, catchup="skip", grace_ms=0)
    assert p.fire == [] and p.missed == MISSED_COUNT_CAP and p.missed_capped
    assert p.first_missed == T0 and p.last_missed == T0 + DAY
    assert p.cursor == T0 + DAY + S
    exact = _plan(Every(1), T0, T0 + 9_999 * S, catchup="skip", grace_ms=0)
    assert exact.missed == MISSED_COUNT_CAP - 1 and not exact.missed_capped
    over = _plan(Every(1), T0, T0 + DAY, catchup="skip")
    assert over.missed == MISSED_COUNT_CAP and over.missed_capped


class _CountingCronSim(ticks.CronSim):
    steps = 0

    def __next__(self) -> datetime:
        _CountingCronSim.steps += 1
        return super().__next__()


def test_plan_does_little_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ticks, "CronSim", _CountingCronSim)
    spec = parse_cron("* * * * * *", "Europe/Paris")
    _CountingCronSim.steps = 0
    assert _plan(spec, T0, T0 + 200).fire == [T0]
    assert _CountingCronSim.steps <= 2  # the due tick and the next one
    # a day of downtime of a 1-second cron: counting stops at the cap, nothing walks the day
    _CountingCronSim.steps = 0
    p = _plan(spec, T0, T0 + DAY + 500, catchup="latest", grace_ms=0)
    assert p.fire == [T0 + DAY] and p.missed_capped and p.last_missed == T0 + DAY - S
    assert _CountingCronSim.steps <= MISSED_COUNT_CAP + 20


def _expected(due: list[int], now: int, kw: dict[str, object]) -> tuple[list[int], int]:
    """The fired ticks and the missed count, straight from the rules in dtq.ticks' docstring."""
    grace, window, cap = int(kw["grace_ms"]), int(kw["window_ms"]), int(kw["cap"])  # type: ignore[call-overload]
    late = [t for t in due if t >= now - grace]
    old = [t for t in due if t < now - grace]
    if kw["catchup"] == "skip":
        fire_old: list[int] = []
    elif kw["catchup"] == "latest":
        fire_old = [] if late else old[-1:]
    else:
        in_window = [t for t in old if t >= now - window]
        fire_old = in_window[max(0, len(in_window) - cap) :] if cap else []
    return fire_old + late, len(old) - len(fire_old)


_CRONS = [
    parse_cron("*/7 * * * * *"),
    parse_cron("*/20 * * * * *", "Europe/Paris"),
    parse_cron("* * * * *", "Australia/Lord_Howe"),
]


_PLAN_BASES = [
    ms("2025-03-30T00:50:00+00:00"),
    ms("2025-10-26T00:50:00+00:00"),
    ms("2025-04-05T14:50:00+00:00"),
]


@st.composite
def _plan_case(draw: st.DrawFn) -> tuple[Spec, int, int, dict[str, object]]:
    spec: Spec
    if draw(st.booleans()):
        spec = Every(
            draw(st.integers(min_value=1, max_value=600)),
            draw(st.integers(min_value=-(10**6), max_value=10**6)),
        )
        span = 10**7
    else:
        spec = draw(st.sampled_from(_CRONS))
        span = 20 * MIN
    # across the DST transitions of Paris (spring, fall) and Lord Howe (fall, 30 minutes)
    base = draw(st.sampled_from(_PLAN_BASES))
    cursor = base + draw(st.integers(min_value=0, max_value=span))
    now = cursor + draw(st.integers(min_value=-span // 100, max_value=span))
    kw: dict[str, object] = {
        "catchup": draw(st.sampled_from(["skip", "latest", "all"])),
        "grace_ms": draw(st.integers(min_value=0, max_value=span // 10)),
        "window_ms": draw(st.integers(min_value=0, max_value=span)),
        "cap": draw(st.integers(min_value=0, max_value=40)),
        "max_fire": draw(st.integers(min_value=1, max_value=8)),
    }
    if draw(st.booleans()):
        kw["start_ms"] = cursor + draw(st.integers(min_value=-span // 10, max_value=span // 2))
    if draw(st.booleans()):
        kw["end_ms"] = cursor + draw(st.integers(min_value=-span // 10, max_value=span))
    return spec, cursor, now, kw


@given(_plan_case())
@hsettings(max_examples=300, deadline=None)
def test_plan_loop_decides_every_due_tick_once(
    case: tuple[Spec, int, int, dict[str, object]],
) -> None:
    spec, cursor, now, kw = case
    start, end = kw.get("start_ms"), kw.get("end_ms")
    lo = max(cursor, start) if isinstance(start, int) else cursor
    hi = min(now, end) if isinstance(end, int) else now
    due = [t for t in preview(spec, lo - 1, 1 + (hi - lo) // 1000) if t <= hi]
    want_fire, want_missed = _expected(due, now, kw)
    fired: list[int] = []
    missed = 0
    c: int | None = cursor
    p: Plan | None = None
    for _ in range(len(due) + 2):
        assert c is not None
        p = _plan(spec, c, now, **kw)
        assert len(p.fire) <= int(kw["max_fire"])  # type: ignore[call-overload]
        fired += p.fire
        missed += p.missed
        c = p.cursor
        if not p.more:
            break
    assert p is not None and not p.more
    assert fired == sorted(set(fired))  # distinct, ascending
    assert all(cursor <= t <= now for t in fired)
    assert fired == want_fire
    assert missed == min(want_missed, MISSED_COUNT_CAP)  # every due tick fired or missed, once
    first = next_after(spec, lo - 1)
    if first is None or (isinstance(end, int) and first > end):
        assert c is None
    elif first > hi:
        assert c == first  # nothing due
    else:
        assert c == next_after(spec, hi, end_ms=end if isinstance(end, int) else None)
