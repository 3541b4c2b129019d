"""Fixtures shared by the replication tests: the sender's fake time and configuration, senders closed after
the test, a queue of the same name on both namespaces, what each namespace's broker holds, and the receivers
a module opened (closed at its end)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import pytest
from pairing import pair_config

from spark_sb.emulator.model import QueueSpec
from spark_sb.replication import DedupeReceiver, ReplicatingSender


class SenderTime:
    """The sender's clock and sleep: the clock moves only when the sender sleeps or a test advances it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []
        self.after_sleep: Callable[[int], None] = lambda count: None

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        self.after_sleep(len(self.sleeps))


@pytest.fixture
def time_() -> SenderTime:
    return SenderTime()


@pytest.fixture
def config(primary: Any, secondary: Any) -> Callable[..., dict]:
    """``config(mode)``: both emulator namespaces, replication ``mode``, retry interval 30 s, short SDK
    timeouts (1 s: opening a link here takes about 0.5 s; no SDK retries) so that failures come fast."""

    def make(mode: str) -> dict:
        conf = pair_config(primary, secondary, "rs", primary_try_timeout="1s", primary_retry_total=0)
        conf["replication"] = {"mode": mode, "retry_interval": "30s"}
        return conf

    return make


@pytest.fixture
def make_sender(config: Callable[..., dict], time_: SenderTime) -> Iterator[Callable[..., ReplicatingSender]]:
    """``make_sender(mode or config dict)``: a ReplicatingSender on fake time, closed after the test."""
    with ExitStack() as senders:
        yield lambda conf: senders.enter_context(ReplicatingSender.from_config(
            config(conf) if isinstance(conf, str) else conf, clock=time_.clock, sleep=time_.sleep))


@pytest.fixture
def pair_queue(emulator: Any, make_queue: Callable[..., str]) -> Callable[..., str]:
    """A queue of the same name on both namespaces (``primary_props``: properties of the primary's only)."""

    def make(**primary_props: Any) -> str:
        name = make_queue("primary", **primary_props)
        server = emulator.server("secondary")
        server.call(lambda: server.broker.create_entity(QueueSpec(name=name)))
        return name

    return make


@pytest.fixture
def stored(emulator: Any) -> Callable[[str, str], list[str]]:
    """``stored(namespace, queue)``: the message ids the namespace's broker holds in ``queue``, sorted (read
    from the broker itself: immediate, and true under a fault too)."""

    def ids(namespace: str, queue: str) -> list[str]:
        server = emulator.server(namespace)
        return sorted(str(m.message_id) for m in server.call(lambda: server.broker.peek(queue, 0, 1000)))

    return ids


@pytest.fixture(scope="module")
def to_close() -> Iterator[list[DedupeReceiver]]:
    """The receivers the module opened, closed at its end all at once: closing an SDK receiver waits up to a
    second for its keep-alive thread."""
    opened: list[DedupeReceiver] = []
    yield opened
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(DedupeReceiver.close, opened))
