"""mypy checks typed task handles: ``tests/typing_samples/typed_ok.py`` (the API used as
documented, its types pinned with ``assert_type``) passes the project's strict configuration,
and ``typed_bad.py`` (a wrong payload type, a misspelt or mistyped option, a result used as
what it is not) fails with exactly the errors marked ``# E: <code>`` on their lines.

One mypy run checks both files, against the ``dtq`` and ``dtq_tasks`` this test imports."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import dtq_tasks

TESTS = Path(__file__).resolve().parents[1]
SAMPLES = TESTS / "typing_samples"
CONFIG = TESTS.parent / "pyproject.toml"
ERROR = re.compile(r"^(?P<path>[^:]+):(?P<line>\d+): error: .*\[(?P<code>[a-z-]+)\]$")
MARK = re.compile(r"#\s*E:\s*(?P<code>[a-z-]+)\s*$")


def _marked(path: Path) -> set[tuple[int, str]]:
    lines = path.read_text().splitlines()
    return {(n, m["code"]) for n, line in enumerate(lines, 1) if (m := MARK.search(line))}


def test_mypy_accepts_the_documented_use_and_rejects_the_misuses(tmp_path: Path) -> None:
    ok, bad = SAMPLES / "typed_ok.py", SAMPLES / "typed_bad.py"
    expected = _marked(bad)
    assert len(expected) >= 10, "the bad sample lost its marks"
    assert not _marked(ok)
    # MYPYPATH: the source tree under test, whatever the venv's install points at.
    src = Path(dtq_tasks.__file__).resolve().parents[1]
    env = {**os.environ, "MYPYPATH": str(src)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(CONFIG),
            "--cache-dir",
            str(tmp_path / "mypy-cache"),
            "--no-error-summary",
            "--hide-error-context",
            "--no-pretty",
            str(ok),
            str(bad),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=110,
        check=False,
    )
    errors: dict[str, set[tuple[int, str]]] = {}
    other = []
    for line in proc.stdout.splitlines():
        if m := ERROR.match(line):
            errors.setdefault(Path(m["path"]).name, set()).add((int(m["line"]), m["code"]))
        elif ": note: " not in line:
            other.append(line)
    assert not other, f"mypy said what is not an error line:\n{proc.stdout}{proc.stderr}"
    assert set(errors) <= {ok.name, bad.name}, proc.stdout
    assert errors.get(ok.name, set()) == set(), proc.stdout
    found = errors.get(bad.name, set())
    assert found == expected, (
        f"missing: {sorted(expected - found)}, unexpected: {sorted(found - expected)}\n"
        f"{proc.stdout}"
    )
    assert proc.returncode == 1, proc.stderr
