"""Helpers shared by the test suites (no tests here; pytest collects only ``test_*`` files).

``tests/`` is on ``sys.path`` (``tests/conftest.py`` sits at its root, pytest's default import
mode), so tests import ``from support import ...``:

- :mod:`support.waiting`: ``wait_until`` / ``wait_until_sync``, the one deadline-bound wait;
- :mod:`support.events`: ``Events``, the one collector of ``dtq:events``;
- :mod:`support.worker`: ``running_worker`` / ``started``, the one in-process worker, always
  stopped; worker subprocesses; waits on task and worker state;
- :mod:`support.api`, :mod:`support.cli`, :mod:`support.dashboard`, :mod:`support.scheduler`:
  what the tests of one surface share.

The three shared pieces are importable from the package itself.
"""

from support.events import Events
from support.waiting import wait_until, wait_until_sync
from support.worker import running_worker, started

__all__ = ["Events", "running_worker", "started", "wait_until", "wait_until_sync"]
