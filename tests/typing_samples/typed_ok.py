"""Typed task handles used as documented: mypy --strict accepts every line, and each
``assert_type`` pins what the API gives back (tests/unit/test_typed_handles_mypy.py)."""

from __future__ import annotations

from typing import Any, assert_type

from pydantic import BaseModel

from dtq import Queue, SyncQueue, Task
from dtq_tasks import AsyncTaskDef, SyncTaskHandle, TaskContext, TaskDef, TaskHandle, task


class Resize(BaseModel):
    url: str
    width: int


class Thumb(BaseModel):
    url: str
    width: int


@task("sample_resize", payload_model=Resize)
async def resize(payload: dict[str, Any], ctx: TaskContext) -> Thumb:
    return Thumb(url=payload["url"], width=payload["width"])


@task("sample_add")
def add(payload: dict, ctx: TaskContext) -> int:  # type: ignore[type-arg]  # the contract's form
    return int(payload["a"]) + int(payload["b"])


async def produce(q: Queue, ctx: TaskContext) -> None:
    handle = await resize.submit(q, Resize(url="https://example.com/a.png", width=64), priority=7)
    assert_type(handle, TaskHandle[Thumb])
    assert_type(handle.task_id, str)
    assert_type(handle.task, Task)
    assert_type(await handle.wait(timeout=5), Task)
    thumb = await handle.result(timeout=5)
    assert_type(thumb, Thumb)
    print(thumb.width + 1)

    by_fields = await resize.submit_fields(q, {"url": "u", "width": 8}, queue="images")
    assert_type(by_fields, TaskHandle[Thumb])

    sums = await add.submit(q, {"a": 1, "b": 2}, idempotency_key="k", ttl_seconds=60)
    assert_type(await sums.result(), int)

    # Still the handler: a test can call it directly.
    assert_type(await resize({"url": "u", "width": 1}, ctx), Thumb)
    assert_type(add({"a": 1, "b": 2}, ctx), int)
    as_async: AsyncTaskDef[Resize, Thumb, [dict[str, Any], TaskContext]] = resize
    as_base: TaskDef[Resize, Thumb] = as_async
    assert as_base.name == "sample_resize"


def produce_sync(sq: SyncQueue) -> int:
    handle = add.submit_sync(sq, {"a": 1, "b": 2}, max_attempts=3)
    assert_type(handle, SyncTaskHandle[int])
    assert_type(handle.wait(timeout=5), Task)
    thumb = resize.submit_fields_sync(sq, {"url": "u", "width": 8}).result(timeout=5)
    return handle.result(timeout=5) + thumb.width
