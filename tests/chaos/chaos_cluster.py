"""Scenarios on a Redis Cluster (the cluster layout, ``DTQ_REDIS_CLUSTER``): a worker killed
with ``kill -9``, and a primary killed with ``kill -9`` while its replica takes over.

Each scenario forms a cluster of its own (:func:`dtq.devcluster.start_cluster`: 3 primaries,
a replica each, AOF off) in its folder, so a killed primary never degrades another test's
cluster. Worker subprocesses serve :data:`QUEUES`, six queues whose slots lie two on each
primary, under a steady stream of SDK submits.

What a failover may cost (docs/delivery-guarantees.md): replication is asynchronous, so the
writes a primary acknowledged in the last moments before it died may be missing from the
replica that takes its place. The scenario therefore watches each submit reach the replica
(:class:`ReplicaWitness`: a read of the task hash on the replica, before the kill) and asserts
the promise that holds: every task seen accepted *and* on the replica reaches exactly one
terminal state; the accepted tasks that are missing at the end were all acknowledged by the
killed primary and not yet on its replica (counted and reported as ``lost``); a task runs more
than once only when it belonged to the killed primary and ran around the failover (its start
or finish was among the writes the replica missed). The outage is the time from the first
failed submit to the first successful one: in the killed primary's queues (``outage_s``: from
the kill to the replica's promotion), and in the others (``outage_other_s``: every node
answers CLUSTERDOWN from the moment they agree the primary failed until its replica serves).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, cast

import redis as sync_redis
from chaos_checker import Report, dup_unexplained, finish, require_clean
from chaos_faults import _next_move
from chaos_harness import (
    REAPER_S,
    VISIBILITY_S,
    Cluster,
    EventLog,
    Run,
    Scale,
    WorkerProc,
    now_ns,
    supervise,
)
from chaos_load import LoadGen, Spec, SubmitRecord, pending_entries
from redis.asyncio import Redis, RedisCluster
from redis.exceptions import RedisError

from dtq import keys
from dtq.devcluster import CLUSTER_SLOTS, DevCluster, start_cluster


def _spread_queues(per_primary: int = 2, primaries: int = 3) -> tuple[str, ...]:
    """``per_primary`` queue names in each primary's share of the slots (start_cluster splits
    them evenly, in order): the first names ``c0``, ``c1``... that fall there."""
    found: list[list[str]] = [[] for _ in range(primaries)]
    n = 0
    while any(len(f) < per_primary for f in found):
        name = f"c{n}"
        share = keys.slot("{" + name + "}") * primaries // CLUSTER_SLOTS
        if len(found[share]) < per_primary:
            found[share].append(name)
        n += 1
    return tuple(q for share in found for q in share)


QUEUES = _spread_queues()
CLUSTER_SETTINGS = {"REDIS_CLUSTER": "true"}
NODE_TIMEOUT_MS = 2000  # a failover takes about this plus a second or two


class ClusterProcs(Cluster):
    """The harness's :class:`Cluster` on a :class:`DevCluster` instead of one redis-server:
    workers are given a live primary's URL and the cluster layout."""

    def __init__(self, root: Path, dev: DevCluster) -> None:
        super().__init__(root, settings=CLUSTER_SETTINGS)
        self.dev = dev

    @property
    def url(self) -> str:
        return self.dev.url

    def redis_client(self) -> Redis:
        """A cluster client that follows a failover (redis-py's own retries and slot-table
        refresh), typed as the :class:`Redis` the checker's helpers take."""
        client = RedisCluster.from_url(self.dev.url, decode_responses=True, socket_timeout=10)
        return cast(Redis, client)

    def spawn_queue_worker(self, slot: str, **kwargs: Any) -> WorkerProc:
        args = [a for q in QUEUES for a in ("--queue", q)]
        return self.spawn_worker(slot, args=args, **kwargs)

    def close(self) -> None:
        super().close()
        self.dev.stop()


@contextlib.asynccontextmanager
async def running_cluster(root: Path, name: str) -> AsyncIterator[Run]:
    """A cluster formed, the event log open (on a replica: a primary may be killed), the
    cluster key layout in this process for the checker; everything stopped at the end and
    the flat layout restored for the tests that follow."""
    folder = root / name
    dev = await asyncio.to_thread(
        start_cluster, folder / "cluster", node_timeout_ms=NODE_TIMEOUT_MS
    )
    procs = ClusterProcs(folder, dev)
    keys.use_layout(True)
    try:
        with EventLog(dev.replicas()[0].url, _shards(dev)) as events:
            r = procs.redis_client()
            try:
                yield Run(procs, events, r)
            finally:
                await r.aclose()
    finally:
        procs.close()
        keys.use_layout(False)


def _shards(dev: DevCluster) -> list[tuple[str, list[str]]]:
    """Where the event log follows the queues' shard channels when the server has sharded
    pub/sub (Redis or Valkey 7 and later: dtq.connection.choose_events): each queue's channel
    on the replica of the primary that owns its slot (a replica, as a primary may be killed;
    after the failover the replica is that primary). None on an older server, whose events are
    all on dtq:events."""
    replica = dev.replicas()[0]
    # CLUSTER SLOTS for the owners: Valkey lists a replica there only once it has an offset.
    with contextlib.closing(sync_redis.Redis.from_url(replica.url)) as client:
        major = str(client.info("server").get("redis_version", "0")).partition(".")[0]
        if int(major) < 7:
            return []
        ranges = client.execute_command("CLUSTER", "SLOTS")
    by_primary = {node.primary_port: node for node in dev.replicas()}
    shards: dict[str, list[str]] = {}
    for queue in QUEUES:
        slot = keys.slot("{" + queue + "}")
        for start, end, primary, *_ in ranges:
            if int(start) <= slot <= int(end):
                node = by_primary[int(primary[1])]
                keys.use_sharded_events(True)
                shards.setdefault(node.url, []).append(keys.events(queue))
    return list(shards.items())


def queue_specs(n: int, rng: random.Random, *, long_share: float = 0.0) -> list[Spec]:
    """``n`` ordinary tasks (5-50 ms; ``long_share`` of them 200-800 ms, so that some are
    running whenever a fault strikes) over :data:`QUEUES` in turn; one in ten asks for one
    retry, so the scheduler leader's promotion runs on every primary too."""
    specs = []
    for i in range(n):
        long = rng.random() < long_share
        payload: dict[str, Any] = {
            "seq": i,
            "ms": rng.randint(200, 800) if long else rng.randint(5, 50),
        }
        if rng.random() < 0.1:
            payload["fail"] = "retry:1"
        specs.append(Spec(i, "chaos_work", payload, {"queue": QUEUES[i % len(QUEUES)]}))
    return specs


# -- kill -9 a worker ---------------------------------------------------------------------------


async def cluster_kill9(root: Path, scale: Scale) -> list[Report]:
    """Three workers serve the six queues; a random one is SIGKILLed about every 3 s under a
    paced load and a supervisor starts a new one. Every accepted task ends once; duplicates
    only for the killed workers' in-flight tasks, taken over by the reaper of a worker whose
    primary may be another than the entry's."""
    rng = scale.rng("cluster_kill9")
    n, duration_s = scale.pick(300, 10_000), scale.pick(7, 30)
    kills: list[tuple[int, WorkerProc, list[str]]] = []
    started = time.monotonic()
    async with running_cluster(root, "cluster_kill9") as run:
        c = cast(ClusterProcs, run.cluster)
        await c.wait_workers([c.spawn_queue_worker("ck") for _ in range(3)])
        load = LoadGen()
        loading = asyncio.create_task(
            load.via_sdk(c.url, queue_specs(n, rng), n / duration_s, settings=CLUSTER_SETTINGS)
        )
        stop, deaths = asyncio.Event(), list[WorkerProc]()
        sup = asyncio.create_task(supervise(c, stop, lambda _: c.spawn_queue_worker("ck"), deaths))
        try:
            while not loading.done():
                await asyncio.wait({loading}, timeout=rng.uniform(2.5, 3.5))
                old = [w for w in c.workers if now_ns() - w.proc.started_ns > 2e9]
                if loading.done() or not old:
                    continue
                victim = rng.choice(old)
                t_kill = now_ns()
                victim.proc.kill9()
                in_flight = await pending_entries(run.r, victim.worker_id, QUEUES)
                kills.append((t_kill, victim, [tid for _, _, tid in in_flight]))
            await loading
        finally:
            stop.set()
            await sup
        rep = await finish(run, "cluster: kill -9 workers", load, queues=QUEUES)
        require_events(rep, run)
        failures = loop_failures(c)
    require_clean(rep, dup=False)
    rep.require_zero("worker loops failed", failures)
    rep.require_zero(
        "dup_exec not from a killed worker", dup_unexplained(rep, {w.pid for _, w, _ in kills})
    )
    held = {tid for _, _, ids in kills for tid in ids}
    rep.require_zero(
        "dup_exec of a task no killed worker held", [t for t in rep.dup_exec if t not in held]
    )
    rep.require(bool(kills), "no worker was killed")
    recoveries = [  # from the kill to the next start or end of each held task by another worker
        (moved - t_kill / 1e6) / 1000
        for t_kill, victim, ids in kills
        for tid in ids
        if (moved := _next_move(rep, tid, t_kill / 1e6, victim.worker_id)) is not None
    ]
    rep.recovery_s = max(recoveries, default=float("nan"))
    bound = VISIBILITY_S + REAPER_S + 1
    rep.notes.update(
        kills=len(kills),
        in_flight_on_killed=len(held),
        recovery_bound_s=bound,
        over_bound=sum(1 for x in recoveries if x > bound),
        queues=len(QUEUES),
        wall_s=round(time.monotonic() - started, 1),
    )
    return [rep]


# -- kill -9 a primary ------------------------------------------------------------------------


class ReplicaWitness:
    """Reads each accepted task's hash on the replica of its queue's primary: :attr:`seen`
    holds the ids found there before :meth:`freeze` (the primary's kill), the tasks a
    failover must not lose."""

    def __init__(
        self, dev: DevCluster, primary_of_queue: Mapping[str, int], queue_of: Mapping[int, str]
    ) -> None:
        replica_of = {n.primary_port: n.port for n in dev.replicas()}
        self.replica_of_queue = {q: replica_of[p] for q, p in primary_of_queue.items()}
        self.queue_of = queue_of
        self.seen: set[str] = set()
        self._clients: dict[int, sync_redis.Redis] = {}
        self._frozen = False

    def _client(self, port: int) -> sync_redis.Redis:
        client = self._clients.get(port)
        if client is None:
            client = sync_redis.Redis(  # one connection: READONLY holds for what follows
                port=port, socket_timeout=2, decode_responses=True, single_connection_client=True
            )
            client.execute_command("READONLY")  # type: ignore[no-untyped-call]
            self._clients[port] = client
        return client

    def freeze(self) -> None:
        self._frozen = True

    def _look(self, accepted: list[tuple[str, int]]) -> None:
        by_replica: dict[int, list[str]] = {}
        for tid, seq in accepted:
            if tid not in self.seen:
                by_replica.setdefault(self.replica_of_queue[self.queue_of[seq]], []).append(tid)
        for port, ids in by_replica.items():
            client = self._client(port)  # a pipeline would take another, pooled, connection
            with contextlib.suppress(RedisError, OSError):
                for tid in ids:
                    if client.exists(keys.task(tid)):
                        self.seen.add(tid)

    async def watch(self, load: LoadGen) -> None:
        """Look every 20 ms until :meth:`freeze`."""
        while not self._frozen:
            accepted = [(tid, rec.seq) for tid, rec in load.accepted().items()]
            await asyncio.to_thread(self._look, accepted)
            await asyncio.sleep(0.02)

    def close(self) -> None:
        for client in self._clients.values():
            client.close()


def require_events(rep: Report, run: Run) -> None:
    """The event log (subscribed on one node) heard the terminal events published on every
    primary: else the check of terminal events would have had nothing to judge."""
    heard = sum(1 for v in rep.views.values() if v.terminal_events)
    rep.notes["terminal_events_heard"] = heard
    rep.require(heard >= rep.accepted // 2, f"terminal events of {heard} task(s) heard")


def loop_failures(c: Cluster) -> list[str]:
    """The workers' lines saying a loop or the finish pipeline failed on an unexpected error
    (a bug: the loop is restarted), whoever logged them, killed workers included."""
    return [
        f"{name}: {line[:200]}"
        for name, text in c.logs().items()
        for line in text.splitlines()
        if "loop failed; restarting it" in line or "finish pipeline failed" in line
    ]


def _outage_s(records: list[SubmitRecord], queue_of: Mapping[int, str], queues: set[str]) -> float:
    """From the first failed submit to ``queues`` to the first successful one after it."""
    mine = sorted((r for r in records if queue_of[r.seq] in queues), key=lambda r: r.invoked_ns)
    first_failed = next((r for r in mine if r.outcome != "accepted"), None)
    if first_failed is None:
        return 0.0
    back = next(
        (r for r in mine if r.outcome == "accepted" and r.invoked_ns > first_failed.invoked_ns),
        None,
    )
    return (back.done_ns - first_failed.invoked_ns) / 1e9 if back else float("inf")


async def cluster_primary_kill(root: Path, scale: Scale) -> list[Report]:
    """Three workers serve the six queues under a paced load; a quarter of the way in, the
    primary of two of them is SIGKILLed and its replica takes over. The workers, the
    scheduler leader and the SDK go on without a restart (module docstring: what may be lost,
    what may run twice)."""
    rng = scale.rng("cluster_primary_kill")
    n, duration_s = scale.pick(400, 10_000), scale.pick(10, 40)
    started = time.monotonic()
    async with running_cluster(root, "cluster_primary_kill") as run:
        c = cast(ClusterProcs, run.cluster)
        dev = c.dev
        workers = [c.spawn_queue_worker("cp") for _ in range(3)]
        await c.wait_workers(workers)
        victim = rng.choice(dev.primaries())
        rc = cast(RedisCluster, run.r)
        await rc.initialize()
        specs = queue_specs(n, rng, long_share=0.2)
        queue_of = {s.seq: str(s.options["queue"]) for s in specs}
        primary_of_queue = {q: rc.get_node_from_key(keys.stream(q, 5)).port for q in QUEUES}
        victim_queues = {q for q, port in primary_of_queue.items() if port == victim.port}
        load = LoadGen()
        witness = ReplicaWitness(dev, primary_of_queue, queue_of)
        watching = asyncio.create_task(witness.watch(load))
        loading = asyncio.create_task(
            load.via_sdk(c.url, specs, n / duration_s, settings=CLUSTER_SETTINGS)
        )
        try:
            await asyncio.wait({loading}, timeout=duration_s / 4)
            t_kill = now_ns()
            dev.kill(victim.port)
            witness.freeze()
            await watching
            await asyncio.to_thread(dev.wait_healthy, 30)
            t_healthy = now_ns()
            await loading
        finally:
            witness.freeze()
            await watching
            witness.close()
        # The killed primary's tasks whose submit was sent before the kill and that its replica
        # was not seen to hold: the ones a failover may lose (their start or finish may be lost
        # with them, so they may run twice too). Every other accepted task must end.
        victim_tasks = {
            tid for tid, rec in load.accepted().items() if queue_of[rec.seq] in victim_queues
        }
        at_risk = {
            tid for tid in victim_tasks - witness.seen if load.accepted()[tid].invoked_ns < t_kill
        }
        pipe = run.r.pipeline(transaction=False)
        for tid in sorted(at_risk):
            pipe.exists(keys.task(tid))
        gone = {
            tid
            for tid, n_keys in zip(sorted(at_risk), await pipe.execute(), strict=True)
            if not n_keys
        }
        rep = await finish(run, "cluster: kill -9 a primary", load, gone=gone, queues=QUEUES)
        require_events(rep, run)
        exited = [w.worker_id for w in workers if not w.proc.alive()]
        failures = loop_failures(c)
        victim_tasks |= {  # orphans (a submit with no answer) of the victim's queues
            tid for tid, v in rep.views.items() if queue_of.get(v.seq or -1) in victim_queues
        }
    rep.require_zero("workers that exited (they must follow the failover)", exited)
    rep.require_zero("worker loops failed", failures)
    rep.require(
        any(
            queue_of[rec.seq] in victim_queues and rec.invoked_ns > t_healthy
            for rec in load.accepted().values()
        ),
        "no submit to the killed primary's queues was accepted after the failover",
    )
    # The promise: an accepted task is lost only if the killed primary acknowledged it and
    # its replica was not seen to hold it before the kill.
    rep.require_zero("lost (not explained by the failover)", [t for t in rep.lost if t not in gone])
    rep.require_zero(
        "terminal_conflicts in a task's history",
        [t for t in rep.terminal_conflicts if ": history " in t],
    )
    rep.require_zero(
        "terminal event conflicts outside the killed primary's queues",
        [t for t in rep.terminal_conflicts if t[:32] not in victim_tasks and ": history " not in t],
    )
    rep.require_zero(
        "late_exec outside the killed primary's queues",
        [t for t in rep.late_exec if t[:32] not in victim_tasks],
    )
    # A run twice is explained by the failover only where one of its runs began before the
    # replica took over (its start or finish among the writes the replica missed).
    rep.require_zero(
        "dup_exec not explained by the failover",
        [
            t
            for t in rep.dup_exec
            if t not in victim_tasks or min(e.start_ns for e in rep.views[t].execs) > t_healthy
        ],
    )
    rep.recovery_s = (t_healthy - t_kill) / 1e9
    other_queues = set(QUEUES) - victim_queues
    rep.notes.update(
        victim_queues="/".join(sorted(victim_queues)),
        outage_s=round(_outage_s(load.records, queue_of, victim_queues), 2),
        outage_other_s=round(_outage_s(load.records, queue_of, other_queues), 2),
        failover_s=round(rep.recovery_s, 2),
        at_risk=len(at_risk),
        replicated_seen=len(witness.seen),
        lost_in_failover=len(gone),
        event_conflicts=sum(1 for t in rep.terminal_conflicts if ": history " not in t),
        wall_s=round(time.monotonic() - started, 1),
    )
    return [rep]
