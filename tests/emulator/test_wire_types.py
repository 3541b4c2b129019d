"""The AMQP types of the emulator's $cbs and $management answers, read by a bare Proton client.

The Python SDK accepts an int of any width and a list where an array is meant; the Java SDK does not
(azure-core-amqp casts ``statusCode`` to ``int``, azure-messaging-servicebus reads ``sequence-numbers`` as
``long[]`` and ``expirations`` as ``Date[]``, the session ``expiration`` as ``Date``, ``messages`` as an
``Iterable`` of maps whose ``message`` is binary and ``lock-token`` a uuid). The real service sends exactly
those types; these tests decode the raw answers so that a wrong type is caught without a JVM."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage
from proton import Array, Data, Message, int32, symbol, timestamp
from proton.handlers import MessagingHandler
from proton.reactor import Container
from proton.utils import BlockingConnection

from spark_sb.emulator import NamespaceInfo, sas


class RawClient:
    """One AMQP connection with the SDK's request/response links: $cbs, then one $management pair per node."""

    def __init__(self, ns: NamespaceInfo) -> None:
        self.ns = ns
        self.conn = BlockingConnection(f"amqp://localhost:{ns.amqp_port}", allowed_mechs="ANONYMOUS", timeout=10)
        self.links: dict[str, tuple[Any, Any]] = {}

    def request(self, node: str, body: Any, **properties: Any) -> Message:
        if node not in self.links:
            self.links[node] = (self.conn.create_sender(node), self.conn.create_receiver(node, credit=10))
        sender, receiver = self.links[node]
        msg_id = uuid.uuid4()
        sender.send(Message(id=msg_id, reply_to=f"{node}-client", properties=properties, body=body))
        reply = receiver.receive(timeout=10)
        receiver.accept()
        assert reply.correlation_id == msg_id
        return reply

    def put_token(self, entity: str = "") -> Message:
        audience = f"sb://localhost:{self.ns.amqp_port}/{entity}".rstrip("/")
        token = sas.make_token(audience, self.ns.key_name, self.ns.key)
        return self.request("$cbs", token, operation="put-token", type="servicebus.windows.net:sastoken",
                            name=audience, expiration=timestamp(int((dt.datetime.now().timestamp() + 3600) * 1000)))

    def management(self, entity: str, operation: str, body: dict[str, Any]) -> Message:
        return self.request(f"{entity}/$management", body, operation=f"com.microsoft:{operation}")

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def raw(primary: NamespaceInfo) -> Iterator[RawClient]:
    c = RawClient(primary)
    try:
        assert _status(c.put_token()) == 202
        yield c
    finally:
        c.close()


def _status(reply: Message) -> int:
    props = reply.properties
    code = props.get("statusCode", props.get("status-code"))
    # the Java SDK does `(int) properties.get("statusCode")`: a long there is a ClassCastException
    assert type(code) is int32, f"status code {code!r} is {type(code).__name__}, not an AMQP int"
    return int(code)


def _binary(value: Any) -> bytes:
    # Proton decodes an AMQP binary as bytes or a memoryview (a string would come back as str)
    assert isinstance(value, bytes | memoryview), f"{value!r} is a {type(value).__name__}, not an AMQP binary"
    return bytes(value)


def _array_of(value: Any, element_type: int) -> list[Any]:
    assert isinstance(value, Array), f"{value!r} is a {type(value).__name__}, not an AMQP array"
    assert value.type == element_type, f"array of type {value.type}, not {element_type}"
    return list(value.elements)


def test_put_token_answers_status_code_as_an_int(primary: NamespaceInfo) -> None:
    c = RawClient(primary)
    try:
        reply = c.put_token()
        assert _status(reply) == 202
        assert isinstance(reply.properties["status-description"], str)
    finally:
        c.close()


def test_management_answers_status_code_as_an_int_for_ok_no_content_and_errors(raw: RawClient, make_queue) -> None:
    q = make_queue()
    assert _status(raw.management(q, "peek-message", {"from-sequence-number": 0, "message-count": 1})) == 204
    assert _status(raw.management(q, "set-session-state", {"session-id": "s", "session-state": b"x"})) == 200
    missing = raw.management(q, "receive-by-sequence-number",
                             {"sequence-numbers": Array(0, Data.LONG, 999), "receiver-settle-mode": 1})
    assert _status(missing) == 404
    assert missing.properties["errorCondition"] == symbol("com.microsoft:message-not-found")


def test_schedule_answers_sequence_numbers_as_an_array_of_long(raw: RawClient, make_queue) -> None:
    q = make_queue()
    when = timestamp(int((dt.datetime.now().timestamp() + 3600) * 1000))
    messages = [
        {"message-id": f"m{i}",
         "message": Message(body=f"b{i}", annotations={symbol("x-opt-scheduled-enqueue-time"): when}).encode()}
        for i in range(2)
    ]
    reply = raw.management(q, "schedule-message", {"messages": messages})
    assert _status(reply) == 200
    seqs = _array_of(reply.body["sequence-numbers"], Data.LONG)
    assert len(seqs) == 2 and seqs[0] < seqs[1]
    cancel = raw.management(q, "cancel-scheduled-message", {"sequence-numbers": Array(0, Data.LONG, *seqs)})
    assert _status(cancel) == 200


def test_renew_lock_answers_expirations_as_an_array_of_timestamps(
    raw: RawClient, client: ServiceBusClient, make_queue
) -> None:
    q = make_queue(lock_duration=30.0)
    with client.get_queue_sender(q) as s:
        s.send_messages(ServiceBusMessage("renew me"))
    with client.get_queue_receiver(q, max_wait_time=5) as r:
        (m,) = r.receive_messages(max_message_count=1, max_wait_time=5)
        reply = raw.management(q, "renew-lock", {"lock-tokens": Array(0, Data.UUID, uuid.UUID(str(m.lock_token)))})
        assert _status(reply) == 200
        (expiry,) = _array_of(reply.body["expirations"], Data.TIMESTAMP)
        assert isinstance(expiry, timestamp)
        assert expiry / 1000 > dt.datetime.now().timestamp() + 20
        r.complete_message(m)


def test_session_answers_expiration_as_a_timestamp_and_state_as_binary(
    raw: RawClient, client: ServiceBusClient, make_queue
) -> None:
    q = make_queue(requires_session=True, lock_duration=30.0)
    with client.get_queue_sender(q) as s:
        s.send_messages(ServiceBusMessage("x", session_id="S"))
    with client.get_queue_receiver(q, session_id="S", max_wait_time=5):
        renewed = raw.management(q, "renew-session-lock", {"session-id": "S"})
        assert _status(renewed) == 200
        assert isinstance(renewed.body["expiration"], timestamp)
        assert _status(raw.management(q, "set-session-state", {"session-id": "S", "session-state": b"\x01st"})) == 200
        state = raw.management(q, "get-session-state", {"session-id": "S"})
        assert _status(state) == 200
        assert _binary(state.body["session-state"]) == b"\x01st"


def test_deferred_and_peeked_messages_come_as_a_list_of_maps_with_binary_and_uuid(
    raw: RawClient, client: ServiceBusClient, make_queue
) -> None:
    q = make_queue(lock_duration=30.0)
    with client.get_queue_sender(q) as s:
        s.send_messages(ServiceBusMessage("deferred"))
    with client.get_queue_receiver(q, max_wait_time=5) as r:
        (m,) = r.receive_messages(max_message_count=1, max_wait_time=5)
        r.defer_message(m)
    got = raw.management(q, "receive-by-sequence-number",
                         {"sequence-numbers": Array(0, Data.LONG, m.sequence_number), "receiver-settle-mode": 1})
    assert _status(got) == 200
    # the Java SDK iterates "messages" (an AMQP list, as the service sends; an array would not be Iterable)
    (entry,) = got.body["messages"]
    assert isinstance(entry["lock-token"], uuid.UUID)
    decoded = Message()
    decoded.decode(_binary(entry["message"]))
    assert bytes(decoded.body) == b"deferred"  # the Python SDK sends a str body as one data section
    peeked = raw.management(q, "peek-message", {"from-sequence-number": 0, "message-count": 5})
    assert _status(peeked) == 200
    (entry,) = peeked.body["messages"]
    assert _binary(entry["message"])
    done = raw.management(q, "update-disposition",
                          {"disposition-status": "completed", "lock-tokens": Array(0, Data.UUID, got.body["messages"][0]["lock-token"])})
    assert _status(done) == 200


def test_rule_manager_operations_add_list_and_remove_rules_in_the_service_encoding(
    raw: RawClient, make_topic
) -> None:
    # the Java, .NET and JavaScript rule managers (ServiceBusRuleManager) use add-rule, enumerate-rules and
    # remove-rule; the answer's rules are described types (rule description [filter, action, name])
    topic = make_topic({"s": {}})
    node = f"{topic}/Subscriptions/s"
    sql = {"sql-filter": {"expression": "color = 'red'"}, "sql-rule-action": {"expression": "SET tagged = 1"},
           "rule-name": "red"}
    assert _status(raw.management(node, "add-rule", {"rule-name": "red", "rule-description": sql})) == 200
    correlation = {"correlation-filter": {"correlation-id": "c-1", "label": "order", "to": None,
                                          "properties": {"region": "eu"}},
                   "sql-rule-action": None, "rule-name": "corr"}
    assert _status(raw.management(node, "add-rule", {"rule-name": "corr", "rule-description": correlation})) == 200
    again = raw.management(node, "add-rule", {"rule-name": "red", "rule-description": sql})
    assert _status(again) == 409
    assert _status(raw.management(node, "remove-rule", {"rule-name": "$Default"})) == 200
    listed = raw.management(node, "enumerate-rules", {"skip": int32(0), "top": int32(2**31 - 1)})
    assert _status(listed) == 200
    rules = [entry["rule-description"] for entry in listed.body["rules"]]
    assert [r.descriptor for r in rules] == [0x13700000004] * 2
    (red_filter, red_action, red_name), (corr_filter, corr_action, corr_name) = (r.value for r in rules)
    assert (red_name, red_filter.descriptor, red_filter.value[0]) == ("red", 0x1370000006, "color = 'red'")
    assert (red_action.descriptor, red_action.value[0]) == (0x13700000006, "SET tagged = 1")
    assert (corr_name, corr_filter.descriptor, corr_action.descriptor) == ("corr", 0x1370000009, 0x13700000005)
    assert corr_filter.value[0] == "c-1" and corr_filter.value[4] == "order" and corr_filter.value[8] == {"region": "eu"}
    assert _status(raw.management(node, "remove-rule", {"rule-name": "red"})) == 200
    assert _status(raw.management(node, "remove-rule", {"rule-name": "corr"})) == 200
    assert _status(raw.management(node, "enumerate-rules", {"skip": int32(0), "top": int32(10)})) == 204


def test_a_transaction_declare_is_refused_with_a_clear_error(primary: NamespaceInfo) -> None:
    # the emulator has no transactions: a coordinator link's declare (the Java SDK's createTransaction) is
    # rejected with amqp:not-implemented naming them, not taken for a send to an entity named ''
    outcome: dict[str, Any] = {}

    class Declare(MessagingHandler):
        def on_start(self, event: Any) -> None:
            self.conn = event.container.connect(f"amqp://localhost:{primary.amqp_port}", allowed_mechs="ANONYMOUS")
            event.container.declare_transaction(self.conn, handler=self)
            self.timer = event.container.schedule(10, self)

        def on_transaction_declared(self, event: Any) -> None:
            outcome["declared"] = True
            self._stop()

        def on_transaction_declare_failed(self, event: Any) -> None:
            cond = event.delivery.remote.condition
            outcome["refused"] = (cond.name, cond.description) if cond is not None else None
            self._stop()

        def on_timer_task(self, event: Any) -> None:
            outcome["timeout"] = True
            self.conn.close()

        def _stop(self) -> None:
            self.timer.cancel()
            self.conn.close()

    Container(Declare()).run()
    assert outcome == {"refused": ("amqp:not-implemented", "Transactions are not supported by the emulator.")}


def test_session_listing_answers_an_array_of_strings_and_an_int_skip(
    raw: RawClient, client: ServiceBusClient, make_queue
) -> None:
    # Microsoft's AMQP request-response reference: sessions-ids "array of strings", skip "int"
    q = make_queue(requires_session=True)
    with client.get_queue_sender(q) as s:
        s.send_messages([ServiceBusMessage("x", session_id=sid) for sid in ("a", "b")])
    listed = raw.management(q, "get-message-sessions",
                            {"last-updated-time": timestamp(253402300799000), "skip": int32(0), "top": int32(10)})
    assert _status(listed) == 200
    assert sorted(_array_of(listed.body["sessions-ids"], Data.STRING)) == ["a", "b"]
    assert type(listed.body["skip"]) is int32 and listed.body["skip"] == 2
