"""Every surface applies the core's rules through one Queue, with one message each: the
registered task types and the payload models (the API, ``dtq submit`` and the SDK), the
queue-name rule (the SDK, the API's body, path and query, the CLI's flags, the worker's
--queue) and the list bounds."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from dtq import Queue, connect, keys
from dtq.config import Settings
from dtq.devserver import free_port
from dtq.errors import InvalidTaskError, UnknownTaskTypeError
from dtq.models import LIST_LIMIT_MAX, check_queue_name
from dtq_tasks import load_task_types
from support.api import Api, api_settings, error_of, running_api
from support.cli import REPO, Cli, clean_env

BAD_QUEUE = "Bad Queue"
DEMO = "examples.tasks"  # the demo modules: sleep_task declares a payload model


def queue_message(name: str = BAD_QUEUE) -> str:
    with pytest.raises(InvalidTaskError) as exc:
        check_queue_name(name)
    return exc.value.message


@pytest.fixture
async def api(settings: Settings) -> AsyncIterator[Api]:
    async with running_api(api_settings(settings, task_modules=DEMO)) as running:
        yield running


@pytest.fixture
def cli(redis_url: str) -> Cli:
    return Cli(redis_url, DTQ_TASK_MODULES=DEMO)


@pytest.fixture
def free_url() -> str:
    """A Redis URL nobody answers at: a command that got past loading would exit 1."""
    return f"redis://127.0.0.1:{free_port()}/0"


@pytest.fixture
async def typed_queue(settings: Settings) -> AsyncIterator[Queue]:
    """The SDK with the registry a producer loads (as the API and dtq submit do)."""
    known, models = load_task_types(settings.model_copy(update={"task_modules": DEMO}))
    q = await connect(settings=settings, known_types=known, payload_models=models)
    try:
        yield q
    finally:
        await q.close()


async def api_error(api: Api, status: int, **body: Any) -> dict[str, Any]:
    resp = await api.client.post("/api/v1/tasks", json=body)
    assert resp.status_code == status, resp.text
    return error_of(resp)


# -- registered types and payload models -----------------------------------------------------------


async def test_cli_refuses_an_unknown_type_with_the_api_message(
    api: Api, cli: Cli, r: Redis
) -> None:
    err = await api_error(api, 400, task_type="no_such_type")
    assert err["code"] == "UNKNOWN_TASK_TYPE"
    run = await asyncio.to_thread(cli.fails, 2, "submit", "--type", "no_such_type")
    assert run.err.strip() == f"dtq: error: {err['message']}"
    assert await r.zcard(keys.RECENT) == 0  # nothing was written by either


async def test_cli_checks_payload_models_like_the_api(api: Api, cli: Cli, r: Redis) -> None:
    err = await api_error(api, 400, task_type="sleep_task", payload={"seconds": "long"})
    assert err["code"] == "INVALID_TASK" and err["message"].startswith("payload.seconds: ")
    run = await asyncio.to_thread(
        cli.fails, 2, "submit", "--type", "sleep_task", "--payload", '{"seconds": "long"}'
    )
    assert run.err.strip() == f"dtq: error: {err['message']}"
    ok = await asyncio.to_thread(
        cli.ok, "submit", "--type", "sleep_task", "--payload", '{"seconds": 0}', "--json"
    )
    assert ok.json()["status"] == "queued"


async def test_cli_names_a_task_module_it_cannot_import(cli: Cli) -> None:
    run = await asyncio.to_thread(
        cli.fails, 2, "submit", "--type", "echo_task", env={"DTQ_TASK_MODULES": "no_such_mod"}
    )
    assert "cannot import task module 'no_such_mod'" in run.err


async def test_sdk_checks_payload_models_at_ingest(api: Api, typed_queue: Queue, r: Redis) -> None:
    err = await api_error(api, 400, task_type="sleep_task", payload={"seconds": 99})
    with pytest.raises(InvalidTaskError) as exc:
        await typed_queue.submit("sleep_task", {"seconds": 99})
    assert exc.value.code == err["code"] == "INVALID_TASK"
    assert exc.value.message == err["message"]
    assert exc.value.details["errors"] == err["details"]["errors"]
    with pytest.raises(InvalidTaskError):  # every item of a batch is checked before sending
        await typed_queue.submit_many(
            [{"task_type": "sleep_task"}, {"task_type": "sleep_task", "payload": {"x": 1}}]
        )
    with pytest.raises(UnknownTaskTypeError):
        await typed_queue.submit("no_such_type")
    assert await r.zcard(keys.RECENT) == 0
    task = await typed_queue.submit("sleep_task", {"seconds": 0.5})
    assert task.payload == {"seconds": 0.5}


# -- one queue-name rule ---------------------------------------------------------------------------


async def test_one_queue_name_message_on_every_surface(
    api: Api, cli: Cli, queue: Queue, settings: Settings
) -> None:
    message = queue_message()
    assert message.startswith("'Bad Queue' is not a valid queue name")

    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: queue.submit("echo_task", queue=BAD_QUEUE),
        lambda: queue.list(queue=BAD_QUEUE),
        lambda: queue.pause_queue(BAD_QUEUE),
        lambda: queue.queue_stats(BAD_QUEUE),
        lambda: queue.purge_queue(BAD_QUEUE),
    ]
    for call in calls:
        with pytest.raises(InvalidTaskError) as exc:
            await call()
        assert message in exc.value.message

    body = await api_error(api, 400, task_type="echo_task", queue=BAD_QUEUE)
    assert body["message"] == f"queue: {message}"
    for resp in (
        await api.client.get(f"/api/v1/queues/{BAD_QUEUE}"),
        await api.client.post(f"/api/v1/queue/{BAD_QUEUE}/pause"),
        await api.client.get("/api/v1/tasks", params={"queue": BAD_QUEUE}),
    ):
        assert resp.status_code == 400
        err = error_of(resp)
        assert err["code"] == "INVALID_REQUEST"
        assert err["message"].endswith(f": {message}")

    for args in (
        ["submit", "--type", "echo_task", "--queue", BAD_QUEUE],
        ["list", "--queue", BAD_QUEUE],
        ["queue", "stats", BAD_QUEUE],
    ):
        run = await asyncio.to_thread(cli.fails, 2, *args)
        assert message in run.err

    worker = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "dtq.worker", "--queue", BAD_QUEUE],
        capture_output=True,
        text=True,
        env=clean_env(settings.redis_url, DTQ_TASK_MODULES=DEMO),
        cwd=REPO,
        timeout=60,
    )
    assert worker.returncode == 2, worker
    # python -m dtq.worker is dtq worker run: the CLI's parser refuses the flag.
    assert f"argument --queue: {message}" in worker.stderr


# -- one list bound --------------------------------------------------------------------------------


async def test_one_list_bound_on_every_surface(api: Api, cli: Cli, queue: Queue) -> None:
    """The SDK's dead-letter and audit lists refused a limit out of range only on the API;
    the SDK clamped it. Now every list read refuses it, with one message."""
    message = f"limit must be between 1 and {LIST_LIMIT_MAX}, not {LIST_LIMIT_MAX + 1}"
    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: queue.list(limit=LIST_LIMIT_MAX + 1),
        lambda: queue.dlq_list(LIST_LIMIT_MAX + 1),
        lambda: queue.audit_log(LIST_LIMIT_MAX + 1),
    ]
    for call in calls:
        with pytest.raises(InvalidTaskError) as exc:
            await call()
        assert exc.value.message == message
    with pytest.raises(InvalidTaskError):
        await queue.dlq_list(0)
    assert await queue.dlq_list(LIST_LIMIT_MAX) == []

    for path in ("/api/v1/tasks", "/api/v1/dlq", "/api/v1/audit"):
        resp = await api.client.get(path, params={"limit": LIST_LIMIT_MAX + 1})
        assert resp.status_code == 400
        err = error_of(resp)
        assert err["code"] == "INVALID_REQUEST" and err["message"].endswith(f": {message}")

    for args in (["list"], ["dlq", "list"]):
        run = await asyncio.to_thread(cli.fails, 2, *args, "--limit", str(LIST_LIMIT_MAX + 1))
        assert message in run.err


# -- one loader of task modules --------------------------------------------------------------------

BROKEN_MODULE = 'raise ValueError("boom at import")\n'


@pytest.mark.parametrize("command", [["api", "--port", "1"], ["submit", "--type", "echo_task"]])
@pytest.mark.parametrize(
    ("modules", "needle"),
    [
        (
            "broken_tasks",
            "cannot import task module 'broken_tasks' (DTQ_TASK_MODULES or --tasks): "
            "ValueError: boom at import",
        ),
        ("json", "no task handlers registered"),
    ],
)
def test_the_api_and_submit_load_task_modules_like_the_worker(
    tmp_path: Path, free_url: str, command: list[str], modules: str, needle: str
) -> None:
    """The API caught only an ImportError (anything else a module raised was a traceback) and
    accepted modules that register nothing (every submit then refused): the worker's rules win,
    one line, exit 2, before Redis is reached."""
    (tmp_path / "broken_tasks.py").write_text(BROKEN_MODULE)
    run = Cli(free_url, DTQ_TASK_MODULES=modules).fails(2, *command, cwd=tmp_path)
    assert run.err.startswith(f"dtq: error: {needle}"), run.err
    assert run.err.count("\n") == 1, run.err


async def test_one_status_message_on_every_surface(api: Api, cli: Cli, queue: Queue) -> None:
    message = "status 'bogus' is not one of pending, queued, running, succeeded, retrying, "
    with pytest.raises(InvalidTaskError) as exc:
        await queue.list(status="bogus")
    assert exc.value.message.startswith(message)
    resp = await api.client.get("/api/v1/tasks", params={"status": "bogus"})
    assert resp.status_code == 400
    err = error_of(resp)
    assert (
        err["code"] == "INVALID_REQUEST" and err["message"] == f"query.status: {exc.value.message}"
    )
    assert (await api.client.get("/api/v1/tasks", params={"status": "queued"})).status_code == 200
    run = await asyncio.to_thread(cli.fails, 2, "list", "--status", "bogus")
    assert exc.value.message in run.err
