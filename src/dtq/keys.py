"""Every Redis key and channel name dtq uses; nowhere else writes ``"dtq:"``.

Two layouts, chosen once per process by :func:`use_layout` (``DTQ_REDIS_CLUSTER``; the SDK,
the worker and the API call it when they connect):

- **flat** (the default): exactly the contract's names (section 2), plus the deliberate
  extensions of DESIGN 6 and 7 and the payload key of tasks an older dtq wrote. Keys shared by
  every queue (the retry schedule, the dead-letter stream, ...) are single keys; the functions
  that take a ``queue`` for them ignore it.
- **cluster**: every key a state-change script touches is in one hash slot, its queue's. A
  queue's keys carry the hash tag ``{<queue>}`` (``dtq:{emails}:stream:p5``), and the keys the
  contract shares between queues are made per queue (``dtq:{emails}:retry:schedule``). A task's
  own keys carry the first five hex digits of its id as their tag (``dtq:{3f2a1}:task:<id>``):
  ids are made (:func:`task_id_prefix`) so that those five digits hash to their queue's slot,
  so a task is found from its id alone and still shares its queue's slot. What stays global
  (the queue registry, the scheduler lock, the worker hashes, handler operation records, the
  classic events channel) is written by single-key calls of its own.

Events go to ``dtq:events`` (classic pub/sub), except in the cluster layout on a server with
sharded pub/sub (Redis or Valkey 7.0 and later; :func:`use_sharded_events`): there a task's or
queue's events go to its queue's shard channel ``dtq:{<queue>}:events``, in the queue's slot
(:func:`events`), and only the worker events stay on ``dtq:events``.

``docs/redis-schema.md`` describes each key in both layouts; which keys a script receives is
in its header (``src/dtq/lua``).
"""

from __future__ import annotations

import functools
from binascii import crc_hqx
from collections.abc import Iterable
from importlib import resources

__all__ = [
    "AUDIT",
    "CANCELLED",
    "CONSUMER_GROUP",
    "DEAD_LETTER",
    "EVENTS",
    "EXPIRY",
    "PREFIX",
    "PRIORITIES",
    "QUEUES",
    "RECENT",
    "RETRY_CLAIMED",
    "RETRY_SCHEDULE",
    "SCHEDULER_LOCK",
    "TASK_MATCH",
    "WORKERS",
    "audit",
    "cancelled",
    "cluster_layout",
    "dead_letter",
    "done",
    "events",
    "expiry",
    "fair",
    "fair_held",
    "fair_keys",
    "fair_rounds",
    "history",
    "idempotency",
    "limit_state",
    "limit_sweep",
    "limits",
    "operation",
    "payload",
    "queue_last_submit",
    "queue_paused",
    "queue_streams",
    "recent",
    "result",
    "retry_claimed",
    "retry_schedule",
    "schedule",
    "schedule_history",
    "schedules",
    "scopes",
    "sharded_events",
    "slot",
    "stream",
    "stream_queue",
    "task",
    "task_id_of",
    "task_id_prefix",
    "task_match",
    "use_layout",
    "use_sharded_events",
    "waiter",
    "wf_outbox",
    "worker",
    "workflow",
    "workflow_nodes",
]

PREFIX = "dtq:"
CONSUMER_GROUP = "workers"
PRIORITIES = tuple(range(9, -1, -1))  # strict order of reading: p9 first

# Global in both layouts.
WORKERS = "dtq:workers"
SCHEDULER_LOCK = "dtq:lock:scheduler"
EVENTS = "dtq:events"  # classic pub/sub channel, not a key (and see events())
QUEUES = "dtq:queues"  # deliberate extension: set of the queue names in use (DESIGN 11)

# The contract's names of the keys the flat layout shares between queues: what outside tools
# read. dtq's own code reaches them through the functions below (dead_letter(queue), ...),
# which give the cluster layout's per-queue keys too; tests/unit/test_keys.py keeps src/ off
# these constants.
DEAD_LETTER = "dtq:stream:dead-letter"
AUDIT = "dtq:stream:audit"
RETRY_SCHEDULE = "dtq:retry:schedule"
RETRY_CLAIMED = "dtq:retry:claimed"
CANCELLED = "dtq:cancelled"
RECENT = "dtq:tasks:recent"
EXPIRY = "dtq:expiry"  # deliberate extension (DESIGN 6)
TASK_MATCH = "dtq:task:*"

_CLUSTER = False
_SHARDED_EVENTS = False
_SHARD_CHANNELS: dict[str, str] = {}  # queue -> its shard channel, made once
SLOTS = 16384
TAG_DIGITS = 5  # hex digits of a task id that are its keys' hash tag (cluster layout)


def use_layout(cluster: bool) -> None:
    """Choose the layout of this process's keys: the cluster one or the flat (contract) one.
    Every process of one deployment must use the same (``DTQ_REDIS_CLUSTER``). A change of
    layout also goes back to classic events until :func:`use_sharded_events` says otherwise."""
    global _CLUSTER, _SHARDED_EVENTS
    if cluster != _CLUSTER:
        _SHARDED_EVENTS = False
    _CLUSTER = cluster


def use_sharded_events(sharded: bool) -> None:
    """Whether this process's scripts publish a queue's events on its shard channel (SPUBLISH)
    and the API's event hub subscribes there (SSUBSCRIBE): only in the cluster layout, where
    :func:`dtq.connection.choose_events` calls it once per process with what the server has."""
    global _SHARDED_EVENTS
    _SHARDED_EVENTS = sharded and _CLUSTER


def sharded_events() -> bool:
    """Whether a queue's events go to its shard channel (:func:`events`)."""
    return _SHARDED_EVENTS


def cluster_layout() -> bool:
    """Whether this process uses the cluster layout."""
    return _CLUSTER


def scopes(queues: Iterable[str]) -> list[str]:
    """What to pass to :func:`dead_letter`, :func:`retry_schedule` and the other keys the flat
    layout keeps once for every queue, to reach all of ``queues``' share of them: each queue
    (once) in the cluster layout; in the flat one, ``[""]``, the one key whatever the queues."""
    if _CLUSTER:
        return list(dict.fromkeys(queues))
    return [""]


def slot(key: str) -> int:
    """Redis Cluster's hash slot of ``key`` (CRC16 of its hash tag, or of the key, mod 16384)."""
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    return crc_hqx(key.encode(), 0) % SLOTS


@functools.cache
def _slot_tags() -> str:
    """``slot_tags.txt``: for each slot in order, the smallest five-hex-digit string whose slot
    it is (every slot has one: there are 2**20 candidates for 2**14 slots), 5 characters each.
    A table, because finding one takes up to a million CRCs; tests/unit/test_keys.py derives it
    again and compares."""
    return resources.files("dtq").joinpath("slot_tags.txt").read_text(encoding="ascii").strip()


def _slot_prefix(target: int) -> str:
    """The tag of slot ``target``: deterministic, so every process gives a queue's tasks the
    same prefix."""
    return _slot_tags()[TAG_DIGITS * target : TAG_DIGITS * (target + 1)]


def task_id_prefix(queue: str) -> str:
    """What a new task id of ``queue`` starts with: nothing in the flat layout; in the cluster
    one, the five hex digits that make the task's keys share its queue's slot."""
    if not _CLUSTER:
        return ""
    return _slot_prefix(slot("{" + queue + "}"))


def _q(queue: str) -> str:
    return "dtq:{" + queue + "}:"


def _t(task_id: str) -> str:
    return "dtq:{" + task_id[:TAG_DIGITS] + "}:task:" + task_id


# -- a queue's keys -------------------------------------------------------------------------------


def stream(queue: str, priority: int) -> str:
    if _CLUSTER:
        return f"dtq:{{{queue}}}:stream:p{priority}"
    return f"dtq:stream:{queue}:p{priority}"


def queue_streams(queue: str) -> list[str]:
    """The queue's ten streams, p9 first (the order workers read them in)."""
    return [stream(queue, p) for p in PRIORITIES]


def stream_queue(stream_key: str) -> tuple[str, int]:
    """Inverse of :func:`stream`: the stream's (queue, priority)."""
    if _CLUSTER:  # dtq:{<queue>}:stream:p<N>
        tag_end = stream_key.index("}")
        return stream_key[5:tag_end], int(stream_key[tag_end + 10 :])
    _, _, queue, band = stream_key.split(":")
    return queue, int(band[1:])


def queue_paused(queue: str) -> str:
    return _q(queue) + "paused" if _CLUSTER else f"dtq:queue:{queue}:paused"


def queue_last_submit(queue: str) -> str:
    """The Redis time (epoch ms) of the queue's last submit: written by submit.lua, read and
    deleted by remove_queue.lua (docs/redis-schema.md, "Queue lifetime")."""
    return _q(queue) + "last_submit" if _CLUSTER else f"dtq:queue:{queue}:last_submit"


def idempotency(queue: str, key: str | None) -> str:
    """The idempotency record's key; a task without a key gets a placeholder never written
    (in its queue's slot, in the cluster layout)."""
    if _CLUSTER:
        return _q(queue) + ("idempotency:" + key if key else "idempotency:-")
    return f"dtq:idempotency:{queue}:{key}" if key else "dtq:idempotency:-"


# -- shared by every queue in the flat layout, one per queue in the cluster one ------------------


def retry_schedule(queue: str) -> str:
    return _q(queue) + "retry:schedule" if _CLUSTER else RETRY_SCHEDULE


def retry_claimed(queue: str) -> str:
    return _q(queue) + "retry:claimed" if _CLUSTER else RETRY_CLAIMED


def expiry(queue: str) -> str:
    """Deliberate extension (DESIGN 6): not-started tasks by deadline."""
    return _q(queue) + "expiry" if _CLUSTER else EXPIRY


def cancelled(queue: str) -> str:
    return _q(queue) + "cancelled" if _CLUSTER else CANCELLED


def recent(queue: str) -> str:
    return _q(queue) + "tasks:recent" if _CLUSTER else RECENT


def dead_letter(queue: str) -> str:
    """The dead-letter stream of ``queue``'s tasks (the task's original queue)."""
    return _q(queue) + "stream:dead-letter" if _CLUSTER else DEAD_LETTER


def audit(queue: str) -> str:
    """The audit stream an operation on ``queue`` (or one of its tasks) is recorded in."""
    return _q(queue) + "stream:audit" if _CLUSTER else AUDIT


def events(queue: str) -> str:
    """The pub/sub channel a script publishes ``queue``'s events on: ``dtq:events``, or with
    sharded events (:func:`use_sharded_events`) the queue's shard channel
    ``dtq:{<queue>}:events``, in its slot. A script SPUBLISHes to a channel whose name has a
    hash tag and PUBLISHes to the other (``emit`` in ``lua/_lib.lua``)."""
    if not _SHARDED_EVENTS:
        return EVENTS
    channel = _SHARD_CHANNELS.get(queue)
    if channel is None:
        channel = _SHARD_CHANNELS[queue] = _q(queue) + "events"
    return channel


# -- periodic schedules (deliberate extension: docs/schedules.md) ------------------------------


def schedules(queue: str) -> str:
    """The index of schedules by next fire time (a sorted set: name -> epoch ms, ``+inf`` while
    paused or ended): one for every schedule in the flat layout; in the cluster one, one per
    queue, holding the schedules whose tasks go to that queue (in its slot, so the firing
    script that enqueues a tick also moves the index)."""
    return _q(queue) + "schedules" if _CLUSTER else "dtq:schedules"


def schedule(name: str, queue: str) -> str:
    """A schedule's hash (definition, cursor, counters); ``queue`` is its tasks' queue, which
    decides the slot in the cluster layout and nothing in the flat one."""
    return _q(queue) + "schedule:" + name if _CLUSTER else "dtq:schedule:" + name


def schedule_history(name: str, queue: str) -> str:
    """A schedule's capped list of decisions (fired, skipped, missed), newest first."""
    return schedule(name, queue) + ":history"


# -- rate and concurrency limits (deliberate extension: docs/limits.md) ------------------------


def limits(queue: str) -> str:
    """The limit definitions (a hash: limit name -> its JSON): one for every limit in the flat
    layout; in the cluster one, one per queue, holding the limits of that queue's tasks (in its
    slot, so the script that stores one also writes its audit entry)."""
    return _q(queue) + "limits" if _CLUSTER else "dtq:limits"


def limit_state(queue: str, name: str, key_value: str = "") -> str:
    """The prefix of one limit's state (of one key value of a keyed limit), in its queue's
    slot: ``<prefix>:rate`` (GCRA's theoretical arrival time), ``<prefix>:running`` (the
    RUNNING tasks holding a place), ``<prefix>:waiting`` (the tasks parked for a place)."""
    base = (_q(queue) if _CLUSTER else "dtq:") + "limit:" + name
    # "=" is in no limit name (nor task type), so a name never runs into a key value
    return base + "=" + key_value if key_value else base


def fair(queue: str) -> str:
    """The queue's fairness state (a hash, docs/limits.md "Fairness across keys"): ``key``, the
    payload path its tasks are served round-robin by (set and removed with the queue's keyed
    limits; absent: the queue is served in plain priority order), and ``r0`` .. ``r9``, the
    round last served in each priority band (band 0 = p9). In its queue's slot."""
    return _q(queue) + "fair" if _CLUSTER else f"dtq:fair:{queue}"


def fair_held(queue: str) -> str:
    """The tasks of a fair queue held back from its streams (a zset of task ids, scored
    ``band * 2**40 + round``): the lowest score goes into its stream first."""
    return fair(queue) + ":held"


def fair_rounds(queue: str) -> str:
    """The last round given to each key value of a fair queue, per band (a zset: member
    ``<band>:<key value>``, scored like :func:`fair_held`); a round already served is removed."""
    return fair(queue) + ":rounds"


def fair_keys(queue: str) -> list[str]:
    """The three fairness keys of a queue, in the order the scripts take them."""
    return [fair(queue), fair_held(queue), fair_rounds(queue)]


def limit_sweep(queue: str) -> str:
    """Who sweeps the places of ``queue``'s concurrency limits now (a string with a TTL of one
    sweep interval, ``SET NX``): one worker per queue and interval does it."""
    return _q(queue) + "limits:sweep" if _CLUSTER else "dtq:limits:sweep:" + queue


def wf_outbox(queue: str) -> str:
    """Deliberate extension (docs/workflows.md): the ends of ``queue``'s workflow nodes, one
    entry {task_id, status, key} written by the script that ended the task (``retain`` in
    _lib.lua), and a workflow's release entry {kind, workflow_id} in its home queue's. Read by
    the workers' relay (group ``workers``), each entry deleted once applied."""
    return _q(queue) + "wfbox" if _CLUSTER else f"dtq:wfbox:{queue}"


# -- a workflow's keys (docs/workflows.md) ------------------------------------------------------


def workflow(workflow_id: str) -> str:
    """A workflow's hash (workflow.lua). Its id is made like a task id of its home queue (the
    first node's), so in the cluster layout it carries the same kind of tag and shares that
    queue's slot."""
    if _CLUSTER:
        return "dtq:{" + workflow_id[:TAG_DIGITS] + "}:workflow:" + workflow_id
    return f"dtq:workflow:{workflow_id}"


def workflow_nodes(workflow_id: str) -> str:
    """A workflow's nodes (workflow.lua), in its hash's slot."""
    return workflow(workflow_id) + ":nodes"


# -- a task's keys ------------------------------------------------------------------------------


def task(task_id: str) -> str:
    return _t(task_id) if _CLUSTER else f"dtq:task:{task_id}"


def task_match() -> str:
    """SCAN pattern of the task hashes (with ``TYPE hash``: a task's history and an older dtq's
    payload key match it too)."""
    return "dtq:{*}:task:*" if _CLUSTER else TASK_MATCH


def task_id_of(task_key: str) -> str:
    """Inverse of :func:`task`: the task id in a task hash's key."""
    return task_key.rsplit(":", 1)[1]


def history(task_id: str) -> str:
    return _t(task_id) + ":history" if _CLUSTER else f"dtq:task:{task_id}:history"


def done(task_id: str) -> str:
    """Where a waiting producer is told that the task ended (deliberate extension,
    docs/redis-schema.md): a stream of one entry ``{status}`` that the script making a task
    terminal writes when the hash's ``waited`` field says someone waits, with the hash's
    lifetime. ``Queue.wait`` blocks on it with XREAD."""
    return _t(task_id) + ":done" if _CLUSTER else f"dtq:task:{task_id}:done"


def waiter(token: str, like_task_id: str) -> str:
    """The wake-up stream of one of a process's blocked done-stream readers (``dtq.waits``):
    a new waiter added to the reader's keys XADDs to it, so that the reader's XREAD returns and
    is sent again with the new key. In the slot of ``like_task_id`` (the reader's tasks' slot:
    a command's keys share one); MAXLEN 1 and a 2 min TTL, so a reader that died leaves
    nothing behind."""
    return (
        "dtq:{" + like_task_id[:TAG_DIGITS] + "}:waiter:" + token
        if _CLUSTER
        else f"dtq:waiter:{token}"
    )


def payload(task_id: str) -> str:
    """Where the dtq before this one kept a task's payload JSON, beside its hash. Nothing
    writes it now (the payload is the hash's ``payload`` field, contract section 2): the
    scripts that give a task a lifetime receive it to move such a key into the hash, and reads
    fall back to it for a task not moved yet (docs/redis-schema.md, "Tasks an older dtq
    wrote"). The cluster layout never had it; its scripts receive the name all the same."""
    return _t(task_id) + ":payload" if _CLUSTER else f"dtq:task:{task_id}:payload"


def result(task_id: str) -> str:
    if _CLUSTER:
        return "dtq:{" + task_id[:TAG_DIGITS] + "}:result:" + task_id
    return f"dtq:result:{task_id}"


# -- global in both layouts ---------------------------------------------------------------------


def operation(key: str) -> str:
    """The record of one handler-level operation (``dtq_tasks.idempotent_operation``)."""
    return f"dtq:op:{key}"


def worker(worker_id: str) -> str:
    return f"dtq:worker:{worker_id}"
