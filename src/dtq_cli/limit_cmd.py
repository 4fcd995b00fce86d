"""Limit commands: set, list, show, remove (docs/cli.md, "Limits"; the semantics are
docs/limits.md's), and their argparse tree.

Everything goes through the SDK's limit methods (:class:`dtq.client.Queue`), which own the
rules: a bad rate, key or count comes back as LimitSpecError (INVALID_LIMIT, exit 2), an
unknown limit as LimitNotFoundError (exit 1). The changes are audited as
``cli:<user>@<host>``; ``remove`` asks for the limit's name unless --yes.
"""

from __future__ import annotations

import argparse
from typing import Any

from dtq.admin.limits import Limit
from dtq_cli import inputs
from dtq_cli.admin_cmd import confirm
from dtq_cli.context import Ctx
from dtq_cli.flags import json_flag, sub, yes_flag

__all__ = ["DEFINITION_FLAGS", "add_commands", "list_limits", "remove", "set_limit", "show"]

# The dests of set's flags: the LimitDef fields an operator gives (a test keeps them in step).
DEFINITION_FLAGS = ("queue", "task_type", "key", "rate", "burst", "concurrency")


def _name(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", type=inputs.limit_name, help="the limit's name")


def add_commands(subs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub(
        subs,
        "limit",
        "Rate and concurrency limits, per queue, task type or payload key, applied by every worker",
        "  dtq limit set charge --queue payments --task-type charge --rate 100/s --burst 20\n"
        "  dtq limit list",
    )
    ls = p.add_subparsers(dest="limit_command", metavar="<limit command>", required=True)
    json_flag(p)

    p = sub(
        ls,
        "set",
        "Create a limit, or replace its definition",
        """\
          dtq limit set charge --task-type charge --rate 100/s --concurrency 20
          dtq limit set per-tenant --queue jobs --key payload.tenant_id --rate 5/s --burst 10
        """,
        """\
        The flags are the whole definition: a flag left out is not kept from a stored one.
        Give --rate, --concurrency or both. Every worker applies it within a second. Audited.
        """,
    )
    p.set_defaults(cmd="limit.set")
    _name(p)
    p.add_argument("--queue", metavar="Q", help="the queue whose tasks it limits (default: "
                   "default)")  # fmt: skip
    p.add_argument("--task-type", "--type", dest="task_type", metavar="T",
                   help="only tasks of this type (default: every task of the queue)")  # fmt: skip
    p.add_argument("--key", metavar="payload.PATH",
                   help="one limit per value of the payload at PATH (payload.id)")  # fmt: skip
    p.add_argument("--rate", metavar="N/PERIOD",
                   help="a smooth rate: 100/s, 5/m, 1000/h, 10/30s")  # fmt: skip
    p.add_argument("--burst", type=inputs.positive_int, metavar="N",
                   help="with --rate: N tasks at once at most (default 1)")  # fmt: skip
    p.add_argument("--concurrency", type=inputs.positive_int, metavar="N",
                   help="at most N tasks RUNNING at once")  # fmt: skip
    json_flag(p)

    p = sub(ls, "list", "List the limits with their use (running and waiting tasks)",
            "  dtq limit list --json")  # fmt: skip
    p.set_defaults(cmd="limit.list")
    json_flag(p)

    p = sub(ls, "show", "Show a limit: its definition and its use", "  dtq limit show charge")
    p.set_defaults(cmd="limit.show")
    _name(p)
    json_flag(p)

    p = sub(
        ls,
        "remove",
        "Delete a limit (tasks running under it still free their places)",
        "  dtq limit remove charge --yes",
        "Asks you to type the limit's name unless --yes. Audited.",
    )
    p.set_defaults(cmd="limit.remove")
    _name(p)
    yes_flag(p)
    json_flag(p)


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


def _use(limit: Limit) -> tuple[str, str]:
    capped = "+" if limit.use.capped else ""
    return f"{limit.use.running}{capped}", f"{limit.use.waiting}{capped}"


async def set_limit(ctx: Ctx) -> int:
    args = ctx.args
    fields: dict[str, Any] = {
        f: getattr(args, f) for f in DEFINITION_FLAGS if getattr(args, f) is not None
    }
    limit, outcome = await ctx.q.put_limit(args.name, fields, audit=ctx.audit())
    if ctx.json:
        ctx.out.json(
            {"name": limit.name, "outcome": outcome, "limit": limit.model_dump(mode="json")}
        )
        return 0
    text = {"created": "Created", "updated": "Updated"}.get(outcome)
    ctx.out.line(f"{text} limit {limit.name}." if text else f"Limit {limit.name} unchanged.")
    _fields(ctx, limit)
    return 0


async def list_limits(ctx: Ctx) -> int:
    limits = await ctx.q.list_limits()
    if ctx.json:
        docs = [x.model_dump(mode="json") for x in limits]
        ctx.out.json({"count": len(docs), "limits": docs})
        return 0
    if not limits:
        ctx.out.line("No limits.")
        return 0
    rows = [
        [x.name, x.queue, _dash(x.task_type), _dash(x.key), _dash(x.rate), _dash(x.burst),
         _dash(x.concurrency), *_use(x)]
        for x in limits
    ]  # fmt: skip
    headers = ["NAME", "QUEUE", "TASK_TYPE", "KEY", "RATE", "BURST", "CONCURRENCY", "RUNNING",
               "WAITING"]  # fmt: skip
    ctx.out.table(headers, rows)
    return 0


def _fields(ctx: Ctx, x: Limit) -> None:
    running, waiting = _use(x)
    pairs = [
        ("name", x.name),
        ("queue", x.queue),
        ("task_type", x.task_type or "- (every task of the queue)"),
        ("key", x.key or "-"),
        ("rate", _dash(x.rate) + (f" (burst {x.burst})" if x.burst else "")),
        ("concurrency", _dash(x.concurrency)),
        ("source", "code" if x.from_code else "api"),
        ("running", running),
        ("waiting", waiting),
    ]
    if x.use.keys is not None:
        pairs.append(("keys", f"{x.use.keys}{'+' if x.use.capped else ''} with state"))
    ctx.out.fields(pairs)


async def show(ctx: Ctx) -> int:
    limit = await ctx.q.get_limit(ctx.args.name)
    if ctx.json:
        ctx.out.json(limit.model_dump(mode="json"))
        return 0
    _fields(ctx, limit)
    if limit.from_code:
        ctx.out.note(
            f"note: limit {limit.name} is declared in code: the next worker that starts with "
            "that code puts the code's definition back"
        )
    return 0


async def remove(ctx: Ctx) -> int:
    name = ctx.args.name
    await ctx.q.get_limit(name)  # not found: refused before asking
    confirm(ctx, f"delete limit {name!r} (workers stop applying it within a second)", name)
    await ctx.q.delete_limit(name, audit=ctx.audit())
    if ctx.json:
        ctx.out.json({"name": name, "outcome": "deleted"})
    else:
        ctx.out.line(f"Deleted limit {name}.")
    return 0
