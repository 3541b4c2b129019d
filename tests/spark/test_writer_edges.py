"""The servicebus format's writer at its edges (issue 33): a management endpoint that accepts and never answers,
options that would otherwise be ignored, two queries writing the same rows, a subscription as the entity, and
complete mode. Each against the emulator pair, through the real SDK."""

from __future__ import annotations

import collections
import json
import logging
import os
import subprocess
import sys
from typing import Any

import pytest
from azure.servicebus.exceptions import MessagingEntityNotFoundError
from pairing import peek_all, within
from pyspark.sql import types as T

from spark_sb.config import load_config
from spark_sb.source import config_options, register

from .conftest import receive_all, sink_config, write_json

SCHEMA = T.StructType([T.StructField("body", T.StringType()), T.StructField("n", T.LongType())])
#: what "within a minute" means for a hanging management endpoint: azure-core's default would wait 300 s
MINUTE = 60.0


@pytest.fixture(autouse=True)
def _formats(spark: Any) -> None:
    register(spark)


def _rows(spark: Any, n: int) -> Any:
    return spark.createDataFrame([(f"row {i}", i) for i in range(n)], SCHEMA)


def _bodies(connection_string: str, queue: str) -> collections.Counter[str]:
    return collections.Counter(str(m) for m in receive_all(connection_string, queue))



def test_a_management_endpoint_that_never_answers_costs_the_writer_and_the_reader_seconds(
    spark, primary, secondary, make_queue, silent_endpoint
) -> None:
    q = make_queue()
    config = sink_config(primary, secondary)
    config["primary"] = {**config["primary"], "admin_endpoint": silent_endpoint, "admin_timeout": "2s"}
    options = {**config_options(config), "entity": q}
    within(MINUTE, lambda: _rows(spark, 20).write.format("servicebus").options(**options).mode("append").save())
    assert _bodies(primary.connection_string, q) == collections.Counter(f"row {i}" for i in range(20))
    _rows(spark, 5).write.format("servicebus").options(**options).mode("append").save()  # queued after the first
    read = within(MINUTE, lambda: spark.read.format("servicebus").options(**config_options(config))
                   .option("entity", q).load().collect())
    assert sorted(r.body.decode() for r in read) == [f"row {i}" for i in range(5)]


def test_options_the_writer_does_not_take_are_refused_naming_them(spark, primary, secondary, make_queue) -> None:
    q, other = make_queue(), make_queue()
    options = config_options(sink_config(primary, secondary))
    df = _rows(spark, 5)

    def refused(match: str, **extra: str) -> str:
        with pytest.raises(Exception, match="(?i)" + match) as caught:
            df.write.format("servicebus").options(**{**options, "entity": q, **extra}).mode("append").save()
        return str(caught.value)

    refused(r"queue: is not an option of the servicebus writer \(did you mean entity\?\)", queue=other)
    refused(r"key_column: is not an option of the servicebus writer \(did you mean keyColumn\?\)", key_column="n")
    refused(r"sink.entity: is a configuration option next to option conf", **{"sink.entity": other})
    refused(r"sink.keyColumn: is a configuration option next to option conf", **{"sink.keyColumn": "n"})
    text = refused(r"primary.connectionString: is a configuration option next to option conf",
                   **{"primary.connectionString": primary.connection_string})
    assert "SharedAccessKey=" not in text
    assert receive_all(primary.connection_string, q, wait=0.5) == []
    assert receive_all(primary.connection_string, other, wait=0.5) == []



def test_two_queries_writing_the_same_rows_both_land_under_duplicate_detection(
    spark, primary, secondary, make_queue, tmp_path
) -> None:
    q = make_queue(requires_duplicate_detection=True)
    source = tmp_path / "in"
    write_json(source, "part-0.json", [{"body": f"same {i}", "n": i} for i in range(10)])
    for run in range(2):  # same rows, same batch 0, same partition: another query (a new checkpoint)
        query = (spark.readStream.schema(SCHEMA).json(str(source)).writeStream.format("servicebus")
                 .options(**config_options(sink_config(primary, secondary)), entity=q)
                 .option("checkpointLocation", str(tmp_path / f"cp{run}")).trigger(availableNow=True).start())
        query.awaitTermination(180)
        assert query.exception() is None
    assert _bodies(primary.connection_string, q) == collections.Counter({f"same {i}": 2 for i in range(10)})


def test_a_subscription_is_refused_as_the_entity_and_a_row_naming_one_is_rejected_never_parked(
    spark, primary, secondary, make_topic, tmp_path
) -> None:
    topic = make_topic({"all": {}})
    config = sink_config(primary, secondary, reject_table=str(tmp_path / "rejects"))
    options = config_options(config)
    df = _rows(spark, 3)
    with pytest.raises(Exception, match=rf"entity: is a subscription: Service Bus takes messages at its topic; send "
                                        rf"to '{topic}', got {topic}/subscriptions/all"):
        df.write.format("servicebus").options(**options, entity=f"{topic}/subscriptions/all").mode("append").save()
    rows = spark.createDataFrame([("to the topic", topic), ("to the subscription", f"{topic}/subscriptions/all"),
                                  ("to its dead letters", f"{topic}/subscriptions/all/$DeadLetterQueue")],
                                 "body string, entity string")
    rows.write.format("servicebus").options(**options).mode("append").save()
    received = receive_all(primary.connection_string, f"{topic}/subscriptions/all")
    assert [str(m) for m in received] == ["to the topic"]
    rejected = spark.read.format("delta").load(str(tmp_path / "rejects")).collect()
    assert sorted((r.body.decode(), r.reason.split(":")[0]) for r in rejected) == [
        ("to its dead letters", "the entity is a dead-letter queue"),
        ("to the subscription", "the entity is a subscription")]
    assert _parked(secondary.connection_string, config) == []


def _parked(connection_string: str, config: dict) -> list:
    """What the backlog queues of ``config`` hold (none provisioned: nothing)."""
    parked = []
    for queue in load_config(config).send_availability.backlog_queue_names():
        try:
            parked.extend(peek_all(connection_string, queue))
        except MessagingEntityNotFoundError:
            continue
    return parked


def test_complete_mode_is_refused_before_anything_is_sent(spark, primary, secondary, make_queue, tmp_path) -> None:
    q = make_queue()
    counts = spark.readStream.format("rate").option("rowsPerSecond", 5).load().groupBy().count()
    with pytest.raises(Exception, match="outputMode: a Service Bus entity cannot be overwritten"):
        query = (counts.selectExpr("cast(count as string) as body").writeStream.format("servicebus")
                 .options(**config_options(sink_config(primary, secondary)), entity=q).outputMode("complete")
                 .option("checkpointLocation", str(tmp_path / "cp")).start())
        try:
            query.awaitTermination(60)
        finally:
            query.stop()
    assert receive_all(primary.connection_string, q, wait=0.5) == []


#: a batch write of 40 rejected rows of 100 KB (their key is null) in a Spark whose driver takes at most 1 MiB of
#: task results
_LARGE_REJECTS = """
import json, sys
from pyspark.sql import SparkSession
from spark_sb.source import register
spark = (SparkSession.builder.master("local[2]").config("spark.driver.maxResultSize", "1m")
         .config("spark.ui.enabled", "false").getOrCreate())
register(spark)
rows = [("x" * 100_000, None)] * 40 + [("fine", "1")]
spark.createDataFrame(rows, "body string, k string").repartition(2).write.format("servicebus") \\
    .options(**json.loads(sys.argv[1])).mode("append").save()
spark.stop()
"""


def test_rejected_rows_never_travel_to_the_driver(primary, secondary, make_queue, tmp_path) -> None:
    from deltalake import DeltaTable

    q = make_queue()
    rejects = tmp_path / "rejects"
    options = {**config_options(sink_config(primary, secondary, reject_table=str(rejects))), "entity": q,
               "keyColumn": "k"}
    done = subprocess.run([sys.executable, "-c", _LARGE_REJECTS, json.dumps(options)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [str(m) for m in receive_all(primary.connection_string, q)] == ["fine"]
    table = DeltaTable(str(rejects)).to_pyarrow_table(columns=["entity", "body"]).to_pylist()
    assert len(table) == 40 and all(len(r["body"]) == 100_000 for r in table)


def test_an_abort_logs_what_was_sent_even_when_the_entity_is_gone(primary, secondary, caplog) -> None:
    """Spark's streaming runner builds the writer again to commit or abort a batch (in its
    python_streaming_sink_runner module); by then the entity may have been deleted: the abort still logs what
    the batch had sent instead of failing on the entity check, which planning a batch still makes."""
    from spark_sb.errors import ConfigError
    from spark_sb.writer import stream_writer

    options = {**config_options(sink_config(primary, secondary)), "entity": "deleted-meanwhile"}
    with pytest.raises(ConfigError, match="entity: is neither a queue nor a topic on the primary"):
        stream_writer(options, SCHEMA)  # planning a batch
    runner = os.path.join(os.sep, "site-packages", "pyspark", "sql", "worker", "python_streaming_sink_runner.py")
    names = {"stream_writer": stream_writer, "options": options, "schema": SCHEMA}
    with caplog.at_level(logging.ERROR, logger="spark_sb.writer"):
        exec(compile("stream_writer(options, schema).abort([None, None], 3)", runner, "exec"), names)  # noqa: S102
    assert "servicebus writer batch 3 failed: the 0 partitions that finished sent 0 of their 0 rows" in caplog.text
