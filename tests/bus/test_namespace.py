"""The bus layer against the emulator pair: cached senders and receivers that survive a detach and a broken
use, the process-wide namespaces of a configuration, and close_all."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage, ServiceBusReceiveMode, ServiceBusReceiver
from azure.servicebus.exceptions import ServiceBusError
from pairing import pair_config

from spark_sb import bus
from spark_sb.config import SparkSbConfig, load_config
from spark_sb.errors import is_message_not_found


@pytest.fixture
def config(primary: Any, secondary: Any) -> SparkSbConfig:
    return load_config(pair_config(primary, secondary, "bus", backlog_queue_count=1))


@pytest.fixture
def namespace(config: SparkSbConfig) -> Iterator[bus.Namespace]:
    ns = bus.Namespace("primary", config.primary, {"retry_total": 0})
    yield ns
    ns.close()


def _drain(connection_string: str, queue: str, expected: int, wait: float = 5.0) -> list[str]:
    bodies: list[str] = []
    with ServiceBusClient.from_connection_string(connection_string, retry_total=0) as client, \
            client.get_queue_receiver(queue, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as receiver:
        deadline = time.monotonic() + wait
        while len(bodies) < expected and time.monotonic() < deadline:
            bodies.extend(str(m) for m in receiver.receive_messages(max_message_count=50, max_wait_time=0.5))
    return bodies


def test_a_detach_never_closes_a_sender_under_a_running_send(namespace, make_queue, primary) -> None:
    q = make_queue()
    with namespace.sender(q) as old:
        assert namespace.detach() is True  # e.g. another thread saw the connection drop
        old.send_messages(ServiceBusMessage("sent through the detached generation"))
        assert namespace.wait_closed(time.monotonic() + 0.2) is False  # still held: not closed
    assert namespace.wait_closed(time.monotonic() + 5) is True  # closed once the send let go
    with namespace.sender(q) as new:
        assert new is not old
        new.send_messages(ServiceBusMessage("sent through the new generation"))
    assert sorted(_drain(primary.connection_string, q, 2)) == [
        "sent through the detached generation", "sent through the new generation"]


def test_a_dropped_sender_is_replaced_on_next_use(namespace, make_queue, primary) -> None:
    q = make_queue()
    with namespace.sender(q) as first:
        first.send_messages(ServiceBusMessage("one"))
    namespace.drop_sender(q)
    with namespace.sender(q) as second:
        assert second is not first
        second.send_messages(ServiceBusMessage("two"))
    with namespace.sender(q) as again:
        assert again is second  # cached until dropped
    assert sorted(_drain(primary.connection_string, q, 2)) == ["one", "two"]


def test_a_receiver_that_failed_is_replaced_and_the_next_use_receives(namespace, make_queue, primary) -> None:
    q = make_queue()
    with ServiceBusClient.from_connection_string(primary.connection_string) as client, \
            client.get_queue_sender(q) as sender:
        sender.send_messages(ServiceBusMessage("waiting"))
    with pytest.raises(RuntimeError, match="broken link"):
        with namespace.receiver(q) as first:
            raise RuntimeError("broken link")
    with namespace.receiver(q) as second:
        assert second is not first
        received = second.receive_messages(max_message_count=1, max_wait_time=5)
        assert [str(m) for m in received] == ["waiting"]
        second.complete_message(received[0])
    with namespace.receiver(q) as again:
        assert again is second  # cached while it works


def test_message_not_found_keeps_the_receiver_and_fails_fast_without_retries(config, make_queue) -> None:
    q = make_queue("secondary")
    ns = bus.shared_namespace(config, "secondary", retries=False)
    started = time.monotonic()
    with pytest.raises(Exception) as info:  # noqa: PT011 - the SDK's error, read through errors.py
        with ns.receiver(q) as first:
            first.receive_deferred_messages([123456])
    assert is_message_not_found(info.value)
    assert time.monotonic() - started < 3  # no SDK retries with backoff
    with ns.receiver(q) as again:
        assert again is first  # an answer about a message, not a broken link


def test_a_receive_and_delete_receiver_is_its_own_and_removes_what_it_receives(namespace, make_queue,
                                                                               primary) -> None:
    q = make_queue()
    with namespace.sender(q) as sender:
        sender.send_messages([ServiceBusMessage("a"), ServiceBusMessage("b")])
    got: list[str] = []
    with namespace.receiver(q, delete=True) as deleting, namespace.receiver(q) as locking:
        assert deleting is not locking
        deadline = time.monotonic() + 5
        while len(got) < 2 and time.monotonic() < deadline:
            got += [str(m) for m in deleting.receive_messages(max_message_count=2, max_wait_time=1)]
    assert sorted(got) == ["a", "b"]
    assert _drain(primary.connection_string, q, 1, wait=1.0) == []  # received and deleted: nothing came back


def test_one_user_at_a_time_per_entity(namespace, make_queue, primary) -> None:
    q = make_queue()
    inside = threading.Event()
    release = threading.Event()
    order: list[str] = []

    def hold() -> None:
        with namespace.sender(q) as sdk_sender:
            inside.set()
            release.wait(5)
            sdk_sender.send_messages(ServiceBusMessage("first"))
            order.append("first")

    holder = threading.Thread(target=hold)
    holder.start()
    assert inside.wait(5)
    second = threading.Thread(target=lambda: (namespace.ping(q), order.append("ping")))
    second.start()
    second.join(0.3)
    assert order == []  # the ping waits for the sender
    release.set()
    holder.join(5)
    second.join(5)
    assert order == ["first", "ping"]
    assert _drain(primary.connection_string, q, 2, wait=1.0) == ["first"]  # the ping never reaches anyone


def test_shared_namespace_is_one_per_configuration_side_and_retry_policy(primary, secondary) -> None:
    settings = pair_config(primary, secondary, "bus", backlog_queue_count=1)
    first, second = load_config(settings), load_config(dict(settings))
    shared = bus.shared_namespace(first, "primary")
    assert bus.shared_namespace(second, "primary") is shared  # equal configurations share the handles
    assert bus.shared_namespace(first, "primary", retries=False) is not shared
    assert bus.shared_namespace(first, "secondary") is not shared
    assert bus.shared_namespace(first, "secondary").namespace == first.secondary
    other = load_config({**settings, "send_availability": {**settings["send_availability"],
                                                           "failover_interval": "2s"}})
    assert bus.shared_namespace(other, "primary") is not shared


class _Closable:
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_close_all_closes_every_handle_and_the_next_use_opens_new_ones(config, make_queue, primary) -> None:
    q = make_queue()
    ns = bus.shared_namespace(config, "primary")
    with ns.sender(q) as sdk_sender:
        sdk_sender.send_messages(ServiceBusMessage("before"))
    thing = bus.shared("test-thing", "k", _Closable)
    assert bus.shared("test-thing", "k", _Closable) is thing
    board = bus.shared_board(("test-board",), lambda: bus.HealthBoard(
        failover_interval=1, ping_interval=1, backlog_cooldown=1, clock=time.monotonic))

    bus.close_all()

    assert thing.closed == 1
    with pytest.raises(RuntimeError, match="closed"):
        with ns.sender(q):
            pass
    assert ns.wait_closed(time.monotonic() + 1)  # nothing left open
    assert bus.shared_board(("test-board",), lambda: pytest.fail("entity health is kept")) is board
    again = bus.shared_namespace(config, "primary")
    assert again is not ns
    with again.sender(q) as sdk_sender:
        sdk_sender.send_messages(ServiceBusMessage("after"))
    assert sorted(_drain(primary.connection_string, q, 2)) == ["after", "before"]
    assert bus.shared("test-thing", "k", _Closable) is not thing
    bus.close_all("test-thing")
    assert thing.closed == 1  # closed once


def test_a_new_object_replaces_an_outdated_one_and_closes_it() -> None:
    old = bus.shared("test-replace", "k", _Closable)
    assert bus.shared("test-replace", "k", _Closable, replace_if=lambda current: False) is old
    new = bus.shared("test-replace", "k", _Closable, replace_if=lambda current: current is old)
    assert new is not old and old.closed == 1 and new.closed == 0
    bus.close_all("test-replace")
    assert new.closed == 1


def _listens_on_receiver_connections(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Record, for every pyamqp connection, how many threads are inside ``listen`` at once (each call held 20 ms
    longer, to widen a window two threads could share), which threads called it, and the connections the SDK's
    keep-alive thread listened on (the objects: kept alive, their ids are never reused)."""
    from azure.servicebus._pyamqp._connection import Connection

    seen: dict[str, Any] = {"most": 0, "threads": set(), "keep_alive": []}
    inside: dict[int, int] = {}
    guard = threading.Lock()
    listen = Connection.listen

    def counting_listen(self: Connection, *args: Any, **kwargs: Any) -> Any:
        with guard:
            inside[id(self)] = inside.get(id(self), 0) + 1
            seen["most"] = max(seen["most"], inside[id(self)])
            seen["threads"].add(threading.current_thread().name)
            if "_keep_alive" in threading.current_thread().name:
                seen["keep_alive"].append(self)
        try:
            time.sleep(0.02)
            return listen(self, *args, **kwargs)
        finally:
            with guard:
                inside[id(self)] -= 1

    monkeypatch.setattr(Connection, "listen", counting_listen)
    return seen


def test_one_thread_at_a_time_listens_on_a_receivers_connection(namespace, make_queue, emulator, primary,
                                                                  monkeypatch) -> None:
    """With prefetch 0 the SDK's keep-alive thread listens on a receiver's connection every 5 s beside the
    thread that receives; two threads processing one link's transfers built messages with each other's delivery
    tags, and a message whose own delivery was never settled came back a lock's duration late (docs/sizing.md, "A
    straggler, found and fixed"). The namespace's receivers keep the thread (it releases messages that reach an idle receiver)
    but never let it listen at the same time as the receiving thread, also on the connection the same SDK
    receiver opens again after its connection dropped."""
    queue = make_queue()
    seen = _listens_on_receiver_connections(monkeypatch)

    def connection(receiver: ServiceBusReceiver) -> Any:
        return receiver._handler._connection  # the pyamqp Connection the SDK receiver listens on now

    def receive_until_the_keep_alive_listens_on(receiver: ServiceBusReceiver, conn: Any) -> None:
        deadline = time.monotonic() + 60  # the keep-alive thread listens 5 s after opening, on a quiet machine
        while not any(c is conn for c in seen["keep_alive"]) and time.monotonic() < deadline:
            assert receiver.receive_messages(max_message_count=1, max_wait_time=0.3) == []
        assert any(c is conn for c in seen["keep_alive"])  # the SDK's thread listened on this connection...

    with namespace.receiver(queue) as receiver:
        first = connection(receiver)
        receive_until_the_keep_alive_listens_on(receiver, first)
        emulator.fault("primary", "down")  # the namespace drops every connection...
        emulator.heal("primary")  # ...and takes new ones at once
        failed = False
        deadline = time.monotonic() + 60
        while not failed and time.monotonic() < deadline:
            try:  # caught inside the block: the namespace keeps this SDK receiver
                assert receiver.receive_messages(max_message_count=1, max_wait_time=0.3) == []
            except ServiceBusError:  # retry_total=0: the SDK closed its handler and gives up this once
                failed = True
        assert failed
        # a next receive reopens it: the SDK calls _create_handler again, on a new connection (a receive whose
        # max_wait_time ran out while opening closes what it opened, and the next one opens anew)
        reopened = False
        deadline = time.monotonic() + 60
        while not reopened and time.monotonic() < deadline:
            try:
                assert receiver.receive_messages(max_message_count=1, max_wait_time=1) == []
                reopened = True
            except ServiceBusError:
                pass
        assert reopened
        second = connection(receiver)
        assert second is not first
        receive_until_the_keep_alive_listens_on(receiver, second)
    with namespace.receiver(queue) as again:
        assert again is receiver  # one SDK receiver throughout
    assert seen["most"] == 1  # ...never beside the receiving thread, on either connection


def test_a_message_reaching_an_idle_receiver_is_released_for_others(namespace, make_queue, primary) -> None:
    """A receive that returns empty-handed can leave link credit open; a message sent then reaches the idle
    cached receiver. The SDK's keep-alive thread releases it, so another receiver gets it well within its
    lock duration (60 s) instead of after it."""
    queue = make_queue()
    with namespace.receiver(queue) as idle:
        assert idle.receive_messages(max_message_count=5, max_wait_time=0.2) == []
    with ServiceBusClient.from_connection_string(primary.connection_string) as client:
        with client.get_queue_sender(queue) as sender:
            sender.send_messages(ServiceBusMessage("for whoever asks"))
        with client.get_queue_receiver(queue) as other:
            got: list[str] = []
            deadline = time.monotonic() + 30
            while not got and time.monotonic() < deadline:
                got = [str(m) for m in other.receive_messages(max_message_count=1, max_wait_time=1)]
            assert got == ["for whoever asks"]


@pytest.mark.parametrize("use", ["sender", "receiver"])
def test_a_rejected_credential_is_raised_at_once_naming_the_namespace(emulator, primary, make_queue, use) -> None:
    """The SDK marks an authentication error retryable and retries it for its whole policy (3 retries with its
    defaults, about 15 s): a wrong key was refused four times, on four connections, before the caller saw the SDK's
    "Service Bus has encountered an error". A handle of the bus raises CredentialRejectedError on the first refusal,
    naming the namespace, its host, the entity and the refusal, never the key."""
    import re

    from spark_sb.config import NamespaceConfig
    from spark_sb.errors import CredentialRejectedError, ErrorClass

    q = make_queue()
    wrong = re.sub(r"SharedAccessKey=[^;]*", "SharedAccessKey=d3Jvbmc=", primary.connection_string)
    ns = bus.Namespace("primary", NamespaceConfig(connection_string=wrong, admin_endpoint=primary.admin_url))
    server = emulator.server("primary")
    opened = server.call(lambda: server.stats()["connections_opened"])
    try:
        with pytest.raises(CredentialRejectedError) as refused:
            if use == "sender":
                with ns.sender(q) as sender:
                    sender.send_messages(ServiceBusMessage("never sent"))
            else:
                with ns.receiver(q) as receiver:
                    receiver.peek_messages(max_message_count=1)
    finally:
        ns.close()
    assert refused.value.error_class is ErrorClass.CONFIGURATION_CREDENTIAL and not refused.value.retryable
    assert str(refused.value).startswith(f"the primary namespace (localhost:{primary.amqp_port}) refused the "
                                         f"credential for {q!r}: 401 "), str(refused.value)
    assert "d3Jvbmc=" not in str(refused.value) and primary.key not in str(refused.value)
    assert server.call(lambda: server.stats()["connections_opened"]) - opened == 1
