"""The limits a worker's tasks meet (docs/limits.md): the definitions of the queues it serves,
read again every :data:`REFRESH_S`, so that a change takes effect within about a second on
every worker; and, per delivered entry, the :class:`~dtq.calls.LimitUse` tuple its start sends
(its key value read from its payload). An entry of a queue and task type without a limit
costs one dict lookup."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from dtq import keys
from dtq.calls import Entry, LimitUse
from dtq.limits import LimitDef, key_value
from dtq.store import Store

__all__ = ["REFRESH_S", "LimitCache"]

log = logging.getLogger("dtq.worker.worker")

REFRESH_S = 1.0


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
