"""Batched start and finish (dtq.scripts.BATCHED, lua/_batch.lua): a worker's read batch is
started, and its finishes recorded, by one script call per slot and up to BATCH_MAX entries,
and each entry still gets its own checks, writes and reply: a fenced, missing or failing entry
changes nothing for the others. On both backends: a cluster batch is one slot's calls."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis, RedisCluster
from redis.exceptions import ResponseError

from dtq import Queue, connect, keys
from dtq.calls import (
    Entry,
    LimitUse,
    Outcome,
    StartReply,
    finish_call,
    finish_many,
    start_many,
)
from dtq.config import Settings
from dtq.scripts import BATCH_MAX, Scripts, _shared
from dtq.store import Store
from support.worker import read_as

pytestmark = pytest.mark.backends("single", "cluster")


async def evalsha_calls(r: Redis) -> int:
    """How many EVALSHA the server (every primary, on a cluster) has run so far."""
    if isinstance(r, RedisCluster):
        stats: Any = await r.info("commandstats", target_nodes=RedisCluster.PRIMARIES)
        return sum(s.get("cmdstat_evalsha", {}).get("calls", 0) for s in stats.values())
    return int((await r.info("commandstats")).get("cmdstat_evalsha", {}).get("calls", 0))


async def read_all(r: Redis, consumer: str, queue: str, n: int) -> list[Entry]:
    stream = keys.stream(queue, 5)
    [(_, delivered)] = await r.xreadgroup(keys.CONSUMER_GROUP, consumer, {stream: ">"}, count=n)
    out = [Entry.parse(stream, entry_id, fields) for entry_id, fields in delivered]
    assert all(e is not None for e in out) and len(out) == n
    return [e for e in out if e is not None]


def kinds(replies: list[StartReply | Exception]) -> list[str]:
    return [type(r).__name__ if isinstance(r, Exception) else r.kind for r in replies]


async def test_each_entry_of_a_start_batch_gets_its_own_checks_in_one_call(
    queue: Queue, r: Redis, settings: Settings
) -> None:
    ids = [(await queue.submit("echo_task", {"i": i})).task_id for i in range(4)]
    first, gone, third = [await read_as(r, "w-1") for _ in range(3)]
    theirs = await read_as(r, "w-2")  # another worker's entry: w-1's start is fenced
    await r.delete(keys.task(gone.task_id))
    seen: list[tuple[str, bool]] = []
    store = Store(r, Scripts(on_call=lambda name, ok: seen.append((name, ok))), settings)
    before = await evalsha_calls(r)
    replies = await start_many(store, [first, gone, third, theirs], "w-1", token="t-1")
    assert await evalsha_calls(r) - before == 1
    assert kinds(replies) == ["run", "missing", "run", "fenced"]
    assert seen == [("start", True)] * 4  # told per call, by the script's own name
    for task_id in (ids[0], ids[2]):
        h = await r.hgetall(keys.task(task_id))
        assert (h["status"], h["attempt"], h["worker_id"]) == ("running", "1", "w-1")
    assert await r.hget(keys.task(ids[3]), "status") == "queued"  # fenced: nothing written
    pending = await r.xpending(keys.stream("default", 5), keys.CONSUMER_GROUP)
    assert pending["pending"] == 3  # the missing task's entry is acknowledged


async def test_a_call_that_raises_in_a_batch_is_that_calls_error_alone(
    queue: Queue, r: Redis, settings: Settings
) -> None:
    for i in range(3):
        await queue.submit("echo_task", {"i": i})
    entries = await read_all(r, "w-1", "default", 3)
    # Its history is no list: that start's RPUSH fails, WRONGTYPE.
    await r.delete(keys.history(entries[1].task_id))
    await r.set(keys.history(entries[1].task_id), "not a list")
    seen: list[tuple[str, bool]] = []
    store = Store(r, Scripts(on_call=lambda name, ok: seen.append((name, ok))), settings)
    replies = await start_many(store, entries, "w-1")
    assert kinds(replies) == ["run", "ResponseError", "run"]
    assert "WRONGTYPE" in str(replies[1])
    assert seen == [("start", True), ("start", False), ("start", True)]
    for e in (entries[0], entries[2]):
        assert await r.hget(keys.task(e.task_id), "status") == "running"


async def test_more_entries_than_a_batch_holds_start_and_finish_once_each(
    queue: Queue, r: Redis, settings: Settings
) -> None:
    n = 2 * BATCH_MAX + 1
    await queue.submit_many([{"task_type": "echo_task", "payload": {"i": i}} for i in range(n)])
    entries = await read_all(r, "w-1", "default", n)
    store = Store(r, Scripts(), settings)
    await r.script_flush()  # the batched scripts too: loaded again, and nothing runs twice
    started = await start_many(store, entries, "w-1", token="t-1")
    assert kinds(started) == ["run"] * n
    before = await evalsha_calls(r)
    calls = [
        finish_call(e, 1, Outcome("success", result_json=f'{{"i": {i}}}'), "w-1", settings)
        for i, e in enumerate(entries)
    ]
    finished = await finish_many(store, calls)
    assert [f if isinstance(f, Exception) else f.status for f in finished] == ["succeeded"] * n
    if not isinstance(r, RedisCluster):  # a cluster's are split by slot
        assert await evalsha_calls(r) - before == 3
    for i, e in enumerate(entries):
        h = await r.hmget(keys.task(e.task_id), "status", "attempt")
        assert h == ["succeeded", "1"], (i, h)
        assert await queue.result(e.task_id) == {"i": i}
    assert await r.xlen(keys.stream("default", 5)) == 0


async def test_a_batch_across_queues_starts_each_in_its_own_slot(
    r: Redis, settings: Settings
) -> None:
    """On a cluster the queues' keys sit in other slots (other primaries, for most): the batch
    is split by slot, each slot's share one call; a single server takes them in one."""
    queues = [f"bq{i}" for i in range(4)]
    q = await connect(settings=settings)
    try:
        entries: list[Entry] = []
        for name in queues:
            for i in range(3):
                await q.submit("echo_task", {"i": i}, queue=name)
            entries += await read_all(r, "w-1", name, 3)
        replies = await start_many(Store(r, Scripts(), settings), entries, "w-1")
        assert kinds(replies) == ["run"] * len(entries)
        for e, reply in zip(entries, replies, strict=True):
            assert isinstance(reply, StartReply)
            assert await r.hget(keys.task(e.task_id), "status") == "running"
    finally:
        await q.close()


async def test_every_call_of_a_batch_that_raises_gets_its_error(r: Redis) -> None:
    """Two finishes of an entry whose stream is a string: each raises (WRONGTYPE), and each
    call's result is its own error, not a reply."""
    scripts = Scripts()
    await r.set("dtq:not-a-stream", "x")
    bad = ("finish", ["dtq:not-a-stream"] * 12, ["x", "0-1", "w", keys.CONSUMER_GROUP, 1, "nope"])
    results = await scripts.call_many(r, [bad, bad])
    assert len(results) == 2, results
    assert all(isinstance(x, ResponseError) and "WRONGTYPE" in str(x) for x in results), results


async def test_calls_of_different_lengths_share_only_what_they_all_have(
    queue: Queue, r: Redis, settings: Settings
) -> None:
    """Every other entry meets a limit of one place (its start has four keys and five args
    more): the first of those runs, the second is parked for the place, the others run; each
    call got its own keys and args back whole, shared or not."""
    for i in range(6):
        await queue.submit("echo_task", {"i": i})
    entries = await read_all(r, "w-1", "default", 6)
    one = LimitUse("one", keys.limit_state("default", "one"), 0, 0, 1)
    replies = await start_many(
        Store(r, Scripts(), settings),
        entries,
        "w-1",
        limits=lambda e: (one,) if entries.index(e) % 2 == 0 else (),
    )
    assert kinds(replies) == ["run", "run", "throttled", "run", "throttled", "run"]
    running = await r.zrange(keys.limit_state("default", "one") + ":running", 0, -1)
    assert running == [entries[0].task_id]
    # Parked in the same instant (a batch shares one TIME), in either order.
    waiting = await r.zrange(keys.limit_state("default", "one") + ":waiting", 0, -1)
    assert sorted(waiting) == sorted([entries[2].task_id, entries[4].task_id])


def test_only_equal_values_of_one_type_are_shared() -> None:
    at, values, own = _shared([["a", 1, "x", 5], ["a", "1", "x"], ["a", 1.0, "x", 6, 7]])
    assert (at, values) == ([0, 2], ["a", "x"])  # 1, "1" and 1.0 are three values
    assert own == [[1, 5], ["1"], [1.0, 6, 7]]
    assert _shared([[True, 2], [1, 2]]) == ([1], [2], [[True], [1]])
