"""Tasks whose stream entry was removed outside dtq (``XDEL``, ``XTRIM``, a stream deleted by
hand) are found and given a new entry (DESIGN 3; docs/delivery-guarantees.md, "Entries removed
outside dtq").

Nothing indexes a task by its entry id, and the reaper only learns the ids of deleted entries
(Redis 7 lists them in ``XAUTOCLAIM``'s reply; 6.2 answers nil and the reaper acknowledges
them): the task is found from its hash. The scheduler leader walks the task hashes with
``SCAN ... MATCH dtq:task:* TYPE hash`` one page per step (``PAGE`` keys looked at, one pipeline
of ``HMGET`` for the hashes found, one of ``XRANGE id id`` for the QUEUED and RUNNING ones); a
task whose entry is gone goes to ``recover.lua``, which checks it all again, leaves an entry
someone still has pending, and a RUNNING task whose worker is alive (that worker finishes it on
its hash), and writes the new entry.

Cost and bound: a step is three round trips of at most ``PAGE`` commands each; the scheduler
makes one step per tick while a pass is under way (``DTQ_SCHEDULER_INTERVAL_S``, 0.5 s by
default: about 2,000 keys a second) and starts a pass at most every ``PASS_EVERY_MS``. So a task
whose entry was removed is found within ``PASS_EVERY_MS`` plus two passes: with 100,000 queued
tasks (about 200,000 keys with their histories, plus the finished tasks retained) a pass takes
well under two minutes at that pace. On a Redis Cluster the pass walks each primary in turn
(``SCAN`` is per node), and the liveness of the RUNNING tasks' workers, whose hashes are in
other slots than the tasks', is read just before their ``recover.lua`` calls.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, cast

from redis.asyncio import RedisCluster

from dtq import calls, keys
from dtq.calls import LostEntry
from dtq.models import TASK_ID_RE
from dtq.store import Store

__all__ = ["PAGE", "PASS_EVERY_MS", "LostEntries"]

log = logging.getLogger(__name__)

PAGE = 1_000  # keys SCAN looks at per step
PASS_EVERY_MS = 60_000  # a new pass starts at most this often

_IN_STREAM = ("queued", "running")


class LostEntries:
    """The leader's pass over the task hashes, one page per :meth:`step`."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.cursor = 0  # of the SCAN; 0 once a pass is complete
        self.node = 0  # cluster layout: the index of the primary being walked

    async def step(self) -> tuple[list[tuple[str, str]], bool]:
        """One page of the pass. Returns (task id, its status) of each task given a new entry,
        and whether the pass is complete."""
        found, done = await self._page()
        ids = [tid for k in found if TASK_ID_RE.fullmatch(tid := keys.task_id_of(str(k)))]
        lost = await _lost(self.store, ids)
        recovered: list[tuple[str, str]] = []
        if lost:
            alive = await _alive_workers(self.store, lost) if keys.cluster_layout() else set()
            replies = await calls.recover_many(self.store, lost, alive)
            for one, reply in zip(lost, replies, strict=True):
                if isinstance(reply, Exception):  # that task's keys are not dtq's
                    log.error("recovery of task %s failed: %s", one.task_id, reply)
                elif reply[0] == "requeued":
                    recovered.append((one.task_id, reply[1]))
                    log.warning(
                        "task %s (%s): its entry %s was removed from %s outside dtq: new entry "
                        "%s%s",
                        one.task_id,
                        reply[1],
                        one.entry_id,
                        keys.stream(one.queue, one.priority),
                        reply[2],
                        " (a crash redelivery: its worker is gone)" * (reply[1] == "running"),
                    )
        return recovered, done

    async def _page(self) -> tuple[list[str], bool]:
        """One SCAN page of task hash keys, and whether the pass is complete (on a cluster,
        each primary's keyspace is walked in turn, the pass complete after the last one's)."""
        redis = self.store.redis
        if not isinstance(redis, RedisCluster):
            cursor, found = await redis.scan(
                self.cursor, match=keys.task_match(), count=PAGE, _type="hash"
            )
            self.cursor = int(cursor)
            return [str(k) for k in found], self.cursor == 0
        primaries = sorted(redis.get_primaries(), key=lambda n: n.name)
        if self.node >= len(primaries):
            self.node, self.cursor = 0, 0
        node = primaries[self.node]
        reply = await redis.execute_command(
            "SCAN",
            self.cursor,
            "MATCH",
            keys.task_match(),
            "COUNT",
            PAGE,
            "TYPE",
            "hash",
            target_nodes=node,
        )
        cursor, found = reply
        if isinstance(cursor, dict):  # redis-py's cluster SCAN: the cursor of each node asked
            cursor = next(iter(cursor.values()))
        self.cursor = int(cursor)
        if self.cursor == 0:
            self.node += 1
        done = self.cursor == 0 and self.node >= len(primaries)
        if done:
            self.node = 0
        return [str(k) for k in found], done


async def _alive_workers(store: Store, lost: Sequence[LostEntry]) -> set[str]:
    """Cluster layout: which of the RUNNING tasks' workers are alive (a worker hash that exists
    and does not say stopped), read for recover.lua, which cannot (another slot)."""
    ids = sorted({one.worker_id for one in lost if one.worker_id})
    if not ids:
        return set()
    pipe = store.redis.pipeline(transaction=False)
    for wid in ids:
        pipe.hget(keys.worker(wid), "status")
    return {
        wid for wid, st in zip(ids, await pipe.execute(), strict=True) if st and st != "stopped"
    }


async def _lost(store: Store, task_ids: Sequence[str]) -> list[LostEntry]:
    """Those of ``task_ids`` that are QUEUED or RUNNING and whose entry is not in their stream
    (two round trips)."""
    if not task_ids:
        return []
    pipe = store.redis.pipeline(transaction=False)
    for tid in task_ids:
        pipe.hmget(keys.task(tid), "status", "queue", "priority", "entry_id", "worker_id")
    rows = cast(list[list[Any]], await pipe.execute())
    todo: list[LostEntry] = []
    for tid, (status, queue, priority, entry_id, worker_id) in zip(task_ids, rows, strict=True):
        if status not in _IN_STREAM or not queue or not entry_id:
            continue
        try:
            todo.append(LostEntry(tid, queue, int(priority), entry_id, worker_id or ""))
        except (TypeError, ValueError):
            continue  # a foreign write: leave it alone
    if not todo:
        return []
    pipe = store.redis.pipeline(transaction=False)
    for one in todo:
        pipe.xrange(keys.stream(one.queue, one.priority), one.entry_id, one.entry_id, count=1)
    found = await pipe.execute(raise_on_error=False)
    return [one for one, rows_found in zip(todo, found, strict=True) if rows_found == []]
