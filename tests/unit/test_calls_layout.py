"""The script calls :mod:`dtq.calls` builds follow the key layout in force when they are built,
also in a process that switches layouts (the tests and the benchmarks do): what it caches per
queue is cached per layout."""

from __future__ import annotations

from dtq import calls, keys
from dtq.config import Settings
from dtq.models import SubmitRequest


def _submit_keys(queue: str) -> list[str]:
    req = SubmitRequest(task_type="t", payload={}, queue=queue)
    ((_, call_keys, _),) = calls.submit_calls([req], [calls.new_task_id(queue)], Settings())
    return call_keys


def test_a_submit_call_takes_the_layout_in_force_not_the_one_cached_before() -> None:
    flat = _submit_keys("layouts")
    assert keys.stream("layouts", 5) in flat
    keys.use_layout(True)
    try:
        clustered = _submit_keys("layouts")
        assert {keys.slot(k) for k in clustered} == {keys.slot("{layouts}")}
    finally:
        keys.use_layout(False)
    again = _submit_keys("layouts")
    assert set(keys.queue_streams("layouts")) <= set(again)
    assert not [k for k in again if "{" in k]  # flat again: no hash tag anywhere
