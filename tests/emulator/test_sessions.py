"""Sessions through the unmodified azure-servicebus SDK, following the calls of Microsoft's session samples:
a session is free again the moment its receiver closes, a pool of next-available receivers drains every
session of several queues, the session lock covers the messages received in it, session listing."""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from azure.servicebus import (
    NEXT_AVAILABLE_SESSION,
    AutoLockRenewer,
    ServiceBusClient,
    ServiceBusMessage,
)
from azure.servicebus.exceptions import OperationTimeoutError, SessionCannotBeLockedError


def _send(client: ServiceBusClient, queue: str, sessions: dict[str, int]) -> None:
    with client.get_queue_sender(queue) as s:
        for sid, n in sessions.items():
            s.send_messages([ServiceBusMessage(f"{sid}-{i}", session_id=sid) for i in range(n)])


def test_a_session_is_free_again_as_soon_as_its_receiver_closes(client: ServiceBusClient, make_queue) -> None:
    q = make_queue(requires_session=True, lock_duration=60.0)
    _send(client, q, {"S": 4})
    for expected in (["S-0", "S-1"], ["S-2", "S-3"]):
        started = time.monotonic()
        with client.get_queue_receiver(q, session_id="S", max_wait_time=5) as r:
            got = r.receive_messages(max_message_count=2, max_wait_time=3)
            assert [str(m) for m in got] == expected
            for m in got:
                r.complete_message(m)
        # the second receiver gets the session at once, not after the 60 s session lock
        assert time.monotonic() - started < 15


def test_next_available_pool_over_three_queues_gets_every_message(
    client: ServiceBusClient, make_queue: Callable[..., str]
) -> None:
    queues = [make_queue(requires_session=True, lock_duration=60.0) for _ in range(3)]
    expected: set[str] = set()
    for qi, q in enumerate(queues):
        sessions = {f"q{qi}-s{j}": 3 + j for j in range(3)}
        _send(client, q, sessions)
        expected |= {f"{sid}-{i}" for sid, n in sessions.items() for i in range(n)}
    got: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(q: str) -> None:
        # the sample's loop: take the next session, drain it, close, take the next, until none is left
        try:
            while True:
                try:
                    with client.get_queue_receiver(q, session_id=NEXT_AVAILABLE_SESSION, max_wait_time=1) as r:
                        # a few messages per turn, so most sessions are taken again after a receiver closed
                        for m in r.receive_messages(max_message_count=2, max_wait_time=1):
                            r.complete_message(m)
                            with lock:
                                got.append(str(m))
                except OperationTimeoutError:
                    return
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(q,)) for q in queues for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors
    assert sorted(got) == sorted(expected)


def test_the_session_lock_covers_its_messages_while_it_is_renewed(
    emulator_with_clock: Any, fake_clock: Any
) -> None:
    q = emulator_with_clock.make_queue(requires_session=True, lock_duration=30.0)
    # the SDK compares the session's locked-until with the real time: start the emulator's clock no earlier
    # (the session-wide fake clock stood still while other tests ran)
    fake_clock.advance(max(0.0, time.time() - fake_clock()))
    with ServiceBusClient.from_connection_string(emulator_with_clock["clocked"].connection_string) as client:
        _send(client, q, {"R": 2})
        with client.get_queue_receiver(q, session_id="R", max_wait_time=5) as r:
            got = r.receive_messages(max_message_count=2, max_wait_time=3)
            assert len(got) == 2
            for _ in range(4):  # 80 s on the emulator's clock: 2.7 lock durations, the session renewed
                fake_clock.advance(20)
                r.session.renew_lock()
            time.sleep(0.2)  # the emulator's timer runs (it would expire message locks here)
            for m in got:
                r.complete_message(m)  # no MessageLockLostError: the session lock holds them
        with client.get_queue_receiver(q, session_id="R", max_wait_time=2) as r:
            assert r.receive_messages(max_wait_time=1) == []


@pytest.mark.slow
def test_auto_lock_renewer_keeps_a_session_past_its_lock_duration(
    client: ServiceBusClient, make_queue: Callable[..., str]
) -> None:
    q = make_queue(requires_session=True, lock_duration=5.0)
    _send(client, q, {"A": 3})
    renewer = AutoLockRenewer()
    try:
        with client.get_queue_receiver(q, session_id="A", max_wait_time=5, auto_lock_renewer=renewer) as r:
            got = r.receive_messages(max_message_count=3, max_wait_time=3)
            assert len(got) == 3
            time.sleep(8)  # longer than the lock duration; the renewer renews the session at 5 s - 10 s margin
            for m in got:
                r.complete_message(m)
    finally:
        renewer.close()


def test_listing_sessions_without_a_date_returns_every_session_with_messages_or_state(
    client: ServiceBusClient, make_queue: Callable[..., str]
) -> None:
    q = make_queue(requires_session=True)
    _send(client, q, {"x": 1, "y": 1})
    with client.get_queue_receiver(q, session_id="z", max_wait_time=2) as r:
        r.session.set_state(b"state-z")  # a session with state and no message
    # no date: the SDK sends its year-10000 marker, which means "every session with messages or state"
    assert sorted(client.list_queue_sessions(q)) == ["x", "y", "z"]
    # with a date: the sessions whose state was set since
    since = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    assert list(client.list_queue_sessions(q, state_updated_after=since)) == ["z"]
    assert list(client.list_queue_sessions(q, state_updated_after=dt.datetime.now(dt.UTC) + dt.timedelta(hours=1))) == []


def test_messages_left_unsettled_by_a_closed_session_receiver_come_back_at_once(
    client: ServiceBusClient, make_queue: Callable[..., str]
) -> None:
    q = make_queue(requires_session=True, lock_duration=60.0)
    _send(client, q, {"U": 2})
    with client.get_queue_receiver(q, session_id="U", max_wait_time=5) as r:
        first = r.receive_messages(max_message_count=2, max_wait_time=3)
        assert [str(m) for m in first] == ["U-0", "U-1"]  # not settled
    with client.get_queue_receiver(q, session_id="U", max_wait_time=5) as r:
        again = r.receive_messages(max_message_count=2, max_wait_time=3)
        assert [(str(m), m.delivery_count) for m in again] == [("U-0", 1), ("U-1", 1)]
        for m in again:
            r.complete_message(m)


def test_a_locked_session_is_refused_at_open_with_the_services_error(
    client: ServiceBusClient, make_queue: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    q = make_queue(requires_session=True)
    entered = []
    with caplog.at_level(logging.INFO):
        with client.get_queue_receiver(q, session_id="L", max_wait_time=2):
            with pytest.raises(SessionCannotBeLockedError):
                with client.get_queue_receiver(q, session_id="L", max_wait_time=2):
                    entered.append(True)  # the refusal comes at open, not at the first receive
        with pytest.raises(OperationTimeoutError):
            with client.get_queue_receiver(q, session_id=NEXT_AVAILABLE_SESSION, max_wait_time=1):
                entered.append(True)
    assert entered == []
    assert "AttributeError" not in caplog.text
