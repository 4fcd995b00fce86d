"""Waiting for tasks to end, pushed by the script that ends them (docs/sdk.md, "Waiting for a
task").

A wait is two steps and no loop:

1. ``wait.lua`` checks each task and, in the same atomic step, marks the ones still going
   (the hash's ``waited`` field). Unknown ids and terminal tasks are answered at once.
2. The waiter blocks with one ``XREAD BLOCK`` on the tasks' ``dtq:task:<id>:done`` streams
   from id 0. The script that makes a marked task terminal writes its entry (``retain`` in
   ``lua/_lib.lua``), so the read returns at that moment, or at once if the entry is already
   there: no end can fall between the check and the read.

Many tasks share one read (up to :data:`KEYS_PER_READ` per XREAD; in the cluster layout one
read per slot, since a command's keys must share one). A read blocks at most
:data:`BLOCK_S`; the waiter then checks again, which also marks a task again whose mark a
failover lost. A connection error or a cluster's refusal is retried with a short backoff
until the deadline: a Redis restart ends no wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Coroutine,
    Iterable,
    Sequence,
)
from contextvars import ContextVar
from typing import Any

from redis.exceptions import ClusterDownError, RedisClusterException, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dtq import calls, keys
from dtq.errors import (
    InvalidTaskError,
    ResultExpired,
    TaskCancelled,
    TaskExpired,
    TaskFailed,
    TaskNotFoundError,
    WaitTimeout,
)
from dtq.models import Task, TaskStatus
from dtq.store import Store

__all__ = [
    "BLOCK_S",
    "DEFAULT_WAIT_S",
    "HANDLER_QUEUES",
    "KEYS_PER_READ",
    "MAX_WAIT_S",
    "WaitHub",
    "as_completed",
    "check_timeout",
    "result_of",
    "wait_many",
]

log = logging.getLogger("dtq.wait")

DEFAULT_WAIT_S = 60.0  # a wait without a timeout still ends
MAX_WAIT_S = 86_400.0
BLOCK_S = 30.0  # one XREAD blocks at most this long, then the waiter checks again
KEYS_PER_READ = 500  # tasks in one XREAD
RETRY_FIRST_S = 0.05  # backoff after a connection error: doubles up to RETRY_MAX_S
RETRY_MAX_S = 1.0
WAKE_TTL_MS = 120_000  # a reader's wake-up stream outlives its process by at most this

_TRANSIENT = (
    RedisConnectionError,
    RedisTimeoutError,
    OSError,
    ClusterDownError,
    TryAgainError,
    RedisClusterException,
)

# The queues of the worker whose handler is running in this context (set by the worker around
# each execution): a handler that waits for a task of its own worker's queues may wait for a
# slot it holds itself, so the wait logs a warning.
HANDLER_QUEUES: ContextVar[Collection[str] | None] = ContextVar("dtq_handler_queues", default=None)


def check_timeout(timeout: float) -> float:
    """A wait's timeout in seconds: > 0 and at most :data:`MAX_WAIT_S`."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise InvalidTaskError(f"timeout must be a number of seconds, got {timeout!r}")
    if not 0 < timeout <= MAX_WAIT_S:
        raise InvalidTaskError(
            f"timeout must be more than 0 and at most {MAX_WAIT_S:.0f} seconds, got {timeout}"
        )
    return float(timeout)


def _check_ids(task_ids: Iterable[str]) -> list[str]:
    ids = list(dict.fromkeys(task_ids))  # each id once, first-seen order
    for tid in ids:
        if not isinstance(tid, str) or not tid:
            raise InvalidTaskError(f"a task id must be a non-empty string, got {tid!r}")
    return ids


def _spawn(coro: Coroutine[Any, Any, None], holder: set[asyncio.Task[None]]) -> None:
    """Run ``coro`` in the background, referenced by ``holder`` until it ends."""
    task = asyncio.ensure_future(coro)
    holder.add(task)
    task.add_done_callback(holder.discard)


class _Batcher:
    """Coalesces the requests of concurrent waiters made in one pass of the event loop into
    calls of ``fn`` for at most :data:`KEYS_PER_READ` ids each, so that a thousand waiters
    starting together cost a couple of commands, not a thousand connections."""

    def __init__(self, fn: Callable[[list[str]], Awaitable[dict[str, Any]]]) -> None:
        self._fn = fn
        self._pending: dict[str, list[asyncio.Future[Any]]] = {}
        self._scheduled = False
        self._running: set[asyncio.Task[None]] = set()

    async def get(self, ids: Sequence[str]) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        futs = []
        for tid in ids:
            fut: asyncio.Future[Any] = loop.create_future()
            self._pending.setdefault(tid, []).append(fut)
            futs.append(fut)
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)
        values = await asyncio.gather(*futs)
        return dict(zip(ids, values, strict=True))

    def _flush(self) -> None:
        self._scheduled = False
        pending, self._pending = self._pending, {}
        ids = list(pending)
        for i in range(0, len(ids), KEYS_PER_READ):
            chunk = {tid: pending[tid] for tid in ids[i : i + KEYS_PER_READ]}
            _spawn(self._run(chunk), self._running)

    async def _run(self, chunk: dict[str, list[asyncio.Future[Any]]]) -> None:
        try:
            values = await self._fn(list(chunk))
        except BaseException as exc:  # every requester of the chunk gets the error
            for futs in chunk.values():
                for f in futs:
                    if not f.done():
                        f.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for tid, futs in chunk.items():
            for f in futs:
                if not f.done():
                    f.set_result(values.get(tid))


class _Reader:
    """One blocking ``XREAD`` loop over the done streams of up to :data:`KEYS_PER_READ` tasks
    of one slot, plus its own wake-up stream (:func:`dtq.keys.waiter`)."""

    def __init__(self, hub: WaitHub, slot: int, like_task_id: str) -> None:
        self.hub = hub
        self.slot = slot
        self.ids: set[str] = set()
        self.wake = keys.waiter(uuid.uuid4().hex, like_task_id)
        # Never "$": a wake-up that reaches Redis before this read does must still wake it.
        self.wake_from = "0-0"
        self.blocked = False
        self.wake_sent = False
        self.task = asyncio.ensure_future(self._run())

    def add(self, tid: str) -> None:
        self.ids.add(tid)
        if self.blocked and not self.wake_sent:
            self.wake_sent = True
            _spawn(self._wake(), self.hub.background)

    async def _wake(self) -> None:
        pipe = self.hub.redis.pipeline(transaction=False)
        pipe.xadd(self.wake, {"w": "1"}, maxlen=1, approximate=False)
        pipe.pexpire(self.wake, WAKE_TTL_MS)
        with contextlib.suppress(*_TRANSIENT):
            await pipe.execute()

    async def _run(self) -> None:
        backoff = RETRY_FIRST_S
        while self.ids:
            streams: dict[Any, Any] = {keys.done(tid): "0" for tid in self.ids}
            streams[self.wake] = self.wake_from
            self.blocked, self.wake_sent = True, False
            try:
                reply: Any = await self.hub.redis.xread(streams, count=1, block=int(BLOCK_S * 1000))
                backoff = RETRY_FIRST_S
            except _TRANSIENT as exc:
                self.blocked = False
                log.debug("wait: Redis error %s; reading again in %.2fs", exc, backoff)
                self.hub.recheck(self.ids)  # their waiters check again (a restart may lose marks)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RETRY_MAX_S)
                continue
            finally:
                self.blocked = False
            if not reply:
                self.hub.recheck(self.ids)  # BLOCK_S passed: check again what failover lost
                continue
            for name, entries in reply:
                if name == self.wake:
                    self.wake_from = entries[-1][0]
                    continue
                tid = keys.task_id_of(str(name).removesuffix(":done"))
                self.ids.discard(tid)
                self.hub.ended(tid)
        self.hub.reader_done(self)


class WaitHub:
    """A process's waits on one Redis (one per :class:`dtq.Queue`): batched checks
    (wait.lua) and reads of ended tasks, and the blocked readers of done streams, one per slot
    and :data:`KEYS_PER_READ` tasks."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.redis = store.redis
        self._watch: dict[str, list[asyncio.Future[bool]]] = {}
        self._reader_of: dict[str, _Reader] = {}
        self._readers: dict[int, list[_Reader]] = {}
        self.background: set[asyncio.Task[None]] = set()
        self._check = _Batcher(self._check_many)
        self._fetch = _Batcher(self._fetch_many)

    async def check(self, ids: Sequence[str]) -> dict[str, int]:
        """0 unknown, 1 terminal, 2 not yet (and marked): wait.lua, batched."""
        return await self._check.get(ids)

    async def fetch(self, ids: Sequence[str]) -> dict[str, Task | None]:
        """The tasks as they are now (None: gone), batched."""
        return await self._fetch.get(ids)

    def watch(self, tid: str) -> asyncio.Future[bool]:
        """A future set to True when ``tid``'s done entry is read, False when its waiter
        should check again (a read's block passed, or Redis failed)."""
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._watch.setdefault(tid, []).append(fut)
        if tid not in self._reader_of:
            self._reader_for(tid).add(tid)
        return fut

    def forget(self, tid: str, fut: asyncio.Future[bool]) -> None:
        futs = self._watch.get(tid)
        if futs is None:
            return
        with contextlib.suppress(ValueError):
            futs.remove(fut)
        if not futs:
            del self._watch[tid]
            reader = self._reader_of.pop(tid, None)
            if reader is not None:
                reader.ids.discard(tid)  # left out of its next read

    def ended(self, tid: str) -> None:
        self._reader_of.pop(tid, None)
        for fut in self._watch.pop(tid, []):
            if not fut.done():
                fut.set_result(True)

    def recheck(self, ids: Collection[str]) -> None:
        for tid in list(ids):
            for fut in self._watch.get(tid, []):
                if not fut.done():
                    fut.set_result(False)

    def reader_done(self, reader: _Reader) -> None:
        group = self._readers.get(reader.slot, [])
        if reader in group:
            group.remove(reader)

    def _reader_for(self, tid: str) -> _Reader:
        slot = keys.slot(keys.task(tid)) if keys.cluster_layout() else 0
        group = self._readers.setdefault(slot, [])
        reader = next((r for r in group if len(r.ids) < KEYS_PER_READ and not r.task.done()), None)
        if reader is None:
            reader = _Reader(self, slot, tid)
            group.append(reader)
        self._reader_of[tid] = reader
        return reader

    async def _check_many(self, ids: list[str]) -> dict[str, int]:
        return await calls.wait_check(self.store, ids)

    async def _fetch_many(self, ids: list[str]) -> dict[str, Task | None]:
        found = {t.task_id: t for t in await self.store.get_many(ids)}
        return {tid: found.get(tid) for tid in ids}

    async def close(self) -> None:
        readers = [r for group in self._readers.values() for r in group]
        self._readers.clear()
        for r in readers:
            r.task.cancel()
        await asyncio.gather(*(r.task for r in readers), return_exceptions=True)


class _Deadline:
    def __init__(self, timeout: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._at = self._loop.time() + timeout

    def left(self) -> float:
        return self._at - self._loop.time()


def _not_found(tid: str) -> TaskNotFoundError:
    return TaskNotFoundError(
        f"task {tid} not found (unknown id, or its retention ran out)", task_id=tid
    )


async def _ended(
    hub: WaitHub, ids: Sequence[str], deadline: _Deadline
) -> AsyncIterator[list[Task]]:
    """Batches of the tasks of ``ids`` as they end, until all have, or the deadline
    (:class:`WaitTimeout`). An unknown id raises :class:`TaskNotFoundError` at once.

    The tasks are checked (and marked) once, then watched; they are checked again only when
    the hub says so (a read's block passed, Redis failed) or a task read back is not
    terminal, never because some of them ended."""
    pending = list(ids)
    watched: dict[str, asyncio.Future[bool]] = {}
    check = True
    backoff = RETRY_FIRST_S

    def unwatch(tids: Iterable[str]) -> None:
        for tid in list(tids):
            fut = watched.pop(tid, None)
            if fut is not None:
                hub.forget(tid, fut)

    try:
        while pending:
            try:
                ended: list[str] = []
                if check:
                    unwatch(list(watched))
                    states = await hub.check(pending)
                    gone = next((tid for tid in pending if states[tid] == 0), None)
                    if gone is not None:
                        raise _not_found(gone)
                    ended = [tid for tid in pending if states[tid] == 1]
                    watched = {tid: hub.watch(tid) for tid in pending if states[tid] == 2}
                    check = False
                left = deadline.left()
                if not ended and left > 0:
                    open_ = [f for f in watched.values() if not f.done()]
                    if open_:
                        await asyncio.wait(open_, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                    signalled = {tid: f.result() for tid, f in watched.items() if f.done()}
                    ended = [tid for tid, done in signalled.items() if done]
                    check = any(not done for done in signalled.values())
                    unwatch(signalled)
                tasks = await hub.fetch(ended) if ended else {}
                backoff = RETRY_FIRST_S
            except _TRANSIENT as exc:
                check = True
                left = deadline.left()
                if left <= 0:
                    raise WaitTimeout.of(pending, await _last_seen(hub, pending)) from exc
                log.debug("wait: Redis error %s; trying again in %.2fs", exc, backoff)
                await asyncio.sleep(min(backoff, left))
                backoff = min(backoff * 2, RETRY_MAX_S)
                continue
            lost = next((tid for tid, t in tasks.items() if t is None), None)
            if lost is not None:
                raise _not_found(lost)
            batch = [t for t in tasks.values() if t is not None and t.is_terminal]
            if len(batch) < len(tasks):
                # A task read back not terminal ended and was requeued since (a dead letter
                # sent back): it stays pending, and is checked (marked) again.
                check = True
            if batch:
                out = {t.task_id for t in batch}
                pending = [tid for tid in pending if tid not in out]
                yield batch
            elif deadline.left() <= 0:
                raise WaitTimeout.of(pending, await _last_seen(hub, pending))
    finally:
        unwatch(list(watched))


async def _last_seen(hub: WaitHub, ids: Sequence[str]) -> list[Task]:
    """The tasks as they are now, for a WaitTimeout (none when Redis does not answer)."""
    try:
        return await hub.store.get_many(ids[:KEYS_PER_READ])
    except _TRANSIENT:
        return []


async def _warn_if_own_queue(hub: WaitHub, ids: Sequence[str]) -> None:
    own = HANDLER_QUEUES.get()
    if not own:
        return
    with contextlib.suppress(*_TRANSIENT):
        mine = sorted({t.queue for t in await hub.store.get_many(ids[:100]) if t.queue in own})
        if mine:
            log.warning(
                "a handler waits for a task of queue %s, which its own worker serves: if "
                "every slot of the worker is taken by waiting handlers, the awaited task "
                "cannot start before the wait times out",
                ", ".join(mine),
            )


async def wait_many(hub: WaitHub, task_ids: Iterable[str], timeout_s: float) -> list[Task]:
    """Every task of ``task_ids`` once terminal, in the order given."""
    ids = _check_ids(task_ids)
    deadline = _Deadline(check_timeout(timeout_s))
    await _warn_if_own_queue(hub, ids)
    got: dict[str, Task] = {}
    async for batch in _ended(hub, ids, deadline):
        got.update((t.task_id, t) for t in batch)
    return [got[tid] for tid in ids]


async def as_completed(
    hub: WaitHub, task_ids: Iterable[str], timeout_s: float
) -> AsyncIterator[Task]:
    """The tasks of ``task_ids`` one by one as they end."""
    ids = _check_ids(task_ids)
    deadline = _Deadline(check_timeout(timeout_s))
    await _warn_if_own_queue(hub, ids)
    async for batch in _ended(hub, ids, deadline):
        for t in batch:
            yield t


def result_of(task: Task) -> Any:
    """The handler's result of a terminal task, or the error that says why there is none."""
    status = task.status
    if status == TaskStatus.SUCCEEDED:
        if task.result is None and task.result_expired:
            raise ResultExpired(
                f"the result of task {task.task_id} expired (DTQ_RESULT_RETENTION_S)",
                task_id=task.task_id,
            )
        return task.result
    if status in (TaskStatus.FAILED, TaskStatus.DEAD_LETTERED):
        raise TaskFailed.of(task)
    if status == TaskStatus.CANCELLED:
        raise TaskCancelled(f"task {task.task_id} was cancelled", task=task)
    if status == TaskStatus.EXPIRED:
        raise TaskExpired(f"task {task.task_id} expired before it started", task=task)
    raise InvalidTaskError(f"task {task.task_id} is {status}, not terminal")  # pragma: no cover
