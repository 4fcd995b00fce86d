"""What every command receives: the connected SDK queue, its arguments and the output, and the
audit identity of the person running it."""

from __future__ import annotations

import argparse
import getpass
import os
import socket
import uuid
from dataclasses import dataclass, field

from dtq.client import Audit, Queue
from dtq.errors import DtqError
from dtq_cli.output import Output

__all__ = ["Ctx", "NotConfirmedError", "UsageError", "cli_actor"]


class UsageError(DtqError):
    """The command line cannot be carried out as given (exit 2), e.g. a purge without --yes
    when there is no terminal to confirm on."""

    code = "USAGE"


class NotConfirmedError(DtqError):
    """The person at the terminal did not type the confirmation: nothing changed (exit 1)."""

    code = "NOT_CONFIRMED"


def cli_actor() -> str:
    """``cli:<user>@<host>``: who ran a destructive command, as the audit stream records it."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a uid with no passwd entry (some containers)
        user = f"uid{os.getuid()}"
    return f"cli:{user}@{socket.gethostname()}"


@dataclass
class Ctx:
    q: Queue
    args: argparse.Namespace
    out: Output
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def json(self) -> bool:
        return bool(getattr(self.args, "json", False))

    def audit(self) -> Audit:
        """One audit identity per invocation: every entry it writes shares the request id."""
        return Audit(actor=cli_actor(), request_id=self.request_id)
