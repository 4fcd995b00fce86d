"""Heartbeat and lease renewal, on a thread of their own (contract section 6, DESIGN 3).

Every ``DTQ_HEARTBEAT_INTERVAL_S`` (with jitter) the thread:

1. renews the lease of every in-flight entry with ``touch.lua`` (owner-checked
   ``XCLAIM ... IDLE 0 JUSTID``) and reports entries this worker no longer owns;
2. writes ``dtq:worker:<id>`` (the contract's fields plus ``queues``, ``pid`` and
   ``last_heartbeat_ms``) with a TTL of three intervals, and adds the id to ``dtq:workers``;
3. measures the offset of the local clock to the Redis clock.

It uses its own synchronous connection, so a busy event loop cannot starve the lease: the
failure mode of dramatiq#692 and taskiq-redis#101. But a loop that cannot run at all (an async
handler blocking it in a call that does not return) must not keep its tasks: nothing on it can
finish, cancel or time them out. The loop stamps its pulse every ``STAMP_S`` (a callback of its
own); a beat that finds no pulse for :func:`stall_after_s` treats the worker as **stalled**
(docs/operations.md, "A stalled event loop"): it renews no lease, so peers take the in-flight
entries over after the visibility timeout through their reapers, and it reports status
``stalled`` in the worker hash, which it keeps writing (the process is alive and still holds
its worker id). One WARNING when the stall is found, one INFO with its length when the loop runs
again; that beat comes at once and reports the entries taken over meanwhile as lost. If it
cannot renew for most of the visibility timeout while tasks are in flight, it logs that they
are at risk of redelivery. Redis unavailable: the failure goes to the worker's
:class:`~dtq.worker.outage.RedisOutage` (shared with the event loop's loops, rate-limited); any
other Redis error is logged with its trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.exceptions import RedisError

from dtq import calls, keys
from dtq.clock import RedisClock
from dtq.config import Settings
from dtq.connection import sync_client
from dtq.events import make_event
from dtq.models import format_ts
from dtq.records import stale_after_ms
from dtq.scripts import Scripts
from dtq.worker.outage import TRANSIENT, RedisOutage

__all__ = ["STAMP_S", "Heartbeat", "stall_after_s"]

log = logging.getLogger(__name__)

JITTER = 0.1
AT_RISK_FRACTION = 0.8
STAMP_S = 0.1  # the event loop stamps its pulse this often
STALL_AFTER_S = 1.0


def stall_after_s(settings: Settings) -> float:
    """How long the event loop may go without running before its worker is stalled: a second,
    or half the visibility timeout when that is shorter (a stall found later than that would
    renew leases the loop cannot honour for most of a timeout)."""
    return min(STALL_AFTER_S, settings.visibility_timeout_s / 2)


class Heartbeat:
    """The heartbeat thread of one worker. ``snapshot()`` returns the (stream, entry id, task
    id) of each entry in flight and ``stats()`` the worker hash's changing fields (both called
    on the heartbeat thread); ``on_lost`` receives entry ids this worker no longer owns,
    called on the event loop given to :meth:`start`."""

    def __init__(
        self,
        settings: Settings,
        scripts: Scripts,
        worker_id: str,
        queues: Sequence[str],
        concurrency: int,
        clock: RedisClock,
        snapshot: Callable[[], list[tuple[str, str, str]]],
        stats: Callable[[], dict[str, Any]],
        on_lost: Callable[[list[str]], None],
        outage: RedisOutage | None = None,
    ) -> None:
        self.settings = settings
        self.scripts = scripts
        self.worker_id = worker_id
        self.queues = list(queues)
        self.concurrency = concurrency
        self.clock = clock
        self._snapshot = snapshot
        self._stats = stats
        self._on_lost = on_lost
        self._outage = outage or RedisOutage()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._redis: redis.Redis | None = None
        self._rng = random.Random()
        self._started_ms = 0
        self._last_ok = time.monotonic()
        self._at_risk_logged = False
        self.status = "starting"
        self._stall_after_s = stall_after_s(settings)
        # The loop's last pulse (time.monotonic(), written on the loop, read here: one float,
        # replaced whole) and, while stalled, the pulse the stall began after (this thread's).
        self._pulse = time.monotonic()
        self._stalled_since: float | None = None

    # -- control (event loop side) --------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Connect, write the first beat (status starting) and start the thread; lost leases
        are told to ``on_lost`` on ``loop``."""
        self._loop = loop
        self._redis = sync_client(
            self.settings, socket_timeout=max(2.0, self.settings.heartbeat_interval_s)
        )
        self.clock.sync_blocking(self._redis)
        self._started_ms = self.clock.now_ms()
        self._pulse = time.monotonic()
        loop.call_soon_threadsafe(self._stamp)
        self.beat()
        self._thread = threading.Thread(
            target=self._run, name=f"dtq-heartbeat-{self.worker_id}", daemon=True
        )
        self._thread.start()

    def set_status(self, status: str) -> None:
        """Change the self-reported status and beat at once."""
        self.status = status
        self._wake.set()

    def stop(self, *, publish_stopped: bool = True) -> None:
        """Final beat (status stopped), leave ``dtq:workers``, WORKER_STOPPED; close."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 2 * self.settings.heartbeat_interval_s))
        self.status = "stopped"
        if self._redis is None:
            return
        try:
            self._write_hash()
            pipe = self._redis.pipeline(transaction=False)
            pipe.srem(keys.WORKERS, self.worker_id)
            if publish_stopped:
                # execute_command: a cluster pipeline refuses .publish() (the channel is no key)
                pipe.execute_command("PUBLISH", keys.EVENTS, self._event("WORKER_STOPPED"))  # type: ignore[no-untyped-call]
            pipe.execute()
        except (RedisError, OSError) as exc:
            log.warning("worker %s: final heartbeat failed: %s", self.worker_id, exc)
        finally:
            self._redis.close()
            self._redis = None

    def publish_started(self) -> None:
        assert self._redis is not None
        try:
            self._redis.publish(keys.EVENTS, self._event("WORKER_STARTED"))
        except (RedisError, OSError) as exc:
            log.warning("worker %s: WORKER_STARTED not published: %s", self.worker_id, exc)

    def _stamp(self) -> None:
        """The loop's pulse (on the loop, every ``STAMP_S``); after a stall it wakes the
        thread, whose next beat finds the leases lost meanwhile."""
        self._pulse = time.monotonic()
        if self._stalled_since is not None:
            self._wake.set()
        if not self._stopping.is_set() and self._loop is not None:
            self._loop.call_later(STAMP_S, self._stamp)

    # -- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        interval = self.settings.heartbeat_interval_s
        while not self._stopping.is_set():
            self._wake.wait(interval * (1 + self._rng.uniform(-JITTER, JITTER)))
            self._wake.clear()
            if self._stopping.is_set():
                return
            self.beat()

    def beat(self) -> None:
        """One heartbeat; failures are logged, never raised (the next beat tries again)."""
        assert self._redis is not None
        stalled = self._loop_stalled()
        try:
            if not stalled:
                self._touch()
            self._write_hash()
            self.clock.sync_blocking(self._redis)
        except TRANSIENT as exc:
            self._outage.failed("heartbeat", exc)
            self._check_at_risk()
            return
        except RedisError:  # not an outage: a refused command or a script error
            log.exception("worker %s: heartbeat failed", self.worker_id)
            self._check_at_risk()
            return
        self._outage.ok("heartbeat")
        self._last_ok = time.monotonic()
        self._at_risk_logged = False

    def _loop_stalled(self) -> bool:
        """Whether the event loop has gone without a pulse for the stall limit; logs a stall's
        start and end (once each)."""
        pulse = self._pulse
        silent_s = time.monotonic() - pulse
        if silent_s > self._stall_after_s:
            if self._stalled_since is None:
                self._stalled_since = pulse
                log.warning(
                    "worker %s: event loop stalled: it has not run for %.1fs (a handler blocks "
                    "it?); the leases of its %d in-flight task(s) are no longer renewed, other "
                    "workers take them over after the visibility timeout (%.1fs)",
                    self.worker_id,
                    silent_s,
                    len(self._snapshot()),
                    self.settings.visibility_timeout_s,
                )
            return True
        if self._stalled_since is not None:
            log.info(
                "worker %s: event loop runs again after a stall of %.1fs; tasks taken over "
                "meanwhile are dropped here without a write",
                self.worker_id,
                pulse - self._stalled_since,
            )
            self._stalled_since = None
        return False

    def _touch(self) -> None:
        owned = self._snapshot()
        if not owned:
            return
        assert self._redis is not None
        lost, deleted = calls.touch_blocking(self._redis, self.scripts, self.worker_id, owned)
        if deleted:
            # Removed outside dtq: the handler goes on, finish.lua records it on the task hash.
            log.warning(
                "worker %s: entries %s were removed from their stream while running: their "
                "tasks run on and finish (docs/delivery-guarantees.md)",
                self.worker_id,
                ", ".join(deleted),
            )
        if lost and self._loop is not None:
            # Most are entries finished between the snapshot and the touch; the worker keeps
            # (and logs) only those still running here.
            with contextlib.suppress(RuntimeError):  # the loop is closing: nothing to stop
                self._loop.call_soon_threadsafe(self._on_lost, lost)

    def _write_hash(self) -> None:
        assert self._redis is not None
        now_ms = self.clock.now_ms()
        stats = self._stats()
        fields: dict[str, str | int] = {
            "worker_id": self.worker_id,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "queues": ",".join(self.queues),
            "concurrency": self.concurrency,
            "started_at": format_ts(self._started_ms),
            "last_heartbeat": format_ts(now_ms),
            "last_heartbeat_ms": now_ms,
            "status": self._reported_status(stats),
            **{k: int(v) for k, v in stats.items()},
        }
        # The hash goes when its worker is stale (dtq.records: three intervals without a beat).
        ttl_ms = max(1, stale_after_ms(self.settings.heartbeat_interval_s))
        pipe = self._redis.pipeline(transaction=False)
        pipe.hset(keys.worker(self.worker_id), mapping=fields)  # type: ignore[arg-type]
        pipe.pexpire(keys.worker(self.worker_id), ttl_ms)
        if self.status != "stopped":
            pipe.sadd(keys.WORKERS, self.worker_id)
        pipe.execute()

    def _reported_status(self, stats: dict[str, Any]) -> str:
        if self._stalled_since is not None and self.status in {"running", "draining"}:
            return "stalled"
        if self.status == "running":
            return "busy" if int(stats.get("active_tasks", 0)) > 0 else "ready"
        return self.status

    def _check_at_risk(self) -> None:
        silent_s = time.monotonic() - self._last_ok
        limit_s = AT_RISK_FRACTION * self.settings.visibility_timeout_s
        if silent_s < limit_s or self._at_risk_logged:
            return
        in_flight = len(self._snapshot())
        if in_flight:
            self._at_risk_logged = True
            log.error(
                "worker %s: no heartbeat for %.1fs (visibility timeout %.1fs): %d in-flight "
                "task(s) at risk of being redelivered to another worker",
                self.worker_id,
                silent_s,
                self.settings.visibility_timeout_s,
                in_flight,
            )

    def _event(self, etype: str) -> str:
        return make_event(
            etype,
            worker_id=self.worker_id,
            metadata={
                "hostname": socket.gethostname(),
                "pid": os.getpid(),
                "queues": self.queues,
                "concurrency": self.concurrency,
            },
            ts_ms=self.clock.now_ms(),
        )
