"""Tests of the thumbnail app as its authors would write them with ``dtq.testing``: the
handler, run by a real worker until its queue is drained, and the endpoint that waits for its
task, with a worker running and without one. Run them with ``pytest examples/fastapi_app``."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio

from dtq import Queue, Settings, TaskFailed, TaskStatus
from dtq.testing import drain, running_worker
from examples.fastapi_app.app import create_app
from examples.fastapi_app.tasks import QUEUE

pytestmark = pytest.mark.asyncio

TOM = {"image": "cats/tom.png", "width": 1024, "height": 768}


# -- the handler: submit, drain, look at what it did ------------------------------------------


async def test_a_thumbnail_keeps_the_aspect_ratio(dtq_queue: Queue) -> None:
    task = await dtq_queue.submit("make_thumbnail", TOM, queue=QUEUE)
    result = await drain(dtq_queue, queues=[QUEUE])
    assert result.counts == {"succeeded": 1}
    assert result.task(task.task_id).result == {
        "thumbnail": "thumbs/cats/tom_128x96.png",
        "width": 128,
        "height": 96,
    }


async def test_a_small_image_is_not_scaled_up(dtq_queue: Queue) -> None:
    task = await dtq_queue.submit(
        "make_thumbnail", {"image": "icon.webp", "width": 64, "height": 32}, queue=QUEUE
    )
    result = await drain(dtq_queue, queues=[QUEUE], raise_failures=True)
    assert result.task(task.task_id).result["width"] == 64


async def test_an_unsupported_format_fails_without_retries(dtq_queue: Queue) -> None:
    task = await dtq_queue.submit("make_thumbnail", {**TOM, "image": "cats/tom.gif"}, queue=QUEUE)
    result = await drain(dtq_queue, queues=[QUEUE])
    [failed] = result.failed
    assert failed.status is TaskStatus.DEAD_LETTERED
    assert failed.attempt == 1  # a permanent error: no retry
    assert failed.error_message == "unsupported image format: cats/tom.gif"
    # the producer's view of the same failure
    with pytest.raises(TaskFailed) as caught:
        await dtq_queue.result(task.task_id, timeout=1)
    assert caught.value.error_class == "PermanentError"


# -- the app: a request that waits for its task -----------------------------------------------


@pytest_asyncio.fixture
async def client(dtq_settings: Settings, dtq_queue: Queue) -> AsyncIterator[httpx.AsyncClient]:
    """The app with its lifespan running (connected to the test's Redis), and a client on it."""
    app = create_app(dtq_settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            yield c


async def test_post_returns_the_thumbnail_once_made(
    client: httpx.AsyncClient, dtq_queue: Queue
) -> None:
    async with running_worker(dtq_queue, queues=[QUEUE]):
        resp = await client.post("/thumbnails", json=TOM)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["thumbnail"] == "thumbs/cats/tom_128x96.png"
    assert (await dtq_queue.get(body["task_id"])).status is TaskStatus.SUCCEEDED


async def test_a_failed_thumbnail_is_a_502(client: httpx.AsyncClient, dtq_queue: Queue) -> None:
    async with running_worker(dtq_queue, queues=[QUEUE]):
        resp = await client.post("/thumbnails", json={**TOM, "image": "cats/tom.gif"})
    assert resp.status_code == 502, resp.text
    assert resp.json()["status"] == "dead_lettered"
    assert resp.json()["error_message"] == "unsupported image format: cats/tom.gif"


async def test_without_a_worker_the_request_gives_up_and_the_task_goes_on(
    client: httpx.AsyncClient, dtq_queue: Queue
) -> None:
    resp = await client.post("/thumbnails", params={"wait": 0.2}, json=TOM)
    assert resp.status_code == 504, resp.text
    assert resp.json()["status"] == "queued"
    await drain(dtq_queue, queues=[QUEUE])  # a worker comes up later
    later = await client.get(resp.headers["location"])
    assert later.json()["status"] == "succeeded"
    assert later.json()["result"]["thumbnail"] == "thumbs/cats/tom_128x96.png"


async def test_an_invalid_request_submits_nothing(
    client: httpx.AsyncClient, dtq_queue: Queue
) -> None:
    resp = await client.post("/thumbnails", json={"image": "cats/tom.png"})  # no size
    assert resp.status_code == 422
    assert await dtq_queue.list() == []
