"""The product on Microsoft Entra ID, against the emulator with the real SDK and the real azure-identity:
``fully_qualified_namespace`` + ``credential`` + ``emulator: true`` for sends (the paired sender), receives
(the Spark-free syphon core) and provisioning (the backlog queues, through the admin API with a Bearer token).
Tokens come from the emulator's managed-identity endpoint through ``IDENTITY_ENDPOINT``/``IDENTITY_HEADER``."""

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
from spark_sb.config import from_options, load_config, load_reference
from spark_sb.emulator import Emulator, NamespaceOptions
from spark_sb.emulator.aad import OWNER_ROLE, RECEIVER_ROLE, SENDER_ROLE, AadOptions, Identity
from spark_sb.emulator.model import QueueSpec
from spark_sb.errors import ConfigError, CredentialRejectedError, PairingError
from spark_sb.paired import PRIMARY, PairedSender
from spark_sb.syphon import Syphon

IDENTITY_HEADER = f"test-identity-header-{uuid.uuid4().hex}"
# the SDK renews a token in the last tenth of its life, in whole seconds: int(0.1 * (expires_on - int(now))) when it
# gets it (azure/servicebus/_pyamqp/cbs.py). A 10-second token got across a second's boundary left it int(0.9) = 0:
# no renewal before the expiry, the connection refused (CBS Authentication Expired) and opened again, and this test's
# count of tokens renewed on an open connection 0 (CI, 02:47). 30 s leaves it 2 s at the least.
SHORT_LIFETIME = 30.0
_AZURE_ENV = ("AZURE_CLIENT_ID", "AZURE_TENANT_ID", "AZURE_CLIENT_SECRET", "AZURE_CLIENT_CERTIFICATE_PATH",
              "AZURE_FEDERATED_TOKEN_FILE", "AZURE_USERNAME", "MSI_ENDPOINT", "MSI_SECRET", "IMDS_ENDPOINT",
              "IDENTITY_SERVER_THUMBPRINT", "AZURE_POD_IDENTITY_AUTHORITY_HOST")


@pytest.fixture(scope="module")
def aad_emulator() -> Iterator[Emulator]:
    """Two namespaces whose token endpoint serves: the system-assigned identity (Data Owner), ``receiver``
    (Data Receiver only), ``sender`` (Data Sender only) and ``short`` (Data Owner, 30-second tokens)."""
    options = AadOptions(identities=(Identity(), Identity("receiver", (RECEIVER_ROLE,)),
                                     Identity("sender", (SENDER_ROLE,)),
                                     Identity("short", (OWNER_ROLE,), lifetime=SHORT_LIFETIME)),
                         identity_header=IDENTITY_HEADER)
    with Emulator([NamespaceOptions("primary"), NamespaceOptions("secondary")], entra_id=True, aad=options) as emu:
        yield emu


@pytest.fixture
def identity_env(aad_emulator: Emulator, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Only the App Service managed identity is configured, pointing at the emulator's endpoint."""
    for name in _AZURE_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("IDENTITY_ENDPOINT", aad_emulator["primary"].identity_endpoint)
    monkeypatch.setenv("IDENTITY_HEADER", IDENTITY_HEADER)
    yield
    close_all()


def _queue(emu: Emulator, namespace: str = "primary", **props: Any) -> str:
    name = f"aad-{uuid.uuid4().hex[:10]}"
    server = emu.server(namespace)
    server.call(lambda: server.broker.create_entity(QueueSpec(name=name, **props)))
    return name


def _namespace(emu: Emulator, side: str, credential: dict | None = None) -> dict:
    info = emu[side]
    section: dict[str, Any] = {"fully_qualified_namespace": f"localhost:{info.amqp_port}", "emulator": True,
                               "admin_endpoint": info.admin_url}
    if credential is not None:
        section["credential"] = credential
    return section


def _config(emu: Emulator, primary: dict | None = None, secondary: dict | None = None, **sa: Any) -> dict:
    return {"primary": _namespace(emu, "primary", primary), "secondary": _namespace(emu, "secondary", secondary),
            "send_availability": {"backlog_prefix": f"aad-{uuid.uuid4().hex[:8]}", "backlog_queue_count": 2,
                                  "failover_interval": "0s", "primary_try_timeout": "2s", **sa},
            "syphon": {"retry_interval": "1s"}}


def _drain(emu: Emulator, side: str, queue: str, expected: int, wait: float = 5.0) -> list[str]:
    """Receive-and-delete with a SAS connection string (independent of the code under test)."""
    out: list[str] = []
    with ServiceBusClient.from_connection_string(emu[side].connection_string, retry_total=0) as client:
        with client.get_queue_receiver(queue, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as receiver:
            deadline = time.monotonic() + wait
            while len(out) < expected and time.monotonic() < deadline:
                out.extend(str(m) for m in receiver.receive_messages(max_message_count=100, max_wait_time=0.5))
            out.extend(str(m) for m in receiver.receive_messages(max_message_count=100, max_wait_time=0.2))
    return out


def _held(emu: Emulator, side: str, queue: str) -> int:
    """Messages a queue holds (active, dead-lettered, scheduled), read from the emulator's broker."""
    server = emu.server(side)
    return server.call(lambda: server.broker.runtime_counts(queue)).total


# --- sends, provisioning, receives -------------------------------------------------------------------------------


def test_the_paired_sender_and_the_syphon_run_on_entra_id(aad_emulator, identity_env) -> None:
    """DefaultAzureCredential everywhere: the paired sender provisions its backlog queues on the secondary
    (Bearer token on the admin API), sends to the primary, fails over to the backlog through an outage, and the
    syphon (a receiver on the secondary, a sender on the primary) moves the backlog home: every id once."""
    emu = aad_emulator
    entity = _queue(emu)
    config = _config(emu)
    issued_before = emu.authority.issued
    with PairedSender.from_config(config) as producer:
        assert producer.pair() == 2
        for i in range(5):
            assert producer.send(entity, ServiceBusMessage(f"m{i}", message_id=f"m{i}")).destination == PRIMARY
        emu.fault("primary", "down")
        try:
            for i in range(5, 10):
                assert producer.send(entity, ServiceBusMessage(f"m{i}", message_id=f"m{i}")).destination != PRIMARY
        finally:
            emu.heal("primary")
        backlog = producer.backlog_queues
    assert emu.authority.issued > issued_before  # the tokens came from the emulator's endpoint
    with Syphon.from_config(config) as syphon:
        summary = syphon.run_once(max_wait_time=0.5)
    assert summary.total_moved == 5 and summary.total_dead_lettered == 0
    assert sorted(_drain(emu, "primary", entity, 10)) == sorted(f"m{i}" for i in range(10))
    assert [_held(emu, "secondary", queue) for queue in backlog] == [0, 0]


def test_provisioning_goes_to_the_admin_endpoint_with_a_bearer_token(aad_emulator, identity_env) -> None:
    """spark_sb.admin.admin_client with a credential and use_tls=False: the real ServiceBusAdministrationClient
    creates and reads a queue on the emulator; a Data Sender token is refused naming the Manage right."""
    from azure.identity import ManagedIdentityCredential

    from spark_sb.errors import classify

    info = aad_emulator["secondary"]
    name = f"aad-admin-{uuid.uuid4().hex[:8]}"
    with admin_client(fully_qualified_namespace=f"localhost:{info.amqp_port}", credential=ManagedIdentityCredential(),
                      use_tls=False, admin_endpoint=info.admin_url, retry_total=0) as admin:
        admin.create_queue(name, max_delivery_count=7)
        assert admin.get_queue(name).max_delivery_count == 7
    with admin_client(fully_qualified_namespace=f"localhost:{info.amqp_port}",
                      credential=ManagedIdentityCredential(client_id="sender"), use_tls=False,
                      admin_endpoint=info.admin_url, retry_total=0) as admin:
        with pytest.raises(Exception) as caught:
            admin.get_queue(name)
    assert classify(caught.value).value == "configuration-credential"
    assert "'Manage' claim(s) are required" in str(caught.value)
    assert "Azure Service Bus Data Owner" in str(caught.value)


def test_pairing_without_the_owner_role_is_a_clear_error(aad_emulator, identity_env) -> None:
    config = _config(aad_emulator, secondary={"type": "managed_identity", "client_id": "sender"})
    with PairedSender.from_config(config) as producer:
        with pytest.raises(PairingError, match="credential rejected while listing queues") as caught:
            producer.pair()
    assert "Manage" in str(caught.value) and "Azure Service Bus Data Owner" in str(caught.value)


# --- a credential without the Sender role -------------------------------------------------------------------------


def test_a_token_without_the_sender_role_is_refused_and_nothing_fails_over(aad_emulator, identity_env) -> None:
    emu = aad_emulator
    entity = _queue(emu)
    config = _config(emu, primary={"type": "managed_identity", "client_id": "receiver"})
    with PairedSender.from_config(config) as producer:
        with pytest.raises(CredentialRejectedError) as caught:
            producer.send(entity, ServiceBusMessage("refused", message_id="refused"))
        text = str(caught.value)
        assert "'Send' claim(s) are required" in text and "Azure Service Bus Data Sender" in text
        assert "principal receiver" in text and "Azure Service Bus Data Receiver" in text
        assert producer.state(entity) == "healthy"  # a configuration error: no failover, no backlog
        backlog = producer.backlog_queues
    assert backlog == ()  # the backlog was never needed: nothing was provisioned, nothing parked
    assert _held(emu, "primary", entity) == 0


# --- a token that expires mid-run ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_token_that_expires_mid_run_is_renewed_and_nothing_is_lost(aad_emulator, identity_env, caplog) -> None:
    """30-second tokens: the paired sender sends for longer than a token lives; the SDK puts a fresh token
    before the old one expires (the emulator refuses transfers on an expired one: see
    tests/emulator/test_aad.py) and every message arrives once, none in the backlog, no send failed."""
    emu = aad_emulator
    entity = _queue(emu)
    config = _config(emu, primary={"type": "managed_identity", "client_id": "short"})
    issued_before = emu.authority.issued_for("short")
    server = emu.server("primary")
    renewed_before = server.call(lambda: server.stats()["tokens_renewed"])
    sent: list[str] = []
    caplog.set_level(logging.INFO)
    with PairedSender.from_config(config) as producer:
        deadline = time.monotonic() + SHORT_LIFETIME + 1.0  # past the first token's expiry
        while time.monotonic() < deadline:
            body = f"r{len(sent)}"
            assert producer.send(entity, ServiceBusMessage(body, message_id=body)).destination == PRIMARY
            sent.append(body)
            time.sleep(0.05)
        backlog = producer.backlog_queues
    assert emu.authority.issued_for("short") - issued_before >= 2  # renewed at least once
    # and put on the open connection in place of the old one (the namespace's stats count it)
    assert server.call(lambda: server.stats()["tokens_renewed"]) > renewed_before
    assert not [r for r in caplog.records if r.name.startswith("spark_sb.paired") and r.levelno >= logging.WARNING]
    received = _drain(emu, "primary", entity, len(sent))
    assert sorted(received) == sorted(sent) and len(set(received)) == len(sent)
    assert backlog == ()  # the backlog was never needed


# --- configuration ---------------------------------------------------------------------------------------------------


def test_the_emulator_option_reaches_plain_tcp_and_is_only_for_a_credential() -> None:
    config = load_config({"primary": {"fully_qualified_namespace": "localhost:5672", "emulator": True,
                                      "admin_endpoint": "localhost:5300"},
                          "secondary": {"fully_qualified_namespace": "localhost:5673", "emulator": "true"}})
    assert config.primary.is_emulator and not config.primary.use_tls
    assert config.primary.admin_endpoint == "http://localhost:5300"
    assert config.primary.credential_config is not None and config.primary.credential_config.type == "default"
    assert config.to_dict()["primary"]["emulator"] is True
    assert load_config(config.to_dict()) == config
    assert config.send_availability.backlog_prefix == "localhost-5672"
    spark = from_options({"primary.fullyQualifiedNamespace": "localhost:5672", "primary.emulator": "true",
                          "primary.credential.type": "managed_identity", "primary.credential.clientId": "app",
                          "secondary.fullyQualifiedNamespace": "localhost:5673", "secondary.emulator": "true"})
    assert spark.primary.is_emulator and spark.secondary.is_emulator
    assert spark.primary.credential_config is not None and spark.primary.credential_config.client_id == "app"
    assert load_reference(spark.reference() or {}) == spark  # travels to executors by reference: no secret in it
    real = load_config({"primary": {"fully_qualified_namespace": "contoso.servicebus.windows.net"},
                        "secondary": {"fully_qualified_namespace": "contoso-dr.servicebus.windows.net"}})
    assert real.primary.use_tls and "emulator" not in real.to_dict()["primary"]


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"fully_qualified_namespace": "contoso-dr.servicebus.windows.net", "admin_endpoint": "http://localhost:5301"},
         "secondary.admin_endpoint: only used with an emulator: a connection string with UseDevelopmentEmulator=true, "
         "or fully_qualified_namespace with emulator: true, got 'http://localhost:5301'"),
        ({"connection_string": "Endpoint=sb://localhost:5673;SharedAccessKeyName=k;SharedAccessKey=s;"
                               "UseDevelopmentEmulator=true", "emulator": True},
         "secondary.emulator: only used with fully_qualified_namespace (a connection string says "
         "UseDevelopmentEmulator=true), got True"),
        ({"fully_qualified_namespace": "localhost:5673", "emulator": "perhaps"},
         "secondary.emulator: must be true or false, got 'perhaps'"),
        ({"fully_qualified_namespace": "localhost:5673", "credential": {"type": "workload"}},
         "secondary.credential.type: must be one of default, client_secret, managed_identity, got 'workload'"),
        ({"fully_qualified_namespace": "localhost:5673", "credential": {"type": "client_secret", "client_id": "c",
                                                                       "client_secret": "s3cr3t-value"}},
         "secondary.credential.tenant_id: required when type is client_secret"),
        ({"fully_qualified_namespace": "localhost:5673", "credential": {"type": "client_secret", "tenant_id": "t",
                                                                       "client_secret": "s3cr3t-value"}},
         "secondary.credential.client_id: required when type is client_secret"),
        ({"fully_qualified_namespace": "localhost:5673", "credential": {"type": "client_secret", "tenant_id": "t",
                                                                       "client_id": "c"}},
         "secondary.credential.client_secret: required when type is client_secret"),
        ({"fully_qualified_namespace": "localhost:5673", "credential": {"type": "managed_identity",
                                                                       "client_secret": "s3cr3t-value"}},
         "secondary.credential.client_secret: only used with type client_secret, got ***"),
        ({"fully_qualified_namespace": "localhost:5673", "credential": {"type": "managed_identity", "tenant_id": "t"}},
         "secondary.credential.tenant_id: only used with type client_secret, got 't'"),
        ({"fully_qualified_namespace": "localhost:5673", "credential": {"type": "default", "clientid": "c"}},
         "secondary.credential.clientid: unknown option (did you mean client_id?)"),
    ],
)
def test_bad_credential_sections_are_named(section: dict, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config({"primary": {"fully_qualified_namespace": "localhost:5672", "emulator": True},
                     "secondary": section})
    assert str(caught.value) == message
    assert "s3cr3t-value" not in str(caught.value)


def test_a_client_secret_and_the_tokens_never_show(aad_emulator, identity_env, caplog) -> None:
    """The client secret is not in the config's repr, str, dump or errors; neither the tokens nor the identity
    header are in any log line of a run on Entra ID (spark_sb, the emulator, the SDK, azure-identity, msal)."""
    secret = f"client-secret-{uuid.uuid4().hex}"
    config = load_config({"primary": {"fully_qualified_namespace": "localhost:5672", "emulator": True,
                                      "credential": {"type": "client_secret", "tenant_id": "t", "client_id": "c",
                                                     "client_secret": secret}},
                          "secondary": {"fully_qualified_namespace": "localhost:5673", "emulator": True}})
    shown = [repr(config), str(config), repr(config.primary), repr(config.primary.credential_config),
             str(config.to_dict()), config.model_dump_json()]
    assert all(secret not in text for text in shown)
    assert config.primary.credential_config is not None
    assert config.primary.credential_config.client_secret is not None
    assert config.primary.credential_config.client_secret.get_secret_value() == secret

    emu = aad_emulator
    entity = _queue(emu)
    caplog.set_level(logging.DEBUG)
    from azure.identity import DefaultAzureCredential

    credential = DefaultAzureCredential()
    token = credential.get_token("https://servicebus.azure.net//.default").token
    cfg = load_config(_config(emu))
    with cfg.primary.client(retry_total=0) as client, client.get_queue_sender(entity) as sender:
        sender.send_messages(ServiceBusMessage("quiet"))
    refused = load_config(_config(emu, primary={"type": "managed_identity", "client_id": "receiver"}))
    with refused.primary.client(retry_total=0) as client:
        # refused when the sender's link opens, as the service refuses it (no credit first)
        with pytest.raises(Exception), client.get_queue_sender(entity) as sender:  # noqa: B017 - the logs matter
            sender.send_messages(ServiceBusMessage("refused"))
    logged = caplog.text + "".join(str(r.args) for r in caplog.records)
    assert caplog.records  # something was logged at DEBUG
    assert token not in logged and token.split(".")[2] not in logged
    assert IDENTITY_HEADER not in logged
    assert _drain(emu, "primary", entity, 1) == ["quiet"]
