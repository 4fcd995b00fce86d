"""A worker whose connections lose replies, for the dropped-replies scenario
(``chaos_worker.py`` runs it when ``CHAOS_LOSE_REPLIES=<probability>`` is set).

Each write to Redis that holds a script call (``EVALSHA``) or a read (``XREADGROUP``) loses,
with that probability, its last reply: Redis ran every command of the write and answered, then
the connection is closed and the reply never arrives, as when the network drops a connection
at the worst moment (``tests/support/wire.py`` does the same, once, for the integration
tests). Every loss is logged on standard error as ``chaos-wire: lost the reply of <what>``,
where ``what`` names each command of the write (a script by its name).

Only the worker's asyncio client loses replies: the heartbeat thread's own connection does not.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import sys
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.connection import Connection, ConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError

# The head of one command of a write: its argument count, then its name.
_COMMAND = re.compile(rb"\*\d+\r\n\$\d+\r\n([A-Za-z]+)\r\n(?:\$\d+\r\n([0-9a-f]{40})\r\n)?")
_LOSABLE = (b"EVALSHA", b"XREADGROUP")


class LossyConnection(Connection):
    """Loses the last reply of a write of script calls or reads with probability ``p``."""

    p = 0.0
    rng = random.Random(0)
    script_names: dict[str, str] = {}

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        chunks = [command] if isinstance(command, bytes | str) else list(command)
        data = b"".join(c for c in chunks if isinstance(c, bytes | bytearray))
        heads = _COMMAND.findall(data)
        cls = type(self)
        self._lose_after = 0
        self._what = ""
        if any(name.upper() in _LOSABLE for name, _ in heads) and cls.rng.random() < cls.p:
            self._lose_after = len(heads)
            self._what = " ".join(
                cls.script_names.get(sha.decode(), "script") if sha else name.decode().upper()
                for name, sha in heads
            )
        await super().send_packed_command(chunks, check_health)

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        reply = await super().read_response(*args, **kwargs)
        if getattr(self, "_lose_after", 0):
            self._lose_after -= 1
            if not self._lose_after:  # every command of the write has run and answered
                print(f"chaos-wire: lost the reply of {self._what}", file=sys.stderr, flush=True)
                await self.disconnect()
                raise RedisConnectionError("chaos: connection lost before the reply was read")
        return reply


def lossy_client(url: str) -> Redis:
    """The worker's client (decoded strings, no retries, as ``dtq.worker.connection``), on
    :class:`LossyConnection`; no health-check PING, whose reply would count as one of a write's."""
    from dtq.connection import no_retry

    pool = ConnectionPool.from_url(
        url,
        connection_class=LossyConnection,
        decode_responses=True,
        socket_connect_timeout=5,
        socket_timeout=10,
        health_check_interval=0,
        retry=no_retry(),
    )
    return Redis.from_pool(pool)


def run_lossy_worker(argv: list[str]) -> int:
    from dtq.config import load_settings
    from dtq.log import configure_logging
    from dtq.scripts import Scripts
    from dtq.worker import Worker
    from dtq_cli.parser import build_parser
    from dtq_tasks import load_task_modules

    LossyConnection.p = float(os.environ["CHAOS_LOSE_REPLIES"])
    LossyConnection.rng = random.Random(os.environ.get("CHAOS_LOSE_SEED", "0"))
    LossyConnection.script_names = {sha: name for name, sha in Scripts().sha.items()}
    args = build_parser().parse_args(["worker", "run", *argv])
    settings = load_settings()
    configure_logging(settings, "worker")
    handlers = load_task_modules(args.task_modules or settings.task_module_list).handlers

    async def serve() -> None:
        worker = Worker(
            settings,
            queues=args.queues or ["default"],
            concurrency=args.concurrency,
            handlers=handlers,
            redis=lossy_client(settings.redis_url),
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.stop)
        await worker.run()

    asyncio.run(serve())
    return 0
