"""The product through Service Bus's habits (issue 22): every entity link idle longer than a second is detached,
and every entity link every 2.5 seconds, on both namespaces (``amqp:link:detach-forced``, as Service Bus does
after 10 idle minutes and in upgrades). The paired sender, ``DedupeReceiver``, the ``servicebus`` source's
reader and the syphon work in rounds with pauses longer than the idle limit: nothing is lost, nothing is
duplicated, nothing fails over. The Spark jobs (the writer, the syphon job, the ``servicebus`` source through
``dedupe``) run through the same habits, among overlapping faults, in ``bench/soak.py`` (``make soak``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage
from azure.servicebus.exceptions import MessageLockLostError
from pairing import pair_config, peek_all

from spark_sb import messages
from spark_sb.bus import close_all
from spark_sb.config import load_config
from spark_sb.emulator import Emulator, NamespaceOptions
from spark_sb.emulator.model import QueueSpec
from spark_sb.paired import PairedSender
from spark_sb.replication import DedupeReceiver
from spark_sb.replication.dedupe import ReceiveUnavailableError

IDLE, EVERY, PAUSE = 1.0, 2.5, 1.3
#: a receive cut by a detach leaves the rest of its page locked until the lock expires (LOCK): a reader waits.
#: Nearly every management operation (peek, settle by sequence number) meets a detached $management link and is
#: tried again after a backoff, so a round takes seconds: the syphon's 40 messages took 82 s in 10-message
#: batches; a loaded machine gets DEADLINE (a quiet one breaks out as soon as everything is home)
LOCK, DEADLINE = 10.0, 240.0
QUEUES = ["h-dd", "h-rep", "h-src", "h-home"]
#: the guarantee is at least once (a send whose acknowledgement a detach cut off is sent again): "nothing
#: duplicated" holds where the entity detects duplicates, as the issue and behaviour.md say
DEDUPLICATED = {"h-dd", "h-home"}


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    habits = {"idle_detach": IDLE, "detach_every": EVERY}
    emu = Emulator([NamespaceOptions("primary", **habits), NamespaceOptions("secondary", **habits)],
                   data_dir=tmp_path_factory.mktemp("habits"),
                   entities={"queues": [{"name": q, "requires_duplicate_detection": q in DEDUPLICATED,
                                              "lock_duration": LOCK} for q in QUEUES]})
    with emu:
        yield emu


@pytest.fixture
def config(primary: Any, secondary: Any) -> Iterator[dict]:
    yield pair_config(primary, secondary, "habits", backlog_queue_count=2, failover_interval="10s",
                      primary_try_timeout="5s")
    close_all()


def _detached(emu: Emulator) -> int:
    total = 0
    for name in ("primary", "secondary"):
        server = emu.server(name)
        total += server.call(lambda server=server: sum(server.detached.values()))
    return total


def _held(info: Any, queue: str) -> list[str]:
    """The ids ``queue`` holds, in any state, by peeking, pings left out (the syphon pings a destination before
    it sends there; every reader drops them): nothing is taken. A receive and delete would lose what a detach
    cuts off between the broker's transfer and the SDK's return (the service does the same: that mode is at most
    once), so the tests never count with it. A peek cut by a detach is repeated."""
    return [str(m.message_id) for m in peek_all(info.connection_string, queue, retry_total=3, tries=5) if not messages.is_ping(m)]


def _send(info: Any, queue: str, ids: list[str], make: Any = lambda m: m) -> None:
    with ServiceBusClient.from_connection_string(info.connection_string) as client, \
            client.get_queue_sender(queue) as sender:
        sender.send_messages([make(ServiceBusMessage(i, message_id=i)) for i in ids])


def test_the_paired_sender_sends_every_message_to_the_primary_once(emulator, config, primary) -> None:
    before = _detached(emulator)
    sent: list[str] = []
    with PairedSender.from_config(config) as sender:
        for round_ in range(4):
            ids = [f"p{round_}-{i}" for i in range(25)]
            result = sender.send("h-dd", [ServiceBusMessage(i, message_id=i) for i in ids])
            assert dict(result.destinations) == {"primary": 25}  # a detach is no outage: nothing failed over
            sent += ids
            time.sleep(PAUSE)
    assert sorted(_held(primary, "h-dd")) == sorted(sent)
    assert _detached(emulator) - before >= 2


def test_dedupe_receiver_gives_each_id_once_and_completes_both_copies(emulator, config, primary, secondary) -> None:
    ids = [f"r-{i}" for i in range(30)]
    for info in (primary, secondary):
        _send(info, "h-rep", ids)
    before = _detached(emulator)
    got: list[str] = []
    lock_lost = unavailable = 0
    deadline = time.monotonic() + DEADLINE
    with DedupeReceiver.from_config(config, "h-rep") as receiver:
        while time.monotonic() < deadline:
            try:
                page = receiver.receive_messages(max_message_count=10, max_wait_time=0.5)
            except ReceiveUnavailableError:  # both namespaces detached twice in one call: repeat it (the contract)
                unavailable += 1
                continue
            for message in page:
                got.append(str(message.message_id))
                try:
                    receiver.complete_message(message)
                except MessageLockLostError:  # its link was detached: the id is recorded, the redelivery dropped
                    lock_lost += 1
            # every id returned is not enough: the other copy of the last ids may not have been received yet (a
            # detach cut that namespace's receive), and a later call drops it
            if not page and len(set(got)) == len(ids) and _detached(emulator) - before >= 2 \
                    and _held(primary, "h-rep") == _held(secondary, "h-rep") == []:
                break
            time.sleep(PAUSE)
    assert sorted(got) == sorted(ids)
    assert unavailable < 5  # each detach alone is retried within the call
    assert _held(primary, "h-rep") == [] and _held(secondary, "h-rep") == []  # every copy completed
    assert _detached(emulator) - before >= 2


def _read_limit(rows: int) -> Any:
    from pyspark.sql.streaming.datasource import ReadMaxRows

    return ReadMaxRows(rows)


def test_the_servicebus_source_reads_every_message_once(emulator, config, primary) -> None:
    from spark_sb.source import SERVICEBUS_SCHEMA, ServiceBusStreamReader, config_options

    ids = [f"s-{i}" for i in range(40)]
    _send(primary, "h-src", ids)
    before = _detached(emulator)
    reader = ServiceBusStreamReader({**config_options(config), "entity": "h-src", "receiveTimeout": "0.5",
                                     "reportBacklogDepth": "false"})
    got: list[str] = []
    start = reader.initialOffset()
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        end = reader.latestOffset(start, _read_limit(10))
        got += [dict(zip(SERVICEBUS_SCHEMA.names, row, strict=True))["message_id"]
                for partition in reader.partitions(start, end) for row in reader.read(partition)]
        reader.commit(end)
        start = end
        if len(got) >= len(ids) and _detached(emulator) - before >= 2:
            break
        time.sleep(PAUSE)
    reader.latestOffset(start, _read_limit(10))  # completes the last batch (as Spark's next trigger does)
    reader.stop()
    assert sorted(got) == sorted(ids)
    assert _held(primary, "h-src") == []  # every message completed, none left deferred
    assert _detached(emulator) - before >= 2


def test_the_syphon_moves_every_parked_message_home_once(emulator, config, primary, secondary) -> None:
    from spark_sb.source import SCHEMA, BacklogStreamReader, config_options
    from spark_sb.syphon import republish_received, settle_outcomes

    queues = load_config(config).send_availability.backlog_queue_names()
    server = emulator.server("secondary")
    for queue in queues:  # as pairing creates them, with a short lock (a page cut by a detach waits for it)
        spec = QueueSpec(name=queue, max_delivery_count=2147483647, lock_duration=LOCK)
        server.call(lambda spec=spec: server.broker.create_entity(spec))
    with PairedSender.from_config(config) as sender:
        assert sender.pair() == len(queues)
    ids = [f"b-{i}" for i in range(40)]
    for n, queue in enumerate(queues):
        _send(secondary, queue, ids[n::len(queues)], lambda m: messages.to_backlog(m, "h-home"))
    before = _detached(emulator)
    reader = BacklogStreamReader({**config_options(config), "receiveTimeout": "0.5", "reportBacklogDepth": "false"})
    delivered: list[str] = []
    start = reader.initialOffset()
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        end = reader.latestOffset(start, _read_limit(20))
        received: dict[str, list[Any]] = {}
        for partition in reader.partitions(start, end):
            for row in reader.read(partition):
                values = dict(zip(SCHEMA.names, row, strict=True))
                received.setdefault(values["backlog_queue"], []).append(
                    messages.from_received_bytes(values["backlog_message"]))
        outcomes = republish_received(load_config(config), received) if received else []
        settle_outcomes(load_config(config), outcomes)
        delivered += [o.message_id for o in outcomes if o.outcome == "delivered"]
        reader.commit(end)
        start = end
        if len(delivered) >= len(ids) and _detached(emulator) - before >= 2:
            break
        time.sleep(PAUSE)
    reader.stop()
    assert sorted(delivered) == sorted(ids)
    assert sorted(_held(primary, "h-home")) == sorted(ids)  # each home once
    for queue in queues:
        assert _held(secondary, queue) == []  # nothing left parked or deferred
    assert _detached(emulator) - before >= 2
