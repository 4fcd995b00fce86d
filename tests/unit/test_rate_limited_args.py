"""The arguments of ``RateLimited`` and ``ctx.rate_limited`` (docs/limits.md, "Back-pressure
from a handler"): ``retry_after_s`` more than 0 and at most a day, ``slow`` a bool; anything else
is a ValueError that names the argument. The outcome the worker records, and the finish call's
limit part (each limit's rate, running and waiting keys, then the count and the slow flag)."""

from __future__ import annotations

import math
import random
import time
from datetime import UTC, datetime
from typing import Any

import pytest

import dtq
from dtq import calls, keys
from dtq.calls import Entry, LimitUse, Outcome, StartReply
from dtq.config import Settings
from dtq.metrics import Metrics
from dtq.worker.handlers import rate_limited
from dtq.worker.observer import TaskFinished
from dtq.worker.telemetry import LogObserver, MetricsObserver
from dtq_tasks import HandlerError, RateLimited, TaskContext


def ctx() -> TaskContext:
    return TaskContext(
        task_id="t1",
        idempotency_key=None,
        attempt=1,
        worker_id="w",
        queue="default",
        deadline=datetime.now(UTC),
    )


@pytest.mark.parametrize("value", [0.001, 1, 2.5, 86400, 86400.0])
def test_a_good_retry_after_is_kept(value: float) -> None:
    exc = RateLimited(value)
    assert exc.retry_after_s == float(value) and exc.slow is False
    assert RateLimited(retry_after_s=value, slow=True).slow is True


@pytest.mark.parametrize(
    "value", [0, 0.0, -1, 86400.001, math.nan, math.inf, -math.inf, True, False, "5", None]
)
def test_a_bad_retry_after_is_refused(value: Any) -> None:
    with pytest.raises(ValueError, match="retry_after_s must be a number more than 0"):
        RateLimited(value)
    with pytest.raises(ValueError, match="at most 86400"):
        ctx().rate_limited(value)


@pytest.mark.parametrize("value", [1, 0, "yes", None])
def test_slow_is_a_bool(value: Any) -> None:
    with pytest.raises(ValueError, match="slow must be True or False"):
        RateLimited(1, slow=value)


def test_the_context_method_raises_it() -> None:
    with pytest.raises(RateLimited) as raised:
        ctx().rate_limited(30, slow=True)
    assert raised.value.retry_after_s == 30.0 and raised.value.slow is True
    assert isinstance(raised.value, HandlerError)


def test_it_is_exported_from_dtq_too() -> None:
    assert dtq.RateLimited is RateLimited
    assert "RateLimited" in dtq.__all__


START = StartReply("run", attempt=1, max_attempts=3, timeout_ms=1000, started_ms=0)


def test_the_outcome_parks_at_least_a_millisecond() -> None:
    got = rate_limited(RateLimited(0.0001, slow=True), START, Settings(), random.Random(1), 0)
    assert got.kind == "rate_limited" and got.delay_ms == 1 and got.slow is True
    got = rate_limited(RateLimited(1.5), START, Settings(), random.Random(1), time.monotonic())
    assert got.delay_ms == 1500 and got.slow is False


class Sneaky(RateLimited):
    def __init__(self, retry_after_s: Any, slow: Any = False) -> None:
        HandlerError.__init__(self, "sneaky")
        self.retry_after_s = retry_after_s
        self.slow = slow


@pytest.mark.parametrize(("value", "slow"), [(math.nan, False), (-1, False), (5, "yes")])
def test_a_subclass_that_skips_the_checks_ends_as_an_error(value: Any, slow: Any) -> None:
    got = rate_limited(Sneaky(value, slow), START, Settings(), random.Random(1), 0)
    assert got.kind == "error" and got.error_class == "ValueError"
    assert got.error_message.startswith("RateLimited: ")


def test_a_subclass_without_the_attributes_ends_as_an_error() -> None:
    class Bare(RateLimited):
        def __init__(self) -> None:
            HandlerError.__init__(self, "bare")

    got = rate_limited(Bare(), START, Settings(), random.Random(1), 0)
    assert got.kind == "error" and "retry_after_s" in got.error_message


def test_the_finish_call_passes_each_limits_rate_state_and_the_slow_flag() -> None:
    entry = Entry(
        stream=keys.stream("default", 5),
        entry_id="1-0",
        task_id="t1",
        queue="default",
        task_type="call",
        payload="{}",
        idempotency_key="",
        timeout_ms=1000,
    )
    a = keys.limit_state("default", "per-tenant", "a")
    b = keys.limit_state("default", "solo")
    uses = (LimitUse("per-tenant", a, 0, 0, 5), LimitUse("solo", b, 10.0, 0, 0))
    outcome = Outcome("rate_limited", delay_ms=2000, slow=True)
    _, call_keys, argv = calls.finish_call(entry, 1, outcome, "w", Settings(), uses)
    assert call_keys[12:] == [
        a + ":rate",
        a + ":running",
        a + ":waiting",
        b + ":rate",
        b + ":running",
        b + ":waiting",
    ]
    assert argv[5] == "rate_limited" and argv[11] == 2000
    assert argv[21:] == [2, "1"]
    _, none_keys, none_argv = calls.finish_call(entry, 1, outcome, "w", Settings())
    assert len(none_keys) == 12 and none_argv[21:] == [0, "1"]  # slow said, nothing to hold
    plain = Outcome("rate_limited", delay_ms=2000)
    _, plain_keys, plain_argv = calls.finish_call(entry, 1, plain, "w", Settings())
    assert len(plain_keys) == 12 and len(plain_argv) == 21  # no limit: no limit part at all


def test_the_worker_counts_it_as_a_throttle_and_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    """A finish that parked the task (status pending) counts in dtq_tasks_throttled_total, as
    an execution ended by the handler (failure), not as a completion or a retry; one INFO
    line says so."""
    m = Metrics(known_types={"call"})
    event = TaskFinished("t1", "default", "call", 1, "pending", "failure", 12, 12, 20, 2000)
    MetricsObserver(m, "worker-1").task_finished(event)
    with caplog.at_level("INFO", logger="dtq.worker.tasks"):
        LogObserver().task_finished(event)
    qt = {"queue": "default", "task_type": "call"}
    assert m.registry.get_sample_value("dtq_tasks_throttled_total", qt) == 1
    assert m.registry.get_sample_value("dtq_retry_delay_seconds_count", qt) is None
    attempts = m.registry.get_sample_value("dtq_task_attempts_total", {**qt, "result": "failure"})
    assert attempts == 1
    (line,) = caplog.records
    assert line.levelname == "INFO" and "rate limited by its handler" in line.getMessage()
    assert "parked 2000 ms" in line.getMessage()
    assert getattr(line, "event_type", None) == "TASK_THROTTLED"
