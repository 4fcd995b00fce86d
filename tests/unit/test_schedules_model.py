"""The schedule data model (dtq.schedules), pure: the definition's rules, the part of it that
decides the ticks, a firing's submit request and idempotency key, and the read model's state.
The tick arithmetic itself is tests/unit/test_ticks.py's."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from dtq.config import Settings
from dtq.errors import InvalidTaskError, ScheduleSpecError
from dtq.models import format_ts
from dtq.schedules import (
    ScheduleDef,
    firing_of,
    idempotency_key,
    parse_schedule,
    template_request,
)

T0 = 1_796_000_040_000  # a whole minute, epoch ms


def define(**fields: Any) -> ScheduleDef:
    return ScheduleDef.parse({"task_type": "report", **fields})


# -- the firing's key -----------------------------------------------------------------------------


def test_firing_key_round_trips() -> None:
    assert idempotency_key("nightly", T0) == f"schedule:nightly:{T0}"
    assert firing_of(idempotency_key("nightly", T0)) == ("nightly", T0)
    assert idempotency_key("nightly", T0, manual="deploy-1") == "schedule:nightly:manual:deploy-1"
    assert firing_of("schedule:nightly:manual:deploy:with:colons") == ("nightly", None)


@pytest.mark.parametrize(
    "key",
    [
        None,
        "",
        "report:2024",
        "schedule:",
        "schedule:nightly",
        "schedule:Not A Name:1",
        "schedule:nightly:12a",
        "schedule:nightly:manual",
        "schedule:nightly:1:2",
    ],
)
def test_other_keys_are_no_firing(key: str | None) -> None:
    assert firing_of(key) is None


# -- the definition's rules -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "field", "match"),
    [
        ({}, "cron", "exactly one of cron and every"),
        ({"cron": "* * * * *", "every": 60}, "cron", "exactly one of cron and every"),
        ({"every": 60, "tz": "Europe/Paris"}, "tz", "tz goes with cron"),
        ({"cron": "* * * * *", "anchor": "2030-01-01T00:00:00Z"}, "anchor", "goes with every"),
        ({"cron": "61 * * * *"}, "cron", "bad minute"),
        ({"cron": "* * * * *", "tz": "Mars/Olympus"}, "tz", "unknown time zone"),
        (
            {"every": 60, "start_at": "2030-01-02T00:00:00Z", "end_at": "2030-01-01T00:00:00Z"},
            "end_at",
            "after start_at",
        ),
    ],
)
def test_spec_errors_name_their_field(fields: dict[str, Any], field: str, match: str) -> None:
    with pytest.raises(ScheduleSpecError, match=match) as info:
        define(**fields)
    assert info.value.code == "INVALID_SCHEDULE"
    assert info.value.field == field
    assert isinstance(info.value, InvalidTaskError)  # a 400 like any invalid submit


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"every": 60, "start_at": "2030-01-01T00:00:00"}, "timezone-aware"),
        ({"every": 60, "end_at": 1_900_000_000}, "ISO 8601"),
        ({"every": 60, "priority": True}, "not a boolean"),
        ({"every": 60, "overlap": "queue"}, "overlap"),
        ({"every": 60, "catchup": "some"}, "catchup"),
        ({"every": 60, "metadata": {"scheduled_for": "x"}}, "set by dtq"),
        ({"every": 60, "metadata": {"schedule": "x"}}, "set by dtq"),
        ({"every": 60, "bogus": 1}, "bogus"),
    ],
)
def test_invalid_definitions_are_invalid_task_errors(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidTaskError, match=match):
        define(**fields)


def test_defaults_and_normal_forms() -> None:
    d = define(every="1h30m")
    assert d.every == 5_400 and d.tz == "UTC"
    assert (d.overlap, d.catchup, d.catchup_window_s, d.grace_s) == ("skip", "latest", 3_600, 10)
    assert define(cron="0  7 * * *").cron == "0 7 * * *"


def test_spec_key_changes_with_the_ticks_only() -> None:
    """A change of the template or the policies keeps the cursor (same spec key); a change of
    anything that decides the ticks restarts it."""
    base = define(cron="0 7 * * *", tz="Europe/Paris")
    same = define(
        cron="0 7 * * *",
        tz="Europe/Paris",
        payload={"v": 2},
        queue="reports",
        overlap="allow",
        catchup="all",
        ttl_seconds=60,
    )
    assert same.spec_key() == base.spec_key()
    for other in (
        define(cron="0 8 * * *", tz="Europe/Paris"),
        define(cron="0 7 * * *", tz="Europe/London"),
        define(cron="0 7 * * *", tz="Europe/Paris", start_at="2030-01-01T00:00:00Z"),
        define(cron="0 7 * * *", tz="Europe/Paris", end_at="2030-01-01T00:00:00Z"),
    ):
        assert other.spec_key() != base.spec_key()
    assert define(every=60).spec_key() != define(every=60, anchor="2030-01-01T00:00:30Z").spec_key()


def test_first_cursor_respects_start_and_end() -> None:
    assert define(every=60).first_cursor(T0 + 1) == T0 + 60_000
    assert define(every=60).first_cursor(T0) == T0  # a tick at creation time is due at once
    start = datetime.fromtimestamp((T0 + 600_000) / 1000, tz=UTC)
    assert define(every=60, start_at=start.isoformat()).first_cursor(T0) == T0 + 600_000
    ended = datetime.fromtimestamp((T0 - 1) / 1000, tz=UTC)
    assert define(every=60, end_at=ended.isoformat()).first_cursor(T0) is None


# -- a firing's request -------------------------------------------------------------------------


def test_firing_request_carries_tick_key_and_deadline_from_the_tick() -> None:
    d = define(every=60, payload={"a": 1}, metadata={"team": "ops"}, ttl_seconds=30, priority=2)
    req = template_request(d, "nightly", T0, Settings())
    assert req.idempotency_key == f"schedule:nightly:{T0}"
    assert req.metadata == {"team": "ops", "schedule": "nightly", "scheduled_for": format_ts(T0)}
    assert req.payload == {"a": 1} and req.priority == 2
    assert req.expires_at is not None
    assert req.expires_at.timestamp() * 1000 == T0 + 30_000
    manual = template_request(d, "nightly", T0, Settings(), manual="k")
    assert manual.idempotency_key == "schedule:nightly:manual:k"
    assert manual.metadata["trigger"] == "manual"
    assert template_request(define(every=60), "n", T0, Settings()).expires_at is None


def test_firing_request_checks_the_task_type() -> None:
    with pytest.raises(InvalidTaskError):
        template_request(define(every=60), "n", T0, Settings(), known_types={"other"})


# -- the read model -----------------------------------------------------------------------------


def stored(**fields: str) -> dict[str, str]:
    return {"name": "n", "definition": define(every=60).stored(), "rev": "3", **fields}


@pytest.mark.parametrize(
    ("fields", "state"),
    [
        ({"cursor": str(T0)}, "active"),
        ({"cursor": str(T0), "paused": "1"}, "paused"),
        ({"cursor": "", "paused": "1"}, "paused"),
        ({"cursor": ""}, "ended"),
        ({"cursor": "", "buffered_ms": str(T0)}, "active"),  # its held tick is still to fire
    ],
)
def test_read_model_state(fields: dict[str, str], state: str) -> None:
    s = parse_schedule(stored(**fields))
    assert s.state == state
    assert s.definition.paused is (state == "paused")


def test_read_model_fields() -> None:
    s = parse_schedule(
        stored(
            cursor=str(T0),
            source="code",
            fired="4",
            missed="2",
            skipped_overlap="1",
            last_tick_ms=str(T0 - 60_000),
            paused="1",
            paused_reason="removed from code",
        ),
        ['{"decision": "fired", "tick": "x"}'],
    )
    assert s.origin == "code" and s.paused_reason == "removed from code"
    assert (s.fired, s.missed, s.skipped_overlap, s.rev) == (4, 2, 1, 3)
    assert s.next_fire_at == datetime.fromtimestamp(T0 / 1000, tz=UTC)
    assert s.last_tick_at == datetime.fromtimestamp((T0 - 60_000) / 1000, tz=UTC)
    assert s.history == [{"decision": "fired", "tick": "x"}]
    assert parse_schedule(stored(cursor=str(T0))).origin == "api"
