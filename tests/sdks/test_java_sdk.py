"""The emulator held to the Java SDK: azure-messaging-servicebus 7.17.20 runs every scenario of
tests/sdks/java (one JVM for the module) against the in-process emulator; one test per scenario.

The Java program is built on first use, like .venv: ``make tests/sdks/java/target/.installed`` (Maven,
Java 17), under a file lock because xdist may start this module while another worker builds."""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import fast_path
import harness
import pytest

from spark_sb.emulator import Emulator
from spark_sb.emulator.model import QueueSpec, RuleSpec, SubscriptionSpec, TopicSpec

#: a JVM in a subprocess; the first test's setup also builds the program (Maven downloads its jars the first time)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = harness.ROOT
JAVA = ROOT / "tests" / "sdks" / "java"
STAMP = "tests/sdks/java/target/.installed"
RUN_TIMEOUT_S = 240

#: fast_path.QUEUES' names -> the scenario python_fast_path's queues (its own, then its helpers)
FAST_PATH_QUEUES = {"fast": "python_fast_path", "sdk": "python_fast_path_sdk",
                    "fast_session": "python_fast_path_session", "sdk_session": "python_fast_path_session_sdk"}
#: scenario -> the entity it uses (named <prefix><scenario with hyphens>), as Scenarios.java expects
QUEUES: dict[str, dict[str, Any]] = {
    "send_receive_fields": {},
    "body_types": {},
    "batch": {},
    "peek": {},
    "defer": {},
    "dead_letter": {},
    "abandon": {},
    "schedule": {},
    "sessions": {"requires_session": True, "lock_duration": 30.0},
    "duplicate_detection": {"requires_duplicate_detection": True},
    "lock_renewal": {"lock_duration": 5.0},
    "processor": {},
    "session_processor": {"requires_session": True, "lock_duration": 30.0},
    "receive_and_delete": {},
    "transactions_refused": {},
    "async_clients": {},
    "size_limit": {},
    "errors": {"lock_duration": 5.0},
    "errors_disabled": {"status": "Disabled"},
    "errors_busy": {},
    "ttl_expiry": {"dead_lettering_on_message_expiration": True},
    "outage_recovery": {},
    "close": {},
    # what the Python sink sent with its fast encoder (python_fast_path) and with the SDK's (fast_path.py)
    **{FAST_PATH_QUEUES[name]: {"requires_session": True} if session else {}
       for name, session in fast_path.QUEUES.items()},
}
#: scenario -> its topic's subscriptions and each one's rule
TOPICS: dict[str, dict[str, RuleSpec]] = {
    "topic_filters": {
        "sql": RuleSpec("red-many", {"type": "sql", "expression": "color = 'red' AND quantity > 2"}),
        "correlation": RuleSpec("order-42", {"type": "correlation", "correlation_id": "order-42"}),
        "all": RuleSpec(),
    },
    "rule_manager": {"managed": RuleSpec()},
}
#: entities of a scenario, not scenarios; errors_busy carries an injected busy fault during the run
HELPERS = {"errors_disabled", "errors_busy", *list(FAST_PATH_QUEUES.values())[1:]}
#: the administration scenario makes its own entities through the Java admin client
SCENARIOS = [*(q for q in QUEUES if q not in HELPERS), *TOPICS, "administration"]


def _build() -> None:
    """Run the Makefile rule (it rebuilds when pom.xml or a source is newer than the stamp)."""
    harness.make(STAMP, ("java", "mvn"), "Java SDK (Java 17 and Maven)", JAVA / "target" / ".build.lock", 900)


def create(emulator: Emulator, namespace: str, spec: Any) -> None:
    server = emulator.server(namespace)  # as tests/conftest.py's create (a conftest is not importable)
    server.call(lambda: server.broker.create_entity(spec))


def _entities(emulator: Emulator, prefix: str) -> None:
    for scenario, props in QUEUES.items():
        create(emulator, "primary", QueueSpec(name=prefix + scenario.replace("_", "-"), **props))
    for scenario, subscriptions in TOPICS.items():
        topic = prefix + scenario.replace("_", "-")
        create(emulator, "primary", TopicSpec(name=topic))
        for sub, rule in subscriptions.items():
            create(emulator, "primary", SubscriptionSpec(topic=topic, name=sub, rules=[rule]))


@pytest.fixture(scope="module")
def java_results(emulator: Emulator) -> dict[str, Any]:
    _build()
    prefix = f"java-{uuid.uuid4().hex[:6]}-"
    _entities(emulator, prefix)
    sent = fast_path.send(emulator, {name: prefix + scenario.replace("_", "-")
                                     for name, scenario in FAST_PATH_QUEUES.items()})
    ns = emulator["primary"]
    env = dict(os.environ, SB_CONNECTION_STRING=ns.connection_string, SB_ENTITY_PREFIX=prefix,
               SB_ADMIN_ENDPOINT=f"http://localhost:{ns.admin_port}", SB_FAST_PATH=json.dumps(sent))
    cmd = ["java", "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn", "-cp",
           f"{JAVA / 'target' / 'classes'}{os.pathsep}{JAVA / 'target' / 'dependency' / '*'}", "sparksb.Scenarios"]
    busy = prefix + "errors-busy"
    emulator.fault("primary", "busy", entity=busy)
    try:
        return harness.run(cmd, cwd=ROOT, env=env, timeout=RUN_TIMEOUT_S)
    finally:
        emulator.heal("primary", entity=busy)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_java_sdk(java_results: dict[str, Any], scenario: str) -> None:
    harness.check(java_results, scenario, "the Java program")


def test_the_java_program_exits_cleanly_and_every_scenario_it_ran_is_asserted(java_results: dict[str, Any]) -> None:
    assert java_results["exit"] == 0, f"exit {java_results['exit']}; stderr ends:\n{java_results['stderr'][-4000:]}"
    unasserted = sorted(set(java_results["lines"]) - set(SCENARIOS))
    assert not unasserted, f"Scenarios.java ran {unasserted}: add them to SCENARIOS (with their entities)"
