"""The sources' receives in flight (option ``receivesInFlight``) against a far namespace: deferring costs a round
trip per message, so a batch is received on several lanes at once (a thread each, with its own receivers: one
per entity, two for an entity read alone), and every message still lands in the batch once. Not timed: the overlap is proven by the receives themselves (two
lanes meet at a barrier), the guarantees by what the batch and the entity hold."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage

from spark_sb.emulator import Emulator, NamespaceOptions
from spark_sb.source import SERVICEBUS_SCHEMA, ServiceBusStreamReader, config_options

from .conftest import read_limit

QUEUE = "lanes-q"


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    emu = Emulator([NamespaceOptions("primary", latency=0.01), NamespaceOptions("secondary")],
                   data_dir=tmp_path_factory.mktemp("lanes"), entities={"queues": [{"name": QUEUE}]})
    with emu:
        yield emu


def _send(info: Any, n: int, tag: str) -> list[str]:
    ids = [f"{tag}-{i}" for i in range(n)]
    with ServiceBusClient.from_connection_string(info.connection_string) as client, \
            client.get_queue_sender(QUEUE) as sender:
        sender.send_messages([ServiceBusMessage(i, message_id=i) for i in ids])
    return ids


def _watched(reader: ServiceBusStreamReader, meet: int, wait: float) -> tuple[list[int], threading.Barrier]:
    """Record the lane of each receive of ``reader``; the first ``meet`` receives wait for each other at a
    barrier (broken after ``wait`` seconds): it is passed only if that many lanes receive at once."""
    lanes: list[int] = []
    barrier = threading.Barrier(meet, timeout=wait)
    defer_entity = reader._defer_entity

    def watched(entity: Any, cap: Any, found: Any, lane: int = 0) -> int:
        lanes.append(lane)
        if len(lanes) <= meet:
            try:
                barrier.wait()
            except threading.BrokenBarrierError:
                pass
        return defer_entity(entity, cap, found, lane)

    reader._defer_entity = watched  # type: ignore[method-assign]
    return lanes, barrier


def _batch(reader: ServiceBusStreamReader, n: int) -> tuple[dict, list[dict]]:
    start = reader.initialOffset()
    end = reader.latestOffset(start, read_limit(n))
    rows = [dict(zip(SERVICEBUS_SCHEMA.names, row, strict=True))
            for partition in reader.partitions(start, end) for row in reader.read(partition)]
    return end, rows


def _read_watched(conf: dict, n: int, in_flight: int, wait: float) -> tuple[dict, list[dict], list[int], bool]:
    """One batch of up to ``n`` through a reader with ``receivesInFlight: in_flight``, watched (:func:`_watched`):
    the batch's end offset, its rows, the lanes used and whether two receives met at the barrier."""
    reader = ServiceBusStreamReader({**config_options(conf), "entity": QUEUE, "receiveTimeout": "2",
                                     "receivesInFlight": str(in_flight)})
    lanes, barrier = _watched(reader, 2, wait)
    end, rows = _batch(reader, n)
    reader.commit(end)
    reader.stop()
    return end, rows, lanes, not barrier.broken


def test_a_queue_read_alone_is_received_on_two_lanes_at_once_and_every_message_lands_once(conf, primary) -> None:
    ids = _send(primary, 300, "many")
    end, rows, lanes, met = _read_watched(conf, 300, 4, 30)
    assert met, "two lanes never received at the same time"
    assert set(lanes) == {1, 2}  # the reader's own lane (0) is left to its sweeps and completions
    assert sorted(r["message_id"] for r in rows) == sorted(ids)  # each once
    numbers = end["entities"][f"primary:{QUEUE}"]
    assert len(numbers) == len(set(numbers)) == 300
    with ServiceBusClient.from_connection_string(primary.connection_string) as client, \
            client.get_queue_receiver(QUEUE) as receiver:
        assert receiver.peek_messages(max_message_count=10) == []  # completed, nothing left deferred


def test_one_receive_in_flight_receives_on_one_lane(conf, primary) -> None:
    ids = _send(primary, 50, "one")
    _, rows, lanes, met = _read_watched(conf, 50, 1, 1)
    assert set(lanes) == {1} and not met  # no second receive ran beside the first
    assert sorted(r["message_id"] for r in rows) == sorted(ids)
