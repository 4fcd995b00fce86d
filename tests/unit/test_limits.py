"""The definition of a limit (docs/limits.md): the rate syntax, the checks of a definition, the
key value of a task, and limits declared next to their handler (``@task(..., rate_limit=...)``).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import pytest

from dtq.limits import KEY_VALUE_MAX, NO_KEY, LimitDef, LimitSpecError, key_value, parse_rate
from dtq_tasks import TaskRegistrationError, code_limits, task

registry_module = importlib.import_module("dtq_tasks.registry")  # the module, not the function


@pytest.mark.parametrize(
    ("text", "count", "period_ms"),
    [
        ("100/s", 100, 1000),
        ("5/m", 5, 60_000),
        ("1000/h", 1000, 3_600_000),
        ("10/30s", 10, 30_000),
        ("1/500ms", 1, 500),
        (" 2.5 / 2 minutes ", 2.5, 120_000),
    ],
)
def test_rates(text: str, count: float, period_ms: float) -> None:
    rate = parse_rate(text)
    assert (rate.count, rate.period_ms) == (count, period_ms)
    assert rate.interval_ms == period_ms / count


@pytest.mark.parametrize(
    "text", ["", "100", "100/", "/s", "0/s", "1/0s", "-1/s", "1/day", "1e3/s", "200000/s", 100]
)
def test_bad_rates(text: object) -> None:
    with pytest.raises(LimitSpecError) as info:
        parse_rate(text)
    assert info.value.code == "INVALID_LIMIT"


def test_the_largest_rate_is_100000_a_second() -> None:
    assert parse_rate("100000/s").interval_ms == 0.01
    with pytest.raises(LimitSpecError, match="100,000"):
        parse_rate("100001/s")


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({}, "needs a rate, a concurrency"),
        ({"burst": 5, "concurrency": 1}, "burst needs a rate"),
        ({"rate": "1/s", "burst": 0}, "burst"),
        ({"concurrency": 1_000_001}, "concurrency"),
        ({"concurrency": True, "rate": "x"}, "rate"),
        ({"rate": "1/s", "key": "payload"}, "payload path"),
        ({"rate": "1/s", "key": "payload.a.b.c.d.e.f.g.h.i"}, "payload path"),
        ({"rate": "1/s", "key": "metadata.a"}, "payload path"),
        ({"rate": "1/s", "task_type": "no spaces"}, "task_type"),
        ({"rate": "1/s", "source": "cli"}, "source"),
        ({"rate": "1/s", "extra": 1}, "extra"),
    ],
)
def test_bad_definitions(fields: dict[str, Any], words: str) -> None:
    with pytest.raises(LimitSpecError, match=words):
        LimitDef.parse(fields)


def test_gcra_parameters_and_json() -> None:
    d = LimitDef.parse({"rate": "10/s", "burst": 5, "key": "payload.tenant"})
    assert (d.interval_ms, d.tolerance_ms) == (100, 400)
    assert LimitDef.parse({"rate": "10/s"}).tolerance_ms == 0
    assert LimitDef.parse({"concurrency": 3}).interval_ms == 0
    assert LimitDef.model_validate_json(d.to_json()) == d
    assert d.to_json() == (
        '{"queue":"default","key":"payload.tenant","rate":"10/s","burst":5,"source":"api"}'
    )
    assert d.applies_to("default", "anything") and not d.applies_to("other", "anything")
    typed = LimitDef.parse({"concurrency": 1, "task_type": "charge"})
    assert typed.applies_to("default", "charge") and not typed.applies_to("default", "refund")


def test_key_values() -> None:
    d = LimitDef.parse({"concurrency": 1, "key": "payload.customer.id"})
    assert key_value(LimitDef.parse({"concurrency": 1}), {"customer": {"id": 1}}) == ""
    assert key_value(d, {"customer": {"id": "acme"}}) == "acme"
    assert key_value(d, {"customer": {"id": 42}}) == "42"
    assert key_value(d, {"customer": {"id": [1, "a"]}}) == '[1,"a"]'
    assert key_value(d, {"customer": {"id": None}}) == "null"
    assert key_value(d, {"customer": {"id": ""}}) == NO_KEY
    assert key_value(d, {"customer": {}}) == NO_KEY
    assert key_value(d, {"customer": "acme"}) == NO_KEY
    assert key_value(d, {}) == NO_KEY
    long_a, long_b = "a" * 500, "a" * 499 + "b"
    cut_a, cut_b = (
        key_value(d, {"customer": {"id": long_a}}),
        key_value(d, {"customer": {"id": long_b}}),
    )
    assert len(cut_a) == len(cut_b) == KEY_VALUE_MAX
    assert cut_a != cut_b and cut_a.startswith("a" * 100)
    exact = "x" * KEY_VALUE_MAX
    assert key_value(d, {"customer": {"id": exact}}) == exact


# -- declared in code -----------------------------------------------------------------------------


@pytest.fixture
def clean_registry() -> Iterator[None]:
    """Each test declares into an empty registry, and leaves the process's as it found it."""
    handlers, limits = dict(registry_module._REGISTRY), dict(registry_module._LIMITS)
    registry_module._REGISTRY.clear()
    registry_module._LIMITS.clear()
    yield
    registry_module._REGISTRY.clear()
    registry_module._REGISTRY.update(handlers)
    registry_module._LIMITS.clear()
    registry_module._LIMITS.update(limits)


def _noop(payload: dict[str, Any], ctx: Any) -> None:
    return None


@pytest.mark.usefixtures("clean_registry")
def test_a_declared_limit_is_named_after_its_task() -> None:
    task("charge", rate_limit="100/s", concurrency=20)(_noop)
    task("per-tenant", rate_limit="5/s", limit_burst=10, limit_key="payload.tenant_id",
         limit_queue="payments")(_noop)  # fmt: skip
    task("plain")(_noop)
    assert dict(code_limits()) == {
        "charge": LimitDef(task_type="charge", rate="100/s", concurrency=20, source="code"),
        "per-tenant": LimitDef(
            queue="payments",
            task_type="per-tenant",
            key="payload.tenant_id",
            rate="5/s",
            burst=10,
            source="code",
        ),
    }


@pytest.mark.usefixtures("clean_registry")
def test_a_module_reloaded_without_its_limit_drops_it() -> None:
    task("charge", concurrency=2)(_noop)
    task("charge")(_noop)
    assert dict(code_limits()) == {}


@pytest.mark.usefixtures("clean_registry")
@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"rate_limit": "fast"}, "COUNT/PERIOD"),
        ({"concurrency": 0}, "concurrency"),
        ({"rate_limit": "1/s", "limit_key": "tenant"}, "payload path"),
        ({"rate_limit": "1/s", "limit_queue": "Bad"}, "queue"),
        ({"concurrency": 1, "limit_burst": 2}, "burst needs a rate"),
        ({"limit_key": "payload.a"}, "need rate_limit or concurrency"),
    ],
)
def test_a_bad_declared_limit_is_refused_at_decoration(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(TaskRegistrationError, match=words) as info:
        task("charge", **kwargs)
    assert "'charge'" in str(info.value)
    assert dict(code_limits()) == {}
