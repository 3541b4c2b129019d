"""The syphon: move messages parked in the backlog queues on the secondary back to their destinations on the
primary (behaviour.md, "The syphon").

:class:`Syphon` receives from one backlog queue in peek-lock, restores each message with
:func:`spark_sb.messages.from_backlog` and then, per message:

* a ping (content type ``application/vnd.ms-servicebus-ping``) is completed: pings never reach a consumer;
* an invalid message (no string ``x-ms-path``, an ``x-ms-*`` property of the wrong type) or one whose TTL ran
  out in the backlog is dead-lettered in the backlog queue, the reason naming the property or
  ``TTLExpiredInBacklog``;
* the others are grouped by destination. Each destination is pinged first (:meth:`PairedSender.ping`); only a
  healthy destination gets its messages. A destination in an outage is skipped for ``syphon.retry_interval``
  and its messages are abandoned, so that they come back; a destination that does not exist gets its messages
  dead-lettered with reason ``DestinationNotFound``; a rejected credential stops the syphon with
  :class:`~spark_sb.errors.CredentialRejectedError` (the messages it held are abandoned first).

A backlog message is completed only after the primary accepted its restored copy (or after it was
dead-lettered on purpose). A crash in between leaves it in the backlog: it is sent again with the same
message id, and duplicate detection on the primary suppresses the second copy.

Choices where behaviour.md is silent:

* the restored copies go straight to the primary with no failover: the syphon never sends a message back to
  a backlog queue (but to re-park it, below); a send failure is handled like a failed ping (skip the
  destination, abandon);
* a restored message the primary refuses as invalid (e.g. no session id for a session entity) is
  dead-lettered with reason ``RejectedByDestination`` and the service's description; one the SDK cannot
  encode (an application property its encoder rejects) with reason ``application property <name> cannot be
  encoded``, whether its destination is up or down: one bad message never stops the syphon;
* sessions keep their order: each destination's messages are sent in sequence order, and once a message of a
  session (``x-ms-sessionid``) is left in the backlog, so are the later messages of that session in the same
  call; a message with a session is never re-parked (its copy would go behind the session's later messages): it
  stays deferred with outcome ``left``, and the ``servicebus-backlog`` source offers it again first;
* re-parking (``repark=True``, the Spark path, whose deferred messages cannot be abandoned): the messages without
  a session for a destination that is down go back to their backlog queue as copies, in batches that fit one
  ``ServiceBusMessageBatch``, each copy carrying ``x-ms-reparked-from`` = ``"<backlog queue>:<sequence number
  of the original>"`` (a copy re-parked again carries only its own original's). A replayed batch
  (:func:`republish_deferred` with ``replay``) first peeks the queue from its oldest message on for these
  markers (:func:`reparked_copies`) and sends nothing for a message whose copy is there: its outcome is
  ``reparked`` and the copy carries it on, so a replay adds no second copy and no second delivery. That
  search costs one peek per 250 messages after the batch's oldest (it stops early once every message of the
  batch has its copy); a batch that is not a replay pays nothing;
* re-parking asks first whether the primary namespace answers at all (:func:`primary_unanswered`, once per
  call): a destination down while the namespace answers is an outage of that entity, and its messages are
  re-parked so that the other destinations' go on; a namespace that does not answer is the primary down, and
  then nothing is re-parked or sent in that call: every message not settled yet stays deferred with outcome
  ``left`` and reason :data:`PRIMARY_DOWN` (the syphon job's republisher then stops its run, see
  :class:`PrimaryDownError`), so that an outage does not rewrite the backlog batch after batch;
* a message whose lock was lost before it could be settled is left to the broker (it comes back);
* a receiver whose link or connection is lost while it settles (:func:`~spark_sb.errors.is_link_gone`: the
  secondary went down, the service detached the link) settles nothing more in that call: every message not
  settled yet stays in the backlog, and those not sent yet are not sent (outcome ``left``, reason
  :data:`RECEIVER_LOST`); one warning names the queue and how many were left, and the receiver is closed, so that
  the next receive opens a new one. Their locks lapse and the broker delivers them again; one already sent is
  sent again with its message id, and duplicate detection on the primary drops the second copy;
* taking back (:meth:`Syphon.take_back`, which :meth:`Syphon.drain` runs first): a syphon job's source defers
  the messages of each batch and reads them back by sequence number, so a job that died leaves them deferred,
  and a deferred message is never delivered to a receive. ``drain`` finds them by peeking (their state says
  deferred), receives them by sequence number in peek-lock and moves them as any received message, after
  looking for their re-parked copies as a replay does (a message the job re-parked and did not complete is
  completed, not sent). A message the job had sent already is sent again with its message id: duplicate
  detection on the primary makes it a duplicate, not a second copy. Nothing tells a dead job's deferred
  messages from a running job's (a deferred message has no owner and no lock), so ``drain`` does not guess:
  run one mover per backlog at a time, and beside a running job ``drain(take_deferred=False)``.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from azure.servicebus import ServiceBusMessage

from . import messages as msgs
from . import wire
from .bus import Namespace, entity_key, shared, shared_namespace
from .bus.deferred import complete_deferred, deferred_numbers, peek_deferred, peek_pages, receive_deferred
from .config import SparkSbConfig, load_config
from .errors import (
    ENCODING_ERRORS,
    BadMessageError,
    CredentialRejectedError,
    ErrorClass,
    SparkSbError,
    classify,
    is_blip,
    is_link_gone,
    is_lock_lost,
    is_too_large,
    redact,
    refusal,
)
from .paired.retry import ExponentialBackoff, RetryFor

_LOGGER = logging.getLogger(__name__)

__all__ = ["PRIMARY_DOWN", "PROBE_ENTITY", "RECEIVER_LOST", "REJECTED_BY_DESTINATION", "X_MS_REPARKED_FROM",
           "MoveSummary", "Outcome", "PrimaryDownError", "Syphon", "SyphonSettleError", "primary_unanswered",
           "probe_primary", "reparked_copies", "republish_deferred", "republish_received", "settle_outcomes",
           "summary_dict"]

#: dead-letter reason for a restored message that the destination refused as invalid
REJECTED_BY_DESTINATION = "RejectedByDestination"
#: the application property of a re-parked copy: ``"<backlog queue>:<sequence number of the original>"``
#: (:func:`spark_sb.messages.from_backlog` strips it with every ``x-ms-*`` property)
X_MS_REPARKED_FROM = msgs.X_MS_REPARKED_FROM
_MAX_DESCRIPTION = 1024
#: the ledger reason of a message left in the backlog, not re-parked, because the primary namespace did not answer
PRIMARY_DOWN = "PrimaryDown"
#: the reason of a message left in the backlog, not sent, because its receiver's link or connection was lost
#: while the syphon settled the messages it had received (it comes back when its lock lapses)
RECEIVER_LOST = "BacklogReceiverLost"
#: the entity :func:`primary_unanswered` pings: one that does not exist, so that the namespace's "not found"
#: proves it answers without touching a destination
PROBE_ENTITY = "spark-sb-primary-probe"


def primary_unanswered(primary: Namespace) -> BaseException | None:
    """Whether the primary namespace answers at all: a ping (:meth:`~spark_sb.bus.Namespace.ping`) of
    :data:`PROBE_ENTITY`, which does not exist. Any answer (not found, as expected; a credential refused for that
    path; busy; success, should it exist) means the namespace is up; an outage-class failure (the connection
    refused or lost, a host that does not resolve, no answer within ``primary_try_timeout``) that it is down:
    that failure is returned, else None. Bounded by the primary's try timeout and retry policy
    (``send_availability.primary_try_timeout``, ``primary_retry_total``). A failure that is no Service Bus
    answer at all (a bug) is raised."""
    try:
        primary.ping(PROBE_ENTITY)
    except Exception as exc:
        error_class = classify(exc)
        if error_class is ErrorClass.OUTAGE:
            return exc
        if error_class is ErrorClass.OTHER:
            raise
    finally:
        primary.drop_sender(PROBE_ENTITY)
    return None


def probe_primary(config: SparkSbConfig) -> BaseException | None:
    """:func:`primary_unanswered` for ``config``'s primary, on a connection of its own (closed after): what the
    syphon job asks before a run moves anything."""
    primary = Namespace("primary", config.primary, config.send_availability.primary_client_kwargs())
    try:
        return primary_unanswered(primary)
    finally:
        primary.close()


class PrimaryDownError(SparkSbError):
    """A syphon batch found the primary namespace down (:func:`primary_unanswered`): it re-parked nothing, and
    left deferred every message it had not settled yet (outcome ``left``, reason :data:`PRIMARY_DOWN`). Raised
    by the job's republisher once the batch's ledger rows are written and what it delivered, re-parked or
    dead-lettered is settled, so that Spark does not commit the batch: the run stops, and the next run replays
    the batch (its pre-check waits for the primary). Nothing is lost."""

    def __init__(self, batch_id: int, left: int) -> None:
        super().__init__(f"the primary namespace did not answer during batch {batch_id}: {left} of its messages "
                         "stay in the backlog, not re-parked (the next run replays the batch)")
        self.batch_id = batch_id
        self.left = left


@dataclass
class MoveSummary:
    """What one :meth:`Syphon.move` call did with the messages it received.

    :ivar moved: ``{destination: count}`` accepted by the primary (and completed in the backlog).
    :ivar dead_lettered: ``{reason: count}`` dead-lettered in the backlog queue.
    :ivar left: ``{destination: count}`` left in the backlog (abandoned: destination down or skipped).
    :ivar pings: pings dropped (completed).
    :ivar down: destinations found down (or still inside their retry interval).
    :ivar taken_back: deferred messages received by sequence number (:meth:`Syphon.take_back`), counted in
        ``received`` too.
    :ivar deferred_locked: deferred messages not taken back because another receiver holds their lock; they
        stay deferred (in a :meth:`Syphon.drain` summary: those still locked at its end).
    :ivar unsettled: messages left in the backlog unsettled because their receiver's link or connection was lost
        while it settled them, or their own lock was (counted in ``moved`` too when they had been sent, else in
        ``left``): they come back when their locks lapse.
    """

    backlog_queue: str
    received: int = 0
    moved: dict[str, int] = field(default_factory=dict)
    dead_lettered: dict[str, int] = field(default_factory=dict)
    left: dict[str, int] = field(default_factory=dict)
    pings: int = 0
    down: list[str] = field(default_factory=list)
    taken_back: int = 0
    deferred_locked: int = 0
    unsettled: int = 0
    #: one :class:`Outcome` per message settled (not pings), for the ledger
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def total_moved(self) -> int:
        return sum(self.moved.values())

    @property
    def total_dead_lettered(self) -> int:
        return sum(self.dead_lettered.values())

    @property
    def total_left(self) -> int:
        return sum(self.left.values())

    def merge(self, other: MoveSummary) -> None:
        self.received += other.received
        self.pings += other.pings
        self.taken_back += other.taken_back
        self.deferred_locked += other.deferred_locked
        self.unsettled += other.unsettled
        for mine, theirs in ((self.moved, other.moved), (self.dead_lettered, other.dead_lettered),
                             (self.left, other.left)):
            for key, n in theirs.items():
                mine[key] = mine.get(key, 0) + n
        self.down.extend(d for d in other.down if d not in self.down)
        self.outcomes.extend(other.outcomes)


@dataclass(frozen=True)
class Outcome:
    """What happened to one backlog message: ``delivered``, ``dead_lettered``, ``left`` (abandoned, it comes
    back) or ``reparked`` (a copy with the remaining TTL went back to the backlog queue, the original was
    completed)."""

    backlog_queue: str
    sequence_number: int | None
    message_id: str | None
    destination: str | None
    outcome: str
    reason: str | None
    backlog_enqueued_time: datetime.datetime | None
    #: the dead-letter error description (dead_lettered only)
    description: str | None = None


def _outcome(queue: str, message: Any, destination: str | None, outcome: str, reason: str | None = None,
             description: str | None = None) -> Outcome:
    enqueued = getattr(message, "enqueued_time_utc", None)
    if enqueued is not None and enqueued.tzinfo is None:
        enqueued = enqueued.replace(tzinfo=datetime.UTC)
    number = getattr(message, "sequence_number", None)
    message_id = getattr(message, "message_id", None)
    return Outcome(queue, None if number is None else int(number), None if message_id is None else str(message_id),
                   destination, outcome, reason, enqueued, description)


def _add(counts: dict[str, int], key: str, n: int = 1) -> None:
    counts[key] = counts.get(key, 0) + n


class _DestinationDown(Exception):
    def __init__(self, error: BaseException) -> None:
        super().__init__(type(error).__name__)
        self.error = error


#: how long re-parking rides out a secondary that does not answer, in the republishing path (as settle_outcomes)
REPARK_OUTAGE_WAIT = 120.0


class Syphon:
    """Move backlog messages home. Build it with :meth:`from_config`; close it (or use ``with``).

    ``clock`` (epoch seconds) decides TTL expiry and the retry interval. Its SDK handles are two
    :class:`~spark_sb.bus.Namespace` of its own (closed with it): the primary's, which pings and sends the
    restored copies, and the secondary's, which receives from and re-parks to the backlog queues.
    """

    def __init__(self, config: SparkSbConfig, *, clock: Callable[[], float] = time.time, repark: bool = False
                 ) -> None:
        self.config = config
        #: leave messages for a destination that is down by sending a copy back to the backlog queue and
        #: completing the original (the Spark source's deferred messages cannot be abandoned back to the queue)
        self.repark = repark
        self._clock = clock
        self._retry_interval = config.syphon.retry_interval.total_seconds()
        self._skip_until: dict[str, float] = {}
        self._healthy_at: dict[str, float] = {}  # when each destination last accepted a ping or a send
        self._left_sessions: set[tuple[str, str]] = set()  # of the current settle call (see _leave)
        self._primary_down: bool | None = None  # of the current settle call: None until asked (see _leave)
        self._call = _SettleCall()  # what the current settle call could not settle (see _settle)
        self._primary = Namespace("primary", config.primary, config.send_availability.primary_client_kwargs())
        self._secondary = Namespace("secondary", config.secondary, {"retry_total": 0})
        #: held by whoever uses this syphon (one batch at a time: :func:`syphon_for`)
        self.lock = threading.Lock()

    @classmethod
    def from_config(cls, source: str | os.PathLike[str] | Mapping[str, Any] | SparkSbConfig, *,
                    clock: Callable[[], float] = time.time, repark: bool = False) -> Syphon:
        """From a YAML path, a dict or a :class:`SparkSbConfig`."""
        return cls(load_config(source), clock=clock, repark=repark)

    def __enter__(self) -> Syphon:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Syphon(primary={self.config.primary.fully_qualified_namespace!r}, "
                f"prefix={self.config.send_availability.backlog_prefix!r})")

    @property
    def backlog_queues(self) -> list[str]:
        return self.config.send_availability.backlog_queue_names()

    def close(self) -> None:
        """Close every SDK handle (idempotent)."""
        self._primary.close()
        self._secondary.close()

    # --- moving --------------------------------------------------------------------------------------------

    def run_once(self, max_messages: int | None = None, max_wait_time: float = 1.0) -> MoveSummary:
        """One :meth:`move` over every backlog queue; the merged summary (``backlog_queue`` ``"*"``)."""
        total = MoveSummary("*")
        for queue in self.backlog_queues:
            total.merge(self.move(queue, max_messages, max_wait_time=max_wait_time))
        return total

    def drain(self, max_wait_time: float = 1.0, max_rounds: int = 100, *, take_deferred: bool = True
              ) -> MoveSummary:
        """Move the whole backlog: rounds of :meth:`move` over every backlog queue until a round moves and
        dead-letters nothing (at most ``max_rounds``).

        ``take_deferred`` (default): the first round also takes back every deferred message of the backlog
        queues (:meth:`take_back`), which a syphon job that died left behind; later rounds take again those left
        (destination down) or locked by another receiver. Run it only when no syphon job runs: a running job's
        batch is deferred too, and taking it races the job (each may send the message: a duplicate the primary
        drops only with duplicate detection). ``take_deferred=False`` moves only what a receive gets, which
        never races the job (a received message is locked to one receiver). What stays deferred is logged."""
        total = MoveSummary("*")
        pending: dict[str, list[int] | None] = dict.fromkeys(self.backlog_queues) if take_deferred else {}
        locked: dict[str, int] = {}  # per queue, as its last take found them
        for _ in range(max_rounds):
            summary = MoveSummary("*")
            for queue in self.backlog_queues:
                if queue in pending:
                    # the first round sweeps the queue; later ones take again what stayed (copies looked for once)
                    numbers = pending[queue]
                    taken, pending[queue] = self._take_back(queue, numbers, look_for_copies=numbers is None)
                    locked[queue] = taken.deferred_locked
                    summary.merge(taken)
                    if not pending[queue]:
                        del pending[queue]
                summary.merge(self.move(queue, max_wait_time=max_wait_time))
            total.merge(summary)
            if not summary.total_moved and not summary.total_dead_lettered and not summary.pings:
                break
        total.deferred_locked = sum(locked.values())
        if pending:
            _LOGGER.warning("deferred backlog messages stay deferred (destination down, or locked by another "
                            "receiver): %s; the next drain or syphon job run takes them back",
                            {queue: len(numbers or ()) for queue, numbers in pending.items()})
        return total

    def deferred(self, queues: Sequence[str] | None = None) -> dict[str, list[int]]:
        """The sequence numbers of the deferred messages of each backlog queue (default: every one), found by
        peeking the whole queue (one request per 250 messages; no lock taken, no delivery counted). A deferred
        message is never delivered to a receive: a syphon job's source deferred it and reads it back by number,
        or, if that job died, :meth:`take_back` does."""
        found: dict[str, list[int]] = {}
        for queue in self.backlog_queues if queues is None else queues:
            try:
                with self._secondary.receiver(queue) as receiver:
                    found[queue] = deferred_numbers(receiver)
            except Exception as exc:
                if not _missing(queue, exc):
                    raise
                found[queue] = []
        return found

    def take_back(self, backlog_queue: str, sequence_numbers: Sequence[int] | None = None) -> MoveSummary:
        """Receive deferred messages of ``backlog_queue`` by sequence number (default: every one there, found
        by :meth:`deferred`) in peek-lock, a ``syphon.receive_batch`` at a time, and move them as :meth:`move`
        moves what it receives. First, as a replayed batch of the job does, the queue is peeked for their
        re-parked copies (:func:`reparked_copies`): a message the job re-parked and died before completing is
        completed and not sent (outcome ``reparked``, its copy carries it on). A message the job had sent
        already is sent again with its message id (duplicate detection on the primary makes it a duplicate).
        One whose destination is down is abandoned: it stays deferred. One locked by another receiver is not
        taken (``deferred_locked``). See :meth:`drain` on a syphon job that is running."""
        return self._take_back(backlog_queue, sequence_numbers)[0]

    def _take_back(self, queue: str, sequence_numbers: Sequence[int] | None, *, look_for_copies: bool = True
                   ) -> tuple[MoveSummary, list[int]]:
        """:meth:`take_back`, and the sequence numbers still deferred after it: abandoned, or locked.
        ``look_for_copies`` False: these messages were looked for before (by this syphon, which re-parks none of
        them without completing it)."""
        summary = MoveSummary(queue)
        try:
            return self._take_back_from(queue, sequence_numbers, look_for_copies, summary)
        except Exception as exc:
            if summary.received or not _missing(queue, exc):
                raise
            return summary, []

    def _take_back_from(self, queue: str, sequence_numbers: Sequence[int] | None, look_for_copies: bool,
                        summary: MoveSummary) -> tuple[MoveSummary, list[int]]:
        """:meth:`_take_back` on the queue's receiver (what it takes back is counted in ``summary`` as it goes)."""
        with self._secondary.receiver(queue) as receiver:
            if sequence_numbers is None:
                numbers = deferred_numbers(receiver)
                if numbers:
                    _LOGGER.warning("taking back %d deferred messages of %r, left by a syphon job that died (or "
                                    "held by one still running: run one mover per backlog at a time)",
                                    len(numbers), queue)
            else:
                numbers = sorted({int(n) for n in sequence_numbers})
            if not numbers:
                return summary, []
            copied = reparked_copies(receiver, queue, numbers) if look_for_copies else set()
            step = self.config.syphon.receive_batch
            for start in range(0, len(numbers), step):
                received = receive_deferred(receiver, numbers[start:start + step])
                summary.received += len(received)
                summary.taken_back += len(received)
                self.settle(receiver, received, summary, reparked=copied, behind=session_gaps(receiver, received))
                if self._call.lost is not None:  # the receiver is gone: the rest waits for the next take
                    break
            settled = {o.sequence_number for o in summary.outcomes if o.outcome != "left"}
            rest = [n for n in numbers if n not in settled]
            lost = self._call.lost is not None
            # gone: settled by another (a lost receiver peeks nothing: what it left is taken again next time)
            still = rest if lost else [int(m.sequence_number) for m in peek_deferred(receiver, rest)]
        if lost:
            self._secondary.drop_receiver(queue)
        taken = {o.sequence_number for o in summary.outcomes}
        summary.deferred_locked = sum(1 for n in still if n not in taken)
        if summary.taken_back:
            _LOGGER.info("syphon %s: took back %d deferred, moved %s, dead-lettered %s, left %s", queue,
                         summary.taken_back, summary.moved, summary.dead_lettered, summary.left)
        return summary, still

    def move(self, backlog_queue: str, max_messages: int | None = None, *,
             max_wait_time: float = 1.0) -> MoveSummary:
        """Receive up to ``max_messages`` (default ``syphon.receive_batch``) from ``backlog_queue`` in
        peek-lock and move them home (see the module docstring). Returns what happened to them."""
        limit = max_messages or self.config.syphon.receive_batch
        summary = MoveSummary(backlog_queue)
        try:
            with self._secondary.receiver(backlog_queue) as receiver:  # an error drops it: rebuilt on next use
                received = list(receiver.receive_messages(max_message_count=limit, max_wait_time=max_wait_time))
                summary.received = len(received)
                self.settle(receiver, received, summary, behind=session_gaps(receiver, received))
            if self._call.lost is not None:  # lost while settling (settle said so once): the next move opens anew
                self._secondary.drop_receiver(backlog_queue)
        except Exception as exc:
            if summary.received or not _missing(backlog_queue, exc):
                raise
            return summary
        if summary.received:
            _LOGGER.info("syphon %s: received %d, moved %s, dead-lettered %s, left %s", backlog_queue,
                         summary.received, summary.moved, summary.dead_lettered, summary.left)
        return summary

    def settle(self, receiver: Any | None, received: Sequence[Any], summary: MoveSummary, *,
               reparked: Collection[int] = (), behind: Mapping[tuple[str, str], int] | None = None) -> None:
        """Restore, republish and settle messages ``received`` (locked) by ``receiver``. Every message ends
        completed, dead-lettered or abandoned, with its :class:`Outcome` in ``summary.outcomes``.

        ``receiver`` None: the messages were peeked (deferred, not locked); decide, republish and re-park
        only, and settle nothing: the caller settles them from the outcomes (:func:`settle_outcomes`).
        ``reparked``: sequence numbers of messages whose re-parked copy is already in the backlog queue (an
        attempt that died re-parked them, see :func:`reparked_copies`): nothing is sent for them, their
        outcome is ``reparked`` (the copy carries them on).
        ``behind``: per ``(entity, session id)``, the lowest sequence number of a message of that session in the
        backlog queue and not in ``received`` (:func:`session_gaps`: locked by a receive whose answer was lost,
        say); the session's messages above it are left (outcome ``left``), so that they never overtake it.

        A settlement that finds ``receiver``'s link or connection gone (:func:`~spark_sb.errors.is_link_gone`) ends
        the settling through it: the messages not settled yet stay in the backlog (those not sent yet are not sent:
        outcome ``left``, reason :data:`RECEIVER_LOST`), counted in ``summary.unsettled``; one warning at the end
        of the call names the queue and how many, and the caller closes the receiver (:meth:`move` and
        :meth:`take_back` do). Messages whose locks were lost are counted and named by one warning too."""
        self._call = _SettleCall(summary.unsettled)
        try:
            self._settle_received(receiver, received, summary, reparked, behind)
        finally:
            self._call.warn(summary)

    def _settle_received(self, receiver: Any | None, received: Sequence[Any], summary: MoveSummary,
                         reparked: Collection[int], behind: Mapping[tuple[str, str], int] | None) -> None:
        """:meth:`settle`'s work."""
        now = datetime.datetime.fromtimestamp(self._clock(), datetime.UTC)
        groups: dict[str, list[tuple[Any, ServiceBusMessage]]] = {}
        spelled: dict[str, str] = {}  # entity_key -> the first spelling of the call (entity names are case-insensitive)
        for message in received:
            if msgs.is_ping(message):
                if self._settle(receiver, summary, "complete_message", message):
                    summary.pings += 1
                continue
            try:
                restored = msgs.from_backlog(message, now, fast=self.config.syphon.encoder == "fast")
            except Exception as exc:  # a shape from_backlog did not foresee: dead-letter, never crash
                restored = msgs.Restored(msgs.RestoreStatus.INVALID, reason="unreadable message",
                                         description=f"{type(exc).__name__}: {exc}")
            if not restored.ok or restored.entity is None or restored.message is None:
                self._dead_letter(receiver, message, str(restored.reason), restored.description, summary,
                                  restored.entity)
                continue
            if reparked and getattr(message, "sequence_number", None) in reparked:
                self._settle(receiver, summary, "complete_message", message)
                summary.outcomes.append(_outcome(summary.backlog_queue, message, restored.entity, "reparked"))
                _add(summary.left, restored.entity)
                _LOGGER.info("backlog message %s was re-parked by an earlier attempt: not sent again",
                             getattr(message, "message_id", None))
                continue
            # one group per entity, whatever the spellings it was parked under: a session keeps its order
            entity = spelled.setdefault(entity_key(restored.entity), restored.entity)
            groups.setdefault(entity, []).append((message, restored.message))
        for items in groups.values():  # a session reaches its destination in the order it was parked
            items.sort(key=lambda item: int(getattr(item[0], "sequence_number", None) or 0))
        self._left_sessions = set()  # (entity, session id) of this call's messages left: their later ones stay too
        self._primary_down = None  # asked again by this call's first re-park
        if behind:
            for entity, items in list(groups.items()):
                waiting = [item for item in items if _above_gap(entity, item, behind)]
                if waiting:
                    self._wait_for_gap(receiver, entity, waiting, summary, behind)
                    groups[entity] = [item for item in items if not _above_gap(entity, item, behind)]
        pending = [(entity, items) for entity, items in groups.items() if items]
        try:
            while pending:
                entity, items = pending.pop(0)
                self._deliver(receiver, entity, items, summary)
        except BaseException:
            for entity, items in pending:
                for message, _ in items:
                    self._settle(receiver, summary, "abandon_message", message)
                    summary.outcomes.append(_outcome(summary.backlog_queue, message, entity, "left"))
                _add(summary.left, entity, len(items))
            raise

    def _deliver(self, receiver: Any, entity: str, items: list[tuple[Any, ServiceBusMessage]],
                 summary: MoveSummary, *, one_by_one: bool = False, fresh: bool = False) -> None:
        if self._call.lost is not None:  # the receiver is gone: what it cannot settle is not sent either
            self._unsent(entity, items, summary)
            return
        if self._primary_down or self._skip_until.get(entity, 0.0) > self._clock():
            self._leave(receiver, entity, items, summary)
            return
        behind = [item for item in items if _session(entity, item) in self._left_sessions]
        if behind:  # an earlier message of their session stays in the backlog: so do they
            self._leave(receiver, entity, behind, summary)
            items = [item for item in items if _session(entity, item) not in self._left_sessions]
            if not items:
                return
        done = 0
        try:
            # ping first, unless the destination accepted a ping or a send within the retry interval
            if not one_by_one and self._clock() - self._healthy_at.get(entity, float("-inf")) > self._retry_interval:
                self._primary.ping(entity)
                self._healthy_at[entity] = self._clock()
            with self._primary.sender(entity) as sdk_sender:
                for batch, built in _batches(sdk_sender, items, entity, one_by_one):
                    if self._call.lost is not None:  # lost while completing the batch before: send no more
                        break
                    sdk_sender.send_messages(built)
                    for message, _ in batch:
                        self._settle(receiver, summary, "complete_message", message, sent=True)
                        summary.outcomes.append(_outcome(summary.backlog_queue, message, entity, "delivered"))
                    done += len(batch)
                    _add(summary.moved, entity, len(batch))
                    self._healthy_at[entity] = self._clock()
            if done < len(items):  # the receiver was lost
                self._unsent(entity, items[done:], summary)
        except _BadMessage as bad:  # the messages before it were sent; dead-letter it, go on with the rest
            self._dead_letter(receiver, bad.message, bad.reason, bad.description, summary, entity)
            rest = [item for item in items[done:] if item[0] is not bad.message]
            if rest:
                self._deliver(receiver, entity, rest, summary, one_by_one=one_by_one)
        except Exception as exc:
            rest = items[done:]
            if not fresh and not done and is_link_gone(exc):
                # the service detached the sender's link (idle, or forced in an upgrade): once more on a new one
                self._primary.drop_sender(entity)
                self._deliver(receiver, entity, rest, summary, one_by_one=one_by_one, fresh=True)
                return
            error_class = classify(exc)
            if error_class is ErrorClass.BAD_MESSAGE:
                if one_by_one or len(rest) == 1:
                    self._dead_letter(receiver, rest[0][0], REJECTED_BY_DESTINATION, redact(str(exc)), summary,
                                      entity)
                    rest = rest[1:]
                if rest:  # find the one the destination refuses
                    self._deliver(receiver, entity, rest, summary, one_by_one=True)
                return
            if error_class is ErrorClass.CONFIGURATION_NOT_FOUND:
                _LOGGER.warning("destination %r not found on the primary: dead-lettering %d messages", entity,
                                len(rest))
                for message, _ in rest:
                    self._dead_letter(receiver, message, msgs.DESTINATION_NOT_FOUND,
                                      f"{entity!r} does not exist on the primary", summary, entity)
                return
            if not (self.repark and error_class is ErrorClass.CONFIGURATION_CREDENTIAL):  # that fails the batch:
                self._leave(receiver, entity, rest, summary)  # copies re-parked then would be churn only
            self._primary.drop_sender(entity)
            if error_class is ErrorClass.CONFIGURATION_CREDENTIAL:
                raise CredentialRejectedError(
                    f"primary {self.config.primary.fully_qualified_namespace}", refusal(exc), entity=entity,
                ) from exc
            self._healthy_at.pop(entity, None)
            if self._primary_down:  # not the entity: the namespace; the next call asks again at once
                return
            self._skip_until[entity] = self._clock() + self._retry_interval
            _LOGGER.info("destination %r unavailable (%s): %d messages stay in the backlog for %.3g s", entity,
                         type(exc).__name__, len(rest), self._retry_interval)

    def _wait_for_gap(self, receiver: Any, entity: str, items: Sequence[tuple[Any, Any]], summary: MoveSummary,
                      behind: Mapping[tuple[str, str], int]) -> None:
        """Leave ``items``: an earlier message of each one's session is in the backlog queue but not in this
        call (locked by another receive, or not yet taken); they go once it has (never re-parked)."""
        for item in items:
            key = _session(entity, item)
            self._settle(receiver, summary, "abandon_message", item[0])
            summary.outcomes.append(_outcome(summary.backlog_queue, item[0], entity, "left", SESSION_GAP,
                                             f"behind message {behind[key] if key else '?'} of its session, still "
                                             f"in the backlog queue"))
        _add(summary.left, entity, len(items))
        self._left_sessions.update(key for key in (_session(entity, item) for item in items) if key)
        _LOGGER.info("syphon %s: %d messages for %r wait behind an earlier message of their session that is not in "
                     "this batch", summary.backlog_queue, len(items), entity)

    def _leave(self, receiver: Any, entity: str, items: Sequence[tuple[Any, Any]], summary: MoveSummary) -> None:
        """Leave these messages in the backlog: abandoned (or, re-parking, left deferred: the source offers them
        again first), but a message without a session when re-parking: its copy goes to the end of the queue.
        A session's message is never re-parked (its copy would go behind the session's later messages), and once
        one is left, so are the later messages of its session in this call. Before the first re-park of a call
        the primary namespace is asked whether it answers at all (:func:`primary_unanswered`): when it does not,
        nothing is re-parked in this call, every message is left deferred with reason :data:`PRIMARY_DOWN`."""
        self._left_sessions.update(session for session in (_session(entity, item) for item in items) if session)
        if entity not in summary.down:
            summary.down.append(entity)
        # a lost receiver cannot complete an original: a copy would be a second one (it comes back anyway)
        parked = [self.repark and self._call.lost is None and _session(entity, item) is None for item in items]
        primary_down = any(parked) and self._primary_is_down()
        if primary_down:
            parked = [False] * len(items)
        kept = [item for item, park in zip(items, parked, strict=True) if not park]
        for message, _ in kept:
            self._settle(receiver, summary, "abandon_message", message)
            summary.outcomes.append(_outcome(summary.backlog_queue, message, entity, "left",
                                             PRIMARY_DOWN if primary_down else None))
        if kept:
            _add(summary.left, entity, len(kept))
        if len(kept) < len(items):
            self._repark(receiver, entity, [item for item, park in zip(items, parked, strict=True) if park], summary)

    def _primary_is_down(self) -> bool:
        """Whether the primary namespace does not answer, asked once per :meth:`settle` call."""
        if self._primary_down is None:
            failure = primary_unanswered(self._primary)
            self._primary_down = failure is not None
            if failure is not None:
                _LOGGER.warning("the primary namespace %s does not answer (%s: %s): nothing is re-parked, this "
                                "batch's messages stay in the backlog", self.config.primary.fully_qualified_namespace,
                                type(failure).__name__, redact(str(failure))[:200])
        return self._primary_down

    def _repark(self, receiver: Any, entity: str, items: Sequence[tuple[Any, Any]], summary: MoveSummary) -> None:
        """Send a copy of each message back to its backlog queue, in batches that fit, then complete the
        original. Each copy carries :data:`X_MS_REPARKED_FROM` naming its original, so that a replay finds
        it (:func:`reparked_copies`). A message that cannot be encoded is dead-lettered; a failed send
        raises (what it held is not completed: the caller's batch fails and is replayed). Republishing
        (``receiver`` None: nothing is settled here) first rides out a blip of the secondary for up to
        :data:`REPARK_OUTAGE_WAIT`, sending what is left."""
        queue = summary.backlog_queue
        copies: list[tuple[Any, ServiceBusMessage]] = []
        for message, restored in items:
            try:
                copy = msgs.to_backlog(restored, entity)
                properties = copy.application_properties
                if properties is None:
                    properties = copy.application_properties = {}
                properties[X_MS_REPARKED_FROM] = _marker(queue, message)
            except BadMessageError as bad:  # the SDK cannot encode it
                self._dead_letter(receiver, message, _cannot_encode(bad),
                                  f"cannot be re-parked in {queue!r}: {bad.reason}", summary, entity)
                continue
            except Exception as exc:  # a shape to_backlog cannot copy: never wedge on it
                self._dead_letter(receiver, message, REJECTED_BY_DESTINATION,
                                  f"cannot be re-parked in {queue!r}: {type(exc).__name__}: {exc}", summary, entity)
                continue
            copies.append((message, copy))
        fresh = False  # a detached sender's link was replaced once already

        def attempt() -> None:
            """Send what is left of ``copies``; on a failure, ``copies`` keeps only what was not sent."""
            nonlocal copies, fresh
            while copies:
                sent = 0
                try:
                    with self._secondary.sender(queue) as sdk_sender:
                        for batch, built in _batches(sdk_sender, copies, queue, False):
                            if self._call.lost is not None:  # its originals could not be completed: no copies
                                break
                            sdk_sender.send_messages(built)
                            for message, _ in batch:
                                self._settle(receiver, summary, "complete_message", message, sent=True)
                                summary.outcomes.append(_outcome(queue, message, entity, "reparked"))
                            sent += len(batch)
                            _add(summary.left, entity, len(batch))
                    if sent < len(copies):  # the receiver was lost
                        self._unsent(entity, copies[sent:], summary)
                    copies = []
                except _BadMessage as bad:  # those before it were sent: dead-letter it, go on with the rest
                    self._dead_letter(receiver, bad.message, bad.reason, bad.description, summary, entity)
                    copies = [item for item in copies[sent:] if item[0] is not bad.message]
                except Exception as exc:
                    self._secondary.drop_sender(queue)
                    copies = copies[sent:]  # those sent are recorded: a try again sends the rest
                    if fresh or sent or not is_link_gone(exc):
                        raise
                    fresh = True  # the service detached the sender's link (idle, forced): once more on a new one

        if receiver is not None:  # settling as it goes: a failed send fails the call (its batch is replayed)
            attempt()
            return
        # republishing (the syphon job): nothing is settled here, so a blip of the secondary (a lost connection,
        # a timeout, busy) is ridden out with backoff within a bound, as the settlement rides it out
        blips = RetryFor(REPARK_OUTAGE_WAIT, ExponentialBackoff(0.5, 5.0), clock=time.monotonic, sleep=time.sleep)
        blips.call(attempt, is_blip, what=f"re-parking {len(copies)} messages in {queue!r}")

    def _settle(self, receiver: Any | None, summary: MoveSummary, action: str, message: Any, *, sent: bool = False,
                **kwargs: Any) -> bool:
        """Settle one message (``receiver`` None: leave it to the caller); whether it was settled. A lost lock
        (:func:`~spark_sb.errors.is_lock_lost`) leaves that message to the broker: its lock lapses and it comes
        back. A link or connection gone (:func:`~spark_sb.errors.is_link_gone`: the connection was lost and the
        SDK shut the receiver's handler down, whose later settlements all raise its ``ValueError`` "Failed to
        complete the message as the handler has already been shutdown") ends the settling through ``receiver``
        for the rest of the call: this message and every later one are left to the broker unsettled. Both are
        counted in ``summary.unsettled`` and told once, at the end of the call (:meth:`_SettleCall.warn`);
        ``sent``: the message was sent home already. Anything else raises."""
        if receiver is None:
            return True
        call = self._call
        if call.lost is None:
            try:
                getattr(receiver, action)(message, **kwargs)
                return True
            except Exception as exc:
                if is_link_gone(exc):
                    call.lost = exc
                elif is_lock_lost(exc):
                    call.lock_lost = exc
                else:
                    raise
        summary.unsettled += 1
        call.sent += sent
        return False

    def _unsent(self, entity: str, items: Sequence[tuple[Any, Any]], summary: MoveSummary) -> None:
        """Leave ``items`` in the backlog unsent and unsettled: the receiver that holds their locks was lost
        (outcome ``left``, reason :data:`RECEIVER_LOST`)."""
        for message, _ in items:
            summary.outcomes.append(_outcome(summary.backlog_queue, message, entity, "left", RECEIVER_LOST))
        _add(summary.left, entity, len(items))
        summary.unsettled += len(items)

    def _dead_letter(self, receiver: Any | None, message: Any, reason: str, description: str | None,
                     summary: MoveSummary, entity: str | None = None) -> None:
        description = (description or reason)[:_MAX_DESCRIPTION]
        if not self._settle(receiver, summary, "dead_letter_message", message, reason=reason,
                            error_description=description):  # it stays in the backlog, and comes back
            summary.outcomes.append(_outcome(summary.backlog_queue, message, entity, "left",
                                             RECEIVER_LOST if self._call.lost is not None else None))
            if entity is not None:
                _add(summary.left, entity)
            return
        _add(summary.dead_lettered, reason)
        summary.outcomes.append(_outcome(summary.backlog_queue, message, entity, "dead_lettered", reason,
                                         description))
        _LOGGER.info("dead-lettered backlog message %s: %s", getattr(message, "message_id", None), reason)


class _BadMessage(SparkSbError):
    def __init__(self, message: Any, description: str, reason: str = REJECTED_BY_DESTINATION) -> None:
        super().__init__(description)
        self.message = message
        self.description = description
        self.reason = reason


def _batches(sdk_sender: Any, items: list[tuple[Any, ServiceBusMessage]], entity: str, one_by_one: bool
             ) -> Iterator[tuple[list[tuple[Any, ServiceBusMessage]], Any]]:
    """Groups of ``items`` that fit one of ``sdk_sender``'s ``ServiceBusMessageBatch`` (or single messages), each
    with the batch that holds it (sent as it is: its messages are encoded once); a message that fits no batch or
    cannot be encoded is raised as :class:`_BadMessage`."""
    batch: list[tuple[Any, ServiceBusMessage]] = []
    current = sdk_sender.create_message_batch()
    for item in items:
        if batch and (one_by_one or not _fits(current, item, entity)):
            yield batch, current
            batch, current = [], sdk_sender.create_message_batch()
        if not batch and not _fits(current, item, entity):
            raise _BadMessage(item[0], f"too large for {entity!r} ({msgs.message_size(item[1])} bytes, the "
                                       f"limit is {current.max_size_in_bytes})")
        batch.append(item)
    if batch:
        yield batch, current


def _cannot_encode(bad: BadMessageError) -> str:
    """The dead-letter reason for a message the SDK cannot encode: the field, e.g. ``application property 'n'
    cannot be encoded`` (the description carries the value and the SDK's words)."""
    return f"{bad.reason.split(':', 1)[0]:.100} cannot be encoded"


def _fits(batch: Any, item: tuple[Any, ServiceBusMessage], entity: str) -> bool:
    """Add the message to the batch; False when it does not fit; :class:`_BadMessage` when it cannot be
    encoded at all (the reason names the field the SDK cannot encode: :func:`messages.check_encodable`)."""
    try:
        if not wire.append(batch, item[1]):  # a restored message's bytes as they are, when it carries them
            batch.add_message(item[1])
    except Exception as exc:
        if is_too_large(exc):
            return False
        if not isinstance(exc, ENCODING_ERRORS):
            raise
        try:
            msgs.check_encodable(item[1], entity)
        except BadMessageError as bad:
            raise _BadMessage(item[0], f"the SDK cannot encode the message for {entity!r}: {bad.reason}",
                              _cannot_encode(bad)) from exc
        raise _BadMessage(item[0], f"cannot be encoded for {entity!r}: {type(exc).__name__}: {exc}"[:300]) from exc
    return True


def _property(message: ServiceBusMessage, name: str) -> Any:
    for key, value in (message.application_properties or {}).items():
        if msgs.text(key) == name:
            return value
    return None


#: the reason of a session's message left behind an earlier one still in the backlog queue (ledger ``reason``)
SESSION_GAP = "BehindEarlierSessionMessage"


def _above_gap(entity: str, item: tuple[Any, Any], behind: Mapping[tuple[str, str], int]) -> bool:
    key = _session(entity, item)
    return key is not None and key in behind and int(getattr(item[0], "sequence_number", 0) or 0) > behind[key]


def session_gaps(receiver: Any, found: Sequence[Any]) -> dict[tuple[str, str], int]:
    """Per ``(entity, session id)`` of the session messages in ``found`` (backlog messages of ``receiver``'s
    queue), the lowest sequence number of a message of that session in the queue (active, locked, deferred) that
    is not in ``found`` and is below the highest of ``found``: a message the batch must not overtake. Peeks the
    queue up to that highest number (one request per 250 messages); nothing when ``found`` holds no session."""
    numbers = {int(m.sequence_number or 0) for m in found}
    sessions = {key for key in (_parked(m) for m in found) if key is not None}
    if not sessions:
        return {}
    top = max(numbers)
    gaps: dict[tuple[str, str], int] = {}
    for page in peek_pages(receiver):
        for message in page:
            number = int(message.sequence_number or 0)
            if number > top:
                return gaps
            key = _parked(message)
            if number not in numbers and key in sessions and key is not None:
                gaps[key] = min(gaps.get(key, number), number)
    return gaps


def _parked(message: Any) -> tuple[str, str] | None:
    """``(entity_key(entity), session id)`` of a backlog message, None when it has no session."""
    entity, session_id = msgs.parked_session(message)
    return None if entity is None or session_id is None else (entity_key(entity), session_id)


def _session(entity: str, item: tuple[Any, Any]) -> tuple[str, str] | None:
    """``(entity, session id)`` of a restored backlog message (a ``(backlog message, restored copy)`` pair), None
    when it has no session."""
    session_id = msgs.text(getattr(item[1], "session_id", None))
    return None if session_id is None else (entity_key(entity), session_id)


def _marker(queue: str, message: Any) -> str:
    """The :data:`X_MS_REPARKED_FROM` value of a copy of backlog message ``message`` of ``queue``."""
    return f"{queue}:{int(message.sequence_number)}"


def reparked_copies(receiver: Any, queue: str, sequence_numbers: Collection[int], *, page: int = 250) -> set[int]:
    """Which of these backlog messages of ``queue`` already have a re-parked copy in the queue: peeks
    (active and deferred messages alike, no lock taken) from the smallest sequence number onward, since a
    copy always comes after its original, collecting the :data:`X_MS_REPARKED_FROM` markers, until every
    message is accounted for or the queue ends. Costs one peek per ``page`` messages after the oldest one:
    run it only on a replay (an attempt that died may have re-parked them)."""
    wanted = {int(n) for n in sequence_numbers}
    found: set[int] = set()
    if not wanted:
        return found
    prefix = f"{queue}:"
    start = min(wanted) + 1
    while len(found) < len(wanted):
        messages = receiver.peek_messages(max_message_count=page, sequence_number=start)
        if not messages:
            break
        for message in messages:
            value = _property(message, X_MS_REPARKED_FROM)
            text = msgs.text(value) or ""
            if text.startswith(prefix) and text[len(prefix):].isdigit():
                original = int(text[len(prefix):])
                if original in wanted and int(message.sequence_number or 0) > original:
                    found.add(original)
        start = int(messages[-1].sequence_number or 0) + 1
    return found


@dataclass
class _SettleCall:
    """What one :meth:`Syphon.settle` call could not settle, told once at its end (:meth:`warn`)."""

    #: ``summary.unsettled`` when the call began
    before: int = 0
    #: why the receiver is gone (a link or connection lost); None while it settles
    lost: BaseException | None = None
    #: the last error of a message whose own lock was lost (its settlement failed, the call went on)
    lock_lost: BaseException | None = None
    #: of the messages left unsettled, those sent home (or re-parked) already
    sent: int = 0

    def warn(self, summary: MoveSummary) -> None:
        """One warning for the messages this call left unsettled, naming the backlog queue and how many."""
        left = summary.unsettled - self.before
        if not left:
            return
        again = (f" ({self.sent} of them sent home or re-parked already: when they come back they are sent again "
                 "with their message ids, and duplicate detection on the primary drops the second copy)"
                 if self.sent else "")
        if self.lost is not None:
            _LOGGER.warning("backlog queue %r: the receiver's link or connection was lost while settling (%s: %s): "
                            "%d of the %d messages received stay in the backlog unsettled%s; they come back when "
                            "their locks lapse, to a new receiver", summary.backlog_queue, type(self.lost).__name__,
                            redact(str(self.lost))[:200], left, summary.received, again)
        else:
            lock_lost = self.lock_lost
            _LOGGER.warning("backlog queue %r: %d messages were not settled, their locks lost (%s: %s)%s; they stay "
                            "in the backlog and come back", summary.backlog_queue, left, type(lock_lost).__name__,
                            redact(str(lock_lost))[:200], again)


def _missing(queue: str, exc: BaseException) -> bool:
    """Whether ``exc`` (met opening or receiving from backlog queue ``queue``) says the queue does not exist: the
    sender pairs (creates the backlog queues) at its first failover only, so before it nothing was parked and
    there is nothing to move. Logged; a missing queue is an empty one."""
    if classify(exc) is not ErrorClass.CONFIGURATION_NOT_FOUND:
        return False
    _LOGGER.info("backlog queue %r does not exist (yet: a sender creates the backlog queues at its first failover); "
                 "nothing to move there", queue)
    return True


@contextlib.contextmanager
def syphon_for(config: SparkSbConfig) -> Iterator[Syphon]:
    """This process's :class:`Syphon` (re-parking, for the Spark path) for ``config``, held exclusively for the
    ``with`` block: what it learnt about destinations (down until when, healthy when) and its connections last
    from batch to batch. Closed with the process registry (:func:`spark_sb.bus.close_all`)."""
    syphon = shared("syphon", config.fingerprint(), lambda: Syphon(config, repark=True))
    with syphon.lock:
        yield syphon


def summary_dict(summary: MoveSummary) -> Mapping[str, Any]:
    """The summary as a plain dict (for logs and the CLI)."""
    return {"backlog_queue": summary.backlog_queue, "received": summary.received, "moved": dict(summary.moved),
            "dead_lettered": dict(summary.dead_lettered), "left": dict(summary.left), "pings": summary.pings,
            "down": list(summary.down), "taken_back": summary.taken_back, "deferred_locked": summary.deferred_locked,
            "unsettled": summary.unsettled}


# --- republishing what a Spark batch read, and settling it once its ledger recorded it ---------------------

#: outcomes that settle the backlog message (``left`` leaves it in the backlog)
_COMPLETE, _DEAD_LETTER = ("delivered", "reparked"), "dead_lettered"


def republish_received(config: SparkSbConfig, received: Mapping[str, Sequence[Any]], *,
                       syphon: Syphon | None = None, replay: bool = False) -> list[Outcome]:
    """Republish deferred backlog messages already read (``{queue: messages}``, as peeked or as the
    ``servicebus-backlog`` source's rows carry them): send the restored copies to healthy destinations,
    re-park those for a destination that is down (a copy back to the backlog queue) and decide which to
    dead-letter, **settling nothing**: one :class:`Outcome` per message. Record the outcomes, then
    :func:`settle_outcomes`. ``syphon`` (re-parking) defaults to this process's
    (:func:`syphon_for`), which remembers destinations found down between batches.

    ``replay``: an earlier attempt at these messages may have died after re-parking some of them; the queue
    is searched for their copies first (:func:`reparked_copies`), and a message with a copy is not sent
    again (outcome ``reparked``): a replay adds no second copy, and sends no message whose copy will."""
    outcomes: list[Outcome] = []
    with contextlib.nullcontext(syphon) if syphon is not None else syphon_for(config) as mover:
        for queue, found in received.items():
            copied: set[int] = set()
            gaps: dict[tuple[str, str], int] = {}
            if found and (replay or any(_parked(m) for m in found)):  # a receiver only when it has a question
                with shared_namespace(config, "secondary").receiver(queue) as receiver:
                    if replay:
                        copied = reparked_copies(receiver, queue, [int(m.sequence_number) for m in found])
                    gaps = session_gaps(receiver, found)
            summary = MoveSummary(queue, received=len(found))
            mover.settle(None, found, summary, reparked=copied, behind=gaps)
            outcomes.extend(summary.outcomes)
    return outcomes


def republish_deferred(config: SparkSbConfig, wanted: Mapping[str, Sequence[int]], *,
                       syphon: Syphon | None = None, replay: bool = False) -> list[Outcome]:
    """:func:`republish_received` for the deferred backlog messages with these sequence numbers
    (``{queue: sequence numbers}``) that are still there, peeked first."""
    found: dict[str, list[Any]] = {}
    for queue, numbers in wanted.items():
        with shared_namespace(config, "secondary").receiver(queue) as receiver:
            found[queue] = peek_deferred(receiver, sorted(set(numbers)))
    return republish_received(config, found, syphon=syphon, replay=replay)


def settle_outcomes(config: SparkSbConfig, outcomes: Sequence[Outcome], *, lock_wait: float = 330.0,
                    outage_wait: float = 120.0, clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep) -> int:
    """Settle the deferred backlog messages of recorded outcomes: complete the delivered and re-parked ones,
    dead-letter the others with their reason and description. A message no longer there was settled by an
    earlier attempt. One still locked by an earlier attempt that died is waited for until its lock expires
    (at most ``lock_wait`` seconds, longer than the service's 5 minute maximum lock), then
    :class:`SyphonSettleError`. A secondary that does not answer (a lost connection, a timeout, busy) is tried
    again with backoff for up to ``outage_wait`` seconds in a row, then its error is raised: a blip does not
    fail the batch (in local mode, the query). Returns how many this call settled."""
    by_queue: dict[str, dict[int, Outcome]] = {}
    for outcome in outcomes:
        if outcome.sequence_number is not None and outcome.outcome in (*_COMPLETE, _DEAD_LETTER):
            by_queue.setdefault(outcome.backlog_queue, {})[outcome.sequence_number] = outcome
    settled = 0
    for queue, pending in by_queue.items():
        state = _Settling(pending, lock_wait)
        blips = RetryFor(outage_wait, ExponentialBackoff(0.5, 5.0), clock=clock, sleep=sleep)
        blips.call(functools.partial(_settle_queue, config, queue, state, clock, sleep), is_blip,
                   what=f"settling {len(pending)} backlog messages of {queue!r}")
        settled += state.settled
    return settled


@dataclass
class _Settling:
    """What :func:`settle_outcomes` has left to do on one backlog queue, kept across the tries of a blip."""

    pending: dict[int, Outcome]
    lock_wait: float
    settled: int = 0
    #: a first try completes as if every message were there (nothing peeked); a later one peeks first
    first: bool = True
    #: when messages locked by an earlier attempt stop being waited for (set when first seen locked)
    deadline: float | None = None
    pause: float = 1.0


def _settle_queue(config: SparkSbConfig, queue: str, state: _Settling, clock: Callable[[], float],
                  sleep: Callable[[float], None]) -> None:
    """:func:`settle_outcomes` for one backlog queue, one try; ``state`` keeps what is pending across tries."""
    pending = state.pending
    namespace = shared_namespace(config, "secondary", retries=False)
    while pending:
        bulk_first, state.first = state.first, False  # a try that fails part way may have settled some
        done = sorted(n for n, o in pending.items() if o.outcome != _DEAD_LETTER)
        for number in complete_deferred(namespace, queue, done, bulk_first=bulk_first):
            pending.pop(number)
            state.settled += 1
        doomed = sorted(n for n, o in pending.items() if o.outcome == _DEAD_LETTER)
        with namespace.receiver(queue) as receiver:
            # dead-letter in peek-lock, one request each
            for message in receive_deferred(receiver, doomed):
                outcome = pending.pop(int(message.sequence_number))
                receiver.dead_letter_message(message, reason=outcome.reason,
                                             error_description=outcome.description or outcome.reason)
                state.settled += 1
            if pending:  # gone: settled by an earlier attempt; still there: locked by one
                there = {int(m.sequence_number) for m in peek_deferred(receiver, list(pending))}
                for number in [n for n in pending if n not in there]:
                    pending.pop(number)
        if not pending:
            break
        if state.deadline is None:  # locked by an earlier attempt: wait for the locks to expire
            state.deadline = clock() + state.lock_wait
            _LOGGER.warning("%d backlog messages of %r are still locked by an earlier attempt; waiting "
                            "for their locks to expire", len(pending), queue)
        elif clock() >= state.deadline:
            raise SyphonSettleError(queue, sorted(pending))
        sleep(state.pause)
        state.pause = min(state.pause * 2, 10.0)


class SyphonSettleError(SparkSbError):
    """Backlog messages stayed locked longer than any lock lasts: the batch fails and is replayed."""

    def __init__(self, queue: str, sequence_numbers: Sequence[int]) -> None:
        shown = ", ".join(str(n) for n in sequence_numbers[:10]) + (" ..." if len(sequence_numbers) > 10 else "")
        super().__init__(f"backlog queue {queue!r}: {len(sequence_numbers)} messages (sequence numbers {shown}) "
                         "stayed locked; the batch will be replayed")
        self.queue = queue
        self.sequence_numbers = list(sequence_numbers)
