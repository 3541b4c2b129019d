"""Sessions at their edges (issue 48): a secondary that cannot be asked never holds a send nothing could have
parked, what a sender parks is known to every thread at once, an entity's session is one whatever the case of its
name, an unencodable session id is a bad message, and a session's question to the backlog costs what its own
session needs."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage
from pairing import pair_config, session_bodies

from spark_sb import messages
from spark_sb import sink as sink_module
from spark_sb.config import load_config
from spark_sb.errors import BacklogUnavailableError, BadMessageError
from spark_sb.paired import PRIMARY, PairedSender
from spark_sb.paired import sender as sender_module
from spark_sb.syphon import Syphon


def _send(sender: Any, q: str, session: str, n: int) -> dict[str, int]:
    message = ServiceBusMessage(f"{session}/{n}", message_id=f"{session}/{n}", session_id=session)
    return dict(sender.send(q, message).destinations)


def _drain_backlog(config: dict, expected: int) -> None:
    with Syphon.from_config(config) as syphon:
        assert syphon.drain(max_wait_time=0.5).total_moved == expected


# --- 1. a secondary that cannot be asked -------------------------------------------------------------------

def test_a_long_running_sender_whose_session_queue_was_found_absent_goes_on_to_the_primary_while_the_secondary_is_down(
        emulator, make_queue, make_sender, make_config, primary) -> None:
    """``session_order: strict``. Nothing ever failed over, so the session's backlog queue was never made: the
    sender found it absent, and remembers it when the secondary goes down. A new partition (``new_batch``) cannot
    ask the secondary, but nothing could have been parked in a queue that does not exist: its messages go on to
    the healthy primary instead of failing every batch."""
    q = make_queue(requires_session=True)
    sender = make_sender(config=make_config(backlog_queue_count=1, pairing_timeout="2s"))
    assert _send(sender, q, "a", 0) == {PRIMARY: 1}
    emulator.fault("secondary", "down")
    try:
        for n in range(1, 4):
            sender.new_batch()  # a partition each, as the sink does
            assert _send(sender, q, "a", n) == {PRIMARY: 1}
        assert sender.stats()["session_held"] == 0
    finally:
        emulator.heal("secondary")
    assert session_bodies(primary.connection_string, q, "a", 4) == [f"a/{n}" for n in range(4)]


def test_a_fresh_sender_of_a_process_that_found_the_queue_absent_goes_on_to_the_primary_while_the_secondary_is_down(
        emulator, make_queue, make_sender, make_config, primary) -> None:
    """What the process found absent is the process's: a new sender (a new sink after a configuration change, a
    new ``PairedSender`` in a script) does not hold the session while the secondary is down either."""
    q = make_queue(requires_session=True)
    config = make_config(backlog_queue_count=1, pairing_timeout="2s")
    first = make_sender(config=config)
    assert _send(first, q, "a", 0) == {PRIMARY: 1}
    first.close()
    emulator.fault("secondary", "down")
    try:
        fresh = make_sender(config=config)
        assert _send(fresh, q, "a", 1) == {PRIMARY: 1}
        assert fresh.stats()["session_held"] == 0
    finally:
        emulator.heal("secondary")
    assert session_bodies(primary.connection_string, q, "a", 2) == ["a/0", "a/1"]


def test_a_queue_found_absent_then_made_by_this_process_holds_its_sessions_again_while_the_secondary_is_down(
        emulator, make_queue, make_sender, make_config) -> None:
    """The memory of an absent queue lasts until the process makes it (it parks nothing without making it
    first): once paired, a session whose queue cannot be asked is held again in strict mode."""
    q = make_queue(requires_session=True)
    sender = make_sender(config=make_config(backlog_queue_count=1, pairing_timeout="2s"))
    assert _send(sender, q, "a", 0) == {PRIMARY: 1}
    sender.pair()  # the queue exists now: something could be parked there
    emulator.fault("secondary", "down")
    try:
        sender.new_batch()
        with pytest.raises(BacklogUnavailableError, match="session_order: strict"):
            _send(sender, q, "a", 1)
    finally:
        emulator.heal("secondary")


# --- 4. entity names are case-insensitive ------------------------------------------------------------------

def test_a_session_sent_under_two_spellings_of_its_entity_keeps_its_order(
        emulator, make_queue, make_sender, make_config, fake_time, primary) -> None:
    """Service Bus entity names are case-insensitive: ``Orders`` and ``orders`` are one queue, so one session.
    Messages parked under one spelling are followed by messages sent under the other."""
    q = make_queue(requires_session=True)
    config = make_config(failover_interval="0s", backlog_queue_count=4)
    sender = make_sender(config=config)
    spellings = [q, q.upper(), q.title()]
    sessions = [f"s{n}" for n in range(8)]  # several, so that some hash differently under another spelling
    for s in sessions:
        assert _send(sender, spellings[0], s, 0) == {PRIMARY: 1}
    emulator.fault("primary", "quota")  # the emulator keys a fault by the spelling: the whole namespace
    for s in sessions:
        assert PRIMARY not in _send(sender, spellings[1], s, 1)  # failed over: parked
    emulator.heal("primary")
    fake_time.advance(5)
    sender.run_pings_once()
    assert sender.state(spellings[2]) == "healthy" and sender.state(spellings[1]) == "healthy"
    for s in sessions:
        assert PRIMARY not in _send(sender, spellings[2], s, 2)  # follows the parked one, whatever the spelling
    for s in sessions:
        assert PRIMARY not in _send(sender, spellings[1], s, 3)
    # the syphon moves one session of one entity, whatever the spellings its messages were parked under
    _drain_backlog(config, 3 * len(sessions))
    for s in sessions:
        assert session_bodies(primary.connection_string, q, s, 4) == [f"{s}/{n}" for n in range(4)]


def test_the_health_of_an_entity_is_one_whatever_the_spelling(
        emulator, make_queue, make_sender, make_config) -> None:
    q = make_queue()
    sender = make_sender(config=make_config(failover_interval="0s", backlog_queue_count=1))
    emulator.fault("primary", "quota")
    try:
        assert sender.send(q.upper(), ServiceBusMessage("x")).backlog == 1
    finally:
        emulator.heal("primary")
    assert sender.state(q) == "failed_over"
    assert sender.board.snapshot() == {q.upper(): "failed_over"}  # one entity, as first spelled


# --- 6. an unencodable session id --------------------------------------------------------------------------

@pytest.mark.parametrize("failed_over", [False, True])
def test_an_unencodable_session_id_is_a_bad_message_naming_the_field_and_value(
        emulator, make_queue, make_sender, make_config, failed_over) -> None:
    q = make_queue(requires_session=True)
    sender = make_sender(config=make_config(failover_interval="0s", backlog_queue_count=2))
    if failed_over:
        emulator.fault("primary", "quota", entity=q)
        sender.send(q, ServiceBusMessage("first", session_id="ok"))
        assert sender.state(q) == "failed_over"
    bad = ServiceBusMessage("x", message_id="m-1", session_id="s\ud800")
    with pytest.raises(BadMessageError) as caught:
        sender.send(q, [ServiceBusMessage("fine", message_id="m-0", session_id="ok"), bad])
    text = str(caught.value)
    assert "'m-1'" in text and "session_id" in text and "'s\\ud800'" in text, text


# --- 2. what a sender parks is known to every thread at once -----------------------------------------------

def test_two_threads_one_session_each_keep_their_order_through_an_outage_and_a_failback(
        emulator, make_queue, make_sender, make_config, fake_time, primary, monkeypatch) -> None:
    """Thread A parks a message of its session; while A's backlog send is still on its way, the primary comes
    back and thread B asks the backlog about B's session (its peek cannot see A's message yet). A's next message
    must still follow the parked one, not overtake it on the healed primary."""
    q = make_queue(requires_session=True)
    config = make_config(failover_interval="0s", backlog_queue_count=1)
    sender = make_sender(config=config)
    a_in_flight, b_done = threading.Event(), threading.Event()
    real_send_batches = sender_module.send_batches

    def send_batches(namespace: Any, queue: str, batch: Any, entity: str) -> Any:
        if threading.current_thread().name == "A" and namespace is sender._secondary and not b_done.is_set():
            a_in_flight.set()  # A's backlog send has begun; it goes on once B has asked the backlog
            assert b_done.wait(30)
        return real_send_batches(namespace, queue, batch, entity)

    monkeypatch.setattr(sender_module, "send_batches", send_batches)
    emulator.fault("primary", "quota", entity=q)
    results: dict[str, list[dict[str, int]]] = {"A": [], "B": []}
    errors: list[BaseException] = []

    def thread_a() -> None:
        try:
            for n in range(3):
                results["A"].append(_send(sender, q, "A", n))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    def thread_b() -> None:
        try:
            assert a_in_flight.wait(30)
            emulator.heal("primary", entity=q)
            fake_time.advance(5)
            sender.run_pings_once()  # failed back while A's message is on its way
            for n in range(3):
                results["B"].append(_send(sender, q, "B", n))
                b_done.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
        finally:
            b_done.set()

    threads = [threading.Thread(target=thread_a, name="A"), threading.Thread(target=thread_b, name="B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert PRIMARY not in results["A"][0] and all(PRIMARY not in r for r in results["A"]), results
    _drain_backlog(config, 3)
    assert session_bodies(primary.connection_string, q, "A", 3) == ["A/0", "A/1", "A/2"]
    assert session_bodies(primary.connection_string, q, "B", 3) == ["B/0", "B/1", "B/2"]


# --- 5. a session's question costs what its own session needs ----------------------------------------------

def _park_others(connection_string: str, queue: str, entity: str, n: int) -> None:
    """``n`` messages of another entity, without sessions, parked in ``queue`` as a failover would."""
    with ServiceBusClient.from_connection_string(connection_string, retry_total=0) as client:
        with client.get_queue_sender(queue) as sender:
            for start in range(0, n, 500):
                batch = sender.create_message_batch()
                for i in range(start, min(n, start + 500)):
                    batch.add_message(messages.to_backlog(ServiceBusMessage(f"o{i}", message_id=f"o{i}"), entity))
                sender.send_messages(batch)


def test_a_sessions_question_is_not_proportional_to_other_entities_backlog(
        emulator, make_queue, make_sender, make_config, secondary, primary) -> None:
    """5,000 messages of another entity parked in the session's backlog queue: once the process has read them,
    a new partition's question about the session costs a request or two, not a walk of the whole queue."""
    q = make_queue(requires_session=True)
    sender = make_sender(config=make_config(backlog_queue_count=1))
    sender.pair()
    [name] = sender.backlog_queues
    _park_others(secondary.connection_string, name, "other-entity", 5000)
    assert _send(sender, q, "a", 0) == {PRIMARY: 1}  # the process reads what is parked
    for n in range(1, 4):
        sender.new_batch()  # a partition each
        before = sender.stats()["session_peeks"]
        assert _send(sender, q, "a", n) == {PRIMARY: 1}
        assert sender.stats()["session_peeks"] - before <= 2
    assert session_bodies(primary.connection_string, q, "a", 4) == [f"a/{n}" for n in range(4)]


def test_a_sessions_question_is_bounded_as_a_whole_and_goes_on_where_it_stopped(
        emulator, make_queue, make_config, fake_time, secondary, primary) -> None:
    """The walk through a large backlog stops at ``pairing_timeout`` in all (here every reading of the sender's
    clock costs a second: a slow secondary): the message it could not answer for goes behind whatever may be
    parked (to its backlog queue, which keeps its order), and the next question goes on from where the last one
    stopped, so a new session reaches the primary once the walk is done."""
    q = make_queue(requires_session=True)
    config = make_config(backlog_queue_count=1, pairing_timeout="3s")
    slow = threading.Event()

    def clock() -> float:
        if slow.is_set():
            fake_time.advance(1)
        return fake_time.now

    with PairedSender.from_config(config, clock=clock, sleep=fake_time.sleep, ping_wait=fake_time.idle) as sender:
        sender.pair()
        [name] = sender.backlog_queues
        _park_others(secondary.connection_string, name, "other-entity", 5000)
        slow.set()
        assert _send(sender, q, "c0", 0) == {name: 1}  # not answered in time: behind whatever may be parked
        first = sender.stats()["session_peeks"]
        assert first <= 6, first  # not the 21 requests of the whole queue
        for n in range(1, 15):
            sender.new_batch()  # a partition each, a new session each
            if _send(sender, q, f"c{n}", 0) == {PRIMARY: 1}:
                break
        else:
            pytest.fail("the walk never ended")
        assert sender.stats()["session_peeks"] <= 21 + 2 * n
    assert session_bodies(primary.connection_string, q, f"c{n}", 1) == [f"c{n}/0"]


def test_a_sink_partition_sends_a_session_in_order_whatever_the_spellings_of_its_entity(
        emulator, make_queue, primary, secondary) -> None:
    """The sink gathers a partition's rows in chunks per entity: rows of one session under two spellings of its
    entity are one chunk, in order, not two chunks sent one after the other."""
    q = make_queue(requires_session=True)
    raw = pair_config(primary, secondary, "se", backlog_queue_count=1, failover_interval="10s",
                      ping_primary_interval="5s", primary_try_timeout="3s")
    config = load_config({**raw, "sink": {"entity": q}})
    spellings = [q, q.upper()]
    rows = [{"body": f"S/{n}".encode(), "message_id": f"S/{n}", "session_id": "S", "entity": spellings[n % 2]}
            for n in range(6)]
    try:
        run = sink_module.PartitionRun(config, config.fingerprint(), 1, 0, (), reject=False)
        out = list(run.run_rows(rows))
        [summary] = [b for b in out if b.column("kind")[0].as_py() == "summary"]
        assert summary.column("sent")[0].as_py() == 6
    finally:
        sink_module.close_senders()
    assert session_bodies(primary.connection_string, q, "S", 6) == [f"S/{n}" for n in range(6)]


def test_a_session_handed_to_another_sender_of_the_process_follows_what_the_first_parked(
        emulator, make_queue, make_sender, make_config, fake_time, primary, monkeypatch) -> None:
    """Two senders of one process (a sink's sender replaced, a script's two): the second asked the backlog while
    the first one's backlog send of session S was on its way, then takes S over without ``new_batch()``. What the
    process parks is known to all its senders: S's next message follows the parked one."""
    q = make_queue(requires_session=True)
    config = make_config(failover_interval="0s", backlog_queue_count=1)
    first, second = make_sender(config=config), make_sender(config=config)
    in_flight, asked = threading.Event(), threading.Event()
    real_send_batches = sender_module.send_batches

    def send_batches(namespace: Any, queue: str, batch: Any, entity: str) -> Any:
        if namespace is first._secondary and not asked.is_set():
            in_flight.set()  # the first sender's backlog send has begun; it goes on once the second has asked
            assert asked.wait(30)
        return real_send_batches(namespace, queue, batch, entity)

    monkeypatch.setattr(sender_module, "send_batches", send_batches)
    emulator.fault("primary", "quota", entity=q)
    parking = threading.Thread(target=lambda: first.send(q, ServiceBusMessage("S/0", message_id="S/0",
                                                                              session_id="S")))
    parking.start()
    try:
        assert in_flight.wait(30)
        emulator.heal("primary", entity=q)
        fake_time.advance(5)
        second.run_pings_once()  # failed back while the first sender's message is on its way
        assert _send(second, q, "X", 0) == {PRIMARY: 1}  # the second sender asks the backlog meanwhile
    finally:
        asked.set()
        parking.join(30)
    assert PRIMARY not in _send(second, q, "S", 1)  # handed over: behind the parked one
    _drain_backlog(config, 2)
    assert session_bodies(primary.connection_string, q, "S", 2) == ["S/0", "S/1"]
