"""Fixtures shared by the integration tests that run real worker processes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from support.worker import WorkerProcess, write_task_module


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
