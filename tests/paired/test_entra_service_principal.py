"""The product with a service principal, against the emulator with the real SDK and the real azure-identity:
``fully_qualified_namespace`` + ``credential: {type: client_secret, authority, connection_verify}`` +
``emulator: true``. azure-identity's ``ClientSecretCredential`` gets its tokens from the emulator's Entra ID
authority (https, the emulator's CA); the paired sender provisions its backlog queues (the admin API with a Bearer
token), sends, fails over and the syphon moves the backlog home. A wrong secret is a clear error naming the
credential, never the secret."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage, ServiceBusReceiveMode

from spark_sb.admin import admin_client
from spark_sb.bus import close_all
from spark_sb.config import CredentialConfig, from_options, load_config
from spark_sb.emulator import Emulator, NamespaceOptions
from spark_sb.emulator.aad import OWNER_ROLE, SENDER_ROLE, TENANT_ID, AadOptions, App
from spark_sb.emulator.model import QueueSpec
from spark_sb.errors import ConfigError, CredentialRejectedError, PairingError
from spark_sb.paired import PRIMARY, PairedSender
from spark_sb.syphon import Syphon

OWNER_APP, OWNER_SECRET = "writer-app", f"owner-secret-{uuid.uuid4().hex}"
SENDER_APP, SENDER_SECRET = "sender-app", f"sender-secret-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def sp_emulator() -> Iterator[Emulator]:
    """Two namespaces on plain AMQP and the Entra ID authority (https) on a free port, knowing ``writer-app``
    (Data Owner) and ``sender-app`` (Data Sender only)."""
    options = AadOptions(apps=(App(OWNER_APP, OWNER_SECRET, (OWNER_ROLE,)),
                               App(SENDER_APP, SENDER_SECRET, (SENDER_ROLE,))))
    with Emulator([NamespaceOptions("primary"), NamespaceOptions("secondary")], entra_id=True, aad=options,
                  authority_port=0) as emu:
        yield emu
    close_all()


def _credential(emu: Emulator, client_id: str = OWNER_APP, secret: str = OWNER_SECRET) -> dict[str, Any]:
    info = emu["primary"]
    return {"type": "client_secret", "tenant_id": TENANT_ID, "client_id": client_id, "client_secret": secret,
            "authority": info.authority_url, "connection_verify": info.ca_file}


def _namespace(emu: Emulator, side: str, credential: dict[str, Any]) -> dict[str, Any]:
    info = emu[side]
    return {"fully_qualified_namespace": f"localhost:{info.amqp_port}", "emulator": True,
            "admin_endpoint": info.admin_url, "credential": credential}


def _config(emu: Emulator, primary: dict | None = None, secondary: dict | None = None) -> dict[str, Any]:
    return {"primary": _namespace(emu, "primary", primary or _credential(emu)),
            "secondary": _namespace(emu, "secondary", secondary or _credential(emu)),
            "send_availability": {"backlog_prefix": f"sp-{uuid.uuid4().hex[:8]}", "backlog_queue_count": 2,
                                  "failover_interval": "0s", "primary_try_timeout": "2s"},
            "syphon": {"retry_interval": "1s"}}


def _queue(emu: Emulator) -> str:
    name = f"sp-{uuid.uuid4().hex[:10]}"
    server = emu.server("primary")
    server.call(lambda: server.broker.create_entity(QueueSpec(name=name)))
    return name


def _drain(emu: Emulator, queue: str, expected: int, wait: float = 5.0) -> list[str]:
    """Receive-and-delete on the primary with a SAS connection string (independent of the code under test)."""
    out: list[str] = []
    with ServiceBusClient.from_connection_string(emu["primary"].connection_string, retry_total=0) as client:
        with client.get_queue_receiver(queue, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as receiver:
            deadline = time.monotonic() + wait
            while len(out) < expected and time.monotonic() < deadline:
                out.extend(str(m) for m in receiver.receive_messages(max_message_count=100, max_wait_time=0.5))
    return out


def test_the_paired_sender_and_the_syphon_run_on_a_service_principal(sp_emulator) -> None:
    """credential type client_secret on both namespaces: pairing provisions the backlog queues on the secondary,
    sends reach the primary, an outage parks messages in the backlog, the syphon moves them home; every token
    came from the emulator's authority."""
    emu = sp_emulator
    entity = _queue(emu)
    before = emu.authority.issued_for(OWNER_APP)
    config = load_config(_config(emu))
    with PairedSender.from_config(config) as producer:
        assert producer.pair() == 2
        for i in range(4):
            assert producer.send(entity, ServiceBusMessage(f"m{i}", message_id=f"m{i}")).destination == PRIMARY
        emu.fault("primary", "down")
        try:
            for i in range(4, 8):
                assert producer.send(entity, ServiceBusMessage(f"m{i}", message_id=f"m{i}")).destination != PRIMARY
        finally:
            emu.heal("primary")
    assert emu.authority.issued_for(OWNER_APP) > before
    with Syphon.from_config(config) as syphon:
        assert syphon.run_once(max_wait_time=0.5).total_moved == 4
    assert sorted(_drain(emu, entity, 8)) == [f"m{i}" for i in range(8)]


def test_provisioning_with_the_products_admin_client(sp_emulator) -> None:
    """The credential the configuration builds, given to spark_sb.admin.admin_client: queues created and read."""
    emu = sp_emulator
    namespace = load_config(_config(emu)).secondary
    name = f"sp-admin-{uuid.uuid4().hex[:8]}"
    with admin_client(fully_qualified_namespace=namespace.fully_qualified_namespace,
                      credential=namespace.credential(), use_tls=False, admin_endpoint=namespace.admin_endpoint,
                      retry_total=0) as admin:
        admin.create_queue(name, lock_duration="PT45S")
        assert admin.get_queue(name).lock_duration.total_seconds() == 45


def test_a_wrong_secret_is_a_clear_error_naming_the_credential(sp_emulator, caplog) -> None:
    """Pairing with a wrong secret fails naming the app and the credential's refusal (AADSTS7000215); sending with
    one is CredentialRejectedError naming the namespace; nothing reaches the primary, the secret is nowhere."""
    emu = sp_emulator
    entity = _queue(emu)
    wrong = f"wrong-secret-{uuid.uuid4().hex}"
    caplog.set_level(logging.DEBUG)
    bad = _credential(emu, OWNER_APP, wrong)
    with PairedSender.from_config(_config(emu, secondary=bad)) as producer:
        with pytest.raises(PairingError) as paired:
            producer.pair()
    with PairedSender.from_config(_config(emu, primary=bad)) as producer:
        with pytest.raises(CredentialRejectedError) as sent:
            producer.send(entity, ServiceBusMessage("never sent", message_id="x"))
    for caught in (paired, sent):
        text = str(caught.value)
        assert ("credential rejected" in text or "refused the credential" in text), text
        assert "AADSTS7000215: Invalid client secret" in text, text
        assert f"'{OWNER_APP}'" in text
    # the app got no token at all: no hint about the rights a token would need
    # the cause names the token, not the rights (the advice every PairingError ends with lists both)
    assert "could not get a token" in paired.value.detail and "Manage rights" not in paired.value.detail
    assert f"localhost:{emu['primary'].amqp_port}" in str(sent.value)
    shown = " ".join([str(paired.value), str(sent.value), caplog.text, *(repr(r.args) for r in caplog.records)])
    assert wrong not in shown and OWNER_SECRET not in shown
    server = emu.server("primary")
    assert server.call(lambda: server.broker.runtime_counts(entity)).total == 0


def test_a_sender_only_app_cannot_provision(sp_emulator) -> None:
    emu = sp_emulator
    config = _config(emu, secondary=_credential(emu, SENDER_APP, SENDER_SECRET))
    with PairedSender.from_config(config) as producer:
        with pytest.raises(PairingError, match="credential rejected while listing queues") as caught:
            producer.pair()
    assert "Manage" in str(caught.value) and OWNER_ROLE in str(caught.value) and SENDER_APP in str(caught.value)


# --- the options ----------------------------------------------------------------------------------------------


def test_the_client_secret_options_reach_the_credential() -> None:
    """``authority`` implies instance discovery off unless it is Microsoft's; Spark's flat options spell them in
    camelCase; the secret is in no dump."""
    emulator = CredentialConfig(type="client_secret", tenant_id="t", client_id="c", client_secret="s3cr3t-value",
                                authority="localhost:5310")
    assert emulator.authority == "https://localhost:5310"
    assert emulator.client_secret_kwargs() == {"authority": "https://localhost:5310",
                                               "disable_instance_discovery": True}
    government = CredentialConfig(type="client_secret", tenant_id="t", client_id="c", client_secret="s",
                                  authority="https://login.microsoftonline.us/")
    assert government.client_secret_kwargs() == {"authority": "https://login.microsoftonline.us"}
    assert CredentialConfig(type="client_secret", tenant_id="t", client_id="c", client_secret="s",
                            disable_instance_discovery=True).client_secret_kwargs() == {
        "disable_instance_discovery": True}
    spark = from_options({"primary.fullyQualifiedNamespace": "localhost:5672", "primary.emulator": "true",
                          "primary.credential.type": "client_secret", "primary.credential.tenantId": "t",
                          "primary.credential.clientId": "c", "primary.credential.clientSecret": "s3cr3t-value",
                          "primary.credential.authority": "https://localhost:5310",
                          "primary.credential.connectionVerify": "/tmp/ca.pem",
                          "secondary.fullyQualifiedNamespace": "localhost:5673", "secondary.emulator": "true"})
    credential = spark.primary.credential_config
    assert credential is not None and credential.authority == "https://localhost:5310"
    assert credential.connection_verify == "/tmp/ca.pem"
    assert "s3cr3t-value" not in repr(spark) and "s3cr3t-value" not in str(spark.to_dict())


@pytest.mark.parametrize(
    ("credential", "message"),
    [
        ({"authority": "http://localhost:5310"},
         "secondary.credential.authority: must be an https URL (Entra ID tokens travel over TLS only), got "
         "'http://localhost:5310'"),
        ({"authority": f"https://localhost:5310/{TENANT_ID}"},
         "secondary.credential.authority: must look like https://host[:port], the authority host without a tenant "
         "(e.g. login.microsoftonline.com, or the emulator's https://localhost:5310), got "
         f"'https://localhost:5310/{TENANT_ID}'"),
        ({"tenant_id": "my tenant"},
         "secondary.credential.tenant_id: must be a tenant id or domain (letters, digits, '-' and '.'), got "
         "'my tenant'"),
        ({"type": "managed_identity", "client_secret": None, "tenant_id": None, "authority": "https://localhost:5310"},
         "secondary.credential.authority: only used with type client_secret, got 'https://localhost:5310'"),
        ({"type": "default", "client_secret": None, "tenant_id": None, "connection_verify": "/tmp/ca.pem"},
         "secondary.credential.connection_verify: only used with type client_secret, got '/tmp/ca.pem'"),
        ({"disable_instance_discovery": "perhaps"},
         "secondary.credential.disable_instance_discovery: must be true or false, got 'perhaps'"),
    ],
)
def test_bad_client_secret_options_are_named(credential: dict, message: str) -> None:
    section = {"type": "client_secret", "tenant_id": "t", "client_id": "c", "client_secret": "s3cr3t-value",
               **credential}
    with pytest.raises(ConfigError) as caught:
        load_config({"primary": {"fully_qualified_namespace": "localhost:5672", "emulator": True},
                     "secondary": {"fully_qualified_namespace": "localhost:5673", "emulator": True,
                                   "credential": {k: v for k, v in section.items() if v is not None}}})
    assert str(caught.value) == message
    assert "s3cr3t-value" not in str(caught.value)


def test_a_missing_ca_file_is_named_when_the_credential_is_built(tmp_path) -> None:
    config = load_config({"primary": {"fully_qualified_namespace": "localhost:5672", "emulator": True,
                                      "credential": {"type": "client_secret", "tenant_id": "t", "client_id": "c",
                                                     "client_secret": "s3cr3t-value",
                                                     "authority": "https://localhost:5310",
                                                     "connection_verify": str(tmp_path / "ca.pem")}},
                          "secondary": {"fully_qualified_namespace": "localhost:5673", "emulator": True}})
    with pytest.raises(ConfigError) as caught:
        config.primary.credential()
    assert str(caught.value) == (f"credential.connection_verify: is not a readable CA bundle (PEM) file on this "
                                 f"machine, got '{tmp_path / 'ca.pem'}'")
