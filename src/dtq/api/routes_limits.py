"""Limit routes (docs/limits.md, docs/api.md): create or update, list, get with its use, and
delete. Every rule is the core's (:class:`dtq.client.Queue`'s limit methods); the changes need
the operator (auth.py), are audited atomically by the scripts behind them and logged here.

A limit name that breaks the name rules is 400 INVALID_REQUEST on every route; a bad definition
is 400 INVALID_LIMIT with the core's message."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from dtq.admin.limits import Limit
from dtq.api.auth import RequireOperator
from dtq.api.deps import State, core_rule, json_object
from dtq.api.errors import responses
from dtq.limits import LIMIT_NAME_RE, LimitDef, check_limit_name

__all__ = ["LimitList", "LimitPut", "limit_body_schema", "router"]

router = APIRouter(prefix="/api/v1", tags=["limits"])


class LimitPut(Limit):
    """The limit as stored after a PUT, and what the PUT did."""

    outcome: Literal["created", "updated", "unchanged"]


class LimitList(BaseModel):
    limits: list[Limit]


LimitName = Annotated[
    str,
    Path(
        description="A limit name: 1-128 letters, digits, '_', '.', ':', '-'",
        json_schema_extra={"pattern": LIMIT_NAME_RE.pattern, "maxLength": 128},
    ),
    core_rule(check_limit_name),
]


def limit_body_schema() -> dict[str, Any]:
    """The PUT body's JSON schema: :class:`LimitDef`'s; the rules it cannot state (the rate's
    syntax, a rate or a concurrency at least) are the core's, answered 400 INVALID_LIMIT."""
    schema = LimitDef.model_json_schema()
    schema["additionalProperties"] = False
    return schema


_PUT_OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": limit_body_schema()}},
    }
}


@router.put(
    "/limits/{name}",
    response_model=LimitPut,
    summary="Create or update a limit",
    responses={
        200: {"model": LimitPut, "description": "Updated, or unchanged (the same definition)"},
        201: {"model": LimitPut, "description": "Created"},
        **responses(400, 401, 403),
    },
    openapi_extra=_PUT_OPENAPI,
)
async def put_limit(
    name: LimitName, request: Request, state: State, op: RequireOperator
) -> JSONResponse:
    """The body is the definition (docs/limits.md): ``queue``, ``task_type``, ``key``,
    ``rate`` (+ ``burst``) and/or ``concurrency``. Every worker applies it within a second.
    400 INVALID_LIMIT for a bad definition."""
    fields = json_object(await request.body())
    limit, outcome = await state.q.put_limit(name, fields, audit=op.audit())
    op.log("limit_put", name, outcome=outcome)
    body = LimitPut(**limit.model_dump(), outcome=outcome)
    return JSONResponse(
        body.model_dump(mode="json"),
        status_code=201 if outcome == "created" else 200,
        headers={"Location": f"/api/v1/limits/{name}"},
    )


@router.get("/limits", response_model=LimitList)
async def list_limits(state: State) -> LimitList:
    """Every limit by name, with its use now (running and waiting tasks)."""
    return LimitList(limits=await state.q.list_limits())


@router.get("/limits/{name}", response_model=Limit, responses=responses(400, 404))
async def get_limit(name: LimitName, state: State) -> Limit:
    """The limit and its use now. 404 LIMIT_NOT_FOUND."""
    return await state.q.get_limit(name)


@router.delete(
    "/limits/{name}",
    status_code=204,
    response_class=Response,
    responses={204: {"description": "Deleted"}, **responses(400, 401, 403, 404)},
)
async def delete_limit(name: LimitName, state: State, op: RequireOperator) -> Response:
    """The definition is removed: workers stop applying it within a second; tasks running
    under it still free their places."""
    await state.q.delete_limit(name, audit=op.audit())
    op.log("limit_delete", name)
    return Response(status_code=204)
