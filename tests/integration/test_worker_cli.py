"""``python -m dtq.worker`` (``dtq worker run``): its flags and exit codes (0 clean stop, 1 Redis,
2 bad input)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_worker_support import REPO, write_task_module

from dtq.devserver import free_port
from dtq.worker.supervisor import child_settings, child_worker_id


def run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("DTQ_")}
    full["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "src")])
    full["DTQ_WORKER_METRICS_PORT"] = "0"  # no endpoint on 0.0.0.0 in tests
    full.update(env)
    return subprocess.run(
        [sys.executable, "-m", "dtq.worker", *args],
        cwd=cwd,
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_help_lists_the_flags(tmp_path: Path) -> None:
    out = run(["--help"], tmp_path)
    assert out.returncode == 0
    for flag in ("--concurrency", "--queue", "--tasks", "--processes"):
        assert flag in out.stdout


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["--queue", "Bad Queue"], {}, "'Bad Queue' is not a valid queue name"),
        (["--tasks", "no_such_module_xyz"], {}, "cannot import task module 'no_such_module_xyz'"),
        (["--tasks", "json"], {}, "no task handlers registered"),
        ([], {"DTQ_VISIBILITY_TIMEOUT_S": "-3"}, "DTQ_VISIBILITY_TIMEOUT_S"),
        (["--concurrency", "0"], {}, "must be at least 1"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    tmp_path: Path, args: list[str], env: dict[str, str], needle: str
) -> None:
    out = run(args, tmp_path, DTQ_TASK_MODULES="examples.tasks", **env)
    assert out.returncode == 2, out
    assert needle in out.stderr
    assert "Traceback" not in out.stderr


def test_unreachable_redis_exits_1(tmp_path: Path) -> None:
    write_task_module(tmp_path)
    url = f"redis://127.0.0.1:{free_port()}/0"
    out = run(["--tasks", "sp_tasks"], tmp_path, DTQ_REDIS_URL=url)
    assert out.returncode == 1, out
    assert "Redis at" in out.stderr and "Traceback" not in out.stderr


def test_current_directory_is_on_sys_path_for_task_modules(tmp_path: Path) -> None:
    """A module next to where the worker starts is importable (DESIGN 9); shown by reaching
    the Redis connection step, past the import."""
    write_task_module(tmp_path, "local_tasks")
    url = f"redis://127.0.0.1:{free_port()}/0"
    out = run(["--tasks", "local_tasks"], tmp_path, DTQ_REDIS_URL=url)
    assert out.returncode == 1 and "cannot import" not in out.stderr


def test_supervisor_child_settings(settings_env: None) -> None:
    from dtq.config import Settings

    s = Settings(worker_id="w-main", visibility_timeout_s=7, dlq_enabled=False)
    assert child_worker_id(s, 2) == "w-main-2"
    child = child_settings(s, 2, child_worker_id(s, 2))
    assert child.worker_id == "w-main-2" and child.visibility_timeout_s == 7
    assert child.dlq_enabled is False and s.worker_id == "w-main"  # the parent is untouched
    metered = child_settings(Settings(worker_metrics_port=9100), 3, "worker-00000003")
    assert metered.worker_metrics_port == 9103
    auto = {child_worker_id(Settings(), 0) for _ in range(3)}
    assert len(auto) == 3 and all(re.fullmatch(r"worker-[0-9a-f]{8}", a) for a in auto)


@pytest.fixture
def settings_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("DTQ_"):
            monkeypatch.delenv(name)
