"""What the SDK conformance modules share: installing an SDK on first use through its Makefile rule (under a file
lock, since xdist may start two modules at once), running its scenario program once, and asserting one scenario
of its JSON lines (``{"scenario", "ok", "detail"}``)."""

from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def make(stamp: str, tools: Sequence[str], what: str, lock: Path, timeout: float) -> None:
    """Run the Makefile rule ``stamp`` (it rebuilds what is older than its inputs); fail naming the tools that are
    missing (``what`` says which), or with the rule's output."""
    missing = [tool for tool in (*tools, "make") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"the {what} tests need {', '.join(missing)} on PATH: install them", pytrace=False)
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        done = subprocess.run(["make", "--no-print-directory", stamp], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout)
    if done.returncode != 0:
        pytest.fail(f"make {stamp} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}", pytrace=False)


def run(cmd: Sequence[str], *, cwd: Path, env: Mapping[str, str], timeout: float) -> dict[str, Any]:
    """Run a scenario program: its JSON lines by scenario (``lines``), its ``exit`` and its ``stderr``."""
    try:
        done = subprocess.run(list(cmd), cwd=cwd, env=dict(env), capture_output=True, text=True, timeout=timeout)
        stdout, stderr, code = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as err:
        stdout = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        stderr = err.stderr.decode() if isinstance(err.stderr, bytes) else (err.stderr or "")
        code = f"killed after {timeout:g} s"
    lines = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            lines[row["scenario"]] = row
    return {"lines": lines, "exit": code, "stderr": stderr}


def check(results: dict[str, Any], scenario: str, program: str) -> None:
    """The scenario passed; a scenario that printed nothing fails with the program's exit and stderr."""
    row = results["lines"].get(scenario)
    if row is None:
        pytest.fail(f"{program} printed no line for {scenario} (exit {results['exit']}); its stderr ends:\n"
                    f"{results['stderr'][-4000:]}", pytrace=False)
    assert row["ok"], f"{scenario}: {row['detail']}"
