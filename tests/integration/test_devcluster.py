"""dtq.devcluster forms a 3-primary Redis Cluster from the server binary DTQ_REDIS_SERVER picks,
redis-py's cluster client uses it, and a killed primary's replica takes over."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
import redis
from redis.asyncio.cluster import RedisCluster

from dtq.devcluster import DevCluster, start_cluster
from dtq.errors import ConfigError
from support.waiting import wait_until

CLUSTER_SLOTS = 16384


def _client(port: int) -> redis.Redis:
    return redis.Redis(port=port, decode_responses=True)


def _processes_under(folder: Path) -> list[int]:
    """PIDs of the live processes working in ``folder`` (a server chdirs to its --dir; its
    command line is rewritten to its address, so that cannot tell)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            cwd = os.readlink(entry / "cwd") if entry.name.isdigit() else ""
            state = (entry / "stat").read_text().split()[2] if cwd else ""
        except OSError:
            continue
        if cwd.startswith(str(folder)) and state != "Z":
            pids.append(int(entry.name))
    return pids


def test_the_cluster_forms(redis_cluster: DevCluster) -> None:
    primaries, replicas = redis_cluster.primaries(), redis_cluster.replicas()
    assert len(primaries) == 3 and len(replicas) == 3
    primary_ports = {node.port for node in primaries}
    assert {node.primary_port for node in replicas} == primary_ports
    assert all(os.path.exists(f"/proc/{node.pid}") for node in redis_cluster.nodes)
    assert redis_cluster.url in {node.url for node in primaries}

    for node in redis_cluster.nodes:
        with _client(node.port) as client:
            info = client.execute_command("CLUSTER", "INFO")
            slots = client.execute_command("CLUSTER", "SLOTS")
            role = client.execute_command("ROLE")
        assert "cluster_state:ok" in info and "cluster_known_nodes:6" in info
        # Every slot once, on one of the three primaries, in every node's view.
        covered = sorted((int(first), int(last)) for first, last, *_ in slots)
        assert sum(last - first + 1 for first, last in covered) == CLUSTER_SLOTS
        assert covered[0][0] == 0 and covered[-1][1] == CLUSTER_SLOTS - 1
        assert {int(r[2][1]) for r in slots} == primary_ports
        if node.role == "primary":
            # Its one replica is attached.
            assert [int(r[1]) for r in role[2]] == [
                n.port for n in replicas if n.primary_port == node.port
            ]


def _dbsize(port: int) -> int:
    with _client(port) as client:
        return int(client.dbsize())


async def test_the_cluster_client_writes_and_reads_many_slots(
    redis_cluster: DevCluster, cluster_url: str
) -> None:
    rc = RedisCluster.from_url(cluster_url, decode_responses=True)
    try:
        keys = [f"key:{i}" for i in range(300)]
        for key in keys:
            await rc.set(key, key.upper())
        assert [await rc.get(key) for key in keys] == [key.upper() for key in keys]
        assert len({rc.keyslot(key) for key in keys}) == len(keys)
    finally:
        await rc.aclose()

    # Spread over every primary, and nowhere else: the fixture flushed what came before.
    sizes = {node.port: _dbsize(node.port) for node in redis_cluster.primaries()}
    assert sum(sizes.values()) == len(keys) and min(sizes.values()) > 50

    # flushall empties every primary, and the replicas follow.
    redis_cluster.flushall()

    async def all_empty() -> bool:
        return not any(_dbsize(node.port) for node in redis_cluster.nodes)

    await wait_until(all_empty, 5, "every node empty after flushall")


async def test_a_killed_primary_is_replaced_by_its_replica(tmp_path: Path) -> None:
    with start_cluster(tmp_path / "cluster", node_timeout_ms=1000) as cluster:
        rc = RedisCluster.from_url(cluster.url, decode_responses=True)
        try:
            keys = [f"task:{i}" for i in range(200)]
            for key in keys:
                await rc.set(key, key)
            # One connection per node (the writes were sequential), so WAIT on it covers them.
            for node in rc.get_primaries():
                acked = await rc.execute_command("WAIT", 1, 5000, target_nodes=node)
                assert acked == 1

            victim = cluster.primaries()[0]
            heir = next(n for n in cluster.replicas() if n.primary_port == victim.port)
            started = time.monotonic()
            cluster.kill(victim.port)
            assert not cluster.alive(victim.port)
            # Blocking: from a running event loop, in a thread.
            await asyncio.to_thread(cluster.wait_healthy, 20)
            elapsed = time.monotonic() - started

            roles = {node.port: node.role for node in cluster.nodes}
            assert roles[victim.port] == "down" and roles[heir.port] == "primary"
            assert elapsed < 15
            # The same client follows the failover: every key written before is there.
            assert [await rc.get(key) for key in keys] == keys
            await rc.set("after", "1")
            assert await rc.get("after") == "1"
        finally:
            await rc.aclose()
    assert _processes_under(tmp_path / "cluster") == []


def test_a_cluster_that_does_not_form_in_time_is_stopped(tmp_path: Path) -> None:
    # A primary waits 2 s after its start before it says cluster_state:ok: 0.5 s cannot do.
    with pytest.raises(TimeoutError, match="did not"):
        start_cluster(tmp_path / "cluster", timeout_s=0.5)
    assert _processes_under(tmp_path / "cluster") == []


def test_a_server_that_will_not_start_is_a_clear_error(tmp_path: Path) -> None:
    binary = tmp_path / "broken-server"
    binary.write_text("#!/bin/sh\nexit 3\n")
    binary.chmod(0o755)
    with pytest.raises(ConfigError, match=r"exited at start \(code 3"):
        start_cluster(tmp_path / "cluster", binary=str(binary))
