"""``python -m dtq.worker [--concurrency N] [--queue Q ...] [--tasks MODULE ...] [--processes N]``:
``dtq worker run`` with the same flags, parsed by the CLI's one parser (docs/cli.md)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dtq_cli.cli import main as cli_main


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(["worker", "run", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
