"""Scenarios at the edges a well-behaved worker never reaches: replies lost on the wire with a
single attempt per task, and an async handler that blocks its worker's event loop.

Each scenario is ``async def name(root, scale) -> list[Report]``, as in :mod:`chaos_faults`.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

from chaos_checker import Exec, Report, dup_unexplained, finish, iso_ms, read_execs, require_clean
from chaos_faults import _next_move
from chaos_harness import REAPER_S, VISIBILITY_S, Run, Scale, running
from chaos_load import LoadGen, Spec, pending_entries, work_specs

from dtq import keys

# -- dropped replies, one attempt per task -------------------------------------------------------

# The probability that a write of scripts or reads loses its last reply. Each loss costs its
# loop a reconnect and the outage reporter's pause: at one in ten the full run's 10,000 tasks
# drain at about 60/s, slower than they are submitted; one in fifty keeps up.
LOSE_P = {False: 0.1, True: 0.02}
LOST_LINE = "chaos-wire: lost the reply of "


def _losses(out: str) -> Counter[str]:
    """The commands whose reply a worker's log says were lost, by name (a script by its own)."""
    lost: Counter[str] = Counter()
    for line in out.splitlines():
        if LOST_LINE in line:
            lost.update(line.split(LOST_LINE, 1)[1].split())
    return lost


async def dropped_replies(root: Path, scale: Scale) -> list[Report]:
    """Three workers whose connections lose the reply of one in ten writes of scripts or reads
    (full run: one in fifty) after Redis ran them (``chaos_wire``), while every task has
    ``max_attempts=1``: a worker that did not die never costs an attempt, so every task
    succeeds at attempt 1, its handler run once, and nothing is dead-lettered or failed
    (``WorkerLost``)."""
    rng = scale.rng("dropped_replies")
    n, duration_s = scale.pick(300, 10_000), scale.pick(6, 30)
    async with running(root, "dropped_replies") as run:
        c = run.cluster
        workers = [
            c.spawn_worker(
                "lr",
                env={
                    "CHAOS_LOSE_REPLIES": str(LOSE_P[scale.full]),
                    "CHAOS_LOSE_SEED": str(rng.random()),
                },
                entry="chaos",
            )
            for _ in range(3)
        ]
        await c.wait_workers(workers)
        specs = work_specs(rng, n)
        for s in specs:
            s.options["max_attempts"] = 1
        load = LoadGen()
        await load.via_sdk(c.url, specs, rate=n / duration_s)
        rep = await finish(run, "dropped replies, max_attempts=1", load)
        dlq = await run.r.xlen(keys.DEAD_LETTER)
        dead = [w.worker_id for w in workers if not w.proc.alive()]
        lost = sum((_losses(w.proc.output()) for w in workers), Counter[str]())
    require_clean(rep)
    rep.require_zero("workers that exited", dead)
    rep.require_zero("dead-letter entries", dlq)
    wrong = [
        f"{v.task_id}: {v.status} attempt {v.hash.get('attempt')} {v.hash.get('error_class', '')}"[
            :200
        ]
        for v in rep.views.values()
        if v.status != "succeeded" or v.hash.get("attempt") != "1" or len(v.execs) != 1
    ]
    rep.require_zero("tasks not succeeded at attempt 1 with one run", wrong)
    for what in ("read", "start", "finish"):
        rep.require(lost[what] > 0, f"no {what} reply was lost: the scenario tested nothing")
    rep.notes["lost_replies"] = "/".join(f"{k}:{v}" for k, v in sorted(lost.items()))
    return [rep]


# -- a handler that blocks the event loop -------------------------------------------------------

STALL_S = min(1.0, VISIBILITY_S / 2)  # dtq.worker.heartbeat.stall_after_s under SETTINGS
BLOCK_S = 4 * VISIBILITY_S  # longer than any take-over: peers must not wait for the loop


async def _running_on(run: Run, task_id: str, timeout_s: float = 20) -> str:
    """The worker that runs ``task_id`` once its hash says RUNNING."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        h = await run.r.hmget(keys.task(task_id), "status", "worker_id")
        if h[0] == "running" and h[1]:
            return str(h[1])
        await asyncio.sleep(0.02)
    raise AssertionError(f"{task_id} never ran")


async def _serving_again(run: Run, worker_id: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await run.r.hget(keys.worker(worker_id), "status") in {"ready", "busy"}:
            return True
        await asyncio.sleep(0.1)
    return False


async def loop_block(root: Path, scale: Scale) -> list[Report]:
    """Among a paced load of ordinary tasks (400-1200 ms each, so that every worker holds a
    few), a task whose async handler blocks its event loop ``BLOCK_S`` (4 x the visibility
    timeout) on its first attempt, several times in a row. The blocked worker is stalled: every
    task it held is taken over by a peer (the bound: visibility timeout + reaper interval +
    the stall limit, printed), none by the blocked worker again, which writes nothing for what
    it lost once its loop runs, and serves again."""
    rng = scale.rng("loop_block")
    n, blocks, n_workers = scale.pick(200, 6000), scale.pick(2, 6), scale.pick(3, 4)
    lo_ms, hi_ms = (400, 1200) if not scale.full else (50, 350)
    duration_s = blocks * (BLOCK_S + 2) + 2
    held: list[tuple[str, str, list[str]]] = []  # (block task, blocked worker, its entries)
    async with running(root, "loop_block") as run:
        c = run.cluster
        await c.wait_workers([c.spawn_worker("lb") for _ in range(n_workers)])
        specs = [
            Spec(i, "chaos_work", {"seq": i, "ms": rng.randint(lo_ms, hi_ms)}) for i in range(n)
        ]
        load = LoadGen()
        loading = asyncio.create_task(load.via_sdk(c.url, specs, rate=n / duration_s))
        for b in range(blocks):
            await asyncio.sleep(1.5)
            seq = n + b
            block = Spec(seq, "chaos_block", {"seq": seq, "block_s": BLOCK_S}, {"max_attempts": 3})
            await load.via_sdk(c.url, [block], rate=None)
            task_id = next(r.task_id for r in load.records if r.seq == seq)
            assert task_id is not None, "the blocking task was not accepted"
            blocked = await _running_on(run, task_id)
            await asyncio.sleep(0.3)  # the handler's first step: the loop is blocked from here
            entries = await pending_entries(run.r, blocked)
            held.append((task_id, blocked, [tid for _, _, tid in entries]))
            ok = await _serving_again(run, blocked, BLOCK_S + 10)
            assert ok, f"{blocked} did not serve again after its loop was blocked"
        await loading
        rep = await finish(run, "loop-blocking handler", load)
        logs = {w.worker_id: w.proc.output() for w in c.workers}
    execs = read_execs(c.exec_dir)
    return [_judge_blocks(rep, held, execs, logs)]


def _judge_blocks(
    rep: Report,
    held: list[tuple[str, str, list[str]]],
    execs: dict[str, list[Exec]],
    logs: dict[str, str],
) -> Report:
    require_clean(rep, dup=False, late=False)
    blocked_pids: set[int] = set()
    late_ok, recoveries, not_taken, writes, regained = [], [], [], [], []
    for block_id, blocked, entries in held:
        first = next(e for e in execs[block_id] if e.attempt == 1)
        blocked_pids.add(first.pid)
        start_ms, end_ms = first.start_ms, (first.end_ns or 0) / 1e6
        for tid in entries:
            v = rep.views[tid]
            moved = _next_move(rep, tid, start_ms, blocked)
            if moved is None or moved > end_ms:
                not_taken.append(f"{tid}: not taken over while {blocked} was blocked")
                continue
            recoveries.append((moved - start_ms) / 1000)
            own = [h for h in v.history if h.get("worker_id") == blocked]
            if any(iso_ms(h["ts"]) >= end_ms for h in own):
                writes.append(f"{tid}: {[(h['from'], h['to']) for h in own]}")
            # Its own start may land just after the block began (a start batch Redis ran while
            # the loop was blocked): a start after the peer's is a task it took back.
            if any(h.get("to") == "running" and iso_ms(h["ts"]) > moved for h in own):
                regained.append(tid)
        for tid, e in rep.late_runs:
            if e.pid == first.pid and tid in entries and 0 <= e.start_ms - end_ms <= 500:
                late_ok.append(tid)
        said = logs.get(blocked, "").count("event loop stalled")
        rep.require(said >= 1, f"{blocked} never logged its stall")
    late = [
        f"{tid}: attempt {e.attempt} on {e.worker_id}"
        for tid, e in rep.late_runs
        if tid not in late_ok
    ]
    rep.require_zero("late_exec not a handler resumed with its loop", late)
    rep.require_zero("dup_exec not from a blocked worker", dup_unexplained(rep, blocked_pids))
    rep.require_zero("held tasks not taken over during the block", not_taken)
    rep.require_zero("writes of the blocked worker for what it lost", writes)
    rep.require_zero("tasks the blocked worker ran again", regained)
    bound = VISIBILITY_S + REAPER_S + STALL_S
    rep.recovery_s = max(recoveries, default=float("nan"))
    rep.notes.update(
        blocks=len(held),
        held=sum(len(e) for _, _, e in held),
        taken_over=len(recoveries),
        recovery_bound_s=bound,
        over_bound=sum(1 for x in recoveries if x > bound),
        resumed_late=len(late_ok),
    )
    return rep
