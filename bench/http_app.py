"""The ASGI app the HTTP enqueue scenario serves under uvicorn (``--factory``).

dtq's own app from ``dtq.api.create_app(settings)`` with one extra no-op POST route,
``/bench/noop``: the same process, middleware and JSON body as ``POST /api/v1/tasks``, but no dtq
work, so it is the ceiling a submit endpoint can reach on this server.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from dtq.api import create_app
from dtq.config import load_settings

__all__ = ["NOOP_PATH", "create"]

NOOP_PATH = "/bench/noop"


def create() -> FastAPI:
    app = create_app(load_settings())

    @app.post(NOOP_PATH, status_code=201)
    async def noop(body: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True, "fields": len(body)}

    return app
