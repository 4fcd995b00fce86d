"""Smoke run of the benchmarks: ``python -m bench --quick`` against the test Redis completes and
reports one valid JSON line per result, every scenario measured ("ok": a worker that cannot
start is an error row and exit code 1). No timing is asserted: figures on a shared 2-core
machine are for ``make bench``, never a gate of ``make test``."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ("baseline", "enqueue", "drain", "latency", "memory", "scaling", "expiration")


def test_quick_bench_reports_every_scenario(redis_url: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--redis-url", redis_url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert results, proc.stdout
    names = {r["scenario"] for r in results}
    for scenario in SCENARIOS:
        assert any(n.split(".")[0] == scenario for n in names), (scenario, sorted(names))
    assert {"enqueue.http_noop", "enqueue.http_submit", "drain.noop", "drain.rpush"} <= names
    for r in results:
        assert r["status"] == "ok", r
        value = r[r["figure"]]
        assert isinstance(value, int | float) and math.isfinite(value) and value >= 0, r
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert len(table) == len(results) + 2  # header, rule, one row per result
