"""Service Bus's limits, played per namespace (:mod:`spark_sb.emulator.limits`), against the real SDK: the connection
quota, the concurrent receivers of an entity, throttling, and the stats that count them.

Small limits keep each test to seconds. What the SDK raises (azure-servicebus 7.15, sync):

- a connection over ``max-connections``: ``ServiceBusConnectionError`` (pyamqp raises a connection error for a closed
  connection, whatever its condition), ``str()`` = the description + `` Error condition: amqp:resource-limit-exceeded.``;
- a receiver over ``max-receivers``: ``ServiceBusQuotaExceededError`` while it opens, not retried;
- a throttled send: ``ServiceBusServerBusyError``, ``str()`` = the service's words with "Please wait N seconds";
  a throttled management request likewise, with `` Status Code: 503.``.
"""

from __future__ import annotations

import gc
import re
import socket
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest
from azure.servicebus import (
    ServiceBusClient,
    ServiceBusMessage,
    ServiceBusReceiveMode,
    ServiceBusReceiver,
    ServiceBusSender,
)
from azure.servicebus.exceptions import (
    ServiceBusConnectionError,
    ServiceBusQuotaExceededError,
    ServiceBusServerBusyError,
)

from spark_sb import cli
from spark_sb.emulator import Emulator, EmulatorProcess, NamespaceInfo, NamespaceOptions
from spark_sb.emulator.model import QueueSpec
from spark_sb.emulator.server import send_control

ENTITIES = {"queues": [{"name": "orders"}, {"name": "other"}],
            "topics": [{"name": "events", "subscriptions": [{"name": "audit"}]}]}
QUOTA = "amqp:resource-limit-exceeded"
WAIT = re.compile(r"Please wait (\d+) seconds and try again\.")


def _stats(info: NamespaceInfo) -> dict:
    return send_control(info.admin_url, "stats")


def _until(what: str, check: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def _client(info: NamespaceInfo, stack: ExitStack, **kwargs: Any) -> ServiceBusClient:
    """A client that does not retry (a refusal is the answer), closed with ``stack``."""
    return stack.enter_context(ServiceBusClient.from_connection_string(info.connection_string, retry_total=0,
                                                                       **kwargs))


def _held_sender(info: NamespaceInfo, stack: ExitStack, **kwargs: Any) -> ServiceBusSender:
    """A sender whose connection is open (it sent a message); each SDK sender has its own connection (without a
    keep-alive thread, a sender closes at once)."""
    sender = stack.enter_context(_client(info, stack, **kwargs).get_queue_sender("orders", keep_alive=0))
    sender.send_messages(ServiceBusMessage("hold"), timeout=10)
    return sender


@pytest.fixture
def start() -> Iterator[Callable[..., Emulator]]:
    """``start(**options)``: an emulator with one namespace, ``limits``, of these options; stopped after the test."""
    with ExitStack() as stack:
        def run(websockets: bool = False, **options: Any) -> Emulator:
            return stack.enter_context(Emulator([NamespaceOptions("limits", **options)], entities=ENTITIES,
                                                websockets=websockets))

        yield run


@pytest.mark.timeout(60)
def test_the_connection_over_the_quota_is_refused_and_a_closed_one_frees_its_slot(
        start: Callable[..., Emulator]) -> None:
    info = start(max_connections=3)["limits"]
    with ExitStack() as held:
        senders = [_held_sender(info, held) for _ in range(3)]
        assert _stats(info)["connections"] == 3
        with ExitStack() as extra:
            with pytest.raises(ServiceBusConnectionError) as caught:
                _held_sender(info, extra)
        text = str(caught.value)
        assert ("Cannot open a new connection: the namespace 'limits' already has 3 concurrent connections, its "
                "maximum (max-connections)") in text
        assert f"Error condition: {QUOTA}." in text
        stats = _stats(info)
        assert (stats["connections"], stats["connections_refused"]) == (3, 1)
        senders[0].close()
        _until("the closed sender's connection is forgotten", lambda: _stats(info)["connections"] == 2)
        with ExitStack() as again:
            _held_sender(info, again)  # the freed slot is usable
            assert _stats(info)["connections"] == 3
        _until("the last sender's connection is forgotten", lambda: _stats(info)["connections"] == 2)
    _until("every connection is forgotten", lambda: _stats(info)["connections"] == 0)
    assert _stats(info)["connections_refused"] == 1


@pytest.mark.timeout(60)
def test_every_transport_counts_and_a_connection_counts_from_accept_to_close(
        start: Callable[..., Emulator]) -> None:
    info = start(max_connections=2, websockets=True)["limits"]
    ws = info.websocket_connection_string_kwargs
    bare = socket.create_connection(("127.0.0.1", info.amqp_port), timeout=10)  # never speaks AMQP: still held
    try:
        _until("the bare connection counts", lambda: _stats(info)["connections"] == 1)
        with ExitStack() as held:
            _held_sender(info, held, **ws)  # AMQP over WebSockets
            assert _stats(info)["connections"] == 2
            # at the quota, a new connection takes the slot of one without a token (issue 49): the bare one
            _held_sender(info, held)
            assert bare.recv(1024) == b""  # dropped: it never opened, there is nothing to answer
            stats = _stats(info)
            assert (stats["connections"], stats["connections_refused"], stats["unauthenticated_closed"]) == (2, 0, 1)
            # both held have a token: the next is refused, whatever its transport
            with ExitStack() as extra, pytest.raises(ServiceBusConnectionError, match="max-connections"):
                _held_sender(info, extra, **ws)
            with ExitStack() as extra, pytest.raises(ServiceBusConnectionError, match="max-connections"):
                _held_sender(info, extra)
            stats = _stats(info)
            assert (stats["connections"], stats["connections_refused"]) == (2, 2)
    finally:
        bare.close()
    _until("every connection is forgotten", lambda: _stats(info)["connections"] == 0)


@pytest.mark.timeout(60)
def test_the_receiver_over_an_entitys_limit_is_refused_while_it_opens(
        start: Callable[..., Emulator]) -> None:
    info = start(max_receivers=1)["limits"]
    with ExitStack() as stack:
        client = _client(info, stack)

        def receiver(entity: str, stack: ExitStack = stack) -> ServiceBusReceiver:
            if entity == "events/subscriptions/audit":
                return stack.enter_context(client.get_subscription_receiver("events", "audit", max_wait_time=1))
            return stack.enter_context(client.get_queue_receiver(entity, max_wait_time=1))

        first = receiver("orders")
        with ExitStack() as extra, pytest.raises(ServiceBusQuotaExceededError) as caught:
            receiver("orders", extra)
        assert ("Cannot attach a receiver to 'orders': it already has 1 concurrent receivers, its maximum "
                "(max-receivers)") in str(caught.value)
        assert f"Error condition: {QUOTA}." in str(caught.value)
        # the limit is per entity: a subscription has its own; senders do not count
        receiver("events/subscriptions/audit")
        with ExitStack() as extra, pytest.raises(ServiceBusQuotaExceededError, match="'events/subscriptions/audit'"):
            receiver("events/subscriptions/audit", extra)
        with client.get_queue_sender("orders", keep_alive=0) as sender:
            sender.send_messages(ServiceBusMessage("for the third receiver"), timeout=10)
        assert _stats(info)["receivers_refused"] == 2
        first.close()  # its slot is free again
        third = receiver("orders")
        got = third.receive_messages(max_message_count=1, max_wait_time=5)
        assert [str(m) for m in got] == ["for the third receiver"]
        third.complete_message(got[0])
    assert _stats(info)["receivers_refused"] == 2


@pytest.mark.timeout(60)
def test_a_burst_over_the_rate_gets_server_busy_with_the_seconds_to_wait(
        start: Callable[..., Emulator]) -> None:
    info = start(ops_per_second=5)["limits"]
    with ExitStack() as stack:
        client = _client(info, stack)
        sender = stack.enter_context(client.get_queue_sender("orders", keep_alive=0))
        receiver = stack.enter_context(client.get_queue_receiver("other", max_wait_time=1))
        # the bucket holds 5 tokens: a batch of 30 finds it positive and is admitted, which takes it to -25 (5 s)
        sender.send_messages([ServiceBusMessage(f"m{i}") for i in range(30)], timeout=10)
        sent_at = time.monotonic()
        with pytest.raises(ServiceBusServerBusyError) as caught:
            sender.send_messages(ServiceBusMessage("one too many"), timeout=10)
        text = str(caught.value)
        assert ("The request was terminated because the namespace 'limits' is being throttled. Error code : 50002. "
                "Please wait ") in text
        assert "Error condition: com.microsoft:server-busy." in text
        wait = int(WAIT.search(text).group(1))  # type: ignore[union-attr]
        assert 5 - (time.monotonic() - sent_at) - 1 <= wait <= 5
        with pytest.raises(ServiceBusServerBusyError, match=r"Please wait \d+ seconds.*Status Code: 503"):
            receiver.peek_messages(max_message_count=1)
    stats = _stats(info)
    assert (stats["ops"], stats["throttled"]) == (30, 2)
    assert stats["limits"] == {"max_connections": 5000, "max_receivers": 5000, "ops_per_second": 5,
                               "message_overhead": 800}  # the in-memory store's


@pytest.mark.timeout(60)
def test_deliveries_over_the_rate_wait_and_are_never_refused(
        start: Callable[..., Emulator]) -> None:
    info = start(ops_per_second=20)["limits"]
    with ExitStack() as stack:
        client = _client(info, stack)
        receiver = stack.enter_context(client.get_queue_receiver(
            "orders", receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE, max_wait_time=1))
        with client.get_queue_sender("orders", keep_alive=0) as sender:
            began = time.monotonic()
            sender.send_messages([ServiceBusMessage(f"m{i}") for i in range(40)], timeout=10)  # the bucket: -20
        got: list[str] = []
        deadline = time.monotonic() + 30
        while len(got) < 40 and time.monotonic() < deadline:
            got += [str(m) for m in receiver.receive_messages(max_message_count=40, max_wait_time=1)]
        took = time.monotonic() - began
    assert sorted(got) == sorted(f"m{i}" for i in range(40))
    # nothing is delivered until the bucket is positive again (1 s), then 20 a second: 40 take 2 s more
    assert took >= 2.5, f"40 deliveries at 20 ops/s after a 40-message send took only {took:.2f} s"
    stats = _stats(info)
    assert (stats["ops"], stats["throttled"]) == (80, 0)


@pytest.mark.timeout(60)
def test_a_client_that_waits_as_told_sends_at_the_rate_and_no_more_is_admitted(
        start: Callable[..., Emulator]) -> None:
    rate, batch = 200, 20
    emulator = start(ops_per_second=rate)
    info, server = emulator["limits"], emulator.server("limits")
    busy: list[tuple[float, int]] = []  # (when, operations admitted so far), at each busy answer
    with ExitStack() as stack:
        sender = stack.enter_context(_client(info, stack).get_queue_sender("orders", keep_alive=0))
        began = time.monotonic()
        while time.monotonic() - began < 5:
            try:
                sender.send_messages([ServiceBusMessage("x") for _ in range(batch)], timeout=10)
            except ServiceBusServerBusyError as err:
                busy.append((time.monotonic(), server.call(lambda: server.ops)))
                time.sleep(int(WAIT.search(str(err)).group(1)))  # type: ignore[union-attr]
        elapsed = time.monotonic() - began
    admitted = _stats(info)["ops"]
    # never more than a full bucket and the rate since, plus what the last admitted batch overdrew
    assert admitted <= rate + rate * elapsed + batch, f"{admitted} operations admitted in {elapsed:.2f} s"
    assert len(busy) >= 3, f"the client was told to wait fewer than three times: {busy}"
    # between two busy answers the bucket went from at most 0 to at most 0: it admitted the rate, within a batch
    # (and the time a busy answer takes to reach the client)
    (t0, ops0), (t1, ops1) = busy[0], busy[-1]
    measured = (ops1 - ops0) / (t1 - t0)
    assert measured <= rate * 1.1, f"{measured:.0f} ops/s admitted at {rate} ops/s"
    # the client loses what the full bucket could not hold while it overslept its wait: loosely bounded
    assert measured >= rate * 0.8, f"a client waiting as told got only {measured:.0f} ops/s of {rate}"


def test_the_namespace_spec_reads_and_writes_the_limits() -> None:
    opts = NamespaceOptions.parse("p=0:0,max-connections=20,ops-per-second=500,max-receivers=5")
    assert (opts.max_connections, opts.max_receivers, opts.ops_per_second) == (20, 5, 500)
    assert NamespaceOptions.parse(opts.spec()) == opts
    assert opts.spec() == "p=0:0,max-connections=20,max-receivers=5,ops-per-second=500"
    default = NamespaceOptions.parse("p=0:0")
    assert (default.max_connections, default.max_receivers, default.ops_per_second) == (5000, 5000, None)
    assert default.spec() == "p=0:0"
    assert NamespaceOptions.parse("p=0:0,ops-per-second=0.5").ops_per_second == 0.5


@pytest.mark.parametrize(("extra", "what"), [
    ("max-connections=0", "max-connections must be a positive integer, got '0'"),
    ("max-connections=many", "max-connections must be a positive integer, got 'many'"),
    ("max-receivers=2.5", "max-receivers must be a positive integer, got '2.5'"),
    ("max-receivers=-1", "max-receivers must be a positive integer, got '-1'"),
    ("ops-per-second=fast", "ops-per-second must be a positive number of operations a second, got 'fast'"),
    ("ops-per-second=0", "ops-per-second must be a positive number of operations a second, got '0'"),
    ("ops-per-second=inf", "ops-per-second must be a positive number of operations a second, got 'inf'"),
    ("max-connection=5", "the limits max-connections=N, max-receivers=N, ops-per-second=RATE"),
])
def test_a_bad_limit_is_refused_naming_the_field_and_the_value(extra: str, what: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=re.escape(what)):
        NamespaceOptions.parse(f"p=0:0,{extra}")
    assert cli.main(["emulator", "start", "--in-memory", "--namespace", f"p=0:0,{extra}"]) == 2
    assert what in capsys.readouterr().err


@pytest.mark.parametrize(("field", "value"), [("max_connections", 0), ("max_receivers", 1.5),
                                              ("ops_per_second", 0), ("ops_per_second", float("nan"))])
def test_the_python_api_refuses_a_bad_limit_naming_it(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"{field} must be a positive"):
        NamespaceOptions("p", **{field: value})


@pytest.mark.timeout(60)
def test_the_command_line_sets_each_namespaces_limits_and_the_stats_report_them() -> None:
    proc = EmulatorProcess.start(data_dir=None, namespaces=[
        NamespaceOptions("tight", max_connections=7, max_receivers=3, ops_per_second=250), NamespaceOptions("plain")])
    try:
        assert _stats(proc["tight"])["limits"] == {"max_connections": 7, "max_receivers": 3, "ops_per_second": 250,
                                                   "message_overhead": 800}
        assert _stats(proc["plain"])["limits"] == {"max_connections": 5000, "max_receivers": 5000,
                                                   "ops_per_second": None, "message_overhead": 800}
    finally:
        proc.stop()


def test_one_byte_messages_meet_their_queues_quota_before_they_outgrow_it_in_memory() -> None:
    """One-byte messages were counted against max-size at their 62 encoded bytes and cost ~13 times that in memory,
    so a 1 GB queue could reach ~13 GB before its quota refused anything. Each stored message is now counted at its
    encoded size plus what its copy costs the emulator: of 50,000 one-byte messages sent to a 4 MB queue, those
    past its quota are refused, and the memory held grew by no more than the quota (or under 300 bytes a message)."""
    quota_mb, total = 4, 50_000
    with Emulator([NamespaceOptions("costly")]) as emu:  # the in-memory store: the costlier one
        server = emu.server("costly")
        server.call(lambda: server.broker.create_entity(QueueSpec(name="tiny", max_size_in_megabytes=quota_mb)))
        with ServiceBusClient.from_connection_string(emu["costly"].connection_string) as client, \
                client.get_queue_sender("tiny") as sender:
            sender.send_messages(ServiceBusMessage(b"x"))  # the link and its first allocations, before measuring
            gc.collect()
            tracemalloc.start()
            try:
                base, sent = tracemalloc.get_traced_memory()[0], 1
                refused: str | None = None
                while sent < total and refused is None:
                    batch, added = sender.create_message_batch(), 0
                    while sent + added < total:
                        try:
                            batch.add_message(ServiceBusMessage(b"x"))
                        except ValueError:  # the batch is full
                            break
                        added += 1
                    try:
                        sender.send_messages(batch)
                        sent += added
                    except ServiceBusQuotaExceededError as err:
                        refused = str(err)
                del batch  # the SDK's copy of the refused messages: not the emulator's
                gc.collect()
                grown = tracemalloc.get_traced_memory()[0] - base
            finally:
                tracemalloc.stop()
    assert refused is not None, f"all {sent} one-byte messages were taken by a {quota_mb} MB queue"
    assert "The maximum entity size has been reached or exceeded for 'tiny'" in refused
    assert grown < max(300 * sent, 1.25 * quota_mb * 1024 * 1024), f"{grown} bytes for {sent} messages"
