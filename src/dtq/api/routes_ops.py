"""Operational routes at the root: ``/health`` (process alive), ``/ready`` (Redis answers and
the ``workers`` group exists on the default queue's streams; 503 naming the failing
dependency otherwise) and ``/metrics`` (Prometheus text format)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from redis.exceptions import RedisError

from dtq import keys
from dtq.api.deps import State
from dtq.api.errors import ApiError, ErrorBody

__all__ = ["Health", "Ready", "router"]

router = APIRouter(tags=["operations"])

DEFAULT_QUEUE = "default"


class Health(BaseModel):
    status: str


class Ready(BaseModel):
    status: str
    checks: dict[str, str]


@router.get("/health", response_model=Health)
async def health() -> Health:
    """The process is alive (no dependency is checked)."""
    return Health(status="ok")


@router.get(
    "/ready",
    response_model=Ready,
    responses={503: {"model": ErrorBody, "description": "NOT_READY: details name the failure"}},
)
async def ready(state: State) -> Ready:
    """Redis answers PING and the consumer group exists on the default queue's streams."""
    checks: dict[str, str] = {}
    redis = state.q.redis
    try:
        await redis.ping()
        checks["redis"] = "ok"
    except (RedisError, OSError) as exc:
        checks["redis"] = f"unreachable: {exc}"
        checks["consumer_groups"] = "not checked"
        raise ApiError(
            "NOT_READY", "redis is unreachable", dependency="redis", checks=checks
        ) from None
    missing = await state.q.missing_groups(DEFAULT_QUEUE)
    if missing:
        checks["consumer_groups"] = f"missing on {', '.join(missing)}"
        raise ApiError(
            "NOT_READY",
            f"consumer group {keys.CONSUMER_GROUP!r} is missing on {len(missing)} stream(s)",
            dependency="consumer_groups",
            checks=checks,
        )
    checks["consumer_groups"] = "ok"
    return Ready(status="ready", checks=checks)


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}},
)
async def metrics(state: State) -> Response:
    """Prometheus metrics of this process, and the gauges read from Redis at this scrape
    (queue depth and pending, retry schedule, DLQ, workers, near-expiration)."""
    await state.metrics.refresh(state.q.redis)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
