"""Scenarios about what must stay bounded and unique: idempotency under concurrency, and a
soak of several rounds after which every key has a TTL or a documented bound and Redis memory
is flat. Also :func:`audit_keys`, the key check shared with the state machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import random
import re
import sys
import time
import unicodedata
from collections import Counter, defaultdict
from pathlib import Path

from chaos_checker import Report, check, require_clean
from chaos_harness import CHAOS_DIR, REPO, Cluster, Proc, Scale, running
from chaos_load import LoadGen, Spec, all_task_ids, wait_quiet, work_specs
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from dtq import keys
from dtq.models import IDEMPOTENCY_KEY_MAX
from dtq.store import RECENT_CAP
from support import wait_until

# -- what the docs promise about keys ----------------------------------------------------------

SCHEMA_DOCS = (REPO / "docs" / "redis-schema.md", REPO / "docs" / "delivery-guarantees.md")
_TTL_WORDS = re.compile(r"\b(EXPIRE|PEXPIRE|EX|PX|TTL)\b")


@functools.cache
def documented_keys() -> tuple[tuple[re.Pattern[str], bool, str], ...]:
    """(pattern, has a TTL, name) of every key named in the first column of a table in the
    schema docs; the bound column says whether it is a TTL or another bound."""
    out = []
    for path in SCHEMA_DOCS:
        for line in path.read_text(encoding="utf-8").splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) < 3 or not cells[0].startswith("`dtq:"):
                continue
            name = cells[0].split("`")[1]
            pattern = re.escape(name)
            pattern = re.sub(r"\\?<0\\?-9\\?>", "[0-9]", pattern)
            pattern = re.sub(r"\\?<[^>]*\\?>", ".+", pattern)
            out.append((re.compile(pattern + r"\Z", re.S), bool(_TTL_WORDS.search(cells[2])), name))
    return tuple(out)


async def audit_keys(r: Redis) -> list[str]:
    """Every key without a TTL that no doc names as bounded, and every key no doc names."""
    docs = documented_keys()
    found = [key async for key in r.scan_iter(count=1000)]
    pipe = r.pipeline(transaction=False)
    for key in found:
        pipe.pttl(key)
    problems = []
    for key, pttl in zip(found, await pipe.execute(), strict=True):
        matches = [(ttl, name) for pattern, ttl, name in docs if pattern.match(key)]
        if not matches:
            problems.append(f"{key!r}: no doc names it")
        elif pttl == -1 and all(ttl for ttl, _ in matches):
            problems.append(f"{key!r}: no TTL, but {matches[0][1]} is documented with one")
    return problems


# -- 6. idempotency under concurrency ----------------------------------------------------------

PRODUCERS = 8
_PRINTABLE = st.characters(exclude_categories=("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs"))
_KEY = st.text(_PRINTABLE | st.just(" "), min_size=1, max_size=IDEMPOTENCY_KEY_MAX)


def idempotency_keys(run_seed: int, n: int) -> list[str]:
    """``n`` distinct valid keys: drawn by hypothesis (any printable unicode, up to the maximal
    length), each with near-duplicates (case, NFC/NFD, one character more or less, padded to
    the maximal length) that must all be different logical tasks."""
    drawn: list[str] = []

    @seed(run_seed)
    @settings(
        max_examples=max(50, n // 4),
        phases=[Phase.generate],
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.lists(_KEY, min_size=1, max_size=4))
    def draw(values: list[str]) -> None:
        drawn.extend(values)

    draw()
    out: dict[str, None] = {}
    for k in drawn:
        near = [
            k,
            k.upper(),
            k.lower(),
            unicodedata.normalize("NFD", k),
            unicodedata.normalize("NFC", k),
            k[:-1],
            k + "x",
            (k * IDEMPOTENCY_KEY_MAX)[:IDEMPOTENCY_KEY_MAX],
        ]
        for v in near:
            if 1 <= len(v) <= IDEMPOTENCY_KEY_MAX and v.isprintable():
                out.setdefault(v, None)
    keys_ = list(out)
    return keys_[:n]


async def idempotency(root: Path, scale: Scale) -> list[Report]:
    """Eight processes submit the same keys at once, in different orders, while two workers
    run the tasks: exactly one logical task per key, every answer names it, every record has
    a TTL."""
    n = scale.pick(200, 1000)
    key_list = idempotency_keys(scale.seed, n)
    async with running(root, "idempotency") as run:
        c = run.cluster
        await c.wait_workers([c.spawn_worker("idem") for _ in range(2)])
        keys_path = c.root / "keys.json"
        keys_path.write_text(json.dumps(key_list, ensure_ascii=False), encoding="utf-8")
        start_at = time.time() + 3.0  # every producer imports dtq first, then they all go
        producers = [
            Proc(
                f"producer-{i}",
                [
                    sys.executable,
                    str(CHAOS_DIR / "chaos_producer.py"),
                    c.url,
                    str(keys_path),
                    str(c.root / f"answers-{i}.jsonl"),
                    str(scale.seed * 100 + i),
                    str(start_at),
                ],
                c.env(),
                c.log_dir,
            )
            for i in range(PRODUCERS)
        ]
        try:

            async def done() -> bool:
                return all(not p.alive() for p in producers)

            await wait_until(done, scale.pick(60, 300), "producers finished", every_s=0.2)
        finally:
            for p in producers:
                p.stop()
        codes = [p.process.returncode for p in producers]
        ids = await all_task_ids(run.r)
        left = await wait_quiet(run.r, ids, 60)
        rep = await check("idempotency, 8 processes", run.r, [], c.exec_dir, run.events.events())
        ttl = []
        for k in key_list:
            pttl = await run.r.pttl(keys.idempotency("default", k))
            ttl.append(pttl)
    rep.require(codes == [0] * PRODUCERS, f"producer exit codes {codes}")
    rep.require(not left, f"{len(left)} task(s) not terminal")
    answers: list[dict[str, object]] = []
    for i in range(PRODUCERS):
        path = c.root / f"answers-{i}.jsonl"
        answers.extend(json.loads(x) for x in path.read_text().splitlines())
    named: dict[int, set[object]] = defaultdict(set)
    kinds = Counter(str(a["answer"]) for a in answers)
    for a in answers:
        named[int(str(a["i"]))].add(a["task_id"])
    per_key: dict[str, list[str]] = defaultdict(list)
    for tid, v in rep.views.items():
        per_key[v.hash.get("idempotency_key", "")].append(tid)
    wrong = [
        f"key #{i}: answers name {sorted(map(str, ids_))}, Redis has {per_key.get(k)}"
        for i, k in enumerate(key_list)
        if (ids_ := named[i]) != {tid for tid in per_key.get(k, [])} or len(per_key.get(k, [])) != 1
    ]
    rep.require(len(answers) == PRODUCERS * len(key_list), f"{len(answers)} answers")
    rep.require_zero("keys without exactly one task named by every answer", wrong)
    rep.require_zero("errors", kinds.get("error", 0))
    rep.require_zero("idempotency records without a TTL", sum(1 for t in ttl if t <= 0))
    rep.require(len(rep.views) == len(key_list), f"{len(rep.views)} tasks for {n} keys")
    require_clean(rep)
    rep.accepted = len(key_list)
    rep.notes.update(
        keys=len(key_list),
        longest=max(len(k) for k in key_list),
        non_ascii=sum(1 for k in key_list if not k.isascii()),
        answers="/".join(f"{k}:{v}" for k, v in sorted(kinds.items())),
    )
    return [rep]


# -- 7. boundedness soak ------------------------------------------------------------------------

SOAK_ROUNDS = 5


async def soak(root: Path, scale: Scale) -> list[Report]:
    """Rounds of tasks (about 5 % dead letters) with a short task retention (a task hash
    lives a few seconds after its last change, so each round's keys are gone before the next
    measure): after each round every key has a TTL or a documented bound, the task streams
    are empty, consumers and workers stay bounded although two workers are replaced by new
    ids before every round after the first (one stopped with SIGTERM, one killed -9), and the
    memory of Redis's keys after rounds 3-5 is flat within 5 % (full run: by then the capped
    keys, the recent list and the dead-letter stream, are at their caps)."""
    rng = scale.rng("soak")
    n = scale.pick(60, 10_000)
    dlq_maxlen = scale.pick(20, 1000)
    # Longer than a round takes (a full round's 10,000 tasks wait up to ~20 s in the stream,
    # and the check reads them all at the end), short enough to wait for between rounds.
    retention = str(scale.pick(2, 45))
    workers = 4
    memory: list[int] = []
    used_memory: list[int] = []
    reports: list[Report] = []
    settings_ = {
        "TASK_RETENTION_S": retention,
        "RESULT_RETENTION_S": retention,
        "DLQ_MAXLEN": str(dlq_maxlen),
    }
    async with running(root, "soak", settings=settings_) as run:
        c = run.cluster
        await c.wait_workers([c.spawn_worker("soak") for _ in range(workers)])
        restarts = 0
        for rnd in range(1, SOAK_ROUNDS + 1):
            if rnd > 1:
                restarts += await _replace_two_workers(c, rng)
            specs: list[Spec] = work_specs(rng, n, start_seq=rnd * n)
            for s in rng.sample(specs, max(1, n // 20)):
                s.payload["fail"] = "dead"
            load = LoadGen(concurrency=64)
            await load.via_sdk(c.url, specs, rate=None)
            ids = set(load.accepted())
            left = await wait_quiet(run.r, ids, scale.pick(60, 300))
            rep = await check(f"soak round {rnd}", run.r, load.records, c.exec_dir, [])
            rep.require(not left, f"{len(left)} task(s) not terminal")
            require_clean(rep)
            dead = rep.statuses.get("dead_lettered", 0)
            rep.require(dead == max(1, n // 20), f"{dead} dead letters, planned {max(1, n // 20)}")
            await _expect_bounded(run.r, rep, workers, dlq_maxlen)
            used, dataset, key_bytes = await _memory_after_expiry(run.r)
            memory.append(key_bytes)
            used_memory.append(used)
            rep.notes.update(
                round=rnd,
                worker_restarts=restarts,
                used_memory=used,
                dataset=dataset,
                key_bytes=key_bytes,
                dead_lettered=dead,
            )
            reports.append(rep)
    tail = memory[2:]
    spread = (max(tail) - min(tail)) / min(tail) if tail else math.nan
    reports[-1].notes["key_bytes_spread_rounds_3_5"] = f"{100 * spread:.1f}%"
    used = used_memory[2:]
    if used:
        swing = (max(used) - min(used)) / min(used)
        reports[-1].notes["used_memory_spread_rounds_3_5"] = f"{100 * swing:.1f}%"
    if scale.full:  # reduced rounds stay below the caps of the bounded keys: they still grow
        reports[-1].require(spread <= 0.05, f"keys' size after rounds 3-5 {tail}: {spread:.1%}")
    return reports


async def _replace_two_workers(c: Cluster, rng: random.Random) -> int:
    """At quiescence: one worker stopped with SIGTERM, one killed -9, two new ones (new ids)."""
    stopped, killed = rng.sample(c.workers, 2)
    killed.proc.kill9()
    await asyncio.to_thread(stopped.proc.stop)
    for w in (stopped, killed):
        c.retire(w)
    await c.wait_workers([c.spawn_worker("soak") for _ in range(2)])
    return 2


async def _max_consumers(r: Redis, streams: list[str]) -> int:
    most = 0
    for s in streams:
        most = max(most, len(await r.xinfo_consumers(s, keys.CONSUMER_GROUP)))
    return most


async def _expect_bounded(r: Redis, rep: Report, workers: int, dlq_maxlen: int) -> None:
    rep.require_zero("keys without a TTL or a documented bound", await audit_keys(r))
    streams = keys.queue_streams("default")
    pipe = r.pipeline(transaction=False)
    for s in streams:
        pipe.xlen(s)
    lengths = await pipe.execute()
    rep.require(sum(lengths) == 0, f"task streams hold {sum(lengths)} entries at quiescence")

    # A killed worker's consumers and membership go once the leader sees its heartbeat gone
    # (its lock, if it led, expires in 10 s first): bounded means back to one per live worker.
    async def bounded() -> bool:
        return (
            await _max_consumers(r, streams) <= workers and await r.scard(keys.WORKERS) <= workers
        )

    with contextlib.suppress(AssertionError):
        await wait_until(bounded, 40, "consumers and workers back to one per live worker")
    consumers = await _max_consumers(r, streams)
    rep.require(consumers <= workers, f"{consumers} consumers on one stream, {workers} workers")
    rep.require(await r.scard(keys.WORKERS) <= workers, "dtq:workers grew")
    recent, dead = await r.zcard(keys.RECENT), await r.xlen(keys.DEAD_LETTER)
    rep.require(recent <= RECENT_CAP, f"{keys.RECENT} holds {recent} > {RECENT_CAP}")
    # MAXLEN ~ trims whole stream nodes (100 entries each by default).
    rep.require(dead <= dlq_maxlen + 100, f"{keys.DEAD_LETTER} holds {dead} > ~{dlq_maxlen}")
    rep.notes.update(consumers=consumers, recent=recent, dlq_len=dead)


async def _memory_after_expiry(r: Redis) -> tuple[int, int, int]:
    """Once the round's task hashes have expired: Redis's ``used_memory`` and
    ``used_memory_dataset``, and the exact size of every key (``MEMORY USAGE ... SAMPLES 0``).
    The last is what dtq keeps; the first two also count connection buffers and allocations
    that come and go with a round's 30,000 short-lived keys (a few % either way at the moment
    of measure, not a trend)."""

    async def expired() -> bool:
        return not await all_task_ids(r)

    await wait_until(expired, 120, "task hashes expired", every_s=0.5)
    key_bytes = 0
    async for key in r.scan_iter(count=1000):  # SCAN deletes the keys it meets past their TTL
        key_bytes += await r.memory_usage(key, samples=0) or 0
    info = await r.info("memory")
    return int(info["used_memory"]), int(info["used_memory_dataset"]), key_bytes
