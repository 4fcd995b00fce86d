"""Settings: every ``DTQ_*`` variable, validated once at start (contract section 10).

``Settings`` is built by an entry point (``load_settings``) and passed down; nothing reads the
environment at import time. An invalid value raises :class:`dtq.errors.ConfigError` whose
message is one line naming the variable, the value and the rule.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from collections.abc import Mapping
from typing import Annotated, Any, Self

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from dtq.errors import ConfigError

__all__ = [
    "MAX_REPLICA_TIMEOUT_MS",
    "MAX_SUBMIT_REPLICAS",
    "MAX_TIMEOUT_MS",
    "WORKER_ID_RE",
    "Settings",
    "describe_redis",
    "load_settings",
    "parse_sentinels",
    "redact_url",
    "unknown_variables",
]

MAX_TIMEOUT_MS = 3_600_000
MAX_SUBMIT_REPLICAS = 16
# WAIT holds the submit's connection (and its caller) this long at most; WAIT 0 would block
# forever, so 0 is refused too.
MAX_REPLICA_TIMEOUT_MS = 60_000
WORKER_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")  # DTQ_WORKER_ID, and the API's worker lookups

PositiveInt = Annotated[int, Field(gt=0)]


class Settings(BaseSettings):
    """All of dtq's settings with the contract's defaults. Durations carry their unit."""

    model_config = SettingsConfigDict(
        env_prefix="DTQ_",
        extra="ignore",
        frozen=True,
        validate_default=True,
        allow_inf_nan=False,  # DTQ_RETRY_MAX_DELAY=inf would pass every ">= 0" rule
    )

    redis_url: str = "redis://localhost:6379/0"
    # A Redis Cluster: DTQ_REDIS_URL names any of its nodes, and keys take the cluster layout
    # (dtq.keys; docs/redis-schema.md, "The cluster layout").
    redis_cluster: bool = False
    # A Sentinel-managed primary (docs/operations.md, "Sentinel"): the sentinels to ask and
    # the name they monitor it by. The primary's password, db and TLS still come from
    # redis_url, whose host and port are then unused.
    redis_sentinels: str = ""
    redis_sentinel_master: str = ""
    redis_sentinel_password: Annotated[str, Field(repr=False)] = ""
    api_host: str = "0.0.0.0"  # noqa: S104 - the contract's default; containers listen on all
    api_port: Annotated[int, Field(ge=1, le=65535)] = 8000
    ws_path: str = "/ws/events"
    worker_concurrency: Annotated[int, Field(ge=1, le=10_000)] = 4
    worker_id: str = ""
    worker_metrics_port: Annotated[int, Field(ge=0, le=65535)] = 9100
    worker_metrics_host: str = "0.0.0.0"  # noqa: S104 - like the API: containers listen on all
    visibility_timeout_s: Annotated[float, Field(gt=0)] = 30
    heartbeat_interval_s: Annotated[float, Field(gt=0)] = 5
    max_queue_depth: PositiveInt = 10_000
    max_payload_bytes: PositiveInt = 262_144
    task_timeout_ms: Annotated[int, Field(ge=1, le=MAX_TIMEOUT_MS)] = 30_000
    max_attempts: Annotated[int, Field(ge=1, le=1000)] = 10
    retry_base_delay: Annotated[float, Field(ge=0)] = 1.0
    retry_max_delay: Annotated[float, Field(ge=0)] = 60.0
    retry_jitter: Annotated[float, Field(ge=0, lt=1)] = 0.2
    task_retention_s: PositiveInt = 604_800
    result_retention_s: PositiveInt = 3_600
    result_max_bytes: Annotated[int, Field(ge=0)] = 8_192
    idem_ttl_s: PositiveInt = 86_400
    # Replicated submits (docs/delivery-guarantees.md, "Replicated submits"): a submit is
    # answered only once WAIT saw this many replicas hold it, or after the timeout with
    # REPLICATION_TIMEOUT. 0 sends no WAIT at all.
    submit_min_replicas: Annotated[int, Field(ge=0, le=MAX_SUBMIT_REPLICAS)] = 0
    submit_replica_timeout_ms: Annotated[int, Field(ge=1, le=MAX_REPLICA_TIMEOUT_MS)] = 1_000
    # A queue idle this long (no submit, nothing waiting, delayed, retrying or running) has its
    # keys removed by the scheduler leader (docs/redis-schema.md, "Queue lifetime").
    queue_idle_ttl_s: PositiveInt = 86_400
    drain_timeout_s: Annotated[float, Field(ge=0)] = 30
    dlq_enabled: bool = True
    dlq_maxlen: PositiveInt = 10_000
    api_key: str = ""
    log_level: str = "INFO"
    log_json: bool = False
    task_modules: str = "examples.tasks"
    near_expiration_s: PositiveInt = 60
    # Intervals of the worker's loops; production defaults, shrunk by tests.
    scheduler_interval_s: Annotated[float, Field(gt=0, le=60)] = 0.5
    reaper_interval_s: Annotated[float, Field(gt=0, le=600)] = 5.0
    claim_stale_s: Annotated[float, Field(gt=0)] = 60.0
    # How often a concurrency limit's places are checked for tasks that no longer run
    # (docs/limits.md, "Places that nothing holds").
    limit_sweep_s: Annotated[float, Field(gt=0, le=3600)] = 30.0

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str) -> str:
        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return value

    @field_validator("redis_sentinels")
    @classmethod
    def _sentinels(cls, value: str) -> str:
        parse_sentinels(value)
        return value

    @field_validator("ws_path")
    @classmethod
    def _ws_path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must start with /")
        return value

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, value: str) -> str:
        upper = value.upper()
        if upper not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ValueError("must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
        return upper

    @field_validator("worker_id")
    @classmethod
    def _worker_id(cls, value: str) -> str:
        if value and not WORKER_ID_RE.fullmatch(value):
            raise ValueError("must be at most 64 ASCII letters, digits, '-' or '_'")
        return value

    @model_validator(mode="after")
    def _cross_field(self) -> Self:
        if self.redis_sentinels and not self.redis_sentinel_master:
            raise ValueError(
                "DTQ_REDIS_SENTINEL_MASTER (the name the sentinels monitor the primary by) "
                "is required when DTQ_REDIS_SENTINELS is set"
            )
        if self.redis_sentinel_master and not self.redis_sentinels:
            raise ValueError(
                "DTQ_REDIS_SENTINEL_MASTER is set but DTQ_REDIS_SENTINELS is empty: "
                "name the sentinels as host:port,host:port"
            )
        if self.redis_cluster and self.redis_sentinels:
            raise ValueError(
                "DTQ_REDIS_CLUSTER and DTQ_REDIS_SENTINELS exclude each other: a cluster fails "
                "over on its own (its replicas), a Sentinel group watches one primary"
            )
        if self.redis_cluster and self.redis_url.startswith("unix://"):
            raise ValueError(
                "DTQ_REDIS_URL must be redis:// or rediss:// with DTQ_REDIS_CLUSTER (a cluster's "
                "nodes are found by host and port)"
            )
        if self.redis_sentinels and self.redis_url.startswith("unix://"):
            raise ValueError(
                "DTQ_REDIS_URL must be redis:// or rediss:// when DTQ_REDIS_SENTINELS is set "
                "(the sentinels name the primary by host and port)"
            )
        if self.heartbeat_interval_s >= self.visibility_timeout_s:
            raise ValueError(
                "DTQ_HEARTBEAT_INTERVAL_S must be below DTQ_VISIBILITY_TIMEOUT_S "
                f"({self.heartbeat_interval_s} >= {self.visibility_timeout_s})"
            )
        if self.retry_base_delay > self.retry_max_delay:
            raise ValueError(
                "DTQ_RETRY_BASE_DELAY must not exceed DTQ_RETRY_MAX_DELAY "
                f"({self.retry_base_delay} > {self.retry_max_delay})"
            )
        return self

    @property
    def task_module_list(self) -> list[str]:
        return [m.strip() for m in self.task_modules.split(",") if m.strip()]

    @property
    def sentinel_addresses(self) -> list[tuple[str, int]]:
        """``DTQ_REDIS_SENTINELS`` as (host, port) pairs; empty without Sentinel."""
        return parse_sentinels(self.redis_sentinels)


def parse_sentinels(value: str) -> list[tuple[str, int]]:
    """``"host:port,host:port"`` as (host, port) pairs (an IPv6 host in brackets:
    ``[::1]:26379``); an empty text is no sentinels. ValueError names the bad item."""
    out: list[tuple[str, int]] = []
    for raw in value.split(","):
        item = raw.strip()
        if not item and not value.strip():
            continue
        host, sep, port = item.rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(
                f"{item!r} is not host:port (comma-separated, port 1..65535, "
                "an IPv6 host in brackets)"
            )
        out.append((host, int(port)))
    return out


def describe_redis(settings: Settings) -> str:
    """Where ``settings`` point, fit for logs and messages (no credentials): the redacted URL
    (named a cluster's with ``DTQ_REDIS_CLUSTER``), or the primary's name and its sentinels."""
    if settings.redis_sentinels:
        sentinels = ",".join(f"{h}:{p}" for h, p in settings.sentinel_addresses)
        return f"primary {settings.redis_sentinel_master!r} via sentinels {sentinels}"
    if settings.redis_cluster:
        return f"the Redis Cluster at {redact_url(settings.redis_url)}"
    return redact_url(settings.redis_url)


def load_settings(**overrides: Any) -> Settings:
    """Build the settings from the environment (and overrides); one-line ConfigError if invalid.

    A ``DTQ_`` variable that is no setting is most likely misspelt: it is named in a warning
    (with the closest setting) instead of being dropped in silence.
    """
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        raise ConfigError(_one_line(exc)) from None
    for line in unknown_variables(os.environ):
        logging.getLogger("dtq.config").warning(line)
    return settings


# DTQ_ variables read by dtq's own tools, not settings of a running dtq.
_NOT_SETTINGS = frozenset(
    {"DTQ_TEST_REDIS_URL", "DTQ_CHAOS_SEED", "DTQ_CHAOS_FULL", "DTQ_REDIS_SERVER"}
)


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One warning line per ``DTQ_*`` variable that names no setting."""
    known = {f"DTQ_{name.upper()}" for name in Settings.model_fields}
    lines = []
    for name in sorted(environ):
        if not name.startswith("DTQ_") or name in known or name in _NOT_SETTINGS:
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        lines.append(f"{name} is not a dtq setting and is ignored{hint}")
    return lines


def _one_line(exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = err.get("loc") or ()
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    if not loc:  # a cross-field rule: its message names the variables already
        return f"invalid configuration: {msg}"
    name = "DTQ_" + str(loc[0]).upper()
    value = err.get("input")
    if isinstance(value, str):  # a URL's password stays out
        value = redact_url(value)
    return f"invalid configuration: {name}={value!r}: {msg}"


def redact_url(url: str) -> str:
    """``url`` without its credentials, fit for logs and messages: what stands before the last
    ``@`` of the part after the scheme becomes ``***`` (``redis://:pw@host`` ->
    ``redis://***@host``). Text without an ``@`` there is returned as it is."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    if "@" not in rest:
        return url
    return f"{scheme}{sep}***@{rest.rpartition('@')[2]}"
