"""One error body everywhere: ``{"error": {"code", "message", "details"}}``.

Each :class:`dtq.errors.DtqError` leaf maps by its ``code`` to one HTTP status (the table in
:mod:`dtq.errors`); a leaf added later with a code of its own inherits the status of its
nearest mapped ancestor. The API adds a few codes of its own for HTTP-level failures:

=====================  ======  ==================================================
INVALID_REQUEST        400     a query or path parameter out of its range
UNAUTHORIZED           401     X-API-Key missing on a destructive operation
FORBIDDEN              403     X-API-Key wrong
NOT_FOUND              404     no such route
METHOD_NOT_ALLOWED     405     route exists, method does not
NOT_READY              503     /ready: a dependency failed (details name it)
INTERNAL_ERROR         500     a bug; the message never leaks internals
=====================  ======  ==================================================
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException

from dtq.errors import DtqError, QueueFullError

__all__ = [
    "STATUS_BY_CODE",
    "ApiError",
    "ErrorBody",
    "ErrorDetail",
    "clean",
    "error_response",
    "install_error_handlers",
    "responses",
    "route_methods",
    "status_for",
]

log = logging.getLogger("dtq.api")

# A Redis outage is usually short (a restart, a failover): clients are told to come back soon.
_UNAVAILABLE_HEADERS = {"Retry-After": "1"}

STATUS_BY_CODE: dict[str, int] = {
    "INVALID_TASK": 400,
    "UNKNOWN_TASK_TYPE": 400,
    "INVALID_SCHEDULE": 400,
    "PAYLOAD_TOO_LARGE": 413,
    "QUEUE_FULL": 429,
    "IDEMPOTENCY_IN_PROGRESS": 409,
    "TASK_NOT_FOUND": 404,
    "INVALID_WORKFLOW": 400,
    "WORKFLOW_NOT_FOUND": 404,
    "INVALID_TRANSITION": 409,
    "TASK_RUNNING": 409,
    "TASK_TERMINAL": 410,
    "NOT_IN_DLQ": 404,
    "WORKER_NOT_FOUND": 404,
    "SCHEDULE_NOT_FOUND": 404,
    "SCHEDULE_EXISTS": 409,
    "LIMIT_NOT_FOUND": 404,
    "REDIS_UNAVAILABLE": 503,
    "REPLICATION_TIMEOUT": 503,
    "CONFIG_ERROR": 500,
    # The API's own codes.
    "INVALID_REQUEST": 400,
    "UNAUTHORIZED": 401,
    "FORBIDDEN": 403,
    "NOT_FOUND": 404,
    "METHOD_NOT_ALLOWED": 405,
    "NOT_READY": 503,
    "INTERNAL_ERROR": 500,
}

_HTTP_CODES = {
    400: "INVALID_REQUEST",
    401: "UNAUTHORIZED",
    403: "FORBIDDEN",
    404: "NOT_FOUND",
    405: "METHOD_NOT_ALLOWED",
    413: "PAYLOAD_TOO_LARGE",
    503: "NOT_READY",
}


class ErrorDetail(BaseModel):
    code: str = Field(examples=["QUEUE_FULL"])
    message: str = Field(examples=["queue 'default' is full (10000 tasks waiting or running)"])
    details: dict[str, Any] = Field(default_factory=dict)


class ErrorBody(BaseModel):
    """The body of every error response."""

    error: ErrorDetail


class ApiError(Exception):
    """An HTTP-level error of the API itself (auth, readiness); ``code`` is in the table."""

    def __init__(self, code: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details


def status_for(exc: DtqError) -> int:
    """The HTTP status of a dtq error: its own code, else its nearest mapped ancestor's."""
    for cls in type(exc).__mro__:
        code = getattr(cls, "code", None)
        if isinstance(code, str) and code in STATUS_BY_CODE:
            return STATUS_BY_CODE[code]
    return 500


def error_response(
    status: int,
    code: str,
    message: str,
    details: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"code": code, "message": message, "details": details or {}}}
    return JSONResponse(body, status_code=status, headers=headers)


def _request_id_header(request: Request) -> dict[str, str]:
    # Handlers of 500s run outside the request-id middleware: echo the id from the scope.
    rid = request.scope.get("state", {}).get("request_id")
    return {"X-Request-ID": rid} if isinstance(rid, str) else {}


async def _dtq_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, DtqError)
    status = status_for(exc)
    headers = None
    if isinstance(exc, QueueFullError):
        headers = {"Retry-After": str(max(1, int(exc.retry_after_s)))}
    elif status == 503:
        headers = dict(_UNAVAILABLE_HEADERS)
    details = {k: v for k, v in exc.details.items() if _jsonable(v)}
    if status >= 500:
        log.error(
            "%s %s: %s %s", request.method, clean(request.url.path), exc.code, clean(exc.message)
        )
    return error_response(status, exc.code, exc.message, details, headers)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(STATUS_BY_CODE[exc.code], exc.code, exc.message, exc.details)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = _HTTP_CODES.get(exc.status_code, "INVALID_REQUEST" if exc.status_code < 500 else "")
    code = code or "INTERNAL_ERROR"
    message = str(exc.detail) if exc.detail else code.lower().replace("_", " ")
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    headers = dict(exc.headers) if exc.headers else None
    if exc.status_code == 405:
        headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(request))}
    return error_response(exc.status_code, code, message, headers=headers)


def _allowed_methods(request: Request) -> list[str]:
    """The methods served on this path (``app.state.route_methods``, set by
    :func:`dtq.api.create_app`): those of every route whose template matches it, the most
    specific templates only (``/api/v1/dlq/purge`` is POST; the GET of ``/api/v1/dlq/{task_id}``
    does not count). Starlette's own ``Allow`` names only the first route whose path matched,
    so ``/api/v1/tasks`` (GET list, POST submit) said POST alone."""
    table: list[tuple[re.Pattern[str], int, frozenset[str]]] = getattr(
        request.app.state, "route_methods", []
    )
    path = request.url.path
    matching = [(params, methods) for regex, params, methods in table if regex.match(path)]
    fewest = min((params for params, _ in matching), default=0)
    return sorted({m for params, methods in matching if params == fewest for m in methods})


def route_methods(routes: Iterable[Any]) -> list[tuple[re.Pattern[str], int, frozenset[str]]]:
    """(path regex, number of path parameters, methods) of the HTTP routes among ``routes``."""
    return [
        (route.path_regex, len(route.param_convertors), frozenset(route.methods))
        for route in routes
        if isinstance(route, APIRoute) and route.methods
    ]


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = [
        {
            "field": ".".join(str(p) for p in e.get("loc", ())),
            "message": str(e.get("msg", "invalid")).removeprefix("Value error, "),
        }
        for e in exc.errors()
    ]
    first = errors[0] if errors else {"field": "request", "message": "invalid"}
    return error_response(
        400, "INVALID_REQUEST", f"{first['field']}: {first['message']}", {"errors": errors}
    )


async def _redis_down(request: Request, exc: Exception) -> JSONResponse:
    log.warning(
        "Redis unavailable during %s %s: %s", request.method, clean(request.url.path), clean(exc)
    )
    return error_response(
        503,
        "REDIS_UNAVAILABLE",
        "Redis is unreachable",
        {"dependency": "redis"},
        headers=dict(_UNAVAILABLE_HEADERS),
    )


async def _internal(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error in %s %s", request.method, clean(request.url.path))
    return error_response(
        500,
        "INTERNAL_ERROR",
        "internal error; the server log has the details",
        headers=_request_id_header(request),
    )


def clean(text: object, limit: int = 200) -> str:
    """A value safe to log: no line breaks (log injection), bounded length."""
    return str(text).replace("\r", "\\r").replace("\n", "\\n")[:limit]


def _jsonable(value: Any) -> bool:
    return isinstance(value, str | int | float | bool | list | dict) or value is None


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(DtqError, _dtq_error)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(RedisConnectionError, _redis_down)
    app.add_exception_handler(RedisTimeoutError, _redis_down)
    app.add_exception_handler(Exception, _internal)


_DESCRIPTIONS = {
    400: "Invalid input (INVALID_TASK, UNKNOWN_TASK_TYPE, INVALID_SCHEDULE or INVALID_REQUEST)",
    401: "X-API-Key missing (UNAUTHORIZED)",
    403: "X-API-Key wrong (FORBIDDEN)",
    404: "Not found",
    409: "Conflict with the task's state",
    410: "The task is already terminal (TASK_TERMINAL)",
    413: "Request body or payload too large (PAYLOAD_TOO_LARGE)",
    429: "Queue full (QUEUE_FULL); see Retry-After",
    503: (
        "Redis unreachable (REDIS_UNAVAILABLE), not ready (NOT_READY), or a submit its "
        "replicas did not confirm in time (REPLICATION_TIMEOUT; details.task_id names the task)"
    ),
}


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for the error statuses a route can answer (plus 413 and 503,
    which any route can: the body limit and Redis apply everywhere)."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in sorted({*statuses, 413, 503}):
        entry: dict[str, Any] = {"model": ErrorBody, "description": _DESCRIPTIONS[status]}
        if status in (429, 503):
            entry["headers"] = {
                "Retry-After": {
                    "description": "Seconds to wait before trying again",
                    "schema": {"type": "integer"},
                }
            }
        out[status] = entry
    return out
