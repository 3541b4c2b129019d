"""Issue 33, item 4: a dead-lettered message read in batch and written back with ``df.write.format("servicebus")``
(or ``foreachBatch(PairedSink)``) arrives as the original did: its application properties of their AMQP types
(an int stays an int, a timestamp a timestamp), its TTL and its fields, without the dead-letter reason the service
put among its properties. What arrives is read with a bare Proton receiver, which keeps every AMQP type (the
Python SDK's decoder does not)."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage
from azure.servicebus._pyamqp.utils import amqp_long_value
from proton import Message, timestamp
from proton.utils import BlockingConnection

from spark_sb import messages
from spark_sb.emulator import NamespaceInfo, sas
from spark_sb.emulator.model import RuleSpec
from spark_sb.sink import PairedSink
from spark_sb.source import config_options, register

AT = dt.datetime(2024, 5, 1, 12, 30, 15, 123000, tzinfo=dt.UTC)
TTL = dt.timedelta(seconds=90, milliseconds=500)


@pytest.fixture
def conf(paired_conf: dict) -> dict:
    """The emulator pair in paired mode (the writer sends through the paired sender)."""
    return paired_conf


def _original() -> ServiceBusMessage:
    message = ServiceBusMessage(
        b'{"order": 42}', message_id="order-42", subject="orders.created", correlation_id="corr-42",
        content_type="application/json", to="billing", reply_to="replies",
        application_properties={"p": 5, "count": amqp_long_value(7), "ratio": 0.25, "urgent": True, "at": AT,
                                "region": "eu-west"})
    messages.set_time_to_live(message, TTL)
    return message


def _dead_letter_one(info: NamespaceInfo, queue: str, message: ServiceBusMessage) -> None:
    with ServiceBusClient.from_connection_string(info.connection_string, retry_total=0) as client:
        with client.get_queue_sender(queue) as sender:
            sender.send_messages(message)
        with client.get_queue_receiver(queue) as receiver:
            received = receiver.receive_messages(max_message_count=1, max_wait_time=5)
            assert len(received) == 1
            receiver.dead_letter_message(received[0], reason="BadFormat", error_description="order 42 is bad")


def _receive_raw(info: NamespaceInfo, entity: str, timeout: float = 10.0) -> Message | None:
    """One message of ``entity`` (accepted), received by Proton, which decodes each AMQP type to a type of its
    own (int32, long as int, timestamp, float32, symbol...); None when none came within ``timeout``."""
    conn = BlockingConnection(f"amqp://localhost:{info.amqp_port}", allowed_mechs="ANONYMOUS", timeout=10)
    try:
        cbs_sender = conn.create_sender("$cbs")
        cbs_receiver = conn.create_receiver("$cbs", credit=1)
        audience = f"sb://localhost:{info.amqp_port}/{entity}"
        expires = timestamp(int((dt.datetime.now().timestamp() + 3600) * 1000))
        cbs_sender.send(Message(id=uuid.uuid4(), reply_to="$cbs-client", body=sas.make_token(
            audience, info.key_name, info.key), properties={
                "operation": "put-token", "type": "servicebus.windows.net:sastoken", "name": audience,
                "expiration": expires}))
        cbs_receiver.receive(timeout=10)
        cbs_receiver.accept()
        receiver = conn.create_receiver(entity, credit=1)
        try:
            message = receiver.receive(timeout=timeout)
        except Exception:  # proton's Timeout: nothing came
            return None
        receiver.accept()
        return message
    finally:
        conn.close()


def _typed(properties: dict) -> dict[str, tuple[str, Any]]:
    return {str(k): (type(v).__name__, v) for k, v in properties.items()}


#: what a Proton receiver decodes the original's properties to: the AMQP type of each, and its value
ORIGINAL_TYPES = {"p": ("int32", 5), "count": ("int", 7), "ratio": ("float", 0.25), "urgent": ("bool", True),
                  "at": ("timestamp", int(AT.timestamp() * 1000)), "region": ("str", "eu-west")}


def test_a_dead_lettered_message_written_back_keeps_its_property_types_ttl_and_fields(
        read, conf, primary, make_queue, make_topic) -> None:
    from pyspark.sql import functions as F

    queue = make_queue()
    topic = make_topic({
        "big": {"rules": [RuleSpec(name="big", filter={"type": "sql", "expression": "p > 3 AND count = 7"})]},
        "small": {"rules": [RuleSpec(name="small", filter={"type": "sql", "expression": "p < 3"})]},
    })
    _dead_letter_one(primary, queue, _original())
    dlq = read(f"{queue}/$DeadLetterQueue")
    # as the round trip in docs/dead-letters.md does: a new id, the same on every run, and nothing else changed
    resend = dlq.withColumn("message_id", F.concat_ws("-", "message_id", F.lit("resent"), "sequence_number"))
    resend.write.format("servicebus").options(**config_options(conf)).mode("append").save()
    resend.withColumn("entity", F.lit(topic)).write.format("servicebus").options(**config_options(conf)) \
        .mode("append").save()

    home = _receive_raw(primary, queue)
    assert home is not None
    assert _typed(home.properties) == ORIGINAL_TYPES  # no DeadLetterReason, no DeadLetterErrorDescription
    assert home.ttl == pytest.approx(TTL.total_seconds())
    assert (home.subject, home.correlation_id, home.content_type, home.address, home.reply_to) == (
        "orders.created", "corr-42", "application/json", "billing", "replies")
    assert bytes(home.body) == b'{"order": 42}' and str(home.id).startswith("order-42-resent-")

    # a numeric filter matches the resent message as it matched the original
    big = _receive_raw(primary, f"{topic}/subscriptions/big")
    assert big is not None and _typed(big.properties) == ORIGINAL_TYPES
    assert _receive_raw(primary, f"{topic}/subscriptions/small", timeout=1.0) is None

    # foreachBatch(PairedSink) maps the same columns the same way
    other = make_queue()
    PairedSink.from_config(conf)(resend.withColumn("entity", F.lit(other)), 1)
    again = _receive_raw(primary, other)
    assert again is not None and _typed(again.properties) == ORIGINAL_TYPES
    assert again.ttl == pytest.approx(TTL.total_seconds()) and again.subject == "orders.created"

    row = dlq.first()
    assert row["dead_letter_reason"] == "BadFormat" and row["dead_letter_error_description"] == "order 42 is bad"
    assert set(row["application_properties"]) == {"p", "count", "ratio", "urgent", "at", "region"}
    assert row["application_property_types"] == {"p": "int", "count": "long", "ratio": "double", "urgent": "boolean",
                                                  "at": "timestamp", "region": "string"}
    assert row["time_to_live_ms"] == 90_500


def test_a_property_whose_text_no_longer_fits_its_type_fails_the_write_naming_it(
        spark, conf, primary, make_queue) -> None:
    """Nothing is retyped behind the user's back: a row whose ``p`` says int but holds ``five`` is refused (no
    reject table: the write fails naming the property), and nothing of it is sent."""
    register(spark)
    queue = make_queue()
    rows = [("fixed", "m-1", {"p": "five", "region": "eu"}, {"p": "int", "region": "string"})]
    df = spark.createDataFrame(rows, "body string, message_id string, application_properties map<string, string>, "
                                     "application_property_types map<string, string>")
    with pytest.raises(Exception, match=r"message 'm-1'.*application property 'p': 'five' is not an int"):
        df.write.format("servicebus").options(**config_options(conf)).option("entity", queue).mode("append").save()
    assert _receive_raw(primary, queue, timeout=1.0) is None


def test_a_ttl_in_both_seconds_and_milliseconds_is_refused_naming_both(spark, conf, make_queue) -> None:
    register(spark)
    queue = make_queue()
    df = spark.createDataFrame([("b", 60.0, 60_000)], "body string, time_to_live double, time_to_live_ms long")
    with pytest.raises(Exception, match="time_to_live_ms.*time_to_live|time_to_live.*time_to_live_ms"):
        df.write.format("servicebus").options(**config_options(conf)).option("entity", queue).mode("append").save()
