"""Settings against contract section 10: every DTQ_ variable, its default, each rule.

The environment is set with monkeypatch and read by ``load_settings()``, as an entry point does.
An invalid value is one ConfigError line naming the variable, the value and the rule.
"""

from __future__ import annotations

import os

import pytest

from dtq.config import Settings, load_settings, redact_url
from dtq.errors import ConfigError

# Contract section 10, plus DTQ_TASK_MODULES (DESIGN 9), as the environment would spell them.
CONTRACT_DEFAULTS = {
    "DTQ_REDIS_URL": "redis://localhost:6379/0",
    "DTQ_API_HOST": "0.0.0.0",
    "DTQ_API_PORT": 8000,
    "DTQ_WS_PATH": "/ws/events",
    "DTQ_WORKER_CONCURRENCY": 4,
    "DTQ_WORKER_ID": "",
    "DTQ_VISIBILITY_TIMEOUT_S": 30,
    "DTQ_HEARTBEAT_INTERVAL_S": 5,
    "DTQ_MAX_QUEUE_DEPTH": 10000,
    "DTQ_MAX_PAYLOAD_BYTES": 262144,
    "DTQ_TASK_TIMEOUT_MS": 30000,
    "DTQ_MAX_ATTEMPTS": 10,
    "DTQ_RETRY_BASE_DELAY": 1.0,
    "DTQ_RETRY_MAX_DELAY": 60.0,
    "DTQ_RETRY_JITTER": 0.2,
    "DTQ_TASK_RETENTION_S": 604800,
    "DTQ_RESULT_RETENTION_S": 3600,
    "DTQ_RESULT_MAX_BYTES": 8192,
    "DTQ_IDEM_TTL_S": 86400,
    "DTQ_DRAIN_TIMEOUT_S": 30,
    "DTQ_DLQ_ENABLED": True,
    "DTQ_DLQ_MAXLEN": 10000,
    "DTQ_API_KEY": "",
    "DTQ_LOG_LEVEL": "INFO",
    "DTQ_LOG_JSON": False,
    "DTQ_TASK_MODULES": "examples.tasks",
}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("DTQ_"):
            monkeypatch.delenv(name)


def field(var: str) -> str:
    return var.removeprefix("DTQ_").lower()


@pytest.mark.parametrize(("var", "default"), CONTRACT_DEFAULTS.items())
def test_default(var: str, default: object) -> None:
    value = getattr(load_settings(), field(var))
    assert value == default
    assert type(value) is type(default) or isinstance(default, int)


@pytest.mark.parametrize(
    ("var", "raw", "expected"),
    [
        ("DTQ_REDIS_URL", "redis://10.0.0.1:6380/2", "redis://10.0.0.1:6380/2"),
        ("DTQ_REDIS_URL", "unix:///tmp/redis.sock", "unix:///tmp/redis.sock"),
        ("DTQ_API_PORT", "65535", 65535),
        ("DTQ_WORKER_CONCURRENCY", "1", 1),
        ("DTQ_WORKER_ID", "worker-0a1b2c3d", "worker-0a1b2c3d"),
        ("DTQ_VISIBILITY_TIMEOUT_S", "5.5", 5.5),
        ("DTQ_HEARTBEAT_INTERVAL_S", "29.9", 29.9),
        ("DTQ_TASK_TIMEOUT_MS", "3600000", 3_600_000),
        ("DTQ_TASK_TIMEOUT_MS", "1", 1),
        ("DTQ_MAX_ATTEMPTS", "1", 1),
        ("DTQ_RETRY_JITTER", "0", 0.0),
        ("DTQ_RETRY_JITTER", "0.999", 0.999),
        ("DTQ_RETRY_BASE_DELAY", "60", 60.0),
        ("DTQ_RESULT_MAX_BYTES", "0", 0),
        ("DTQ_DRAIN_TIMEOUT_S", "0", 0.0),
        ("DTQ_DLQ_ENABLED", "false", False),
        ("DTQ_LOG_JSON", "true", True),
        ("DTQ_LOG_LEVEL", "debug", "DEBUG"),
        ("DTQ_TASK_MODULES", "a.tasks, b.tasks", "a.tasks, b.tasks"),
    ],
)
def test_valid_values(
    monkeypatch: pytest.MonkeyPatch, var: str, raw: str, expected: object
) -> None:
    monkeypatch.setenv(var, raw)
    assert getattr(load_settings(), field(var)) == expected


def test_task_module_list() -> None:
    assert Settings(task_modules=" a.tasks, ,b.tasks ").task_module_list == ["a.tasks", "b.tasks"]


# (variable, bad value, a words of the rule the message must contain)
BAD_VALUES = [
    ("DTQ_REDIS_URL", "http://localhost:6379", "redis://"),
    ("DTQ_API_PORT", "0", "greater than or equal to 1"),
    ("DTQ_API_PORT", "65536", "less than or equal to 65535"),
    ("DTQ_API_PORT", "eighty", "valid integer"),
    ("DTQ_WS_PATH", "ws/events", "must start with /"),
    ("DTQ_WORKER_CONCURRENCY", "0", "greater than or equal to 1"),
    ("DTQ_WORKER_ID", "bad id", "letters, digits"),
    ("DTQ_WORKER_ID", "w" * 65, "at most 64"),
    # the API looks workers up by ASCII ids only: a worker it could never find is refused
    ("DTQ_WORKER_ID", "wörker-1", "ASCII letters, digits"),
    ("DTQ_WORKER_METRICS_PORT", "-1", "greater than or equal to 0"),
    ("DTQ_VISIBILITY_TIMEOUT_S", "0", "greater than 0"),
    ("DTQ_VISIBILITY_TIMEOUT_S", "nan", "finite"),
    ("DTQ_HEARTBEAT_INTERVAL_S", "-1", "greater than 0"),
    ("DTQ_MAX_QUEUE_DEPTH", "0", "greater than 0"),
    ("DTQ_MAX_PAYLOAD_BYTES", "0", "greater than 0"),
    ("DTQ_TASK_TIMEOUT_MS", "0", "greater than or equal to 1"),
    ("DTQ_TASK_TIMEOUT_MS", "3600001", "less than or equal to 3600000"),
    ("DTQ_MAX_ATTEMPTS", "0", "greater than or equal to 1"),
    ("DTQ_RETRY_BASE_DELAY", "-0.1", "greater than or equal to 0"),
    ("DTQ_RETRY_MAX_DELAY", "-1", "greater than or equal to 0"),
    ("DTQ_RETRY_MAX_DELAY", "inf", "finite"),
    ("DTQ_RETRY_JITTER", "1", "less than 1"),
    ("DTQ_RETRY_JITTER", "1.5", "less than 1"),
    ("DTQ_RETRY_JITTER", "-0.1", "greater than or equal to 0"),
    ("DTQ_TASK_RETENTION_S", "0", "greater than 0"),
    ("DTQ_RESULT_RETENTION_S", "0", "greater than 0"),
    ("DTQ_RESULT_MAX_BYTES", "-1", "greater than or equal to 0"),
    ("DTQ_IDEM_TTL_S", "0", "greater than 0"),
    ("DTQ_QUEUE_IDLE_TTL_S", "0", "greater than 0"),
    ("DTQ_QUEUE_IDLE_TTL_S", "a day", "valid integer"),
    ("DTQ_DRAIN_TIMEOUT_S", "-1", "greater than or equal to 0"),
    ("DTQ_DRAIN_TIMEOUT_S", "inf", "finite"),
    ("DTQ_DLQ_ENABLED", "maybe", "boolean"),
    ("DTQ_DLQ_MAXLEN", "0", "greater than 0"),
    ("DTQ_LOG_LEVEL", "LOUD", "DEBUG, INFO"),
    ("DTQ_LOG_JSON", "sometimes", "boolean"),
    ("DTQ_NEAR_EXPIRATION_S", "0", "greater than 0"),
    ("DTQ_SCHEDULER_INTERVAL_S", "0", "greater than 0"),
    ("DTQ_SCHEDULER_INTERVAL_S", "61", "less than or equal to 60"),
    ("DTQ_REAPER_INTERVAL_S", "601", "less than or equal to 600"),
    ("DTQ_CLAIM_STALE_S", "0", "greater than 0"),
]


@pytest.mark.parametrize(
    ("var", "raw", "rule"), BAD_VALUES, ids=[f"{v}={r}" for v, r, _ in BAD_VALUES]
)
def test_invalid_value_one_line(
    monkeypatch: pytest.MonkeyPatch, var: str, raw: str, rule: str
) -> None:
    monkeypatch.setenv(var, raw)
    with pytest.raises(ConfigError) as exc:
        load_settings()
    message = str(exc.value)
    assert "\n" not in message
    assert f"{var}={raw!r}" in message
    assert rule in message
    assert exc.value.__cause__ is None and exc.value.__suppress_context__  # no pydantic trace


def test_value_with_newline_stays_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTQ_LOG_LEVEL", "INFO\nDEBUG")
    with pytest.raises(ConfigError) as exc:
        load_settings()
    assert "\n" not in str(exc.value) and "DTQ_LOG_LEVEL" in str(exc.value)


# Cross-field rules: the message names both variables, both values and the rule.
@pytest.mark.parametrize(
    ("env", "words"),
    [
        (
            {"DTQ_HEARTBEAT_INTERVAL_S": "30"},  # equal to the default visibility timeout
            ["DTQ_HEARTBEAT_INTERVAL_S", "DTQ_VISIBILITY_TIMEOUT_S", "below", "30.0 >= 30.0"],
        ),
        (
            {"DTQ_HEARTBEAT_INTERVAL_S": "10", "DTQ_VISIBILITY_TIMEOUT_S": "8"},
            ["DTQ_HEARTBEAT_INTERVAL_S", "DTQ_VISIBILITY_TIMEOUT_S", "below", "10.0 >= 8.0"],
        ),
        (
            {"DTQ_RETRY_BASE_DELAY": "61"},
            ["DTQ_RETRY_BASE_DELAY", "DTQ_RETRY_MAX_DELAY", "not exceed", "61.0 > 60.0"],
        ),
        (
            {"DTQ_RETRY_BASE_DELAY": "2", "DTQ_RETRY_MAX_DELAY": "1.5"},
            ["DTQ_RETRY_BASE_DELAY", "DTQ_RETRY_MAX_DELAY", "not exceed", "2.0 > 1.5"],
        ),
    ],
)
def test_cross_field_rules(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], words: list[str]
) -> None:
    for var, raw in env.items():
        monkeypatch.setenv(var, raw)
    with pytest.raises(ConfigError) as exc:
        load_settings()
    message = str(exc.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_cross_field_boundaries_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTQ_RETRY_BASE_DELAY", "60")  # equal to the max: allowed
    monkeypatch.setenv("DTQ_HEARTBEAT_INTERVAL_S", "0.1")
    monkeypatch.setenv("DTQ_VISIBILITY_TIMEOUT_S", "0.2")
    s = load_settings()
    assert s.retry_base_delay == s.retry_max_delay == 60.0
    assert s.heartbeat_interval_s < s.visibility_timeout_s


def test_overrides_are_validated_too() -> None:
    with pytest.raises(ConfigError, match="DTQ_MAX_QUEUE_DEPTH"):
        load_settings(max_queue_depth=-1)
    assert load_settings(max_queue_depth=7).max_queue_depth == 7


def test_config_error_code() -> None:
    assert ConfigError("x").code == "CONFIG_ERROR"


def test_settings_are_frozen() -> None:
    s = load_settings()
    with pytest.raises(ValueError, match="frozen"):
        s.max_queue_depth = 1  # type: ignore[misc]


def test_redis_url_password_not_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTQ_REDIS_URL", "http://user:s3cret@redis.internal:6379/0")
    with pytest.raises(ConfigError) as exc:
        load_settings()
    assert "s3cret" not in str(exc.value)
    assert "DTQ_REDIS_URL='http://***@redis.internal:6379/0'" in str(exc.value)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://localhost:6379/0", "redis://localhost:6379/0"),
        ("redis://:s3cret@redis.internal:6379/0", "redis://***@redis.internal:6379/0"),
        ("rediss://user:s3cret@redis.internal/1", "rediss://***@redis.internal/1"),
        ("redis://user:p@ss@host:6379", "redis://***@host:6379"),  # an unescaped @ in it
        ("unix:///run/redis.sock", "unix:///run/redis.sock"),
        ("user:s3cret@host", "***@host"),  # no scheme: still no password
    ],
)
def test_redact_url_hides_the_credentials(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_a_misspelt_variable_is_named_with_the_closest_setting() -> None:
    from dtq.config import unknown_variables

    lines = unknown_variables(
        {"DTQ_WORKER_CONCURENCY": "8", "DTQ_REDIS_URL": "redis://x", "PATH": "/bin"}
    )
    assert lines == [
        "DTQ_WORKER_CONCURENCY is not a dtq setting and is ignored "
        "(did you mean DTQ_WORKER_CONCURRENCY?)"
    ]


def test_load_settings_warns_about_a_misspelt_variable(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("DTQ_VISIBILITY_TIMEOUT", "5")
    with caplog.at_level("WARNING", logger="dtq.config"):
        load_settings()
    assert any("DTQ_VISIBILITY_TIMEOUT is not a dtq setting" in r.message for r in caplog.records)


def test_queue_idle_ttl_default() -> None:
    assert load_settings().queue_idle_ttl_s == 86_400  # a day (DESIGN 11)


# -- a Sentinel-managed primary (docs/operations.md, "Sentinel") ---------------------------------

SENTINEL = {"DTQ_REDIS_SENTINEL_MASTER": "mymaster"}


@pytest.mark.parametrize(
    ("raw", "addresses"),
    [
        ("10.0.0.1:26379", [("10.0.0.1", 26379)]),
        ("a:1, b.example:26380 ,c:65535", [("a", 1), ("b.example", 26380), ("c", 65535)]),
        ("[::1]:26379,[fd00::2]:26380", [("::1", 26379), ("fd00::2", 26380)]),
    ],
)
def test_sentinel_addresses(
    monkeypatch: pytest.MonkeyPatch, raw: str, addresses: list[tuple[str, int]]
) -> None:
    monkeypatch.setenv("DTQ_REDIS_SENTINELS", raw)
    monkeypatch.setenv("DTQ_REDIS_SENTINEL_MASTER", "mymaster")
    s = load_settings()
    assert s.sentinel_addresses == addresses
    assert s.redis_sentinel_master == "mymaster"


def test_no_sentinels_by_default() -> None:
    s = load_settings()
    assert (s.redis_sentinels, s.redis_sentinel_master, s.redis_sentinel_password) == ("", "", "")
    assert s.sentinel_addresses == []


@pytest.mark.parametrize(
    "raw", ["localhost", "a:0", "a:65536", "a:port", ":26379", "a:1,", "a:1,,b:2", "a:-1"]
)
def test_bad_sentinel_addresses(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("DTQ_REDIS_SENTINELS", raw)
    monkeypatch.setenv("DTQ_REDIS_SENTINEL_MASTER", "mymaster")
    with pytest.raises(ConfigError) as exc:
        load_settings()
    message = str(exc.value)
    assert "\n" not in message
    assert f"DTQ_REDIS_SENTINELS={raw!r}" in message and "host:port" in message


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"DTQ_REDIS_SENTINELS": "a:26379"}, ["DTQ_REDIS_SENTINEL_MASTER", "required"]),
        ({"DTQ_REDIS_SENTINEL_MASTER": "m"}, ["DTQ_REDIS_SENTINELS", "empty"]),
        (
            {**SENTINEL, "DTQ_REDIS_SENTINELS": "a:1", "DTQ_REDIS_URL": "unix:///r.sock"},
            ["DTQ_REDIS_URL", "redis://", "DTQ_REDIS_SENTINELS"],
        ),
        (
            {**SENTINEL, "DTQ_REDIS_SENTINELS": "a:1", "DTQ_REDIS_CLUSTER": "true"},
            ["DTQ_REDIS_CLUSTER", "DTQ_REDIS_SENTINELS", "exclude"],
        ),
        (
            {"DTQ_REDIS_CLUSTER": "true", "DTQ_REDIS_URL": "unix:///r.sock"},
            ["DTQ_REDIS_URL", "DTQ_REDIS_CLUSTER"],
        ),
    ],
)
def test_sentinel_cross_field_rules(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], words: list[str]
) -> None:
    for var, raw in env.items():
        monkeypatch.setenv(var, raw)
    with pytest.raises(ConfigError) as exc:
        load_settings()
    for word in words:
        assert word in str(exc.value)


def test_describe_redis_names_the_primary_without_secrets() -> None:
    from dtq.config import describe_redis

    plain = Settings(redis_url="redis://:s3cret@h:6379/0")
    assert describe_redis(plain) == "redis://***@h:6379/0"
    cluster = Settings(redis_url="redis://:s3cret@h:7000/0", redis_cluster=True)
    assert describe_redis(cluster) == "the Redis Cluster at redis://***@h:7000/0"
    managed = Settings(
        redis_url="rediss://:s3cret@unused:1/2",
        redis_sentinels="s1:26379, s2:26380",
        redis_sentinel_master="mymaster",
        redis_sentinel_password="sentinel-pw",
    )
    shown = describe_redis(managed)
    assert shown == "primary 'mymaster' via sentinels s1:26379,s2:26380"
    assert "s3cret" not in shown and "sentinel-pw" not in shown
    assert "sentinel-pw" not in repr(managed)  # a failing test prints the settings
