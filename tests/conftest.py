"""Real-Redis fixtures (DESIGN 8): one private redis-server per test session, a clean database
per test. DTQ_REDIS_SERVER picks the binary (redis, valkey, system or a path: dtq.devserver), for
this server and every other one a test starts. Set DTQ_TEST_REDIS_URL to use a server you started
instead (it will be flushed). A test that asks for ``cluster_url`` gets a private 3-primary Redis
Cluster instead (dtq.devcluster), started once per session, flushed per test.

A module opts in to both backends with ``pytestmark = pytest.mark.backends("single",
"cluster")``: each of its tests runs once per backend (ids ``[single]`` and ``[cluster]``), and
``redis_url``, ``settings``, ``r`` and ``queue`` follow the one chosen (``backend``). On
``cluster`` the URL is the cluster's, ``settings.redis_cluster`` is set, ``r`` is an initialized
:class:`redis.asyncio.RedisCluster`, and the process uses the cluster key layout for the test
(flat again after it). A test of such a module that holds on one backend only says why:
``@pytest.mark.backends("single", reason="...")``. Every other module runs on ``single``.
``DTQ_TEST_BACKENDS=single`` (comma separated) keeps a run to the backends it names."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from redis.asyncio import Redis, RedisCluster

from dtq import Queue, connect, keys
from dtq.config import Settings
from dtq.devcluster import DevCluster, start_cluster
from dtq.devsentinel import DevSentinel, start_sentinel_group
from dtq.devserver import SERVER_ENV, RedisServer, find_redis_server, start_redis
from dtq.errors import ConfigError

# The chaos seed and figures: run-wide, so in the process that starts the run (also xdist's).
pytest_plugins = ("support.chaos_run",)

BACKENDS = ("single", "cluster")


def pytest_configure(config: pytest.Config) -> None:
    config.stash[FIGURES] = []
    config.addinivalue_line(
        "markers",
        "backends(*names, reason=None): the Redis backends (single, cluster) a test runs on; "
        "a reason is required where a test of a two-backend module runs on one",
    )


def pytest_report_header() -> str:
    """Which server binary this run starts (``make test`` runs on two)."""
    try:
        binary = find_redis_server()
    except ConfigError as exc:
        binary = f"none ({exc})"
    return f"server: {SERVER_ENV}={os.environ.get(SERVER_ENV, '') or 'auto'}: {binary}"


FIGURES = pytest.StashKey[list[str]]()


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


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run each test of a ``backends`` module once per backend its closest marker names."""
    if "backend" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("backends")
    if marker is None:
        return
    names = tuple(marker.args)
    unknown = set(names) - set(BACKENDS)
    if not names or unknown:
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: backends {names} not in {BACKENDS}")
    own = marker in metafunc.definition.own_markers  # a test's exception to its module's
    if own and set(names) != set(BACKENDS) and not marker.kwargs.get("reason"):
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: say why it runs on {names} only")
    chosen = os.environ.get("DTQ_TEST_BACKENDS")
    if chosen:
        names = tuple(name for name in names if name in chosen.split(","))
    metafunc.parametrize("backend", names, indirect=True)


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """``single`` or ``cluster`` (a ``backends`` module's parameter); the key layout follows it
    for the test, and is the flat one again after it."""
    chosen: str = getattr(request, "param", "single")
    keys.use_layout(chosen == "cluster")
    try:
        yield chosen
    finally:
        keys.use_layout(False)


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
def redis_url(request: pytest.FixtureRequest, backend: str) -> str:
    """The URL of the test's backend, emptied: the single server's, or the cluster's."""
    if backend == "cluster":
        cluster: DevCluster = request.getfixturevalue("redis_cluster")
        cluster.flushall()
        return cluster.url
    import redis as sync_redis

    server: str = request.getfixturevalue("redis_server")
    client = sync_redis.Redis.from_url(server)
    client.flushall()
    client.close()
    return server


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
def settings(redis_url: str, backend: str) -> Settings:
    return Settings(redis_url=redis_url, redis_cluster=backend == "cluster")


@pytest.fixture
async def r(redis_url: str, backend: str) -> AsyncIterator[Redis]:
    """A client on the test's backend (typed as the :class:`Redis` whose commands a
    :class:`RedisCluster` shares, as :func:`dtq.connection.async_client` does)."""
    if backend == "cluster":
        cluster = RedisCluster.from_url(redis_url, decode_responses=True)
        await cluster.initialize()
        yield cast(Redis, cluster)
        await cluster.aclose()
        return
    client = Redis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
async def queue(settings: Settings) -> AsyncIterator[Queue]:
    q = await connect(settings=settings)
    yield q
    await q.close()
