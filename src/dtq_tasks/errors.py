"""The exceptions a handler raises to tell the worker what to do next (contract sections 4, 15).

::

    HandlerError
    ├── RetryableError     try again after the backoff of contract section 4 (up to max_attempts)
    ├── PermanentError     never try again: dead letter (or FAILED when the DLQ is disabled)
    ├── RescheduleError    not an error: run again after ``delay_seconds`` (counts as an attempt)
    ├── RateLimited        pushed back by an upstream: parked for ``retry_after_s`` (no attempt
    │                      spent), and with ``slow=True`` its limits held as long
    └── TaskCancelled      raised by the worker inside a sync handler's thread on a cancel

    TimeoutError
    └── TimeLimitExceeded  raised by the worker inside a sync handler's thread at its deadline

The last two are not for handlers to raise: the worker raises them asynchronously in the thread
of a sync handler (``PyThreadState_SetAsyncExc``, so at the handler's next Python bytecode, never
inside C code), to stop it. A handler may catch them to clean up, and should then re-raise; one
that swallows them keeps running, and its task stays RUNNING until it returns
(docs/delivery-guarantees.md, "Sync handlers").

Any other exception is classified by :func:`dtq.retry.classify`: timeouts and Redis connection
errors are retryable, everything else is permanent (the contract: "never retry everything").
"""

from __future__ import annotations

import math

__all__ = [
    "RETRY_AFTER_MAX_S",
    "HandlerError",
    "PermanentError",
    "RateLimited",
    "RescheduleError",
    "RetryableError",
    "TaskCancelled",
    "TimeLimitExceeded",
    "retry_after_problem",
]


class HandlerError(Exception):
    """Root of the handler-side exceptions."""


class RetryableError(HandlerError):
    """A transient failure: the task is retried with backoff while attempts remain."""


class PermanentError(HandlerError):
    """A failure that retrying cannot fix: the task is dead-lettered (or FAILED) at once."""


class RescheduleError(HandlerError):
    """Run this task again later, without counting it as a failure.

    The attempt ends RETRYING with no error, due ``delay_seconds`` from now on the Redis clock;
    it counts toward ``max_attempts`` (a task that reschedules itself forever still ends,
    dead-lettered with error_class ``RescheduleLimit``). ``extend_expiration_seconds`` adds that
    many seconds to the task's ``expires_at`` (atomically with the reschedule, shown in the
    history); a task without a deadline keeps having none.
    """

    def __init__(self, delay_seconds: float, extend_expiration_seconds: float | None = None):
        if not _finite_non_negative(delay_seconds):
            raise ValueError(f"delay_seconds must be a finite number >= 0, not {delay_seconds!r}")
        if extend_expiration_seconds is not None and not _finite_non_negative(
            extend_expiration_seconds
        ):
            raise ValueError(
                "extend_expiration_seconds must be a finite number >= 0, "
                f"not {extend_expiration_seconds!r}"
            )
        super().__init__(f"reschedule in {delay_seconds}s")
        self.delay_seconds = float(delay_seconds)
        self.extend_expiration_seconds = (
            None if extend_expiration_seconds is None else float(extend_expiration_seconds)
        )


RETRY_AFTER_MAX_S = 86400.0
"""The longest ``retry_after_s`` a handler may give :class:`RateLimited` (a day)."""


class RateLimited(HandlerError):
    """An upstream pushed back (an HTTP 429, a quota): park this task for ``retry_after_s``
    seconds without spending an attempt (docs/limits.md, "Back-pressure from a handler").

    The task goes back to PENDING, due ``retry_after_s`` from now on the Redis clock, and its
    next start runs the same attempt number again: a task with ``max_attempts=1`` may be
    rate limited any number of times. Its deadline (``expires_at``) still applies while it
    waits, and a cancel requested while it ran cancels it instead. ``slow=True`` also holds
    every limit the task met at its start (for a per-key limit: its key only) for as long:
    tasks under them are parked until then. ``retry_after_s`` must be a number more than 0
    and at most 86400 (a day), else ValueError (a handler bug: the attempt ends as an error
    with that message).
    """

    def __init__(self, retry_after_s: float, *, slow: bool = False) -> None:
        problem = retry_after_problem(retry_after_s, slow)
        if problem is not None:
            raise ValueError(problem)
        super().__init__(f"rate limited: retry after {retry_after_s}s")
        self.retry_after_s = float(retry_after_s)
        self.slow = slow


def retry_after_problem(retry_after_s: object, slow: object) -> str | None:
    """What is wrong with :class:`RateLimited`'s arguments (None: nothing); the worker checks
    them again on what a handler raised, which a subclass could have changed."""
    if not (
        isinstance(retry_after_s, int | float)
        and not isinstance(retry_after_s, bool)
        and math.isfinite(retry_after_s)
        and 0 < retry_after_s <= RETRY_AFTER_MAX_S
    ):
        return (
            "RateLimited: retry_after_s must be a number more than 0 and at most 86400 "
            f"(a day), not {retry_after_s!r}"
        )
    if not isinstance(slow, bool):
        return f"RateLimited: slow must be True or False, not {slow!r}"
    return None


class TaskCancelled(HandlerError):
    """Raised inside a sync handler's thread when its task's cancel was requested (or its
    lease was lost to another worker): the run is over, its result would be discarded."""


class TimeLimitExceeded(TimeoutError):
    """Raised inside a sync handler's thread when it passed its ``timeout_ms`` (or the
    worker's drain timeout at shutdown). A ``TimeoutError``: the attempt is recorded as a
    timeout, retryable, as for an ``async`` handler."""


def _finite_non_negative(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )
