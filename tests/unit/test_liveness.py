"""The one liveness rule (dtq.records.worker_liveness) that the admin views, the API's gauges and
the scheduler leader share, and the depth/pending sums of a queue's streams."""

from __future__ import annotations

from redis.exceptions import ResponseError

from dtq.records import STALE_HEARTBEATS, queue_depth, stale_after_ms, worker_liveness

NOW_MS = 1_800_000_000_000
STALE_MS = stale_after_ms(5.0)


def test_the_stale_limit_is_three_heartbeat_intervals() -> None:
    assert STALE_HEARTBEATS == 3 and STALE_MS == 15_000


def test_a_fresh_heartbeat_is_alive() -> None:
    live = worker_liveness({"last_heartbeat_ms": str(NOW_MS - 15_000)}, NOW_MS, STALE_MS)
    assert live.alive and not live.stale and live.age_ms == 15_000


def test_an_old_heartbeat_is_stale() -> None:
    live = worker_liveness({"last_heartbeat_ms": str(NOW_MS - 15_001)}, NOW_MS, STALE_MS)
    assert live.stale and not live.alive


def test_a_hash_gone_is_stale() -> None:
    for gone in (None, {}):
        live = worker_liveness(gone, NOW_MS, STALE_MS)
        assert live.stale and not live.alive and live.beat_ms is None


def test_a_worker_without_a_heartbeat_yet_is_alive() -> None:
    live = worker_liveness({"last_heartbeat_ms": None, "status": "starting"}, NOW_MS, STALE_MS)
    assert live.alive and not live.stale and live.age_ms is None


def test_a_stopped_worker_is_neither_alive_nor_stale_while_its_beat_is_young() -> None:
    h = {"last_heartbeat_ms": str(NOW_MS - 1_000), "status": "stopped"}
    live = worker_liveness(h, NOW_MS, STALE_MS)
    assert not live.alive and not live.stale


def test_the_iso_heartbeat_counts_when_the_ms_field_is_missing() -> None:
    live = worker_liveness({"last_heartbeat": "2020-01-01T00:00:00.000Z"}, NOW_MS, STALE_MS)
    assert live.stale and live.beat_ms == 1_577_836_800_000


def test_depth_and_pending_sum_the_streams_and_count_missing_ones_as_zero() -> None:
    missing = ResponseError("NOGROUP No such key or consumer group")  # what redis-py gives
    streams = [3, {"pending": 1}, 0, missing, 5, {"pending": 2}, 0, None] + [0, None] * 6
    assert queue_depth([*streams, 0]) == (8, 3)
    assert queue_depth([*streams, 4]) == (12, 3)  # the tasks a fair queue holds are waiting too


def _replies(*first: object, held: object = 0) -> list[object]:
    """read_depth's replies: ``first`` for the first streams, the others empty, then ZCARD."""
    return [*first, *[0, None] * (10 - len(first) // 2), held]


def test_a_queue_is_never_empty_for_want_of_an_answer() -> None:
    """A stream or group that does not exist counts 0; a reply that says the read did not
    happen (CLUSTERDOWN during a failover, TRYAGAIN, a lost connection) is raised."""
    import pytest
    from redis.exceptions import ClusterDownError, TryAgainError
    from redis.exceptions import ConnectionError as RedisConnectionError

    nogroup = ResponseError("NOGROUP No such key 'dtq:stream:q:p9' or consumer group")
    assert queue_depth(_replies(3, {"pending": 1}, 0, nogroup)) == (3, 1)
    for missing in (
        ClusterDownError("CLUSTERDOWN"),
        TryAgainError("TRYAGAIN"),
        RedisConnectionError(),
    ):
        with pytest.raises(type(missing)):
            queue_depth(_replies(3, {"pending": 1}, missing, nogroup))
