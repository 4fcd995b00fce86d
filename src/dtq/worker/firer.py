"""The schedule firer (docs/schedules.md): every worker runs one.

Each pass reads the Redis time and, from each schedule index (:func:`dtq.keys.schedules`),
the schedules whose next fire time has come, then fires them
(:func:`dtq.admin.schedules.fire_due`: a plan per schedule from its hash, one ``fire.lua``
call each, one round trip per ``FIRE_CHUNK`` schedules, the chunks concurrently). The
scheduler leader (holder of ``dtq:lock:scheduler``) fires a schedule as soon as it is due;
every other worker only once it is ``TAKEOVER_MS`` late, so a leader that stalls or dies costs
its schedules that delay, never a tick (a tick stays due until it is decided, and a late tick
within the schedule's ``grace_s`` fires as any other). Two firers that plan the same tick are
harmless: the first call moves the schedule's ``rev``, the second finds it changed and plans
again from the new cursor; and the tick's task has the idempotency key
``schedule:<name>:<tick ms>``.

The leader plans ahead: ``PLAN_AHEAD_MS`` before the next fire time it reads and plans the
schedules due then (:func:`dtq.admin.schedules.plan_due` at that time), and sends the calls
when the time comes, so many schedules due at one instant wait only for Redis to run their
calls. A planned call is checked like any other: one whose schedule changed or fired meanwhile
is stale and planned again; ``fire.lua`` leaves a tick that is not due yet by the server's
clock for the next call.

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
from dtq.admin.schedules import PreparedFiring, fire_due, plan_due, prepare_calls
from dtq.calls import FireReply, Firing
from dtq.clock import time_reply_ms
from dtq.errors import DtqError
from dtq.schedules import ScheduleDef
from dtq.store import Store
from dtq.worker.outage import TRANSIENT, RedisOutage

__all__ = [
    "DUE_BATCH",
    "FIRE_CHUNK",
    "PLAN_AHEAD_MS",
    "POLL_S",
    "STANDBY_POLL_S",
    "TAKEOVER_MS",
    "Firer",
]

log = logging.getLogger(__name__)

TAKEOVER_MS = 2_000  # how late a schedule is before a worker other than the leader fires it
POLL_S = 0.2  # longest pause between passes of the leader
STANDBY_POLL_S = 0.5  # of any other worker (it fires only what is TAKEOVER_MS late)
DUE_BATCH = 1_000  # due schedules read per index per pass (a full batch: the next pass at once)
REFUSED_RETRY_S = 10  # a schedule whose task this process refuses is planned again after this
# Due schedules per fire_due call. A pass's calls run concurrently, so Redis runs one chunk's
# fire.lua calls while this process plans the next: a thousand schedules due at one instant
# take about the larger of the two CPU times, not their sum.
FIRE_CHUNK = 100
# The leader plans the schedules due at the next fire time this long before it, and sends
# their calls at that time (Firer._plan_ahead).
PLAN_AHEAD_MS = 400

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
        # Planned ahead: (their time, the firings with their calls, made beforehand too).
        self._ready: tuple[int, list[PreparedFiring]] | None = None

    @property
    def planned_for(self) -> int | None:
        """The fire time (epoch ms) of the firings planned ahead, None when there are none."""
        return None if self._ready is None else self._ready[0]

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
        read_at = time.monotonic()
        horizon = now - late_ms
        ready = self._take_ready(leader, now)
        pipe = redis.pipeline(transaction=False)
        for scope in scopes:
            idx = keys.schedules(scope)
            pipe.zrangebyscore(idx, "-inf", horizon, start=0, num=DUE_BATCH)
            pipe.zrange(idx, 0, 0, withscores=True)
        replies = await pipe.execute()
        due: list[tuple[str, str]] = []
        next_ms = math.inf
        full = False
        planned = {f.name for f, _ in ready}
        for i, scope in enumerate(scopes):
            names, first = replies[2 * i], replies[2 * i + 1]
            due += [(name, scope) for name in names if name not in planned]
            full = full or len(names) == DUE_BATCH
            if first and first[0][1] > horizon:
                next_ms = min(next_ms, first[0][1] + late_ms)
        if due or ready:
            done = await self._fire(due, ready)
            if full:
                return 0.0
            return 0.0 if any(r.kind == "ok" and _due_again(r, now) for _, r in done) else POLL_S
        poll_s = POLL_S if leader else STANDBY_POLL_S
        if next_ms == math.inf:
            return poll_s
        if leader and self._ready is None and next_ms - now <= PLAN_AHEAD_MS:
            await self._plan_ahead(scopes, int(next_ms))
            return max(0.0, (next_ms - now) / 1000 - (time.monotonic() - read_at))
        if leader and self._ready is None:
            next_ms -= PLAN_AHEAD_MS
        return min(poll_s, max(0.0, (next_ms - now) / 1000))

    def _take_ready(self, leader: bool, now_ms: int) -> list[PreparedFiring]:
        """The firings planned ahead, once their time has come (dropped when this worker is
        not the leader any more, or when they are more than PLAN_AHEAD_MS overdue: a firer
        stalled that long plans again, with the catch-up policy applied at the real time)."""
        if self._ready is None:
            return []
        at_ms, firings = self._ready
        if not leader or now_ms - at_ms > PLAN_AHEAD_MS:
            self._ready = None
            return []
        if now_ms < at_ms:
            return []
        self._ready = None
        return firings

    async def _plan_ahead(self, scopes: Sequence[str], at_ms: int) -> None:
        """Plan the firings of the schedules due at ``at_ms`` (the next fire time) now, to send
        them at that time: a thousand schedules due at one instant are then enqueued within
        the time Redis takes to run their calls, without this process's planning before it.
        A schedule that changes or fires meanwhile moves its ``rev``, and its planned call is
        stale: it is planned again when sent."""
        pipe = self.store.redis.pipeline(transaction=False)
        for scope in scopes:
            pipe.zrangebyscore(keys.schedules(scope), "-inf", at_ms, start=0, num=DUE_BATCH)
        found = await pipe.execute()
        due = [(n, scope) for scope, names in zip(scopes, found, strict=True) for n in names]
        if not due:
            return
        chunks = [due[i : i + FIRE_CHUNK] for i in range(0, len(due), FIRE_CHUNK)]
        refused: list[tuple[str, str, DtqError]] = []
        plans = await asyncio.gather(
            *(plan_due(self.store, chunk, self._definitions, refused, at_ms) for chunk in chunks)
        )
        self._refuse(refused)  # each is found due again at its time, and then skipped
        self._ready = (at_ms, prepare_calls(self.store, [f for plan in plans for f in plan]))

    async def _fire(
        self, due: Sequence[tuple[str, str]], ready: Sequence[PreparedFiring]
    ) -> list[tuple[Firing, FireReply]]:
        """Fire ``due`` schedules and the ``ready`` planned firings, in concurrent chunks."""
        refused: list[tuple[str, str, DtqError]] = []
        mono = time.monotonic()
        skip = {k for k, until in self._refused.items() if until > mono}
        defs = self._definitions
        jobs = [
            fire_due(self.store, (), defs, refused, planned=ready[i : i + FIRE_CHUNK])
            for i in range(0, len(ready), FIRE_CHUNK)
        ] + [
            fire_due(self.store, due[i : i + FIRE_CHUNK], defs, refused, skip)
            for i in range(0, len(due), FIRE_CHUNK)
        ]
        replies = await asyncio.gather(*jobs, return_exceptions=True)
        done = [fired for reply in replies if isinstance(reply, list) for fired in reply]
        self._refuse(refused)
        self._report(done)
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        return done

    def _refuse(self, refused: Sequence[tuple[str, str, DtqError]]) -> None:
        """Log (once) each schedule whose task this process refuses, and leave it alone for
        ``REFUSED_RETRY_S``; forget the ones whose time is up."""
        mono = time.monotonic()
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
