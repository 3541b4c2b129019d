"""AMQP over WebSockets on the emulator, with the real SDK: the sync transport (websocket-client) and the async one
(aiohttp), built from the emulator's connection string (``ws://``) and from a namespace and a credential
(``wss://``, trusting the emulator's CA), directly and through an HTTP proxy that asks for a password. They run
the data-plane scenarios of ``test_sdk_dataplane``; a wrong proxy password is refused; an outage drops WebSocket
clients and they reconnect after heal; the endpoint serves the SDKs' path and subprotocol only; the ports are
printed, kept across a restart and named when taken."""

from __future__ import annotations

import asyncio
import inspect
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import test_sdk_dataplane as dataplane
import websocket
from azure.core.credentials import AzureNamedKeyCredential
from azure.servicebus import (
    ServiceBusClient,
    ServiceBusMessage,
    ServiceBusReceiveMode,
    ServiceBusSubQueue,
    TransportType,
)
from azure.servicebus.aio import ServiceBusClient as AsyncServiceBusClient
from azure.servicebus.exceptions import (
    MessagingEntityNotFoundError,
    ServiceBusConnectionError,
    ServiceBusError,
)

from spark_sb.emulator import Emulator, EmulatorProcess, NamespaceInfo, NamespaceOptions
from spark_sb.emulator.model import QueueSpec
from spark_sb.emulator.proxy import HttpProxy
from spark_sb.emulator.server import DEFAULT_KEY, DEFAULT_KEY_NAME, WEBSOCKET_PATH

AMQP_SASL_HEADER = b"AMQP\x03\x01\x00\x00"
#: how a client is built: from the connection string (ws://) or a namespace and a credential (wss://), and
#: whether it goes through the proxy
KINDS = ["ws", "wss", "ws-proxy", "wss-proxy"]


@pytest.fixture(scope="module")
def emulator(websocket_emulator: Emulator) -> Emulator:
    """The conftest's ``primary``, ``make_queue`` and ``make_topic`` on the emulator with WebSockets."""
    return websocket_emulator


@pytest.fixture
def proxy(http_proxy_server: HttpProxy) -> HttpProxy:
    return http_proxy_server


def _kwargs(kind: str, info: NamespaceInfo, proxy: HttpProxy, aio: bool = False) -> dict[str, Any]:
    options = dict(info.websocket_connection_string_kwargs if kind.startswith("ws-") or kind == "ws"
                   else info.websocket_client_kwargs)
    if kind.endswith("-proxy"):
        options["http_proxy"] = proxy.aio_http_proxy if aio else proxy.http_proxy
    return options


def _sync_client(kind: str, info: NamespaceInfo, proxy: HttpProxy, **extra: Any) -> ServiceBusClient:
    options = {"retry_total": 0, **_kwargs(kind, info, proxy), **extra}
    if kind.startswith("wss"):
        return ServiceBusClient("localhost", AzureNamedKeyCredential(DEFAULT_KEY_NAME, DEFAULT_KEY), **options)
    return ServiceBusClient.from_connection_string(info.connection_string, **options)


def _async_client(kind: str, info: NamespaceInfo, proxy: HttpProxy) -> AsyncServiceBusClient:
    options = {"retry_total": 0, **_kwargs(kind, info, proxy, aio=True)}
    if kind.startswith("wss"):
        return AsyncServiceBusClient("localhost", AzureNamedKeyCredential(DEFAULT_KEY_NAME, DEFAULT_KEY), **options)
    return AsyncServiceBusClient.from_connection_string(info.connection_string, **options)


def _port(kind: str, info: NamespaceInfo) -> int | None:
    return info.wss_port if kind.startswith("wss") else info.ws_port


# --- the data-plane scenarios ----------------------------------------------------------------------------------

#: test_sdk_dataplane's scenarios that need only a client and entities (the others follow a fake clock or open
#: their own clients from the connection string)
SCENARIOS = [
    dataplane.test_single_and_batch_send_arrive_in_order_with_every_field,
    dataplane.test_receive_and_delete_removes_without_settlement,
    dataplane.test_abandon_redelivers_with_incremented_delivery_count_then_dead_letters,
    dataplane.test_prefetched_messages_released_by_a_closing_receiver_are_not_counted_as_deliveries,
    dataplane.test_dead_letter_with_reason_and_description,
    dataplane.test_defer_then_receive_by_sequence_number_and_complete,
    dataplane.test_duplicate_detection_drops_a_repeated_message_id,
    dataplane.test_sessions_named_next_available_lock_and_state,
    dataplane.test_next_available_session_times_out_when_none_has_messages,
    dataplane.test_peek_sees_messages_without_locking_them,
    dataplane.test_message_over_256_kib_is_refused_and_one_under_is_accepted,
    dataplane.test_a_batch_filled_to_the_sdks_limit_is_accepted,
    dataplane.test_unknown_entity_raises_not_found_for_sender_and_receiver,
    dataplane.test_topic_fans_out_to_matching_subscriptions,
    dataplane.test_sequence_numbers_are_counted_per_queue_from_one,
]


# through every layer at once: a namespace and a credential, TLS with the emulator's CA, the proxy's tunnel (the
# connection string's ws:// without a proxy is the round trips' below, and the outages')
@pytest.mark.parametrize("kind", ["wss-proxy"])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__.removeprefix("test_"))
def test_the_data_plane_scenarios_pass_over_websockets(scenario: Callable[..., None], kind: str,
                                                       primary: NamespaceInfo, proxy: HttpProxy,
                                                       make_queue, make_topic) -> None:
    tunnels = proxy.tunnels[("localhost", _port(kind, primary))]
    fixtures = {"make_queue": make_queue, "make_topic": make_topic}
    with _sync_client(kind, primary, proxy) as client:
        scenario(**{name: client if name == "client" else fixtures[name]
                    for name in inspect.signature(scenario).parameters})
    opened = proxy.tunnels[("localhost", _port(kind, primary))] - tunnels
    assert opened > 0 if kind.endswith("-proxy") else opened == 0


# --- every way in, sync and async ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_sync_clients_send_peek_receive_renew_settle_and_keep_session_state(
        kind: str, primary: NamespaceInfo, proxy: HttpProxy, make_queue) -> None:
    queue, sessions = make_queue(), make_queue(requires_session=True)
    tunnels = proxy.tunnels[("localhost", _port(kind, primary))]
    with _sync_client(kind, primary, proxy) as client:
        with client.get_queue_sender(queue) as sender:
            sender.send_messages([ServiceBusMessage(f"{kind}-{i}", message_id=str(i)) for i in range(4)])
        with client.get_queue_sender(sessions) as sender:
            sender.send_messages(ServiceBusMessage(f"{kind}-in-a-session", session_id="s1"))
        with client.get_queue_receiver(queue, max_wait_time=2) as receiver:
            assert [m.message_id for m in receiver.peek_messages(max_message_count=10)] == ["0", "1", "2", "3"]
            got = dataplane_receive(receiver, 4)
            assert [str(m) for m in got] == [f"{kind}-{i}" for i in range(4)]
            assert receiver.renew_message_lock(got[0]) >= got[0].locked_until_utc
            receiver.complete_message(got[0])
            receiver.abandon_message(got[1])
            receiver.defer_message(got[2])
            receiver.dead_letter_message(got[3], reason="bad", error_description="over websockets")
            (again,) = receiver.receive_messages(max_wait_time=2)
            assert (again.message_id, again.delivery_count) == ("1", 1)
            receiver.complete_message(again)
            (deferred,) = receiver.receive_deferred_messages([got[2].sequence_number])
            receiver.complete_message(deferred)
            assert receiver.peek_messages(max_message_count=10) == []
        with client.get_queue_receiver(queue, sub_queue=ServiceBusSubQueue.DEAD_LETTER, max_wait_time=2) as dlq:
            (dead,) = dlq.receive_messages(max_wait_time=2)
            assert (dead.message_id, dead.dead_letter_reason) == ("3", "bad")
            dlq.complete_message(dead)
        with client.get_queue_receiver(sessions, session_id="s1", max_wait_time=2) as receiver:
            receiver.session.set_state(b"seen")
            (message,) = receiver.receive_messages(max_wait_time=2)
            receiver.complete_message(message)
            assert (str(message), receiver.session.get_state()) == (f"{kind}-in-a-session", b"seen")
    opened = proxy.tunnels[("localhost", _port(kind, primary))] - tunnels
    # each sender and receiver opens its own connection
    assert opened >= 5 if kind.endswith("-proxy") else opened == 0


def dataplane_receive(receiver: Any, expected: int) -> list[Any]:
    got: list[Any] = []
    for _ in range(10):
        if len(got) >= expected:
            break
        got += receiver.receive_messages(max_message_count=expected - len(got), max_wait_time=2)
    return got


# the two ends of the transports (plain; TLS through a proxy): the sync test covers the four, and the async SDK
# shares their transport code but its own WebSocket connect, which both of these go through
@pytest.mark.parametrize("kind", ["ws", "wss-proxy"])
def test_async_clients_send_peek_receive_renew_settle_and_keep_session_state(
        kind: str, primary: NamespaceInfo, proxy: HttpProxy, make_queue) -> None:
    queue, sessions = make_queue(), make_queue(requires_session=True)
    tunnels = proxy.tunnels[("localhost", _port(kind, primary))]

    async def run() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with _async_client(kind, primary, proxy) as client:
            async with client.get_queue_sender(queue) as sender:
                batch = await sender.create_message_batch()
                for i in range(3):
                    batch.add_message(ServiceBusMessage(f"{kind}-{i}"))
                await sender.send_messages(batch)
            async with client.get_queue_sender(sessions) as sender:
                await sender.send_messages(ServiceBusMessage(f"{kind}-in-a-session", session_id="s1"))
            async with client.get_queue_receiver(queue, max_wait_time=2) as receiver:
                out["peeked"] = [str(m) for m in await receiver.peek_messages(max_message_count=10)]
                got: list[Any] = []
                while len(got) < 3:
                    got += await receiver.receive_messages(max_message_count=3, max_wait_time=2)
                await receiver.renew_message_lock(got[0])
                await receiver.complete_message(got[0])
                await receiver.defer_message(got[1])
                await receiver.dead_letter_message(got[2], reason="bad")
                deferred = await receiver.receive_deferred_messages([got[1].sequence_number])
                await receiver.complete_message(deferred[0])
                out["received"] = [str(m) for m in got]
                out["left"] = await receiver.peek_messages(max_message_count=10)
            async with client.get_queue_receiver(sessions, session_id="s1", max_wait_time=2) as receiver:
                await receiver.session.set_state("seen")
                out["session"] = [str(m) async for m in receiver]
                out["state"] = await receiver.session.get_state()
        return out

    out = asyncio.run(run())
    assert out["peeked"] == out["received"] == [f"{kind}-{i}" for i in range(3)] and out["left"] == []
    assert out["session"] == [f"{kind}-in-a-session"] and out["state"] == b"seen"
    opened = proxy.tunnels[("localhost", _port(kind, primary))] - tunnels
    assert opened >= 4 if kind.endswith("-proxy") else opened == 0
    with _sync_client("ws", primary, proxy) as client:
        with client.get_queue_receiver(queue, sub_queue=ServiceBusSubQueue.DEAD_LETTER, max_wait_time=2) as dlq:
            assert [(str(m), m.dead_letter_reason) for m in dlq.receive_messages(max_wait_time=2)] \
                == [(f"{kind}-2", "bad")]


# --- the proxy -------------------------------------------------------------------------------------------------


def _empty(info: NamespaceInfo, queue: str, proxy: HttpProxy) -> bool:
    with _sync_client("ws", info, proxy) as client:
        with client.get_queue_receiver(queue) as receiver:
            return receiver.peek_messages(max_message_count=5) == []


def test_a_wrong_proxy_password_is_refused_before_anything_is_sent(primary: NamespaceInfo, proxy: HttpProxy,
                                                                    make_queue) -> None:
    queue = make_queue()
    refused = proxy.refused
    wrong = {**proxy.http_proxy, "password": "not-the-password"}
    with pytest.raises(ServiceBusError, match="407") as sync_error:
        with _sync_client("wss", primary, proxy, http_proxy=wrong) as client:
            with client.get_queue_sender(queue) as sender:
                sender.send_messages(ServiceBusMessage("never"))

    async def run() -> None:
        options = {**primary.websocket_client_kwargs, "http_proxy": {**proxy.aio_http_proxy, "password": "nope"}}
        async with AsyncServiceBusClient("localhost", AzureNamedKeyCredential(DEFAULT_KEY_NAME, DEFAULT_KEY),
                                         retry_total=0, **options) as client:
            async with client.get_queue_sender(queue) as sender:
                await sender.send_messages(ServiceBusMessage("never"))

    with pytest.raises(ServiceBusError, match="407.*Proxy Authentication Required") as async_error:
        asyncio.run(run())
    assert proxy.refused == refused + 2
    assert _empty(primary, queue, proxy)
    for error in (sync_error.value, async_error.value):
        assert proxy.http_proxy["password"] not in str(error) and "not-the-password" not in str(error)
    assert proxy.http_proxy["password"] not in repr(proxy)


def test_without_a_password_the_proxy_answers_407_and_one_limited_to_443_answers_403(primary: NamespaceInfo,
                                                                                     make_queue) -> None:
    queue = make_queue()
    with HttpProxy(username="user", password="secret") as strict, HttpProxy(allowed_ports={443}) as egress:
        anonymous = {"proxy_hostname": strict.host, "proxy_port": strict.port}
        with pytest.raises(ServiceBusError, match="407"):
            with _sync_client("wss", primary, strict, http_proxy=anonymous) as client:
                with client.get_queue_sender(queue) as sender:
                    sender.send_messages(ServiceBusMessage("never"))
        # an egress that opens 443 only: the emulator's wss port is not 443
        with pytest.raises(ServiceBusError, match="403"):
            with _sync_client("wss-proxy", primary, egress) as client:
                with client.get_queue_sender(queue) as sender:
                    sender.send_messages(ServiceBusMessage("never"))
        assert (strict.refused, egress.refused, sum(strict.tunnels.values()), sum(egress.tunnels.values())) \
            == (1, 1, 0, 0)
    assert _empty(primary, queue, strict)


def test_the_async_sdk_takes_the_proxy_as_a_url_and_the_sync_one_as_a_host(primary: NamespaceInfo,
                                                                           proxy: HttpProxy, make_queue) -> None:
    """azure-servicebus 7.15 hands ``proxy_hostname:proxy_port`` to aiohttp, which wants a URL, and to
    websocket-client, which wants a host: Microsoft's sample (a bare host) works with the sync client only."""
    queue = make_queue()

    async def send(http_proxy: dict[str, Any]) -> None:
        options = {**primary.websocket_client_kwargs, "http_proxy": http_proxy}
        async with AsyncServiceBusClient("localhost", AzureNamedKeyCredential(DEFAULT_KEY_NAME, DEFAULT_KEY),
                                         retry_total=0, **options) as client:
            async with client.get_queue_sender(queue) as sender:
                await sender.send_messages(ServiceBusMessage("through the proxy"))

    with pytest.raises(ServiceBusError, match=f"{proxy.host}:{proxy.port}"):
        asyncio.run(send(proxy.http_proxy))
    with pytest.raises(ServiceBusConnectionError, match="Name or service not known|resolve|getaddrinfo"):
        with _sync_client("wss", primary, proxy, http_proxy=proxy.aio_http_proxy) as client:
            with client.get_queue_sender(queue) as sender:
                sender.send_messages(ServiceBusMessage("never"))
    asyncio.run(send(proxy.aio_http_proxy))
    with _sync_client("wss-proxy", primary, proxy) as client:
        with client.get_queue_receiver(queue, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as receiver:
            assert [str(m) for m in receiver.receive_messages(max_message_count=5, max_wait_time=2)] \
                == ["through the proxy"]


def test_the_proxy_command_tunnels_for_the_sdk_with_its_password_from_the_environment(
        primary: NamespaceInfo, proxy: HttpProxy, make_queue) -> None:
    queue, secret = make_queue(), uuid.uuid4().hex
    env = {**os.environ, "SPARK_SB_PROXY_PASSWORD": secret}
    command = [sys.executable, "-m", "spark_sb.cli", "emulator", "proxy", "--port", "0", "--username", "egress"]
    missing = subprocess.run(command, capture_output=True, text=True, timeout=30,
                             env={k: v for k, v in env.items() if k != "SPARK_SB_PROXY_PASSWORD"})
    assert (missing.returncode, missing.stderr.strip()) \
        == (2, "spark-sb emulator proxy: --username needs the password in $SPARK_SB_PROXY_PASSWORD")
    running = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        tag, url = running.stdout.readline().split()
        assert tag == "PROXY" and url.startswith("http://127.0.0.1:")
        http_proxy = {"proxy_hostname": "127.0.0.1", "proxy_port": int(url.rsplit(":", 1)[1]),
                      "username": "egress", "password": secret}
        with _sync_client("wss", primary, proxy, http_proxy=http_proxy) as client:
            with client.get_queue_sender(queue) as sender:
                sender.send_messages(ServiceBusMessage("through the command's proxy"))
    finally:
        running.terminate()
        out, err = running.communicate(timeout=10)
    assert running.returncode == 0 and out.strip() == "opened 1 tunnels, refused 0 requests"
    assert secret not in out + err
    assert not _empty(primary, queue, proxy)


# --- outages ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["ws", "wss-proxy"])
def test_an_outage_drops_websocket_clients_and_they_reconnect_after_heal(
        kind: str, emulator: Emulator, primary: NamespaceInfo, proxy: HttpProxy, make_queue) -> None:
    queue = make_queue()
    with _sync_client(kind, primary, proxy) as client:
        with client.get_queue_sender(queue) as sender:
            sender.send_messages(ServiceBusMessage("before"))
            emulator.fault("primary", "down")
            started = time.monotonic()
            with pytest.raises(ServiceBusConnectionError):
                sender.send_messages(ServiceBusMessage("during"))
            assert time.monotonic() - started < 10
            emulator.heal("primary")
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


def test_an_outage_drops_an_async_websocket_receiver_and_it_receives_after_heal(
        emulator: Emulator, primary: NamespaceInfo, proxy: HttpProxy, make_queue) -> None:
    queue = make_queue()

    async def run() -> tuple[type[BaseException], list[str]]:
        async with _async_client("wss-proxy", primary, proxy) as client:
            async with client.get_queue_receiver(queue, max_wait_time=2) as receiver:
                await receiver.peek_messages(max_message_count=1)  # the connection is open
                emulator.fault("primary", "down")
                try:
                    with pytest.raises(ServiceBusConnectionError) as dropped:
                        await receiver.peek_messages(max_message_count=1)
                finally:
                    emulator.heal("primary")
            with _sync_client("ws", primary, proxy) as sync_client, sync_client.get_queue_sender(queue) as sender:
                sender.send_messages(ServiceBusMessage("after heal"))
            async with client.get_queue_receiver(queue, max_wait_time=2) as receiver:
                got = await receiver.receive_messages(max_wait_time=3)
                for m in got:
                    await receiver.complete_message(m)
        return dropped.type, [str(m) for m in got]

    assert asyncio.run(run()) == (ServiceBusConnectionError, ["after heal"])


def test_an_outage_closes_an_idle_websocket_at_once_and_nothing_is_served_while_down(
        emulator: Emulator, primary: NamespaceInfo) -> None:
    ws = websocket.create_connection(f"ws://localhost:{primary.ws_port}{WEBSOCKET_PATH}",
                                     subprotocols=["AMQPWSB10"], timeout=5)
    try:
        ws.send_binary(AMQP_SASL_HEADER)
        assert ws.recv()[:8] == AMQP_SASL_HEADER  # the namespace answers with its own header
        emulator.fault("primary", "down")
        started = time.monotonic()
        with pytest.raises(websocket.WebSocketConnectionClosedException):
            while True:
                ws.recv()  # the mechanisms frame, then the end of the stream
        assert time.monotonic() - started < 3
        with pytest.raises(websocket.WebSocketConnectionClosedException):
            again = websocket.create_connection(f"ws://localhost:{primary.ws_port}{WEBSOCKET_PATH}",
                                                subprotocols=["AMQPWSB10"], timeout=5)
            again.send_binary(AMQP_SASL_HEADER)
            again.recv()
    finally:
        emulator.heal("primary")
        ws.close()


# --- the endpoint ----------------------------------------------------------------------------------------------


def test_only_the_sdks_path_and_subprotocol_open_a_websocket(primary: NamespaceInfo) -> None:
    context = ssl.create_default_context(cafile=primary.ca_file)
    secure = websocket.create_connection(f"wss://localhost:{primary.wss_port}{WEBSOCKET_PATH}",
                                         subprotocols=["AMQPWSB10"], sslopt={"context": context}, timeout=5)
    try:
        assert secure.getheaders()["sec-websocket-protocol"] == "AMQPWSB10"
        secure.send_binary(AMQP_SASL_HEADER)
        assert secure.recv()[:8] == AMQP_SASL_HEADER
    finally:
        secure.close()
    with pytest.raises(websocket.WebSocketBadStatusException) as wrong_path:
        websocket.create_connection(f"ws://localhost:{primary.ws_port}/websocket", subprotocols=["AMQPWSB10"],
                                    timeout=5)
    assert wrong_path.value.status_code == 404 and WEBSOCKET_PATH.encode() in wrong_path.value.resp_body
    with pytest.raises(websocket.WebSocketBadStatusException) as no_subprotocol:
        websocket.create_connection(f"ws://localhost:{primary.ws_port}{WEBSOCKET_PATH}", timeout=5)
    assert no_subprotocol.value.status_code == 400
    with pytest.raises(ssl.SSLCertVerificationError):  # wss is TLS with the emulator's CA, not a public one
        websocket.create_connection(f"wss://localhost:{primary.wss_port}{WEBSOCKET_PATH}",
                                    subprotocols=["AMQPWSB10"], timeout=5)
    text = websocket.create_connection(f"ws://localhost:{primary.ws_port}{WEBSOCKET_PATH}",
                                       subprotocols=["AMQPWSB10"], timeout=5)
    try:
        text.send("AMQP")  # the binding carries binary messages only
        with pytest.raises(websocket.WebSocketConnectionClosedException):
            while True:
                text.recv()
    finally:
        text.close()


def test_a_namespace_without_websockets_has_no_websocket_ports(emulator: Emulator) -> None:
    with Emulator([NamespaceOptions("plain"), NamespaceOptions("secure", wss_port=0)]) as emu:
        plain, secure = emu["plain"], emu["secure"]
        assert (plain.ws_port, plain.wss_port, plain.ca_file) == (None, None, None)
        assert secure.ws_port is None and secure.wss_port and secure.ca_file
        with pytest.raises(ValueError, match="'plain' has no wss port"):
            plain.websocket_client_kwargs  # noqa: B018
        with pytest.raises(ValueError, match="'secure' has no ws port"):
            secure.websocket_connection_string_kwargs  # noqa: B018


def _ws_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "sb-emulator-ws"]


def test_stop_closes_the_websocket_ports_and_open_clients(tmp_path) -> None:
    before = len(_ws_threads())
    emu = Emulator([NamespaceOptions("p")], data_dir=tmp_path, websockets=True)
    with emu:
        info = emu["p"]
        server = emu.server("p")
        server.call(lambda: server.broker.create_entity(QueueSpec(name="q")))
        client = ServiceBusClient.from_connection_string(info.connection_string, retry_total=0,
                                                         **info.websocket_connection_string_kwargs)
        sender = client.get_queue_sender("q")
        sender.send_messages(ServiceBusMessage("open at stop"))
        ports = (info.ws_port, info.wss_port)
    assert len(_ws_threads()) == before
    for port in ports:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("127.0.0.1", port))
    with pytest.raises(ServiceBusConnectionError):
        sender.send_messages(ServiceBusMessage("after stop"))
    sender.close()
    client.close()


def test_a_taken_websocket_port_is_a_clear_error_naming_it() -> None:
    before = len(_ws_threads())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"namespace p: cannot listen for AMQP over WebSockets \\(ws\\) on "
                                          f"127.0.0.1:{port}"):
            Emulator([NamespaceOptions("p", ws_port=port)]).start()
        result = subprocess.run(
            [sys.executable, "-m", "spark_sb.cli", "emulator", "start", "--in-memory",
             "--namespace", f"p=0:0,wss={port}"], capture_output=True, text=True, timeout=30)
    assert len(_ws_threads()) == before
    assert result.returncode == 2, result.stderr
    assert f"secure WebSockets (wss) on 127.0.0.1:{port}" in result.stderr and "Traceback" not in result.stderr


def test_the_namespace_spec_names_websocket_ports_and_says_what_it_expects() -> None:
    options = NamespaceOptions.parse("p=5672:5300:5671,ws=5380,wss=5443")
    assert (options.tls_port, options.ws_port, options.wss_port) == (5671, 5380, 5443)
    assert NamespaceOptions.parse(options.spec()) == options
    assert NamespaceOptions.parse("p=0:0,wss=0") == NamespaceOptions("p", wss_port=0)
    for bad in ("p=0:0,wx=1", "p=0:0,ws=1,ws=2", "p=0:0,ws=", "p=0:0,ws=70000"):
        with pytest.raises(ValueError, match=r"ws=PORT, wss=PORT|port number") as err:
            NamespaceOptions.parse(bad)
        assert repr(bad) in str(err.value)


def test_the_cli_prints_the_websocket_urls_and_the_ca_file(tmp_path) -> None:
    from spark_sb.emulator.server import default_namespaces

    # without --namespace, --websockets puts the primary on ws 5380 and wss 5443
    assert [(n.name, n.ws_port, n.wss_port) for n in default_namespaces(websockets=True)] \
        == [("primary", 5380, 5443), ("secondary", 5381, 5444)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "spark_sb.cli", "emulator", "start", "--data-dir", str(tmp_path / "data"),
         "--websockets", "--namespace", "alpha=0:0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = [proc.stdout.readline().strip() for _ in range(4)]
        name, connection_string = lines[0].split(" ", 1)
        (ws_tag, ws_name, ws_url), (wss_tag, wss_name, wss_url) = (line.split(" ") for line in lines[1:3])
        assert (name, ws_tag, ws_name, wss_tag, wss_name) == ("alpha", "WS", "alpha", "WSS", "alpha")
        assert ws_url.startswith("ws://localhost:") and ws_url.endswith("/$servicebus/websocket")
        assert wss_url.startswith("wss://localhost:") and wss_url.endswith("/$servicebus/websocket")
        assert lines[3] == f"CA {(tmp_path / 'data' / 'tls' / 'ca.pem').absolute()}"
        ws_port = int(ws_url.split(":")[2].split("/")[0])
        with ServiceBusClient.from_connection_string(
                connection_string, retry_total=0, transport_type=TransportType.AmqpOverWebsocket,
                custom_endpoint_address=f"sb://localhost:{ws_port}") as client:
            with pytest.raises(MessagingEntityNotFoundError):  # the namespace answered over the WebSocket
                with client.get_queue_sender("no-such-queue") as sender:
                    sender.send_messages(ServiceBusMessage("x"))
    finally:
        proc.terminate()
        proc.wait(10)
    assert proc.returncode == 0


def test_the_subprocess_emulator_keeps_its_websocket_ports_and_messages_across_a_restart(tmp_path) -> None:
    queue = f"ws-{uuid.uuid4().hex[:6]}"
    entities = tmp_path / "entities.yaml"
    entities.write_text(f"queues:\n  - name: {queue}\n")
    proc = EmulatorProcess.start(data_dir=tmp_path / "data", namespaces=[NamespaceOptions("p")],
                                 entities=entities, websockets=True)
    try:
        before = proc["p"]
        assert before.ws_port and before.wss_port and before.ca_file
        with ServiceBusClient.from_connection_string(before.connection_string, retry_total=0,
                                                     **before.websocket_connection_string_kwargs) as client:
            with client.get_queue_sender(queue) as sender:
                sender.send_messages(ServiceBusMessage("kept"))
        proc.kill()
        proc = proc.restart()
        after = proc["p"]
        assert (after.ws_port, after.wss_port, after.ca_file) == (before.ws_port, before.wss_port, before.ca_file)
        credential = AzureNamedKeyCredential(DEFAULT_KEY_NAME, DEFAULT_KEY)
        with ServiceBusClient("localhost", credential, retry_total=0, **after.websocket_client_kwargs) as client:
            with client.get_queue_receiver(queue, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as receiver:
                assert [str(m) for m in receiver.receive_messages(max_wait_time=3)] == ["kept"]
    finally:
        proc.stop()


def test_a_connection_string_naming_a_websocket_port_is_this_namespaces(primary: NamespaceInfo,
                                                                        make_queue: Callable[..., str]) -> None:
    """``Endpoint=sb://localhost:<ws port>``: the SDK's tokens then name that port. It is this namespace's, as
    its AMQP, AMQPS and admin ports are (the put-token was refused as another namespace's)."""
    from spark_sb.admin import admin_client

    queue = make_queue()
    conn = primary.connection_string.replace(f":{primary.amqp_port};", f":{primary.ws_port};")
    with ServiceBusClient.from_connection_string(conn, retry_total=0,
                                                 **primary.websocket_connection_string_kwargs) as client:
        with client.get_queue_sender(queue) as sender:
            sender.send_messages(ServiceBusMessage("via the ws port", message_id="ws-port"))
        with client.get_queue_receiver(queue) as receiver:
            [got] = receiver.receive_messages(max_wait_time=5)
            receiver.complete_message(got)
    assert got.message_id == "ws-port"
    with admin_client(conn, admin_endpoint=primary.admin_url, retry_total=0) as admin:
        assert admin.get_queue(queue).name == queue
