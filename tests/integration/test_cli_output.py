"""The installed ``dtq`` executable: help texts, colour rules, Redis unreachable, invalid
configuration, a closed pipe, and the relative-time wording."""

from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import pytest

from dtq import Queue, TaskStatus, connect_sync
from dtq.devserver import free_port
from dtq_cli.output import STATUS_COLOUR, human_duration, relative
from support.cli import DTQ, MISSING_ID, Cli, Run, clean_env

ANSI = re.compile(r"\x1b\[[0-9;]*m")

COMMANDS = [
    ["submit"], ["get"], ["status"], ["list"], ["history"], ["cancel"], ["expire"],
    ["dlq"], ["dlq", "list"], ["retry-dlq"], ["discard-dlq"], ["purge-dlq"], ["purge"],
    ["queue"], ["queue", "pause"], ["queue", "resume"], ["queue", "stats"],
    ["worker"], ["worker", "run"], ["api"], ["dev"],
]  # fmt: skip


@pytest.fixture
def cli(redis_url: str) -> Cli:
    return Cli(redis_url)


def parallel(cli: Cli, commands: list[list[str]], **kwargs: object) -> list[Run]:
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(lambda args: cli(*args, **kwargs), commands))  # type: ignore[arg-type]


def test_main_help_lists_examples_exit_codes_and_every_command(cli: Cli) -> None:
    run = cli.ok("--help")
    for text in ("examples:", "exit codes:", "NO_COLOR", "--json", "DTQ_REDIS_URL"):
        assert text in run.out
    for command in {c[0] for c in COMMANDS}:
        assert f"    {command}" in run.out
    assert cli.ok("--version").out.startswith("dtq ")
    assert "required" in cli.fails(2).err  # no command: usage error


def test_every_command_has_help_with_an_example(cli: Cli) -> None:
    runs = parallel(cli, [[*c, "--help"] for c in COMMANDS])
    for command, run in zip(COMMANDS, runs, strict=True):
        assert run.code == 0, (command, run.err)
        assert "example:" in run.out, command
        assert f"dtq {' '.join(command)}" in run.out.split("example:")[1], command


def test_submit_help_names_every_flag(cli: Cli) -> None:
    out = cli.ok("submit", "--help").out
    for flag in ("--type", "--payload", "--queue", "--idempotency-key", "--max-attempts",
                 "--priority", "--timeout-ms", "--delay-seconds", "--ttl", "--expires-at",
                 "--schedule-at", "--json"):  # fmt: skip
        assert flag in out
    out = cli.ok("worker", "run", "--help").out
    for flag in ("--concurrency", "--queue", "--tasks", "--processes"):
        assert flag in out


def test_unreachable_redis_is_one_line_naming_the_url_exit_1(redis_url: str) -> None:
    port = free_port()  # nothing listens there
    url = f"redis://127.0.0.1:{port}/0"
    cli = Cli(url)
    # Every Redis command connects the same way before it runs: one of each kind here.
    commands = [
        ["submit", "--type", "echo_task"], ["get", MISSING_ID, "--json"], ["list"],
        ["cancel", MISSING_ID], ["dlq", "list"], ["purge-dlq", "--yes"],
        ["queue", "pause", "q"], ["queue", "stats", "--json"],
    ]  # fmt: skip
    for command, run in zip(commands, parallel(cli, commands), strict=True):
        assert run.code == 1, (command, run.err)
        assert run.out == ""
        lines = run.err.strip().splitlines()
        assert len(lines) == 1, (command, run.err)
        assert lines[0].startswith(f"dtq: error: Redis at {url} is unreachable: "), lines[0]


def test_password_is_not_printed(redis_url: str) -> None:
    url = f"redis://:s3cret@127.0.0.1:{free_port()}/0"
    run = Cli(url).fails(1, "list")
    assert "s3cret" not in run.err and "***@127.0.0.1" in run.err


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DTQ_MAX_ATTEMPTS": "0"}, "invalid configuration: DTQ_MAX_ATTEMPTS='0'"),
        ({"DTQ_REDIS_URL": "http://localhost"}, "invalid configuration: DTQ_REDIS_URL"),
        ({"DTQ_HEARTBEAT_INTERVAL_S": "60"}, "DTQ_HEARTBEAT_INTERVAL_S must be below"),
    ],
)
def test_invalid_configuration_exits_2_with_one_line(
    cli: Cli, env: dict[str, str], message: str
) -> None:
    run = cli.fails(2, "list", env=env)
    assert len(run.err.strip().splitlines()) == 1 and run.err.startswith("dtq: error: ")
    assert message in run.err


async def test_colour_only_on_a_terminal_and_never_with_no_color(cli: Cli, queue: Queue) -> None:
    await queue.submit("echo_task", {})
    await queue.submit("echo_task", {}, ttl_seconds=0)
    on_tty = cli.tty("list", tty_stdout=True)
    assert on_tty.code == 0
    assert "\x1b[36mqueued" in on_tty.out  # cyan status
    assert ANSI.sub("", on_tty.out).splitlines()[0].split()[0] == "TASK_ID"
    no_color = cli.tty("list", tty_stdout=True, env={"NO_COLOR": "1"})
    assert no_color.code == 0 and "queued" in no_color.out
    assert not ANSI.search(no_color.out)
    piped = cli.ok("list")
    assert not ANSI.search(piped.out)
    # Aligned with colour too: the escape codes are added after padding. (Two submits in the
    # same millisecond tie in the recent list, so the rows are found by their status.)
    header, *rows = [ANSI.sub("", line) for line in on_tty.out.splitlines()]
    expired = next(row for row in rows if " expired " in row)
    queued = next(row for row in rows if " queued " in row)
    assert header.index("STATUS") == expired.index("expired") == queued.index("queued")


def test_closed_pipe_is_not_an_error(redis_url: str) -> None:
    with connect_sync(redis_url) as q:
        q.submit_many([{"task_type": "echo_task", "payload": {"n": n}} for n in range(800)])
    proc = subprocess.Popen(
        [DTQ, "list", "--limit", "800"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=clean_env(redis_url),
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith(b"TASK_ID")
    proc.stdout.close()  # like `dtq list | head -1`
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert err == b""


def test_status_colours_cover_every_status() -> None:
    assert set(STATUS_COLOUR) == {s.value for s in TaskStatus}


def test_relative_time_wording() -> None:
    now = datetime(2026, 1, 28, 14, 30, tzinfo=UTC)
    assert relative(now + timedelta(hours=2, minutes=30), now) == "in 2h 30m"
    assert relative(now - timedelta(minutes=5), now) == "5m ago"
    assert relative(now + timedelta(milliseconds=300), now) == "now"
    assert relative(None, now) == "-"
    assert [human_duration(s) for s in (0, 45, 90, 3600, 5400, 8999.6, 7 * 86400, 100_900)] == [
        "0s", "45s", "1m 30s", "1h", "1h 30m", "2h 30m", "7d", "1d 4h",
    ]  # fmt: skip
