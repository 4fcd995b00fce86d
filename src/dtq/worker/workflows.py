"""The workflow relay, the worker's part of workflows (docs/workflows.md).

The script that ends a workflow node's task appends that end to its queue's outbox
(``dtq:wfbox:<queue>``, ``retain`` in _lib.lua), atomically with the end. Every worker reads
the outboxes of its queues in the consumer group ``workers`` (XREADGROUP BLOCK, one loop per
queue: in the cluster layout each outbox is in its queue's slot), applies each entry
(:func:`dtq.admin.workflows.apply_entry`: workflow.lua's "end", then the submit of what it
released), then acknowledges and deletes it. An entry whose worker died before that is taken
over by another worker once it has been idle ``DTQ_VISIBILITY_TIMEOUT_S`` (XAUTOCLAIM, every
``CLAIM_EVERY_S``); applying an end twice changes nothing, and a release submitted twice is
absorbed by its idempotency key. An entry that cannot be applied yet (its node's queue is full)
stays pending and is tried again the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from redis.exceptions import ResponseError

from dtq import keys
from dtq.admin.workflows import apply_entry
from dtq.errors import DtqError
from dtq.store import Store

__all__ = ["BATCH", "BLOCK_MS", "CLAIM_EVERY_S", "WorkflowRelay"]

log = logging.getLogger("dtq.worker.workflows")

BLOCK_MS = 500
BATCH = 100
CLAIM_EVERY_S = 5.0


async def _wait(stopping: asyncio.Event, seconds: float) -> None:
    """``seconds``, or less when the worker stops."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stopping.wait(), seconds)


class WorkflowRelay:
    """Relays the workflow outboxes of one worker's queues."""

    def __init__(
        self, store: Store, worker_id: str, queues: Sequence[str], visibility_timeout_s: float
    ) -> None:
        self._store = store
        self._worker_id = worker_id
        self._queues = sorted(set(queues))
        self._min_idle_ms = int(visibility_timeout_s * 1000)
        self.applied = 0  # entries applied by this worker (tests, logs)

    async def run(self, stopping: asyncio.Event) -> None:
        """One loop per queue until the worker stops (each sees the stop within one BLOCK)."""
        loops = [asyncio.create_task(self._queue_loop(q, stopping)) for q in self._queues]
        try:
            await asyncio.gather(*loops)
        finally:
            for t in loops:
                t.cancel()

    async def _queue_loop(self, queue: str, stopping: asyncio.Event) -> None:
        outbox = keys.wf_outbox(queue)
        loop = asyncio.get_running_loop()
        next_claim = 0.0
        grouped = False
        while not stopping.is_set():
            if not grouped:
                # The outbox exists once a node of this queue has ended (or a workflow was
                # written with this home): until then, nothing to read, and nothing is created
                # (an idle queue's keys go with it: remove_queue.lua).
                grouped = await self._ensure_group(outbox)
                if not grouped:
                    await _wait(stopping, BLOCK_MS / 1000)
                    continue
            if loop.time() >= next_claim:
                next_claim = loop.time() + CLAIM_EVERY_S
                await self._claim(queue, outbox)
            try:
                reply: Any = await self._store.redis.xreadgroup(
                    keys.CONSUMER_GROUP,
                    self._worker_id,
                    {outbox: ">"},
                    count=BATCH,
                    block=BLOCK_MS,
                )
            except ResponseError as exc:
                if "NOGROUP" not in str(exc) and "UNBLOCKED" not in str(exc):
                    raise
                grouped = False  # the outbox was removed with its queue
                continue
            for _stream, entries in reply or ():
                await self._apply(queue, outbox, entries)

    async def _ensure_group(self, outbox: str) -> bool:
        """The consumer group on ``outbox`` (from its first entry); False while there is no
        outbox."""
        try:
            await self._store.redis.xgroup_create(outbox, keys.CONSUMER_GROUP, id="0")
        except ResponseError as exc:
            if "BUSYGROUP" in str(exc):
                return True
            if "requires the key to exist" in str(exc):
                return False
            raise
        return True

    async def _claim(self, queue: str, outbox: str) -> None:
        """Take over the entries a worker read and did not apply in time (it died)."""
        cursor = "0-0"
        while True:
            try:
                reply: Any = await self._store.redis.xautoclaim(
                    outbox,
                    keys.CONSUMER_GROUP,
                    self._worker_id,
                    self._min_idle_ms,
                    cursor,
                    count=BATCH,
                )
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                return
            cursor, entries = reply[0], reply[1]
            await self._apply(queue, outbox, [e for e in entries if e and e[1] is not None])
            if cursor in ("0-0", b"0-0"):
                return

    async def _apply(
        self, queue: str, outbox: str, entries: Sequence[tuple[str, dict[str, str]]]
    ) -> None:
        done: list[str] = []
        for entry_id, fields in entries:
            try:
                await apply_entry(self._store, queue, fields)
            except DtqError as exc:
                # A node's queue is full: the entry stays pending, tried again later.
                log.warning("workflow outbox of %s: %s left for later: %s", queue, entry_id, exc)
                continue
            done.append(entry_id)
        if done:
            pipe = self._store.redis.pipeline(transaction=False)
            pipe.xack(outbox, keys.CONSUMER_GROUP, *done)
            pipe.xdel(outbox, *done)
            await pipe.execute()
            self.applied += len(done)
