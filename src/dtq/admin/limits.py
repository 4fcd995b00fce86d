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

from dtq import calls, keys
from dtq.calls import Audit
from dtq.errors import LimitNotFoundError
from dtq.limits import LimitDef, check_limit_name
from dtq.metrics.limit_gauges import read_use, scan_keyed_state
from dtq.store import Store

__all__ = [
    "DELETE_PAGE",
    "SCAN_KEYS_MAX",
    "Limit",
    "LimitUse",
    "delete_keyed_state",
    "delete_limit",
    "get_limit",
    "list_limits",
    "locate",
    "put_limit",
    "sync_code_limits",
]

SCAN_KEYS_MAX = 10_000  # state keys of a keyed limit read for its use, at most
DELETE_PAGE = 100  # state keys deleted per script call when a keyed limit is deleted


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
        if old is not None and old[0] != d.queue:  # its state in the old queue's slot goes
            old_state = calls.limit_state_keys(keys.limit_state(old[0], name))
            await calls.limit_delete(store, name, old[0], None, old_state)
            if old[1].key is not None:
                await delete_keyed_state(store, name, old[0])
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
    """Delete limit ``name``'s definition and its state, so that a limit created again under
    that name starts clean: the unkeyed state in the same script, a keyed limit's key values
    after it (:func:`delete_keyed_state`). A task running under it frees no place at its
    finish; one parked for a place is due again within 30 s of its park (docs/limits.md)."""
    queue, d = await _located(store, name)
    state = calls.limit_state_keys(keys.limit_state(queue, name))
    if not await calls.limit_delete(store, name, queue, audit, state):
        raise LimitNotFoundError(f"limit {name!r} not found", limit=name)
    if d.key is not None:
        await delete_keyed_state(store, name, queue)


async def delete_keyed_state(store: Store, name: str, queue: str) -> int:
    """Delete the state of every key value of the deleted keyed limit ``name`` of ``queue``
    (found by bounded SCANs, sent in pages of :data:`DELETE_PAGE` keys), unless a limit of that
    name exists again meanwhile; how many keys it deleted. Per-key state of a limit no longer
    defined is what nothing else would delete: an idle key value's rate expires, but a set of
    places left by a lost task does not."""
    deleted = 0
    while True:
        found = await scan_keyed_state(store.redis, queue, name, SCAN_KEYS_MAX)
        for at in range(0, len(found.keys), DELETE_PAGE):
            page = found.keys[at : at + DELETE_PAGE]
            n = await calls.limit_delete_state(store, name, queue, page)
            if n is None:  # defined again: its state is the new limit's
                return deleted
            deleted += n
        if not found.capped:
            return deleted


async def _read(store: Store, defs: builtins.list[tuple[str, LimitDef]]) -> builtins.list[Limit]:
    """The read models of ``defs``, with their use (:func:`dtq.metrics.limit_gauges.read_use`:
    one round trip, and one bounded SCAN per keyed limit)."""
    if not defs:
        return []
    use = await read_use(store.redis, dict(defs), SCAN_KEYS_MAX)
    return [
        Limit(
            name=n,
            use=LimitUse(
                running=use[n].running,
                waiting=use[n].waiting,
                keys=None if d.key is None else use[n].keys,
                capped=use[n].capped,
            ),
            **d.model_dump(exclude_none=True),
        )
        for n, d in defs
    ]


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
