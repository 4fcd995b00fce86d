"""The handler contract (contract section 15, ``dtq_tasks``): registration, the context a
handler sees, ``idempotent_operation``, and every demo task of ``examples/`` (section 14)
through a real worker."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from datetime import UTC, datetime
from typing import Any

import pytest
import redis as sync_redis
from pydantic import BaseModel
from redis.asyncio import Redis

from dtq import Queue, keys
from dtq.config import Settings
from dtq_tasks import (
    Handler,
    RescheduleError,
    RetryableError,
    TaskContext,
    TaskRegistrationError,
    get_handler,
    idempotent_operation,
    load_task_modules,
    registry,
    task,
)
from support import running_worker, wait_until
from support.worker import REPO, fast, handlers, wait_status

# -- registration -------------------------------------------------------------------------------


@task("th_registered")
async def th_registered(payload: dict[str, Any], ctx: TaskContext) -> int:
    return 1


def test_task_registers_the_function_and_returns_its_definition() -> None:
    assert registry()["th_registered"].fn is th_registered.fn
    assert th_registered.name == "th_registered" and th_registered.__name__ == "th_registered"
    handler = get_handler("th_registered")
    assert handler is not None and handler.is_async and handler.payload_model is None
    assert get_handler("th_nobody") is None
    with pytest.raises(TypeError):
        registry()["x"] = handler  # type: ignore[index]


def test_second_handler_under_a_taken_name_is_an_error() -> None:
    with pytest.raises(TaskRegistrationError, match="already registered"):

        @task("th_registered")
        async def other(payload: dict[str, Any], ctx: TaskContext) -> int:
            return 2

    assert registry()["th_registered"].fn is th_registered.fn


def test_reregistering_the_same_definition_is_allowed() -> None:
    """A module imported again (importlib.reload) registers its handlers again."""
    task("th_registered")(th_registered)
    assert registry()["th_registered"].fn is th_registered.fn


@pytest.mark.parametrize("name", ["", "has space", "x" * 200, "bad\n", "1starts_with_digit"])
def test_invalid_names_are_refused(name: str) -> None:
    with pytest.raises(TaskRegistrationError, match="invalid"):
        task(name)


def test_payload_model_must_be_a_pydantic_model() -> None:
    with pytest.raises(TaskRegistrationError, match="payload_model"):
        task("th_bad_model", payload_model=dict)  # type: ignore[arg-type]


def test_sync_and_callable_handlers() -> None:
    def sync_fn(payload: dict[str, Any], ctx: TaskContext) -> int:
        return 1

    class AsyncCallable:
        async def __call__(self, payload: dict[str, Any], ctx: TaskContext) -> int:
            return 1

    assert not Handler("a", sync_fn).is_async
    assert Handler("b", AsyncCallable()).is_async


def test_payload_model_validation() -> None:
    class P(BaseModel):
        n: int

    h = Handler("p", th_registered, P)
    assert h.validate({"n": "3"}) == {"n": 3}
    with pytest.raises(ValueError, match="validation error"):
        h.validate({"n": "x"})


def test_reschedule_error_arguments() -> None:
    e = RescheduleError(5, extend_expiration_seconds=60)
    assert (e.delay_seconds, e.extend_expiration_seconds) == (5.0, 60.0)
    assert RescheduleError(0).extend_expiration_seconds is None
    for bad in (-1, float("inf"), float("nan"), "5", True):
        with pytest.raises(ValueError, match="delay_seconds"):
            RescheduleError(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="extend_expiration_seconds"):
        RescheduleError(1, extend_expiration_seconds=-5)


def test_dtq_tasks_imports_neither_worker_nor_api() -> None:
    code = (
        "import sys, dtq_tasks\n"
        "bad = [m for m in sys.modules if m.startswith(('dtq.worker', 'dtq.api', 'fastapi'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)


# -- the context a handler sees ----------------------------------------------------------------


async def test_context_fields(settings: Settings, r: Redis, queue: Queue) -> None:
    seen: list[TaskContext] = []

    async def record(payload: dict[str, Any], ctx: TaskContext) -> None:
        seen.append(ctx)

    t = await queue.submit(
        "th_ctx",
        {},
        queue="ctxq",
        idempotency_key="idem-1",
        timeout_ms=5000,
        ttl_seconds=60,
        max_attempts=4,
    )
    plain = await queue.submit("th_ctx", {}, queue="ctxq")
    async with running_worker(fast(settings), handlers(th_ctx=record), queues=("ctxq",)) as w:
        await wait_status(r, t.task_id, "succeeded")
        await wait_status(r, plain.task_id, "succeeded")
    ctx = next(c for c in seen if c.task_id == t.task_id)
    assert ctx.idempotency_key == "idem-1" and ctx.attempt == 1 and ctx.max_attempts == 4
    assert ctx.worker_id == w.worker_id and ctx.queue == "ctxq" and ctx.task_type == "th_ctx"
    assert ctx.expires_at == t.expires_at
    started = (await queue.get(t.task_id)).started_at
    assert started is not None and ctx.deadline.tzinfo is not None
    assert abs((ctx.deadline - started).total_seconds() - 5.0) < 0.01
    other = next(c for c in seen if c.task_id == plain.task_id)
    assert other.idempotency_key is None and other.expires_at is None


# -- idempotent_operation ----------------------------------------------------------------------


async def test_idempotent_operation_runs_once_per_key(r: Redis) -> None:
    runs: list[int] = []

    async def charge() -> dict[str, int]:
        runs.append(1)
        return {"receipt": 42}

    first = await idempotent_operation(r, "charge:1", 60, charge)
    second = await idempotent_operation(r, "charge:1", 60, charge)
    assert first == second == {"receipt": 42}
    assert runs == [1]
    assert 0 < await r.ttl(keys.operation("charge:1")) <= 60
    assert json.loads(await r.get(keys.operation("charge:1")))["state"] == "done"
    # A sync fn with the async client.
    assert await idempotent_operation(r, "charge:2", 60, lambda: "sync ok") == "sync ok"


async def test_idempotent_operation_failure_releases_and_in_progress_retries(r: Redis) -> None:
    def boom() -> None:
        raise RuntimeError("side effect failed")

    with pytest.raises(RuntimeError):
        await idempotent_operation(r, "op:f", 60, boom)
    assert not await r.exists(keys.operation("op:f"))  # a retry can run it again
    assert await idempotent_operation(r, "op:f", 60, lambda: 1) == 1

    gate = asyncio.Event()

    async def slow() -> int:
        await gate.wait()
        return 7

    first = asyncio.create_task(idempotent_operation(r, "op:slow", 60, slow))

    async def claimed() -> bool:
        return bool(await r.exists(keys.operation("op:slow")))

    await wait_until(claimed, 5, "claimed")
    with pytest.raises(RetryableError, match="in progress"):
        await idempotent_operation(r, "op:slow", 60, slow)
    gate.set()
    assert await first == 7


def test_idempotent_operation_with_a_sync_client(redis_url: str) -> None:
    client = sync_redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        runs: list[int] = []
        for _ in range(3):
            assert idempotent_operation(client, "sync:1", 30, lambda: runs.append(1) or "v") == "v"
        assert runs == [1]
    finally:
        client.close()


@pytest.mark.parametrize(("key", "ttl"), [("", 10), ("k", 0), ("k", -1), ("k", 1.5), ("a\nb", 1)])
async def test_idempotent_operation_rejects_bad_arguments(r: Redis, key: str, ttl: Any) -> None:
    with pytest.raises(ValueError):
        await idempotent_operation(r, key, ttl, lambda: 1)


def test_idempotent_operation_needs_a_redis_client() -> None:
    with pytest.raises(TypeError, match="redis"):
        idempotent_operation(object(), "k", 10, lambda: 1)  # type: ignore[call-overload]


# -- the demo tasks (examples/tasks.py) --------------------------------------------------------


async def test_demo_tasks_through_a_worker(
    settings: Settings, r: Redis, queue: Queue, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DTQ_REDIS_URL", redis_url)  # counter_task reads it when it runs
    demo = load_task_modules(["examples.tasks"]).handlers
    for name in ("echo_task", "sleep_task", "fibonacci_task", "flaky_task", "always_fail_task",
                 "counter_task", "slow_task"):  # fmt: skip
        assert name in demo
    assert "CPU-BOUND" in (demo["fibonacci_task"].fn.__doc__ or "")
    submit = queue.submit
    echo = await submit("echo_task", {"hello": "world"})
    sleep = await submit("sleep_task", {"seconds": 0.05})
    too_long = await submit("sleep_task", {"seconds": 31})
    fib = await submit("fibonacci_task", {"n": 15})
    flaky = await submit("flaky_task", {"fail_times": 2}, max_attempts=5)
    fail = await submit("always_fail_task", {}, max_attempts=2)
    counters = [await submit("counter_task", {"name": "c1"}) for _ in range(3)]
    slow = await submit("slow_task", {"seconds": 0.1})
    t0 = datetime.now(UTC)
    async with running_worker(fast(settings), demo):
        for t in (echo, sleep, fib, flaky, slow, *counters):
            await wait_status(r, t.task_id, "succeeded")
        await wait_status(r, too_long.task_id, "dead_lettered")
        await wait_status(r, fail.task_id, "dead_lettered")
    assert (await queue.get(echo.task_id)).result == {"hello": "world"}
    assert (await queue.get(sleep.task_id)).result == {"slept": 0.05}
    assert (await queue.get(too_long.task_id)).error_class == "ValidationError"
    assert (await queue.get(fib.task_id)).result == {"n": 15, "value": 610}
    done = await queue.get(flaky.task_id)
    assert done.attempt == 3 and done.result == {"succeeded_on_attempt": 3}
    failed = await queue.get(fail.task_id)
    assert failed.attempt == 2 and failed.error_class == "RetryableError"
    values = sorted([(await queue.get(t.task_id)).result["value"] for t in counters])
    assert values == [1, 2, 3]
    assert await r.get("demo:counter:c1") == "3"
    assert await r.ttl("demo:counter:c1") > 0
    assert (await queue.get(slow.task_id)).result == {"slept": 0.1}
    assert (datetime.now(UTC) - t0).total_seconds() < 30
