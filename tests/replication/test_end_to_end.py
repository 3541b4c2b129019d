"""Active and passive replication end to end on the emulator pair with the real SDK: a ReplicatingSender sends
through outages, a DedupeReceiver reads both namespaces, and the tests assert what a user notices: every
message arrives, each id once, nothing is left behind; and the two hazards of passive replication on the
outages page (``shared/seeds/service-bus-outages-disasters.md``), delay and duplicate reception, reproduced
and counted.

Sender and receiver share one fake time (the sender's retry interval, the receiver's window); the only real
waits are the SDK's (a 1 s try timeout for the lost acknowledgement) and short receive waits."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage
from azure.servicebus.exceptions import OperationTimeoutError

from spark_sb.errors import ReplicationError
from spark_sb.replication import DedupeReceiver

SIDES = ("primary", "secondary")
BOTH = {"primary": 5, "secondary": 5}


@pytest.fixture
def open_receiver(config: Callable[..., dict], time_: Any,
                  to_close: list[DedupeReceiver]) -> Callable[[str], DedupeReceiver]:
    """``open_receiver(queue)``: a DedupeReceiver of ``queue`` over both namespaces (window in memory, on the
    test's fake time), closed at the end of the module."""

    def open_(queue: str) -> DedupeReceiver:
        to_close.append(DedupeReceiver.from_config(config("active"), queue, clock=time_.clock))
        return to_close[-1]

    return open_


def msgs(*ids: str | None) -> list[ServiceBusMessage]:
    out = []
    for message_id in ids:
        message = ServiceBusMessage(f"body of {message_id}")
        message.message_id = message_id  # None: the sender gives it one
        out.append(message)
    return out


def receive(receiver: DedupeReceiver, count: int, timeout: float = 10.0) -> list[tuple[str, str]]:
    """Receive until ``count`` messages came back (or ``timeout``), completing each as a user would;
    ``(message_id, namespace it came from)`` in the order returned."""
    got: list[tuple[str, str]] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        for message in receiver.receive_messages(max_message_count=50, max_wait_time=0.5):
            got.append((str(message.message_id), receiver.namespace_of(message)))
            receiver.complete_message(message)
    return got


def nothing_more(receiver: DedupeReceiver, stored: Callable[[str, str], list[str]], queue: str,
                 timeout: float = 10.0) -> None:
    """Keep receiving until both namespaces' queues are empty: every copy still there must be completed and
    dropped by the receiver, none returned."""
    deadline = time.monotonic() + timeout
    while any(stored(side, queue) for side in SIDES) and time.monotonic() < deadline:
        extra = receiver.receive_messages(max_message_count=50, max_wait_time=0.5)
        assert extra == [], f"returned again: {[m.message_id for m in extra]}"
    assert (stored("primary", queue), stored("secondary", queue)) == ([], [])


def peek(namespace: Any, queue: str) -> list[str]:
    """The ids a plain SDK receiver of ``queue`` on ``namespace`` sees (peeked, in the queue's order)."""
    with ServiceBusClient.from_connection_string(namespace.connection_string, retry_total=0) as client:
        with client.get_queue_receiver(queue) as receiver:
            return [str(m.message_id) for m in receiver.peek_messages(max_message_count=100)]


def ids_of(got: Sequence[tuple[str, str]]) -> list[str]:
    return [message_id for message_id, _ in got]


# --- active --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("down", ["primary", "secondary"])
def test_active_through_an_outage_of_one_side_nothing_is_lost_and_each_id_arrives_once(
    emulator, make_sender, open_receiver, pair_queue, stored, primary, secondary, time_, down
) -> None:
    """30 messages in 6 sends of 5; ``down`` is down for sends 3 and 4, then healed. A receiver reading
    through the outage and after it gets each of the 30 ids once; the 20 second copies are dropped."""
    q = pair_queue()
    up = "secondary" if down == "primary" else "primary"
    sender = make_sender("active")
    sends = [[f"e-{5 * n + i:02d}" for i in range(5)] for n in range(6)]
    results = [sender.send(q, msgs(*sends[0])), sender.send(q, msgs(*sends[1]))]
    emulator.fault(down, "down")
    results.append(sender.send(q, msgs(*sends[2])))  # the down side fails: skipped from now on
    receiver = open_receiver(q)
    during = receive(receiver, 15)  # while it is down: what the up side holds
    assert sorted(ids_of(during)) == sends[0] + sends[1] + sends[2]
    assert {side for _, side in during} == {up}
    results.append(sender.send(q, msgs(*sends[3])))  # skipped, not tried
    emulator.heal(down)
    time_.now += 30  # the retry interval: the healed side is tried again
    results += [sender.send(q, msgs(*sends[4])), sender.send(q, msgs(*sends[5]))]

    assert [dict(r.destinations) for r in results] == [BOTH, BOTH, {up: 5}, {up: 5}, BOTH, BOTH]
    assert all(r.sent == 5 for r in results) and set(results[2].errors) == {down}
    assert (len(stored(up, q)), len(stored(down, q))) == (30 - 15, 20)  # the up side: 15 received already
    after = receive(receiver, 15)
    nothing_more(receiver, stored, q)

    every = ids_of(during + after)
    assert len(every) == 30 and Counter(every) == Counter(i for ids in sends for i in ids)  # each id once, all
    stats = receiver.stats()
    assert (stats.returned, stats.duplicates_dropped, stats.held, stats.in_flight) == (30, 20, 0, 0)
    assert stats.received == {up: 30, down: 20}
    sent = sender.stats()
    assert (sent[f"sent_{up}"], sent[f"sent_{down}"], sent["skipped_sides"], sent["degraded_sends"]) == (30, 20, 1, 1)
    assert time_.sleeps == []


# --- both down -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["active", "passive"])
def test_both_down_the_send_raises_nothing_is_stored_and_a_retry_after_healing_delivers_each_id_once(
    emulator, make_sender, open_receiver, pair_queue, stored, primary, secondary, mode
) -> None:
    q = pair_queue()
    sender = make_sender(mode)
    batch = msgs("b-1", "b-2", "b-3", None)
    emulator.fault("primary", "down")
    emulator.fault("secondary", "down")
    with pytest.raises(ReplicationError) as info:
        sender.send(q, batch)
    assert set(info.value.errors) == {"primary", "secondary"} and info.value.retryable
    assert (stored("primary", q), stored("secondary", q)) == ([], [])  # nothing acknowledged, nothing stored
    unnamed = batch[3].message_id  # given by the failed call: the retry keeps it
    assert unnamed is not None

    emulator.heal("primary")
    emulator.heal("secondary")
    retry = sender.send(q, batch)  # the same call again
    copies = {"active": {"primary": 4, "secondary": 4}, "passive": {"primary": 4}}[mode]
    assert dict(retry.destinations) == copies and retry.sent == 4
    assert batch[3].message_id == unnamed

    receiver = open_receiver(q)
    got = receive(receiver, 4)
    nothing_more(receiver, stored, q)
    assert sorted(ids_of(got)) == sorted(["b-1", "b-2", "b-3", unnamed])  # each id once
    stats = receiver.stats()
    assert (stats.returned, stats.duplicates_dropped) == (4, 4 if mode == "active" else 0)


# --- passive -------------------------------------------------------------------------------------------------


def test_passive_hazard_delay_a_message_accepted_before_the_outage_arrives_after_later_ones(
    emulator, make_sender, open_receiver, pair_queue, stored, primary, secondary
) -> None:
    """The outages page's passive-replication hazard "message delay": m1 is accepted by the primary, the
    primary becomes unavailable, m2 goes to the secondary (the sender swaps). A receiver reading while the
    primary is down gets m2 first; m1 arrives only when the primary is back (in a disaster, never).
    Deduplication cannot reorder: the delay is reproduced and counted here, not removed."""
    q = pair_queue()
    sender = make_sender("passive")
    send_order = ["m1", "m2"]
    assert dict(sender.send(q, msgs("m1")).destinations) == {"primary": 1}
    emulator.fault("primary", "down")
    assert dict(sender.send(q, msgs("m2")).destinations) == {"secondary": 1}
    assert sender.active_namespace(q) == "secondary"

    receiver = open_receiver(q)
    got = receive(receiver, 1)  # while the primary is down
    assert got == [("m2", "secondary")]
    assert receiver.receive_messages(max_message_count=10, max_wait_time=0.5) == []  # m1 is out of reach
    assert stored("primary", q) == ["m1"]  # but not lost
    emulator.heal("primary")
    got += receive(receiver, 1)
    nothing_more(receiver, stored, q)

    assert got == [("m2", "secondary"), ("m1", "primary")]
    order = ids_of(got)
    delayed = [mid for i, mid in enumerate(order)  # arrived after a message sent later than it
               if any(send_order.index(earlier) > send_order.index(mid) for earlier in order[:i])]
    assert delayed == ["m1"]  # one message of two out of send order
    assert sorted(order) == send_order  # nothing lost
    assert receiver.stats().duplicates_dropped == 0


@pytest.mark.parametrize("primary_down_while_reading", [False, True], ids=["both-up", "primary-back-later"])
def test_passive_hazard_duplicate_reception_a_lost_acknowledgement_stores_two_copies_and_dedupe_keeps_one(
    emulator, make_sender, open_receiver, pair_queue, stored, primary, secondary, primary_down_while_reading
) -> None:
    """The outages page's passive-replication hazard "duplicate reception": the primary stores m but its
    acknowledgement is lost; after the send times out the sender sends m to the secondary and swaps. Both
    namespaces hold m: a receiver without de-duplication sees it twice, the DedupeReceiver once, whether the
    two copies are read at about the same time (both up: the second is held, then dropped) or the primary's
    copy only once the primary is back from an outage (dropped by the window of completed ids)."""
    q = pair_queue()
    sender = make_sender("passive")
    sender.send(q, msgs("m0"))  # the link is open: the next send only waits for its answer
    emulator.fault("primary", "ack-lost", entity=q)
    result = sender.send(q, msgs("m"))
    assert dict(result.destinations) == {"secondary": 1}
    assert isinstance(result.errors["primary"], OperationTimeoutError)
    assert sender.active_namespace(q) == "secondary"
    emulator.heal("primary", entity=q)

    assert (stored("primary", q), stored("secondary", q)) == (["m", "m0"], ["m"])
    plain = peek(primary, q) + peek(secondary, q)  # what a plain SDK receiver of both namespaces would get
    assert Counter(plain) == {"m": 2, "m0": 1}

    receiver = open_receiver(q)
    got: list[tuple[str, str]] = []
    if primary_down_while_reading:
        emulator.fault("primary", "down")
        got += receive(receiver, 1)
        assert got == [("m", "secondary")]  # the second copy first, alone
        emulator.heal("primary")
    got += receive(receiver, 2 - len(got))
    nothing_more(receiver, stored, q)
    assert Counter(ids_of(got)) == {"m": 1, "m0": 1}
    stats = receiver.stats()
    assert (stats.returned, stats.duplicates_dropped) == (2, 1)  # the other copy of m completed and dropped
    assert stats.received == {"primary": 2, "secondary": 1}


def test_passive_swaps_on_an_outage_and_the_receiver_keeps_getting_messages_from_the_secondary_after_healing(
    emulator, make_sender, open_receiver, pair_queue, stored, primary, secondary
) -> None:
    """No failback: once the primary's outage swapped the roles, messages sent after the primary is back
    still come from the secondary, until the next outage (of the secondary) swaps them back."""
    q = pair_queue()
    sender = make_sender("passive")
    sender.send(q, msgs("before"))
    emulator.fault("primary", "down")
    sender.send(q, msgs("during"))
    emulator.heal("primary")
    sender.send(q, msgs("healed-1", "healed-2"))

    receiver = open_receiver(q)
    got = receive(receiver, 4)
    assert sorted(got) == [("before", "primary"), ("during", "secondary"), ("healed-1", "secondary"),
                           ("healed-2", "secondary")]
    emulator.fault("secondary", "down")  # the next outage
    assert dict(sender.send(q, msgs("back")).destinations) == {"primary": 1}
    emulator.heal("secondary")
    got += receive(receiver, 1)
    nothing_more(receiver, stored, q)

    assert got[4:] == [("back", "primary")]
    assert Counter(side for _, side in got) == {"secondary": 3, "primary": 2}
    assert sender.stats()["swaps"] == 2 and sender.active_namespace(q) == "primary"
    assert receiver.stats().duplicates_dropped == 0
