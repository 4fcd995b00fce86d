"""The model against the contract: the status table (all 81 pairs) and submit validation.

The expected transition table is written here from the contract's text (section 1), not read
from ``dtq.models``, so a wrong table in the code cannot agree with itself.
"""

from __future__ import annotations

import json
import string
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from dtq.config import Settings
from dtq.errors import InvalidTaskError, PayloadTooLargeError, UnknownTaskTypeError
from dtq.models import (
    NOT_STARTED,
    TERMINAL,
    HistoryEntry,
    SubmitRequest,
    Task,
    TaskStatus,
    can_transition,
    compact_json,
)

# -- the status table, from contract section 1 -----------------------------------------------

STATUSES = [
    "pending",
    "queued",
    "running",
    "succeeded",
    "retrying",
    "failed",
    "dead_lettered",
    "cancelled",
    "expired",
]
CONTRACT_TABLE = """
PENDING -> QUEUED | CANCELLED | EXPIRED
QUEUED -> RUNNING | CANCELLED | EXPIRED
RUNNING -> SUCCEEDED | RETRYING | FAILED | DEAD_LETTERED | CANCELLED
RETRYING -> QUEUED | CANCELLED
"""
CONTRACT_TERMINAL = {"succeeded", "failed", "dead_lettered", "cancelled", "expired"}


def _allowed_pairs() -> set[tuple[str, str]]:
    pairs = set()
    for line in CONTRACT_TABLE.strip().splitlines():
        src, dsts = line.split("->")
        for dst in dsts.split("|"):
            pairs.add((src.strip().lower(), dst.strip().lower()))
    # "Any non-terminal -> CANCELLED."
    for src in STATUSES:
        if src not in CONTRACT_TERMINAL:
            pairs.add((src, "cancelled"))
    return pairs


ALLOWED = _allowed_pairs()
ALL_PAIRS = [(s, d) for s in STATUSES for d in STATUSES]


def test_statuses_are_the_contracts() -> None:
    assert [s.value for s in TaskStatus] == STATUSES
    assert len(ALL_PAIRS) == 81
    assert len(ALLOWED) == 3 + 3 + 5 + 2


@pytest.mark.parametrize(("src", "dst"), ALL_PAIRS, ids=[f"{s}->{d}" for s, d in ALL_PAIRS])
def test_transition(src: str, dst: str) -> None:
    assert can_transition(TaskStatus(src), TaskStatus(dst)) is ((src, dst) in ALLOWED)


def test_named_sets() -> None:
    assert {s.value for s in TERMINAL} == CONTRACT_TERMINAL
    assert {s.value for s in NOT_STARTED} == {"pending", "queued", "retrying"}
    for status in TERMINAL:  # terminal states have no outgoing transitions
        assert not any(can_transition(status, d) for d in TaskStatus)


# -- SubmitRequest.build ---------------------------------------------------------------------

SETTINGS = Settings()


def build(settings: Settings = SETTINGS, known: Any = None, **fields: Any) -> SubmitRequest:
    fields.setdefault("task_type", "echo_task")
    return SubmitRequest.build(settings, known, **fields)


def _is_valid_queue(name: str) -> bool:
    head = string.ascii_lowercase + string.digits
    return 1 <= len(name) <= 64 and name[0] in head and all(c in head + "_-" for c in name[1:])


@given(st.from_regex(r"\A[a-z0-9][a-z0-9_-]{0,63}\Z"))
def test_valid_queue_names(name: str) -> None:
    assert build(queue=name).queue == name


@given(st.text(alphabet=string.ascii_letters + string.digits + "_-:. \n\t/é", max_size=70))
@example("abc\n")
@example("default\n")
@example("a" * 65)
@example("")
@example("-abc")
@example("_abc")
@example("Abc")
def test_queue_names_checked(name: str) -> None:
    if _is_valid_queue(name):
        assert build(queue=name).queue == name
    else:
        with pytest.raises(InvalidTaskError) as exc:
            build(queue=name)
        assert "queue" in exc.value.message


def test_queue_length_limit() -> None:
    assert build(queue="a" * 64).queue == "a" * 64
    with pytest.raises(InvalidTaskError):
        build(queue="a" * 65)


def test_task_type_with_newline_refused() -> None:
    with pytest.raises(InvalidTaskError, match="task_type"):
        build(task_type="echo_task\n")


@given(st.integers(min_value=-100, max_value=100))
def test_priority_range(priority: int) -> None:
    if 0 <= priority <= 9:
        assert build(priority=priority).priority == priority
    else:
        with pytest.raises(InvalidTaskError, match="priority"):
            build(priority=priority)


@pytest.mark.parametrize(
    "field", ["priority", "max_attempts", "timeout_ms", "delay_seconds", "ttl_seconds"]
)
def test_booleans_are_not_numbers(field: str) -> None:
    with pytest.raises(InvalidTaskError, match=field):
        build(**{field: True})


@given(cap=st.integers(min_value=1, max_value=1000), value=st.integers(-5, 1010))
def test_max_attempts_range(cap: int, value: int) -> None:
    settings = Settings(max_attempts=cap)
    if 1 <= value <= cap:
        assert build(settings, max_attempts=value).max_attempts == value
    else:
        with pytest.raises(InvalidTaskError, match="max_attempts"):
            build(settings, max_attempts=value)


def test_max_attempts_default_and_cap() -> None:
    assert build().max_attempts == 5
    assert build(max_attempts=10).max_attempts == 10
    with pytest.raises(InvalidTaskError, match="DTQ_MAX_ATTEMPTS"):
        build(max_attempts=11)


@given(st.integers(min_value=-10, max_value=3_600_010))
@example(0)
@example(1)
@example(3_600_000)
@example(3_600_001)
def test_timeout_ms_range(value: int) -> None:
    if 1 <= value <= 3_600_000:
        assert build(timeout_ms=value).timeout_ms == value
    else:
        with pytest.raises(InvalidTaskError, match="timeout_ms"):
            build(timeout_ms=value)


@given(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False))
@example(0.0)
@example(-0.001)
def test_delay_seconds_not_negative(value: float) -> None:
    if value >= 0:
        assert build(delay_seconds=value).delay_seconds == value
    else:
        with pytest.raises(InvalidTaskError, match="delay_seconds"):
            build(delay_seconds=value)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_delay_and_ttl_finite(value: float) -> None:
    with pytest.raises(InvalidTaskError, match="delay_seconds"):
        build(delay_seconds=value)
    with pytest.raises(InvalidTaskError, match="ttl_seconds"):
        build(ttl_seconds=value)


# Characters of 1, 2, 3 and 4 UTF-8 bytes, none of which JSON escapes.
FILL_CHARS = ["a", "é", "€", "😀"]


def _payload_of_size(size: int, fill: str) -> dict[str, Any]:
    overhead = len(compact_json({"d": ""}).encode())
    room = size - overhead
    width = len(fill.encode())
    text = fill * (room // width) + "a" * (room % width)
    payload = {"d": text}
    assert len(compact_json(payload).encode()) == size
    return payload


@hsettings(max_examples=60)
@given(limit=st.integers(min_value=16, max_value=20_000), fill=st.sampled_from(FILL_CHARS))
def test_payload_size_limit_in_utf8_bytes(limit: int, fill: str) -> None:
    settings = Settings(max_payload_bytes=limit)
    payload = _payload_of_size(limit, fill)
    assert build(settings, payload=payload).payload == payload
    bigger = {"d": payload["d"] + "a"}
    with pytest.raises(PayloadTooLargeError) as exc:
        build(settings, payload=bigger)
    assert exc.value.code == "PAYLOAD_TOO_LARGE"
    assert exc.value.details == {"size": limit + 1, "limit": limit}


def test_payload_default_limit() -> None:
    assert SETTINGS.max_payload_bytes == 262_144
    build(payload=_payload_of_size(262_144, "€"))
    with pytest.raises(PayloadTooLargeError):
        build(payload=_payload_of_size(262_145, "€"))


def test_payload_size_is_the_compact_form() -> None:
    # Spaces of json.dumps' default separators would count; the compact form is measured.
    settings = Settings(max_payload_bytes=len('{"a":1,"b":[1,2]}'))
    build(settings, payload={"a": 1, "b": [1, 2]})


@pytest.mark.parametrize("payload", [[], [1, 2], "text", 3, None, json.dumps({"a": 1})])
def test_payload_must_be_an_object(payload: Any) -> None:
    with pytest.raises(InvalidTaskError, match="payload"):
        build(payload=payload)


@pytest.mark.parametrize(
    "payload",
    [{"a": float("nan")}, {"a": float("inf")}, {"a": {1, 2}}, {"a": object()}, {"a": "\ud800"}],
    ids=["nan", "inf", "set", "object", "lone-surrogate"],
)
def test_payload_must_be_json(payload: dict[str, Any]) -> None:
    with pytest.raises(InvalidTaskError) as exc:
        build(payload=payload)
    assert type(exc.value) is InvalidTaskError


def test_metadata_limit() -> None:
    overhead = len(compact_json({"m": ""}).encode())
    exact = {"m": "x" * (4096 - overhead)}
    assert build(metadata=exact).metadata == exact
    with pytest.raises(InvalidTaskError, match="metadata") as exc:
        build(metadata={"m": "x" * (4097 - overhead)})
    assert type(exc.value) is InvalidTaskError  # not a 413: the payload limit is another rule
    with pytest.raises(InvalidTaskError, match="metadata"):
        build(metadata={"m": "é" * 2100})
    with pytest.raises(InvalidTaskError, match="metadata"):
        build(metadata=[1])
    with pytest.raises(InvalidTaskError):
        build(metadata={"m": "\ud800"})


# -- expiration fields (DESIGN 6) --------------------------------------------------------------

SOON = datetime(2030, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        ({"expires_at": SOON, "ttl_seconds": 5}, ("expires_at", "ttl_seconds")),
        ({"expires_at": SOON, "metadata": {"ttl_seconds": 5}}, ("expires_at", "metadata.ttl")),
        ({"ttl_seconds": 5, "metadata": {"ttl_seconds": 5}}, ("ttl_seconds", "metadata.ttl")),
        (
            {"expires_at": SOON, "ttl_seconds": 0, "metadata": {"ttl_seconds": 1}},
            ("expires_at", "ttl_seconds", "metadata.ttl_seconds"),
        ),
    ],
)
def test_expiration_fields_exclusive(fields: dict[str, Any], names: tuple[str, ...]) -> None:
    with pytest.raises(InvalidTaskError) as exc:
        build(**fields)
    assert exc.value.code == "INVALID_TASK"
    for name in names:
        assert name in exc.value.message
    assert "only one" in exc.value.message


@pytest.mark.parametrize("value", [datetime(2030, 1, 1), "2030-01-01T00:00:00"])
def test_naive_expires_at_refused(value: Any) -> None:
    with pytest.raises(InvalidTaskError, match="timezone"):
        build(expires_at=value)
    with pytest.raises(InvalidTaskError, match="timezone"):
        build(schedule_at=value)


def test_aware_expires_at_accepted() -> None:
    plus2 = timezone(timedelta(hours=2))
    req = build(expires_at=datetime(2030, 1, 1, 2, tzinfo=plus2))
    assert req.expires_at_ms() == int(SOON.timestamp() * 1000)
    assert build(expires_at="2030-01-01T00:00:00Z").expires_at_ms() == req.expires_at_ms()


@given(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False))
@example(0.0)
@example(-0.001)
def test_ttl_seconds_not_negative(value: float) -> None:
    if value >= 0:
        req = build(ttl_seconds=value)
        assert req.effective_ttl_ms() == round(value * 1000)
    else:
        with pytest.raises(InvalidTaskError, match="ttl_seconds"):
            build(ttl_seconds=value)


@pytest.mark.parametrize("value", [-1, "10", True, None, float("nan")])
def test_metadata_ttl_must_be_a_number(value: Any) -> None:
    if value is None:  # null means "not given"
        assert build(metadata={"ttl_seconds": None}).effective_ttl_ms() is None
        return
    with pytest.raises(InvalidTaskError, match=r"metadata\.ttl_seconds"):
        build(metadata={"ttl_seconds": value})


def test_metadata_ttl_is_a_ttl() -> None:
    assert build(metadata={"ttl_seconds": 2.5}).effective_ttl_ms() == 2500
    assert build(ttl_seconds=0).effective_ttl_ms() == 0


def test_delay_and_schedule_at_exclusive() -> None:
    with pytest.raises(InvalidTaskError, match="delay_seconds and schedule_at"):
        build(delay_seconds=5, schedule_at=SOON)


# -- task types --------------------------------------------------------------------------------


def test_unknown_task_type() -> None:
    with pytest.raises(UnknownTaskTypeError) as exc:
        build(known={"echo_task"}, task_type="nope_task")
    assert exc.value.code == "UNKNOWN_TASK_TYPE"
    assert "nope_task" in exc.value.message
    assert build(known={"echo_task"}).task_type == "echo_task"
    assert build(known=None, task_type="anything_goes").task_type == "anything_goes"


@pytest.mark.parametrize("task_type", ["", "1abc", "a b", "a" * 129, "x;rm"])
def test_task_type_shape(task_type: str) -> None:
    with pytest.raises(InvalidTaskError, match="task_type"):
        build(task_type=task_type)


def test_unknown_field_refused() -> None:
    with pytest.raises(InvalidTaskError, match="colour"):
        build(colour="red")


@pytest.mark.parametrize("key", ["", "a" * 257, "line\nbreak"])
def test_idempotency_key_shape(key: str) -> None:
    with pytest.raises(InvalidTaskError, match="idempotency_key"):
        build(idempotency_key=key)


def test_defaults_are_the_contracts() -> None:
    req = build()
    assert (req.queue, req.priority, req.max_attempts, req.delay_seconds) == ("default", 5, 5, 0)
    assert req.payload == {} and req.metadata == {}
    assert req.idempotency_key is None and req.timeout_ms is None  # settings' default applies


# -- Task and history from Redis data ----------------------------------------------------------


def test_task_from_hash() -> None:
    h = {
        "task_id": "ab" * 16,
        "idempotency_key": "",
        "task_type": "echo_task",
        "payload": '{"x":1}',
        "created_at": "2030-01-01T00:00:00.000Z",
        "created_ms": "1893456000000",
        "available_at": "2030-01-01T00:00:01.000Z",
        "updated_at": "2030-01-01T00:00:02.000Z",
        "attempt": "2",
        "max_attempts": "5",
        "priority": "7",
        "timeout_ms": "1000",
        "status": "retrying",
        "queue": "default",
        "metadata": '{"k":"v"}',
        "expires_at": "",
        "expires_at_ms": "",
        "entry_id": "1-0",
        "retryable": "1",
        "retry_delay_ms": "1500",
        "error_class": "TimeoutError",
        "cancel_requested": "1",
    }
    task = Task.from_hash(h, '{"ok":true}')
    assert task.status is TaskStatus.RETRYING and not task.is_terminal
    assert task.idempotency_key is None and task.expires_at is None
    assert task.created_at == SOON and task.attempt == 2 and task.priority == 7
    assert task.retryable is True and task.retry_delay_ms == 1500 and task.cancel_requested
    assert task.result == {"ok": True} and task.payload == {"x": 1}
    assert task.public_dict()["status"] == "retrying"


def test_history_entry_from_json() -> None:
    raw = json.dumps(
        {"ts": "2030-01-01T00:00:00.000Z", "from": None, "to": "queued", "attempt": 0,
         "reason": "created", "expires_at": "2030-01-02T00:00:00.000Z"}
    )  # fmt: skip
    entry = HistoryEntry.from_json(raw)
    assert entry.from_status is None and entry.to_status is TaskStatus.QUEUED
    assert entry.reason == "created" and entry.worker_id is None
    assert entry.details == {"expires_at": "2030-01-02T00:00:00.000Z"}
