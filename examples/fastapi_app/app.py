"""A FastAPI app whose requests wait for their task: ``POST /thumbnails`` submits
``make_thumbnail`` and awaits its result with ``q.result(task_id, timeout=...)``.

- 200: the thumbnail (the task's result), with its ``task_id``;
- 504: not done within ``?wait=`` seconds (default 10): the task goes on, the body and the
  ``Location`` header name ``GET /thumbnails/{task_id}``, where the client finds it later;
- 502: the task failed (its error class and message), or was cancelled or expired;
- 422: a body that is not a :class:`~examples.fastapi_app.tasks.ThumbnailRequest`.

Run it, with Redis at ``DTQ_REDIS_URL`` and a worker (``tasks.py`` says how)::

    uvicorn --factory examples.fastapi_app.app:create_app
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse

from dtq import (
    Queue,
    Settings,
    TaskCancelled,
    TaskExpired,
    TaskFailed,
    TaskNotFound,
    WaitTimeout,
    connect,
    load_settings,
)
from examples.fastapi_app.tasks import QUEUE, ThumbnailRequest

WAIT_S = 10.0  # how long a request waits for its thumbnail, unless it asks otherwise
MAX_WAIT_S = 30.0
TTL_S = 300  # a thumbnail no worker started within 5 minutes is not worth making any more


def create_app(settings: Settings | None = None) -> FastAPI:
    """The app; it connects to Redis at start (``settings``, else ``DTQ_*`` from the
    environment, read then, not at import) and closes the connection at shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.queue = await connect(settings=settings or load_settings())
        try:
            yield
        finally:
            await app.state.queue.close()

    app = FastAPI(title="thumbnails (a dtq example)", lifespan=lifespan)

    @app.post("/thumbnails")
    async def create_thumbnail(
        body: ThumbnailRequest,
        request: Request,
        wait: float = Query(WAIT_S, gt=0, le=MAX_WAIT_S),
    ) -> JSONResponse:
        q: Queue = request.app.state.queue
        task = await q.submit("make_thumbnail", body.model_dump(), queue=QUEUE, ttl_seconds=TTL_S)
        tid = task.task_id
        try:
            result = await q.result(tid, timeout=wait)
        except WaitTimeout as exc:
            status = exc.task.status.value if exc.task else task.status.value
            later = f"/thumbnails/{tid}"
            body_504 = {"task_id": tid, "status": status, "detail": f"not done yet: GET {later}"}
            return JSONResponse(body_504, status_code=504, headers={"Location": later})
        except TaskFailed as exc:
            failed = {"error_class": exc.error_class, "error_message": exc.error_message}
            return JSONResponse(_state(exc.task.task_id, exc.task.status.value, failed), 502)
        except (TaskCancelled, TaskExpired) as exc:
            return JSONResponse(_state(exc.task.task_id, exc.task.status.value), 502)
        return JSONResponse({"task_id": tid, **result})

    @app.get("/thumbnails/{task_id}")
    async def get_thumbnail(task_id: str, request: Request) -> JSONResponse:
        q: Queue = request.app.state.queue
        try:
            task = await q.get(task_id)
        except TaskNotFound:
            return JSONResponse({"task_id": task_id, "detail": "no such task"}, 404)
        found: dict[str, Any] = {"result": task.result} if task.result is not None else {}
        if task.error_class:
            found.update(error_class=task.error_class, error_message=task.error_message)
        return JSONResponse(_state(task_id, task.status.value, found))

    return app


def _state(task_id: str, status: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"task_id": task_id, "status": status, **(extra or {})}
