"""The installed ``dtq`` executable waiting on tasks: ``dtq wait`` and ``dtq submit --wait``,
their output and every exit code, with a real worker (in the test's event loop) running the
tasks while the command waits."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest

from dtq import waits
from dtq.config import Settings
from dtq_cli.flags import DEFAULT_WAIT_S
from dtq_tasks import Handler, PermanentError, TaskContext
from support import running_worker
from support.cli import MISSING_ID, Cli, Run, fast_settings, task_count

pytestmark = pytest.mark.backends("single", "cluster")


async def double(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    return {"n": payload["n"] * 2}


async def boom(payload: dict[str, Any], ctx: TaskContext) -> None:
    raise PermanentError("bad input")


@pytest.fixture
def cli(settings: Settings) -> Cli:
    # The handlers are the in-process worker's; no module registers their types.
    return Cli(settings.redis_url, cluster=settings.redis_cluster, DTQ_TASK_MODULES="")


@pytest.fixture
async def worker(settings: Settings) -> AsyncIterator[None]:
    handlers = {"double": Handler("double", double), "boom": Handler("boom", boom)}
    fast = fast_settings(settings.redis_url, cluster=settings.redis_cluster)
    async with running_worker(fast, handlers):
        yield


async def run(cli: Cli, *args: str) -> Run:
    """The command in a thread, so the worker in this event loop runs meanwhile."""
    return await asyncio.to_thread(cli, *args)


# -- dtq wait -------------------------------------------------------------------------------------


def test_the_default_timeout_is_the_sdks() -> None:
    assert DEFAULT_WAIT_S == waits.DEFAULT_WAIT_S


async def test_wait_exits_0_when_the_task_succeeded(cli: Cli, worker: None) -> None:
    task_id = cli.submit("--type", "double", "--payload", '{"n": 2}')
    done = await run(cli, "wait", task_id, "--timeout", "20")
    assert done.code == 0, done.err
    assert re.search(r"status: succeeded", done.out) and f"task_id: {task_id}" in done.out
    doc = (await run(cli, "wait", task_id, "--json")).json()
    assert doc["status"] == "succeeded" and doc["task_id"] == task_id and "now" in doc


async def test_wait_exits_1_when_the_task_failed(cli: Cli, worker: None) -> None:
    task_id = cli.submit("--type", "boom", "--max-attempts", "1")
    done = await run(cli, "wait", task_id, "--timeout", "20")
    assert done.code == 1, done.out + done.err
    assert re.search(r"status: (failed|dead_lettered)", done.out), done.out
    assert "bad input" in done.out
    assert "timed out" not in done.err


def test_wait_exits_1_for_a_cancelled_task(cli: Cli) -> None:
    task_id = cli.submit("--type", "double", "--payload", '{"n": 1}')
    cli.ok("cancel", task_id)
    done = cli("wait", task_id)
    assert done.code == 1 and "status: cancelled" in done.out, done.out + done.err


def test_wait_times_out_with_exit_1_and_shows_the_task_as_it_is(cli: Cli) -> None:
    task_id = cli.submit("--type", "double", "--delay-seconds", "600")
    done = cli.fails(1, "wait", task_id, "--timeout", "0.5")
    assert "status: pending" in done.out
    assert f"timed out after 0.5 s: task {task_id} is pending" in done.err
    doc = cli.fails(1, "wait", task_id, "--timeout", "0.2", "--json").json()
    assert doc["status"] == "pending" and doc["task_id"] == task_id


def test_wait_for_an_unknown_task_exits_1(cli: Cli) -> None:
    done = cli.fails(1, "wait", MISSING_ID, "--timeout", "5")
    assert "not found" in done.err and not done.out


@pytest.mark.parametrize("timeout", ["-1", "0", "abc", "nan", "86401"])
def test_wait_refuses_a_bad_timeout_as_a_usage_error(cli: Cli, timeout: str) -> None:
    done = cli.fails(2, "wait", MISSING_ID, "--timeout", timeout)
    assert "--timeout" in done.err


# -- dtq submit --wait ----------------------------------------------------------------------------


async def test_submit_wait_prints_the_result(cli: Cli, worker: None) -> None:
    done = await run(cli, "submit", "--type", "double", "--payload", '{"n": 7}', "--wait")
    assert done.code == 0, done.err
    assert json.loads(done.out) == {"n": 14}
    assert re.match(r"Submitted task [0-9a-f]{32}; waiting up to 60 s", done.err), done.err


async def test_submit_wait_json_prints_the_finished_task(cli: Cli, worker: None) -> None:
    args = ("submit", "--type", "double", "--payload", '{"n": 3}', "--wait", "--timeout", "20")
    done = await run(cli, *args, "--json")
    assert done.code == 0, done.err
    doc = done.json()
    assert doc["status"] == "succeeded" and doc["result"] == {"n": 6}
    assert not done.err


async def test_submit_wait_of_a_task_that_fails_exits_1_with_its_error(
    cli: Cli, worker: None
) -> None:
    done = await run(cli, "submit", "--type", "boom", "--max-attempts", "1", "--wait", "-q")
    assert done.code == 1, done.out + done.err
    assert not done.out
    assert re.search(r"task [0-9a-f]{32} (failed|dead-lettered): \w+: bad input", done.err)
    assert "Traceback" not in done.err

    doc = await run(cli, "submit", "--type", "boom", "--max-attempts", "1", "--wait", "--json")
    assert doc.code == 1 and doc.json()["status"] in ("failed", "dead_lettered")


def test_submit_wait_times_out_with_exit_1(cli: Cli) -> None:
    done = cli.fails(1, "submit", "--type", "double", "--wait", "--timeout", "0.5")
    assert not done.out
    assert re.search(r"timed out after 0.5 s: task [0-9a-f]{32} is queued", done.err), done.err


def test_submit_wait_of_an_expired_task_exits_1(cli: Cli) -> None:
    done = cli.fails(1, "submit", "--type", "double", "--ttl", "0", "--wait")
    assert re.search(r"task [0-9a-f]{32} expired", done.err), done.err


def test_submit_timeout_without_wait_is_a_usage_error_and_submits_nothing(
    cli: Cli, settings: Settings
) -> None:
    done = cli.fails(2, "submit", "--type", "double", "--timeout", "5")
    assert "--wait" in done.err
    cli.fails(2, "submit", "--type", "double", "--wait", "--timeout", "-3")
    assert task_count(settings) == 0
