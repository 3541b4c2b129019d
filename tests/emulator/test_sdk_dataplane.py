"""The unmodified azure-servicebus SDK against the emulator: the data plane."""

from __future__ import annotations

import datetime as dt
import threading
import time

import pytest
from azure.servicebus import (
    NEXT_AVAILABLE_SESSION,
    ServiceBusClient,
    ServiceBusMessage,
    ServiceBusReceiveMode,
    ServiceBusSubQueue,
)
from azure.servicebus.exceptions import (
    MessageLockLostError,
    MessageSizeExceededError,
    MessagingEntityNotFoundError,
    OperationTimeoutError,
    SessionCannotBeLockedError,
)

from spark_sb.emulator.model import RuleSpec
from spark_sb.emulator.server import send_control


def _utc(seconds_from_now: float) -> dt.datetime:
    return dt.datetime.now(dt.UTC) + dt.timedelta(seconds=seconds_from_now)


def test_single_and_batch_send_arrive_in_order_with_every_field(client: ServiceBusClient, make_queue) -> None:
    q = make_queue()
    first = ServiceBusMessage(
        b"\x00binary body",
        message_id="m-1",
        correlation_id="corr",
        subject="subj",
        content_type="application/octet-stream",
        to="somewhere",
        reply_to="back",
        reply_to_session_id="rs",
        application_properties={"s": "v", "i": 7, "f": 1.5, "b": True},
        time_to_live=dt.timedelta(minutes=5),
        partition_key="pk",
    )
    with client.get_queue_sender(q) as sender:
        sender.send_messages(first)
        batch = sender.create_message_batch()
        for i in range(50):
            batch.add_message(ServiceBusMessage(f"b{i}", message_id=f"b-{i}"))
        sender.send_messages(batch)
        sender.send_messages([ServiceBusMessage("list", message_id="l-1")])
    with client.get_queue_receiver(q, max_wait_time=2) as receiver:
        got = []
        while len(got) < 52:
            msgs = receiver.receive_messages(max_message_count=60, max_wait_time=2)
            if not msgs:
                break
            for m in msgs:
                receiver.complete_message(m)
            got.extend(msgs)
    assert [m.message_id for m in got] == ["m-1"] + [f"b-{i}" for i in range(50)] + ["l-1"]
    m = got[0]
    assert b"".join(m.body) == b"\x00binary body"
    assert (m.correlation_id, m.subject, m.content_type, m.to, m.reply_to, m.reply_to_session_id) == (
        "corr", "subj", "application/octet-stream", "somewhere", "back", "rs")
    assert {k.decode() if isinstance(k, bytes) else k: v for k, v in m.application_properties.items()} == {
        "s": b"v" if isinstance(m.application_properties.get(b"s"), bytes) else "v", "i": 7, "f": 1.5, "b": True}
    assert m.time_to_live == dt.timedelta(minutes=5)
    assert m.partition_key == "pk"
    seqs = [x.sequence_number for x in got]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert m.enqueued_time_utc is not None and abs((m.enqueued_time_utc - _utc(0)).total_seconds()) < 30
    assert m.delivery_count == 0


def test_receive_and_delete_removes_without_settlement(client: ServiceBusClient, make_queue) -> None:
    q = make_queue()
    with client.get_queue_sender(q) as s:
        s.send_messages([ServiceBusMessage(f"x{i}") for i in range(3)])
    with client.get_queue_receiver(q, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as r:
        got = r.receive_messages(max_message_count=10, max_wait_time=2)
    assert sorted(str(m) for m in got) == ["x0", "x1", "x2"]
    with client.get_queue_receiver(q) as r:
        assert r.receive_messages(max_wait_time=1) == []


def test_abandon_redelivers_with_incremented_delivery_count_then_dead_letters(
    client: ServiceBusClient, make_queue
) -> None:
    q = make_queue(max_delivery_count=2)
    with client.get_queue_sender(q) as s:
        s.send_messages(ServiceBusMessage("poison", message_id="p"))
    counts = []
    with client.get_queue_receiver(q) as r:
        for _ in range(2):
            (m,) = r.receive_messages(max_wait_time=2)
            counts.append(m.delivery_count)
            r.abandon_message(m)
        assert r.receive_messages(max_wait_time=1) == []
    assert counts == [0, 1]
    with client.get_queue_receiver(q, sub_queue=ServiceBusSubQueue.DEAD_LETTER) as dlq:
        (d,) = dlq.receive_messages(max_wait_time=2)
        dlq.complete_message(d)
    assert d.message_id == "p"
    assert d.dead_letter_reason == "MaxDeliveryCountExceeded"


def test_prefetched_messages_released_by_a_closing_receiver_are_not_counted_as_deliveries(
    client: ServiceBusClient, make_queue
) -> None:
    q = make_queue(max_delivery_count=1)
    with client.get_queue_sender(q) as s:
        s.send_messages([ServiceBusMessage(f"r{i}", message_id=f"r{i}") for i in range(20)])
    for _ in range(3):  # each receiver prefetches, takes one, and closes
        with client.get_queue_receiver(q, prefetch_count=20) as r:
            (m,) = r.receive_messages(max_message_count=1, max_wait_time=2)
            r.complete_message(m)
    with client.get_queue_receiver(q) as r:
        rest = []
        while batch := r.receive_messages(max_message_count=20, max_wait_time=2):
            rest.extend(batch)
            for m in batch:
                r.complete_message(m)
    assert len(rest) == 17  # none dead-lettered by the release churn
    assert all(m.delivery_count == 0 for m in rest)


def test_dead_letter_with_reason_and_description(client: ServiceBusClient, make_queue) -> None:
    q = make_queue()
    with client.get_queue_sender(q) as s:
        s.send_messages(ServiceBusMessage("bad", message_id="d1"))
    with client.get_queue_receiver(q) as r:
        (m,) = r.receive_messages(max_wait_time=2)
        r.dead_letter_message(m, reason="Invalid", error_description="field x missing")
    with client.get_queue_receiver(q, sub_queue=ServiceBusSubQueue.DEAD_LETTER) as dlq:
        (d,) = dlq.receive_messages(max_wait_time=2)
    assert (d.message_id, d.dead_letter_reason, d.dead_letter_error_description) == ("d1", "Invalid", "field x missing")
    assert d.dead_letter_source is None or q in d.dead_letter_source


def test_defer_then_receive_by_sequence_number_and_complete(client: ServiceBusClient, make_queue) -> None:
    q = make_queue()
    with client.get_queue_sender(q) as s:
        s.send_messages([ServiceBusMessage("a", message_id="a"), ServiceBusMessage("b", message_id="b")])
    with client.get_queue_receiver(q) as r:
        msgs = r.receive_messages(max_message_count=2, max_wait_time=2)
        deferred = [m.sequence_number for m in msgs if m.message_id == "a"]
        for m in msgs:
            if m.message_id == "a":
                r.defer_message(m)
            else:
                r.complete_message(m)
        assert r.receive_messages(max_wait_time=1) == []  # deferred messages are not delivered
        peeked = r.peek_messages(max_message_count=10, sequence_number=1)
        assert [(p.message_id, p.state.name) for p in peeked] == [("a", "DEFERRED")]
        (again,) = r.receive_deferred_messages(deferred)
        assert again.message_id == "a"
        r.complete_message(again)
        assert r.peek_messages(max_message_count=10, sequence_number=1) == []


def test_lock_renewal_extends_and_lock_loss_is_reported(emulator_with_clock, fake_clock) -> None:
    info = emulator_with_clock["clocked"]
    q = emulator_with_clock.make_queue(lock_duration=30)
    with ServiceBusClient.from_connection_string(info.connection_string, retry_total=0) as c:
        with c.get_queue_sender(q) as s:
            s.send_messages(ServiceBusMessage("locked", message_id="L"))
        with c.get_queue_receiver(q) as r:
            (m,) = r.receive_messages(max_wait_time=2)
            before = m.locked_until_utc
            fake_clock.advance(20)
            renewed = r.renew_message_lock(m)
            assert renewed > before
            fake_clock.advance(31)  # past the renewed lock
            time.sleep(0.3)  # let the emulator's timer see the new time
            with pytest.raises(MessageLockLostError):
                r.complete_message(m)
            (again,) = r.receive_messages(max_wait_time=2)
            assert again.message_id == "L" and again.delivery_count == 1
            r.complete_message(again)


def test_ttl_expiry_dead_letters_when_the_queue_says_so(emulator_with_clock, fake_clock) -> None:
    info = emulator_with_clock["clocked"]
    q = emulator_with_clock.make_queue(dead_lettering_on_message_expiration=True)
    with ServiceBusClient.from_connection_string(info.connection_string, retry_total=0) as c:
        with c.get_queue_sender(q) as s:
            s.send_messages(ServiceBusMessage("short", message_id="ttl", time_to_live=dt.timedelta(seconds=10)))
            s.send_messages(ServiceBusMessage("long", message_id="keep"))
        fake_clock.advance(11)
        time.sleep(0.3)
        with c.get_queue_receiver(q) as r:
            got = r.receive_messages(max_message_count=5, max_wait_time=2)
            assert [m.message_id for m in got] == ["keep"]
            r.complete_message(got[0])
        with c.get_queue_receiver(q, sub_queue=ServiceBusSubQueue.DEAD_LETTER) as dlq:
            (d,) = dlq.receive_messages(max_wait_time=2)
    assert (d.message_id, d.dead_letter_reason) == ("ttl", "TTLExpiredException")


def test_scheduled_message_appears_at_its_time_and_cancel_removes_it(emulator_with_clock, fake_clock) -> None:
    info = emulator_with_clock["clocked"]
    q = emulator_with_clock.make_queue()
    with ServiceBusClient.from_connection_string(info.connection_string, retry_total=0) as c:
        with c.get_queue_sender(q) as s:
            (keep,) = s.schedule_messages(ServiceBusMessage("later", message_id="later"), _utc(60))
            (drop,) = s.schedule_messages(ServiceBusMessage("never", message_id="never"), _utc(60))
            s.cancel_scheduled_messages(drop)
            via_send = ServiceBusMessage("annotated", message_id="annotated", scheduled_enqueue_time_utc=_utc(60))
            s.send_messages(via_send)
        with c.get_queue_receiver(q) as r:
            assert r.receive_messages(max_wait_time=1) == []
            states = {p.message_id: p.state.name for p in r.peek_messages(max_message_count=10)}
            assert states == {"later": "SCHEDULED", "annotated": "SCHEDULED"}
            fake_clock.advance(61)
            time.sleep(0.3)
            got = r.receive_messages(max_message_count=5, max_wait_time=2)
            assert sorted(m.message_id for m in got) == ["annotated", "later"]
            assert keep in [m.sequence_number for m in got]
            for m in got:
                r.complete_message(m)


def test_duplicate_detection_drops_a_repeated_message_id(client: ServiceBusClient, make_queue) -> None:
    q = make_queue(requires_duplicate_detection=True, duplicate_detection_history_time_window=60)
    with client.get_queue_sender(q) as s:
        s.send_messages(ServiceBusMessage("one", message_id="same"))
        s.send_messages(ServiceBusMessage("two", message_id="same"))
        s.send_messages([ServiceBusMessage("three", message_id="same"), ServiceBusMessage("x", message_id="other")])
    with client.get_queue_receiver(q, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as r:
        got = r.receive_messages(max_message_count=10, max_wait_time=2)
    assert [(m.message_id, str(m)) for m in got] == [("same", "one"), ("other", "x")]


def test_sessions_named_next_available_lock_and_state(client: ServiceBusClient, make_queue) -> None:
    q = make_queue(requires_session=True)
    with client.get_queue_sender(q) as s:
        s.send_messages([ServiceBusMessage(f"a{i}", session_id="A") for i in range(3)])
        s.send_messages([ServiceBusMessage(f"b{i}", session_id="B") for i in range(2)])
    with client.get_queue_receiver(q, session_id="B") as rb:
        assert rb.session.session_id == "B"
        got = rb.receive_messages(max_message_count=10, max_wait_time=2)
        assert [str(m) for m in got] == ["b0", "b1"]
        for m in got:
            rb.complete_message(m)
        rb.session.set_state(b"checkpoint-2")
        assert rb.session.get_state() == b"checkpoint-2"
        assert rb.session.renew_lock() > _utc(0)
        with pytest.raises(SessionCannotBeLockedError):
            with client.get_queue_receiver(q, session_id="B", max_wait_time=2) as other:
                other.receive_messages(max_wait_time=1)
    with client.get_queue_receiver(q, session_id=NEXT_AVAILABLE_SESSION, max_wait_time=5) as ra:
        assert ra.session.session_id == "A"
        got = ra.receive_messages(max_message_count=10, max_wait_time=2)
        assert [str(m) for m in got] == ["a0", "a1", "a2"]
        for m in got:
            ra.complete_message(m)
    with client.get_queue_receiver(q, session_id="B") as rb:
        assert rb.session.get_state() == b"checkpoint-2"


def test_next_available_session_times_out_when_none_has_messages(client: ServiceBusClient, make_queue) -> None:
    q = make_queue(requires_session=True)
    started = time.monotonic()
    with pytest.raises(OperationTimeoutError):
        with client.get_queue_receiver(q, session_id=NEXT_AVAILABLE_SESSION, max_wait_time=2) as r:
            r.receive_messages(max_wait_time=1)
    assert time.monotonic() - started < 30


def test_peek_sees_messages_without_locking_them(client: ServiceBusClient, make_queue) -> None:
    q = make_queue()
    with client.get_queue_sender(q) as s:
        s.send_messages([ServiceBusMessage(f"p{i}", message_id=f"p{i}") for i in range(5)])
    with client.get_queue_receiver(q) as r:
        peeked = r.peek_messages(max_message_count=3)
        assert [m.message_id for m in peeked] == ["p0", "p1", "p2"]
        more = r.peek_messages(max_message_count=10, sequence_number=peeked[-1].sequence_number + 1)
        assert [m.message_id for m in more] == ["p3", "p4"]
        got = r.receive_messages(max_message_count=5, max_wait_time=2)
        assert len(got) == 5 and got[0].delivery_count == 0


def test_message_over_256_kib_is_refused_and_one_under_is_accepted(client: ServiceBusClient, make_queue) -> None:
    q = make_queue()
    with client.get_queue_sender(q) as s:
        s.send_messages(ServiceBusMessage(b"x" * (250 * 1024), message_id="fits"))
        with pytest.raises(MessageSizeExceededError):
            s.send_messages(ServiceBusMessage(b"x" * (257 * 1024), message_id="too-big"))
    with client.get_queue_receiver(q, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as r:
        got = r.receive_messages(max_message_count=5, max_wait_time=2)
    assert [m.message_id for m in got] == ["fits"]
    assert len(b"".join(got[0].body)) == 250 * 1024


def test_a_batch_filled_to_the_sdks_limit_is_accepted(client: ServiceBusClient, make_queue) -> None:
    q = make_queue()
    with client.get_queue_sender(q) as s:
        batch = s.create_message_batch()
        n = 0
        while True:
            try:
                batch.add_message(ServiceBusMessage(b"x" * 1024, message_id=f"full-{n}"))
            except ValueError:
                break
            n += 1
        s.send_messages(batch)
    with client.get_queue_receiver(q, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as r:
        got = []
        while page := r.receive_messages(max_message_count=n, max_wait_time=2):
            got.extend(page)
    assert n > 200 and len(got) == n


def test_unknown_entity_raises_not_found_for_sender_and_receiver(client: ServiceBusClient) -> None:
    with pytest.raises(MessagingEntityNotFoundError):
        with client.get_queue_sender("no-such-queue") as s:
            s.send_messages(ServiceBusMessage("x"))
    with pytest.raises(MessagingEntityNotFoundError):
        with client.get_queue_receiver("no-such-queue") as r:
            r.receive_messages(max_wait_time=1)


def test_topic_fans_out_to_matching_subscriptions(client: ServiceBusClient, make_topic) -> None:
    t = make_topic({
        "all": {},
        "eu": {"rules": [RuleSpec(name="eu", filter={"type": "correlation", "properties": {"region": "eu"}})]},
        "urgent": {"rules": [RuleSpec(name="u", filter={"type": "correlation", "subject": "urgent"})]},
        "sql": {"rules": [RuleSpec(name="s", filter={"type": "sql", "expression": "region = 'us'"})]},
    })
    with client.get_topic_sender(t) as s:
        s.send_messages(ServiceBusMessage("1", message_id="eu-normal", application_properties={"region": "eu"}))
        s.send_messages(ServiceBusMessage("2", message_id="us-urgent", subject="urgent",
                                          application_properties={"region": "us"}))
    got = {}
    for sub in ("all", "eu", "urgent", "sql"):
        with client.get_subscription_receiver(t, sub, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as r:
            got[sub] = sorted(m.message_id for m in r.receive_messages(max_message_count=10, max_wait_time=2))
    assert got == {"all": ["eu-normal", "us-urgent"], "eu": ["eu-normal"], "urgent": ["us-urgent"], "sql": ["us-urgent"]}


def test_many_concurrent_clients_are_served_at_once(primary, make_queue) -> None:
    q = make_queue()
    n = 25
    all_open = threading.Barrier(n + 1, timeout=120)
    may_close = threading.Event()
    sent = []

    def work(i: int) -> None:
        with ServiceBusClient.from_connection_string(primary.connection_string, retry_total=0) as c:
            with c.get_queue_sender(q) as s:
                s.send_messages(ServiceBusMessage(str(i)))
                sent.append(i)
                all_open.wait()
                may_close.wait(60)  # hold the connection until the emulator has been asked

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    all_open.wait()
    peak = send_control(primary.admin_url, "stats")["connections"]
    may_close.set()
    for t in threads:
        t.join(60)
    assert peak >= n
    with ServiceBusClient.from_connection_string(primary.connection_string) as c:
        with c.get_queue_receiver(q, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as r:
            got = []
            while batch := r.receive_messages(max_message_count=n, max_wait_time=2):
                got.extend(batch)
    assert sorted(int(str(m)) for m in got) == list(range(n))


def test_sequence_numbers_are_counted_per_queue_from_one(client: ServiceBusClient, make_queue) -> None:
    first, second = make_queue(), make_queue()
    for q, n in ((first, 3), (second, 2)):
        with client.get_queue_sender(q) as s:
            s.send_messages([ServiceBusMessage(f"{q}-{i}") for i in range(n)])
    with client.get_queue_sender(first) as s:
        [scheduled] = s.schedule_messages(ServiceBusMessage("later"), _utc(3600))
    assert scheduled == 4
    for q, expected in ((first, [1, 2, 3, 4]), (second, [1, 2])):
        with client.get_queue_receiver(q) as r:
            assert [m.sequence_number for m in r.peek_messages(max_message_count=10, sequence_number=1)] == expected


def test_a_message_sent_without_an_id_is_given_one_and_keeps_its_other_fields(
        client: ServiceBusClient, make_queue) -> None:
    """Service Bus gives every message an id when its sender set none; the JavaScript SDK sends none unless told
    and failed to settle such a message ("Failed to stop auto lock renewal - no message ID")."""
    from azure.servicebus.amqp import AmqpAnnotatedMessage

    q = make_queue()
    with client.get_queue_sender(q) as s:
        s.send_messages([AmqpAnnotatedMessage(data_body=b"no id", application_properties={"k": 1}),
                         AmqpAnnotatedMessage(data_body=b"no id either", properties={"subject": "s"})])
    with client.get_queue_receiver(q, max_wait_time=2) as r:
        got = r.receive_messages(max_message_count=2, max_wait_time=2)
        for m in got:
            r.complete_message(m)
    assert [str(m) for m in got] == ["no id", "no id either"]
    ids = [m.message_id for m in got]
    assert all(isinstance(i, str) and len(i) == 32 for i in ids) and ids[0] != ids[1]
    assert got[0].application_properties == {b"k": 1} and got[1].subject == "s"
