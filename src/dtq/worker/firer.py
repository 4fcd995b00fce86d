"""The schedule firer (docs/schedules.md): every worker runs one.

Each pass reads the Redis time and, from each schedule index (:func:`dtq.keys.schedules`),
the schedules whose next fire time has come, then fires them
(:func:`dtq.admin.schedules.fire_due`: a plan per schedule from its hash, one ``fire.lua``
call each, all in one round trip). The scheduler leader (holder of ``dtq:lock:scheduler``)
fires a schedule as soon as it is due; every other worker only once it is ``TAKEOVER_MS``
late, so a leader that stalls or dies costs its schedules that delay, never a tick (a tick
stays due until it is decided, and a late tick within the schedule's ``grace_s`` fires as any
other). Two firers that plan the same tick are harmless: the first call moves the schedule's
``rev``, the second finds it changed and plans again from the new cursor; and the tick's task
has the idempotency key ``schedule:<name>:<tick ms>``.

Between passes the firer sleeps until the next fire time in the indexes, at most ``POLL_S``
on the leader (a schedule created, resumed or changed elsewhere is seen within that), so a
tick fires within a few milliseconds of its time there; at most ``STANDBY_POLL_S`` on the
others. A Redis failure is reported to the worker's
:class:`~dtq.worker.outage.RedisOutage` and the pass is tried again after ``POLL_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence

from dtq import keys
from dtq.admin.schedules import fire_due
from dtq.calls import FireReply, Firing
from dtq.clock import time_reply_ms
from dtq.errors import DtqError
from dtq.schedules import ScheduleDef
from dtq.store import Store
from dtq.worker.outage import TRANSIENT, RedisOutage

__all__ = ["DUE_BATCH", "POLL_S", "STANDBY_POLL_S", "TAKEOVER_MS", "Firer"]

log = logging.getLogger(__name__)

TAKEOVER_MS = 2_000  # how late a schedule is before a worker other than the leader fires it
POLL_S = 0.2  # longest pause between passes of the leader
STANDBY_POLL_S = 0.5  # of any other worker (it fires only what is TAKEOVER_MS late)
DUE_BATCH = 200  # due schedules read per index per pass (a full batch: the next pass at once)
REFUSED_RETRY_S = 10  # a schedule whose task this process refuses is planned again after this

Fired = Callable[[Sequence[tuple[Firing, FireReply]]], None]


class Firer:
    """The firing loop of one worker; see the module docstring."""

    def __init__(
        self,
        store: Store,
        is_leader: Callable[[], bool],
        on_fired: Fired | None = None,
        outage: RedisOutage | None = None,
    ) -> None:
        self.store = store
        self.is_leader = is_leader
        self.on_fired = on_fired
        self.outage = outage or RedisOutage()
        self._definitions: dict[str, ScheduleDef] = {}
        self._refused: dict[tuple[str, str], float] = {}  # -> monotonic time to try again

    async def run(self, stopping: asyncio.Event) -> None:
        """Pass after pass until ``stopping`` is set."""
        while not stopping.is_set():
            try:
                delay_s = await self.step()
                self.outage.ok("firer")
            except TRANSIENT as exc:
                self.outage.failed("schedule firer", exc)
                delay_s = POLL_S
            except Exception:  # a bug must not end the loop; it is logged with its trace
                log.exception("schedule firer pass failed")
                delay_s = POLL_S
            if delay_s > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), delay_s)

    async def step(self) -> float:
        """One pass: fire what is due; the seconds until the next pass."""
        redis = self.store.redis
        leader = self.is_leader()
        late_ms = 0 if leader else TAKEOVER_MS
        scopes = await self.store.scopes()
        now = time_reply_ms(await redis.time())
        horizon = now - late_ms
        pipe = redis.pipeline(transaction=False)
        for scope in scopes:
            idx = keys.schedules(scope)
            pipe.zrangebyscore(idx, "-inf", horizon, start=0, num=DUE_BATCH)
            pipe.zrange(idx, 0, 0, withscores=True)
        replies = await pipe.execute()
        due: list[tuple[str, str]] = []
        next_ms = math.inf
        full = False
        for i, scope in enumerate(scopes):
            names, first = replies[2 * i], replies[2 * i + 1]
            due += [(name, scope) for name in names]
            full = full or len(names) == DUE_BATCH
            if first and first[0][1] > horizon:
                next_ms = min(next_ms, first[0][1] + late_ms)
        if due:
            refused: list[tuple[str, str, DtqError]] = []
            mono = time.monotonic()
            skip = {k for k, until in self._refused.items() if until > mono}
            done = await fire_due(self.store, due, self._definitions, refused, skip)
            for name, queue, exc in refused:
                if (name, queue) not in self._refused:
                    log.error(
                        "schedule %s: its task is refused here (%s: %s); not fired, tried again "
                        "every %d s",
                        name,
                        exc.code,
                        exc.message,
                        REFUSED_RETRY_S,
                    )
                self._refused[(name, queue)] = mono + REFUSED_RETRY_S
            for key in [k for k, until in self._refused.items() if until <= mono]:
                del self._refused[key]
            self._report(done)
            if full:
                return 0.0
            return 0.0 if any(r.kind == "ok" and _due_again(r, now) for _, r in done) else POLL_S
        poll_s = POLL_S if leader else STANDBY_POLL_S
        if next_ms == math.inf:
            return poll_s
        return min(poll_s, max(0.0, (next_ms - now) / 1000))

    def _report(self, done: Sequence[tuple[Firing, FireReply]]) -> None:
        for firing, reply in done:
            for d in reply.decisions:
                if d.decision == "rejected":
                    log.warning(
                        "schedule %s: tick %s not enqueued (%s); tried again in a second",
                        firing.name,
                        d.tick_ms,
                        d.detail,
                    )
        if self.on_fired is None:
            return
        try:
            self.on_fired(done)
        except Exception:  # an observer's bug must not stop the firer
            log.exception("schedule firer on_fired failed")


def _due_again(reply: FireReply, now_ms: int) -> bool:
    """A plan cut at its maximum of ticks left the cursor on a tick already due."""
    try:
        return float(reply.score) <= now_ms
    except ValueError:
        return False
