"""dtq's web dashboard at ``/dashboard``: static HTML, CSS and JavaScript shipped in the package
(``static/``), served by the API process with no build step and no third-party front-end code.

Routes (none in the OpenAPI schema):

- ``GET /dashboard``: a redirect to ``/dashboard/`` (relative, so a path prefix added by a
  proxy survives);
- ``GET /dashboard/``: the single page (``index.html``);
- ``GET /dashboard/config.json``: what the page needs to know about this API: the WebSocket
  path (``DTQ_WS_PATH``), whether destructive operations need ``X-API-Key``, the version;
- ``GET /dashboard/static/<file>``: the files of ``static/`` (a fixed list; anything else is a
  404 in the API's error shape).

Every response carries a strict Content-Security-Policy: scripts, styles and images from this
origin only (no inline script or style, no ``eval``), network access to this origin only (the
API and its WebSocket), no framing, no forms, and Trusted Types required for every DOM
injection sink, so an assignment of a string to ``innerHTML`` throws in the browser: values
from tasks can only be shown as text. Static files are sent with an ``ETag`` and
``Cache-Control: no-cache`` (revalidated on every load; 304 when unchanged).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from dtq import __version__
from dtq.api.deps import State

__all__ = ["CONTENT_SECURITY_POLICY", "SECURITY_HEADERS", "StaticFile", "router", "static_file"]

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
        "require-trusted-types-for 'script'",
        "trusted-types 'none'",
    ]
)

SECURITY_HEADERS: dict[str, str] = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
}

_MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}

router = APIRouter(include_in_schema=False)


@dataclass(frozen=True)
class StaticFile:
    """One file of ``static/``, read once, with its media type and ETag."""

    body: bytes
    media_type: str
    etag: str


@cache
def _static_files() -> dict[str, StaticFile]:
    """Every servable file of ``static/``, read on first use (never at import)."""
    files: dict[str, StaticFile] = {}
    for entry in resources.files(__name__).joinpath("static").iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if not entry.is_file() or suffix not in _MEDIA_TYPES:
            continue
        body = entry.read_bytes()
        etag = '"' + hashlib.sha256(body).hexdigest()[:20] + '"'
        files[entry.name] = StaticFile(body, _MEDIA_TYPES[suffix], etag)
    return files


def static_file(name: str) -> StaticFile:
    """The file ``name`` of ``static/``; a 404 (the API's NOT_FOUND body) for anything else."""
    found = _static_files().get(name)
    if found is None:
        raise StarletteHTTPException(404)
    return found


def _send(request: Request, file: StaticFile) -> Response:
    headers = {**SECURITY_HEADERS, "ETag": file.etag, "Cache-Control": "no-cache"}
    if request.headers.get("if-none-match") == file.etag:
        return Response(status_code=304, headers=headers)
    return Response(file.body, media_type=file.media_type, headers=headers)


@router.get("/dashboard")
async def dashboard_redirect() -> RedirectResponse:
    return RedirectResponse("dashboard/", status_code=307, headers=SECURITY_HEADERS)


@router.get("/dashboard/")
async def dashboard_page(request: Request) -> Response:
    return _send(request, static_file("index.html"))


@router.get("/dashboard/config.json")
async def dashboard_config(state: State) -> JSONResponse:
    config: dict[str, Any] = {
        "version": __version__,
        "ws_path": state.settings.ws_path,
        "auth_required": bool(state.settings.api_key),
    }
    return JSONResponse(config, headers={**SECURITY_HEADERS, "Cache-Control": "no-store"})


@router.get("/dashboard/static/{name}")
async def dashboard_static(name: str, request: Request) -> Response:
    return _send(request, static_file(name))
