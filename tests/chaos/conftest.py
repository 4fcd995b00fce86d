"""The chaos suite's seed, scale and figures.

- The seed: ``DTQ_CHAOS_SEED`` or a fresh random one, printed in the header and the summary
  of every run; every random choice of a scenario derives from it (``Scale.rng``). Processes
  still race, so a replay repeats the choices (which worker is killed when, which keys,
  which payloads), not the exact interleaving.
- The scale: reduced (``make test``) unless ``DTQ_CHAOS_FULL=1`` (``make chaos``).
- The figures: every scenario's reports go to one list; the terminal summary prints them as
  a Markdown table.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
from chaos_checker import Report, format_table
from chaos_harness import Scale, full_run

SEED_KEY = pytest.StashKey[int]()
FIGURES_KEY = pytest.StashKey[list[Report]]()


def pytest_configure(config: pytest.Config) -> None:
    raw = os.environ.get("DTQ_CHAOS_SEED", "")
    try:
        seed = int(raw) if raw else random.SystemRandom().randrange(1, 1 << 31)
    except ValueError:
        raise pytest.UsageError(f"DTQ_CHAOS_SEED={raw!r} is not a whole number") from None
    config.stash[SEED_KEY] = seed
    config.stash[FIGURES_KEY] = []


def pytest_report_header(config: pytest.Config) -> str:
    seed = config.stash[SEED_KEY]
    mode = "full (DTQ_CHAOS_FULL=1)" if full_run() else "reduced"
    return f"chaos: seed {seed} ({mode}); replay with DTQ_CHAOS_SEED={seed}"


@pytest.fixture(scope="session")
def chaos_scale(pytestconfig: pytest.Config) -> Scale:
    return Scale(full=full_run(), seed=pytestconfig.stash[SEED_KEY])


@pytest.fixture(scope="session")
def chaos_figures(pytestconfig: pytest.Config) -> list[Report]:
    return pytestconfig.stash[FIGURES_KEY]


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    reports = config.stash.get(FIGURES_KEY, [])
    if not reports:
        return
    seed = config.stash[SEED_KEY]
    mode = "full" if full_run() else "reduced"
    terminalreporter.section(f"chaos figures ({mode} run, seed {seed})")
    terminalreporter.write_line(format_table([r.summary() for r in reports]))
    terminalreporter.write_line(f"replay: DTQ_CHAOS_SEED={seed}")
