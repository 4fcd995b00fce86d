"""Key names exactly as contract section 2 spells them (plus DESIGN's documented extensions)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dtq import keys


def test_fixed_names() -> None:
    assert keys.DEAD_LETTER == "dtq:stream:dead-letter"
    assert keys.AUDIT == "dtq:stream:audit"
    assert keys.RETRY_SCHEDULE == "dtq:retry:schedule"
    assert keys.RETRY_CLAIMED == "dtq:retry:claimed"
    assert keys.WORKERS == "dtq:workers"
    assert keys.CANCELLED == "dtq:cancelled"
    assert keys.RECENT == "dtq:tasks:recent"
    assert keys.SCHEDULER_LOCK == "dtq:lock:scheduler"
    assert keys.CONSUMER_GROUP == "workers"
    assert keys.EVENTS == "dtq:events"
    # Deliberate extensions (DESIGN 6 and the queue registry).
    assert keys.EXPIRY == "dtq:expiry"
    assert keys.QUEUES == "dtq:queues"


def test_per_task_and_per_queue_names() -> None:
    tid = "0123456789abcdef0123456789abcdef"
    assert keys.task(tid) == f"dtq:task:{tid}"
    assert keys.history(tid) == f"dtq:task:{tid}:history"
    assert keys.payload(tid) == f"dtq:task:{tid}:payload"
    assert keys.result(tid) == f"dtq:result:{tid}"
    assert keys.idempotency("emails", "order-42") == "dtq:idempotency:emails:order-42"
    assert keys.worker("worker-0a1b2c3d") == "dtq:worker:worker-0a1b2c3d"
    assert keys.queue_paused("emails") == "dtq:queue:emails:paused"
    assert keys.queue_last_submit("emails") == "dtq:queue:emails:last_submit"
    assert keys.stream("emails", 7) == "dtq:stream:emails:p7"


def test_no_key_without_idempotency_key() -> None:
    # A task without a key gets a placeholder that no script writes and no queue can produce.
    placeholder = keys.idempotency("default", None)
    assert placeholder == keys.idempotency("default", "")
    assert placeholder != keys.idempotency("default", "-")


def test_queue_streams_strict_order() -> None:
    assert keys.PRIORITIES == (9, 8, 7, 6, 5, 4, 3, 2, 1, 0)
    assert keys.queue_streams("default") == [f"dtq:stream:default:p{p}" for p in range(9, -1, -1)]


@given(
    st.from_regex(r"\A[a-z0-9][a-z0-9_-]{0,63}\Z"),
    st.integers(min_value=0, max_value=9),
)
def test_stream_queue_inverse(queue: str, priority: int) -> None:
    assert keys.stream_queue(keys.stream(queue, priority)) == (queue, priority)


def test_dead_letter_stream_is_not_a_task_stream() -> None:
    # A queue named "dead-letter" would own dtq:stream:dead-letter:p<N>, never the DLQ key.
    assert keys.DEAD_LETTER not in keys.queue_streams("dead-letter")
