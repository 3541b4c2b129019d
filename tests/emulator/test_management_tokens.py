"""Which $cbs tokens open an entity's $management node, read by a bare Proton client.

The JavaScript SDK (@azure/service-bus) puts a token for ``<entity>/$management`` before a management call on an
entity it has no link to (``scheduleMessages`` on a sender not yet used): Service Bus takes it; the emulator answered
401 ("no valid token was put on $cbs for it")."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from proton import Message, symbol, timestamp
from proton.utils import BlockingConnection

from spark_sb.emulator import NamespaceInfo, sas


def _request(conn: Any, links: dict[str, Any], node: str, body: Any, **properties: Any) -> Message:
    if node not in links:
        links[node] = (conn.create_sender(node), conn.create_receiver(node, credit=10))
    sender, receiver = links[node]
    msg_id = uuid.uuid4()
    sender.send(Message(id=msg_id, reply_to=f"{node}-client", properties=properties, body=body))
    reply = receiver.receive(timeout=10)
    receiver.accept()
    assert reply.correlation_id == msg_id
    return reply


def _status(reply: Message) -> int:
    return int(reply.properties.get("statusCode", reply.properties.get("status-code")))


def _schedule_with_a_token_for(ns: NamespaceInfo, queue: str, token_path: str) -> Message:
    conn = BlockingConnection(f"amqp://localhost:{ns.amqp_port}", allowed_mechs="ANONYMOUS", timeout=10)
    links: dict[str, Any] = {}
    try:
        audience = f"sb://localhost:{ns.amqp_port}/{token_path}"
        expiry = timestamp(int((dt.datetime.now().timestamp() + 3600) * 1000))
        put = _request(conn, links, "$cbs", sas.make_token(audience, ns.key_name, ns.key), operation="put-token",
                       type="servicebus.windows.net:sastoken", name=audience, expiration=expiry)
        assert _status(put) == 202
        when = timestamp(int((dt.datetime.now().timestamp() + 3600) * 1000))
        message = Message(body="later", annotations={symbol("x-opt-scheduled-enqueue-time"): when}).encode()
        return _request(conn, links, f"{queue}/$management", {"messages": [{"message-id": "m", "message": message}]},
                        operation="com.microsoft:schedule-message")
    finally:
        conn.close()


def test_a_token_for_the_management_node_opens_it(primary: NamespaceInfo, make_queue) -> None:
    q = make_queue()
    reply = _schedule_with_a_token_for(primary, q, f"{q}/$management")
    assert _status(reply) == 200, reply.properties
    assert len(list(reply.body["sequence-numbers"].elements)) == 1


def test_a_token_for_the_entity_still_opens_its_management_node_and_no_other(primary: NamespaceInfo,
                                                                             make_queue) -> None:
    q, other = make_queue(), make_queue()
    assert _status(_schedule_with_a_token_for(primary, q, q)) == 200
    refused = _schedule_with_a_token_for(primary, other, f"{q}/$management")
    assert _status(refused) == 401
    assert refused.properties["errorCondition"] == symbol("amqp:unauthorized-access")
