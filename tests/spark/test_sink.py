"""The Spark sink against the emulator pair: fields, outages, replays, health propagation, bad input."""

from __future__ import annotations

import collections
import datetime
import time
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage
from chispa import assert_df_equality
from pyspark.sql import functions as F
from pyspark.sql import types as T

from spark_sb.config import load_config
from spark_sb.errors import BadInputError
from spark_sb.sink import PairedSink, sender_for

from .conftest import backlog_ids, receive_all, sink_config, write_json

#: run on every Spark version make test tries (Makefile, EVERY_SPARK)
pytestmark = pytest.mark.every_spark

FIELDS_SCHEMA = T.StructType([
    T.StructField("body", T.StringType()),
    T.StructField("message_id", T.StringType()),
    T.StructField("session_id", T.StringType()),
    T.StructField("partition_key", T.StringType()),
    T.StructField("subject", T.StringType()),
    T.StructField("content_type", T.StringType()),
    T.StructField("correlation_id", T.StringType()),
    T.StructField("to", T.StringType()),
    T.StructField("reply_to", T.StringType()),
    T.StructField("ttl_ms", T.LongType()),
    T.StructField("scheduled_ms", T.LongType()),
    T.StructField("region", T.StringType()),
    T.StructField("priority", T.LongType()),
])


def test_every_field_of_a_row_lands_on_the_message(spark, primary, secondary, make_queue) -> None:
    q = make_queue(requires_session=True)
    scheduled = datetime.datetime.now(datetime.UTC).replace(microsecond=0) - datetime.timedelta(minutes=1)
    rows = [
        (f"order {i}", f"id-{i}", "s1", "s1", f"subject-{i}", "text/plain", f"corr-{i}", f"to-{i}", f"reply-{i}",
         60_000 + 1000 * i, int(scheduled.timestamp() * 1000), "eu" if i % 2 else "us", i)
        for i in range(6)
    ]
    expected = spark.createDataFrame(rows, FIELDS_SCHEMA)
    batch = expected.select(
        "body", "message_id", "session_id", "partition_key", "subject", "content_type", "correlation_id", "to",
        F.col("reply_to").alias("reply_address"),  # a renamed column, mapped by sink.columns
        F.make_dt_interval(secs=F.col("ttl_ms") / 1000).alias("time_to_live"),
        F.timestamp_millis("scheduled_ms").alias("scheduled_enqueue_time"),
        F.create_map(F.lit("region"), F.col("region"), F.lit("priority"), F.col("priority").cast("string"))
        .alias("application_properties"),
    ).repartition(2)
    sink = PairedSink.from_config(sink_config(primary, secondary, entity=q, columns={"reply_to": "reply_address"}))
    summary = sink.send_batch(batch, 0)
    assert (summary.rows, summary.primary, summary.backlog_total, summary.rejected) == (6, 6, 0, 0)

    with ServiceBusClient.from_connection_string(primary.connection_string) as client:
        with client.get_queue_receiver(q, session_id="s1", max_wait_time=3) as receiver:
            received = []
            while len(received) < 6 and (page := receiver.receive_messages(max_message_count=10, max_wait_time=3)):
                received.extend(page)
                for m in page:
                    receiver.complete_message(m)

    def props(m: Any) -> dict[str, str]:
        return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                for k, v in (m.application_properties or {}).items()}

    actual = spark.createDataFrame([
        (str(m), m.message_id, m.session_id, m.partition_key, m.subject, m.content_type, m.correlation_id, m.to,
         m.reply_to, int(m.time_to_live.total_seconds() * 1000), int(m.scheduled_enqueue_time_utc.timestamp() * 1000),
         props(m)["region"], int(props(m)["priority"]))
        for m in received
    ], FIELDS_SCHEMA)
    assert_df_equality(actual, expected, ignore_row_order=True)


@pytest.mark.spark_independent
def test_during_a_primary_outage_every_row_lands_in_the_primary_or_a_backlog_queue(
    spark, emulator, primary, secondary, make_queue
) -> None:
    q = make_queue()
    sink = PairedSink.from_config(sink_config(primary, secondary, entity=q, key_column="key"))
    produced: list[str] = []
    summaries = []
    for batch_id in range(4):
        if batch_id == 1:
            emulator.fault("primary", "down")
        if batch_id == 3:
            emulator.heal("primary")
        df = spark.range(batch_id * 40, (batch_id + 1) * 40, numPartitions=2).select(
            F.concat(F.lit("order "), F.col("id")).alias("body"), F.col("id").cast("string").alias("key"))
        produced.extend(str(i) for i in range(batch_id * 40, (batch_id + 1) * 40))
        summaries.append(sink.send_batch(df, batch_id))
    assert summaries[0].primary == 40
    assert summaries[1].backlog_total == 40 and summaries[1].failovers >= 1
    assert summaries[2].backlog_total == 40  # still failed over: straight to the backlog, no new interval
    assert sink.totals.rows == 160 and sink.totals.sent == 160
    in_primary = [str(m.message_id) for m in receive_all(primary.connection_string, q)]
    in_backlog = backlog_ids(secondary.connection_string, sink.config.send_availability.backlog_queue_names())
    counted = collections.Counter(in_primary + in_backlog)
    assert set(counted) == set(produced)  # none lost
    assert max(counted.values()) == 1  # none twice



def test_a_batch_killed_mid_way_and_replayed_from_its_checkpoint(
    spark, primary, secondary, make_queue, tmp_path
) -> None:
    deduplicated = make_queue(requires_duplicate_detection=True)
    plain = make_queue()
    source = tmp_path / "in"
    for f in range(3):  # one file per batch; identical rows too, which must still arrive as two messages
        rows = [{"body": "same", "entity": e} for e in (deduplicated, plain) for _ in range(2)]
        rows += [{"body": f"row {f}-{i}", "entity": e} for e in (deduplicated, plain) for i in range(8)]
        write_json(source, f"part-{f}.json", rows)
    schema = T.StructType([T.StructField("body", T.StringType()), T.StructField("entity", T.StringType())])
    sink = PairedSink.from_config(sink_config(primary, secondary))
    crashed: list[int] = []

    def crash_after_sending(df: Any, batch_id: int) -> None:
        sink(df, batch_id)
        if batch_id == 1 and not crashed:  # everything sent, the checkpoint not yet committed: a crash
            crashed.append(batch_id)
            raise RuntimeError("killed after sending batch 1")

    def run() -> Any:
        return (spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).json(str(source))
                .writeStream.foreachBatch(crash_after_sending).option("checkpointLocation", str(tmp_path / "cp"))
                .trigger(availableNow=True).start())

    query = run()
    with pytest.raises(Exception, match="killed after sending batch 1"):
        query.awaitTermination(120)
    query = run()  # restarted from the checkpoint: batch 1 is replayed with the same message ids
    query.awaitTermination(120)
    assert sink.totals.batches == 4 and sink.totals.sent == 4 * 20

    def ids(queue: str) -> collections.Counter[str]:
        return collections.Counter(str(m.message_id) for m in receive_all(primary.connection_string, queue))

    with_detection, without = ids(deduplicated), ids(plain)
    assert sum(with_detection.values()) == 30 and max(with_detection.values()) == 1  # exactly once
    replayed = 10  # batch 1's rows for the plain queue
    assert sum(without.values()) == 30 + replayed  # at least once: the replayed rows twice, nothing else
    assert len(without) == 30 and sorted(without.values()).count(2) == replayed


@pytest.mark.spark_independent
def test_a_new_worker_starts_a_failed_over_entity_in_backlog_mode_at_once(
    spark, emulator, primary, secondary, make_queue
) -> None:
    q = make_queue()
    emulator.fault("primary", "down")
    first = PairedSink.from_config(sink_config(primary, secondary, entity=q))
    df = spark.range(20, numPartitions=2).select(F.col("id").cast("string").alias("body"))
    assert first.send_batch(df, 0).backlog_total == 20  # waited out the 1 s failover interval
    assert first.health == {q: "failed_over"}
    # workers that never saw the entity (another pairing's board: fresh state), with a 60 s failover interval
    config = sink_config(primary, secondary, entity=q, send_availability={"failover_interval": "60s"})
    second = PairedSink.from_config(config)
    second.health = dict(first.health)  # what the previous batch's partitions reported
    started = time.monotonic()
    summary = second.send_batch(df, 1)
    assert time.monotonic() - started < 30  # not the 60 s interval
    assert summary.backlog_total == 20 and summary.failovers == 0 and summary.assumed_failovers == 2
    assert summary.failed_over == (q,)
    emulator.heal("primary")


def _bad_batch(spark: Any, q: str, missing: str) -> Any:
    rows = [("k0", "fine", q), ("k1", None, q), ("k2", "x" * 300_000, q), ("k3", "lost", missing), ("k4", "ok", q)]
    return spark.createDataFrame(rows, "key string, body string, entity string").coalesce(1)


@pytest.mark.parametrize(("row", "expected"), [
    (1, "batch 7, entity '{q}', message 'k1': body is null"),
    (2, "batch 7, entity '{q}', message 'k2': "),
    (3, "batch 7, entity 'no-such-queue', message 'k3': entity not found"),
])
def test_bad_input_fails_the_batch_naming_batch_entity_and_message(
    spark, primary, secondary, make_queue, row, expected
) -> None:
    q = make_queue()
    sink = PairedSink.from_config(sink_config(primary, secondary, key_column="key"))
    bad = _bad_batch(spark, q, "no-such-queue")
    rows = bad.filter(F.col("key").isin("k0", f"k{row}"))
    with pytest.raises(Exception) as caught:
        sink(rows, 7)
    assert expected.format(q=q) in str(caught.value)
    assert sink.latest is None and sink.totals.batches == 0  # the batch failed


def test_a_column_of_the_wrong_type_fails_before_anything_is_sent(spark, primary, secondary, make_queue) -> None:
    q = make_queue()
    sink = PairedSink.from_config(sink_config(primary, secondary, entity=q, reject_table="/unused"))
    with pytest.raises(BadInputError) as caught:
        sink(spark.range(5).select(F.col("id").alias("body")), 3)
    assert str(caught.value) == ("batch 3, column 'body': has type bigint, message field body needs string or "
                                 "binary; nothing was sent")
    with pytest.raises(BadInputError, match="batch 4, column 'subject': has type int"):
        sink(spark.range(5).select(F.lit("b").alias("body"), F.lit(1).alias("subject")), 4)
    assert receive_all(primary.connection_string, q, wait=0.5) == []


def test_with_a_reject_table_bad_rows_go_there_and_the_rest_is_sent(
    spark, primary, secondary, make_queue, tmp_path
) -> None:
    q = make_queue()
    rejects, metrics = str(tmp_path / "rejects"), str(tmp_path / "metrics")
    sink = PairedSink.from_config(sink_config(primary, secondary, key_column="key", reject_table=rejects,
                                              metrics_table=metrics))
    summary = sink.send_batch(_bad_batch(spark, q, "no-such-queue"), 9)
    assert (summary.rows, summary.primary, summary.rejected) == (5, 2, 3)
    assert sorted(str(m.message_id) for m in receive_all(primary.connection_string, q)) == ["k0", "k4"]
    found = spark.read.format("delta").load(rejects).select("batch_id", "message_id", "entity", "reason")
    got = {r["message_id"]: r for r in found.collect()}
    assert sorted(got) == ["k1", "k2", "k3"]
    assert got["k1"]["reason"] == "body is null" and got["k1"]["batch_id"] == 9
    assert "exceeds the limit" in got["k2"]["reason"]
    assert got["k3"]["entity"] == "no-such-queue" and "not found" in got["k3"]["reason"]
    metrics_row = spark.read.format("delta").load(metrics).collect()
    assert [(r["batch_id"], r["rows"], r["primary"], r["rejected"]) for r in metrics_row] == [(9, 5, 2, 3)]


def test_derived_message_ids_are_deterministic(spark, primary, secondary, make_queue) -> None:
    q = make_queue()
    sink = PairedSink.from_config(sink_config(primary, secondary, entity=q))
    df = spark.createDataFrame([("a",), ("a",), ("b",)], "body string").coalesce(1)
    sink(df, 5)
    first = sorted(str(m.message_id) for m in receive_all(primary.connection_string, q, expected=3))
    sink(df, 5)
    assert sorted(str(m.message_id) for m in receive_all(primary.connection_string, q, expected=3)) == first
    assert len(set(first)) == 3 and all(i.startswith("5-0-") for i in first)


def test_a_batch_that_fails_part_way_is_replayed_without_duplicates_where_detection_is_on(
    spark, emulator, primary, secondary, make_queue, tmp_path
) -> None:
    deduplicated = make_queue(requires_duplicate_detection=True)
    other = make_queue()
    source = tmp_path / "in"
    for f in range(2):  # each batch: rows for both queues in two partitions (one file each)
        for half in range(2):
            write_json(source, f"part-{f}-{half}.json",
                        [{"body": f"row {f}-{half}-{i}", "entity": e} for e in (deduplicated, other) for i in range(5)])
    schema = T.StructType([T.StructField("body", T.StringType()), T.StructField("entity", T.StringType())])
    sink = PairedSink.from_config(sink_config(primary, secondary))

    def run() -> Any:
        return (spark.readStream.schema(schema).option("maxFilesPerTrigger", 2).json(str(source))
                .writeStream.foreachBatch(sink).option("checkpointLocation", str(tmp_path / "cp"))
                .trigger(availableNow=True).start())

    emulator.fault("primary", "notfound", entity=other)  # batch 0: the rows for `deduplicated` go, the rest fail
    query = run()
    with pytest.raises(Exception, match=f"batch 0, entity '{other}'"):
        query.awaitTermination(120)
    emulator.heal("primary", entity=other)
    run().awaitTermination(120)  # batch 0 replayed from the checkpoint, then batch 1
    assert sink.totals.batches == 2 and sink.totals.sent == 40
    got = collections.Counter(str(m.message_id) for m in receive_all(primary.connection_string, deduplicated))
    assert sum(got.values()) == 20 and max(got.values()) == 1  # batch 0's rows were sent twice, kept once
    # without detection, at least once: a task still running when the query failed may have sent its rows for
    # `other` after the heal, and they are sent again by the replay (same ids); at most batch 0's 10 rows twice
    again = collections.Counter(str(m.message_id) for m in receive_all(primary.connection_string, other))
    assert len(again) == 20 and sum(again.values()) <= 30


_POISON_SCHEMA = "key string, body string, application_properties map<string, binary>, time_to_live double"
_POISON = [("k0", "fine", {"b": b"ok"}, None), ("k1", "bad bytes", {"b": b"\xff\xfe"}, None),
           ("k2", "negative ttl", None, -1.0), ("k3", "ttl over the limit", None, 1e12),
           ("k4", "and a half", None, 30.5)]


def test_values_the_sdk_cannot_encode_are_rejected_naming_the_field(
    spark, primary, secondary, make_queue, tmp_path
) -> None:
    q = make_queue()
    rejects = str(tmp_path / "rejects")
    sink = PairedSink.from_config(sink_config(primary, secondary, entity=q, key_column="key", reject_table=rejects))
    summary = sink.send_batch(spark.createDataFrame(_POISON, _POISON_SCHEMA).coalesce(1), 4)
    assert (summary.rows, summary.primary, summary.rejected) == (5, 2, 3)
    received = {str(m.message_id): m for m in receive_all(primary.connection_string, q)}
    assert sorted(received) == ["k0", "k4"]
    assert received["k4"].time_to_live == datetime.timedelta(seconds=30.5)  # not truncated to 30 s
    reasons = {r["message_id"]: r["reason"] for r in spark.read.format("delta").load(rejects).collect()}
    assert sorted(reasons) == ["k1", "k2", "k3"]
    assert "application property 'b'" in reasons["k1"] and "UTF-8" in reasons["k1"]
    assert "time_to_live" in reasons["k2"] and "time_to_live" in reasons["k3"]
    # without a reject table the batch fails with an error naming batch, entity, message and field
    plain = PairedSink.from_config(sink_config(primary, secondary, entity=q, key_column="key"))
    with pytest.raises(Exception, match=rf"batch 5, entity '{q}', message 'k1': .*application property 'b'"):
        plain(spark.createDataFrame(_POISON[:2], _POISON_SCHEMA).coalesce(1), 5)


@pytest.mark.spark_independent
def test_bad_rows_while_failed_over_are_rejected_and_leave_the_backlog_in_the_rotation(
    spark, emulator, primary, secondary, make_queue, tmp_path
) -> None:
    q, other = make_queue(), make_queue()
    rejects = str(tmp_path / "rejects")
    config = sink_config(primary, secondary, entity=q, key_column="key", reject_table=rejects,
                         send_availability={"failover_interval": "0s"})
    sink = PairedSink.from_config(config)
    emulator.fault("primary", "down")
    try:
        summary = sink.send_batch(spark.createDataFrame(_POISON, _POISON_SCHEMA).coalesce(1), 0)
        assert (summary.backlog_total, summary.rejected) == (2, 3)
        # valid rows for another entity still find a backlog queue
        good = spark.createDataFrame([("g0", "ok", other)], "key string, body string, entity string")
        assert sink.send_batch(good, 1).backlog_total == 1
        assert sender_for(sink.config).board.cooling() == []
    finally:
        emulator.heal("primary")


def test_application_properties_keep_bigints_and_nulls(spark, primary, secondary, make_queue) -> None:
    q = make_queue()
    sink = PairedSink.from_config(sink_config(primary, secondary, entity=q, key_column="key"))
    rows = [("k0", "b", {"big": 3_000_000_000, "small": 7, "none": None})]
    assert sink.send_batch(spark.createDataFrame(rows, "key string, body string, application_properties map<string, bigint>"),
                           0).primary == 1
    (message,) = receive_all(primary.connection_string, q)
    assert dict(message.application_properties) == {b"big": 3_000_000_000, b"small": 7, b"none": None}


def test_a_new_configuration_of_a_pairing_replaces_the_worker_sender(primary, secondary, make_queue) -> None:
    # a Python worker outlives a query: rerunning with other intervals must not be refused by the old sender
    first = sink_config(primary, secondary, entity="q")
    second = {**first, "send_availability": {**first["send_availability"], "failover_interval": "7s"}}
    old = sender_for(load_config(first))
    new = sender_for(load_config(second))
    assert new is not old and new.board.failover_interval == 7.0
    with pytest.raises(RuntimeError, match="closed"):
        old.send("q", ServiceBusMessage("x"))
