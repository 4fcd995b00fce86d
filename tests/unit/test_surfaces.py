"""The surfaces that mirror the Queue stay in step with it: the submit options of the SDK, the
HTTP body and the CLI's flags are one list; SyncQueue has every async method of Queue, with
the same parameters."""

from __future__ import annotations

import argparse
import inspect

from dtq.client import Queue, SyncQueue
from dtq.models import SUBMIT_OPTIONS, SubmitItem, SubmitRequest
from dtq_cli.parser import build_parser

SDK_ONLY = {"ttl"}  # a timedelta: the body and the CLI say it in seconds or as a duration


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[name]
            return found
    raise AssertionError(f"no subcommand {name!r}")


def test_submit_options_are_the_fields_of_the_request_model() -> None:
    assert set(SubmitRequest.model_fields) == {"task_type", "payload"} | (SUBMIT_OPTIONS - SDK_ONLY)
    assert set(SubmitItem.__annotations__) == SUBMIT_OPTIONS | {"task_type", "payload"}


def test_every_submit_option_is_a_flag_of_dtq_submit() -> None:
    """The submit command passes every parsed value named like an option: each option has
    one flag whose dest is its name (the CLI's --ttl is a duration: the SDK's ttl)."""
    submit = _subparser(build_parser(), "submit")
    dests = {a.dest for a in submit._actions}
    assert SUBMIT_OPTIONS - {"ttl_seconds"} <= dests
    assert {"task_type", "payload"} <= dests


def test_sync_queue_has_every_async_method_of_queue_with_its_signature() -> None:
    public_async = {
        name
        for name, fn in inspect.getmembers(Queue, inspect.iscoroutinefunction)
        if not name.startswith("_")
    }
    assert public_async  # the check looks at something
    missing = {name for name in public_async if not hasattr(SyncQueue, name)}
    assert missing == set(), f"SyncQueue lacks {sorted(missing)}"
    for name in public_async - {"close"}:
        sync, async_ = getattr(SyncQueue, name), getattr(Queue, name)
        assert not inspect.iscoroutinefunction(sync), name
        assert inspect.signature(sync) == inspect.signature(async_), name


def test_the_list_bound_is_what_the_lists_hold() -> None:
    """check_list_limit's bound is the size of the recent-tasks index and of the DLQ and audit
    reads: a larger limit could not return more."""
    from dtq.admin._common import LIST_CAP
    from dtq.models import LIST_LIMIT_MAX
    from dtq.store import RECENT_CAP

    assert LIST_LIMIT_MAX == RECENT_CAP == LIST_CAP
