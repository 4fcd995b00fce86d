"""The cost of replicated submits: one submit at a time with DTQ_SUBMIT_MIN_REPLICAS 0 and 1.

    python -m bench.replicas [--n N] [--rounds R]

Starts a private primary and a replica of it (``REPLICAOF``) on this machine, then submits N
tasks one at a time (``await q.submit``, a 100-byte payload), alternating the two settings for
R rounds so that both see the same machine load, and prints per setting the median rate, the
client's CPU per task and the primary's CPU per task (CPU time: ``bench.profile``), and the
ratios of 1 to 0. With 1, each submit also waits for the replica's acknowledgement (``WAIT``
in the same round trip), so the rate measures the replication round trip of a local replica;
a replica across a network adds its latency to every submit.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import redis as sync_redis

from bench.harness import NOOP_TASK, PAYLOAD_100B
from bench.profile import redis_cpu_s
from dtq import connect
from dtq.config import Settings
from dtq.devserver import RedisServer, start_redis


def _in_sync(primary: RedisServer, timeout_ms: int = 10_000) -> None:
    """Every write of the primary so far is on the replica (a write, then WAIT on it)."""
    client = sync_redis.Redis.from_url(primary.url)
    try:
        client.flushall()
        if int(client.execute_command("WAIT", 1, timeout_ms)) < 1:
            raise RuntimeError("the replica did not acknowledge the primary's writes")
    finally:
        client.close()


async def _one_run(primary: RedisServer, replicas: int, n: int) -> tuple[float, float, float]:
    """(tasks/s, client CPU us/task, primary CPU us/task) of n single submits."""
    settings = Settings(
        redis_url=primary.url, max_queue_depth=1_000_000, submit_min_replicas=replicas
    )
    async with await connect(settings=settings) as q:
        for _ in range(200):  # warm: scripts loaded, connection open
            await q.submit(NOOP_TASK, PAYLOAD_100B)
        r0, c0, t0 = redis_cpu_s(primary.pid), time.process_time(), time.perf_counter()
        for _ in range(n):
            await q.submit(NOOP_TASK, PAYLOAD_100B)
        wall = time.perf_counter() - t0
        cpu, rcpu = time.process_time() - c0, redis_cpu_s(primary.pid) - r0
    return n / wall, cpu / n * 1e6, rcpu / n * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.replicas", description=__doc__)
    p.add_argument("--n", type=int, default=3_000, help="submits per run (default 3,000)")
    p.add_argument("--rounds", type=int, default=3, help="runs of each setting (default 3)")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="dtq-replicas-"))
    primary = start_redis(work / "primary")
    replica = start_redis(work / "replica")
    try:
        client = sync_redis.Redis.from_url(replica.url)
        client.replicaof("127.0.0.1", primary.port)
        client.close()
        runs: dict[int, list[tuple[float, float, float]]] = {0: [], 1: []}
        for _ in range(args.rounds):
            for replicas in (0, 1):
                _in_sync(primary)
                runs[replicas].append(asyncio.run(_one_run(primary, replicas, args.n)))
        med = {
            k: tuple(statistics.median(run[i] for run in v) for i in range(3))
            for k, v in runs.items()
        }
        for k, (rate, cpu, rcpu) in med.items():
            print(
                f"min_replicas={k}: {rate:,.0f} submits/s; client CPU {cpu:.1f} us/task; "
                f"primary CPU {rcpu:.1f} us/task (median of {args.rounds} x {args.n:,})"
            )
        (r0, c0, p0), (r1, c1, p1) = med[0], med[1]
        print(f"ratio 1/0: rate {r1 / r0:.2f}, client CPU {c1 / c0:.2f}, primary CPU {p1 / p0:.2f}")
    finally:
        replica.stop()
        primary.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
