"""The retry policy of contract section 4: the backoff formula and error classification."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dtq.config import Settings
from dtq.retry import ERROR_MESSAGE_MAX, PayloadDecodeError, classify, next_retry_delay_s, sanitize
from dtq_tasks import (
    PermanentError,
    RescheduleError,
    RetryableError,
    TaskCancelled,
    TimeLimitExceeded,
)


class FixedRng(random.Random):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def uniform(self, a: float, b: float) -> float:
        return a + (b - a) * self.value


def test_formula_with_defaults() -> None:
    s = Settings()
    mid = FixedRng(0.5)  # jitter 0
    assert [next_retry_delay_s(a, s, mid) for a in range(1, 9)] == [
        1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0,
    ]  # fmt: skip
    assert next_retry_delay_s(1, s, FixedRng(0.0)) == pytest.approx(0.8)
    assert next_retry_delay_s(1, s, FixedRng(1.0)) == pytest.approx(1.2)
    assert next_retry_delay_s(10, s, FixedRng(1.0)) == pytest.approx(72.0)


@hsettings(max_examples=200)
@given(
    attempt=st.integers(1, 1000),
    base=st.floats(0, 10),
    cap=st.floats(10, 100),
    jitter=st.floats(0, 0.99),
    seed=st.integers(0, 2**32),
)
def test_formula_bounds(attempt: int, base: float, cap: float, jitter: float, seed: int) -> None:
    s = Settings(retry_base_delay=base, retry_max_delay=cap, retry_jitter=jitter)
    capped = min(cap, base * 2.0 ** min(attempt - 1, 64))
    delay = next_retry_delay_s(attempt, s, random.Random(seed))
    assert delay >= 0
    assert capped * (1 - jitter) - 1e-9 <= delay <= capped * (1 + jitter) + 1e-9


def test_attempt_must_be_positive() -> None:
    with pytest.raises(ValueError, match="attempt"):
        next_retry_delay_s(0, Settings(), random.Random(1))


class Model(BaseModel):
    n: int


def _validation_error() -> ValidationError:
    try:
        Model.model_validate({"n": "x"})
    except ValidationError as exc:
        return exc
    raise AssertionError("no error")


@pytest.mark.parametrize(
    ("exc", "retryable", "error_class"),
    [
        (RetryableError("later"), True, "RetryableError"),
        (TimeoutError(), True, "TimeoutError"),
        (TimeoutError(), True, "TimeoutError"),
        (RedisConnectionError("down"), True, "ConnectionError"),
        (RedisTimeoutError("slow"), True, "TimeoutError"),
        (PermanentError("no"), False, "PermanentError"),
        (_validation_error(), False, "ValidationError"),
        (PayloadDecodeError("not json"), False, "PayloadDecodeError"),
        (KeyError("k"), False, "KeyError"),
        (ValueError("v"), False, "ValueError"),
        (RetryableError("x" * (ERROR_MESSAGE_MAX + 1)), False, "RetryableError"),
        # The interrupts the worker raises in a sync handler's thread; the attempt itself is
        # recorded from the deadline or the cancel, whatever the thread ends with.
        (TimeLimitExceeded(), True, "TimeLimitExceeded"),
        (TaskCancelled(), False, "TaskCancelled"),
    ],
)
def test_classify(exc: BaseException, retryable: bool, error_class: str) -> None:
    got_retryable, got_class, message = classify(exc)
    assert (got_retryable, got_class) == (retryable, error_class)
    assert message and len(message) <= ERROR_MESSAGE_MAX and "\n" not in message


def test_classify_subclasses_of_handler_errors() -> None:
    class Busy(RetryableError):
        pass

    class Broken(PermanentError):
        pass

    assert classify(Busy("b"))[:2] == (True, "Busy")
    assert classify(Broken("b"))[:2] == (False, "Broken")
    assert classify(RescheduleError(1))[0] is False  # never classified: the worker reschedules


def test_sanitize() -> None:
    assert sanitize("a\nb\r\nc\td\x00e\x1bf") == "a b c d e f"
    assert sanitize("x" * 600) == "x" * 500
    assert sanitize("line\u2028sep") == "line sep"
    assert sanitize("  padded\n") == "padded"
    assert sanitize("") == ""
