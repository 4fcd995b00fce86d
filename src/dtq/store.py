"""Task reads and the submit path against Redis.

State changes are Lua scripts (``dtq/lua``) called through :mod:`dtq.calls`; this module
batches submits, turns the submit replies into tasks or dtq errors, and reads tasks (hash,
payload, result, history, the recent index). Admin operations (cancel, expire, dead letters,
pause, purge) are in :mod:`dtq.admin`.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import cast

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from dtq import calls, keys
from dtq.calls import RECENT_CAP, SUBMIT_CHUNK, SubmitReply, new_id, new_task_id
from dtq.config import Settings
from dtq.errors import (
    DtqError,
    IdempotencyInProgressError,
    QueueFullError,
    ReplicationTimeoutError,
    TaskNotFoundError,
)
from dtq.models import HistoryEntry, SubmitRequest, Task, TaskStatus
from dtq.scripts import Scripts

__all__ = ["RECENT_CAP", "SUBMIT_CHUNK", "Store", "ms_to_dt", "new_id"]

_LIST_CHUNK = 500

_Outcome = Task | DtqError | ResponseError
"""What one submit came to: its task, the error it was refused with, or its Redis error."""


def ms_to_dt(ms: int | float | str) -> datetime:
    return datetime.fromtimestamp(int(ms) / 1000, tz=UTC)


@dataclass
class Store:
    """Task reads and the submit path over one Redis client (decode_responses=True)."""

    redis: Redis
    scripts: Scripts
    settings: Settings
    known_types: Collection[str] | None = None
    # submit() calls waiting for the next batch, the batches being sent, and how many
    # submit batches are in flight.
    _pending: builtins.list[tuple[SubmitRequest, asyncio.Future[_Outcome]]] = field(
        default_factory=list, init=False, repr=False, compare=False
    )
    # Cluster layout: when this process last added each queue to dtq:queues (monotonic s).
    _listed: dict[str, float] = field(default_factory=dict, init=False, repr=False, compare=False)
    _flushing: set[asyncio.Task[None]] = field(
        default_factory=set, init=False, repr=False, compare=False
    )
    _in_flight: int = field(default=0, init=False, repr=False, compare=False)

    # -- submit ---------------------------------------------------------------------------------

    async def submit(self, req: SubmitRequest) -> Task:
        """One task. With no submit in flight it is sent at once; calls made while others are
        in flight wait for the next batch, which they share (DESIGN 3: the hot path is
        batched). Each is still decided on its own, with its own reply or error, and a call
        cancelled before its batch is sent is not sent."""
        if not self._in_flight:
            self._in_flight += 1
            try:
                result = (await self._submit_each([req]))[0]
            finally:
                self._in_flight -= 1
        else:
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[_Outcome] = loop.create_future()
            self._pending.append((req, fut))
            if len(self._pending) == 1:
                flush = loop.create_task(self._flush_submits())
                self._flushing.add(flush)
                flush.add_done_callback(self._flushing.discard)
            result = await fut
        if isinstance(result, Exception):
            raise result
        return result

    async def _flush_submits(self) -> None:
        batch, self._pending = self._pending, []
        batch = [(req, fut) for req, fut in batch if not fut.cancelled()]
        if not batch:
            return
        self._in_flight += 1
        try:
            results = await self._submit_each([req for req, _ in batch])
        except BaseException as exc:
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        finally:
            self._in_flight -= 1
        for (_, fut), result in zip(batch, results, strict=True):
            if not fut.done():
                fut.set_result(result)

    async def submit_many(self, reqs: Sequence[SubmitRequest]) -> list[Task | DtqError]:
        """All submits in one round trip (:func:`dtq.calls.submit`: one ``submit.lua`` call per
        ``SUBMIT_CHUNK`` tasks). Each item is the task or the error for that item; a Redis
        error in any item (a wrong-type key, out of memory) is raised once every reply is in
        (the other items may have been committed), as is a lost connection.
        """
        results = await self._submit_each(reqs)
        for result in results:
            if isinstance(result, ResponseError):
                raise result
        return cast(builtins.list[Task | DtqError], results)

    async def submit_with_ids(
        self, reqs: Sequence[SubmitRequest], ids: Sequence[str]
    ) -> list[Task | DtqError]:
        """:meth:`submit_many` with the task ids chosen by the caller (each made by
        :func:`dtq.calls.new_task_id` for its queue): a workflow's nodes have their ids from
        the workflow's submit, before their tasks exist."""
        results = await self._submit_each(reqs, ids)
        for result in results:
            if isinstance(result, ResponseError):
                raise result
        return cast(builtins.list[Task | DtqError], results)

    async def _submit_each(
        self, reqs: Sequence[SubmitRequest], given: Sequence[str] | None = None
    ) -> builtins.list[_Outcome]:
        """:meth:`submit_many` with a Redis error as the result of the items it failed (one
        item; every item of a script call that raised), so that concurrent submits sharing a
        batch each get their own outcome. A lost connection is raised: no outcome is known."""
        if not reqs:
            return []
        ids = list(given) if given is not None else [new_task_id(req.queue) for req in reqs]
        submitted = await calls.submit(self, reqs, ids)
        replies = submitted.replies
        if keys.cluster_layout():
            await self._register(reqs, replies)
        # Replays return the stored tasks: all of them read in one more round trip.
        dup_ids = [r.task_id for r in replies if not isinstance(r, Exception) and r.kind == "dup"]
        stored = {t.task_id: t for t in await self.get_many(dup_ids)}
        out: builtins.list[_Outcome] = []
        for req, task_id, reply in zip(reqs, ids, replies, strict=True):
            if isinstance(reply, ResponseError):
                out.append(reply)
            elif reply.kind == "new":
                out.append(_new_task(req, task_id, reply, self.settings))
            elif reply.kind == "dup":
                task = stored.get(reply.task_id)
                if task is None:
                    out.append(
                        TaskNotFoundError(
                            f"idempotency key {req.idempotency_key!r} belongs to task "
                            f"{reply.task_id} whose record has expired",
                            task_id=reply.task_id,
                        )
                    )
                    continue
                out.append(task.model_copy(update={"duplicate": True}))
            else:
                out.append(_submit_error(req, reply))
        wanted = self.settings.submit_min_replicas
        if submitted.replicas is not None and submitted.replicas < wanted:
            return [
                _unconfirmed(req, outcome, submitted, self.settings)
                for req, outcome in zip(reqs, out, strict=True)
            ]
        return out

    async def _register(
        self, reqs: Sequence[SubmitRequest], replies: Sequence[SubmitReply | ResponseError]
    ) -> None:
        """Cluster layout: add the queues of the tasks just accepted to ``dtq:queues``, a key in
        another slot than theirs, after their submit (docs/redis-schema.md, "The cluster
        layout": with remove_queue's order, a queue with accepted work is always listed). A
        queue this process listed less than half ``DTQ_QUEUE_IDLE_TTL_S`` ago (at most a
        minute) is not sent again: it cannot have been removed since, as its submits kept it
        busy."""
        now = time.monotonic()
        ttl = min(60.0, self.settings.queue_idle_ttl_s / 2)
        todo = {
            req.queue
            for req, reply in zip(reqs, replies, strict=True)
            if not isinstance(reply, ResponseError)
            and reply.kind == "new"
            and now - self._listed.get(req.queue, -ttl) >= ttl
        }
        if todo:
            await self.redis.sadd(keys.QUEUES, *todo)
            for q in todo:
                self._listed[q] = now

    # -- reads ----------------------------------------------------------------------------------

    async def get(self, task_id: str) -> Task:
        tasks = await self.get_many([task_id])
        if not tasks:
            raise TaskNotFoundError(f"task {task_id} not found", task_id=task_id)
        return tasks[0]

    async def get_many(self, task_ids: Sequence[str]) -> list[Task]:
        """Tasks that still exist, in the order given, in one round trip: each task's hash (its
        payload one of the fields) and its result key.

        A hash without a payload is a task an older dtq wrote, its payload still in its old key
        (docs/redis-schema.md, "Tasks an older dtq wrote"): those alone take a second round trip
        (:meth:`_old_payloads`), so that a task written now costs no extra command.
        """
        if not task_ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for tid in task_ids:
            pipe.hgetall(keys.task(tid))
            pipe.get(keys.result(tid))
        flat = await pipe.execute()
        found = [(h, r) for h, r in zip(flat[::2], flat[1::2], strict=True) if h]
        old = [h for h, _ in found if "payload" not in h]
        if old:
            await self._old_payloads(old)
        return [Task.from_hash(h, r) for h, r in found]

    async def _old_payloads(self, hashes: Sequence[dict[str, str]]) -> None:
        """Fill in the payload of hashes read without one, in one round trip: the old key's, or
        the hash's field when a script moved the key into the hash after the first read."""
        pipe = self.redis.pipeline(transaction=False)
        for h in hashes:
            pipe.hget(keys.task(h["task_id"]), "payload")
            pipe.get(keys.payload(h["task_id"]))
        flat = await pipe.execute()
        for h, moved, old in zip(hashes, flat[::2], flat[1::2], strict=True):
            h["payload"] = moved or old or "{}"

    async def list(
        self,
        *,
        queue: str | None = None,
        status: TaskStatus | None = None,
        task_type: str | None = None,
        limit: int = 50,
    ) -> builtins.list[Task]:
        """Recent tasks first (from ``dtq:tasks:recent``; in the cluster layout, each queue's
        index, merged by submit time), filtered; at most ``limit``."""
        limit = max(1, min(limit, RECENT_CAP))
        if not keys.cluster_layout():
            scopes = [queue or ""]
        else:
            scopes = [queue] if queue is not None else await self.queues()
        found: builtins.list[tuple[float, str]] = []
        for scope in scopes:
            found += await self._recent(keys.recent(scope), queue, status, task_type, limit)
        found.sort(reverse=True)
        return await self.get_many([tid for _, tid in found[:limit]])

    async def _recent(
        self,
        index: str,
        queue: str | None,
        status: TaskStatus | None,
        task_type: str | None,
        limit: int,
    ) -> builtins.list[tuple[float, str]]:
        """The newest ``limit`` (score, task id) of the recent index ``index`` that match."""
        found: builtins.list[tuple[float, str]] = []
        start = 0
        while len(found) < limit and start < RECENT_CAP:
            page = cast(
                builtins.list[tuple[str, float]],
                await self.redis.zrevrange(index, start, start + _LIST_CHUNK - 1, withscores=True),
            )
            if not page:
                break
            start += _LIST_CHUNK
            if queue is None and status is None and task_type is None:
                found.extend((score, tid) for tid, score in page)
                continue
            pipe = self.redis.pipeline(transaction=False)
            for tid, _ in page:
                pipe.hmget(keys.task(tid), "queue", "status", "task_type")
            for (tid, score), (q, st, tt) in zip(page, await pipe.execute(), strict=True):
                if st is None:
                    continue
                if queue is not None and q != queue:
                    continue
                if status is not None and st != status.value:
                    continue
                if task_type is not None and tt != task_type:
                    continue
                found.append((score, tid))
        return found[:limit]

    async def history(self, task_id: str) -> builtins.list[HistoryEntry]:
        """Every state change of the task, oldest first."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.lrange(keys.history(task_id), 0, -1)
        pipe.exists(keys.task(task_id))
        raw, exists = await pipe.execute()
        if not raw and not exists:
            raise TaskNotFoundError(f"task {task_id} not found", task_id=task_id)
        return [HistoryEntry.from_json(r) for r in raw]

    async def queues(self) -> builtins.list[str]:
        return sorted(cast(set[str], await self.redis.smembers(keys.QUEUES)))

    async def scopes(self) -> builtins.list[str]:
        """:func:`dtq.keys.scopes` of every queue: ``[""]`` in the flat layout (no round trip),
        the queues of ``dtq:queues`` in the cluster one."""
        return keys.scopes(await self.queues()) if keys.cluster_layout() else [""]

    async def ensure_groups(self, queue: str) -> None:
        """Create the consumer group on all ten streams of ``queue`` (idempotent), and list the
        queue in ``dtq:queues``: streams a worker created are found, and removed once idle, like
        those of a submit (docs/redis-schema.md, "Queue lifetime")."""
        pipe = self.redis.pipeline(transaction=False)
        for key in keys.queue_streams(queue):
            pipe.xgroup_create(key, keys.CONSUMER_GROUP, id="0", mkstream=True)
        pipe.sadd(keys.QUEUES, queue)
        for r in await pipe.execute(raise_on_error=False):
            # A cluster pipeline gives a lost node's error as a reply: raised like the others.
            if isinstance(r, Exception) and "BUSYGROUP" not in str(r):
                raise r


def _new_task(req: SubmitRequest, task_id: str, reply: SubmitReply, settings: Settings) -> Task:
    status, now_ms, due_ms, exp_ms = reply.status, reply.now_ms, reply.due_ms, reply.expires_at_ms
    created = ms_to_dt(now_ms)
    # A copy of the template with the fields a submit decides: half the cost of
    # model_construct over all 29 fields, and the same model (every field set).
    return _NEW_TASK.model_copy(
        update={
            "task_id": task_id,
            "idempotency_key": req.idempotency_key,
            "task_type": req.task_type,
            "payload": req.payload,
            "created_at": created,
            "available_at": created if due_ms == now_ms else ms_to_dt(due_ms),
            "updated_at": created,
            "max_attempts": req.max_attempts,
            "priority": req.priority,
            "timeout_ms": req.timeout_ms or settings.task_timeout_ms,
            "status": TaskStatus(status),
            "queue": req.queue,
            "metadata": {} if req.metadata_json == "{}" else json.loads(req.metadata_json),
            "expires_at": None if exp_ms is None else ms_to_dt(exp_ms),
            "expired_at": created if status == TaskStatus.EXPIRED else None,
            "entry_id": reply.entry_id or None,
        }
    )


_EPOCH = datetime.fromtimestamp(0, tz=UTC)
_NEW_TASK = Task.model_construct(
    task_id="",
    idempotency_key=None,
    task_type="",
    payload={},
    created_at=_EPOCH,
    available_at=_EPOCH,
    updated_at=_EPOCH,
    attempt=0,
    max_attempts=1,
    priority=0,
    timeout_ms=1,
    status=TaskStatus.QUEUED,
    queue="",
    metadata={},
    expires_at=None,
    expired_at=None,
    entry_id=None,
    cancel_requested=False,
    started_at=None,
    finished_at=None,
    duration_ms=None,
    worker_id=None,
    error_class=None,
    error_message=None,
    retryable=None,
    retry_delay_ms=None,
    result=None,
    result_truncated=False,
    duplicate=False,
)
"""A task just submitted, before the fields of its submission (see :func:`_new_task`)."""


def _unconfirmed(
    req: SubmitRequest, outcome: _Outcome, submitted: calls.Submitted, settings: Settings
) -> _Outcome:
    """``outcome`` of a batch that fewer than DTQ_SUBMIT_MIN_REPLICAS replicas confirmed: an
    answer that says a task exists (a new task, a replay, a replay of a task in progress)
    becomes ReplicationTimeoutError naming it; refusals and errors stay as they are."""
    if isinstance(outcome, Task):
        task_id, duplicate, task = outcome.task_id, outcome.duplicate, outcome
    elif isinstance(outcome, IdempotencyInProgressError):
        task_id, duplicate, task = str(outcome.details["task_id"]), True, None
    else:
        return outcome
    wanted, acked = settings.submit_min_replicas, submitted.replicas or 0
    why = submitted.wait_error or (
        f"{acked} of {wanted} replica(s) confirmed it within "
        f"{settings.submit_replica_timeout_ms} ms"
    )
    what = "replay of an existing task" if duplicate else "new task"
    retry = (
        "a retry with the same idempotency key is safe"
        if req.idempotency_key
        else "it has no idempotency key: a retry submits a second task"
    )
    return ReplicationTimeoutError(
        f"task {task_id} ({what}) is on the Redis primary but not confirmed by its replicas: "
        f"{why}; it is not rolled back and may run; {retry}",
        task_id=task_id,
        duplicate=duplicate,
        task=task,
        replicas=acked,
        min_replicas=wanted,
    )


def _submit_error(req: SubmitRequest, reply: SubmitReply) -> DtqError:
    code, detail = reply.code, reply.detail
    if code == "QUEUE_FULL":
        return QueueFullError(
            f"queue {req.queue!r} is full ({detail} tasks waiting or running)",
            retry_after_s=1,
            queue=req.queue,
            depth=int(detail),
        )
    if code == "IDEMPOTENCY_IN_PROGRESS":
        return IdempotencyInProgressError(
            f"a task with idempotency key {req.idempotency_key!r} on queue {req.queue!r} "
            f"is still in progress ({detail})",
            task_id=detail,
        )
    return DtqError(f"submit refused: {code} {detail}")
