"""Operator routes (contract section 11): queues, workers, dead letters, pause and resume;
extensions: queue purge and the audit log. Destructive ones need the operator (auth.py) and
are audited atomically by the scripts behind :class:`dtq.client.Queue` and logged here."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

from dtq.api.auth import RequireOperator
from dtq.api.deps import Limit, QueueName, State, check_task_id, check_worker_id
from dtq.api.errors import responses
from dtq.errors import NotInDeadLetterError, TaskNotFoundError
from dtq.models import Task
from dtq.views import AuditEntry, DeadLetter, QueueStats, WorkerInfo

__all__ = [
    "AuditLog",
    "DeadLetterList",
    "Discarded",
    "PauseResult",
    "Purged",
    "QueueList",
    "QueuePurged",
    "WorkerList",
    "check_dlq_id",
    "router",
]

router = APIRouter(prefix="/api/v1", tags=["operations"])


class QueueList(BaseModel):
    queues: list[QueueStats]


class WorkerList(BaseModel):
    workers: list[WorkerInfo]


class DeadLetterList(BaseModel):
    dead_letters: list[DeadLetter]


class Discarded(BaseModel):
    task_id: str
    discarded: bool


class Purged(BaseModel):
    purged: int


class PauseResult(BaseModel):
    queue: str
    paused: bool
    changed: bool


class QueuePurged(BaseModel):
    queue: str
    cancelled: int


class AuditLog(BaseModel):
    entries: list[AuditEntry]


# -- queues ---------------------------------------------------------------------------------------


@router.get("/queues", response_model=QueueList, responses=responses())
async def list_queues(state: State) -> QueueList:
    """Every known queue: depth, pending, waiting, paused, retry_scheduled (docs/api.md labels
    each value exact or approximate)."""
    return QueueList(queues=await state.q.all_queue_stats())


@router.get("/queues/{queue}", response_model=QueueStats, responses=responses(400))
async def get_queue(queue: QueueName, state: State) -> QueueStats:
    """One queue, with dlq_depth and workers_active."""
    return await state.q.queue_stats(queue)


async def _set_paused(state: State, op: RequireOperator, queue: str, paused: bool) -> PauseResult:
    if paused:
        changed = await state.q.pause_queue(queue, audit=op.audit())
    else:
        changed = await state.q.resume_queue(queue, audit=op.audit())
    op.log("queue_pause" if paused else "queue_resume", queue, changed=changed)
    return PauseResult(queue=queue, paused=paused, changed=changed)


@router.post("/queue/{queue}/pause", response_model=PauseResult, responses=responses(400, 401, 403))
async def pause_queue(queue: QueueName, state: State, op: RequireOperator) -> PauseResult:
    """Workers stop taking new tasks from the queue; running tasks finish."""
    return await _set_paused(state, op, queue, True)


@router.post(
    "/queue/{queue}/resume", response_model=PauseResult, responses=responses(400, 401, 403)
)
async def resume_queue(queue: QueueName, state: State, op: RequireOperator) -> PauseResult:
    return await _set_paused(state, op, queue, False)


@router.post("/queue/{queue}/purge", response_model=QueuePurged, responses=responses(400, 401, 403))
async def purge_queue(queue: QueueName, state: State, op: RequireOperator) -> QueuePurged:
    """Extension: cancel every task of the queue that has not started (metadata.purged=true);
    running tasks are untouched."""
    cancelled = await state.q.purge_queue(queue, audit=op.audit())
    op.log("purge", queue, cancelled=cancelled)
    return QueuePurged(queue=queue, cancelled=cancelled)


# -- workers --------------------------------------------------------------------------------------


@router.get("/workers", response_model=WorkerList, responses=responses())
async def list_workers(state: State) -> WorkerList:
    """Workers with their liveness, from the age of their last heartbeat."""
    return WorkerList(workers=await state.q.workers())


@router.get("/workers/{worker_id}", response_model=WorkerInfo, responses=responses(404))
async def get_worker(worker_id: str, state: State) -> WorkerInfo:
    return await state.q.worker(check_worker_id(worker_id))


# -- dead letters ---------------------------------------------------------------------------------


@router.get("/dlq", response_model=DeadLetterList, responses=responses(400))
async def list_dead_letters(state: State, limit: Limit = 50) -> DeadLetterList:
    """The most recent dead letters first."""
    return DeadLetterList(dead_letters=await state.q.dlq_list(limit))


@router.post("/dlq/purge", response_model=Purged, responses=responses(401, 403))
async def purge_dead_letters(state: State, op: RequireOperator) -> Purged:
    """Trim the dead-letter stream to 0 (the task hashes stay DEAD_LETTERED)."""
    purged = await state.q.purge_dead_letters(audit=op.audit())
    op.log("dlq_purge", None, purged=purged)
    return Purged(purged=purged)


@router.get("/dlq/{task_id}", response_model=DeadLetter, responses=responses(404))
async def get_dead_letter(task_id: str, state: State) -> DeadLetter:
    """Extension: one dead letter with its failure fields; 404 NOT_IN_DLQ."""
    return await state.q.dlq_get(check_dlq_id(task_id))


@router.post("/dlq/{task_id}/requeue", response_model=Task, responses=responses(401, 403, 404, 409))
async def requeue_dead_letter(task_id: str, state: State, op: RequireOperator) -> Task:
    """Back to QUEUED with attempt 0; earlier attempts kept in metadata.previous_attempts; the
    entry leaves the DLQ stream. 404 TASK_NOT_FOUND or NOT_IN_DLQ (any other status, an expired
    or discarded task); 409 INVALID_TRANSITION when its deadline has passed."""
    task = await state.q.requeue_dead_letter(check_task_id(task_id), audit=op.audit())
    op.log("dlq_requeue", task_id)
    return task


@router.post("/dlq/{task_id}/discard", response_model=Discarded, responses=responses(401, 403, 404))
async def discard_dead_letter(task_id: str, state: State, op: RequireOperator) -> Discarded:
    """Remove the entry from the DLQ stream; the task stays DEAD_LETTERED with
    metadata.discarded=true (never destroyed)."""
    await state.q.discard_dead_letter(check_task_id(task_id), audit=op.audit())
    op.log("dlq_discard", task_id)
    return Discarded(task_id=task_id, discarded=True)


def check_dlq_id(task_id: str) -> str:
    """GET /dlq/{task_id}'s id: a malformed one is NOT_IN_DLQ, as an unknown one is."""
    try:
        return check_task_id(task_id)
    except TaskNotFoundError:
        raise NotInDeadLetterError(
            f"task {task_id[:64]!r} is not in the dead-letter queue", task_id=task_id[:64]
        ) from None


# -- audit ----------------------------------------------------------------------------------------


@router.get("/audit", response_model=AuditLog, responses=responses(400))
async def audit_log(state: State, limit: Limit = 50) -> AuditLog:
    """Extension: the most recent operator actions (dtq:stream:audit)."""
    return AuditLog(entries=await state.q.audit_log(limit))
