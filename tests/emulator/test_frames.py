"""Clients that number deliveries out of sequence (issue 13, gap 3): the SDK's ``AutoLockRenewer`` over many
messages, the renumbering of incoming frames underneath, and the info field of a close the engine sends."""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

import pytest
from azure.servicebus import AutoLockRenewer, ServiceBusClient, ServiceBusMessage
from hypothesis import given
from hypothesis import strategies as st
from proton import Data

from spark_sb.emulator.frames import DeliveryIdRenumbering


def _encode(value: Any, kind: str) -> bytes:
    d = Data()
    getattr(d, f"put_{kind}")(value)
    return d.encode()


def _transfer(channel: int, handle: int, delivery_id: int | None, *, more: bool = False,
              payload: bytes = b"\x00Sw\xa1\x02hi", list8: bool = True) -> bytes:
    """A transfer frame as pyamqp writes it (list8, ``list8=False``: list32 as Proton writes it)."""
    items = [_encode(handle, "uint"), b"\x40" if delivery_id is None else _encode(delivery_id, "uint"),
             _encode(b"tag", "binary"), _encode(0, "uint"), _encode(False, "bool"), _encode(more, "bool")]
    body = b"".join(items)
    if list8:
        performative = b"\x00\x53\x14\xc0" + bytes([len(body) + 1, len(items)]) + body
    else:
        performative = b"\x00\x53\x14\xd0" + struct.pack(">II", len(body) + 4, len(items)) + body
    frame = performative + payload
    return struct.pack(">IBBH", len(frame) + 8, 2, 0, channel) + frame


def _begin(channel: int) -> bytes:
    d = Data()
    d.put_described()
    d.enter()
    d.put_ulong(0x11)
    d.put_list()
    d.enter()
    d.put_null()
    d.put_uint(0)
    d.put_uint(100)
    d.put_uint(100)
    d.exit()
    d.exit()
    body = d.encode()
    return struct.pack(">IBBH", len(body) + 8, 2, 0, channel) + body


def _frames(data: bytes) -> list[tuple[int, Any]]:
    """(channel, performative) of each frame in ``data``; a performative is a proton ``Described``."""
    out, pos = [], 0
    while pos < len(data):
        if data[pos:pos + 4] == b"AMQP":
            pos += 8
            continue
        size, doff, _, channel = struct.unpack_from(">IBBH", data, pos)
        d = Data()
        d.decode(data[pos + doff * 4:pos + size])
        performative = d.get_object()
        if isinstance(performative.value, list):  # binaries decode as views into ``d``: copy them out
            performative.value[:] = [bytes(v) if isinstance(v, memoryview) else v for v in performative.value]
        out.append((channel, performative))
        pos += size
    return out


def _ids(data: bytes) -> list[int | None]:
    return [p.value[1] for _, p in _frames(data) if int(p.descriptor) == 0x14]


def test_deliveries_numbered_twice_or_out_of_order_get_the_ids_the_session_expects() -> None:
    stream = b"".join([_transfer(1, 0, 4), _transfer(1, 2, 6), _transfer(1, 2, 4), _transfer(1, 2, 5),
                       _transfer(1, 2, 7), _transfer(1, 2, 7, list8=False), _transfer(1, 2, 9)])
    renumbering = DeliveryIdRenumbering()
    out = renumbering.feed(stream)
    assert _ids(out) == [4, 5, 6, 7, 8, 9, 10]
    assert renumbering.renumbered == 6
    # what a frame carried besides its id is as it came
    assert [(p.value[0], bytes(p.value[2]), p.value[3:]) for _, p in _frames(out)] == [
        (h, b"tag", [0, False, False]) for h in (0, 2, 2, 2, 2, 2, 2)]
    assert out.endswith(b"\x00Sw\xa1\x02hi")


def test_well_numbered_traffic_passes_byte_for_byte() -> None:
    stream = (b"AMQP\x03\x01\x00\x00" + b"AMQP\x00\x01\x00\x00" + _begin(0) + _transfer(0, 0, 0)
              + _transfer(0, 1, 1, more=True) + _transfer(0, 1, None) + _transfer(0, 0, 2)
              + struct.pack(">IBBH", 8, 2, 0, 0))  # an empty frame (heartbeat)
    renumbering = DeliveryIdRenumbering()
    assert renumbering.feed(stream) == stream
    assert renumbering.renumbered == 0


def test_each_session_counts_its_own_deliveries_and_a_new_begin_starts_again() -> None:
    stream = (_transfer(0, 0, 10) + _transfer(3, 0, 0) + _transfer(0, 0, 10) + _transfer(3, 0, 1)
              + _begin(3) + _transfer(3, 0, 50) + _transfer(3, 0, 50))
    assert _ids(DeliveryIdRenumbering().feed(stream)) == [10, 0, 11, 1, 50, 51]


def test_the_frames_of_one_multi_frame_delivery_keep_its_number() -> None:
    stream = (_transfer(0, 0, 3) + _transfer(0, 1, 3, more=True) + _transfer(0, 1, 3, more=True)
              + _transfer(0, 1, None) + _transfer(0, 0, 5))
    assert _ids(DeliveryIdRenumbering().feed(stream)) == [3, 4, 3, None, 5]


def _end(channel: int) -> bytes:
    body = b"\x00\x53\x17\x45"  # end, no fields
    return struct.pack(">IBBH", len(body) + 8, 2, 0, channel) + body


def test_frames_a_client_sends_on_a_session_it_has_ended_are_dropped_until_it_begins_one_again() -> None:
    """pyamqp's renewal threads can still detach or send on a receiver's session after the receiver ended it; the
    engine closed the whole connection ("no such channel: 1")."""
    late = _transfer(1, 4, 7, payload=b"x" * 300)
    stream = _transfer(1, 0, 0) + _end(1) + late + _transfer(0, 0, 0) + _begin(1) + _transfer(1, 0, 0)
    renumbering, out = DeliveryIdRenumbering(), []
    for i in range(0, len(stream), 50):  # the dropped frame spans several reads
        out.append(renumbering.feed(stream[i:i + 50]))
    assert [(c, int(p.descriptor)) for c, p in _frames(b"".join(out))] == [
        (1, 0x14), (1, 0x17), (0, 0x14), (1, 0x11), (1, 0x14)]


@given(st.lists(st.integers(min_value=1, max_value=200), max_size=12))
def test_frames_split_anywhere_come_out_as_if_whole(cuts: list[int]) -> None:
    stream = b"AMQP\x00\x01\x00\x00" + b"".join(_transfer(1, 0, i % 3) for i in range(6))
    whole = DeliveryIdRenumbering().feed(stream)
    renumbering, out, pos = DeliveryIdRenumbering(), [], 0
    for cut in cuts:
        out.append(renumbering.feed(stream[pos:pos + cut]))
        pos += cut
    out.append(renumbering.feed(stream[pos:]))
    assert b"".join(out) == whole
    assert _ids(whole) == [0, 1, 2, 3, 4, 5]


def test_what_is_not_a_frame_goes_to_the_engine_as_it_came() -> None:
    garbage = b"\x00\x00\x00\x02\x00\x00\x00\x00rest"
    assert DeliveryIdRenumbering().feed(garbage) == garbage


@pytest.mark.slow
def test_auto_lock_renewer_over_ten_messages_keeps_them_past_their_lock_duration(
        client: ServiceBusClient, make_queue) -> None:
    """The lock renewal sample's calls: ten messages registered with ``AutoLockRenewer`` on one receiver. Its
    threads race on the receiver's session and number their management requests out of sequence; the emulator
    closed the connection ("sequencing error, expected delivery-id 6, got 4"), and the SDK crashed reading that
    close (IndexError)."""
    queue = make_queue(lock_duration=10)  # 5 s: in a loaded make test a lock ran out before the renewer's first turn
    with client.get_queue_sender(queue) as sender:
        sender.send_messages([ServiceBusMessage(f"m{i}") for i in range(10)])
    renewer = AutoLockRenewer()
    failures: list[tuple[str, Any]] = []
    completing: set[str] = set()

    def failed(message: Any, error: Any) -> None:
        # a renewal that races the message's completion fails with the lock lost, at the service too
        if str(message.message_id) not in completing:
            failures.append((str(message), getattr(error, "inner_exception", error)))

    try:
        with client.get_queue_receiver(queue) as receiver:
            received: list[Any] = []
            while len(received) < 10:
                batch = receiver.receive_messages(max_message_count=10, max_wait_time=5)
                assert batch, "the queue's messages did not arrive"
                received += batch
            for message in received:
                renewer.register(receiver, message, max_lock_renewal_duration=60, on_lock_renew_failure=failed)
            time.sleep(12)  # longer than the lock duration: only renewals keep the messages
            for message in received:
                completing.add(str(message.message_id))
                receiver.complete_message(message)
    finally:
        renewer.close()
    assert failures == []
    with client.get_queue_receiver(queue) as receiver:
        assert receiver.peek_messages(max_message_count=20) == []


def performative(code: int, kind: int, *fields: tuple[str, Any]) -> bytes:
    """One AMQP frame (``kind`` 0: AMQP, 1: SASL) of the performative ``code`` with ``fields`` as (put_ type, value)."""
    d = Data()
    d.put_described()
    d.enter()
    d.put_ulong(code)
    d.put_list()
    d.enter()
    for put, value in fields:
        getattr(d, f"put_{put}")(value)
    d.exit()
    d.exit()
    body = d.encode()
    return struct.pack(">IBBH", len(body) + 8, 2, kind, 0) + body


def test_a_connection_the_engine_cannot_read_is_closed_with_an_error_the_sdk_can_read(primary) -> None:
    """pyamqp reads the info field of a close's error by position: the engine's own errors came without one, and
    the SDK crashed with IndexError instead of reporting the close."""
    with socket.create_connection(("127.0.0.1", primary.amqp_port), timeout=5) as sock:
        sock.sendall(b"AMQP\x03\x01\x00\x00" + performative(0x41, 1, ("symbol", "ANONYMOUS"))  # sasl-init
                     + b"AMQP\x00\x01\x00\x00" + performative(0x10, 0, ("string", "raw-client")))  # open
        time.sleep(0.2)
        sock.sendall(_begin(0) + _transfer(0, 5, 0))  # a transfer on a link never attached
        data = b""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    performatives = [p for _, p in _frames(data)]
    closes = [p for p in performatives if int(p.descriptor) == 0x18]
    assert closes, f"the emulator did not close the connection: {performatives}"
    error = closes[0].value[0]
    assert str(error.value[0]).startswith("amqp:")  # the engine's condition and description, as before
    assert len(error.value) == 3 and "com.microsoft:tracking-id" in {str(k) for k in error.value[2]}


def test_a_transport_the_filter_cannot_reach_is_served_and_said_once(caplog) -> None:
    """Should a Proton release stop exposing the transport its reactor pushes into, the emulator still serves
    the connection, and says once that out-of-sequence clients will be disconnected."""
    from types import SimpleNamespace

    from proton import Connection, Transport

    from spark_sb.emulator.amqp import NamespaceServer

    server = NamespaceServer("bare", lambda _on_available: None, keys={"k": "v"})  # type: ignore[arg-type,return-value]
    events = []
    for _ in range(2):
        transport, connection = Transport(Transport.SERVER), Connection()
        transport.bind(connection)
        events.append(SimpleNamespace(transport=transport, connection=connection))
    with caplog.at_level("WARNING", logger="spark_sb.emulator.amqp"):
        for event in events:
            server.on_connection_bound(event)
    assert [r.getMessage() for r in caplog.records if "out of sequence" in r.getMessage()] == [
        "namespace bare: this Proton version hides the transport the reactor reads into; clients that number "
        "deliveries out of sequence (AutoLockRenewer) will be disconnected"]
    assert len(server._connections) == 2  # both served


def test_a_close_on_the_channel_of_an_ended_session_reaches_the_engine() -> None:
    """Open and close are the connection's, whatever channel carries them: rhea (the JavaScript SDK) ends its session
    on channel 0 and then closes on channel 0. The filter dropped that close, and the SDK waited 60 s for an answer."""
    close = performative(0x18, 0)
    out = DeliveryIdRenumbering().feed(_begin(0) + _end(0) + close)
    assert [(c, int(p.descriptor)) for c, p in _frames(out)] == [(0, 0x11), (0, 0x17), (0, 0x18)]


def test_a_client_that_ends_its_sessions_before_closing_gets_the_close_answered(primary) -> None:
    """What ``ServiceBusClient.close()`` of the JavaScript SDK sends: end on channel 0, then close on channel 0."""
    with socket.create_connection(("127.0.0.1", primary.amqp_port), timeout=5) as sock:
        sock.sendall(b"AMQP\x03\x01\x00\x00" + performative(0x41, 1, ("symbol", "ANONYMOUS"))  # sasl-init
                     + b"AMQP\x00\x01\x00\x00" + performative(0x10, 0, ("string", "raw-client"))  # open
                     + _begin(0))
        time.sleep(0.2)
        sock.sendall(_end(0) + performative(0x18, 0))  # end, close
        data = b""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not data.endswith(b"\x00\x53\x18\x45"):
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            data += chunk
    # the server's frames: sasl (type 1) frames and headers are skipped by looking at AMQP frames only
    amqp = data[data.rindex(b"AMQP\x00\x01\x00\x00"):]
    closes = [p for _, p in _frames(amqp) if int(p.descriptor) == 0x18]
    assert closes, f"the emulator did not answer the close: {[int(p.descriptor) for _, p in _frames(amqp)]}"
    assert not closes[0].value or closes[0].value[0] is None  # a clean close, no error
