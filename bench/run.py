"""The benchmark runner: one private redis-server, every scenario in one run with the baseline.

    python -m bench [--quick] [--only drain,latency] [--redis-url URL] [--markdown FILE]

Prints one JSON line per result as it is measured, then the Markdown table of the run. Without
``--redis-url`` it starts its own redis-server on a free port of 127.0.0.1 (dtq.devserver) and
stops it by PID at the end; with it, that server's data is FLUSHALLed between scenarios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path

import redis

from bench.harness import Env, Result
from bench.scenarios import (
    baseline,
    cluster,
    drain,
    enqueue,
    expiration,
    http,
    latency,
    limits,
    memory,
    scaling,
    schedules,
    waits,
    workflows,
)
from dtq.devserver import start_redis

__all__ = ["SCENARIOS", "main"]

Scenario = Callable[[Env], Awaitable[list[Result]]]

SCENARIOS: dict[str, Scenario] = {
    "baseline": baseline.run,
    "enqueue": enqueue.run,
    "http": http.run,
    "drain": drain.run,
    "latency": latency.run,
    "memory": memory.run,
    "scaling": scaling.run,
    "expiration": expiration.run,
    "schedules": schedules.run,
    "waits": waits.run,
    "limits": limits.run,
    "cluster": cluster.run,
    "workflows": workflows.run,
}

HEADER = (
    "| scenario | figure | ratios (same run) | target | met | notes |\n"
    "| --- | --- | --- | --- | --- | --- |"
)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small counts (a smoke run, seconds)")
    p.add_argument(
        "--only",
        default="",
        help=f"comma-separated scenarios to run (baseline always runs): {', '.join(SCENARIOS)}",
    )
    p.add_argument("--redis-url", default="", help="use this server instead (it is flushed)")
    p.add_argument("--markdown", default="", help="also write the Markdown table to this file")
    args = p.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    unknown = set(only) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    return args


def _emit(res: Result, rows: list[Result]) -> None:
    rows.append(res)
    print(res.as_json(), flush=True)


async def _run_all(env: Env, names: list[str]) -> list[Result]:
    rows: list[Result] = []
    for name in names:
        t = time.monotonic()
        try:
            results = await SCENARIOS[name](env)
        except Exception as exc:  # a scenario's failure is reported, the run goes on
            tb = traceback.format_exc(limit=3).replace("\n", " | ")
            results = [Result(name, status="error", note=f"{type(exc).__name__}: {exc} ({tb})")]
        finally:
            env.stop_children()
        for res in results:
            res.values.setdefault("scenario_s", round(time.monotonic() - t, 1))
            _emit(res, rows)
    return rows


def _table(rows: list[Result], env: Env, started: float, server_info: str, load: str) -> str:
    mode = "quick" if env.quick else "full"
    lines = [
        f"dtq benchmark ({mode} run, {time.strftime('%Y-%m-%d %H:%M:%S')}, "
        f"{time.monotonic() - started:.0f} s): Python {platform.python_version()}, "
        f"{server_info}, {os.cpu_count()} cores, load average {load} -> {_load()} "
        "(other work on the machine skews every figure; compare ratios within one run)",
        "",
        HEADER,
        *(r.as_row() for r in rows),
    ]
    return "\n".join(lines)


def _load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    names = [
        "baseline",
        *[s for s in SCENARIOS if s != "baseline" and (not args.only or s in args.only)],
    ]
    started = time.monotonic()
    load = _load()
    work = Path(tempfile.mkdtemp(prefix="dtq-bench-"))
    server = None
    try:
        if args.redis_url:
            url = args.redis_url
        else:
            server = start_redis(work / "redis")
            url = server.url
        info = redis.Redis.from_url(url).info("server")
        server_info = f"redis-server {info['redis_version']}"
        env = Env(redis_url=url, quick=args.quick, work_dir=work)
        rows = asyncio.run(_run_all(env, names))
        table = _table(rows, env, started, server_info, load)
        print()
        print(table, flush=True)
        if args.markdown:
            Path(args.markdown).write_text(table + "\n", encoding="utf-8")
        return 1 if any(r.status == "error" for r in rows) else 0
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
        sys.stdout.flush()
