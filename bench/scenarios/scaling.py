"""Scaling: the drain with 1, 2 and 4 worker processes (``--processes N``), as speed-up over one,
run in the order 1, 2, 4, 2, 1 and averaged per count.

On a 2-core machine Redis, the worker processes and this benchmark share both cores: 4 processes
show the cost of oversubscription rather than a gain.
"""

from __future__ import annotations

from bench.harness import NOOP_TASK, Env, Result
from bench.workers import drain

PROCESSES = (1, 2, 4)
ORDER = (1, 2, 4, 2, 1)  # there and back: a drift of the machine's load hits each count alike
QUICK_ORDER = (1, 2)  # the smoke run keeps to its time budget


async def run(env: Env) -> list[Result]:
    n = env.n(20_000, 300)
    runs: dict[int, list[float]] = {}
    order = QUICK_ORDER if env.quick else ORDER
    for procs in order:
        await env.flush()
        q = await env.queue()
        try:
            ids = await env.fill(q, n, NOOP_TASK)
        finally:
            await q.close()
        res = await drain(env, ids, concurrency=env.concurrency, processes=procs)
        runs.setdefault(procs, []).append(res.rate)
    await env.flush()
    rates = {p: sum(v) / len(v) for p, v in runs.items()}
    one = rates[1]
    return [
        Result(
            f"scaling.processes_{p}",
            figure="rate",
            unit="tasks/s",
            values={"rate": rates[p], "processes": p, "n": n, "runs": runs[p]},
            ratios={"one_process": rates[p] / one},
            target=">= 1.5x one process" if p == 2 else "",
            met=rates[p] >= 1.5 * one if p == 2 else None,
            note=f"{n:,} no-op tasks, --processes {p} --concurrency {env.concurrency}; mean of "
            f"{len(runs[p])} run(s), order {'-'.join(map(str, order))}",
        )
        for p in sorted(rates)
    ]
