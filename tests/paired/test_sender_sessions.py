"""Sessions keep their order through an outage (spark_sb.paired.sessions): a session's parked messages share one
backlog queue, its new messages follow them there until the syphon moved them home, and the primary receives every
session in the order it was sent, each message once."""

from __future__ import annotations

import time
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage
from pairing import session_bodies

from spark_sb import messages
from spark_sb.errors import BacklogUnavailableError
from spark_sb.paired import PRIMARY
from spark_sb.paired.sessions import session_queue
from spark_sb.syphon import Syphon

SESSIONS = [f"account-{n}" for n in range(6)]


def _round(sender: Any, q: str, n: int, sessions: list[str] = SESSIONS) -> dict[str, int]:
    """Message ``n`` of every session, in one call (a partition's chunk holds several sessions)."""
    batch = [ServiceBusMessage(f"{s}/{n}", message_id=f"{s}/{n}", session_id=s) for s in sessions]
    return dict(sender.send(q, batch).destinations)


def _parked(connection_string: str, queue: str) -> list[tuple[str | None, str | None, str]]:
    with ServiceBusClient.from_connection_string(connection_string, retry_total=0) as client:
        with client.get_queue_receiver(queue) as receiver:
            return [(*messages.parked_session(m), str(m.message_id))
                    for m in receiver.peek_messages(max_message_count=250, sequence_number=1)]


def test_sessions_reach_the_primary_in_order_through_an_outage_and_a_failback(
        emulator, make_queue, make_sender, make_config, fake_time, primary, secondary) -> None:
    q = make_queue(requires_session=True)
    config = make_config(failover_interval="0s", backlog_queue_count=3)
    sender = make_sender(config=config)
    names = sender.config.send_availability.backlog_queue_names()
    assert _round(sender, q, 0) == {PRIMARY: 6}
    emulator.fault("primary", "quota", entity=q)
    assert PRIMARY not in _round(sender, q, 1)  # failed over: parked
    _round(sender, q, 2)
    # each session's parked messages are in its own backlog queue, in order
    for queue in names:
        for entity, session_id, message_id in _parked(secondary.connection_string, queue):
            assert entity == q and session_queue(q, session_id, names) == queue, message_id
    emulator.heal("primary", entity=q)
    fake_time.advance(5)
    sender.run_pings_once()
    assert sender.state(q) == "healthy"
    # the primary is back, but every session has messages parked: its new ones follow them, a new session does not
    followed = _round(sender, q, 3, SESSIONS + ["fresh"])
    assert followed.get(PRIMARY) == 1 and sum(followed.values()) == 7
    assert sender.stats()["session_follows"] == 6
    with Syphon.from_config(config) as syphon:
        assert syphon.drain(max_wait_time=0.5).total_moved == 18
    sender.new_batch()  # the next Spark batch asks the backlog again: nothing parked now
    assert _round(sender, q, 4, SESSIONS + ["fresh"]) == {PRIMARY: 7}
    for s in SESSIONS:
        assert session_bodies(primary.connection_string, q, s, 5) == [f"{s}/{n}" for n in range(5)]
    assert session_bodies(primary.connection_string, q, "fresh", 2) == ["fresh/3", "fresh/4"]


def test_another_sender_sees_what_the_first_parked_and_follows(
        emulator, make_queue, make_sender, make_config, fake_time, primary) -> None:
    """As a Spark batch on another executor would: a sender that parked nothing asks the backlog."""
    q = make_queue(requires_session=True)
    config = make_config(failover_interval="0s", backlog_queue_count=2)
    first = make_sender(config=config)
    emulator.fault("primary", "quota", entity=q)
    _round(first, q, 0, SESSIONS[:2])
    emulator.heal("primary", entity=q)
    fake_time.advance(5)
    first.run_pings_once()
    other = make_sender(config=config)
    assert other.state(q) == "healthy"
    assert PRIMARY not in _round(other, q, 1, SESSIONS[:2])
    assert other.stats()["session_peeks"] >= 1
    with Syphon.from_config(config) as syphon:
        syphon.drain(max_wait_time=0.5)
    other.new_batch()
    assert _round(other, q, 2, SESSIONS[:2]) == {PRIMARY: 2}
    for s in SESSIONS[:2]:
        assert session_bodies(primary.connection_string, q, s, 3) == [f"{s}/{n}" for n in range(3)]


def test_a_session_never_moves_to_another_backlog_queue(emulator, make_queue, make_sender, make_config) -> None:
    """Its backlog queue refusing fails the send (the caller retries; Spark replays the batch): another queue
    would let the syphon move a later message of the session before an earlier one."""
    q = make_queue(requires_session=True)
    sender = make_sender(config=make_config(failover_interval="0s", backlog_queue_count=2))
    names = sender.config.send_availability.backlog_queue_names()
    emulator.fault("primary", "quota", entity=q)
    _round(sender, q, 0, ["a"])
    mine = session_queue(q, "a", names)
    emulator.fault("secondary", "quota", entity=mine)
    with pytest.raises(BacklogUnavailableError, match="session"):
        _round(sender, q, 1, ["a"])
    emulator.heal("secondary", entity=mine)
    assert _round(sender, q, 1, ["a"]) == {mine: 1}
    # messages without a session still rotate over the queues as before
    assert sender.send(q, ServiceBusMessage("plain")).backlog == 1


def test_a_backlog_that_cannot_be_asked_holds_a_session_by_default_and_nothing_overtakes(
        emulator, make_queue, make_sender, make_config, fake_time, primary, secondary) -> None:
    """``session_order: strict`` (the default): a session has messages parked, then the secondary goes down. The
    backlog can neither say whether the session has messages parked nor take its new ones, so the send fails
    (nothing acknowledged: Spark replays the batch) instead of sending them to the healthy primary ahead of the
    parked ones. Once the secondary is back they follow the parked ones, and the session arrives in order."""
    q = make_queue(requires_session=True)
    config = make_config(backlog_queue_count=1, pairing_timeout="2s", failover_interval="0s")
    other = make_sender(config=config)
    other.pair()
    [name] = other.backlog_queues
    # parked by another executor (another process): this one knows nothing of it
    with ServiceBusClient.from_connection_string(secondary.connection_string, retry_total=0) as client:
        with client.get_queue_sender(name) as backlog:
            backlog.send_messages(messages.to_backlog(
                ServiceBusMessage("a/0", message_id="a/0", session_id="a"), q))
    emulator.fault("secondary", "down")
    try:
        with pytest.raises(BacklogUnavailableError, match="session.*'a'.*session_order: strict"):
            _round(other, q, 1, ["a"])
        assert other.stats()["session_held"] == 1
    finally:
        emulator.heal("secondary")
    fake_time.advance(5)  # the failed peek is not retried before a ping interval
    other.new_batch()
    assert _round(other, q, 1, ["a"]) != {PRIMARY: 1}  # behind the parked one
    with Syphon.from_config(config) as syphon:
        assert syphon.drain(max_wait_time=0.5).total_moved == 2
    assert session_bodies(primary.connection_string, q, "a", 2) == ["a/0", "a/1"]


def test_a_backlog_that_cannot_be_asked_does_not_hold_a_healthy_primary_when_availability_wins(
        emulator, make_queue, make_sender, make_config, fake_time, primary) -> None:
    """``session_order: available``: the secondary down, nothing parked here: the backlog can neither say whether
    the session has messages parked nor take its new ones, so they go to the primary (logged, counted), and the
    backlog is peeked again only after a ping interval, not by every partition."""
    q = make_queue(requires_session=True)
    sender = make_sender(config=make_config(backlog_queue_count=1, pairing_timeout="2s", session_order="available"))
    emulator.fault("secondary", "down")
    try:
        for n in range(3):
            sender.new_batch()  # a partition each
            assert _round(sender, q, n, ["a"]) == {PRIMARY: 1}
        stats = sender.stats()
        assert (stats["session_peek_failures"], stats["session_unordered"]) == (1, 3)
        fake_time.advance(5)
        sender.new_batch()
        assert _round(sender, q, 3, ["a"]) == {PRIMARY: 1}
        assert sender.stats()["session_peek_failures"] == 2
    finally:
        emulator.heal("secondary")
    assert session_bodies(primary.connection_string, q, "a", 4) == [f"a/{n}" for n in range(4)]


def test_a_send_that_fails_the_entity_back_itself_follows_the_parked_messages(
        emulator, make_queue, make_sender, make_config, fake_time, primary) -> None:
    """The first send after the outage pings (its ping was due) and fails the entity back: its session messages
    still follow the parked ones (the soak found them sent to the primary ahead of them)."""
    q = make_queue(requires_session=True)
    config = make_config(failover_interval="0s", backlog_queue_count=2)
    sender = make_sender(config=config)
    emulator.fault("primary", "quota", entity=q)
    assert PRIMARY not in _round(sender, q, 0, SESSIONS[:2])
    emulator.heal("primary", entity=q)
    fake_time.advance(5)  # the ping is due; nobody ran it: this send does
    assert sender.state(q) == "failed_over"
    assert PRIMARY not in _round(sender, q, 1, SESSIONS[:2])
    assert sender.state(q) == "healthy" and sender.stats()["session_follows"] == 2
    with Syphon.from_config(config) as syphon:
        syphon.drain(max_wait_time=0.5)
    for s in SESSIONS[:2]:
        assert session_bodies(primary.connection_string, q, s, 2) == [f"{s}/0", f"{s}/1"]


@pytest.mark.parametrize("fault", ["timeout", "down"])
def test_a_backlog_queue_that_never_answers_a_peek_holds_a_session_message_no_longer_than_the_pairing_timeout(
        emulator, make_queue, make_sender, make_config, primary, fault) -> None:
    """The session's backlog queue exists, then accepts the peek and never answers it (or is down): with
    ``session_order: available`` the message still reaches the healthy primary, counted as sent without knowing
    what was parked, after two peeks bounded by half the pairing timeout each (and the link's opening), not the
    SDK's own operation timeout."""
    q = make_queue(requires_session=True)
    sender = make_sender(config=make_config(backlog_queue_count=1, pairing_timeout="2s", session_order="available"))
    sender.pair()  # provisions the backlog queue
    [name] = sender.config.send_availability.backlog_queue_names()
    emulator.fault("secondary", fault, entity=name)
    try:
        started = time.monotonic()
        assert _round(sender, q, 0, ["a"]) == {PRIMARY: 1}
        took = time.monotonic() - started
    finally:
        emulator.heal("secondary", entity=name)
    assert (sender.stats()["session_peek_failures"], sender.stats()["session_unordered"]) == (1, 1)
    assert took < 30, f"a session's message waited {took:.0f} s on a backlog that never answered"
    assert session_bodies(primary.connection_string, q, "a", 1) == ["a/0"]
