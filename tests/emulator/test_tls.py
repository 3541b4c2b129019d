"""AMQPS on the emulator, with the real SDK: clients built from a namespace and a credential (always TLS) send,
receive, settle and call the management link through the emulator's TLS endpoint; the CA it makes is what a
client must trust, and how it can; outages drop TLS clients too; certificates survive restarts; bad input is
named."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import certifi
import pytest
from azure.core.credentials import AzureNamedKeyCredential, AzureSasCredential
from azure.servicebus import ServiceBusClient, ServiceBusMessage, ServiceBusReceiveMode
from azure.servicebus.exceptions import ServiceBusConnectionError
from cryptography import x509

from spark_sb.emulator import Emulator, NamespaceInfo, NamespaceOptions
from spark_sb.emulator import tls as emulator_tls
from spark_sb.emulator.aad import AadOptions
from spark_sb.emulator.model import QueueSpec
from spark_sb.emulator.sas import make_token
from spark_sb.emulator.server import DEFAULT_KEY, DEFAULT_KEY_NAME

HEADER = f"identity-header-{uuid.uuid4().hex}"
_AZURE_ENV = ("AZURE_CLIENT_ID", "AZURE_TENANT_ID", "AZURE_CLIENT_SECRET", "AZURE_CLIENT_CERTIFICATE_PATH",
              "AZURE_FEDERATED_TOKEN_FILE", "AZURE_USERNAME", "MSI_ENDPOINT", "MSI_SECRET", "IMDS_ENDPOINT",
              "IDENTITY_SERVER_THUMBPRINT")


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    with Emulator([NamespaceOptions("secure", tls_port=0), NamespaceOptions("plain")],
                  data_dir=tmp_path_factory.mktemp("tls"), entra_id=True,
                  aad=AadOptions(identity_header=HEADER)) as emulator:
        yield emulator


@pytest.fixture
def secure(emu: Emulator) -> Iterator[NamespaceInfo]:
    yield emu["secure"]
    emu.heal("secure")


@pytest.fixture
def queue(emu: Emulator) -> str:
    name = f"tls-{uuid.uuid4().hex[:10]}"
    server = emu.server("secure")
    server.call(lambda: server.broker.create_entity(QueueSpec(name=name)))
    return name


def _credential(kind: str, queue: str) -> Any:
    if kind == "named-key":
        return AzureNamedKeyCredential(DEFAULT_KEY_NAME, DEFAULT_KEY)
    # a SAS token for the queue alone, as a service would hand one out
    return AzureSasCredential(make_token(f"sb://localhost/{queue}", DEFAULT_KEY_NAME, DEFAULT_KEY))


def _client(info: NamespaceInfo, credential: Any, **kwargs: Any) -> ServiceBusClient:
    options = {**info.tls_client_kwargs, **kwargs}
    return ServiceBusClient("localhost", credential, retry_total=0, **options)


def _send_and_receive(client: ServiceBusClient, queue: str, body: str) -> list[str]:
    with client.get_queue_sender(queue) as sender:
        sender.send_messages(ServiceBusMessage(body))
    with client.get_queue_receiver(queue, max_wait_time=5, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) \
            as receiver:
        return [str(m) for m in receiver.receive_messages(max_message_count=10, max_wait_time=5)]


def _round_trip(client: ServiceBusClient, queue: str, body: str) -> None:
    """Send, peek, receive, renew the lock, complete: what a user of the samples does."""
    with client.get_queue_sender(queue) as sender:
        sender.send_messages(ServiceBusMessage(body, message_id=body))
    with client.get_queue_receiver(queue, max_wait_time=5) as receiver:
        assert [str(m) for m in receiver.peek_messages(max_message_count=5)] == [body]
        got = receiver.receive_messages(max_message_count=1, max_wait_time=5)
        assert [str(m) for m in got] == [body]
        locked_until = got[0].locked_until_utc
        assert receiver.renew_message_lock(got[0]) >= locked_until
        receiver.complete_message(got[0])
        assert receiver.peek_messages(max_message_count=5) == []


# --- the credential-based clients ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["named-key", "sas"])
def test_credential_clients_send_receive_renew_and_complete_over_tls(secure, queue, kind) -> None:
    with _client(secure, _credential(kind, queue)) as client:
        _round_trip(client, queue, f"{kind}-sync")


def test_async_credential_clients_send_receive_renew_and_complete_over_tls(emu, secure) -> None:
    from azure.servicebus.aio import ServiceBusClient as AsyncClient

    async def run(kind: str) -> list[str]:
        queue = f"tls-async-{kind}-{uuid.uuid4().hex[:6]}"
        server = emu.server("secure")
        server.call(lambda: server.broker.create_entity(QueueSpec(name=queue)))
        body = f"{kind}-async"
        async with AsyncClient("localhost", _credential(kind, queue), retry_total=0,
                               **secure.tls_client_kwargs) as client:
            async with client.get_queue_sender(queue) as sender:
                await sender.send_messages(ServiceBusMessage(body))
            async with client.get_queue_receiver(queue, max_wait_time=5) as receiver:
                peeked = [str(m) for m in await receiver.peek_messages(max_message_count=5)]
                got = await receiver.receive_messages(max_message_count=1, max_wait_time=5)
                await receiver.renew_message_lock(got[0])
                await receiver.complete_message(got[0])
                left = await receiver.peek_messages(max_message_count=5)
        return [*peeked, *(str(m) for m in got), str(len(left))]

    async def both() -> list[list[str]]:
        return list(await asyncio.gather(run("named-key"), run("sas")))

    assert asyncio.run(both()) == [["named-key-async"] * 2 + ["0"], ["sas-async"] * 2 + ["0"]]


def test_a_managed_identity_credential_works_over_tls(emu, secure, queue, monkeypatch) -> None:
    from azure.identity import ManagedIdentityCredential

    for name in _AZURE_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("IDENTITY_ENDPOINT", secure.identity_endpoint)  # plain HTTP, the emulator's admin port
    monkeypatch.setenv("IDENTITY_HEADER", HEADER)
    with _client(secure, ManagedIdentityCredential()) as client:
        _round_trip(client, queue, "entra-id")


# --- trusting the CA -------------------------------------------------------------------------------------------


def test_without_the_ca_the_client_fails_at_once_with_a_certificate_error(secure, queue, monkeypatch) -> None:
    # SSL_CERT_FILE does not help: the SDK always loads connection_verify or certifi's bundle, never the
    # system's default paths
    monkeypatch.setenv("SSL_CERT_FILE", secure.ca_file)
    options = {k: v for k, v in secure.tls_client_kwargs.items() if k != "connection_verify"}
    started = time.monotonic()
    with pytest.raises(ServiceBusConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        with ServiceBusClient("localhost", _credential("named-key", queue), retry_total=0, **options) as client:
            with client.get_queue_sender(queue) as sender:
                sender.send_messages(ServiceBusMessage("never"))
    assert time.monotonic() - started < 10


def test_the_ca_can_be_trusted_through_an_ssl_context_or_the_certifi_bundle(secure, queue, tmp_path,
                                                                            monkeypatch) -> None:
    context = ssl.create_default_context(cafile=secure.ca_file)
    assert context.check_hostname and context.verify_mode == ssl.CERT_REQUIRED
    with _client(secure, _credential("named-key", queue), ssl_context=context) as client:
        with client.get_queue_sender(queue) as sender:
            sender.send_messages(ServiceBusMessage("ssl-context"))

    # appending the CA to the environment's certifi bundle (here a copy: the test leaves the venv alone)
    bundle = tmp_path / "cacert.pem"
    bundle.write_text(Path(certifi.where()).read_text() + "\n" + Path(secure.ca_file).read_text())
    monkeypatch.setattr(certifi, "where", lambda: str(bundle))
    options = {k: v for k, v in secure.tls_client_kwargs.items() if k != "connection_verify"}
    with ServiceBusClient("localhost", _credential("named-key", queue), retry_total=0, **options) as client:
        assert _send_and_receive(client, queue, "certifi-bundle") == ["ssl-context", "certifi-bundle"]


@pytest.mark.parametrize("name", ["localhost", "127.0.0.1"])
def test_the_certificate_names_the_loopback_host_and_hostname_checks_stay_on(secure, name) -> None:
    context = ssl.create_default_context(cafile=secure.ca_file)
    with socket.create_connection(("127.0.0.1", secure.tls_port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname=name) as tls_sock:
            assert tls_sock.version() in ("TLSv1.2", "TLSv1.3")
    with socket.create_connection(("127.0.0.1", secure.tls_port), timeout=5) as raw:
        with pytest.raises(ssl.SSLCertVerificationError, match="[Hh]ostname mismatch"):
            context.wrap_socket(raw, server_hostname="mynamespace.servicebus.windows.net")


def test_the_ca_vouches_for_the_emulators_names_only(secure) -> None:
    ca = x509.load_pem_x509_certificate(Path(secure.ca_file).read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    constraints = ca.extensions.get_extension_for_class(x509.NameConstraints)
    assert constraints.critical
    permitted = {str(n.value) for n in constraints.value.permitted_subtrees or []}
    assert permitted == {"localhost", "127.0.0.1/32", "::1/128"}
    assert not (Path(secure.ca_file).parent / "ca.key").exists()  # its key was never stored


# --- outages ---------------------------------------------------------------------------------------------------


def test_an_outage_closes_an_idle_tls_connection_at_once(emu, secure) -> None:
    context = ssl.create_default_context(cafile=secure.ca_file)
    with socket.create_connection(("127.0.0.1", secure.tls_port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="localhost") as conn:
            conn.sendall(b"AMQP\x03\x01\x00\x00")  # SASL: the namespace answers with its own header
            assert conn.recv(8) == b"AMQP\x03\x01\x00\x00"
            emu.fault("secure", "down")
            try:
                started = time.monotonic()
                rest = b""
                while chunk := conn.recv(4096):  # the mechanisms frame, then the end of the stream
                    rest += chunk
            finally:
                emu.heal("secure")
    assert time.monotonic() - started < 3


def test_an_outage_drops_tls_clients_and_they_reconnect_after_heal(emu, secure, queue) -> None:
    with _client(secure, _credential("named-key", queue)) as client:
        with client.get_queue_sender(queue) as sender:
            sender.send_messages(ServiceBusMessage("before"))
            emu.fault("secure", "down")
            started = time.monotonic()
            with pytest.raises(ServiceBusConnectionError):
                sender.send_messages(ServiceBusMessage("during"))
            assert time.monotonic() - started < 10
            emu.heal("secure")
            deadline = time.monotonic() + 10
            while True:  # the SDK reopens its connection on the next call
                try:
                    sender.send_messages(ServiceBusMessage("after"))
                    break
                except ServiceBusConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
        with client.get_queue_receiver(queue, max_wait_time=2) as receiver:
            bodies = [str(m) for m in receiver.receive_messages(max_message_count=10, max_wait_time=3)]
    assert bodies == ["before", "after"]


# --- lifecycle -------------------------------------------------------------------------------------------------


def _tls_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "sb-emulator-tls"]


def test_certificates_are_reused_across_a_restart_and_stop_leaves_nothing_open(tmp_path) -> None:
    before = len(_tls_threads())
    emulator = Emulator([NamespaceOptions("p", tls_port=0)], data_dir=tmp_path)
    with emulator:
        info = emulator["p"]
        ca_pem = Path(info.ca_file).read_bytes()
        assert info.ca_file == str(tmp_path.absolute() / "tls" / "ca.pem")
        server = emulator.server("p")
        server.call(lambda: server.broker.create_entity(QueueSpec(name="q")))
        client = _client(info, _credential("named-key", "q"))
        port = info.tls_port
        # a connection still open at stop is closed with the emulator
        sender = client.get_queue_sender("q")
        sender.send_messages([ServiceBusMessage("1"), ServiceBusMessage("2")])
    assert len(_tls_threads()) == before
    with socket.socket() as probe:  # the TLS port is free again
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))
    sender.close()
    client.close()

    with Emulator([NamespaceOptions("p", tls_port=0)], data_dir=tmp_path) as again:
        assert Path(again["p"].ca_file).read_bytes() == ca_pem  # what the user trusted still works
        with _client(again["p"], _credential("named-key", "q")) as client:
            with client.get_queue_receiver("q", max_wait_time=3) as receiver:
                assert sorted(str(m) for m in receiver.receive_messages(max_message_count=5, max_wait_time=3)) \
                    == ["1", "2"]


def test_a_namespace_without_tls_has_no_tls_port(emu) -> None:
    plain = emu["plain"]
    assert plain.tls_port is None and plain.ca_file is None
    assert emu.server("plain").tls_port is None
    with pytest.raises(ValueError, match="'plain' has no TLS port"):
        plain.tls_client_kwargs  # noqa: B018


def test_without_a_data_dir_the_certificates_live_in_a_temporary_directory_removed_at_stop() -> None:
    with Emulator([NamespaceOptions("p")], tls=True) as emulator:
        ca_file = Path(emulator["p"].ca_file)
        assert ca_file.exists() and emulator["p"].tls_port
    assert not ca_file.parent.exists()


def test_expiring_or_missing_certificates_are_made_again(tmp_path) -> None:
    first = emulator_tls.ensure_certificates(tmp_path)
    ca_pem = first.ca_file.read_bytes()
    assert emulator_tls.ensure_certificates(tmp_path).ca_file.read_bytes() == ca_pem
    later = time.time() + (emulator_tls.VALIDITY - emulator_tls.RENEW_BEFORE).total_seconds() + 3600
    renewed = emulator_tls.ensure_certificates(tmp_path, clock=lambda: later)
    assert renewed.ca_file.read_bytes() != ca_pem
    ca = x509.load_pem_x509_certificate(renewed.ca_file.read_bytes())
    assert ca.not_valid_after_utc.timestamp() > later + 300 * 86400
    renewed_pem = renewed.ca_file.read_bytes()
    renewed.key_file.unlink()
    again = emulator_tls.ensure_certificates(tmp_path)
    assert again.key_file.exists() and again.ca_file.read_bytes() != renewed_pem
    # a host the certificate does not name yet makes a new one that does
    wider = emulator_tls.ensure_certificates(tmp_path, [*emulator_tls.certificate_hosts("127.0.0.1"), "emu.test"])
    cert = x509.load_pem_x509_certificate(wider.cert_file.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "emu.test" in names.get_values_for_type(x509.DNSName)


# --- bad input -------------------------------------------------------------------------------------------------


def test_a_corrupt_certificate_file_is_made_again_with_a_warning_naming_it(tmp_path, caplog) -> None:
    certs = emulator_tls.ensure_certificates(tmp_path / "tls")
    certs.cert_file.write_text("-----BEGIN CERTIFICATE-----\nnot a certificate\n-----END CERTIFICATE-----\n")
    with caplog.at_level(logging.WARNING, logger="spark_sb.emulator.tls"):
        with Emulator([NamespaceOptions("p", tls_port=0)], data_dir=tmp_path) as emulator:
            server = emulator.server("p")
            server.call(lambda: server.broker.create_entity(QueueSpec(name="q")))
            with _client(emulator["p"], _credential("named-key", "q")) as client:
                with client.get_queue_sender("q") as sender:
                    sender.send_messages(ServiceBusMessage("works"))
    assert any(str(certs.cert_file) in r.getMessage() for r in caplog.records)


def test_a_taken_tls_port_is_a_clear_error_naming_it(tmp_path) -> None:
    before = len(_tls_threads())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"namespace p: cannot listen for AMQPS \\(TLS\\) on 127.0.0.1:{port}"):
            Emulator([NamespaceOptions("p", tls_port=port)]).start()
        result = subprocess.run(
            [sys.executable, "-m", "spark_sb.cli", "emulator", "start", "--in-memory", "--tls",
             "--namespace", f"p=0:0:{port}"], capture_output=True, text=True, timeout=30)
    assert len(_tls_threads()) == before
    assert result.returncode == 2
    assert f"127.0.0.1:{port}" in result.stderr and "AMQPS" in result.stderr
    assert "Traceback" not in result.stderr
