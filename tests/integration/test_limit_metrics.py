"""The gauges of limit use (docs/operations.md, docs/limits.md): ``dtq_limit_running`` and
``dtq_limit_waiting`` on the API's ``/metrics``, read from the limits' state in Redis while an
in-process worker's handlers hold their places, summed over the key values of a keyed limit
(never a key value as a label), back to 0 once the places are given back."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis
from test_metrics import Scrape, check_labels, gauges_text

from dtq import Queue, keys
from dtq.config import Settings
from dtq.limits import LimitDef
from dtq.metrics import Metrics
from dtq.metrics.limit_gauges import LimitUseReader
from dtq_tasks import TaskContext
from support import running_worker, wait_until
from support.api import Api
from support.worker import fast, handlers

pytestmark = pytest.mark.backends("single", "cluster")

TENANT_MARKER = "tenant-marker-4b1e"


async def define(r: Redis, name: str, **fields: Any) -> None:
    d = LimitDef.parse(fields)
    await r.hset(keys.limits(d.queue), name, d.to_json())


class Gate:
    """Handlers that run until the test opens the gate; ``running`` counts them."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.running = 0

    async def hold(self, payload: dict[str, Any], ctx: TaskContext) -> None:
        self.running += 1
        try:
            await self.open.wait()
        finally:
            self.running -= 1


async def scrape(api: Api) -> Scrape:
    resp = await api.client.get("/metrics")
    assert resp.status_code == 200, resp.text
    return Scrape(resp.text)


def use(s: Scrape, limit: str) -> tuple[float, float, list[dict[str, str]]]:
    running = s.samples("dtq_limit_running")
    return (
        s.value("dtq_limit_running", limit=limit),
        s.value("dtq_limit_waiting", limit=limit),
        [x.labels for x in running if x.labels["limit"] == limit],
    )


async def test_limit_gauges_follow_the_places_held_and_waited_for(
    queue: Queue, settings: Settings, r: Redis, api: Api
) -> None:
    await define(r, "two-at-once", task_type="hold", concurrency=2)
    await define(r, "per-tenant", task_type="khold", key="payload.tenant", concurrency=1)
    await define(r, "elsewhere", queue="other", concurrency=3)  # a queue with nothing running
    await r.sadd(keys.QUEUES, "other")
    gate = Gate()
    async with running_worker(  # served, so that the idle "other" queue stays listed
        fast(settings),
        handlers(hold=gate.hold, khold=gate.hold),
        queues=("default", "other"),
        concurrency=8,
    ):
        await r.hset(keys.limits("default"), "broken", "{not json")  # left out, as workers do
        ids = [(await queue.submit("hold", {})).task_id for _ in range(5)]
        tenants = [TENANT_MARKER + "-a"] * 3 + [TENANT_MARKER + "-b"] * 2
        ids += [(await queue.submit("khold", {"tenant": t})).task_id for t in tenants]
        # 2 of "hold" and one per tenant run; the other 3 + 3 are parked for a place.
        await wait_until(lambda: _running(gate, 4), 10, "four handlers hold their places")
        seen: Scrape | None = None

        async def all_parked() -> bool:
            nonlocal seen
            seen = await scrape(api)
            return use(seen, "two-at-once")[1] == 3 and use(seen, "per-tenant")[1] == 3

        await wait_until(all_parked, 10, "the parked tasks are counted")
        assert seen is not None
        assert use(seen, "two-at-once") == (
            2,
            3,
            [{"queue": "default", "task_type": "hold", "limit": "two-at-once"}],
        )
        assert use(seen, "per-tenant") == (
            2,
            3,
            [{"queue": "default", "task_type": "khold", "limit": "per-tenant"}],
        )
        assert use(seen, "elsewhere") == (
            0,
            0,
            [{"queue": "other", "task_type": "", "limit": "elsewhere"}],
        )
        assert not seen.samples("dtq_limit_running") or all(
            x.labels["limit"] != "broken" for x in seen.samples("dtq_limit_running")
        )
        check_labels(seen, [TENANT_MARKER])
        gate.open.set()
        await queue.wait_many(ids, timeout=60)
        after = await scrape(api)
    assert use(after, "two-at-once")[:2] == (0, 0)
    assert use(after, "per-tenant")[:2] == (0, 0)


async def _running(gate: Gate, n: int) -> bool:
    return gate.running == n


async def test_a_keyed_limit_sums_at_most_the_cap_of_its_key_states(
    settings: Settings, r: Redis
) -> None:
    """Past the cap, the scan stops: the sums cover the keys found (each key state here holds
    one task, so the sum is the number of keys read)."""
    await define(r, "per-tenant", key="payload.tenant", concurrency=1)
    for i in range(30):
        await r.zadd(keys.limit_state("default", "per-tenant", f"t{i}") + ":running", {"x": 1})
    raw = await r.hgetall(keys.limits("default"))
    (whole,) = await LimitUseReader().read(r, raw)
    assert (whole.running, whole.waiting) == (30, 0)
    (capped,) = await LimitUseReader(keyed_cap=10).read(r, raw)
    assert capped.running == 10


async def test_the_first_scrape_has_the_limits_of_a_queue_it_did_not_know(
    settings: Settings, r: Redis
) -> None:
    """In the cluster layout a queue's limits are in that queue's hash: a queue listed since
    the last scrape has its hash read in the same scrape."""
    await define(r, "elsewhere", queue="other", task_type="work", concurrency=3)
    await r.sadd(keys.QUEUES, "other")
    metrics = Metrics()
    metrics.add_redis_gauges(settings)
    await metrics.refresh(r)
    scrape = gauges_text(metrics)
    (sample,) = scrape.samples("dtq_limit_running")
    assert sample.labels == {"queue": "other", "task_type": "work", "limit": "elsewhere"}
    assert sample.value == 0 and scrape.value("dtq_limit_waiting", limit="elsewhere") == 0
