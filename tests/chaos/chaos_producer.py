"""One producer process of the idempotency scenario:
``python chaos_producer.py <redis url> <keys.json> <out.jsonl> <order seed> <start at (epoch s)>``.

Submits one task per key (in its own shuffled order, 16 at a time) with the key as
idempotency key, and writes one JSON line per answer: ``{"i": key index, "answer": "new" |
"duplicate" | "in_progress" | "error", "task_id": ..., "detail": ...}``.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from dtq import connect
from dtq.errors import DtqError, IdempotencyInProgressError

CONCURRENCY = 16


async def produce(url: str, keys: list[str], out: Path, order_seed: int, start_at: float) -> None:
    order = list(range(len(keys)))
    random.Random(order_seed).shuffle(order)
    queue = await connect(url)
    answers: list[dict[str, Any]] = []
    sem = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int) -> None:
        async with sem:
            try:
                task = await queue.submit(
                    "chaos_work", {"seq": i, "ms": 5}, idempotency_key=keys[i]
                )
            except IdempotencyInProgressError as exc:
                answers.append(
                    {"i": i, "answer": "in_progress", "task_id": exc.details.get("task_id")}
                )
            except DtqError as exc:
                answers.append({"i": i, "answer": "error", "task_id": None, "detail": exc.code})
            else:
                kind = "duplicate" if task.duplicate else "new"
                answers.append({"i": i, "answer": kind, "task_id": task.task_id})

    try:
        await asyncio.sleep(max(0.0, start_at - time.time()))  # all producers start together
        await asyncio.gather(*(one(i) for i in order))
    finally:
        await queue.close()
    text = "".join(json.dumps(a) + "\n" for a in answers)
    await asyncio.to_thread(out.write_text, text)


def main(argv: list[str]) -> int:
    url, keys_path, out, order_seed, start_at = argv
    keys = json.loads(Path(keys_path).read_text(encoding="utf-8"))
    asyncio.run(produce(url, keys, Path(out), int(order_seed), float(start_at)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
