"""Injected faults and rejected credentials, as the SDK surfaces them."""

from __future__ import annotations

import socket
import time

import pytest
from azure.core.credentials import AzureSasCredential
from azure.servicebus import ServiceBusClient, ServiceBusMessage, ServiceBusReceiveMode
from azure.servicebus.exceptions import (
    MessagingEntityDisabledError,
    MessagingEntityNotFoundError,
    OperationTimeoutError,
    ServiceBusAuthenticationError,
    ServiceBusAuthorizationError,
    ServiceBusConnectionError,
    ServiceBusQuotaExceededError,
    ServiceBusServerBusyError,
)

from spark_sb.emulator import fault, heal
from spark_sb.emulator.sas import make_token

EXPECTED = {
    "busy": ServiceBusServerBusyError,
    "disabled": MessagingEntityDisabledError,
    "notfound": MessagingEntityNotFoundError,
    "quota": ServiceBusQuotaExceededError,
    "down": ServiceBusConnectionError,
    "unauthorized": (ServiceBusAuthenticationError, ServiceBusAuthorizationError),
}


def _send(conn_str: str, queue: str, body: str = "x", timeout: float | None = None) -> None:
    with ServiceBusClient.from_connection_string(conn_str, retry_total=0) as c:
        with c.get_queue_sender(queue) as s:
            s.send_messages(ServiceBusMessage(body), timeout=timeout)


def _drain(conn_str: str, queue: str) -> list[str]:
    with ServiceBusClient.from_connection_string(conn_str, retry_total=0) as c:
        with c.get_queue_receiver(queue, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as r:
            return [str(m) for m in r.receive_messages(max_message_count=100, max_wait_time=2)]


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_each_namespace_fault_surfaces_as_the_services_exception(emulator, primary, make_queue, kind) -> None:
    q = make_queue()
    emulator.fault("primary", kind)
    with pytest.raises(EXPECTED[kind]):
        _send(primary.connection_string, q, "during-fault")
    emulator.heal("primary")
    _send(primary.connection_string, q, "after-heal")
    assert _drain(primary.connection_string, q) == ["after-heal"]  # nothing half-stored by the fault


def test_timeout_fault_never_answers_and_stores_nothing(emulator, primary, make_queue) -> None:
    q = make_queue()
    emulator.fault("primary", "timeout", entity=q)
    started = time.monotonic()
    with pytest.raises(OperationTimeoutError):
        _send(primary.connection_string, q, "unanswered", timeout=2)
    assert time.monotonic() - started < 20
    emulator.heal("primary", entity=q)
    _send(primary.connection_string, q, "answered")
    assert _drain(primary.connection_string, q) == ["answered"]


@pytest.mark.parametrize("scope", ["entity", "namespace"])
def test_ack_lost_stores_the_message_but_the_send_times_out(emulator, primary, make_queue, scope) -> None:
    q = make_queue()
    emulator.fault("primary", "ack-lost", entity=q if scope == "entity" else None)
    started = time.monotonic()
    with ServiceBusClient.from_connection_string(primary.connection_string, retry_total=0, try_timeout=1) as c:
        with c.get_queue_sender(q) as s:
            with pytest.raises(OperationTimeoutError):
                s.send_messages(ServiceBusMessage("stored-unanswered", message_id="m-ack-lost"))
    assert time.monotonic() - started < 10
    # the duplicate-reception hazard: the sender saw a failure, yet a receiver gets the message (during the
    # fault, and it is still there, once, after healing answers the held delivery with an error)
    assert _drain(primary.connection_string, q) == ["stored-unanswered"]
    emulator.heal("primary")
    _send(primary.connection_string, q, "answered")
    assert _drain(primary.connection_string, q) == ["answered"]


def test_ack_lost_is_accepted_over_the_admin_port(primary, make_queue) -> None:
    q = make_queue()
    assert fault(primary.admin_url, "ack-lost", entity=q)["kind"] == "ack-lost"
    with pytest.raises(OperationTimeoutError):
        _send(primary.connection_string, q, "stored", timeout=0.5)
    heal(primary.admin_url, entity=q)
    assert _drain(primary.connection_string, q) == ["stored"]


def test_entity_fault_leaves_other_entities_working(emulator, primary, make_queue) -> None:
    broken, fine = make_queue(), make_queue()
    emulator.fault("primary", "busy", entity=broken)
    with pytest.raises(ServiceBusServerBusyError):
        _send(primary.connection_string, broken)
    _send(primary.connection_string, fine, "ok")
    assert _drain(primary.connection_string, fine) == ["ok"]


def test_fault_with_duration_heals_by_itself(emulator, primary, make_queue) -> None:
    """A fault of 3 s (of 0.5 s, a loaded make test's first send opened its connection after the fault had healed),
    then sends until one goes through, without a heal."""
    q = make_queue()
    emulator.fault("primary", "disabled", entity=q, duration=3)
    with pytest.raises(MessagingEntityDisabledError):
        _send(primary.connection_string, q)
    deadline = time.monotonic() + 30
    while True:
        try:
            _send(primary.connection_string, q, "healed")
            break
        except MessagingEntityDisabledError:
            assert time.monotonic() < deadline, "the fault did not heal by itself"
            time.sleep(0.5)
    assert _drain(primary.connection_string, q) == ["healed"]


def test_fault_and_heal_over_the_admin_port_as_the_cli_does(primary, make_queue) -> None:
    q = make_queue()
    result = fault(primary.admin_url, "busy", entity=q)
    assert result["kind"] == "busy"
    with pytest.raises(ServiceBusServerBusyError):
        _send(primary.connection_string, q)
    heal(primary.admin_url, entity=q)
    _send(primary.connection_string, q, "ok")
    with pytest.raises(RuntimeError, match="kind must be one of"):
        fault(primary.admin_url, "meltdown")


def test_a_wrong_key_is_rejected(primary, make_queue) -> None:
    q = make_queue()
    wrong = primary.connection_string.replace("SAS_KEY_VALUE", "not-the-key")
    with pytest.raises((ServiceBusAuthenticationError, ServiceBusAuthorizationError)) as info:
        _send(wrong, q)
    assert "not-the-key" not in str(info.value)
    assert _drain(primary.connection_string, q) == []


def test_an_expired_token_is_rejected_and_a_valid_one_accepted(primary, make_queue) -> None:
    q = make_queue()
    resource = f"sb://localhost:{primary.amqp_port}/{q}"
    endpoint = f"localhost:{primary.amqp_port}"
    expired = AzureSasCredential(make_token(resource, primary.key_name, primary.key, ttl=-60))
    with ServiceBusClient(endpoint, expired, retry_total=0, use_tls=False) as c:
        with pytest.raises((ServiceBusAuthenticationError, ServiceBusAuthorizationError)):
            with c.get_queue_sender(q) as s:
                s.send_messages(ServiceBusMessage("x"))
    valid = AzureSasCredential(make_token(resource, primary.key_name, primary.key, ttl=600))
    with ServiceBusClient(endpoint, valid, retry_total=0, use_tls=False) as c:
        with c.get_queue_sender(q) as s:
            s.send_messages(ServiceBusMessage("signed"))
    assert _drain(primary.connection_string, q) == ["signed"]


def test_garbage_on_the_socket_does_not_hurt_other_clients(primary, make_queue) -> None:
    q = make_queue()
    for junk in (b"GET / HTTP/1.1\r\n\r\n", b"AMQP\x00\x01\x00\x00" + b"\xff" * 64, b"\x00" * 8):
        with socket.create_connection(("127.0.0.1", primary.amqp_port), timeout=5) as sock:
            sock.sendall(junk)
            sock.settimeout(2)
            try:
                sock.recv(1024)
            except (TimeoutError, ConnectionResetError):
                pass
    _send(primary.connection_string, q, "still-serving")
    assert _drain(primary.connection_string, q) == ["still-serving"]


def test_a_token_for_another_namespace_on_the_same_host_is_rejected(primary, secondary, make_queue) -> None:
    q = make_queue()
    # same host, same key name and key (the emulator's development key), another port: the secondary's token
    for_secondary = make_token(f"sb://localhost:{secondary.amqp_port}", secondary.key_name, secondary.key, ttl=600)
    endpoint = f"localhost:{primary.amqp_port}"
    with ServiceBusClient(endpoint, AzureSasCredential(for_secondary), retry_total=0, use_tls=False) as c:
        with pytest.raises((ServiceBusAuthenticationError, ServiceBusAuthorizationError)):
            with c.get_queue_sender(q) as s:
                s.send_messages(ServiceBusMessage("x"))
    assert _drain(primary.connection_string, q) == []
    # the primary's own namespace-wide token still opens it
    for_primary = make_token(f"sb://localhost:{primary.amqp_port}", primary.key_name, primary.key, ttl=600)
    with ServiceBusClient(endpoint, AzureSasCredential(for_primary), retry_total=0, use_tls=False) as c:
        with c.get_queue_sender(q) as s:
            s.send_messages(ServiceBusMessage("signed"))
    assert _drain(primary.connection_string, q) == ["signed"]
