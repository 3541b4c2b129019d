"""Microsoft's azure-servicebus samples (release 7.11.4, ``samples/sync_samples`` and ``async_samples``), their SDK
calls run against the emulator: written here after each sample's calls, not copied, and nothing downloaded.

Samples whose calls other modules already follow:
- ``auto_lock_renew``: ten messages on one receiver (``test_frames``), a session past its lock
  (``test_sessions``);
- ``session_pool_receive``, ``session_send_receive`` (state, reopening at once): ``test_sessions``;
- ``topic_subscription_with_rule_operations``, ``mgmt_rule``: ``test_rules``, ``test_admin``;
- ``mgmt_queue``, ``mgmt_topic``, ``mgmt_subscription``: ``test_admin`` too (through the project's admin wrapper;
  their async versions through ``async_admin_client``, here);
- ``receive_deferred_message_queue``, ``receive_peek``, ``schedule_messages_and_cancellation``,
  ``receive_deadlettered_messages``: ``test_sdk_dataplane``;
- the credential samples (``authenticate_using_azure_named_key_credential``, ``..._sas_credential``,
  ``client_identity_authentication``): ``test_tls``.

``proxy`` and ``proxy_async`` run here against the emulator's AMQP over WebSockets through a local HTTP proxy
(:mod:`spark_sb.emulator.proxy`), with one change each: the emulator's WebSocket port named as
``custom_endpoint_address`` (with ``http_proxy`` the SDK opens ``ws://`` on port 80, or 443 for the async client,
without it). The async sample needs a second: aiohttp takes ``proxy_hostname`` as a URL (``http://127.0.0.1``);
as written (a bare host, which the sync client needs) it fails with ``InvalidURL`` (``test_websockets``).
"""

from __future__ import annotations

import asyncio
import datetime
import sys
import uuid
from typing import Any

import pytest
from azure.servicebus import (
    ServiceBusClient,
    ServiceBusMessage,
    ServiceBusReceivedMessage,
    ServiceBusSubQueue,
)
from azure.servicebus.aio import ServiceBusClient as AsyncServiceBusClient
from azure.servicebus.amqp import AmqpAnnotatedMessage, AmqpMessageBodyType
from azure.servicebus.management import SqlRuleFilter

from spark_sb import admin as admin_module
from spark_sb.admin import admin_client, async_admin_client
from spark_sb.emulator import Emulator, NamespaceInfo
from spark_sb.emulator.model import QueueSpec
from spark_sb.emulator.proxy import HttpProxy


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


def _drain(receiver: Any, expected: int) -> list[ServiceBusReceivedMessage]:
    got: list[ServiceBusReceivedMessage] = []
    for _ in range(20):
        if len(got) >= expected:
            break
        got += receiver.receive_messages(max_message_count=expected - len(got), max_wait_time=2)
    return got


def test_amqp_annotated_messages_keep_their_body_type_and_sections(client: ServiceBusClient, make_queue) -> None:
    """send_and_receive_amqp_annotated_message: data, sequence and value bodies, with delivery annotations,
    a footer, properties, a header and message annotations."""
    queue = make_queue()
    with client.get_queue_sender(queue) as sender:
        sender.send_messages(AmqpAnnotatedMessage(
            data_body=[b"aa", b"bb", b"cc"], delivery_annotations={"delivery_annotation_key": "value"},
            application_properties={"body_type": "data"}))
        sender.send_messages(AmqpAnnotatedMessage(
            sequence_body=[b"message", 123.456, True], footer={"footer_key": "footer_value"},
            properties={"subject": "sequence"}, application_properties={"body_type": "sequence"}))
        sender.send_messages(AmqpAnnotatedMessage(
            value_body={b"key": [-123, b"data", False]}, header={"priority": 10},
            annotations={"annotation_key": "value"}, application_properties={"body_type": "value"}))
    with client.get_queue_receiver(queue, max_wait_time=1) as receiver:
        got = {}
        for message in receiver:
            raw = message.raw_amqp_message
            got[_text(message.application_properties[b"body_type"])] = raw
            receiver.complete_message(message)
    assert set(got) == {"data", "sequence", "value"}
    data, sequence, value = got["data"], got["sequence"], got["value"]
    assert data.body_type == AmqpMessageBodyType.DATA and list(data.body) == [b"aa", b"bb", b"cc"]
    assert sequence.body_type == AmqpMessageBodyType.SEQUENCE
    assert list(sequence.body) == [[b"message", 123.456, True]]
    assert _text(sequence.properties.subject) == "sequence"
    assert {_text(k): _text(v) for k, v in (sequence.footer or {}).items()} == {"footer_key": "footer_value"}
    assert value.body_type == AmqpMessageBodyType.VALUE and value.body == {b"key": [-123, b"data", False]}
    assert value.header.priority == 10
    assert _text(value.annotations[b"annotation_key"]) == "value"


def test_dead_lettered_messages_are_read_from_the_dead_letter_queue_corrected_and_sent_again(
        client: ServiceBusClient, make_queue) -> None:
    """deadletter_messages_and_correct: messages abandoned past their maximum delivery count, and messages
    dead-lettered with a reason, read from the dead-letter sub-queue; the bad ones corrected and sent again."""
    queue = make_queue(max_delivery_count=2)
    with client.get_queue_sender(queue) as sender:
        sender.send_messages([ServiceBusMessage(f"number {i}", subject="Bad" if i % 2 == 0 else "Good")
                              for i in range(10)])
    # exceed_max_delivery: abandon until the queue is empty
    with client.get_queue_receiver(queue) as receiver:
        received = receiver.receive_messages(max_message_count=10, max_wait_time=2)
        while received:
            for message in received:
                receiver.abandon_message(message)
            received = receiver.receive_messages(max_message_count=10, max_wait_time=1)
    with client.get_queue_receiver(queue, sub_queue=ServiceBusSubQueue.DEAD_LETTER) as dlq:
        dead = _drain(dlq, 10)
        assert sorted(str(m) for m in dead) == sorted(f"number {i}" for i in range(10))
        assert {m.dead_letter_reason for m in dead} == {"MaxDeliveryCountExceeded"}
        for message in dead:
            dlq.complete_message(message)
    # receive_messages: the good ones completed, the bad ones dead-lettered with a reason
    with client.get_queue_sender(queue) as sender:
        sender.send_messages([ServiceBusMessage(f"number {i}", subject="Bad" if i % 2 == 0 else "Good")
                              for i in range(10)])
    with client.get_queue_receiver(queue) as receiver:
        for message in _drain(receiver, 10):
            if message.subject == "Good":
                receiver.complete_message(message)
            else:
                receiver.dead_letter_message(message, reason="ProcessingError",
                                             error_description="Message processing failed")
    # fix_deadletters: read, correct, send again, complete
    with client.get_queue_receiver(queue, sub_queue=ServiceBusSubQueue.DEAD_LETTER) as dlq, \
            client.get_queue_sender(queue) as sender:
        dead = _drain(dlq, 5)
        assert {(m.subject, m.dead_letter_reason, m.dead_letter_error_description) for m in dead} == {
            ("Bad", "ProcessingError", "Message processing failed")}
        for message in dead:
            sender.send_messages(ServiceBusMessage(f"fixed: {message}", subject="Good"))
            dlq.complete_message(message)
    with client.get_queue_receiver(queue) as receiver:
        fixed = _drain(receiver, 5)
        for message in fixed:
            receiver.complete_message(message)
    assert sorted(str(m) for m in fixed) == sorted(f"fixed: number {i}" for i in range(0, 10, 2))
    assert {m.subject for m in fixed} == {"Good"}


def test_receiving_with_the_iterator_yields_every_message_and_ends_after_max_wait_time(
        client: ServiceBusClient, make_queue) -> None:
    """receive_iterator_queue: ``for message in receiver`` on a receiver with ``max_wait_time``."""
    queue = make_queue()
    with client.get_queue_sender(queue) as sender:
        sender.send_messages([ServiceBusMessage(f"Message in list {i}") for i in range(10)])
    with client.get_queue_receiver(queue, max_wait_time=1) as receiver:
        seen = []
        for message in receiver:
            seen.append(str(message))
            receiver.complete_message(message)
    assert sorted(seen) == sorted(f"Message in list {i}" for i in range(10))


def test_messages_scheduled_on_a_topic_are_cancelled_before_any_subscription_sees_them(
        client: ServiceBusClient, make_topic) -> None:
    """schedule_topic_messages_and_cancellation: ``schedule_messages`` on a topic sender returns sequence numbers
    that ``cancel_scheduled_messages`` takes."""
    topic = make_topic({"sub": {}})
    at = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=30)
    with client.get_topic_sender(topic) as sender:
        one = sender.schedule_messages(ServiceBusMessage("one"), at)
        many = sender.schedule_messages([ServiceBusMessage(f"m{i}") for i in range(10)], at)
        assert len(one) == 1 and len(many) == 10 and len(set(one + many)) == 11
        with client.get_subscription_receiver(topic, "sub") as receiver:
            assert len(receiver.peek_messages(max_message_count=20)) == 11  # scheduled, not yet active
        sender.cancel_scheduled_messages(one)
        sender.cancel_scheduled_messages(many)
    with client.get_subscription_receiver(topic, "sub") as receiver:
        assert receiver.peek_messages(max_message_count=20) == []


def test_the_code_snippets_sample_async_calls(primary: NamespaceInfo, make_queue, make_topic) -> None:
    """sample_code_servicebus_async: the async client's sender, receivers (queue, subscription, sessions),
    peek, defer and receive the deferred, dead-letter sub-queue, session state."""
    queue, session_queue = make_queue(), make_queue(requires_session=True)
    topic = make_topic({"sub": {}})

    async def run() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with AsyncServiceBusClient.from_connection_string(primary.connection_string) as client:
            async with client.get_queue_sender(queue) as sender:
                batch = await sender.create_message_batch()
                for i in range(3):
                    batch.add_message(ServiceBusMessage(f"batch {i}"))
                await sender.send_messages(batch)
                await sender.send_messages(ServiceBusMessage("single"))
            async with client.get_queue_receiver(queue) as receiver:
                out["peeked"] = [str(m) for m in await receiver.peek_messages(max_message_count=10)]
                messages = []
                while len(messages) < 4:
                    messages += await receiver.receive_messages(max_message_count=4, max_wait_time=2)
                await receiver.defer_message(messages[0])
                await receiver.dead_letter_message(messages[1], reason="reason", error_description="description")
                for m in messages[2:]:
                    await receiver.complete_message(m)
                deferred = await receiver.receive_deferred_messages([messages[0].sequence_number])
                out["deferred"] = [str(m) for m in deferred]
                await receiver.complete_message(deferred[0])
            async with client.get_queue_receiver(queue, sub_queue=ServiceBusSubQueue.DEAD_LETTER,
                                                 max_wait_time=1) as dlq:
                out["dead"] = [(str(m), m.dead_letter_reason) async for m in dlq]
            async with client.get_topic_sender(topic) as sender:
                await sender.send_messages(ServiceBusMessage("to the topic"))
            async with client.get_subscription_receiver(topic, "sub", max_wait_time=1) as receiver:
                got = [m async for m in receiver]
                for m in got:
                    await receiver.complete_message(m)
                out["subscription"] = [str(m) for m in got]
            async with client.get_queue_sender(session_queue) as sender:
                await sender.send_messages(ServiceBusMessage("in a session", session_id="s1"))
            async with client.get_queue_receiver(session_queue, session_id="s1", max_wait_time=1) as receiver:
                await receiver.session.set_state("START")
                out["state"] = await receiver.session.get_state()
                got = [m async for m in receiver]
                for m in got:
                    await receiver.complete_message(m)
                out["session"] = [str(m) for m in got]
                await receiver.session.renew_lock()
        return out

    out = asyncio.run(run())
    assert sorted(out["peeked"]) == sorted(["batch 0", "batch 1", "batch 2", "single"])
    assert out["deferred"] == [out["peeked"][0]]
    assert out["dead"] == [(out["peeked"][1], "reason")]
    assert out["subscription"] == ["to the topic"]
    assert out["state"] == b"START" and out["session"] == ["in a session"]


def test_the_management_samples_run_through_the_admin_wrapper(primary: NamespaceInfo) -> None:
    """mgmt_queue, mgmt_topic, mgmt_subscription, mgmt_rule: create, list, get, runtime properties, update,
    delete, with ``admin_client(connection_string)`` in place of ``from_connection_string``."""
    queue, topic = f"sample-queue-{uuid.uuid4().hex[:6]}", f"sample-topic-{uuid.uuid4().hex[:6]}"
    with admin_client(primary.connection_string, admin_endpoint=primary.admin_url) as admin:
        admin.create_queue(queue)
        admin.create_topic(topic)
        admin.create_subscription(topic, "sample-sub")
        admin.create_rule(topic, "sample-sub", "sample-rule", filter=SqlRuleFilter("Priority = 'low'"))
        try:
            assert queue in [q.name for q in admin.list_queues()]
            assert admin.get_queue_runtime_properties(queue).active_message_count == 0
            properties = admin.get_queue(queue)
            properties.max_delivery_count = 5
            admin.update_queue(properties)
            assert admin.get_queue(queue).max_delivery_count == 5
            assert [s.name for s in admin.list_subscriptions(topic)] == ["sample-sub"]
            rules = {r.name: r for r in admin.list_rules(topic, "sample-sub")}
            assert rules["sample-rule"].filter.sql_expression == "Priority = 'low'"
            assert admin.get_topic_runtime_properties(topic).subscription_count == 1
        finally:
            admin.delete_rule(topic, "sample-sub", "sample-rule")
            admin.delete_subscription(topic, "sample-sub")
            admin.delete_topic(topic)
            admin.delete_queue(queue)
        assert queue not in [q.name for q in admin.list_queues()]


def test_the_async_management_samples_run_through_the_async_admin_wrapper(primary: NamespaceInfo) -> None:
    """mgmt_queue_async, mgmt_topic_async, mgmt_subscription_async, mgmt_rule_async,
    topic_subscription_with_rule_operations_async: ``async_admin_client(connection_string)`` in place of the async
    ``ServiceBusAdministrationClient.from_connection_string``."""
    queue, topic = f"async-queue-{uuid.uuid4().hex[:6]}", f"async-topic-{uuid.uuid4().hex[:6]}"

    async def run() -> dict[str, Any]:
        async with async_admin_client(primary.connection_string, admin_endpoint=primary.admin_url) as admin:
            await admin.create_queue(queue, max_delivery_count=7)
            await admin.create_topic(topic)
            await admin.create_subscription(topic, "sub")
            await admin.create_rule(topic, "sub", "params", filter=SqlRuleFilter("Color = @c", parameters={"@c": "Red"}))
            out = {
                "queues": [q.name async for q in admin.list_queues()],
                "delivery": (await admin.get_queue(queue)).max_delivery_count,
                "rules": sorted([r.name async for r in admin.list_rules(topic, "sub")]),
                "subscriptions": (await admin.get_topic_runtime_properties(topic)).subscription_count,
            }
            await admin.delete_topic(topic)
            await admin.delete_queue(queue)
            out["after"] = [q.name async for q in admin.list_queues()]
            return out

    out = asyncio.run(run())
    assert queue in out["queues"] and queue not in out["after"]
    assert out["delivery"] == 7 and out["rules"] == ["$Default", "params"] and out["subscriptions"] == 1


def test_without_aiohttp_the_async_admin_client_says_what_to_install(primary: NamespaceInfo, monkeypatch) -> None:
    admin_module._async_classes.cache_clear()
    monkeypatch.setitem(sys.modules, "aiohttp", None)
    monkeypatch.setitem(sys.modules, "azure.core.pipeline.transport._aiohttp", None)
    try:
        with pytest.raises(ImportError, match="pip install aiohttp"):
            async_admin_client(primary.connection_string)
    finally:
        admin_module._async_classes.cache_clear()


def _proxy_sample_queue(emulator: Emulator) -> tuple[NamespaceInfo, str]:
    queue = f"proxy-sample-{uuid.uuid4().hex[:6]}"
    server = emulator.server("primary")
    server.call(lambda: server.broker.create_entity(QueueSpec(name=queue)))
    return emulator["primary"], queue


def _received(info: NamespaceInfo, queue: str) -> list[str]:
    with ServiceBusClient.from_connection_string(info.connection_string) as client:
        with client.get_queue_receiver(queue, max_wait_time=2) as receiver:
            got = receiver.receive_messages(max_message_count=5, max_wait_time=2)
            for message in got:
                receiver.complete_message(message)
    return [str(m) for m in got]


def test_the_proxy_sample_sends_through_the_proxy(websocket_emulator: Emulator,
                                                  http_proxy_server: HttpProxy) -> None:
    """proxy: a client from the connection string with ``http_proxy`` (a host, a port, a username and a password)
    sends one message."""
    info, queue = _proxy_sample_queue(websocket_emulator)
    opened = http_proxy_server.tunnels[("localhost", info.ws_port)]
    http_proxy = http_proxy_server.http_proxy
    assert set(http_proxy) == {"proxy_hostname", "proxy_port", "username", "password"}
    client = ServiceBusClient.from_connection_string(conn_str=info.connection_string, http_proxy=http_proxy,
                                                     **info.websocket_connection_string_kwargs)
    with client:
        sender = client.get_queue_sender(queue_name=queue)
        with sender:
            sender.send_messages(ServiceBusMessage("Single Message"))
    assert http_proxy_server.tunnels[("localhost", info.ws_port)] == opened + 1
    assert _received(info, queue) == ["Single Message"]


def test_the_async_proxy_sample_sends_through_the_proxy(websocket_emulator: Emulator,
                                                        http_proxy_server: HttpProxy) -> None:
    """proxy_async: the same with the async client, its proxy host written as a URL."""
    info, queue = _proxy_sample_queue(websocket_emulator)
    opened = http_proxy_server.tunnels[("localhost", info.ws_port)]

    async def main() -> None:
        client = AsyncServiceBusClient.from_connection_string(
            conn_str=info.connection_string, http_proxy=http_proxy_server.aio_http_proxy,
            **info.websocket_connection_string_kwargs)
        async with client:
            sender = client.get_queue_sender(queue_name=queue)
            async with sender:
                await sender.send_messages(ServiceBusMessage("Single Message"))

    asyncio.run(main())
    assert http_proxy_server.tunnels[("localhost", info.ws_port)] == opened + 1
    assert _received(info, queue) == ["Single Message"]
