"""What the routers share: the app state and identifier checks.

Identifiers from a URL are checked before they reach a Redis key: a task id is what the core
generates (32 hex digits, ``dtq.store.new_id``) and a worker id is letters, digits, ``-`` and
``_``; anything else cannot exist, so it is a plain 404 rather than a read of some other key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request
from pydantic import BaseModel

from dtq.api.ws import EventHub
from dtq.client import Queue
from dtq.config import Settings
from dtq.errors import TaskNotFoundError, WorkerNotFoundError
from dtq.metrics import Metrics
from dtq.store import Store

__all__ = ["ApiState", "State", "check_task_id", "check_worker_id", "get_state"]

TASK_ID_RE = re.compile(r"[0-9a-f]{32}")
WORKER_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass
class ApiState:
    """Everything a request handler needs, on ``app.state.dtq``."""

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

    @property
    def store(self) -> Store:
        return self.q.store


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
