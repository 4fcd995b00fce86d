"""A Redis Cluster that refuses every command for a while (CLUSTERDOWN), as it does from the
moment its nodes agree a primary has failed until a replica serves that primary's slots: the
SDK says Redis is unavailable, and a worker's finish waits for the cluster instead of leaving
its entry to be run again.

The cluster here is a private one-primary cluster: ``CLUSTER DELSLOTS`` of one slot makes it
refuse every command (``cluster-require-full-coverage``, on by default), ``CLUSTER ADDSLOTS``
of that slot makes it serve again. No key of these tests is in that slot."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis as sync_redis
from redis.exceptions import ClusterDownError

from dtq import Queue, calls, connect, keys
from dtq.config import Settings
from dtq.devcluster import DevCluster, start_cluster
from dtq.errors import RedisUnavailableError
from dtq_tasks import TaskContext
from support import running_worker, wait_until
from support.worker import handlers

DOWN_SLOT = 0  # the slot taken away and given back
QUEUE = "down"


@pytest.fixture(scope="module")
def one_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    with start_cluster(Path(tmp_path_factory.mktemp("down")), primaries=1, replicas=0) as c:
        yield c


def _slots(cluster: DevCluster, *args: Any) -> None:
    client = sync_redis.Redis(port=cluster.primaries()[0].port, decode_responses=True)
    try:
        client.execute_command("CLUSTER", *args, DOWN_SLOT)  # type: ignore[no-untyped-call]
    finally:
        client.close()


def _state(cluster: DevCluster) -> str:
    client = sync_redis.Redis(port=cluster.primaries()[0].port, decode_responses=True)
    try:
        info = client.execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
    finally:
        client.close()
    return "ok" if "cluster_state:ok" in info else "fail"


async def _set_state(cluster: DevCluster, want: str) -> None:
    _slots(cluster, "DELSLOTS" if want == "fail" else "ADDSLOTS")

    async def reached() -> bool:
        return _state(cluster) == want

    await wait_until(reached, 10, f"cluster_state:{want}")


@pytest.fixture
def dsettings(one_node: DevCluster) -> Iterator[Settings]:
    one_node.flushall()
    assert keys.slot("{" + QUEUE + "}") != DOWN_SLOT
    yield Settings(
        redis_url=one_node.url,
        redis_cluster=True,
        visibility_timeout_s=6,
        heartbeat_interval_s=0.5,
        reaper_interval_s=0.5,
    )
    if _state(one_node) != "ok":
        _slots(one_node, "ADDSLOTS")


@pytest.fixture
async def dq(dsettings: Settings) -> AsyncIterator[Queue]:
    q = await connect(settings=dsettings)
    yield q
    await q.close()
    keys.use_layout(False)


async def test_a_submit_to_a_down_cluster_is_redis_unavailable(
    dq: Queue, one_node: DevCluster
) -> None:
    await _set_state(one_node, "fail")
    with pytest.raises(RedisUnavailableError, match="cluster is down"):
        await dq.submit("echo_task", {}, queue=QUEUE)
    await _set_state(one_node, "ok")
    task = await dq.submit("echo_task", {}, queue=QUEUE)
    assert (await dq.get(task.task_id)).status == "queued"


async def test_a_finish_refused_by_a_down_cluster_is_sent_again(
    dq: Queue, dsettings: Settings, one_node: DevCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler ends while the cluster is down: its finish is refused (it did not run) and
    sent again once the cluster serves, within the finisher's budget (half the visibility
    timeout). Left to the reaper, the entry would run a second attempt after the visibility
    timeout."""
    running, release = asyncio.Event(), asyncio.Event()
    runs: list[int] = []
    refused: list[Any] = []
    real_finish_many = calls.finish_many

    async def finish_many(*args: Any) -> list[Any]:  # the real calls, their replies seen
        replies = await real_finish_many(*args)
        refused.extend(r for r in replies if isinstance(r, ClusterDownError))
        return replies

    monkeypatch.setattr(calls, "finish_many", finish_many)

    async def held(payload: dict[str, Any], ctx: TaskContext) -> str:
        runs.append(ctx.attempt)
        running.set()
        await release.wait()
        return "done"

    async with running_worker(dsettings, handlers(cd_held=held), queues=(QUEUE,)):
        task = await dq.submit("cd_held", {}, queue=QUEUE)
        await asyncio.wait_for(running.wait(), 10)
        await _set_state(one_node, "fail")
        release.set()

        async def finish_refused() -> bool:
            return bool(refused)

        await wait_until(finish_refused, 5, "the finish refused by the down cluster")
        await _set_state(one_node, "ok")

        async def succeeded() -> bool:
            return (await dq.get(task.task_id)).status == "succeeded"

        await wait_until(succeeded, dsettings.visibility_timeout_s / 2, "succeeded")
        history = await dq.history(task.task_id)
    assert runs == [1]
    assert [h.to_status for h in history] == ["queued", "running", "succeeded"]


async def test_a_start_refused_by_a_down_cluster_is_sent_again(
    dq: Queue,
    dsettings: Settings,
    one_node: DevCluster,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The cluster goes down between the read that delivered an entry and its start: the
    start is refused (it did not run), kept, and sent again once the cluster serves, with no
    error logged for the task. Left to the reaper, the entry would wait for the visibility
    timeout."""
    runs: list[int] = []
    refused: list[Any] = []
    real_start_many = calls.start_many

    async def start_many(*args: Any) -> list[Any]:  # the first start meets a down cluster
        down = not refused
        if down:
            _slots(one_node, "DELSLOTS")
        try:
            replies = await real_start_many(*args)
        finally:
            if down:
                await _set_state(one_node, "ok")
        refused.extend(r for r in replies if isinstance(r, ClusterDownError))
        return replies

    async def noted(payload: dict[str, Any], ctx: TaskContext) -> str:
        runs.append(ctx.attempt)
        return "done"

    monkeypatch.setattr(calls, "start_many", start_many)
    async with running_worker(dsettings, handlers(cd_noted=noted), queues=(QUEUE,)):
        task = await dq.submit("cd_noted", {}, queue=QUEUE)

        async def succeeded() -> bool:
            try:
                return (await dq.get(task.task_id)).status == "succeeded"
            except RedisUnavailableError:  # asked while the start met the down cluster
                return False

        await wait_until(succeeded, dsettings.visibility_timeout_s / 2, "succeeded")
        history = await dq.history(task.task_id)
    assert refused and runs == [1]
    assert [h.to_status for h in history] == ["queued", "running", "succeeded"]
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def test_queue_figures_of_a_down_cluster_are_an_error_not_zero(
    dq: Queue, dsettings: Settings, one_node: DevCluster
) -> None:
    """While the cluster answers CLUSTERDOWN, a queue's stats and the Redis gauges fail as Redis
    unavailable (the SDK) or are not collected (the gauges): never a queue reported empty."""
    from redis.asyncio import Redis

    from dtq.metrics.redis_gauges import RedisGauges

    for i in range(3):
        await dq.submit("echo_task", {"i": i}, queue=QUEUE)
    assert (await dq.queue_stats(QUEUE)).depth == 3
    gauges = RedisGauges(dsettings)
    await gauges.refresh(cast(Redis, dq.redis))
    assert {m.name for m in gauges.collect()} >= {"dtq_queue_depth"}
    await _set_state(one_node, "fail")
    try:
        with pytest.raises(RedisUnavailableError):
            await dq.queue_stats(QUEUE)
        await gauges.refresh(cast(Redis, dq.redis))
        assert list(gauges.collect()) == []  # nothing collected, rather than zeros
    finally:
        await _set_state(one_node, "ok")
    assert (await dq.queue_stats(QUEUE)).depth == 3
