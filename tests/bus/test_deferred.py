"""Completing deferred messages by sequence number, on the emulator with the real SDK."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage
from pairing import pair_config

from spark_sb import bus
from spark_sb.bus.deferred import complete_deferred
from spark_sb.config import load_config


@pytest.fixture
def namespace(primary: Any, secondary: Any) -> Iterator[bus.Namespace]:
    handles = bus.Namespace("primary", load_config(pair_config(primary, secondary, "dfr")).primary, {"retry_total": 0})
    yield handles
    handles.close()


@pytest.mark.parametrize("bulk_first", [True, False], ids=["bulk-first", "peek-first"])
def test_only_what_is_still_deferred_is_completed_and_a_locked_one_is_left(
        namespace: Any, primary: Any, make_queue: Any, bulk_first: bool) -> None:
    queue = make_queue()
    with ServiceBusClient.from_connection_string(primary.connection_string, retry_total=0) as client:
        with client.get_queue_sender(queue) as sender:
            sender.send_messages([ServiceBusMessage(f"m{i}", message_id=f"m{i}") for i in range(600)])
        with client.get_queue_receiver(queue, prefetch_count=0) as receiver:
            received = []
            while len(received) < 600:
                received += receiver.receive_messages(max_message_count=250, max_wait_time=5)
            for message in received:
                receiver.defer_message(message)
            numbers = [int(m.sequence_number) for m in received]
            gone, locked = numbers[10], numbers[300]
            (taken,) = receiver.receive_deferred_messages([gone])
            receiver.complete_message(taken)
            (held,) = receiver.receive_deferred_messages([locked])  # locked: not completed under the holder
            done = complete_deferred(namespace, queue, numbers, bulk_first=bulk_first)
            assert done == set(numbers) - {gone, locked}
            assert [int(m.sequence_number) for m in receiver.peek_messages(max_message_count=10, sequence_number=1)] == [locked]
            receiver.complete_message(held)


def test_every_deferred_message_is_found_by_a_receiver_that_peeked_further_before(
        namespace: Any, primary: Any, make_queue: Any) -> None:
    """The SDK reads a peek from sequence number 0 as "after the last one this receiver saw": the sweep for
    messages a dead run left deferred goes through a long-lived receiver, and must still see them all."""
    from spark_sb.bus.deferred import deferred_numbers

    queue = make_queue()
    with ServiceBusClient.from_connection_string(primary.connection_string, retry_total=0) as client:
        with client.get_queue_sender(queue) as sender:
            sender.send_messages([ServiceBusMessage(f"m{i}") for i in range(5)])
        with client.get_queue_receiver(queue, prefetch_count=0) as receiver:
            first = receiver.receive_messages(max_message_count=2, max_wait_time=5)
            for message in first:
                receiver.defer_message(message)
    with namespace.receiver(queue) as receiver:
        assert len(receiver.peek_messages(max_message_count=5, sequence_number=1)) == 5  # the receiver saw them
        assert deferred_numbers(receiver) == sorted(int(m.sequence_number) for m in first)
