"""Pings (issue 9, finding 12 and the ping task): a ping refused for a rejected credential or an unknown entity
is a configuration error surfaced at the next send; a rejected credential on the secondary is one too."""

from __future__ import annotations

import threading
import time

import pytest
from azure.servicebus import ServiceBusMessage

from spark_sb.bus.pings import THREAD_NAME
from spark_sb.errors import CredentialRejectedError, EntityNotFoundError
from spark_sb.paired import PairedSender


def backlog_total(admin, sender) -> int:
    return sum(admin.get_queue_runtime_properties(q).active_message_count for q in sender.backlog_queues)


@pytest.mark.parametrize(("fault", "error"), [("unauthorized", CredentialRejectedError),
                                              ("notfound", EntityNotFoundError)])
def test_a_ping_refused_for_configuration_surfaces_at_the_next_send(
    emulator, make_sender, make_queue, fake_time, primary, secondary_admin, fault, error
) -> None:
    q = make_queue()
    sender = make_sender(failover_interval="0s", ping_primary_interval="5s")
    emulator.fault("primary", "quota", entity=q)
    assert sender.send(q, ServiceBusMessage("a")).backlog == 1
    emulator.fault("primary", fault, entity=q)  # replaces the outage: now the primary refuses the ping
    fake_time.advance(5)
    with pytest.raises(error) as info:
        sender.send(q, ServiceBusMessage("b"))  # pings first: refused, not "still down"
    assert q in str(info.value) and primary.connection_string.split("SharedAccessKey=")[1] not in str(info.value)
    assert "still down" not in str(info.value)
    assert backlog_total(secondary_admin, sender) == 1  # the refused send went nowhere
    emulator.heal("primary", entity=q)
    fake_time.advance(5)
    assert sender.send(q, ServiceBusMessage("c")).primary == 1  # a later ping succeeds: failed back
    assert sender.state(q) == "healthy"


def test_a_ping_that_cannot_reach_the_primary_leaves_the_secondarys_connection_open(
    emulator, make_sender, make_queue, fake_time, secondary_admin
) -> None:
    """A failed ping (the primary namespace down: a lost connection) closed both namespaces' clients, so each
    failed-over send after a ping opened the secondary's connection again: 0.9 s against 0.01 s in the soak's
    10-minute outage. Only the primary's client is reset now."""
    q = make_queue()
    sender = make_sender(failover_interval="0s", ping_primary_interval="5s", backlog_queue_count=1)
    sender.pair()
    emulator.fault("primary", "down")
    assert sender.send(q, ServiceBusMessage("a")).backlog == 1  # failed over
    server = emulator.server("secondary")
    opened = server.call(lambda: server.stats()["connections_opened"])
    for i in range(3):
        fake_time.advance(5)  # a ping is due: the send pings first, and the primary cannot be reached
        assert sender.send(q, ServiceBusMessage(f"b{i}")).backlog == 1
        assert sender.state(q) == "failed_over"
    assert server.call(lambda: server.stats()["connections_opened"]) == opened
    assert backlog_total(secondary_admin, sender) == 4


def test_a_send_that_cannot_reach_the_primary_leaves_the_secondarys_connection_open(
    emulator, make_sender, make_queue, secondary_admin
) -> None:
    """Issue 47: a send to the primary that found its connection gone closed both namespaces' clients, so sends
    in flight to the backlog and the next ones reconnected to the secondary (a worker held 3 connections to it in
    a failover). Only the side whose connection failed is reset now."""
    healthy, parked = make_queue(), make_queue()
    sender = make_sender(failover_interval="0s", backlog_queue_count=1)
    sender.pair()
    emulator.fault("primary", "down", entity=parked)
    assert sender.send(parked, ServiceBusMessage("a")).backlog == 1  # failed over: the secondary's connection open
    server = emulator.server("secondary")
    opened = server.call(lambda: server.stats()["connections_opened"])
    emulator.fault("primary", "down")  # now the whole primary: its connection closed, a new one refused
    for i in range(3):
        assert sender.send(healthy, ServiceBusMessage(f"h{i}")).backlog == 1  # the primary's connection lost
        assert sender.send(parked, ServiceBusMessage(f"p{i}")).backlog == 1
    assert server.call(lambda: server.stats()["connections_opened"]) == opened
    assert backlog_total(secondary_admin, sender) == 7


def test_a_rejected_credential_on_the_secondary_is_a_credential_error_naming_it(
    emulator, make_sender, make_queue, secondary, secondary_admin
) -> None:
    q = make_queue()
    sender = make_sender(failover_interval="0s", backlog_queue_count=2)
    sender.pair()
    emulator.fault("primary", "quota", entity=q)
    emulator.fault("secondary", "unauthorized")
    with pytest.raises(CredentialRejectedError) as info:
        sender.send(q, ServiceBusMessage("x"))
    text = str(info.value)
    assert sender.config.secondary.fully_qualified_namespace in text and "secondary" in text
    assert "SAS_KEY_VALUE" not in text and not info.value.retryable
    assert sender.board.cooling() == []  # not the backlog queues' fault
    emulator.heal("secondary")
    assert sender.send(q, ServiceBusMessage("y")).backlog == 1


def _ping_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


def test_a_round_of_the_ping_task_fails_an_idle_entity_back_without_a_send(
    emulator, make_sender, make_queue, fake_time, primary_admin
) -> None:
    q = make_queue()
    sender = make_sender(failover_interval="0s", ping_primary_interval="5s")
    emulator.fault("primary", "quota", entity=q)
    assert sender.send(q, ServiceBusMessage("a")).backlog == 1
    sent = sender.stats()
    assert sender.run_pings_once() == 5.0  # nothing due yet: the next ping in 5 s
    fake_time.advance(5)
    assert sender.run_pings_once() == 5.0  # the primary still refuses: still failed over, next ping in 5 s
    assert sender.state(q) == "failed_over"
    emulator.heal("primary", entity=q)
    fake_time.advance(5)
    assert sender.run_pings_once() is None  # pinged, failed back: no entity failed over any more
    assert sender.state(q) == "healthy" and sender.stats()["failbacks"] == 1
    assert {k: sender.stats()[k] for k in ("sent_primary", "sent_backlog")} == {
        k: sent[k] for k in ("sent_primary", "sent_backlog")}  # no send did it
    runtime = primary_admin.get_queue_runtime_properties(q)
    assert (runtime.active_message_count, runtime.scheduled_message_count) == (0, 0)  # the ping left nothing


def test_a_ping_of_the_task_refused_for_a_credential_surfaces_at_the_next_send(
    emulator, make_sender, make_queue, fake_time
) -> None:
    q = make_queue()
    sender = make_sender(failover_interval="0s", ping_primary_interval="5s")
    emulator.fault("primary", "quota", entity=q)
    assert sender.send(q, ServiceBusMessage("a")).backlog == 1
    emulator.fault("primary", "unauthorized", entity=q)
    fake_time.advance(5)
    sender.run_pings_once()
    with pytest.raises(CredentialRejectedError, match="ping"):
        sender.send(q, ServiceBusMessage("b"))
    with pytest.raises(CredentialRejectedError):  # every send, until a later ping answers otherwise
        sender.send(q, ServiceBusMessage("c"))


def test_the_ping_thread_follows_the_clock_and_stops_with_the_last_sender(
    emulator, make_sender, make_queue, make_config, fake_time
) -> None:
    q = make_queue()
    config = make_config(failover_interval="0s", ping_primary_interval="5s")
    first = make_sender(config=config, ping_wait=fake_time.wait)
    second = make_sender(config=config)
    assert second.board is first.board
    emulator.fault("primary", "quota", entity=q)
    assert first.send(q, ServiceBusMessage("a")).backlog == 1
    assert second.send(q, ServiceBusMessage("b")).backlog == 1
    thread = first.board.pings.thread
    assert thread is not None and thread.is_alive() and _ping_threads().count(thread) == 1  # one per pairing
    emulator.heal("primary", entity=q)
    fake_time.advance(4.9)
    time.sleep(0.3)
    assert first.state(q) == "failed_over"  # the ping is not due yet
    fake_time.advance(0.1)
    deadline = time.monotonic() + 5
    while first.state(q) != "healthy" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert first.state(q) == "healthy"  # the thread pinged and failed back, no send did
    first.close()
    assert thread.is_alive()  # the second sender still uses the pairing
    second.close()
    assert not thread.is_alive() and thread not in threading.enumerate()
    with pytest.raises(RuntimeError, match="closed"):
        first.run_pings_once()


@pytest.mark.slow
def test_an_idle_failed_over_entity_fails_back_within_the_ping_interval_in_real_time(
    emulator, make_config, make_queue
) -> None:
    q = make_queue()
    config = make_config(failover_interval="0s", ping_primary_interval="1s", backlog_queue_count=1)
    with PairedSender.from_config(config) as sender:
        emulator.fault("primary", "quota", entity=q)
        assert sender.send(q, ServiceBusMessage("during")).backlog == 1
        time.sleep(0.5)  # a ping or two may fail meanwhile
        emulator.heal("primary", entity=q)
        healed = time.monotonic()
        while sender.state(q) != "healthy" and time.monotonic() - healed < 3:
            time.sleep(0.02)
        assert sender.state(q) == "healthy"
        assert time.monotonic() - healed <= 1 + 1  # ping interval + 1 s, with no send
        thread = sender.board.pings.thread
    assert thread is not None and not thread.is_alive()
    assert sender.stats()["sent_primary"] == 0
