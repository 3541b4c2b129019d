"""Fixtures for the paired sender: a config over the two emulator namespaces with a unique backlog prefix,
fake time, and helpers that count what reached the primary and the backlog queues."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusReceiveMode
from pairing import pair_config

from spark_sb.admin import admin_client
from spark_sb.paired import ConstantBackoff, PairedSender


class FakeTime:
    """A clock that only moves when the sender sleeps (or a test advances it); records every sleep and runs
    ``on_sleep(fake_time)`` after each one."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []
        self.on_sleep: Callable[[FakeTime], None] | None = None

    def clock(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        if self.on_sleep is not None:
            self.on_sleep(self)

    def wait(self, stop: threading.Event, seconds: float) -> None:
        """The ping task's wait on this clock: returns when ``stop`` is set or the clock has moved ``seconds``
        (checked every 5 ms of real time)."""
        deadline = self.now + seconds
        while not stop.is_set() and self.now < deadline:
            stop.wait(0.005)

    @staticmethod
    def idle(stop: threading.Event, seconds: float) -> None:
        """A ping task's wait that only close() ends: the test drives the rounds (``run_pings_once``)."""
        stop.wait()


@pytest.fixture
def fake_time() -> FakeTime:
    return FakeTime()


def config_dict(primary: Any, secondary: Any, prefix: str | None = None, **send_availability: Any) -> dict:
    # a try timeout long enough for a loaded machine: at 500 ms the first operation after a heal (a new
    # connection, a link, a ping scheduled and cancelled) timed out now and then, and a test saw its entity stay
    # failed over; tests of the timeout itself set their own
    defaults = {"backlog_queue_count": 2, "failover_interval": "10s", "ping_primary_interval": "5s",
                "primary_try_timeout": "3s", "backlog_cooldown": "30s"}
    return pair_config(primary, secondary, "pt", prefix=prefix, **{**defaults, **send_availability})


@pytest.fixture
def make_config(primary: Any, secondary: Any) -> Callable[..., dict]:
    def make(**send_availability: Any) -> dict:
        return config_dict(primary, secondary, **send_availability)

    return make


@pytest.fixture
def make_sender(make_config: Callable[..., dict], fake_time: FakeTime) -> Iterator[Callable[..., PairedSender]]:
    """A PairedSender on fake time (backoff 4 s between primary attempts unless given); its pairing's ping task
    only pings when the test calls ``run_pings_once`` (``ping_wait=fake_time.wait`` lets it follow the fake
    clock); closed after the test."""
    made: list[PairedSender] = []

    def make(backoff: Any = None, config: dict | None = None, ping_wait: Any = None,
             **send_availability: Any) -> PairedSender:
        sender = PairedSender.from_config(
            config or make_config(**send_availability), clock=fake_time.clock, sleep=fake_time.sleep,
            backoff=backoff or ConstantBackoff(4.0), ping_wait=ping_wait or fake_time.idle,
        )
        made.append(sender)
        return sender

    yield make
    for sender in made:
        sender.close()


@pytest.fixture
def secondary_admin(secondary: Any) -> Iterator[Any]:
    client = admin_client(secondary.connection_string, admin_endpoint=secondary.admin_url)
    yield client
    client.close()


@pytest.fixture
def primary_admin(primary: Any) -> Iterator[Any]:
    client = admin_client(primary.connection_string, admin_endpoint=primary.admin_url)
    yield client
    client.close()


def _drain(connection_string: str, queue: str, expected: int, *, wait: float = 5.0) -> list:
    """Receive (and delete) until ``expected`` messages arrived or ``wait`` seconds passed."""
    received: list = []
    with ServiceBusClient.from_connection_string(connection_string, retry_total=0) as client:
        kwargs: dict[str, Any] = {"receive_mode": ServiceBusReceiveMode.RECEIVE_AND_DELETE}
        with client.get_queue_receiver(queue, **kwargs) as receiver:
            deadline = time.monotonic() + wait
            while len(received) < expected and time.monotonic() < deadline:
                received.extend(receiver.receive_messages(max_message_count=100, max_wait_time=0.5))
    return received


@pytest.fixture
def drain() -> Callable[..., list]:
    """``drain(connection_string, queue, expected, wait=5.0)``: receive-and-delete up to ``expected``."""
    return _drain
