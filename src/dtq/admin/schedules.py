"""Periodic schedules (docs/schedules.md): create or update, read, pause, resume, delete,
trigger, preview, and the planning of one firing, shared by the worker's firer
(:mod:`dtq.worker.firer`) and a manual trigger.

A schedule is found by its name. In the flat layout its keys are named by it alone; in the
cluster one they are in the slot of its tasks' queue (the firing script enqueues a tick and
moves the cursor in one call), so a name is found by asking each queue's index
(:func:`locate`), and a schedule whose queue changes is moved: deleted from the old queue's
slot, then created in the new one with the cursor it had (a spec that did not change).
"""

from __future__ import annotations

import builtins
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal, cast

from pydantic import BaseModel

from dtq import calls, keys, ticks
from dtq.calls import Audit, FireCandidate, FireReply, Firing
from dtq.clock import redis_time_ms, time_reply_ms
from dtq.errors import (
    DtqError,
    InvalidTaskError,
    QueueFullError,
    ScheduleExistsError,
    ScheduleNotFoundError,
)
from dtq.models import LIST_LIMIT_MAX, Task, check_list_limit
from dtq.schedules import (
    BUFFER_POLL_MS,
    CATCHUP_CAP,
    HISTORY_CAP,
    MAX_FIRE,
    Schedule,
    ScheduleDef,
    check_schedule_name,
    parse_schedule,
    template_request,
)
from dtq.scripts import Call
from dtq.store import Store

__all__ = [
    "CAS_TRIES",
    "REMOVED_FROM_CODE",
    "delete_schedule",
    "fire_due",
    "get_schedule",
    "list_schedules",
    "locate",
    "next_fire_times",
    "plan_due",
    "plan_firing",
    "prepare_calls",
    "preview_definition",
    "put_schedule",
    "set_schedule_paused",
    "sync_code_schedules",
    "trigger_schedule",
]

CAS_TRIES = 5  # plans made again after a firing found the schedule changed
# The hash fields a firing is planned from (plan_firing): read alone, not the whole hash, whose
# other fields (counters, timestamps, the spec key) cost the firer's read of a thousand hashes
# a second as much again to parse.
PLAN_FIELDS = ("definition", "cursor", "rev", "last_task_id", "buffered_ms")

PreparedFiring = tuple[Firing, Call]
"""A firing planned ahead and its fire.lua call (:func:`prepare_calls`)."""
PREVIEW_MAX = 1_000


def _defined(fields: ScheduleDef | Mapping[str, Any]) -> ScheduleDef:
    if isinstance(fields, ScheduleDef):
        return fields.checked()
    return ScheduleDef.parse(fields)


async def locate(store: Store, name: str) -> str | None:
    """The queue of schedule ``name`` (None: no such schedule). Flat layout: its hash says;
    cluster layout: the first queue whose index holds the name."""
    redis = store.redis
    if not keys.cluster_layout():
        return cast(str | None, await redis.hget(keys.schedule(name, ""), "queue"))
    scopes = await store.scopes()
    if not scopes:
        return None
    pipe = redis.pipeline(transaction=False)
    for scope in scopes:
        pipe.zscore(keys.schedules(scope), name)
    for scope, score in zip(scopes, await pipe.execute(), strict=True):
        if score is not None:
            return scope
    return None


async def _located(store: Store, name: str) -> str:
    queue = await locate(store, check_schedule_name(name))
    if queue is None:
        raise ScheduleNotFoundError(f"schedule {name!r} not found", schedule=name)
    return queue


async def put_schedule(
    store: Store,
    name: str,
    definition: ScheduleDef | Mapping[str, Any],
    *,
    source: str = "api",
    audit: Audit | None = None,
    known_types: Collection[str] | None = None,
    payload_models: Mapping[str, type[BaseModel]] | None = None,
    only: Literal["create", "update"] | None = None,
) -> tuple[Schedule, str]:
    """Create or update schedule ``name``: (the schedule, ``created`` | ``updated`` |
    ``unchanged``). The template is checked as a submit of it would be (a firing's request is
    built from it now); ``known_types`` refuses task types no handler is registered for.
    ``only="create"`` refuses a name that exists (ScheduleExistsError), ``only="update"`` one
    that does not (ScheduleNotFoundError), in the same script that writes."""
    name = check_schedule_name(name)
    d = _defined(definition)
    redis = store.redis
    now = await redis_time_ms(redis)
    template_request(d, name, now, store.settings, known_types, payload_models)
    cursor = d.first_cursor(now)
    moved = False
    if keys.cluster_layout():
        old = await locate(store, name)
        if only == "create" and old is not None:
            raise ScheduleExistsError(f"schedule {name!r} exists", schedule=name)
        if only == "update" and old is None:
            raise ScheduleNotFoundError(f"schedule {name!r} not found", schedule=name)
        if old is not None and old != d.queue:
            spec_key, old_cursor = await redis.hmget(
                keys.schedule(name, old), ["spec_key", "cursor"]
            )
            if spec_key == d.spec_key():
                cursor = int(old_cursor) if old_cursor else None
            await calls.schedule_set(store, name, old, "delete", "", HISTORY_CAP, None)
            moved = True
        await redis.sadd(keys.QUEUES, d.queue)  # the firer finds the queue's index there
    outcome, _ = await calls.schedule_put(
        store,
        name,
        d.queue,
        d.task_type,
        d.stored(),
        d.spec_key(),
        cursor,
        source,
        d.paused,
        d.overlap,
        HISTORY_CAP,
        audit,
        # a schedule moved to another queue's slot was deleted there just now: create it
        None if only == "update" and moved else only,
    )
    if outcome == "exists":
        raise ScheduleExistsError(f"schedule {name!r} exists", schedule=name)
    if outcome == "missing":
        raise ScheduleNotFoundError(f"schedule {name!r} not found", schedule=name)
    return await get_schedule(store, name), outcome


async def get_schedule(store: Store, name: str, *, history: int = HISTORY_CAP) -> Schedule:
    """Schedule ``name`` with its latest ``history`` decisions (newest first)."""
    queue = await _located(store, name)
    pipe = store.redis.pipeline(transaction=False)
    pipe.hgetall(keys.schedule(name, queue))
    pipe.lrange(keys.schedule_history(name, queue), 0, max(0, history) - 1)
    h, hist = await pipe.execute()
    if not h:
        raise ScheduleNotFoundError(f"schedule {name!r} not found", schedule=name)
    return parse_schedule(h, hist if history > 0 else [])


async def list_schedules(store: Store, limit: int = LIST_LIMIT_MAX) -> builtins.list[Schedule]:
    """Every schedule (at most ``limit``), by next fire time (paused and ended ones last)."""
    limit = check_list_limit(limit)
    redis = store.redis
    found: list[tuple[float, str, str]] = []
    for scope in await store.scopes():
        page = cast(
            list[tuple[str, float]],
            await redis.zrange(keys.schedules(scope), 0, limit - 1, withscores=True),
        )
        found += [(float(score), str(member), scope) for member, score in page]
    found.sort()
    found = found[:limit]
    if not found:
        return []
    pipe = redis.pipeline(transaction=False)
    for _, name, scope in found:
        pipe.hgetall(keys.schedule(name, scope))
    return [parse_schedule(h) for h in await pipe.execute() if h]


async def set_schedule_paused(
    store: Store, name: str, paused: bool, *, reason: str = "", audit: Audit | None = None
) -> bool:
    """Pause or resume schedule ``name``; True when its state changed. A resumed schedule goes
    on from where it was paused: the ticks of the pause are due at once, and its catch-up
    policy decides which fire."""
    queue = await _located(store, name)
    op: Literal["pause", "resume"] = "pause" if paused else "resume"
    changed = await calls.schedule_set(store, name, queue, op, reason, HISTORY_CAP, audit)
    if changed < 0:
        raise ScheduleNotFoundError(f"schedule {name!r} not found", schedule=name)
    return changed == 1


async def delete_schedule(store: Store, name: str, *, audit: Audit | None = None) -> None:
    """Delete schedule ``name`` and its keys (tasks it fired are not touched)."""
    queue = await _located(store, name)
    if await calls.schedule_set(store, name, queue, "delete", "", HISTORY_CAP, audit) < 0:
        raise ScheduleNotFoundError(f"schedule {name!r} not found", schedule=name)


async def next_fire_times(store: Store, name: str, n: int = 10) -> builtins.list[int]:
    """The next ``n`` fire times of schedule ``name`` (epoch ms): from its cursor when that is
    ahead, else from now; [] when it has ended."""
    if not 1 <= n <= PREVIEW_MAX:
        raise InvalidTaskError(f"n must be from 1 to {PREVIEW_MAX}", field="n")
    s = await get_schedule(store, name, history=0)
    now = await redis_time_ms(store.redis)
    d = s.definition
    if s.next_fire_at is None:
        return []
    return preview_definition(d, max(round(s.next_fire_at.timestamp() * 1000), now), n)


def preview_definition(d: ScheduleDef, from_ms: int, n: int) -> builtins.list[int]:
    """The first ``n`` ticks of ``d`` at or after ``from_ms`` (and its start), before its end."""
    if not 1 <= n <= PREVIEW_MAX:
        raise InvalidTaskError(f"n must be from 1 to {PREVIEW_MAX}", field="n")
    if d.start_ms is not None:
        from_ms = max(from_ms, d.start_ms)
    return ticks.preview(d.spec(), from_ms - 1, n, end_ms=d.end_ms)


# -- firing -------------------------------------------------------------------------------------


def plan_firing(
    name: str, h: Mapping[str, str], d: ScheduleDef, now_ms: int, store: Store
) -> Firing:
    """The fire.lua call (tick mode) for schedule hash ``h`` (definition ``d``) at Redis time
    ``now_ms``: the buffered tick, if any, then the due ticks as :func:`dtq.ticks.plan` decides
    them by the catch-up policy."""
    cands: list[FireCandidate] = []
    buffered = h.get("buffered_ms") or ""
    if buffered:
        cands.append(_candidate(d, name, int(buffered), "buffered", store))
    raw_cursor = h.get("cursor") or ""
    cursor: int | None = int(raw_cursor) if raw_cursor else None
    missed = 0
    first = last = None
    capped = False
    if cursor is not None and cursor <= now_ms:
        p = ticks.plan(
            d.spec(),
            cursor,
            now_ms,
            catchup=d.catchup,
            grace_ms=d.grace_s * 1000,
            window_ms=d.catchup_window_s * 1000,
            cap=CATCHUP_CAP,
            max_fire=MAX_FIRE - len(cands),
            start_ms=d.start_ms,
            end_ms=d.end_ms,
        )
        cands += [_candidate(d, name, t, "tick", store) for t in p.fire]
        cursor, missed, capped = p.cursor, p.missed, p.missed_capped
        first, last = p.first_missed, p.last_missed
    return Firing(
        name=name,
        queue=d.queue,
        rev=h.get("rev") or "0",
        mode="tick",
        last_task_id=h.get("last_task_id") or "",
        candidates=cands,
        cursor=cursor,
        missed=missed,
        first_missed=first,
        last_missed=last,
        missed_capped=capped,
        task_type=d.task_type,
    )


def _candidate(
    d: ScheduleDef, name: str, tick_ms: int, kind: Any, store: Store, manual: str | None = None
) -> FireCandidate:
    req = template_request(d, name, tick_ms, store.settings, manual=manual)
    return FireCandidate(tick_ms, kind, req, calls.new_task_id(d.queue))


async def plan_due(
    store: Store,
    due: Sequence[tuple[str, str]],
    definitions: dict[str, ScheduleDef],
    refused: builtins.list[tuple[str, str, DtqError]],
    at_ms: int | None = None,
) -> builtins.list[Firing]:
    """Read the hash of each of schedules ``due`` ((name, queue) pairs) and plan its firing at
    Redis time ``at_ms`` (None: the server's time now, read in the same round trip); a
    schedule deleted meanwhile is planned as a call that removes its index member.
    ``definitions`` caches the parsed definitions by their JSON. A schedule whose firing's
    task this process refuses is added to ``refused`` and not planned."""
    pipe = store.redis.pipeline(transaction=False)
    for name, queue in due:
        pipe.hmget(keys.schedule(name, queue), PLAN_FIELDS)
    pipe.execute_command("TIME")  # not .time(): a cluster pipeline refuses that name
    *rows, clock = await pipe.execute()
    now = time_reply_ms(clock) if at_ms is None else at_ms
    firings: list[Firing] = []
    for (name, queue), row in zip(due, rows, strict=True):
        raw = row[0]
        if raw is None:  # deleted meanwhile: fire.lua removes a stale index member
            firings.append(Firing(name, queue, "", "tick", "", ()))
            continue
        h = {k: v for k, v in zip(PLAN_FIELDS, row, strict=True) if v is not None}
        d = definitions.get(raw)
        if d is None:
            if len(definitions) > 10_000:
                definitions.clear()
            d = definitions[raw] = ScheduleDef.model_validate_json(raw)
        try:
            firings.append(plan_firing(name, h, d, now, store))
        except DtqError as exc:
            # The template was valid when it was stored, and is not under this process's
            # settings (a lower DTQ_MAX_ATTEMPTS, DTQ_MAX_PAYLOAD_BYTES): this schedule waits,
            # the others fire.
            refused.append((name, queue, exc))
    return firings


def prepare_calls(store: Store, firings: Sequence[Firing]) -> builtins.list[PreparedFiring]:
    """Each of ``firings`` with its fire.lua call, made now to be sent later (fire_due's
    ``planned``)."""
    s = store.settings
    return [(f, calls.fire_call(f, s, HISTORY_CAP, BUFFER_POLL_MS)) for f in firings]


async def fire_due(
    store: Store,
    due: Sequence[tuple[str, str]],
    definitions: dict[str, ScheduleDef],
    refused: builtins.list[tuple[str, str, DtqError]],
    skip: Collection[tuple[str, str]] = (),
    planned: Sequence[PreparedFiring] = (),
) -> builtins.list[tuple[Firing, FireReply]]:
    """Fire schedules ``due`` ((name, queue) pairs whose index score has come) but those in
    ``skip``: read each hash, plan (:func:`plan_due`), and send every fire.lua call in one
    round trip; a call that finds the schedule changed is planned and sent again (up to
    ``CAS_TRIES`` times). ``planned`` are firings planned earlier (by :func:`plan_due` for a
    time that has come now, with their calls: :func:`prepare_calls`), sent first as they are:
    one that is out of date is stale and planned again. Returns each call that ran and its
    reply; a schedule whose firing's task this process refuses (its template against the
    settings) is added to ``refused`` with the error, and not fired."""
    todo = [(name, queue) for name, queue in due if (name, queue) not in skip]
    done: list[tuple[Firing, FireReply]] = []
    firings = [f for f, _ in planned]
    prepared = [c for _, c in planned]
    for _ in range(CAS_TRIES):
        if todo:
            new = await plan_due(store, todo, definitions, refused)
            firings += new
            prepared += [c for _, c in prepare_calls(store, new)]
        if not firings:
            break
        replies = await calls.fire_calls(store, prepared)
        todo = []
        for f, reply in zip(firings, replies, strict=True):
            if isinstance(reply, Exception):
                raise reply
            if reply.kind == "stale":
                todo.append((f.name, f.queue))
            else:
                done.append((f, reply))
        firings, prepared = [], []
    return done


async def trigger_schedule(
    store: Store, name: str, *, key: str | None = None, audit: Audit | None = None
) -> Task:
    """Fire schedule ``name`` now, whatever its cursor, pause or overlap policy: a task with
    ``metadata.trigger = "manual"`` and ``scheduled_for`` = now. ``key`` deduplicates: a
    second trigger with the same key returns the first one's task (``duplicate=True``);
    without one, two triggers in the same millisecond are one."""
    queue = await _located(store, name)
    redis = store.redis
    for _ in range(CAS_TRIES):
        pipe = redis.pipeline(transaction=False)
        pipe.hgetall(keys.schedule(name, queue))
        pipe.execute_command("TIME")  # not .time(): a cluster pipeline refuses that name
        h, clock = await pipe.execute()
        if not h:
            break
        now = time_reply_ms(clock)
        d = ScheduleDef.model_validate_json(h["definition"])
        cand = _candidate(d, name, now, "trigger", store, manual=key or str(now))
        firing = Firing(
            name=name,
            queue=queue,
            rev=h.get("rev") or "0",
            mode="trigger",
            last_task_id=h.get("last_task_id") or "",
            candidates=[cand],
            audit=audit,
            task_type=d.task_type,
        )
        (reply,) = await calls.fire(store, [firing], HISTORY_CAP, BUFFER_POLL_MS)
        if isinstance(reply, Exception):
            raise reply
        if reply.kind == "stale":
            continue
        if reply.kind == "gone":
            break
        decision = reply.decisions[0]
        if decision.decision == "rejected":
            raise QueueFullError(
                f"schedule {name!r} not triggered: {decision.detail}", schedule=name
            )
        task = await store.get(decision.task_id)
        if decision.decision == "duplicate":
            task = task.model_copy(update={"duplicate": True})
        return task
    raise ScheduleNotFoundError(f"schedule {name!r} not found", schedule=name)


REMOVED_FROM_CODE = "removed from code"


async def sync_code_schedules(
    store: Store,
    declared: Mapping[str, ScheduleDef],
    task_types: Collection[str],
    *,
    audit: Audit | None = None,
) -> tuple[dict[str, str], builtins.list[str]]:
    """What a starting worker does with the schedules its code declares (``declared``): each
    is created or updated (source ``code``: a spec that did not change keeps its cursor, so a
    deploy neither fires nor loses a tick); then each schedule from code in Redis that
    ``declared`` lacks, whose task type is one of ``task_types`` (this worker's handlers, whose
    code would declare it), is paused with reason ``removed from code``: reported, not kept
    firing. Returns (name -> created | updated | unchanged, the names paused)."""
    outcomes: dict[str, str] = {}
    for name, d in declared.items():
        _, outcomes[name] = await put_schedule(store, name, d, source="code", audit=audit)
    paused: list[str] = []
    for s in await list_schedules(store):
        if (
            s.origin == "code"
            and s.name not in declared
            and s.definition.task_type in task_types
            and s.state != "paused"
            and await set_schedule_paused(
                store, s.name, True, reason=REMOVED_FROM_CODE, audit=audit
            )
        ):
            paused.append(s.name)
    return outcomes, paused
