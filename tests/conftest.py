"""Shared fixtures: one emulator pair per test session, fresh entities per test."""

from __future__ import annotations

import itertools
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient

from spark_sb.emulator import Emulator, NamespaceInfo, NamespaceOptions
from spark_sb.emulator.model import QueueSpec, SubscriptionSpec, TopicSpec

_counter = itertools.count()
# Spark (the session of tests/spark and the jobs the tests start) talks to itself over loopback only
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
# The tests' JVMs (the Spark session, the jobs and the cluster the tests start, the Java SDK's scenarios) start
# often and run small workloads: compiling with C1 only and collecting with the serial collector took a fifth less
# time than the JIT's default tiers on two cores (tests/spark/test_sink.py and test_writer_job.py: 114 s against
# 145 s). Tests only: the jobs users run keep the JVM's defaults, and JDK_JAVA_OPTIONS set by the caller wins.
os.environ.setdefault("JDK_JAVA_OPTIONS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files that hold a slow test first, the one with the longest timeout first; the rest keep their order.

    ``make test`` hands out whole files (xdist's ``--dist loadfile --no-loadscope-reorder``) in this order, so the
    longest start first: xdist's own order (the files with the most tests first) hands out the one-test files of the
    standalone cluster and the README (about six minutes each) last, to run on after the other processes are done."""
    default = float(config.getini("timeout") or 0)

    def weight(item: pytest.Item) -> float:
        if not item.get_closest_marker("slow"):
            return 0.0
        timeout = item.get_closest_marker("timeout")
        return float(timeout.args[0]) if timeout and timeout.args else default

    weights: dict[Any, float] = {}
    for item in items:
        weights[item.path] = max(weights.get(item.path, 0.0), weight(item))
    items.sort(key=lambda item: -weights[item.path])  # stable: a file's tests keep their order


#: what fetches Delta's jars into Ivy's cache: those of delta-spark's pip helper (the session fixture) and those
#: the jobs, the cluster and the Connect tests name (spark_sb.capabilities.delta_package, not always the same)
_FETCH_DELTA = """
from delta import configure_spark_with_delta_pip
from pyspark.sql import SparkSession
from spark_sb.capabilities import delta_package
builder = SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
configure_spark_with_delta_pip(builder, extra_packages=[delta_package()]).getOrCreate().stop()
"""


def pytest_configure(config: pytest.Config) -> None:
    """Fetch Delta's jars once, in the controller, before xdist starts its workers. Each worker's first Spark
    session (or a job a test starts) otherwise resolves them from Maven Central at the same time as the other's,
    into the one Ivy cache, and on a machine that has not fetched them yet one of the two got a file of 0 bytes and
    its Spark did not start (a clean-clone make test on Spark 3.5: "Downloaded file size (0) doesn't match expected
    Content Length"). A marker per pyspark and delta-spark version keeps later runs from paying the JVM's start."""
    if hasattr(config, "workerinput"):
        return
    from importlib.metadata import PackageNotFoundError, version
    from pathlib import Path

    try:
        versions = f"pyspark-{version('pyspark')}-delta-{version('delta-spark')}"
    except PackageNotFoundError:
        return  # no Spark here
    marker = Path.home() / ".cache" / "spark-sb" / f"jars-{versions}.fetched"
    if marker.exists():
        return
    import fcntl
    import subprocess
    import sys

    marker.parent.mkdir(parents=True, exist_ok=True)
    # make test runs the other Spark versions beside this one: one fetch into the Ivy cache at a time
    with open(marker.parent / "ivy.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():
            return
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_GATEWAY")}
        env["PYSPARK_PYTHON"] = sys.executable
        done = subprocess.run([sys.executable, "-c", _FETCH_DELTA], env=env, capture_output=True, text=True,
                              timeout=900)
        if done.returncode == 0:
            marker.touch()


class FakeClock:
    """Epoch seconds that only move when a test says so."""

    def __init__(self, start: float | None = None) -> None:
        self.now = time.time() if start is None else start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def catch_up(self) -> None:
        """Not behind real time: the SDK checks a lock's expiry against the real clock, so a clock the session
        left behind (it moves only when told) made a lock the emulator had just given look expired (a
        MessageLockLostError raised by the SDK itself, in a long run only)."""
        self.now = max(self.now, time.time())


@pytest.fixture(scope="session")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    emu = Emulator(
        [NamespaceOptions("primary"), NamespaceOptions("secondary")],
        data_dir=tmp_path_factory.mktemp("emulator"),
    )
    with emu:
        yield emu


@pytest.fixture
def primary(emulator: Emulator) -> Iterator[NamespaceInfo]:
    yield emulator["primary"]
    emulator.heal("primary")


@pytest.fixture
def secondary(emulator: Emulator) -> Iterator[NamespaceInfo]:
    yield emulator["secondary"]
    emulator.heal("secondary")


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of a server that accepts every connection and never answers (a management
    endpoint that hangs): each connection is held open, unread, until the test ends."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, name="silent-endpoint", daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join(5)
    listener.close()
    for connection in held:
        connection.close()


@pytest.fixture
def client(primary: NamespaceInfo) -> Iterator[ServiceBusClient]:
    with ServiceBusClient.from_connection_string(primary.connection_string, retry_total=0) as c:
        yield c


def unique_name(request: pytest.FixtureRequest, prefix: str = "") -> str:
    base = re.sub(r"[^A-Za-z0-9-]", "-", request.node.name)[:40].strip("-")
    return f"{prefix}{base}-{next(_counter)}"


def create(emulator: Emulator, namespace: str, spec: Any) -> None:
    server = emulator.server(namespace)
    server.call(lambda: server.broker.create_entity(spec))


@pytest.fixture
def make_queue(emulator: Emulator, request: pytest.FixtureRequest) -> Callable[..., str]:
    """Create a queue with the given properties on a namespace (default primary); returns its name."""

    def make(namespace: str = "primary", **props: Any) -> str:
        name = unique_name(request, "q-")
        create(emulator, namespace, QueueSpec(name=name, **props))
        return name

    return make


@pytest.fixture
def make_topic(emulator: Emulator, request: pytest.FixtureRequest) -> Callable[..., str]:
    """Create a topic with subscriptions ({name: SubscriptionSpec kwargs}); returns the topic name."""

    def make(subscriptions: dict[str, dict[str, Any]], namespace: str = "primary", **props: Any) -> str:
        name = unique_name(request, "t-")
        create(emulator, namespace, TopicSpec(name=name, **props))
        for sub, kwargs in subscriptions.items():
            create(emulator, namespace, SubscriptionSpec(topic=name, name=sub, **kwargs))
        return name

    return make


@pytest.fixture(scope="session")
def session_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def fake_clock(session_clock: FakeClock) -> FakeClock:
    """The session's fake clock, caught up with real time at the start of each test (see FakeClock.catch_up)."""
    session_clock.catch_up()
    return session_clock


class ClockedEmulator:
    """An emulator whose time is a FakeClock: lock expiry, TTL and schedules move when a test says."""

    def __init__(self, emu: Emulator) -> None:
        self.emu = emu

    def __getitem__(self, name: str) -> NamespaceInfo:
        return self.emu[name]

    def make_queue(self, **props: Any) -> str:
        name = f"clocked-{next(_counter)}"
        create(self.emu, "clocked", QueueSpec(name=name, **props))
        return name


@pytest.fixture(scope="session")
def emulator_with_clock(session_clock: FakeClock, tmp_path_factory: pytest.TempPathFactory
                        ) -> Iterator[ClockedEmulator]:
    emu = Emulator([NamespaceOptions("clocked")], data_dir=tmp_path_factory.mktemp("clocked"), clock=session_clock)
    with emu:
        yield ClockedEmulator(emu)
