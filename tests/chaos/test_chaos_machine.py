"""A hypothesis state machine against the real Redis: random interleavings of submit, deliver,
start, finish, crash, reclaim, promote, heartbeat, cancel and expire, driven through dtq's own
seams (the SDK and Store for submits, ``dtq.admin`` for cancel and expire, the scheduler's
``tick`` for promotion and the expiry sweep, and ``dtq.calls`` for the start, finish and touch
scripts), so every state change is made by the real Lua scripts.

The model keeps only what a worker keeps locally (the entries each consumer was delivered and
is running) and never predicts a status; the invariants are read from Redis after every step:

- each task is in exactly one place: waiting in its stream, delivered (in the consumer group's
  pending list, PEL), in the retry schedule or the scheduler's claimed set, or nowhere
  (terminal);
- a PEL entry belongs to a RUNNING task, or to a task delivered but not started yet: QUEUED,
  or CANCELLED/EXPIRED while delivered (that entry waits for its consumer's start script,
  which acknowledges it without running; the task is then in ``dtq:cancelled`` if cancelled);
- a scheduled task (PENDING, RETRYING) has no stream or PEL entry;
- a terminal task has no schedule, claim or expiry member; a finished one (succeeded, failed,
  dead-lettered) no PEL entry either;
- an expiry member belongs to a task not started, with its deadline as score;
- a terminal status never changes, and the history's last step is the status;
- every key has a TTL or is documented as bounded (``docs/redis-schema.md``);
- fencing: a start or finish by a consumer that does not own the entry changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
from chaos_bounds import audit_keys
from hypothesis import HealthCheck, Phase, event
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from redis.asyncio import Redis

from dtq import admin, keys
from dtq.calls import (
    Entry,
    Outcome,
    entry_key,
    finish_call,
    finish_many,
    parse_read,
    start_many,
    touch,
)
from dtq.client import Queue
from dtq.config import Settings
from dtq.errors import DtqError
from dtq.scripts import Scripts
from dtq.worker.scheduler import Scheduler
from support.chaos_run import full_run

T = TypeVar("T")
QUEUE = "default"
STREAMS = keys.queue_streams(QUEUE)
TERMINAL = {"succeeded", "failed", "dead_lettered", "cancelled", "expired"}
FINISHED = {"succeeded", "failed", "dead_lettered"}
NOT_STARTED = {"pending", "queued", "retrying"}
# Nothing here depends on how long the steps take, so that hypothesis can replay and shrink
# a failing run: "soon" is due after 1 ms and the promote rule waits 5 ms first; a deadline is
# either already passed at submit (ttl 0) or far away.
SUBMITS: dict[str, dict[str, Any]] = {
    "now": {},
    "soon": {"delay_seconds": 0.001},
    "later": {"delay_seconds": 3600},
    "far deadline": {"ttl_seconds": 3600},
    "expired": {"ttl_seconds": 0},
}
PROMOTE_WAIT_S = 0.005
TICK_S = 0.002  # after a submit or a finish: no two schedule scores tie (ties order by id)
OUTCOMES: dict[str, Outcome] = {
    "success": Outcome("success", duration_ms=1, result_json='{"ok":true}'),
    "retry": Outcome("error", error_class="RetryableError", error_message="x", retryable=True),
    "permanent": Outcome("error", error_class="PermanentError", error_message="x"),
    "reschedule": Outcome("reschedule", delay_ms=0),
    "cancelled": Outcome("cancelled", duration_ms=1),
}


@dataclass
class Consumer:
    """What one worker process knows: entries delivered to it, executions it runs."""

    # Keyed by (stream, entry id), in the order they came: hypothesis draws from these lists,
    # and a draw must not depend on random ids for a failing run to replay.
    delivered: dict[tuple[str, str], Entry] = field(default_factory=dict)
    running: dict[tuple[str, str], tuple[Entry, int]] = field(default_factory=dict)


class DeliveryMachine(RuleBasedStateMachine):
    def __init__(self, url: str) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.settings = Settings(
            redis_url=url, visibility_timeout_s=2, heartbeat_interval_s=0.5, dlq_maxlen=100
        )
        self.r = Redis.from_url(url, decode_responses=True)
        self.scripts = Scripts()
        self.queue = Queue(self.r, self.settings, scripts=self.scripts)
        self.store = self.queue.store
        self.scheduler = Scheduler(self.store, self.settings, "sm-scheduler")
        self.tasks: list[str] = []
        self.consumers: dict[str, Consumer] = {}
        self.serial = 0
        self.final: dict[str, str] = {}

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        self.run(self.r.aclose())
        self.loop.close()

    def _new_consumer(self) -> None:
        self.serial += 1
        self.consumers[f"w{self.serial}"] = Consumer()

    @initialize()
    def clean(self) -> None:
        self.run(self.r.flushall())
        self.run(self.store.ensure_groups(QUEUE))  # what every worker does at start
        for _ in range(2):
            self._new_consumer()

    # -- rules ------------------------------------------------------------------------------

    @rule(
        kind=st.sampled_from(sorted(SUBMITS)), priority=st.integers(0, 9), tries=st.integers(1, 3)
    )
    def submit(self, kind: str, priority: int, tries: int) -> None:
        task = self.run(
            self.queue.submit("sm_task", {}, priority=priority, max_attempts=tries, **SUBMITS[kind])
        )
        self.tasks.append(task.task_id)
        self.run(asyncio.sleep(TICK_S))

    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        """XREADGROUP of one entry, as the worker's poll loop does (strict priority)."""
        name = data.draw(st.sampled_from(sorted(self.consumers)))
        for stream in STREAMS:
            reply = self.run(self.r.xreadgroup(keys.CONSUMER_GROUP, name, {stream: ">"}, count=1))
            entries, bad = parse_read(reply)
            assert not bad
            if entries:
                self.consumers[name].delivered[(stream, entries[0].entry_id)] = entries[0]
                return

    @precondition(lambda self: any(c.delivered for c in self.consumers.values()))
    @rule(data=st.data())
    def start(self, data: st.DataObject) -> None:
        name = data.draw(
            st.sampled_from(sorted(n for n, c in self.consumers.items() if c.delivered))
        )
        c = self.consumers[name]
        entry = c.delivered.pop(data.draw(st.sampled_from(list(c.delivered))))
        owner, before = self._owner(entry), self._snapshot(entry.task_id)
        [reply] = self.run(start_many(self.store, [entry], name))
        assert not isinstance(reply, Exception), reply
        event(f"start: {reply.kind}" + (" (zombie)" if owner != name else ""))
        if owner != name:
            assert reply.kind == "fenced", (owner, name, reply)
            assert self._snapshot(entry.task_id) == before, "a fenced start changed the task"
        elif reply.kind == "run":
            c.running[(entry.stream, entry.entry_id)] = (entry, reply.attempt)

    @precondition(lambda self: any(c.running for c in self.consumers.values()))
    @rule(data=st.data(), outcome=st.sampled_from(sorted(OUTCOMES)))
    def finish(self, data: st.DataObject, outcome: str) -> None:
        name = data.draw(st.sampled_from(sorted(n for n, c in self.consumers.items() if c.running)))
        c = self.consumers[name]
        entry, attempt = c.running.pop(data.draw(st.sampled_from(list(c.running))))
        owner, before = self._owner(entry), self._snapshot(entry.task_id)
        call = finish_call(entry, attempt, OUTCOMES[outcome], name, self.settings)
        [reply] = self.run(finish_many(self.store, [call]))
        assert not isinstance(reply, Exception), reply
        event(f"finish: {reply.status}" + (" (zombie)" if owner != name else ""))
        if owner != name:
            assert reply.status == "fenced", (owner, name, reply)
        if reply.status == "fenced":
            assert self._snapshot(entry.task_id) == before, "a fenced finish changed the task"
        self.run(asyncio.sleep(TICK_S))

    @rule(data=st.data())
    def crash(self, data: st.DataObject) -> None:
        """A worker dies: what it knew is gone, its pending entries stay for a reaper."""
        del self.consumers[data.draw(st.sampled_from(sorted(self.consumers)))]
        self._new_consumer()

    @rule(data=st.data())
    def reclaim(self, data: st.DataObject) -> None:
        """XAUTOCLAIM as if the visibility timeout had passed for every pending entry (their
        holders, if alive, become zombies that still believe they hold them)."""
        name = data.draw(st.sampled_from(sorted(self.consumers)))
        c = self.consumers[name]
        for stream in STREAMS:
            reply = self.run(
                self.r.xautoclaim(stream, keys.CONSUMER_GROUP, name, 0, "0-0", count=10)
            )
            for entry_id, fields in reply[1]:
                entry = Entry.parse(stream, entry_id, fields)
                if entry is not None and (stream, entry_id) not in c.running:
                    c.delivered[(stream, entry_id)] = entry

    @rule()
    def promote(self) -> None:
        """One scheduler tick: due retries and delayed tasks promoted, due deadlines swept."""
        self.run(asyncio.sleep(PROMOTE_WAIT_S))
        self.run(self.scheduler.tick())

    @precondition(lambda self: any(c.running for c in self.consumers.values()))
    @rule(data=st.data())
    def heartbeat(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(n for n, c in self.consumers.items() if c.running)))
        c = self.consumers[name]
        owned = list(c.running)
        triples = [(stream, eid, c.running[(stream, eid)][0].task_id) for stream, eid in owned]
        lost = set(self.run(touch(self.store, name, triples)))
        for key in owned:  # the worker stops those handlers and forgets them
            if entry_key(*key) in lost:
                c.running.pop(key, None)

    @precondition(lambda self: bool(self.tasks))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        tid = data.draw(st.sampled_from(self.tasks))
        with contextlib.suppress(DtqError):  # running (requested) or terminal: legitimate
            self.run(admin.cancel(self.store, tid))

    @precondition(lambda self: bool(self.tasks))
    @rule(data=st.data())
    def expire(self, data: st.DataObject) -> None:
        tid = data.draw(st.sampled_from(self.tasks))
        with contextlib.suppress(DtqError):  # started or terminal: refused
            self.run(admin.expire(self.store, tid))

    # -- helpers --------------------------------------------------------------------------------

    def _owner(self, entry: Entry) -> str | None:
        rows = self.run(
            self.r.xpending_range(
                entry.stream, keys.CONSUMER_GROUP, entry.entry_id, entry.entry_id, 1
            )
        )
        return str(rows[0]["consumer"]) if rows else None

    def _snapshot(self, task_id: str) -> tuple[dict[str, str], int]:
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(keys.task(task_id))
        pipe.llen(keys.history(task_id))
        h, n = self.run(pipe.execute())
        return h, n

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def every_task_in_exactly_one_place(self) -> None:
        self.run(self._check())

    async def _check(self) -> None:
        r = self.r
        waiting: dict[str, list[str]] = {}  # task id -> entry ids in a stream, not delivered
        pel: dict[str, list[str]] = {}  # task id -> entry ids delivered (pending)
        for stream in STREAMS:
            pending = (
                {
                    str(p["message_id"])
                    for p in await r.xpending_range(stream, keys.CONSUMER_GROUP, "-", "+", 1000)
                }
                if await r.exists(stream)
                else set()
            )
            for entry_id, fields in await r.xrange(stream):
                where = pel if entry_id in pending else waiting
                where.setdefault(fields["task_id"], []).append(entry_id)
                pending.discard(entry_id)
            assert not pending, f"PEL entries gone from {stream}: {pending}"
        schedule = {m: s for m, s in await r.zrange(keys.RETRY_SCHEDULE, 0, -1, withscores=True)}
        claimed = set(await r.zrange(keys.RETRY_CLAIMED, 0, -1))
        expiry = {m: s for m, s in await r.zrange(keys.EXPIRY, 0, -1, withscores=True)}
        cancelled = set(await r.smembers(keys.CANCELLED))
        pipe = r.pipeline(transaction=False)
        for tid in self.tasks:
            pipe.hgetall(keys.task(tid))
            pipe.lindex(keys.history(tid), -1)
        flat = await pipe.execute()
        for tid, h, last in zip(self.tasks, flat[::2], flat[1::2], strict=True):
            status, live = h["status"], h.get("entry_id", "")
            places = [
                name
                for name, present in (
                    ("stream", tid in waiting),
                    ("pel", tid in pel),
                    ("schedule", tid in schedule),
                    ("claimed", tid in claimed),
                )
                if present
            ]
            assert len(places) <= 1, f"{tid} ({status}) is in {places}"
            for where in (waiting, pel):
                assert where.get(tid, [live]) == [live], f"{tid}: stray entries {where[tid]}"
            expected = {
                "queued": {"stream", "pel"},
                "running": {"pel"},
                "pending": {"schedule", "claimed"},
                "retrying": {"schedule", "claimed"},
                "cancelled": {"pel", None},
                "expired": {"pel", None},
            }.get(status, {None})
            assert (places[0] if places else None) in expected, f"{tid} {status} in {places}"
            if tid in expiry:
                assert status in NOT_STARTED, f"{tid} {status} has an expiry member"
                assert int(expiry[tid]) == int(h["expires_at_ms"]), f"{tid}: expiry score"
            if tid in cancelled:
                assert status == "cancelled" and tid in pel, f"{tid} {status} in dtq:cancelled"
            if status in TERMINAL:
                assert self.final.setdefault(tid, status) == status, (
                    f"{tid} was {self.final[tid]}, now {status}"
                )
            assert json.loads(last)["to"] == status, f"{tid}: history ends {last}"
            assert int(h["attempt"]) <= int(h["max_attempts"]), f"{tid}: attempt past max"
        problems = await audit_keys(r)
        assert not problems, problems


@pytest.mark.timeout(300)
def test_delivery_protocol_state_machine(redis_url: str) -> None:
    run_state_machine_as_test(
        lambda: DeliveryMachine(redis_url),
        settings=hyp_settings(
            max_examples=200 if full_run() else 30,
            stateful_step_count=50,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            # No explain phase: on Python 3.11 its line tracing makes replays ten times slower.
            phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
        ),
    )
