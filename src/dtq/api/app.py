"""The ASGI application: :func:`create_app` (the factory, ``uvicorn --factory
dtq.api:create_app``) and :func:`serve` (a blocking uvicorn run, for ``dtq api``/``dtq dev``).

The app is a thin layer over the core: every request goes through one :class:`dtq.client.Queue`,
which owns every rule (validation, registered types, payload models, limits); the API maps
them to HTTP. At start (the lifespan) it connects the Queue, ensures the ``workers`` group on
the default queue's streams, starts the WebSocket event hub, and warns when auth is off or
Redis is not set up for durability; at stop it closes them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, WebSocket
from fastapi.openapi.utils import get_openapi

from dtq import __version__, client
from dtq.api import (
    dashboard,
    routes_admin,
    routes_limits,
    routes_ops,
    routes_schedules,
    routes_tasks,
    routes_workflows,
)
from dtq.api.deps import ApiState
from dtq.api.errors import install_error_handlers, route_methods
from dtq.api.limits import BodyLimitMiddleware, RequestIdMiddleware, max_body_bytes
from dtq.api.ws import EventHub, serve_client
from dtq.config import Settings, describe_redis, load_settings
from dtq.connection import warn_durability
from dtq.log import configure_logging
from dtq.metrics import Metrics, count_commands
from dtq.scripts import Scripts
from dtq_tasks import load_task_types

__all__ = ["DtqApp", "create_app", "serve"]

log = logging.getLogger("dtq.api")

DEFAULT_QUEUE = "default"


class DtqApp(FastAPI):
    """FastAPI with dtq's OpenAPI tweaks: errors are 400 with our body, never 422."""

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema:
            return self.openapi_schema
        schema = get_openapi(
            title=self.title,
            version=self.version,
            description=self.description,
            routes=self.routes,
        )
        for path in schema.get("paths", {}).values():
            for op in path.values():
                if isinstance(op, dict):
                    op.get("responses", {}).pop("422", None)
        state = getattr(self.state, "dtq", None)
        if isinstance(state, ApiState):
            routes_tasks.refine_openapi(schema, state.settings, state.known_types)
        comps = schema.get("components", {}).get("schemas", {})
        comps.pop("HTTPValidationError", None)
        comps.pop("ValidationError", None)
        self.openapi_schema = schema
        return schema


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the dtq HTTP API; ``settings`` default to the environment (DTQ_*)."""
    settings = settings or load_settings()
    known_types, payload_models = load_task_types(settings)
    metrics = Metrics(known_types=known_types)
    metrics.add_redis_gauges(settings)
    state = ApiState(settings, known_types, payload_models, metrics=metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await _start(state)
        try:
            yield
        finally:
            await _stop(state)

    app = DtqApp(
        title="dtq",
        version=__version__,
        description=(
            "HTTP API of dtq, a distributed task queue on Redis Streams. "
            'Every error has the body {"error": {"code", "message", "details"}}.'
        ),
        lifespan=lifespan,
    )
    app.state.dtq = state
    install_error_handlers(app)
    routers = (
        routes_tasks.router,
        routes_workflows.router,
        routes_admin.router,
        routes_schedules.router,
        routes_limits.router,
        routes_ops.router,
        dashboard.router,
    )
    for router in routers:
        app.include_router(router)
    app.state.route_methods = route_methods(r for router in routers for r in router.routes)

    async def events(websocket: WebSocket) -> None:
        if state.hub is None:
            await websocket.close(code=1011, reason="the event hub is not running")
            return
        await serve_client(websocket, state.hub, websocket.query_params.multi_items())

    app.add_api_websocket_route(settings.ws_path, events, name="events")
    # Added last = outermost: the request id is set before the body limit can refuse.
    app.add_middleware(
        BodyLimitMiddleware,
        limit=max_body_bytes(settings.max_payload_bytes),
        on_refuse=lambda path: _body_refused(metrics, path),
    )
    app.add_middleware(RequestIdMiddleware)
    return app


async def _start(state: ApiState) -> None:
    s = state.settings
    if not s.api_key:
        log.warning(
            "DTQ_API_KEY is not set: destructive operations are open to anyone who can reach "
            "the API (local development mode)"
        )
    if state.known_types is None:
        log.warning("DTQ_TASK_MODULES is empty: any well-formed task_type is accepted")
    if not any(importlib.util.find_spec(m) for m in ("websockets", "wsproto")):
        log.warning(
            "neither 'websockets' nor 'wsproto' is installed: uvicorn cannot serve the "
            "WebSocket events at %s (pip install websockets)",
            s.ws_path,
        )
    queue = await client.connect(
        settings=s,
        known_types=state.known_types,
        payload_models=state.payload_models,
        scripts=Scripts(on_call=state.metrics.script_call),
    )
    count_commands(queue.redis, state.metrics.redis_op)
    try:
        await queue.ensure_groups(DEFAULT_QUEUE)
        await warn_durability(queue.redis, log)
        hub = EventHub(queue.redis)
        await hub.start()
    except BaseException:
        await queue.close()
        raise
    state.queue, state.hub = queue, hub
    log.info("dtq API ready (Redis %s, events on %s)", describe_redis(s), s.ws_path)


def _body_refused(metrics: Metrics, path: str) -> None:
    if path == "/api/v1/tasks":  # a submission refused before its body was read
        metrics.ingest_rejected(None, "PAYLOAD_TOO_LARGE")


async def _stop(state: ApiState) -> None:
    if state.hub is not None:
        await state.hub.stop()
        state.hub = None
    if state.queue is not None:
        await state.queue.close()
        state.queue = None


def serve(settings: Settings, host: str | None = None, port: int | None = None) -> None:
    """Run the API with uvicorn until interrupted (blocking). Logging is dtq's (DTQ_LOG_JSON,
    DTQ_LOG_LEVEL); uvicorn's own loggers go through it."""
    configure_logging(settings, "api")
    uvicorn.run(
        create_app(settings),
        host=host or settings.api_host,
        port=port or settings.api_port,
        log_level=settings.log_level.lower(),
        log_config=None,
        timeout_graceful_shutdown=5,
    )
