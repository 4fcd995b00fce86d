"""Drain: 20,000 no-op tasks queued, then one worker process until all are SUCCEEDED.

Tasks/s from the first completion to the last (``finished_at``, Redis clock) and from the
worker's spawn; also with a handler that does one Redis RPUSH per task. In a full run a short
sweep picks the best ``--concurrency`` first. Ratios are to the raw consume+ack loops, measured
again just before (``baseline.refresh``).
"""

from __future__ import annotations

from bench.harness import NOOP_TASK, RPUSH_KEY, RPUSH_TASK, Env, Result
from bench.scenarios import baseline
from bench.workers import DEFAULT_CONCURRENCY, drain

SWEEP = (32, 128, 512)


def _ratios(env: Env, rate: float) -> dict[str, float]:
    b = env.baseline
    out = {}
    if b.get("consume_ack"):
        out["consume_ack"] = rate / b["consume_ack"]
    if b.get("consume_ack_hset"):
        out["consume_ack_hset"] = rate / b["consume_ack_hset"]
    return out


async def _best_concurrency(env: Env) -> tuple[int, dict[str, float]]:
    rates: dict[str, float] = {}
    for c in SWEEP:
        await env.flush()
        q = await env.queue()
        try:
            ids = await env.fill(q, 5_000, NOOP_TASK)
        finally:
            await q.close()
        rates[str(c)] = (await drain(env, ids, concurrency=c)).rate
    best = max(rates, key=lambda k: rates[k])
    return int(best), rates


async def run(env: Env) -> list[Result]:
    await env.flush()
    await baseline.refresh(env)
    sweep: dict[str, float] = {}
    conc = DEFAULT_CONCURRENCY
    if not env.quick:
        conc, sweep = await _best_concurrency(env)
    env.concurrency = conc
    n = env.n(20_000, 300)
    out = []
    for name, task_type in (("drain.noop", NOOP_TASK), ("drain.rpush", RPUSH_TASK)):
        await env.flush()
        q = await env.queue()
        try:
            ids = await env.fill(q, n, task_type)
        finally:
            await q.close()
        res = await drain(env, ids, concurrency=conc)
        note = f"{n:,} tasks, 1 process, --concurrency {conc}"
        if task_type == RPUSH_TASK:
            r = await env.redis()
            pushed = await r.llen(RPUSH_KEY)
            await r.aclose()
            note += f", {pushed:,} RPUSHes"
        env.drain_rate[task_type] = res.rate
        values = {
            "rate": res.rate,
            "rate_from_start": res.rate_from_start,
            "wall_s": res.wall_s,
            "concurrency": conc,
            "baseline_consume_ack": env.baseline.get("consume_ack", 0.0),
        }
        if sweep and task_type == NOOP_TASK:
            values["concurrency_sweep_5k"] = sweep
        base = env.baseline.get("consume_ack", 0)
        out.append(
            Result(
                name,
                figure="rate",
                unit="tasks/s",
                values=values,
                ratios=_ratios(env, res.rate),
                target=">= 8% of consume+ack" if task_type == NOOP_TASK else "",
                met=res.rate >= 0.08 * base if task_type == NOOP_TASK and base else None,
                note=note,
            )
        )
    await env.flush()
    return out
