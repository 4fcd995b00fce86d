"""Instruction counts under valgrind's callgrind: the figure a shared machine cannot blur.

On a machine whose CPU time per task moves by half from one minute to the next (other tenants,
frequency changes), two variants' CPU times compare only over many interleaved rounds. The
instructions a process runs for the same work do not move: run it under callgrind with its
instrumentation off (``--instr-atstart=no``), switch it on for the measured work only
(``callgrind_control -i on``), off again, dump, and read the totals. Timers of the process
(a server's cron, a worker's heartbeat) still run a little more under valgrind's slowness, so a
count is exact to a fraction of a percent, not to the instruction. valgrind is Debian's
``valgrind`` package; ``callgrind_control`` and ``callgrind_annotate`` come with it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["annotate", "instructions", "launcher", "server_wrapper", "switch"]


def launcher(out_dir: Path, name: str) -> tuple[str, ...]:
    """The command prefix that runs a program under callgrind, instrumentation off, its dumps
    in ``out_dir`` as ``<name>.out*``."""
    return (
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={out_dir / name}.out",
    )


def server_wrapper(out_dir: Path, binary: str) -> str:
    """An executable that runs the server ``binary`` under :func:`launcher` (for
    ``start_redis(binary=...)``, which runs the binary it is given)."""
    wrapper = out_dir / "redis-server"
    prefix = " ".join(launcher(out_dir, "redis"))
    wrapper.write_text(f'#!/bin/sh\nexec {prefix} {binary} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def switch(pid: int, on: bool) -> None:
    """Instrumentation of ``pid`` on, or off and what it counted so far dumped."""
    state = "on" if on else "off"
    subprocess.run(["callgrind_control", "-i", state, str(pid)], check=True, capture_output=True)
    if not on:
        subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)


def _dumps(out_dir: Path, name: str) -> list[Path]:
    return sorted(out_dir.glob(f"{name}.out*"))


def instructions(out_dir: Path, name: str) -> int:
    """The instructions the dumps of ``name`` counted, in all."""
    return sum(
        int(line.split()[1])
        for dump in _dumps(out_dir, name)
        for line in dump.read_text().splitlines()
        if line.startswith("totals:")
    )


def annotate(out_dir: Path, name: str, top: int = 40) -> str:
    """The functions that ran the most of ``name``'s instructions themselves."""
    parts = []
    for dump in _dumps(out_dir, name):
        report = subprocess.run(
            ["callgrind_annotate", str(dump)], check=True, capture_output=True, text=True
        ).stdout
        lines = report.splitlines()
        start = next((i for i, line in enumerate(lines) if "PROGRAM TOTALS" in line), None)
        if start is not None and not lines[start].lstrip().startswith(("0 ", ".")):
            parts.append("\n".join(lines[start : start + top + 4]))
    return "\n".join(parts)
