"""The use of each declared limit (docs/limits.md), read at scrape time for
``dtq_limit_running`` and ``dtq_limit_waiting`` (:class:`dtq.metrics.RedisGauges`).

A limit's use is the ZCARD of its state's ``:running`` zset (the tasks holding a place) and of
its ``:waiting`` zset (the tasks parked for a place). A keyed limit keeps one pair per key
value, so its figures are the sums over its key values, found by ``SCAN MATCH <prefix>=*
COUNT 1000`` (in the cluster layout, on the node of the limit's queue only); past
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

__all__ = [
    "KEYED_CAP",
    "SCAN_COUNT",
    "KeyedState",
    "LimitUse",
    "LimitUseReader",
    "Use",
    "limit_hashes",
    "read_use",
    "scan_keyed_state",
]

log = logging.getLogger(__name__)

KEYED_CAP = 10_000  # keys of one keyed limit read per scrape at most
SCAN_COUNT = 1000
_RUNNING, _WAITING, _RATE = ":running", ":waiting", ":rate"
_SUFFIXES = (_RUNNING, _WAITING, _RATE)


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


@dataclass(frozen=True)
class Use:
    """One limit's use now: tasks holding a place, tasks parked for one, and for a keyed limit
    how many key values have state (``capped``: more than the cap, the figures count those
    read)."""

    running: int = 0
    waiting: int = 0
    keys: int = 0
    capped: bool = False


async def read_use(
    redis: Redis, defs: Mapping[str, LimitDef], cap: int = KEYED_CAP
) -> dict[str, Use]:
    """The use of each limit of ``defs`` (limit name -> definition): one pipelined round trip
    of ZCARDs, after one bounded SCAN of each keyed limit's key values (in the cluster layout
    on the node of its queue only). The one reader of limit use: the read model of
    ``dtq.admin.limits`` and the gauges both use it."""
    counted: dict[str, list[str]] = {}  # name -> the zsets to count
    keyed: dict[str, tuple[int, bool]] = {}  # name -> (key values with state, capped)
    for name, d in defs.items():
        prefix = keys.limit_state(d.queue, name)
        if d.key is None:
            counted[name] = [prefix + _RUNNING, prefix + _WAITING]
        else:
            state = await scan_keyed_state(redis, d.queue, name, cap)
            counted[name] = [k for k in state.keys if not k.endswith(_RATE)]
            keyed[name] = (state.values, state.capped)
    pipe = redis.pipeline(transaction=False)
    for zsets in counted.values():
        for zset in zsets:
            pipe.zcard(zset)
    replies: list[Any] = await pipe.execute(raise_on_error=False) if len(pipe) else []
    out: dict[str, Use] = {}
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
        n_keys, capped = keyed.get(name, (0, False))
        out[name] = Use(running, waiting, n_keys, capped)
    return out


@dataclass(frozen=True)
class KeyedState:
    """What one bounded SCAN found of a keyed limit's state: its state keys
    (``<prefix>=<value>:<rate|running|waiting>``), how many key values they are of, and
    whether the scan stopped at the cap (more may be there)."""

    keys: list[str]
    values: int
    capped: bool

    def of(self, suffix: str) -> list[str]:
        """The keys found that end in ``suffix`` (``:running``, ``:waiting`` or ``:rate``)."""
        return [k for k in self.keys if k.endswith(suffix)]

    def prefixes(self) -> list[str]:
        """The state prefix of each key value with a running set (what a sweep reads)."""
        return [k[: -len(_RUNNING)] for k in self.of(_RUNNING)]


async def scan_keyed_state(redis: Redis, queue: str, name: str, cap: int = KEYED_CAP) -> KeyedState:
    """The state keys of keyed limit ``name`` of ``queue``, by one SCAN ``MATCH <prefix>=*``
    stopped after ``cap`` state keys ("=" ends the prefix and is in no limit name, so no other
    limit's state matches); in the cluster layout on the node of the queue's slot only, where
    all of them are. The one SCAN loop over limit state: the use read here, the worker's sweep
    (:mod:`dtq.worker.limits`) and the state deleted with a limit (:mod:`dtq.admin.limits`)."""
    base = keys.limit_state(queue, name) + "="
    where: dict[str, Any] = {}
    if isinstance(redis, RedisCluster):  # the state is in its queue's slot: one node's
        where["target_nodes"] = redis.get_node_from_key(keys.limits(queue))
    found: list[str] = []
    values: set[str] = set()
    async for key in redis.scan_iter(match=base + "*", count=SCAN_COUNT, **where):
        k = key.decode() if isinstance(key, bytes) else str(key)
        suffix = next((x for x in _SUFFIXES if k.endswith(x)), None)
        if suffix is None:
            continue
        found.append(k)
        values.add(k[len(base) : -len(suffix)])
        if len(found) >= cap:
            return KeyedState(found, len(values), True)
    return KeyedState(found, len(values), False)


class LimitUseReader:
    """Reads the use of the limits whose definitions a scrape found (:meth:`read`)."""

    def __init__(self, keyed_cap: int = KEYED_CAP) -> None:
        self.keyed_cap = keyed_cap
        self._warned: set[str] = set()

    async def read(self, redis: Redis, raw: Mapping[str, str]) -> list[LimitUse]:
        """The use of every valid definition in ``raw`` (limit name -> its JSON, as the
        definition hashes hold it). An invalid definition is left out (the workers log it and
        do not apply it)."""
        defs = _parse(raw)
        if not defs:
            return []
        out: list[LimitUse] = []
        for name, use in (await read_use(redis, defs, self.keyed_cap)).items():
            if use.capped and name not in self._warned:
                self._warned.add(name)
                log.warning(
                    "metrics: limit %s has %d or more key states: dtq_limit_running and "
                    "dtq_limit_waiting count the first %d found",
                    name,
                    self.keyed_cap,
                    self.keyed_cap,
                )
            d = defs[name]
            out.append(LimitUse(d.queue, d.task_type or "", name, use.running, use.waiting))
        return out


def _parse(raw: Mapping[str, str]) -> dict[str, LimitDef]:
    out: dict[str, LimitDef] = {}
    for name, text in sorted(raw.items()):
        d = LimitDef.stored(text)
        if d is not None:
            out[name] = d
    return out
