"""Operator operations and what an operator reads (contract sections 11, 12, 13; DESIGN 10).

State changes are one Lua script each (cancel, expire, dlq_requeue, dlq_discard, set_paused) or
a run of bounded chunks of one script (dlq_purge, purge_queue: at most ``CHUNK`` tasks per
call, so no script runs long), called through :mod:`dtq.calls`. These functions read what a
script needs (a task's queue, priority and idempotency key decide its stream and record; the
metadata a compare-and-set expects) and map the replies to dtq errors.

``audit``: given an :class:`Audit`, the same script that makes the change appends
``{actor, action, task_id, queue, ts, request_id}`` to ``dtq:stream:audit`` (MAXLEN ~ 10000),
so the change and its audit entry are one atomic step. Without one nothing is audited (the
scheduler's expiry sweep, internal callers).

Modules: ``tasks`` (cancel, expire, sweep), ``dlq`` (dead letters), ``queues`` (pause, resume,
purge), ``reads`` (statistics, workers, audit log). ``docs/operations-admin.md`` describes each
operation in Redis terms and which values are exact.
"""

from dtq.admin._common import CHUNK, SWEEP_BATCH
from dtq.admin.dlq import dlq_discard, dlq_get, dlq_list, dlq_purge, dlq_requeue
from dtq.admin.queues import purge_queue, set_paused
from dtq.admin.reads import all_queue_stats, audit_log, queue_stats, worker, workers
from dtq.admin.tasks import Swept, cancel, expire, sweep_due, task_keys

__all__ = [
    "CHUNK",
    "SWEEP_BATCH",
    "Swept",
    "all_queue_stats",
    "audit_log",
    "cancel",
    "dlq_discard",
    "dlq_get",
    "dlq_list",
    "dlq_purge",
    "dlq_requeue",
    "expire",
    "purge_queue",
    "queue_stats",
    "set_paused",
    "sweep_due",
    "task_keys",
    "worker",
    "workers",
]
