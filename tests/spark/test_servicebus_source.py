"""The general ``servicebus`` streaming source: its reader on the emulator pair (no Spark session needed), its
options' errors, and ``spark_sb.dedupe``. The streaming end to end (active sink -> source over both namespaces ->
dedupe -> Delta) is in test_replication_stream.py."""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage

from spark_sb import messages
from spark_sb.bus import close_all
from spark_sb.capabilities import trigger_available_now
from spark_sb.emulator.model import QueueSpec, SubscriptionSpec, TopicSpec
from spark_sb.errors import ConfigError, EntityNotFoundError
from spark_sb.source import SERVICEBUS_SCHEMA, ServiceBusStreamReader, config_options

from .conftest import read_limit

#: run on every Spark version make test tries (Makefile, EVERY_SPARK)
pytestmark = pytest.mark.every_spark


def create(emulator: Any, namespace: str, spec: Any) -> None:
    server = emulator.server(namespace)
    server.call(lambda: server.broker.create_entity(spec))


def unique_name(request: pytest.FixtureRequest, prefix: str) -> str:
    return f"{prefix}{request.node.name[:30].strip('_-[]')}-{uuid.uuid4().hex[:6]}".replace("_", "-").replace("[", "-")


@pytest.fixture
def replicated_queue(emulator: Any, request: pytest.FixtureRequest) -> Callable[..., str]:
    """A queue of the same name on both namespaces (as active and passive replication need)."""

    def make(**props: Any) -> str:
        name = unique_name(request, "rq-")
        for namespace in ("primary", "secondary"):
            create(emulator, namespace, QueueSpec(name=name, **props))
        return name

    return make


def _send(info: Any, entity: str, items: list[ServiceBusMessage]) -> None:
    with ServiceBusClient.from_connection_string(info.connection_string, retry_total=0) as client:
        with client.get_queue_sender(entity) as sender:
            sender.send_messages(items)


def _peek(info: Any, entity: str) -> list[Any]:
    with ServiceBusClient.from_connection_string(info.connection_string, retry_total=0) as client:
        with client.get_queue_receiver(entity) as receiver:
            return receiver.peek_messages(max_message_count=100, sequence_number=1)


def _reader(conf: dict, **options: str) -> ServiceBusStreamReader:
    return ServiceBusStreamReader({**config_options(conf), "receiveTimeout": "0.5", **options})


def _rows(reader: ServiceBusStreamReader, start: dict, end: dict) -> list[dict]:
    return [dict(zip(SERVICEBUS_SCHEMA.names, row, strict=True))
            for partition in reader.partitions(start, end) for row in reader.read(partition)]


def test_reads_a_queue_on_both_namespaces_replayably_and_completes_only_on_commit(conf, primary, secondary,
                                                                                   replicated_queue) -> None:
    queue = replicated_queue()
    _send(primary, queue, [ServiceBusMessage(b"one", message_id="m1", subject="s", content_type="text/plain",
                                             correlation_id="c", application_properties={"color": "red", "n": 7},
                                             time_to_live=datetime.timedelta(minutes=5)),
                           messages.ping_message()])
    _send(secondary, queue, [ServiceBusMessage(b"one", message_id="m1"), ServiceBusMessage(b"two", message_id="m2")])
    reader = _reader(conf, entity=queue, namespaces="primary, secondary")
    start = reader.initialOffset()
    end = reader.latestOffset(start, read_limit(10))
    assert sorted(end["entities"]) == [f"primary:{queue}", f"secondary:{queue}"]
    rows = _rows(reader, start, end)
    assert sorted((r["namespace"], r["message_id"]) for r in rows) == [
        ("primary", "m1"), ("secondary", "m1"), ("secondary", "m2")]  # the ping never became a row
    first = next(r for r in rows if r["namespace"] == "primary")
    assert (first["entity"], first["body"], first["subject"], first["content_type"], first["correlation_id"]) == (
        queue, b"one", "s", "text/plain", "c")
    assert first["application_properties"] == {"color": "red", "n": "7"}
    assert 0 < first["time_to_live_ms"] <= 300_000 and first["sequence_number"] >= 1
    assert first["enqueued_time"].tzinfo is not None and first["delivery_count"] >= 0
    # replayable: reading the batch again gives the same rows, and nothing is completed before the commit
    assert _rows(reader, start, end) == rows
    assert len(_peek(primary, queue)) == 1 and len(_peek(secondary, queue)) == 2
    reader.commit(end)
    assert _peek(primary, queue) == [] and _peek(secondary, queue) == []


@pytest.mark.spark_independent
def test_a_namespace_down_is_left_out_and_read_when_it_is_back(conf, emulator, primary, secondary,
                                                              replicated_queue) -> None:
    queue = replicated_queue()
    _send(primary, queue, [ServiceBusMessage(b"p", message_id="p1")])
    _send(secondary, queue, [ServiceBusMessage(b"s", message_id="s1")])
    emulator.fault("primary", "down")
    reader = _reader(conf, entity=queue, namespaces="primary,secondary")  # the check logs, does not raise
    start = reader.initialOffset()
    end = reader.latestOffset(start, read_limit(10))
    assert [r["message_id"] for r in _rows(reader, start, end)] == ["s1"]
    emulator.heal("primary")
    close_all()  # the clients the outage broke
    later, ids = end, []
    for _ in range(3):  # the primary is swept first, then received from (by the next receive ahead)
        start, later = later, reader.latestOffset(later, read_limit(10))
        ids += [r["message_id"] for r in _rows(reader, start, later)]
    assert ids == ["p1"]
    reader.commit(later)
    assert _peek(primary, queue) == [] and _peek(secondary, queue) == []


@pytest.mark.spark_independent
def test_a_read_carries_on_through_a_stall_of_its_namespace(conf, emulator, primary, replicated_queue) -> None:
    """The primary holds every answer for 5 s, longer than one attempt's try timeout (3 s), while a planned batch
    is read: the read retries and returns every row once (it raised OperationTimeoutError, and the query
    stopped)."""
    queue = replicated_queue()
    _send(primary, queue, [ServiceBusMessage(f"b{i}", message_id=f"m{i}") for i in range(5)])
    reader = _reader(conf, entity=queue)
    start = reader.initialOffset()
    end = reader.latestOffset(start, read_limit(10))
    emulator.fault("primary", "timeout", duration=5)
    rows = _rows(reader, start, end)
    assert sorted(r["message_id"] for r in rows) == [f"m{i}" for i in range(5)]
    reader.commit(end)
    assert _peek(primary, queue) == []


@pytest.mark.spark_independent
def test_a_read_gives_up_after_its_bound_naming_the_namespace_and_the_entity(conf, emulator, primary,
                                                                               replicated_queue) -> None:
    """A namespace down for longer than ``readRetryTimeout`` (a fake clock: the test takes no minutes) fails the
    read with SourceUnavailableError naming where and how long; the batch stays deferred and is read later."""
    from spark_sb.errors import SourceUnavailableError

    queue = replicated_queue()
    _send(primary, queue, [ServiceBusMessage(f"b{i}", message_id=f"m{i}") for i in range(3)])
    reader = _reader(conf, entity=queue, readRetryTimeout="30")
    now = [0.0]
    reader._clock = lambda: now[0]
    reader._sleep = lambda seconds: now.__setitem__(0, now[0] + seconds)
    start = reader.initialOffset()
    end = reader.latestOffset(start, read_limit(10))
    emulator.fault("primary", "down")
    try:
        with pytest.raises(SourceUnavailableError) as caught:
            _rows(reader, start, end)
    finally:
        emulator.heal("primary")
    text = str(caught.value)
    assert f"{queue!r} on the primary localhost:{primary.amqp_port}" in text and "failed for 30 s" in text, text
    assert now[0] == 30.0
    close_all()  # the clients the outage broke
    assert sorted(r["message_id"] for r in _rows(reader, start, end)) == ["m0", "m1", "m2"]  # nothing lost
    reader.commit(end)
    assert _peek(primary, queue) == []


@pytest.mark.spark_independent
def test_a_commit_that_cannot_reach_its_namespace_is_retried_with_the_next_batch(conf, emulator, primary,
                                                                                   replicated_queue) -> None:
    queue = replicated_queue()
    _send(primary, queue, [ServiceBusMessage(f"b{i}", message_id=f"m{i}") for i in range(3)])
    reader = _reader(conf, entity=queue)
    start = reader.initialOffset()
    end = reader.latestOffset(start, read_limit(10))
    assert len(_rows(reader, start, end)) == 3
    emulator.fault("primary", "down")
    try:
        reader.commit(end)  # logged; the query goes on
    finally:
        emulator.heal("primary")
    assert len(_peek(primary, queue)) == 3  # still deferred
    close_all()
    reader.latestOffset(end, read_limit(10))  # the next batch completes them
    assert _peek(primary, queue) == []


@pytest.mark.spark_independent
def test_a_restarted_reader_takes_back_what_a_dead_one_left_deferred(conf, primary, replicated_queue) -> None:
    queue = replicated_queue()
    _send(primary, queue, [ServiceBusMessage(f"b{i}", message_id=f"m{i}") for i in range(3)])
    dead = _reader(conf, entity=queue)
    dead.latestOffset(dead.initialOffset(), read_limit(10))  # deferred; Spark never recorded the offset
    fresh = _reader(conf, entity=queue)
    start = fresh.initialOffset()
    end = fresh.latestOffset(start, read_limit(10))
    assert sorted(r["message_id"] for r in _rows(fresh, start, end)) == ["m0", "m1", "m2"]
    fresh.commit(end)
    assert _peek(primary, queue) == []


def test_reads_a_topic_subscription(conf, emulator, primary, request) -> None:
    topic = unique_name(request, "rt-")
    create(emulator, "primary", TopicSpec(name=topic))
    create(emulator, "primary", SubscriptionSpec(topic=topic, name="all"))
    with ServiceBusClient.from_connection_string(primary.connection_string, retry_total=0) as client:
        with client.get_topic_sender(topic) as sender:
            sender.send_messages([ServiceBusMessage(b"e", message_id="e1")])
    reader = _reader(conf, entity=f"{topic}/subscriptions/all")
    start = reader.initialOffset()
    end = reader.latestOffset(start, read_limit(10))
    [row] = _rows(reader, start, end)
    assert (row["namespace"], row["entity"], row["message_id"]) == ("primary", f"{topic}/subscriptions/all", "e1")


@pytest.mark.parametrize(("options", "field", "shown"), [
    ({}, "entity", "required"),
    ({"entity": "orders", "namespaces": "primary,tertiary"}, "namespaces", "'tertiary' is not a namespace"),
    ({"entity": "orders", "namespaces": " , "}, "namespaces", "names no namespace"),
    ({"entity": "events/subscriptions/"}, "entity", "topic/subscriptions/name"),
    ({"entity": "orders", "maxMessagesPerTrigger": "0"}, "maxMessagesPerTrigger", "positive"),
    ({"entity": "orders", "receivesInFlight": "33"}, "receivesInFlight", "at most 32"),
])
def test_bad_options_are_refused_before_anything_starts(conf, options, field, shown) -> None:
    with pytest.raises(ConfigError) as caught:
        _reader(conf, **options)
    assert caught.value.option == field and shown in str(caught.value)


def test_a_missing_entity_and_a_session_entity_are_refused_before_anything_starts(conf, emulator, secondary,
                                                                                 replicated_queue, request) -> None:
    with pytest.raises(EntityNotFoundError, match="no-such-queue"):
        _reader(conf, entity="no-such-queue")
    only_primary = unique_name(request, "op-")
    create(emulator, "primary", QueueSpec(name=only_primary))
    with pytest.raises(EntityNotFoundError, match="secondary"):
        _reader(conf, entity=only_primary, namespaces="primary,secondary")
    sessions = replicated_queue(requires_session=True)
    with pytest.raises(ConfigError, match="requires sessions") as caught:
        _reader(conf, entity=sessions)
    assert caught.value.option == "entity"


def test_dedupe_is_withwatermark_and_drop_duplicates_within_it(spark) -> None:
    from spark_sb import dedupe

    df = spark.readStream.format("rate").load().selectExpr("CAST(value % 3 AS STRING) AS message_id",
                                                          "timestamp AS enqueued_time")
    plan = dedupe(df, window="10 minutes")._jdf.queryExecution().logical().toString()
    assert "DeduplicateWithinWatermark [message_id" in plan
    assert "EventTimeWatermark" in plan and "enqueued_time" in plan and "10 minutes" in plan
    with pytest.raises(ConfigError, match="window"):
        dedupe(df, window="soon")
    with pytest.raises(ConfigError, match="time_column.*arrival"):
        dedupe(df, time_column="arrival")


@pytest.mark.spark_independent
def test_a_defer_whose_answer_is_lost_is_taken_back_in_a_later_batch(conf, primary, replicated_queue,
                                                                     monkeypatch) -> None:
    """The broker deferred the message but the client saw an error (an answer lost): the message is in no
    batch, so the reader sweeps the entity again and reads it in a later batch, once."""
    from azure.servicebus import ServiceBusReceiver

    queue = replicated_queue()
    _send(primary, queue, [ServiceBusMessage(f"b{i}", message_id=f"m{i}") for i in range(6)])
    real_defer = ServiceBusReceiver.defer_message
    calls = {"n": 0}

    def defer_then_fail(self: Any, message: Any) -> None:
        real_defer(self, message)
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("the settlement's answer was lost")

    monkeypatch.setattr(ServiceBusReceiver, "defer_message", defer_then_fail)
    reader = _reader(conf, entity=queue)
    offset, ids = reader.initialOffset(), []
    for _ in range(4):
        start, offset = offset, reader.latestOffset(offset, read_limit(10))
        ids += [r["message_id"] for r in _rows(reader, start, offset)]
    monkeypatch.setattr(ServiceBusReceiver, "defer_message", real_defer)
    assert sorted(ids) == [f"m{i}" for i in range(6)]  # each once, the one whose answer was lost too
    reader.latestOffset(offset, read_limit(10))  # completes the last batch
    assert _peek(primary, queue) == []


def test_the_entity_option_takes_a_hierarchical_queue_name() -> None:
    from spark_sb.source import _entity_option

    assert _entity_option({"Entity": "sales/orders"}) == "sales/orders"


@pytest.mark.skipif(not trigger_available_now(), reason="Trigger.AvailableNow for Python sources needs Spark 4.2")
def test_available_now_reads_what_was_there_at_the_start_and_stops(spark, conf, primary, replicated_queue,
                                                                  tmp_path) -> None:
    from spark_sb import register

    register(spark)
    queue = replicated_queue()
    _send(primary, queue, [ServiceBusMessage(f"m{i}", message_id=f"m{i}") for i in range(7)])
    seen: list[str] = []

    def collect(df: Any, batch_id: int) -> None:
        if not seen:  # sent while the query runs: they wait for the next run
            _send(primary, queue, [ServiceBusMessage(f"late{i}", message_id=f"late{i}") for i in range(3)])
        seen.extend(r.message_id for r in df.select("message_id").collect())

    def run() -> None:
        query = (spark.readStream.format("servicebus").options(**config_options(conf), entity=queue,
                                                               maxMessagesPerTrigger="3", receiveTimeout="0.5")
                 .load().writeStream.foreachBatch(collect).option("checkpointLocation", str(tmp_path / "ck"))
                 .trigger(availableNow=True).start())
        assert query.awaitTermination(120), "the availableNow query did not stop by itself"
        assert query.exception() is None

    run()
    assert sorted(seen) == [f"m{i}" for i in range(7)]  # in three batches of at most 3, then it stopped
    assert sorted(str(m.message_id) for m in _peek(primary, queue)) == ["late0", "late1", "late2"]
    run()  # the next run takes them, once
    assert sorted(seen) == sorted([f"m{i}" for i in range(7)] + ["late0", "late1", "late2"])
    assert _peek(primary, queue) == []
