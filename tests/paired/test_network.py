"""The namespaces' network options (``transport``, ``custom_endpoint_address``, ``http_proxy``,
``connection_verify``) with the real SDK against the emulator: the paired sender through an outage and the syphon
core, over the emulator's TLS endpoint (AMQPS) and over AMQP over WebSockets with TLS, trusting its CA."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage, ServiceBusReceiveMode

from spark_sb.bus import close_all
from spark_sb.config import load_config
from spark_sb.emulator import Emulator, NamespaceOptions
from spark_sb.emulator.model import QueueSpec
from spark_sb.errors import ConfigError
from spark_sb.paired import PRIMARY, PairedSender
from spark_sb.syphon import Syphon


@pytest.fixture(scope="module")
def tls_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    with Emulator([NamespaceOptions("primary"), NamespaceOptions("secondary")], tls=True, websockets=True,
                  data_dir=tmp_path_factory.mktemp("tls-emulator")) as emu:
        yield emu
    close_all()


def _queue(emu: Emulator, namespace: str = "primary") -> str:
    name = f"net-{uuid.uuid4().hex[:10]}"
    server = emu.server(namespace)
    server.call(lambda: server.broker.create_entity(QueueSpec(name=name)))
    return name


def _over_tls(emu: Emulator, side: str, transport: str = "amqp", **options: Any) -> dict[str, Any]:
    """An emulator connection string, its CA, and its AMQPS port (``amqp``) or WebSocket-over-TLS port."""
    info = emu[side]
    port = info.tls_port if transport == "amqp" else info.wss_port
    return {"connection_string": info.connection_string, "admin_endpoint": info.admin_url, "transport": transport,
            "custom_endpoint_address": f"sb://localhost:{port}", "connection_verify": info.ca_file, **options}


def _config(emu: Emulator, transport: str = "amqp", **primary: Any) -> dict[str, Any]:
    return {"primary": _over_tls(emu, "primary", transport, **primary),
            "secondary": _over_tls(emu, "secondary", transport),
            "send_availability": {"backlog_prefix": f"net-{uuid.uuid4().hex[:8]}", "backlog_queue_count": 2,
                                  "failover_interval": "0s", "primary_try_timeout": "5s"},
            "syphon": {"retry_interval": "1s"}}


def _drain(emu: Emulator, side: str, queue: str, expected: int) -> list[str]:
    """Receive-and-delete over the plain port with the SAS string (independent of the code under test)."""
    out: list[str] = []
    with ServiceBusClient.from_connection_string(emu[side].connection_string, retry_total=0) as client:
        with client.get_queue_receiver(queue, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as receiver:
            for _ in range(20):
                out.extend(str(m) for m in receiver.receive_messages(max_message_count=100, max_wait_time=0.3))
                if len(out) >= expected:
                    break
            out.extend(str(m) for m in receiver.receive_messages(max_message_count=100, max_wait_time=0.2))
    return out


@pytest.mark.parametrize("transport", ["amqp", "websockets"])
def test_the_paired_sender_and_the_syphon_over_the_emulators_tls_endpoints(tls_emulator: Emulator,
                                                                          transport: str) -> None:
    """An emulator connection string with ``connection_verify`` (the emulator's CA) and its AMQPS or
    WebSocket-over-TLS port as the custom endpoint: sends, the failover to the secondary's backlog and the
    syphon's moves all go over TLS."""
    emu = tls_emulator
    entity = _queue(emu)
    config = load_config(_config(emu, transport))
    assert config.primary.use_tls and config.primary.is_emulator
    with PairedSender.from_config(config) as producer:
        assert producer.pair() == 2
        for i in range(3):
            assert producer.send(entity, ServiceBusMessage(f"m{i}", message_id=f"m{i}")).destination == PRIMARY
        emu.fault("primary", "down")
        try:
            for i in range(3, 6):
                assert producer.send(entity, ServiceBusMessage(f"m{i}", message_id=f"m{i}")).destination != PRIMARY
        finally:
            emu.heal("primary")
    with Syphon.from_config(config) as syphon:
        summary = syphon.run_once(max_wait_time=0.5)
    assert summary.total_moved == 3 and summary.total_dead_lettered == 0
    assert sorted(_drain(emu, "primary", entity, 6)) == [f"m{i}" for i in range(6)]


def test_a_ca_bundle_that_is_not_there_is_named_before_anything_is_sent(tls_emulator: Emulator,
                                                                        tmp_path: Any) -> None:
    emu = tls_emulator
    entity = _queue(emu)
    missing = str(tmp_path / "no-such-ca.pem")
    config = load_config(_config(emu, connection_verify=missing))
    with PairedSender.from_config(config) as producer:
        with pytest.raises(ConfigError, match="connection_verify") as caught:
            producer.send(entity, ServiceBusMessage("never", message_id="never"))
    assert missing in str(caught.value)
    assert emu.server("primary").call(lambda: emu.server("primary").broker.runtime_counts(entity)).total == 0


def test_without_the_ca_the_emulators_certificate_is_refused(tls_emulator: Emulator) -> None:
    """TLS is verified: with a CA bundle that did not sign the emulator's certificate (the system's), the
    handshake fails and nothing is sent."""
    import certifi

    emu = tls_emulator
    entity = _queue(emu)
    config = load_config(_config(emu, connection_verify=certifi.where()))
    with config.primary.client(retry_total=0) as client:
        with pytest.raises(Exception, match="(?i)certificate verify failed"):
            with client.get_queue_sender(entity) as sender:
                sender.send_messages(ServiceBusMessage("never", message_id="never"))
    assert emu.server("primary").call(lambda: emu.server("primary").broker.runtime_counts(entity)).total == 0
