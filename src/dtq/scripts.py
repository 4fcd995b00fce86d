"""Loads the Lua scripts once and calls them by SHA.

Each ``lua/<name>.lua`` is one atomic operation; ``lua/_lib.lua`` is prepended to each. Calls go
out as EVALSHA; after a NOSCRIPT reply (a restarted or flushed Redis) the scripts are loaded
again and only the calls that did not run are sent again, so nothing runs twice. A single call
is a plain EVALSHA (no pipeline machinery); a batch is one write of all its EVALSHAs on one
pooled connection and its replies read in order: one round trip, no SCRIPT EXISTS before it
(as redis-py's pipeline would add), no timer per reply.

On a Redis Cluster (a :class:`redis.asyncio.RedisCluster`, ``DTQ_REDIS_CLUSTER``) each call
goes to the primary of its keys' slot (every script's keys share one slot: :mod:`dtq.keys`); a
batch is split by node, each node's share written on one of its connections, the nodes
concurrently. A MOVED or ASK reply means the call did not run: it is sent again where the
cluster says (MOVED also updates the slot table); a lost connection refreshes the slot table
before it is raised (a failover moved the slot, and the next call goes to the new primary).

A call is sent at most once. Once its bytes may have reached Redis, a lost connection or a
timeout is raised to the caller, never retried, whatever retry policy the client was built
with (redis-py's ``execute_command`` would send the EVALSHA again, and submit, start,
claim_due or cancel run twice); only connecting, before anything is written, follows it.
dtq's own clients pin retries off as well (:func:`dtq.connection.no_retry`).

The calls of a batch to a script in :data:`BATCHED` (start, finish: one per entry of a worker's
read or finish batch) go as one EVALSHA of ``<name>_batch`` per slot and up to
:data:`BATCH_MAX` calls: that script runs the named script's body once per call, in order, each
with its own keys and args and its own reply or error (``lua/_batch.lua``), so each call keeps
its checks and writes while the per-EVALSHA cost in Redis is paid once. ``on_call`` still
hears of each call by its own name.

:meth:`Scripts.call_many_wait` sends ``WAIT numreplicas timeout`` after the calls, in the same
write on the same connection: WAIT waits until replicas acknowledge the last write of the
connection it runs on, so it must follow the scripts there, and it costs no round trip of its
own.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
from collections.abc import Callable, Sequence
from importlib import resources
from operator import itemgetter
from typing import Any

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import (
    AskError,
    MovedError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dtq.keys import slot

__all__ = ["SCRIPT_NAMES", "Call", "Scripts", "WaitError"]

SCRIPT_NAMES = (
    "submit",
    "read",
    "start",
    "finish",
    "touch",
    "adopt",
    "claim_due",
    "promote",
    "expire",
    "cancel",
    "dlq_requeue",
    "dlq_discard",
    "dlq_purge",
    "set_paused",
    "purge_queue",
    "lock",
    "drop_consumers",
    "remove_queue",
    "recover",
    "fire",
    "schedule_put",
    "schedule_set",
    "wait",
    "progress",
    "limit_put",
    "limit_delete",
    "fair_move",
    "limit_sweep",
    "workflow",
)

# Scripts that run another script's code as a local function: fire.lua makes a tick's task
# with submit.lua's code, called as run_submit(KEYS, ARGV) (the parameters shadow the globals).
EMBEDS = {"fire": ("run_submit", "submit")}

# Scripts whose calls a batch packs into one call of "<name>_batch" (see the module's doc).
BATCHED = ("start", "finish")
BATCH_MAX = 64  # calls per batched script call: bounds how long one EVALSHA holds Redis

Call = tuple[str, Sequence[str], Sequence[Any]]
"""(script name, keys, args) of one script call."""

OpHook = Callable[[str, bool], None]


class WaitError(ResponseError):
    """Redis refused the WAIT that followed a batch (renamed, disabled or denied by an ACL):
    the scripts ran, and their replies are in ``results``."""

    def __init__(self, message: str, results: list[Any]) -> None:
        super().__init__(message)
        self.results = results


def _read(name: str) -> str:
    return resources.files("dtq").joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")


class Scripts:
    """The compiled set of dtq scripts, shared by every client of one process."""

    def __init__(self, on_call: OpHook | None = None) -> None:
        lib = _read("_lib")
        self.source: dict[str, str] = {}
        self.sha: dict[str, str] = {}
        for name in SCRIPT_NAMES:
            src = lib + "\n" + _read(name)
            if name in EMBEDS:
                fn, inner = EMBEDS[name]
                body = _read(name)
                src = f"{lib}\nlocal function {fn}(KEYS, ARGV)\n{_read(inner)}\nend\n{body}"
            self.source[name] = src
            if name in BATCHED:
                self.source[f"{name}_batch"] = (
                    f"{lib}\nlocal function run_one(KEYS, ARGV)\n{_read(name)}\nend\n"
                    + _read("_batch")
                )
        for name, src in self.source.items():
            self.sha[name] = hashlib.sha1(src.encode(), usedforsecurity=False).hexdigest()
        self._on_call = on_call

    async def load(self, redis: Redis | RedisCluster) -> None:
        if isinstance(redis, RedisCluster):  # SCRIPT LOAD goes to every primary
            for src in self.source.values():
                await redis.script_load(src)
            return
        pipe = redis.pipeline(transaction=False)
        for src in self.source.values():
            pipe.script_load(src)
        await pipe.execute()

    async def call(self, redis: Redis, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """One script call, a plain EVALSHA (no pipeline); raises what the script raised."""
        return await self._call_one(redis, name, keys, args)

    async def _call_one(
        self, redis: Redis, name: str, keys: Sequence[str], args: Sequence[Any]
    ) -> Any:
        if isinstance(redis, RedisCluster):
            (reply,) = await self._cluster_calls(redis, [(name, keys, args)])
            if self._on_call is not None:
                self._on_call(name, not isinstance(reply, ResponseError))
            if isinstance(reply, ResponseError):
                raise reply
            return reply
        command = ("EVALSHA", self.sha[name], len(keys), *keys, *args)
        # On a pooled connection of its own, not through execute_command: that retries by the
        # client's policy, and it would count the call in a per-command metrics hook
        # (dtq.metrics.count_commands), where a script call is reported once, by name,
        # through ``on_call``.
        try:
            try:
                result = await _send_once(redis, command)
            except ResponseError as err:
                if not _is_noscript(err):
                    raise
                await self.load(redis)  # NOSCRIPT: the call did not run; send it again
                result = await _send_once(redis, command)
        except ResponseError:
            if self._on_call is not None:
                self._on_call(name, False)
            raise
        if self._on_call is not None:
            self._on_call(name, True)
        return result

    async def call_many(self, redis: Redis, calls: Sequence[Call]) -> list[Any]:
        """All calls in one round trip. Each result is the reply or the exception for that
        call. A lone call is a plain EVALSHA (an idle worker's wake-up, a single submit or
        finish): no pipeline machinery on its way. Calls to a :data:`BATCHED` script are
        packed, per slot, into calls of its batched form (the module's doc)."""
        if not calls:
            return []
        if len(calls) == 1:
            try:
                return [await self._call_one(redis, *calls[0])]
            except ResponseError as exc:  # the script's error, for that call alone
                return [exc]
        units, packed = _pack(calls, isinstance(redis, RedisCluster))
        if isinstance(redis, RedisCluster):
            sent = await self._cluster_calls(redis, units)
        else:
            sent = await self._send(redis, units)
            missing = [i for i, r in enumerate(sent) if isinstance(r, NoScriptError)]
            if missing:
                await self.load(redis)
                again = await self._send(redis, [units[i] for i in missing])
                for i, r in zip(missing, again, strict=True):
                    sent[i] = r
        results = _unpack(len(calls), packed, sent)
        if self._on_call is not None:
            for (name, _, _), r in zip(calls, results, strict=True):
                self._on_call(name, not isinstance(r, Exception))
        return results

    async def call_many_wait(
        self, redis: Redis, calls: Sequence[Call], replicas: int, timeout_ms: int
    ) -> tuple[list[Any], int]:
        """:meth:`call_many`, then ``WAIT replicas timeout_ms`` on the same connection in the
        same write; returns the results and how many replicas acknowledged every write the
        calls made (fewer than ``replicas`` once the timeout passed). Calls sent again after a
        NOSCRIPT reply go out with a WAIT of their own (perhaps on another connection): the
        count is the smaller of the two. A refused WAIT raises :class:`WaitError`."""
        if not calls:
            return [], replicas
        wait = ("WAIT", replicas, timeout_ms)
        if isinstance(redis, RedisCluster):  # a WAIT after each node's share, on its connection
            results, waits = await self._cluster_exchange(redis, calls, wait)
            if self._on_call is not None:
                for (name, _, _), r in zip(calls, results, strict=True):
                    self._on_call(name, not isinstance(r, Exception))
            refused = next((w for w in waits if isinstance(w, Exception)), None)
            if refused is not None:
                raise WaitError(f"WAIT after the scripts was refused: {refused}", results)
            return results, min(int(w) for w in waits)
        results = await self._send(redis, calls, wait)
        acked = results.pop()
        missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
        if missing:
            await self.load(redis)
            again = await self._send(redis, [calls[i] for i in missing], wait)
            acked_again = again.pop()
            for i, r in zip(missing, again, strict=True):
                results[i] = r
            if isinstance(acked_again, Exception):  # an error of either WAIT wins
                acked = acked_again
            elif not isinstance(acked, Exception):
                acked = min(acked, acked_again)
        if self._on_call is not None:
            for (name, _, _), r in zip(calls, results, strict=True):
                self._on_call(name, not isinstance(r, Exception))
        if isinstance(acked, ResponseError):
            raise WaitError(f"WAIT after the scripts was refused: {acked}", results)
        return results, int(acked)

    async def _send(
        self, redis: Redis, calls: Sequence[Call], wait: Sequence[Any] = ()
    ) -> list[Any]:
        """The calls on one pooled connection: one write, then every reply in order under one
        socket timeout. A redis-py pipeline arms a timer per reply and adds per-call
        bookkeeping (~10 us of a worker's CPU per task). A lost connection or a timeout is
        raised, never retried: some of the calls may have run. ``wait``: a WAIT command sent
        after the calls (its reply, or error, is the last result; the timeout is the socket's
        plus WAIT's own)."""
        commands: list[Sequence[Any]] = [
            ("EVALSHA", self.sha[n], len(k), *k, *a) for n, k, a in calls
        ]
        extra_s = 0.0
        if wait:
            commands.append(wait)
            extra_s = int(wait[2]) / 1000
        pool = redis.connection_pool
        conn: AbstractConnection = await pool.get_connection()  # type: ignore[no-untyped-call]
        try:
            results = await _exchange(conn, commands, extra_s)
        finally:
            await pool.release(conn)
        return [
            NoScriptError(str(r)) if isinstance(r, ResponseError) and _is_noscript(r) else r
            for r in results
        ]

    async def _cluster_calls(self, redis: RedisCluster, calls: Sequence[Call]) -> list[Any]:
        """``calls`` on a cluster: each to its slot's primary, one write per node, the nodes
        concurrently; again where a MOVED or ASK reply says (the call did not run), or after
        loading the scripts on a NOSCRIPT. A lost connection is raised (some calls may have
        run) once the slot table is refreshed."""
        results, _ = await self._cluster_exchange(redis, calls)
        return results

    async def _cluster_exchange(
        self, redis: RedisCluster, calls: Sequence[Call], wait: Sequence[Any] = ()
    ) -> tuple[list[Any], list[Any]]:
        """:meth:`_cluster_calls`, each node's write ended by ``wait`` (a WAIT) when given: the
        results, and the WAIT replies (or errors) of every node write."""
        waits: list[Any] = []
        if not redis.nodes_manager.slots_cache:
            await redis.initialize()
        results: list[Any] = [None] * len(calls)
        todo: list[tuple[int, ClusterNode | None]] = [(i, None) for i in range(len(calls))]
        for _ in range(_REDIRECTS):
            groups: dict[str, tuple[ClusterNode, bool, list[int]]] = {}
            for i, asked in todo:
                node = asked or redis.nodes_manager.get_node_from_slot(slot(calls[i][1][0]))
                group = groups.setdefault(
                    f"{node.name}:{asked is not None}", (node, asked is not None, [])
                )
                group[2].append(i)
            sent = await asyncio.gather(
                *(
                    self._node_send(node, ask, [calls[i] for i in idx], wait)
                    for node, ask, idx in groups.values()
                ),
                return_exceptions=True,
            )
            failed = next((r for r in sent if isinstance(r, BaseException)), None)
            if failed is not None:
                if isinstance(failed, (RedisConnectionError, RedisTimeoutError, OSError)):
                    # Best effort: a refresh that fails (no node answers, or the slots are not
                    # all served yet) must not hide the lost connection.
                    with contextlib.suppress(RedisError, RedisClusterException, OSError):
                        await redis.nodes_manager.initialize()
                raise failed
            todo = []
            noscript = False
            for (_, _, idx), replies in zip(groups.values(), sent, strict=True):
                assert isinstance(replies, list)
                if wait:
                    waits.append(replies.pop())
                for i, r in zip(idx, replies, strict=True):
                    if isinstance(r, MovedError):
                        await redis.nodes_manager.move_slot(r)
                        todo.append((i, None))
                    elif isinstance(r, AskError):
                        target = redis.nodes_manager.get_node(host=r.host, port=r.port)
                        todo.append((i, target))
                    elif isinstance(r, ResponseError) and _is_noscript(r):
                        noscript = True
                        todo.append((i, None))
                    else:
                        results[i] = r
            if noscript:
                await self.load(redis)
            if not todo:
                return results, waits
        raise RedisConnectionError(
            f"{len(todo)} script calls still redirected after {_REDIRECTS} tries"
        )

    async def _node_send(
        self, node: ClusterNode, asking: bool, calls: Sequence[Call], wait: Sequence[Any] = ()
    ) -> list[Any]:
        """``calls`` on one connection of ``node`` (after ASKING, for an ASK redirection), one
        write, their replies in order; ``wait`` (a WAIT) after them, its reply last."""
        commands: list[Sequence[Any]] = []
        for n, k, a in calls:
            if asking:
                commands.append(("ASKING",))
            commands.append(("EVALSHA", self.sha[n], len(k), *k, *a))
        extra_s = 0.0
        if wait:
            commands.append(wait)
            extra_s = int(wait[2]) / 1000
        conn = node.acquire_connection()
        try:
            replies = await _exchange(conn, commands, extra_s)
        except AttributeError as exc:
            if conn.is_connected:
                raise
            # Closed while in use: redis-py's cluster client disconnects every connection of
            # every node, those in use too, when a command of its own meets CLUSTERDOWN (a
            # failover under way). A lost connection: the calls may have run.
            raise RedisConnectionError(f"connection to {node.name} closed while in use") from exc
        except BaseException:
            await conn.disconnect(nowait=True)
            raise
        finally:
            node.release(conn)
        if asking:
            tail = [replies.pop()] if wait else []
            return [*replies[1::2], *tail]
        return replies


Packed = list[tuple[int, ...] | int]
"""For each call :func:`_pack` made, the index of the call it is, or (a batched call) the
indexes of the calls it stands for, in order."""


def _pack(calls: Sequence[Call], cluster: bool) -> tuple[Sequence[Call], Packed | None]:
    """The calls to send for ``calls``: each call to a :data:`BATCHED` script joins the others
    to that script (of its slot, on a cluster) in one call of ``<name>_batch``, up to
    :data:`BATCH_MAX` each; any other call, or one alone of its kind, goes as it is. None for
    the second: nothing was packed, the calls go as they are."""
    groups: dict[tuple[str, int], list[int]] = {}
    for i, (name, k, _) in enumerate(calls):
        if name in BATCHED:
            groups.setdefault((name, slot(k[0]) if cluster else 0), []).append(i)
    if all(len(idx) == 1 for idx in groups.values()):
        return calls, None
    units: list[Call] = []
    packed: Packed = []
    for i, call in enumerate(calls):
        if call[0] not in BATCHED:
            units.append(call)
            packed.append(i)
    for (name, _), idx in groups.items():
        for at in range(0, len(idx), BATCH_MAX):
            chunk = idx[at : at + BATCH_MAX]
            if len(chunk) == 1:
                units.append(calls[chunk[0]])
                packed.append(chunk[0])
                continue
            units.append(_batch_call(name, [calls[i] for i in chunk]))
            packed.append(tuple(chunk))
    return units, packed


def _shared(rows: Sequence[Sequence[Any]]) -> tuple[list[int], list[Any], list[list[Any]]]:
    """The positions (0-based) at which every row holds the same value (of the same type), up
    to the shortest row; those values; and each row without them."""
    cols = list(zip(*rows, strict=False))  # the shortest row's length
    n = len(rows)
    at = [
        j
        for j, col in enumerate(cols)
        if col.count(col[0]) == n and len({type(v) for v in col}) == 1
    ]
    if not at:
        return at, [], [list(r) for r in rows]
    values = [cols[j][0] for j in at]
    skip = set(at)
    keep = [j for j in range(len(cols)) if j not in skip]
    width = len(cols)
    if not keep:
        return at, values, [list(r[width:]) for r in rows]
    if len(keep) == 1:
        j = keep[0]
        return at, values, [[r[j], *r[width:]] for r in rows]
    get = itemgetter(*keep)
    return at, values, [[*get(r), *r[width:]] for r in rows]


def _batch_call(name: str, calls: Sequence[Call]) -> Call:
    """One call of ``<name>_batch`` for ``calls`` (lua/_batch.lua has the layout): the keys
    and args every call has at the same place sent once, the rest per call."""
    kat, kval, kown = _shared([c[1] for c in calls])
    aat, aval, aown = _shared([c[2] for c in calls])
    all_keys: list[Any] = list(kval)
    argv: list[Any] = [len(calls), len(kat), len(aat)]
    argv += [j + 1 for j in kat]
    argv += [j + 1 for j in aat]
    argv += aval
    for k, a in zip(kown, aown, strict=True):
        argv += (len(k), len(a))
    for k in kown:
        all_keys += k
    for a in aown:
        argv += a
    return (f"{name}_batch", all_keys, argv)


def _unpack(n: int, packed: Packed | None, sent: list[Any]) -> list[Any]:
    """The result of each of ``n`` calls from the replies to the calls :func:`_pack` made: a
    batched call's reply is its calls' replies in order; an error of the whole batched call
    (it did not run, or Redis refused it) is each of its calls' error."""
    if packed is None:
        return sent
    results: list[Any] = [None] * n
    for at, reply in zip(packed, sent, strict=True):
        if isinstance(at, int):
            results[at] = reply
        elif isinstance(reply, Exception):
            for i in at:
                results[i] = reply
        else:
            for i, r in zip(at, reply, strict=True):
                results[i] = r
    return results


_REDIRECTS = 5  # MOVED / ASK / NOSCRIPT rounds a cluster batch follows before giving up


async def _send_once(redis: Redis, command: Sequence[Any]) -> Any:
    """One command on a pooled connection, sent once; its reply, or the error it raised (a
    connection that failed, or was cancelled, mid-exchange is dropped by redis-py first)."""
    pool = redis.connection_pool
    conn: AbstractConnection = await pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        await conn.send_packed_command(conn.pack_command(*command))
        return await conn.read_response()
    finally:
        await pool.release(conn)


async def _exchange(
    conn: AbstractConnection, commands: Sequence[Sequence[Any]], extra_s: float = 0.0
) -> list[Any]:
    """Every command in one write, every reply in order, within the socket timeout (plus
    ``extra_s``, the time a command may block in Redis on purpose, as WAIT does)."""
    await conn.send_packed_command(conn.pack_commands(commands))
    replies: list[Any] = []
    limit = conn.socket_timeout
    if limit is not None:
        limit += extra_s
    try:
        async with asyncio.timeout(limit):
            for _ in commands:
                try:  # math.inf: no timer per reply (the one above bounds them all)
                    replies.append(await conn.read_response(timeout=math.inf))
                except ResponseError as exc:
                    replies.append(exc)
    except TimeoutError:
        await conn.disconnect(nowait=True)  # replies still unread: the connection is unusable
        raise RedisTimeoutError(f"timeout reading {len(commands)} script replies") from None
    return replies


def _is_noscript(err: ResponseError) -> bool:
    return isinstance(err, NoScriptError) or str(err).startswith("NOSCRIPT")
