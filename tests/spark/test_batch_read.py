"""``spark.read.format("servicebus")``: a batch peek of a queue, a subscription or a dead-letter queue, which never
locks or removes anything; and ``spark_sb.dead_letters.remove``, which removes exactly the dead-lettered messages
it is given."""

from __future__ import annotations

from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage, ServiceBusReceiveMode, ServiceBusSubQueue

from spark_sb import dead_letters, messages
from spark_sb.admin import admin_client
from spark_sb.bus import close_all
from spark_sb.source import DEAD_LETTER_SCHEMA, SERVICEBUS_SCHEMA, config_options, register

from .conftest import sink_config


@pytest.fixture
def conf(primary: Any, secondary: Any) -> Any:
    """The emulator pair in paired mode (the round trip sends back through the sink)."""
    yield sink_config(primary, secondary)
    close_all()


@pytest.fixture
def read(spark: Any, conf: dict) -> Any:
    register(spark)

    def load(entity: str, **options: str) -> Any:
        return spark.read.format("servicebus").options(**config_options(conf), entity=entity, **options).load()

    return load


def _send(info: Any, queue: str, items: list[ServiceBusMessage]) -> None:
    with ServiceBusClient.from_connection_string(info.connection_string, retry_total=0) as client, \
            client.get_queue_sender(queue) as sender:
        for start in range(0, len(items), 1000):
            batch = sender.create_message_batch()
            for item in items[start:start + 1000]:
                batch.add_message(item)
            sender.send_messages(batch)


def _counts(info: Any, queue: str) -> tuple[int, int]:
    with admin_client(info.connection_string, admin_endpoint=info.admin_url) as admin:
        props = admin.get_queue_runtime_properties(queue)
    return props.active_message_count, props.dead_letter_message_count


def _dead_letter(info: Any, queue: str, reasons: dict[str, str]) -> None:
    """Dead-letter the messages of ``queue`` whose ids are in ``reasons``, with that reason."""
    with ServiceBusClient.from_connection_string(info.connection_string, retry_total=0) as client, \
            client.get_queue_receiver(queue) as receiver:
        left = set(reasons)
        while left:
            for message in receiver.receive_messages(max_message_count=50, max_wait_time=2):
                receiver.dead_letter_message(message, reason=reasons[str(message.message_id)],
                                             error_description=f"{message.message_id} is bad")
                left.discard(str(message.message_id))


@pytest.mark.every_spark
def test_a_batch_read_of_10000_messages_leaves_them_all_there_and_bounds_by_sequence_number(
        read, primary, make_queue) -> None:
    queue = make_queue()
    _send(primary, queue, [ServiceBusMessage(f"body {i}", message_id=f"m{i:05d}", subject="s",
                                             application_properties={"n": i}) for i in range(10_000)]
          + [messages.ping_message()])
    df = read(queue)
    assert df.schema == SERVICEBUS_SCHEMA
    rows = df.select("message_id", "sequence_number", "delivery_count", "namespace", "entity").collect()
    assert sorted(r["message_id"] for r in rows) == [f"m{i:05d}" for i in range(10_000)]  # the ping left out
    assert {(r["namespace"], r["entity"], r["delivery_count"]) for r in rows} == {("primary", queue, 0)}
    assert _counts(primary, queue)[0] >= 10_000  # nothing taken away (the ping may have expired: its TTL is 1 s)
    numbers = sorted(r["sequence_number"] for r in rows)
    first = numbers[100]
    bounded = read(queue, fromSequenceNumber=str(first), toSequenceNumber=str(first + 299)).collect()
    assert sorted(r["sequence_number"] for r in bounded) == numbers[100:400]
    assert [r["message_id"] for r in read(queue, maxMessages="7").orderBy("sequence_number").collect()] == [
        f"m{i:05d}" for i in range(7)]
    one = read(queue, fromSequenceNumber=str(first), maxMessages="1").first()
    assert (one["body"], one["subject"], one["application_properties"]) == (b"body 100", "s", {"n": "100"})
    assert _counts(primary, queue)[0] >= 10_000


def test_the_dead_letter_round_trip_resends_the_fixed_rows_once_and_removes_exactly_those(
        read, conf, primary, make_queue) -> None:
    """Read the dead-letter queue in batch, fix some rows, send them back (twice: duplicate detection keeps one),
    then remove exactly the resent ones from the dead-letter queue."""
    from pyspark.sql import functions as F

    queue = make_queue(requires_duplicate_detection=True)
    ids = [f"d{i}" for i in range(6)]
    _send(primary, queue, [ServiceBusMessage(f"bad {i}", message_id=i) for i in ids])
    _dead_letter(primary, queue, {i: "BadFormat" if i < "d3" else "TooOld" for i in ids})
    dlq = read(f"{queue}/$DeadLetterQueue")
    assert dlq.schema == DEAD_LETTER_SCHEMA
    rows = {r["message_id"]: r for r in dlq.collect()}
    assert sorted(rows) == ids
    assert rows["d1"]["entity"] == queue and rows["d1"]["dead_letter_reason"] == "BadFormat"
    assert rows["d4"]["dead_letter_reason"] == "TooOld" and rows["d4"]["dead_letter_error_description"] == "d4 is bad"
    assert _counts(primary, queue) == (0, 6)  # the read took nothing

    # a new id, the same on every run: the original id is still in the duplicate detection window, where Service
    # Bus would drop the resent message as a duplicate of the one that was dead-lettered
    fixed = (dlq.where(F.col("message_id").isin("d1", "d3", "d4"))
             .withColumn("body", F.concat(F.lit("fixed "), F.col("message_id")))
             .withColumn("message_id", F.concat_ws("-", "message_id", F.lit("resent"), "sequence_number")))
    for _ in range(2):  # the same rows twice, as a notebook run twice would; back to the queue of their `entity`
        fixed.write.format("servicebus").options(**config_options(conf)).mode("append").save()
    resent = [r["sequence_number"] for r in fixed.select("sequence_number").collect()]
    done = dead_letters.remove(conf, queue, [*resent, 987654])
    assert done.removed == tuple(sorted(resent)) and done.missing == (987654,)
    left = sorted(r["message_id"] for r in read(f"{queue}/$deadletterqueue").collect())
    assert left == ["d0", "d2", "d5"]  # nothing removed that was not asked for, and the others are not locked
    again = dead_letters.remove(conf, f"{queue}/$DeadLetterQueue", resent)
    assert again.removed == () and again.missing == tuple(sorted(resent))
    with ServiceBusClient.from_connection_string(primary.connection_string, retry_total=0) as client:
        with client.get_queue_receiver(queue, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as receiver:
            home = sorted(str(m) for m in receiver.receive_messages(10, max_wait_time=2))
        with client.get_queue_receiver(queue, sub_queue=ServiceBusSubQueue.DEAD_LETTER,
                                       receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as receiver:
            still = sorted(str(m.message_id) for m in receiver.receive_messages(10, max_wait_time=2))
    assert home == ["fixed d1", "fixed d3", "fixed d4"]  # once each, fixed
    assert still == left


def test_bad_read_options_are_refused_before_anything_is_read(read, spark, conf, make_queue) -> None:
    queue = make_queue()
    for options, named in ((dict(entity="no-such-queue"), "no-such-queue"),
                           (dict(entity=queue, toSequenceNumber="3", fromSequenceNumber="9"), "toSequenceNumber"),
                           (dict(entity=queue, maxMessages="0"), "maxMessages"),
                           (dict(entity=queue, fromSequenceNumber="-1"), "fromSequenceNumber")):
        entity = options.pop("entity")
        with pytest.raises(Exception, match=named):
            read(entity, **options).collect()
    with pytest.raises(Exception, match="dead-letter queue, which the servicebus source reads in batch only"):
        (spark.readStream.format("servicebus").options(**config_options(conf), entity=f"{queue}/$DeadLetterQueue")
         .load().writeStream.format("noop").start().awaitTermination(30))
