"""Typed task handles (README.md, "Typed task handles"): a ``@task`` definition submits
itself with its payload and options checked, and its handle's ``result()`` gives the handler's
return value as the handler's return type, from a real worker on a real Redis."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field
from redis.asyncio import Redis

from dtq import Queue, SyncQueue, keys
from dtq.config import Settings
from dtq.errors import IdempotencyInProgressError, InvalidTaskError
from dtq_tasks import (
    AsyncTaskDef,
    Handler,
    SyncTaskDef,
    TaskContext,
    TaskHandle,
    get_handler,
    task,
)


class Resize(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str
    width: int = Field(ge=1, le=4096)
    label: str = Field(default="thumb", alias="Label")


class Thumb(BaseModel):
    url: str
    width: int


@task("tt_resize", payload_model=Resize)
async def tt_resize(payload: dict[str, Any], ctx: TaskContext) -> Thumb:
    return Thumb(url=f"{payload['url']}#{payload['width']}", width=payload["width"])


@task("tt_pair")
def tt_pair(payload: dict[str, Any], ctx: TaskContext) -> tuple[int, int]:
    return payload["a"], payload["b"]


async def _stored_payload(r: Redis, task_id: str) -> Any:
    return json.loads(await r.hget(keys.task(task_id), "payload") or "null")


# -- submit -------------------------------------------------------------------------------------


async def test_a_definition_is_still_the_handler() -> None:
    assert isinstance(tt_resize, AsyncTaskDef) and isinstance(tt_pair, SyncTaskDef)
    ctx: Any = None
    assert await tt_resize({"url": "u", "width": 3}, ctx) == Thumb(url="u#3", width=3)
    assert tt_pair({"a": 1, "b": 2}, ctx) == (1, 2)
    assert tt_resize.__name__ == "tt_resize" and tt_resize.__wrapped__ is tt_resize.fn
    # The worker runs the function: what is registered, and a Handler built from a definition.
    assert get_handler("tt_resize") == Handler("tt_resize", tt_resize.fn, Resize)
    built = Handler("x", tt_resize)
    assert built.fn is tt_resize.fn and built.is_async
    # A definition registered again (a module reloaded) registers its function.
    assert task("tt_pair")(tt_pair).fn is tt_pair.fn


async def test_submit_a_model_instance_with_options(queue: Queue, r: Redis) -> None:
    handle = await tt_resize.submit(
        queue, Resize(url="https://x/a.png", width=64), queue="tt-images", priority=7
    )
    assert isinstance(handle, TaskHandle) and handle.task_id == handle.task.task_id
    got = await queue.get(handle.task_id)
    assert (got.task_type, got.queue, got.priority) == ("tt_resize", "tt-images", 7)
    # The model's JSON, by alias: what the worker's validation of the payload accepts.
    assert await _stored_payload(r, handle.task_id) == {
        "url": "https://x/a.png",
        "width": 64,
        "Label": "thumb",
    }


async def test_submit_fields_is_checked_by_the_model(queue: Queue, r: Redis) -> None:
    handle = await tt_resize.submit_fields(queue, {"url": "u", "width": "8"})
    assert await _stored_payload(r, handle.task_id) == {"url": "u", "width": 8, "Label": "thumb"}
    with pytest.raises(InvalidTaskError, match=r"payload\.width") as caught:
        await tt_resize.submit_fields(queue, {"url": "u", "width": 0})
    assert caught.value.code == "INVALID_TASK"
    assert [e["field"] for e in caught.value.details["errors"]] == ["payload.width"]
    with pytest.raises(InvalidTaskError, match=r"payload\.url"):
        await tt_resize.submit(queue)  # no payload: the model's fields, none given
    assert len(await queue.list(task_type="tt_resize")) == 1


async def test_wrong_payload_and_options_are_refused_as_queue_submit_refuses_them(
    queue: Queue,
) -> None:
    with pytest.raises(InvalidTaskError, match="takes a Resize payload, not dict"):
        await tt_resize.submit(queue, {"url": "u", "width": 1})  # type: ignore[arg-type]
    with pytest.raises(InvalidTaskError, match="unknown submit option"):
        await tt_pair.submit(queue, {"a": 1, "b": 2}, prio=3)  # type: ignore[call-arg]
    with pytest.raises(InvalidTaskError, match="priority"):
        await tt_pair.submit(queue, {"a": 1, "b": 2}, priority=12)
    with pytest.raises(InvalidTaskError, match="payload"):
        await tt_pair.submit(queue, [1, 2])  # type: ignore[arg-type]
    assert await queue.list(task_type="tt_resize") == []
    assert await queue.list(task_type="tt_pair") == []


def test_submit_through_a_sync_queue(settings: Settings) -> None:
    with SyncQueue(settings=settings) as sq:
        handle = tt_resize.submit_sync(sq, Resize(url="u", width=2), idempotency_key="tt-1")
        assert sq.get(handle.task_id).task_type == "tt_resize"
        # The options go through SyncQueue.submit: a replay of the key names the first task.
        with pytest.raises(IdempotencyInProgressError) as caught:
            tt_resize.submit_fields_sync(sq, {"url": "u", "width": 2}, idempotency_key="tt-1")
        assert caught.value.details["task_id"] == handle.task_id
