"""Sending a call's messages to one entity of one namespace in ``ServiceBusMessageBatch``es built before
anything is sent (the paired sender and the replicating sender share it).

* every batch is built first: a message that does not fit an empty batch, or that the SDK cannot encode
  (``add_message`` raises ``ValueError``/``TypeError``/``OverflowError``), raises
  :class:`~spark_sb.errors.BadMessageError` naming its message id, and nothing of the call is sent;
* then the batches are sent in order; a failure after some were accepted raises :class:`PartialSend` with the
  count of messages accepted before it (``items[:sent]`` are stored, ``items[sent:]`` are not known to be), so
  that the caller resends only the rest;
* batches built for one namespace can be sent to another as they are (``built``): active replication encodes
  each message once for both.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from azure.servicebus import ServiceBusMessage

from .. import messages as msgs
from .. import wire
from ..config import unsendable
from ..errors import (
    ENCODING_ERRORS,
    BadMessageError,
    ConfigError,
    ErrorClass,
    classify,
    encoding_error,
    is_too_large,
    redact,
)
from ._namespace import Namespace
from .pipeline import SenderClosed

_LOGGER = logging.getLogger(__name__)

__all__ = ["PartialSend", "batches_after", "build_batches", "call_messages", "message_id", "send_batches"]


class PartialSend(Exception):
    """A send that failed (``error``) after ``sent`` messages of the call were accepted."""

    def __init__(self, sent: int, error: BaseException) -> None:
        super().__init__(str(error))
        self.sent = sent
        self.error = error


def call_messages(entity: str, message: ServiceBusMessage | Sequence[ServiceBusMessage]) -> list[ServiceBusMessage]:
    """The messages of one send call as a list, once its arguments are checked: ``entity`` must be a non-empty
    string naming a queue or a topic (:class:`~spark_sb.errors.ConfigError`, a ``ValueError``; a subscription or a
    dead-letter queue takes no message), every message a ``ServiceBusMessage`` (``TypeError``)."""
    if not isinstance(entity, str) or not entity:
        raise ValueError(f"entity must be a non-empty string, got {entity!r}")
    problem = unsendable(entity)
    if problem is not None:
        raise ConfigError("entity", problem, repr(entity))
    batch = [message] if isinstance(message, ServiceBusMessage) else list(message)
    for item in batch:
        if not isinstance(item, ServiceBusMessage):
            raise TypeError(f"expected ServiceBusMessage, got {type(item).__name__}")
    return batch


def message_id(message: ServiceBusMessage) -> object:
    """``message.message_id``, or ``None`` for a message without properties."""
    try:
        return message.message_id
    except Exception:  # a message without properties
        return None


def _unencodable(item: ServiceBusMessage, entity: str, exc: BaseException) -> BadMessageError:
    """The error for a message the SDK raised ``exc`` encoding: the one of ``messages.check_encodable``, which
    names the field, else one quoting the SDK's words."""
    try:
        msgs.check_encodable(item, entity)
    except BadMessageError as precise:
        return precise
    return encoding_error(exc, message_id(item), entity)


def _add(batch: Any, item: ServiceBusMessage, entity: str) -> None:
    """``batch.add_message(item)`` (its bytes as they are when it carries them: :func:`spark_sb.wire.append`); an
    encoding error there is a bad message (behaviour.md, "Error classes")."""
    try:
        if not wire.append(batch, item):
            batch.add_message(item)
    except ENCODING_ERRORS as exc:
        if is_too_large(exc):  # the SDK's size error is a ValueError too: the caller decides (a new batch)
            raise
        raise _unencodable(item, entity, exc) from exc


def _too_big(item: ServiceBusMessage, path: str, entity: str, limit: int) -> BadMessageError:
    where = "" if path == entity else f" rewritten for backlog queue {path!r}"
    size = msgs.message_size(item)
    return BadMessageError(message_id(item), entity, f"{size} bytes{where} exceeds the limit of {limit} bytes")


def _fits(batch: Any, item: ServiceBusMessage, path: str, entity: str, *, first: bool) -> bool:
    """Add ``item`` to ``batch``; False when it does not fit there. A message that does not fit an empty batch
    (``first``) is a :class:`BadMessageError`."""
    try:
        _add(batch, item, entity)
    except Exception as exc:
        if not is_too_large(exc):
            raise
        if first:
            raise _too_big(item, path, entity, batch.max_size_in_bytes) from None
        return False
    return True


def build_batches(sdk_sender: Any, path: str, items: Sequence[ServiceBusMessage], entity: str) -> list[Any]:
    """``items``, in order, in as few of ``sdk_sender``'s batches as fit (see :func:`send_batches`)."""
    batches = []
    current = sdk_sender.create_message_batch()
    for item in items:
        if _fits(current, item, path, entity, first=len(current) == 0):
            continue
        batches.append(current)
        current = sdk_sender.create_message_batch()
        _fits(current, item, path, entity, first=True)
    batches.append(current)
    return batches


def _fit_link(batches: Sequence[Any], sdk_sender: Any) -> bool:
    """Whether ``sdk_sender``'s link takes each of ``batches`` (namespaces of different tiers have different
    limits)."""
    limit = sdk_sender.create_message_batch().max_size_in_bytes
    return all(batch.size_in_bytes <= limit for batch in batches)


def batches_after(batches: Sequence[Any] | None, sent: int) -> list[Any] | None:
    """What is left of ``batches`` once their first ``sent`` messages were accepted; ``None`` when ``sent`` ends
    inside a batch (or there were no batches): the rest is built again."""
    if batches is None:
        return None
    for i, batch in enumerate(batches):
        if sent == 0:
            return list(batches[i:])
        sent -= len(batch)
        if sent < 0:
            return None
    return [] if sent == 0 else None


def _built(side: Namespace, path: str, items: Sequence[ServiceBusMessage], entity: str,
           built: Sequence[Any] | None) -> list[Any]:
    """``built`` when ``path``'s link takes batches that large, else ``items`` in batches of ``path``'s sender,
    built while the sends in flight on it go on (:meth:`~spark_sb.bus.Namespace.batch_sender`); once again on a
    new sender when another thread dropped it meanwhile."""
    for _ in range(2):
        try:
            with side.batch_sender(path) as sdk_sender:
                if built is not None and _fit_link(built, sdk_sender):
                    return list(built)
                return build_batches(sdk_sender, path, items, entity)
        except SenderClosed:
            _LOGGER.debug("the sender of %r was dropped while its batches were built; building them again", path)
    with side.batch_sender(path) as sdk_sender:
        return build_batches(sdk_sender, path, items, entity)


def send_batches(side: Namespace, path: str, items: Sequence[ServiceBusMessage], entity: str, *,
                 built: Sequence[Any] | None = None, on_built: Callable[[list[Any]], None] | None = None) -> None:
    """Send ``items`` to ``path`` on ``side`` in as few batches as fit. ``entity`` is what errors name (the
    entity the caller sends to; ``path`` differs from it for a backlog queue). Raises :class:`PartialSend` with
    the count sent before a failure, or :class:`BadMessageError` for a message that fits no batch or cannot be
    encoded (then nothing was sent) or that the service refused as a bad message.

    ``built``: ``items`` already in batches (by another namespace's sender, for the same entity), sent as they
    are when this link takes batches that large, else built again here: a batch holds its messages encoded and
    the SDK sends it without changing it, so two namespaces can be sent the same bytes. ``on_built`` is handed
    the batches sent, before the first is sent."""
    sent = 0
    try:
        batches = _built(side, path, items, entity, built)
        if on_built is not None:
            on_built(batches)
        # one after the other (a failure leaves a prefix sent), while other threads' sends share the link
        for one in batches:
            side.send(path, one)
            sent += len(one)
    except BadMessageError:
        raise
    except Exception as exc:
        if classify(exc) is ErrorClass.BAD_MESSAGE:
            bad = items[sent] if sent < len(items) and len(items) == 1 else None
            bad_id = message_id(bad) if bad is not None else None
            raise BadMessageError(bad_id, entity, redact(str(exc))) from exc
        raise PartialSend(sent, exc) from exc
