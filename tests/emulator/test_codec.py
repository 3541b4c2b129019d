"""Message bytes as the SDK encodes them: batches unpacked, deliveries rendered, bad bytes refused."""

from __future__ import annotations

import uuid

import pytest
from azure.servicebus import ServiceBusMessage, ServiceBusMessageBatch
from azure.servicebus._pyamqp._decode import decode_payload
from azure.servicebus._pyamqp._encode import encode_payload
from azure.servicebus._pyamqp.message import BatchMessage
from azure.servicebus._transport._pyamqp_transport import PyamqpTransport

from spark_sb.emulator import codec
from spark_sb.emulator.broker import Stored


def _encoded(message: ServiceBusMessage) -> bytes:
    outgoing = PyamqpTransport.to_outgoing_amqp_message(message.raw_amqp_message)
    return bytes(encode_payload(bytearray(), outgoing))


def _encoded_batch(messages: list[ServiceBusMessage]) -> bytes:
    batch = ServiceBusMessageBatch(max_size_in_bytes=1024 * 1024)
    for m in messages:
        batch.add_message(m)
    return bytes(encode_payload(bytearray(), BatchMessage(*batch._message)))


def test_a_batch_envelope_unpacks_into_its_messages_with_their_own_fields() -> None:
    raw = _encoded_batch([ServiceBusMessage(f"m{i}", message_id=f"id-{i}", session_id="s") for i in range(3)])
    incoming = list(codec.iter_incoming(raw))
    assert [(m.message_id, m.session_id) for m in incoming] == [("id-0", "s"), ("id-1", "s"), ("id-2", "s")]


def test_a_single_message_with_binary_body_stays_one_message() -> None:
    raw = _encoded(ServiceBusMessage(b"\x00\x53\x75 looks like a section", message_id="one"))
    (m,) = list(codec.iter_incoming(raw))
    assert m.message_id == "one"


def test_rendered_delivery_keeps_the_clients_bytes_and_adds_broker_annotations() -> None:
    raw = _encoded(ServiceBusMessage(b"body", message_id="x", application_properties={"k": "v"}))
    token = uuid.uuid4()
    stored = Stored(entity="q/$DeadLetterQueue", sequence_number=42, raw=raw, message_id="x", session_id=None,
                    enqueued_time=1_700_000_000.0, expires_at=None, scheduled_enqueue_time=None,
                    delivery_count=3, dead_letter_reason="Bad", dead_letter_description="why")
    out = decode_payload(memoryview(codec.render(stored, lock_token=token, locked_until=1_700_000_060.0)))
    assert out.message_annotations[b"x-opt-sequence-number"] == 42
    assert out.message_annotations[b"x-opt-locked-until"] == 1_700_000_060_000
    assert out.header.delivery_count == 2  # earlier deliveries, as the service reports
    assert out.application_properties[b"k"] == b"v"
    assert out.application_properties[b"DeadLetterReason"] == b"Bad"
    assert out.data == [b"body"] or list(out.data) == [b"body"]


@pytest.mark.parametrize("junk", [b"", b"\x01\x02", b"\x00\x53\x75\xb0\xff\xff\xff\xff", b"\x00\x99"])
def test_malformed_bytes_are_refused_with_a_clear_error(junk: bytes) -> None:
    with pytest.raises(codec.MalformedMessage):
        list(codec.iter_incoming(junk))


@pytest.mark.parametrize("value_body", [None, "text", 42, [1, "a"], {b"binary-key": [1, {"n": None}]}])
def test_every_message_of_a_batch_with_value_bodies_is_unpacked(value_body) -> None:
    from azure.servicebus.amqp import AmqpAnnotatedMessage

    batch = ServiceBusMessageBatch(max_size_in_bytes=1024 * 1024)
    batch.add_message(ServiceBusMessage("a", message_id="1"))
    batch.add_message(AmqpAnnotatedMessage(value_body=value_body, properties={"message_id": "2"}))
    batch.add_message(ServiceBusMessage("c", message_id="3"))
    raw = bytes(encode_payload(bytearray(), BatchMessage(*batch._message)))
    assert [m.message_id for m in codec.iter_incoming(raw)] == ["1", "2", "3"]


def test_an_envelope_only_partly_made_of_messages_is_refused_not_guessed() -> None:
    good = _encoded(ServiceBusMessage("ok", message_id="1"))
    envelope = _encoded_batch([ServiceBusMessage("x", message_id="0")])
    # append a data section that is not an encoded message
    junk = b"\x00\x53\x75\xa0\x03abc"
    with pytest.raises(codec.MalformedMessage):
        codec.unpack(envelope + junk)
    assert [m.message_id for m in codec.iter_incoming(good)] == ["1"]
