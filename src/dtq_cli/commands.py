"""The dispatch table: each parsed ``cmd`` name to the function that runs it."""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable

from dtq.client import connect
from dtq.config import Settings
from dtq_cli import admin_cmd, limit_cmd, run_cmd, schedule_cmd, tasks_cmd, workflow_cmd
from dtq_cli.context import Ctx
from dtq_cli.output import Output
from dtq_tasks import load_task_types

__all__ = ["PROCESS_COMMANDS", "REDIS_COMMANDS", "SUBMIT_COMMANDS", "with_queue"]

RedisCommand = Callable[[Ctx], Awaitable[int]]
ProcessCommand = Callable[[argparse.Namespace, Settings, Output], int]

REDIS_COMMANDS: dict[str, RedisCommand] = {
    "submit": tasks_cmd.submit,
    "get": tasks_cmd.get,
    "status": tasks_cmd.status,
    "wait": tasks_cmd.wait,
    "list": tasks_cmd.list_tasks,
    "history": tasks_cmd.history,
    "cancel": tasks_cmd.cancel,
    "expire": tasks_cmd.expire,
    "dlq.list": admin_cmd.dlq_list,
    "dlq.retry": admin_cmd.retry_dlq,
    "dlq.discard": admin_cmd.discard_dlq,
    "dlq.purge": admin_cmd.purge_dlq,
    "purge": admin_cmd.purge_queue,
    "queue.pause": admin_cmd.pause,
    "queue.resume": admin_cmd.resume,
    "queue.stats": admin_cmd.stats,
    "schedule.add": schedule_cmd.add,
    "schedule.update": schedule_cmd.update,
    "schedule.list": schedule_cmd.list_schedules,
    "schedule.show": schedule_cmd.show,
    "schedule.pause": schedule_cmd.pause,
    "schedule.resume": schedule_cmd.resume,
    "schedule.remove": schedule_cmd.remove,
    "schedule.trigger": schedule_cmd.trigger,
    "schedule.next": schedule_cmd.next_times,
    "limit.set": limit_cmd.set_limit,
    "limit.list": limit_cmd.list_limits,
    "limit.show": limit_cmd.show,
    "limit.remove": limit_cmd.remove,
    "workflow.submit": workflow_cmd.submit,
    "workflow.show": workflow_cmd.show,
    "workflow.cancel": workflow_cmd.cancel,
}
# Commands that submit, or store a template that will: they check task types against
# DTQ_TASK_MODULES, as the API does.
SUBMIT_COMMANDS = frozenset({"submit", "schedule.add", "schedule.update", "workflow.submit"})
PROCESS_COMMANDS: dict[str, ProcessCommand] = {
    "worker.run": run_cmd.worker_run,
    "api": run_cmd.api,
    "dev": run_cmd.dev,
}


async def with_queue(
    command: RedisCommand, args: argparse.Namespace, settings: Settings, out: Output
) -> int:
    """Connect (RedisUnavailableError names the URL if that fails), run, close. A submit
    command first imports the task modules (ConfigError if one cannot be imported)."""
    known_types, payload_models = None, None
    if args.cmd in SUBMIT_COMMANDS:
        known_types, payload_models = load_task_types(settings)
    queue = await connect(settings=settings, known_types=known_types, payload_models=payload_models)
    try:
        return await command(Ctx(queue, args, out))
    finally:
        await queue.close()
