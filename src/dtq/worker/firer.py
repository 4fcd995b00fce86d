"""The schedule firer (docs/schedules.md): every worker runs one.

Each pass reads the Redis time and, from each schedule index (:func:`dtq.keys.schedules`),
the schedules whose next fire time has come, then fires them
(:func:`dtq.admin.schedules.fire_due`: a plan per schedule from its hash, one ``fire.lua``
call each, in one round trip per ``FIRE_CHUNK`` schedules, the chunks concurrently). The scheduler leader (holder of ``dtq:lock:scheduler``)
fires a schedule as soon as it is due; every other worker only once it is ``TAKEOVER_MS``
late, so a leader that stalls or dies costs its schedules that delay, never a tick (a tick
stays due until it is decided, and a late tick within the schedule's ``grace_s`` fires as any
other). Two firers that plan the same tick are harmless: the first call moves the schedule's
``rev``, the second finds it changed and plans again from the new cursor; and the tick's task
has the idempotency key ``schedule:<name>:<tick ms>``.

Between passes the firer sleeps until the next fire time in the indexes, at most ``POLL_S``
(a schedule created, resumed or changed elsewhere is seen within that), so a tick fires within
a few milliseconds of its time on the leader. A Redis failure is reported to the worker's
:class:`~dtq.worker.outage.RedisOutage` and the pass is tried again after ``POLL_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Sequence

from dtq import keys
from dtq.admin.schedules import fire_due
from dtq.calls import FireReply, Firing
from dtq.schedules import ScheduleDef
from dtq.store import Store
from dtq.worker.outage import TRANSIENT, RedisOutage

__all__ = ["DUE_BATCH", "FIRE_CHUNK", "POLL_S", "TAKEOVER_MS", "Firer"]

log = logging.getLogger(__name__)

TAKEOVER_MS = 2_000  # how late a schedule is before a worker other than the leader fires it
POLL_S = 0.2  # longest pause between passes
DUE_BATCH = 1_000  # due schedules read per index per pass (a full batch: the next pass at once)
# Due schedules per fire_due call. A pass's calls run concurrently, so Redis runs one chunk's
# fire.lua calls while this process plans the next: a thousand schedules due at one instant
# take about the larger of the two CPU times, not their sum.
FIRE_CHUNK = 100

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
        clock = await redis.time()
        now = int(clock[0]) * 1000 + int(clock[1]) // 1000
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
            chunks = [due[i : i + FIRE_CHUNK] for i in range(0, len(due), FIRE_CHUNK)]
            replies = await asyncio.gather(
                *(fire_due(self.store, chunk, self._definitions) for chunk in chunks),
                return_exceptions=True,
            )
            done = [fired for reply in replies if isinstance(reply, list) for fired in reply]
            self._report(done)
            for reply in replies:
                if isinstance(reply, BaseException):
                    raise reply
            if full:
                return 0.0
            return 0.0 if any(r.kind == "ok" and _due_again(r, now) for _, r in done) else POLL_S
        if next_ms == math.inf:
            return POLL_S
        return min(POLL_S, max(0.0, (next_ms - now) / 1000))

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
