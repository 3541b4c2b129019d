"""The configuration of the test session's emulator pair, and what a queue holds, shared by the paired, Spark
and syphon tests (imported as ``pairing``: ``tests/`` is on ``sys.path`` through its conftest)."""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from azure.servicebus import ServiceBusClient, ServiceBusReceivedMessage, ServiceBusReceiveMode
from azure.servicebus.exceptions import ServiceBusError

_prefixes = itertools.count()


def pair_config(primary: Any, secondary: Any, tag: str, *, prefix: str | None = None,
                **send_availability: Any) -> dict:
    """``primary`` and ``secondary`` sections for the emulator pair, and a ``send_availability`` section with a
    backlog prefix unique to the call (``<tag><n>-<random>``, unless ``prefix``) and the given options."""
    return {
        "primary": {"connection_string": primary.connection_string, "admin_endpoint": primary.admin_url},
        "secondary": {"connection_string": secondary.connection_string, "admin_endpoint": secondary.admin_url},
        "send_availability": {"backlog_prefix": prefix or f"{tag}{next(_prefixes)}-{uuid.uuid4().hex[:8]}",
                              **send_availability},
    }


def received_ids(connection_string: str, queue: str, *, settle: float = 20.0) -> list[str]:
    """Every message id in ``queue`` (received and deleted), duplicates kept. It ends after two empty receives in a
    row (a message the namespace has sent, so no longer in the queue, may still be on its way) and a peek that
    finds the queue empty, or ``settle`` seconds after the last message came (what a peek shows and a receive never
    gets is locked by another receiver): in a loaded make test one empty receive of a second ended it with 2,499 of
    8,000 messages still to come."""
    ids: list[str] = []
    with ServiceBusClient.from_connection_string(connection_string, retry_total=0) as client, \
            client.get_queue_receiver(queue, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as receiver:
        last, empty = time.monotonic(), 0
        while True:
            if batch := receiver.receive_messages(max_message_count=500, max_wait_time=1):
                ids.extend(str(m.message_id) for m in batch)
                last, empty = time.monotonic(), 0
                continue
            empty += 1
            if empty >= 2 and (not receiver.peek_messages(max_message_count=1) or time.monotonic() - last > settle):
                return ids


def peek_all(connection_string: str, queue: str, *, retry_total: int = 0,
             tries: int = 1) -> list[ServiceBusReceivedMessage]:
    """Every message ``queue`` holds, in any state (active, locked, deferred), peeked page by page by sequence
    number: nothing is locked or taken, so counting never loses a page the way a receive-and-delete cut off by a
    detach does. ``retry_total`` is the SDK's; a page whose peek still fails is asked for again, up to ``tries``
    times in all (for an emulator that detaches links on purpose)."""
    out: list[ServiceBusReceivedMessage] = []
    with ServiceBusClient.from_connection_string(connection_string, retry_total=retry_total) as client, \
            client.get_queue_receiver(queue) as receiver:
        after, failures = 0, 0
        while True:
            try:
                page = receiver.peek_messages(max_message_count=100, sequence_number=after)
            except ServiceBusError:
                failures += 1
                if failures >= tries:
                    raise
                continue
            if not page:
                return out
            out.extend(page)
            after, failures = page[-1].sequence_number + 1, 0


def within(seconds: float, work: Callable[[], Any]) -> Any:
    """``work()`` run in a thread: its value, or its error raised here; an ``AssertionError`` when it is still
    running after ``seconds`` (the thread, a daemon, is left to end with the process). For "finishes or fails
    within a bound" against an endpoint that never answers."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="within", daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds:g} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def session_bodies(connection_string: str, queue: str, session_id: str, expected: int, *,
                   wait: float = 10.0) -> list[str]:
    """The bodies of session ``session_id`` of ``queue`` in the order received (and completed): ``expected`` of
    them within ``wait`` seconds, and any that arrive beyond them (a second copy is not left unseen)."""
    with ServiceBusClient.from_connection_string(connection_string, retry_total=0) as client:
        with client.get_queue_receiver(queue, session_id=session_id) as receiver:
            got: list[str] = []
            deadline = time.monotonic() + wait
            while len(got) < expected and time.monotonic() < deadline:
                for message in receiver.receive_messages(max_message_count=100, max_wait_time=1):
                    got.append(str(message))
                    receiver.complete_message(message)
            got += [str(m) for m in receiver.receive_messages(max_message_count=10, max_wait_time=0.2)]
            return got
