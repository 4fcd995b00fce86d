"""The README's CLI tour is run, command by command, so it cannot drift from the CLI."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from test_cli_support import DTQ, REPO, clean_env

START, END = "<!-- cli-tour:start -->", "<!-- cli-tour:end -->"


def tour_block() -> str:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index(START) : readme.index(END)]
    blocks = re.findall(r"```sh\n(.*?)```", section, flags=re.DOTALL)
    assert len(blocks) == 1, "the tour is one ```sh block between the markers"
    return str(blocks[0])


def commands(block: str) -> list[str]:
    """Each command of the block (continuation lines joined, comments dropped)."""
    joined = block.replace("\\\n", " ")
    lines = [ln.split(" # ")[0].strip() for ln in joined.splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def test_every_tour_line_is_a_dtq_command() -> None:
    cmds = commands(tour_block())
    assert len(cmds) >= 10
    for cmd in cmds:
        assert re.match(r"^(\w+=\$\()?dtq ", cmd), cmd


def test_the_tour_runs(redis_url: str) -> None:
    """From the project root, as the README says (dtq submit imports examples.tasks)."""
    block = tour_block()
    env = clean_env(redis_url)
    env["PATH"] = f"{Path(DTQ).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(
        ["bash", "-c", "set -euo pipefail -x\n" + block],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
    ran = [ln for ln in proc.stderr.splitlines() if re.match(r"^\++ dtq ", ln)]
    assert len(ran) == len(commands(block))  # every command ran, none was skipped
    out = proc.stdout
    assert re.search(r"expires_at: 20\S+Z \(in (1h|59m \d+s)\)", out), out
    assert re.search(r"Version 1: queued \(created, expires_at: ", out)
    assert "Version 2: cancelled (cancel)" in out
    assert '"status": "expired"' in out
    assert "Purged queue tour: 0 tasks cancelled." in out
