"""deploy/: the compose file, the Dockerfile, Prometheus's configuration and alert rules, and the
Grafana dashboard, checked without Docker (it cannot run here): parsed, held against the real
entry points and settings, and every metric they name found in a live scrape of a real API and
a real worker."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from dtq.api import create_app
from dtq.config import Settings
from dtq.metrics import LABEL_NAMES, MetricsServer
from dtq.worker import Worker
from dtq.worker.telemetry import WorkerTelemetry
from dtq_cli.parser import build_parser
from dtq_tasks import load_task_modules

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "dtq.json"

METRIC_RE = re.compile(r"\b(dtq_[a-z0-9_]+)\b")
BY_RE = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
SELECTOR_RE = re.compile(r"\{([^}]*)\}")
PROMETHEUS_LABELS = {"job", "instance"}  # of `up`, set by Prometheus itself


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def compose() -> dict[str, Any]:
    data: dict[str, Any] = load_yaml(COMPOSE)
    return data


def services() -> dict[str, Any]:
    svc: dict[str, Any] = compose()["services"]
    return svc


def workers() -> dict[str, Any]:
    return {name: s for name, s in services().items() if name.startswith("worker")}


# -- compose -------------------------------------------------------------------------------------


def test_compose_has_redis_api_two_workers_and_prometheus() -> None:
    svc = services()
    assert {"redis", "api", "prometheus"} <= set(svc)
    assert len(workers()) == 2


def test_redis_is_persistent_and_publishes_no_port() -> None:
    svc = services()
    redis = svc["redis"]
    assert "ports" not in redis
    cmd = redis["command"]
    cmd = shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]
    assert cmd[cmd.index("--appendonly") + 1] == "yes", cmd
    assert cmd[cmd.index("--maxmemory-policy") + 1] == "noeviction", cmd
    assert any(str(v).endswith(":/data") for v in redis["volumes"]), "a volume holds its data"
    for name, service in svc.items():
        for port in service.get("ports", []):
            assert "6379" not in str(port), f"{name} publishes a Redis port"
    networks = compose()["networks"]
    assert redis["networks"] == ["backend"] and networks["backend"]["internal"] is True


def _command(service: dict[str, Any]) -> list[str]:
    cmd = service["command"]
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def test_commands_are_the_real_entry_points() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["dtq"] == "dtq_cli.cli:main"
    parser = build_parser()
    api = _command(services()["api"])
    assert api[:2] == ["dtq", "api"]
    assert parser.parse_args(api[1:]).cmd == "api"
    for name, worker in workers().items():
        cmd = _command(worker)
        assert cmd[:3] == ["dtq", "worker", "run"], name
        assert parser.parse_args(cmd[1:]).cmd == "worker.run", name


def test_environment_names_real_settings_and_the_redis_service() -> None:
    fields = set(Settings.model_fields)
    for name in ("api", *workers()):
        env = services()[name]["environment"]
        for key in env:
            assert key.startswith("DTQ_") and key[4:].lower() in fields, f"{name}: {key}"
        assert env["DTQ_REDIS_URL"].startswith("redis://redis:"), name
        assert env["DTQ_API_KEY"].startswith("${DTQ_API_KEY:?"), "no default API key"


def test_prometheus_scrapes_the_api_and_every_worker() -> None:
    mounts = [str(v).split(":")[0] for v in services()["prometheus"]["volumes"]]
    for mount in mounts:
        if mount.startswith("./"):
            assert (DEPLOY / mount).is_file(), mount
    config = load_yaml(PROMETHEUS)
    targets = {
        job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
        for job in config["scrape_configs"]
    }
    assert targets["dtq-api"] == ["api:8000"]
    port = str(services()["worker-1"]["environment"]["DTQ_WORKER_METRICS_PORT"])
    assert sorted(targets["dtq-worker"]) == sorted(f"{w}:{port}" for w in workers())
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]


# -- Dockerfile ------------------------------------------------------------------------------------


def instructions(path: Path) -> Iterator[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            joined += line[:-1] + " "
            continue
        joined += line
        word, _, rest = joined.partition(" ")
        yield word.upper(), rest.strip()
        joined = ""


def test_dockerfile_is_multi_stage_and_runs_as_non_root() -> None:
    steps = list(instructions(DOCKERFILE))
    froms = [i for i, (word, _) in enumerate(steps) if word == "FROM"]
    assert len(froms) >= 2, "multi-stage"
    final = steps[froms[-1] :]
    assert any(w == "COPY" and a.startswith("--from=") for w, a in final), "copies a build stage"
    users = [a for w, a in final if w == "USER"]
    assert users, "the final stage sets USER"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}, user
    cmd = json.loads(next(a for w, a in reversed(final) if w == "CMD"))
    assert cmd[:2] == ["dtq", "api"]
    exposed = [p for w, a in final if w == "EXPOSE" for p in a.split()]
    assert "6379" not in exposed


# -- alerts and dashboard, against a live scrape -----------------------------------------------


def alert_exprs() -> list[str]:
    rules = [r for g in load_yaml(ALERTS)["groups"] for r in g["rules"]]
    for rule in rules:
        assert rule["alert"] and rule["expr"], rule
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule
        assert rule["annotations"]["summary"], rule
    return [str(r["expr"]) for r in rules]


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"]]
    return exprs


def test_alert_rules_cover_the_issue() -> None:
    names = {r["alert"] for g in load_yaml(ALERTS)["groups"] for r in g["rules"]}
    assert {
        "DtqNoLiveWorker",
        "DtqQueueNearFull",
        "DtqDeadLettersGrowing",
        "DtqRetryRateHigh",
        "DtqStaleWorkers",
        "DtqTasksExpiringUnprocessed",
    } <= names


def test_queries_group_and_select_only_real_labels() -> None:
    for expr in alert_exprs() + dashboard_exprs():
        for group in BY_RE.findall(expr):
            for label in filter(None, (x.strip() for x in group.split(","))):
                assert label in LABEL_NAMES | {"le"}, f"{label!r} in {expr}"
        for selector in SELECTOR_RE.findall(expr):
            for matcher in filter(None, (m.strip() for m in selector.split(","))):
                label = re.split(r"[=!~]", matcher, maxsplit=1)[0].strip()
                assert label in LABEL_NAMES | PROMETHEUS_LABELS, f"{label!r} in {expr}"


async def _live_names(settings: Settings) -> set[str]:
    """Every sample name a real API and a real worker can expose, from their /metrics."""
    s = settings.model_copy(update={"task_modules": "examples.tasks", "heartbeat_interval_s": 0.5})
    handlers = load_task_modules(s.task_module_list).handlers
    telemetry = WorkerTelemetry(handlers)
    worker = Worker(
        s,
        handlers=handlers,
        worker_id="worker-deploy01",
        observers=telemetry.observers("worker-deploy01"),
        on_redis_op=telemetry.metrics.script_call,
    )
    telemetry.watch(worker)
    server = MetricsServer(telemetry.metrics.registry, "127.0.0.1", 0)
    run = asyncio.create_task(worker.run())
    texts = []
    try:
        await asyncio.wait_for(worker.started.wait(), 15)
        async with httpx.AsyncClient() as c:
            texts.append((await c.get(f"http://127.0.0.1:{server.port}/metrics")).text)
        app = create_app(s)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                texts.append((await c.get("/metrics")).text)
    finally:
        worker.stop()
        await asyncio.wait_for(run, 30)
        server.stop()
    names: set[str] = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    for text in texts:
        for family in text_string_to_metric_families(text):
            names.update(family.name + sfx for sfx in suffixes.get(family.type, ("",)))
    return names


@pytest.mark.parametrize("source", ["alerts", "dashboard"])
async def test_every_metric_referenced_exists_in_a_live_scrape(
    settings: Settings, source: str
) -> None:
    exprs = alert_exprs() if source == "alerts" else dashboard_exprs()
    referenced = {name for expr in exprs for name in METRIC_RE.findall(expr)}
    assert len(referenced) >= 10
    live = await _live_names(settings)
    missing = sorted(referenced - live)
    assert not missing, f"{source} reference metrics no process exposes: {missing}"


def test_operations_doc_lists_every_setting() -> None:
    doc = (REPO / "docs" / "operations.md").read_text()
    missing = [n for n in Settings.model_fields if f"`DTQ_{n.upper()}`" not in doc]
    assert not missing, f"docs/operations.md does not describe {missing}"


async def test_operations_doc_describes_every_metric(settings: Settings) -> None:
    doc = (REPO / "docs" / "operations.md").read_text()
    live = await _live_names(settings)
    skip = ("_bucket", "_sum", "_created")
    exposed = {n for n in live if n.startswith("dtq_") and not n.endswith(skip)}
    exposed = {n.removesuffix("_count") for n in exposed}
    missing = sorted(n for n in exposed if f"`{n}" not in doc)
    assert not missing, f"docs/operations.md does not describe {missing}"
