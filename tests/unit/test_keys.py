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
    assert keys.done(tid) == f"dtq:task:{tid}:done"
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


FLAT_ONLY = ("DEAD_LETTER", "AUDIT", "RETRY_SCHEDULE", "RETRY_CLAIMED", "CANCELLED", "RECENT")
FLAT_ONLY += ("EXPIRY", "TASK_MATCH")


def test_src_reaches_the_shared_keys_through_the_layout() -> None:
    """The contract's constants are the flat layout's names only: code that used them would
    write one key for every queue on a cluster, in another slot than the scripts' others."""
    import pathlib
    import re

    src = pathlib.Path(keys.__file__).parent
    used = re.compile(r"keys\.(" + "|".join(FLAT_ONLY) + r")\b")
    offenders = [
        f"{path.relative_to(src)}:{n}"
        for path in src.rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if used.search(line)
    ]
    assert offenders == []


@given(st.from_regex(r"[a-z0-9_-]{1,64}", fullmatch=True), st.integers(0, 9))
def test_cluster_layout_puts_a_queue_and_its_tasks_in_one_slot(queue: str, priority: int) -> None:
    from dtq.calls import new_task_id

    keys.use_layout(True)
    try:
        task_id = new_task_id(queue)
        assert len(task_id) == 32 and task_id[12] == "4"  # still a uuid4 as 32 hex digits
        queue_keys = [
            keys.stream(queue, priority),
            keys.queue_paused(queue),
            keys.queue_last_submit(queue),
            keys.idempotency(queue, "k"),
            keys.idempotency(queue, None),
            keys.retry_schedule(queue),
            keys.retry_claimed(queue),
            keys.expiry(queue),
            keys.cancelled(queue),
            keys.recent(queue),
            keys.dead_letter(queue),
            keys.audit(queue),
        ]
        task_keys = [
            keys.task(task_id),
            keys.history(task_id),
            keys.payload(task_id),
            keys.done(task_id),
            keys.result(task_id),
        ]
        assert {keys.slot(k) for k in queue_keys + task_keys} == {keys.slot("{" + queue + "}")}
        assert keys.stream_queue(keys.stream(queue, priority)) == (queue, priority)
        assert keys.task_id_of(keys.task(task_id)) == task_id
        assert keys.task(task_id) == "dtq:{" + task_id[:5] + "}:task:" + task_id
    finally:
        keys.use_layout(False)


def test_the_slot_tag_table_is_the_smallest_tag_of_every_slot() -> None:
    """slot_tags.txt, derived again: each slot's smallest five-hex-digit string (every slot has
    one)."""
    from binascii import crc_hqx

    smallest: dict[int, str] = {}
    for n in range(16**keys.TAG_DIGITS):
        tag = f"{n:05x}"
        smallest.setdefault(crc_hqx(tag.encode(), 0) % keys.SLOTS, tag)
    assert len(smallest) == keys.SLOTS
    assert keys._slot_tags() == "".join(smallest[s] for s in range(keys.SLOTS))


def test_slot_matches_redis_cluster() -> None:
    """Values from CLUSTER KEYSLOT (Redis's documentation examples and a hash tag)."""
    assert keys.slot("foo") == 12182
    assert keys.slot("{user1000}.following") == keys.slot("{user1000}.followers")
    assert keys.slot("{}foo") == keys.slot("{}foo")  # an empty tag: the whole key is hashed
    assert keys.slot("a{b}c") == keys.slot("b")


def test_events_go_to_a_shard_channel_only_when_sharded_in_the_cluster_layout() -> None:
    keys.use_sharded_events(True)  # ignored in the flat layout: dtq:events exactly
    assert keys.events("emails") == keys.EVENTS == "dtq:events"
    assert not keys.sharded_events()
    keys.use_layout(True)
    try:
        assert keys.events("emails") == keys.EVENTS  # a server without sharded pub/sub
        keys.use_sharded_events(True)
        assert keys.events("emails") == "dtq:{emails}:events"
        assert keys.slot(keys.events("emails")) == keys.slot(keys.stream("emails", 5))
        assert keys.events("emails") is keys.events("emails")  # made once
        keys.use_layout(True)  # the same layout again (another client): still sharded
        assert keys.sharded_events()
    finally:
        keys.use_layout(False)
    assert not keys.sharded_events() and keys.events("emails") == keys.EVENTS
