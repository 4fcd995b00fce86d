"""The use of each declared limit (docs/limits.md), read at scrape time for
``dtq_limit_running`` and ``dtq_limit_waiting`` (:class:`dtq.metrics.RedisGauges`).

A limit's use is the ZCARD of its state's ``:running`` zset (the tasks holding a place) and of
its ``:waiting`` zset (the tasks parked for a place). A keyed limit keeps one pair per key
value, so its figures are the sums over its key values, found by ``SCAN MATCH <prefix>=*
TYPE zset COUNT 1000`` (in the cluster layout, on the node of the limit's queue only); past
:data:`KEYED_CAP` keys of one limit the scan stops and its sums cover the keys found so far (a
warning is logged once per limit). A key value is never a label: the gauges are per ``queue``,
``task_type`` (``""`` for a limit of every type) and ``limit``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis, RedisCluster
from redis.exceptions import ResponseError

from dtq import keys
from dtq.limits import LimitDef

__all__ = ["KEYED_CAP", "SCAN_COUNT", "LimitUse", "LimitUseReader", "limit_hashes"]

log = logging.getLogger(__name__)

KEYED_CAP = 10_000  # keys of one keyed limit read per scrape at most
SCAN_COUNT = 1000
_RUNNING, _WAITING = ":running", ":waiting"


@dataclass(frozen=True)
class LimitUse:
    """One limit's figures of one scrape."""

    queue: str
    task_type: str
    limit: str
    running: int
    waiting: int


def limit_hashes(queues: Sequence[str]) -> list[str]:
    """The definition hashes holding the limits of ``queues``: one per queue in the cluster
    layout, the one ``dtq:limits`` in the flat one."""
    return list(dict.fromkeys(keys.limits(q) for q in queues))


class LimitUseReader:
    """Reads the use of the limits whose definitions a scrape found (:meth:`read`)."""

    def __init__(self, keyed_cap: int = KEYED_CAP) -> None:
        self.keyed_cap = keyed_cap
        self._warned: set[str] = set()

    async def read(self, redis: Redis, raw: Mapping[str, str]) -> list[LimitUse]:
        """The use of every valid definition in ``raw`` (limit name -> its JSON, as the
        definition hashes hold it): one pipelined round trip for the limits without a key,
        plus the SCAN of each keyed limit's key values. An invalid definition is left out
        (the workers log it and do not apply it)."""
        defs = _parse(raw)
        if not defs:
            return []
        prefixes = {name: keys.limit_state(d.queue, name) for name, d in defs.items()}
        counted: dict[str, list[str]] = {}  # name -> the zsets to count
        for name, d in defs.items():
            if d.key is None:
                counted[name] = [prefixes[name] + _RUNNING, prefixes[name] + _WAITING]
            else:
                counted[name] = await self._keyed_zsets(redis, name, d.queue, prefixes)
        pipe = redis.pipeline(transaction=False)
        for zsets in counted.values():
            for zset in zsets:
                pipe.zcard(zset)
        replies: list[Any] = await pipe.execute(raise_on_error=False) if len(pipe) else []
        out: list[LimitUse] = []
        at = 0
        for name, zsets in counted.items():
            running = waiting = 0
            for zset, n in zip(zsets, replies[at : at + len(zsets)], strict=True):
                if isinstance(n, ResponseError):  # not a zset (not dtq's): counts nothing
                    continue
                if isinstance(n, Exception):
                    raise n  # no answer is no figure
                if zset.endswith(_RUNNING):
                    running += int(n)
                else:
                    waiting += int(n)
            at += len(zsets)
            d = defs[name]
            out.append(LimitUse(d.queue, d.task_type or "", name, running, waiting))
        return out

    async def _keyed_zsets(
        self, redis: Redis, name: str, queue: str, prefixes: Mapping[str, str]
    ) -> list[str]:
        """The ``:running`` and ``:waiting`` zsets of a keyed limit's key values (at most
        :attr:`keyed_cap`): ``<prefix>=<value>:...`` ("=" is in no limit name, so no other
        limit's state matches)."""
        match = prefixes[name] + "="
        found: list[str] = []
        where: dict[str, Any] = {}
        if isinstance(redis, RedisCluster):  # the state is in its queue's slot: one node's
            where["target_nodes"] = redis.get_node_from_key(keys.limits(queue))
        scan = redis.scan_iter(match=match + "*", count=SCAN_COUNT, _type="zset", **where)
        async for key in scan:
            k = key.decode() if isinstance(key, bytes) else str(key)
            if not k.endswith((_RUNNING, _WAITING)):
                continue
            found.append(k)
            if len(found) >= self.keyed_cap:
                if name not in self._warned:
                    self._warned.add(name)
                    log.warning(
                        "metrics: limit %s has %d or more key states: dtq_limit_running and "
                        "dtq_limit_waiting count the first %d found",
                        name,
                        self.keyed_cap,
                        self.keyed_cap,
                    )
                break
        return found


def _parse(raw: Mapping[str, str]) -> dict[str, LimitDef]:
    out: dict[str, LimitDef] = {}
    for name, text in sorted(raw.items()):
        d = LimitDef.stored(text)
        if d is not None:
            out[name] = d
    return out
