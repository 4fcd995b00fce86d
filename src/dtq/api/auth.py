"""API-key auth for destructive operations and the audit identity (contract section 13).

With ``DTQ_API_KEY`` set, cancel, expire, DLQ requeue/discard/purge, queue pause/resume/purge
and every change of a schedule (put, pause, resume, trigger, delete) need ``X-API-Key`` equal
to it (compared in constant time): 401 UNAUTHORIZED when missing, 403 FORBIDDEN when wrong.
Reads and submit stay open. Unset means local development: everything is open, and the app
logs a warning at start.

The audit actor is ``api:<key id>`` where the key id is a short SHA-256 fingerprint of the key
(never the key itself), or ``api:anonymous`` when auth is off.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader

from dtq.api.errors import ApiError
from dtq.client import Audit

__all__ = ["API_KEY_HEADER", "Operator", "key_id", "operator"]

log = logging.getLogger("dtq.api.audit")

API_KEY_HEADER = APIKeyHeader(
    name="X-API-Key",
    auto_error=False,
    description="Required on destructive operations when DTQ_API_KEY is set.",
)


def key_id(key: str) -> str:
    """A fingerprint that names a key in audit entries and logs without revealing it."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Operator:
    """Who performs a destructive operation, and the request it came with."""

    actor: str
    request_id: str

    def audit(self) -> Audit:
        return Audit(self.actor, self.request_id)

    def log(self, action: str, target: str | None = None, **extra: object) -> None:
        """Log one destructive operation (the audit stream has the same entry)."""
        fields = " ".join(f"{k}={v}" for k, v in extra.items())
        log.info(
            "audit actor=%s action=%s target=%s request_id=%s %s",
            self.actor,
            action,
            target or "-",
            self.request_id,
            fields,
            extra={"actor": self.actor, "action": action, "request_id": self.request_id},
        )


async def operator(
    request: Request,
    given: Annotated[str | None, Depends(API_KEY_HEADER)],
) -> Operator:
    """FastAPI dependency of every destructive route (async: no thread-pool hop)."""
    key: str = request.app.state.dtq.settings.api_key
    rid = str(request.scope.get("state", {}).get("request_id", ""))
    if not key:
        return Operator("api:anonymous", rid)
    if not given:
        raise ApiError("UNAUTHORIZED", "this operation needs the X-API-Key header")
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise ApiError("FORBIDDEN", "X-API-Key is not valid")
    return Operator(f"api:{key_id(key)}", rid)


RequireOperator = Annotated[Operator, Depends(operator)]
