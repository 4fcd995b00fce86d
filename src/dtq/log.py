"""Logging setup for dtq processes (contract sections 10 and 13).

:func:`configure_logging` installs one handler on the root logger, at ``DTQ_LOG_LEVEL``:

- ``DTQ_LOG_JSON=true``: one JSON object per line with ``timestamp`` (ISO 8601 UTC), ``level``,
  ``service``, ``logger``, ``message`` and, where they apply, the contract's fields
  ``worker_id``, ``task_id``, ``task_type``, ``queue``, ``attempt``, ``status``, ``duration_ms``,
  ``event_type`` (plus ``request_id``, ``actor``, ``action`` on the API's audit lines, and
  ``exc_type``/``exception`` for a logged exception).
- otherwise a readable line: ``<timestamp> <LEVEL> <service>[<worker id>] <logger>: <message>``
  followed by ``key=value`` for the fields that apply.

Where the fields come from: ``extra={...}`` of a log call, the fields bound to the current
context with :func:`bind` (the worker binds a task's fields for the asyncio task that runs it,
so a handler's own log lines carry them too), and the process's fields given to
:func:`configure_logging` or :func:`set_process_fields` (``worker_id``).

Safety: newlines and other control characters in logged values are escaped (``\\n``, ``\\x1b``)
so a value can never start a forged line; a plain-mode traceback keeps its lines but every one
is prefixed with ``  | ``. The API key and the Redis password of the settings are replaced by
``***`` wherever they would appear. dtq never logs payloads: the fields above are the only
structured values, and no dtq log call formats a payload into a message.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sys
import traceback
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from datetime import UTC, datetime
from types import MappingProxyType
from typing import IO, Any
from urllib.parse import urlsplit

from dtq.config import Settings

__all__ = [
    "CONTRACT_FIELDS",
    "JsonFormatter",
    "PlainFormatter",
    "bind",
    "bound",
    "configure_logging",
    "escape",
    "set_process_fields",
]

CONTRACT_FIELDS = (
    "worker_id",
    "task_id",
    "task_type",
    "queue",
    "attempt",
    "status",
    "duration_ms",
    "event_type",
)
"""The structured fields of contract section 13, in output order."""

EXTRA_FIELDS = ("request_id", "actor", "action")
"""Other structured fields a log call may pass in ``extra`` (the API's audit lines)."""

_FIELDS = CONTRACT_FIELDS + EXTRA_FIELDS
_INT_FIELDS = frozenset({"attempt", "duration_ms"})
_MARK = "_dtq_handler"  # set on the handler configure_logging installs

_EMPTY: Mapping[str, Any] = MappingProxyType({})
_context: ContextVar[Mapping[str, Any]] = ContextVar("dtq_log_fields", default=_EMPTY)

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# json.dumps escapes C0 controls itself; these are legal raw in JSON but split lines for some
# readers (str.splitlines, JavaScript), so they are escaped too.
_JSON_UNSAFE = re.compile(r"[\x7f-\x9f\u2028\u2029]")


def escape(text: str) -> str:
    """``text`` with every control character (newlines included) written as an escape."""

    def one(m: re.Match[str]) -> str:
        ch = m.group()
        named = _NAMED.get(ch)
        if named is not None:
            return named
        code = ord(ch)
        return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"

    return _CONTROL.sub(one, text)


def bind(**fields: Any) -> None:
    """Add fields to every log line of the current context (an asyncio task has its own copy,
    so fields bound inside a task end with it)."""
    _context.set(MappingProxyType({**_context.get(), **fields}))


@contextlib.contextmanager
def bound(**fields: Any) -> Iterator[None]:
    """Fields for the log lines inside the ``with`` block only."""
    token = _context.set(MappingProxyType({**_context.get(), **fields}))
    try:
        yield
    finally:
        _context.reset(token)


SECRET_MIN_CHARS = 4  # shorter values are not secrets worth garbling every line for


def _secrets(settings: Settings) -> list[str]:
    out = [settings.api_key, settings.redis_sentinel_password]
    with contextlib.suppress(ValueError):  # a URL urllib cannot split has no password to hide
        out.append(urlsplit(settings.redis_url).password or "")
    return sorted((s for s in out if len(s) >= SECRET_MIN_CHARS), key=len, reverse=True)


class _Base(logging.Formatter):
    def __init__(self, service: str, fields: Mapping[str, Any], secrets: list[str]) -> None:
        super().__init__()
        self.service = service
        self.process_fields = dict(fields)
        self.secrets = secrets

    def redact(self, text: str) -> str:
        for secret in self.secrets:
            if secret in text:
                text = text.replace(secret, "***")
        return text

    def fields(self, record: logging.LogRecord) -> dict[str, Any]:
        """The structured fields of a record: its extras win over the context's, which win
        over the process's."""
        ctx = _context.get()
        out: dict[str, Any] = {}
        for name in _FIELDS:
            value = record.__dict__.get(name)
            if value is None:
                value = ctx.get(name)
            if value is None:
                value = self.process_fields.get(name)
            if value is None or value == "":
                continue
            if name in _INT_FIELDS:
                try:
                    value = int(value)
                except (TypeError, ValueError):
                    value = self.redact(str(value))
            else:
                value = self.redact(str(value))
            out[name] = value
        return out

    @staticmethod
    def timestamp(record: logging.LogRecord) -> str:
        dt = datetime.fromtimestamp(record.created, tz=UTC)
        return dt.isoformat(timespec="milliseconds").replace("+00:00", "Z")

    def message(self, record: logging.LogRecord) -> str:
        return self.redact(record.getMessage())

    def exception_text(self, record: logging.LogRecord) -> str | None:
        if record.exc_info and record.exc_info[0] is not None:
            return self.redact("".join(traceback.format_exception(*record.exc_info)).rstrip())
        if record.stack_info:
            return self.redact(record.stack_info)
        return None


class JsonFormatter(_Base):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "timestamp": self.timestamp(record),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": self.message(record),
        }
        out.update(self.fields(record))
        exc = self.exception_text(record)
        if exc is not None:
            if record.exc_info and record.exc_info[0] is not None:
                out["exc_type"] = record.exc_info[0].__name__
            out["exception"] = exc
        line = json.dumps(out, ensure_ascii=False, separators=(",", ":"), default=str)
        return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", line)


class PlainFormatter(_Base):
    """``<timestamp> <LEVEL> <service>[<worker id>] <logger>: <message> key=value ...``"""

    def format(self, record: logging.LogRecord) -> str:
        fields = self.fields(record)
        who = self.service
        worker = fields.pop("worker_id", None)
        if worker is not None:
            who = f"{who}[{escape(str(worker))}]"
        line = (
            f"{self.timestamp(record)} {record.levelname:<7} {who} {record.name}: "
            f"{escape(self.message(record))}"
        )
        if fields:
            line += "  " + " ".join(f"{k}={escape(str(v))}" for k, v in fields.items())
        exc = self.exception_text(record)
        if exc is not None:
            line += "".join(f"\n  | {escape(part)}" for part in exc.split("\n"))
        return line


def configure_logging(
    settings: Settings,
    service: str,
    *,
    stream: IO[str] | None = None,
    **process_fields: Any,
) -> logging.Handler:
    """Send every log record of the process to ``stream`` (stderr) in the configured format,
    at ``DTQ_LOG_LEVEL``. Calling it again replaces the handler it installed before (other
    handlers, such as pytest's, are left alone). Returns the handler."""
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, _MARK, False):
            root.removeHandler(old)
            old.close()
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    formatter_cls = JsonFormatter if settings.log_json else PlainFormatter
    handler.setFormatter(formatter_cls(service, process_fields, _secrets(settings)))
    setattr(handler, _MARK, True)
    root.addHandler(handler)
    root.setLevel(settings.log_level)
    logging.captureWarnings(True)  # Python warnings become records too: one format on stderr
    return handler


def set_process_fields(**fields: Any) -> None:
    """Add fields (e.g. ``worker_id`` once it is known) to every line of the process."""
    for handler in logging.getLogger().handlers:
        formatter = handler.formatter
        if getattr(handler, _MARK, False) and isinstance(formatter, _Base):
            formatter.process_fields.update(fields)
