"""A/B of the start and finish scripts alone: each entry's own EVALSHA against the batched form.

    python -m bench.scripts_ab [--n 10000] [--rounds 5] [--batch 64] [--callgrind]

No worker: this process fills the queue, reads its entries as one consumer in read batches of
``--batch`` (as a worker's read does), starts each batch with ``calls.start_many`` and
finishes it with ``calls.finish_many`` (a no-op success), so what is measured is the scripts
and their calls, nothing else. Variants: ``per-call`` (``dtq.scripts.BATCHED`` emptied: each
start and finish its own EVALSHA, all of a batch in one write, as before the batched form) and
``batched``, the rounds interleaved, the order reversed every other round. Printed per round
and as medians: Redis's CPU per task (start + finish, from /proc) and this process's CPU per
task (``time.process_time``), both microseconds.

``--callgrind`` counts Redis's instructions instead of its CPU time, which a shared machine's
load does not move: each variant gets a server of its own run under valgrind's callgrind,
counting only while the scripts run (``callgrind_control -i``); one round per variant is exact
to within the server's own timers. Printed: instructions per task; ``--annotate`` adds the
functions that ran the most of them themselves (callgrind_annotate). This process's own
instructions too, when it runs under callgrind itself:

    valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=/tmp/cg/client.out \
        .venv/bin/python -m bench.scripts_ab --callgrind --client-dumps /tmp/cg
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from redis.asyncio import Redis

from bench import callgrind
from bench.harness import NOOP_TASK, PAYLOAD_100B
from bench.profile import redis_cpu_s
from dtq import Queue, calls, connect, keys, scripts
from dtq.config import Settings
from dtq.connection import async_client
from dtq.devserver import find_redis_server, start_redis
from dtq.scripts import Scripts
from dtq.store import Store

VARIANTS = ("per-call", "batched")
# --client-dumps: this process runs under callgrind, its dumps there as client.out*
CLIENT_DUMPS: Path | None = None


async def one_round(
    r: Redis,
    q: Queue,
    settings: Settings,
    pid: int,
    n: int,
    batch: int,
    variant: str,
    counting: bool = False,
) -> tuple[float, float]:
    saved = scripts.BATCHED
    scripts.BATCHED = () if variant == "per-call" else saved
    try:
        store = Store(r, Scripts(), settings)
        await store.scripts.load(r)
        items = [{"task_type": NOOP_TASK, "payload": PAYLOAD_100B}] * 100
        for _ in range(n // 100):
            await q.submit_many(items)
        stream = keys.stream("default", 5)
        if counting:
            callgrind.switch(pid, on=True)
            if CLIENT_DUMPS is not None:
                callgrind.switch(os.getpid(), on=True)
        redis0, client0 = redis_cpu_s(pid), time.process_time()
        done = 0
        while done < n:
            reply = await r.xreadgroup(keys.CONSUMER_GROUP, "w-1", {stream: ">"}, count=batch)
            entries = [calls.Entry.parse(stream, eid, f) for eid, f in reply[0][1]]
            ready = [e for e in entries if e is not None]
            started = await calls.start_many(store, ready, "w-1", token="t")
            outcome = calls.Outcome("success", result_json="null")
            finishes = [
                calls.finish_call(e, s.attempt, outcome, "w-1", settings)
                for e, s in zip(ready, started, strict=True)
                if isinstance(s, calls.StartReply) and s.kind == "run"
            ]
            await calls.finish_many(store, finishes)
            done += len(ready)
        if counting:
            callgrind.switch(pid, on=False)
            if CLIENT_DUMPS is not None:
                callgrind.switch(os.getpid(), on=False)
        redis_us = (redis_cpu_s(pid) - redis0) / n * 1e6
        client_us = (time.process_time() - client0) / n * 1e6
        await r.flushall()
        return redis_us, client_us
    finally:
        scripts.BATCHED = saved


async def main(n: int, rounds: int, batch: int) -> None:
    with tempfile.TemporaryDirectory(prefix="dtq-scripts-ab-") as tmp:
        server = start_redis(Path(tmp))
        try:
            settings = Settings(redis_url=server.url, max_queue_depth=1_000_000)
            r = async_client(settings)  # what a worker uses: hiredis packing
            q = await connect(settings=settings)
            seen: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
            await one_round(r, q, settings, server.pid, 1000, batch, "batched")  # warm
            for i in range(rounds):
                order = VARIANTS if i % 2 == 0 else VARIANTS[::-1]
                for v in order:
                    got = await one_round(r, q, settings, server.pid, n, batch, v)
                    seen[v].append(got)
                    redis_us, client_us = got
                    print(
                        f"round {i + 1} {v}: redis us/task {redis_us:.1f}, client {client_us:.1f}"
                    )
            print(f"medians of {rounds} rounds of {n:,} tasks, read batches of {batch}:")
            for v in VARIANTS:
                redis_us = statistics.median(x for x, _ in seen[v])
                client_us = statistics.median(y for _, y in seen[v])
                print(f"  {v}: redis us/task {redis_us:.1f}, client us/task {client_us:.1f}")
            await q.close()
            await r.aclose()
        finally:
            server.stop()


async def count(n: int, batch: int, annotate: bool = False) -> None:
    """One server under callgrind per variant; its instructions per task while the scripts
    run."""
    for v in VARIANTS:
        with tempfile.TemporaryDirectory(prefix="dtq-scripts-cg-") as tmp:
            out = Path(tmp)
            wrapper = callgrind.server_wrapper(out, find_redis_server())
            server = start_redis(out, binary=wrapper, timeout_s=120)
            try:
                settings = Settings(redis_url=server.url, max_queue_depth=1_000_000)
                r = async_client(settings)  # what a worker uses: hiredis packing
                q = await connect(settings=settings)
                await one_round(r, q, settings, server.pid, 200, batch, v)  # warm
                client_before = (
                    callgrind.instructions(CLIENT_DUMPS, "client") if CLIENT_DUMPS else 0
                )
                await one_round(r, q, settings, server.pid, n, batch, v, counting=True)
                await q.close()
                await r.aclose()
            finally:
                server.stop(timeout_s=120)
            if annotate:
                print(callgrind.annotate(out, "redis"))
            instructions = callgrind.instructions(out, "redis")
            line = f"  {v}: redis instructions/task {instructions / n:,.0f}"
            if CLIENT_DUMPS is not None:
                client = callgrind.instructions(CLIENT_DUMPS, "client")
                line += f", client {(client - client_before) / n:,.0f}"
            print(line)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--callgrind", action="store_true")
    parser.add_argument("--client-dumps", type=Path, help="with --callgrind: see the doc")
    parser.add_argument("--annotate", action="store_true", help="with --callgrind: the top")
    args = parser.parse_args()
    CLIENT_DUMPS = args.client_dumps
    if args.callgrind:
        asyncio.run(count(args.n, args.batch, args.annotate))
    else:
        asyncio.run(main(args.n, args.rounds, args.batch))
