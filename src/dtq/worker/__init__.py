"""The dtq worker: :func:`run_worker` (``main.py``: what ``dtq worker run`` calls, and
``python -m dtq.worker`` through it) and :class:`Worker`, the engine.

One task's path, file by file; each step calls only the next ones, and every script goes
through :mod:`dtq.calls`:

1. ``worker.py`` (:class:`Worker`): the loops (poll, reaper, cancel watcher, finisher,
   scheduler, heartbeat) and the ordered shutdown;
2. ``intake.py``: entries come in: read.lua for the poll loops, ``XAUTOCLAIM`` for the reaper,
   ``adopt.lua`` for a dead process's entries, each read within slots reserved from the executor;
3. ``execution.py`` (:class:`~dtq.worker.execution.Executor`): the slots, start.lua for each
   read batch, one asyncio task per started entry, cancel requests and lost leases;
4. ``handlers.py`` (:class:`~dtq.worker.handlers.Runner`): the run of one entry: what its
   handler gets (payload, TaskContext), the lease check right before it, the handler under
   its timeout (a sync one on a thread), how it ended as an outcome;
5. ``finish.py`` (:class:`~dtq.worker.finish.Finisher`): finish.lua in one pipeline per
   event-loop tick, the replies, the counts and the end events.

Beside the path: ``heartbeat.py`` (its own thread: touch.lua and the worker hash),
``scheduler.py``, ``consumers.py`` and ``idle_queues.py`` (the leader's promotions, expiry
sweep, stale workers, idle consumers and idle queues), ``observer.py`` (the lifecycle events
and their hooks), ``telemetry.py`` (metrics and logs as observers), ``outage.py`` (the one
"Redis unavailable" reporter), ``supervisor.py`` (``--processes``), ``connection.py`` (the
Redis client), ``threads.py`` (the threads of sync handlers, and their interrupts).
"""

from dtq.worker.main import run_worker
from dtq.worker.observer import WorkerObserver
from dtq.worker.worker import Worker, new_worker_id

__all__ = ["Worker", "WorkerObserver", "new_worker_id", "run_worker"]
