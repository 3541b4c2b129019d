"""A far namespace (issue 21): ``latency`` delays every byte of its AMQP connections each way, so a round trip
costs twice the latency, over AMQP and AMQPS alike; nothing else changes. Only lower bounds on time are asserted
(a loaded machine makes a round trip longer, never shorter)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage
from azure.servicebus.exceptions import ServiceBusError

from spark_sb.emulator import Emulator, NamespaceOptions
from spark_sb.emulator.model import QueueSpec

LATENCY = 0.05


@pytest.fixture(scope="module")
def far() -> Iterator[Emulator]:
    emu = Emulator([NamespaceOptions("near"), NamespaceOptions("far", latency=LATENCY)], tls=True,
                   entities={"queues": [{"name": "q"}]})
    with emu:
        yield emu


def _round_trips(client: ServiceBusClient, n: int = 5) -> float:
    """The shortest of ``n`` sends (each one round trip once the link is open)."""
    with client.get_queue_sender("q", keep_alive=0) as sender:
        sender.send_messages(ServiceBusMessage(b"open"))
        times = []
        for i in range(n):
            started = time.perf_counter()
            sender.send_messages(ServiceBusMessage(f"m{i}"))
            times.append(time.perf_counter() - started)
    return min(times)


def test_a_round_trip_to_a_far_namespace_costs_twice_its_latency(far) -> None:
    with ServiceBusClient.from_connection_string(far["far"].connection_string) as client:
        far_trip = _round_trips(client)
        assert far_trip >= 2 * LATENCY
        with client.get_queue_receiver("q", max_wait_time=2) as receiver:  # and it is a namespace like any other
            got = receiver.receive_messages(max_message_count=10, max_wait_time=2)
            assert {str(m) for m in got} >= {"open", "m0"}
            for m in got:
                receiver.complete_message(m)
    with ServiceBusClient.from_connection_string(far["near"].connection_string) as client:
        assert _round_trips(client) < far_trip  # the other namespace is not delayed


def test_amqps_to_a_far_namespace_is_as_far(far) -> None:
    from azure.core.credentials import AzureNamedKeyCredential

    info = far["far"]
    credential = AzureNamedKeyCredential(info.key_name, info.key)
    with ServiceBusClient("localhost", credential, **info.tls_client_kwargs) as client:
        assert _round_trips(client) >= 2 * LATENCY


def test_a_far_namespace_going_down_drops_its_clients(far) -> None:
    server = far.server("far")
    server.call(lambda: server.broker.create_entity(QueueSpec(name="down-q")))
    with ServiceBusClient.from_connection_string(far["far"].connection_string, retry_total=0) as client, \
            client.get_queue_sender("down-q", keep_alive=0) as sender:
        sender.send_messages(ServiceBusMessage(b"before"))
        far.fault("far", "down", duration=5)
        try:
            with pytest.raises(ServiceBusError):
                sender.send_messages(ServiceBusMessage(b"during"))
        finally:
            far.heal("far")


def test_the_namespace_spec_carries_the_latency() -> None:
    options = NamespaceOptions.parse("far=0:0,latency=20ms")
    assert options.latency == pytest.approx(0.02) and NamespaceOptions.parse(options.spec()) == options
    assert NamespaceOptions.parse("p=0:0:0,ws=0,latency=1.5").latency == 1.5
    for bad, says in (("p=0:0,latency=soon", "latency: not a duration"), ("p=0:0,latency=-5ms", "latency")):
        with pytest.raises(ValueError, match=says) as err:
            NamespaceOptions.parse(bad)
        assert bad in str(err.value)
