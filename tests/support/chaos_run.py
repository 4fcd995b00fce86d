"""The chaos suite's run-wide state: one seed and one table of figures per pytest run, also
when pytest-xdist spreads the tests over worker processes (each its own session). A plugin
of ``tests/conftest.py``, so the process that starts the run has it whichever tests it was
given; tests/chaos/conftest.py holds the fixtures.

- The seed: ``DTQ_CHAOS_SEED`` or a fresh random one, picked once by the process that starts
  the run (xdist's controller, or pytest alone) and handed to every xdist worker in its
  ``workerinput``; it is in the header and the summary, and every random choice of a
  scenario derives from it (``Scale.rng``).
- The figures: a scenario puts its reports' summaries in its test report's
  ``user_properties`` under :data:`FIGURES` (xdist sends them to the controller); the terminal
  summary prints every row as one Markdown table.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

__all__ = ["FIGURES", "SEED_KEY", "format_table", "full_run"]

SEED_ENV = "DTQ_CHAOS_SEED"
SEED_INPUT = "dtq_chaos_seed"  # the key of the seed in an xdist worker's workerinput
SEED_KEY = pytest.StashKey[int]()
FIGURES = "chaos_figures"  # the user_properties name of a test's rows


def full_run() -> bool:
    """``make chaos`` (DTQ_CHAOS_FULL=1): full sizes; otherwise the reduced run."""
    return os.environ.get("DTQ_CHAOS_FULL") == "1"


def pytest_configure(config: pytest.Config) -> None:
    workerinput: dict[str, Any] | None = getattr(config, "workerinput", None)
    if workerinput is not None and SEED_INPUT in workerinput:
        seed = int(workerinput[SEED_INPUT])
    else:
        raw = os.environ.get(SEED_ENV, "")
        try:
            seed = int(raw) if raw else random.SystemRandom().randrange(1, 1 << 31)
        except ValueError:
            raise pytest.UsageError(f"{SEED_ENV}={raw!r} is not a whole number") from None
    config.stash[SEED_KEY] = seed


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist's controller, for each worker it starts: the run's seed."""
    node.workerinput[SEED_INPUT] = node.config.stash[SEED_KEY]


def pytest_report_header(config: pytest.Config) -> str:
    seed = config.stash[SEED_KEY]
    mode = "full (DTQ_CHAOS_FULL=1)" if full_run() else "reduced"
    return f"chaos: seed {seed} ({mode}); replay with {SEED_ENV}={seed}"


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    rows = [
        row
        for reports in terminalreporter.stats.values()
        for report in reports
        if getattr(report, "when", None) == "call"
        for name, value in report.user_properties
        if name == FIGURES
        for row in value
    ]
    if not rows:
        return
    seed = config.stash[SEED_KEY]
    mode = "full" if full_run() else "reduced"
    terminalreporter.section(f"chaos figures ({mode} run, seed {seed})")
    terminalreporter.write_line(format_table(rows))
    terminalreporter.write_line(f"replay: {SEED_ENV}={seed}")


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The figures as a Markdown table."""
    cols = [
        ("scenario", "scenario"),
        ("accepted", "accepted"),
        ("lost", "lost"),
        ("dup_exec", "dup_exec"),
        ("dup_per_10k", "dup /10k"),
        ("terminal_conflicts", "terminal conflicts"),
        ("late_exec", "late_exec"),
        ("recovery_s", "recovery s"),
        ("p50_ms", "p50 ms"),
        ("p99_ms", "p99 ms"),
        ("throughput", "tasks/s"),
        ("refused", "refused"),
        ("unknown", "unknown"),
    ]
    lines = [
        "| " + " | ".join(title for _, title in cols) + " | notes |",
        "|" + "---|" * (len(cols) + 1),
    ]
    for row in rows:
        cells = [_cell(row.get(key)) for key, _ in cols]
        notes = "; ".join(f"{k}={_cell(v)}" for k, v in row.items() if k not in dict(cols))
        lines.append("| " + " | ".join(cells) + f" | {notes} |")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.0f}" if abs(value) >= 100 else f"{value:.2f}"
    return str(value)
