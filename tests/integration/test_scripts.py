"""Scripts: loaded once, called by SHA, re-loaded after NOSCRIPT without running anything twice."""

from __future__ import annotations

import hashlib
from importlib import resources

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from dtq import Queue, keys
from dtq.metrics import count_commands
from dtq.models import Task
from dtq.scripts import BATCHED, SCRIPT_NAMES, Scripts
from dtq.store import SUBMIT_CHUNK


async def task_count(r: Redis) -> int:
    n = 0
    async for key in r.scan_iter(match=keys.task("*"), count=1000):
        n += key.count(":") == 2
    return n


async def depth(r: Redis, queue: str) -> int:
    return sum([await r.xlen(k) for k in keys.queue_streams(queue)])


def test_every_lua_file_is_a_known_script() -> None:
    files = {
        p.name.removesuffix(".lua")
        for p in resources.files("dtq").joinpath("lua").iterdir()
        if p.name.endswith(".lua") and not p.name.startswith("_")
    }
    assert files == set(SCRIPT_NAMES), (
        f"never loaded: {files - set(SCRIPT_NAMES)}; no file: {set(SCRIPT_NAMES) - files}"
    )
    scripts = Scripts()
    assert set(scripts.source) == files | {f"{name}_batch" for name in BATCHED}
    lua = resources.files("dtq").joinpath("lua")
    lib = lua.joinpath("_lib.lua").read_text()
    batch = lua.joinpath("_batch.lua").read_text()
    for name, src in scripts.source.items():
        # The library, then the script's own file (a batched form: that file's body as a
        # function, then _batch.lua); the SHA is the one Redis computes for it.
        own = name.removesuffix("_batch")
        body = lua.joinpath(f"{own}.lua").read_text()
        assert src.startswith(lib), name
        if own == name:
            assert src.endswith(body), name
        else:
            assert src.endswith(batch) and body in src, name
        assert scripts.sha[name] == hashlib.sha1(src.encode()).hexdigest(), name


async def test_every_script_compiles_and_sha_matches(r: Redis) -> None:
    scripts = Scripts()
    for name, src in scripts.source.items():
        assert await r.script_load(src) == scripts.sha[name], name


async def test_noscript_after_flush(queue: Queue, r: Redis) -> None:
    await queue.submit("echo_task")
    await r.script_flush()
    assert await r.script_exists(queue.scripts.sha["submit"]) == [False]
    task = await queue.submit("echo_task", {"after": "flush"})
    assert (await queue.get(task.task_id)).payload == {"after": "flush"}
    # Nothing ran twice: exactly the two tasks, two entries, two index members.
    assert await task_count(r) == 2
    assert await depth(r, "default") == 2
    assert await r.zcard(keys.RECENT) == 2
    assert await r.script_exists(queue.scripts.sha["submit"]) == [True]


async def test_noscript_in_a_batch_resends_only_what_did_not_run(queue: Queue, r: Redis) -> None:
    await r.script_flush()
    n = 2 * SUBMIT_CHUNK + 3  # three submit.lua calls in one pipeline
    results = await queue.submit_many(
        [{"task_type": "echo_task", "payload": {"i": i}} for i in range(n)]
    )
    assert all(isinstance(t, Task) for t in results)
    assert [t.payload["i"] for t in results if isinstance(t, Task)] == list(range(n))
    assert await task_count(r) == n
    assert await depth(r, "default") == n


async def test_idempotent_submit_after_flush(queue: Queue, r: Redis) -> None:
    await r.script_flush()
    first = await queue.submit("echo_task", idempotency_key="once")
    await queue.cancel(first.task_id)
    await r.script_flush()
    replay = await queue.submit("echo_task", idempotency_key="once")
    assert replay.duplicate and replay.task_id == first.task_id
    assert await task_count(r) == 1


async def test_script_error_is_per_call(queue: Queue, r: Redis) -> None:
    seen: list[tuple[str, bool]] = []
    scripts = Scripts(on_call=lambda name, ok: seen.append((name, ok)))
    # SET ... PX x fails in the lock script: that call alone reports it.
    good = ("lock", [keys.SCHEDULER_LOCK], ["acquire", "w-1", 10_000])
    bad = ("lock", ["another-lock"], ["acquire", "w-2", "x"])
    results = await scripts.call_many(r, [good, bad, good])
    assert results[0] == 1 and results[2] == 1
    assert isinstance(results[1], ResponseError)
    assert seen == [("lock", True), ("lock", False), ("lock", True)]
    with pytest.raises(ResponseError):
        await scripts.call(r, *bad)
    assert await scripts.call_many(r, []) == []


async def test_single_call_reports_once_and_reloads_after_flush(r: Redis) -> None:
    """``Scripts.call`` is a plain EVALSHA: after a flush it loads the scripts and runs the
    call once; ``on_call`` sees it once by name, and a per-command metrics hook on the same
    client does not count it again."""
    calls: list[tuple[str, bool]] = []
    commands: list[tuple[str, bool]] = []
    scripts = Scripts(on_call=lambda name, ok: calls.append((name, ok)))
    count_commands(r, lambda name, ok: commands.append((name, ok)))
    await r.script_flush()
    args = ["acquire", "w-1", 10_000]
    assert await scripts.call(r, "lock", [keys.SCHEDULER_LOCK], args) == 1
    assert await r.get(keys.SCHEDULER_LOCK) == "w-1"
    assert await scripts.call(r, "lock", [keys.SCHEDULER_LOCK], ["acquire", "w-2", 10_000]) == 0
    assert calls == [("lock", True), ("lock", True)]
    assert [name for name, _ in commands if name == "evalsha"] == []
    await r.delete(keys.SCHEDULER_LOCK)
    with pytest.raises(ResponseError):  # SET ... PX x: the script's error is raised
        await scripts.call(r, "lock", [keys.SCHEDULER_LOCK], ["acquire", "w-3", "x"])
    assert calls[-1] == ("lock", False)
