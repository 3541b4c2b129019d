"""The backlog rewrite and its inverse, through the SDK's own wire encoding.

A "received" message here is what the SDK's receiver would hand over: the message is converted for sending
by the SDK (``transform_outbound_messages``), encoded by its AMQP encoder, given the annotations a broker
adds (enqueued time, sequence number), and decoded by ``ServiceBusReceivedMessage.from_bytes`` (the same
``decode_payload`` the receiver link uses).
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import pytest
from azure.servicebus import ServiceBusMessage, ServiceBusMessageBatch, ServiceBusReceivedMessage
from azure.servicebus._common.utils import transform_outbound_messages
from azure.servicebus._pyamqp._encode import encode_payload
from azure.servicebus._pyamqp.utils import amqp_long_value, amqp_timestamp_value
from azure.servicebus._transport._pyamqp_transport import PyamqpTransport
from azure.servicebus.amqp import AmqpAnnotatedMessage, AmqpMessageBodyType

from spark_sb import wire
from spark_sb.errors import BadMessageError
from spark_sb.messages import (
    BACKLOG_PROPERTIES,
    PING_CONTENT_TYPE,
    TTL_EXPIRED_IN_BACKLOG,
    X_MS_PARTITION_KEY,
    X_MS_PATH,
    X_MS_REPARKED_FROM,
    X_MS_SCHEDULED_ENQUEUE_TIME,
    X_MS_SESSION_ID,
    X_MS_TIME_TO_LIVE,
    RestoreStatus,
    check_encodable,
    from_backlog,
    is_ping,
    message_size,
    ping_message,
    set_time_to_live,
    to_backlog,
)

ENQUEUED = dt.datetime(2030, 5, 1, 12, 0, 0, tzinfo=dt.UTC)
SCHEDULED = dt.datetime(2030, 5, 2, 8, 30, 15, 250000, tzinfo=dt.UTC)


def receive(message: ServiceBusMessage, enqueued: dt.datetime = ENQUEUED, sequence_number: int = 7) -> ServiceBusReceivedMessage:
    outgoing = transform_outbound_messages(message, ServiceBusMessage, PyamqpTransport.to_outgoing_amqp_message)
    wire = outgoing._message
    annotations = dict(wire.message_annotations or {})
    annotations[b"x-opt-enqueued-time"] = amqp_timestamp_value(round(enqueued.timestamp() * 1000))
    annotations[b"x-opt-sequence-number"] = amqp_long_value(sequence_number)
    annotations[b"x-opt-locked-until"] = amqp_timestamp_value(round(enqueued.timestamp() * 1000) + 60_000)
    payload = bytearray()
    encode_payload(payload, wire._replace(message_annotations=annotations))
    return ServiceBusReceivedMessage.from_bytes(bytes(payload))


def full_message(body: Any = "hello", **overrides: Any) -> ServiceBusMessage:
    fields: dict[str, Any] = dict(
        application_properties={"tenant": "eu", "attempt": 3, "ratio": 0.5, "flag": True,
                                 "trace": uuid.UUID("12345678-1234-5678-1234-567812345678")},
        session_id="session-1",
        partition_key="session-1",
        message_id="m-1",
        correlation_id="c-1",
        subject="order-created",
        content_type="application/json",
        to="billing",
        reply_to="replies",
        reply_to_session_id="reply-session",
        time_to_live=dt.timedelta(minutes=10),
        scheduled_enqueue_time_utc=SCHEDULED,
    )
    fields.update(overrides)
    return ServiceBusMessage(body, **fields)


def with_body(kind: str) -> ServiceBusMessage:
    if kind == "str":
        return full_message("hello")
    if kind == "bytes":
        return full_message(b"\x00\x01binary\xff")
    if kind == "none":
        return full_message(None)
    raw = {
        "data-sections": AmqpAnnotatedMessage(data_body=[b"part-1", b"part-2"]),
        "value": AmqpAnnotatedMessage(value_body={"k": "v", "n": [1, 2, 3]}),
        "sequence": AmqpAnnotatedMessage(sequence_body=[[1, "a"], [2, "b"]]),
    }[kind]
    message = transform_outbound_messages(raw, ServiceBusMessage, PyamqpTransport.to_outgoing_amqp_message)
    base = full_message()
    for name in ("session_id", "message_id", "correlation_id", "subject", "content_type", "to", "reply_to",
                 "reply_to_session_id", "time_to_live", "partition_key", "scheduled_enqueue_time_utc",
                 "application_properties"):
        setattr(message, name, getattr(base, name))
    return message


def body_of(message: ServiceBusMessage) -> Any:
    return message.body if message.body_type == AmqpMessageBodyType.VALUE else list(message.body)


def text_properties(properties: dict[Any, Any] | None) -> dict[str, Any]:
    def text(value: Any) -> Any:
        return value.decode() if isinstance(value, bytes) else value

    return {text(k): text(v) for k, v in (properties or {}).items()}


def seen_by_consumer(message: ServiceBusReceivedMessage) -> dict[str, Any]:
    """Everything a consumer of the destination entity can observe, except times set by the broker."""
    return {
        "body_type": message.body_type,
        "body": body_of(message),
        "application_properties": text_properties(message.application_properties),
        **{name: getattr(message, name) for name in (
            "message_id", "correlation_id", "subject", "content_type", "to", "reply_to", "reply_to_session_id",
            "session_id", "partition_key", "scheduled_enqueue_time_utc", "time_to_live")},
    }


def test_to_backlog_moves_the_fields_a_backlog_queue_cannot_hold() -> None:
    original = full_message()
    backlog = to_backlog(original, "billing/events")
    assert backlog.session_id is None
    assert backlog.partition_key is None
    assert backlog.time_to_live is None
    assert backlog.scheduled_enqueue_time_utc is None
    received = receive(backlog)
    properties = text_properties(received.application_properties)
    assert properties[X_MS_PATH] == "billing/events"
    assert properties[X_MS_SESSION_ID] == "session-1"
    assert properties[X_MS_PARTITION_KEY] == "session-1"
    assert properties[X_MS_TIME_TO_LIVE] == 600_000
    assert properties[X_MS_SCHEDULED_ENQUEUE_TIME] == round(SCHEDULED.timestamp() * 1000)  # AMQP timestamp, ms
    assert received.session_id is None and received.time_to_live is None and received.partition_key is None
    for name in ("message_id", "correlation_id", "subject", "content_type", "to", "reply_to", "reply_to_session_id"):
        assert getattr(received, name) == getattr(original, name), name
    assert list(received.body) == [b"hello"]
    assert {k: v for k, v in properties.items() if not k.startswith("x-ms-")} == text_properties(
        original.application_properties
    )


def test_to_backlog_writes_the_ttl_as_an_amqp_long() -> None:
    # 30 days in ms does not fit an AMQP int: it must go out as a long (int64 milliseconds)
    original = full_message(time_to_live=dt.timedelta(days=30))
    received = receive(to_backlog(original, "orders"))
    assert received.application_properties[b"x-ms-timetolive"] == 30 * 86_400_000


def test_to_backlog_never_mutates_its_input() -> None:
    original = full_message()
    before = (repr(original), dict(original.application_properties), dict(original.raw_amqp_message.annotations))
    to_backlog(original, "orders")
    message_size(original)
    assert (repr(original), dict(original.application_properties), dict(original.raw_amqp_message.annotations)) == before
    assert original.session_id == "session-1" and original.time_to_live == dt.timedelta(minutes=10)


@pytest.mark.parametrize("kind", ["str", "bytes", "none", "data-sections", "value", "sequence"])
def test_round_trip_restores_every_field(kind: str) -> None:
    original = with_body(kind)
    in_backlog = receive(to_backlog(original, "orders"), enqueued=ENQUEUED)

    # the message is scheduled for later: its TTL has not started yet (Service Bus starts it at the
    # scheduled enqueue time), so all of it remains
    restored = from_backlog(in_backlog, now=ENQUEUED + dt.timedelta(seconds=90))

    assert restored.status is RestoreStatus.RESTORED and restored.ok
    assert restored.entity == "orders"
    message = restored.message
    assert message is not None
    assert message.session_id == "session-1"
    assert message.partition_key == "session-1"
    assert message.scheduled_enqueue_time_utc == SCHEDULED
    assert message.time_to_live == dt.timedelta(minutes=10)
    assert not [k for k in message.application_properties or {} if str(k).startswith("x-ms-")]
    assert seen_by_consumer(receive(message)) == seen_by_consumer(receive(original))


def test_ttl_counts_from_the_backlog_enqueued_time_given() -> None:
    in_backlog = receive(to_backlog(full_message(scheduled_enqueue_time_utc=None), "orders"), enqueued=ENQUEUED)
    restored = from_backlog(
        in_backlog,
        now=ENQUEUED + dt.timedelta(minutes=5),
        backlog_enqueued_time=ENQUEUED + dt.timedelta(minutes=4, milliseconds=500),
    )
    assert restored.message is not None
    assert restored.message.raw_amqp_message.header.time_to_live == 600_000 - 59_500


@pytest.mark.parametrize("spent", [dt.timedelta(minutes=10), dt.timedelta(hours=3)])
def test_a_message_expired_in_the_backlog_is_dead_lettered(spent: dt.timedelta) -> None:
    in_backlog = receive(to_backlog(full_message(scheduled_enqueue_time_utc=None), "orders"), enqueued=ENQUEUED)
    restored = from_backlog(in_backlog, now=ENQUEUED + spent)
    assert restored.status is RestoreStatus.EXPIRED
    assert restored.reason == TTL_EXPIRED_IN_BACKLOG
    assert restored.entity == "orders"
    assert restored.message is None
    assert "600000 ms" in (restored.description or "")


def test_a_message_without_optional_fields_round_trips_without_them() -> None:
    original = ServiceBusMessage(b"plain", message_id="m-2")
    backlog = to_backlog(original, "orders")
    assert set(text_properties(receive(backlog).application_properties)) == {X_MS_PATH}
    restored = from_backlog(receive(backlog), now=ENQUEUED + dt.timedelta(days=365))
    assert restored.message is not None
    assert seen_by_consumer(receive(restored.message)) == seen_by_consumer(receive(original))


def test_stale_backlog_properties_on_the_input_are_replaced() -> None:
    original = ServiceBusMessage(b"x", application_properties={"x-ms-sessionid": "stale", b"x-ms-path": "stale"})
    received = receive(to_backlog(original, "orders"))
    assert text_properties(received.application_properties) == {X_MS_PATH: "orders"}


def test_the_backlog_properties_and_broker_annotations_are_removed() -> None:
    original = full_message(application_properties={"keep": "yes"})
    restored = from_backlog(receive(to_backlog(original, "orders")), now=ENQUEUED)
    assert restored.message is not None
    assert restored.message.application_properties == {"keep": "yes"}
    annotation_keys = {bytes(k).decode() if isinstance(k, bytes) else k for k in restored.message.raw_amqp_message.annotations}
    assert annotation_keys == {"x-opt-partition-key", "x-opt-scheduled-enqueue-time"}


def test_a_received_message_can_be_forwarded_to_the_backlog() -> None:
    received = receive(full_message())  # bytes keys and values, broker annotations
    in_backlog = receive(to_backlog(received, "orders"))
    restored = from_backlog(in_backlog, now=ENQUEUED)
    assert restored.message is not None
    assert restored.message.message_id == "m-1"
    assert restored.message.session_id == "session-1"
    assert restored.message.application_properties["tenant"] == "eu"


def backlog_message(**properties: Any) -> ServiceBusReceivedMessage:
    return receive(ServiceBusMessage(b"payload", message_id="bad-1", application_properties=properties))


@pytest.mark.parametrize(
    ("properties", "reason"),
    [
        ({}, "x-ms-path missing or not a string"),
        ({X_MS_PATH: 5}, "x-ms-path missing or not a string"),
        ({X_MS_PATH: ""}, "x-ms-path missing or not a string"),
        ({X_MS_PATH: "orders", X_MS_TIME_TO_LIVE: "60000"}, "x-ms-timetolive is not an int64 number of milliseconds"),
        ({X_MS_PATH: "orders", X_MS_TIME_TO_LIVE: 1.5}, "x-ms-timetolive is not an int64 number of milliseconds"),
        ({X_MS_PATH: "orders", X_MS_TIME_TO_LIVE: -5}, "x-ms-timetolive is not a positive int64 number of milliseconds"),
        ({X_MS_PATH: "orders", X_MS_SESSION_ID: 42}, "x-ms-sessionid is not a string"),
        ({X_MS_PATH: "orders", X_MS_SESSION_ID: "s" * 129}, "x-ms-sessionid is longer than 128 characters"),
        ({X_MS_PATH: "orders", X_MS_PARTITION_KEY: True}, "x-ms-partitionkey is not a string"),
        ({X_MS_PATH: "orders", X_MS_SCHEDULED_ENQUEUE_TIME: "tomorrow"}, "x-ms-scheduledenqueuetimeutc is not a UTC timestamp"),
        ({X_MS_PATH: "orders", X_MS_SESSION_ID: "a", X_MS_PARTITION_KEY: "b"}, "x-ms-partitionkey differs from x-ms-sessionid"),
    ],
    ids=["path-missing", "path-int", "path-empty", "ttl-string", "ttl-float", "ttl-negative", "session-int",
         "session-long", "partition-bool", "schedule-string", "partition-vs-session"],
)
def test_each_bad_property_is_dead_lettered_with_a_reason_naming_it(properties: dict[str, Any], reason: str) -> None:
    restored = from_backlog(backlog_message(**properties), now=ENQUEUED)
    assert restored.status is RestoreStatus.INVALID
    assert restored.reason == reason
    assert restored.message is None
    assert restored.description


def test_a_ttl_beyond_the_amqp_header_range_is_restored_as_no_ttl() -> None:
    # .NET's TimeSpan.MaxValue in ms: the AMQP header ttl (uint) cannot carry it; the entity default applies
    in_backlog = backlog_message(**{X_MS_PATH: "orders", X_MS_TIME_TO_LIVE: amqp_long_value(922337203685477)})
    restored = from_backlog(in_backlog, now=ENQUEUED + dt.timedelta(days=1))
    assert restored.message is not None and restored.message.time_to_live is None
    receive(restored.message)  # and the SDK can send it


def test_restoring_a_message_built_in_process_accepts_its_own_types() -> None:
    restored = from_backlog(to_backlog(full_message(), "orders"), now=ENQUEUED, backlog_enqueued_time=ENQUEUED)
    assert restored.message is not None
    assert restored.message.time_to_live == dt.timedelta(minutes=10)
    assert restored.message.scheduled_enqueue_time_utc == SCHEDULED


def test_message_size_is_what_the_sdk_batch_counts() -> None:
    for message in (full_message(), full_message(b"x" * 1000), to_backlog(full_message(), "orders")):
        size = message_size(message)
        batch = ServiceBusMessageBatch(max_size_in_bytes=1024 * 1024)
        before = batch.size_in_bytes
        batch.add_message(message)
        assert batch.size_in_bytes - before == size + (5 if size < 256 else 8)
    original = full_message()
    assert message_size(to_backlog(original, "orders")) > message_size(original)


def test_pings_are_recognised_after_the_wire() -> None:
    ping = ping_message(session_id="any")
    assert ping.content_type == PING_CONTENT_TYPE
    assert ping.time_to_live == dt.timedelta(seconds=1)
    assert ping.session_id == "any" and ping.message_id
    assert is_ping(ping) and is_ping(receive(ping))
    assert not is_ping(full_message()) and not is_ping(receive(full_message()))


def test_to_backlog_needs_an_entity() -> None:
    with pytest.raises(ValueError, match="entity"):
        to_backlog(full_message(), "")


# --- issue 9: nothing lost, nothing wedged -------------------------------------------------------------------

def on_the_wire(message: ServiceBusMessage | AmqpAnnotatedMessage) -> Any:
    """The message as the SDK puts it on the wire, decoded by proton (which, unlike the SDK's decoder, keeps
    every AMQP type: str for a string, bytes for binary, ``timestamp``, ``int32``, ``symbol``...)."""
    import proton

    outgoing = transform_outbound_messages(message, ServiceBusMessage, PyamqpTransport.to_outgoing_amqp_message)
    decoded = proton.Message()
    decoded.decode(bytes(encode_payload(bytearray(), outgoing._message)))
    return decoded


def typed(value: Any) -> Any:
    """``value`` with the type of every part spelled out, so that equality compares AMQP types too."""
    if isinstance(value, dict):
        return {typed(k): typed(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [typed(v) for v in value]
    if isinstance(value, memoryview):  # proton's binary
        value = value.tobytes()
    return (type(value).__name__, value)


EVERY_PROPERTY_TYPE: dict[str, Any] = {
    "str": "text",
    "int": 7,
    "int-min": -(2**31),
    "long": amqp_long_value(2**40),  # the SDK encodes a plain int as an AMQP int: a long goes wrapped
    "small-long": amqp_long_value(5),
    "float": 0.25,
    "bool": True,
    "bytes": b"raw",  # the SDK sends bytes values as strings
    "uuid": uuid.UUID("12345678-1234-5678-1234-567812345678"),
    "datetime": dt.datetime(2030, 1, 2, 3, 4, 5, 678000, tzinfo=dt.UTC),
    "before-1970": dt.datetime(1969, 12, 31, 23, 59, 59, 999000, tzinfo=dt.UTC),
    "none": None,
}


def test_a_decimal_property_crosses_the_backlog_as_text_and_comes_back_a_decimal128() -> None:
    """The SDK's decoder cannot read the decimal128 its encoder writes: a backlog copy carrying one would fail
    every receive of the syphon's batch (the stream stuck). The copy carries the decimal's text; the restored
    message has the decimal128 the original had, byte for byte."""
    import decimal

    from azure.servicebus._pyamqp.types import TYPE, VALUE, AMQPTypes

    with pytest.raises(Exception, match="not a valid AMQP 1.0 message"):  # the SDK, by itself
        receive(ServiceBusMessage(b"x", application_properties={"price": decimal.Decimal("1.5")}))
    properties = {"price": decimal.Decimal("12345.678"), "tiny": {TYPE: AMQPTypes.decimal128, VALUE:
                  decimal.Decimal("-0.001")}, "big": decimal.Decimal("1E+10"), "label": "x"}
    for original in (ServiceBusMessage(b"x", message_id="d", application_properties=dict(properties)),
                     wire.encoded_message(b"x", "d", application_properties=dict(properties))):
        received = receive(to_backlog(original, "orders"))  # the syphon reads it
        assert received.application_properties[b"price"] == b"12345.678"
        restored = from_backlog(received, now=ENQUEUED)
        assert restored.ok and restored.message is not None
        assert typed(on_the_wire(restored.message).properties) == typed(on_the_wire(original).properties)


def test_every_property_type_keeps_its_type_and_value_through_the_backlog() -> None:
    original = ServiceBusMessage(b"x", message_id="types", application_properties=dict(EVERY_PROPERTY_TYPE))
    restored = from_backlog(receive(to_backlog(original, "orders")), now=ENQUEUED)
    assert restored.ok and restored.message is not None
    assert typed(on_the_wire(restored.message).properties) == typed(on_the_wire(original).properties)
    assert typed(receive(restored.message).application_properties) == typed(receive(original).application_properties)


VALUE_BODY = {"a": "text", "b": b"bin", "c": ["x", 1], "d": dt.datetime(2031, 1, 1, tzinfo=dt.UTC),
              "e": {"nested": [b"\x00\xff", "y", 2.5, None, True]}}
SEQUENCE_BODY = [["x", b"y", 3], [{"k": "v", "b": b"\x01"}]]


@pytest.mark.parametrize("kind", ["value", "sequence"])
def test_strings_stay_strings_and_binary_stays_binary_in_value_and_sequence_bodies(kind: str) -> None:
    body = AmqpAnnotatedMessage(value_body=VALUE_BODY) if kind == "value" else AmqpAnnotatedMessage(
        sequence_body=SEQUENCE_BODY)
    original = transform_outbound_messages(body, ServiceBusMessage, PyamqpTransport.to_outgoing_amqp_message)
    original.message_id = "bodies"
    restored = from_backlog(receive(to_backlog(original, "orders")), now=ENQUEUED)
    assert restored.ok and restored.message is not None
    assert typed(on_the_wire(restored.message).body) == typed(on_the_wire(original).body)
    assert seen_by_consumer(receive(restored.message)) == seen_by_consumer(receive(original))


def test_a_scheduled_message_ttl_starts_at_its_scheduled_time() -> None:
    in_backlog = receive(to_backlog(full_message(), "orders"), enqueued=ENQUEUED)  # TTL 10 min, SCHEDULED later
    before = from_backlog(in_backlog, now=SCHEDULED - dt.timedelta(hours=1))
    assert before.message is not None and before.message.time_to_live == dt.timedelta(minutes=10)
    after = from_backlog(in_backlog, now=SCHEDULED + dt.timedelta(seconds=90))
    assert after.message is not None and after.message.time_to_live == dt.timedelta(minutes=8, seconds=30)
    expired = from_backlog(in_backlog, now=SCHEDULED + dt.timedelta(minutes=10))
    assert expired.status is RestoreStatus.EXPIRED
    assert "600000 ms" in (expired.description or "") and "scheduled" in (expired.description or "")


def test_a_user_x_ms_property_survives_the_backlog_only_ours_are_consumed() -> None:
    mine = {"x-ms-foo": "1", "X-MS-Path": "not ours", "x-ms-sessionid-copy": "2", "keep": "yes"}
    restored = from_backlog(receive(to_backlog(full_message(application_properties=dict(mine)), "orders")),
                            now=ENQUEUED)
    assert restored.message is not None
    assert text_properties(restored.message.application_properties) == mine
    assert X_MS_REPARKED_FROM == "x-ms-reparked-from" and X_MS_REPARKED_FROM in BACKLOG_PROPERTIES
    reparked = backlog_message(**{X_MS_PATH: "orders", X_MS_REPARKED_FROM: "sy/x-servicebus-transfer/3", "k": "v"})
    restored = from_backlog(reparked, now=ENQUEUED)
    assert restored.message is not None and text_properties(restored.message.application_properties) == {"k": "v"}


@pytest.mark.parametrize(
    ("ttl", "ms"),
    [(dt.timedelta(seconds=1.5), 1500), (dt.timedelta(milliseconds=500), 500), (dt.timedelta(microseconds=1), 1),
     (dt.timedelta(milliseconds=1, microseconds=1), 2), (dt.timedelta(milliseconds=0xFFFFFFFF), 0xFFFFFFFF)],
)
def test_set_time_to_live_keeps_milliseconds_rounding_up(ttl: dt.timedelta, ms: int) -> None:
    message = ServiceBusMessage(b"x")
    set_time_to_live(message, ttl)
    assert message.raw_amqp_message.header.time_to_live == ms
    assert receive(message).time_to_live == dt.timedelta(milliseconds=ms)


@pytest.mark.parametrize("ttl", [dt.timedelta(0), dt.timedelta(seconds=-1), dt.timedelta(milliseconds=0x100000000)])
def test_set_time_to_live_refuses_what_the_header_cannot_carry(ttl: dt.timedelta) -> None:
    with pytest.raises(ValueError, match="time_to_live") as raised:
        set_time_to_live(ServiceBusMessage(b"x"), ttl)
    assert str(ttl) in str(raised.value)


def test_the_sink_keeps_a_ttl_under_one_second() -> None:
    from spark_sb.sink import _to_message

    assert _to_message({"body": b"x", "time_to_live": 0.5}, "m").raw_amqp_message.header.time_to_live == 500
    assert _to_message({"body": b"x", "time_to_live": dt.timedelta(seconds=1.5)}, "m").time_to_live == dt.timedelta(
        seconds=1.5)
    with pytest.raises(ValueError, match="time_to_live"):
        _to_message({"body": b"x", "time_to_live": 1e20}, "m")


def big_int_in_body() -> ServiceBusMessage:
    return transform_outbound_messages(AmqpAnnotatedMessage(value_body={"a": [1, 3_000_000_000]},
                                                            properties={"message_id": "m-bad"}),
                                       ServiceBusMessage, PyamqpTransport.to_outgoing_amqp_message)


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: ServiceBusMessage(b"x", message_id="m-bad", application_properties={"n": 3_000_000_000}),
         "application property 'n': int 3000000000 is out of range for the SDK's encoder"),
        (lambda: ServiceBusMessage(b"x", message_id="m-bad", application_properties={"b": b"\xff\xfe"}),
         "application property 'b': bytes b'\\xff\\xfe' are not UTF-8 text"),
        (lambda: ServiceBusMessage(b"x", message_id="m-bad", application_properties={"s": {1, 2}}),
         "application property 's': set {1, 2} is not a type the SDK can encode"),
        (lambda: ServiceBusMessage(b"x", message_id="m-bad", time_to_live=dt.timedelta(seconds=-1)),
         "time_to_live: -1 s is negative"),
        (lambda: ServiceBusMessage(b"x", message_id="m-bad", time_to_live=dt.timedelta(days=60)),
         "time_to_live: 5184000 s is beyond"),
        (lambda: ServiceBusMessage(b"x", message_id="m-bad", subject="a\ud800b"),
         "subject: str 'a\\ud800b' is not valid Unicode text"),
        (big_int_in_body, "value body ['a'][1]: int 3000000000 is out of range for the SDK's encoder"),
    ],
    ids=["int-range", "bytes-not-utf8", "set", "ttl-negative", "ttl-too-long", "surrogate", "body-int"],
)
def test_an_unencodable_message_is_a_bad_message_naming_the_field(make: Any, reason: str) -> None:
    with pytest.raises(BadMessageError) as raised:
        check_encodable(make(), "orders")
    assert raised.value.message_id == "m-bad" and raised.value.entity == "orders"
    assert reason in raised.value.reason
    with pytest.raises(BadMessageError) as raised:
        to_backlog(make(), "orders")
    assert reason in raised.value.reason


def test_an_encodable_message_passes_and_is_not_modified() -> None:
    message = full_message(application_properties={"b": b"bytes", **EVERY_PROPERTY_TYPE})
    before = repr(message)
    assert check_encodable(message, "orders") is None
    assert repr(message) == before and message.application_properties["b"] == b"bytes"


@pytest.mark.parametrize(
    "value_body",
    [{b"binary-key": [1, {"n": None}]}, [[1, [2, [b"\x00\xff", "x"]]]], uuid.UUID(int=5),
     {"when": dt.datetime(2030, 1, 1, tzinfo=dt.UTC), "id": uuid.UUID(int=7)}, {1: "int key", 2.5: b"v"},
     "text", 42],
    ids=["binary-keys", "nested-lists", "uuid", "timestamp-uuid", "number-keys", "str", "int"],
)
@pytest.mark.parametrize("with_path", [True, False], ids=["restored", "invalid"])
def test_the_backlog_source_turns_any_value_body_into_a_row(value_body: Any, with_path: bool) -> None:
    from spark_sb.source import SCHEMA, backlog_row

    original = transform_outbound_messages(AmqpAnnotatedMessage(value_body=value_body,
                                                                properties={"message_id": "v-1"}),
                                           ServiceBusMessage, PyamqpTransport.to_outgoing_amqp_message)
    received = receive(to_backlog(original, "orders")) if with_path else receive(original)
    row = backlog_row(received, "sy/x-servicebus-transfer/0", ENQUEUED)
    assert len(row) == len(SCHEMA.fields)
    fields = dict(zip(SCHEMA.fieldNames(), row, strict=True))
    assert fields["status"] == ("restored" if with_path else "invalid")
    assert fields["message_id"] == "v-1"
    assert isinstance(fields["body"], bytes) and fields["body"]


# --- end to end on the emulator, with the real SDK -----------------------------------------------------------

def _send(connection_string: str, queue: str, message: ServiceBusMessage) -> None:
    from azure.servicebus import ServiceBusClient

    with ServiceBusClient.from_connection_string(connection_string, retry_total=0) as client:
        with client.get_queue_sender(queue) as sender:
            sender.send_messages(message)


def _receive_one(connection_string: str, queue: str) -> ServiceBusReceivedMessage:
    from azure.servicebus import ServiceBusClient, ServiceBusReceiveMode

    with ServiceBusClient.from_connection_string(connection_string, retry_total=0) as client:
        with client.get_queue_receiver(queue, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as receiver:
            got = receiver.receive_messages(max_message_count=1, max_wait_time=5)
    assert len(got) == 1, f"nothing received from {queue}"
    return got[0]


def _stored(emulator: Any, namespace: str, queue: str) -> Any:
    """The one message stored in ``queue``, as its sender encoded it, decoded by proton (AMQP types kept)."""
    import proton

    server = emulator.server(namespace)
    stored = server.call(lambda: server.broker.peek(queue, 0, 10))
    assert len(stored) == 1
    decoded = proton.Message()
    decoded.decode(stored[0].raw)
    return decoded


def _e2e_message(kind: str) -> ServiceBusMessage:
    if kind == "properties":
        return ServiceBusMessage(b"x", message_id="e2e", application_properties=dict(EVERY_PROPERTY_TYPE))
    body = AmqpAnnotatedMessage(value_body=VALUE_BODY) if kind == "value" else AmqpAnnotatedMessage(
        sequence_body=SEQUENCE_BODY)
    message = transform_outbound_messages(body, ServiceBusMessage, PyamqpTransport.to_outgoing_amqp_message)
    message.message_id = "e2e"
    return message


@pytest.mark.parametrize("kind", ["properties", "value", "sequence"])
def test_primary_backlog_primary_on_the_emulator_keeps_every_type(emulator: Any, primary: Any, secondary: Any,
                                                                  make_queue: Any, kind: str) -> None:
    backlog, restored_queue, direct = make_queue("secondary"), make_queue(), make_queue()
    _send(secondary.connection_string, backlog, to_backlog(_e2e_message(kind), restored_queue))
    in_backlog = _receive_one(secondary.connection_string, backlog)  # what the syphon gets
    restored = from_backlog(in_backlog, now=in_backlog.enqueued_time_utc)
    assert restored.ok and restored.entity == restored_queue and restored.message is not None
    _send(primary.connection_string, restored_queue, restored.message)
    _send(primary.connection_string, direct, _e2e_message(kind))

    sent_back, sent_direct = _stored(emulator, "primary", restored_queue), _stored(emulator, "primary", direct)
    assert typed(sent_back.properties) == typed(sent_direct.properties)
    assert typed(sent_back.body) == typed(sent_direct.body)
    assert seen_by_consumer(_receive_one(primary.connection_string, restored_queue)) == seen_by_consumer(
        _receive_one(primary.connection_string, direct))


def test_a_500_ms_ttl_reaches_the_wire_and_expires(emulator_with_clock: Any, fake_clock: Any) -> None:
    queue = emulator_with_clock.make_queue()
    connection_string = emulator_with_clock["clocked"].connection_string
    short = ServiceBusMessage(b"short", message_id="short")
    set_time_to_live(short, dt.timedelta(milliseconds=500))
    long = ServiceBusMessage(b"long", message_id="long")
    set_time_to_live(long, dt.timedelta(minutes=1))
    _send(connection_string, queue, short)
    _send(connection_string, queue, long)
    server = emulator_with_clock.emu.server("clocked")
    stored = {m.message_id: m for m in server.call(lambda: server.broker.peek(queue, 0, 10))}
    assert stored["short"].expires_at - stored["short"].enqueued_time == pytest.approx(0.5)
    fake_clock.advance(1)
    received = _receive_one(connection_string, queue)
    assert received.message_id == "long" and received.time_to_live == dt.timedelta(minutes=1)


def test_a_peeked_backlog_message_restores_the_same_from_its_received_bytes(
        client: Any, make_queue: Any) -> None:
    """The syphon source's rows carry a peeked message as bytes (received_bytes); the republisher restores from
    them what it would have restored from the peeked message itself, sequence number included."""
    from spark_sb.messages import from_received_bytes, received_bytes

    queue = make_queue()
    original = full_message(application_properties=dict(EVERY_PROPERTY_TYPE))
    with client.get_queue_sender(queue) as sender:
        sender.send_messages(to_backlog(original, "orders"))
    with client.get_queue_receiver(queue) as receiver:
        (peeked,) = receiver.peek_messages(max_message_count=1)
    copy = from_received_bytes(received_bytes(peeked))
    assert copy.sequence_number == peeked.sequence_number and copy.enqueued_time_utc == peeked.enqueued_time_utc
    direct, via_bytes = from_backlog(peeked, now=ENQUEUED), from_backlog(copy, now=ENQUEUED)
    assert direct.ok and via_bytes.ok and direct.entity == via_bytes.entity == "orders"
    assert typed(on_the_wire(via_bytes.message).properties) == typed(on_the_wire(direct.message).properties)
    assert typed(on_the_wire(via_bytes.message).body) == typed(on_the_wire(direct.message).body)
    assert seen_by_consumer(receive(via_bytes.message)) == seen_by_consumer(receive(direct.message))


@pytest.mark.parametrize("value_body", [dt.datetime(1970, 1, 1, tzinfo=dt.UTC), dt.datetime(2031, 1, 1, tzinfo=dt.UTC),
                                        {"k": [dt.datetime(1970, 1, 1, tzinfo=dt.UTC), amqp_long_value(2**40)]}],
                         ids=["epoch", "timestamp", "nested"])
def test_a_value_body_survives_the_received_bytes(value_body: Any) -> None:
    """The SDK decodes a timestamp body as an int: 0 for the epoch, which its encoder would drop (found by the
    property test); the bytes the syphon source's rows carry keep it."""
    from spark_sb.messages import from_received_bytes, received_bytes

    original = transform_outbound_messages(AmqpAnnotatedMessage(value_body=value_body, properties={"message_id": "v"}),
                                           ServiceBusMessage, PyamqpTransport.to_outgoing_amqp_message)
    in_backlog = receive(to_backlog(original, "orders"))
    direct = from_backlog(in_backlog, now=ENQUEUED)
    via_bytes = from_backlog(from_received_bytes(received_bytes(in_backlog)), now=ENQUEUED)
    assert direct.message is not None and via_bytes.message is not None
    assert typed(on_the_wire(via_bytes.message).body) == typed(on_the_wire(direct.message).body)
    assert typed(on_the_wire(via_bytes.message).body) == typed(on_the_wire(original).body)
