"""The servicebus format's writers (``df.writeStream.format("servicebus")``, ``df.write.format("servicebus")``)
against the emulator pair: through an outage and a crash before the commit, exactly once with duplicate
detection; one-off batch writes; bad options refused before anything is sent."""

from __future__ import annotations

import collections
import logging
import uuid
from pathlib import Path
from typing import Any

import pytest
from pyspark import cloudpickle
from pyspark.sql import functions as F
from pyspark.sql import types as T

from spark_sb.emulator.model import QueueSpec
from spark_sb.source import ServiceBusDataSource, config_options, register
from spark_sb.syphon import Syphon
from spark_sb.writer import stream_writer

from .conftest import receive_all, sink_config, write_json

#: the stream writer's tests run on every Spark version make test tries (Makefile, EVERY_SPARK): Spark 4.0 hands
#: it rows, 4.1 and later Arrow batches; the batch writer takes Arrow batches everywhere (Spark 4.2 only)
every_spark = pytest.mark.every_spark

SCHEMA = T.StructType([T.StructField("body", T.StringType()), T.StructField("n", T.LongType())])


class CrashingOnce(ServiceBusDataSource):
    """The servicebus format, whose streaming commit of batch ``crashBatch`` fails once after the real commit
    (every row of the batch sent, Spark's commit log not yet written): what a driver killed at that point
    leaves. The marker file (option ``crashMarker``) records that it crashed."""

    @classmethod
    def name(cls) -> str:
        return "servicebus-crashing-once"

    def streamWriter(self, schema: T.StructType, overwrite: bool) -> Any:
        own = {"crashmarker", "crashbatch"}  # this test format's options, which the servicebus writer refuses
        writer = stream_writer({k: v for k, v in self.options.items() if k.lower() not in own}, schema, overwrite)
        marker, crash_batch = Path(self.options["crashMarker"]), int(self.options["crashBatch"])
        commit = writer.commit

        def crash_once(messages: Any, batch_id: int) -> None:
            commit(messages, batch_id)
            if batch_id == crash_batch and not marker.exists():
                marker.write_text(str(batch_id))
                raise RuntimeError(f"killed after sending batch {batch_id}")

        writer.commit = crash_once
        return writer


cloudpickle.register_pickle_by_value(__import__(__name__, fromlist=["_"]))


@pytest.fixture(autouse=True)
def _formats(spark: Any) -> None:
    register(spark)
    spark.dataSource.register(CrashingOnce)



def _bodies(connection_string: str, queue: str) -> collections.Counter[str]:
    return collections.Counter(str(m) for m in receive_all(connection_string, queue))


@every_spark
def test_a_stream_through_an_outage_and_a_crash_before_its_commit_lands_every_row_once(
    spark, emulator, primary, secondary, make_queue, tmp_path
) -> None:
    q = make_queue(requires_duplicate_detection=True)
    config = sink_config(primary, secondary, chunk_size=7)
    source, marker = tmp_path / "in", tmp_path / "crashed"
    produced: list[str] = []

    def add_file(f: int) -> None:  # one file per batch; two identical rows, which must arrive as two messages
        rows = [f"row {f}-{i}" for i in range(23)] + [f"same {f}"] * 2
        produced.extend(rows)
        write_json(source, f"part-{f}.json", [{"body": b, "n": i} for i, b in enumerate(rows)])

    def run() -> Any:
        return (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).json(str(source)).repartition(2)
                .writeStream.format("servicebus-crashing-once").options(**config_options(config))
                .option("entity", q).option("crashMarker", str(marker)).option("crashBatch", "2")
                .option("checkpointLocation", str(tmp_path / "cp")).trigger(availableNow=True).start())

    add_file(0)
    add_file(1)
    run().awaitTermination(180)  # batches 0 and 1, healthy
    emulator.fault("primary", "down")
    add_file(2)
    add_file(3)
    with pytest.raises(Exception, match="killed after sending batch 2"):
        run().awaitTermination(180)  # batch 2 sent to the backlog, then the driver "dies" before Spark's commit
    assert marker.exists()
    run().awaitTermination(180)  # restarted from the checkpoint: batch 2 again (the same ids), then batch 3
    emulator.heal("primary")
    with Syphon.from_config(config) as syphon:  # the backlog home: both copies of batch 2, one kept
        moved = syphon.drain().total_moved
    assert moved == 3 * 25  # batch 2 parked twice (before the crash and on replay), batch 3 once
    assert _bodies(primary.connection_string, q) == collections.Counter(produced)


def _written(spark: Any, rows: int) -> Any:
    return spark.range(rows, numPartitions=2).select(F.concat(F.lit("order "), F.col("id")).alias("body"),
                                                     F.col("id").cast("string").alias("order_id"))


def test_a_batch_write_sends_every_row_once_and_a_keyed_rewrite_is_a_duplicate(
    spark, primary, secondary, make_queue
) -> None:
    q = make_queue(requires_duplicate_detection=True)
    options = {**config_options(sink_config(primary, secondary)), "entity": q}
    _written(spark, 500).write.format("servicebus").options(**options).mode("append").save()
    _written(spark, 500).write.format("servicebus").options(**options).mode("append").save()  # new write, new ids
    assert _bodies(primary.connection_string, q) == collections.Counter({f"order {i}": 2 for i in range(500)})
    for _ in range(2):  # keyed: the second write's messages are duplicates of the first's
        _written(spark, 300).write.format("servicebus").options(**options, keyColumn="order_id").mode("append").save()
    received = receive_all(primary.connection_string, q)
    assert sorted(str(m.message_id) for m in received) == sorted(str(i) for i in range(300))


def test_bad_options_are_refused_before_anything_is_sent_naming_the_option(
    spark, primary, secondary, make_queue
) -> None:
    q = make_queue()
    options = config_options(sink_config(primary, secondary))
    df = _written(spark, 10)

    def refused(match: str, frame: Any = df, **extra: str) -> None:
        with pytest.raises(Exception, match=match):
            frame.write.format("servicebus").options(**{**options, **extra}).mode("append").save()

    refused(r"entity: is neither a queue nor a topic on the primary .*, got no-such-queue", entity="no-such-queue")
    refused(r"keyColumn: column not found .*\(option keyColumn\).*, got missing", entity=q, keyColumn="missing")
    refused(r"sink.columns.body: column not found", frame=df.drop("body"), entity=q)
    refused(r"column 'body': has type int, message field body needs string or binary",
            frame=df.select(F.lit(1).alias("body")), entity=q)
    refused(r"no entity", )
    flat = {"primary.connectionString": primary.connection_string, "secondary.connectionString": secondary.connection_string,
            "entity": q}
    with pytest.raises(Exception, match="holds a literal secret") as caught:
        df.write.format("servicebus").options(**flat).mode("append").save()
    assert "SharedAccessKey=" not in str(caught.value)
    for table in ("main.default.rejects", "abfss://c@account.dfs.core.windows.net/rejects"):
        tables = config_options(sink_config(primary, secondary, reject_table=table))
        with pytest.raises(Exception, match=f"sink.reject_table: .* by local path only .*, got {table}"):
            df.write.format("servicebus").options(**tables, entity=q).mode("append").save()
    with pytest.raises(Exception, match="mode: a Service Bus entity cannot be overwritten"):
        df.write.format("servicebus").options(**options, entity=q).mode("overwrite").save()
    assert receive_all(primary.connection_string, q, wait=0.5) == []  # nothing sent by any of them


@every_spark
def test_a_bad_row_fails_the_stream_naming_the_batch_entity_and_message(
    spark, primary, secondary, make_queue, tmp_path
) -> None:
    q = make_queue()
    source = tmp_path / "in"
    write_json(source, "part-0.json", [{"body": "fine", "n": 1}, {"body": None, "n": 2}])
    query = (spark.readStream.schema(SCHEMA).json(str(source)).writeStream.format("servicebus")
             .options(**config_options(sink_config(primary, secondary)), entity=q, keyColumn="n")
             .option("checkpointLocation", str(tmp_path / "cp")).trigger(availableNow=True).start())
    with pytest.raises(Exception, match=rf"batch 0, entity '{q}', message '2': body is null"):
        query.awaitTermination(120)


@every_spark
def test_with_a_reject_table_bad_rows_go_there_the_rest_is_sent_and_each_batch_has_a_metrics_row(
    spark, primary, secondary, make_queue, tmp_path
) -> None:
    q = make_queue()
    source = tmp_path / "in"
    rejects, metrics = tmp_path / "rejects", tmp_path / "metrics"
    config = sink_config(primary, secondary, reject_table=str(rejects), metrics_table=str(metrics))
    for f in range(2):
        write_json(source, f"part-{f}.json", [{"body": f"fine {f}-{i}", "n": 10 * f + i} for i in range(5)]
                    + [{"body": None, "n": 10 * f + 9}])
    query = (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).json(str(source))
             .writeStream.format("servicebus").options(**config_options(config), entity=q, keyColumn="n")
             .option("checkpointLocation", str(tmp_path / "cp")).trigger(availableNow=True).start())
    query.awaitTermination(180)
    assert query.exception() is None
    assert sorted(_bodies(primary.connection_string, q)) == sorted(f"fine {f}-{i}" for f in range(2) for i in range(5))
    rejected = spark.read.format("delta").load(str(rejects)).orderBy("batch_id").collect()
    assert sorted((r.message_id, r.entity, r.reason) for r in rejected) == [
        ("19", q, "body is null"), ("9", q, "body is null")]
    assert sorted(r.batch_id for r in rejected) == [0, 1]  # one a batch (the files' order is Spark's)
    rows = spark.read.format("delta").load(str(metrics)).orderBy("batch_id").collect()
    assert [(r.batch_id, r.rows, r.sent, r.primary, r.rejected) for r in rows] == [(0, 6, 5, 5, 1), (1, 6, 5, 5, 1)]
    # the sink appends to the same tables (Spark and delta-rs share them)
    df = spark.createDataFrame([("by the sink", None)], "body string, n long")
    from spark_sb.sink import PairedSink

    PairedSink.from_config({**config, "sink": {**config["sink"], "entity": q}})(df.select("body"), 7)
    assert spark.read.format("delta").load(str(metrics)).where("batch_id = 7").count() == 1


def test_in_active_replication_a_batch_write_sends_every_row_to_both_namespaces_and_rides_out_an_outage(
    spark, emulator, primary, secondary
) -> None:
    q = f"fw-{uuid.uuid4().hex[:8]}"
    for namespace in ("primary", "secondary"):  # the entity on both namespaces, as active replication needs
        server = emulator.server(namespace)
        server.call(lambda server=server: server.broker.create_entity(QueueSpec(name=q)))
    config = sink_config(primary, secondary)
    config["replication"] = {"mode": "active", "retry_interval": "1s"}
    options = {**config_options(config), "entity": q, "keyColumn": "order_id"}
    _written(spark, 100).write.format("servicebus").options(**options).mode("append").save()
    emulator.fault("primary", "down")
    _written(spark, 150).where(F.col("order_id").cast("long") >= 100).write.format("servicebus").options(**options).mode("append").save()
    emulator.heal("primary")
    in_primary = sorted(str(m.message_id) for m in receive_all(primary.connection_string, q))
    in_secondary = sorted(str(m.message_id) for m in receive_all(secondary.connection_string, q))
    assert in_primary == sorted(str(i) for i in range(100))  # the primary was down for the second write
    assert in_secondary == sorted(str(i) for i in range(150))


def test_a_timestamp_in_a_row_is_read_as_the_local_time_pyspark_made_it(monkeypatch) -> None:
    # Spark 4.0 hands a stream writer rows, whose TimestampType values pyspark turns into naive local times
    import datetime
    import time

    from spark_sb.writer import _utc_row_value

    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        aware = datetime.datetime(2026, 11, 26, 12, 0, tzinfo=datetime.UTC)
        naive_local = aware.astimezone().replace(tzinfo=None)  # as pyspark 4.0's row conversion makes it
        assert naive_local.hour == 7
        assert _utc_row_value(naive_local, True) == aware
        assert _utc_row_value({"at": naive_local}, True) == {"at": aware}  # application_properties
        assert _utc_row_value(naive_local, False) is naive_local  # a timestamp_ntz column: as it is (UTC)
    finally:
        monkeypatch.undo()
        time.tzset()


def test_commit_and_abort_log_what_the_batch_did(primary, secondary, make_queue, caplog) -> None:
    # what Spark hands them: one commit message per partition (None for a partition that failed)
    from spark_sb.writer import PartitionSent, stream_writer

    q = make_queue()
    writer = stream_writer({**config_options(sink_config(primary, secondary)), "entity": q}, SCHEMA)

    def sent(partition: int, primary_rows: int, backlog: dict[str, int]) -> PartitionSent:
        rows = primary_rows + sum(backlog.values())
        return PartitionSent({"kind": "summary", "partition": partition, "rows": rows, "sent": rows,
                              "primary": primary_rows, "secondary": 0, "rejected": 0, "failovers": 1 if backlog else 0,
                              "failbacks": 0, "busy_waits": 0, "assumed_failovers": 0, "swaps": 0, "backlog": backlog,
                              "health": {q: "failed_over" if backlog else "healthy"}, "seconds": 0.5})

    caplog.set_level(logging.INFO, logger="spark_sb")
    writer.commit([sent(0, 10, {}), sent(1, 0, {"p/x-servicebus-transfer/0": 7})], 4)
    assert ("servicebus writer batch 4: 17 rows: 10 -> primary, 7 -> backlog (p/x-servicebus-transfer/0: 7), "
            "0 rejected, failovers 1") in caplog.text
    writer.abort([sent(0, 10, {}), None], 5)
    assert "servicebus writer batch 5 failed: the 1 partitions that finished sent 10 of their 10 rows" in caplog.text


def test_a_batch_write_to_a_topic_reaches_its_subscription(spark, primary, secondary, make_topic) -> None:
    from azure.servicebus import ServiceBusClient

    topic = make_topic({"all": {}})
    options = {**config_options(sink_config(primary, secondary)), "entity": topic, "keyColumn": "order_id"}
    _written(spark, 20).write.format("servicebus").options(**options).mode("append").save()
    with ServiceBusClient.from_connection_string(primary.connection_string) as client, \
            client.get_subscription_receiver(topic, "all") as receiver:
        got = [str(m.message_id) for m in receiver.receive_messages(50, max_wait_time=5)]
        while len(got) < 20 and (page := receiver.receive_messages(50, max_wait_time=2)):
            got += [str(m.message_id) for m in page]
    assert sorted(got, key=int) == [str(i) for i in range(20)]


@every_spark
def test_a_replayed_batch_adds_no_second_copy_of_its_rejects_or_its_metrics_row(
    spark, primary, secondary, make_queue, tmp_path
) -> None:
    q = make_queue()
    source, marker = tmp_path / "in", tmp_path / "crashed"
    rejects, metrics = tmp_path / "rejects", tmp_path / "metrics"
    config = sink_config(primary, secondary, reject_table=str(rejects), metrics_table=str(metrics))
    write_json(source, "part-0.json", [{"body": f"fine {i}", "n": i} for i in range(4)] + [{"body": None, "n": 9}])

    def run() -> Any:
        return (spark.readStream.schema(SCHEMA).json(str(source)).repartition(2)
                .writeStream.format("servicebus-crashing-once").options(**config_options(config))
                .option("entity", q).option("crashMarker", str(marker)).option("crashBatch", "0")
                .option("checkpointLocation", str(tmp_path / "cp")).trigger(availableNow=True).start())

    with pytest.raises(Exception, match="killed after sending batch 0"):
        run().awaitTermination(180)  # batch 0 sent, its reject and metrics rows appended, Spark's commit not written
    query = run()  # batch 0 again from the checkpoint
    query.awaitTermination(180)
    assert query.exception() is None
    assert [(r.batch_id, r.reason) for r in spark.read.format("delta").load(str(rejects)).collect()] == [
        (0, "body is null")]
    assert [(r.batch_id, r.rows) for r in spark.read.format("delta").load(str(metrics)).collect()] == [(0, 5)]
