"""One "Redis unavailable" reporter per worker process (docs/reliability.md).

Every loop of a worker (poll, reaper, cancel watcher, scheduler, finisher, and the heartbeat on
its own thread) tells the process's :class:`RedisOutage` when a Redis call failed for a
transient reason (:data:`TRANSIENT`: connection refused or lost, a timeout, a cluster that
refuses commands during a failover) with :meth:`~RedisOutage.failed`, and when one succeeded
with :meth:`~RedisOutage.ok`. Instead of one
line per failing loop iteration (10 to 20 lines a second per worker in a one-second outage), the
log gets:

- the **first failure** at once, naming what failed and the error;
- then **at most one line a second** while Redis stays away, with how many failures were not
  logged since the previous line, and of which loops;
- **one line when Redis answers again**, with how long it was unavailable and how many
  failures there were in all.

Finishes the finisher gave up on during the outage (:meth:`~RedisOutage.unrecorded`: their
entries stay pending and are redelivered after the visibility timeout, so those tasks may run
twice) are told in those same lines, with their task ids, never by lines of their own.

No two lines of an outage story are less than ``interval_s`` apart, except its last one (Redis
answers again), which comes at once. An outage that begins less than ``interval_s`` after the
previous line (Redis flapping) is not told by a line of its own: its failures are counted, and
the next line allowed tells them ("briefly unavailable N times").

Errors that are not transient (a bug, a script error) are not for this class: they are logged
where they happen, with their trace. Thread-safe; :meth:`ok` costs one attribute read while
nothing is to be told, so it can be called after every successful call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from redis.exceptions import ClusterDownError, RedisClusterException, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["NOT_RUN", "TRANSIENT", "RedisOutage"]

log = logging.getLogger(__name__)

IDS_TOLD = 20  # task ids named for the finishes not recorded since the last line

NOT_RUN = (ClusterDownError, TryAgainError)
"""A Redis Cluster's replies that it did not run a command, for now: CLUSTERDOWN while a failover
is under way (every node refuses every command until a replica serves the dead primary's
slots), TRYAGAIN during a slot migration. Sending the command again is safe."""

TRANSIENT = (RedisConnectionError, RedisTimeoutError, OSError, RedisClusterException, *NOT_RUN)
"""Errors that mean "Redis did not answer" (redis-py's BusyLoadingError, while a restarted Redis
loads its data, is a ConnectionError; its RedisClusterException, when no node it knows gives it
a slot map that covers every slot), or did not run the command for now (:data:`NOT_RUN`): the
loops retry them and this class reports them."""


class RedisOutage:
    """The rate-limited outage reporter of one worker process; see the module docstring."""

    def __init__(
        self,
        logger: logging.Logger | None = None,
        *,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger or log
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._dirty = False  # down, or brief outages not told yet: ok() has work to do
        self._since: float | None = None  # start of the current outage; None: Redis answers
        self._announced = False  # the current outage's first line was written
        self._failures = 0  # failures of the current outage
        self._untold: Counter[str] = Counter()  # failures not in any line yet, by what failed
        self._last_error = ""
        self._last_line = -float("inf")
        self._brief = 0  # outages that ended before a line could tell them
        self._brief_s = 0.0
        self._brief_failures = 0
        self.last_failure = -float("inf")  # clock time of the last failure (monotonic)
        self._unrecorded = 0  # finishes given up, not told yet
        self._unrecorded_ids: list[str] = []

    @property
    def down(self) -> bool:
        """True from a failure until the next success."""
        return self._since is not None

    def failed(self, what: str, exc: BaseException) -> None:
        """A Redis call of ``what`` (e.g. ``"poll loop"``, ``"heartbeat"``) failed with ``exc``."""
        with self._lock:
            now = self._clock()
            self.last_failure = now
            self._dirty = True
            if self._since is None:
                self._since = now
                self._announced = False
                self._failures = 0
            self._failures += 1
            self._last_error = f"{what}: {_describe(exc)}"
            if now - self._last_line < self.interval_s:
                self._untold[what] += 1
                return
            if not self._announced:
                self._announce(now)
            else:
                self._log.warning(
                    "Redis still unavailable after %.1fs: %d failure(s) not logged since the "
                    "last line (%s); last: %s%s",
                    now - self._since,
                    sum(self._untold.values()) + 1,
                    _by_what(self._untold + Counter({what: 1})),
                    self._last_error,
                    self._take_unrecorded(),
                )
            self._untold.clear()
            self._last_line = now

    def seconds_since_failure(self) -> float:
        """How long ago the last failure was (infinite when there was none)."""
        return self._clock() - self.last_failure

    def unrecorded(self, task_ids: Sequence[str]) -> None:
        """The finisher gave up recording these tasks' finishes (Redis stayed away past its
        retry budget): told in the outage's next line."""
        with self._lock:
            self._dirty = True
            self._unrecorded += len(task_ids)
            room = IDS_TOLD - len(self._unrecorded_ids)
            self._unrecorded_ids.extend(task_ids[: max(0, room)])

    def ok(self, what: str = "") -> None:
        """A Redis call of ``what`` succeeded: Redis answers."""
        if not self._dirty:
            return
        with self._lock:
            now = self._clock()
            if self._since is not None:
                duration_s = now - self._since
                if self._announced:
                    self._log.log(
                        logging.WARNING if self._unrecorded else logging.INFO,
                        "Redis answers again%s after %.1fs unavailable (%d failure(s) in all)%s",
                        f" ({what})" if what else "",
                        duration_s,
                        self._failures,
                        self._take_unrecorded(),
                    )
                    self._last_line = now
                else:
                    self._brief += 1
                    self._brief_s += duration_s
                    self._brief_failures += self._failures
                self._since = None
                self._untold.clear()
            if (self._brief or self._unrecorded) and now - self._last_line >= self.interval_s:
                self._tell_brief()
                self._last_line = now
            self._dirty = self._brief > 0 or self._unrecorded > 0

    def flush(self) -> None:
        """Tell brief outages not told yet, whatever the time since the last line (at exit)."""
        with self._lock:
            if (self._brief or self._unrecorded) and self._since is None:
                self._tell_brief()
                self._dirty = False

    # -- lines (called with the lock held) ------------------------------------------------------

    def _announce(self, now: float) -> None:
        assert self._since is not None
        earlier = ""
        if self._brief:
            earlier = (
                f"; before it, briefly unavailable {self._brief} time(s) "
                f"({self._brief_s:.1f}s, {self._brief_failures} failure(s))"
            )
            self._brief, self._brief_s, self._brief_failures = 0, 0.0, 0
        if self._untold:
            n, age_s = sum(self._untold.values()), now - self._since
            earlier += f"; {n} failure(s) in the last {age_s:.1f}s"
        self._log.warning(
            "Redis unavailable: %s%s -- the worker retries, at most one line a second until "
            "Redis answers%s",
            self._last_error,
            earlier,
            self._take_unrecorded(),
        )
        self._announced = True

    def _tell_brief(self) -> None:
        if not self._brief:  # only finishes given up during an outage already told
            self._log.warning("Redis answers%s", self._take_unrecorded())
            return
        self._log.warning(
            "Redis was briefly unavailable %d time(s) (%.1fs in all, %d failure(s); last: %s); "
            "it answers now%s",
            self._brief,
            self._brief_s,
            self._brief_failures,
            self._last_error,
            self._take_unrecorded(),
        )
        self._brief, self._brief_s, self._brief_failures = 0, 0.0, 0

    def _take_unrecorded(self) -> str:
        """The finishes given up since the last line, as the end of a line (then forgotten)."""
        if not self._unrecorded:
            return ""
        n, ids = self._unrecorded, self._unrecorded_ids
        self._unrecorded, self._unrecorded_ids = 0, []
        more = f" and {n - len(ids)} more" if n > len(ids) else ""
        return (
            f"; the finish of {n} task(s) was not recorded: their entries stay pending and are "
            f"redelivered after the visibility timeout (they may run twice): {', '.join(ids)}{more}"
        )


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _by_what(counts: Counter[str]) -> str:
    return ", ".join(f"{what} {n}" for what, n in counts.most_common())
