"""Backlog queue provisioning on the secondary (behaviour.md, "Backlog queue provisioning")."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from azure.servicebus import ServiceBusMessage

from spark_sb.errors import PairingError
from spark_sb.paired import PRIMARY

MAX_DAYS = 10675199  # TimeSpan.MaxValue


def test_creates_the_missing_queues_with_the_backlog_properties_and_touches_nothing_else(
    make_sender, secondary_admin
) -> None:
    sender = make_sender(backlog_queue_count=3)
    prefix = sender.config.send_availability.backlog_prefix
    names = sender.config.send_availability.backlog_queue_names()
    secondary_admin.create_queue(names[1], max_delivery_count=5, lock_duration=timedelta(seconds=30))
    secondary_admin.create_queue(names[2], status="Disabled")
    extra = f"{prefix}/x-servicebus-transfer/7"
    other = f"{prefix}/other"
    secondary_admin.create_queue(extra, max_delivery_count=3)
    secondary_admin.create_queue(other)

    assert sender.pair() == 2
    assert sender.backlog_queues == (names[0], names[1])  # the disabled one is left out, not modified

    created = secondary_admin.get_queue(names[0])
    assert created.max_size_in_megabytes == 5120
    assert created.max_delivery_count == 2147483647
    assert created.default_message_time_to_live.days == MAX_DAYS
    assert created.auto_delete_on_idle.days == MAX_DAYS
    assert created.lock_duration == timedelta(minutes=1)
    assert created.dead_lettering_on_message_expiration is True
    assert created.enable_batched_operations is True
    assert created.requires_session is False
    assert created.requires_duplicate_detection is False

    kept = secondary_admin.get_queue(names[1])
    assert (kept.max_delivery_count, kept.lock_duration) == (5, timedelta(seconds=30))
    assert secondary_admin.get_queue(names[2]).status == "Disabled"
    assert secondary_admin.get_queue(extra).max_delivery_count == 3
    assert secondary_admin.get_queue(other).max_delivery_count == 10

    assert sender.pair() == 2  # again: everything exists, nothing changes


def test_zero_usable_queues_is_a_pairing_error_when_pairing_and_when_the_backlog_is_needed(
        emulator, make_sender, make_queue, fake_time) -> None:
    q = make_queue()
    sender = make_sender(backlog_queue_count=2, provision_retries=3, provision_retry_spacing="2s",
                         failover_interval="0s")
    emulator.fault("secondary", "busy")
    with pytest.raises(PairingError, match="no usable backlog queue"):
        sender.pair()
    # listing and each creation tried 3 times, 2 s apart
    assert fake_time.sleeps == [2.0] * 6
    # a healthy primary never needs the secondary: the sends go on
    assert sender.send(q, ServiceBusMessage("x")).destination == PRIMARY
    emulator.fault("primary", "quota", entity=q)
    with pytest.raises(PairingError, match="no usable backlog queue"):  # the failed-over batch's error
        sender.send(q, ServiceBusMessage("y"))


def test_a_new_sender_sends_to_a_healthy_primary_while_the_secondary_is_unreachable(
        emulator, make_sender, make_queue, primary, drain) -> None:
    """Pairing waits for the backlog to be needed: a new worker's sender (never paired) sends to a healthy primary
    with the secondary down; once the secondary is back, a failover pairs and parks the messages."""
    q = make_queue()
    emulator.fault("secondary", "down")
    try:
        sender = make_sender(failover_interval="0s")
        for i in range(3):
            assert sender.send(q, ServiceBusMessage(f"m{i}", message_id=f"m{i}")).destination == PRIMARY
        assert sender.backlog_queues == ()  # nothing provisioned yet
    finally:
        emulator.heal("secondary")
    assert sorted(str(m) for m in drain(primary.connection_string, q, 3)) == ["m0", "m1", "m2"]
    emulator.fault("primary", "quota", entity=q)
    result = sender.send(q, ServiceBusMessage("parked", message_id="parked"))
    assert result.backlog == 1 and len(sender.backlog_queues) == 2


def test_an_authorisation_failure_aborts_at_once(emulator, make_sender, fake_time) -> None:
    sender = make_sender()
    emulator.fault("secondary", "unauthorized")
    with pytest.raises(PairingError, match="credential rejected") as info:
        sender.pair()
    assert "SAS_KEY_VALUE" not in str(info.value)
    assert fake_time.sleeps == []


def test_an_unreachable_admin_endpoint_is_named_with_the_refused_connection(make_config, make_sender) -> None:
    config = make_config(backlog_queue_count=2, provision_retries=2, provision_retry_spacing="1s")
    config["secondary"]["admin_endpoint"] = "http://localhost:1"  # nothing listens there
    sender = make_sender(config=config)
    with pytest.raises(PairingError) as info:
        sender.pair()
    text = str(info.value)
    assert "http://localhost:1" in text
    assert "connection refused" in text.lower()
    assert "SAS_KEY_VALUE" not in text and "SharedAccessKey=" not in text


def test_sends_in_flight_wait_out_one_pairing_not_one_each(emulator, make_sender, make_queue, monkeypatch) -> None:
    """Sends in flight at once that all need the backlog while the secondary cannot be reached: one pairing
    attempt answers all of them (the chaos bench's row with every backlog queue failing wedged when each of a
    partition's eight sends in flight waited out a pairing of its own, one after the other)."""
    q = make_queue()
    sender = make_sender(failover_interval="0s")
    threads = 4
    arrived: set[int] = set()  # the threads that asked for the backlog queues
    everyone = threading.Condition()
    attempts: list[int] = []
    ensure, provision = sender._ensure_paired, sender._provision

    def counted_ensure(*args: Any) -> tuple[str, ...]:
        with everyone:
            arrived.add(threading.get_ident())
            everyone.notify_all()
        return ensure(*args)

    def held_provision(*args: Any) -> list[str]:
        attempts.append(1)
        if len(attempts) == 1:  # the first attempt answers once every send is waiting for the backlog
            with everyone:
                assert everyone.wait_for(lambda: len(arrived) == threads, timeout=30)
        return provision(*args)

    monkeypatch.setattr(sender, "_ensure_paired", counted_ensure)
    monkeypatch.setattr(sender, "_provision", held_provision)
    emulator.fault("primary", "quota", entity=q)  # refused at once: straight to the backlog (interval 0 s)
    emulator.fault("secondary", "down")
    try:
        with ThreadPoolExecutor(threads) as pool:
            futures = [pool.submit(sender.send, q, ServiceBusMessage(f"m{i}")) for i in range(threads)]
            errors = [f.exception(60) for f in futures]
    finally:
        emulator.heal("secondary")
        emulator.heal("primary")
    assert all(isinstance(e, PairingError) for e in errors), errors
    assert len(attempts) == 1
