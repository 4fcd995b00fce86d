"""Rate and concurrency limits (docs/limits.md): create or update, read, list, delete, and the
sync of the limits declared in code that a starting worker does.

A limit is found by its name, unique in the deployment. In the flat layout every definition is
in one hash; in the cluster one each is in its queue's hash (in that queue's slot, with the
limit's state), so a name is found by asking each queue of ``dtq:queues`` (:func:`locate`), and
a limit whose queue changes is moved: deleted from the old queue's hash, created in the new.

A limit's ``use`` is read from its state keys, which the start and finish scripts write: for a
limit without a key, the ZCARD of its running and waiting sets; for a keyed one, the sums over
its key values, found by one bounded SCAN of the limit's prefix.
"""

from __future__ import annotations

import builtins
from collections.abc import Collection, Mapping
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict
from redis.asyncio import RedisCluster

from dtq import calls, keys
from dtq.calls import Audit
from dtq.errors import LimitNotFoundError
from dtq.limits import LimitDef, check_limit_name
from dtq.store import Store

__all__ = [
    "SCAN_KEYS_MAX",
    "Limit",
    "LimitUse",
    "delete_limit",
    "get_limit",
    "list_limits",
    "locate",
    "put_limit",
    "sync_code_limits",
]

SCAN_KEYS_MAX = 10_000  # state keys of a keyed limit read for its use, at most
SCAN_PAGE = 1_000
_STATE_SUFFIXES = (":running", ":waiting", ":rate")


class LimitUse(BaseModel):
    """A limit's use now: tasks holding a place (RUNNING) and tasks parked for one; for a keyed
    limit, summed over its key values, ``keys`` saying how many have state (``capped``: more
    than :data:`SCAN_KEYS_MAX` state keys, the sums are of those read)."""

    running: int = 0
    waiting: int = 0
    keys: int | None = None
    capped: bool = False


class Limit(BaseModel):
    """One limit: its name, its definition's fields and its use."""

    model_config = ConfigDict(frozen=True)

    name: str
    queue: str
    task_type: str | None = None
    key: str | None = None
    rate: str | None = None
    burst: int | None = None
    concurrency: int | None = None
    source: Literal["api", "code"] = "api"
    use: LimitUse = LimitUse()

    @property
    def from_code(self) -> bool:
        """Declared in code (``@task(..., rate_limit=...)``): a starting worker puts it back."""
        match self:  # a pattern, not ``self.source``: that name is a script's in dtq's checks
            case Limit(source="code"):
                return True
        return False

    @property
    def definition(self) -> LimitDef:
        return LimitDef.model_validate(self.model_dump(exclude={"name", "use"}))


def _defined(definition: LimitDef | Mapping[str, Any]) -> LimitDef:
    return definition if isinstance(definition, LimitDef) else LimitDef.parse(definition)


async def locate(store: Store, name: str) -> tuple[str, LimitDef] | None:
    """The queue and definition of limit ``name`` (None: no such limit)."""
    redis = store.redis
    scopes = await store.scopes()
    if not scopes:
        return None
    pipe = redis.pipeline(transaction=False)
    for scope in scopes:
        pipe.hget(keys.limits(scope), name)
    for raw in await pipe.execute():
        d = None if raw is None else LimitDef.stored(raw)
        if d is not None:
            return d.queue, d
    return None


async def _located(store: Store, name: str) -> tuple[str, LimitDef]:
    found = await locate(store, check_limit_name(name))
    if found is None:
        raise LimitNotFoundError(f"limit {name!r} not found", limit=name)
    return found


async def put_limit(
    store: Store,
    name: str,
    definition: LimitDef | Mapping[str, Any],
    *,
    audit: Audit | None = None,
) -> tuple[Limit, str]:
    """Create or update limit ``name``: (the limit, ``created`` | ``updated`` | ``unchanged``).
    A bad definition raises :class:`dtq.limits.LimitSpecError` (INVALID_LIMIT)."""
    name = check_limit_name(name)
    d = _defined(definition)
    moved = False
    if keys.cluster_layout():
        old = await locate(store, name)
        if old is not None and old[0] != d.queue:
            await calls.limit_delete(store, name, old[0], None)
            moved = True
        await store.redis.sadd(keys.QUEUES, d.queue)  # workers and locate find the hash there
    outcome = await calls.limit_put(store, name, d.queue, d.to_json(), audit)
    if moved:  # created in the new queue's hash, after it was deleted from the old one
        outcome = "updated"
    return (await _read(store, [(name, d)]))[0], outcome


async def get_limit(store: Store, name: str) -> Limit:
    """Limit ``name`` with its use now; LimitNotFoundError if there is none."""
    _, d = await _located(store, name)
    return (await _read(store, [(name, d)]))[0]


async def list_limits(store: Store) -> builtins.list[Limit]:
    """Every limit with its use now, by name."""
    redis = store.redis
    scopes = await store.scopes()
    if not scopes:
        return []
    pipe = redis.pipeline(transaction=False)
    for scope in scopes:
        pipe.hgetall(keys.limits(scope))
    found: dict[str, LimitDef] = {}
    for h in await pipe.execute():
        for name, raw in cast(dict[str, str], h).items():
            d = LimitDef.stored(raw)
            if d is not None:
                found[name] = d
    return await _read(store, sorted(found.items()))


async def delete_limit(store: Store, name: str, *, audit: Audit | None = None) -> None:
    """Delete limit ``name``'s definition; its state stays (a running task still frees its
    place) and its per-key state expires when idle."""
    queue, _ = await _located(store, name)
    if not await calls.limit_delete(store, name, queue, audit):
        raise LimitNotFoundError(f"limit {name!r} not found", limit=name)


async def _read(store: Store, defs: builtins.list[tuple[str, LimitDef]]) -> builtins.list[Limit]:
    """The read models of ``defs``, their use read in one round trip (the unkeyed ones) and one
    bounded SCAN each (the keyed ones)."""
    if not defs:
        return []
    pipe = store.redis.pipeline(transaction=False)
    unkeyed = [(n, d) for n, d in defs if d.key is None]
    for n, d in unkeyed:
        prefix = keys.limit_state(d.queue, n)
        pipe.zcard(prefix + ":running")
        pipe.zcard(prefix + ":waiting")
    counts = await pipe.execute() if unkeyed else []
    use: dict[str, LimitUse] = {}
    for i, (n, _) in enumerate(unkeyed):
        use[n] = LimitUse(running=int(counts[2 * i]), waiting=int(counts[2 * i + 1]))
    for n, d in defs:
        if d.key is not None:
            use[n] = await _keyed_use(store, n, d)
    return [Limit(name=n, use=use[n], **d.model_dump(exclude_none=True)) for n, d in defs]


async def _keyed_use(store: Store, name: str, d: LimitDef) -> LimitUse:
    """A keyed limit's use: its state keys ``<prefix>=<value>:<running|waiting|rate>`` found
    by SCAN (on the node of the queue's slot in the cluster layout), at most
    :data:`SCAN_KEYS_MAX` of them."""
    redis = store.redis
    base = keys.limit_state(d.queue, name, "x")[:-1]  # "<prefix>="
    match = base + "*"
    node = None
    if isinstance(redis, RedisCluster):
        node = redis.get_node_from_key(keys.limits(d.queue))
    found: list[str] = []
    cursor = 0
    while True:
        if node is None:
            cursor, page = await redis.scan(cursor, match=match, count=SCAN_PAGE)
        else:
            reply = await redis.execute_command(
                "SCAN", cursor, "MATCH", match, "COUNT", SCAN_PAGE, target_nodes=node
            )
            cursor, page = reply
            if isinstance(cursor, dict):  # redis-py's cluster SCAN: the cursor of each node
                cursor = next(iter(cursor.values()))
        found += [str(k) for k in page]
        cursor = int(cursor)
        if cursor == 0 or len(found) >= SCAN_KEYS_MAX:
            break
    capped = cursor != 0
    values: set[str] = set()
    counted: list[tuple[str, str]] = []
    for k in found[:SCAN_KEYS_MAX]:
        for suffix in _STATE_SUFFIXES:
            if k.endswith(suffix):
                values.add(k[len(base) : -len(suffix)])
                if suffix != ":rate":
                    counted.append((suffix, k))
                break
    running = waiting = 0
    if counted:
        pipe = redis.pipeline(transaction=False)
        for _, k in counted:
            pipe.zcard(k)
        for (suffix, _), n in zip(counted, await pipe.execute(), strict=True):
            if suffix == ":running":
                running += int(n)
            else:
                waiting += int(n)
    return LimitUse(running=running, waiting=waiting, keys=len(values), capped=capped)


async def sync_code_limits(
    store: Store,
    declared: Mapping[str, LimitDef],
    task_types: Collection[str],
    *,
    audit: Audit | None = None,
) -> tuple[dict[str, str], builtins.list[str]]:
    """What a starting worker does with the limits its code declares (``declared``, by name):
    each whose task type is one of ``task_types`` (this worker's handlers) is created or
    updated; then each limit from code in Redis whose task type is one of ``task_types`` and
    that the code no longer declares is deleted. Returns (name -> created | updated |
    unchanged, the names deleted)."""
    mine = {n: d for n, d in declared.items() if d.task_type in task_types}
    outcomes: dict[str, str] = {}
    for name, d in mine.items():
        _, outcomes[name] = await put_limit(store, name, d, audit=audit)
    deleted: list[str] = []
    for limit in await list_limits(store):
        name = limit.name
        if limit.from_code and name not in mine and limit.task_type in task_types:
            try:
                await delete_limit(store, name, audit=audit)
            except LimitNotFoundError:
                continue  # another worker deleted it meanwhile
            deleted.append(name)
    return outcomes, deleted
