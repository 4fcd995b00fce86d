"""The fault-injection scenarios (``docs/reliability.md``). Each one starts its own
processes (a private redis-server, worker subprocesses, the API under uvicorn) on 127.0.0.1,
injects its faults, waits for quiescence and checks its invariants; the figures go to the
table printed at the end of the run.

``make test`` runs them reduced (a few hundred tasks each, about 3.5 minutes of work), twice:
on redis-server 6.2.5, then on valkey-server 8.1; ``make chaos`` (``DTQ_CHAOS_FULL=1``) runs
10,000 tasks per scenario. A failure names the
seed: ``DTQ_CHAOS_SEED=<seed>`` replays the same random choices.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import chaos_api
import chaos_bounds
import chaos_edges
import chaos_faults
import chaos_lifetimes
import chaos_outages
import pytest
from chaos_checker import Report
from chaos_harness import Scale

from support.chaos_run import FIGURES, full_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500 if full_run() else 150)]

Scenario = Callable[[Path, Scale], Awaitable[list[Report]]]
RecordProperty = Callable[[str, object], None]
SCENARIOS: dict[str, Scenario] = {
    "baseline": chaos_faults.baseline,
    "kill9": chaos_faults.kill9,
    "crash_points": chaos_faults.crash_points,
    "redis_restart": chaos_outages.redis_restart,
    "sigstop": chaos_faults.sigstop,
    "idempotency": chaos_bounds.idempotency,
    "soak": chaos_bounds.soak,
    "conn_drops": chaos_outages.conn_drops,
    "api_kill": chaos_outages.api_kill,
    "clock_skew": chaos_faults.clock_skew,
    "ws_slow_client": chaos_api.ws_slow_client,
    "bad_input": chaos_api.bad_input,
    "retention_pressure": chaos_lifetimes.retention_pressure,
    "queue_flood": chaos_lifetimes.queue_flood,
    "dropped_replies": chaos_edges.dropped_replies,
    "loop_block": chaos_edges.loop_block,
}


def _judge(
    reports: list[Report],
    scale: Scale,
    figures: list[Report],
    record: RecordProperty,
    logs: Path,
) -> None:
    figures.extend(reports)
    record(FIGURES, [r.summary() for r in reports])
    violations = [f"{r.name}: {v}" for r in reports for v in r.violations]
    assert reports and not violations, (
        f"seed {scale.seed} (replay: DTQ_CHAOS_SEED={scale.seed}); process logs and "
        f"side-effect logs under {logs}\n" + "\n".join(violations)
    )


@pytest.mark.parametrize("name", list(SCENARIOS))
async def test_scenario(
    name: str,
    tmp_path: Path,
    chaos_scale: Scale,
    chaos_figures: list[Report],
    record_property: RecordProperty,
) -> None:
    reports = await SCENARIOS[name](tmp_path, chaos_scale)
    _judge(reports, chaos_scale, chaos_figures, record_property, tmp_path)


async def test_poison_pills(
    tmp_path: Path,
    chaos_scale: Scale,
    chaos_figures: list[Report],
    record_property: RecordProperty,
) -> None:
    """After the baseline when one process runs both (not so under pytest-xdist, where they
    may land on two workers): its burst throughput is the reference of a note."""
    reference = next((r.throughput for r in chaos_figures if r.name == "baseline burst"), None)
    reports = await chaos_faults.poison(tmp_path, chaos_scale, reference)
    _judge(reports, chaos_scale, chaos_figures, record_property, tmp_path)
