"""Real-Redis fixtures (DESIGN 8): one private redis-server per test session, a clean database
per test. DTQ_REDIS_SERVER picks the binary (redis, valkey, system or a path: dtq.devserver), for
this server and every other one a test starts. Set DTQ_TEST_REDIS_URL to use a server you started
instead (it will be flushed)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from dtq import Queue, connect
from dtq.config import Settings
from dtq.devserver import SERVER_ENV, RedisServer, find_redis_server, start_redis
from dtq.errors import ConfigError

# The chaos seed and figures: run-wide, so in the process that starts the run (also xdist's).
pytest_plugins = ("support.chaos_run",)


def pytest_report_header() -> str:
    """Which server binary this run starts (``make test`` runs on two)."""
    try:
        binary = find_redis_server()
    except ConfigError as exc:
        binary = f"none ({exc})"
    return f"server: {SERVER_ENV}={os.environ.get(SERVER_ENV, '') or 'auto'}: {binary}"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = os.environ.get("DTQ_TEST_REDIS_URL")
    if url:
        yield url
        return
    server: RedisServer = start_redis(Path(tmp_path_factory.mktemp("redis")))
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: str) -> str:
    import redis as sync_redis

    client = sync_redis.Redis.from_url(redis_server)
    client.flushall()
    client.close()
    return redis_server


@pytest.fixture
def settings(redis_url: str) -> Settings:
    return Settings(redis_url=redis_url)


@pytest.fixture
async def r(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
async def queue(settings: Settings) -> AsyncIterator[Queue]:
    q = await connect(settings=settings)
    yield q
    await q.close()
