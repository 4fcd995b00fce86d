"""Smoke run of the benchmarks: ``python -m bench --quick`` against the test Redis completes and
reports one valid JSON line per result, every scenario measured ("ok": a worker that cannot
start is an error row and exit code 1). The cluster scenario, which starts clusters of its own,
the schedules scenario, which waits for its ticks, and the limits scenario, whose limits pace
its drains, run in tests apart, so that each stays within its time limit. No timing is
asserted: figures on a shared 2-core machine are for ``make bench``, never a gate of ``make
test`` (the schedules test asserts the exactly-once count, which is not a timing)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ("baseline", "enqueue", "drain", "latency", "memory", "scaling", "expiration")
"""The first word of the results' names; the ``http`` scenario's results are ``enqueue.http_*``."""


def quick_bench(redis_url: str, scenarios: Sequence[str]) -> list[dict[str, Any]]:
    """``python -m bench --quick --only <scenarios>``: its results, each one checked "ok" with a
    finite figure, and its table checked to have a row for each."""
    only = ",".join(scenarios)
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--only", only, "--redis-url", redis_url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert results, proc.stdout
    for r in results:
        assert r["status"] == "ok", r
        value = r[r["figure"]]
        assert isinstance(value, int | float) and math.isfinite(value) and value >= 0, r
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert len(table) == len(results) + 2  # header, rule, one row per result
    return results


def test_quick_bench_reports_every_scenario(redis_url: str) -> None:
    results = quick_bench(redis_url, [*SCENARIOS, "http"])
    names = {r["scenario"] for r in results}
    for scenario in SCENARIOS:
        assert any(n.split(".")[0] == scenario for n in names), (scenario, sorted(names))
    assert {"enqueue.http_noop", "enqueue.http_submit", "drain.noop", "drain.rpush"} <= names


def test_quick_cluster_bench_reports_each_primary_against_one_redis(redis_url: str) -> None:
    rows = {r["scenario"]: r for r in quick_bench(redis_url, ["cluster"])}
    primaries = [rows[f"cluster.primary_{i}"] for i in range(3)]
    assert {"cluster.single_redis", "cluster.one_primary", "cluster.drain"} <= set(rows)
    assert len(rows["cluster.publish"]["receivers_us"]) == 2  # the other two primaries
    n = rows["cluster.single_redis"]["n"]
    # Two queues on each primary, every task on the primary of its queue, every primary busy.
    assert sorted(q for p in primaries for q in p["queues"]) == sorted(
        rows["cluster.one_primary"]["queues"]
    )
    assert all(len(p["queues"]) == 2 for p in primaries)
    assert sum(p["tasks"] for p in primaries) == n
    assert all(p["tasks"] == n // 3 for p in primaries)
    assert all(p["cpu_us_per_task"] > 0 and p["ratios"]["single_redis"] > 0 for p in primaries)
    assert math.isclose(sum(p["cpu_share"] for p in primaries), 1, rel_tol=1e-3)


def test_quick_schedules_bench_fires_every_tick_once(redis_url: str) -> None:
    rows = {r["scenario"]: r for r in quick_bench(redis_url, ["schedules"])}
    assert {"schedules.tick_lag", "schedules.exactly_once", "schedules.drain_ratio"} <= set(rows)
    once = rows["schedules.exactly_once"]
    assert once["met"] is True, once
    assert once["firings"] == once["expected"] == once["tasks_queued"] > 0
    lag = rows["schedules.tick_lag"]
    assert lag["firings"] == lag["schedules"] * lag["seconds"]
    assert 0 <= lag["p50_ms"] <= lag["p99_ms"] <= lag["max_ms"]
    drain = rows["schedules.drain_ratio"]
    assert [r.split()[0] for r in drain["rounds"]] == ["A", "B"]


def test_quick_waits_bench_reports_latency_and_reads(redis_url: str) -> None:
    rows = {r["scenario"]: r for r in quick_bench(redis_url, ["waits"])}
    assert rows["waits.result_latency"]["n"] == 100  # every producer had its result
    many = rows["waits.thousand_waiters"]
    assert many["waiters"] == 100 and many["blocked_clients"] >= 1
    assert many["xread_calls"] < many["waiters"]  # a count, not a timing


def test_quick_limits_bench_drains_every_limited_queue(redis_url: str) -> None:
    rows = {r["scenario"]: r for r in quick_bench(redis_url, ["limits"])}
    assert rows["limits.rate"]["n"] == 200 and rows["limits.rate"]["limit_per_s"] == 100
    assert rows["limits.concurrency"]["n"] == 80  # every task SUCCEEDED, counted
    assert rows["limits.concurrency_fast_scheduler"]["ceiling_per_s"] == 800
    assert rows["limits.fair"]["n"] == 2_000 and rows["limits.fair"]["plain_rate"] > 0


def test_quick_workflows_bench_ends_its_fan_in(redis_url: str) -> None:
    row = {r["scenario"]: r for r in quick_bench(redis_url, ["workflows"])}["workflows.fan_in"]
    assert row["nodes"] == 52  # root, 50 members, callback: the workflow succeeded
    assert row["submit_ms"] > 0 and row["redis_cpu_us_per_node"] > 0
    assert row["plain_tasks_per_s"] > 0 and row["ratios"]["plain"] > 0
