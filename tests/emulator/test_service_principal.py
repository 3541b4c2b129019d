"""A service principal end to end on the emulator: azure-identity's own ``ClientSecretCredential`` gets its tokens
from the emulator's Entra ID authority (https with the emulator's CA, the client-credentials grant, the roles of
the app registration), and the real SDK sends, receives and administers with them. A wrong secret or an unknown
app is refused as Entra ID refuses it, naming the app and never the secret."""

from __future__ import annotations

import json
import logging
import ssl
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import jwt
import pytest
from azure.core.exceptions import ClientAuthenticationError
from azure.identity import ClientSecretCredential
from azure.servicebus import ServiceBusClient, ServiceBusMessage
from azure.servicebus.exceptions import ServiceBusAuthorizationError, ServiceBusError

from spark_sb.admin import admin_client
from spark_sb.emulator import Emulator, EmulatorProcess, NamespaceOptions
from spark_sb.emulator.aad import (
    DEFAULT_CLIENT_ID,
    DEFAULT_CLIENT_SECRET,
    OWNER_ROLE,
    RECEIVER_ROLE,
    SENDER_ROLE,
    TENANT_ID,
    AadOptions,
    App,
)
from spark_sb.emulator.model import QueueSpec

SCOPE = "https://servicebus.azure.net//.default"  # what the SDK asks azure-identity for
SENDER_SECRET = f"sender-secret-{uuid.uuid4().hex}"
READER_SECRET = f"reader-secret-{uuid.uuid4().hex}"
OTHER_TENANT = "contoso.onmicrosoft.com"


@pytest.fixture(scope="module")
def emu() -> Iterator[Emulator]:
    """Two namespaces with AMQPS and the authority on a free port: the well-known development app (Data Owner),
    ``sender-app`` (Data Sender only) and ``reader-app`` (Data Receiver, in another tenant)."""
    options = AadOptions(apps=(App(), App("sender-app", SENDER_SECRET, (SENDER_ROLE,)),
                               App("reader-app", READER_SECRET, (RECEIVER_ROLE,), tenant_id=OTHER_TENANT)))
    with Emulator([NamespaceOptions("one"), NamespaceOptions("two")], entra_id=True, aad=options,
                  tls=True) as emulator:
        yield emulator


@pytest.fixture
def queue(emu: Emulator) -> str:
    name = f"sp-{uuid.uuid4().hex[:10]}"
    for namespace in ("one", "two"):
        server = emu.server(namespace)
        server.call(lambda s=server: s.broker.create_entity(QueueSpec(name=name)))
    return name


def _credential(emu: Emulator, client_id: str = DEFAULT_CLIENT_ID, secret: str = DEFAULT_CLIENT_SECRET,
                tenant: str = TENANT_ID, **kwargs: Any) -> ClientSecretCredential:
    return ClientSecretCredential(tenant, client_id, secret, **{**emu["one"].authority_kwargs, **kwargs})


def _client(emu: Emulator, credential: Any, namespace: str = "one") -> ServiceBusClient:
    """A client built from a namespace and a credential, as on Azure: AMQPS, with the emulator's CA."""
    return ServiceBusClient("localhost", credential, retry_total=0, **emu[namespace].tls_client_kwargs)


def _https(emu: Emulator, path: str, form: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """A raw request to the authority, trusting the emulator's CA."""
    context = ssl.create_default_context(cafile=emu["one"].ca_file)
    data = urllib.parse.urlencode(form).encode() if form is not None else None
    request = urllib.request.Request(emu["one"].authority_url + path, data=data)
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


# --- the authority ----------------------------------------------------------------------------------------------


def test_client_secret_credential_gets_a_token_with_the_apps_roles(emu) -> None:
    """azure-identity's own ClientSecretCredential (MSAL inside): the OpenID configuration, then the token
    endpoint; the token carries the app registration's roles, for Service Bus."""
    before = emu.authority.issued_for("sender-app")
    with _credential(emu, "sender-app", SENDER_SECRET) as credential:
        token = credential.get_token(SCOPE)
    claims = jwt.decode(token.token, options={"verify_signature": False})
    assert claims["roles"] == [SENDER_ROLE]
    assert claims["appid"] == "sender-app" and claims["tid"] == TENANT_ID
    assert claims["aud"] == "https://servicebus.azure.net"
    assert 3500 < token.expires_on - claims["iat"] <= 3600
    assert emu.authority.issued_for("sender-app") == before + 1
    with _credential(emu, "reader-app", READER_SECRET, tenant=OTHER_TENANT) as credential:
        claims = jwt.decode(credential.get_token(SCOPE).token, options={"verify_signature": False})
    assert claims["roles"] == [RECEIVER_ROLE] and claims["tid"] == OTHER_TENANT


def test_the_authority_serves_the_openid_configuration_and_refuses_bad_requests(emu) -> None:
    status, config = _https(emu, f"/{TENANT_ID}/v2.0/.well-known/openid-configuration")
    assert status == 200
    assert config["token_endpoint"] == f"{emu['one'].authority_url}/{TENANT_ID}/oauth2/v2.0/token"
    status, answer = _https(emu, "/nowhere.example/v2.0/.well-known/openid-configuration")
    assert status == 400 and answer["error"] == "invalid_tenant" and "AADSTS90002" in answer["error_description"]
    form = {"grant_type": "client_credentials", "client_id": DEFAULT_CLIENT_ID,
            "client_secret": DEFAULT_CLIENT_SECRET, "scope": "https://servicebus.azure.net/.default"}
    status, answer = _https(emu, f"/{TENANT_ID}/oauth2/v2.0/token", form)
    assert status == 200 and answer["token_type"] == "Bearer" and answer["expires_in"] == 3600
    status, answer = _https(emu, f"/{TENANT_ID}/oauth2/v2.0/token", {**form, "grant_type": "password"})
    assert status == 400 and answer["error"] == "unsupported_grant_type"
    status, answer = _https(emu, f"/{TENANT_ID}/oauth2/v2.0/token", {**form, "scope": "https://vault.azure.net/.default"})
    assert status == 400 and answer["error"] == "invalid_resource"
    status, answer = _https(emu, f"/{TENANT_ID}/oauth2/v2.0/token", {**form, "scope": "https://servicebus.azure.net"})
    assert status == 400 and answer["error"] == "invalid_scope" and "/.default" in answer["error_description"]


def test_the_authority_speaks_https_only_with_the_emulators_ca(emu) -> None:
    """Without the CA (certifi's bundle) the credential cannot reach the authority: a certificate error."""
    kwargs = {k: v for k, v in emu["one"].authority_kwargs.items() if k != "connection_verify"}
    with ClientSecretCredential(TENANT_ID, DEFAULT_CLIENT_ID, DEFAULT_CLIENT_SECRET, **kwargs) as credential:
        with pytest.raises(ClientAuthenticationError, match="CERTIFICATE_VERIFY_FAILED"):
            credential.get_token(SCOPE)


# --- the SDK with a service principal ----------------------------------------------------------------------------


def test_an_owner_app_sends_receives_and_administers(emu, queue) -> None:
    """AMQPS on both namespaces with one credential (a token is good for every namespace of the emulator), and
    the administration client with a Bearer token."""
    with _credential(emu) as credential:
        for namespace in ("one", "two"):
            with _client(emu, credential, namespace) as client:
                with client.get_queue_sender(queue) as sender:
                    sender.send_messages([ServiceBusMessage(f"{namespace}-{i}") for i in range(3)])
                with client.get_queue_receiver(queue, max_wait_time=2) as receiver:
                    received = receiver.receive_messages(max_message_count=10, max_wait_time=2)
                    for message in received:
                        receiver.complete_message(message)
            assert sorted(str(m) for m in received) == [f"{namespace}-{i}" for i in range(3)]
        info = emu["two"]
        name = f"sp-admin-{uuid.uuid4().hex[:8]}"
        with admin_client(fully_qualified_namespace=f"localhost:{info.amqp_port}", credential=credential,
                          use_tls=False, admin_endpoint=info.admin_url, retry_total=0) as admin:
            admin.create_queue(name, max_delivery_count=4)
            assert admin.get_queue(name).max_delivery_count == 4
            assert name in [q.name for q in admin.list_queues()]
    assert emu.authority.issued_for(DEFAULT_CLIENT_ID) >= 1


def test_the_async_credential_and_client_work_the_same(emu, queue) -> None:
    """azure.identity.aio's ClientSecretCredential (aiohttp, the CA by connection_verify) and the async SDK."""
    import asyncio

    from azure.identity.aio import ClientSecretCredential as AsyncClientSecretCredential
    from azure.servicebus.aio import ServiceBusClient as AsyncServiceBusClient

    async def run() -> list[str]:
        async with AsyncClientSecretCredential(TENANT_ID, DEFAULT_CLIENT_ID, DEFAULT_CLIENT_SECRET,
                                               **emu["one"].authority_kwargs) as credential:
            async with AsyncServiceBusClient("localhost", credential, retry_total=0,
                                             **emu["one"].tls_client_kwargs) as client:
                async with client.get_queue_sender(queue) as sender:
                    await sender.send_messages(ServiceBusMessage("async"))
                async with client.get_queue_receiver(queue) as receiver:
                    received = await receiver.receive_messages(max_message_count=5, max_wait_time=2)
                    for message in received:
                        await receiver.complete_message(message)
                    return [str(m) for m in received]

    assert asyncio.run(run()) == ["async"]

def test_a_sender_only_app_sends_but_cannot_receive_or_administer(emu, queue) -> None:
    with _credential(emu, "sender-app", SENDER_SECRET) as credential, _client(emu, credential) as client:
        with client.get_queue_sender(queue) as sender:
            sender.send_messages(ServiceBusMessage("from the sender app"))
        with pytest.raises(ServiceBusAuthorizationError) as caught:
            with client.get_queue_receiver(queue) as receiver:
                receiver.receive_messages(max_message_count=1, max_wait_time=2)
        assert "Listen" in str(caught.value) and RECEIVER_ROLE in str(caught.value)
        assert "sender-app" in str(caught.value)
        info = emu["one"]
        with admin_client(fully_qualified_namespace=f"localhost:{info.amqp_port}", credential=credential,
                          use_tls=False, admin_endpoint=info.admin_url, retry_total=0) as admin:
            with pytest.raises(ClientAuthenticationError, match="'Manage' claim"):
                admin.get_queue(queue)
    server = emu.server("one")
    assert server.call(lambda: server.broker.runtime_counts(queue)).active == 1  # sent, and still there


def test_a_wrong_secret_is_refused_naming_the_app_never_the_secret(emu, queue, caplog) -> None:
    """The OAuth error Entra ID gives (invalid_client, AADSTS7000215) reaches the user as azure-identity's
    ClientAuthenticationError naming the app; the SDK fails the send with it inside. The secret is nowhere."""
    caplog.set_level(logging.DEBUG)
    wrong = f"wrong-secret-{uuid.uuid4().hex}"
    with _credential(emu, "sender-app", wrong) as credential:
        with pytest.raises(ClientAuthenticationError) as caught:
            credential.get_token(SCOPE)
        text = str(caught.value)
        assert "AADSTS7000215" in text and "Invalid client secret" in text and "'sender-app'" in text
        with _client(emu, credential) as client:
            with pytest.raises(ServiceBusError) as sent:
                with client.get_queue_sender(queue) as sender:  # opening the link needs the token
                    sender.send_messages(ServiceBusMessage("never sent"))
        assert "AADSTS7000215" in str(sent.value)
    with _credential(emu, "nobody", wrong) as credential:
        with pytest.raises(ClientAuthenticationError, match="AADSTS700016: Application with identifier 'nobody'"):
            credential.get_token(SCOPE)
    with _credential(emu, "reader-app", READER_SECRET) as credential:  # registered in another tenant
        with pytest.raises(ClientAuthenticationError, match=f"'reader-app' was not found in the directory "
                                                            f"'{TENANT_ID}'"):
            credential.get_token(SCOPE)
    with _credential(emu, tenant="nowhere.example") as credential:
        # MSAL keeps the discovery's answer (AADSTS90002) to itself and names the authority and the tenant
        with pytest.raises(ClientAuthenticationError, match="authority configuration for https://localhost:[0-9]+/"
                                                            "nowhere.example.*double check your tenant"):
            credential.get_token(SCOPE)
    shown = " ".join([text, str(sent.value), caplog.text, *(repr(r.args) for r in caplog.records)])
    assert wrong not in shown and DEFAULT_CLIENT_SECRET not in shown and READER_SECRET not in shown
    assert any("refused: invalid client secret" in r.getMessage() for r in caplog.records)  # the emulator says why
    server = emu.server("one")
    assert server.call(lambda: server.broker.runtime_counts(queue)).active == 0


# --- options and the process -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("make", "message"), [
    (lambda: App(roles=("Reader",)), "App.roles: unknown role 'Reader'"),
    (lambda: App(secret=""), "App.secret: must be a non-empty string"),
    (lambda: App(tenant_id="a tenant"), "App.tenant_id: letters, digits"),
    (lambda: AadOptions(apps=(App("a"), App("a", "other"))), "AadOptions.apps: (tenant_id, client_id) must be distinct"),
])
def test_bad_app_options_are_named(make: Any, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        make()
    assert message in str(caught.value)


def test_the_apps_secret_is_not_in_the_repr() -> None:
    app = App("a", SENDER_SECRET, (OWNER_ROLE,))
    assert SENDER_SECRET not in repr(app) and SENDER_SECRET not in repr(AadOptions(apps=(app,)))


def test_the_cli_emulator_serves_the_authority(tmp_path) -> None:
    """``spark-sb emulator start --tls --authority-port 0``: the status carries the authority, a
    ClientSecretCredential gets a token from it and sends over AMQPS; after kill -9 a restart keeps the port."""
    entities = tmp_path / "entities.yaml"
    entities.write_text("queues:\n  - name: orders\n")
    proc = EmulatorProcess.start(data_dir=tmp_path / "data", namespaces=[NamespaceOptions("p")], tls=True,
                                 entra_id=True, authority_port=0, entities=entities)
    try:
        port = proc["p"].authority_port
        assert port is not None and proc["p"].authority_url == f"https://localhost:{port}"
        proc.kill()
        proc = proc.restart()
        assert proc["p"].authority_port == port
        info = proc["p"]
        with ClientSecretCredential(TENANT_ID, DEFAULT_CLIENT_ID, DEFAULT_CLIENT_SECRET,
                                    **info.authority_kwargs) as credential:
            with ServiceBusClient("localhost", credential, retry_total=0, **info.tls_client_kwargs) as client:
                with client.get_queue_sender("orders") as sender:
                    sender.send_messages(ServiceBusMessage("over AMQPS with a service principal"))
                with client.get_queue_receiver("orders", max_wait_time=5) as receiver:
                    assert [str(m) for m in receiver.receive_messages(max_wait_time=5)] == [
                        "over AMQPS with a service principal"]
    finally:
        proc.stop()


def test_spark_sb_emulator_start_prints_the_authority() -> None:
    """``spark-sb emulator start --tls --entra-id``: after the CA line, ``AUTHORITY https://localhost:PORT``."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "spark_sb.cli", "emulator", "start", "--in-memory", "--tls", "--namespace", "p=0:0",
         "--entra-id", "--authority-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline().strip() for _ in range(4)]
        assert [line.split(" ", 1)[0] for line in lines] == ["p", "AMQPS", "CA", "AUTHORITY"]
        ca_file, authority = lines[2].split(" ", 1)[1], lines[3].split(" ", 1)[1]
        with ClientSecretCredential(TENANT_ID, DEFAULT_CLIENT_ID, DEFAULT_CLIENT_SECRET, authority=authority,
                                    disable_instance_discovery=True, connection_verify=ca_file) as credential:
            assert credential.get_token(SCOPE).token
    finally:
        proc.terminate()
        proc.wait(10)
    assert proc.returncode == 0
