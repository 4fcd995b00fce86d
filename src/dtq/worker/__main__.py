"""``python -m dtq.worker [--concurrency N] [--queue Q ...] [--tasks MODULE ...] [--processes N]``:
the same as ``dtq worker run``."""

from __future__ import annotations

import argparse
import sys

from dtq.config import load_settings
from dtq.errors import ConfigError
from dtq.worker import run_worker


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dtq.worker", description="Run a dtq worker.")
    p.add_argument(
        "--concurrency",
        type=_positive,
        default=None,
        help="tasks run at once (default DTQ_WORKER_CONCURRENCY)",
    )
    p.add_argument(
        "--queue",
        action="append",
        dest="queues",
        metavar="Q",
        help="queue to serve; repeat for several (default: default)",
    )
    p.add_argument(
        "--tasks",
        action="append",
        dest="task_modules",
        metavar="MODULE",
        help="module registering handlers; repeat (default DTQ_TASK_MODULES)",
    )
    p.add_argument(
        "--processes",
        type=_positive,
        default=1,
        help="worker processes under one supervisor (default 1)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = load_settings()
    except ConfigError as exc:
        print(f"dtq worker: {exc.message}", file=sys.stderr)
        return 2
    return run_worker(
        settings,
        queues=args.queues,
        concurrency=args.concurrency,
        task_modules=args.task_modules,
        processes=args.processes,
    )


if __name__ == "__main__":
    sys.exit(main())
