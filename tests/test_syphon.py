"""The syphon against the emulator pair: restore and republish, dead-letter what cannot be delivered, leave
what cannot be delivered yet."""

from __future__ import annotations

import contextlib
import datetime
import decimal
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
from azure.servicebus import (
    ServiceBusClient,
    ServiceBusMessage,
    ServiceBusMessageState,
    ServiceBusReceiveMode,
    ServiceBusSubQueue,
)
from azure.servicebus.amqp import AmqpAnnotatedMessage
from azure.servicebus.exceptions import ServiceBusConnectionError
from pairing import pair_config, peek_all, received_ids

from spark_sb import messages
from spark_sb.bus import close_all
from spark_sb.bus.deferred import peek_deferred
from spark_sb.config import load_config
from spark_sb.emulator.model import QueueSpec
from spark_sb.errors import CredentialRejectedError
from spark_sb.paired import PRIMARY, PairedSender
from spark_sb.syphon import (
    REJECTED_BY_DESTINATION,
    SESSION_GAP,
    MoveSummary,
    Outcome,
    Syphon,
    SyphonSettleError,
    republish_deferred,
    republish_received,
    settle_outcomes,
)


def _config(primary: Any, secondary: Any, **send_availability: Any) -> dict:
    sa = {"backlog_queue_count": 1, "failover_interval": "0s", "primary_try_timeout": "3s", **send_availability}
    return {**pair_config(primary, secondary, "sy", **sa), "syphon": {"retry_interval": "5s"}}


@pytest.fixture
def config(emulator: Any, primary: Any, secondary: Any) -> Iterator[dict]:
    """A configuration whose one backlog queue exists on the secondary."""
    cfg = _config(primary, secondary)
    queue = f"{cfg['send_availability']['backlog_prefix']}/x-servicebus-transfer/0"
    server = emulator.server("secondary")
    server.call(lambda: server.broker.create_entity(QueueSpec(name=queue, max_delivery_count=2147483647)))
    cfg["backlog_queue"] = queue
    yield cfg
    close_all()  # this process's backlog receivers and syphons (the Spark path keeps them)


def _syphon_config(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k != "backlog_queue"}


def _to_backlog(secondary: Any, queue: str, items: list[Any]) -> None:
    with ServiceBusClient.from_connection_string(secondary.connection_string, retry_total=0) as client:
        with client.get_queue_sender(queue) as sender:
            for item in items:  # one at a time: a batch holding a value-body message lost the rest (emulator)
                sender.send_messages(item)


def _receive(connection_string: str, queue: str, *, expected: int, sub_queue: Any = None,
             session_id: str | None = None) -> list:
    out: list = []
    with ServiceBusClient.from_connection_string(connection_string, retry_total=0) as client:
        with client.get_queue_receiver(queue, sub_queue=sub_queue, session_id=session_id,
                                       receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as receiver:
            deadline = time.monotonic() + 5
            while len(out) < expected and time.monotonic() < deadline:
                out.extend(receiver.receive_messages(max_message_count=50, max_wait_time=0.5))
    return out


def _peek(connection_string: str, queue: str) -> list:
    with ServiceBusClient.from_connection_string(connection_string, retry_total=0) as client:
        with client.get_queue_receiver(queue) as receiver:
            return list(receiver.peek_messages(max_message_count=50))


def test_every_field_round_trips_through_failover_and_syphon(emulator, primary, secondary, make_queue) -> None:
    plain = make_queue()
    sessions = make_queue(requires_session=True)
    cfg = _config(primary, secondary)
    scheduled = datetime.datetime.now(datetime.UTC).replace(microsecond=0) + datetime.timedelta(hours=1)
    first = ServiceBusMessage(
        b"\x00body", message_id="m-1", correlation_id="c-1", subject="subj", content_type="application/x-test",
        to="to-1", reply_to="reply", reply_to_session_id="rs", partition_key="pk-1",
        time_to_live=datetime.timedelta(hours=1), scheduled_enqueue_time_utc=scheduled,
        application_properties={"color": "red", "n": 7},
    )
    second = ServiceBusMessage("in a session", message_id="m-2", session_id="s-1", partition_key="s-1",
                               time_to_live=datetime.timedelta(minutes=10))
    with PairedSender.from_config(cfg) as producer:
        emulator.fault("primary", "down")
        try:
            assert producer.send(plain, first).destination != PRIMARY
            assert producer.send(sessions, second).destination != PRIMARY
        finally:
            emulator.heal("primary")
        backlog_queue = producer.backlog_queues[0]

    with Syphon.from_config(cfg) as syphon:
        summary = syphon.move(backlog_queue)
    assert summary.moved == {plain: 1, sessions: 1}
    assert summary.dead_lettered == {} and summary.left == {}
    assert _peek(secondary.connection_string, backlog_queue) == []

    [restored] = _peek(primary.connection_string, plain)  # scheduled an hour ahead: visible to peek only
    assert b"".join(restored.body) == b"\x00body"
    assert (restored.message_id, restored.correlation_id, restored.subject, restored.content_type) == (
        "m-1", "c-1", "subj", "application/x-test")
    assert (restored.to, restored.reply_to, restored.reply_to_session_id) == ("to-1", "reply", "rs")
    assert restored.partition_key == "pk-1"
    assert restored.scheduled_enqueue_time_utc == scheduled
    assert datetime.timedelta(minutes=59) < restored.time_to_live <= datetime.timedelta(hours=1)
    assert {k.decode() if isinstance(k, bytes) else k: v for k, v in restored.application_properties.items()} == {
        "color": b"red", "n": 7}

    [in_session] = _receive(primary.connection_string, sessions, expected=1, session_id="s-1")
    assert str(in_session) == "in a session"
    assert (in_session.message_id, in_session.session_id, in_session.partition_key) == ("m-2", "s-1", "s-1")
    assert datetime.timedelta(minutes=9) < in_session.time_to_live <= datetime.timedelta(minutes=10)


def test_a_decimal_property_is_moved_home_as_the_decimal128_it_was_sent_as(emulator, primary, secondary,
                                                                          make_queue) -> None:
    """The SDK's decoder fails on a decimal128 (its own encoding): a backlog copy that carried one stopped every
    receive of the syphon's batch. The copy carries its text; the primary gets the decimal128 back."""
    import proton

    queue = make_queue()
    cfg = _config(primary, secondary)
    price = decimal.Decimal("12345.678")
    with PairedSender.from_config(cfg) as producer:
        emulator.fault("primary", "down")
        try:
            sent = producer.send(queue, [ServiceBusMessage(b"x", message_id=f"d-{i}", application_properties={
                "price": price, "i": i}) for i in range(3)])
            assert sent.destination != PRIMARY
        finally:
            emulator.heal("primary")
        backlog_queue = producer.backlog_queues[0]
    with Syphon.from_config(cfg) as syphon:
        summary = syphon.move(backlog_queue)
    assert summary.moved == {queue: 3} and summary.dead_lettered == {} and summary.left == {}
    # what arrived, read off the emulator's store (the SDK cannot decode it: nor could any Python consumer)
    server = emulator.server("primary")
    stored = server.call(lambda: [m.raw for m in server.broker.peek(queue, 0, 10)])
    assert len(stored) == 3
    for payload in stored:
        decoded = proton.Message()
        decoded.decode(bytes(payload))
        assert isinstance(decoded.properties["price"], proton.decimal128)
        assert bytes(decoded.properties["price"]) == _decimal128_bytes(price)


def _decimal128_bytes(value: decimal.Decimal) -> bytes:
    from azure.servicebus._pyamqp._encode import encode_value

    out = bytearray()
    encode_value(out, value)
    return bytes(out[1:])  # without its constructor


def test_invalid_expired_and_foreign_messages_are_dead_lettered_with_their_reasons(
    config, primary, secondary, make_queue
) -> None:
    q = make_queue()
    queue = config["backlog_queue"]
    good = messages.to_backlog(ServiceBusMessage("good", message_id="good"), q)
    no_path = ServiceBusMessage("no path", message_id="no-path")  # a foreign-shaped message
    bad_ttl = ServiceBusMessage("bad ttl", message_id="bad-ttl",
                                application_properties={"x-ms-path": q, "x-ms-timetolive": "soon"})
    expired = messages.to_backlog(
        ServiceBusMessage("expired", message_id="expired", time_to_live=datetime.timedelta(seconds=1)), q)
    odd = ServiceBusMessage(None, raw_amqp_message=AmqpAnnotatedMessage(  # a value body, x-ms-path an int
        value_body={"a": 1}, application_properties={"x-ms-path": 42}, properties={"message_id": "odd"}))
    ping = ServiceBusMessage(b"", content_type=messages.PING_CONTENT_TYPE, message_id="ping")  # no 1 s TTL here
    _to_backlog(secondary, queue, [good, no_path, bad_ttl, expired, odd, ping])
    time.sleep(1.2)  # the 1 s TTL runs out in the backlog

    # the destination's ping gets 10 s, not the fixture's 500 ms: under load a slow answer made it "down" and
    # left the good message in the backlog (a clean-clone run: moved {} instead of {q: 1})
    slow_ok = {**config, "send_availability": {**config["send_availability"], "primary_try_timeout": "10s"}}
    with Syphon.from_config(_syphon_config(slow_ok)) as syphon:
        summary = syphon.move(queue)
    assert summary.moved == {q: 1}, summary
    assert summary.pings == 1
    assert summary.dead_lettered == {
        "x-ms-path missing or not a string": 2,
        "x-ms-timetolive is not an int64 number of milliseconds": 1,
        messages.TTL_EXPIRED_IN_BACKLOG: 1,
    }
    dead = _receive(secondary.connection_string, queue, expected=4, sub_queue=ServiceBusSubQueue.DEAD_LETTER)
    reasons = {m.message_id: m.dead_letter_reason for m in dead}
    assert [r for i, r in reasons.items() if i not in ("no-path", "bad-ttl", "expired")] == [
        "x-ms-path missing or not a string"]  # the value-body message (the SDK gave it its own message id)
    assert {i: r for i, r in reasons.items() if i in ("no-path", "bad-ttl", "expired")} == {
        "no-path": "x-ms-path missing or not a string",
        "bad-ttl": "x-ms-timetolive is not an int64 number of milliseconds",
        "expired": messages.TTL_EXPIRED_IN_BACKLOG,
    }
    assert [m.message_id for m in _receive(primary.connection_string, q, expected=1)] == ["good"]
    assert _peek(secondary.connection_string, queue) == []


def test_a_destination_down_gets_nothing_and_loses_nothing(emulator, config, primary, secondary, make_queue) -> None:
    down, up = make_queue(), make_queue()
    queue = config["backlog_queue"]
    _to_backlog(secondary, queue, [messages.to_backlog(ServiceBusMessage(f"{e}-{i}", message_id=f"{e}-{i}"), e)
                                   for e in (down, up) for i in range(3)])
    now = [time.time()]
    emulator.fault("primary", "quota", entity=down)
    try:
        with Syphon.from_config(_syphon_config(config), clock=lambda: now[0]) as syphon:
            first = syphon.move(queue)
            assert first.moved == {up: 3} and first.left == {down: 3} and first.down == [down]
            emulator.heal("primary", entity=down)
            again = syphon.move(queue)  # inside the retry interval: not even pinged
            assert again.moved == {} and again.left == {down: 3}
            now[0] += 6
            last = syphon.move(queue)
            assert last.moved == {down: 3} and last.left == {}
    finally:
        emulator.heal("primary", entity=down)
    assert sorted(m.message_id for m in _receive(primary.connection_string, down, expected=3)) == [
        f"{down}-{i}" for i in range(3)]
    assert _peek(secondary.connection_string, queue) == []


def test_a_destination_that_does_not_exist_is_dead_lettered(config, secondary) -> None:
    queue = config["backlog_queue"]
    _to_backlog(secondary, queue, [messages.to_backlog(ServiceBusMessage("x", message_id="lost"), "no-such-queue")])
    with Syphon.from_config(_syphon_config(config)) as syphon:
        summary = syphon.move(queue)
    assert summary.dead_lettered == {messages.DESTINATION_NOT_FOUND: 1}
    [dead] = _receive(secondary.connection_string, queue, expected=1, sub_queue=ServiceBusSubQueue.DEAD_LETTER)
    assert (dead.message_id, dead.dead_letter_reason) == ("lost", messages.DESTINATION_NOT_FOUND)


def test_a_rejected_credential_stops_the_syphon_and_keeps_the_messages(
    emulator, config, primary, secondary, make_queue
) -> None:
    q = make_queue()
    queue = config["backlog_queue"]
    _to_backlog(secondary, queue, [messages.to_backlog(ServiceBusMessage("x", message_id="kept"), q)])
    emulator.fault("primary", "unauthorized")
    try:
        with Syphon.from_config(_syphon_config(config)) as syphon:
            with pytest.raises(CredentialRejectedError):
                syphon.move(queue)
    finally:
        emulator.heal("primary")
    assert [m.message_id for m in _peek(secondary.connection_string, queue)] == ["kept"]


# --- the Spark path: decide and send from peeked deferred messages, settle only after recording -------------


def _defer_all(secondary: Any, queue: str, expected: int) -> list[int]:
    """Defer every message of the queue, as the servicebus-backlog source does; their sequence numbers."""
    numbers: list[int] = []
    with ServiceBusClient.from_connection_string(secondary.connection_string, retry_total=0) as client:
        with client.get_queue_receiver(queue, prefetch_count=0) as receiver:
            deadline = time.monotonic() + 5
            while len(numbers) < expected and time.monotonic() < deadline:
                for message in receiver.receive_messages(max_message_count=50, max_wait_time=0.5):
                    receiver.defer_message(message)
                    numbers.append(message.sequence_number)
    assert len(numbers) == expected
    return numbers


def test_a_destination_down_is_reparked_and_nothing_is_settled_before_the_outcomes_are(
    emulator, config, primary, secondary, make_queue
) -> None:
    down, up = make_queue(), make_queue()
    queue = config["backlog_queue"]
    _to_backlog(secondary, queue, [messages.to_backlog(ServiceBusMessage(f"{e}-{i}", message_id=f"{e}-{i}",
                                                                         time_to_live=datetime.timedelta(hours=1)), e)
                                   for e in (down, up) for i in range(2)])
    numbers = _defer_all(secondary, queue, 4)
    cfg = _syphon_config(config)
    emulator.fault("primary", "quota", entity=down)
    try:
        outcomes = republish_deferred(load_config(cfg), {queue: numbers})
    finally:
        emulator.heal("primary", entity=down)
    assert sorted((o.destination, o.outcome) for o in outcomes) == [
        (down, "reparked"), (down, "reparked"), (up, "delivered"), (up, "delivered")]
    assert sorted(m.message_id for m in _receive(primary.connection_string, up, expected=2)) == [f"{up}-0", f"{up}-1"]
    # nothing settled yet: the four originals are still deferred, the two copies wait behind them
    backlog = _peek(secondary.connection_string, queue)
    assert sorted((m.state, m.message_id) for m in backlog) == sorted(
        [(ServiceBusMessageState.DEFERRED, f"{e}-{i}") for e in (down, up) for i in range(2)]
        + [(ServiceBusMessageState.ACTIVE, f"{down}-{i}") for i in range(2)])

    assert settle_outcomes(load_config(cfg), outcomes) == 4
    assert settle_outcomes(load_config(cfg), outcomes) == 0  # a replay settles nothing twice
    copies = _peek(secondary.connection_string, queue)
    assert sorted(m.message_id for m in copies) == [f"{down}-0", f"{down}-1"]
    assert {m.application_properties[b"x-ms-path"] for m in copies} == {down.encode()}
    # the copies carry the remaining TTL (the backlog message itself has none)
    assert all(59 * 60_000 < m.application_properties[b"x-ms-timetolive"] <= 3_600_000 for m in copies)
    with Syphon.from_config(cfg) as syphon:  # the destination is back: the copies go home
        assert syphon.move(queue).moved == {down: 2}
    assert sorted(m.message_id for m in _receive(primary.connection_string, down, expected=2)) == [
        f"{down}-0", f"{down}-1"]


def test_a_restored_message_the_destination_refuses_is_dead_lettered_with_its_reason(
    config, primary, secondary, make_queue
) -> None:
    sessions = make_queue(requires_session=True)
    queue = config["backlog_queue"]
    _to_backlog(secondary, queue, [
        messages.to_backlog(ServiceBusMessage("no session", message_id="no-session"), sessions),
        messages.to_backlog(ServiceBusMessage("in session", message_id="in-session", session_id="s"), sessions),
    ])
    numbers = _defer_all(secondary, queue, 2)
    cfg = load_config(_syphon_config(config))
    outcomes = {o.message_id: o for o in republish_deferred(cfg, {queue: numbers})}
    assert outcomes["in-session"].outcome == "delivered"
    refused = outcomes["no-session"]
    assert (refused.outcome, refused.reason) == ("dead_lettered", REJECTED_BY_DESTINATION)
    assert "session" in (refused.description or "").lower()
    assert settle_outcomes(cfg, list(outcomes.values())) == 2
    [dead] = _receive(secondary.connection_string, queue, expected=1, sub_queue=ServiceBusSubQueue.DEAD_LETTER)
    assert (dead.message_id, dead.dead_letter_reason) == ("no-session", REJECTED_BY_DESTINATION)
    assert dead.dead_letter_error_description == refused.description
    [home] = _receive(primary.connection_string, sessions, expected=1, session_id="s")
    assert home.message_id == "in-session"
    assert _peek(secondary.connection_string, queue) == []


def test_session_messages_whose_sends_time_out_are_left_not_dead_lettered(
    emulator, config, primary, secondary, make_queue
) -> None:
    """The session soak's 3 lost and 2 out-of-order messages (issue 48): the ping of a session queue is refused
    for want of a session id (which says the entity is there), and the sends that then timed out (acknowledgements
    lost) carried that refusal as their context, so they were taken for refused messages and dead-lettered (the
    ones the service had in fact stored arrived out of order, the others were lost)."""
    sessions = make_queue(requires_session=True)
    queue = config["backlog_queue"]
    _to_backlog(secondary, queue, [messages.to_backlog(
        ServiceBusMessage(f"m{i}", message_id=f"m{i}", session_id=f"s{i % 2}"), sessions) for i in range(4)])
    numbers = _defer_all(secondary, queue, 4)
    cfg = _syphon_config(config)
    cfg["send_availability"] = {**cfg["send_availability"], "primary_try_timeout": "2s"}
    emulator.fault("primary", "ack-lost", entity=sessions)
    try:
        outcomes = republish_deferred(load_config(cfg), {queue: numbers})
    finally:
        emulator.heal("primary", entity=sessions)
    assert {(o.message_id, o.outcome) for o in outcomes} == {(f"m{i}", "left") for i in range(4)}


def test_settling_carries_on_through_a_secondary_that_stops_answering_for_a_few_seconds(
    emulator, config, primary, secondary, make_queue
) -> None:
    """A blip of the secondary while the syphon settles its batch (soak: the secondary's emulator killed and
    restarted) failed the batch, and in local mode stopped the syphon job; it is tried again with backoff."""
    home = make_queue()
    queue = config["backlog_queue"]
    _to_backlog(secondary, queue, _parked(home, [f"m{i}" for i in range(4)]))
    numbers = _defer_all(secondary, queue, 4)
    cfg = load_config(_syphon_config(config))
    outcomes = republish_deferred(cfg, {queue: numbers})
    assert [o.outcome for o in outcomes] == ["delivered"] * 4
    close_all()  # the settlement opens its connection while the secondary is down
    emulator.fault("secondary", "down", duration=2.0)
    assert settle_outcomes(cfg, outcomes) == 4
    assert _peek(secondary.connection_string, queue) == []
    assert sorted(m.message_id for m in _receive(primary.connection_string, home, expected=4)) == [
        f"m{i}" for i in range(4)]


def test_re_parking_carries_on_through_a_secondary_that_stops_answering_for_a_few_seconds(
    emulator, config, primary, secondary, make_queue
) -> None:
    """The destination is down, so the syphon re-parks its messages; the secondary stops answering for 2 s just
    then (test_link_habits saw the copy's send fail with a lost connection, and the batch failed). The copies
    are sent once it answers again."""
    home = make_queue()
    queue = config["backlog_queue"]
    _to_backlog(secondary, queue, _parked(home, [f"m{i}" for i in range(3)]))
    numbers = _defer_all(secondary, queue, 3)
    cfg = load_config(_syphon_config(config))
    with ServiceBusClient.from_connection_string(secondary.connection_string, retry_total=0) as client, \
            client.get_queue_receiver(queue) as receiver:
        found = peek_deferred(receiver, numbers)
    close_all()
    emulator.fault("primary", "down", entity=home)  # the destination (the namespace answers): re-parked
    emulator.fault("secondary", "down", duration=2.0)
    try:
        outcomes = republish_received(cfg, {queue: found})
    finally:
        emulator.heal("primary")
    assert [o.outcome for o in outcomes] == ["reparked"] * 3
    copies = [m for m in peek_all(secondary.connection_string, queue) if m.state != ServiceBusMessageState.DEFERRED]
    assert sorted(str(m.message_id) for m in copies) == ["m0", "m1", "m2"]  # one copy each


def test_settling_gives_up_after_the_outage_wait_and_leaves_the_messages_deferred(
    emulator, config, primary, secondary, make_queue
) -> None:
    home = make_queue()
    queue = config["backlog_queue"]
    _to_backlog(secondary, queue, [messages.to_backlog(ServiceBusMessage("m", message_id="m"), home)])
    numbers = _defer_all(secondary, queue, 1)
    cfg = load_config(_syphon_config(config))
    outcomes = republish_deferred(cfg, {queue: numbers})
    close_all()
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    emulator.fault("secondary", "down")
    try:
        with pytest.raises(ServiceBusConnectionError):
            settle_outcomes(cfg, outcomes, outage_wait=10, clock=lambda: now[0], sleep=sleep)
    finally:
        emulator.heal("secondary")
    assert 10 <= sum(slept) < 15 and slept[:3] == [0.5, 1.0, 2.0]  # backoff, bounded by outage_wait
    assert [m.state for m in _peek(secondary.connection_string, queue)] == [ServiceBusMessageState.DEFERRED]


def test_settling_waits_for_a_lock_left_by_an_attempt_that_died(emulator_with_clock, fake_clock, primary) -> None:
    clocked = emulator_with_clock["clocked"]
    fake_clock.advance(max(0.0, time.time() - fake_clock.now))  # not behind real time: the SDK checks locks too
    queue = emulator_with_clock.make_queue(lock_duration=30, max_delivery_count=2147483647)
    _to_backlog(clocked, queue, [messages.to_backlog(ServiceBusMessage("x", message_id="locked"), "q")])
    [number] = _defer_all(clocked, queue, 1)
    with ServiceBusClient.from_connection_string(clocked.connection_string, retry_total=0) as client:
        with client.get_queue_receiver(queue) as receiver:  # an attempt locks it, then dies
            assert len(receiver.receive_deferred_messages([number])) == 1
    outcome = Outcome(queue, number, "locked", "q", "delivered", None, None)
    cfg = load_config(_config(primary, clocked))
    with pytest.raises(SyphonSettleError, match=rf"{queue}.*sequence numbers {number}.*replayed"):
        settle_outcomes(cfg, [outcome], lock_wait=10, clock=fake_clock, sleep=fake_clock.advance)
    assert [m.message_id for m in _peek(clocked.connection_string, queue)] == ["locked"]  # nothing lost
    # waited for: the lock expires (30 s of fake time) and the message is settled
    assert settle_outcomes(cfg, [outcome], clock=fake_clock, sleep=fake_clock.advance) == 1
    assert _peek(clocked.connection_string, queue) == []
    close_all()


# --- re-parking: size-bounded batches, idempotent on a replay -----------------------------------------------


def _drain_home(cfg: dict) -> list[Outcome]:
    """A single-process syphon run until a round finds the backlog empty; its outcomes. A round waits up to
    3 s for its first message: on a loaded machine a receiver's first messages took longer than 0.5 s, and the
    drain ended before moving anything."""
    with Syphon.from_config(cfg) as syphon:
        return syphon.drain(max_wait_time=3.0).outcomes


def _parked(queue: str, ids: list[str], size: int = 0) -> list[ServiceBusMessage]:
    return [messages.to_backlog(ServiceBusMessage(f"{i}:".encode() + b"x" * size, message_id=i,
                                                  time_to_live=datetime.timedelta(hours=1)), queue) for i in ids]


def test_reparking_more_than_a_batch_holds_goes_in_several_batches(
    emulator, config, primary, secondary, make_queue
) -> None:
    down = make_queue()
    queue = config["backlog_queue"]
    ids = [f"big-{i}" for i in range(40)]  # 40 x 10 KiB: more than one 256 KiB batch
    _to_backlog(secondary, queue, _parked(down, ids, size=10 * 1024))
    numbers = _defer_all(secondary, queue, 40)
    cfg = _syphon_config(config)
    emulator.fault("primary", "quota", entity=down)
    try:
        outcomes = republish_deferred(load_config(cfg), {queue: numbers})
        assert sorted((o.message_id, o.outcome) for o in outcomes) == [(i, "reparked") for i in sorted(ids)]
        backlog = peek_all(secondary.connection_string, queue)
        copies = [m for m in backlog if m.state == ServiceBusMessageState.ACTIVE]
        assert sorted(m.message_id for m in copies) == sorted(ids)  # every copy, once
        assert settle_outcomes(load_config(cfg), outcomes) == 40
    finally:
        emulator.heal("primary", entity=down)
    assert sorted(m.sequence_number for m in peek_all(secondary.connection_string, queue)) == sorted(
        m.sequence_number for m in copies)  # the originals completed, the copies kept
    delivered = [o.message_id for o in _drain_home(cfg) if o.outcome == "delivered"]
    assert sorted(delivered) == sorted(ids)
    home = _receive(primary.connection_string, down, expected=41)
    assert sorted(m.message_id for m in home) == sorted(ids)  # each exactly once
    assert all(len(b"".join(m.body)) > 10 * 1024 for m in home)


def test_a_replayed_repark_adds_no_second_copy(emulator, config, primary, secondary, make_queue) -> None:
    down = make_queue()
    queue = config["backlog_queue"]
    ids = [f"r-{i}" for i in range(3)]
    _to_backlog(secondary, queue, _parked(down, ids))
    numbers = _defer_all(secondary, queue, 3)
    cfg = load_config(_syphon_config(config))
    emulator.fault("primary", "quota", entity=down)
    try:
        first = republish_deferred(cfg, {queue: numbers})
        assert {o.outcome for o in first} == {"reparked"}
        # the attempt dies here: no ledger row, nothing settled; the batch is replayed
        close_all()  # a new process
        again = republish_deferred(cfg, {queue: numbers}, replay=True)
    finally:
        emulator.heal("primary", entity=down)
    assert sorted((o.message_id, o.sequence_number, o.outcome) for o in again) == sorted(
        (o.message_id, o.sequence_number, "reparked") for o in first)
    backlog = peek_all(secondary.connection_string, queue)
    copies = [m for m in backlog if m.state == ServiceBusMessageState.ACTIVE]
    assert sorted(m.message_id for m in copies) == sorted(ids)  # one copy each
    assert {m.application_properties[b"x-ms-reparked-from"] for m in copies} == {
        f"{queue}:{n}".encode() for n in numbers}
    assert settle_outcomes(cfg, again) == 3
    assert sorted(m.sequence_number for m in peek_all(secondary.connection_string, queue)) == sorted(
        m.sequence_number for m in copies)
    delivered = [o.message_id for o in _drain_home(_syphon_config(config)) if o.outcome == "delivered"]
    assert sorted(delivered) == sorted(ids)  # one delivered outcome per message id
    assert sorted(m.message_id for m in _receive(primary.connection_string, down, expected=4)) == sorted(ids)


@pytest.mark.parametrize("at_replay", ["down", "healed"])
def test_a_replay_that_also_took_back_the_copies_leaves_one_copy_or_delivers_once(
    emulator, config, primary, secondary, make_queue, at_replay
) -> None:
    down = make_queue()
    queue = config["backlog_queue"]
    ids = [f"t-{i}" for i in range(3)]
    _to_backlog(secondary, queue, _parked(down, ids))
    originals = _defer_all(secondary, queue, 3)
    cfg = load_config(_syphon_config(config))
    emulator.fault("primary", "quota", entity=down)
    try:
        assert {o.outcome for o in republish_deferred(cfg, {queue: originals})} == {"reparked"}
        # the attempt dies; the source's next first call takes back what is deferred and reads the copies too
        close_all()
        copies = _defer_all(secondary, queue, 3)
        if at_replay == "healed":
            emulator.heal("primary", entity=down)
        outcomes = republish_deferred(cfg, {queue: originals + copies}, replay=True)
    finally:
        emulator.heal("primary", entity=down)
    by_number = {o.sequence_number: o.outcome for o in outcomes}
    assert [by_number[n] for n in originals] == ["reparked"] * 3  # their copies carry them on: nothing sent
    assert [by_number[n] for n in copies] == ["reparked" if at_replay == "down" else "delivered"] * 3
    assert settle_outcomes(cfg, outcomes) == 6
    left = peek_all(secondary.connection_string, queue)
    if at_replay == "down":  # the copies' copies, each marked with the copy it came from (and only that)
        assert sorted(m.message_id for m in left) == sorted(ids)
        assert sorted(m.application_properties[b"x-ms-reparked-from"] for m in left) == sorted(
            f"{queue}:{n}".encode() for n in copies)
        delivered = [o.message_id for o in _drain_home(_syphon_config(config)) if o.outcome == "delivered"]
        assert sorted(delivered) == sorted(ids)
    else:
        assert left == []
    assert sorted(m.message_id for m in _receive(primary.connection_string, down, expected=4)) == sorted(ids)


def _unencodable(entity: str, message_id: str) -> ServiceBusMessage:
    """A backlog message (from a foreign producer) whose type marker says application property ``big`` is an AMQP
    ubyte while it holds 100000: restored as such, the SDK cannot encode it again."""
    return ServiceBusMessage(message_id, message_id=message_id, application_properties={
        messages.X_MS_PATH: entity, "big": 100_000, messages.X_MS_PROPERTY_TYPES: '{"big": "C"}'})


def _restores_unencodable(secondary: Any, queue: str, message_id: str) -> bool:
    """Whether the parked ``message_id`` is restored as a message the SDK cannot encode."""
    [parked] = [m for m in peek_all(secondary.connection_string, queue) if m.message_id == message_id]
    restored = messages.from_backlog(parked, datetime.datetime.now(datetime.UTC))
    if not restored.ok or restored.message is None:
        return False
    try:
        messages.message_size(restored.message)
    except (TypeError, ValueError):
        return True
    return False


def test_a_message_the_sdk_cannot_encode_is_dead_lettered_and_the_rest_moved(
    emulator, config, primary, secondary, make_queue
) -> None:
    up = make_queue()
    queue = config["backlog_queue"]
    _to_backlog(secondary, queue, [*_parked(up, ["u-0"]), _unencodable(up, "u-bad"), *_parked(up, ["u-1"])])
    assert _restores_unencodable(secondary, queue, "u-bad")
    with Syphon.from_config(_syphon_config(config)) as syphon:
        summary = syphon.move(queue)
    assert _peek(secondary.connection_string, queue) == []
    assert summary.moved == {up: 2}
    [(reason, count)] = summary.dead_lettered.items()
    assert count == 1 and "big" in reason
    [dead] = _receive(secondary.connection_string, queue, expected=1, sub_queue=ServiceBusSubQueue.DEAD_LETTER)
    assert (dead.message_id, dead.dead_letter_reason) == ("u-bad", reason)
    assert "big" in dead.dead_letter_error_description
    assert sorted(m.message_id for m in _receive(primary.connection_string, up, expected=2)) == ["u-0", "u-1"]


def test_a_deferred_message_the_sdk_cannot_encode_is_dead_lettered_whether_its_destination_is_up_or_down(
    emulator, config, primary, secondary, make_queue
) -> None:
    up, down = make_queue(), make_queue()
    queue = config["backlog_queue"]
    _to_backlog(secondary, queue, [*_parked(up, ["u-0"]), _unencodable(up, "u-bad"), *_parked(up, ["u-1"]),
                                   *_parked(down, ["d-0"]), _unencodable(down, "d-bad"), *_parked(down, ["d-1"])])
    assert _restores_unencodable(secondary, queue, "u-bad")
    numbers = _defer_all(secondary, queue, 6)
    cfg = load_config(_syphon_config(config))
    emulator.fault("primary", "quota", entity=down)
    try:
        outcomes = {o.message_id: o for o in republish_deferred(cfg, {queue: numbers})}
    finally:
        emulator.heal("primary", entity=down)
    assert {i: o.outcome for i, o in outcomes.items()} == {
        "u-0": "delivered", "u-1": "delivered", "u-bad": "dead_lettered",
        "d-0": "reparked", "d-1": "reparked", "d-bad": "dead_lettered"}
    assert settle_outcomes(cfg, list(outcomes.values())) == 6
    for i in ("u-bad", "d-bad"):
        assert "big" in (outcomes[i].reason or "") and "big" in (outcomes[i].description or ""), outcomes[i]
    dead = _receive(secondary.connection_string, queue, expected=2, sub_queue=ServiceBusSubQueue.DEAD_LETTER)
    assert sorted(m.message_id for m in dead) == ["d-bad", "u-bad"]
    assert sorted(m.message_id for m in _receive(primary.connection_string, up, expected=2)) == ["u-0", "u-1"]
    assert sorted(m.message_id for m in peek_all(secondary.connection_string, queue)) == ["d-0", "d-1"]


# --- taking back what a syphon job that died left deferred (issue 39) -----------------------------------------


def test_drain_takes_back_what_a_dead_job_left_deferred_and_sends_nothing_a_re_parked_copy_carries(
    emulator, config, primary, secondary, make_queue
) -> None:
    home, other = make_queue(), make_queue()
    queue = config["backlog_queue"]
    _to_backlog(secondary, queue, _parked(home, [f"h-{i}" for i in range(4)]) + _parked(other, ["o-0", "o-1"]))
    numbers = _defer_all(secondary, queue, 6)  # a syphon job deferred its batch...
    cfg = load_config(_syphon_config(config))
    emulator.fault("primary", "quota", entity=other)
    try:  # ...re-parked a copy of the two for a destination that was down, and died before completing them
        assert {o.outcome for o in republish_deferred(cfg, {queue: numbers[4:]})} == {"reparked"}
    finally:
        emulator.heal("primary", entity=other)
    close_all()
    backlog = peek_all(secondary.connection_string, queue)
    assert sorted(m.state for m in backlog).count(ServiceBusMessageState.DEFERRED) == 6
    with Syphon.from_config(_syphon_config(config)) as syphon:
        summary = syphon.drain(max_wait_time=3.0)
    assert peek_all(secondary.connection_string, queue) == []
    assert sorted(m.message_id for m in _receive(primary.connection_string, home, expected=5)) == [
        f"h-{i}" for i in range(4)]
    assert sorted(m.message_id for m in _receive(primary.connection_string, other, expected=3)) == ["o-0", "o-1"]
    assert sorted((o.message_id, o.outcome) for o in summary.outcomes) == [
        *[(f"h-{i}", "delivered") for i in range(4)],
        ("o-0", "delivered"), ("o-0", "reparked"), ("o-1", "delivered"), ("o-1", "reparked")]
    assert summary.taken_back == 6 and summary.deferred_locked == 0


def test_drain_leaves_deferred_messages_when_told_and_those_another_receiver_holds_locked(
    config, primary, secondary, make_queue
) -> None:
    home = make_queue()
    queue = config["backlog_queue"]
    _to_backlog(secondary, queue, _parked(home, ["d-0", "d-1"]))
    deferred = _defer_all(secondary, queue, 2)
    _to_backlog(secondary, queue, _parked(home, ["active"]))
    cfg = _syphon_config(config)
    with Syphon.from_config(cfg) as syphon:  # beside a running job: only what a receive gets
        summary = syphon.drain(max_wait_time=3.0, take_deferred=False)
    assert (summary.moved, summary.taken_back) == ({home: 1}, 0)
    assert [m.sequence_number for m in peek_all(secondary.connection_string, queue)] == deferred
    with ServiceBusClient.from_connection_string(secondary.connection_string, retry_total=0) as client, \
            client.get_queue_receiver(queue) as holder:
        [held] = holder.receive_deferred_messages([deferred[1]])  # another receiver holds it locked
        with Syphon.from_config(cfg) as syphon:
            summary = syphon.drain(max_wait_time=0.5)
        assert (summary.moved, summary.taken_back, summary.deferred_locked) == ({home: 1}, 1, 1)
        holder.abandon_message(held)  # still deferred
    [left] = peek_all(secondary.connection_string, queue)
    assert (left.sequence_number, left.state) == (deferred[1], ServiceBusMessageState.DEFERRED)
    with Syphon.from_config(cfg) as syphon:
        assert syphon.drain(max_wait_time=0.5).moved == {home: 1}
    assert peek_all(secondary.connection_string, queue) == []
    assert sorted(m.message_id for m in _receive(primary.connection_string, home, expected=4)) == [
        "active", "d-0", "d-1"]


def test_a_syphon_before_any_backlog_queue_exists_moves_nothing_and_raises_nothing(primary, secondary) -> None:
    """A sender creates the backlog queues at its first failover: before it, the syphon (drain, run_once, take_back,
    the deferred count) finds no queue, which holds nothing (MessagingEntityNotFoundError escaped before)."""
    cfg = _config(primary, secondary, backlog_queue_count=2)
    with Syphon.from_config(cfg) as syphon:
        queues = syphon.backlog_queues
        total = syphon.drain(max_wait_time=0.2)
        assert (total.received, total.total_moved, total.total_dead_lettered, total.taken_back) == (0, 0, 0, 0)
        assert syphon.run_once(max_wait_time=0.2).received == 0
        assert syphon.take_back(queues[0]).received == 0
        assert syphon.deferred() == {queue: [] for queue in queues}


def test_a_connection_lost_while_settling_leaves_the_messages_in_the_backlog_to_come_back(
        emulator, config, primary, secondary, make_queue, monkeypatch) -> None:
    """The secondary's connection is lost at the first completion (the SDK shuts the receiver's handler down), while
    another destination is down: every later settlement meets the SDK's ValueError "Failed to complete/abandon the
    message as the handler has already been shutdown", which escaped the syphon before. Now those messages are left
    to the broker (their locks lapse, they come back): the move ends, nothing is lost, nothing is sent twice."""
    up, down = make_queue(), make_queue()
    queue = config["backlog_queue"]
    _to_backlog(secondary, queue, [messages.to_backlog(ServiceBusMessage(f"{e}-{i}", message_id=f"{e}-{i}"), e)
                                   for e in (up, down) for i in range(3)])
    emulator.fault("primary", "quota", entity=down)
    try:
        with Syphon.from_config(_syphon_config(config)) as syphon:
            receiver_of = syphon._secondary.receiver

            @contextlib.contextmanager
            def losing_the_connection(name: str, **kwargs: Any) -> Iterator[Any]:
                with receiver_of(name, **kwargs) as sdk_receiver:
                    def lost(message: Any, **_: Any) -> None:
                        del sdk_receiver.complete_message  # once: the next settlements meet the shut handler
                        sdk_receiver._close_handler()  # what the SDK does when it loses the connection
                        raise ServiceBusConnectionError(message="connection lost (injected)")

                    sdk_receiver.complete_message = lost
                    yield sdk_receiver

            monkeypatch.setattr(syphon._secondary, "receiver", losing_the_connection)
            summary = syphon.move(queue)
            assert summary.received == 6 and summary.left == {down: 3}
    finally:
        emulator.heal("primary", entity=down)
    # each copy reached its healthy destination once; every original is still in the backlog (locked until its
    # lock lapses, then delivered again)
    assert sorted(m.message_id for m in _receive(primary.connection_string, up, expected=4)) == [
        f"{up}-{i}" for i in range(3)]
    assert len(peek_all(secondary.connection_string, queue)) == 6


@pytest.mark.parametrize("path", ["move", "take_back"])
def test_a_connection_lost_mid_settle_is_told_once_and_every_message_comes_home_once(
        emulator, primary, secondary, make_queue, monkeypatch, caplog, path) -> None:
    """The secondary namespace goes down as the syphon starts settling the 30 messages it has just sent home
    (issue 51: a cluster run logged one warning per message, "handler has already been shutdown"), whether it
    received them (``move``) or took them back deferred (``take_back``, what ``drain`` runs first). The syphon
    settles nothing more through the dead receiver, says so in one warning naming the queue and the 30 messages,
    and drops the receiver; once the namespace is back, a new receiver gets them again when their locks lapse, and
    each reaches the primary once (sent again with its message id: duplicate detection drops the second copy)."""
    home = make_queue(requires_duplicate_detection=True)
    cfg = _config(primary, secondary)
    queue = f"{cfg['send_availability']['backlog_prefix']}/x-servicebus-transfer/0"
    server = emulator.server("secondary")
    server.call(lambda: server.broker.create_entity(QueueSpec(name=queue, lock_duration=5.0,  # the shortest
                                                              max_delivery_count=2147483647)))
    ids = [f"m-{i:02}" for i in range(30)]
    _to_backlog(secondary, queue, [messages.to_backlog(ServiceBusMessage(i, message_id=i), home) for i in ids])
    if path == "take_back":
        _defer_all(secondary, queue, 30)  # as a syphon job that died leaves its batch
    try:
        with Syphon.from_config(cfg) as syphon:
            receiver_of = syphon._secondary.receiver
            faulted: list[str] = []

            @contextlib.contextmanager
            def down_at_the_first_settlement(name: str, **kwargs: Any) -> Iterator[Any]:
                with receiver_of(name, **kwargs) as sdk_receiver:
                    complete = sdk_receiver.complete_message

                    def fault_then_complete(message: Any, **more: Any) -> None:
                        if not faulted:  # the namespace goes down (its connections dropped) under the settling
                            faulted.append(str(message.message_id))
                            emulator.fault("secondary", "down")
                        complete(message, **more)

                    sdk_receiver.complete_message = fault_then_complete
                    yield sdk_receiver

            monkeypatch.setattr(syphon._secondary, "receiver", down_at_the_first_settlement)
            with caplog.at_level(logging.WARNING, logger="spark_sb"):
                first = syphon.move(queue, 50, max_wait_time=3.0) if path == "move" else syphon.take_back(queue)
            assert first.received == 30 and faulted
            about_settling = [r.getMessage() for r in caplog.records
                              if r.levelno >= logging.WARNING and r.name.startswith("spark_sb") and "settl" in
                              r.getMessage()]
            assert len(about_settling) == 1, about_settling
            assert queue in about_settling[0] and "30 of the 30 messages" in about_settling[0], about_settling[0]
            assert first.unsettled == 30
            emulator.heal("secondary")
            deadline = time.monotonic() + 120  # their locks lapse within 5 s
            while peek_all(secondary.connection_string, queue) and time.monotonic() < deadline:
                syphon.drain(max_wait_time=1.0)
    finally:
        emulator.heal("secondary")
    assert peek_all(secondary.connection_string, queue) == []
    assert sorted(received_ids(primary.connection_string, home)) == ids


# --- sessions keep their order (issue 38) -----------------------------------------------------------------


def _session_backlog(secondary: Any, queue: str, entity: str, sessions: int, per_session: int) -> list[str]:
    """Park ``per_session`` messages of each session, interleaved (s0-0, s1-0, ..., s0-1, ...); their ids."""
    ids = [f"s{s}-{i}" for i in range(per_session) for s in range(sessions)]
    _to_backlog(secondary, queue, [messages.to_backlog(ServiceBusMessage(i, message_id=i, session_id=i.split("-")[0]),
                                                       entity) for i in ids])
    return ids


def _by_session(connection_string: str, entity: str, sessions: int, per_session: int) -> dict[str, list[str]]:
    return {f"s{s}": [str(m.message_id) for m in _receive(connection_string, entity, expected=per_session,
                                                          session_id=f"s{s}")] for s in range(sessions)}


def test_settle_sends_each_session_in_sequence_order_whatever_order_it_is_given(config, primary, secondary,
                                                                                make_queue) -> None:
    entity = make_queue(requires_session=True)
    queue = config["backlog_queue"]
    _session_backlog(secondary, queue, entity, 2, 4)
    with ServiceBusClient.from_connection_string(secondary.connection_string, retry_total=0) as client:
        with client.get_queue_receiver(queue) as receiver:
            peeked = list(receiver.peek_messages(max_message_count=50))
    assert len(peeked) == 8
    shuffled = peeked[::-1]  # e.g. rows merged from two reads, or taken back out of order
    with Syphon.from_config(_syphon_config(config), repark=True) as syphon:
        summary = MoveSummary(queue, received=len(shuffled))
        syphon.settle(None, shuffled, summary)
    assert summary.moved == {entity: 8}
    assert _by_session(primary.connection_string, entity, 2, 4) == {
        f"s{s}": [f"s{s}-{i}" for i in range(4)] for s in range(2)}


def test_a_sessions_messages_for_a_destination_down_are_left_not_re_parked(emulator, config, primary, secondary,
                                                                         make_queue) -> None:
    """Re-parking sends a copy to the end of the backlog queue, behind the session's later messages: a message
    with a session stays where it is (deferred, outcome left); one without a session is still re-parked."""
    entity = make_queue()
    queue = config["backlog_queue"]
    ids = _session_backlog(secondary, queue, entity, 2, 2)
    _to_backlog(secondary, queue, [messages.to_backlog(ServiceBusMessage("plain", message_id="plain"), entity)])
    with ServiceBusClient.from_connection_string(secondary.connection_string, retry_total=0) as client:
        with client.get_queue_receiver(queue) as receiver:
            peeked = list(receiver.peek_messages(max_message_count=50))
    emulator.fault("primary", "quota", entity=entity)
    try:
        with Syphon.from_config(_syphon_config(config), repark=True) as syphon:
            summary = MoveSummary(queue, received=len(peeked))
            syphon.settle(None, peeked, summary)
    finally:
        emulator.heal("primary", entity=entity)
    outcomes = {o.message_id: o.outcome for o in summary.outcomes}
    assert outcomes == {**dict.fromkeys(ids, "left"), "plain": "reparked"}
    after = _peek(secondary.connection_string, queue)
    copies = [m for m in after if m.sequence_number > peeked[-1].sequence_number]
    assert [str(m.message_id) for m in copies] == ["plain"]  # no copy of a session's message


def test_republish_partition_sends_rows_without_bytes_in_their_sequence_order(config, primary, secondary,
                                                                             make_queue) -> None:
    """A row whose bytes the source could not re-encode is peeked again: it goes in its place, not last."""
    import pyarrow as pa

    from spark_sb.republisher import republish_partition

    entity = make_queue(requires_session=True)
    queue = config["backlog_queue"]
    _session_backlog(secondary, queue, entity, 1, 4)
    with ServiceBusClient.from_connection_string(secondary.connection_string, retry_total=0) as client:
        with client.get_queue_receiver(queue) as receiver:
            for message in receiver.receive_messages(max_message_count=4, max_wait_time=5):
                receiver.defer_message(message)
            peeked = list(receiver.peek_messages(max_message_count=50, sequence_number=1))
    assert len(peeked) == 4
    rows = pa.RecordBatch.from_pydict({
        "backlog_queue": [queue] * 4, "sequence_number": [int(m.sequence_number) for m in peeked],
        "backlog_message": [None, None, *(messages.received_bytes(m) for m in peeked[2:])]})
    cfg = load_config(_syphon_config(config))
    ledger = list(republish_partition(cfg, 0, frozenset(), iter([rows])))
    assert ledger[0].column("outcome").to_pylist() == ["delivered"] * 4
    assert _by_session(primary.connection_string, entity, 1, 4) == {"s0": [f"s0-{i}" for i in range(4)]}


def test_a_sessions_messages_wait_behind_an_earlier_one_another_receive_holds_locked(
        config, primary, secondary, make_queue) -> None:
    """s0-0 locked by another receive (one whose defer was lost, say): the syphon leaves s0-1..s0-3 until it
    comes back, then moves the session in order (the soak found a job's receive-ahead losing a defer's answer,
    and the later messages of the session moved first)."""
    entity = make_queue(requires_session=True)
    queue = config["backlog_queue"]
    _session_backlog(secondary, queue, entity, 1, 4)
    cfg = _syphon_config(config)
    with ServiceBusClient.from_connection_string(secondary.connection_string, retry_total=0) as client:
        with client.get_queue_receiver(queue) as locker:
            (first,) = locker.receive_messages(max_message_count=1, max_wait_time=5)
            assert first.message_id == "s0-0"
            with Syphon.from_config(cfg) as syphon:
                summary = syphon.move(queue, max_wait_time=1)
            assert summary.received == 3 and summary.total_moved == 0
            assert {(o.outcome, o.reason) for o in summary.outcomes} == {("left", SESSION_GAP)}
            locker.abandon_message(first)
    with Syphon.from_config(cfg) as syphon:
        assert syphon.drain(max_wait_time=0.5).total_moved == 4
    assert _by_session(primary.connection_string, entity, 1, 4) == {"s0": [f"s0-{i}" for i in range(4)]}


def test_republished_rows_of_a_session_wait_behind_an_earlier_message_not_in_the_batch(
        config, primary, secondary, make_queue) -> None:
    """The syphon job's path (peeked rows, nothing settled): the batch holds s0-1..s0-3 but not s0-0, which is
    still in the queue: they are left (the source offers them again), nothing is sent."""
    entity = make_queue(requires_session=True)
    queue = config["backlog_queue"]
    _session_backlog(secondary, queue, entity, 1, 4)
    peeked = _peek(secondary.connection_string, queue)
    assert [m.message_id for m in peeked] == [f"s0-{i}" for i in range(4)]
    outcomes = republish_received(load_config(_syphon_config(config)), {queue: peeked[1:]})
    assert [(o.outcome, o.reason) for o in outcomes] == [("left", SESSION_GAP)] * 3
    assert not _receive(primary.connection_string, entity, expected=1, session_id="s0")
