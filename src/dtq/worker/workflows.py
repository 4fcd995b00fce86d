"""The workflow relay, the worker's part of workflows (docs/workflows.md).

The script that ends a workflow node's task appends that end to its queue's outbox
(``dtq:wfbox:<queue>``, ``retain`` in _lib.lua), atomically with the end. Every worker reads
the outboxes of its queues in the consumer group ``workers`` (XREADGROUP BLOCK, one loop per
queue: in the cluster layout each outbox is in its queue's slot), applies each entry
(:func:`dtq.admin.workflows.apply_entries`: workflow.lua's "end" for each entry of a read,
all in one round trip, then the submit of what they released), then acknowledges and deletes
them. An entry whose worker died before that is taken
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
from dtq.admin.workflows import apply_entries
from dtq.errors import DtqError
from dtq.store import Store

__all__ = ["BATCH", "BLOCK_MS", "CLAIM_EVERY_S", "HOMES_CACHED", "WorkflowRelay"]

log = logging.getLogger("dtq.worker.workflows")

BLOCK_MS = 500
BATCH = 100
CLAIM_EVERY_S = 5.0
HOMES_CACHED = 10_000


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
        self._homes: dict[str, str] = {}  # workflow id -> home queue (it never changes)

    async def run(self, stopping: asyncio.Event) -> None:
        """One loop per queue until the worker stops (each sees the stop within one BLOCK)."""
        loops = [asyncio.create_task(self._queue_loop(q, stopping)) for q in self._queues]
        try:
            await asyncio.gather(*loops)
        finally:
            # Awaited, not only cancelled: a loop cancelled in its XREADGROUP drops that
            # connection when it next runs, which must be before the worker closes its client
            # (and, in a test, before the event loop ends: an unclosed socket otherwise).
            for t in loops:
                t.cancel()
            await asyncio.gather(*loops, return_exceptions=True)

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
        """Apply a batch of entries (one round trip of workflow.lua calls), then acknowledge
        and delete them. A batch that cannot be applied yet (a node's queue is full) stays
        pending whole, and is tried again once its entries are idle: applying twice changes
        nothing."""
        if not entries:
            return
        try:
            await apply_entries(self._store, queue, [f for _, f in entries], self._homes)
        except DtqError as exc:
            log.warning(
                "workflow outbox of %s: %d entries left for later: %s", queue, len(entries), exc
            )
            return
        ids = [entry_id for entry_id, _ in entries]
        pipe = self._store.redis.pipeline(transaction=False)
        pipe.xack(outbox, keys.CONSUMER_GROUP, *ids)
        pipe.xdel(outbox, *ids)
        await pipe.execute()
        self.applied += len(ids)
        if len(self._homes) > HOMES_CACHED:
            self._homes.clear()
