"""What a token opens on the emulator, and what it never opens (issue 35: security items 1, 4 and part of 8).

* A SAS token opens the entity its ``sr`` names and what is below it, nothing else: a put-token ``name`` crafted to
  read as another entity or as the whole namespace (``.../q-public/x://y``) is refused, and the connection still
  cannot send to, receive from or manage the rules of another entity (a bare Proton client, as the SDK would not
  send such a name; the SDK's own paths keep working).
* Microsoft Entra ID is served only when asked for (``entra_id=True``, ``spark-sb emulator start --entra-id``):
  otherwise a JWT signed with the public development key opens nothing, the admin API refuses Bearer JWTs and the
  token endpoints are not served. When on, the signing key and identity header can be the user's own.
* An Entra ID token is checked for its tenant and issuer, and its ``exp``/``nbf``/``iat`` must be whole seconds.
* A SAS signature that is not ASCII is refused cleanly: 401 on the admin API, a 401 put-token reply on ``$cbs``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import jwt
import pytest
from azure.core.credentials import AccessToken, AzureSasCredential
from azure.servicebus import ServiceBusClient, ServiceBusMessage
from azure.servicebus.exceptions import ServiceBusAuthenticationError, ServiceBusAuthorizationError
from proton import Message, timestamp
from proton.utils import BlockingConnection

from spark_sb.emulator import Emulator, EmulatorProcess, NamespaceInfo, NamespaceOptions, sas
from spark_sb.emulator.aad import (
    DEFAULT_IDENTITY_HEADER,
    DEFAULT_SIGNING_KEY,
    OWNER_ROLE,
    TENANT_ID,
    AadError,
    Authority,
)

SECRET_KEY = f"a-secret-sas-key-{uuid.uuid4().hex}"
PUBLIC, PRIVATE, TOPIC = "q-public", "q-private", "t-private"
ENTITIES = {"queues": [{"name": PUBLIC}, {"name": PRIVATE}],
            "topics": [{"name": TOPIC, "subscriptions": [{"name": "s"}]}]}
_AZURE_ENV = ("AZURE_CLIENT_ID", "AZURE_TENANT_ID", "AZURE_CLIENT_SECRET", "AZURE_CLIENT_CERTIFICATE_PATH",
              "AZURE_FEDERATED_TOKEN_FILE", "AZURE_USERNAME", "MSI_ENDPOINT", "MSI_SECRET", "IMDS_ENDPOINT",
              "IDENTITY_SERVER_THUMBPRINT", "IDENTITY_ENDPOINT", "IDENTITY_HEADER")


@pytest.fixture(scope="module")
def emu() -> Iterator[Emulator]:
    """One namespace with a secret SAS key, Entra ID left at its default (off)."""
    with Emulator([NamespaceOptions("ns", key=SECRET_KEY)], entities=ENTITIES) as emulator:
        yield emulator


@pytest.fixture(scope="module")
def ns(emu: Emulator) -> NamespaceInfo:
    return emu["ns"]


class StaticCredential:
    """A TokenCredential handing the SDK one fixed token (a SAS token or a JWT) that it says lasts an hour."""

    def __init__(self, token: str) -> None:
        self.token = token

    def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        return AccessToken(self.token, int(time.time() + 3600))


def _count(emu: Emulator, path: str) -> int:
    server = emu.server("ns")
    return server.call(lambda: server.broker.runtime_counts(path)).active


def _status(reply: Message) -> int:
    return int(reply.properties.get("statusCode", reply.properties.get("status-code")))


def _request(conn: Any, links: dict[str, Any], node: str, body: Any, timeout: float = 10,
             **properties: Any) -> Message:
    """A request on ``node`` ($cbs or an entity's $management) and its reply, correlated."""
    if node not in links:
        links[node] = (conn.create_sender(node), conn.create_receiver(node, credit=10))
    sender, receiver = links[node]
    msg_id = uuid.uuid4()
    sender.send(Message(id=msg_id, reply_to=f"{node}-client", properties=properties, body=body))
    reply = receiver.receive(timeout=timeout)
    receiver.accept()
    assert reply.correlation_id == msg_id
    return reply


def _put_token(conn: Any, links: dict[str, Any], name: str, token: str, timeout: float = 10) -> Message:
    expiry = timestamp(int((time.time() + 3600) * 1000))
    return _request(conn, links, "$cbs", token, timeout=timeout, operation="put-token",
                    type="servicebus.windows.net:sastoken", name=name, expiration=expiry)


def _connect(ns: NamespaceInfo) -> Any:
    return BlockingConnection(f"amqp://localhost:{ns.amqp_port}", allowed_mechs="ANONYMOUS", timeout=10)


def _public_token(ns: NamespaceInfo) -> str:
    """A valid SAS token scoped to the one entity q-public."""
    return sas.make_token(f"sb://localhost:{ns.amqp_port}/{PUBLIC}", ns.key_name, ns.key)


def _tries(ns: NamespaceInfo, name: str) -> dict[str, Any]:
    """Put the q-public token under ``name`` on a bare Proton connection, then try to send to q-private, receive
    from it and add a rule to t-private/Subscriptions/s; what each gave."""
    results: dict[str, Any] = {}
    conn, links = _connect(ns), {}
    try:
        results["put-token"] = _status(_put_token(conn, links, name, _public_token(ns)))
        try:
            sender = conn.create_sender(PRIVATE)
            sender.send(Message(body="stolen"), timeout=5)
            results["send"] = "accepted"
        except Exception as err:  # noqa: BLE001 - refused: LinkDetached, SendException, Timeout
            results["send"] = type(err).__name__
    finally:
        conn.close()
    conn, links = _connect(ns), {}
    try:
        _put_token(conn, links, name, _public_token(ns))
        try:
            receiver = conn.create_receiver(PRIVATE, credit=1)
            received = receiver.receive(timeout=3)
            receiver.accept()
            results["receive"] = received.body
        except Exception as err:  # noqa: BLE001
            results["receive"] = type(err).__name__
    finally:
        conn.close()
    conn, links = _connect(ns), {}
    try:
        _put_token(conn, links, name, _public_token(ns))
        rule = {"rule-name": f"stolen-{uuid.uuid4().hex[:6]}", "rule-description": {}}
        reply = _request(conn, links, f"{TOPIC}/Subscriptions/s/$management", rule,
                         operation="com.microsoft:add-rule")
        results["add-rule"] = _status(reply)
    finally:
        conn.close()
    return results


# --- item 1: a SAS token opens its sr and below, nothing else --------------------------------------------------------


@pytest.mark.parametrize("tail", [
    "x://y",                    # was read as the empty path: the whole namespace
    "x://elsewhere/q-private",  # was read as q-private
])
def test_a_crafted_put_token_name_opens_no_other_entity(emu, ns, tail) -> None:
    """The put-token name ``localhost:PORT/q-public/<tail>`` with a valid token for q-public: refused, and the
    connection can neither send to q-private, receive from it, nor add a rule to another topic's subscription."""
    with ServiceBusClient.from_connection_string(ns.connection_string) as client, \
            client.get_queue_sender(PRIVATE) as sender:
        sender.send_messages(ServiceBusMessage("private"))
    before = _count(emu, PRIVATE)
    results = _tries(ns, f"localhost:{ns.amqp_port}/{PUBLIC}/{tail}")
    assert results["put-token"] == 401, results
    assert results["send"] != "accepted", results
    assert results["receive"] != "private", results
    assert results["add-rule"] == 401, results
    assert _count(emu, PRIVATE) == before  # nothing got in, nothing got out


def test_the_put_token_refusal_names_the_field_and_the_value(ns) -> None:
    conn, links = _connect(ns), {}
    name = f"localhost:{ns.amqp_port}/{PUBLIC}/x://y"
    token = _public_token(ns)
    try:
        reply = _put_token(conn, links, name, token)
    finally:
        conn.close()
    text = reply.properties["status-description"]
    assert _status(reply) == 401 and "put-token name" in text and name in text, text
    assert token not in text and SECRET_KEY not in text


@pytest.mark.parametrize("name", [
    "sb://localhost:{port}/q-public/../q-private",
    "sb://localhost:{port}/q-public/%2e%2e/q-private",
    "sb://localhost:{port}/q-public%2f..%2fq-private",
    "sb://localhost:{port}/q-public%252f..%252fq-private",
    "sb://localhost:{port}/q-public//q-private",
    "sb://localhost:{port}/q-public\\..\\q-private",
    "ftp://localhost:{port}/q-public",
    "sb://someone@localhost:{port}/q-public",
])
def test_path_tricks_are_refused(ns, name) -> None:
    results = _tries(ns, name.format(port=ns.amqp_port))
    assert results["put-token"] == 401 and results["send"] != "accepted" and results["add-rule"] == 401, results


def test_a_token_opens_its_entity_and_below_with_any_scheme_and_host_case(emu, ns) -> None:
    """The normal paths: the name in any accepted form (sb://, amqps://, https://, none; the host in any case; a
    trailing slash; a query; a path below the token's) opens q-public, and q-public only."""
    for name in (f"sb://localhost:{ns.amqp_port}/{PUBLIC}", f"amqps://LOCALHOST:{ns.amqp_port}/{PUBLIC}/",
                 f"https://localhost:{ns.amqp_port}/{PUBLIC}?api-version=2021-05", f"localhost:{ns.amqp_port}/Q-Public",
                 f"sb://localhost:{ns.amqp_port}/{PUBLIC}/$management"):
        conn, links = _connect(ns), {}
        try:
            assert _status(_put_token(conn, links, name, _public_token(ns))) == 202, name
        finally:
            conn.close()
    token = _public_token(ns)
    for audience, allowed in ((f"sb://localhost:{ns.amqp_port}/{PUBLIC}", True),
                              (f"localhost:{ns.amqp_port}/{PUBLIC}/Subscriptions/x", True),
                              (f"sb://localhost:{ns.amqp_port}/{PRIVATE}", False),
                              (f"sb://localhost:{ns.amqp_port}/{PUBLIC}-and-more", False),
                              (f"sb://localhost:{ns.amqp_port + 1}/{PUBLIC}", False),
                              (f"sb://localhost:{ns.amqp_port}", False)):
        if allowed:
            assert sas.verify(token, {ns.key_name: ns.key}, audience=audience) == ns.key_name
        else:
            with pytest.raises(sas.SasError, match="does not cover"):
                sas.verify(token, {ns.key_name: ns.key}, audience=audience)


def test_the_sdk_with_a_token_for_one_queue_sends_there_and_nowhere_else(emu, ns) -> None:
    credential = AzureSasCredential(_public_token(ns))
    before, private = _count(emu, PUBLIC), _count(emu, PRIVATE)
    with ServiceBusClient(f"localhost:{ns.amqp_port}", credential, use_tls=False, retry_total=0) as client:
        with client.get_queue_sender(PUBLIC) as sender:
            sender.send_messages(ServiceBusMessage("public"))
        with pytest.raises((ServiceBusAuthenticationError, ServiceBusAuthorizationError)) as caught:
            with client.get_queue_sender(PRIVATE) as sender:
                sender.send_messages(ServiceBusMessage("private"))
    assert isinstance(caught.value, (ServiceBusAuthenticationError, ServiceBusAuthorizationError))
    assert _count(emu, PUBLIC) == before + 1 and _count(emu, PRIVATE) == private


def test_parse_resource_is_the_one_reading() -> None:
    from spark_sb.emulator.sas import Resource, parse_resource

    assert parse_resource("sb://LocalHost:5672/q/") == Resource("localhost", 5672, "q")
    assert parse_resource("localhost:5672/t/Subscriptions/s?x=1") == Resource("localhost", 5672, "t/Subscriptions/s")
    assert parse_resource("https://localhost:5300") == Resource("localhost", 5300, "")
    assert parse_resource("amqps://[::1]:5671/q").netloc == "[::1]:5671"
    for bad in ("", "localhost:5672/a/x://y", "localhost:5672/a/../b", "localhost:5672/a%2f..%2fb",
                "localhost:5672/a%252fb", "localhost:notaport/q", "gopher://localhost/q", "localhost:5672/a b"):
        with pytest.raises(sas.SasError) as caught:
            parse_resource(bad, "put-token name")
        assert "put-token name" in str(caught.value)


# --- item 2: Entra ID only when asked for ------------------------------------------------------------------------


def _public_jwt(**claims: Any) -> str:
    """A Data Owner token anyone can sign: the development signing key is public."""
    now = int(time.time())
    body = {"aud": "https://servicebus.azure.net", "iss": f"https://sts.windows.net/{TENANT_ID}/", "tid": TENANT_ID,
            "iat": now, "nbf": now, "exp": now + 3600, "appid": "intruder", "roles": [OWNER_ROLE], **claims}
    return jwt.encode(body, DEFAULT_SIGNING_KEY, algorithm="HS256")


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


def _msi(admin_url: str, header: str) -> tuple[int, str]:
    query = urllib.parse.urlencode({"api-version": "2019-08-01", "resource": "https://servicebus.azure.net"})
    return _get(f"{admin_url}/msi/token?{query}", {"X-IDENTITY-HEADER": header})


def test_without_entra_id_a_self_signed_jwt_opens_nothing(emu, ns, caplog) -> None:
    """A secret SAS key protects the namespace: a JWT signed with the public key is refused on $cbs (the SDK) and
    on the admin API, and the managed-identity endpoint is not served."""
    caplog.set_level(logging.INFO, logger="spark_sb.emulator.amqp")
    assert emu.authority is None
    token = _public_jwt()
    before = _count(emu, PUBLIC)
    with ServiceBusClient(f"localhost:{ns.amqp_port}", StaticCredential(token), use_tls=False,
                          retry_total=0) as client:
        with pytest.raises(ServiceBusAuthenticationError) as caught:
            with client.get_queue_sender(PUBLIC) as sender:
                sender.send_messages(ServiceBusMessage("intruder"))
    assert "ServiceBusAuthenticationError" in repr(caught.value) and token not in str(caught.value)
    assert "Entra ID tokens are not enabled on this namespace (start the emulator with --entra-id" in caplog.text
    assert _count(emu, PUBLIC) == before
    status, text = _get(f"{ns.admin_url}/$Resources/queues?api-version=2021-05", {"Authorization": f"Bearer {token}"})
    assert status == 401 and "Entra ID tokens are not enabled" in text and token not in text
    status, text = _msi(ns.admin_url, DEFAULT_IDENTITY_HEADER)
    assert status == 404 and "--entra-id" in text
    with pytest.raises(RuntimeError, match="entra_id=True"):
        emu.token()


def test_entra_id_is_served_when_asked_for_and_options_need_it() -> None:
    with Emulator([NamespaceOptions("e")], entities=ENTITIES, entra_id=True, tls=True) as emulator:
        info = emulator["e"]
        assert info.authority_port  # with TLS, the authority for service principals
        with ServiceBusClient(f"localhost:{info.amqp_port}", StaticCredential(emulator.token()[0]), use_tls=False,
                              retry_total=0) as client, client.get_queue_sender(PUBLIC) as sender:
            sender.send_messages(ServiceBusMessage("owner"))
        assert _msi(info.admin_url, DEFAULT_IDENTITY_HEADER)[0] == 200
    with Emulator([NamespaceOptions("p")], tls=True) as plain:
        assert plain["p"].authority_port is None  # TLS alone serves no authority
    from spark_sb.emulator.aad import AadOptions

    for kwargs, words in (({"aad": AadOptions()}, "aad=AadOptions"), ({"authority_port": 0}, "authority_port=0")):
        with pytest.raises(ValueError) as caught:
            Emulator([NamespaceOptions("x")], **kwargs)
        assert words in str(caught.value) and "entra_id=True" in str(caught.value)
    with pytest.raises(ValueError, match="token_lifetime=60: Microsoft Entra ID is off"):
        EmulatorProcess.start(data_dir=None, namespaces=[NamespaceOptions("x")], token_lifetime=60)


def test_the_cli_serves_entra_id_only_with_entra_id_and_the_users_secrets(monkeypatch) -> None:
    """``spark-sb emulator start`` leaves Entra ID off; ``--token-lifetime`` without ``--entra-id`` is an error
    naming both; with ``--entra-id`` the signing key and identity header come from the environment when set."""
    for name in _AZURE_ENV:
        monkeypatch.delenv(name, raising=False)
    off = EmulatorProcess.start(data_dir=None, namespaces=[NamespaceOptions("p")])
    try:
        admin = off["p"].admin_url
        assert _msi(admin, DEFAULT_IDENTITY_HEADER)[0] == 404
        status, _ = _get(f"{admin}/$Resources/queues?api-version=2021-05", {"Authorization": f"Bearer {_public_jwt()}"})
        assert status == 401
    finally:
        off.stop()
    wrong = subprocess.run([sys.executable, "-m", "spark_sb.cli", "emulator", "start", "--in-memory",
                            "--namespace", "p=0:0", "--token-lifetime", "60s"],
                           capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and "--token-lifetime 60: Entra ID is off; add --entra-id" in wrong.stderr
    signing_key, header = f"my own signing key, {uuid.uuid4().hex}", f"my-header-{uuid.uuid4().hex}"
    monkeypatch.setenv("SPARK_SB_EMULATOR_ENTRA_ID_KEY", signing_key)
    monkeypatch.setenv("SPARK_SB_EMULATOR_IDENTITY_HEADER", header)
    on = EmulatorProcess.start(data_dir=None, namespaces=[NamespaceOptions("p")], entra_id=True)
    try:
        admin = on["p"].admin_url
        assert _msi(admin, DEFAULT_IDENTITY_HEADER)[0] == 401  # the well-known header no longer works
        status, text = _msi(admin, header)
        assert status == 200
        issued = json.loads(text)["access_token"]
        url = f"{admin}/$Resources/queues?api-version=2021-05"
        assert _get(url, {"Authorization": f"Bearer {issued}"})[0] == 200
        status, text = _get(url, {"Authorization": f"Bearer {_public_jwt()}"})  # the public key opens nothing
        assert status == 401 and "InvalidSignature" in text
    finally:
        on.stop()


# --- item 3: tenant, issuer, and whole-second times ----------------------------------------------------------------


def _signed(authority: Authority, **claims: Any) -> str:
    now = int(time.time())
    body = {"aud": "https://servicebus.azure.net", "iss": f"https://sts.windows.net/{TENANT_ID}/", "tid": TENANT_ID,
            "iat": now, "nbf": now, "exp": now + 3600, "appid": "app", "roles": [OWNER_ROLE], **claims}
    body = {k: v for k, v in body.items() if v is not None}
    return jwt.encode(body, authority.options.signing_key, algorithm="HS256")


@pytest.mark.parametrize(("claims", "reason"), [
    ({"tid": "contoso.onmicrosoft.com", "iss": "https://sts.windows.net/contoso.onmicrosoft.com/"}, "InvalidTenant"),
    ({"tid": "11111111-2222-3333-4444-555555555555"}, "InvalidTenant"),
    ({"tid": None}, "no 'tid' claim"),
    ({"iss": "https://sts.windows.net/11111111-2222-3333-4444-555555555555/"}, "InvalidIssuer"),
    ({"iss": "https://evil.example/"}, "InvalidIssuer"),
    ({"iss": None}, "no 'iss' claim"),
    ({"exp": "inf"}, "'exp' must be a whole number of seconds"),
    ({"exp": "99999999999"}, "'exp' must be a whole number of seconds"),
    ({"exp": 99999999999.5}, "'exp' must be a whole number of seconds"),
    ({"exp": True}, "'exp' must be a whole number of seconds"),
    ({"nbf": "never"}, "'nbf' must be a whole number of seconds"),
    ({"iat": "now"}, "'iat' must be a whole number of seconds"),
])
def test_a_token_of_another_tenant_or_issuer_or_with_odd_times_is_refused(claims, reason) -> None:
    authority = Authority()
    token = _signed(authority, **claims)
    with pytest.raises(AadError, match=reason) as caught:
        authority.verify(token)
    assert token not in str(caught.value)


def test_a_json_infinity_exp_never_opens_anything() -> None:
    """``"exp": Infinity`` (JSON's non-standard literal, which Python reads as a float): refused."""
    authority = Authority()
    header = jwt.utils.base64url_encode(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    now = int(time.time())
    payload = (f'{{"aud": "https://servicebus.azure.net", "iss": "https://sts.windows.net/{TENANT_ID}/", '
               f'"tid": "{TENANT_ID}", "iat": {now}, "exp": Infinity, "roles": ["{OWNER_ROLE}"]}}')
    signing_input = header + b"." + jwt.utils.base64url_encode(payload.encode())
    signature = hmac.new(authority.options.signing_key.encode(), signing_input, hashlib.sha256).digest()
    token = (signing_input + b"." + jwt.utils.base64url_encode(signature)).decode()
    with pytest.raises(AadError, match="'exp' must be a whole number of seconds"):
        authority.verify(token)


def test_tokens_of_the_tenant_v1_and_v2_issuers_are_accepted() -> None:
    authority = Authority()
    for issuer in (f"https://sts.windows.net/{TENANT_ID}/", f"https://login.microsoftonline.com/{TENANT_ID}/v2.0"):
        assert authority.verify(_signed(authority, iss=issuer)).principal == "principal app"
    assert authority.verify(authority.issue()[0]).expires  # what the emulator issues itself


def test_the_sdk_is_refused_with_a_token_of_another_tenant_or_one_that_never_expires(caplog) -> None:
    caplog.set_level(logging.INFO, logger="spark_sb.emulator.amqp")
    with Emulator([NamespaceOptions("e")], entities=ENTITIES, entra_id=True) as emulator:
        info = emulator["e"]
        assert emulator.authority is not None
        for claims, reason in (({"tid": "contoso.onmicrosoft.com",
                                 "iss": "https://sts.windows.net/contoso.onmicrosoft.com/"}, "InvalidTenant"),
                               ({"exp": "inf"}, "'exp' must be a whole number")):
            token = _signed(emulator.authority, **claims)
            with ServiceBusClient(f"localhost:{info.amqp_port}", StaticCredential(token), use_tls=False,
                                  retry_total=0) as client:
                with pytest.raises(ServiceBusAuthenticationError) as caught:
                    with client.get_queue_sender(PUBLIC) as sender:
                        sender.send_messages(ServiceBusMessage("refused"))
            assert token not in str(caught.value)
            assert reason in caplog.text and token not in caplog.text  # the namespace says why (the SDK keeps only the 401)
            status, text = _get(f"{info.admin_url}/$Resources/queues?api-version=2021-05",
                                {"Authorization": f"Bearer {token}"})
            assert status == 401 and reason in text
        server = emulator.server("e")
        assert server.call(lambda: server.broker.runtime_counts(PUBLIC)).active == 0


# --- item 4 (of 8): a non-ASCII signature -------------------------------------------------------------------------


def _non_ascii_sig_token(ns: NamespaceInfo, resource: str) -> str:
    good = sas.make_token(resource, ns.key_name, ns.key)
    return good.replace("&sig=", "&sig=\u00fc", 1)


def test_a_non_ascii_signature_gets_401_on_the_admin_api(ns) -> None:
    token = _non_ascii_sig_token(ns, f"http://localhost:{ns.admin_port}")
    status, text = _get(f"{ns.admin_url}/$Resources/queues?api-version=2021-05", {"Authorization": token})
    assert status == 401, (status, text)
    assert "sig" in text and "not base64" in text
    assert token.split("&sig=")[1].split("&")[0] not in text  # the signature is never echoed


def test_a_non_ascii_signature_gets_a_401_put_token_reply_on_cbs(ns) -> None:
    name = f"sb://localhost:{ns.amqp_port}/{PUBLIC}"
    conn, links = _connect(ns), {}
    try:
        reply = _put_token(conn, links, name, _non_ascii_sig_token(ns, name), timeout=5)
    finally:
        conn.close()
    text = reply.properties["status-description"]
    assert _status(reply) == 401 and "sig" in text and "not base64" in text, text


def test_an_expiry_that_is_not_ascii_digits_is_refused_naming_it(ns) -> None:
    token = sas.make_token(f"sb://localhost:{ns.amqp_port}", ns.key_name, ns.key)
    se = token.split("&se=")[1].split("&")[0]
    arabic = "".join(chr(0x0660 + int(d)) for d in se)  # int() reads Arabic-Indic digits; the service does not
    with pytest.raises(sas.SasError, match=f"se={arabic!r} is not a number"):
        sas.verify(token.replace(f"&se={se}", f"&se={arabic}"), {ns.key_name: ns.key})
