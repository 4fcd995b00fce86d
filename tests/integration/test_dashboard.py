"""The dashboard (/dashboard) in a real browser: Debian's chromium, headless, driven by
Playwright, against a real API (uvicorn on 127.0.0.1), a real worker and the test Redis.

What a user sees: the overview lists a submitted task's queue and updates without reload; a
task moves to succeeded on screen; a cancel through the UI cancels (with the API key entered
once, kept in sessionStorage, sent as X-API-Key, never in a URL); the other operator actions
change Redis; the limits page follows each limit's use; a payload or error containing HTML
shows as text and no dialog fires; the event stream reconnects by itself after the API
restarts; the security headers are on every dashboard response.

Set ``DTQ_DASHBOARD_SCREENSHOT=docs/dashboard.png`` to write the overview screenshot of the
docs (the workload then runs ``DTQ_DASHBOARD_SCREENSHOT_S`` seconds, default 75).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from playwright.async_api import Browser, expect
from redis.asyncio import Redis

from dtq import Queue, connect, keys
from dtq.config import Settings
from dtq_tasks import TaskContext
from support import running_worker, wait_until
from support.api import ApiServer, api_server, api_settings
from support.dashboard import (
    API_KEY,
    Watched,
    browser,
    ensure_chromium,
    watched_page,
    workload,
)
from support.worker import handlers

# One event loop for the module, so that one browser serves every test (launching chromium
# and Playwright's driver costs about 1.5 s). The first test may install chromium (bounded by
# its own timeouts): the per-test timeout covers the test body only, not that setup.
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120, func_only=True)]

SECONDS = 10_000  # Playwright timeouts are in ms


@pytest.fixture(scope="session")
def chromium() -> str:
    return ensure_chromium()


@pytest.fixture
def dash_settings(settings: Settings) -> Settings:
    return api_settings(settings, api_key=API_KEY)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def chrome(chromium: str) -> AsyncIterator[Browser]:
    async with browser(chromium) as instance:
        yield instance


# The async fixtures of tests/conftest.py, in the module's loop.
@pytest_asyncio.fixture(loop_scope="module")
async def r(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


@pytest_asyncio.fixture(loop_scope="module")
async def queue(settings: Settings) -> AsyncIterator[Queue]:
    q = await connect(settings=settings)
    yield q
    await q.close()


@pytest_asyncio.fixture(loop_scope="module")
async def server(dash_settings: Settings) -> AsyncIterator[ApiServer]:
    async with api_server(dash_settings) as running:
        yield running


@pytest_asyncio.fixture(loop_scope="module")
async def ui(chrome: Browser, server: ApiServer) -> AsyncIterator[Watched]:
    async with watched_page(chrome) as watched:
        yield watched
        assert not watched.problems(), watched.problems()
        assert not watched.dialogs, watched.dialogs


async def open_dashboard(ui: Watched, server: ApiServer, view: str = "") -> None:
    await ui.page.goto(f"{server.url}/dashboard/{view}")
    await expect(ui.page.get_by_test_id("live")).to_have_text("live", timeout=SECONDS)
    await ui.mark()


# -- overview -------------------------------------------------------------------------------------


async def test_overview_shows_queues_workers_and_throughput_live(
    ui: Watched, server: ApiServer, queue: Queue, dash_settings: Settings
) -> None:
    await queue.submit("api_echo", {"n": 1}, queue="dash-a")
    await open_dashboard(ui, server)
    a = ui.page.locator('[data-testid="queues"] tr[data-queue="dash-a"]')
    await expect(a.locator('[data-col="depth"]')).to_have_text("1")
    await expect(a.locator('[data-col="waiting"]')).to_have_text("1")
    await expect(a.locator('[data-col="state"]')).to_have_text("active")
    await expect(ui.page.get_by_test_id("workers")).to_contain_text("No live worker")

    # Live, without reload: a new queue appears, a worker comes, the task runs and is counted.
    await queue.submit("api_echo", {"n": 2}, queue="dash-b")
    b = ui.page.locator('[data-testid="queues"] tr[data-queue="dash-b"]')
    await expect(b.locator('[data-col="depth"]')).to_have_text("1", timeout=SECONDS)
    async with running_worker(dash_settings, queues=("dash-a",)) as worker:
        await expect(a.locator('[data-col="depth"]')).to_have_text("0", timeout=SECONDS)
        w = ui.page.locator(f'[data-testid="workers"] tr[data-worker="{worker.worker_id}"]')
        await expect(w.locator('[data-col="status"]')).to_have_text(
            re.compile("ready|busy"), timeout=SECONDS
        )
        await expect(w.locator('[data-col="queues"]')).to_have_text("dash-a")
        await expect(w.locator('[data-col="heartbeat"]')).to_have_text(re.compile(r"\d+ s ago"))
        bars = ui.page.locator('[data-testid="throughput-chart"] rect.bar-ok')
        await expect(bars).to_have_count(1, timeout=SECONDS)
        await expect(ui.page.get_by_test_id("card-throughput")).to_contain_text("1 ok")
    assert await ui.not_reloaded()


async def test_dashboard_responses_carry_a_strict_csp(server: ApiServer) -> None:
    async with httpx.AsyncClient(base_url=server.url) as http:
        moved = await http.get("/dashboard")
        assert moved.status_code == 307
        assert moved.headers["location"] == "dashboard/"
        for path in ("/dashboard/", "/dashboard/static/app.js", "/dashboard/config.json"):
            resp = await http.get(path)
            assert resp.status_code == 200, path
            csp = resp.headers["content-security-policy"]
            assert "script-src 'self'" in csp and "'unsafe-inline'" not in csp
            assert "require-trusted-types-for 'script'" in csp
            assert resp.headers["x-content-type-options"] == "nosniff"
        page = await http.get("/dashboard/")
        assert "<script>" not in page.text  # no inline script: every script is a file
        assert re.search(r'<script type="module" src="static/app\.js"></script>', page.text)
        etag = page.headers["etag"]
        again = await http.get("/dashboard/", headers={"If-None-Match": etag})
        assert again.status_code == 304
        config = (await http.get("/dashboard/config.json")).json()
        assert config["auth_required"] is True and config["ws_path"] == "/ws/events"
        missing = await http.get("/dashboard/static/nope.js")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "NOT_FOUND"
        schema = (await http.get("/openapi.json")).json()
        assert not [p for p in schema["paths"] if p.startswith("/dashboard")]


# -- tasks ----------------------------------------------------------------------------------------


async def test_task_moves_to_succeeded_on_screen_without_reload(
    ui: Watched, server: ApiServer, queue: Queue, dash_settings: Settings
) -> None:
    async with running_worker(dash_settings, queues=("dash-t",)):
        # Due in 5 s: long enough for a page to open on a busy machine (parallel tests) while
        # the task still waits, so the page sees it pending and then, without reload, done.
        task = await queue.submit(
            "api_echo", {"hello": "world"}, queue="dash-t", delay_seconds=5, ttl_seconds=300
        )
        await open_dashboard(ui, server, f"#/task/{task.task_id}")
        status = ui.page.get_by_test_id("task-status")
        await expect(status).to_have_text("pending")
        await expect(ui.page.get_by_test_id("task-deadline")).to_contain_text("expires in 4 min")
        await expect(status).to_have_text("succeeded", timeout=SECONDS)
        await expect(ui.page.get_by_test_id("task-result")).to_contain_text('"hello": "world"')
        await expect(ui.page.get_by_test_id("task-deadline")).to_contain_text(
            "finished before its deadline"
        )
        history = ui.page.get_by_test_id("task-history")
        await expect(history.locator("li.tl-succeeded")).to_have_count(1)
        await expect(history.locator("li.tl-running")).to_have_count(1)
        await expect(history.get_by_test_id("timeline-deadline")).to_have_count(1)
        fields = ui.page.get_by_test_id("task-fields")
        for name in ("task_id", "worker_id", "duration_ms", "expires_at", "finished_at"):
            await expect(fields.locator(f'tr[data-field="{name}"]')).to_have_count(1)

        # The list, filtered by queue, shows a new task and its end without reload too.
        await ui.page.goto(f"{server.url}/dashboard/#/tasks?queue=dash-t")
        second = await queue.submit("api_echo", {}, queue="dash-t", delay_seconds=3)
        line = ui.page.locator(f'[data-testid="tasks"] tr[data-task="{second.task_id}"]')
        await expect(line.locator('[data-col="status"]')).to_have_text("pending", timeout=SECONDS)
        await expect(line.locator('[data-col="status"]')).to_have_text("succeeded", timeout=SECONDS)
    assert await ui.not_reloaded()


async def test_task_page_shows_progress_live(
    ui: Watched, server: ApiServer, queue: Queue, dash_settings: Settings
) -> None:
    """The TASK_PROGRESS events move the bar on screen, without a read of the task; the last
    progress stays once the task has succeeded."""
    step = asyncio.Event()
    done = asyncio.Event()

    async def steps(payload: dict[str, Any], ctx: TaskContext) -> str:
        ctx.progress(0.3, {"file": "<b>a.csv</b>"})
        await step.wait()
        ctx.progress(0.8, {"file": "b.csv"})
        await done.wait()
        return "ok"

    async with running_worker(dash_settings, handlers(dash_steps=steps), queues=("dash-p",)):
        task = await queue.submit("dash_steps", {}, queue="dash-p")
        await open_dashboard(ui, server, f"#/task/{task.task_id}")
        percent = ui.page.get_by_test_id("task-progress-percent")
        await expect(percent).to_have_text("30%", timeout=SECONDS)
        await expect(ui.page.get_by_test_id("task-progress-data")).to_contain_text(
            '"file": "<b>a.csv</b>"'
        )
        own = f"/api/v1/tasks/{task.task_id}"
        reads = len([q for q in ui.requests if q.url.endswith(own)])
        step.set()
        await expect(percent).to_have_text("80%", timeout=SECONDS)
        await expect(ui.page.get_by_test_id("task-progress-bar")).to_have_attribute("value", "0.8")
        assert len([q for q in ui.requests if q.url.endswith(own)]) == reads, "not read again"
        done.set()
        await expect(ui.page.get_by_test_id("task-status")).to_have_text(
            "succeeded", timeout=SECONDS
        )
        await expect(percent).to_have_text("80%")
        fields = ui.page.get_by_test_id("task-fields")
        await expect(fields.locator('tr[data-field="progress"]')).to_have_count(0)
    assert await ui.not_reloaded()


async def test_task_page_shows_expiry(ui: Watched, server: ApiServer, queue: Queue) -> None:
    expired = await queue.submit("api_echo", {}, queue="dash-x", ttl_seconds=0)
    await open_dashboard(ui, server, f"#/task/{expired.task_id}")
    await expect(ui.page.get_by_test_id("task-status")).to_have_text("expired")
    await expect(ui.page.get_by_test_id("task-deadline")).to_contain_text("expired at 20")
    await expect(ui.page.get_by_test_id("task-history").locator("li.tl-expired")).to_have_count(1)

    waiting = await queue.submit("api_echo", {}, queue="dash-x", delay_seconds=600, ttl_seconds=90)
    await ui.page.goto(f"{server.url}/dashboard/#/task/{waiting.task_id}")
    deadline = ui.page.get_by_test_id("task-deadline")
    await expect(deadline).to_contain_text(re.compile(r"expires in 1 min \d+ s"))
    first = await deadline.text_content()
    await expect(deadline).not_to_have_text(first or "", timeout=SECONDS)  # it counts down
    marker = ui.page.get_by_test_id("timeline-deadline")
    await expect(marker).to_contain_text("expires in")


# -- actions --------------------------------------------------------------------------------------


async def test_cancel_through_the_ui_cancels(
    ui: Watched, server: ApiServer, queue: Queue, r: Redis, dash_settings: Settings
) -> None:
    delayed = await queue.submit("api_echo", {}, queue="dash-c", delay_seconds=600)
    await open_dashboard(ui, server, f"#/task/{delayed.task_id}")
    await expect(ui.page.get_by_test_id("task-status")).to_have_text("pending")
    await ui.page.get_by_test_id("action-cancel").click()
    dialog = ui.page.locator("dialog#confirm")
    await expect(dialog).to_be_visible()
    await expect(dialog).to_contain_text("Cancel task")
    key_input = dialog.locator("#confirm-key-input")
    await expect(key_input).to_be_visible()  # auth is on and this tab has no key yet
    await key_input.fill(API_KEY)
    await dialog.locator("#confirm-ok").click()
    await expect(ui.page.get_by_test_id("task-status")).to_have_text("cancelled", timeout=SECONDS)
    assert await r.hget(keys.task(delayed.task_id), "status") == "cancelled"
    stored = await ui.page.evaluate("() => sessionStorage.getItem('dtq.apiKey')")
    assert stored == API_KEY

    # A running task: 409 TASK_RUNNING means requested; the worker stops it, the page shows it.
    async with running_worker(dash_settings, queues=("dash-c",)):
        slow = await queue.submit("api_sleep", {"s": 30}, queue="dash-c")
        await ui.page.goto(f"{server.url}/dashboard/#/task/{slow.task_id}")
        await expect(ui.page.get_by_test_id("task-status")).to_have_text("running", timeout=SECONDS)
        await ui.page.get_by_test_id("action-cancel").click()
        await expect(key_input).to_be_hidden()  # entered once: kept for this tab
        await dialog.locator("#confirm-ok").click()
        await expect(ui.page.locator(".toast")).to_contain_text(["Cancellation requested"])
        await expect(ui.page.get_by_test_id("task-status")).to_have_text(
            "cancelled", timeout=SECONDS
        )
        assert await r.hget(keys.task(slow.task_id), "status") == "cancelled"

    posts = [q for q in ui.requests if q.method == "POST"]
    assert len(posts) == 2
    for post in posts:
        assert (await post.all_headers()).get("x-api-key") == API_KEY, post.url
    assert not [q.url for q in ui.requests if API_KEY in q.url], "the key is never in a URL"
    assert API_KEY not in ui.page.url


async def test_queue_and_dead_letter_actions(
    ui: Watched, server: ApiServer, queue: Queue, r: Redis, dash_settings: Settings
) -> None:
    ids = []
    async with running_worker(dash_settings, queues=("dash-d",)):
        for n in range(3):
            ids.append((await queue.submit("api_fail", {"n": n}, queue="dash-d")).task_id)

        async def all_dead() -> bool:
            return await r.xlen(keys.DEAD_LETTER) == 3

        await wait_until(all_dead, 10, "three dead letters")
    await open_dashboard(ui, server, "#/dlq")
    table = ui.page.get_by_test_id("dlq")
    await expect(table.locator("tr[data-task]")).to_have_count(3)
    dialog = ui.page.locator("dialog#confirm")

    # A wrong key is refused: nothing changes, the key is forgotten, the next action asks again.
    await ui.page.get_by_test_id(f"requeue-{ids[0]}").click()
    await dialog.locator("#confirm-key-input").fill("not-the-key")
    await dialog.locator("#confirm-ok").click()
    await expect(ui.page.locator(".toast-error")).to_contain_text("FORBIDDEN")
    assert await r.hget(keys.task(ids[0]), "status") == "dead_lettered"

    await ui.page.get_by_test_id(f"requeue-{ids[0]}").click()
    await dialog.locator("#confirm-key-input").fill(API_KEY)
    await dialog.locator("#confirm-ok").click()
    await expect(table.locator("tr[data-task]")).to_have_count(2, timeout=SECONDS)
    assert await r.hget(keys.task(ids[0]), "status") == "queued"

    await ui.page.get_by_test_id(f"discard-{ids[1]}").click()
    await dialog.locator("#confirm-ok").click()
    await expect(table.locator("tr[data-task]")).to_have_count(1, timeout=SECONDS)
    metadata = json.loads(await r.hget(keys.task(ids[1]), "metadata") or "{}")
    assert metadata.get("discarded") is True

    # Declining a confirmation does nothing.
    await ui.page.get_by_test_id("dlq-purge").click()
    await dialog.locator("#confirm-cancel").click()
    await expect(dialog).to_be_hidden()
    assert await r.xlen(keys.DEAD_LETTER) == 1
    await ui.page.get_by_test_id("dlq-purge").click()
    await dialog.locator("#confirm-ok").click()
    await expect(table).to_contain_text("The dead-letter queue is empty", timeout=SECONDS)
    assert await r.xlen(keys.DEAD_LETTER) == 0

    # Pause and resume a queue from the overview.
    await ui.page.locator('.nav a[data-view="overview"]').click()
    toggle = ui.page.get_by_test_id("toggle-dash-d")
    await expect(toggle).to_have_text("Pause", timeout=SECONDS)
    await toggle.click()
    await dialog.locator("#confirm-ok").click()
    state = ui.page.locator('[data-testid="queues"] tr[data-queue="dash-d"] [data-col="state"]')
    await expect(state).to_have_text("paused", timeout=SECONDS)
    assert await r.exists(keys.queue_paused("dash-d"))
    await expect(toggle).to_have_text("Resume")
    await toggle.click()
    await dialog.locator("#confirm-ok").click()
    await expect(state).to_have_text("active", timeout=SECONDS)
    assert not await r.exists(keys.queue_paused("dash-d"))
    assert await ui.not_reloaded()


# -- schedules ------------------------------------------------------------------------------------


async def test_schedules_page_lists_pauses_and_triggers(
    ui: Watched, server: ApiServer, queue: Queue, r: Redis
) -> None:
    await queue.put_schedule(
        "dash-nightly", cron="0 7 * * *", tz="Europe/Paris", task_type="api_echo", payload={"n": 1}
    )
    await queue.put_schedule("dash-hourly", every="1h", task_type="api_echo", queue="dash-h")
    await open_dashboard(ui, server, "#/schedules")
    row = ui.page.locator('[data-testid="schedules"] tr[data-schedule="dash-nightly"]')
    await expect(row.locator('[data-col="spec"]')).to_have_text("0 7 * * * (Europe/Paris)")
    await expect(row.locator('[data-col="target"]')).to_have_text("default / api_echo")
    await expect(row.locator('[data-col="state"]')).to_have_text("active")
    await expect(row.locator('[data-col="next"]')).to_contain_text(re.compile(r"· in \d+"))
    await expect(row.locator('[data-col="fired"]')).to_have_text("0")
    hourly = ui.page.locator('[data-testid="schedules"] tr[data-schedule="dash-hourly"]')
    await expect(hourly.locator('[data-col="spec"]')).to_have_text("every 1 h")

    # Pause, with the API key entered once in the confirmation.
    toggle = ui.page.get_by_test_id("schedule-toggle-dash-nightly")
    await expect(toggle).to_have_text("Pause")
    await toggle.click()
    dialog = ui.page.locator("dialog#confirm")
    await expect(dialog).to_contain_text("Pause schedule dash-nightly?")
    await dialog.locator("#confirm-key-input").fill(API_KEY)
    await dialog.locator("#confirm-ok").click()
    await expect(row.locator('[data-col="state"]')).to_have_text("paused", timeout=SECONDS)
    await expect(toggle).to_have_text("Resume")
    assert await r.hget(keys.schedule("dash-nightly", "default"), "paused") == "1"

    # Trigger: a task of the template now, even while paused; the row links to it.
    await ui.page.get_by_test_id("schedule-trigger-dash-nightly").click()
    await dialog.locator("#confirm-ok").click()
    await expect(ui.page.locator(".toast-ok")).to_contain_text(["triggered: task"])
    await expect(row.locator('[data-col="fired"]')).to_have_text("1", timeout=SECONDS)
    task_id = await r.hget(keys.schedule("dash-nightly", "default"), "last_task_id")
    assert task_id
    task = await queue.get(task_id)
    assert task.metadata["schedule"] == "dash-nightly" and task.metadata["trigger"] == "manual"
    await expect(row.locator('[data-col="task"] a')).to_have_text(task_id[:8])

    # Live: a resume made elsewhere shows without reload, from its CONFIGURATION_CHANGED
    # event: well before the view's 30-second safety poll.
    await queue.resume_schedule("dash-nightly")
    await expect(row.locator('[data-col="state"]')).to_have_text("active", timeout=5_000)

    # The schedule's page: its history, next fire times, and the same actions.
    await row.locator("td").first.locator("a").click()
    await expect(ui.page.get_by_test_id("schedule-state")).to_have_text("active")
    history = ui.page.get_by_test_id("schedule-history")
    for decision in ("created", "paused", "triggered", "resumed"):
        await expect(history.locator(f'tr[data-decision="{decision}"]')).to_have_count(1)
    await expect(history.locator('tr[data-decision="triggered"] a')).to_have_text(task_id[:8])
    await expect(ui.page.get_by_test_id("schedule-next").locator("li")).to_have_count(10)
    await ui.page.get_by_test_id("schedule-toggle").click()
    await dialog.locator("#confirm-ok").click()
    await expect(ui.page.get_by_test_id("schedule-state")).to_have_text("paused", timeout=SECONDS)
    assert await r.hget(keys.schedule("dash-nightly", "default"), "paused") == "1"
    posts = [q for q in ui.requests if q.method == "POST"]
    assert len(posts) == 3
    for post in posts:
        assert (await post.all_headers()).get("x-api-key") == API_KEY, post.url
    assert await ui.not_reloaded()


# -- limits ---------------------------------------------------------------------------------------


async def test_limits_page_shows_each_limit_and_its_use_live(
    ui: Watched, server: ApiServer, queue: Queue, dash_settings: Settings
) -> None:
    await queue.put_limit("dash-two", queue="dash-l", task_type="dash_hold", concurrency=2)
    await queue.put_limit(
        "dash-tenants", queue="dash-l", key="payload.tenant", rate="5/s", burst=10
    )
    await open_dashboard(ui, server, "#/limits")
    two = ui.page.locator('[data-testid="limits"] tr[data-limit="dash-two"]')
    await expect(two.locator('[data-col="target"]')).to_have_text("dash-l / dash_hold")
    await expect(two.locator('[data-col="concurrency"]')).to_have_text("2")
    await expect(two.locator('[data-col="rate"]')).to_have_text("—")
    await expect(two.locator('[data-col="running"]')).to_have_text("0")
    tenants = ui.page.locator('[data-testid="limits"] tr[data-limit="dash-tenants"]')
    await expect(tenants.locator('[data-col="target"]')).to_have_text("dash-l / every type")
    await expect(tenants.locator('[data-col="key"]')).to_have_text("payload.tenant")
    await expect(tenants.locator('[data-col="rate"]')).to_have_text("5/s, burst 10")

    # Live, without reload (the view polls every 2 s): two tasks hold the places, three wait.
    release = asyncio.Event()

    async def hold(payload: dict[str, Any], ctx: TaskContext) -> None:
        await release.wait()

    async with running_worker(
        dash_settings, handlers(dash_hold=hold), queues=("dash-l",), concurrency=8
    ):
        ids = [(await queue.submit("dash_hold", {}, queue="dash-l")).task_id for _ in range(5)]
        await expect(two.locator('[data-col="running"]')).to_have_text("2", timeout=SECONDS)
        await expect(two.locator('[data-col="waiting"]')).to_have_text("3", timeout=SECONDS)
        release.set()
        await queue.wait_many(ids, timeout=60)
        await expect(two.locator('[data-col="running"]')).to_have_text("0", timeout=SECONDS)
        await expect(two.locator('[data-col="waiting"]')).to_have_text("0")

    # A limit removed elsewhere leaves the list by itself.
    await queue.delete_limit("dash-tenants")
    await expect(tenants).to_have_count(0, timeout=SECONDS)
    await expect(two).to_have_count(1)
    assert await ui.not_reloaded()


# -- safety ---------------------------------------------------------------------------------------

XSS_PAYLOAD = {
    "html": "<script>alert('payload')</script>",
    "why": "<img src=x onerror=alert('error')>",
}


async def test_html_in_task_values_renders_as_text(
    ui: Watched, server: ApiServer, queue: Queue, r: Redis, dash_settings: Settings
) -> None:
    async with running_worker(dash_settings, queues=("dash-s",)):
        task = await queue.submit(
            "api_fail", XSS_PAYLOAD, queue="dash-s", metadata={"note": "<b onmouseover=alert(3)>"}
        )
        await open_dashboard(ui, server, f"#/task/{task.task_id}")
        await expect(ui.page.get_by_test_id("task-status")).to_have_text(
            re.compile("failed|dead lettered"), timeout=SECONDS
        )
    payload = ui.page.get_by_test_id("task-payload")
    await expect(payload).to_contain_text("<script>alert('payload')</script>")
    error = ui.page.get_by_test_id("task-error-message")
    await expect(error).to_contain_text("<img src=x onerror=alert('error')>")
    await expect(ui.page.get_by_test_id("task-metadata")).to_contain_text("<b onmouseover")
    # Nothing from the task became markup: no image, no bold, one script (the dashboard's).
    assert await ui.page.locator("img").count() == 0
    assert await ui.page.locator("main b").count() == 0
    assert await ui.page.locator("script").count() == 1
    # The dead-letter list shows the error as text too.
    await ui.page.goto(f"{server.url}/dashboard/#/dlq")
    await expect(ui.page.get_by_test_id("dlq")).to_contain_text("onerror=alert('error')")
    assert await ui.page.locator("img").count() == 0
    # The page's CSP makes HTML injection impossible even by mistake (Trusted Types).
    outcome = await ui.page.evaluate(
        "() => { try { document.body.innerHTML = '<b>x</b>'; return 'assigned'; }"
        " catch (e) { return e.name; } }"
    )
    assert outcome == "TypeError"
    refused = [m for m in ui.console_errors if "requires 'TrustedHTML'" in m]
    assert len(refused) == 1
    ui.console_errors.remove(refused[0])  # the refusal this test caused on purpose
    await ui.page.wait_for_timeout(300)  # a late onerror/alert would show up as a dialog
    assert ui.dialogs == []


# -- live connection ------------------------------------------------------------------------------


async def test_live_updates_reconnect_by_themselves_after_an_api_restart(
    chrome: Browser, queue: Queue, dash_settings: Settings
) -> None:
    async with api_server(dash_settings) as first, watched_page(chrome) as ui:
        await open_dashboard(ui, first, "#/tasks")
        live = ui.page.get_by_test_id("live")
        await asyncio.to_thread(first.stop)
        await expect(live).to_have_text(re.compile(r"offline: .*; retry in \d+ s"), timeout=SECONDS)
        async with api_server(dash_settings, port=first.port):
            await expect(live).to_have_text("live", timeout=20_000)
            task = await queue.submit("api_echo", {}, queue="dash-r")
            line = ui.page.locator(f'[data-testid="tasks"] tr[data-task="{task.task_id}"]')
            await expect(line).to_have_count(1, timeout=SECONDS)
        assert await ui.not_reloaded()
        # While the API was down the browser logged refused connections; nothing else.
        assert all("WebSocket" in p or "ERR_CONNECTION" in p for p in ui.problems())


# -- the screenshot of the docs -------------------------------------------------------------------

SCREENSHOT = os.environ.get("DTQ_DASHBOARD_SCREENSHOT")
WORKLOAD_S = float(os.environ.get("DTQ_DASHBOARD_SCREENSHOT_S", "75")) if SCREENSHOT else 3.0


@pytest.mark.timeout(120 + WORKLOAD_S, func_only=True)
async def test_overview_under_a_live_workload(
    chrome: Browser, server: ApiServer, queue: Queue, dash_settings: Settings, tmp_path: Path
) -> None:
    async with (
        watched_page(chrome, width=1280, height=860) as ui,
        running_worker(dash_settings, queues=("default", "emails", "reports")),
    ):
        await open_dashboard(ui, server)
        submitted = await workload(queue, WORKLOAD_S)
        assert submitted > 0
        await expect(ui.page.locator('[data-testid="queues"] tr[data-queue]')).to_have_count(3)
        bars = ui.page.locator('[data-testid="throughput-chart"] rect.bar-ok')
        await expect(bars.first).to_be_visible(timeout=SECONDS)
        await expect(ui.page.locator('[data-testid="workers"] tr[data-worker]')).to_have_count(1)
        path = Path(SCREENSHOT) if SCREENSHOT else tmp_path / "dashboard.png"
        await ui.page.screenshot(path=str(path), full_page=True)
        assert path.stat().st_size > 10_000
        assert not ui.problems(), ui.problems()


# -- workflows ------------------------------------------------------------------------------------


async def test_workflow_page_draws_the_dag_and_follows_it_live(
    ui: Watched, server: ApiServer, queue: Queue, r: Redis, dash_settings: Settings
) -> None:
    from dtq.workflows import chain, group, node

    shape = chain(
        node("fetch", "api_echo", {"x": 1}, queue="dash-w"),
        group(node("left", "api_echo", queue="dash-w"), node("right", "api_echo", queue="dash-w")),
        node("report", "api_echo", queue="dash-w"),
        policy="continue",
    )
    wf = await queue.submit_workflow(shape)
    await open_dashboard(ui, server, f"#/workflow/{wf.workflow_id}")
    graph = ui.page.get_by_test_id("workflow-graph")
    await expect(graph.locator("a.wf-node")).to_have_count(4)
    await expect(graph.locator('[data-node="fetch"]')).to_have_attribute("data-status", "queued")
    await expect(graph.locator('[data-node="report"]')).to_have_attribute("data-status", "waiting")
    # Columns by depth: fetch, then left and right side by side, then report.
    xs = {}
    for name in ("fetch", "left", "right", "report"):
        xs[name] = await graph.locator(f'[data-node="{name}"] rect').get_attribute("x")
    assert float(xs["fetch"]) < float(xs["left"]) == float(xs["right"]) < float(xs["report"])
    # Every edge of the chain is "continue", and says so; four edges in all.
    await expect(graph.locator("g.wf-edge")).to_have_count(4)
    await expect(graph.locator(".wf-edge-label")).to_have_text(["continue"] * 4)

    async with running_worker(dash_settings, queues=("dash-w",)):
        await expect(ui.page.get_by_test_id("workflow-status")).to_have_text(
            "succeeded", timeout=SECONDS
        )
        await expect(graph.locator('a.wf-node[data-status="succeeded"]')).to_have_count(4)
    assert await ui.not_reloaded()

    # A node links to its task's page.
    await graph.locator('[data-node="fetch"]').click()
    fetch_id = next(n.task_id for n in wf.nodes if n.name == "fetch")
    await expect(ui.page.get_by_test_id("task-status")).to_have_text("succeeded")
    assert ui.page.url.endswith(f"#/task/{fetch_id}")

    # Cancel through the page: nothing serves this queue, so every node is cancelled at once.
    idle = await queue.submit_workflow(
        chain(
            node("a", "api_echo", queue="dash-w-idle"), node("b", "api_echo", queue="dash-w-idle")
        )
    )
    await ui.page.goto(f"{server.url}/dashboard/#/workflow/{idle.workflow_id}")
    await ui.page.get_by_test_id("workflow-cancel").click()
    dialog = ui.page.locator("dialog#confirm")
    await dialog.locator("#confirm-key-input").fill(API_KEY)
    await dialog.locator("#confirm-ok").click()
    await expect(ui.page.get_by_test_id("workflow-status")).to_have_text(
        "cancelled", timeout=SECONDS
    )
    a_id = next(n.task_id for n in idle.nodes if n.name == "a")
    assert await r.hget(keys.task(a_id), "status") == "cancelled"
