"""``dtq``: the command line (contract section 12, DESIGN 9 and 10).

It talks to Redis directly through the SDK (:mod:`dtq.client`); every rule (validation,
transitions, idempotency, audit) lives once, in the core. This module parses the arguments,
loads the settings, runs one command and maps its outcome to an exit code:

- 0: success. A cancel of a running task is accepted as a cancellation request: 0 as well.
- 1: refused by the system's state (not found, already terminal, queue full, idempotency key in
  progress, not in the DLQ, a purge not confirmed) or Redis unreachable (one line naming the URL
  and what failed).
- 2: invalid input of any kind (flags, payload, durations, date-times, a workflow file;
  argparse's usage errors)
  or an invalid ``DTQ_*`` setting (the ConfigError line).

No user error prints a traceback; ``dtq --debug`` shows one for an unexpected error.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dtq_cli.output import Output
from dtq_cli.parser import build_parser

if TYPE_CHECKING:
    from dtq.errors import DtqError

__all__ = ["EXIT_OK", "EXIT_REFUSED", "EXIT_USAGE", "exit_code", "main", "run"]

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2


def exit_code(error: DtqError) -> int:
    """2 for what the user typed or configured wrong; 1 for what the system refused."""
    from dtq.errors import ConfigError, InvalidTaskError, InvalidWorkflowError
    from dtq_cli.context import UsageError

    if isinstance(error, ConfigError | InvalidTaskError | InvalidWorkflowError | UsageError):
        return EXIT_USAGE
    return EXIT_REFUSED


def run(args: argparse.Namespace, out: Output) -> int:
    """Run the parsed command; raises dtq errors for :func:`main` to map to exit codes.

    The core is imported here, not at the top: ``--help`` and usage errors answer without it.
    """
    import asyncio

    from dtq.config import describe_redis, load_settings
    from dtq.errors import DtqError, RedisUnavailableError
    from dtq_cli import commands

    settings = load_settings()
    if args.cmd in commands.PROCESS_COMMANDS:
        return commands.PROCESS_COMMANDS[args.cmd](args, settings, out)
    try:
        command = commands.REDIS_COMMANDS[args.cmd]
        return asyncio.run(commands.with_queue(command, args, settings, out))
    except (DtqError, BrokenPipeError):
        raise
    except Exception as exc:
        # A connection dropped mid-command inside redis-py (OSError or a redis.exceptions
        # class): name the server and what failed, in one line, like an unreachable Redis.
        if isinstance(exc, OSError) or type(exc).__module__.split(".")[0] == "redis":
            raise RedisUnavailableError(
                f"Redis at {describe_redis(settings)} failed: {type(exc).__name__}: {exc}"
            ) from exc
        raise


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # usage errors exit 2, --help exits 0
    out = Output()
    from dtq.errors import DtqError

    try:
        return run(args, out)
    except DtqError as exc:
        out.error(exc.message)
        return exit_code(exc)
    except KeyboardInterrupt:
        out.note("interrupted")
        return 130
    except BrokenPipeError:
        # The reader went away (dtq list | head): the command itself succeeded.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except Exception as exc:
        if args.debug:
            raise
        out.error(f"unexpected {type(exc).__name__}: {exc} (run with --debug for the traceback)")
        return EXIT_REFUSED


if __name__ == "__main__":
    raise SystemExit(main())
