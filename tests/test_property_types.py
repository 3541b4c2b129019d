"""Application properties as rows hold them (text, and each one's AMQP type) and back (issue 33, item 4), without a
JVM: the types read off the wire while a receiver peeks, every type's text sent back as that type, a text that
does not fit its type refused naming the property, and the sink's column checks for the new columns."""

from __future__ import annotations

import datetime as dt
import decimal
import re
import uuid
from typing import Any

import pytest
from azure.servicebus import ServiceBusMessage
from azure.servicebus._pyamqp._encode import encode_payload
from azure.servicebus._pyamqp.types import TYPE, VALUE, AMQPTypes
from azure.servicebus._pyamqp.utils import amqp_long_value
from azure.servicebus._transport._pyamqp_transport import PyamqpTransport
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql import types as T

from spark_sb.config import SinkConfig
from spark_sb.messages import (
    keeping_property_types,
    property_reader,
    property_types,
    property_types_on_wire,
    property_value,
)
from spark_sb.sink import _to_message, check_columns

AT = dt.datetime(2024, 5, 1, 12, 30, 15, 123000, tzinfo=dt.UTC)
ID = uuid.UUID("12345678-1234-5678-1234-567812345678")
#: a value of every type a row can give back, and its AMQP type
EVERY_TYPE: dict[str, tuple[Any, str]] = {
    "s": ("text", "string"), "y": ({TYPE: AMQPTypes.symbol, VALUE: b"sym"}, "symbol"),
    "b": ({TYPE: AMQPTypes.binary, VALUE: b"\xff\x00"}, "binary"), "o": (True, "boolean"),
    "c": ({TYPE: AMQPTypes.byte, VALUE: -5}, "byte"), "h": ({TYPE: AMQPTypes.short, VALUE: -300}, "short"),
    "i": (5, "int"), "l": (amqp_long_value(7), "long"), "C": ({TYPE: AMQPTypes.ubyte, VALUE: 200}, "ubyte"),
    "H": ({TYPE: AMQPTypes.ushort, VALUE: 60000}, "ushort"),
    "I": ({TYPE: AMQPTypes.uint, VALUE: 4_000_000_000}, "uint"),
    "L": ({TYPE: AMQPTypes.ulong, VALUE: 2**64 - 1}, "ulong"), "f": ({TYPE: AMQPTypes.float, VALUE: 0.5}, "float"),
    "d": (0.25, "double"), "m": (decimal.Decimal("12.5"), "decimal128"), "t": (AT, "timestamp"), "u": (ID, "uuid"),
}
#: the text of each as a row holds it (what the servicebus source writes: a timestamp in milliseconds, a binary in
#: base64)
TEXTS = {"s": "text", "y": "sym", "b": "/wA=", "o": "True", "c": "-5", "h": "-300", "i": "5", "l": "7", "C": "200",
         "H": "60000", "I": "4000000000", "L": str(2**64 - 1), "f": "0.5", "d": "0.25", "m": "12.5",
         "t": str(int(AT.timestamp() * 1000)), "u": str(ID)}


def _wire(message: ServiceBusMessage) -> bytes:
    out = bytearray()
    raw = message.raw_amqp_message
    raw.application_properties = dict(raw.application_properties or {})
    encode_payload(out, PyamqpTransport.to_outgoing_amqp_message(raw))
    return bytes(out)


def test_the_types_read_off_the_wire_are_every_property_as_sent_nulls_left_out() -> None:
    properties = {name: value for name, (value, _) in EVERY_TYPE.items()}
    message = ServiceBusMessage(b"x" * 300, application_properties={**properties, "n": None,
                                                                      "described": ({TYPE: AMQPTypes.symbol,
                                                                                     VALUE: b"x:t"}, [1, 2])})
    assert property_types_on_wire(_wire(message)) == {
        **{name: kind for name, (_, kind) in EVERY_TYPE.items()}, "described": "described"}
    assert property_types_on_wire(_wire(ServiceBusMessage(b"no properties"))) == {}
    with pytest.raises(ValueError):
        property_types_on_wire(b"\x01not a message")


def test_a_described_value_keeps_its_descriptor_when_its_value_is_of_a_type_that_can_be_sent() -> None:
    """.NET's DateTimeOffset is a long described by ``com.microsoft:datetime-offset``."""
    offset = {TYPE: AMQPTypes.described, VALUE: ({TYPE: AMQPTypes.symbol, VALUE: b"com.microsoft:datetime-offset"},
                                                 amqp_long_value(638_500_000_000_000_000))}
    numbered = {TYPE: AMQPTypes.described, VALUE: ({TYPE: AMQPTypes.ulong, VALUE: 0x1370000001}, "x")}
    types = property_types_on_wire(_wire(ServiceBusMessage(b"x", application_properties={
        "offset": offset, "numbered": numbered})))
    assert types == {"offset": "described:com.microsoft:datetime-offset:long",
                     "numbered": "described:0x1370000001:string"}
    back = _to_message({"body": b"x", "application_properties": {"offset": "638500000000000000", "numbered": "x"},
                        "application_property_types": types}, "m")
    assert property_types_on_wire(_wire(back)) == types
    assert back.application_properties["offset"][VALUE][1] == {TYPE: AMQPTypes.long, VALUE: 638_500_000_000_000_000}
    with pytest.raises(ValueError, match="application property 'offset': 'soon' is not a long"):
        property_value("offset", "soon", types["offset"])


def test_every_type_s_text_is_sent_back_as_that_type() -> None:
    types = {name: kind for name, (_, kind) in EVERY_TYPE.items()}
    row = {"body": b"x", "application_properties": list(TEXTS.items()),
           "application_property_types": list(types.items())}
    message = _to_message(row, "m")
    assert property_types_on_wire(_wire(message)) == types
    sent = message.application_properties
    assert sent["t"] == {TYPE: AMQPTypes.timestamp, VALUE: int(AT.timestamp() * 1000)}
    assert sent["b"][VALUE] == b"\xff\x00"
    assert sent["i"] == 5 and sent["o"] is True and sent["u"] == ID and sent["s"] == "text"
    # an ISO 8601 time is a timestamp too (UTC without an offset); a property without a type is a string
    again = _to_message({"body": b"x", "application_properties": {"t": "2024-05-01T12:30:15.123", "new": "7"},
                         "application_property_types": {"t": "timestamp"}}, "m")
    assert again.application_properties == {"t": {TYPE: AMQPTypes.timestamp, VALUE: int(AT.timestamp() * 1000)},
                                            "new": "7"}


@pytest.mark.parametrize(("text", "kind", "says"), [
    ("five", "int", "'five' is not an int"), ("3000000000", "int", "3000000000 is out of range for an int"),
    ("-1", "uint", "-1 is out of range for a uint"), ("1.5", "long", "'1.5' is not a long"),
    ("yes", "boolean", "'yes' is not a boolean"), ("soon", "timestamp", "'soon' is not a timestamp"),
    ("x", "double", "'x' is not a double"), ("1e39", "float", "out of range for a float"),
    ("**", "binary", "'\\*\\*' is not base64"), ("nope", "uuid", "'nope' is not a uuid"),
    ("x", "decimal128", "'x' is not a decimal128"),
    ("[1]", "list", "has type 'list' in application_property_types, which cannot be sent from text"),
    ("x", "Money", "has type 'Money' in application_property_types, which cannot be sent"),
])
def test_a_text_that_does_not_fit_its_type_is_refused_naming_the_property(text: str, kind: str, says: str) -> None:
    with pytest.raises(ValueError, match=f"application property 'p'.*{says}"):
        property_value("p", text, kind)
    with pytest.raises(ValueError, match=f"application property 'p'.*{says}"):
        _to_message({"body": b"x", "application_properties": {"p": text}, "application_property_types": {"p": kind}},
                    "m")


def test_a_ttl_in_milliseconds_is_kept_to_the_millisecond_and_checked() -> None:
    assert _to_message({"body": b"x", "time_to_live_ms": 90_501}, "m").raw_amqp_message.header.time_to_live == 90_501
    for bad in (0, -5, 2**32):
        with pytest.raises(ValueError, match=f"time_to_live_ms: {bad} ms is not between 1 and"):
            _to_message({"body": b"x", "time_to_live_ms": bad}, "m")
    with pytest.raises(ValueError, match="time_to_live .* and time_to_live_ms .* both give the TTL"):
        _to_message({"body": b"x", "time_to_live": 1.0, "time_to_live_ms": 1000}, "m")


def _schema(**columns: T.DataType) -> T.StructType:
    return T.StructType([T.StructField("body", T.BinaryType()), *(T.StructField(n, t) for n, t in columns.items())])


def _refuse(option: str | None, column: str | None, problem: str) -> Exception:
    return ValueError(f"{column}: {problem}")


def test_the_sink_takes_the_read_s_ttl_and_types_columns_and_refuses_what_contradicts() -> None:
    text_map = T.MapType(T.StringType(), T.StringType())
    sink = SinkConfig(entity="q")
    present = check_columns(sink, _schema(time_to_live_ms=T.LongType(), application_properties=text_map,
                                          application_property_types=text_map, dead_letter_reason=T.StringType()),
                            _refuse)
    assert present == {"body": "body", "time_to_live_ms": "time_to_live_ms", "application_properties":
                       "application_properties", "application_property_types": "application_property_types"}
    with pytest.raises(ValueError, match="time_to_live_ms: and column 'time_to_live' both give the message's TTL"):
        check_columns(sink, _schema(time_to_live=T.DoubleType(), time_to_live_ms=T.LongType()), _refuse)
    with pytest.raises(ValueError, match="application_properties: has type map<string,bigint>: with column "
                                         "'application_property_types'"):
        check_columns(sink, _schema(application_properties=T.MapType(T.StringType(), T.LongType()),
                                    application_property_types=text_map), _refuse)
    with pytest.raises(ValueError, match="time_to_live_ms: has type string, message field time_to_live_ms needs"):
        check_columns(sink, _schema(time_to_live_ms=T.StringType()), _refuse)
    # a configuration that maps time_to_live to that column keeps its meaning
    mapped = SinkConfig(entity="q", columns={"time_to_live": "time_to_live_ms"})
    assert check_columns(mapped, _schema(time_to_live_ms=T.LongType()), _refuse) == {
        "body": "body", "time_to_live": "time_to_live_ms"}


def test_a_peek_keeping_property_types_reads_them_as_sent_where_a_plain_peek_guesses(client, make_queue) -> None:
    queue = make_queue()
    properties = {"i": 5, "l": amqp_long_value(7), "t": AT, "b": {TYPE: AMQPTypes.binary, VALUE: b"\xff"}, "n": None}
    with client.get_queue_sender(queue) as sender:
        sender.send_messages(ServiceBusMessage(b"x", application_properties=properties))
    with client.get_queue_receiver(queue) as receiver:
        plain = receiver.peek_messages(1, sequence_number=1)[0]
        transport = receiver._amqp_transport
        with keeping_property_types(receiver):
            kept = receiver.peek_messages(1, sequence_number=1)[0]
        assert receiver._amqp_transport is transport
        again = receiver.peek_messages(1, sequence_number=1)[0]
    assert property_types(kept) == {"i": "int", "l": "long", "t": "timestamp", "b": "binary"}
    # what the SDK's decoded values tell: a long that fits and a timestamp read as ints, a binary as a string
    assert property_types(plain) == property_types(again) == {"i": "int", "l": "int", "t": "long", "b": "string"}


_TEXTS = st.one_of(
    st.none(), st.text(max_size=24), st.integers().map(str), st.integers(-(2**70), 2**70).map(lambda n: f" {n}"),
    st.floats(allow_nan=True).map(repr), st.sampled_from(["", "-", "-0", "+5", "1_000", "٣", "1e5", "nan", "inf"]))


@settings(max_examples=600, deadline=None)
@given(_TEXTS, st.sampled_from(["string", "long", "int", "double", " Long", "float", "short", "boolean"]))
def test_a_property_reader_gives_what_property_value_gives(text: str | None, kind: str) -> None:
    """The sink reads a row's property texts with a reader per type (quicker for the common ones): same value of
    the same AMQP type, or the same error."""
    try:
        expected: Any = property_value("p", text, kind)
    except (ValueError, TypeError, AttributeError) as err:
        with pytest.raises(type(err), match=re.escape(str(err))):
            property_reader(kind)("p", text)
        return
    got = property_reader(kind)("p", text)
    assert type(got) is type(expected)
    assert repr(got) == repr(expected)  # NaN too
