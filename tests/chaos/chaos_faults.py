"""Scenarios that hurt worker processes: the baseline (no fault), ``kill -9``, crash at fixed
points, SIGSTOP/SIGCONT zombies, poison pills, and skewed clocks.

Each scenario is ``async def name(root, scale) -> list[Report]``; a report's ``violations``
name every invariant that did not hold (the test fails on any), its figures are printed.
"""

from __future__ import annotations

import asyncio
import re
import resource
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

from chaos_checker import SETTLE_S, Report, check, dup_unexplained, finish, iso_ms, require_clean
from chaos_harness import (
    REAPER_S,
    TERMINAL,
    VISIBILITY_S,
    Run,
    Scale,
    WorkerProc,
    now_ns,
    running,
    supervise,
)
from chaos_load import LoadGen, Spec, pending_entries, wait_quiet, work_specs

from dtq import keys

# -- 1. baseline --------------------------------------------------------------------------------


async def baseline(root: Path, scale: Scale) -> list[Report]:
    """Four workers, no fault: a burst (throughput) then a paced load (latency)."""
    rng = scale.rng("baseline")
    n = scale.pick(300, 10_000)
    async with running(root, "baseline") as run:
        workers = [run.cluster.spawn_worker("base") for _ in range(4)]
        await run.cluster.wait_workers(workers)
        burst = LoadGen(concurrency=64)
        await burst.via_sdk(run.cluster.url, work_specs(rng, n // 2), rate=None)
        rep_burst = await finish(run, "baseline burst", burst, settle_s=0.5)
        rate = max(20.0, 0.5 * rep_burst.throughput) if rep_burst.throughput > 0 else 100.0
        paced = LoadGen()
        await paced.via_sdk(run.cluster.url, work_specs(rng, n - n // 2, n // 2), rate=rate)
        rep = await finish(run, "baseline paced", paced, settle_s=0.5, skip=set(rep_burst.views))
    for r in (rep_burst, rep):
        require_clean(r)
    rep_burst.notes["mode"] = "burst: all submitted at once (throughput)"
    rep.notes["mode"] = f"paced at {rate:.0f}/s, half the burst throughput (latency)"
    return [rep_burst, rep]


def _next_move(rep: Report, task_id: str, after_ms: float, not_by: str) -> float | None:
    """When the task was next started or ended by another worker than ``not_by`` after
    ``after_ms`` (Redis clock, ms), or None."""
    for h in rep.views[task_id].history:
        ts = iso_ms(h["ts"])
        if ts < after_ms or h.get("worker_id") == not_by:
            continue
        if h.get("to") == "running" or h.get("to") in TERMINAL:
            return ts
    return None


# -- 2. kill -9 ---------------------------------------------------------------------------------


async def kill9(root: Path, scale: Scale) -> list[Report]:
    """A random worker is SIGKILLed about every 3 s under a paced load; a supervisor starts
    a new one at once. Duplicates are allowed only for tasks in flight on a killed worker."""
    rng = scale.rng("kill9")
    n, duration_s = scale.pick(300, 10_000), scale.pick(7, 30)
    kills: list[tuple[int, WorkerProc, list[str]]] = []
    async with running(root, "kill9") as run:
        c = run.cluster
        await c.wait_workers([c.spawn_worker("k") for _ in range(4)])
        load = LoadGen()
        loading = asyncio.create_task(load.via_sdk(c.url, work_specs(rng, n), rate=n / duration_s))
        stop, deaths = asyncio.Event(), list[WorkerProc]()
        sup = asyncio.create_task(supervise(c, stop, lambda _: c.spawn_worker("k"), deaths))
        try:
            while not loading.done():
                await asyncio.wait({loading}, timeout=rng.uniform(2.5, 3.5))
                old = [w for w in c.workers if now_ns() - w.proc.started_ns > 2e9]
                if loading.done() or not old:
                    continue
                victim = rng.choice(old)
                t_kill = now_ns()
                victim.proc.kill9()
                in_flight = await pending_entries(run.r, victim.worker_id)
                kills.append((t_kill, victim, [tid for _, _, tid in in_flight]))
            await loading
        finally:
            stop.set()
            await sup
        rep = await finish(run, "kill -9 workers", load)
    require_clean(rep, dup=False)
    killed = {w.pid for _, w, _ in kills}
    rep.require_zero("dup_exec not from a killed worker", dup_unexplained(rep, killed))
    recoveries = []
    for t_kill, victim, held in kills:
        for tid in held:
            moved = _next_move(rep, tid, t_kill / 1e6, victim.worker_id)
            if moved is not None:
                recoveries.append((moved - t_kill / 1e6) / 1000)
    bound = VISIBILITY_S + REAPER_S + 1
    rep.recovery_s = max(recoveries, default=float("nan"))
    rep.notes.update(
        kills=len(kills),
        in_flight_on_killed=sum(len(h) for _, _, h in kills),
        recovery_bound_s=bound,
        over_bound=sum(1 for x in recoveries if x > bound),
    )
    return [rep]


# -- 3. crash at fixed points ---------------------------------------------------------------

# The documented outcome of a crash at each point (docs/reliability.md and
# docs/delivery-guarantees.md): (final attempt, attempts whose handler ran, the history's "to").
REDELIVERED = ["queued", "running", "running", "succeeded"]
CRASH_OUTCOMES: dict[str, tuple[int, list[int], list[str]]] = {
    "before_handler": (2, [2], REDELIVERED),
    "after_handler": (2, [1, 2], REDELIVERED),
    "after_finish": (1, [1], ["queued", "running", "succeeded"]),
    "after_retry": (2, [1, 2], ["queued", "running", "retrying", "queued", "running", "succeeded"]),
}


async def crash_points(root: Path, scale: Scale) -> list[Report]:
    """Workers (concurrency 1) that ``os._exit`` at a named point of a task's first attempt;
    each point's outcome must be the documented one in every run."""
    runs = scale.pick(2, 100)
    async with running(root, "crash_points") as run:
        c = run.cluster

        def spawn(_: WorkerProc | None = None) -> WorkerProc:
            return c.spawn_worker(
                "crash", args=["--concurrency", "1"], env={"CHAOS_CRASH": "1"}, entry="chaos"
            )

        await c.wait_workers([spawn() for _ in range(4)])
        specs = [
            Spec(i, "chaos_work", {"seq": i, "ms": 5, "crash": point})
            for i, point in enumerate(p for _ in range(runs) for p in CRASH_OUTCOMES)
        ]
        stop, deaths = asyncio.Event(), list[WorkerProc]()
        sup = asyncio.create_task(supervise(c, stop, spawn, deaths))
        try:
            load = LoadGen()
            await load.via_sdk(c.url, specs, rate=None)
            left = await wait_quiet(run.r, load.accepted(), scale.pick(60, 600))
        finally:
            stop.set()
            await sup
        await run.settle(SETTLE_S)
        rep = await check("crash at fixed points", run.r, load.records, c.exec_dir, [])
    rep.require(not left, f"not quiet: {len(left)} task(s) not terminal")
    require_clean(rep, dup=False)
    point_of = {s.seq: s.payload["crash"] for s in specs}
    matched: Counter[str] = Counter()
    for v in rep.views.values():
        point = point_of[v.seq] if v.seq is not None else ""
        attempt, ran, tos = CRASH_OUTCOMES[point]
        ran_attempts = [e.attempt for e in v.execs]
        got = (int(v.hash.get("attempt", 0)), ran_attempts, [h["to"] for h in v.history])
        if v.status == "succeeded" and got == (attempt, ran, tos):
            matched[point] += 1
        else:
            rep.violations.append(f"{point}: task {v.task_id} ended {v.status} {got}")
    for point in CRASH_OUTCOMES:
        rep.notes[point] = f"{matched[point]}/{runs}"
    rep.notes["crashes"] = len(deaths)
    return [rep]


# -- 5. SIGSTOP / SIGCONT zombie ----------------------------------------------------------------


async def _watch_owners(
    run: Run, entries: list[tuple[str, str, str]], stop: asyncio.Event
) -> dict[str, list[str]]:
    """The owners XPENDING names for each entry, in the order seen, sampled every 50 ms."""
    seen: dict[str, list[str]] = {e: [] for _, e, _ in entries}
    while not stop.is_set():
        pipe = run.r.pipeline(transaction=False)
        for stream, entry_id, _ in entries:
            pipe.xpending_range(stream, keys.CONSUMER_GROUP, entry_id, entry_id, 1)
        for (_, entry_id, _), rows in zip(entries, await pipe.execute(), strict=True):
            owner = str(rows[0]["consumer"]) if rows else "-"
            if not seen[entry_id] or seen[entry_id][-1] != owner:
                seen[entry_id].append(owner)
        await asyncio.sleep(0.05)
    return seen


STOP_BURST = 48  # tasks submitted at once right before the SIGSTOP


async def _holds_some(run: Run, consumer: str, timeout_s: float = 5.0) -> None:
    """Wait (bounded) until ``consumer`` has entries pending."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        summary = await run.r.xpending(keys.stream("default", 5), keys.CONSUMER_GROUP)
        if any(c["name"] == consumer and int(c["pending"]) > 1 for c in summary["consumers"]):
            return
        await asyncio.sleep(0.005)


def _lease_lost(line: str) -> bool:
    """A worker's line saying it lost an entry: its heartbeat, its finish or its start found
    another owner (``lease lost``, ``finish fenced``, ``not run: fenced``)."""
    return "lease lost" in line or "finish fenced" in line or "not run: fenced" in line


# A handler the zombie called before the SIGSTOP takes its first step this soon after SIGCONT.
RESUMED_WITHIN_MS = 500


def _late_on_resume(
    rep: Report, zombie_pid: int, held: set[str], t_cont_ms: float
) -> tuple[list[str], list[str]]:
    """The late runs (started after the task's terminal state), split into those explained by
    the pause and the others. A pause can fall between the worker's last lease check and the
    handler's first line (a few microseconds, nothing awaited) or inside the handler: that run
    goes on as the process resumes, after a peer may have finished the task. Explained: on the
    zombie, for an entry it held when stopped, begun within RESUMED_WITHIN_MS of SIGCONT."""
    explained, other = [], []
    for tid, e in rep.late_runs:
        since_ms = e.start_ms - t_cont_ms
        what = f"{tid}: attempt {e.attempt} on pid {e.pid}, {since_ms:.0f} ms after SIGCONT"
        resumed = e.pid == zombie_pid and tid in held and 0 <= since_ms <= RESUMED_WITHIN_MS
        (explained if resumed else other).append(what)
    return explained, other


def _stolen_back(owners: list[str], zombie: str) -> bool:
    """True when XPENDING named the zombie as owner after it had named another worker."""
    others = [i for i, o in enumerate(owners) if o not in (zombie, "-")]
    return bool(others) and zombie in owners[others[0] + 1 :]


async def sigstop(root: Path, scale: Scale) -> list[Report]:
    """A worker holding K entries is SIGSTOPped for 3 x the visibility timeout, then resumed.
    Its leases are taken over; fencing must keep it from writing or acknowledging anything of
    what another worker took, and it must say so once per task it was running."""
    rng = scale.rng("sigstop")
    n, duration_s = scale.pick(300, 10_000), scale.pick(8, 30)
    async with running(root, "sigstop") as run:
        c = run.cluster
        workers = [c.spawn_worker("s") for _ in range(3)]
        await c.wait_workers(workers)
        load = LoadGen()
        specs = work_specs(rng, n)
        burst, paced = specs[:STOP_BURST], specs[STOP_BURST:]
        loading = asyncio.create_task(load.via_sdk(c.url, paced, rate=len(paced) / duration_s))
        await asyncio.sleep(duration_s * 0.2)
        # A burst first, so that the worker is stopped while it holds several entries.
        bursting = asyncio.create_task(load.via_sdk(c.url, burst, rate=None))
        zombie = rng.choice(workers)
        await _holds_some(run, zombie.worker_id)
        zombie.proc.signal(signal.SIGSTOP)
        t_stop = now_ns()
        held = await pending_entries(run.r, zombie.worker_id)
        stop_watch = asyncio.Event()
        watch = asyncio.create_task(_watch_owners(run, held, stop_watch))
        await asyncio.sleep(3 * VISIBILITY_S)
        t_cont = now_ns()  # before the signal: the zombie may run before os.kill returns
        zombie.proc.signal(signal.SIGCONT)
        await asyncio.gather(loading, bursting)
        rep = await finish(run, "SIGSTOP zombie", load)
        stop_watch.set()
        owners = await watch
        zombie_log = zombie.proc.output()
    require_clean(rep, dup=False, late=False)
    rep.require_zero("dup_exec not from the zombie", dup_unexplained(rep, {zombie.pid}))
    held_ids = [tid for _, _, tid in held]
    resumed, late = _late_on_resume(rep, zombie.pid, set(held_ids), t_cont / 1e6)
    rep.require_zero("late_exec not a handler resumed by SIGCONT", late)
    rep.require(len(rep.dup_exec) <= len(held_ids), f"{len(rep.dup_exec)} dups > K={len(held)}")
    steals = [e for e, seq in owners.items() if _stolen_back(seq, zombie.worker_id)]
    rep.require_zero("ownership steals (XPENDING named the zombie again)", steals)
    taken, writes, lost_lines, recoveries = 0, [], [], []
    for tid in held_ids:
        moved = _next_move(rep, tid, t_stop / 1e6, zombie.worker_id)
        if moved is None or moved > t_cont / 1e6:
            continue  # nobody took it over while the zombie slept: it was still the zombie's
        taken += 1
        recoveries.append((moved - t_stop / 1e6) / 1000)
        history = rep.views[tid].history
        late = [
            h
            for h in history
            if h.get("worker_id") == zombie.worker_id and iso_ms(h["ts"]) >= t_cont / 1e6
        ]
        if late:
            writes.append(f"{tid}: {[(h['from'], h['to']) for h in late]}")
        ran_on_zombie = any(
            h.get("to") == "running" and h.get("worker_id") == zombie.worker_id for h in history
        )
        said = sum(1 for line in zombie_log.splitlines() if tid in line and _lease_lost(line))
        if ran_on_zombie and said != 1:
            lost_lines.append(f"{tid}: {said} lease-lost/fenced line(s)")
    rep.require_zero("zombie writes after its leases were taken", writes)
    rep.require_zero("tasks without exactly one lease-lost line", lost_lines)
    rep.recovery_s = max(recoveries, default=float("nan"))
    rep.notes.update(
        K=len(held), taken_over=taken, stopped_s=3 * VISIBILITY_S, resumed_late=len(resumed)
    )
    return [rep]


# -- 8. poison pills ----------------------------------------------------------------------------

POISON_AS_LIMIT = 1 << 30  # RLIMIT_AS of each worker in the poison scenario (about 5x its need)
POISON_PROCESSES = 4
CHILD_EXITED = re.compile(r"worker process (\d+) \(\S+\) exited with")


def _limit_address_space() -> None:
    """In the supervisor, before exec: its forked children inherit the limit."""
    resource.setrlimit(resource.RLIMIT_AS, (POISON_AS_LIMIT, POISON_AS_LIMIT))


PILL_ATTEMPTS = 3
# task type -> (options, the error classes its dead letter may have, attempts it must use).
# A pill whose worker is killed by another pill (an exit pill in the same process) is
# redelivered like any task: WorkerLost is then a legitimate end for every kind. Attempts are
# what dtq counts and caps; the handler ran at most that many times (fewer if its process was
# killed before the handler began).
PILLS: dict[str, tuple[dict[str, Any], set[str], int]] = {
    "chaos_exit": ({}, {"WorkerLost"}, PILL_ATTEMPTS),
    "chaos_hang": ({"timeout_ms": 300}, {"TimeoutError", "WorkerLost"}, PILL_ATTEMPTS),
    "chaos_hang_sync": ({"timeout_ms": 300}, {"TimeoutError", "WorkerLost"}, PILL_ATTEMPTS),
    # MemoryError is no RetryableError: permanent, dead-lettered at its first attempt
    # (delivery-guarantees.md), or one later per time another pill killed its process.
    "chaos_oom": ({}, {"MemoryError", "WorkerLost"}, 1),
}


async def poison(
    root: Path, scale: Scale, reference_throughput: float | None = None
) -> list[Report]:
    """Pills that kill their worker, exhaust its address space (RLIMIT_AS) or hang past their
    timeout, among a burst of ordinary tasks: each pill ends dead-lettered after its
    documented number of runs and never runs again; the other tasks go on."""
    rng = scale.rng("poison")
    n, per_kind = scale.pick(300, 10_000), scale.pick(2, 10)
    specs = work_specs(rng, n)
    pills = [
        Spec(n + i, kind, {"seq": n + i, "hang_s": 1.0}, {"max_attempts": PILL_ATTEMPTS, **opts})
        for i, (kind, (opts, _, _)) in enumerate(
            (kind, PILLS[kind]) for kind in PILLS for _ in range(per_kind)
        )
    ]
    for pill in pills:
        specs.insert(rng.randrange(len(specs) + 1), pill)
    async with running(root, "poison") as run:
        c = run.cluster
        # dtq's own supervisor (--processes 4, 8 slots each, like the other scenarios' four
        # workers): it forks a child in place of one a pill killed and hands it the dead
        # child's entries. The address-space limit is set before exec, so every child has it.
        sup = c.spawn_worker(
            "p",
            args=["--processes", str(POISON_PROCESSES)],
            env={"MALLOC_ARENA_MAX": "2"},
            preexec_fn=_limit_address_space,
        )
        children = [f"{sup.worker_id}-{i}" for i in range(POISON_PROCESSES)]
        await c.wait_workers([WorkerProc(w, sup.proc) for w in children])
        load = LoadGen(concurrency=64)
        await load.via_sdk(c.url, specs, rate=None)
        rep = await finish(run, "poison pills", load)
        deaths = [int(pid) for pid in CHILD_EXITED.findall(sup.proc.output())]
        rep.require(sup.proc.alive(), "the supervisor exited with its children")
    kind_of = {s.seq: s.task_type for s in specs}
    pill_ids = {tid for tid, v in rep.views.items() if kind_of.get(v.seq or -1) in PILLS}
    rep.require_zero("lost", rep.lost)
    rep.require_zero("terminal_conflicts", rep.terminal_conflicts)
    rep.require_zero("late_exec", rep.late_exec)
    rep.require_zero(
        "dup_exec of ordinary tasks not on a dead worker",
        [d for d in dup_unexplained(rep, set(deaths)) if d[:32] not in pill_ids],
    )
    runs: dict[str, list[int]] = {k: [] for k in PILLS}
    for tid in pill_ids:
        v = rep.views[tid]
        kind = kind_of[v.seq or -1]
        _, classes, attempts = PILLS[kind]
        error_class, attempt = v.hash.get("error_class"), int(v.hash.get("attempt", 0))
        runs[kind].append(len(v.execs))
        # An attempt whose process another pill killed is redelivered and counted: a pill
        # whose own end is permanent (MemoryError) then ends one attempt later per redelivery.
        redelivered = sum(1 for h in v.history if h.get("reason") == "redelivered")
        expected = min(PILL_ATTEMPTS, attempts + redelivered)
        if v.status != "dead_lettered" or error_class not in classes:
            rep.violations.append(f"{kind} {tid}: {v.status} {error_class}")
        elif error_class != "WorkerLost" and attempt != expected:
            rep.violations.append(
                f"{kind} {tid}: dead after attempt {attempt}, not {expected} "
                f"({redelivered} redelivered)"
            )
        elif error_class == "WorkerLost" and attempt != PILL_ATTEMPTS:
            rep.violations.append(f"{kind} {tid}: WorkerLost at attempt {attempt}")
        if len(v.execs) > attempt:
            rep.violations.append(f"{kind} {tid}: {len(v.execs)} runs in {attempt} attempts")
    errors = Counter(str(rep.views[t].hash.get("error_class")) for t in pill_ids)
    # The other tasks' throughput: those not redelivered after a pill killed their process. A
    # task in flight beside a pill when it killed its process waits for the reaper (the visibility
    # timeout: a dead worker's recovery), and the chain of a late pill's three attempts makes a
    # tail of such tasks after everything else has finished; they are counted apart, with
    # how long after the run's other tasks the last of them ended.
    normal = [v for tid, v in rep.views.items() if tid not in pill_ids and v.terminal_ms]
    stranded = [v for v in normal if any(h.get("reason") == "redelivered" for h in v.history)]
    others = [v for v in normal if v not in stranded]
    first = min(r.invoked_ns for r in load.records) / 1e6
    last = max((v.terminal_ms or 0 for v in others), default=0.0)
    rep.throughput = len(others) * 1000 / (last - first) if last > first else float("nan")
    stranded_tail = max((v.terminal_ms or 0 for v in stranded), default=last) - last
    rep.notes.update(
        {f"{k}_runs": "/".join(map(str, sorted(set(v)))) for k, v in runs.items()},
        pill_errors="/".join(f"{c}:{n}" for c, n in sorted(errors.items())),
        worker_deaths=len(deaths),
        stranded=len(stranded),
        stranded_tail_s=round(max(0.0, stranded_tail) / 1000, 2),
    )
    if reference_throughput:
        rep.notes["vs_baseline"] = f"{100 * rep.throughput / reference_throughput:.0f}%"
    return [rep]


# -- clock skew ---------------------------------------------------------------------------------

SKEWS_S = (-3600.0, 0.0, 3600.0, 137.5)


async def clock_skew(root: Path, scale: Scale) -> list[Report]:
    """Workers whose clocks are an hour behind, right, an hour ahead and 137.5 s ahead run
    delayed, retried and expiring tasks. dtq decides on the Redis clock, so: no task runs
    before it is due, a task whose deadline passed before it was due expires without running,
    one with a far deadline never expires, and no worker is ever reported stale."""
    rng = scale.rng("skew")
    n, duration_s = scale.pick(300, 10_000), scale.pick(5, 25)
    specs: list[Spec] = []
    for i in range(n):
        roll, payload = rng.random(), {"seq": i, "ms": rng.randint(5, 50)}
        if roll < 0.45:
            specs.append(Spec(i, "chaos_work", payload))
        elif roll < 0.70:
            delay = round(rng.uniform(0.3, 1.5), 3)
            specs.append(Spec(i, "chaos_work", payload, {"delay_seconds": delay}))
        elif roll < 0.80:
            specs.append(Spec(i, "chaos_work", payload, {"ttl_seconds": 600}))
        elif roll < 0.90:
            specs.append(Spec(i, "chaos_work", {**payload, "fail": "retry:1"}))
        else:
            opts = {"delay_seconds": 1.0, "ttl_seconds": 0.3}
            specs.append(Spec(i, "chaos_work", payload, opts))
    async with running(root, "clock_skew") as run:
        c = run.cluster
        workers = [
            c.spawn_worker("skew", env={"CHAOS_SKEW_S": str(s)}, entry="chaos") for s in SKEWS_S
        ]
        await c.wait_workers(workers)
        load = LoadGen()
        await load.via_sdk(c.url, specs, rate=n / duration_s)
        rep = await finish(run, "clock skew", load)
        stale = [e for e in run.events.events() if e.get("type") == "WORKER_STALE"]
    require_clean(rep)
    spec_of = {s.seq: s for s in specs}
    early, wrong_expiry = [], []
    for tid, v in rep.views.items():
        spec = spec_of[v.seq or 0]
        delay_ms = 1000 * float(spec.options.get("delay_seconds", 0))
        due_ms = int(v.hash["created_ms"]) + delay_ms
        if any(e.start_ms < due_ms for e in v.execs):
            early.append(f"{tid}: ran {due_ms - v.execs[0].start_ms:.0f} ms before due")
        must_expire = spec.options.get("ttl_seconds") == 0.3
        if must_expire != (v.status == "expired") or (must_expire and v.execs):
            wrong_expiry.append(f"{tid}: {v.status}, {len(v.execs)} run(s), {spec.options}")
    rep.require_zero("runs before the due time", early)
    rep.require_zero("wrong expirations", wrong_expiry)
    rep.require_zero("WORKER_STALE events", len(stale))
    rep.notes["skews_s"] = "/".join(f"{s:+g}" for s in SKEWS_S)
    return [rep]
