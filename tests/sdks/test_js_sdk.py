"""The emulator held to the JavaScript SDK: @azure/service-bus 7.9.5 runs every scenario of
tests/sdks/js/scenarios.mjs (one node process for the module) against the in-process emulator; one test per
scenario. The topics, their rules and the duplicate-detection queue are created by the SDK's own
ServiceBusAdministrationClient on the namespace's admin port; the other entities here.

node_modules is installed on first use, like .venv: ``make tests/sdks/js/node_modules/.installed`` (``npm ci``
from package-lock.json), under a file lock because xdist may start this module while another worker installs."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from spark_sb.emulator import Emulator
from spark_sb.emulator.model import QueueSpec

ROOT = Path(__file__).resolve().parents[2]
JS = ROOT / "tests" / "sdks" / "js"
STAMP = "tests/sdks/js/node_modules/.installed"
RUN_TIMEOUT_S = 180

#: the queues this module creates: scenario (or SB_ENTITIES key) -> QueueSpec properties
QUEUES: dict[str, dict[str, Any]] = {
    "fields": {"requires_session": True},
    "without_id": {},
    "batch": {},
    "peek": {},
    "defer": {},
    "dead_letter": {},
    "abandon": {},
    "receive_and_delete": {},
    "schedule": {},
    "session": {"requires_session": True},
    "lock_renewal": {},
    "session_lock": {"requires_session": True},
    "size_limit": {},
    "subscribe": {},
    "body_types": {},
    "iterator": {},
    "session_subscribe": {"requires_session": True},
    "close": {},
}
#: every scenario of scenarios.mjs, in its order; close_shared is the close of the client all the others used
SCENARIOS = [
    "message_fields", "message_without_id", "batch", "peek", "defer", "dead_letter", "abandon", "max_delivery",
    "receive_and_delete", "schedule", "sessions", "topic_filters", "duplicate_detection", "lock_renewal",
    "size_limit", "subscribe", "session_subscribe", "rule_manager", "expiry", "lock_lost", "body_types", "iterator",
    "not_found", "close", "close_shared",
]


def _install() -> None:
    """Run the Makefile rule (it reinstalls when package-lock.json is newer than the stamp)."""
    missing = [tool for tool in ("node", "npm", "make") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"the JavaScript SDK tests need {', '.join(missing)} on PATH (Node.js 18 or later with npm): "
                    "install them", pytrace=False)
    with open(JS / "package-lock.json") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = subprocess.run(["make", "--no-print-directory", STAMP], cwd=ROOT, capture_output=True, text=True,
                              timeout=600)
    if done.returncode != 0:
        pytest.fail(f"installing tests/sdks/js (npm ci) failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}",
                    pytrace=False)


def _create(emulator: Emulator, spec: Any) -> None:
    server = emulator.server("primary")  # as tests/conftest.py's create (a conftest is not importable)
    server.call(lambda: server.broker.create_entity(spec))


def run_scenarios(emulator: Emulator, **extra_env: str) -> dict[str, Any]:
    """Create the queues on ``emulator``'s primary and run scenarios.mjs once against it (``extra_env``: more of
    its input, such as SB_WEBSOCKET); its JSON lines by scenario, its exit and its stderr."""
    _install()
    prefix = f"js-{uuid.uuid4().hex[:6]}"
    names: dict[str, str] = {"prefix": prefix}
    for key, props in QUEUES.items():
        names[key] = f"{prefix}-{key.replace('_', '-')}"
        _create(emulator, QueueSpec(name=names[key], **props))
    ns = emulator["primary"]
    env = dict(os.environ, SB_CONNECTION_STRING=ns.connection_string, SB_ADMIN_PORT=str(ns.admin_port),
               SB_ENTITIES=json.dumps(names), **extra_env)
    try:
        done = subprocess.run(["node", "scenarios.mjs"], cwd=JS, env=env, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
        stdout, stderr, code = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as err:
        stdout = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        stderr = err.stderr.decode() if isinstance(err.stderr, bytes) else (err.stderr or "")
        code = f"killed after {RUN_TIMEOUT_S} s"
    lines = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            lines[row["scenario"]] = row
    return {"lines": lines, "exit": code, "stderr": stderr}


@pytest.fixture(scope="module")
def js_results(emulator: Emulator) -> dict[str, Any]:
    return run_scenarios(emulator)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_js_sdk(js_results: dict[str, Any], scenario: str) -> None:
    row = js_results["lines"].get(scenario)
    if row is None:
        pytest.fail(f"the node script printed no line for {scenario} (exit {js_results['exit']}); its stderr "
                    f"ends:\n{js_results['stderr'][-4000:]}", pytrace=False)
    assert row["ok"], f"{scenario}: {row['detail']}"


def test_every_scenario_is_asserted(js_results: dict[str, Any]) -> None:
    """A scenario added to scenarios.mjs is asserted here too."""
    assert sorted(js_results["lines"]) == sorted(SCENARIOS)
