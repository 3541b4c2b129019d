"""What a strict AMQP 1.0 client sees on the wire, read with bare python-qpid-proton (no SDK leniency).

The Python SDK forgives a lot: a plain string where a described filter is meant, a reply on whichever link of
the entity, a lock token only in the answer's map. Other clients (the Java and JavaScript SDKs, Proton-based
tools) do not, so these tests read the emulator's frames as the AMQP 1.0 specification and the service write
them: no credit on a link about to be refused, an oversize transfer dropped while it streams in, management
replies on the request's reply-to link, lock tokens and session filters where clients read them, and bad
requests answered 400 or ``amqp:decode-error`` rather than failing inside the emulator. Every wait is bounded.
"""

from __future__ import annotations

import datetime as dt
import resource
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage
from proton import Array, Data, Delivery, Described, Endpoint, Message, Timeout, symbol, timestamp
from proton.reactor import Filter, LinkOption
from proton.utils import BlockingConnection, LinkDetached

from spark_sb.admin import admin_client
from spark_sb.emulator import EmulatorProcess, NamespaceInfo, NamespaceOptions, sas

WAIT = 5.0
SESSION_FILTER = symbol("com.microsoft:session-filter")
X_OPT_LOCK_TOKEN = symbol("x-opt-lock-token")


class _Target(LinkOption):
    """A receiver's target address: the address a management client names as its requests' reply-to."""

    def __init__(self, address: str) -> None:
        self.address = address

    def apply(self, link: Any) -> None:
        link.target.address = self.address


class Wire:
    """One bare AMQP connection to the primary namespace."""

    def __init__(self, ns: NamespaceInfo) -> None:
        self.ns = ns
        self.conn = BlockingConnection(f"amqp://localhost:{ns.amqp_port}", allowed_mechs="ANONYMOUS", timeout=WAIT)
        self.pairs: dict[str, tuple[Any, Any, str]] = {}

    def pair(self, node: str, reply_to: str | None = None) -> tuple[Any, Any, str]:
        """A request sender and a reply receiver on ``node`` (the receiver's target is ``reply_to``)."""
        reply_to = reply_to or f"{node}-reply-{uuid.uuid4().hex[:8]}"
        sender = self.conn.create_sender(node, name=f"{reply_to}-requests")
        receiver = self.conn.create_receiver(node, credit=10, name=reply_to, options=_Target(reply_to))
        return sender, receiver, reply_to

    def request(self, node: str, body: Any, pair: tuple[Any, Any, str] | None = None, **properties: Any) -> Message:
        if pair is None:
            if node not in self.pairs:
                self.pairs[node] = self.pair(node)
            pair = self.pairs[node]
        sender, receiver, reply_to = pair
        msg_id = uuid.uuid4()
        sender.send(Message(id=msg_id, reply_to=reply_to, properties=properties, body=body), timeout=WAIT)
        reply = receiver.receive(timeout=WAIT)
        receiver.accept()
        assert reply.correlation_id == msg_id
        return reply

    def put_token(self, entity: str = "") -> None:
        audience = f"sb://localhost:{self.ns.amqp_port}/{entity}".rstrip("/")
        token = sas.make_token(audience, self.ns.key_name, self.ns.key)
        reply = self.request("$cbs", token, operation="put-token", type="servicebus.windows.net:sastoken",
                             name=audience, expiration=timestamp(int((dt.datetime.now().timestamp() + 3600) * 1000)))
        assert reply.properties["status-code"] == 202

    def management(self, entity: str, operation: str, body: Any, pair: Any = None) -> Message:
        return self.request(f"{entity}/$management", body, pair, operation=f"com.microsoft:{operation}")

    def send_raw(self, link: Any, payload: bytes) -> Any:
        """One transfer of ``payload`` as it is; returns its delivery once the emulator settled it."""
        dlv = link.delivery(uuid.uuid4().bytes)
        link.send(payload)
        link.advance()
        self.conn.wait(lambda: dlv.remote_state != 0, timeout=WAIT, msg="the transfer was never settled")
        return dlv

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:  # noqa: BLE001 - a link the test left detached
            pass


@pytest.fixture
def wire(primary: NamespaceInfo) -> Iterator[Wire]:
    w = Wire(primary)
    try:
        w.put_token()
        yield w
    finally:
        w.close()


def _status(reply: Message) -> int:
    return int(reply.properties["statusCode"])


def _filter_value(link: Any) -> Any:
    data = link.remote_source.filter
    data.rewind()
    assert data.next() is not None, "the attach echoed no filter"
    return data.get_object()[SESSION_FILTER]


# ------------------------------------------------------------------ 5: refused links, oversize transfers
def test_a_sender_without_a_token_is_detached_unauthorized_with_no_credit(primary: NamespaceInfo, make_queue) -> None:
    q = make_queue()
    w = Wire(primary)  # no put-token
    try:
        with pytest.raises(LinkDetached) as refused:
            sender = w.conn.create_sender(q)
            # before the fix: attached and given credit, detached only at the first transfer (never, here)
            w.conn.wait(lambda: sender.link.state & Endpoint.REMOTE_CLOSED, timeout=WAIT,
                        msg=f"attached with credit {sender.link.credit} and never detached")
        link = refused.value.link
        assert refused.value.condition == "amqp:unauthorized-access"
        assert link.credit == 0, f"a link refused for want of a token was given credit {link.credit}"
    finally:
        w.close()


@pytest.fixture
def far_wire() -> Iterator[tuple[Wire, int]]:
    """A bare connection to an emulator in a process of its own (whose memory is its own), and its pid."""
    proc = EmulatorProcess.start(data_dir=None, namespaces=[NamespaceOptions("primary")])
    try:
        ns = proc["primary"]
        with admin_client(ns.connection_string, admin_endpoint=f"http://localhost:{ns.admin_port}") as admin:
            admin.create_queue("big")
        w = Wire(proc["primary"])
        try:
            w.put_token()
            yield w, proc.proc.pid
        finally:
            w.close()
    finally:
        proc.stop()


def _resident_mib(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def test_an_oversize_transfer_is_dropped_while_it_streams_in_and_rejected_message_size_exceeded(far_wire) -> None:
    wire, pid = far_wire
    sender = wire.conn.create_sender("big")
    link = sender.link
    limit = link.remote_max_message_size
    assert limit == 256 * 1024
    payload = Message(body=b"x" * (64 * 1024 * 1024)).encode()  # 64 MiB on a 256 KiB link
    chunk = 64 * 1024
    before = _resident_mib(pid)
    dlv = link.delivery(b"oversize")
    for sent in range(0, len(payload), chunk):
        link.send(payload[sent: sent + chunk])
        wire.conn.wait(lambda: link.session.outgoing_bytes == 0, timeout=WAIT, msg="the emulator stopped reading")
    grown = _resident_mib(pid) - before
    link.advance()
    wire.conn.wait(lambda: dlv.remote_state != 0, timeout=WAIT, msg="the oversize delivery was never answered")
    # before the fix the emulator held the delivery whole until its last frame (64 MiB, then copies of it)
    assert grown < 8, f"the emulator holds {grown:.0f} MiB more after 64 MiB of one delivery streamed in"
    assert dlv.remote_state == Delivery.REJECTED
    assert dlv.remote.condition.name == "amqp:link:message-size-exceeded"
    assert "exceeds the limit (262144 bytes)" in dlv.remote.condition.description
    # the link goes on: a message within the limit is taken
    small = wire.send_raw(link, Message(body=b"small").encode())
    assert small.remote_state == Delivery.ACCEPTED


def test_a_message_at_the_limit_still_streams_in_and_is_accepted(wire: Wire, make_queue) -> None:
    q = make_queue()
    sender = wire.conn.create_sender(q)
    payload = Message(body=b"y" * (250 * 1024)).encode()  # several frames, under 256 KiB
    dlv = wire.send_raw(sender.link, payload)
    assert dlv.remote_state == Delivery.ACCEPTED
    receiver = wire.conn.create_receiver(q, credit=1)
    got = receiver.receive(timeout=WAIT)
    receiver.accept()
    assert got.body == b"y" * (250 * 1024)


# ------------------------------------------------------------------ 9: replies on the reply-to link
def test_management_replies_go_to_the_reply_to_link_not_the_entitys_last(wire: Wire, make_queue) -> None:
    q = make_queue()
    node = f"{q}/$management"
    for_sender = wire.pair(node, "reply-for-sender")
    for_receiver = wire.pair(node, "reply-for-receiver")  # opened last: the one an entity-keyed router picks
    when = timestamp(int((dt.datetime.now().timestamp() + 3600) * 1000))
    scheduled = wire.management(q, "schedule-message", {"messages": [{
        "message-id": "m1",
        "message": Message(body="later", annotations={symbol("x-opt-scheduled-enqueue-time"): when}).encode()}]},
        pair=for_sender)  # before the fix: answered on the receiver's link, this timed out
    assert _status(scheduled) == 200
    seqs = list(scheduled.body["sequence-numbers"].elements)
    cancelled = wire.management(q, "cancel-scheduled-message", {"sequence-numbers": Array(0, Data.LONG, *seqs)},
                                pair=for_sender)
    assert _status(cancelled) == 200
    peeked = wire.management(q, "peek-message", {"from-sequence-number": 0, "message-count": 1},
                             pair=for_receiver)
    assert _status(peeked) == 204  # cancelled: nothing left
    with pytest.raises(Timeout):
        for_receiver[1].receive(timeout=0.5)  # nothing of the sender's went astray


def test_cbs_replies_go_to_the_reply_to_link_too(primary: NamespaceInfo, make_queue) -> None:
    q = make_queue()
    w = Wire(primary)
    try:
        first = w.pair("$cbs", "cbs-first")
        last = w.pair("$cbs", "cbs-last")  # opened last: the one a connection-keyed router picks
        audience = f"sb://localhost:{primary.amqp_port}/{q}"
        token = sas.make_token(audience, primary.key_name, primary.key)
        expires = timestamp(int((dt.datetime.now().timestamp() + 3600) * 1000))
        reply = w.request("$cbs", token, first, operation="put-token", type="servicebus.windows.net:sastoken",
                          name=audience, expiration=expires)  # before the fix: answered on the last link, timed out
        assert reply.properties["status-code"] == 202
        with pytest.raises(Timeout):
            last[1].receive(timeout=0.5)
    finally:
        w.close()


# ------------------------------------------------------------------ 10: a deferred message's lock token
def test_a_deferred_messages_lock_token_is_in_its_delivery_annotations(
    wire: Wire, client: ServiceBusClient, make_queue
) -> None:
    q = make_queue(lock_duration=30.0)
    with client.get_queue_sender(q) as s:
        s.send_messages(ServiceBusMessage("defer me"))
    with client.get_queue_receiver(q, max_wait_time=5) as r:
        (m,) = r.receive_messages(max_message_count=1, max_wait_time=5)
        seq = m.sequence_number
        r.defer_message(m)
    reply = wire.management(q, "receive-by-sequence-number",
                            {"sequence-numbers": Array(0, Data.LONG, seq), "receiver-settle-mode": 1})
    assert _status(reply) == 200
    (entry,) = reply.body["messages"]
    decoded = Message()
    decoded.decode(bytes(entry["message"]))
    annotations = decoded.instructions or {}  # Proton's name for the delivery annotations
    assert X_OPT_LOCK_TOKEN in annotations, f"no lock token in the delivery annotations: {annotations}"
    token = annotations[X_OPT_LOCK_TOKEN]
    assert isinstance(token, uuid.UUID) and token == entry["lock-token"]
    # a client that read the token from the message settles with it
    done = wire.management(q, "update-disposition",
                           {"disposition-status": "completed", "lock-tokens": Array(0, Data.UUID, token)})
    assert _status(done) == 200


# ------------------------------------------------------------------ 11: the session filter echoed described
@pytest.mark.parametrize("asked", ["s-1", None], ids=["named", "next-available"])
def test_the_session_filter_is_echoed_as_a_described_value(
    wire: Wire, client: ServiceBusClient, make_queue, asked: str | None
) -> None:
    q = make_queue(requires_session=True, lock_duration=30.0)
    with client.get_queue_sender(q) as s:
        s.send_messages(ServiceBusMessage("in a session", session_id="s-1"))
    receiver = wire.conn.create_receiver(
        q, credit=1, options=Filter({SESSION_FILTER: Described(SESSION_FILTER, asked)}))
    echoed = _filter_value(receiver.link)
    assert isinstance(echoed, Described), f"the session filter came back as {type(echoed).__name__} {echoed!r}"
    assert echoed.descriptor == SESSION_FILTER
    assert echoed.value == "s-1"  # for next-available: the session the broker chose
    got = receiver.receive(timeout=WAIT)
    receiver.accept()
    assert got.body in ("in a session", b"in a session")


# ------------------------------------------------------------------ 8: bad requests
@pytest.mark.parametrize(("operation", "body", "named"), [
    ("cancel-scheduled-message", {"sequence-numbers": "1,2"}, ("sequence-numbers", "list of long", "string")),
    ("receive-by-sequence-number", {"sequence-numbers": ["a"]}, ("sequence-numbers", "list of long", "string")),
    ("renew-lock", {}, ("lock-tokens", "missing")),
    ("schedule-message", {"messages": ["not a map"]}, ("messages", "list of map", "string")),
    ("peek-message", ["not", "a", "map"], ("body", "map", "list")),
    ("set-session-state", {"session-id": "s", "session-state": "text"}, ("session-state", "binary", "string")),
], ids=["string-for-longs", "strings-in-longs", "missing-field", "string-for-map", "list-for-body", "string-state"])
def test_a_request_field_of_the_wrong_type_is_answered_400_naming_it(
    wire: Wire, make_queue, operation: str, body: Any, named: tuple[str, ...]
) -> None:
    q = make_queue()
    reply = wire.management(q, operation, body)
    assert _status(reply) == 400, reply.properties
    assert reply.properties["errorCondition"] == symbol("com.microsoft:argument-error")
    description = reply.properties["statusDescription"]
    for word in named:
        assert word in description, description
    assert _status(wire.management(q, "peek-message", {"from-sequence-number": 0, "message-count": 1})) == 204


@pytest.mark.parametrize(("operation", "body", "named"), [
    ("add-rule", {"rule-name": "r", "rule-description": {"sql-filter": "p = 1"}},
     ("rule-description.sql-filter", "map", "string")),
    ("add-rule", {"rule-name": "r", "rule-description": {"sql-filter": {"expression": 5}}},
     ("rule-description.sql-filter.expression", "string")),
    ("add-rule", {"rule-name": "r", "rule-description": {"correlation-filter": {"correlation-id": ["x"]}}},
     ("rule-description.correlation-filter.correlation-id", "text", "list")),
    ("add-rule", {"rule-name": "r", "rule-description": {"correlation-filter": {"properties": "p=1"}}},
     ("rule-description.correlation-filter.properties", "map", "string")),
    ("add-rule", {"rule-name": "r", "rule-description": {"sql-rule-action": {"expression": ["SET p = 1"]}}},
     ("rule-description.sql-rule-action.expression", "string", "list")),
    ("remove-rule", {"rule-name": 7}, ("rule-name", "string")),
], ids=["string-for-filter", "long-expression", "list-correlation-id", "string-properties", "list-action",
        "long-rule-name"])
def test_a_rule_field_of_the_wrong_type_is_answered_400_naming_where_it_is(
    wire: Wire, make_topic, operation: str, body: Any, named: tuple[str, ...]
) -> None:
    topic = make_topic({"s": {}})
    node = f"{topic}/subscriptions/s"
    reply = wire.management(node, operation, body)
    assert _status(reply) == 400, reply.properties
    assert reply.properties["errorCondition"] == symbol("com.microsoft:argument-error")
    description = reply.properties["statusDescription"]
    for word in named:
        assert word in description, description
    rules = wire.management(node, "enumerate-rules", {"top": 10, "skip": 0})
    assert _status(rules) == 200 and len(rules.body["rules"]) == 1  # only $Default: nothing half-made


def _nested_described(depth: int) -> bytes:
    return b"\x00\x53\x01" * depth + b"\x40"


def _bodiless(message: Message) -> bytes:
    """The message's sections without the null amqp-value body Proton encodes for a message with none."""
    encoded = message.encode()
    return encoded.removesuffix(b"\x00\x53\x77\x40")


def test_deeply_nested_values_are_a_decode_error_not_an_internal_one(wire: Wire, make_queue) -> None:
    q = make_queue()
    header = _bodiless(Message(id=uuid.uuid4(), reply_to="r", properties={"operation": "com.microsoft:peek-message"}))
    request = header + b"\x00\x53\x77" + _nested_described(5000)  # an amqp-value body 5,000 levels deep
    mgmt = wire.conn.create_sender(f"{q}/$management", name="deep-requests")
    dlv = wire.send_raw(mgmt.link, request)
    assert dlv.remote_state == Delivery.REJECTED
    assert dlv.remote.condition.name == "amqp:decode-error", dlv.remote.condition
    sender = wire.conn.create_sender(q)
    dlv = wire.send_raw(sender.link, _bodiless(Message(id="deep")) + b"\x00\x53\x77" + _nested_described(5000))
    assert dlv.remote_state == Delivery.REJECTED
    assert dlv.remote.condition.name == "amqp:decode-error", dlv.remote.condition
    annotations = b"\x00\x53\x72\xc1" + bytes([1 + 3 + 3 * 40 + 1, 2]) + b"\xa3\x01k" + _nested_described(40)
    shallow = wire.send_raw(sender.link, annotations + Message(id="ok", body="fine").encode())
    assert shallow.remote_state == Delivery.ACCEPTED  # 40 levels: within the bound
    # the connection still serves
    assert _status(wire.management(q, "peek-message", {"from-sequence-number": 0, "message-count": 1})) == 200
