"""The exceptions a handler raises to tell the worker what to do next (contract sections 4, 15).

::

    HandlerError
    ├── RetryableError     try again after the backoff of contract section 4 (up to max_attempts)
    ├── PermanentError     never try again: dead letter (or FAILED when the DLQ is disabled)
    ├── RescheduleError    not an error: run again after ``delay_seconds`` (counts as an attempt)
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
    "HandlerError",
    "PermanentError",
    "RescheduleError",
    "RetryableError",
    "TaskCancelled",
    "TimeLimitExceeded",
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
