"""The fast encoder (spark_sb.wire, issue 50) writes the SDK's bytes: over generated messages, what it builds is
byte for byte what the SDK's encoder writes for the same fields (a message, its backlog rewrite, a batch of them),
what it does not cover goes through the SDK (said once), and a message changed after it was built is the SDK's.
Through the emulator, a sink partition sent with ``sink.encoder: fast`` and with ``sdk`` arrives the same."""

from __future__ import annotations

import copy
import datetime as dt
import logging
import pickle
import types
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
from azure.servicebus import (
    ServiceBusClient,
    ServiceBusMessage,
    ServiceBusMessageBatch,
    ServiceBusReceiveMode,
)
from azure.servicebus._pyamqp._encode import encode_payload
from azure.servicebus._pyamqp.message import BatchMessage
from azure.servicebus._pyamqp.types import TYPE, VALUE, AMQPTypes
from azure.servicebus._pyamqp.utils import amqp_long_value
from azure.servicebus._transport._pyamqp_transport import PyamqpTransport
from azure.servicebus.amqp import AmqpMessageHeader
from azure.servicebus.exceptions import MessageSizeExceededError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pairing import pair_config
from test_messages import ENQUEUED, receive

from spark_sb import messages as msgs
from spark_sb import sink as sink_module
from spark_sb import wire
from spark_sb.config import load_config

text = st.text(max_size=40)  # lone surrogates included: the SDK's path then
short = st.text(max_size=130)  # past 128 characters the SDK refuses an id
typed_values = st.one_of(
    st.integers(-(2**63), 2**63 - 1).map(amqp_long_value),
    st.text(st.characters(codec="ascii"), max_size=20).map(lambda s: {TYPE: AMQPTypes.symbol, VALUE: s}),
    st.integers(-(2**62), 2**62).map(lambda ms: {TYPE: AMQPTypes.timestamp, VALUE: ms}),
    st.integers(0, 2**32 - 1).map(lambda n: {TYPE: AMQPTypes.uint, VALUE: n}),
    st.integers(0, 2**64 - 1).map(lambda n: {TYPE: AMQPTypes.ulong, VALUE: n}),
    st.integers(-(2**15), 2**15 - 1).map(lambda n: {TYPE: AMQPTypes.short, VALUE: n}),
    st.integers(0, 255).map(lambda n: {TYPE: AMQPTypes.ubyte, VALUE: n}),
    st.floats(width=32, allow_nan=False).map(lambda f: {TYPE: AMQPTypes.float, VALUE: f}),
    st.binary(max_size=20).map(lambda b: {TYPE: AMQPTypes.binary, VALUE: b}),
)
#: every kind of value a row's application property becomes (messages.property_value, sink._property_value)
property_values = st.one_of(
    text, st.integers(-(2**31), 2**31 - 1), st.integers(-(2**64), 2**64), st.floats(), st.booleans(), st.none(),
    typed_values, st.binary(max_size=10), st.uuids(), st.decimals(allow_nan=False, places=4),
    st.datetimes(timezones=st.just(dt.UTC)),
)


@st.composite
def fields(draw: st.DrawFn) -> dict[str, Any]:
    session = draw(st.none() | short)
    kwargs: dict[str, Any] = {
        "message_id": draw(short),
        "session_id": session,
        "partition_key": draw(st.none() | st.just(session) | short),
        "application_properties": draw(st.none() | st.dictionaries(text, property_values, max_size=6)),
        **{name: draw(st.none() | text) for name in ("subject", "content_type", "correlation_id", "to", "reply_to")},
    }
    kwargs = {name: value for name, value in kwargs.items() if value is not None}
    body = draw(st.binary(max_size=600) | st.text(max_size=300))
    return {"body": body, **kwargs}


def sdk_bytes(message: ServiceBusMessage) -> bytes:
    """What the SDK writes for ``message`` (``add_message``'s encoding)."""
    out = bytearray()
    encode_payload(out, PyamqpTransport.to_outgoing_amqp_message(message.raw_amqp_message))
    return bytes(out)


def sdk_outcome(kwargs: dict[str, Any], rewrite: str | None = None) -> bytes | None:
    """The SDK's bytes for the message of ``kwargs`` (rewritten for a backlog queue of ``rewrite``), or None when
    the SDK refuses it."""
    try:
        message = ServiceBusMessage(kwargs["body"], **{k: v for k, v in kwargs.items() if k != "body"})
        if rewrite is not None:
            message = msgs.to_backlog(message, rewrite, check=False)
        return sdk_bytes(message)
    except Exception:
        return None


def covered(kwargs: dict[str, Any]) -> bool:
    """Whether the fast path writes every value of ``kwargs`` (all but bytes that are not UTF-8 text)."""
    return not any(isinstance(value, bytes) and not _utf8(value)
                   for value in (kwargs.get("application_properties") or {}).values())


def _utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fields())
def test_a_messages_bytes_are_the_sdks(kwargs: dict[str, Any]) -> None:
    expected = sdk_outcome(kwargs)
    body, rest = kwargs["body"], {k: v for k, v in kwargs.items() if k != "body"}
    fast = wire.encoded_message(body, **rest)
    lazy = wire.encoded_message(body, **rest, lazy=True)
    if fast is None:  # not covered: the SDK builds it, whatever it makes of it
        assert lazy is None or lazy.encoded is None
        return
    assert expected is not None, "built a message the SDK refuses"
    assert fast.encoded == expected
    assert lazy is not None and lazy.encoded == expected
    assert covered(kwargs)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fields(), st.sampled_from(["orders", "Orders/Sub", "q" * 200]))
def test_a_backlog_rewrites_bytes_are_the_sdks(kwargs: dict[str, Any], entity: str) -> None:
    body, rest = kwargs["body"], {k: v for k, v in kwargs.items() if k != "body"}
    message = wire.encoded_message(body, **rest, lazy=True)
    if message is None:
        return
    rewritten = msgs.to_backlog(message, entity, check=False)
    expected = sdk_outcome(kwargs, rewrite=entity)
    if expected is None:  # the SDK cannot encode it: neither is it sent fast
        assert not wire.is_encoded(rewritten) or rewritten.encoded is None
        return
    assert (rewritten.encoded if wire.is_encoded(rewritten) else sdk_bytes(rewritten)) == expected
    assert wire.is_encoded(rewritten) == covered(kwargs)
    assert not wire.is_encoded(message) or message._encoded is wire._LATER  # the original never encoded


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fields(), st.sampled_from([None, False, True]), st.none() | st.integers(0, 255),
       st.none() | st.integers(1, 10**9))
def test_a_restored_messages_bytes_are_the_sdks(kwargs: dict[str, Any], durable: bool | None, priority: int | None,
                                                ttl_ms: int | None) -> None:
    """What the syphon sends home: the backlog message as received, restored fast and by the SDK, the same bytes
    (a header from the broker, a TTL: not covered, the SDK's then)."""
    try:
        message = ServiceBusMessage(kwargs["body"], **{k: v for k, v in kwargs.items() if k != "body"})
        if durable is not None or priority is not None:
            message.raw_amqp_message.header = AmqpMessageHeader(durable=durable, priority=priority)
        if ttl_ms is not None:
            msgs.set_time_to_live(message, dt.timedelta(milliseconds=ttl_ms))
        received = receive(msgs.to_backlog(message, "orders"))
    except Exception:  # the SDK cannot send it: nothing to restore
        return
    now = ENQUEUED + dt.timedelta(milliseconds=1)
    fast, slow = msgs.from_backlog(received, now), msgs.from_backlog(received, now, fast=False)
    assert (fast.status, fast.entity, fast.reason) == (slow.status, slow.entity, slow.reason)
    if slow.message is None:
        return
    try:
        expected = sdk_bytes(slow.message)
    except UnicodeDecodeError:  # a binary property comes back as bytes, which the SDK sends as UTF-8 text
        assert not wire.is_encoded(fast.message)
        return
    assert (fast.message.encoded if wire.is_encoded(fast.message) else sdk_bytes(fast.message)) == expected
    binary = any(isinstance(v, dict) and v.get(TYPE) == AMQPTypes.binary
                 for v in (kwargs.get("application_properties") or {}).values())
    if ttl_ms is None and covered(kwargs) and not binary:  # restored as bytes: the SDK's
        assert wire.is_encoded(fast.message)


def _batch_bytes(batch: ServiceBusMessageBatch) -> bytes:
    out = bytearray()
    encode_payload(out, BatchMessage(*batch._message))
    return bytes(out)


def test_a_batch_of_encoded_messages_is_the_sdks_batch_and_fills_at_the_same_message() -> None:
    bodies = [b"x" * n for n in (10, 250, 300, 1000)] * 20
    kwargs = [{"message_id": f"m-{i}", "session_id": "s", "partition_key": "s", "subject": "order",
               "application_properties": {"n": i, "price": i / 3, "region": "eu"}} for i in range(len(bodies))]
    ours, theirs = ServiceBusMessageBatch(max_size_in_bytes=20_000), ServiceBusMessageBatch(max_size_in_bytes=20_000)
    added = 0
    for body, kw in zip(bodies, kwargs, strict=True):
        message = wire.encoded_message(body, **kw)
        assert message is not None
        try:
            theirs.add_message(ServiceBusMessage(body, **kw))
        except MessageSizeExceededError:
            with pytest.raises(MessageSizeExceededError):
                wire.append(ours, message)
            break
        assert wire.append(ours, message)
        added += 1
    assert 0 < added < len(bodies)
    assert (len(ours), ours.size_in_bytes) == (len(theirs), theirs.size_in_bytes)
    assert _batch_bytes(ours) == _batch_bytes(theirs)  # the envelope's ids too


def test_a_message_changed_after_it_was_built_is_the_sdks() -> None:
    message = wire.encoded_message(b"hello", "id-1", subject="before", application_properties={"a": 1})
    assert message is not None and wire.is_encoded(message)
    assert (message.message_id, message.session_id) == ("id-1", None)
    assert wire.is_encoded(message)  # its ids are read without building the SDK's message
    message.subject = "after"
    message.application_properties[b"b"] = "two"  # the SDK's message: its keys as bytes
    assert not wire.is_encoded(message)
    batch = ServiceBusMessageBatch()
    assert not wire.append(batch, message)
    batch.add_message(message)
    decoded = ServiceBusMessage(b"hello", message_id="id-1", subject="after", application_properties={"a": 1})
    decoded.application_properties[b"b"] = "two"
    assert sdk_bytes(message) == sdk_bytes(decoded)


def test_a_pickled_or_copied_message_keeps_its_bytes_or_its_changes() -> None:
    message = wire.encoded_message(b"hello", "id-1", subject="s", application_properties={"a": 1}, lazy=True)
    assert message is not None
    for again in (pickle.loads(pickle.dumps(message)), copy.copy(message), copy.deepcopy(message)):
        assert wire.is_encoded(again) and again.encoded == message.encoded == sdk_bytes(
            ServiceBusMessage(b"hello", message_id="id-1", subject="s", application_properties={"a": 1}))
    message.subject = "changed"
    for again in (pickle.loads(pickle.dumps(message)), copy.copy(message)):
        assert not wire.is_encoded(again) and again.subject == "changed" and sdk_bytes(again) == sdk_bytes(message)


def test_what_it_does_not_cover_goes_through_the_sdk_and_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="spark_sb.wire")
    wire._NOTED.discard("a bytes property that is not UTF-8")
    first = wire.encoded_message(b"x", "a", application_properties={"u": b"\xff"}, lazy=True)
    second = wire.encoded_message(b"x", "b", application_properties={"u": b"\xfe"}, lazy=True)
    assert first is not None and second is not None
    batch = ServiceBusMessageBatch()
    for message in (first, second):
        assert not wire.append(batch, message)
        with pytest.raises(UnicodeDecodeError):  # what the SDK makes of it: the sink reports the row
            batch.add_message(message)
    assert not wire.is_encoded(first) and not wire.is_encoded(second)
    said = [r.getMessage() for r in caplog.records if "UTF-8" in r.getMessage()]
    assert said == ["messages with a bytes property that is not UTF-8 are encoded by the SDK "
                    "(spark_sb.wire covers the others)"]


def test_a_batch_without_the_internals_it_writes_takes_add_message(caplog: pytest.LogCaptureFixture,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "_checked", {})
    caplog.set_level(logging.WARNING, logger="spark_sb.wire")
    later_sdk = types.SimpleNamespace(max_size_in_bytes=1024, _message=[None] * 9)  # no _size, _count, _messages
    message = wire.encoded_message(b"x", "a")
    assert message is not None
    assert wire.missing_internals(later_sdk) == ["ServiceBusMessageBatch._size", "ServiceBusMessageBatch._count",
                                                 "ServiceBusMessageBatch._messages"]
    assert not wire.append(later_sdk, message) and not wire.append(later_sdk, message)
    assert [r.getMessage() for r in caplog.records] == [
        "this azure-servicebus lacks ServiceBusMessageBatch._size, ServiceBusMessageBatch._count, "
        "ServiceBusMessageBatch._messages: messages are encoded by the SDK (add_message)"]


# --- through the emulator -----------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _fresh_senders() -> Iterator[None]:
    yield
    sink_module.close_senders()


def _rows(tag: str) -> list[pa.RecordBatch]:
    n = 40
    return [pa.RecordBatch.from_pydict({
        "body": [f"{tag}-{i}".encode() * (i + 1) for i in range(n)],
        "message_id": [f"m-{i}" for i in range(n)],
        "subject": [None if i % 3 else f"subject-{i}" for i in range(n)],
        "content_type": ["application/json"] * n,
        "correlation_id": [f"c-{i}" for i in range(n)],
        "partition_key": [f"pk-{i % 4}" for i in range(n)],
        "application_properties": pa.array(
            [[("s", f"v{i}"), ("n", str(i * 1_000_000_000)), ("d", str(i / 7)), ("b", "true"), ("t", str(i)),
              ("y", "sym")] for i in range(n)], type=pa.map_(pa.string(), pa.string())),
        "application_property_types": pa.array(
            [[("s", "string"), ("n", "long"), ("d", "double"), ("b", "boolean"), ("t", "timestamp"),
              ("y", "symbol")]] * n, type=pa.map_(pa.string(), pa.string())),
    })]


def _received(connection_string: str, queue: str, n: int) -> dict[str, Any]:
    """{message id: what a receiver sees of it, each property's AMQP type included}."""
    seen: dict[str, Any] = {}
    with ServiceBusClient.from_connection_string(connection_string) as client, \
            client.get_queue_receiver(queue, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as receiver, \
            msgs.keeping_property_types(receiver):
        while len(seen) < n:
            page = receiver.receive_messages(max_message_count=n, max_wait_time=5)
            assert page, f"received {len(seen)} of {n}"
            for m in page:
                seen[str(m.message_id)] = {
                    "body": b"".join(m.body), "subject": m.subject, "content_type": m.content_type,
                    "correlation_id": m.correlation_id, "partition_key": m.partition_key,
                    "properties": m.application_properties, "types": msgs.property_types(m)}
    return seen


@pytest.mark.parametrize("failed_over", [False, True], ids=["primary", "backlog"])
def test_a_partition_sent_fast_arrives_as_one_sent_through_the_sdk(emulator, primary, secondary, make_queue,
                                                                   failed_over: bool) -> None:
    queue = make_queue()
    raw = pair_config(primary, secondary, "wire", backlog_queue_count=1, failover_interval="0s",
                      ping_primary_interval="30m")
    arrived = {}
    for encoder in ("fast", "sdk"):
        config = load_config({**raw, "sink": {"entity": queue, "encoder": encoder}})
        sender = sink_module.sender_for(config)
        sender.pair()
        if failed_over:
            sender.board.assume_failed_over(queue)
            emulator.fault("primary", "down")
        try:
            run = sink_module.PartitionRun(config, config.fingerprint(), 1, 0, (), reject=False)
            out = list(run.run(iter(_rows("r"))))
        finally:
            if failed_over:
                emulator.heal("primary")
        assert out[-1].to_pydict()["sent"] == [40]
        [where] = sender.backlog_queues if failed_over else [queue]
        arrived[encoder] = _received((secondary if failed_over else primary).connection_string, where, 40)
        sink_module.close_senders()
    assert arrived["fast"] == arrived["sdk"]
    seen = arrived["fast"]["m-3"]
    assert seen["properties"][b"n"] == 3_000_000_000 and seen["types"]["n"] == "long"
    if failed_over:  # what the receiver cannot tell, the rewrite recorded: sent as a timestamp and a symbol
        assert seen["properties"][b"x-ms-propertytypes"] == b'{"t":"t","y":"y"}'
    else:
        assert seen["partition_key"] == "pk-3"
