"""The chaos scenarios on a Redis Cluster (``chaos_cluster``): a worker and a primary killed
with ``kill -9``. Each forms a 3-primary cluster of its own. ``make test`` runs them reduced
(tens of seconds each); ``make chaos`` (``DTQ_CHAOS_FULL=1``) at 10,000 tasks."""

from __future__ import annotations

from pathlib import Path

import chaos_cluster
import pytest
from chaos_checker import Report
from chaos_harness import Scale
from test_chaos import RecordProperty, _judge

from support.chaos_run import full_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500 if full_run() else 150)]


async def test_kill9_a_worker(
    tmp_path: Path,
    chaos_scale: Scale,
    chaos_figures: list[Report],
    record_property: RecordProperty,
) -> None:
    reports = await chaos_cluster.cluster_kill9(tmp_path, chaos_scale)
    _judge(reports, chaos_scale, chaos_figures, record_property, tmp_path)


async def test_kill9_a_primary(
    tmp_path: Path,
    chaos_scale: Scale,
    chaos_figures: list[Report],
    record_property: RecordProperty,
) -> None:
    reports = await chaos_cluster.cluster_primary_kill(tmp_path, chaos_scale)
    _judge(reports, chaos_scale, chaos_figures, record_property, tmp_path)
