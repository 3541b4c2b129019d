"""The emulator held to the JavaScript SDK: @azure/service-bus 7.9.5 runs every scenario of
tests/sdks/js/scenarios.mjs (one node process for the module) against the in-process emulator; one test per
scenario. The topics, their rules and the duplicate-detection queue are created by the SDK's own
ServiceBusAdministrationClient on the namespace's admin port; the other entities here.

node_modules is installed on first use, like .venv: ``make tests/sdks/js/node_modules/.installed`` (``npm ci``
from package-lock.json), under a file lock because xdist may start this module while another worker installs."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Sequence
from typing import Any

import fast_path
import harness
import pytest

from spark_sb.emulator import Emulator
from spark_sb.emulator.model import QueueSpec

ROOT = harness.ROOT
JS = ROOT / "tests" / "sdks" / "js"
STAMP = "tests/sdks/js/node_modules/.installed"
RUN_TIMEOUT_S = 180

#: fast_path.QUEUES' names -> this module's queues for them
FAST_PATH_QUEUES = {"fast": "python_fast_path", "sdk": "python_fast_path_sdk",
                    "fast_session": "python_fast_path_session", "sdk_session": "python_fast_path_session_sdk"}
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
    # what the Python sink sent with its fast encoder and with the SDK's (python_fast_path; fast_path.py)
    **{FAST_PATH_QUEUES[name]: {"requires_session": True} if session else {}
       for name, session in fast_path.QUEUES.items()},
}
#: every scenario of scenarios.mjs, in its order; close_shared is the close of the client all the others used
SCENARIOS = [
    "message_fields", "message_without_id", "batch", "peek", "defer", "dead_letter", "abandon", "max_delivery",
    "receive_and_delete", "schedule", "sessions", "topic_filters", "duplicate_detection", "lock_renewal",
    "size_limit", "subscribe", "session_subscribe", "rule_manager", "expiry", "lock_lost", "body_types", "iterator",
    "not_found", "close", "python_fast_path", "close_shared",
]


def _install() -> None:
    """Run the Makefile rule (it reinstalls when package-lock.json is newer than the stamp)."""
    harness.make(STAMP, ("node", "npm"), "JavaScript SDK (Node.js 18 or later with npm)", JS / "package-lock.json",
                 600)


def _create(emulator: Emulator, spec: Any) -> None:
    server = emulator.server("primary")  # as tests/conftest.py's create (a conftest is not importable)
    server.call(lambda: server.broker.create_entity(spec))


def run_scenarios(emulator: Emulator, scenarios: Sequence[str] = SCENARIOS, **extra_env: str) -> dict[str, Any]:
    """Create the queues on ``emulator``'s primary, send python_fast_path's messages there through the Python
    sink when it is one of ``scenarios`` (``emulator`` has a secondary then: the sink's configuration pairs them)
    and run those of scenarios.mjs once against it (``extra_env``: more of its input, such as SB_WEBSOCKET); its
    JSON lines by scenario, its exit and its stderr."""
    _install()
    prefix = f"js-{uuid.uuid4().hex[:6]}"
    names: dict[str, str] = {"prefix": prefix}
    for key, props in QUEUES.items():
        names[key] = f"{prefix}-{key.replace('_', '-')}"
        _create(emulator, QueueSpec(name=names[key], **props))
    ns = emulator["primary"]
    env = dict(os.environ, SB_CONNECTION_STRING=ns.connection_string, SB_ADMIN_PORT=str(ns.admin_port),
               SB_ENTITIES=json.dumps(names), SB_SCENARIOS=",".join(scenarios), **extra_env)
    if "python_fast_path" in scenarios:
        env["SB_FAST_PATH"] = json.dumps(fast_path.send(emulator, {name: names[key]
                                                                   for name, key in FAST_PATH_QUEUES.items()}))
    return harness.run(["node", "scenarios.mjs"], cwd=JS, env=env, timeout=RUN_TIMEOUT_S)


@pytest.fixture(scope="module")
def js_results(emulator: Emulator) -> dict[str, Any]:
    return run_scenarios(emulator)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_js_sdk(js_results: dict[str, Any], scenario: str) -> None:
    harness.check(js_results, scenario, "the node script")


def test_every_scenario_is_asserted(js_results: dict[str, Any]) -> None:
    """A scenario added to scenarios.mjs is asserted here too."""
    assert sorted(js_results["lines"]) == sorted(SCENARIOS)
