"""What the routers share: the app state, the core's name and limit rules as parameter
validators, and identifier checks.

Identifiers from a URL are checked before they reach a Redis key: a task id is what the core
generates (32 hex digits) and a worker id is letters, digits, ``-`` and
``_``; anything else cannot exist, so it is a plain 404 rather than a read of some other key.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Path, Query, Request
from pydantic import AfterValidator, BaseModel, BeforeValidator

from dtq.api.ws import EventHub
from dtq.client import Queue
from dtq.config import WORKER_ID_RE, Settings
from dtq.errors import InvalidTaskError, TaskNotFoundError, WorkerNotFoundError
from dtq.metrics import Metrics
from dtq.models import (
    LIST_LIMIT_MAX,
    QUEUE_RE,
    TASK_ID_RE,
    TaskStatus,
    check_list_limit,
    check_queue_name,
    check_status,
)

__all__ = [
    "ApiState",
    "Limit",
    "QueueFilter",
    "QueueName",
    "State",
    "StatusFilter",
    "check_task_id",
    "check_worker_id",
    "core_rule",
    "get_state",
    "json_object",
]

T = TypeVar("T")


@dataclass
class ApiState:
    """Everything a request handler needs, on ``app.state.dtq``: the settings, the task types
    loaded at start (for the OpenAPI document before the Queue exists; the Queue applies them),
    the :class:`Queue` once the lifespan has connected it, the event hub and the metrics."""

    settings: Settings
    known_types: frozenset[str] | None
    payload_models: Mapping[str, type[BaseModel]]
    queue: Queue | None = None
    hub: EventHub | None = None
    metrics: Metrics = field(default_factory=Metrics)

    @property
    def q(self) -> Queue:
        if self.queue is None:
            raise RuntimeError("the app is not started (its lifespan has not run)")
        return self.queue


async def get_state(request: Request) -> ApiState:
    """Async on purpose: FastAPI runs a sync dependency in its thread pool, per request."""
    state: ApiState = request.app.state.dtq
    return state


State = Annotated[ApiState, Depends(get_state)]


def check_task_id(task_id: str) -> str:
    if not TASK_ID_RE.fullmatch(task_id):
        raise TaskNotFoundError(f"task {task_id[:64]!r} not found", task_id=task_id[:64])
    return task_id


def check_worker_id(worker_id: str) -> str:
    if not WORKER_ID_RE.fullmatch(worker_id):
        raise WorkerNotFoundError(f"worker {worker_id[:64]!r} not found", worker_id=worker_id[:64])
    return worker_id


def core_rule(
    check: Callable[[Any], T], *, before: bool = False
) -> AfterValidator | BeforeValidator:
    """A rule of the core (a function raising InvalidTaskError) as a parameter validator: a bad
    query or path value is 400 INVALID_REQUEST with the core's message. ``before``: the rule
    parses the raw value (the declared type then only documents it)."""

    def validate(value: Any) -> T:
        try:
            return check(value)
        except InvalidTaskError as exc:
            raise ValueError(exc.message) from None

    return BeforeValidator(validate) if before else AfterValidator(validate)


# The pattern and bounds are stated for the OpenAPI document; the core's rule checks them.
_QUEUE_SCHEMA: dict[str, Any] = {"pattern": QUEUE_RE.pattern, "maxLength": 64}

QueueName = Annotated[
    str,
    Path(description="A queue name", json_schema_extra=_QUEUE_SCHEMA),
    core_rule(check_queue_name),
]
QueueFilter = Annotated[
    str | None,
    Query(json_schema_extra=_QUEUE_SCHEMA),
    core_rule(lambda q: None if q is None else check_queue_name(q)),
]
StatusFilter = Annotated[
    TaskStatus | None,
    Query(),
    core_rule(lambda s: None if s is None else check_status(s), before=True),
]
Limit = Annotated[
    int,
    Query(json_schema_extra={"minimum": 1, "maximum": LIST_LIMIT_MAX}),
    core_rule(check_list_limit),
]


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or INVALID_TASK (never a 500 or a 422)."""

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        value = json.loads(raw, parse_constant=no_constants)
    except RecursionError:
        raise InvalidTaskError("request body: JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidTaskError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidTaskError("request body must be a JSON object")
    return value
