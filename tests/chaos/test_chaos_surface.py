"""The attack surface (docs/reliability.md): every route the app serves is enumerated from its
router, and every destructive one refuses without the API key (401) and with a wrong one
(403), on a real API process; the key check is constant-time; and no code under ``src/`` can
run data as code (pickle, marshal, eval, exec, yaml.load, an import_module of a name that is
not the operator's configuration)."""

from __future__ import annotations

import ast
import re
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from chaos_api import API_KEY
from chaos_harness import REPO, Cluster
from fastapi.routing import APIRoute

from dtq.api import create_app
from dtq.config import Settings

SRC = REPO / "src"
SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}
# Non-safe routes that anyone may call: submitting a task is the API's open door (contract 13),
# and a workflow is submitted through the same door (docs/workflows.md).
OPEN_WRITES = {("POST", "/api/v1/tasks"), ("POST", "/api/v1/workflows")}
# import_module calls whose argument is the operator's own configuration (DTQ_TASK_MODULES,
# DESIGN 9), never a value from a request or a task: (file, function).
CONFIGURED_IMPORTS = {("dtq_tasks/modules.py", "load_task_modules")}


def _walk(routes: Iterable[Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """(method, path) of every API route, through included routers (FastAPI >= 0.165 keeps
    an included router behind a wrapper that names it ``original_router``)."""
    for route in routes:
        if isinstance(route, APIRoute):
            for method in route.methods:
                yield method, prefix + route.path
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from _walk(inner.routes, prefix + route.include_context.prefix)


def _routes() -> list[tuple[str, str]]:
    app = create_app(Settings(redis_url="redis://127.0.0.1:1/0", task_modules=""))
    found = set(_walk(app.routes))
    documented = {(m.upper(), p) for p, ops in app.openapi()["paths"].items() for m in ops}
    assert documented <= found, f"routes the walk missed: {documented - found}"
    return sorted(found)


def _fill(path: str) -> str:
    values = {"task_id": "0" * 32, "queue": "default", "worker_id": "w-1"}
    return re.sub(r"\{(\w+)(?::\w+)?\}", lambda m: values.get(m.group(1), "x"), path)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    import asyncio

    c = Cluster(tmp_path_factory.mktemp("surface"))
    try:
        c.start_redis()
        c.spawn_api({"DTQ_API_KEY": API_KEY})
        asyncio.run(c.wait_api())
        yield c
    finally:
        c.close()


@pytest.fixture
async def client(api: Cluster) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=api.api_base, timeout=10) as c:
        yield c


def test_the_router_has_destructive_routes_to_check() -> None:
    destructive = [r for r in _routes() if r[0] not in SAFE_METHODS and r not in OPEN_WRITES]
    assert len(destructive) >= 8, destructive  # cancel, expire, DLQ x3, pause, resume, purge


@pytest.mark.parametrize(
    ("method", "path"),
    [r for r in _routes() if r[0] not in SAFE_METHODS and r not in OPEN_WRITES],
)
async def test_every_destructive_route_refuses_without_the_key(
    client: httpx.AsyncClient, method: str, path: str
) -> None:
    url = _fill(path)
    missing = await client.request(method, url, json={})
    assert missing.status_code == 401, (method, url, missing.text)
    assert missing.json()["error"]["code"] == "UNAUTHORIZED"
    wrong = await client.request(method, url, json={}, headers={"X-API-Key": API_KEY + "x"})
    assert wrong.status_code == 403, (method, url, wrong.text)
    assert wrong.json()["error"]["code"] == "FORBIDDEN"


async def test_reads_and_submit_stay_open(client: httpx.AsyncClient) -> None:
    for method, path in _routes():
        if method in SAFE_METHODS:
            resp = await client.request(method, _fill(path))
            assert resp.status_code not in (401, 403, 500), (method, path, resp.status_code)
    submitted = await client.post("/api/v1/tasks", json={"task_type": "chaos_work"})
    assert submitted.status_code == 202, submitted.text


def test_the_key_is_compared_in_constant_time() -> None:
    tree = ast.parse((SRC / "dtq/api/auth.py").read_text())
    [fn] = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == "operator"
    ]
    calls = [
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "compare_digest"
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "hmac"
    ]
    assert calls, "operator() must compare the key with hmac.compare_digest"
    compared = {
        name.id
        for node in ast.walk(fn)
        if isinstance(node, ast.Compare)
        and any(isinstance(o, ast.Eq | ast.NotEq) for o in node.ops)
        for name in ast.walk(node)
        if isinstance(name, ast.Name)
    }
    assert not compared & {"given", "key"}, f"a plain comparison of the key: {compared}"


def _dangerous(path: Path, root: Path = SRC) -> list[str]:
    rel = path.relative_to(root).as_posix()
    tree = ast.parse(path.read_text(), filename=rel)
    found: list[str] = []
    functions: dict[ast.AST, str] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            for child in ast.walk(fn):
                functions.setdefault(child, fn.name)
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names]
            if isinstance(node, ast.ImportFrom) and node.module:
                names.append(node.module)
            for name in names:
                if name.split(".")[0] in {"pickle", "marshal", "shelve", "dill", "cloudpickle"}:
                    found.append(f"{where}: import {name}")
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in {"eval", "exec", "compile", "__import__"}:
            found.append(f"{where}: {func.id}()")
        if isinstance(func, ast.Attribute):
            owner = func.value.id if isinstance(func.value, ast.Name) else ""
            if func.attr in {"load", "load_all", "unsafe_load"} and owner == "yaml":
                found.append(f"{where}: yaml.{func.attr}()")
            if func.attr in {"loads", "load"} and owner in {"pickle", "marshal"}:
                found.append(f"{where}: {owner}.{func.attr}()")
            if func.attr == "import_module":
                constant = bool(node.args) and isinstance(node.args[0], ast.Constant)
                if not constant and (rel, functions.get(node, "")) not in CONFIGURED_IMPORTS:
                    found.append(f"{where}: import_module of a computed name")
    return found


def test_no_code_under_src_runs_data_as_code() -> None:
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 30
    found = [hit for path in files for hit in _dangerous(path)]
    assert not found, found


def test_the_static_check_catches_what_it_looks_for(tmp_path: Path) -> None:
    """The scanner itself: each forbidden form in a sample file is reported."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import pickle\nimport importlib\nimport yaml\n"
        "def f(name, text):\n"
        "    eval(text)\n    exec(text)\n    yaml.load(text)\n"
        "    pickle.loads(text)\n    importlib.import_module(name)\n"
        "    importlib.import_module('json')\n"
    )
    hits = _dangerous(sample, tmp_path)
    kinds = {h.split(": ", 1)[1] for h in hits}
    assert kinds == {
        "import pickle",
        "eval()",
        "exec()",
        "yaml.load()",
        "pickle.loads()",
        "import_module of a computed name",
    }, hits
