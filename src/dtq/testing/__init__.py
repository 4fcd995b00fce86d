"""Testing your handlers and producers against a real dtq (docs/testing.md).

A pytest plugin you opt into from the ``conftest.py`` at the top of your suite::

    pytest_plugins = ["dtq.testing"]

It gives the fixtures ``dtq_redis_url`` (a private redis-server per session, started by
:mod:`dtq.devserver`), ``dtq_settings`` (short intervals and retry delays) and ``dtq_queue``
(a connected :class:`dtq.Queue`, its database emptied before each test). Then
``await drain(dtq_queue, queues=[...])`` runs the real worker, with your ``@task`` handlers
and the production scripts, until those queues are drained, and returns a
:class:`DrainResult`; ``async with running_worker(dtq_queue): ...`` keeps one running for a
block (a producer that waits on its tasks).
"""

from dtq.testing.drain import (
    DEFAULT_TIMEOUT_S,
    DrainResult,
    DrainTimeout,
    TaskFailures,
    drain,
    running_worker,
)
from dtq.testing.plugin import FAST_SETTINGS, dtq_queue, dtq_redis_url, dtq_settings

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "FAST_SETTINGS",
    "DrainResult",
    "DrainTimeout",
    "TaskFailures",
    "drain",
    "dtq_queue",
    "dtq_redis_url",
    "dtq_settings",
    "running_worker",
]
