"""Workflows (docs/workflows.md): a DAG of tasks submitted as one object.

This module is pure: the specification a producer gives (:class:`WorkflowSpec`, its
:class:`NodeSpec` nodes and :class:`Edge` dependencies), its checks (duplicates, unknown
references, cycles), the builders of the common shapes (:func:`node`, :func:`chain`,
:func:`group`, :func:`chord`), the read model (:class:`Workflow`) and what a child sees of its
parents (:class:`ParentResult`). ``workflow.lua`` keeps the state; ``dtq.admin.workflows``
submits, reads and cancels; the worker relays node ends (``dtq.worker.workflows``).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dtq.errors import InvalidWorkflowError

__all__ = [
    "IDEMPOTENCY_PREFIX",
    "MAX_NODES",
    "NODE_NAME_RE",
    "Edge",
    "NodeSpec",
    "ParentResult",
    "Policy",
    "Shape",
    "Workflow",
    "WorkflowNode",
    "WorkflowSpec",
    "WorkflowStatus",
    "chain",
    "chord",
    "group",
    "node",
    "node_key",
    "parse_node_key",
]

MAX_NODES = 10_000
NODE_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,128}")
IDEMPOTENCY_PREFIX = "dtq-wf:"
"""A node's task has the idempotency key ``dtq-wf:<workflow_id>:<node>``: a release that is
repeated (after a crash of the worker relaying it) is absorbed, and the scripts that end a task
know to tell its workflow (``retain`` in ``_lib.lua``)."""

Policy = Literal["fail", "continue", "skip"]
WorkflowStatus = Literal["running", "succeeded", "failed", "cancelled", "expired"]


def node_key(workflow_id: str, name: str) -> str:
    """The idempotency key of node ``name``'s task."""
    return f"{IDEMPOTENCY_PREFIX}{workflow_id}:{name}"


def parse_node_key(key: str | None) -> tuple[str, str] | None:
    """(workflow_id, node) of a node's idempotency key; None for any other key."""
    if not key or not key.startswith(IDEMPOTENCY_PREFIX):
        return None
    wid, sep, name = key[len(IDEMPOTENCY_PREFIX) :].partition(":")
    return (wid, name) if sep and wid and name else None


class Edge(BaseModel):
    """A dependency: this node waits for ``node``; ``policy`` says what it does when ``node``
    ends other than succeeded (``fail``: it is cancelled and the workflow fails; ``continue``:
    it runs and sees the failure in its parent results; ``skip``: it is skipped)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node: str
    policy: Policy = "fail"


class NodeSpec(BaseModel):
    """One node: a name unique in its workflow, its dependencies, and an ordinary task spec.
    ``ttl_seconds`` counts from the node's release (when its task is queued)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    task_type: str
    payload: dict[str, Any] = Field(default_factory=dict)
    after: tuple[Edge, ...] = ()
    queue: str = "default"
    max_attempts: int | None = None
    priority: int | None = None
    timeout_ms: int | None = None
    expires_at: datetime | None = None
    ttl_seconds: float | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not NODE_NAME_RE.fullmatch(value):
            raise ValueError("must be 1-128 characters: letters, digits, '_', '.', '-'")
        return value

    @field_validator("after", mode="before")
    @classmethod
    def _after(cls, value: Any) -> Any:
        # "after": ["a", {"node": "b", "policy": "continue"}]: a bare name is a "fail" edge.
        if isinstance(value, str | bytes) or not isinstance(value, Iterable):
            raise ValueError("must be a list of node names or {node, policy} objects")
        return [{"node": v} if isinstance(v, str) else v for v in value]

    def submit_fields(self) -> dict[str, Any]:
        """The task's fields for SubmitRequest.build (JSON types), without the idempotency key."""
        out: dict[str, Any] = {
            "task_type": self.task_type,
            "payload": self.payload,
            "queue": self.queue,
        }
        for name in ("max_attempts", "priority", "timeout_ms", "ttl_seconds"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.expires_at is not None:
            out["expires_at"] = self.expires_at.isoformat()
        if self.metadata:
            out["metadata"] = self.metadata
        return out


def _describe(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ())) or "workflow"
    return f"{where}: {str(err.get('msg', 'invalid')).removeprefix('Value error, ')}"


class WorkflowSpec(BaseModel):
    """A workflow as submitted: its nodes (a DAG by their ``after`` edges) and metadata."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nodes: tuple[NodeSpec, ...]
    metadata: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def parse(cls, data: Any) -> WorkflowSpec:
        """Validate a workflow given as JSON data; INVALID_WORKFLOW names the first problem."""
        if isinstance(data, WorkflowSpec):
            spec = data
        else:
            if not isinstance(data, Mapping):
                raise InvalidWorkflowError("a workflow is a JSON object with a 'nodes' list")
            try:
                spec = cls.model_validate(data)
            except ValidationError as exc:
                raise InvalidWorkflowError(_describe(exc)) from None
        spec.check()
        return spec

    def check(self) -> None:
        """Empty, too large, duplicate names, unknown or self references, cycles."""
        if not self.nodes:
            raise InvalidWorkflowError("a workflow needs at least one node")
        if len(self.nodes) > MAX_NODES:
            raise InvalidWorkflowError(
                f"a workflow has at most {MAX_NODES} nodes, this one has {len(self.nodes)}"
            )
        names: set[str] = set()
        for n in self.nodes:
            if n.name in names:
                raise InvalidWorkflowError(f"node {n.name!r} is given twice", node=n.name)
            names.add(n.name)
        for n in self.nodes:
            seen: set[str] = set()
            for e in n.after:
                if e.node == n.name:
                    raise InvalidWorkflowError(f"node {n.name!r} depends on itself", node=n.name)
                if e.node not in names:
                    raise InvalidWorkflowError(
                        f"node {n.name!r} depends on {e.node!r}, which is not a node of this "
                        "workflow",
                        node=n.name,
                    )
                if e.node in seen:
                    raise InvalidWorkflowError(
                        f"node {n.name!r} depends on {e.node!r} twice", node=n.name
                    )
                seen.add(e.node)
        self.order()

    def order(self) -> list[NodeSpec]:
        """The nodes in an order where each comes after its dependencies (Kahn's algorithm, in
        the order given); a cycle is refused with its path."""
        by_name = {n.name: n for n in self.nodes}
        left = {n.name: len(n.after) for n in self.nodes}
        kids = self.children()
        ready = deque(n.name for n in self.nodes if not n.after)
        out: list[NodeSpec] = []
        while ready:
            name = ready.popleft()
            out.append(by_name[name])
            for kid, _ in kids[name]:
                left[kid] -= 1
                if left[kid] == 0:
                    ready.append(kid)
        if len(out) < len(self.nodes):
            raise InvalidWorkflowError(f"the dependencies make a cycle: {self._cycle(left)}")
        return out

    def _cycle(self, left: Mapping[str, int]) -> str:
        """One cycle among the nodes Kahn's algorithm could not order, as "a -> b -> a"."""
        by_name = {n.name: n for n in self.nodes}
        start = next(name for name, count in left.items() if count > 0)
        path: list[str] = []
        seen: dict[str, int] = {}
        cur = start
        while cur not in seen:
            seen[cur] = len(path)
            path.append(cur)
            cur = next(e.node for e in by_name[cur].after if left[e.node] > 0)
        loop = path[seen[cur] :]
        # The edges point from a node to what it waits for: print them in the order they run.
        loop.reverse()
        return " -> ".join([*loop, loop[0]])

    def children(self) -> dict[str, list[tuple[str, Policy]]]:
        """Each node's dependents with the policy of their edge, in node order."""
        kids: dict[str, list[tuple[str, Policy]]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for e in n.after:
                kids[e.node].append((n.name, e.policy))
        return kids


# -- shapes ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """Nodes built by :func:`node`, :func:`chain`, :func:`group` and :func:`chord`: ``heads``
    are the nodes with no dependency inside the shape, ``tails`` the ones nothing inside it
    depends on; composing two shapes makes the second's heads wait for the first's tails."""

    nodes: tuple[NodeSpec, ...]
    heads: tuple[str, ...]
    tails: tuple[str, ...]

    def after(self, parents: Sequence[str], policy: Policy) -> Shape:
        heads = set(self.heads)
        extra = tuple(Edge(node=p, policy=policy) for p in parents)
        nodes = tuple(
            n.model_copy(update={"after": (*n.after, *extra)}) if n.name in heads else n
            for n in self.nodes
        )
        return Shape(nodes, self.heads, self.tails)

    def spec(self, metadata: Mapping[str, Any] | None = None) -> WorkflowSpec:
        """The workflow of this shape, checked."""
        return WorkflowSpec.parse(WorkflowSpec(nodes=self.nodes, metadata=dict(metadata or {})))


def node(
    name: str, task_type: str, payload: Mapping[str, Any] | None = None, **options: Any
) -> Shape:
    """One node; ``options`` are NodeSpec's (queue, priority, max_attempts, timeout_ms,
    expires_at, ttl_seconds, metadata, after)."""
    try:
        spec = NodeSpec(name=name, task_type=task_type, payload=dict(payload or {}), **options)
    except ValidationError as exc:
        raise InvalidWorkflowError(f"node {name!r}: {_describe(exc)}", node=name) from None
    return Shape((spec,), (name,), (name,))


def chain(*steps: Shape, policy: Policy = "fail") -> Shape:
    """Each step after the one before it."""
    if not steps:
        raise InvalidWorkflowError("a chain needs at least one step")
    nodes = list(steps[0].nodes)
    tails = steps[0].tails
    for step in steps[1:]:
        nodes.extend(step.after(tails, policy).nodes)
        tails = step.tails
    return Shape(tuple(nodes), steps[0].heads, tails)


def group(*members: Shape) -> Shape:
    """Members that run side by side."""
    if not members:
        raise InvalidWorkflowError("a group needs at least one member")
    return Shape(
        tuple(n for m in members for n in m.nodes),
        tuple(h for m in members for h in m.heads),
        tuple(t for m in members for t in m.tails),
    )


def chord(members: Shape, callback: Shape, policy: Policy = "fail") -> Shape:
    """A callback after every member: it reads their results in ``ctx.parent_results``."""
    return chain(members, callback, policy=policy)


# -- what a node sees, what a reader sees ---------------------------------------------------


@dataclass(frozen=True)
class ParentResult:
    """One parent of a running node: its end and, when it succeeded, its result."""

    status: str
    result: Any = None
    error_class: str | None = None
    error_message: str | None = None

    @property
    def succeeded(self) -> bool:
        return self.status == "succeeded"


class WorkflowNode(BaseModel):
    name: str
    task_id: str
    queue: str
    task_type: str
    status: str = Field(
        description="waiting (its dependencies have not allowed it yet), skipped, or its "
        "task's status once released (queued, running, succeeded, dead_lettered, ...; released "
        "for the moment before its task is queued)"
    )
    after: list[Edge]
    error_class: str | None = None
    error_message: str | None = None


class Workflow(BaseModel):
    workflow_id: str
    status: WorkflowStatus
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None = None
    cancel_requested: bool = False
    metadata: dict[str, Any] = Field(default_factory=dict)
    nodes: list[WorkflowNode]
