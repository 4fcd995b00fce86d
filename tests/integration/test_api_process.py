"""The two ways to run the API as a process: ``uvicorn --factory dtq.api:create_app`` (settings
from DTQ_* variables) and ``dtq.api.serve`` (what ``dtq api`` and ``dtq dev`` call). Each is
started on 127.0.0.1, answers, and stops cleanly on a signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dtq.devserver import free_port
from support.api import wait_healthy

ROOT = Path(__file__).resolve().parents[2]


def _env(redis_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTQ_")}
    env.update({"DTQ_REDIS_URL": redis_url, "DTQ_TASK_MODULES": "", "DTQ_LOG_LEVEL": "INFO"})
    return env


@pytest.fixture
def stop_later() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _exercise(proc: subprocess.Popen[bytes], port: int, sig: signal.Signals) -> None:
    base = f"http://127.0.0.1:{port}"
    wait_healthy(proc, base)
    assert httpx.get(f"{base}/ready", timeout=5).status_code == 200
    resp = httpx.post(f"{base}/api/v1/tasks", json={"task_type": "any_type"}, timeout=5)
    assert resp.status_code == 202, resp.text
    got = httpx.get(f"{base}/api/v1/tasks/{resp.json()['task_id']}", timeout=5)
    assert got.json()["status"] == "queued"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=15)
    # uvicorn shuts down cleanly, then re-raises the signal it caught.
    assert proc.returncode in (0, -sig), err
    assert b"Application shutdown complete" in err


@pytest.mark.slow
def test_uvicorn_factory(redis_url: str, stop_later: list[subprocess.Popen[bytes]]) -> None:
    port = free_port()
    args = ["-m", "uvicorn", "--factory", "dtq.api:create_app", "--host", "127.0.0.1"]
    proc = subprocess.Popen(
        [sys.executable, *args, "--port", str(port)],
        cwd=ROOT,
        env=_env(redis_url),
        stderr=subprocess.PIPE,
    )
    stop_later.append(proc)
    _exercise(proc, port, signal.SIGTERM)


@pytest.mark.slow
def test_serve(redis_url: str, stop_later: list[subprocess.Popen[bytes]]) -> None:
    port = free_port()
    code = (
        "from dtq.api import serve; from dtq.config import load_settings; "
        f"serve(load_settings(), '127.0.0.1', {port})"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(redis_url), stderr=subprocess.PIPE
    )
    stop_later.append(proc)
    _exercise(proc, port, signal.SIGINT)


@pytest.mark.slow
def test_factory_fails_fast_on_a_bad_task_module(redis_url: str) -> None:
    env = {**_env(redis_url), "DTQ_TASK_MODULES": "no_such_module_here"}
    code = "from dtq.api import create_app; create_app()"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, timeout=60
    )
    assert done.returncode != 0
    assert b"DTQ_TASK_MODULES" in done.stderr and b"no_such_module_here" in done.stderr
