"""Typed task handles misused: mypy must report exactly the errors marked ``# E: <code>``
on their lines, and nothing else (tests/unit/test_typed_handles_mypy.py)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from dtq import Queue, SyncQueue
from dtq_tasks import TaskContext, task


class Resize(BaseModel):
    url: str
    width: int


class Other(BaseModel):
    url: str


class Thumb(BaseModel):
    url: str


@task("sample_resize", payload_model=Resize)
async def resize(payload: dict[str, Any], ctx: TaskContext) -> Thumb:
    return Thumb(url=payload["url"])


@task("sample_add")
def add(payload: dict[str, Any], ctx: TaskContext) -> int:
    return 1


async def produce(q: Queue, ctx: TaskContext) -> None:
    await resize.submit(q, {"url": "u", "width": 1})  # E: arg-type
    await resize.submit(q, Other(url="u"))  # E: arg-type
    await add.submit(q, [1, 2])  # E: arg-type
    await add.submit(q, {}, prio=3)  # E: call-arg
    await add.submit(q, {}, priority="high")  # E: arg-type
    await resize.submit_fields(q, Resize(url="u", width=1))  # E: arg-type

    handle = await resize.submit(q, Resize(url="u", width=1))
    width: int = await handle.result()  # E: assignment
    thumb = await handle.result()
    print(thumb.width)  # E: attr-defined
    total: str = await (await add.submit(q, {})).result()  # E: assignment

    await add({"a": 1}, ctx)  # E: misc
    add("payload", ctx)  # E: arg-type
    print(width, total)


def produce_sync(sq: SyncQueue, q: Queue) -> None:
    add.submit_sync(q, {})  # E: arg-type
    name: str = add.submit_sync(sq, {}).result()  # E: assignment
    print(name)
