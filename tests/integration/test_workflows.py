"""Workflows (docs/workflows.md) against real servers, in both layouts: chains that hand results
down, a diamond under each failure policy, the skip cascade, a chord, a retried step that never
reruns the step before it, cancellation, nodes on queues of different primaries, and the
workflows refused at submit. Every test waits for a terminal workflow state (with a deadline)
and asserts it: none waits on a workflow that could hang."""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import pytest
from redis.asyncio import Redis

from dtq import Queue, Workflow, chain, chord, group, keys, node
from dtq.config import Settings
from dtq.errors import InvalidWorkflowError, WorkflowNotFoundError
from dtq.workflows import WorkflowSpec
from dtq_tasks import PermanentError, RetryableError, TaskContext
from support import running_worker, wait_until
from support.events import Events
from support.worker import fast, handlers

pytestmark = pytest.mark.backends("single", "cluster")

TERMINAL = {"succeeded", "failed", "cancelled", "expired"}


async def ended(queue: Queue, workflow_id: str, timeout_s: float = 30.0) -> Workflow:
    """The workflow once it has ended (asserted terminal: a hang fails here, at the deadline)."""
    seen: Workflow | None = None

    async def done() -> bool:
        nonlocal seen
        seen = await queue.get_workflow(workflow_id)
        return seen.status in TERMINAL

    await wait_until(done, timeout_s=timeout_s, what=f"workflow {workflow_id} to end")
    assert seen is not None
    return seen


def states(wf: Workflow) -> dict[str, str]:
    return {n.name: n.status for n in wf.nodes}


class Log:
    """What each handler call saw: node names in call order, and each node's parents."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.parents: dict[str, dict[str, Any]] = {}

    async def step(self, payload: dict[str, Any], ctx: TaskContext) -> Any:
        assert ctx.node is not None and ctx.workflow_id is not None
        self.calls.append(ctx.node)
        self.parents[ctx.node] = dict(ctx.parent_results)
        if payload.get("fail"):
            raise PermanentError(f"{ctx.node} fails")
        return {"node": ctx.node, "n": payload.get("n")}


async def test_a_chain_hands_each_result_to_the_next(
    queue: Queue, settings: Settings, r: Redis
) -> None:
    log = Log()
    shape = chain(
        node("a", "step", {"n": 1}), node("b", "step", {"n": 2}), node("c", "step", {"n": 3})
    )
    wf = await queue.submit_workflow(shape, metadata={"owner": "tests"})
    assert wf.status == "running" and wf.metadata == {"owner": "tests"}
    assert states(wf) == {"a": "queued", "b": "waiting", "c": "waiting"}
    async with running_worker(fast(settings), handlers(step=log.step)):
        wf = await ended(queue, wf.workflow_id)
    assert wf.status == "succeeded" and wf.finished_at is not None
    assert states(wf) == {"a": "succeeded", "b": "succeeded", "c": "succeeded"}
    assert log.calls == ["a", "b", "c"]
    assert log.parents["a"] == {}
    b_parent = log.parents["b"]["a"]
    assert b_parent.succeeded and b_parent.result == {"node": "a", "n": 1}
    assert log.parents["c"]["b"].result == {"node": "b", "n": 2}
    # Results were kept without a TTL while the workflow ran; from its end they have one.
    for n in wf.nodes:
        ttl = await r.ttl(keys.result(n.task_id))
        assert 0 < ttl <= settings.result_retention_s
    assert await r.ttl(keys.workflow(wf.workflow_id)) > 0
    # The nodes are ordinary tasks with the node's idempotency key.
    task = await queue.get(wf.nodes[0].task_id)
    assert task.idempotency_key == f"dtq-wf:{wf.workflow_id}:a"


@pytest.mark.parametrize(
    ("policy", "d_status", "wf_status"),
    [
        ("fail", "cancelled", "failed"),
        ("continue", "succeeded", "succeeded"),
        ("skip", "skipped", "succeeded"),
    ],
)
async def test_a_diamond_follows_the_policy_of_the_failed_edge(
    queue: Queue, settings: Settings, policy: str, d_status: str, wf_status: str
) -> None:
    log = Log()
    spec = WorkflowSpec.parse(
        {
            "nodes": [
                {"name": "a", "task_type": "step"},
                {
                    "name": "b",
                    "task_type": "step",
                    "payload": {"fail": True},
                    "after": ["a"],
                    "max_attempts": 1,
                },
                {"name": "c", "task_type": "step", "after": ["a"]},
                {"name": "d", "task_type": "step", "after": [{"node": "b", "policy": policy}, "c"]},
            ]
        }
    )
    wf = await queue.submit_workflow(spec)
    async with running_worker(fast(settings), handlers(step=log.step)):
        wf = await ended(queue, wf.workflow_id)
    got = states(wf)
    assert got["a"] == "succeeded" and got["c"] == "succeeded"
    assert got["b"] == "dead_lettered"
    assert got["d"] == d_status
    assert wf.status == wf_status
    d = next(n for n in wf.nodes if n.name == "d")
    if policy == "continue":
        seen = log.parents["d"]
        assert seen["b"].status == "dead_lettered" and not seen["b"].succeeded
        assert seen["b"].error_message and "b fails" in seen["b"].error_message
        assert seen["c"].succeeded
    else:
        assert "d" not in log.calls
        assert d.error_class == ("DependencyFailed" if policy == "fail" else "DependencySkipped")


async def test_a_skip_cascades_by_each_dependents_own_policy(
    queue: Queue, settings: Settings
) -> None:
    log = Log()
    spec = WorkflowSpec.parse(
        {
            "nodes": [
                {"name": "a", "task_type": "step", "payload": {"fail": True}, "max_attempts": 1},
                {"name": "b", "task_type": "step", "after": [{"node": "a", "policy": "skip"}]},
                {"name": "c", "task_type": "step", "after": ["b"]},
                {"name": "d", "task_type": "step", "after": [{"node": "b", "policy": "skip"}]},
                {"name": "e", "task_type": "step", "after": [{"node": "b", "policy": "continue"}]},
            ]
        }
    )
    wf = await queue.submit_workflow(spec)
    async with running_worker(fast(settings), handlers(step=log.step)):
        wf = await ended(queue, wf.workflow_id)
    assert states(wf) == {
        "a": "dead_lettered",
        "b": "skipped",
        "c": "skipped",
        "d": "skipped",
        "e": "succeeded",
    }
    assert log.parents["e"]["b"].status == "skipped"
    assert wf.status == "succeeded"  # a's failure was handled by a skip edge


async def test_an_unhandled_failure_fails_the_workflow(queue: Queue, settings: Settings) -> None:
    log = Log()
    shape = group(node("a", "step"), node("b", "step", {"fail": True}, max_attempts=1))
    wf = await queue.submit_workflow(shape)
    async with running_worker(fast(settings), handlers(step=log.step)):
        wf = await ended(queue, wf.workflow_id)
    assert wf.status == "failed"
    assert states(wf) == {"a": "succeeded", "b": "dead_lettered"}


async def test_a_chord_callback_gets_every_result_once(queue: Queue, settings: Settings) -> None:
    log = Log()
    members = group(*(node(f"m{i}", "step", {"n": i}) for i in range(50)))
    wf = await queue.submit_workflow(chord(members, node("sum", "step")))
    async with running_worker(fast(settings), handlers(step=log.step), concurrency=16):
        wf = await ended(queue, wf.workflow_id, timeout_s=60)
    assert wf.status == "succeeded"
    assert Counter(log.calls) == Counter([*(f"m{i}" for i in range(50)), "sum"])
    parents = log.parents["sum"]
    assert sorted(p.result["n"] for p in parents.values()) == list(range(50))


async def test_a_retried_step_never_reruns_the_step_before_it(
    queue: Queue, settings: Settings, r: Redis
) -> None:
    ttls: list[int] = []
    first_id: list[str] = []
    calls: Counter[str] = Counter()

    async def first(payload: dict[str, Any], ctx: TaskContext) -> str:
        calls["first"] += 1
        return "made once"

    async def second(payload: dict[str, Any], ctx: TaskContext) -> str:
        calls["second"] += 1
        # The parent's result is kept without a TTL while the workflow runs.
        ttls.append(await r.ttl(keys.result(first_id[0])))
        if ctx.attempt <= 2:
            raise RetryableError("not yet")
        return f"{ctx.parent_results['first'].result} and used"

    wf = await queue.submit_workflow(
        chain(node("first", "first"), node("second", "second", max_attempts=5))
    )
    first_id.append(wf.nodes[0].task_id)
    async with running_worker(fast(settings), handlers(first=first, second=second)):
        wf = await ended(queue, wf.workflow_id)
    assert wf.status == "succeeded"
    assert calls == {"first": 1, "second": 3}
    assert ttls == [-1, -1, -1]
    second_task = await queue.get(wf.nodes[1].task_id)
    assert second_task.attempt == 3 and second_task.result == "made once and used"


async def test_cancelling_a_workflow_cancels_what_has_not_ended(
    queue: Queue, settings: Settings
) -> None:
    go = asyncio.Event()
    running: list[str] = []

    async def slow(payload: dict[str, Any], ctx: TaskContext) -> None:
        running.append(str(ctx.node))
        await go.wait()

    shape = chain(group(node("a", "slow"), node("b", "slow", queue="parked")), node("c", "slow"))
    wf = await queue.submit_workflow(shape)
    async with running_worker(fast(settings), handlers(slow=slow)):

        async def a_runs() -> bool:
            return running == ["a"]

        await wait_until(a_runs, what="node a to run")
        wf = await queue.cancel_workflow(wf.workflow_id)
        assert wf.cancel_requested
        wf = await ended(queue, wf.workflow_id)
    assert wf.status == "cancelled"
    assert states(wf) == {"a": "cancelled", "b": "cancelled", "c": "cancelled"}
    assert running == ["a"]
    # An ended workflow is returned as it is.
    again = await queue.cancel_workflow(wf.workflow_id)
    assert again.status == "cancelled"


async def test_nodes_on_queues_of_other_primaries(queue: Queue, settings: Settings) -> None:
    log = Log()
    names = ["alpha", "beta", "gamma", "delta"]
    shape = chord(
        group(*(node(q, "step", {"n": i}, queue=q) for i, q in enumerate(names))),
        node("end", "step", queue="delta"),
    )
    wf = await queue.submit_workflow(shape)
    async with running_worker(fast(settings), handlers(step=log.step), queues=tuple(names)):
        wf = await ended(queue, wf.workflow_id)
    assert wf.status == "succeeded"
    assert sorted(p.result["n"] for p in log.parents["end"].values()) == [0, 1, 2, 3]
    assert {n.queue for n in wf.nodes} == set(names)


async def test_a_node_expired_at_its_release_ends_its_workflow_expired(
    queue: Queue, settings: Settings, r: Redis
) -> None:
    """A node whose deadline passed before its dependencies allowed it ends expired at its
    release (its task is made expired), and its workflow with it."""
    gate = asyncio.Event()

    async def hold(payload: dict[str, Any], ctx: TaskContext) -> None:
        await gate.wait()

    now = await queue.now()
    soon = now.timestamp() + 1.0
    expires = datetime.fromtimestamp(soon, UTC)
    wf = await queue.submit_workflow(
        chain(node("a", "hold"), node("b", "hold", expires_at=expires))
    )
    async with running_worker(fast(settings), handlers(hold=hold)):

        async def past() -> bool:
            return (await queue.now()).timestamp() > soon

        await wait_until(past, what="b's expiry to pass")
        gate.set()
        wf = await ended(queue, wf.workflow_id)
    assert states(wf) == {"a": "succeeded", "b": "expired"}
    assert wf.status == "expired"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"nodes": []}, "at least one node"),
        ({"nodes": [{"name": "a", "task_type": "t"}, {"name": "a", "task_type": "t"}]}, "twice"),
        ({"nodes": [{"name": "a", "task_type": "t", "after": ["zz"]}]}, "'zz'"),
        ({"nodes": [{"name": "a", "task_type": "t", "after": ["a"]}]}, "itself"),
        (
            {
                "nodes": [
                    {"name": "a", "task_type": "t", "after": ["c"]},
                    {"name": "b", "task_type": "t", "after": ["a"]},
                    {"name": "c", "task_type": "t", "after": ["b"]},
                ]
            },
            "cycle",
        ),
        ({"nodes": [{"name": "a b", "task_type": "t"}]}, "nodes.0.name"),
        ({"nodes": [{"name": "a", "task_type": "t", "priority": 12}]}, "node 'a'"),
        (
            {"nodes": [{"name": "a", "task_type": "t", "after": [{"node": "a", "policy": "x"}]}]},
            "policy",
        ),
        ({"nodes": "a"}, "nodes"),
        ([1, 2], "JSON object"),
    ],
)
async def test_a_bad_workflow_is_refused_whole(
    queue: Queue, r: Redis, body: Any, message: str
) -> None:
    with pytest.raises(InvalidWorkflowError) as err:
        await queue.submit_workflow(body)
    assert err.value.code == "INVALID_WORKFLOW"
    assert message in err.value.message
    assert not [k async for k in r.scan_iter(match="*workflow*")]


async def test_an_unknown_workflow_is_not_found(queue: Queue) -> None:
    with pytest.raises(WorkflowNotFoundError):
        await queue.get_workflow("0" * 32)
    with pytest.raises(WorkflowNotFoundError):
        await queue.cancel_workflow("0" * 32)


async def test_a_workflow_publishes_its_submit_and_its_end(
    queue: Queue, settings: Settings, r: Redis
) -> None:
    log = Log()
    async with Events(r, queues=("default", "other")) as events:
        wf = await queue.submit_workflow(chain(node("a", "step"), node("b", "step", queue="other")))
        async with running_worker(
            fast(settings), handlers(step=log.step), queues=("default", "other")
        ):
            wf = await ended(queue, wf.workflow_id)
            [done] = await events.wait_for("WORKFLOW_SUCCEEDED")
        [submitted] = events.of("WORKFLOW_SUBMITTED")
    assert submitted.metadata == {"workflow_id": wf.workflow_id, "status": "running", "nodes": 2}
    assert done.metadata == {"workflow_id": wf.workflow_id, "status": "succeeded"}
    assert done.queue == submitted.queue == "default"  # the home queue's channel
    assert done.task_id is None and done.task_type is None
    assert not events.of("WORKFLOW_FAILED")
