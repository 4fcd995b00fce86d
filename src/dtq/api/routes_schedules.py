"""Schedule routes (docs/schedules.md, docs/api.md): create or update, list, get with the next
fire times, delete, pause, resume and trigger. Every rule is the core's
(:class:`dtq.client.Queue`'s schedule methods); the changes need the operator (auth.py), are
audited atomically by the scripts behind them and logged here.

A schedule name follows the queue-name rules; a name that breaks them is 400 INVALID_REQUEST
on every route, as a bad queue name is."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Path, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from dtq.api.auth import RequireOperator
from dtq.api.deps import Limit, State, core_rule, json_object
from dtq.api.errors import responses
from dtq.errors import InvalidTaskError
from dtq.models import QUEUE_RE, Task
from dtq.schedules import Schedule, ScheduleDef, check_schedule_name

__all__ = [
    "NEXT_MAX",
    "TRIGGER_KEY_MAX",
    "ScheduleChanged",
    "ScheduleDetail",
    "ScheduleList",
    "SchedulePut",
    "check_trigger_key",
    "router",
    "schedule_body_schema",
]

router = APIRouter(prefix="/api/v1", tags=["schedules"])

NEXT_MAX = 100  # next fire times one GET shows at most
# A manual firing's idempotency key is ``schedule:<name>:manual:<key>``: with a name of 64
# characters, a key of up to 160 keeps it within the 256 of any idempotency key.
TRIGGER_KEY_MAX = 160


class SchedulePut(Schedule):
    """The schedule as stored after a PUT, and what the PUT did."""

    outcome: Literal["created", "updated", "unchanged"]


class ScheduleDetail(Schedule):
    """One schedule with its history and its next fire times."""

    next_fire_times: list[datetime]


class ScheduleChanged(Schedule):
    """The schedule after a pause or a resume; ``changed`` is false when it already was."""

    changed: bool


class ScheduleList(BaseModel):
    schedules: list[Schedule]


ScheduleName = Annotated[
    str,
    Path(
        description="A schedule name (the queue-name rules)",
        json_schema_extra={"pattern": QUEUE_RE.pattern, "maxLength": 64},
    ),
    core_rule(check_schedule_name),
]


def check_trigger_key(key: str | None) -> str | None:
    """A manual firing's deduplication key: 1 to ``TRIGGER_KEY_MAX`` printable characters."""
    if key is not None and not (0 < len(key) <= TRIGGER_KEY_MAX and key.isprintable()):
        raise InvalidTaskError(
            f"the trigger key must be 1-{TRIGGER_KEY_MAX} printable characters",
            field="Idempotency-Key",
        )
    return key


_KEY_SCHEMA: dict[str, Any] = {
    "minLength": 1,
    "maxLength": TRIGGER_KEY_MAX,
    "pattern": "^[^\\x00-\\x1f\\x7f-\\x9f]*$",
}


def schedule_body_schema() -> dict[str, Any]:
    """The PUT body's JSON schema: :class:`ScheduleDef` with the name rules JSON Schema can
    state. The spec rules (a valid cron expression or interval, a known zone, exactly one of
    cron and every) are the core's, answered 400 INVALID_SCHEDULE."""
    schema = ScheduleDef.model_json_schema()
    schema["additionalProperties"] = False
    props = schema["properties"]
    props["queue"].update(pattern=QUEUE_RE.pattern, maxLength=64)
    return schema


_PUT_OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": schedule_body_schema()}},
    }
}


@router.put(
    "/schedules/{name}",
    response_model=SchedulePut,
    summary="Create or update a schedule",
    responses={
        200: {"model": SchedulePut, "description": "Updated, or unchanged (the same definition)"},
        201: {"model": SchedulePut, "description": "Created"},
        **responses(400, 401, 403),
    },
    openapi_extra=_PUT_OPENAPI,
)
async def put_schedule(
    name: ScheduleName, request: Request, state: State, op: RequireOperator
) -> JSONResponse:
    """The body is the definition (docs/schedules.md): ``cron`` (+ ``tz``) or ``every``, the
    task template and the policies. An update whose spec changed restarts from now; one that
    did not keeps its cursor. 400 INVALID_SCHEDULE for a bad spec, INVALID_TASK or
    UNKNOWN_TASK_TYPE for a bad template."""
    fields = json_object(await request.body())
    schedule, outcome = await state.q.put_schedule(name, fields, audit=op.audit())
    op.log("schedule_put", name, outcome=outcome)
    body = SchedulePut(**schedule.model_dump(), outcome=outcome)
    return JSONResponse(
        body.model_dump(mode="json"),
        status_code=201 if outcome == "created" else 200,
        headers={"Location": f"/api/v1/schedules/{name}"},
    )


@router.get("/schedules", response_model=ScheduleList, responses=responses(400))
async def list_schedules(state: State, limit: Limit = 100) -> ScheduleList:
    """Every schedule by next fire time (paused and ended ones last), without history."""
    return ScheduleList(schedules=await state.q.list_schedules(limit))


@router.get("/schedules/{name}", response_model=ScheduleDetail, responses=responses(400, 404))
async def get_schedule(
    name: ScheduleName,
    state: State,
    next: Annotated[int, Query(ge=1, le=NEXT_MAX, description="How many next fire times")] = 5,
) -> ScheduleDetail:
    """The schedule, its history (newest first) and its next ``next`` fire times ([] once it
    has ended). 404 SCHEDULE_NOT_FOUND."""
    schedule = await state.q.get_schedule(name)
    times = await state.q.next_fire_times(name, next)
    return ScheduleDetail(**schedule.model_dump(), next_fire_times=times)


@router.delete(
    "/schedules/{name}",
    status_code=204,
    response_class=Response,
    responses={204: {"description": "Deleted, with its keys"}, **responses(400, 401, 403, 404)},
)
async def delete_schedule(name: ScheduleName, state: State, op: RequireOperator) -> Response:
    """The schedule and its keys are removed; the tasks it fired stay."""
    await state.q.delete_schedule(name, audit=op.audit())
    op.log("schedule_delete", name)
    return Response(status_code=204)


async def _set_paused(
    state: State, op: RequireOperator, name: str, paused: bool
) -> ScheduleChanged:
    if paused:
        changed = await state.q.pause_schedule(name, audit=op.audit())
    else:
        changed = await state.q.resume_schedule(name, audit=op.audit())
    op.log("schedule_pause" if paused else "schedule_resume", name, changed=changed)
    schedule = await state.q.get_schedule(name)
    return ScheduleChanged(**schedule.model_dump(), changed=changed)


@router.post(
    "/schedules/{name}/pause",
    response_model=ScheduleChanged,
    responses=responses(400, 401, 403, 404),
)
async def pause_schedule(name: ScheduleName, state: State, op: RequireOperator) -> ScheduleChanged:
    """The schedule stops firing (its ticks are decided when it is resumed)."""
    return await _set_paused(state, op, name, True)


@router.post(
    "/schedules/{name}/resume",
    response_model=ScheduleChanged,
    responses=responses(400, 401, 403, 404),
)
async def resume_schedule(name: ScheduleName, state: State, op: RequireOperator) -> ScheduleChanged:
    """The schedule goes on from now: the ticks of the pause are decided by its catch-up policy
    (the default ``latest`` fires the most recent one once)."""
    return await _set_paused(state, op, name, False)


@router.post(
    "/schedules/{name}/trigger",
    status_code=201,
    response_model=Task,
    responses={
        200: {"model": Task, "description": "A replayed key: the first trigger's task, duplicate"},
        201: {"description": "Fired: the new task"},
        **responses(400, 401, 403, 404, 429),
    },
)
async def trigger_schedule(
    name: ScheduleName,
    state: State,
    op: RequireOperator,
    idempotency_key: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            description="Deduplicates manual firings of this schedule; wins over ?key=",
            json_schema_extra=_KEY_SCHEMA,
        ),
    ] = None,
    key: Annotated[
        str | None,
        Query(description="The same as the Idempotency-Key header", json_schema_extra=_KEY_SCHEMA),
    ] = None,
) -> JSONResponse:
    """Fire the schedule now, whatever its cursor, pause or overlap policy: a task with
    ``metadata.trigger = "manual"``. With a key, a second trigger answers 200 with the first
    one's task (``duplicate: true``)."""
    given = check_trigger_key(idempotency_key if idempotency_key is not None else key)
    task = await state.q.trigger_schedule(name, key=given, audit=op.audit())
    op.log("schedule_trigger", name, task_id=task.task_id, duplicate=task.duplicate)
    if not task.duplicate:
        ttl_s = None
        if task.expires_at is not None:
            ttl_s = (task.expires_at - task.created_at).total_seconds()
        state.metrics.task_submitted(task.queue, task.task_type, ttl_s)
    return JSONResponse(
        task.public_dict(),
        status_code=200 if task.duplicate else 201,
        headers={"Location": f"/api/v1/tasks/{task.task_id}"},
    )
