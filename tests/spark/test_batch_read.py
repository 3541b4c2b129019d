"""``spark.read.format("servicebus")``: a batch peek of a queue, a subscription or a dead-letter queue, which never
locks or removes anything; and ``spark_sb.dead_letters.remove``, which removes exactly the dead-lettered messages
it is given, and ``spark_sb.dead_letters.resend``, the round trip in one call."""

from __future__ import annotations

from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage, ServiceBusReceiveMode

from spark_sb import dead_letters, messages
from spark_sb.admin import admin_client
from spark_sb.emulator.model import QueueSpec
from spark_sb.source import DEAD_LETTER_SCHEMA, SERVICEBUS_SCHEMA, config_options


@pytest.fixture
def conf(paired_conf: dict) -> dict:
    """The emulator pair in paired mode (the round trip sends back through the paired sender)."""
    return paired_conf


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
        read, conf, emulator, primary, secondary, make_queue) -> None:
    """Read the dead-letter queues of both namespaces in batch, fix some rows, resend them (twice: duplicate
    detection keeps one), and remove from the dead-letter queues exactly what the primary accepted: not a row
    it rejected, not a message dead-lettered while the rows were being sent, not the other namespace's message
    with the same sequence number."""
    from pyspark.sql import functions as F

    queue = make_queue(requires_duplicate_detection=True)
    server = emulator.server("secondary")  # the same queue on the secondary
    server.call(lambda: server.broker.create_entity(QueueSpec(name=queue)))
    ids = [f"d{i}" for i in range(6)]
    _send(primary, queue, [ServiceBusMessage(f"bad {i}", message_id=i) for i in ids])
    _dead_letter(primary, queue, {i: "BadFormat" if i < "d3" else "TooOld" for i in ids})
    _send(secondary, queue, [ServiceBusMessage(f"bad s{i}", message_id=f"s{i}") for i in range(3)])
    _dead_letter(secondary, queue, {f"s{i}": "BadFormat" for i in range(3)})
    dlq = read(f"{queue}/$DeadLetterQueue")
    assert dlq.schema == DEAD_LETTER_SCHEMA
    rows = {r["message_id"]: r for r in dlq.collect()}
    assert sorted(rows) == ids
    assert rows["d1"]["entity"] == queue and rows["d1"]["dead_letter_reason"] == "BadFormat"
    assert rows["d4"]["dead_letter_reason"] == "TooOld" and rows["d4"]["dead_letter_error_description"] == "d4 is bad"
    assert _counts(primary, queue) == (0, 6)  # the read took nothing
    both = read(f"{queue}/$DeadLetterQueue", namespaces="primary,secondary")
    s2 = next(r["sequence_number"] for r in both.collect() if r["message_id"] == "s2")
    assert s2 == rows["d2"]["sequence_number"]  # the same number names d2 on the primary, which is not resent

    # a new id, the same on every run: the original id is still in the duplicate detection window, where Service
    # Bus would drop the resent message as a duplicate of the one that was dead-lettered. d4's body is made null:
    # the primary never gets it, so it stays
    fixed = (both.where(F.col("message_id").isin("d1", "d3", "d4", "s2") | (F.col("dead_letter_reason") == "Late"))
             .withColumn("body", F.when(F.col("message_id") == "d4", F.lit(None))
                         .otherwise(F.concat(F.lit("fixed "), F.col("message_id"))).cast("binary"))
             .withColumn("message_id", F.concat_ws("-", "message_id", F.lit("resent"), "sequence_number")))

    def while_sending(rows: Any) -> Any:
        """The rows as resend reads them; once they are read, a message is dead-lettered that ``fixed`` would now
        find: a removal by a second read of ``fixed`` would remove it without its having been resent."""
        yield from rows
        _send(primary, queue, [ServiceBusMessage("late", message_id="late")])
        _dead_letter(primary, queue, {"late": "Late"})

    first = dead_letters.resend(conf, while_sending(fixed.toLocalIterator()))
    named = dead_letters.DeadLettered
    assert sorted(first.sent) == sorted([named("primary", queue, rows["d1"]["sequence_number"]),
                                         named("primary", queue, rows["d3"]["sequence_number"]),
                                         named("secondary", queue, s2)])
    assert first.rejected == ((named("primary", queue, rows["d4"]["sequence_number"]),
                               "cannot build the message: body is null"),)
    assert first.removed.removed == tuple(sorted(first.sent)) and first.removed.missing == first.removed.left == ()
    assert sorted(r["message_id"] for r in read(f"{queue}/$deadletterqueue").collect()) == [
        "d0", "d2", "d4", "d5", "late"]  # nothing removed that was not resent, and the others are not locked
    again = dead_letters.resend(conf, fixed)  # run again: the late message now; d4 rejected again
    assert [m.namespace for m in again.sent] == ["primary"] and again.removed.removed == again.sent
    assert [m for m, _ in again.rejected] == [m for m, _ in first.rejected]
    assert sorted(r["message_id"] for r in read(f"{queue}/$deadletterqueue").collect()) == ["d0", "d2", "d4", "d5"]
    assert sorted(r["message_id"] for r in read(f"{queue}/$DeadLetterQueue", namespaces="secondary").collect()) == [
        "s0", "s1"]
    with ServiceBusClient.from_connection_string(primary.connection_string, retry_total=0) as client:
        with client.get_queue_receiver(queue, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as receiver:
            home = sorted(str(m) for m in receiver.receive_messages(10, max_wait_time=2))
    assert home == ["fixed d1", "fixed d3", "fixed late", "fixed s2"]  # once each, fixed
    done = dead_letters.remove(conf, queue, [987654], namespace="primary")
    assert done.missing == (named("primary", queue, 987654),)


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


#: the dead-letter round trip of docs/dead-letters.md, run as written
ROUND_TRIP_MARK = "<!-- run by tests/spark/test_batch_read.py: the dead-letter round trip, on the dlq read above -->"


def test_the_readme_round_trip_runs_as_written(read, conf, primary, make_queue, tmp_path, capsys) -> None:
    import re
    from pathlib import Path

    import yaml

    text = (Path(__file__).resolve().parents[2] / "docs" / "dead-letters.md").read_text()
    block = re.search(r"```python\n(.*?)```", text[text.index(ROUND_TRIP_MARK):], re.S).group(1)
    queue = make_queue(requires_duplicate_detection=True)
    _send(primary, queue, [ServiceBusMessage(f"bad {i}", message_id=i) for i in "abcd"])
    _dead_letter(primary, queue, {"a": "BadFormat", "b": "BadFormat", "c": "BadFormat", "d": "TooOld"})
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(conf))
    assert '"conf/local.yaml"' in block
    names = {"dlq": read(f"{queue}/$DeadLetterQueue")}  # what the block above reads; the round trip defines fix
    exec(compile(block.replace('"conf/local.yaml"', repr(str(path))), "dead-letters.md", "exec"), names)  # noqa: S102
    assert capsys.readouterr().out.splitlines() == ["sent 3, rejected 0; removed 3, not found 0, left 0"]
    assert [r["message_id"] for r in read(f"{queue}/$DeadLetterQueue").collect()] == ["d"]
    with ServiceBusClient.from_connection_string(primary.connection_string, retry_total=0) as client:
        with client.get_queue_receiver(queue, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as receiver:
            home = sorted(str(m) for m in receiver.receive_messages(10, max_wait_time=2))
    assert home == ["fixed bad a", "fixed bad b", "fixed bad c"]
