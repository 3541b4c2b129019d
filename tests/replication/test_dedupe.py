"""The de-duplicating receiver against the emulator pair, with the real SDK: each id returned once and every
copy completed, a window that survives a restart and forgets what is older than it, copies held while their
id is in flight, one namespace down, pings, a topic subscription, and clear errors."""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage
from azure.servicebus.amqp import AmqpAnnotatedMessage
from pairing import pair_config

from spark_sb import bus
from spark_sb.config import SparkSbConfig, load_config
from spark_sb.emulator import Emulator
from spark_sb.emulator.model import QueueSpec, SubscriptionSpec, TopicSpec
from spark_sb.errors import ConfigError, EntityNotFoundError, ReplicationError
from spark_sb.messages import PING_CONTENT_TYPE
from spark_sb.replication import DedupeReceiver
from spark_sb.replication.dedupe import ReceiveUnavailableError

SIDES = ("primary", "secondary")


@pytest.fixture
def config(primary: Any, secondary: Any) -> SparkSbConfig:
    return load_config(pair_config(primary, secondary, "dedupe"))


@pytest.fixture
def on_both(emulator: Emulator) -> Callable[..., str]:
    """Create the same entity on both namespaces: a queue, or a topic with a subscription ``sub`` when
    ``topic``; returns the path to receive from."""

    def make(*, topic: bool = False) -> str:
        name = f"dd-{uuid.uuid4().hex[:10]}"
        specs: list[Any] = [TopicSpec(name=name), SubscriptionSpec(topic=name, name="sub")] if topic else [
            QueueSpec(name=name)]
        for side in SIDES:
            server = emulator.server(side)
            for spec in specs:
                server.call(lambda server=server, spec=spec: server.broker.create_entity(spec))
        return f"{name}/subscriptions/sub" if topic else name

    return make


@pytest.fixture
def open_receiver(config: SparkSbConfig, to_close: list[DedupeReceiver]) -> Callable[..., DedupeReceiver]:
    def open_(entity: str, **kwargs: Any) -> DedupeReceiver:
        to_close.append(DedupeReceiver.from_config(config, entity, **kwargs))
        return to_close[-1]

    return open_


class Pair:
    """The SDK on both namespaces for a test: one client a namespace and a sender per entity (without the
    SDK's keep-alive, which makes a close wait a second), and the admin API for what an entity holds."""

    def __init__(self, config: SparkSbConfig) -> None:
        self._config = config
        self._clients = {side: ServiceBusClient.from_connection_string(
            getattr(config, side).connection_string.reveal(), retry_total=0) for side in SIDES}
        self._senders: dict[tuple[str, str], Any] = {}

    def send(self, side: str, entity: str, ids: Sequence[str | None], **kwargs: Any) -> None:
        """A message per id (``None``: without a message id) to ``entity`` (a queue, or the topic of a
        ``topic/subscriptions/name`` path) on ``side``, or on both (``side="both"``, at once)."""
        if side == "both":
            with ThreadPoolExecutor(max_workers=2) as pool:
                list(pool.map(lambda one: self.send(one, entity, ids, **kwargs), SIDES))
            return
        target = entity.split("/subscriptions/")[0]
        sender = self._senders.get((side, target))
        if sender is None:
            sender = self._senders[side, target] = self._clients[side].get_queue_sender(target, keep_alive=0)
        sender.send_messages([  # the SDK gives a ServiceBusMessage an id when it has none: send AMQP for none
            AmqpAnnotatedMessage(data_body=[b"no id"]) if mid is None else
            ServiceBusMessage(f"body of {mid}", message_id=mid, **kwargs) for mid in ids])

    def left(self, entity: str) -> tuple[int, int]:
        """How many messages ``entity`` still holds (locked or not) on the primary and on the secondary."""
        counts = []
        for side in SIDES:
            with bus.admin_client(getattr(self._config, side)) as admin:
                topic, _, subscription = entity.partition("/subscriptions/")
                properties = (admin.get_subscription_runtime_properties(topic, subscription) if subscription
                              else admin.get_queue_runtime_properties(entity))
                counts.append(properties.total_message_count)
        return counts[0], counts[1]

    def close(self) -> None:
        for handle in [*self._senders.values(), *self._clients.values()]:
            handle.close()


@pytest.fixture
def pair(config: SparkSbConfig) -> Iterator[Pair]:
    both = Pair(config)
    yield both
    both.close()


def receive(receiver: DedupeReceiver, count: int, timeout: float = 10.0) -> list[Any]:
    """Receive until ``count`` messages came back (or ``timeout``)."""
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        got.extend(receiver.receive_messages(max_message_count=50, max_wait_time=0.25))
    return got


def complete(receiver: DedupeReceiver, messages: Sequence[Any]) -> None:
    for message in messages:
        receiver.complete_message(message)


def sas_key(namespace: Any) -> str:
    match = re.search(r"SharedAccessKey=([^;]+)", namespace.connection_string)
    assert match
    return match.group(1)


def test_each_id_is_returned_once_and_every_copy_ends_completed(open_receiver, on_both, pair) -> None:
    q = on_both()
    ids = [f"order-{i}" for i in range(6)]
    pair.send("both", q, ids)
    receiver = open_receiver(q)
    got = receive(receiver, len(ids))
    assert sorted(m.message_id for m in got) == ids
    complete(receiver, got)
    assert receiver.receive_messages(max_message_count=50, max_wait_time=0.5) == []
    stats = receiver.stats()
    assert (stats.returned, stats.duplicates_dropped, stats.held, stats.in_flight) == (6, 6, 0, 0)
    assert stats.received == {"primary": 6, "secondary": 6}
    assert pair.left(q) == (0, 0)


def test_a_restart_remembers_the_completed_ids(config, open_receiver, on_both, pair, tmp_path) -> None:
    q = on_both()
    ids = ["a", "b", "c"]
    state = tmp_path / "window.sqlite"
    pair.send("primary", q, ids)
    with DedupeReceiver.from_config(config, q, state_path=state) as first:
        complete(first, receive(first, 3))
    pair.send("secondary", q, ids)  # the late copies, arriving after the restart
    with DedupeReceiver.from_config(config, q, state_path=state) as restarted:  # closed: its idle links let go
        assert restarted.receive_messages(max_message_count=10, max_wait_time=0.5) == []
        assert restarted.stats().duplicates_dropped == 3
    assert pair.left(q)[1] == 0
    # an in-memory window forgets on restart: the same copies again are returned
    pair.send("secondary", q, ids)
    forgetful = open_receiver(q)
    assert sorted(m.message_id for m in receive(forgetful, 3)) == ids


def test_the_window_forgets_ids_older_than_it_and_stays_bounded(open_receiver, on_both, pair) -> None:
    q = on_both()
    now = [1_000_000.0]
    receiver = open_receiver(q, window="1m", clock=lambda: now[0])
    old = [f"old-{i}" for i in range(10)]
    pair.send("primary", q, old)
    complete(receiver, receive(receiver, 10))
    assert receiver.stats().window == 10
    now[0] += 30  # inside the window: a late copy is dropped
    pair.send("secondary", q, ["old-1"])
    assert receiver.receive_messages(max_message_count=10, max_wait_time=0.5) == []
    now[0] += 31  # past it: forgotten at once (lookups ignore it), before any pruning
    pair.send("secondary", q, ["old-0"])
    again = receive(receiver, 1)
    assert [m.message_id for m in again] == ["old-0"]
    assert receiver.stats().window == 10
    complete(receiver, again)  # the completion prunes: only old-0, recorded again now, is left
    assert receiver.stats().window == 1
    pair.send("primary", q, [f"new-{i}" for i in range(5)])  # ids keep coming, time keeps moving
    complete(receiver, receive(receiver, 5))
    assert receiver.stats().window == 6
    now[0] += 61
    pair.send("primary", q, ["last"])
    complete(receiver, receive(receiver, 1))
    assert receiver.stats().window == 1  # one window of ids, however many came before
    assert (receiver.stats().duplicates_dropped, receiver.stats().returned) == (1, 17)
    assert pair.left(q) == (0, 0)


def test_a_copy_of_an_id_in_flight_is_held_until_it_is_settled(open_receiver, on_both, pair) -> None:
    q = on_both()
    pair.send("both", q, ["x", "y"])
    receiver = open_receiver(q)
    x, y = sorted(receive(receiver, 2), key=lambda m: m.message_id)
    assert (x.message_id, y.message_id) == ("x", "y")
    assert receiver.receive_messages(max_message_count=10, max_wait_time=0.5) == []  # the copies are held
    stats = receiver.stats()
    assert (stats.held, stats.in_flight, stats.received) == (2, 2, {"primary": 2, "secondary": 2})
    assert pair.left(q) == (2, 2)  # held, not settled
    receiver.complete_message(x)  # its copy is completed with it
    assert (receiver.stats().held, receiver.stats().duplicates_dropped) == (1, 1)
    receiver.abandon_message(y)  # its copy (or its redelivery) is returned next
    [y_again] = receive(receiver, 1)
    assert y_again.message_id == "y"
    receiver.complete_message(y_again)
    assert receiver.receive_messages(max_message_count=10, max_wait_time=0.5) == []  # the last copy: dropped
    assert (receiver.stats().returned, receiver.stats().duplicates_dropped) == (3, 2)
    assert pair.left(q) == (0, 0)
    with pytest.raises(ValueError, match="settled already"):
        receiver.namespace_of(y_again)


def test_max_message_count_bounds_a_call_and_the_rest_comes_next_at_once(open_receiver, on_both, pair) -> None:
    q = on_both()
    pair.send("primary", q, ["m1", "m2"])
    pair.send("secondary", q, ["m3", "m4"])
    receiver = open_receiver(q)
    first = receiver.receive_messages(max_message_count=2, max_wait_time=5)
    assert len(first) == 2 and receiver.stats().held == 2  # both namespaces gave two: two are kept, locked
    started = time.monotonic()
    rest = receiver.receive_messages(max_message_count=2, max_wait_time=5)
    assert time.monotonic() - started < 0.5
    assert sorted(m.message_id for m in first + rest) == ["m1", "m2", "m3", "m4"]
    complete(receiver, first + rest)
    assert pair.left(q) == (0, 0)


def test_links_the_service_detached_are_opened_again_within_the_call(emulator, open_receiver, on_both,
                                                                     pair) -> None:
    """Service Bus detaches a link idle for 10 minutes, and any link in an upgrade (amqp:link:detach-forced): the
    next receive on it fails. The call tries each namespace once more on a new link instead of raising."""
    q = on_both()
    pair.send("both", q, ["x1"])
    receiver = open_receiver(q)
    # one message each: no credit is left on the links, which would lock x2 to a link about to be detached
    complete(receiver, receiver.receive_messages(max_message_count=1, max_wait_time=5))
    pair.send("both", q, ["x2"])
    for side in SIDES:
        server = emulator.server(side)
        assert server.call(lambda server=server: server.detach_links(q)) >= 1  # the receiver's (and a sender's)
    got = receiver.receive_messages(max_message_count=5, max_wait_time=5)  # raised ReceiveUnavailableError before
    assert [m.message_id for m in got] == ["x2"]
    complete(receiver, got)
    assert receive(receiver, 1, timeout=1) == [] and pair.left(q) == (0, 0)  # the copy dropped, both completed


def test_one_namespace_down_leaves_the_other_received(emulator, open_receiver, on_both, pair, primary,
                                                      secondary, caplog) -> None:
    q = on_both()
    ids = ["a", "b", "c"]
    pair.send("both", q, ids)
    receiver = open_receiver(q)
    emulator.fault("primary", "down")
    # a namespace's first failure in a call is logged at INFO and tried once more (a detached link); the second
    # is a WARNING
    with caplog.at_level(logging.INFO, logger="spark_sb.replication.dedupe"):
        got = receive(receiver, 3)
    assert sorted(m.message_id for m in got) == ids
    assert {receiver.namespace_of(m) for m in got} == {"secondary"}
    assert "the primary namespace failed" in caplog.text and sas_key(primary) not in caplog.text
    complete(receiver, got)
    emulator.heal("primary")
    assert receiver.receive_messages(max_message_count=10, max_wait_time=0.5) == []  # rebuilt; copies dropped
    assert receiver.stats().duplicates_dropped == 3
    assert pair.left(q) == (0, 0)


def test_both_namespaces_down_is_a_clear_error_and_receiving_resumes_after(emulator, open_receiver, on_both,
                                                                           pair, primary, secondary) -> None:
    q = on_both()
    receiver = open_receiver(q)
    emulator.fault("primary", "down")
    emulator.fault("secondary", "down")
    with pytest.raises(ReceiveUnavailableError, match=r"on the primary and secondary namespaces") as caught:
        receiver.receive_messages(max_wait_time=1)
    assert isinstance(caught.value, ReplicationError) and caught.value.retryable
    assert set(caught.value.errors) == {"primary", "secondary"}
    assert sas_key(primary) not in str(caught.value) and sas_key(secondary) not in str(caught.value)
    emulator.heal("primary")
    emulator.heal("secondary")
    pair.send("secondary", q, ["after"])
    [after] = receive(receiver, 1)
    assert after.message_id == "after"
    receiver.complete_message(after)


def test_pings_are_never_returned_and_messages_sent_without_an_id_are_returned_as_they_are(open_receiver, on_both,
                                                                                           pair) -> None:
    q = on_both()
    pair.send("primary", q, ["ping-1"], content_type=PING_CONTENT_TYPE)
    pair.send("primary", q, ["real", None])
    pair.send("secondary", q, [None])
    receiver = open_receiver(q)
    got = receive(receiver, 3)
    # no ping; a message sent without an id gets one from each namespace (as Service Bus gives it), so the two
    # copies differ and both are returned: nothing tells them apart
    generated = [m for m in got if m.message_id != "real"]
    assert len(got) == 3 and len(generated) == 2
    assert len({m.message_id for m in generated}) == 2 and all(re.fullmatch(r"[0-9a-f]{32}", str(m.message_id))
                                                               for m in generated)
    assert sorted(receiver.namespace_of(m) for m in generated) == ["primary", "secondary"]
    complete(receiver, got)
    stats = receiver.stats()
    assert (stats.pings, stats.returned) == (1, 3)
    assert pair.left(q) == (0, 0)


def test_a_topic_subscription_is_read_on_both_namespaces(open_receiver, on_both, pair) -> None:
    subscription = on_both(topic=True)
    ids = ["t1", "t2"]
    pair.send("both", subscription, ids)
    receiver = open_receiver(subscription)
    got = receive(receiver, 2)
    assert sorted(m.message_id for m in got) == ids
    complete(receiver, got)
    assert receiver.receive_messages(max_message_count=10, max_wait_time=0.5) == []
    assert pair.left(subscription) == (0, 0)


@pytest.mark.parametrize(("entity", "kwargs", "expected"), [
    ("q", {"namespaces": ("primary", "tertiary")}, "namespaces: unknown namespace .*, got 'tertiary'"),
    ("q", {"namespaces": ()}, "namespaces: must name at least one"),
    ("q", {"namespaces": "primary"}, "namespaces: must be a sequence"),
    ("", {}, "entity: must name a queue or a subscription"),
    ("t/subscriptions/", {}, "entity: must name a queue or a subscription"),
    ("q", {"window": "0s"}, "window: must be longer than 0 s, got 0 s"),
    ("q", {"window": -60}, "window: must be longer than 0 s, got -1 min"),
    ("q", {"window": "ten minutes"}, "window: not a duration .*, got 'ten minutes'"),
])
def test_bad_arguments_name_the_argument_and_the_value(config, entity, kwargs, expected) -> None:
    with pytest.raises(ConfigError, match=expected):
        DedupeReceiver.from_config(config, entity, **kwargs)


def test_a_state_path_that_is_not_a_window_is_named(config, tmp_path) -> None:
    not_a_database = tmp_path / "notes.txt"
    not_a_database.write_text("not SQLite at all, " * 100)
    with pytest.raises(ConfigError, match=r"state_path: cannot hold the de-duplication window .*notes\.txt"):
        DedupeReceiver.from_config(config, "q", state_path=not_a_database)


def test_bad_receive_arguments_and_a_closed_receiver(open_receiver, on_both, primary) -> None:
    receiver = open_receiver(on_both(), window="10 minutes")
    assert sas_key(primary) not in repr(receiver) and "window='10 min'" in repr(receiver)
    with pytest.raises(ConfigError, match="max_message_count: must be a whole number of 1 or more, got 0"):
        receiver.receive_messages(max_message_count=0)
    with pytest.raises(ConfigError, match="max_wait_time: must be more than 0 seconds"):
        receiver.receive_messages(max_wait_time=0)
    receiver.close()
    receiver.close()  # idempotent
    with pytest.raises(RuntimeError, match="is closed"):
        receiver.receive_messages(max_wait_time=0.1)


def test_an_entity_missing_on_one_namespace_is_a_configuration_error(open_receiver, make_queue) -> None:
    q = make_queue()  # on the primary only
    receiver = open_receiver(q)
    with pytest.raises(EntityNotFoundError, match=f"{q}.*secondary"):
        receiver.receive_messages(max_wait_time=1)
