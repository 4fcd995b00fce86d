"""Typed task handles (docs/sdk.md, "Typed task handles"): a ``@task`` definition submits
itself with its payload and options checked, and its handle's ``result()`` gives the handler's
return value as the handler's return type, from a real worker on a real Redis."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from redis.asyncio import Redis

from dtq import Queue, SyncQueue, keys
from dtq.config import Settings
from dtq.errors import IdempotencyInProgressError, InvalidTaskError, TaskFailed
from dtq_tasks import (
    AsyncTaskDef,
    Handler,
    PermanentError,
    SyncTaskDef,
    TaskContext,
    TaskHandle,
    get_handler,
    registry,
    task,
)
from support import running_worker
from support.worker import fast


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


@task("tt_refuse")
async def tt_refuse(payload: dict[str, Any], ctx: TaskContext) -> int:
    raise PermanentError("refused on purpose")


def _workers(settings: Settings) -> Any:
    """An in-process worker running this module's handlers."""
    names = ("tt_resize", "tt_pair", "tt_refuse")
    return running_worker(fast(settings), {n: registry()[n] for n in names})


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


# -- waiting for the typed result ---------------------------------------------------------------


async def test_result_has_the_handlers_return_type(settings: Settings, queue: Queue) -> None:
    thumb_h = await tt_resize.submit(queue, Resize(url="u", width=5))
    pair_h = await tt_pair.submit(queue, {"a": 1, "b": 2})
    refused = await tt_refuse.submit(queue, {}, max_attempts=1)
    async with _workers(settings):
        thumb = await thumb_h.result(timeout=10)
        assert isinstance(thumb, Thumb) and thumb == Thumb(url="u#5", width=5)
        assert await pair_h.result(timeout=10) == (1, 2)  # a tuple, as annotated
        done = await thumb_h.wait(timeout=5)
        assert done.task_id == thumb_h.task_id and done.status == "succeeded"
        # The worker stored the returned model as its JSON.
        assert done.result == {"url": "u#5", "width": 5}
        with pytest.raises(TaskFailed) as caught:
            await refused.result(timeout=10)
        assert caught.value.error_message == "refused on purpose"


async def test_a_sync_handle_blocks_until_the_result(settings: Settings) -> None:
    def produce() -> tuple[int, int]:
        with SyncQueue(settings=settings) as sq:
            handle = tt_pair.submit_sync(sq, {"a": 3, "b": 4})
            assert handle.wait(timeout=10).status == "succeeded"
            return handle.result(timeout=10)

    async with _workers(settings):
        assert await asyncio.to_thread(produce) == (3, 4)


# -- how a stored result becomes the return type -------------------------------------------------


def test_result_of_follows_the_return_annotation() -> None:
    assert tt_resize.result_of({"url": "u", "width": 1}) == Thumb(url="u", width=1)
    assert tt_pair.result_of([1, 2]) == (1, 2)
    with pytest.raises(ValidationError):
        tt_resize.result_of({"url": "u"})

    def untyped(payload: dict[str, Any], ctx: TaskContext):  # type: ignore[no-untyped-def]
        return [1]

    def anything(payload: dict[str, Any], ctx: TaskContext) -> Any:
        return [1]

    def unresolvable(payload: dict[str, Any], ctx: TaskContext) -> NotImportedHere:  # type: ignore[name-defined]  # noqa: F821
        return [1]

    for fn in (untyped, anything, unresolvable):
        defn = SyncTaskDef[Any, Any, Any]("tt_plain", fn, None)
        value = {"kept": ["as", "json"]}
        assert defn.result_of(value) is value
