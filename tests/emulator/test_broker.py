"""The emulator's broker: what a Service Bus client would observe, driven by a fake clock."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Callable

import pytest
from proton import Message

from spark_sb.emulator.broker import (
    DLQ_SUFFIX,
    STATE_ACTIVE,
    STATE_DEFERRED,
    STATE_SCHEDULED,
    Broker,
    BrokerError,
    Cond,
    Incoming,
)
from spark_sb.emulator.model import QueueSpec, RuleSpec, SubscriptionSpec, TopicSpec
from spark_sb.emulator.store import MemoryStore, SqliteStore

T0 = 1_700_000_000.0


class FakeClock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Env:
    """A broker on a fake clock that records on_available calls; ``reopen`` builds a second broker on the
    same store, as a restarted emulator would."""

    def __init__(self, new_store: Callable[[], object], **kwargs: object) -> None:
        self.clock = FakeClock()
        self.available: list[str] = []
        self._new_store = new_store
        self._kwargs = kwargs
        self.broker = self.reopen()

    def reopen(self) -> Broker:
        return Broker(self._new_store(), clock=self.clock, on_available=self.available.append, **self._kwargs)


@pytest.fixture(params=["sqlite", "memory"])
def make_env(request: pytest.FixtureRequest, tmp_path) -> Callable[..., Env]:
    def make(**kwargs: object) -> Env:
        if request.param == "sqlite":
            return Env(lambda: SqliteStore(tmp_path / "ns.db"), **kwargs)
        memory = MemoryStore()
        return Env(lambda: memory, **kwargs)

    return make


@pytest.fixture
def env(make_env: Callable[..., Env]) -> Env:
    return make_env()


def msg(body: str, **kwargs: object) -> Incoming:
    return Incoming(raw=body.encode(), message_id=kwargs.pop("message_id", body), **kwargs)  # type: ignore[arg-type]


def bodies(messages) -> list[str]:
    return [m.raw.decode() for m in messages]


def raises(condition: str):
    return pytest.raises(BrokerError, match=f"^{condition}:")


# --------------------------------------------------------------------------- basic queue behaviour


def test_sequence_numbers_are_per_entity_from_one_and_survive_a_restart(env: Env) -> None:
    b = env.broker
    b.create_entity(QueueSpec("a"))
    b.create_entity(QueueSpec("b"))
    b.create_entity(TopicSpec("t"))
    b.create_entity(SubscriptionSpec("t", "s1"))
    b.create_entity(SubscriptionSpec("t", "s2"))
    assert b.send("a", [msg("a1"), msg("a2")]) == [1, 2]
    assert b.send("b", [msg("b1")]) == [1]
    assert b.send("t", [msg("t1")]) == [1]  # both subscriptions' copies carry the topic's number
    assert [m.sequence_number for m in b.peek("t/subscriptions/s2", 0, 5)] == [1]
    assert b.schedule("a", [msg("later")], T0 + 60) == [3]
    assert len(b.receive("a", 5, peek_lock=False)) == 2  # the queue is empty but for the scheduled one
    restarted = env.reopen()
    # numbers keep growing after a restart, even where every message is gone
    assert restarted.send("a", [msg("a4")]) == [4]
    assert restarted.send("b", [msg("b2")]) == [2]
    restarted.delete_entity("queue", "b")
    restarted.create_entity(QueueSpec("b"))
    assert restarted.send("b", [msg("new")]) == [1]  # a new entity of the same name starts again


def test_messages_come_back_in_order_with_increasing_sequence_numbers(env: Env) -> None:
    b = env.broker
    b.create_entity(QueueSpec("orders"))
    seqs = b.send("orders", [msg("a"), msg("b")]) + b.send("orders", [msg("c")])
    assert seqs == sorted(seqs) and len(set(seqs)) == 3
    assert env.available == ["orders", "orders"]

    got = b.receive("orders", 2, peek_lock=True)
    assert bodies(got) == ["a", "b"]
    assert [m.sequence_number for m in got] == seqs[:2]
    assert all(m.delivery_count == 1 and m.lock_token is not None for m in got)
    assert got[0].locked_until == T0 + 60
    assert bodies(b.receive("orders", 5, peek_lock=True)) == ["c"]
    assert b.receive("orders", 5, peek_lock=True) == []

    b.complete("orders", got[0].lock_token)
    counts = b.runtime_counts("orders")
    assert (counts.active, counts.dead_letter, counts.total) == (2, 0, 2)
    with raises(Cond.LOCK_LOST):
        b.complete("orders", got[0].lock_token)  # settled twice
    with raises(Cond.LOCK_LOST):
        b.complete("orders", uuid.uuid4())


def test_lock_expiry_makes_the_message_receivable_again(env: Env) -> None:
    b = env.broker
    b.create_entity(QueueSpec("orders", lock_duration=30))
    b.send("orders", [msg("a")])
    first = b.receive("orders", 1, peek_lock=True)[0]
    assert b.next_deadline() == T0 + 30

    env.clock.advance(20)
    assert b.renew_lock("orders", [first.lock_token]) == [T0 + 50]
    env.clock.advance(29)
    b.tick()
    assert b.receive("orders", 1, peek_lock=True) == []  # still locked after the renewal

    env.clock.advance(2)
    with raises(Cond.LOCK_LOST):
        b.complete("orders", first.lock_token)
    env.available.clear()
    b.tick()
    assert env.available == ["orders"]
    again = b.receive("orders", 1, peek_lock=True)[0]
    assert (again.raw, again.delivery_count) == (b"a", 2)
    assert again.lock_token != first.lock_token
    with raises(Cond.LOCK_LOST):
        b.renew_lock("orders", [first.lock_token])


def test_receive_and_delete_removes_messages(env: Env) -> None:
    b = env.broker
    b.create_entity(QueueSpec("orders"))
    b.send("orders", [msg("a"), msg("b")])
    got = b.receive("orders", 1, peek_lock=False)
    assert bodies(got) == ["a"] and got[0].lock_token is None
    assert bodies(b.peek("orders", 0, 10)) == ["b"]
    assert bodies(env.reopen().peek("orders", 0, 10)) == ["b"]


def test_abandon_until_max_delivery_count_dead_letters(env: Env) -> None:
    b = env.broker
    b.create_entity(QueueSpec("orders", max_delivery_count=2))
    b.send("orders", [msg("a")])
    for _ in range(2):
        m = b.receive("orders", 1, peek_lock=True)[0]
        b.abandon("orders", m.lock_token)
    assert b.receive("orders", 1, peek_lock=True) == []
    assert "orders" + DLQ_SUFFIX in env.available

    dead = b.receive("orders" + DLQ_SUFFIX, 1, peek_lock=True)
    assert bodies(dead) == ["a"]
    assert dead[0].dead_letter_reason == "MaxDeliveryCountExceeded"
    assert "2 delivery attempts" in (dead[0].dead_letter_description or "")
    assert dead[0].dead_letter_source == "orders"
    counts = b.runtime_counts("orders")
    assert (counts.active, counts.dead_letter) == (0, 1)
    b.complete("orders" + DLQ_SUFFIX, dead[0].lock_token)
    assert b.runtime_counts("orders").dead_letter == 0


def test_lock_expiry_at_max_delivery_count_dead_letters_on_next_delivery(env: Env) -> None:
    b = env.broker
    b.create_entity(QueueSpec("orders", max_delivery_count=1, lock_duration=10))
    b.send("orders", [msg("a"), msg("b")])
    b.receive("orders", 1, peek_lock=True)
    env.clock.advance(11)
    b.tick()
    assert bodies(b.receive("orders", 5, peek_lock=True)) == ["b"]
    dead = b.peek("orders" + DLQ_SUFFIX, 0, 5)
    assert bodies(dead) == ["a"] and dead[0].dead_letter_reason == "MaxDeliveryCountExceeded"


def test_dead_letter_keeps_the_message_with_reason(env: Env) -> None:
    b = env.broker
    b.create_entity(QueueSpec("orders"))
    seq = b.send("orders", [msg("a", session_id=None)])[0]
    m = b.receive("orders", 1, peek_lock=True)[0]
    b.dead_letter("orders", m.lock_token, "BadOrder", "missing customer")
    dead = b.peek("orders/$deadletterqueue", 0, 5)  # any case, as the service accepts
    assert [(d.sequence_number, d.message_id, d.raw) for d in dead] == [(seq, "a", b"a")]
    assert (dead[0].dead_letter_reason, dead[0].dead_letter_description) == ("BadOrder", "missing customer")
    # no further dead-lettering from the DLQ: the message stays there
    d = b.receive("orders" + DLQ_SUFFIX, 1, peek_lock=True)[0]
    b.dead_letter("orders" + DLQ_SUFFIX, d.lock_token, "again", None)
    assert bodies(b.peek("orders" + DLQ_SUFFIX, 0, 5)) == ["a"]


def _amqp(body: str, **properties: object) -> Incoming:
    return Incoming(raw=bytes(Message(body=body, properties=properties).encode()), message_id=body)


def _properties(stored) -> dict:
    m = Message()
    m.decode(stored.raw)
    return dict(m.properties or {})


def test_abandon_defer_and_dead_letter_apply_properties_to_modify(make_env: Callable[..., Env]) -> None:
    # the service merges a settlement's properties-to-modify into the message's application properties
    # (the Java and .NET SDKs send them with abandon, defer and dead-letter); they survive a restart
    env = make_env()
    b = env.broker
    b.create_entity(QueueSpec("orders"))
    b.send("orders", [_amqp("a", kept="yes", attempt=0), _amqp("d"), _amqp("x")])
    a, d, x = b.receive("orders", 3, peek_lock=True)
    b.abandon("orders", a.lock_token, {"attempt": 1, "why": "busy"})
    b.defer("orders", d.lock_token, {"deferred-by": "worker-1"})
    b.dead_letter("orders", x.lock_token, "Bad", "why", {"checked": True})
    b = env.reopen()
    again = b.receive("orders", 1, peek_lock=True)[0]
    assert _properties(again) == {"kept": "yes", "attempt": 1, "why": "busy"}
    (deferred,) = b.receive_deferred("orders", [d.sequence_number], peek_lock=True)
    assert _properties(deferred) == {"deferred-by": "worker-1"}
    (dead,) = b.peek("orders" + DLQ_SUFFIX, 0, 5)
    assert _properties(dead) == {"checked": True} and dead.dead_letter_reason == "Bad"
    b.abandon("orders", again.lock_token)  # no properties: the message stays as it is
    assert _properties(b.receive("orders", 1, peek_lock=True)[0])["attempt"] == 1


def test_defer_and_receive_deferred(env: Env) -> None:
    b = env.broker
    b.create_entity(QueueSpec("orders"))
    seq_a, seq_b = b.send("orders", [msg("a"), msg("b")])
    a = b.receive("orders", 1, peek_lock=True)[0]
    b.defer("orders", a.lock_token)
    assert bodies(b.receive("orders", 5, peek_lock=True)) == ["b"]
    assert b.receive("orders", 5, peek_lock=True) == []

    with raises(Cond.MESSAGE_NOT_FOUND):
        b.receive_deferred("orders", [seq_a, seq_b], peek_lock=True)  # b is not deferred
    got = b.receive_deferred("orders", [seq_a], peek_lock=True)
    assert bodies(got) == ["a"] and got[0].state == STATE_DEFERRED and got[0].delivery_count == 2
    b.abandon("orders", got[0].lock_token)  # stays deferred
    assert b.receive("orders", 5, peek_lock=True) == []
    got = b.receive_deferred("orders", [seq_a], peek_lock=False)
    assert bodies(got) == ["a"]
    with raises(Cond.MESSAGE_NOT_FOUND):
        b.receive_deferred("orders", [seq_a], peek_lock=True)


def test_peek_shows_every_state_without_counting_a_delivery(env: Env) -> None:
    b = env.broker
    b.create_entity(QueueSpec("orders"))
    s1, s2, s3 = b.send("orders", [msg("locked"), msg("deferred"), msg("active")])
    s4 = b.send("orders", [msg("later", scheduled_enqueue_time=T0 + 60)])[0]
    b.receive("orders", 1, peek_lock=True)
    d = b.receive("orders", 1, peek_lock=True)[0]
    b.defer("orders", d.lock_token)

    peeked = b.peek("orders", 0, 10)
    assert [m.sequence_number for m in peeked] == [s1, s2, s3, s4]
    assert [m.state for m in peeked] == [STATE_ACTIVE, STATE_DEFERRED, STATE_ACTIVE, STATE_SCHEDULED]
    assert [m.delivery_count for m in peeked] == [1, 1, 0, 0]
    assert [m.sequence_number for m in b.peek("orders", s2, 2)] == [s2, s3]
    assert bodies(b.receive("orders", 5, peek_lock=True)) == ["active"]


# --------------------------------------------------------------------------- time: TTL and scheduling


def test_expired_messages_are_dead_lettered_or_dropped(env: Env) -> None:
    b = env.broker
    b.create_entity(QueueSpec("keep", default_message_time_to_live=30, dead_lettering_on_message_expiration=True))
    b.create_entity(QueueSpec("drop", default_message_time_to_live=30))
    b.send("keep", [msg("short", ttl=10), msg("default"), msg("long", ttl=3600)])
    b.send("drop", [msg("x")])
    assert [m.expires_at for m in b.peek("keep", 0, 5)] == [T0 + 10, T0 + 30, T0 + 30]
    assert b.next_deadline() == T0 + 10

    env.clock.advance(11)
    b.tick()
    dead = b.peek("keep" + DLQ_SUFFIX, 0, 5)
    assert bodies(dead) == ["short"] and dead[0].dead_letter_reason == "TTLExpiredException"
    assert bodies(b.peek("keep", 0, 5)) == ["default", "long"]

    env.clock.advance(20)  # no tick: receive applies the expiry itself
    assert b.receive("drop", 5, peek_lock=True) == []
    assert b.peek("drop", 0, 5) == []
    assert b.runtime_counts("drop").total == 0
    assert b.receive("keep", 5, peek_lock=True) == []
    assert bodies(b.peek("keep" + DLQ_SUFFIX, 0, 5)) == ["short", "default", "long"]

    env.clock.advance(86400)  # messages do not expire out of the dead-letter queue
    b.tick()
    assert len(b.receive("keep" + DLQ_SUFFIX, 5, peek_lock=True)) == 3


def test_a_locked_message_expires_when_its_lock_ends(env: Env) -> None:
    b = env.broker
    b.create_entity(QueueSpec("orders", lock_duration=30, dead_lettering_on_message_expiration=True))
    b.send("orders", [msg("a", ttl=10)])
    m = b.receive("orders", 1, peek_lock=True)[0]
    env.clock.advance(20)
    b.tick()
    assert b.peek("orders" + DLQ_SUFFIX, 0, 5) == []  # the receiver still holds it
    b.abandon("orders", m.lock_token)
    assert "orders" + DLQ_SUFFIX in env.available
    dead = b.receive("orders" + DLQ_SUFFIX, 5, peek_lock=True)
    assert bodies(dead) == ["a"] and dead[0].dead_letter_reason == "TTLExpiredException"


def test_scheduled_message_becomes_active_at_its_time(env: Env) -> None:
    b = env.broker
    b.create_entity(QueueSpec("orders"))
    seq = b.send("orders", [msg("later", scheduled_enqueue_time=T0 + 60)])[0]
    assert env.available == []
    assert b.receive("orders", 1, peek_lock=True) == []
    counts = b.runtime_counts("orders")
    assert (counts.active, counts.scheduled) == (0, 1)
    assert b.next_deadline() == T0 + 60

    env.clock.advance(59)
    b.tick()
    assert b.receive("orders", 1, peek_lock=True) == []
    env.clock.advance(1)
    b.tick()
    assert env.available == ["orders"]
    got = b.receive("orders", 1, peek_lock=True)
    assert [m.sequence_number for m in got] == [seq] and got[0].enqueued_time == T0 + 60
    assert b.next_deadline() == T0 + 120  # its lock


def test_cancel_scheduled(env: Env) -> None:
    b = env.broker
    b.create_entity(QueueSpec("orders"))
    b.create_entity(TopicSpec("events"))
    b.create_entity(SubscriptionSpec("events", "all"))
    keep, cancel = b.schedule("orders", [msg("keep"), msg("cancel")], T0 + 30)
    b.cancel_scheduled("orders", [cancel, 999_999])
    topic_seq = b.schedule("events", [msg("t")], T0 + 30)[0]
    assert b.runtime_counts("events").scheduled == 1
    b.cancel_scheduled("events", [topic_seq])
    assert b.runtime_counts("events").scheduled == 0

    env.clock.advance(30)
    b.tick()
    assert [m.sequence_number for m in b.receive("orders", 5, peek_lock=True)] == [keep]
    assert b.receive("events/subscriptions/all", 5, peek_lock=True) == []


# --------------------------------------------------------------------------- duplicate detection


def test_duplicate_detection_within_and_after_the_window(env: Env) -> None:
    b = env.broker
    b.create_entity(
        QueueSpec("orders", requires_duplicate_detection=True, duplicate_detection_history_time_window=60)
    )
    first = b.send("orders", [msg("a", message_id="id-1"), msg("b", message_id="id-1"), msg("c", message_id="id-2")])
    assert first[0] == first[1] != first[2]
    env.clock.advance(30)
    assert b.send("orders", [msg("a again", message_id="id-1")]) == [first[0]]
    assert bodies(b.peek("orders", 0, 10)) == ["a", "c"]

    assert b.next_deadline() == T0 + 60
    env.clock.advance(31)
    b.tick()
    again = b.send("orders", [msg("a later", message_id="id-1")])[0]
    assert again > first[2]
    assert bodies(b.peek("orders", 0, 10)) == ["a", "c", "a later"]


def test_queue_without_duplicate_detection_keeps_repeated_ids(env: Env) -> None:
    b = env.broker
    b.create_entity(QueueSpec("orders"))
    b.send("orders", [msg("a", message_id="same"), msg("b", message_id="same")])
    assert bodies(b.peek("orders", 0, 10)) == ["a", "b"]


# --------------------------------------------------------------------------- sessions


def test_sessions_lock_one_owner_and_next_available(env: Env) -> None:
    b = env.broker
    b.create_entity(QueueSpec("jobs", requires_session=True, lock_duration=30))
    b.send("jobs", [msg("s2-1", session_id="s2")])
    b.send("jobs", [msg("s1-1", session_id="s1"), msg("s1-2", session_id="s1")])
    with raises(Cond.INVALID):
        b.send("jobs", [msg("no session")])

    sid, until = b.lock_session("jobs", None, "link-A")
    assert (sid, until) == ("s2", T0 + 30)  # the session with the oldest message
    with raises(Cond.SESSION_CANNOT_BE_LOCKED):
        b.lock_session("jobs", "s2", "link-B")
    assert b.lock_session("jobs", None, "link-B")[0] == "s1"
    with raises(Cond.TIMEOUT):
        b.lock_session("jobs", None, "link-C")

    assert bodies(b.receive("jobs", 5, peek_lock=True, session_id="s1")) == ["s1-1", "s1-2"]
    assert bodies(b.receive("jobs", 5, peek_lock=True, session_id="s2")) == ["s2-1"]
    with raises(Cond.INVALID):
        b.receive("jobs", 5, peek_lock=True)
    with raises(Cond.SESSION_LOCK_LOST):
        b.receive("jobs", 5, peek_lock=True, session_id="s3")  # not locked

    b.release_session("jobs", "s2", "link-A")
    assert b.lock_session("jobs", "s2", "link-C")[0] == "s2"
    env.clock.advance(20)
    assert b.renew_session_lock("jobs", "s2", "link-C") == T0 + 50
    with raises(Cond.SESSION_LOCK_LOST):
        b.renew_session_lock("jobs", "s2", "link-A")
    assert b.renew_session_lock("jobs", "s2", None) == T0 + 50  # $management: whoever holds it
    with raises(Cond.SESSION_CANNOT_BE_LOCKED):
        b.lock_session("jobs", "s2", "link-A")  # still link-C's
    env.clock.advance(15)
    b.tick()  # s1's lock expired
    with raises(Cond.SESSION_LOCK_LOST):
        b.receive("jobs", 1, peek_lock=True, session_id="s1")
    assert b.lock_session("jobs", "s1", "link-D")[0] == "s1"
    b.create_entity(QueueSpec("plain"))
    with raises(Cond.INVALID):
        b.lock_session("plain", None, "link-A")


def test_session_state_and_listing(env: Env) -> None:
    b = env.broker
    b.create_entity(QueueSpec("jobs", requires_session=True))
    b.send("jobs", [msg("a", session_id="s1")])
    assert b.get_session_state("jobs", "s1") is None
    env.clock.advance(5)
    b.set_session_state("jobs", "s2", b"step-3")
    assert b.get_session_state("jobs", "s2") == b"step-3"
    assert b.list_sessions("jobs", None) == ["s1", "s2"]
    assert b.list_sessions("jobs", T0 + 1) == ["s2"]
    b.set_session_state("jobs", "s2", None)
    assert b.get_session_state("jobs", "s2") is None


# --------------------------------------------------------------------------- topics


def test_topic_fans_out_through_true_correlation_and_sql_filters(env: Env) -> None:
    b = env.broker
    b.create_entity(TopicSpec("events"))
    b.create_entity(SubscriptionSpec("events", "all"))
    b.create_entity(SubscriptionSpec("events", "none", rules=[RuleSpec("off", {"type": "false"})]))
    b.create_entity(
        SubscriptionSpec("events", "eu", rules=[RuleSpec("eu", {"type": "correlation", "subject": "order",
                                                                 "properties": {"region": "eu"}})])
    )
    b.create_entity(
        SubscriptionSpec("events", "big-red", rules=[
            RuleSpec("r", {"type": "sql", "expression": "color = 'red' AND (sys.Label = 'order' AND qty = 5)"})
        ])
    )
    b.create_entity(SubscriptionSpec("events", "sql-true", rules=[RuleSpec("t", {"type": "sql", "expression": "1=1"})]))

    def event(body: str, subject: str, **props: object) -> Incoming:
        return msg(body, filter_fields={"subject": subject, "properties": props})

    seqs = b.send("events", [
        event("eu-red-5", "order", region="eu", color="red", qty=5),
        event("us-red-5", "order", region="us", color="red", qty=5),
        event("eu-invoice", "invoice", region="eu", qty="5"),
    ])
    assert len(set(seqs)) == 3

    def sub(name: str) -> list[str]:
        return bodies(b.peek(f"events/subscriptions/{name}", 0, 10))

    assert sub("all") == sub("sql-true") == ["eu-red-5", "us-red-5", "eu-invoice"]
    assert sub("none") == []
    assert sub("eu") == ["eu-red-5"]
    assert sub("big-red") == ["eu-red-5", "us-red-5"]
    # every copy carries the topic's sequence number
    assert [m.sequence_number for m in b.peek("events/subscriptions/eu", 0, 10)] == [seqs[0]]
    counts = b.runtime_counts("events")
    assert (counts.active, counts.size_in_bytes) == (0, len(b"eu-red-5us-red-5eu-invoice"))

    # completing in one subscription leaves the other copies
    m = b.receive("events/subscriptions/eu", 1, peek_lock=True)[0]
    b.complete("events/subscriptions/eu", m.lock_token)
    assert sub("all")[0] == "eu-red-5"


def test_topic_without_matching_subscription_accepts_and_drops(env: Env) -> None:
    b = env.broker
    b.create_entity(TopicSpec("events"))
    b.create_entity(SubscriptionSpec("events", "none", rules=[RuleSpec("off", {"type": "false"})]))
    seq = b.send("events", [msg("lost")])
    assert len(seq) == 1
    assert b.peek("events/subscriptions/none", 0, 10) == []
    assert b.runtime_counts("events").size_in_bytes == 0


def test_rules_change_routing_and_unparsable_sql_is_refused(env: Env) -> None:
    b = env.broker
    b.create_entity(TopicSpec("events"))
    b.create_entity(SubscriptionSpec("events", "s"))
    for bad in ("a >", "a = 1 OR", "a LIKE 5", "", "sys.Nope = 'x'", "EXISTS(a)", "a = @p"):
        with raises(Cond.INVALID):
            b.create_rule("events", "s", RuleSpec("bad", {"type": "sql", "expression": bad}))
    with raises(Cond.INVALID):
        b.create_rule("events", "s", RuleSpec("bad", {"type": "true"}, action={"expression": "SET a"}))
    with raises(Cond.INVALID):
        b.create_entity(SubscriptionSpec("events", "t", rules=[RuleSpec("x", {"type": "sql", "expression": "NOT"})]))

    b.delete_rule("events", "s", "$Default")
    b.create_rule("events", "s", RuleSpec("blue", {"type": "sql", "expression": "user.color = 'blue'"}))
    with raises(Cond.ALREADY_EXISTS):
        b.create_rule("events", "s", RuleSpec("blue", {"type": "true"}))
    assert [r.name for r in b.list_rules("events", "s")] == ["blue"]
    b.send("events", [msg("red", filter_fields={"properties": {"color": "red"}}),
                      msg("blue", filter_fields={"properties": {"color": "blue"}})])
    assert bodies(b.peek("events/subscriptions/s", 0, 10)) == ["blue"]
    b.update_rule("events", "s", RuleSpec("blue", {"type": "correlation", "properties": {"color": "red"}}))
    b.send("events", [msg("red2", filter_fields={"properties": {"color": "red"}})])
    assert bodies(b.peek("events/subscriptions/s", 0, 10)) == ["blue", "red2"]
    with raises(Cond.NOT_FOUND):
        b.delete_rule("events", "s", "nope")


def test_session_subscription_refuses_message_without_session(env: Env) -> None:
    b = env.broker
    b.create_entity(TopicSpec("events"))
    b.create_entity(SubscriptionSpec("events", "s", requires_session=True))
    with raises(Cond.INVALID):
        b.send("events", [msg("x")])
    b.send("events", [msg("y", session_id="k")])
    assert b.lock_session("events/subscriptions/s", None, "link")[0] == "k"


# --------------------------------------------------------------------------- limits and status


def test_message_size_and_quota_errors(make_env: Callable[..., Env]) -> None:
    env = make_env(max_message_size=800 * 1024)
    b = env.broker
    b.create_entity(QueueSpec("small", max_size_in_megabytes=1))
    too_big = Incoming(raw=b"x" * (800 * 1024 + 1), message_id="big-1")
    with pytest.raises(BrokerError) as err:
        b.send("small", [too_big])
    assert err.value.condition == Cond.SIZE
    assert "big-1" in err.value.description and str(800 * 1024 + 1) in err.value.description

    half = b"x" * (600 * 1024)
    b.send("small", [Incoming(raw=half, message_id="1")])
    with pytest.raises(BrokerError) as err:
        b.send("small", [Incoming(raw=b"ok", message_id="2"), Incoming(raw=half, message_id="3")])
    assert err.value.condition == Cond.QUOTA and "'small'" in err.value.description
    assert [m.message_id for m in b.peek("small", 0, 10)] == ["1"]  # all or nothing
    assert b.runtime_counts("small").size_in_bytes == len(half)


def test_disabled_entity_refuses_send_and_receive(env: Env) -> None:
    b = env.broker
    b.create_entity(QueueSpec("orders"))
    b.send("orders", [msg("a")])
    b.update_entity(QueueSpec("orders", status="Disabled"))
    with pytest.raises(BrokerError) as err:
        b.send("orders", [msg("b")])
    assert (err.value.condition, err.value.description) == (
        Cond.DISABLED, "Messaging entity 'orders' is currently disabled."
    )
    with raises(Cond.DISABLED):
        b.receive("orders", 1, peek_lock=True)
    b.update_entity(QueueSpec("orders", status="SendDisabled"))
    with raises(Cond.DISABLED):
        b.send("orders", [msg("b")])
    assert bodies(b.receive("orders", 1, peek_lock=True)) == ["a"]


# --------------------------------------------------------------------------- entities


def test_entity_administration(env: Env) -> None:
    b = env.broker
    b.create_entity(QueueSpec("orders"))
    b.create_entity(QueueSpec("audit"))
    b.create_entity(TopicSpec("events"))
    b.create_entity(SubscriptionSpec("events", "b"))
    b.create_entity(SubscriptionSpec("events", "a"))
    with raises(Cond.ALREADY_EXISTS):
        b.create_entity(QueueSpec("Orders"))
    with raises(Cond.ALREADY_EXISTS):
        b.create_entity(QueueSpec("events"))
    with raises(Cond.NOT_FOUND):
        b.create_entity(SubscriptionSpec("missing", "a"))
    with raises(Cond.INVALID):
        b.create_entity(QueueSpec("bad", lock_duration=1))

    assert [q.name for q in b.list_entities("queue")] == ["audit", "orders"]
    assert [s.name for s in b.list_entities("subscription", "events")] == ["a", "b"]
    assert b.resolve("orders") == ("queue", "orders")
    assert b.resolve("events") == ("topic", "events")
    assert b.resolve("events/subscriptions/a/$DeadLetterQueue") == ("subscription-dlq", "events/subscriptions/a/$DeadLetterQueue")
    assert b.entity_created_at("orders") == T0
    with pytest.raises(BrokerError) as err:
        b.resolve("nope")
    assert err.value.description == "The messaging entity 'nope' could not be found."

    b.send("orders", [msg("a")])
    b.update_entity(QueueSpec("orders", max_delivery_count=3))
    assert b.get_entity("queue", "orders").max_delivery_count == 3
    assert bodies(b.peek("orders", 0, 5)) == ["a"]

    b.send("events", [msg("e")])
    b.delete_entity("topic", "events")
    with raises(Cond.NOT_FOUND):
        b.get_entity("subscription", "events/subscriptions/a")
    with raises(Cond.NOT_FOUND):
        b.send("events", [msg("e")])
    assert [t.name for t in env.reopen().list_entities("topic")] == []


# --------------------------------------------------------------------------- durability


def test_everything_survives_a_killed_process(tmp_path) -> None:
    path = tmp_path / "ns.db"
    clock = FakeClock()
    b = Broker(SqliteStore(path), clock=clock)
    b.create_entity(QueueSpec("orders", requires_duplicate_detection=True, max_delivery_count=5))
    b.create_entity(QueueSpec("jobs", requires_session=True))
    b.create_entity(TopicSpec("events"))
    b.create_entity(SubscriptionSpec("events", "eu", rules=[
        RuleSpec("eu", {"type": "correlation", "properties": {"region": "eu"}})
    ]))
    seq_locked, seq_deferred, seq_active = b.send("orders", [msg("locked"), msg("deferred"), msg("active")])
    seq_later = b.send("orders", [msg("later", scheduled_enqueue_time=T0 + 60)])[0]
    b.receive("orders", 1, peek_lock=True)  # locked, never settled
    d = b.receive("orders", 1, peek_lock=True)[0]
    b.defer("orders", d.lock_token)
    dl = b.send("jobs", [msg("dl", session_id="s")])
    b.lock_session("jobs", "s", "link")
    m = b.receive("jobs", 1, peek_lock=True, session_id="s")[0]
    b.dead_letter("jobs", m.lock_token, "Bad", "why")
    b.set_session_state("jobs", "s", b"state-1")
    b.send("events", [msg("eu", filter_fields={"properties": {"region": "eu"}}),
                      msg("us", filter_fields={"properties": {"region": "us"}})])

    # "kill -9": no close, a second broker opens the same file
    clock.advance(1)
    b2 = Broker(SqliteStore(path), clock=clock)
    assert [q.name for q in b2.list_entities("queue")] == ["jobs", "orders"]
    assert b2.get_entity("queue", "orders").requires_duplicate_detection is True
    peeked = b2.peek("orders", 0, 10)
    assert [(p.sequence_number, p.state, p.delivery_count) for p in peeked] == [
        (seq_locked, STATE_ACTIVE, 1), (seq_deferred, STATE_DEFERRED, 1),
        (seq_active, STATE_ACTIVE, 0), (seq_later, STATE_SCHEDULED, 0),
    ]
    # the lock is forgotten: the message is receivable again, with its delivery count
    got = b2.receive("orders", 5, peek_lock=True)
    assert [(g.raw, g.delivery_count) for g in got] == [(b"locked", 2), (b"active", 1)]
    assert bodies(b2.receive_deferred("orders", [seq_deferred], peek_lock=True)) == ["deferred"]
    assert b2.send("orders", [msg("again", message_id="locked")]) == [seq_locked]  # duplicate history
    new_seq = b2.send("orders", [msg("new")])[0]
    assert new_seq > max(seq_later, dl[0])
    assert b2.get_session_state("jobs", "s") == b"state-1"
    dead = b2.peek("jobs" + DLQ_SUFFIX, 0, 5)
    assert [(x.raw, x.dead_letter_reason, x.dead_letter_description) for x in dead] == [(b"dl", "Bad", "why")]
    assert bodies(b2.peek("events/subscriptions/eu", 0, 5)) == ["eu"]
    assert b2.runtime_counts("events").size_in_bytes == 2
    clock.advance(59)  # the scheduled time; the locks taken at T0 + 1 last until T0 + 61
    b2.tick()
    assert bodies(b2.receive("orders", 5, peek_lock=True)) == ["later", "new"]
    b2.close()
    b.close()


def test_a_store_from_before_per_entity_numbers_continues_from_its_namespace_number(tmp_path) -> None:
    db = tmp_path / "old.db"
    b = Broker(SqliteStore(db), clock=FakeClock())
    b.create_entity(QueueSpec("orders"))
    b.send("orders", [msg("a")])
    b.close()
    conn = sqlite3.connect(db)  # what an older emulator left: no per-entity row, the namespace's last number
    conn.execute("DELETE FROM sequences")
    conn.execute("UPDATE meta SET last_sequence_number = 50")
    conn.commit()
    conn.close()
    again = Broker(SqliteStore(db), clock=FakeClock())
    assert again.send("orders", [msg("b")]) == [51]
    again.close()
