"""Retry policy (contract section 4): the backoff formula and error classification.

Pure: no clock, no I/O. ``rng`` is passed in so tests can pin it.

Classification, in order:

1. ``RetryableError`` (dtq_tasks), ``TimeoutError`` (``asyncio.TimeoutError`` is the same class),
   and Redis connection errors (``redis.exceptions.ConnectionError`` / ``TimeoutError``):
   retryable.
2. ``PermanentError`` (dtq_tasks), pydantic ``ValidationError``, :class:`PayloadDecodeError`:
   permanent.
3. An error whose message is over the 500-character limit: permanent (the contract lists
   "error_message over limit" among the permanent errors; it wins over rule 1).
4. Anything else: permanent. The contract says "never retry everything": only the errors a
   handler marks as transient, timeouts and lost connections are retried. A handler that wants
   a retry on some other failure raises ``RetryableError`` from it.

The ``dtq_tasks`` exceptions are recognised by name along their class hierarchy, because this
module sits below ``dtq_tasks`` in the layering and must not import it.
"""

from __future__ import annotations

import random
import re

from pydantic import ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dtq.config import Settings

__all__ = [
    "ERROR_MESSAGE_MAX",
    "PayloadDecodeError",
    "classify",
    "next_retry_delay_s",
    "sanitize",
]

ERROR_MESSAGE_MAX = 500
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]+")


class PayloadDecodeError(ValueError):
    """The payload of a stream entry is not a JSON object."""


def next_retry_delay_s(attempt: int, settings: Settings, rng: random.Random) -> float:
    """Seconds until the retry after failed ``attempt`` (1-based), contract section 4::

    capped = min(DTQ_RETRY_MAX_DELAY, DTQ_RETRY_BASE_DELAY * 2 ** (attempt - 1))
    actual = max(0, capped * (1 + uniform(-DTQ_RETRY_JITTER, DTQ_RETRY_JITTER)))
    """
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, not {attempt}")
    # 2 ** 1000 as a float overflows; past ~64 doublings every sane base is capped anyway.
    exponent = min(attempt - 1, 64)
    capped = min(settings.retry_max_delay, settings.retry_base_delay * 2.0**exponent)
    jitter = settings.retry_jitter
    actual = capped * (1 + rng.uniform(-jitter, jitter))
    return max(0.0, actual)


def sanitize(message: str) -> str:
    """One line of at most 500 characters: control characters (newlines too) become a space."""
    return _CONTROL.sub(" ", message).strip()[:ERROR_MESSAGE_MAX]


def _class_names(exc: BaseException) -> set[str]:
    return {f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__}


_RETRYABLE_NAMES = {"dtq_tasks.errors.RetryableError"}
_PERMANENT_NAMES = {"dtq_tasks.errors.PermanentError"}


def classify(exc: BaseException) -> tuple[bool, str, str]:
    """(retryable, error_class, sanitized message) of an exception a handler ended with."""
    raw = str(exc)
    error_class = type(exc).__name__
    message = sanitize(raw) or error_class
    names = _class_names(exc)
    if len(raw) > ERROR_MESSAGE_MAX:
        return False, error_class, message
    if names & _PERMANENT_NAMES or isinstance(exc, ValidationError | PayloadDecodeError):
        return False, error_class, message
    if names & _RETRYABLE_NAMES or isinstance(
        exc, TimeoutError | RedisConnectionError | RedisTimeoutError
    ):
        return True, error_class, message
    return False, error_class, message
