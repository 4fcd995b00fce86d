"""``ctx.progress()`` outside a worker, and the one rule for its arguments
(:func:`dtq.models.check_progress`); the hash field as readers show it
(:meth:`dtq.models.Progress.from_field`)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from dtq.models import PROGRESS_DATA_MAX_BYTES, Progress, check_progress
from dtq_tasks import TaskContext


def hand_made(**fields: Any) -> TaskContext:
    return TaskContext(
        task_id="t" * 32,
        idempotency_key=None,
        attempt=1,
        worker_id="worker-test",
        queue="default",
        deadline=datetime(2026, 1, 1, tzinfo=UTC),
        **fields,
    )


def test_a_hand_made_context_checks_and_records_nothing() -> None:
    ctx = hand_made()
    ctx.progress(0.5, {"step": 1})
    ctx.progress(None)
    with pytest.raises(ValueError, match="from 0 to 1"):
        ctx.progress(2)


def test_a_workers_reporter_gets_the_checked_values() -> None:
    got: list[tuple[TaskContext, float | None, str]] = []
    ctx = hand_made(_progress=lambda c, f, d: got.append((c, f, d)))
    ctx.progress(1, ["a", "é"])
    ctx.progress(None)
    assert got == [(ctx, 1.0, '["a","é"]'), (ctx, None, "null")]
    assert isinstance(got[0][1], float)
    assert "_progress" not in repr(ctx)


@pytest.mark.parametrize("fraction", [0, 1, 0.0, 0.25, 1.0, None])
def test_fractions_accepted(fraction: float | None) -> None:
    assert check_progress(fraction, None)[0] == fraction


@pytest.mark.parametrize("fraction", [True, False, "0.5", -1e-9, 1.0000001, float("nan"), [0.5]])
def test_fractions_refused(fraction: Any) -> None:
    with pytest.raises(ValueError, match="progress fraction"):
        check_progress(fraction, None)


def test_data_size_is_bounded_by_its_utf8_json() -> None:
    quotes = len(json.dumps(""))
    assert check_progress(None, "x" * (PROGRESS_DATA_MAX_BYTES - quotes))[1].startswith('"x')
    with pytest.raises(ValueError, match=f"{PROGRESS_DATA_MAX_BYTES + 1} bytes"):
        check_progress(None, "x" * (PROGRESS_DATA_MAX_BYTES - quotes + 1))
    with pytest.raises(ValueError, match="more than"):
        check_progress(None, "é" * (PROGRESS_DATA_MAX_BYTES // 2))  # 2 bytes each
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        check_progress(None, {1j})


def test_the_field_shows_only_for_the_attempt_that_wrote_it() -> None:
    raw = '{"fraction":0.5,"data":{"n":1},"updated_at":"2026-01-01T00:00:00.000Z","attempt":2}'
    shown = Progress.from_field(raw, 2)
    assert shown is not None and (shown.fraction, shown.data) == (0.5, {"n": 1})
    assert shown.updated_at == datetime(2026, 1, 1, tzinfo=UTC)
    assert Progress.from_field(raw, 3) is None
    for foreign in (None, "", "not json", "[]", '{"attempt":2}'):
        assert Progress.from_field(foreign, 2) is None
