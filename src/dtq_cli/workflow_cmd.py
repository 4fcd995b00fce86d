"""Workflow commands: submit, show, cancel (docs/cli.md, "Workflows"; the semantics are
docs/workflows.md's), and their argparse tree.

Everything goes through the SDK's workflow methods (:class:`dtq.client.Queue`), which own the
rules: a file that cannot be read or is not a JSON object is a UsageError, a workflow the core
refuses is InvalidWorkflowError naming the first problem (both exit 2); an unknown workflow is
WorkflowNotFoundError (exit 1). Submit and cancel are audited as ``cli:<user>@<host>``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dtq.workflows import Edge, Workflow
from dtq_cli import inputs
from dtq_cli.context import Ctx, UsageError
from dtq_cli.flags import json_flag, sub
from dtq_cli.output import STATUS_COLOUR, fmt_dt

__all__ = ["add_commands", "after_text", "cancel", "read_workflow_file", "show", "submit"]

# Node statuses beyond a task's (docs/workflows.md), and the workflow's own.
NODE_COLOUR = {**STATUS_COLOUR, "waiting": "blue", "skipped": "dim", "released": "cyan"}
WORKFLOW_COLOUR = {"running": "magenta", "succeeded": "green", "failed": "red",
                   "cancelled": "dim", "expired": "dim"}  # fmt: skip


def add_commands(subs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub(
        subs,
        "workflow",
        "Workflows: a DAG of tasks submitted as one object (docs/workflows.md)",
        "  dtq workflow submit pipeline.json\n  dtq workflow show 3f2a9c0d5e6f47a8b9c0d1e2f3a4b5c6",
    )
    ws = p.add_subparsers(dest="workflow_command", metavar="<workflow command>", required=True)

    p = sub(
        ws,
        "submit",
        "Submit a workflow from a JSON file",
        """\
          dtq workflow submit pipeline.json
          cat pipeline.json | dtq workflow submit - --json
        """,
        """\
        FILE holds {"nodes": [...], "metadata": {...}} (docs/workflows.md); - reads stdin.
        Prints the workflow id and its nodes. Every node is checked as a submit checks its task
        (the task types against DTQ_TASK_MODULES): a cycle, an unknown reference, a name given
        twice or an invalid node is refused with the problem named (exit 2).
        """,
    )
    p.set_defaults(cmd="workflow.submit")
    p.add_argument("file", metavar="FILE", help="the workflow JSON, or - for stdin")
    json_flag(p)

    p = sub(
        ws,
        "show",
        "Show a workflow and the state of each node",
        "  dtq workflow show 3f2a9c0d5e6f47a8b9c0d1e2f3a4b5c6 --json",
        "AFTER lists a node's dependencies; an edge whose policy is not fail reads b(continue).",
    )
    p.set_defaults(cmd="workflow.show")
    _workflow_id(p)
    json_flag(p)

    p = sub(
        ws,
        "cancel",
        "Cancel a workflow: its waiting and queued nodes now, its running ones by request",
        "  dtq workflow cancel 3f2a9c0d5e6f47a8b9c0d1e2f3a4b5c6",
        "An ended workflow is shown as it is (exit 0). Audited as cli:<user>@<host>.",
    )
    p.set_defaults(cmd="workflow.cancel")
    _workflow_id(p)
    json_flag(p)


def _workflow_id(p: argparse.ArgumentParser) -> None:
    p.add_argument("workflow_id", type=inputs.workflow_id, help="the id submit printed")


def read_workflow_file(name: str) -> dict[str, Any]:
    """The JSON object in file ``name`` (``-``: stdin); UsageError in one line otherwise."""
    source = "stdin" if name == "-" else name
    try:
        text = sys.stdin.read() if name == "-" else Path(name).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise UsageError(f"cannot read {source}: {reason}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{source} is not valid JSON: {exc}") from None
    except RecursionError:
        raise UsageError(f"{source}: JSON nested too deeply") from None
    if not isinstance(value, dict):
        raise UsageError(f"{source} must be a JSON object with a 'nodes' list")
    return value


def after_text(after: list[Edge]) -> str:
    """``a, b(continue)``: the dependencies, with each policy that is not the default."""
    if not after:
        return "-"
    return ", ".join(e.node if e.policy == "fail" else f"{e.node}({e.policy})" for e in after)


def _print(ctx: Ctx, wf: Workflow) -> None:
    out = ctx.out
    pairs = [
        ("workflow_id", wf.workflow_id),
        ("status", out.paint(wf.status, WORKFLOW_COLOUR.get(wf.status))
         + (" (cancel requested)" if wf.cancel_requested and wf.status == "running" else "")),
        ("created_at", fmt_dt(wf.created_at)),
        ("updated_at", fmt_dt(wf.updated_at)),
        ("finished_at", fmt_dt(wf.finished_at)),
    ]  # fmt: skip
    if wf.metadata:
        pairs.append(("metadata", json.dumps(wf.metadata, ensure_ascii=False)))
    out.fields(pairs)
    out.line()
    rows: list[list[str]] = []
    colours: list[list[str | None]] = []
    for n in wf.nodes:
        error = f"{n.error_class}: {n.error_message}" if n.error_class else "-"
        rows.append([n.name, n.status, n.task_id, n.queue, after_text(n.after), error])
        colours.append([None, NODE_COLOUR.get(n.status), None, None, None, None])
    out.table(["NODE", "STATUS", "TASK_ID", "QUEUE", "AFTER", "ERROR"], rows, colours=colours)


async def submit(ctx: Ctx) -> int:
    data = read_workflow_file(ctx.args.file)
    wf = await ctx.q.submit_workflow(data, audit=ctx.audit())
    if ctx.json:
        ctx.out.json(wf.model_dump(mode="json"))
        return 0
    ctx.out.line(f"Submitted workflow {wf.workflow_id} ({len(wf.nodes)} nodes).")
    _print(ctx, wf)
    return 0


async def show(ctx: Ctx) -> int:
    wf = await ctx.q.get_workflow(ctx.args.workflow_id)
    if ctx.json:
        ctx.out.json(wf.model_dump(mode="json"))
        return 0
    _print(ctx, wf)
    return 0


async def cancel(ctx: Ctx) -> int:
    wf = await ctx.q.cancel_workflow(ctx.args.workflow_id, audit=ctx.audit())
    if ctx.json:
        ctx.out.json(wf.model_dump(mode="json"))
        return 0
    if wf.status == "running":
        ctx.out.line(
            f"Workflow {wf.workflow_id}: cancellation requested; it ends cancelled once its "
            f"running nodes have stopped (check with: dtq workflow show {wf.workflow_id})."
        )
    else:
        ctx.out.line(f"Workflow {wf.workflow_id} is {wf.status}.")
    _print(ctx, wf)
    return 0
