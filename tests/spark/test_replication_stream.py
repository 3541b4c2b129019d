"""Active replication end to end on the emulator pair: the sink in active mode through a primary outage, then
``format("servicebus")`` over both namespaces through ``spark_sb.dedupe`` into Delta, stopped mid-stream and
restarted from its checkpoint: each row exactly once."""

from __future__ import annotations

import collections
import time
import uuid
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient

from spark_sb import dedupe
from spark_sb.bus import close_all
from spark_sb.emulator.model import QueueSpec
from spark_sb.sink import PairedSink
from spark_sb.source import config_options, register

from .conftest import sink_config

#: run on every Spark version make test tries (Makefile, EVERY_SPARK)
pytestmark = pytest.mark.every_spark

ROWS, FILES = 100, 5


def _queue_on_both(emulator: Any) -> str:
    name = f"rs-{uuid.uuid4().hex[:8]}"
    for namespace in ("primary", "secondary"):
        server = emulator.server(namespace)
        server.call(lambda server=server: server.broker.create_entity(QueueSpec(name=name)))
    return name


def _left(info: Any, queue: str) -> int:
    with ServiceBusClient.from_connection_string(info.connection_string, retry_total=0) as client:
        with client.get_queue_receiver(queue) as receiver:
            return len(receiver.peek_messages(max_message_count=ROWS * 2, sequence_number=1))


def _read_query(spark: Any, conf: dict, queue: str, checkpoint: str, table: str) -> Any:
    stream = (spark.readStream.format("servicebus").options(**config_options(conf))
              .option("entity", queue).option("namespaces", "primary,secondary")
              .option("maxMessagesPerTrigger", "20").option("receiveTimeout", "0.5").load())
    return (dedupe(stream, window="10 minutes").select("message_id", "namespace", "body")
            .writeStream.format("delta").option("checkpointLocation", checkpoint)
            .trigger(processingTime="200 milliseconds").start(table))


def _wait(query: Any, until: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        if query.exception() is not None:
            raise AssertionError(f"the query failed: {query.exception()}")
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.3)


@pytest.mark.timeout(420)
def test_active_sink_through_an_outage_then_source_with_dedupe_yields_each_row_once_across_a_restart(
        spark, emulator, primary, secondary, tmp_path) -> None:
    register(spark)
    queue = _queue_on_both(emulator)
    conf = sink_config(primary, secondary, entity=queue, key_column="id")
    conf["replication"] = {"mode": "active", "retry_interval": "1s"}
    # the writer: FILES files of ROWS / FILES rows, one file per batch
    inbox = tmp_path / "inbox"
    per_file = ROWS // FILES
    for f in range(FILES):
        spark.createDataFrame([(f"id-{f * per_file + i}", f"body {f * per_file + i}") for i in range(per_file)],
                              "id string, body string").coalesce(1).write.parquet(str(inbox / f"f{f}"))
    files = spark.readStream.schema("id string, body string").option("maxFilesPerTrigger", 1).option(
        "recursiveFileLookup", "true").parquet(str(inbox))
    sink = PairedSink.from_config(conf)
    summaries = []

    def write(df: Any, batch_id: int) -> None:
        if batch_id == 1:
            emulator.fault("primary", "down")  # down for batches 1 to 3
        elif batch_id == 4:
            emulator.heal("primary")
        summaries.append(sink.send_batch(df, batch_id))

    writer = files.writeStream.foreachBatch(write).option("checkpointLocation", str(tmp_path / "wcp")).trigger(
        availableNow=True).start()
    writer.awaitTermination(240)
    assert writer.exception() is None
    emulator.heal("primary")
    assert [s.sent for s in summaries] == [per_file] * FILES  # every row accepted by at least one namespace
    assert [s.secondary for s in summaries] == [per_file] * FILES
    assert summaries[0].primary == per_file and sum(s.primary for s in summaries[1:4]) == 0
    assert 0 < _left(primary, queue) < ROWS  # the primary holds copies of some rows only
    close_all()

    # the reader, stopped after a few batches and restarted from its checkpoint
    table, checkpoint = str(tmp_path / "table"), str(tmp_path / "rcp")
    reader = _read_query(spark, conf, queue, checkpoint, table)
    _wait(reader, lambda: (reader.lastProgress or {}).get("batchId", -1) >= 1)
    reader.stop()
    assert spark.read.format("delta").load(table).count() > 0
    assert _left(primary, queue) + _left(secondary, queue) > 0  # stopped mid-stream
    reader = _read_query(spark, conf, queue, checkpoint, table)
    try:
        _wait(reader, lambda: _left(primary, queue) == 0 and _left(secondary, queue) == 0
              and spark.read.format("delta").load(table).count() >= ROWS)
        reader.processAllAvailable()
    finally:
        reader.stop()
    rows = spark.read.format("delta").load(table).collect()
    counts = collections.Counter(r.message_id for r in rows)
    assert set(counts) == {f"id-{i}" for i in range(ROWS)}
    assert [mid for mid, n in counts.items() if n > 1] == []  # each row exactly once
    # both namespaces were drained above, the secondary holding every row and the primary those of batches 0
    # and 4: the copies read second were suppressed. Which copy of a row comes first is the race of two
    # receivers (one CI run took all 100 from the secondary), so the namespaces kept are not asserted.
    assert {r.namespace for r in rows} <= {"primary", "secondary"}
