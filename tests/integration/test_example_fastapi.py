"""examples/fastapi_app: the app served by uvicorn with a ``dtq worker run`` process, as its
docstrings say to run it; its own test suite (docs/testing.md's complete example) run as a user
runs it; and docs/testing.md showing that suite as it is."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dtq.devserver import SERVER_ENV, free_port
from support.waiting import wait_until_sync
from support.worker import REPO, WorkerProcess

EXAMPLE = REPO / "examples" / "fastapi_app"
START, END = "<!-- example:start -->", "<!-- example:end -->"


def _env(**extra: str) -> dict[str, str]:
    # the suite's server binary (DTQ_REDIS_SERVER) carries over; no other dtq setting does
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTQ_") or k == SERVER_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "src")])
    env.update(extra)
    return env


def test_the_doc_shows_the_example_suite_as_it_is() -> None:
    doc = (REPO / "docs" / "testing.md").read_text()
    section = doc[doc.index(START) : doc.index(END)]
    [block] = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert block == (EXAMPLE / "test_thumbnails.py").read_text()


def test_the_example_suite_passes() -> None:
    """``pytest examples/fastapi_app`` from the project root, in a fresh process: the plugin
    starts its own server, the suite drains and runs workers, the app waits on its tasks."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "examples/fastapi_app", "-q", "-p", "no:cacheprovider"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tests = re.findall(r"^async def test_", (EXAMPLE / "test_thumbnails.py").read_text(), re.M)
    assert f"{len(tests)} passed" in proc.stdout, proc.stdout


@pytest.fixture
def app_url(redis_url: str, tmp_path: Path) -> Iterator[str]:
    """``uvicorn --factory examples.fastapi_app.app:create_app`` on a free port, answering."""
    port = free_port()
    log = (tmp_path / "uvicorn.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", "examples.fastapi_app.app:create_app",
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        cwd=REPO,
        env=_env(DTQ_REDIS_URL=redis_url),
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        assert server.poll() is None, (tmp_path / "uvicorn.log").read_text()
        try:
            return httpx.get(f"{url}/thumbnails/none", timeout=1).status_code == 404
        except httpx.TransportError:
            return False

    try:
        wait_until_sync(answers, 20, "the example app answers")
        yield url
    finally:
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(5)
        log.close()


def test_the_app_with_a_worker_process_returns_the_result(
    app_url: str, redis_url: str, tmp_path: Path
) -> None:
    worker = WorkerProcess(
        redis_url, tmp_path, args=("--queue", "thumbnails"), tasks="examples.fastapi_app.tasks"
    )
    try:
        image = {"image": "dogs/rex.jpg", "width": 300, "height": 600, "max_side": 100}
        resp = httpx.post(f"{app_url}/thumbnails", params={"wait": 20}, json=image, timeout=30)
        assert resp.status_code == 200, resp.text + worker.output()
        body = resp.json()
        assert body == {
            "task_id": body["task_id"],
            "thumbnail": "thumbs/dogs/rex_50x100.jpg",
            "width": 50,
            "height": 100,
        }
        later = httpx.get(f"{app_url}/thumbnails/{body['task_id']}", timeout=5).json()
        assert later["status"] == "succeeded"
        assert later["result"] == {k: v for k, v in body.items() if k != "task_id"}
    finally:
        worker.stop()
