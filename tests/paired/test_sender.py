"""The paired sender against two emulator namespaces with injected faults, on fake time."""

from __future__ import annotations

import datetime

import pytest
from azure.servicebus import ServiceBusMessage, ServiceBusMessageBatch
from azure.servicebus._transport._pyamqp_transport import PyamqpTransport
from azure.servicebus.exceptions import MessageSizeExceededError

from spark_sb import messages
from spark_sb.errors import (
    BacklogUnavailableError,
    BadMessageError,
    CredentialRejectedError,
    EntityNotFoundError,
)
from spark_sb.paired import PRIMARY, PairedSender


def backlog_total(admin, sender: PairedSender) -> int:
    return sum(admin.get_queue_runtime_properties(q).active_message_count for q in sender.backlog_queues)


def test_a_healthy_entity_gets_every_message_on_the_primary(make_sender, make_queue, primary, drain) -> None:
    q = make_queue()
    sender = make_sender()
    one = sender.send(q, ServiceBusMessage("one", message_id="m1"))
    many = sender.send(q, [ServiceBusMessage(f"b{i}", message_id=f"b{i}") for i in range(5)])
    assert one.destinations == {PRIMARY: 1} and one.destination == PRIMARY
    assert many.primary == 5 and many.backlog == 0
    assert sender.state(q) == "healthy"
    assert sorted(m.message_id for m in drain(primary.connection_string, q, 6)) == ["b0", "b1", "b2", "b3", "b4", "m1"]


def test_busy_waits_the_server_busy_backoff_and_retries_the_primary(
    emulator, make_sender, make_queue, fake_time, secondary_admin, primary, drain
) -> None:
    q = make_queue()
    sender = make_sender()
    emulator.fault("primary", "busy", entity=q)
    fake_time.on_sleep = lambda t: emulator.heal("primary", entity=q) if len(t.sleeps) == 3 else None
    result = sender.send(q, ServiceBusMessage("after-busy", message_id="busy-1"))
    assert fake_time.sleeps == [10.0, 10.0, 10.0]  # server_busy_backoff each time, never the outage backoff
    assert result.destinations == {PRIMARY: 1}
    assert sender.state(q) == "healthy"  # 30 s of busy: no failover although the interval is 10 s
    assert backlog_total(secondary_admin, sender) == 0
    stats = sender.stats()
    assert (stats["busy_waits"], stats["sent_primary"], stats["sent_backlog"], stats["failovers"]) == (3, 1, 0, 0)
    assert [m.message_id for m in drain(primary.connection_string, q, 1)] == ["busy-1"]


@pytest.mark.parametrize("how", ["missing", "notfound-fault"])
def test_entity_not_found_fails_at_once_and_sends_nothing_to_the_backlog(
    emulator, make_sender, make_queue, fake_time, secondary_admin, how
) -> None:
    sender = make_sender(failover_interval="0s")
    if how == "missing":
        q = "no-such-queue"
    else:
        q = make_queue()
        emulator.fault("primary", "notfound", entity=q)
    with pytest.raises(EntityNotFoundError) as info:
        sender.send(q, ServiceBusMessage("lost?"))
    assert q in str(info.value)
    assert fake_time.sleeps == []
    assert sender.state(q) == "healthy"
    assert backlog_total(secondary_admin, sender) == 0


def test_a_rejected_credential_fails_at_once_without_failover(
    emulator, make_sender, make_queue, fake_time, secondary_admin
) -> None:
    q = make_queue()
    sender = make_sender(failover_interval="0s")
    sender.pair()
    emulator.fault("primary", "unauthorized")
    with pytest.raises(CredentialRejectedError) as info:
        sender.send(q, ServiceBusMessage("x"))
    assert "SAS_KEY_VALUE" not in str(info.value)
    assert fake_time.sleeps == [] and sender.state(q) == "healthy"
    assert backlog_total(secondary_admin, sender) == 0


def test_a_wrong_key_is_a_clear_credential_error(make_sender, make_queue, make_config, primary) -> None:
    q = make_queue()
    config = make_config(failover_interval="0s")
    config["primary"]["connection_string"] = primary.connection_string.replace("SAS_KEY_VALUE", "Zm9vYmFyYmF6")
    sender = make_sender(config=config)
    with pytest.raises(CredentialRejectedError) as info:
        sender.send(q, ServiceBusMessage("x"))
    assert "Zm9vYmFyYmF6" not in str(info.value)
    assert sender.state(q) == "healthy"


@pytest.mark.parametrize("kind", ["down", "timeout", "disabled", "quota"])
def test_outages_retry_the_primary_until_the_interval_then_fail_over(
    emulator, make_sender, make_queue, fake_time, secondary_admin, kind
) -> None:
    q = make_queue()
    # failover_interval 10 s, backoff 4 s; a held answer costs the try timeout in real time. It also bounds the
    # secondary's first send, its connection's opening included: 500 ms was too short in a loaded make test
    sender = make_sender(primary_try_timeout="2s")
    sender.pair()
    emulator.fault("primary", kind, entity=None if kind in ("down", "timeout") else q)
    result = sender.send(q, ServiceBusMessage(f"during-{kind}", message_id=kind))
    # attempts at t=0, 4, 8; at t=10 the interval has passed without a success
    assert fake_time.sleeps == [4.0, 4.0, 2.0]
    assert result.primary == 0 and result.backlog == 1
    assert result.destination in sender.backlog_queues
    assert sender.state(q) == "failed_over"
    assert backlog_total(secondary_admin, sender) == 1


def test_no_failover_while_the_interval_runs(emulator, make_sender, make_queue, fake_time, secondary_admin,
                                             primary, drain) -> None:
    q = make_queue()
    sender = make_sender(failover_interval="60s")
    sender.pair()
    emulator.fault("primary", "quota", entity=q)
    states = []

    def heal_late(t) -> None:
        states.append(sender.state(q))
        if t.now - 1000.0 >= 50:
            emulator.heal("primary", entity=q)

    fake_time.on_sleep = heal_late
    result = sender.send(q, ServiceBusMessage("patient", message_id="p1"))
    assert result.destinations == {PRIMARY: 1}  # the caller only saw latency
    assert len(fake_time.sleeps) >= 5 and sum(fake_time.sleeps) < 60
    assert set(states) == {"failing"}
    assert sender.state(q) == "healthy"
    assert backlog_total(secondary_admin, sender) == 0
    assert [m.message_id for m in drain(primary.connection_string, q, 1)] == ["p1"]


def test_failed_over_messages_carry_their_destination_and_restore(
    emulator, make_sender, make_queue, secondary, drain
) -> None:
    q = make_queue()
    sender = make_sender(failover_interval="0s", backlog_queue_count=1)
    emulator.fault("primary", "disabled", entity=q)
    original = ServiceBusMessage(
        b"payload", message_id="fo-1", correlation_id="c-1", subject="s", content_type="text/plain",
        application_properties={"k": "v"}, time_to_live=datetime.timedelta(minutes=5), partition_key="pk",
    )
    result = sender.send(q, original)
    assert result.destination == sender.backlog_queues[0]
    (received,) = drain(secondary.connection_string, sender.backlog_queues[0], 1)
    props = {k.decode() if isinstance(k, bytes) else k: v for k, v in received.application_properties.items()}
    assert props["x-ms-path"] in (q, q.encode())
    assert props["x-ms-timetolive"] == 300_000
    restored = messages.from_backlog(received, datetime.datetime.now(datetime.UTC))
    assert restored.ok and restored.entity == q
    assert restored.message.message_id == "fo-1"
    assert restored.message.partition_key == "pk"
    assert b"".join(restored.message.body) == b"payload"
    assert restored.message.application_properties["k"] == "v"
    assert datetime.timedelta(minutes=4) < restored.message.time_to_live <= datetime.timedelta(minutes=5)


def test_a_failing_backlog_queue_leaves_the_rotation(emulator, make_sender, make_queue, secondary_admin) -> None:
    q = make_queue()
    sender = make_sender(failover_interval="0s", backlog_queue_count=3)
    emulator.fault("primary", "quota", entity=q)
    first = sender.send(q, ServiceBusMessage("1")).destination
    assert sender.send(q, ServiceBusMessage("2")).destination == first  # the entity keeps its queue
    emulator.fault("secondary", "disabled", entity=first)
    second = sender.send(q, ServiceBusMessage("3")).destination
    assert second in sender.backlog_queues and second != first
    assert sender.board.cooling() == [first]
    # every sender of the process learns: another entity never picks the cooling queue
    other = make_queue()
    emulator.fault("primary", "quota", entity=other)
    for i in range(5):
        assert sender.send(other, ServiceBusMessage(f"o{i}")).destination != first
    counts = {name: secondary_admin.get_queue_runtime_properties(name).active_message_count
              for name in sender.backlog_queues}
    assert counts[first] == 2 and sum(counts.values()) == 8


def test_no_backlog_queue_accepting_raises_and_acknowledges_nothing(emulator, make_sender, make_queue) -> None:
    q = make_queue()
    sender = make_sender(failover_interval="0s", backlog_queue_count=2)
    sender.pair()
    emulator.fault("primary", "quota", entity=q)
    for name in sender.backlog_queues:
        emulator.fault("secondary", "quota", entity=name)
    with pytest.raises(BacklogUnavailableError) as info:
        sender.send(q, ServiceBusMessage("nowhere"))
    assert info.value.retryable and set(info.value.tried) == set(sender.backlog_queues)


def test_pings_never_reach_a_receiver_and_failback_follows_the_ping_interval(
    emulator, make_sender, make_queue, fake_time, primary, primary_admin, drain
) -> None:
    q = make_queue()
    sender = make_sender(failover_interval="0s", ping_primary_interval="5s")
    emulator.fault("primary", "quota", entity=q)
    assert sender.send(q, ServiceBusMessage("a")).backlog == 1
    fake_time.advance(5)
    assert sender.send(q, ServiceBusMessage("b")).backlog == 1  # the ping failed: still failed over
    emulator.heal("primary", entity=q)
    fake_time.advance(4)
    assert sender.send(q, ServiceBusMessage("c")).backlog == 1  # healed, but no ping due yet
    fake_time.advance(1)
    result = sender.send(q, ServiceBusMessage("d", message_id="d"))  # ping succeeds, then the send
    assert result.destinations == {PRIMARY: 1}
    assert sender.state(q) == "healthy"
    runtime = primary_admin.get_queue_runtime_properties(q)
    assert (runtime.active_message_count, runtime.scheduled_message_count) == (1, 0)
    assert [m.message_id for m in drain(primary.connection_string, q, 2, wait=1.5)] == ["d"]  # no ping


def test_ping_uses_a_session_id_when_the_entity_requires_sessions(
    emulator, make_sender, make_queue, fake_time, primary_admin
) -> None:
    q = make_queue(requires_session=True)
    sender = make_sender(failover_interval="0s", ping_primary_interval="5s")
    emulator.fault("primary", "disabled", entity=q)
    assert sender.send(q, ServiceBusMessage("a", session_id="s1")).backlog == 1
    emulator.heal("primary", entity=q)
    fake_time.advance(5)
    # s1 has a message parked: its next one follows it (sessions keep their order); s2 has none
    assert sender.send(q, ServiceBusMessage("b", session_id="s2")).primary == 1
    runtime = primary_admin.get_queue_runtime_properties(q)
    assert (runtime.active_message_count, runtime.scheduled_message_count) == (1, 0)


def _fits(message: ServiceBusMessage, limit: int = 262_144) -> bool:
    batch = ServiceBusMessageBatch(max_size_in_bytes=limit, amqp_transport=PyamqpTransport)
    try:
        batch.add_message(message)
    except MessageSizeExceededError:
        return False
    return True


class _FaultAfterPing(PairedSender):
    """Injects a fault right after a successful ping: the next primary send fails."""

    emulator = None

    def ping(self, entity: str) -> None:
        super().ping(entity)
        self.emulator.fault("primary", "quota", entity=entity)


def test_a_failure_right_after_failback_fails_over_at_once(emulator, make_config, make_queue, fake_time) -> None:
    q = make_queue()
    config = make_config(failover_interval="30s", ping_primary_interval="5s")
    with _FaultAfterPing.from_config(config, clock=fake_time.clock, sleep=fake_time.sleep,
                                     ping_wait=fake_time.idle) as sender:
        sender.emulator = emulator
        emulator.fault("primary", "quota", entity=q)
        assert sender.send(q, ServiceBusMessage("a")).backlog == 1  # after the 30 s interval
        emulator.heal("primary", entity=q)
        fake_time.advance(5)
        slept = len(fake_time.sleeps)
        result = sender.send(q, ServiceBusMessage("b"))  # ping ok, then the primary fails again
        assert result.backlog == 1
        assert fake_time.sleeps[slept:] == []  # no new interval
        assert sender.state(q) == "failed_over"


def test_a_message_too_large_is_rejected_naming_it(emulator, make_sender, make_queue, secondary_admin) -> None:
    q = make_queue()
    sender = make_sender(failover_interval="0s")
    big = ServiceBusMessage(b"x" * 300_000, message_id="huge-1")
    with pytest.raises(BadMessageError) as info:
        sender.send(q, [ServiceBusMessage("small"), big])
    assert "huge-1" in str(info.value) and q in str(info.value)
    emulator.fault("primary", "quota", entity=q)
    sender.send(q, ServiceBusMessage("to the backlog"))
    # the largest message a 256 KB batch holds: fits the primary, not once rewritten for the backlog
    low, high = 200_000, 262_144
    while low < high:
        middle = (low + high + 1) // 2
        if _fits(ServiceBusMessage(b"y" * middle, message_id="almost")):
            low = middle
        else:
            high = middle - 1
    almost = ServiceBusMessage(b"y" * low, message_id="almost")
    with pytest.raises(BadMessageError, match="almost") as info:
        sender.send(q, almost)
    assert "backlog" in str(info.value)
    assert backlog_total(secondary_admin, sender) == 1


def test_a_message_without_session_id_for_a_session_entity_is_a_bad_message_not_an_outage(
    make_sender, make_queue, fake_time
) -> None:
    q = make_queue(requires_session=True)
    sender = make_sender()
    with pytest.raises(BadMessageError) as info:
        sender.send(q, ServiceBusMessage("no session", message_id="lonely"))
    assert q in str(info.value)
    assert sender.state(q) == "healthy"  # no failover timer started
    assert fake_time.sleeps == []  # and no retry loop


def test_a_connection_dropped_while_idle_is_reopened_not_failed_over(
    emulator, make_sender, make_queue, fake_time, primary, drain
) -> None:
    q = make_queue()
    sender = make_sender(failover_interval="0s")  # any counted outage would fail over at once
    assert sender.send(q, ServiceBusMessage("before")).destination == PRIMARY
    emulator.fault("primary", "down")  # the namespace drops every connection ...
    emulator.heal("primary")  # ... and is fine again before the next send
    fake_time.advance(60)  # the sender's connection has been idle for a minute
    result = sender.send(q, ServiceBusMessage("after"))
    assert result.destination == PRIMARY
    assert sender.state(q) == "healthy"
    assert fake_time.sleeps == []
    assert sorted(str(m) for m in drain(primary.connection_string, q, 2)) == ["after", "before"]


class _Killed(BaseException):
    """What a killed task looks like to the code it runs through (not an Exception)."""


@pytest.mark.parametrize("how", ["killed", "another-error"])
def test_a_failing_state_left_behind_does_not_make_a_later_send_fail_over_without_trying(
    emulator, make_sender, make_queue, fake_time, secondary_admin, primary, drain, how
) -> None:
    q = make_queue()
    sender = make_sender(failover_interval="60s")
    sender.pair()
    emulator.fault("primary", "quota", entity=q)

    def leave(t) -> None:
        if how == "killed":
            raise _Killed()
        emulator.fault("primary", "notfound", entity=q)  # the next attempt ends the send with another error

    fake_time.on_sleep = leave
    with pytest.raises(_Killed if how == "killed" else EntityNotFoundError):
        sender.send(q, ServiceBusMessage("interrupted"))
    fake_time.on_sleep = None
    emulator.heal("primary", entity=q)
    fake_time.advance(2 * 3600)  # hours later, the primary is fine
    result = sender.send(q, ServiceBusMessage("hours later", message_id="later"))
    assert result.destinations == {PRIMARY: 1}  # tried the primary, no failover
    assert sender.state(q) == "healthy"
    assert backlog_total(secondary_admin, sender) == 0
    assert [m.message_id for m in drain(primary.connection_string, q, 1)] == ["later"]
