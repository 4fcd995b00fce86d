"""The installed ``dtq`` executable's long-running commands as real processes: ``worker run``,
``api`` and ``dev`` (a private Redis, the API and a worker, stopped by a real Ctrl-C)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import signal
import subprocess
import termios
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_cli_support import DTQ, REPO, Cli, clean_env, wait_until

from dtq.devserver import free_port

pytestmark = pytest.mark.slow

FAST = {
    "DTQ_HEARTBEAT_INTERVAL_S": "0.5",
    "DTQ_VISIBILITY_TIMEOUT_S": "5",
    "DTQ_SCHEDULER_INTERVAL_S": "0.05",
    "DTQ_DRAIN_TIMEOUT_S": "5",
    "DTQ_WORKER_METRICS_PORT": "0",
    "DTQ_LOG_LEVEL": "WARNING",
}

TASKS_MODULE = """
from dtq_tasks import task


@task("cli_upper")
async def upper(payload, ctx):
    return {"text": payload["text"].upper(), "queue": ctx.queue}
"""


@pytest.fixture
def cli(redis_url: str) -> Cli:
    # cli_upper is registered by a module the worker imports from its own directory: the
    # producer does no registry check (DTQ_TASK_MODULES="").
    return Cli(redis_url, DTQ_TASK_MODULES="")


@contextlib.contextmanager
def process(argv: list[str], **kwargs: object) -> Iterator[subprocess.Popen[bytes]]:
    """A child process that is always gone at the end (SIGKILL by PID if it is still there)."""
    proc = subprocess.Popen(argv, **kwargs)  # type: ignore[call-overload]
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def succeeded(cli: Cli, task_id: str) -> bool:
    return bool(cli.ok("get", task_id, "--json").json()["status"] == "succeeded")


def test_worker_run_serves_the_given_queues_with_the_given_modules(
    cli: Cli, redis_url: str, tmp_path: Path
) -> None:
    (tmp_path / "cli_demo_tasks.py").write_text(TASKS_MODULE)
    emails = cli.submit("--type", "cli_upper", "--payload", '{"text": "hi"}', "--queue", "emails")
    other = cli.submit("--type", "cli_upper", "--payload", '{"text": "yo"}', "--queue", "other")
    default = cli.submit("--type", "cli_upper", "--payload", '{"text": "no"}')
    argv = [DTQ, "worker", "run", "--queue", "emails", "--queue", "other",
            "--concurrency", "2", "--tasks", "cli_demo_tasks"]  # fmt: skip
    with process(argv, cwd=tmp_path, env=clean_env(redis_url, **FAST)) as worker:
        wait_until(lambda: succeeded(cli, emails) and succeeded(cli, other), what="both run")
        assert cli.ok("get", emails, "--json").json()["result"] == {
            "text": "HI",
            "queue": "emails",
        }
        assert cli.ok("queue", "stats", "emails", "--json").json()["workers_active"] == 1
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0
    assert cli.ok("get", default, "--json").json()["status"] == "queued"  # not served


def test_worker_run_with_several_processes(cli: Cli, redis_url: str, tmp_path: Path) -> None:
    (tmp_path / "cli_demo_tasks.py").write_text(TASKS_MODULE)
    argv = [DTQ, "worker", "run", "--processes", "2", "--tasks", "cli_demo_tasks"]
    with process(argv, cwd=tmp_path, env=clean_env(redis_url, **FAST)) as worker:
        wait_until(
            lambda: cli.ok("queue", "stats", "default", "--json").json()["workers_active"] == 2,
            timeout_s=30,
            what="two worker processes",
        )
        task_id = cli.submit("--type", "cli_upper", "--payload", '{"text": "x"}')
        wait_until(lambda: succeeded(cli, task_id), what="the task run")
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0


def test_worker_run_refuses_a_module_it_cannot_import(cli: Cli, tmp_path: Path) -> None:
    run = cli.fails(2, "worker", "run", "--tasks", "no_such_module_here")
    assert "no_such_module_here" in run.err
    assert cli.fails(2, "worker", "run", "--concurrency", "0").code == 2


def test_api_serves_until_interrupted(cli: Cli, redis_url: str) -> None:
    port = free_port()
    argv = [DTQ, "api", "--host", "127.0.0.1", "--port", str(port)]
    env = clean_env(redis_url, **FAST, DTQ_TASK_MODULES="examples.tasks", PYTHONPATH=str(REPO))
    with process(argv, env=env, cwd=REPO) as api:
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _answers(base + "/health"), timeout_s=30, what="the API")
        resp = httpx.post(base + "/api/v1/tasks", json={"task_type": "echo_task", "payload": {}})
        assert resp.status_code == 202
        assert cli.ok("get", resp.json()["task_id"], "--json").json()["status"] == "queued"
        api.send_signal(signal.SIGINT)
        assert api.wait(30) == 0


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(p) for p in (task / "children").read_text().split()]
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


def _on_terminal() -> None:
    """In the child: a session of its own whose controlling terminal is stdin (a pty), so a
    Ctrl-C typed there is a SIGINT to its foreground process group, as in a real shell."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


@pytest.mark.parametrize(
    "redis_given", [False, True], ids=["private-redis-ctrl-c", "given-redis-sigterm"]
)
def test_dev_runs_the_stack_and_a_signal_stops_it_in_order(
    redis_url: str, tmp_path: Path, redis_given: bool
) -> None:
    port = free_port()
    url = redis_url if redis_given else f"redis://127.0.0.1:{free_port()}/0"  # closed port
    env = clean_env(url, **FAST, PYTHONPATH=str(REPO))
    out_path, err_path = tmp_path / "out.txt", tmp_path / "err.txt"
    master, slave = os.openpty()
    with (
        out_path.open("wb") as out,
        err_path.open("wb") as err,
        process(
            [DTQ, "dev", "--port", str(port)],
            cwd=tmp_path, env=env, stdin=slave, stdout=out, stderr=err,
            preexec_fn=_on_terminal,
        ) as dev,
    ):  # fmt: skip
        os.close(slave)
        children: list[int] = []
        try:
            wait_until(
                lambda: "dtq dev: API" in out_path.read_text() or dev.poll() is not None,
                timeout_s=60,
                what="the URL line",
            )
            line = next(ln for ln in out_path.read_text().splitlines() if "dtq dev: API" in ln)
            base = f"http://127.0.0.1:{port}"
            for part in (f"API {base}/api/v1", f"docs {base}/docs", f"metrics {base}/metrics",
                         f"events ws://127.0.0.1:{port}/ws/events"):  # fmt: skip
                assert part in line
            redis_in_line = re.search(r"redis (redis://\S+)", line)
            assert redis_in_line is not None
            children = _children(dev.pid)
            assert redis_in_line.group(1) == url  # a private one takes the URL's free port
            if redis_given:
                assert len(children) == 2  # API and worker
                assert not (tmp_path / ".dtq").exists()
            else:
                assert len(children) == 3  # Redis, API and worker
                assert (tmp_path / ".dtq" / "redis" / "redis.log").exists()
                assert f"no Redis answers at {url}; started a private one" in err_path.read_text()
                assert Cli(url).ok("list", "--json").json()["count"] == 0  # same settings

            resp = httpx.post(
                base + "/api/v1/tasks", json={"task_type": "echo_task", "payload": {"hi": 1}}
            )
            assert resp.status_code == 202, resp.text
            task_url = f"{base}/api/v1/tasks/{resp.json()['task_id']}"
            wait_until(
                lambda: httpx.get(task_url).json()["status"] == "succeeded", what="the demo task"
            )
            assert httpx.get(task_url).json()["result"] == {"hi": 1}
            assert _answers(base + "/metrics")

            if redis_given:
                dev.send_signal(signal.SIGTERM)  # as a process manager stops it
            else:
                os.write(master, b"\x03")  # Ctrl-C on its terminal
            assert dev.wait(60) == 0
        finally:
            os.close(master)
            for pid in children:
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
    assert children and not [pid for pid in children if _alive(pid)]
    stderr = err_path.read_text()
    expected = "stopped worker, api" if redis_given else "stopped worker, api, redis"
    assert f"dtq dev: {expected}\n" in stderr
    assert "Traceback" not in stderr


def test_dev_refuses_a_port_in_use(redis_url: str, tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        run = Cli(redis_url).fails(1, "dev", "--port", str(port), cwd=tmp_path)
    assert f"cannot serve the API on 127.0.0.1:{port}: the port is in use" in run.err
    assert not (tmp_path / ".dtq").exists()
