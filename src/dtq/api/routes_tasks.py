"""Task routes (contract section 11): submit, get, list, cancel; extensions history, expire."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from sse_starlette import EventSourceResponse

from dtq.api import sse
from dtq.api.auth import RequireOperator
from dtq.api.deps import (
    ApiState,
    Limit,
    QueueFilter,
    State,
    StatusFilter,
    check_task_id,
    json_object,
)
from dtq.api.errors import ApiError, responses
from dtq.client import Change, Queue
from dtq.config import Settings
from dtq.errors import DtqError, ReplicationTimeoutError, TaskRunningError, WaitTimeout
from dtq.models import (
    IDEMPOTENCY_KEY_MAX,
    MAX_DELAY_S,
    QUEUE_RE,
    TASK_TYPE_RE,
    HistoryEntry,
    SubmitRequest,
    Task,
    TaskStatus,
)

__all__ = [
    "LONG_POLL_MAX_S",
    "ChangeResult",
    "HistoryResponse",
    "TaskList",
    "refine_openapi",
    "router",
    "submit_body_schema",
]

router = APIRouter(prefix="/api/v1", tags=["tasks"])

LONG_POLL_MAX_S = 30.0
"""The longest ``?wait=S`` of a task read: long enough to save most polling, short enough for
proxies' idle timeouts and for a client to notice a dead connection."""


class TaskList(BaseModel):
    tasks: list[Task]


class HistoryResponse(BaseModel):
    task_id: str
    history: list[HistoryEntry]


class ChangeResult(BaseModel):
    """The outcome of a state change requested through the API."""

    task_id: str
    status: TaskStatus
    previous_status: TaskStatus


# SubmitRequest's rule for idempotency keys, as far as JSON Schema states it: 1-256 characters,
# no control characters (the model also refuses the other non-printable ones: str.isprintable).
_IDEMPOTENCY_KEY_RULES = {
    "minLength": 1,
    "maxLength": IDEMPOTENCY_KEY_MAX,
    "pattern": "^[^\\x00-\\x1f\\x7f-\\x9f]*$",
}


def submit_body_schema(
    settings: Settings | None = None, known_types: Collection[str] | None = None
) -> dict[str, Any]:
    """The submit body's JSON schema with the rules of :meth:`SubmitRequest.build` that JSON
    Schema can state, so that a schema-valid body is accepted and an invalid one refused:
    the name patterns, the registered task types and the DTQ_MAX_ATTEMPTS cap (when the
    settings and the registry are known), the recognised ``metadata.ttl_seconds``, and the
    fields that exclude each other (a null counts as absent, as in the model). Not stated:
    the payload and metadata byte limits (413 and 400) and ``isprintable`` beyond control
    characters for idempotency keys."""
    schema = SubmitRequest.model_json_schema()
    schema["additionalProperties"] = False
    props = schema["properties"]
    props["task_type"].update(pattern=TASK_TYPE_RE.pattern, minLength=1, maxLength=128)
    if known_types is not None:
        props["task_type"]["enum"] = sorted(known_types)
    props["queue"].update(pattern=QUEUE_RE.pattern, maxLength=64)
    props["idempotency_key"]["anyOf"][0].update(_IDEMPOTENCY_KEY_RULES)
    if settings is not None:
        props["max_attempts"]["maximum"] = settings.max_attempts
    props["metadata"]["properties"] = {
        "ttl_seconds": {
            "anyOf": [{"type": "number", "minimum": 0, "maximum": MAX_DELAY_S}, {"type": "null"}]
        }
    }

    def both(a: str, a_schema: dict[str, Any], b: str, b_schema: dict[str, Any]) -> Any:
        return {"not": {"required": [a, b], "properties": {a: a_schema, b: b_schema}}}

    number, string = {"type": "number"}, {"type": "string"}
    meta_ttl = {
        "type": "object",
        "required": ["ttl_seconds"],
        "properties": {"ttl_seconds": number},
    }
    schema["allOf"] = [
        both("expires_at", string, "ttl_seconds", number),
        both("expires_at", string, "metadata", meta_ttl),
        both("ttl_seconds", number, "metadata", meta_ttl),
        both("schedule_at", string, "delay_seconds", {"type": "number", "exclusiveMinimum": 0}),
    ]
    return schema


def refine_openapi(
    schema: dict[str, Any], settings: Settings, known_types: Collection[str] | None
) -> None:
    """Put the settings' and the registry's rules into a built OpenAPI document's submit
    operation (its body and its Idempotency-Key header). Payload models are not stated: they
    validate in pydantic's lax mode (``"1.5"`` for a float), which JSON Schema cannot say."""
    op = schema.get("paths", {}).get("/api/v1/tasks", {}).get("post")
    if op is None:
        return
    content = op["requestBody"]["content"]["application/json"]
    content["schema"] = submit_body_schema(settings, known_types)
    for param in op.get("parameters", []):
        if param.get("name") == "Idempotency-Key":
            param["schema"]["anyOf"][0].update(_IDEMPOTENCY_KEY_RULES)


_SUBMIT_OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": submit_body_schema()}},
    }
}


@router.post(
    "/tasks",
    status_code=202,
    response_model=Task,
    summary="Submit a task",
    responses={
        200: {"model": Task, "description": "Idempotent replay: the stored task, duplicate=true"},
        202: {"description": "Accepted: the new task"},
        **responses(400, 404, 409, 429),
    },
    openapi_extra=_SUBMIT_OPENAPI,
)
async def submit_task(
    request: Request,
    state: State,
    idempotency_key: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            description="Wins over the body's idempotency_key; scope is (queue, key).",
        ),
    ] = None,
) -> JSONResponse:
    queue: str | None = None  # for the rejection metric, once the body is read
    try:
        fields = json_object(await request.body())
        given = fields.get("queue", "default")
        queue = given if isinstance(given, str) else None
        if idempotency_key is not None:
            if fields.get("idempotency_key") is not None:
                # The header wins, but a body key that breaks the rules is still bad input.
                state.q.parse_request(fields)
            fields["idempotency_key"] = idempotency_key
        task = await state.q.submit_fields(fields)
    except DtqError as exc:
        state.metrics.ingest_rejected(queue, exc.code)
        if isinstance(exc, ReplicationTimeoutError) and isinstance(exc.task, Task):
            _count_submitted(state, exc.task)  # the primary accepted it all the same
        raise
    _count_submitted(state, task)
    return JSONResponse(
        task.public_dict(),
        status_code=200 if task.duplicate else 202,
        headers={"Location": f"/api/v1/tasks/{task.task_id}"},
    )


def _count_submitted(state: ApiState, task: Task) -> None:
    if task.duplicate:
        return
    ttl_s = None
    if task.expires_at is not None:
        ttl_s = (task.expires_at - task.created_at).total_seconds()
    state.metrics.task_submitted(task.queue, task.task_type, ttl_s)
    if task.status == TaskStatus.EXPIRED:  # ttl 0: expired at ingest, never runs
        state.metrics.task_completed(task.queue, task.task_type, "expired")


WaitParam = Annotated[
    float | None,
    Query(
        gt=0,
        le=LONG_POLL_MAX_S,
        description=(
            "Extension, long poll: answer as soon as the task is terminal, or with the task "
            f"as it is after this many seconds (0 < wait <= {LONG_POLL_MAX_S:g})"
        ),
    ),
]
CLIENT_CLOSED = 499  # the client closed the connection: nobody reads the answer


@router.get("/tasks/{task_id}", response_model=Task, responses=responses(400, 404))
async def get_task(
    task_id: str, state: State, request: Request, wait: WaitParam = None
) -> Task | Response:
    """The task with its execution metadata and result. With ``wait``, a long poll: 200 with
    the task once it is terminal, or as it is when ``wait`` seconds have passed (or the
    server is stopping)."""
    check_task_id(task_id)
    if wait is None:
        return await state.q.get(task_id)
    return await _long_poll(request, state.q, task_id, wait)


async def _long_poll(request: Request, q: Queue, task_id: str, wait_s: float) -> Task | Response:
    """``q.wait`` raced against the client leaving (the wait is given up at once: nobody
    reads the answer, 499 as nginx logs it) and the server stopping (an answer with the task
    as it is, before uvicorn's graceful-shutdown timeout cancels the request)."""
    waiting = asyncio.ensure_future(q.wait(task_id, timeout=wait_s))
    gone = asyncio.ensure_future(sse.client_gone(request))
    stopping = asyncio.ensure_future(sse.server_stopping())
    racers = (waiting, gone, stopping)
    try:
        await asyncio.wait(racers, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for racer in racers:
            racer.cancel()
        await asyncio.gather(*racers, return_exceptions=True)
    if not waiting.cancelled():
        try:
            return waiting.result()
        except WaitTimeout as exc:
            return exc.task if exc.task is not None else await q.get(task_id)
    if gone.done() and not gone.cancelled():
        return Response(status_code=CLIENT_CLOSED)
    return await q.get(task_id)


_EVENT_STREAM_OPENAPI: dict[int | str, dict[str, Any]] = {
    200: {
        "description": (
            "A text/event-stream: one message per event of the task (id = event_id, event = "
            "type, data = the event JSON), ending after its terminal event"
        ),
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    },
    **responses(404),
}


@router.get(
    "/tasks/{task_id}/events",
    response_class=EventSourceResponse,
    responses=_EVENT_STREAM_OPENAPI,
)
async def task_events(task_id: str, state: State) -> EventSourceResponse:
    """Extension: the task's events as server-sent events, ending after its terminal event;
    a task that has already ended gets one event made from its stored state (docs/api.md)."""
    check_task_id(task_id)
    if state.hub is None:
        raise ApiError("NOT_READY", "the event hub is not running")
    return await sse.open_task_stream(state.hub, state.q, task_id)


@router.get("/tasks", response_model=TaskList, responses=responses(400))
async def list_tasks(
    state: State,
    queue: QueueFilter = None,
    status: StatusFilter = None,
    task_type: Annotated[str | None, Query(max_length=128)] = None,
    limit: Limit = 50,
) -> TaskList:
    """Recent tasks first, filtered by queue, status and (extension) task_type."""
    tasks = await state.q.list(queue=queue, status=status, task_type=task_type, limit=limit)
    return TaskList(tasks=tasks)


@router.post(
    "/tasks/{task_id}/cancel",
    status_code=202,
    response_model=ChangeResult,
    responses=responses(401, 403, 404, 409, 410),
)
async def cancel_task(task_id: str, state: State, op: RequireOperator) -> ChangeResult:
    """202 cancelled (it had not started); 409 TASK_RUNNING (cancellation requested, the
    worker stops it); 410 TASK_TERMINAL; 404."""
    check_task_id(task_id)
    try:
        change = await state.q.cancel_change(task_id, audit=op.audit())
    except TaskRunningError:
        op.log("cancel", task_id, outcome="requested")
        raise
    return _changed(state, op, "cancel", change, outcome="cancelled")


@router.get("/tasks/{task_id}/history", response_model=HistoryResponse, responses=responses(404))
async def task_history(task_id: str, state: State) -> HistoryResponse:
    """Extension (DESIGN 7): every state change of the task, oldest first."""
    history = await state.q.history(check_task_id(task_id))
    return HistoryResponse(task_id=task_id, history=history)


@router.post(
    "/tasks/{task_id}/expire",
    response_model=ChangeResult,
    responses=responses(401, 403, 404, 409),
)
async def expire_task(task_id: str, state: State, op: RequireOperator) -> ChangeResult:
    """Extension (DESIGN 6): mark a task that has not started EXPIRED now; any other status is
    409 INVALID_TRANSITION naming it."""
    change = await state.q.mark_expired_change(check_task_id(task_id), audit=op.audit())
    return _changed(state, op, "expire", change)


def _changed(
    state: ApiState, op: RequireOperator, action: str, change: Change, **log_fields: Any
) -> ChangeResult:
    """Log and count a state change this process made, and say what it was."""
    task = change.task
    op.log(action, task.task_id, **log_fields, previous_status=change.previous_status.value)
    state.metrics.task_completed(task.queue, task.task_type, task.status.value)
    return ChangeResult(
        task_id=task.task_id, status=task.status, previous_status=change.previous_status
    )
