"""Real-Redis fixtures (DESIGN 8): one private redis-server per test session, a clean database
per test. DTQ_REDIS_SERVER picks the binary (redis, valkey, system or a path: dtq.devserver), for
this server and every other one a test starts. Set DTQ_TEST_REDIS_URL to use a server you started
instead (it will be flushed). A test that asks for ``cluster_url`` gets a private 3-primary Redis
Cluster instead (dtq.devcluster), started once per session, flushed per test."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from dtq import Queue, connect, keys
from dtq.config import Settings
from dtq.devcluster import DevCluster, start_cluster
from dtq.devsentinel import DevSentinel, start_sentinel_group
from dtq.devserver import SERVER_ENV, RedisServer, find_redis_server, start_redis
from dtq.errors import ConfigError


def pytest_report_header() -> str:
    """Which server binary this run starts (``make test`` runs on two)."""
    try:
        binary = find_redis_server()
    except ConfigError as exc:
        binary = f"none ({exc})"
    return f"server: {SERVER_ENV}={os.environ.get(SERVER_ENV, '') or 'auto'}: {binary}"


FIGURES = pytest.StashKey[list[str]]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[FIGURES] = []


@pytest.fixture
def report_figure(pytestconfig: pytest.Config) -> Callable[[str], None]:
    """``report_figure(line)``: a measured figure (an outage, a count), printed in the run's
    terminal summary whether or not the test passes."""
    return pytestconfig.stash[FIGURES].append


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    lines = config.stash.get(FIGURES, [])
    if lines:
        terminalreporter.section("figures")
        for line in lines:
            terminalreporter.write_line(line)


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


@pytest.fixture(scope="session")
def sentinel_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevSentinel]:
    """A primary, its replica and three sentinels (dtq.devsentinel), started once per session
    from DTQ_REDIS_SERVER's binary, slow to fail over (a loaded machine's pause must not move
    its primary). A test that kills its primary starts a group of its own."""
    base = Path(tmp_path_factory.mktemp("sentinel"))
    with start_sentinel_group(base, down_after_ms=10_000) as group:
        yield group


@pytest.fixture
def redis_url(redis_server: str) -> str:
    import redis as sync_redis

    client = sync_redis.Redis.from_url(redis_server)
    client.flushall()
    client.close()
    return redis_server


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    """3 primaries with a replica each; a test that kills a node starts a cluster of its own."""
    with start_cluster(Path(tmp_path_factory.mktemp("cluster"))) as cluster:
        yield cluster


@pytest.fixture
def cluster_url(redis_cluster: DevCluster) -> Iterator[str]:
    redis_cluster.flushall()
    yield redis_cluster.url
    keys.use_layout(False)  # a client on it chose the cluster layout: the next test is flat


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
