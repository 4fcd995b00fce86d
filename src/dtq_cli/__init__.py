"""The ``dtq`` command line: argparse, talking to Redis through the SDK (contract section 12).

The entry point is :func:`dtq_cli.cli.main`; ``docs/cli.md`` is the reference.
"""

from dtq_cli.cli import main

__all__ = ["main"]
