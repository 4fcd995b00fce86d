"""Prometheus metrics: every metric of contract section 9, the expiration metrics
(docs/expiration.md), and the gauges read from Redis at scrape time.

One :class:`Metrics` per process holds every family in its own registry (nothing is created at
import). Who counts what, each where the thing happens (``docs/operations.md`` has the table):

- the API: ``dtq_tasks_submitted_total``, ``dtq_task_ttl_seconds``, ``dtq_ingest_rejected_total``,
  a task expired at submit (ttl 0) and the cancels and expirations it performs;
- workers, through lifecycle hooks (:mod:`dtq.worker.telemetry`): starts, attempts, outcomes,
  latencies, retries scheduled, in-flight, start-time expirations;
- the scheduler leader (in a worker): retries promoted (``dtq_tasks_retried_total``) and tasks
  expired by the sweep or at promotion;
- both: ``dtq_redis_operations_total`` for script calls (``script:<name>``, a worker's reads are
  ``script:read``) and single commands (``xreadgroup``, ``xautoclaim``, ...).

Labels are only ``queue``, ``task_type``, ``status``, ``result``, ``worker_id``, ``operation``,
``reason`` and ``limit`` (a limit's name, :data:`LABEL_NAMES`); never a task id, payload,
exception text or a limit's key value. A queue or
task type that is not a valid name, or a task type this process does not know, is counted as
``(other)``, so label values stay a small, known set.

:class:`RedisGauges` (the API's ``/metrics``) reads queue depth and pending, the retry schedule,
the DLQ, workers and near-expiration in one pipelined round trip per scrape, and the use of
each declared limit (:mod:`dtq.metrics.limit_gauges`); see its docstring.
"""

from dtq.metrics.redis_gauges import OpHook, RedisGauges
from dtq.metrics.registry import (
    ATTEMPT_RESULTS,
    COMPLETED_STATUSES,
    LABEL_NAMES,
    OTHER,
    REJECT_REASONS,
    UNKNOWN,
    Metrics,
    MetricsServer,
    count_commands,
)

__all__ = [
    "ATTEMPT_RESULTS",
    "COMPLETED_STATUSES",
    "LABEL_NAMES",
    "OTHER",
    "REJECT_REASONS",
    "UNKNOWN",
    "Metrics",
    "MetricsServer",
    "OpHook",
    "RedisGauges",
    "count_commands",
]
