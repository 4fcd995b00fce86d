"""CLI helpers: run the INSTALLED ``dtq`` executable as a subprocess against the test Redis,
and the fast settings of the in-process worker (:func:`support.worker.running_worker`) that
brings tasks into states (running, dead-lettered) only a worker produces."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtq import keys
from dtq.config import Settings
from dtq.connection import sync_client

DTQ = str(Path(sys.executable).with_name("dtq"))
REPO = Path(__file__).resolve().parents[2]
MISSING_ID = "f" * 32


@dataclass
class Run:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


def clean_env(redis_url: str, **extra: str) -> dict[str, str]:
    """The test's environment without any DTQ_* of the developer's, plus DTQ_REDIS_URL."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTQ_") and k != "NO_COLOR"}
    env["DTQ_REDIS_URL"] = redis_url
    env.update(extra)
    return env


class Cli:
    """``cli("list", "--json")`` runs ``dtq list --json`` and returns code, stdout, stderr.

    ``env``: variables every run gets (a run's own ``env`` wins); ``cluster``: the URL is a
    Redis Cluster's (every run gets ``DTQ_REDIS_CLUSTER=1``)."""

    def __init__(self, redis_url: str, *, cluster: bool = False, **env: str) -> None:
        self.redis_url = redis_url
        self.env = {"DTQ_REDIS_CLUSTER": "1", **env} if cluster else env

    def __call__(
        self,
        *args: str,
        stdin: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 30,
        cwd: Path | None = None,
    ) -> Run:
        proc = subprocess.run(
            [DTQ, *args],
            input=stdin if stdin is not None else "",
            capture_output=True,
            text=True,
            env=clean_env(self.redis_url, **{**self.env, **(env or {})}),
            timeout=timeout,
            cwd=cwd,
        )
        return Run(proc.returncode, proc.stdout, proc.stderr)

    def ok(self, *args: str, **kwargs: Any) -> Run:
        run = self(*args, **kwargs)
        assert run.code == 0, f"dtq {' '.join(args)} -> {run.code}\n{run.out}\n{run.err}"
        assert "Traceback" not in run.err
        return run

    def fails(self, code: int, *args: str, **kwargs: Any) -> Run:
        """The command exits ``code`` with one error line on stderr and no traceback."""
        run = self(*args, **kwargs)
        assert run.code == code, f"dtq {' '.join(args)} -> {run.code}\n{run.out}\n{run.err}"
        assert "Traceback" not in run.err
        assert run.err.strip(), "an error must say why on stderr"
        return run

    def tty(
        self,
        *args: str,
        typed: str | None = None,
        tty_stdout: bool = False,
        env: Mapping[str, str] | None = None,
        timeout: float = 30,
    ) -> Run:
        """Run with stdin on a pseudo-terminal (``typed`` is what the person types) and, with
        ``tty_stdout``, stdout on one too (for colour)."""
        master, slave = os.openpty()
        try:
            proc = subprocess.Popen(
                [DTQ, *args],
                stdin=slave,
                stdout=slave if tty_stdout else subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=clean_env(self.redis_url, **{**self.env, **(env or {})}),
            )
            os.close(slave)
            slave = -1
            if typed is not None:
                os.write(master, typed.encode())
            out = _read_tty(master, proc, timeout) if tty_stdout else b""
            stdout, stderr = proc.communicate(timeout=timeout)
        finally:
            os.close(master)
            if slave >= 0:
                os.close(slave)
        text = out.decode(errors="replace").replace("\r\n", "\n")
        if not tty_stdout:
            text = stdout.decode()
        return Run(proc.returncode, text, stderr.decode())

    def submit(self, *args: str) -> str:
        """Submit and return the new task id."""
        return str(self.ok("submit", *args, "--json").json()["task_id"])


def _read_tty(master: int, proc: subprocess.Popen[bytes], timeout: float) -> bytes:
    """Everything the process wrote to its terminal, until it exits and closes it."""
    chunks = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.1)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the last holder of the terminal closed it
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    return b"".join(chunks)


def fast_settings(redis_url: str, *, cluster: bool = False) -> Settings:
    return Settings(
        redis_url=redis_url,
        redis_cluster=cluster,
        heartbeat_interval_s=0.5,
        visibility_timeout_s=5,
        scheduler_interval_s=0.05,
        reaper_interval_s=0.5,
        drain_timeout_s=2,
        retry_base_delay=0.05,
        retry_max_delay=0.1,
    )


def task_count(settings: Settings) -> int:
    """How many tasks the default queue's recent index holds (a refused submit adds none)."""
    client = sync_client(settings, socket_timeout=5)
    try:
        return int(client.zcard(keys.recent("default")))
    finally:
        client.close()
