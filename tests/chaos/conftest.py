"""The chaos suite's fixtures: its scale and the figures of the scenarios run so far.

- The seed: one per run, ``DTQ_CHAOS_SEED`` or a fresh random one, printed in the header and
  the summary of every run, the same in every pytest-xdist worker (``support.chaos_run``);
  every random choice of a scenario derives from it (``Scale.rng``). Processes still race, so
  a replay repeats the choices (which worker is killed when, which keys, which payloads), not
  the exact interleaving.
- The scale: reduced (``make test``) unless ``DTQ_CHAOS_FULL=1`` (``make chaos``).
- The figures: :func:`chaos_figures` are the reports of this process's scenarios; each test
  also records its own (``support.chaos_run.FIGURES``), and the terminal summary prints them
  all as a Markdown table.
"""

from __future__ import annotations

import pytest
from chaos_checker import Report
from chaos_harness import Scale

from support.chaos_run import SEED_KEY, full_run


@pytest.fixture(scope="session")
def chaos_scale(pytestconfig: pytest.Config) -> Scale:
    return Scale(full=full_run(), seed=pytestconfig.stash[SEED_KEY])


@pytest.fixture(scope="session")
def chaos_figures() -> list[Report]:
    return []
