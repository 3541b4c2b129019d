"""The syphon as a stream: servicebus-backlog -> foreachBatch(Republisher) -> Delta ledger, on the emulator
pair and the shared local Spark session."""

from __future__ import annotations

import collections
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage, ServiceBusSubQueue
from chispa import assert_df_equality

from spark_sb import messages
from spark_sb.emulator.model import QueueSpec
from spark_sb.errors import ConfigError
from spark_sb.source import register
from spark_sb.syphon import Republisher

from .conftest import receive_all, sink_config

_JOBS = Path(__file__).resolve().parents[2] / "jobs"


def _job() -> Any:
    sys.path.insert(0, str(_JOBS))
    spec = importlib.util.spec_from_file_location("syphon_job", _JOBS / "syphon.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def setup(emulator: Any, primary: Any, secondary: Any, make_queue: Any, tmp_path: Path) -> dict:
    """A configuration whose two backlog queues exist, a destination queue with duplicate detection, and
    fresh checkpoint and ledger paths."""
    cfg = sink_config(primary, secondary)
    cfg["syphon"] = {"retry_interval": "1s", "checkpoint_location": str(tmp_path / "checkpoint"),
                     "ledger": str(tmp_path / "ledger")}
    cfg.pop("sink")
    prefix = cfg["send_availability"]["backlog_prefix"]
    server = emulator.server("secondary")
    queues = [f"{prefix}/x-servicebus-transfer/{i}" for i in range(2)]
    for name in queues:
        server.call(lambda name=name: server.broker.create_entity(QueueSpec(name=name, max_delivery_count=2**31 - 1)))
    return {"config": cfg, "queues": queues, "entity": make_queue(requires_duplicate_detection=True)}


def _park(secondary: Any, queue: str, entity: str, ids: list[str]) -> None:
    with ServiceBusClient.from_connection_string(secondary.connection_string, retry_total=0) as client:
        with client.get_queue_sender(queue) as sender:
            sender.send_messages([messages.to_backlog(ServiceBusMessage(f"body {i}", message_id=i), entity)
                                  for i in ids])


def _run(spark: Any, config: dict, wrap: Any = None, max_per_trigger: int = 100) -> Republisher:
    job = _job()
    query, republisher = job.start(spark, config, max_per_trigger=max_per_trigger, receive_timeout=0.5)
    if wrap is not None:  # restart the query with a wrapped foreachBatch
        query.stop()
        query = _restart(spark, config, wrap(republisher), max_per_trigger)
    try:
        job.await_until_empty(query, idle_batches=1, timeout=240)
    finally:
        query.stop()
    return republisher


def _restart(spark: Any, config: dict, foreach: Any, max_per_trigger: int) -> Any:
    job = _job()
    from spark_sb.config import load_config

    cfg = load_config(config)
    stream = (spark.readStream.format("servicebus-backlog").options(**job._flat_options(cfg))
              .option("maxMessagesPerTrigger", str(max_per_trigger)).option("receiveTimeout", "0.5").load())
    return (stream.writeStream.foreachBatch(foreach).option("checkpointLocation", cfg.syphon.checkpoint_location)
            .trigger(processingTime="1 second").start())


def _ledger(spark: Any, config: dict) -> Any:
    return spark.read.format("delta").load(config["syphon"]["ledger"])


def test_the_job_refuses_a_configuration_without_checkpoint_or_ledger(spark, setup) -> None:
    config = {**setup["config"], "syphon": {"ledger": "/tmp/x"}}
    with pytest.raises(ConfigError, match="syphon.checkpoint_location"):
        _job().start(spark, config)
    assert not [q for q in spark.streams.active if q.name == "spark-sb-syphon"]


def test_round_trip_through_the_stream_with_a_ledger(spark, setup, primary, secondary) -> None:
    register(spark)
    queues, entity = setup["queues"], setup["entity"]
    _park(secondary, queues[0], entity, [f"a{i}" for i in range(5)])
    _park(secondary, queues[1], entity, [f"b{i}" for i in range(4)])
    with ServiceBusClient.from_connection_string(secondary.connection_string, retry_total=0) as client:
        with client.get_queue_sender(queues[1]) as sender:
            sender.send_messages(ServiceBusMessage("foreign", message_id="foreign"))
    _run(spark, setup["config"], max_per_trigger=6)

    arrived = [str(m.message_id) for m in receive_all(primary.connection_string, entity, expected=9)]
    assert sorted(arrived) == sorted([f"a{i}" for i in range(5)] + [f"b{i}" for i in range(4)])
    for queue in queues:
        assert receive_all(secondary.connection_string, queue, wait=0.5) == []
    with ServiceBusClient.from_connection_string(secondary.connection_string, retry_total=0) as client:
        with client.get_queue_receiver(queues[1], sub_queue=ServiceBusSubQueue.DEAD_LETTER) as receiver:
            [dead] = receiver.receive_messages(max_wait_time=2)
    assert (dead.message_id, dead.dead_letter_reason) == ("foreign", "x-ms-path missing or not a string")
    ledger = _ledger(spark, setup["config"])
    counts = collections.Counter((r.message_id, r.outcome) for r in ledger.collect())
    assert counts == collections.Counter({**{(i, "delivered"): 1 for i in arrived}, ("foreign", "dead_lettered"): 1})
    assert ledger.select("batch_id").distinct().count() >= 2  # six per trigger


def test_a_batch_killed_after_its_sink_is_replayed_without_loss_or_duplicates(spark, setup, primary, secondary
                                                                                 ) -> None:
    register(spark)
    queues, entity = setup["queues"], setup["entity"]
    ids = [f"k{i}" for i in range(6)]
    _park(secondary, queues[0], entity, ids)
    failed: list[int] = []

    def flaky(republisher: Republisher) -> Any:
        def run(df: Any, batch_id: int) -> None:
            republisher(df, batch_id)
            if not failed:  # the driver dies after the sink, before Spark records the batch
                failed.append(batch_id)
                raise RuntimeError("killed")
        return run

    config = setup["config"]
    job = _job()
    query, republisher = job.start(spark, config, max_per_trigger=3, receive_timeout=0.5)
    query.stop()
    query = _restart(spark, config, flaky(republisher), 3)
    with pytest.raises(Exception, match="killed"):
        query.awaitTermination(60)
    # restart from the checkpoint: the failed batch is replayed, then the rest
    query = _restart(spark, config, republisher, 3)
    try:  # the replayed batch reads nothing (its messages were completed): wait for two idle triggers
        job.await_until_empty(query, idle_batches=2, timeout=240)
    finally:
        query.stop()
    arrived = [str(m.message_id) for m in receive_all(primary.connection_string, entity, expected=6)]
    assert sorted(arrived) == ids  # nothing lost, nothing duplicated (duplicate detection + ledger)
    delivered = _ledger(spark, config).where("outcome = 'delivered'").select("message_id")
    assert_df_equality(delivered, spark.createDataFrame([(i,) for i in ids], "message_id string"),
                       ignore_row_order=True, ignore_nullable=True)


def test_messages_left_deferred_by_an_abandoned_run_are_taken_back(spark, setup, primary, secondary) -> None:
    register(spark)
    queues, entity = setup["queues"], setup["entity"]
    _park(secondary, queues[1], entity, ["d0", "d1", "d2"])
    with ServiceBusClient.from_connection_string(secondary.connection_string, retry_total=0) as client:
        with client.get_queue_receiver(queues[1]) as receiver:  # an abandoned run deferred two of them
            got = receiver.receive_messages(max_message_count=2, max_wait_time=2)
            for message in got:
                receiver.defer_message(message)
    assert len(got) == 2
    _run(spark, setup["config"])
    arrived = [str(m.message_id) for m in receive_all(primary.connection_string, entity, expected=3)]
    assert sorted(arrived) == ["d0", "d1", "d2"]
    with ServiceBusClient.from_connection_string(secondary.connection_string, retry_total=0) as client:
        with client.get_queue_receiver(queues[1]) as receiver:
            assert receiver.peek_messages(max_message_count=10) == []


def test_the_reader_defers_reads_restored_rows_and_completes_on_commit(setup, secondary) -> None:
    import datetime

    from pyspark.sql.streaming.datasource import ReadMaxRows

    from spark_sb.config import load_config
    from spark_sb.source import SCHEMA, BacklogStreamReader

    queues, entity = setup["queues"], setup["entity"]
    scheduled = datetime.datetime.now(datetime.UTC).replace(microsecond=0) + datetime.timedelta(hours=1)
    message = ServiceBusMessage(b"payload", message_id="r1", session_id="s", partition_key="s", subject="subj",
                                time_to_live=datetime.timedelta(hours=1), scheduled_enqueue_time_utc=scheduled,
                                application_properties={"color": "red"})
    with ServiceBusClient.from_connection_string(secondary.connection_string, retry_total=0) as client:
        with client.get_queue_sender(queues[0]) as sender:
            sender.send_messages(messages.to_backlog(message, entity))
            sender.send_messages(ServiceBusMessage("foreign", message_id="f1"))
    options = {**_job()._flat_options(load_config(setup["config"])), "receiveTimeout": "0.5"}
    reader = BacklogStreamReader(options)
    start = reader.initialOffset()
    end = reader.latestOffset(start, ReadMaxRows(10))
    assert end["batch"] == 1 and len(end["queues"][queues[0]]) == 2
    [partition] = reader.partitions(start, end)
    rows = {row[1]: dict(zip(SCHEMA.names, row, strict=True)) for row in reader.read(partition)}
    good, foreign = rows["r1"], rows["f1"]
    assert (good["destination"], good["body"], good["session_id"], good["partition_key"], good["subject"]) == (
        entity, b"payload", "s", "s", "subj")
    assert 3500_000 < good["time_to_live_ms"] <= 3600_000
    assert good["scheduled_enqueue_time"] == scheduled
    assert good["application_properties"] == {"color": "red"}
    assert (good["status"], good["backlog_queue"]) == ("restored", queues[0])
    assert (foreign["status"], foreign["reason"]) == ("invalid", "x-ms-path missing or not a string")
    assert sorted(r[1] for r in reader.read(partition)) == ["f1", "r1"]  # replayable: still deferred
    reader.commit(end)
    with ServiceBusClient.from_connection_string(secondary.connection_string, retry_total=0) as client:
        with client.get_queue_receiver(queues[0]) as receiver:
            assert receiver.peek_messages(max_message_count=10) == []
