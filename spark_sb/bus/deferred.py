"""Deferred messages: how the syphon and the ``servicebus-backlog`` source find, peek, fetch and complete the
backlog messages they defer, by sequence number, through a receiver of the layer (:mod:`spark_sb.bus`).

A deferred message stays in its queue and is fetched only by sequence number. Peeking reads one without a
lock and without counting a delivery; fetching it with a receive-and-delete receiver completes it in the same
request. The service answers "not found" for a whole request when one of its messages is gone or locked:
:func:`receive_deferred` then asks one by one, :func:`take_deferred` leaves that page.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

from azure.servicebus import ServiceBusMessageState

from ..errors import is_message_not_found
from ._namespace import Namespace

_LOGGER = logging.getLogger(__name__)

__all__ = ["PAGE", "complete_deferred", "deferred_numbers", "peek_deferred", "receive_deferred", "take_deferred"]

#: messages per peek or fetch request
PAGE = 250


def receive_deferred(receiver: Any, sequence_numbers: Sequence[int]) -> list[Any]:
    """The deferred messages with these sequence numbers (peek-lock) that are still there and not locked."""
    if not sequence_numbers:
        return []
    try:
        return list(receiver.receive_deferred_messages(list(sequence_numbers)))
    except Exception as exc:  # some are gone (or locked): fetch them one by one
        if not is_message_not_found(exc):
            raise
        _LOGGER.debug("receiving %d deferred messages at once failed (%s); one by one", len(sequence_numbers),
                      type(exc).__name__)
    found: list[Any] = []
    for number in sequence_numbers:
        try:
            found.extend(receiver.receive_deferred_messages([number]))
        except Exception as exc:
            if not is_message_not_found(exc):
                raise
            _LOGGER.debug("deferred message %d is gone or locked: %s", number, type(exc).__name__)
    return found


def take_deferred(receiver: Any, sequence_numbers: Sequence[int]) -> list[int]:
    """Fetch these deferred messages in pages of 250 through ``receiver`` (receive-and-delete: this completes
    them), one request per page; a page the service answers "not found" (one of its messages is gone or
    locked) is left untouched. Returns the sequence numbers taken."""
    taken: list[int] = []
    for start in range(0, len(sequence_numbers), PAGE):
        page = [int(n) for n in sequence_numbers[start:start + PAGE]]
        try:
            taken.extend(int(m.sequence_number) for m in receiver.receive_deferred_messages(page))
        except Exception as exc:
            if not is_message_not_found(exc):
                raise
            _LOGGER.debug("deferred messages %d..%d not all there: %s", page[0], page[-1], type(exc).__name__)
    return taken


def peek_deferred(receiver: Any, sequence_numbers: Sequence[int]) -> list[Any]:
    """The deferred messages with these sequence numbers that are still there, by peeking: no lock is taken
    and no delivery counted. A batch's numbers are mostly contiguous, so this pages from the smallest."""
    wanted = set(int(n) for n in sequence_numbers)
    if not wanted:
        return []
    found: list[Any] = []
    start, last = min(wanted), max(wanted)
    while start <= last and len(found) < len(wanted):
        page = receiver.peek_messages(max_message_count=min(PAGE, last - start + 1), sequence_number=start)
        if not page:
            break
        found.extend(m for m in page if int(m.sequence_number or 0) in wanted
                     and m.state == ServiceBusMessageState.DEFERRED)
        start = int(page[-1].sequence_number or 0) + 1
    return found


def peek_pages(receiver: Any, timeout: float | None = None) -> Iterator[list[Any]]:
    """Every message of the receiver's queue (active, locked, deferred, scheduled), a page of ``PAGE`` per
    request, in sequence order; ``timeout``: seconds each request may take (None: the SDK's bound)."""
    start = 1  # not 0: the SDK reads 0 as "after the last message this receiver saw"
    bound = {} if timeout is None else {"timeout": timeout}
    while page := receiver.peek_messages(max_message_count=PAGE, sequence_number=start, **bound):
        yield page
        start = int(page[-1].sequence_number or 0) + 1


def deferred_numbers(receiver: Any) -> list[int]:
    """The sequence numbers of every deferred message in the receiver's queue (peeks the whole queue)."""
    return [int(m.sequence_number or 0) for page in peek_pages(receiver) for m in page
            if m.state == ServiceBusMessageState.DEFERRED]


def complete_deferred(namespace: Namespace, queue: str, sequence_numbers: Sequence[int], *,
                      bulk_first: bool = False) -> set[int]:
    """Complete those of these deferred messages of ``queue`` that are there and not locked (a fetch in
    receive-and-delete mode); returns their sequence numbers. The others are gone (settled before) or locked.

    ``bulk_first``: every message is expected to be there (a first attempt): fetch them all in pages of 250 at
    once (:func:`take_deferred`) and peek only for those of a page the service answered "not found". Else peek
    first (most may be gone, e.g. a sink that settled its batch itself) and fetch only what is there."""
    done: set[int] = set()
    rest = [int(n) for n in sequence_numbers]
    if bulk_first and rest:
        with namespace.receiver(queue, delete=True) as deleter:
            done.update(take_deferred(deleter, rest))
        rest = [n for n in rest if n not in done]
    if rest:
        with namespace.receiver(queue) as receiver:
            there = [int(m.sequence_number) for m in peek_deferred(receiver, rest)]
        if there:
            with namespace.receiver(queue, delete=True) as deleter:
                done.update(int(m.sequence_number) for m in receive_deferred(deleter, there))
    return done
