"""Profile one hot path against a private Redis: where the time goes, per task.

    python -m bench.profile submit-single|submit-concurrent|submit-many [--n N] [--pyinstrument]
    python -m bench.profile drain [--n N] [--py-spy FILE]

Prints the client's CPU time per task (``time.process_time``) and the Redis server's CPU time per
task (utime + stime of its process, from /proc): CPU time, unlike wall time, is not inflated
when other work on the machine preempts either process, so two variants measured this way
compare even on a busy machine. ``--pyinstrument`` (submit modes) prints the call tree of the
client; ``--py-spy FILE`` (drain) records the worker process with py-spy as collapsed stacks,
and prints the functions with the most samples. Neither tool is a dependency of dtq: install
them in the venv (``pip install pyinstrument py-spy``) to use these options.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import NOOP_TASK, PAYLOAD_100B, Env, live_entries, wait_until
from bench.workers import spawn_worker
from dtq import Queue
from dtq.devserver import start_redis

MODES = ("submit-single", "submit-concurrent", "submit-many", "drain")


def process_cpu_s(pid: int) -> tuple[float, float]:
    """(user + system, system) CPU seconds of a process, 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    user, system = int(fields[11]) / tick, int(fields[12]) / tick
    return user + system, system


def redis_cpu_s(pid: int) -> float:
    return process_cpu_s(pid)[0]


async def _submit(q: Queue, mode: str, n: int) -> None:
    if mode == "submit-single":
        for _ in range(n):
            await q.submit(NOOP_TASK, PAYLOAD_100B)
    elif mode == "submit-concurrent":

        async def loop() -> None:
            for _ in range(n // 32):
                await q.submit(NOOP_TASK, PAYLOAD_100B)

        await asyncio.gather(*(loop() for _ in range(32)))
    else:
        items = [{"task_type": NOOP_TASK, "payload": PAYLOAD_100B}] * 100
        for _ in range(n // 100):
            await q.submit_many(items)


async def profile_submit(env: Env, pid: int, mode: str, n: int, tree: bool) -> None:
    q = await env.queue()
    try:
        await _submit(q, mode, 200)  # warm: scripts loaded, connections open
        await env.flush()
        profiler: Any = None
        if tree:
            from pyinstrument import Profiler

            profiler = Profiler(interval=0.0005, async_mode="enabled")
            profiler.start()
        r0, c0, t0 = redis_cpu_s(pid), time.process_time(), time.perf_counter()
        await _submit(q, mode, n)
        wall, cpu, rcpu = (
            time.perf_counter() - t0,
            time.process_time() - c0,
            redis_cpu_s(pid) - r0,
        )
        if profiler is not None:
            profiler.stop()
            print(profiler.output_text(unicode=True, color=False, show_all=False))
    finally:
        await q.close()
    print(
        f"{mode}: {n:,} tasks, {n / wall:,.0f} tasks/s wall; client CPU {cpu / n * 1e6:.1f} "
        f"us/task; Redis CPU {rcpu / n * 1e6:.1f} us/task"
    )


async def profile_drain(env: Env, pid: int, n: int, spy_out: str) -> None:
    q = await env.queue()
    r = await env.redis()
    try:
        await env.fill(q, n, NOOP_TASK)
        r0, t0 = redis_cpu_s(pid), time.perf_counter()
        worker = spawn_worker(env, concurrency=env.concurrency)
        spy = _py_spy(worker.proc.pid, spy_out) if spy_out else None

        async def drained() -> bool:
            return not worker.alive() or await live_entries(r) == 0

        await wait_until(drained, 600, interval_s=0.05)
        wall, rcpu = time.perf_counter() - t0, redis_cpu_s(pid) - r0
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
        worker.stop()
    finally:
        await q.close()
        await r.aclose()
    print(
        f"drain: {n:,} tasks in {wall:.1f} s from spawn ({n / wall:,.0f} tasks/s); Redis CPU "
        f"{rcpu / n * 1e6:.1f} us/task"
    )
    if spy_out:
        print(summarise_stacks(spy_out))


def _py_spy(pid: int, out: str) -> subprocess.Popen[bytes]:
    exe = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or "py-spy"
    return subprocess.Popen(
        [exe, "record", "-p", str(pid), "-r", "200", "-f", "raw", "-o", out, "--nonblocking"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def summarise_stacks(path: str, top: int = 25) -> str:
    """Self and inclusive shares of a py-spy raw (collapsed stacks) file."""
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        frames = [f for f in stack.split(";") if not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        total += n
        own[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    lines = [f"{total} samples; self time:"]
    lines += [f"  {100 * n / total:5.1f}%  {f}" for f, n in own.most_common(top)]
    lines.append("inclusive time (dtq frames):")
    lines += [
        f"  {100 * n / total:5.1f}%  {f}"
        for f, n in incl.most_common(400)
        if "dtq/" in f and "__main__" not in f and "run_worker" not in f
    ][:top]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    p.add_argument("mode", choices=MODES)
    p.add_argument("--n", type=int, default=0, help="tasks (default 5,000; drain 20,000)")
    p.add_argument("--pyinstrument", action="store_true", help="call tree of the client")
    p.add_argument("--py-spy", dest="spy", default="", help="record the worker to this file")
    p.add_argument("--concurrency", type=int, default=128, help="the worker's --concurrency")
    args = p.parse_args(argv)
    n = args.n or (20_000 if args.mode == "drain" else 5_000)
    work = Path(tempfile.mkdtemp(prefix="dtq-profile-"))
    server = start_redis(work / "redis")
    env = Env(redis_url=server.url, quick=False, work_dir=work, concurrency=args.concurrency)
    try:
        if args.mode == "drain":
            asyncio.run(profile_drain(env, server.pid, n, args.spy))
        else:
            asyncio.run(profile_submit(env, server.pid, args.mode, n, args.pyinstrument))
    finally:
        env.stop_children()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
