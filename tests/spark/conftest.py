"""Spark fixtures: one local SparkSession for the whole test session (local[2], Delta configured once, no UI,
two shuffle partitions), configurations over the emulator pair, and helpers that count what arrived."""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusReceiveMode
from pairing import pair_config

from spark_sb import messages
from spark_sb.capabilities import admission_control, python_data_sources

if not python_data_sources():  # Spark 3.5: the sources cannot load there (test_spark_versions shows the error)
    collect_ignore = ["test_batch_read.py", "test_format_writer.py", "test_receive_lanes.py", "test_replication_stream.py",
                      "test_resend_fidelity.py", "test_servicebus_source.py", "test_source_blips.py", "test_source_edges.py",
                      "test_source_refusals.py", "test_errors_through_spark.py", "test_job_console.py",
                      "test_syphon_drain_after_kill.py", "test_syphon_stream.py", "test_until_empty.py",
                      "test_writer_edges.py"]


def read_limit(rows: int) -> Any:
    """The limit Spark passes a reader's ``latestOffset``: ``ReadMaxRows(rows)`` on Spark 4.2; none on Spark 4.0
    and 4.1 (no admission control: the reader's own ``maxMessagesPerTrigger`` caps the batch)."""
    if not admission_control():
        return None
    from pyspark.sql.streaming.datasource import ReadMaxRows

    return ReadMaxRows(rows)


@pytest.fixture(scope="session")
def event_log(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Where the session's Spark event log goes (tests/spark/test_secrets.py reads it)."""
    return tmp_path_factory.mktemp("event-log")


@pytest.fixture(scope="session")
def spark(event_log: Any) -> Iterator[Any]:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from delta import configure_spark_with_delta_pip
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master("local[2]")
        .appName("spark-sb-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension")
        .config("spark.sql.catalog.spark_catalog", "org.apache.spark.sql.delta.catalog.DeltaCatalog")
        .config("spark.driver.memory", "1g")
        # a Delta table's state is rebuilt over 2 partitions, not 50, on first read (5 s a table otherwise)
        .config("spark.databricks.delta.snapshotPartitions", "2")
        .config("spark.eventLog.enabled", "true")
        .config("spark.eventLog.dir", event_log.as_uri())
        .config("spark.eventLog.compress", "false")  # readable by tests/spark/test_syphon_stream.py
        # an idle stream reports progress every 200 ms rather than every 10 s: tests see "empty" at once
        .config("spark.sql.streaming.noDataProgressEventInterval", "200ms")
    )
    session = configure_spark_with_delta_pip(builder).getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


def sink_config(primary: Any, secondary: Any, **sink: Any) -> dict:
    """A configuration over the emulator pair with a unique backlog prefix and short intervals."""
    sa = {"backlog_queue_count": 2, "failover_interval": "1s", "ping_primary_interval": "1s",
          "primary_try_timeout": "3s", **sink.pop("send_availability", {})}  # 500 ms timed out under load
    return {**pair_config(primary, secondary, "sk", **sa), "sink": sink}


def receive_all(connection_string: str, queue: str, *, expected: int | None = None, wait: float = 2.0) -> list:
    """Receive and delete every message of ``queue`` (pings dropped), stopping after ``wait`` seconds without
    a message or once ``expected`` arrived."""
    received: list = []
    with ServiceBusClient.from_connection_string(connection_string, retry_total=0) as client:
        with client.get_queue_receiver(queue, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as receiver:
            while expected is None or len(received) < expected:
                page = receiver.receive_messages(max_message_count=250, max_wait_time=wait)
                if not page:
                    break
                received.extend(m for m in page if not messages.is_ping(m))
    return received


def backlog_ids(connection_string: str, queues: tuple[str, ...]) -> list[str]:
    """Message ids in the backlog queues (received and deleted)."""
    ids: list[str] = []
    for queue in queues:
        ids.extend(str(m.message_id) for m in receive_all(connection_string, queue, wait=0.5))
    return ids


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child process that starts its own Spark: this one without the gateway of the
    test session's JVM (the child would attach to it), with this Python for its workers, and ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_GATEWAY")}
    env["PYSPARK_PYTHON"] = sys.executable
    env.update(extra)
    return env


def wait_until(condition: Any, timeout: float = 30.0, step: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(step)


@pytest.fixture
def conf(primary: Any, secondary: Any) -> Iterator[dict]:
    """The emulator pair in active replication, no sink section: for the ``servicebus`` source's readers (a module
    may define its own ``conf``)."""
    from spark_sb.bus import close_all

    config = sink_config(primary, secondary)
    config["replication"] = {"mode": "active"}
    config.pop("sink")
    yield config
    close_all()


@pytest.fixture
def paired_conf(primary: Any, secondary: Any) -> Iterator[dict]:
    """The emulator pair in paired mode: for the writers, which send through the paired sender."""
    from spark_sb.bus import close_all

    yield sink_config(primary, secondary)
    close_all()


@pytest.fixture
def read(spark: Any, conf: dict) -> Any:
    """A batch read of an entity (``read("q/$DeadLetterQueue", namespaces="primary,secondary")``) with the
    module's ``conf``."""
    from spark_sb.source import config_options, register

    register(spark)

    def load(entity: str, **options: str) -> Any:
        return spark.read.format("servicebus").options(**config_options(conf), entity=entity, **options).load()

    return load


def write_json(folder: Any, name: str, rows: list[dict]) -> None:
    """``rows`` as a JSON lines file ``name`` in ``folder`` (made when missing): a file source's next batch."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


@contextlib.contextmanager
def one_heavy_spark_test(wait: float = 420.0) -> Iterator[None]:
    """Run the block while no other heavy Spark test runs on this machine, across the pytest processes and the Spark
    versions' suites that ``make test`` runs at the same time (a lock file, waited for up to ``wait`` seconds).

    Heavy: a Spark Connect server (``remote("local")`` always binds port 15002) and a standalone cluster (a master,
    two workers and their executors). Run together on two cores, the Connect server's Python ``foreachBatch`` worker
    missed Spark's fixed 10 s to connect back (``PythonWorkerFactory.createSimpleWorker``), and the query failed."""
    with open(Path(tempfile.gettempdir()) / "spark-sb-heavy-spark-test.lock", "w") as lock:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, f"another heavy Spark test still ran after {wait:g} s"
                time.sleep(1)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
