"""Service Bus's habits in the emulator (issue 22): an entity link idle longer than ``idle_detach`` is detached,
and every entity link every ``detach_every`` seconds, both with ``amqp:link:detach-forced``; the SDK opens the
link again on its next use, so a client that retries loses nothing. SAS tokens are accepted for their lifetime
only (their ``se``): a connection that outlives its token must put a new one."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage
from azure.servicebus.exceptions import OperationTimeoutError, ServiceBusConnectionError, ServiceBusError

from spark_sb.emulator import Emulator, NamespaceOptions


@pytest.fixture(scope="module")
def habits() -> Iterator[Emulator]:
    emu = Emulator([NamespaceOptions("idle", idle_detach=1.0), NamespaceOptions("forced", detach_every=4.0),
                    NamespaceOptions("plain")],
                   entities={"queues": [{"name": "q", "lock_duration": 5}]})
    with emu:
        yield emu


def _receive(receiver: Any) -> list[str]:
    """Receive and complete what is there; what was received. A receive's retries must fit in its wait, so a
    short receive on a detached link raises ServiceBusConnectionError, and one whose new link did not open within
    its wait OperationTimeoutError (on Service Bus too; on a loaded machine the opening alone can take longer than
    half a second): receive again, as a client must, waiting longer each time (a receiver that waits past the idle
    limit is detached, and that is one more try). A link detached between a receive and its complete fails the
    complete (ServiceBusError): the complete may have been done or not (its answer was lost with the link); if
    not, the message comes again once its lock expired (the queue's 5 s), and is received again (at least once)."""
    for wait in (0.5, 1.0, 2.0, 2.0, 4.0, 4.0, 8.0, 8.0):
        try:
            got = receiver.receive_messages(max_message_count=10, max_wait_time=wait)
        except (ServiceBusConnectionError, OperationTimeoutError):
            continue
        for message in got:
            with contextlib.suppress(ServiceBusError):
                receiver.complete_message(message)
        return [str(m) for m in got]
    raise AssertionError("eight receives in a row failed")


def _until_empty(receiver: Any, seconds: float = 60) -> list[str]:
    """Receive (and complete) until a peek finds the queue empty, locked messages included (a complete that failed
    leaves its message locked for 5 s): what was received. On a namespace that detaches every link every few
    seconds an empty queue's receive ends detached more often than not (it waits), so a failed receive is tried
    again here too, until the peek says nothing is left."""
    got: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if not receiver.peek_messages(max_message_count=1, sequence_number=1):
                return got
        except ServiceBusError:
            time.sleep(0.2)
            continue
        with contextlib.suppress(AssertionError):
            got += _receive(receiver)
        time.sleep(0.5)
    raise AssertionError(f"the queue still holds messages after {seconds:g} s")


def _detached(emu: Emulator, name: str) -> dict[str, int]:
    server = emu.server(name)
    return server.call(lambda: dict(server.detached))


@pytest.mark.parametrize(("namespace", "kind"), [("idle", "idle"), ("forced", "forced")])
def test_a_detached_link_is_opened_again_by_the_sdk_and_nothing_is_lost(habits, namespace, kind) -> None:
    before = _detached(habits, namespace)[kind]
    with ServiceBusClient.from_connection_string(habits[namespace].connection_string) as client, \
            client.get_queue_sender("q") as sender, client.get_queue_receiver("q", prefetch_count=0) as receiver:
        got: list[str] = []
        sent = 0
        # rounds longer than the idle limit (each receive waits less than it: a receiver waiting longer than the
        # limit is idle too, as on Service Bus), until the sender's and the receiver's links were detached at least
        # twice in all (a forced detach every 4 s takes a few rounds; a link that opens slowly on a loaded machine
        # still has most of that to receive in)
        while sent < 2 or (_detached(habits, namespace)[kind] - before < 2 and sent < 20):
            sender.send_messages(ServiceBusMessage(f"{namespace}-{sent}"))
            sent += 1
            time.sleep(1.2)
            got += _receive(receiver)
            time.sleep(1.2)
        got += _until_empty(receiver)
    assert set(got) == {f"{namespace}-{i}" for i in range(sent)}  # each at least once (a complete may fail)
    assert _detached(habits, namespace)[kind] - before >= 2


def test_a_link_detached_between_a_receive_and_its_complete_fails_the_complete_and_loses_nothing(habits) -> None:
    """The race the detach test met under load: the link is detached after the receive, before the complete. The
    complete fails (ServiceBusError; on Service Bus too, and whether it was done is not known: its answer went
    with the link); the message is not lost: it was completed, or it comes again once its lock expired."""
    info, server = habits["plain"], habits.server("plain")
    with ServiceBusClient.from_connection_string(info.connection_string) as client, \
            client.get_queue_sender("q") as sender, client.get_queue_receiver("q", prefetch_count=0) as receiver:
        sender.send_messages(ServiceBusMessage("raced", message_id="raced"))
        [message] = receiver.receive_messages(max_message_count=1, max_wait_time=5)
        server.call(lambda: server.detach_links("q"))
        with pytest.raises(ServiceBusError):
            receiver.complete_message(message)
        assert set(_until_empty(receiver)) <= {"raced"}


def test_a_forced_detach_takes_the_entitys_management_links_too(habits) -> None:
    """Service Bus moves an entity with its ``$management`` node: a forced detach detaches those links too
    (not ``$cbs``, a namespace link the SDK never opens again). The SDK fails the management call in flight
    (``ServiceBusError``: the handler shuts down) and opens the handler again on the next one."""

    info, server = habits["plain"], habits.server("plain")
    with ServiceBusClient.from_connection_string(info.connection_string) as client, \
            client.get_queue_sender("q") as sender, client.get_queue_receiver("q", prefetch_count=0) as receiver:
        sender.send_messages(ServiceBusMessage("peeked", message_id="peeked"))
        assert [m.message_id for m in receiver.peek_messages(10)] == ["peeked"]  # the receiver's $management
        before = server.call(lambda: dict(server.detached))["forced"]
        detached = server.call(lambda: server.detach_links("q"))
        assert detached == 4  # the sender's and receiver's links, the receiver's two $management links
        failures = 0
        while True:
            try:
                peeked = receiver.peek_messages(10, sequence_number=1)
                break
            except ServiceBusError:
                failures += 1
                assert failures < 3
        assert [m.message_id for m in peeked] == ["peeked"] and failures <= 1
        assert server.call(lambda: dict(server.detached))["forced"] - before == 4
        _receive(receiver)


def test_the_namespace_spec_carries_the_habits() -> None:
    options = NamespaceOptions.parse("p=0:0,idle-detach=10m,detach-every=30s,latency=5ms")
    assert (options.idle_detach, options.detach_every, options.latency) == (600.0, 30.0, 0.005)
    assert NamespaceOptions.parse(options.spec()) == options
    with pytest.raises(ValueError, match="idle-detach"):
        NamespaceOptions.parse("p=0:0,idle-detach=soon")
    with pytest.raises(ValueError, match="detach-every"):
        NamespaceOptions.parse("p=0:0,detach-every=-1s")


class _ShortSas:
    """A TokenCredential that signs SAS tokens valid for ``ttl`` seconds (the SDK's own last an hour): the SDK
    puts a new one on $cbs when 10% of its life is left."""

    def __init__(self, info: Any, ttl: float) -> None:
        self.info, self.ttl, self.issued = info, ttl, 0

    def get_token(self, *scopes: str, **kwargs: Any) -> Any:
        from azure.core.credentials import AccessToken

        from spark_sb.emulator.sas import make_token

        self.issued += 1
        expires = int(time.time() + self.ttl)
        # for the whole namespace (the SDK asks a TokenCredential for its Entra ID scope, not a resource)
        resource = f"sb://localhost:{self.info.amqp_port}"
        return AccessToken(make_token(resource, self.info.key_name, self.info.key, ttl=self.ttl), expires)


def _client(info: Any, credential: Any) -> ServiceBusClient:
    return ServiceBusClient(f"localhost:{info.amqp_port}", credential, use_tls=False, retry_total=0)


class _LyingSas:
    """A TokenCredential that hands the SDK a SAS token valid for 2 s but says it lasts an hour: the SDK neither
    renews it nor notices its expiry, so only the service can refuse it."""

    def __init__(self, token: str) -> None:
        self.token = token

    def get_token(self, *scopes: str, **kwargs: Any) -> Any:
        from azure.core.credentials import AccessToken

        return AccessToken(self.token, int(time.time() + 3600))


def test_a_sas_token_is_accepted_for_its_lifetime_only(habits) -> None:
    from azure.servicebus.exceptions import ServiceBusAuthenticationError, ServiceBusAuthorizationError

    from spark_sb.emulator.sas import make_token

    info = habits["plain"]
    token = make_token(f"sb://localhost:{info.amqp_port}", info.key_name, info.key, ttl=2)
    with _client(info, _LyingSas(token)) as client, client.get_queue_sender("q") as sender:
        sender.send_messages(ServiceBusMessage("in time"))
        time.sleep(3)  # the token expired: the emulator refuses what it no longer covers (it took it forever)
        with pytest.raises((ServiceBusAuthenticationError, ServiceBusAuthorizationError), match="ExpiredToken"):
            sender.send_messages(ServiceBusMessage("too late"))


def test_the_sdk_renews_a_short_lived_sas_token_and_carries_on(habits) -> None:
    info = habits["plain"]
    credential = _ShortSas(info, ttl=10)  # the SDK renews in the last 10%, in whole seconds: at least 1 s
    with _client(info, credential) as client, client.get_queue_sender("q") as sender:
        for i in range(24):  # 12 s, past the first token's life, a send in its last second
            sender.send_messages(ServiceBusMessage(f"renewed-{i}"))
            time.sleep(0.5)
    assert credential.issued >= 2
    got = []
    with ServiceBusClient.from_connection_string(info.connection_string) as client, \
            client.get_queue_receiver("q", prefetch_count=0) as receiver:
        while page := _receive(receiver):
            got += page
    assert sorted(m for m in got if m.startswith("renewed-")) == sorted(f"renewed-{i}" for i in range(24))
