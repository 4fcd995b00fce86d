"""The label values a :class:`dtq.metrics.Metrics` remembers: counts are the same as through
``labels()`` every time, and invented names cannot grow what it keeps."""

from __future__ import annotations

from dtq.metrics import OTHER, Metrics
from dtq.metrics.registry import LABEL_CACHE_MAX


def _value(m: Metrics, name: str, **labels: str) -> float:
    got = m.registry.get_sample_value(name, labels)
    return 0.0 if got is None else got


def test_repeated_and_invented_labels_count_as_before() -> None:
    m = Metrics(known_types={"known"})
    for _ in range(3):
        m.task_started("default", "known", 0.5)
        m.attempt_ended("default", "known", "worker-00000000", "success", 0.01)
        m.task_completed("default", "known", "succeeded", 0.6)
        m.script_call("start", True)
    for i in range(LABEL_CACHE_MAX + 500):
        m.task_started("default", f"made_up_{i}")
    m.task_started("Not A Queue!", "known")
    assert _value(m, "dtq_tasks_started_total", queue="default", task_type="known") == 3
    assert _value(m, "dtq_tasks_started_total", queue="default", task_type=OTHER) == (
        LABEL_CACHE_MAX + 500
    )
    assert _value(m, "dtq_tasks_started_total", queue=OTHER, task_type="known") == 1
    assert _value(m, "dtq_task_wait_seconds_count", queue="default", task_type="known") == 3
    assert _value(m, "dtq_tasks_succeeded_total", queue="default", task_type="known") == 3
    assert (
        _value(
            m, "dtq_tasks_completed_total", queue="default", task_type="known", status="succeeded"
        )
        == 3
    )
    worker = {"worker_id": "worker-00000000", "task_type": "known", "result": "success"}
    assert _value(m, "dtq_worker_tasks_total", **worker) == 3
    assert _value(m, "dtq_redis_operations_total", operation="script:start", result="ok") == 3
    assert len(m._qt_values) <= LABEL_CACHE_MAX
