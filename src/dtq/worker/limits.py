"""The limits a worker's tasks meet (docs/limits.md): the definitions of the queues it serves,
read again every :data:`REFRESH_S`, so that a change takes effect within about a second on
every worker; and, per delivered entry, the :class:`~dtq.calls.LimitUse` tuple its start sends
(its key value read from its payload). An entry of a queue and task type without a limit
costs one dict lookup.

:class:`PlaceSweeper` is the safety net of the concurrency limits: every ``DTQ_LIMIT_SWEEP_S``
one worker per queue (the one whose ``SET NX`` of :func:`dtq.keys.limit_sweep` wins) gives
back the places that no RUNNING task holds (``limit_sweep.lua``; docs/limits.md, "Places
that nothing holds")."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import ResponseError

from dtq import calls, keys
from dtq.calls import Entry, LimitUse
from dtq.limits import LimitDef, key_value
from dtq.metrics.limit_gauges import KEYED_CAP, scan_keyed_state
from dtq.scripts import Call
from dtq.store import Store
from dtq.worker.observer import PlacesSwept

__all__ = ["REFRESH_S", "SWEEP_PAGE", "SWEEP_PAGES_MAX", "LimitCache", "PlaceSweeper"]

log = logging.getLogger("dtq.worker.worker")

REFRESH_S = 1.0
SWEEP_PAGE = 100  # running-set members checked per limit_sweep.lua call
SWEEP_PAGES_MAX = 100  # pages of one running set per sweep: 10,000 places


class LimitCache:
    """What :meth:`refresh` last read, for the queues of one worker."""

    def __init__(self, store: Store, queues: Sequence[str]) -> None:
        self._store = store
        self._queues = list(queues)
        self._raw: list[dict[str, str]] = []
        self._by_queue: dict[str, list[tuple[str, LimitDef]]] = {}
        self._memo: dict[tuple[str, str], tuple[tuple[str, LimitDef], ...]] = {}
        self._refused: set[tuple[str, str]] = set()  # logged once per (name, definition)
        self._fair: frozenset[str] = frozenset()

    @property
    def empty(self) -> bool:
        return not self._by_queue

    @property
    def fair(self) -> frozenset[str]:
        """The served queues with a keyed limit: their tasks are served in turn by key."""
        return self._fair

    async def refresh(self) -> None:
        """Read the definitions again (one round trip: one HGETALL per queue in the cluster
        layout, one in all in the flat one)."""
        names = list(dict.fromkeys(keys.limits(q) for q in self._queues))
        pipe = self._store.redis.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(name)
        raw: list[dict[str, str]] = await pipe.execute()
        if raw == self._raw:
            return
        self._raw = raw
        served = set(self._queues)
        by_queue: dict[str, list[tuple[str, LimitDef]]] = {}
        for hash_ in raw:
            for name, text in sorted(hash_.items()):
                defn = self._parse(name, text)
                if defn is not None and defn.queue in served:
                    by_queue.setdefault(defn.queue, []).append((name, defn))
        self._by_queue = by_queue
        self._fair = frozenset(
            q for q, defs in by_queue.items() if any(d.key is not None for _, d in defs)
        )
        self._memo = {}

    def concurrency_limits(self) -> list[tuple[str, LimitDef]]:
        """The limits with a concurrency of the queues served, as :meth:`refresh` read them."""
        return [(n, d) for ds in self._by_queue.values() for n, d in ds if d.concurrency]

    def _parse(self, name: str, text: str) -> LimitDef | None:
        d = LimitDef.stored(text)
        if d is None and (name, text) not in self._refused:
            self._refused.add((name, text))
            log.error("limit %s is not a valid definition, not applied: %r", name, text[:200])
        return d

    def _applicable(self, queue: str, task_type: str) -> tuple[tuple[str, LimitDef], ...]:
        got = self._memo.get((queue, task_type))
        if got is None:
            got = self._memo[queue, task_type] = tuple(
                (name, d)
                for name, d in self._by_queue.get(queue, ())
                if d.applies_to(queue, task_type)
            )
        return got

    def uses(self, entry: Entry) -> tuple[LimitUse, ...]:
        """The limits ``entry``'s task meets, with its key values."""
        if not self._by_queue:
            return ()
        found = self._applicable(entry.queue, entry.task_type)
        if not found:
            return ()
        payload: Any = None
        out = []
        for name, d in found:
            value = ""
            if d.key is not None:
                if payload is None:
                    try:
                        payload = json.loads(entry.payload)
                    except ValueError:
                        payload = {}
                value = key_value(d, payload if isinstance(payload, dict) else {})
            out.append(
                LimitUse(
                    name,
                    keys.limit_state(d.queue, name, value),
                    d.interval_ms,
                    d.tolerance_ms,
                    d.concurrency or 0,
                )
            )
        return tuple(out)


class PlaceSweeper:
    """Gives back the places of the concurrency limits of ``cache`` that no RUNNING task holds
    (:meth:`sweep`), each logged at WARNING and reported to ``on_swept``."""

    def __init__(
        self,
        store: Store,
        cache: LimitCache,
        interval_s: float,
        on_swept: Callable[[PlacesSwept], None] | None = None,
    ) -> None:
        self._store = store
        self._cache = cache
        self._claim_ms = max(1, int(interval_s * 1000))
        self._on_swept = on_swept

    async def sweep(self) -> list[PlacesSwept]:
        """One sweep of the queues whose claim this worker wins: each running set (a keyed
        limit's found by a bounded SCAN) read in pages of :data:`SWEEP_PAGE` members, one
        ``limit_sweep.lua`` call per page, the pages of one round in one round trip."""
        limits = self._cache.concurrency_limits()
        if not limits:
            return []
        mine = await self._claim(sorted({d.queue for _, d in limits}))
        sets: list[tuple[str, str, str]] = []  # (queue, limit, state prefix)
        for name, d in limits:
            if d.queue not in mine:
                continue
            if d.key is None:
                sets.append((d.queue, name, keys.limit_state(d.queue, name)))
            else:
                found = await scan_keyed_state(self._store.redis, d.queue, name, KEYED_CAP)
                sets += [(d.queue, name, prefix) for prefix in found.prefixes()]
        removed: dict[tuple[str, str], list[str]] = {}
        offsets = [0] * len(sets)
        todo = list(range(len(sets)))
        for _ in range(SWEEP_PAGES_MAX):
            if not todo:
                break
            todo = await self._round(sets, offsets, todo, removed)
        out = [PlacesSwept(q, n, tuple(ids)) for (q, n), ids in removed.items() if ids]
        for swept in out:
            for task_id in swept.task_ids:
                log.warning(
                    "limit %s (queue %s): place of task %s given back: the task is not running",
                    swept.limit,
                    swept.queue,
                    task_id,
                )
            if self._on_swept is not None:
                self._on_swept(swept)
        return out

    async def _claim(self, queues: list[str]) -> set[str]:
        """The queues this worker sweeps now: those whose claim it set (one round trip)."""
        pipe = self._store.redis.pipeline(transaction=False)
        for q in queues:
            pipe.set(keys.limit_sweep(q), "1", nx=True, px=self._claim_ms)
        won = await pipe.execute()
        return {q for q, ok in zip(queues, won, strict=True) if ok}

    async def _round(
        self,
        sets: list[tuple[str, str, str]],
        offsets: list[int],
        todo: list[int],
        removed: dict[tuple[str, str], list[str]],
    ) -> list[int]:
        """One page of each running set in ``todo``; returns those with more to read."""
        pipe = self._store.redis.pipeline(transaction=False)
        for i in todo:
            pipe.zrange(sets[i][2] + ":running", offsets[i], offsets[i] + SWEEP_PAGE - 1)
        # A key that is not a zset (not dtq's) answers an error: that set is not swept.
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        pages = [[] if isinstance(p, ResponseError) else p for p in replies]
        sent: list[int] = []
        batch: list[Call] = []
        for i, page in zip(todo, pages, strict=True):
            queue, _, prefix = sets[i]
            members = [m.decode() if isinstance(m, bytes) else str(m) for m in page]
            if keys.cluster_layout():  # a member of another slot is no task of this queue
                home = keys.slot(prefix)
                members = [m for m in members if keys.slot(keys.task(m)) == home]
            if members:
                sent.append(i)
                batch.append(calls.limit_sweep_call(queue, prefix, members))
            offsets[i] += len(page)
        more = [i for i, page in zip(todo, pages, strict=True) if len(page) == SWEEP_PAGE]
        if not batch:
            return more
        for i, reply in zip(sent, await calls.limit_sweep_many(self._store, batch), strict=True):
            if isinstance(reply, Exception):
                log.error("limit %s: sweep of %s failed: %s", sets[i][1], sets[i][2], reply)
                continue
            removed.setdefault((sets[i][0], sets[i][1]), []).extend(reply)
            offsets[i] -= len(reply)  # the members after them moved up
        return more
