"""Dashboard helpers: Debian's chromium (installed with
apt-get when missing), the API served by a real uvicorn on 127.0.0.1 in a thread of its own,
a browser page that records what the user would notice (dialogs, script errors, CSP
violations), and a small steady workload for the overview.

Playwright drives the system's chromium (``executable_path``); its own browser download
(``playwright install``) is never used.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import random
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from playwright.async_api import Browser, ConsoleMessage, Dialog, Page, Request, async_playwright

from dtq import Queue

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
APT_UPDATE_TIMEOUT_S = 300
APT_INSTALL_TIMEOUT_S = 600
API_KEY = "dash-test-key"
INSTALL_LOCK = os.path.join(tempfile.gettempdir(), "dtq-tests-chromium-install.lock")


def ensure_chromium() -> str:
    """The path of Debian's chromium, installing it (apt-get, as root) when it is missing.

    Skips the calling tests with the reason when it cannot be installed. Parallel test
    workers install it one at a time (a second apt-get would fail on dpkg's lock): each waits
    for :data:`INSTALL_LOCK`, then looks again."""
    if os.access(CHROMIUM, os.X_OK):
        return CHROMIUM
    with open(INSTALL_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return _install_chromium()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _install_chromium() -> str:
    if os.access(CHROMIUM, os.X_OK):
        return CHROMIUM  # another worker installed it meanwhile
    apt = shutil.which("apt-get")
    if apt is None:
        pytest.skip(f"{CHROMIUM} is missing and there is no apt-get to install it")
    if os.geteuid() != 0:
        pytest.skip(
            f"{CHROMIUM} is missing and installing it needs root (apt-get install chromium)"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    steps = [
        ([apt, "update"], APT_UPDATE_TIMEOUT_S),
        ([apt, "install", "-y", "chromium"], APT_INSTALL_TIMEOUT_S),
    ]
    for argv, timeout_s in steps:
        try:
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.skip(
                f"chromium could not be installed: {' '.join(argv)} took over {timeout_s} s"
            )
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
            pytest.skip(
                f"chromium could not be installed: {' '.join(argv)} exited {done.returncode}: "
                + " | ".join(tail)
            )
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"apt-get installed chromium but {CHROMIUM} is not there")
    return CHROMIUM


@dataclass
class Watched:
    """A page and what happened on it that a user would notice or a test must refuse."""

    page: Page
    dialogs: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)

    def problems(self) -> list[str]:
        """Script errors and refusals (CSP, Trusted Types); failed HTTP statuses are not."""
        refused = [m for m in self.console_errors if not m.startswith("Failed to load resource")]
        return self.page_errors + refused

    async def mark(self) -> None:
        """Set a marker that a reload would erase (see :meth:`not_reloaded`)."""
        await self.page.evaluate("() => { window.__dtqNotReloaded = true; }")

    async def not_reloaded(self) -> bool:
        return bool(await self.page.evaluate("() => window.__dtqNotReloaded === true"))


@contextlib.asynccontextmanager
async def browser(executable: str) -> AsyncIterator[Browser]:
    """Debian's chromium (``executable``, from :func:`ensure_chromium`), headless."""
    async with async_playwright() as pw:
        instance = await pw.chromium.launch(
            executable_path=executable, args=CHROMIUM_FLAGS, headless=True
        )
        try:
            yield instance
        finally:
            await instance.close()


@contextlib.asynccontextmanager
async def watched_page(
    instance: Browser, width: int = 1360, height: int = 900
) -> AsyncIterator[Watched]:
    """A page in a fresh context (its own sessionStorage) that records dialogs (dismissed at
    once), uncaught script errors, console errors and every request."""
    context = await instance.new_context(viewport={"width": width, "height": height})
    page = await context.new_page()
    watched = Watched(page)

    async def on_dialog(dialog: Dialog) -> None:
        watched.dialogs.append(f"{dialog.type}: {dialog.message}")
        await dialog.dismiss()

    def on_console(msg: ConsoleMessage) -> None:
        if msg.type == "error":
            watched.console_errors.append(msg.text)

    page.on("dialog", on_dialog)
    page.on("pageerror", lambda exc: watched.page_errors.append(str(exc)))
    page.on("console", on_console)
    page.on("request", lambda request: watched.requests.append(request))
    try:
        yield watched
    finally:
        await context.close()


async def workload(queue: Queue, seconds: float, per_second: float = 6.0) -> int:
    """A small steady workload on three queues (echo, short sleeps, some failures that retry
    and dead-letter) for ``seconds``; returns how many tasks were submitted."""
    rng = random.Random(7)
    plan: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
        ("default", "api_echo", {"n": 1}, {}),
        ("default", "api_sleep", {"s": 0.4}, {}),
        ("emails", "api_echo", {"to": "someone@example.com"}, {"ttl_seconds": 600}),
        ("emails", "api_sleep", {"s": 0.2}, {}),
        ("reports", "api_sleep", {"s": 1.2}, {"priority": 7}),
        ("reports", "api_fail", {"why": "report source unavailable"}, {"max_attempts": 2}),
    ]
    weights = [5, 3, 5, 3, 2, 1]
    submitted = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        name, task_type, payload, extra = rng.choices(plan, weights)[0]
        await queue.submit(task_type, payload, queue=name, **extra)
        submitted += 1
        await asyncio.sleep(rng.expovariate(per_second))
    return submitted
