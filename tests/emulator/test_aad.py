"""Microsoft Entra ID on the emulator, with the real SDK and the real azure-identity: the managed-identity token
endpoint (App Service protocol), ``jwt`` put-tokens checked for signature, audience and expiry, the roles
(Data Sender / Data Receiver / Data Owner) checked per operation, a token that expires and is not renewed
refused, and the admin API taking an Owner's Bearer token."""

from __future__ import annotations

import datetime
import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import jwt
import pytest
from azure.core.credentials import AccessToken
from azure.core.exceptions import ClientAuthenticationError
from azure.servicebus import ServiceBusClient, ServiceBusMessage
from azure.servicebus.exceptions import ServiceBusAuthenticationError, ServiceBusAuthorizationError

from spark_sb.emulator import Emulator, NamespaceOptions
from spark_sb.emulator.aad import (
    AUDIENCE,
    OWNER_ROLE,
    RECEIVER_ROLE,
    SENDER_ROLE,
    AadError,
    AadOptions,
    Authority,
    Identity,
)
from spark_sb.emulator.model import QueueSpec
from spark_sb.errors import ErrorClass, classify

HEADER = f"identity-header-{uuid.uuid4().hex}"
SCOPE = "https://servicebus.azure.net//.default"  # what the SDK asks azure-identity for
_AZURE_ENV = ("AZURE_CLIENT_ID", "AZURE_TENANT_ID", "AZURE_CLIENT_SECRET", "AZURE_CLIENT_CERTIFICATE_PATH",
              "AZURE_FEDERATED_TOKEN_FILE", "AZURE_USERNAME", "MSI_ENDPOINT", "MSI_SECRET", "IMDS_ENDPOINT",
              "IDENTITY_SERVER_THUMBPRINT")


class StaticCredential:
    """A TokenCredential that always hands out the same token, claiming it lives ``claimed`` seconds (as a
    token cached elsewhere would): the SDK never renews it."""

    def __init__(self, token: str, claimed: float = 3600.0) -> None:
        self.token, self.claimed = token, claimed
        self.calls = 0

    def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        self.calls += 1
        return AccessToken(self.token, int(time.time() + self.claimed))


@pytest.fixture(scope="module")
def emu() -> Iterator[Emulator]:
    options = AadOptions(identities=(Identity(), Identity("receiver", (RECEIVER_ROLE,)),
                                     Identity("sender", (SENDER_ROLE,)), Identity("brief", lifetime=30)),
                         token_lifetime=600, identity_header=HEADER)
    with Emulator([NamespaceOptions("one"), NamespaceOptions("two")], entra_id=True, aad=options) as emulator:
        yield emulator


@pytest.fixture
def identity_env(emu: Emulator, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _AZURE_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("IDENTITY_ENDPOINT", emu["one"].identity_endpoint)
    monkeypatch.setenv("IDENTITY_HEADER", HEADER)


@pytest.fixture
def queue(emu: Emulator) -> str:
    name = f"aad-{uuid.uuid4().hex[:10]}"
    for namespace in ("one", "two"):
        server = emu.server(namespace)
        server.call(lambda s=server: s.broker.create_entity(QueueSpec(name=name)))
    return name


def _client(emu: Emulator, credential: Any, namespace: str = "one") -> ServiceBusClient:
    return ServiceBusClient(f"localhost:{emu[namespace].amqp_port}", credential, use_tls=False, retry_total=0)


def _claims(token: str) -> dict[str, Any]:
    return jwt.decode(token, options={"verify_signature": False})


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
            status = response.status
    except urllib.error.HTTPError as err:
        body, status = err.read(), err.code
    try:
        return status, json.loads(body or b"{}")
    except ValueError:
        return status, {"text": body.decode(errors="replace")}


# --- the token endpoint ----------------------------------------------------------------------------------------


def test_managed_identity_credential_gets_tokens_with_the_identitys_roles(emu, identity_env) -> None:
    from azure.identity import ManagedIdentityCredential

    before = time.time()
    owner = ManagedIdentityCredential().get_token(SCOPE)
    claims = _claims(owner.token)
    assert claims["aud"] == "https://servicebus.azure.net/"  # the resource azure-identity asked for
    assert claims["roles"] == [OWNER_ROLE]
    assert before + 590 <= claims["exp"] <= time.time() + 601 and abs(owner.expires_on - claims["exp"]) <= 1
    receiver = _claims(ManagedIdentityCredential(client_id="receiver").get_token(SCOPE).token)
    assert receiver["roles"] == [RECEIVER_ROLE] and receiver["appid"] == "receiver"
    assert receiver["oid"] != claims["oid"]
    brief = ManagedIdentityCredential(client_id="brief").get_token(SCOPE)
    assert brief.expires_on <= time.time() + 31  # its own lifetime
    assert emu.authority.verify(owner.token).principal  # signed by the emulator's key


def test_default_azure_credential_gets_its_token_from_the_endpoint(emu, identity_env, queue) -> None:
    from azure.identity import DefaultAzureCredential

    issued = emu.authority.issued_for(None)
    credential = DefaultAzureCredential()
    with _client(emu, credential) as client:
        with client.get_queue_sender(queue) as sender:
            sender.send_messages(ServiceBusMessage("via DefaultAzureCredential"))
        with client.get_queue_receiver(queue, max_wait_time=2) as receiver:
            [message] = receiver.receive_messages(max_wait_time=2)
            receiver.complete_message(message)
    assert str(message) == "via DefaultAzureCredential"
    assert emu.authority.issued_for(None) > issued


def test_the_token_endpoint_speaks_the_app_service_protocol(emu, monkeypatch, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    url = emu["two"].identity_endpoint  # every namespace's admin port serves it
    query = {"api-version": "2019-08-01", "resource": "https://servicebus.azure.net"}
    status, body = _get(f"{url}?{urllib.parse.urlencode(query)}", {"X-IDENTITY-HEADER": HEADER})
    assert status == 200
    assert set(body) == {"access_token", "expires_on", "resource", "token_type", "client_id"}
    assert body["token_type"] == "Bearer" and body["resource"] == "https://servicebus.azure.net"
    assert int(body["expires_on"]) > time.time() + 500
    cases = [
        (query, {}, 401, "X-IDENTITY-HEADER"),
        (query, {"X-IDENTITY-HEADER": "wrong"}, 401, "does not match"),
        ({**query, "api-version": "2017-09-01"}, {"X-IDENTITY-HEADER": HEADER}, 400, "api-version must be 2019-08-01"),
        ({"api-version": "2019-08-01"}, {"X-IDENTITY-HEADER": HEADER}, 400, "'resource' is required"),
        ({**query, "client_id": "nobody"}, {"X-IDENTITY-HEADER": HEADER}, 400, "client_id 'nobody'"),
        ({**query, "mi_res_id": "/subscriptions/x"}, {"X-IDENTITY-HEADER": HEADER}, 400, "mi_res_id"),
    ]
    for params, headers, expected, words in cases:
        status, answer = _get(f"{url}?{urllib.parse.urlencode(params)}", headers)
        assert (status, answer["statusCode"]) == (expected, expected)
        assert words in answer["message"]
    assert HEADER not in caplog.text and body["access_token"] not in caplog.text

    from azure.identity import ManagedIdentityCredential

    for name in _AZURE_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("IDENTITY_ENDPOINT", url)
    monkeypatch.setenv("IDENTITY_HEADER", "not-the-header")
    with pytest.raises(ClientAuthenticationError) as caught:
        ManagedIdentityCredential().get_token(SCOPE)
    assert classify(caught.value) is ErrorClass.CONFIGURATION_CREDENTIAL


# --- put-token: signature, audience, expiry ----------------------------------------------------------------------


def test_a_token_is_checked_for_signature_audience_and_expiry(emu, queue) -> None:
    foreign = Authority(AadOptions(signing_key="another tenant's signing key, 32 bytes or more"))
    cases = {
        "not signed by the emulator's key": (foreign.issue()[0], "InvalidSignature"),
        "for another resource": (emu.token(resource="https://storage.azure.com/")[0], "InvalidAudience"),
        "expired": (emu.token(lifetime=10, now=time.time() - 60)[0], "ExpiredToken"),
        "not a token at all": ("a.b.c", "MalformedToken"),
    }
    for case, (token, _reason) in cases.items():
        with _client(emu, StaticCredential(token)) as client, pytest.raises(ServiceBusAuthenticationError) as caught:
            with client.get_queue_sender(queue) as sender:  # opening it puts the token
                sender.send_messages(ServiceBusMessage("refused"))
        assert classify(caught.value) is ErrorClass.CONFIGURATION_CREDENTIAL, case
        assert token not in str(caught.value)
    for token, reason in cases.values():  # the reasons, as the namespace checks them
        with pytest.raises(AadError, match=reason):
            emu.authority.verify(token)
    for audience in (AUDIENCE, AUDIENCE + "/", AUDIENCE + "//.default", "HTTPS://ServiceBus.Azure.NET"):
        assert emu.authority.verify(emu.token(resource=audience)[0]).expires


def test_a_token_is_good_on_every_namespace_of_the_emulator(emu, queue) -> None:
    token, _ = emu.token()
    for namespace in ("one", "two"):
        with _client(emu, StaticCredential(token), namespace) as client, client.get_queue_sender(queue) as sender:
            sender.send_messages(ServiceBusMessage(namespace))


# --- roles per operation -------------------------------------------------------------------------------------------


def test_a_data_sender_sends_and_schedules_but_cannot_receive(emu, queue) -> None:
    credential = StaticCredential(emu.token("sender")[0])
    with _client(emu, credential) as client:
        with client.get_queue_sender(queue) as sender:
            sender.send_messages(ServiceBusMessage("sent"))
            when = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=1)
            sender.cancel_scheduled_messages(sender.schedule_messages(ServiceBusMessage("ping"), when))
        for operation in ("receive", "peek"):
            with client.get_queue_receiver(queue, max_wait_time=1) as receiver:
                with pytest.raises(ServiceBusAuthorizationError) as caught:
                    if operation == "receive":
                        receiver.receive_messages(max_wait_time=1)
                    else:
                        receiver.peek_messages()
            text = str(caught.value)
            assert "'Listen' claim(s) are required" in text, operation
            assert f"needs the role {RECEIVER_ROLE} or {OWNER_ROLE}" in text
            assert f"the token of principal sender has {SENDER_ROLE}" in text
            assert classify(caught.value) is ErrorClass.CONFIGURATION_CREDENTIAL


def test_a_data_receiver_receives_settles_and_renews_but_cannot_send(emu, queue) -> None:
    owner = StaticCredential(emu.token()[0])
    with _client(emu, owner) as client, client.get_queue_sender(queue) as sender:
        sender.send_messages([ServiceBusMessage(f"m{i}") for i in range(4)])
    credential = StaticCredential(emu.token("receiver")[0])
    with _client(emu, credential) as client:
        with client.get_queue_receiver(queue, max_wait_time=2) as receiver:
            assert len(receiver.peek_messages(max_message_count=10)) == 4
            received: list = []
            while len(received) < 4:
                received.extend(receiver.receive_messages(max_message_count=4, max_wait_time=2))
            first, second, third, fourth = received
            receiver.renew_message_lock(first)
            receiver.complete_message(first)
            receiver.abandon_message(second)
            receiver.dead_letter_message(third, reason="test")
            receiver.defer_message(fourth)
            [deferred] = receiver.receive_deferred_messages([fourth.sequence_number])
            receiver.complete_message(deferred)
        with pytest.raises(ServiceBusAuthorizationError) as caught:  # the link is refused at attach, as the service does
            with client.get_queue_sender(queue) as sender:
                sender.send_messages(ServiceBusMessage("refused"))
    text = str(caught.value)
    assert "'Send' claim(s) are required" in text and f"needs the role {SENDER_ROLE} or {OWNER_ROLE}" in text
    assert classify(caught.value) is ErrorClass.CONFIGURATION_CREDENTIAL


# --- expiry ---------------------------------------------------------------------------------------------------------


def test_a_token_that_expires_and_is_not_renewed_stops_working(emu, queue) -> None:
    """The client believes its token lives an hour; it lives 8 s (2 s were too few for the first send, receive and
    complete on a loaded machine). After that the namespace refuses the links it authorized (a transfer, a receive)
    until a fresh token is put."""
    token, expires = emu.token(lifetime=8)
    credential = StaticCredential(token)
    with _client(emu, credential) as client:
        with client.get_queue_sender(queue) as sender, client.get_queue_receiver(queue, max_wait_time=1) as receiver:
            sender.send_messages(ServiceBusMessage("before"))
            [before] = receiver.receive_messages(max_wait_time=2)
            receiver.complete_message(before)
            time.sleep(max(0.0, expires - time.time()) + 0.3)
            with pytest.raises((ServiceBusAuthorizationError, ServiceBusAuthenticationError)) as sending:
                sender.send_messages(ServiceBusMessage("after"))
            with pytest.raises((ServiceBusAuthorizationError, ServiceBusAuthenticationError)) as receiving:
                receiver.receive_messages(max_wait_time=1)
    for caught in (sending, receiving):
        assert classify(caught.value) is ErrorClass.CONFIGURATION_CREDENTIAL
        assert "ExpiredToken" in str(caught.value)
    assert credential.calls >= 1
    fresh = StaticCredential(emu.token()[0])
    with _client(emu, fresh) as client, client.get_queue_receiver(queue, max_wait_time=1) as receiver:
        assert receiver.receive_messages(max_wait_time=1) == []  # "after" never got in


# --- the admin API ----------------------------------------------------------------------------------------------------


def test_the_admin_api_takes_a_bearer_token_of_a_data_owner_only(emu) -> None:
    url = f"{emu['one'].admin_url}/$Resources/queues?api-version=2021-05"
    status, _ = _get(url, {"Authorization": f"Bearer {emu.token()[0]}"})
    assert status == 200
    for token, words in ((emu.token("receiver")[0], "'Manage' claim(s) are required"),
                         (emu.token(resource="https://vault.azure.net")[0], "InvalidAudience"),
                         (emu.token(lifetime=5, now=time.time() - 60)[0], "ExpiredToken")):
        status, answer = _get(url, {"Authorization": f"Bearer {token}"})
        assert status == 401
        assert words in answer["text"] and token not in answer["text"]


# --- options ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Identity("x", ("Azure Service Bus Data Reader",)), "unknown role 'Azure Service Bus Data Reader'"),
        (lambda: Identity("x", lifetime=0), "Identity.lifetime: must be a positive number of seconds, got 0"),
        (lambda: AadOptions(token_lifetime=-1), "AadOptions.token_lifetime: must be a positive"),
        (lambda: AadOptions(signing_key="short"), "AadOptions.signing_key: must be at least 32 bytes"),
        (lambda: AadOptions(identities=(Identity("a"), Identity("a"))), "client ids must be distinct"),
    ],
)
def test_bad_options_are_named(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_the_secrets_are_not_in_the_options_repr() -> None:
    options = AadOptions(identity_header="header-secret-value", signing_key="k" * 40)
    assert "header-secret-value" not in repr(options) and "k" * 40 not in repr(options)
