"""The worker's "Redis unavailable" reporter: what it writes, on a clock the test moves."""

from __future__ import annotations

import logging
import threading

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from dtq.worker.outage import RedisOutage

REFUSED = RedisConnectionError("Error 111 connecting to 127.0.0.1:6390. Connection refused.")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


class Lines:
    """The messages logged so far (read anew at each use)."""

    def __init__(self, caplog: pytest.LogCaptureFixture) -> None:
        self._caplog = caplog

    def __len__(self) -> int:
        return len(self._caplog.messages)

    def __getitem__(self, i: int) -> str:
        return self._caplog.messages[i]


@pytest.fixture
def lines(caplog: pytest.LogCaptureFixture) -> Lines:
    caplog.set_level(logging.DEBUG, logger="dtq.test.outage")
    return Lines(caplog)


def reporter(clock: Clock) -> RedisOutage:
    return RedisOutage(logging.getLogger("dtq.test.outage"), clock=clock)


def test_first_failure_at_once_then_one_line_a_second_then_recovery(
    clock: Clock, lines: Lines
) -> None:
    out = reporter(clock)
    out.failed("poll loop", REFUSED)
    assert len(lines) == 1
    assert "Redis unavailable: poll loop: ConnectionError: Error 111" in lines[0]
    for _ in range(7):  # 0.875 s of failures of several loops: nothing more
        clock.now += 0.125
        out.failed("scheduler lock", REFUSED)
        out.failed("heartbeat", REFUSED)
    assert len(lines) == 1
    clock.now += 0.125
    out.failed("poll loop", REFUSED)
    assert len(lines) == 2
    assert lines[1].startswith("Redis still unavailable after 1.0s: 15 failure(s) not logged")
    assert "scheduler lock 7, heartbeat 7, poll loop 1" in lines[1]
    clock.now += 1.5
    out.ok("heartbeat")
    assert (
        lines[2] == "Redis answers again (heartbeat) after 2.5s unavailable (16 failure(s) in all)"
    )
    out.ok("poll loop")  # nothing more to tell
    assert len(lines) == 3 and not out.down


def test_no_failure_no_line(clock: Clock, lines: Lines) -> None:
    out = reporter(clock)
    for _ in range(100):
        out.ok("poll loop")
    out.flush()
    assert len(lines) == 0


def test_a_new_outage_right_after_a_line_is_told_later(clock: Clock, lines: Lines) -> None:
    out = reporter(clock)
    out.failed("poll loop", REFUSED)
    clock.now += 0.2
    out.ok("poll loop")  # the recovery closes the story at once
    assert len(lines) == 2
    for _ in range(3):  # Redis flaps: three short outages within the next second
        clock.now += 0.1
        out.failed("finish", REFUSED)
        clock.now += 0.1
        out.ok("finish")
    assert len(lines) == 2
    clock.now += 0.5
    out.ok("scheduler")
    assert len(lines) == 3
    assert lines[2].startswith("Redis was briefly unavailable 3 time(s) (0.3s in all, 3 failure(s)")


def test_a_long_outage_that_began_unannounced_is_announced(clock: Clock, lines: Lines) -> None:
    out = reporter(clock)
    out.failed("poll loop", REFUSED)
    clock.now += 0.1
    out.ok()
    clock.now += 0.1
    out.failed("reaper loop", REFUSED)  # 0.1 s after the recovery line: counted
    clock.now += 1.0
    out.failed("reaper loop", REFUSED)
    assert len(lines) == 3
    assert lines[2].startswith("Redis unavailable: reaper loop: ConnectionError")
    assert "1 failure(s) in the last 1.0s" in lines[2]


def test_finishes_given_up_are_told_in_the_outage_lines_with_their_ids(
    clock: Clock, lines: Lines
) -> None:
    """The finisher's give-up is part of the story, not a line of its own (at most a line a
    second, docs/operations.md); the next line names the tasks, the recovery line says what is
    left."""
    out = reporter(clock)
    out.failed("finish", REFUSED)
    clock.now += 0.8
    out.unrecorded(["a" * 32, "b" * 32])
    assert len(lines) == 1
    clock.now += 0.3
    out.failed("poll loop", REFUSED)
    assert len(lines) == 2
    assert "the finish of 2 task(s) was not recorded" in lines[1]
    assert "a" * 32 + ", " + "b" * 32 in lines[1] and "may run twice" in lines[1]
    out.unrecorded([f"{i:032x}" for i in range(25)])
    clock.now += 0.2
    out.ok("poll loop")
    assert len(lines) == 3
    assert lines[2].startswith("Redis answers again (poll loop) after 1.3s unavailable")
    assert "the finish of 25 task(s) was not recorded" in lines[2] and "and 5 more" in lines[2]
    out.ok()
    assert len(lines) == 3


def test_flush_tells_what_is_left(clock: Clock, lines: Lines) -> None:
    out = reporter(clock)
    out.failed("poll loop", REFUSED)
    out.ok()
    out.failed("finish", REFUSED)
    out.ok()
    assert len(lines) == 2
    out.flush()
    assert lines[2].startswith("Redis was briefly unavailable 1 time(s)")


def test_threads_share_one_reporter(lines: Lines) -> None:
    out = RedisOutage(logging.getLogger("dtq.test.outage"), interval_s=3600)
    per_thread = 500

    def fail() -> None:
        for _ in range(per_thread):
            out.failed("heartbeat", REFUSED)

    threads = [threading.Thread(target=fail) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.ok()
    assert len(lines) == 2
    assert lines[1].endswith(f"({8 * per_thread} failure(s) in all)")
