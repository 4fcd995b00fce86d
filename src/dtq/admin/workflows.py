"""Workflows (docs/workflows.md): submit, read, cancel, and apply a node's end.

``workflow.lua`` keeps a workflow's state in its home queue's slot and decides, atomically,
which nodes an end releases. What it releases is submitted here, as ordinary tasks with the
ids the workflow gave them and the idempotency key ``dtq-wf:<wid>:<node>``: a release repeated
after a crash is absorbed by the key. The ends of node tasks reach :func:`apply_entry` through
their queue's outbox (the worker's relay), or :func:`apply_end` directly for a node that could
not be submitted.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any, cast

from pydantic import BaseModel

from dtq import calls, keys
from dtq.admin.tasks import cancel as cancel_task
from dtq.calls import Audit, new_task_id
from dtq.errors import (
    DtqError,
    IdempotencyInProgressError,
    InvalidWorkflowError,
    QueueFullError,
    TaskNotFoundError,
    TaskRunningError,
    TaskTerminalError,
    WorkflowNotFoundError,
)
from dtq.models import SubmitRequest, Task, TaskStatus, compact_json
from dtq.scripts import Call
from dtq.store import Store, ms_to_dt
from dtq.workflows import (
    Edge,
    ParentResult,
    Workflow,
    WorkflowNode,
    WorkflowSpec,
    node_key,
    parse_node_key,
)

__all__ = [
    "WorkflowReply",
    "apply_end",
    "apply_entries",
    "cancel_workflow",
    "get_workflow",
    "parent_results",
    "submit_workflow",
]

log = logging.getLogger("dtq.workflows")


class WorkflowReply(BaseModel):
    """workflow.lua's answer to an end, a release or a cancel."""

    status: str
    released: list[tuple[str, str, str, str]]  # (node, task id, queue, submit fields JSON)
    succeeded: list[str]
    running: dict[str, str]  # task id -> node: the RELEASED nodes (op cancel)


def _reply(raw: Sequence[Any]) -> WorkflowReply | None:
    if raw[0] == "gone":
        return None
    flat = list(raw[1])
    released = [(flat[i], flat[i + 1], flat[i + 2], flat[i + 3]) for i in range(0, len(flat), 4)]
    return WorkflowReply(
        status=raw[0],
        released=released,
        succeeded=list(raw[2]),
        running=dict(zip(raw[3][::2], raw[3][1::2], strict=True)),
    )


async def _home(store: Store, workflow_id: str) -> str:
    home = await store.redis.hget(keys.workflow(workflow_id), "home")
    if home is None:
        raise WorkflowNotFoundError(f"workflow {workflow_id} not found", workflow_id=workflow_id)
    return cast(str, home)


# -- submit ---------------------------------------------------------------------------------


async def submit_workflow(
    store: Store,
    spec: WorkflowSpec | Mapping[str, Any],
    *,
    known_types: Collection[str] | None = None,
    payload_models: Mapping[str, type[BaseModel]] | None = None,
    audit: Audit | None = None,
) -> Workflow:
    """Check the workflow and every node's task as a submit would (INVALID_WORKFLOW naming
    the node), write it in one script call, submit its roots, and return it."""
    spec = WorkflowSpec.parse(spec)
    home = spec.nodes[0].queue
    workflow_id = new_task_id(home)
    nodes: list[dict[str, Any]] = []
    for n in spec.nodes:
        fields = n.submit_fields()
        try:
            SubmitRequest.build(
                store.settings,
                known_types,
                payload_models,
                **fields,
                idempotency_key=node_key(workflow_id, n.name),
            )
        except DtqError as exc:
            raise InvalidWorkflowError(
                f"node {n.name!r}: {exc.message}", node=n.name, cause=exc.code
            ) from None
        nodes.append(
            {
                "name": n.name,
                "task": new_task_id(n.queue),
                "queue": n.queue,
                "type": n.task_type,
                "req": compact_json(fields),
                "after": [[e.node, e.policy] for e in n.after],
            }
        )
    actor, request_id = ("", "") if audit is None else (audit.actor, audit.request_id or "")
    try:
        metadata = compact_json(spec.metadata)
    except (TypeError, ValueError) as exc:
        raise InvalidWorkflowError(f"metadata must be JSON: {exc}") from None
    raw = await calls.workflow(
        store, workflow_id, home, "create", metadata, compact_json(nodes), actor, request_id
    )
    entry_id = raw[0]
    roots = [
        (str(n["name"]), str(n["task"]), str(n["queue"]), str(n["req"]))
        for n in nodes
        if not n["after"]
    ]
    try:
        await _submit(store, workflow_id, home, roots)
    except QueueFullError:
        # A root's queue is full: the workflow exists, its release entry stays, and the
        # workers' relay queues the roots once there is room (they show "released" meanwhile).
        return await get_workflow(store, workflow_id)
    # The release entry is there for a submitter that died before this point: the workers'
    # relay then submits the roots. Submitted, it is not needed.
    await store.redis.xdel(keys.wf_outbox(home), entry_id)
    return await get_workflow(store, workflow_id)


async def _submit(
    store: Store,
    workflow_id: str,
    home: str,
    released: Sequence[tuple[str, str, str, str]],
) -> None:
    """Submit released nodes' tasks. A node whose task cannot be made ends FAILED
    (SubmitRefused); one expired already at its release ends EXPIRED; a full queue raises
    QueueFullError, so that the relay tries again later (the entry stays pending)."""
    if not released:
        return
    reqs: list[SubmitRequest] = []
    ids: list[str] = []
    names: list[str] = []
    refused: list[tuple[str, str]] = []
    for name, task_id, _queue, fields in released:
        try:
            req = SubmitRequest.build(
                store.settings,
                None,
                None,
                **json.loads(fields),
                idempotency_key=node_key(workflow_id, name),
            )
        except DtqError as exc:
            refused.append((name, exc.message))
            continue
        reqs.append(req)
        ids.append(task_id)
        names.append(name)
    results = await store.submit_with_ids(reqs, ids) if reqs else []
    full: QueueFullError | None = None
    expired: list[str] = []
    submitted: dict[str, str] = {}
    for name, result in zip(names, results, strict=True):
        if isinstance(result, Task):
            submitted[result.task_id] = name
            if result.status is TaskStatus.EXPIRED and not result.duplicate:
                expired.append(name)
        elif isinstance(result, IdempotencyInProgressError):
            continue  # submitted already, by an earlier release
        elif isinstance(result, QueueFullError):
            full = result
        else:
            refused.append((name, result.message))
    for name in expired:
        await apply_end(store, workflow_id, name, TaskStatus.EXPIRED, home=home)
    for name, message in refused:
        await apply_end(
            store,
            workflow_id,
            name,
            TaskStatus.FAILED,
            error_class="SubmitRefused",
            error_message=message,
            home=home,
        )
    if submitted:
        flag = await store.redis.hget(keys.workflow(workflow_id), "cancel_requested")
        if flag == "1":
            # A cancel came between the release and this submit: it could not cancel a task
            # that did not exist yet, so the tasks just made are cancelled here.
            await _cancel_tasks(store, workflow_id, home, submitted, None)
    if full is not None:
        raise full


# -- ends -----------------------------------------------------------------------------------


async def apply_end(
    store: Store,
    workflow_id: str,
    node: str,
    status: str,
    *,
    error_class: str = "",
    error_message: str = "",
    home: str | None = None,
) -> WorkflowReply | None:
    """Tell the workflow that ``node`` ended as ``status``; submit what that releases and, once
    the workflow has ended, give its nodes' results their retention. None when the workflow is
    gone (ended longer than its retention ago, or deleted)."""
    try:
        home = home or await _home(store, workflow_id)
    except WorkflowNotFoundError:
        return None
    raw = await calls.workflow(
        store, workflow_id, home, "end", node, status, error_class, error_message
    )
    return await _follow(store, workflow_id, home, raw)


async def _follow(
    store: Store, workflow_id: str, home: str, raw: Sequence[Any]
) -> WorkflowReply | None:
    reply = _reply(raw)
    if reply is None:
        return None
    await _submit(store, workflow_id, home, reply.released)
    if reply.status != "running" and reply.succeeded:
        await _retain_results(store, reply.succeeded)
    return reply


async def _retain_results(store: Store, task_ids: Sequence[str]) -> None:
    """A node's result has no TTL while its workflow runs (its children read it); from the
    workflow's end it lives ``DTQ_RESULT_RETENTION_S`` like any result. Repeated after a
    crash, this only moves that end a little."""
    pipe = store.redis.pipeline(transaction=False)
    for tid in task_ids:
        pipe.expire(keys.result(tid), store.settings.result_retention_s)
    await pipe.execute()


async def apply_entries(
    store: Store, queue: str, entries: Sequence[Mapping[str, str]], homes: dict[str, str]
) -> None:
    """Apply entries of ``queue``'s outbox: nodes' ends and workflows' release entries, every
    workflow.lua call in one round trip, then the submits of what they released. ``homes``
    caches each workflow's home queue (read once: it never changes). Raises what a submit
    raises (a full queue): the caller leaves every entry pending, and applying them again
    changes nothing."""
    todo: list[tuple[str, str, str, str]] = []  # (workflow id, node or "", status, task id)
    for fields in entries:
        if fields.get("kind") == "release":
            wid = fields.get("workflow_id", "")
            homes.setdefault(wid, queue)
            todo.append((wid, "", "", ""))
            continue
        parsed = parse_node_key(fields.get("key"))
        if parsed is None:
            log.warning("workflow outbox of %s: entry without a node key: %s", queue, dict(fields))
            continue
        todo.append((*parsed, fields.get("status", ""), fields.get("task_id", "")))
    unknown = sorted({t[0] for t in todo if t[0] not in homes})
    if unknown:
        pipe = store.redis.pipeline(transaction=False)
        for wid in unknown:
            pipe.hget(keys.workflow(wid), "home")
        for wid, home in zip(unknown, await pipe.execute(), strict=True):
            if home is not None:
                homes[wid] = home
    sent: list[tuple[str, str, str]] = []  # (workflow id, status, task id) of each call
    prepared: list[Call] = []
    # A node's task that succeeded once its workflow was gone or ended (requeued from the
    # dead-letter queue): its result, kept without a TTL for children, gets the retention.
    orphans: list[str] = []
    for wid, node, status, task_id in todo:
        home = homes.get(wid)
        if home is None:
            if status == TaskStatus.SUCCEEDED:
                orphans.append(task_id)
            continue
        op = ("released",) if not node else ("end", node, status, "", "")
        sent.append((wid, status, task_id))
        prepared.append(calls.workflow_call(store.settings, wid, home, *op))
    replies = await calls.workflow_many(store, prepared) if prepared else []
    for (wid, status, task_id), raw in zip(sent, replies, strict=True):
        if isinstance(raw, Exception):
            raise raw
        reply = await _follow(store, wid, homes[wid], raw)
        if reply is None:
            homes.pop(wid, None)
        if status == TaskStatus.SUCCEEDED and (reply is None or reply.status != "running"):
            orphans.append(task_id)
    if orphans:
        await _retain_results(store, orphans)


# -- read, cancel ---------------------------------------------------------------------------


async def get_workflow(store: Store, workflow_id: str) -> Workflow:
    """The workflow with each node's state: waiting, skipped, or its task's status (released
    for the moment between its release and its task's submit)."""
    pipe = store.redis.pipeline(transaction=False)
    pipe.hgetall(keys.workflow(workflow_id))
    pipe.hgetall(keys.workflow_nodes(workflow_id))
    wf, nodes = await pipe.execute()
    if not wf or "names" not in wf:
        raise WorkflowNotFoundError(f"workflow {workflow_id} not found", workflow_id=workflow_id)
    names: list[str] = json.loads(wf["names"])
    with_task = [n for n in names if nodes.get(f"{n}:st") not in ("waiting", "skipped", None)]
    pipe = store.redis.pipeline(transaction=False)
    for n in with_task:
        pipe.hmget(keys.task(nodes[f"{n}:task"]), "status", "error_class", "error_message")
    tasks = dict(zip(with_task, await pipe.execute() if with_task else [], strict=True))
    out: list[WorkflowNode] = []
    for n in names:
        st = nodes.get(f"{n}:st", "waiting")
        err = json.loads(nodes[f"{n}:err"]) if f"{n}:err" in nodes else {}
        error_class, error_message = err.get("class"), err.get("message")
        t = tasks.get(n)
        if t is not None and t[0] is not None:
            st = t[0]
            error_class = t[1] or error_class
            error_message = t[2] or error_message
        out.append(
            WorkflowNode(
                name=n,
                task_id=nodes.get(f"{n}:task", ""),
                queue=nodes.get(f"{n}:queue", ""),
                task_type=nodes.get(f"{n}:type", ""),
                status=st,
                after=[Edge(node=p, policy=pol) for p, pol, _ in json.loads(nodes[f"{n}:after"])],
                error_class=error_class or None,
                error_message=error_message or None,
            )
        )
    return Workflow(
        workflow_id=workflow_id,
        status=wf["status"],
        created_at=ms_to_dt(wf["created_at"]),
        updated_at=ms_to_dt(wf["updated_at"]),
        finished_at=ms_to_dt(wf["finished_at"]) if wf.get("finished_at") else None,
        cancel_requested=wf.get("cancel_requested") == "1",
        metadata=json.loads(wf.get("metadata") or "{}"),
        nodes=out,
    )


async def _cancel_tasks(
    store: Store, workflow_id: str, home: str, task_ids: Mapping[str, str], audit: Audit | None
) -> None:
    """Cancel released nodes' tasks (node by task id). A task cancelled here (it had not
    started) is applied to its workflow at once: the relay of its queue may not run (a queue
    no worker serves), and applying the end again when its entry comes changes nothing."""
    for tid, name in task_ids.items():
        try:
            await cancel_task(store, tid, reason="workflow_cancel", audit=audit)
        except (TaskNotFoundError, TaskTerminalError, TaskRunningError):
            # Not submitted yet (its submit cancels it), ended already (its end is relayed),
            # or running in a thread its worker cannot stop (cancellation stays requested).
            continue
        await apply_end(store, workflow_id, name, TaskStatus.CANCELLED, home=home)


async def cancel_workflow(
    store: Store, workflow_id: str, *, audit: Audit | None = None
) -> Workflow:
    """Cancel the waiting nodes, cancel the queued ones and request cancellation of the
    running ones; the workflow ends ``cancelled`` once every node has. An ended workflow is
    returned as it is."""
    home = await _home(store, workflow_id)
    actor, request_id = ("", "") if audit is None else (audit.actor, audit.request_id or "")
    raw = await calls.workflow(store, workflow_id, home, "cancel", actor, request_id)
    reply = await _follow(store, workflow_id, home, raw)
    if reply is not None:
        await _cancel_tasks(store, workflow_id, home, reply.running, audit)
    return await get_workflow(store, workflow_id)


# -- what a running node reads --------------------------------------------------------------


async def parent_results(store: Store, workflow_id: str, node: str) -> dict[str, ParentResult]:
    """The end of each of ``node``'s parents, with its result when it succeeded."""
    nk = keys.workflow_nodes(workflow_id)
    after_json = await store.redis.hget(nk, f"{node}:after")
    if after_json is None:
        return {}
    after = json.loads(after_json)
    tasks = {t.task_id: t for t in await store.get_many([tid for _, _, tid in after])}
    out: dict[str, ParentResult] = {}
    missing = [p for p, _, tid in after if tid not in tasks]
    ends: dict[str, tuple[str | None, str | None]] = {}
    if missing:
        fields = [f for p in missing for f in (f"{p}:st", f"{p}:err")]
        vals = await store.redis.hmget(nk, fields)
        for i, p in enumerate(missing):
            ends[p] = (cast("str | None", vals[2 * i]), cast("str | None", vals[2 * i + 1]))
    for p, _, tid in after:
        task = tasks.get(tid)
        if task is not None:
            out[p] = ParentResult(
                status=task.status.value,
                result=task.result,
                error_class=task.error_class,
                error_message=task.error_message,
            )
            continue
        st, err_json = ends.get(p, (None, None))
        err = json.loads(err_json) if err_json else {}
        out[p] = ParentResult(
            status=st or "unknown",
            error_class=err.get("class"),
            error_message=err.get("message"),
        )
    return out
