"""Run the real worker in a test's event loop: :func:`drain` until queues are drained, and
:func:`running_worker` for a block (docs/testing.md).

What "drained" means, at one instant (one pipeline):

- the queues' ten streams hold no entry: nothing waits and nothing runs (an entry leaves its
  stream only when finish.lua records how it ended);
- no task of the queues is being promoted by the scheduler (``dtq:retry:claimed``);
- no delayed or retrying task of the queues is due by the *horizon*: the drain's deadline with
  ``wait_scheduled=True`` (the default: retries with backoff and short delays run to their
  end within the timeout), the Redis clock's now with ``wait_scheduled=False`` (a retry or
  delay not yet due is left alone). Tasks due after the horizon are left, PENDING or
  RETRYING, and listed in :attr:`DrainResult.scheduled`.

The worker is :class:`dtq.worker.Worker` itself, on the same scripts as in production; the
only addition is that each handler is wrapped to keep the exceptions it raised
(:attr:`DrainResult.errors`), which it raises again unchanged. A drain does not create the
schedules declared in code (``@task(..., schedule=...)``): a test that wants a firing calls
``q.trigger_schedule``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

from redis.asyncio import Redis
from redis.exceptions import RedisError

from dtq import keys
from dtq.client import Queue
from dtq.models import Task, TaskStatus, check_queue_name
from dtq.records import DEPTH_READS, queue_depth, read_depth
from dtq.worker import Worker, WorkerObserver, new_worker_id
from dtq.worker.connection import worker_redis
from dtq.worker.observer import TaskFinished, TaskSkipped, TaskStarted
from dtq_tasks import Handler, RescheduleError, TaskContext, registry

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DrainResult",
    "DrainTimeout",
    "TaskFailures",
    "drain",
    "running_worker",
]

DEFAULT_TIMEOUT_S = 10.0
CHECK_EVERY_S = 0.025  # how often drain() looks at the queues
UNBLOCK_EVERY_S = 0.02  # a stopping worker's blocking reads are ended this often
START_TIMEOUT_S = 15.0  # a worker that has not started by then is a broken setup
FAILED = frozenset({TaskStatus.FAILED, TaskStatus.DEAD_LETTERED})


@dataclass(frozen=True)
class DrainResult:
    """What a drain did.

    ``tasks``: every task the worker started or consumed (run, skipped as cancelled or
    expired at start), in the order first seen, as read once the worker had stopped.
    ``scheduled``: the queues' delayed or retrying tasks left because they are due after the
    horizon (see the module docstring). ``errors``: the exceptions each task's handler raised,
    by task id, one per failed attempt, with their tracebacks.
    """

    tasks: tuple[Task, ...] = ()
    scheduled: tuple[Task, ...] = ()
    errors: Mapping[str, tuple[BaseException, ...]] = field(default_factory=dict)

    @property
    def counts(self) -> dict[str, int]:
        """Tasks by status (``{"succeeded": 3, "dead_lettered": 1}``); absent statuses omitted."""
        return dict(Counter(t.status.value for t in self.tasks))

    @property
    def succeeded(self) -> list[Task]:
        return [t for t in self.tasks if t.status is TaskStatus.SUCCEEDED]

    @property
    def failed(self) -> list[Task]:
        """The tasks that ended failed or dead-lettered (their ``error_class`` and
        ``error_message`` say why; :attr:`errors` has the exceptions themselves)."""
        return [t for t in self.tasks if t.status in FAILED]

    def task(self, task_id: str) -> Task:
        """The task ``task_id`` as this drain left it; KeyError if the drain did not see it."""
        for t in (*self.tasks, *self.scheduled):
            if t.task_id == task_id:
                return t
        raise KeyError(task_id)

    def raise_failures(self) -> None:
        """Raise :class:`TaskFailures` if any task ended failed or dead-lettered, chained to
        the last exception the first one's handler raised (pytest shows its traceback)."""
        failed = self.failed
        if not failed:
            return
        first = self.errors.get(failed[0].task_id, ())
        raise TaskFailures(failed) from (first[-1] if first else None)


class TaskFailures(AssertionError):
    """:meth:`DrainResult.raise_failures`: tasks ended failed or dead-lettered (``tasks``)."""

    def __init__(self, tasks: Sequence[Task]) -> None:
        self.tasks = list(tasks)
        lines = [
            f"  {t.task_id} {t.task_type}: {t.status.value} after attempt {t.attempt}: "
            f"{t.error_class}: {t.error_message}"
            for t in self.tasks
        ]
        super().__init__(f"{len(self.tasks)} task(s) failed:\n" + "\n".join(lines))


class DrainTimeout(AssertionError):
    """The queues were not drained within the timeout: ``left`` says what remained (streams,
    claimed or due tasks), ``result`` what the drain did until then."""

    def __init__(self, timeout_s: float, left: Sequence[str], result: DrainResult) -> None:
        self.timeout_s = timeout_s
        self.left = list(left)
        self.result = result
        super().__init__(
            f"queues not drained within {timeout_s:g} s: {'; '.join(self.left)} "
            f"(done so far: {result.counts or 'nothing'})"
        )


async def drain(
    q: Queue,
    queues: Iterable[str] = ("default",),
    *,
    timeout: float = DEFAULT_TIMEOUT_S,  # noqa: ASYNC109 - a deadline for several awaits, like q.wait's
    wait_scheduled: bool = True,
    handlers: Mapping[str, Handler] | None = None,
    concurrency: int | None = None,
    raise_failures: bool = False,
) -> DrainResult:
    """Run a :class:`dtq.worker.Worker` on ``queues`` (with ``q``'s settings) until they are
    drained (module docstring), stop it, and return what it did.

    ``handlers``: by default every handler registered with ``@task`` (import the task modules
    first). ``timeout`` (seconds) bounds the whole drain: when it passes, the worker is stopped
    without waiting for what runs, and :class:`DrainTimeout` is raised. ``raise_failures``:
    raise :class:`TaskFailures` if a task ended failed or dead-lettered
    (:meth:`DrainResult.raise_failures`).
    """
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0, not {timeout!r}")
    served = _queue_names(queues)
    deadline = time.monotonic() + timeout
    seen = _Seen()
    errors = _Errors()
    worker = _worker(q, served, handlers, concurrency, seen, errors)
    left: list[str] = []
    later: list[str] = []
    async with _running(worker, force_stop=lambda: bool(left)):
        while True:
            remaining_ms = max(0, round((deadline - time.monotonic()) * 1000))
            left, later = await _left(q, served, remaining_ms if wait_scheduled else 0)
            if not left or remaining_ms == 0:
                break
            await asyncio.sleep(CHECK_EVERY_S)
    result = DrainResult(
        tasks=tuple(await q.store.get_many(list(seen.ids))),
        scheduled=tuple(await q.store.get_many(later)),
        errors=errors.snapshot(),
    )
    if left:
        raise DrainTimeout(timeout, left, result)
    if raise_failures:
        result.raise_failures()
    return result


@contextlib.asynccontextmanager
async def running_worker(
    q: Queue,
    queues: Iterable[str] = ("default",),
    *,
    handlers: Mapping[str, Handler] | None = None,
    concurrency: int | None = None,
) -> AsyncIterator[Worker]:
    """A :class:`dtq.worker.Worker` on ``queues`` running for the block, in this event loop
    (for a producer test that waits on its tasks: ``q.result`` inside the block). It has
    started when the block begins; it is stopped at its end, after what runs has finished."""
    worker = _worker(q, _queue_names(queues), handlers, concurrency, None, None)
    async with _running(worker):
        yield worker


def _queue_names(queues: Iterable[str]) -> list[str]:
    """The queue names, checked, without repeats; a bare string is refused (it would be read
    as one queue per character)."""
    if isinstance(queues, str):
        raise TypeError(f"queues is a list of queue names: queues=[{queues!r}]")
    names = [check_queue_name(name) for name in dict.fromkeys(queues)]
    if not names:
        raise ValueError("no queue given")
    return names


def _worker(
    q: Queue,
    queues: Sequence[str],
    handlers: Mapping[str, Handler] | None,
    concurrency: int | None,
    seen: _Seen | None,
    errors: _Errors | None,
) -> Worker:
    """The worker of a drain or a block: the production client, its connections named after
    the worker (CLIENT SETNAME at connect) so that its stop can unblock them (:func:`_stopped`)."""
    chosen = dict(registry() if handlers is None else handlers)
    if errors is not None:
        chosen = {name: errors.wrap(h) for name, h in chosen.items()}
    worker_id = new_worker_id()
    redis = worker_redis(q.settings)
    pool = getattr(redis, "connection_pool", None)  # a cluster client has one per node
    if pool is not None:
        pool.connection_kwargs["client_name"] = _client_name(worker_id)
    return Worker(
        q.settings,
        queues=queues,
        concurrency=concurrency,
        handlers=chosen,
        worker_id=worker_id,
        observers=() if seen is None else (seen,),
        redis=redis,
        schedules={},
    )


@contextlib.asynccontextmanager
async def _running(
    worker: Worker, *, force_stop: Callable[[], bool] = lambda: False
) -> AsyncIterator[None]:
    """``worker`` runs for the block: its start awaited (what stopped it first is raised), and
    always stopped at the end, drained, or at once when ``force_stop()`` says so."""
    run = asyncio.create_task(worker.run(), name=f"dtq-testing-{worker.worker_id}")
    starting = asyncio.create_task(worker.started.wait())
    await asyncio.wait({run, starting}, timeout=START_TIMEOUT_S, return_when="FIRST_COMPLETED")
    starting.cancel()
    try:
        if run.done():
            run.result()  # raises what stopped it
        if not worker.started.is_set():
            raise RuntimeError(f"the dtq worker did not start within {START_TIMEOUT_S:g} s")
        yield
    finally:
        worker.stop()
        if force_stop():
            worker.stop()  # a second stop skips the drain of what still runs
        await _stopped(worker, run)


async def _stopped(worker: Worker, run: asyncio.Task[None]) -> None:
    """Wait for a stopping ``worker``'s run, and meanwhile end its blocking reads at once
    (``CLIENT UNBLOCK``: a read returns as if it had timed out, delivering nothing) instead of
    letting each wait out its block: a drain stops in milliseconds. Only the connections named
    after this worker are unblocked (:func:`_worker`); on a cluster the reads time out.

    The unblocking goes through a client of its own, closed here: the worker closes its own
    client as it stops, and a command sent on it after that opened a connection nobody closed."""
    name = _client_name(worker.worker_id)
    unblocker: Redis | None = None
    try:
        while True:
            done, _ = await asyncio.wait({run}, timeout=UNBLOCK_EVERY_S)
            if done:
                return run.result()
            if keys.cluster_layout():
                continue
            if unblocker is None:
                unblocker = worker_redis(worker.settings)
            with contextlib.suppress(RedisError):
                for client in await unblocker.client_list(_type="normal"):
                    if client.get("name") == name and "b" in client.get("flags", ""):
                        await unblocker.client_unblock(int(client["id"]))
    finally:
        if unblocker is not None:
            await unblocker.aclose()


def _client_name(worker_id: str) -> str:
    return f"dtq-testing:{worker_id}"


class _Seen(WorkerObserver):
    """The ids of the tasks a worker started or consumed, in the order first seen."""

    def __init__(self) -> None:
        self.ids: dict[str, None] = {}

    def task_started(self, event: TaskStarted) -> None:
        self.ids.setdefault(event.task_id)

    def task_skipped(self, event: TaskSkipped) -> None:
        self.ids.setdefault(event.task_id)

    def task_finished(self, event: TaskFinished) -> None:
        self.ids.setdefault(event.task_id)


class _Errors:
    """The exceptions handlers raised, by task id (sync handlers run on threads: a lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_task: dict[str, list[BaseException]] = {}

    def record(self, task_id: str, exc: BaseException) -> None:
        with self._lock:
            self._by_task.setdefault(task_id, []).append(exc)

    def snapshot(self) -> dict[str, tuple[BaseException, ...]]:
        with self._lock:
            return {tid: tuple(excs) for tid, excs in self._by_task.items()}

    def wrap(self, handler: Handler) -> Handler:
        """``handler`` with a function that records what it raises (a RescheduleError is no
        failure) and raises it again; async stays async, sync stays sync."""
        fn = handler.fn
        record = self.record
        if handler.is_async:

            async def run_async(payload: dict[str, Any], ctx: TaskContext) -> Any:
                try:
                    return await cast(Callable[..., Awaitable[Any]], fn)(payload, ctx)
                except RescheduleError:
                    raise
                except Exception as exc:
                    record(ctx.task_id, exc)
                    raise

            return replace(handler, fn=run_async)

        def run_sync(payload: dict[str, Any], ctx: TaskContext) -> Any:
            try:
                return fn(payload, ctx)
            except RescheduleError:
                raise
            except Exception as exc:
                record(ctx.task_id, exc)
                raise

        return replace(handler, fn=run_sync)


async def _left(q: Queue, queues: Sequence[str], horizon_ms: int) -> tuple[list[str], list[str]]:
    """What keeps ``queues`` from being drained (empty: drained), and the ids of their tasks
    scheduled after now + ``horizon_ms`` (Redis clock), read in one pipeline (and one more for
    the queues of scheduled tasks, whose set the flat key layout shares between queues)."""
    redis = q.store.redis
    pipe = redis.pipeline(transaction=False)
    for name in queues:
        read_depth(pipe, name)
        pipe.exists(keys.queue_paused(name))
    sets = list(dict.fromkeys((keys.retry_schedule(n), keys.retry_claimed(n)) for n in queues))
    for schedule, claimed in sets:
        pipe.zrange(schedule, 0, -1, withscores=True)
        pipe.zrange(claimed, 0, -1)
    pipe.execute_command("TIME")
    replies = await pipe.execute(raise_on_error=False)
    left: list[str] = []
    at = 0
    for name in queues:
        depth, pending = queue_depth(replies[at : at + DEPTH_READS])
        paused = bool(replies[at + DEPTH_READS])
        at += DEPTH_READS + 1
        if depth:
            running = f"{pending} running, " if pending else ""
            left.append(
                f"queue {name}: {running}{depth - pending} waiting"
                + (" (paused)" if paused else "")
            )
    due: dict[str, float] = {}
    claimed_ids: set[str] = set()
    for _ in sets:
        for member, score in replies[at]:
            due[str(member)] = float(score)
        claimed_ids.update(str(m) for m in replies[at + 1])
        at += 2
    seconds, micros = replies[at]
    horizon = int(seconds) * 1000 + int(micros) // 1000 + horizon_ms
    ids = [*due, *(c for c in claimed_ids if c not in due)]
    later: list[str] = []
    if ids:
        pipe = redis.pipeline(transaction=False)
        for tid in ids:
            pipe.hget(keys.task(tid), "queue")
        owners = dict(zip(ids, await pipe.execute(), strict=True))
        ours = {tid for tid, owner in owners.items() if owner in queues}
        being_promoted = sorted(ours & claimed_ids)
        due_now = sorted(t for t in ours - claimed_ids if due[t] <= horizon)
        later = [t for t in sorted(ours - claimed_ids, key=due.__getitem__) if due[t] > horizon]
        if being_promoted:
            left.append(f"{len(being_promoted)} task(s) being promoted by the scheduler")
        if due_now:
            left.append(f"{len(due_now)} delayed or retrying task(s) due: {', '.join(due_now)}")
    return left, later
