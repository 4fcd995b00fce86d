"""Fixtures shared by the integration tests: real worker processes, and the API in process."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from dtq.config import Settings
from support.api import API_KEY, Api, api_settings, running_api
from support.worker import WorkerProcess, write_task_module


@pytest.fixture
async def api(settings: Settings) -> AsyncIterator[Api]:
    """The API with auth off (DTQ_API_KEY unset: local development)."""
    async with running_api(api_settings(settings)) as running:
        yield running


@pytest.fixture
async def api_auth(settings: Settings) -> AsyncIterator[Api]:
    """The API with DTQ_API_KEY set (support.api.API_KEY)."""
    async with running_api(api_settings(settings, api_key=API_KEY)) as running:
        yield running


@pytest.fixture
async def spawn(
    tmp_path: Path, redis_url: str, backend: str
) -> AsyncIterator[Callable[..., WorkerProcess]]:
    """``spawn(worker_id=None, *args, **env)``: a ``dtq worker run`` process on the test's
    task module (``sp_tasks``) and backend, stopped at the end of the test."""
    write_task_module(tmp_path)
    started: list[WorkerProcess] = []

    def make(worker_id: str | None = None, *args: str, **env: Any) -> WorkerProcess:
        proc = WorkerProcess(
            redis_url,
            tmp_path,
            worker_id=worker_id,
            args=args,
            env=env,
            cluster=backend == "cluster",
        )
        started.append(proc)
        return proc

    yield make
    for proc in started:
        proc.stop()
