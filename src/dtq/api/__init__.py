"""dtq's HTTP API and WebSocket events (FastAPI): ``create_app`` is the ASGI factory
(``uvicorn --factory dtq.api:create_app``), ``serve`` runs it with uvicorn."""

from dtq.api.app import create_app, serve

__all__ = ["create_app", "serve"]
