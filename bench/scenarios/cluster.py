"""Cluster: no-op tasks over 6 queues on a 3-primary Redis Cluster, against one Redis.

The scenario starts its own clusters (:func:`dtq.devcluster.start_cluster`, with the binary
:func:`dtq.devserver.find_redis_server` picks, as for the run's own server, and **no
replicas**: a replica replays every write of its primary on the same 2 cores, and the single
Redis it is compared with has none). It picks 6 queue names whose hash tags put two
queues on each of the 3 primaries, and runs the same load three times:

- **single Redis**: the run's own server, flat layout (the baseline of every ratio);
- **one primary**: a cluster of one primary (all 16384 slots), cluster layout: what the layout
  and a cluster-enabled server cost by themselves, with nothing spread;
- **3 primaries**: the queues spread, two on each primary.

Each load is ``submit_many`` of N no-op tasks in batches of 1,000, round-robin over the 6
queues, then one worker process of the 6 queues (``DTQ_REDIS_CLUSTER=1`` on a cluster) until
every stream is empty and every task SUCCEEDED. Reported: the drain rate (first to last
``finished_at``) and, for every server, the tasks it holds and its Redis **CPU time** per task
(``used_cpu_user + used_cpu_sys`` of INFO CPU before and after the submits and the drain; the
server's whole process, so the worker's reads, touches and heartbeats count too). CPU time, not
wall time: the 2 cores run the servers, the worker and this process at once, and a server that
waits for a core is not charged for the wait. Each primary's figure is a ratio to the single
Redis's per task (``single_redis``) and, for the CPU it spent on its third of the load, to the
single Redis's for the whole load (``single_redis_load``); the primaries' shares of the
cluster's CPU show how evenly the work split. Last, ``cluster.publish``: what one PUBLISH costs
the primary it is sent to and every other primary (a cluster's bus takes each message to every
node), on 3 primaries and on 1.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import redis
from redis.asyncio import Redis, RedisCluster

from bench.harness import NOOP_TASK, PAYLOAD_100B, Env, Result
from bench.workers import drain
from dtq import Queue, connect, keys
from dtq.config import Settings
from dtq.devcluster import DevCluster, start_cluster

PRIMARIES = 3
QUEUES_PER_PRIMARY = 2
BATCH = 1_000
PROCESSES = 1
SPLIT_TOLERANCE = 0.1
"""How far a primary's share of the cluster's Redis CPU may stray from a third and still count
as an even split, relative (0.1: between 30 % and 36.7 %)."""


@dataclass
class Cpu:
    """CPU seconds of one server: all of it, and the system (kernel) part."""

    total: float = 0.0
    sys: float = 0.0

    def __sub__(self, other: Cpu) -> Cpu:
        return Cpu(self.total - other.total, self.sys - other.sys)

    def __add__(self, other: Cpu) -> Cpu:
        return Cpu(self.total + other.total, self.sys + other.sys)


@dataclass
class Phase:
    """One load on one deployment: its rates, and by server (port) the tasks it held and the
    CPU it spent on the submits and on the drain."""

    rate: float
    submit_rate: float
    tasks: dict[int, int]
    submit_cpu: dict[int, Cpu]
    drain_cpu: dict[int, Cpu]
    queues: dict[int, list[str]] = field(default_factory=dict)

    def per_task_us(self, port: int) -> dict[str, float]:
        """The server's CPU microseconds per task it held: in all, by phase, in the kernel."""
        n = self.tasks[port]
        submit, drained = self.submit_cpu[port], self.drain_cpu[port]
        return {
            "cpu_us_per_task": (submit + drained).total / n * 1e6,
            "submit_us_per_task": submit.total / n * 1e6,
            "drain_us_per_task": drained.total / n * 1e6,
            "sys_us_per_task": (submit + drained).sys / n * 1e6,
        }

    def cpu_shares(self) -> dict[int, float]:
        spent = {port: (self.submit_cpu[port] + self.drain_cpu[port]).total for port in self.tasks}
        whole = sum(spent.values())
        return {port: s / whole for port, s in spent.items()}


async def _cpu(servers: dict[int, Redis]) -> dict[int, Cpu]:
    """Each server's CPU time so far (user + system of its whole process)."""
    out = {}
    for port, client in servers.items():
        info = await client.info("cpu")
        user, system = float(info["used_cpu_user"]), float(info["used_cpu_sys"])
        out[port] = Cpu(user + system, system)
    return out


def _delta(after: dict[int, Cpu], before: dict[int, Cpu]) -> dict[int, Cpu]:
    return {port: after[port] - before[port] for port in after}


def queues_by_primary(
    node_of_name: Callable[[str], int], primaries: Sequence[int]
) -> dict[int, list[str]]:
    """``QUEUES_PER_PRIMARY`` queue names for each of ``primaries``: the first names of ``c0,
    c1, ...`` that ``node_of_name`` (a queue's primary: its hash tag's slot's) puts there."""
    picked: dict[int, list[str]] = {port: [] for port in primaries}
    i = 0
    while any(len(names) < QUEUES_PER_PRIMARY for names in picked.values()):
        name = f"c{i}"
        names = picked[node_of_name(name)]
        if len(names) < QUEUES_PER_PRIMARY:
            names.append(name)
        i += 1
    return picked


def _round_robin(by_primary: dict[int, list[str]]) -> list[str]:
    """The queues in an order that visits every primary in turn."""
    return [names[i] for i in range(QUEUES_PER_PRIMARY) for names in by_primary.values()]


async def _fill(q: Queue, n: int, queues: Sequence[str]) -> list[str]:
    """``n`` no-op tasks, round-robin over ``queues``, by ``submit_many`` of ``BATCH``."""
    ids: list[str] = []
    while len(ids) < n:
        items = [
            {"task_type": NOOP_TASK, "payload": PAYLOAD_100B, "queue": queues[i % len(queues)]}
            for i in range(len(ids), min(n, len(ids) + BATCH))
        ]
        for t in await q.submit_many(items):
            if isinstance(t, Exception):
                raise t
            ids.append(t.task_id)
    return ids


async def _phase(
    env: Env,
    n: int,
    queues: Sequence[str],
    settings: Settings,
    client: Redis,
    servers: dict[int, Redis],
    server_of_task: Callable[[str], int],
    worker_env: dict[str, str],
) -> Phase:
    """Submit ``n`` tasks over ``queues`` to ``settings``' Redis, then drain them with a worker
    (``worker_env``); ``client`` reads the tasks back, ``servers`` are sampled for CPU time,
    ``server_of_task`` names the one that holds a task."""
    loop = asyncio.get_running_loop()
    q = await connect(settings=settings)  # takes settings' key layout for this process
    try:
        cpu0 = await _cpu(servers)
        t = loop.time()
        ids = await _fill(q, n, queues)
        submit_s = loop.time() - t
    finally:
        await q.close()
    cpu1 = await _cpu(servers)
    tasks = dict(Counter(server_of_task(tid) for tid in ids))
    cpu2: dict[int, Cpu] = {}

    async def drained() -> None:
        cpu2.update(await _cpu(servers))

    res = await drain(
        env,
        ids,
        concurrency=env.concurrency,
        processes=PROCESSES,
        queues=queues,
        client=client,
        worker_env=worker_env,
        drained=drained,
    )
    return Phase(res.rate, n / submit_s, tasks, _delta(cpu1, cpu0), _delta(cpu2, cpu1))


async def _single(env: Env, n: int, queues: Sequence[str]) -> Phase:
    await env.flush()
    r = await env.redis()
    try:
        port = int(r.connection_pool.connection_kwargs.get("port", 6379))
        phase = await _phase(env, n, queues, env.settings, r, {port: r}, lambda _: port, {})
    finally:
        await r.aclose()
    await env.flush()
    phase.queues = {port: list(queues)}
    return phase


async def _cluster(
    env: Env, n: int, cluster: DevCluster, queues: Sequence[str], by_primary: dict[int, list[str]]
) -> Phase:
    """The load over ``queues`` on ``cluster``, whose primaries serve them as ``by_primary``
    says."""
    settings = Settings(redis_url=cluster.url, redis_cluster=True, max_queue_depth=1_000_000)
    rc = RedisCluster.from_url(cluster.url, decode_responses=True)
    servers = {
        port: Redis(host="127.0.0.1", port=port, decode_responses=True) for port in by_primary
    }
    try:
        await rc.initialize()
        phase = await _phase(
            env,
            n,
            queues,
            settings,
            cast(Redis, rc),  # the commands the drain sends are the same on both clients
            servers,
            lambda task_id: rc.get_node_from_key(keys.task(task_id)).port,
            {"DTQ_REDIS_URL": cluster.url, "DTQ_REDIS_CLUSTER": "1"},
        )
    finally:
        await rc.aclose()
        for client in servers.values():
            await client.aclose()
        keys.use_layout(False)
    phase.queues = by_primary
    return phase


def _pick_queues(cluster: DevCluster) -> dict[int, list[str]]:
    """Two queues per primary of ``cluster``, by the slots its primaries serve; the server's
    CLUSTER KEYSLOT of each queue's stream key is checked against :func:`dtq.keys.slot`."""
    rc = redis.RedisCluster.from_url(cluster.url)
    try:
        keys.use_layout(True)  # the names are chosen by their cluster keys' slots
        primaries = [node.port for node in cluster.primaries()]
        picked = queues_by_primary(
            lambda q: rc.get_node_from_key(keys.stream(q, 5)).port, primaries
        )
        for queue in _round_robin(picked):
            key = keys.stream(queue, 5)
            if rc.cluster_keyslot(key) != keys.slot(key):
                raise RuntimeError(f"CLUSTER KEYSLOT {key} is not dtq.keys.slot's")
        return picked
    finally:
        keys.use_layout(False)
        rc.close()


def _row(name: str, phase: Phase, port: int, base_us: float, n: int, note: str) -> Result:
    """A server's row: its CPU per task it held, as a ratio to one Redis's; a server that held
    part of the load also gets the share of one Redis's CPU for the whole load it spent."""
    us = phase.per_task_us(port)
    ratios = {"single_redis": us["cpu_us_per_task"] / base_us}
    if phase.tasks[port] != n:
        ratios["single_redis_load"] = us["cpu_us_per_task"] * phase.tasks[port] / (base_us * n)
    return Result(
        name,
        figure="cpu_us_per_task",
        unit="us Redis CPU/task",
        values={
            **us,
            "tasks": phase.tasks[port],
            "cpu_share": phase.cpu_shares()[port],
            "queues": phase.queues[port],
            "drain_rate": phase.rate,
        },
        ratios=ratios,
        target="<= single Redis",
        met=us["cpu_us_per_task"] <= base_us,
        note=f"{note}; submit {us['submit_us_per_task']:.1f} + drain "
        f"{us['drain_us_per_task']:.1f} us/task, {us['sys_us_per_task']:.1f} of it in the kernel",
    )


def results(
    n: int, concurrency: int, single: Phase, solo: Phase, spread: Phase, servers: str
) -> list[Result]:
    """The rows of the three loads (module docstring)."""
    (base_port,) = single.tasks
    base = single.per_task_us(base_port)
    base_us = base["cpu_us_per_task"]
    shares = spread.cpu_shares()
    even = 1 / PRIMARIES
    split_ok = all(abs(s - even) <= SPLIT_TOLERANCE * even for s in shares.values())
    load = (
        f"{n:,} no-op tasks over 6 queues, {PROCESSES} worker process --concurrency {concurrency}"
    )
    (solo_port,) = solo.tasks
    out = [
        Result(
            "cluster.single_redis",
            figure="rate",
            unit="tasks/s",
            values={"rate": single.rate, "submit_rate": single.submit_rate, "n": n, **base},
            note=f"the baseline of the cluster rows: one Redis, flat layout; {load}; Redis CPU "
            f"{base_us:.1f} us/task (submit {base['submit_us_per_task']:.1f} + drain "
            f"{base['drain_us_per_task']:.1f}, {base['sys_us_per_task']:.1f} in the kernel)",
        ),
        _row(
            "cluster.one_primary",
            solo,
            solo_port,
            base_us,
            n,
            f"the same load on a cluster of 1 primary, cluster layout; {solo.rate:,.0f} tasks/s",
        ),
        Result(
            "cluster.drain",
            figure="rate",
            unit="tasks/s",
            values={
                "rate": spread.rate,
                "submit_rate": spread.submit_rate,
                "n": n,
                "cpu_shares": {str(port): s for port, s in shares.items()},
            },
            ratios={"single_redis": spread.rate / single.rate},
            target=f"each primary's share of the Redis CPU within {SPLIT_TOLERANCE:.0%} of a third",
            met=split_ok,
            note=f"{servers}; {load}; shares of the Redis CPU "
            + ", ".join(f"{s:.1%}" for s in shares.values())
            + "; servers, worker and bench share 2 cores",
        ),
    ]
    for i, port in enumerate(spread.tasks):
        queues = ", ".join(spread.queues[port])
        out.append(
            _row(
                f"cluster.primary_{i}",
                spread,
                port,
                base_us,
                n,
                f"queues {queues}: {spread.tasks[port]:,} tasks",
            )
        )
    return out


EVENT = json.dumps(
    {
        "event_id": "0" * 32,
        "event_type": "TASK_SUCCEEDED",
        "task_id": "0" * 32,
        "queue": "c0",
        "task_type": NOOP_TASK,
        "attempt": 1,
        "worker_id": "w-" + "0" * 12,
        "timestamp": "2026-01-01T00:00:00.000Z",
    }
)
"""A message of an event's size, for :func:`publish_cost`."""


def publish_cost(cluster: DevCluster, n: int) -> list[float]:
    """CPU microseconds per PUBLISH on each primary of ``cluster`` when ``n`` are sent to the
    first one (pipelines of 100): the first is the sender's cost, the others the receivers'.
    A cluster sends every PUBLISH to every node over its bus: each task's events (three per
    no-op task: queued, started, succeeded) cost every primary something."""
    clients = [redis.Redis(port=node.port) for node in cluster.primaries()]
    try:

        def cpu_s() -> list[float]:
            infos = [c.info("cpu") for c in clients]
            return [float(i["used_cpu_user"]) + float(i["used_cpu_sys"]) for i in infos]

        before = cpu_s()
        for _ in range(0, n, 100):
            pipe = clients[0].pipeline(transaction=False)
            for _ in range(100):
                pipe.publish(keys.EVENTS, EVENT)
            pipe.execute()
        return [(a - b) / n * 1e6 for a, b in zip(cpu_s(), before, strict=True)]
    finally:
        for c in clients:
            c.close()


def _publish_row(spread: list[float], solo: list[float], n: int) -> Result:
    receivers = ", ".join(f"{us:.2f}" for us in spread[1:])
    return Result(
        "cluster.publish",
        figure="sender_us",
        unit="us Redis CPU/PUBLISH",
        values={
            "sender_us": spread[0],
            "receivers_us": spread[1:],
            "one_primary_us": solo[0],
            "n": n,
        },
        ratios={"one_primary": spread[0] / solo[0]},
        note=f"{n:,} PUBLISH of a {len(EVENT)}-byte event to one primary of {PRIMARIES}: "
        f"{receivers} us on each other primary (the cluster bus takes every message to every "
        f"node); on a cluster of 1 primary {solo[0]:.2f} us",
    )


def _start(env: Env) -> tuple[DevCluster, DevCluster]:
    spread = start_cluster(env.work_dir / "cluster-3", primaries=PRIMARIES, replicas=0)
    try:
        solo = start_cluster(env.work_dir / "cluster-1", primaries=1, replicas=0)
    except BaseException:
        spread.stop()
        raise
    return spread, solo


async def run(env: Env) -> list[Result]:
    n = env.n(30_000, 300)
    spread_cluster, solo_cluster = await asyncio.to_thread(_start, env)
    try:
        by_primary = await asyncio.to_thread(_pick_queues, spread_cluster)
        queues = _round_robin(by_primary)
        single = await _single(env, n, queues)
        (solo_port,) = [node.port for node in solo_cluster.primaries()]
        solo = await _cluster(env, n, solo_cluster, queues, {solo_port: queues})
        spread = await _cluster(env, n, spread_cluster, queues, by_primary)
        pubs = env.n(30_000, 1_000)
        publish = await asyncio.to_thread(publish_cost, spread_cluster, pubs)
        publish_solo = await asyncio.to_thread(publish_cost, solo_cluster, pubs)
    finally:
        await asyncio.to_thread(spread_cluster.stop)
        await asyncio.to_thread(solo_cluster.stop)
    servers = f"{PRIMARIES} primaries, no replicas ({Path(spread_cluster.binary).name})"
    rows = results(n, env.concurrency, single, solo, spread, servers)
    return [*rows, _publish_row(publish, publish_solo, pubs)]
