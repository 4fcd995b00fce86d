"""A/B of the worker's drain: two or more source trees of dtq, rounds interleaved, one Redis.

    python -m bench.ab before=/path/to/old/src after=src [--n 20000] [--rounds 3]
        [--concurrency 128] [--processes 1] [--callgrind]

Each variant is a folder holding the ``dtq`` package (a checkout's ``src``, e.g. from
``git archive <commit> src | tar -x -C /tmp/old``); its workers import dtq from there
(``PYTHONPATH``), the rest of the run uses this checkout. Per round and variant: the queue is
paused, filled with ``--n`` no-op tasks, the worker (``--processes`` of them) started and
waited for until ready, then the CPU time of the worker processes and of Redis is read, the
queue resumed, and the drain waited for. Printed: tasks/s (first to last ``finished_at``, Redis
clock), the worker's CPU per task (user + system, and system alone) and Redis's CPU per task,
each round and the medians. CPU per task is what to compare on a shared machine; the rates move
with the machine's load. Variants run in turns, the order reversed every other round, so a
drift of the load hits each alike.

``--callgrind`` (one round is enough; ``--n 2000`` keeps it to minutes): Redis and each worker
run under valgrind's callgrind (:mod:`bench.callgrind`), and what is printed is the
instructions per task of each, counted from the queue's resume to its drain: figures the
machine's load does not move, so one run compares two trees on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from redis.asyncio import Redis

from bench import callgrind
from bench.harness import NOOP_TASK, Env, iso_ms, live_entries, statuses, wait_until
from bench.profile import process_cpu_s, redis_cpu_s
from bench.workers import spawn_worker
from dtq import keys
from dtq.devserver import find_redis_server, start_redis

SETTLE_POLL_S = 0.2  # the workers' start-up work is over once their CPU time stands still


async def ready_pids(r: Redis, want: int) -> list[int]:
    """The pids of ``want`` workers that report ready, or [] until there are as many."""
    pids = []
    for worker_id in await r.smembers(keys.WORKERS):
        h = await r.hgetall(keys.worker(worker_id))
        if h.get("status") in ("ready", "busy") and h.get("pid"):
            pids.append(int(h["pid"]))
    return pids if len(pids) >= want else []


async def settled(pids: list[int]) -> None:
    """Wait (at most 10 s) until the workers' CPU time stands still for ``SETTLE_POLL_S``:
    their imports and set-up must not count as the drain's."""
    last = [process_cpu_s(p)[0] for p in pids]

    async def still() -> bool:
        nonlocal last
        await asyncio.sleep(SETTLE_POLL_S)
        now = [process_cpu_s(p)[0] for p in pids]
        same, last = now == last, now
        return same

    await wait_until(still, 10, interval_s=0)


async def drain_once(
    env: Env,
    redis_pid: int,
    src: str,
    n: int,
    concurrency: int,
    processes: int,
    counts: Path | None = None,
    name: str = "",
) -> dict[str, float]:
    """One drain; ``counts``: Redis and the workers run under callgrind, their dumps there
    (``name``: the workers' dump names), and instructions per task are returned."""
    await env.flush()
    r = await env.redis()
    q = await env.queue()
    try:
        await r.set(keys.queue_paused("default"), "1")
        ids = await env.fill(q, n, NOOP_TASK)
        os.environ["PYTHONPATH"] = src  # the workers' dtq (bench.workers keeps the root first)
        if counts is not None:
            env.launcher = callgrind.launcher(counts, name)
        spawn_worker(env, concurrency=concurrency, processes=processes)
        env.launcher = ()
        pids: list[int] = []

        async def ready() -> bool:
            nonlocal pids
            pids = await ready_pids(r, processes)
            return bool(pids)

        ready_s = 60 if counts is None else 600  # valgrind starts Python slowly
        if not await wait_until(ready, ready_s, interval_s=0.05):
            raise RuntimeError(f"the workers did not get ready within {ready_s} s")
        await settled(pids)
        if counts is not None:
            redis_before = callgrind.instructions(counts, "redis")
            for pid in (redis_pid, *pids):
                callgrind.switch(pid, on=True)
        w0 = [process_cpu_s(p) for p in pids]
        r0 = redis_cpu_s(redis_pid)
        await r.delete(keys.queue_paused("default"))

        async def drained() -> bool:
            return await live_entries(r) == 0

        if not await wait_until(drained, 600, interval_s=0.05):
            raise RuntimeError("not drained within 600 s")
        w1 = [process_cpu_s(p) for p in pids]
        r1 = redis_cpu_s(redis_pid)
        if counts is not None:
            for pid in (redis_pid, *pids):
                callgrind.switch(pid, on=False)
        rows = await statuses(r, ids, "status", "finished_at")
        done = [iso_ms(fin) for st, fin in rows if st == "succeeded" and fin]
        if len(done) != n:
            raise RuntimeError(f"{n - len(done)} of {n} tasks did not succeed")
    finally:
        env.stop_children()
        await q.close()
        await r.aclose()
    if counts is not None:
        return {
            "tasks/s": (n - 1) / ((max(done) - min(done)) / 1000),
            "worker instructions/task": callgrind.instructions(counts, name) / n,
            "redis instructions/task": (callgrind.instructions(counts, "redis") - redis_before) / n,
        }
    return {
        "tasks/s": (n - 1) / ((max(done) - min(done)) / 1000),
        "worker us/task": sum(b[0] - a[0] for a, b in zip(w0, w1, strict=True)) / n * 1e6,
        "worker sys us/task": sum(b[1] - a[1] for a, b in zip(w0, w1, strict=True)) / n * 1e6,
        "redis us/task": (r1 - r0) / n * 1e6,
    }


def _line(values: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:,.1f}" for k, v in values.items())


async def run(args: argparse.Namespace) -> None:
    variants: list[tuple[str, str]] = args.variants
    work = Path(tempfile.mkdtemp(prefix="dtq-ab-"))
    counts = work / "callgrind" if args.callgrind else None
    if counts is not None:
        counts.mkdir()
        binary = callgrind.server_wrapper(counts, find_redis_server())
        server = start_redis(work / "redis", binary=binary, timeout_s=120)
    else:
        server = start_redis(work / "redis")
    env = Env(redis_url=server.url, quick=False, work_dir=work, concurrency=args.concurrency)
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in variants}
    try:
        for i in range(args.rounds):
            for name, src in variants if i % 2 == 0 else variants[::-1]:
                got = await drain_once(
                    env,
                    server.pid,
                    src,
                    args.n,
                    args.concurrency,
                    args.processes,
                    counts,
                    f"worker-{name}-{i}",
                )
                results[name].append(got)
                print(f"round {i + 1} {name}: {_line(got)}", flush=True)
    finally:
        env.stop_children()
        server.stop(timeout_s=120)
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"medians of {args.rounds} rounds of {args.n:,} tasks, --concurrency {args.concurrency}"
        f" --processes {args.processes}, load average {os.getloadavg()[0]:.2f} at the end:"
    )
    for name, rows in results.items():
        print(f"  {name}: {_line({k: statistics.median(r[k] for r in rows) for k in rows[0]})}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__)
    p.add_argument("variants", nargs="+", metavar="NAME=SRC", help="a name and a src folder")
    p.add_argument("--n", type=int, default=20_000, help="tasks per drain (default 20,000)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--processes", type=int, default=1)
    p.add_argument("--callgrind", action="store_true", help="count instructions (valgrind)")
    args = p.parse_args(argv)
    if any("=" not in v for v in args.variants):
        p.error("each variant is NAME=SRC")
    args.variants = [
        (name, os.path.abspath(src)) for name, src in (v.split("=", 1) for v in args.variants)
    ]
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
