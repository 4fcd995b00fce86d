"""Workflow routes (docs/workflows.md, docs/api.md): submit, get, cancel.

Every rule is the core's (:meth:`dtq.client.Queue.submit_workflow` checks the DAG and each
node's task as a submit would, with the registered task types and payload models). Submit is
open like a task submit; cancel needs the operator (auth.py). Both are audited by the script
behind them (``workflow_submit``, ``workflow_cancel``) and logged here; a submit's actor is
the key's id when a valid ``X-API-Key`` came with it, else ``api:anonymous``. A workflow id
is what the core generates (32 hex digits, like a task id); anything else cannot exist, so it
is a plain 404.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from dtq.api.auth import RequireOperator, key_id
from dtq.api.deps import State, json_object
from dtq.api.errors import responses
from dtq.client import Audit
from dtq.errors import WorkflowNotFoundError
from dtq.models import QUEUE_RE, TASK_ID_RE, TASK_TYPE_RE
from dtq.workflows import MAX_NODES, NODE_NAME_RE, Workflow, WorkflowSpec

__all__ = ["check_workflow_id", "router", "workflow_body_schema"]

router = APIRouter(prefix="/api/v1", tags=["workflows"])
log = logging.getLogger("dtq.api")


def check_workflow_id(workflow_id: str) -> str:
    if not TASK_ID_RE.fullmatch(workflow_id):
        raise WorkflowNotFoundError(
            f"workflow {workflow_id[:64]!r} not found", workflow_id=workflow_id[:64]
        )
    return workflow_id


def _inline(value: Any, defs: dict[str, Any]) -> Any:
    """``value`` with every ``#/$defs/X`` reference replaced by X (the models have no cycle)."""
    if isinstance(value, dict):
        ref = value.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline(v, defs) for k, v in value.items()}
    if isinstance(value, list):
        return [_inline(v, defs) for v in value]
    return value


def workflow_body_schema() -> dict[str, Any]:
    """The submit body's JSON schema with the rules JSON Schema can state: the node-name,
    task-type and queue patterns and the node count. Not stated: unique names, known
    references, no cycle, and each node's task rules (400 INVALID_WORKFLOW names them)."""
    raw = WorkflowSpec.model_json_schema()
    defs = raw.pop("$defs", {})
    node = defs["NodeSpec"]
    props = node["properties"]
    props["name"].update(pattern=f"^{NODE_NAME_RE.pattern}$", minLength=1, maxLength=128)
    props["task_type"].update(pattern=TASK_TYPE_RE.pattern, minLength=1, maxLength=128)
    props["queue"].update(pattern=QUEUE_RE.pattern, maxLength=64)
    schema: dict[str, Any] = _inline(raw, defs)
    schema["properties"]["nodes"].update(minItems=1, maxItems=MAX_NODES)
    return schema


def _submitter(request: Request, api_key: str) -> Audit:
    """Who submits: submit needs no key, but a valid one names its holder in the audit."""
    given = request.headers.get("x-api-key", "")
    known = bool(api_key) and hmac.compare_digest(given.encode(), api_key.encode())
    rid = str(request.scope.get("state", {}).get("request_id", ""))
    return Audit(f"api:{key_id(api_key)}" if known else "api:anonymous", rid)


_SUBMIT_OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": workflow_body_schema()}},
    }
}


@router.post(
    "/workflows",
    status_code=201,
    response_model=Workflow,
    summary="Submit a workflow",
    responses={201: {"description": "Created: the workflow, its roots queued"}, **responses(400)},
    openapi_extra=_SUBMIT_OPENAPI,
)
async def submit_workflow(request: Request, state: State) -> JSONResponse:
    """A DAG of tasks as one object (docs/workflows.md); 400 INVALID_WORKFLOW names the first
    problem (a cycle, an unknown reference, a name given twice, a node whose task is
    invalid)."""
    fields = json_object(await request.body())
    workflow = await state.q.submit_workflow(
        fields, audit=_submitter(request, state.settings.api_key)
    )
    log.info(
        "workflow submitted workflow_id=%s nodes=%d", workflow.workflow_id, len(workflow.nodes)
    )
    return JSONResponse(
        workflow.model_dump(mode="json"),
        status_code=201,
        headers={"Location": f"/api/v1/workflows/{workflow.workflow_id}"},
    )


@router.get("/workflows/{workflow_id}", response_model=Workflow, responses=responses(404))
async def get_workflow(workflow_id: str, state: State) -> Workflow:
    """The workflow and the state of each node; 404 WORKFLOW_NOT_FOUND."""
    return await state.q.get_workflow(check_workflow_id(workflow_id))


@router.post(
    "/workflows/{workflow_id}/cancel",
    response_model=Workflow,
    responses=responses(401, 403, 404),
)
async def cancel_workflow(workflow_id: str, state: State, op: RequireOperator) -> Workflow:
    """Cancel the nodes that have not started and request the cancellation of the running
    ones; the workflow ends ``cancelled`` once they have ended. A workflow that has ended
    already is answered as it is."""
    workflow = await state.q.cancel_workflow(check_workflow_id(workflow_id), audit=op.audit())
    op.log("cancel_workflow", workflow_id, status=workflow.status)
    return workflow
