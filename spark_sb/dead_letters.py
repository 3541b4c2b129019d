"""The dead-letter round trip's last step: remove exactly the dead-lettered messages that were sent again.

A notebook reads a dead-letter queue in batch (``spark.read.format("servicebus")`` with ``entity:
orders/$DeadLetterQueue``: a peek, nothing taken away), fixes the rows it wants, writes them back to the entity,
and then calls :func:`remove` with the rows it resent. Each row names its message by the batch read's columns
``namespace``, ``entity`` and ``sequence_number``::

    resent = fixed.select("namespace", "entity", "sequence_number").collect()
    spark_sb.dead_letters.remove("conf/local.yaml", resent)      # removed 3, not found 0, left 0

The primary and the secondary number their messages each on their own, so the same sequence number names a
different message on each (a read of ``namespaces=primary,secondary`` returns both): a message is named by all
three fields. Rows may be pyspark Rows, mappings, :class:`DeadLettered` or ``(namespace, entity,
sequence_number)`` tuples; a row that lacks a field, or whose namespace is neither primary nor secondary, is
refused (:class:`~spark_sb.errors.ConfigError` naming the field and the value) before anything is removed. Bare sequence numbers are taken only with the namespace they belong to:
``remove(conf, "orders", [17, 18], namespace="primary")``.

Service Bus fetches a dead-lettered message only by receiving it (a sequence number fetches deferred messages
only), and a message given back (abandoned) is available again at once, at its place in sequence-number order.
For each dead-letter queue, :func:`remove`

1. **peeks** (nothing locked) from the smallest number asked for, jumping to the next number asked for after each
   page: a message asked for that is not there is **missing** (removed already, or never there: calling twice
   removes nothing more);
2. **receives once** in peek-lock, in sequence-number order: it completes the messages asked for and holds the
   lock of every other one it receives, since a message given back would be the next one received. One receiver
   therefore reaches at most as deep as it receives within one lock duration (the entity's: 60 s by default, at
   most 5 min). The pass stops when it has every message asked for that is there, when it has passed the highest,
   before the oldest lock it holds runs out (watching its ``locked_until_utc``, with a margin of twice the slowest
   receive so far), after :data:`MOST_HELD` held messages, or when what is left of ``timeout`` is only enough to
   give back what it holds (a settlement each, as long as a complete took, or until their locks run out anyway);
3. **gives back** the held messages, the newest locks first; one whose lock has run out (or went with its link) is
   available again anyway and is counted, not retried;
4. **peeks again** at the messages asked for that it did not remove: one still there is **left**
   (:attr:`Removed.left`: locked by another receiver, deferred, or deeper than one lock duration lets a receiver
   go), one gone is missing. One warning line per dead-letter queue says why messages were left and what to do
   (never a line per message).

Nothing is removed that was not asked for. The call returns within ``timeout`` (plus at most
:data:`GIVE_BACK_GRACE` to give back what it holds, and one request). What it keeps: the sequence numbers asked
for, and the SDK's message objects of the held messages (needed to give them back), at most :data:`MOST_HELD`.

Spark-free: it runs on the driver, through the process's namespaces (:mod:`spark_sb.bus`); a pyspark Row is read
through its ``asDict()``, without importing pyspark.
"""

from __future__ import annotations

import bisect
import datetime
import logging
import math
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from .bus import shared_namespace
from .config import DEAD_LETTER_SUFFIX, SparkSbConfig, entity_path, load_config, split_dead_letter, unsendable
from .errors import (
    ENCODING_ERRORS,
    BadMessageError,
    ConfigError,
    as_spark_sb_error,
    is_link_gone,
    is_lock_lost,
    redact,
)

_LOGGER = logging.getLogger(__name__)

__all__ = ["DEFAULT_TIMEOUT", "GIVE_BACK_GRACE", "MOST_HELD", "DeadLettered", "Removed", "Resent", "remove", "resend"]

#: messages per receive, and at most per peek
_PAGE = 250
#: the most messages one pass holds locked (their SDK message objects are kept until they are given back)
MOST_HELD = 50_000
#: seconds :func:`remove` spends at most, by default
DEFAULT_TIMEOUT = 300.0
#: seconds after ``timeout`` spent at most on giving back the held messages (those not given back by then are
#: available again when their locks run out)
GIVE_BACK_GRACE = 5.0
#: seconds the oldest held lock must have left when a receive starts, on top of twice the slowest receive so far
_LOCK_MARGIN = 0.5
#: a receive is not started with less time than this to wait
_LEAST_WAIT = 0.05
_Side = Literal["primary", "secondary"]
_FIELDS = ("namespace", "entity", "sequence_number")

#: the clocks (injectable): time for the deadlines, and UTC now for the locks' ``locked_until_utc``
_monotonic = time.monotonic


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class DeadLettered(NamedTuple):
    """One dead-lettered message: its namespace (``primary`` or ``secondary``), the queue or
    ``topic/subscriptions/name`` whose dead-letter queue holds it, and its sequence number there."""

    namespace: str
    entity: str
    sequence_number: int


@dataclass(frozen=True)
class Removed:
    """What :func:`remove` did with the messages asked for, each sorted by namespace, entity and number:
    ``removed``; ``missing``: not there (removed already, or never there); ``left``: there, and not removed
    (locked by another receiver, deferred, deeper than one lock duration lets a receiver go, or not reached before
    the timeout): ask again later, see the warning logged."""

    removed: tuple[DeadLettered, ...] = ()
    missing: tuple[DeadLettered, ...] = ()
    left: tuple[DeadLettered, ...] = ()

    def __str__(self) -> str:
        return f"removed {len(self.removed)}, not found {len(self.missing)}, left {len(self.left)}"


def remove(conf: str | os.PathLike[str] | Mapping[str, Any] | SparkSbConfig, messages: Iterable[Any] | str,
           sequence_numbers: Iterable[int] | None = None, *,
           namespace: Literal["primary", "secondary"] | None = None, receive_wait: float = 1.0,
           timeout: float = DEFAULT_TIMEOUT) -> Removed:
    """Remove these dead-lettered messages from their dead-letter queues, and nothing else.

    ``messages``: the messages, each naming ``namespace`` (primary or secondary), ``entity`` (a queue or
    ``topic/subscriptions/name``, as the batch read's ``entity`` column gives it; ``/$DeadLetterQueue`` may be
    written or not) and ``sequence_number``: pyspark Rows, mappings, :class:`DeadLettered` or 3-tuples in that
    order. The older form ``remove(conf, entity, sequence_numbers, namespace=...)`` names one entity and bare
    numbers, and needs ``namespace``: the same numbers name other messages on the other namespace.
    ``receive_wait``: seconds a receive waits for the next message before the dead-letter queue counts as read
    through. ``timeout``: seconds after which it stops, gives back what it holds and reports what it left.

    A message is refused (:class:`ConfigError` naming the field and the value) before anything is removed. An
    error of Service Bus is raised as :func:`~spark_sb.errors.as_spark_sb_error` classifies it."""
    config = load_config(conf)
    wait = _seconds("receive_wait", receive_wait)
    budget = _seconds("timeout", timeout)
    groups = _groups(messages, sequence_numbers, namespace)
    deadline = _monotonic() + budget
    removed: list[DeadLettered] = []
    missing: list[DeadLettered] = []
    left: list[DeadLettered] = []
    for (side, entity), wanted in groups.items():
        done = _Pass(config, side, entity, wanted, deadline, wait, budget).run(len(removed))
        removed.extend(DeadLettered(side, entity, n) for n in done.removed)
        missing.extend(DeadLettered(side, entity, n) for n in done.missing)
        left.extend(DeadLettered(side, entity, n) for n in done.left)
    result = Removed(tuple(sorted(removed)), tuple(sorted(missing)), tuple(sorted(left)))
    _LOGGER.info("dead letters of %d entities: %s", len(groups), result)
    return result


# --- what the caller asked for ------------------------------------------------------------------------------


def _seconds(option: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ConfigError(option, "must be a positive number of seconds", repr(value))
    return float(value)


def _groups(messages: Any, sequence_numbers: Any, namespace: Any) -> dict[tuple[_Side, str], set[int]]:
    """The sequence numbers asked for per (namespace, entity), every message checked first."""
    if isinstance(messages, str) or sequence_numbers is not None:
        return _entity_and_numbers(messages, sequence_numbers, namespace)
    if namespace is not None:
        raise ConfigError("namespace", "is named by each message: give namespace only with an entity and bare "
                                       "sequence numbers", repr(namespace))
    if callable(getattr(type(messages), "toLocalIterator", None)):
        raise ConfigError("messages", "is a DataFrame: pass its rows, e.g. df.select('namespace', 'entity', "
                                      "'sequence_number').collect()")
    if isinstance(messages, Mapping) or not isinstance(messages, Iterable):
        raise ConfigError("messages", "must be an iterable of messages (rows, mappings or (namespace, entity, "
                                      "sequence_number) tuples)", type(messages).__name__)
    groups: dict[tuple[_Side, str], set[int]] = {}
    for index, item in enumerate(messages):
        side, entity, number = _message(item, index)
        groups.setdefault((side, entity), set()).add(number)
    return groups


def _entity_and_numbers(entity: Any, sequence_numbers: Any, namespace: Any) -> dict[tuple[_Side, str], set[int]]:
    """The older form: one entity, bare sequence numbers, and the namespace they belong to."""
    if namespace is None:
        raise ConfigError("namespace", "must be given with bare sequence numbers: the primary and the secondary "
                                       "number their messages each on their own, so a number alone may name a "
                                       "message of either; pass namespace='primary' or 'secondary', or pass the "
                                       "batch read's rows (namespace, entity, sequence_number)")
    if sequence_numbers is None:
        raise ConfigError("sequence_numbers", "must be given with an entity")
    if isinstance(sequence_numbers, str | bytes) or not isinstance(sequence_numbers, Iterable):
        raise ConfigError("sequence_numbers", "must be an iterable of whole numbers", repr(sequence_numbers))
    side = _namespace(namespace, "namespace")
    base = _entity(entity, "entity")
    return {(side, base): {_number(n, "sequence_numbers") for n in sequence_numbers}}


def _message(item: Any, index: int) -> tuple[_Side, str, int]:
    """``(namespace, entity, sequence_number)`` of one message: a Row (``asDict()``), a mapping, a named tuple or
    an object with the three attributes, or a plain 3-tuple in that order."""
    where = f"messages[{index}]"
    if isinstance(item, str | bytes) or hasattr(type(item), "__index__"):
        raise ConfigError(f"{where}.namespace", "is not named: a bare sequence number or name is not a message (the "
                                                "same numbers exist on the primary and the secondary); pass rows "
                                                "with namespace, entity and sequence_number", repr(item))
    fields: Mapping[str, Any]
    if isinstance(item, Mapping):
        fields = item
    elif callable(getattr(item, "asDict", None)):  # a pyspark Row
        fields = item.asDict()
    elif isinstance(item, tuple) and hasattr(item, "_asdict"):
        fields = item._asdict()
    elif isinstance(item, tuple | list):
        if len(item) != len(_FIELDS):
            raise ConfigError(where, "must be (namespace, entity, sequence_number)", repr(item))
        fields = dict(zip(_FIELDS, item, strict=True))
    else:
        fields = {name: getattr(item, name) for name in _FIELDS if hasattr(item, name)}
    for name in _FIELDS:
        if name not in fields:
            has = ", ".join(str(k) for k in fields) or "no fields"
            raise ConfigError(f"{where}.{name}", f"is missing (the message has {has}); select the batch read's "
                                                 "namespace, entity and sequence_number")
    return (_namespace(fields["namespace"], f"{where}.namespace"), _entity(fields["entity"], f"{where}.entity"),
            _number(fields["sequence_number"], f"{where}.sequence_number"))


def _namespace(value: Any, option: str) -> _Side:
    side = value.strip().lower() if isinstance(value, str) else value
    if side == "primary":
        return "primary"
    if side == "secondary":
        return "secondary"
    raise ConfigError(option, "must be primary or secondary", repr(value))


def _entity(value: Any, option: str) -> str:
    """The queue or subscription whose dead-letter queue it is (the suffix taken off)."""
    if not isinstance(value, str):
        raise ConfigError(option, "must name a queue or a subscription as 'topic/subscriptions/name'", repr(value))
    return entity_path(split_dead_letter(value.strip())[0], option)


def _number(value: Any, option: str) -> int:
    try:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(value)
        return int(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(option, "must be a whole number", repr(value)) from None


# --- one dead-letter queue ----------------------------------------------------------------------------------


@dataclass
class _Done:
    """The sequence numbers of one dead-letter queue: removed, missing, left."""

    removed: list[int] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    left: list[int] = field(default_factory=list)


@dataclass
class _GivenBack:
    """What giving back the held messages did: abandoned, found with their lock run out (available again
    anyway), and whether the link went (every lock with it)."""

    back: int = 0
    ran_out: int = 0
    link_gone: bool = False


class _GiveBackLinkGone(Exception):
    """The link went while giving back: the held locks went with it. Raised inside the receiver's ``with`` block
    so that the layer forgets that receiver; caught outside it."""


@dataclass
class _Receipt:
    """What the receive pass did."""

    removed: list[int] = field(default_factory=list)
    #: the messages received and not asked for, locked, the oldest first
    held: dict[int, Any] = field(default_factory=dict)
    #: why it stopped: done (nothing more asked for), read through (nothing more to receive), passed (the highest
    #: asked for), lock (the oldest lock held near its end), cap (MOST_HELD held), timeout
    stop: str = "done"
    #: the highest sequence number it received (0: none)
    deepest: int = 0
    #: seconds a lock lasted, as the first page showed (0: not known)
    lock_seconds: float = 0.0
    started: float = 0.0
    stopped: float = 0.0


class _Pass:
    """Removing the messages asked for from one dead-letter queue (see the module's docstring)."""

    def __init__(self, config: SparkSbConfig, side: _Side, entity: str, wanted: set[int], deadline: float,
                 receive_wait: float, budget: float) -> None:
        self.config, self.side, self.entity = config, side, entity
        self.path = entity + DEAD_LETTER_SUFFIX
        self.wanted = wanted
        self.deadline, self.receive_wait, self.budget = deadline, receive_wait, budget
        self.where = f"{side} {getattr(config, side).fully_qualified_namespace}"

    def run(self, removed_before: int) -> _Done:
        done = _Done()
        if not self.wanted:
            return done
        if _monotonic() >= self.deadline:
            done.left = sorted(self.wanted)
            _LOGGER.warning("dead-letter queue of %r on the %s: %d messages asked for left untouched: the timeout "
                            "(%.0f s) ran out before it was reached; call remove again with Removed.left",
                            self.entity, self.side, len(done.left), self.budget)
            return done
        receipt = _Receipt()
        given = _GivenBack()
        done.missing = sorted(n for n in self.wanted if n < 1)  # Service Bus numbers its messages from 1
        numbers = sorted(n for n in self.wanted if n >= 1)
        unlooked: set[int] = set()
        try:
            with shared_namespace(self.config, self.side).receiver(self.path) as receiver:
                present, unlooked = _peek_present(receiver, numbers, self.deadline)
                done.missing += [n for n in numbers if n not in present and n not in unlooked]
                if present:
                    try:
                        self._receive(receiver, set(present), receipt)
                    finally:
                        given = self._give_back(receiver, receipt.held)
                    if given.link_gone:
                        raise _GiveBackLinkGone
                done.removed = sorted(receipt.removed)
                unremoved = sorted(present - set(receipt.removed))
                # still there? one removed by someone else in the meantime is missing, not left
                still, unchecked = _peek_present(receiver, unremoved, self.deadline + GIVE_BACK_GRACE)
                done.missing += [n for n in unremoved if n not in still and n not in unchecked]
                done.left = sorted({*still, *unchecked, *unlooked})
        except _GiveBackLinkGone:
            done.removed = sorted(receipt.removed)
            done.left = sorted(self.wanted - set(receipt.removed) - set(done.missing))
        except Exception as exc:
            converted = as_spark_sb_error(exc, namespace=self.where, entity=self.path)
            _LOGGER.error("removing dead-lettered messages of %r on the %s stopped after %d removed there (%d in "
                          "all): %s", self.entity, self.where, len(receipt.removed),
                          removed_before + len(receipt.removed), type(exc).__name__)
            if converted is None:
                raise
            raise converted from exc
        done.missing.sort()
        self._report(done, receipt, given, unlooked)
        return done

    def _receive(self, receiver: Any, pending: set[int], receipt: _Receipt) -> None:
        """One pass in peek-lock from the front: complete what is asked for, hold the rest (see the module),
        recorded in ``receipt`` as it goes."""
        receipt.started = _monotonic()
        held = receipt.held
        highest = max(pending)
        slowest = 0.0  # the slowest receive so far
        settled, settling = 0, 0.0  # completes so far, and the seconds they took
        try:
            while pending:
                now = _monotonic()
                wait, bound = self.receive_wait, "read through"
                # time to give back what it holds before the timeout: a settlement each, as long as a complete
                # took (a receive, before the first complete), and no longer than their locks last anyway
                reserve = 0.0
                if held:
                    reserve = min(len(held) * (settling / settled if settled else slowest),
                                  max(_lock_left(next(reversed(held.values()))), 0.0))
                if self.deadline - reserve - now < wait:
                    wait, bound = self.deadline - reserve - now, "timeout"
                if len(held) >= MOST_HELD:
                    receipt.stop = "cap"
                    break
                if held:
                    room = _lock_left(next(iter(held.values()))) - _LOCK_MARGIN - 2 * slowest
                    if room < wait:
                        wait, bound = room, "lock"
                if wait < min(_LEAST_WAIT, self.receive_wait):
                    receipt.stop = bound
                    break
                before = _utcnow()
                page = receiver.receive_messages(max_message_count=min(_PAGE, MOST_HELD - len(held)),
                                                 max_wait_time=wait)
                slowest = max(slowest, _monotonic() - now)
                if not page:
                    receipt.stop = bound
                    break
                if not receipt.lock_seconds and page[0].locked_until_utc is not None:
                    receipt.lock_seconds = (page[0].locked_until_utc - before).total_seconds()
                again = False
                for message in page:
                    number = int(message.sequence_number)
                    receipt.deepest = max(receipt.deepest, number)
                    if number in pending:
                        settle_started = _monotonic()
                        try:
                            receiver.complete_message(message)
                        except Exception as exc:
                            if not is_lock_lost(exc):
                                raise
                            again = True  # its lock ran out before it was completed: it is there again
                            continue
                        settled, settling = settled + 1, settling + _monotonic() - settle_started
                        pending.discard(number)
                        receipt.removed.append(number)
                        if number == highest and pending:
                            highest = max(pending)
                    else:
                        # received again: a lock held ran out (the margin was not enough); stop here
                        again = held.pop(number, None) is not None or again
                        held[number] = message
                if again:
                    receipt.stop = "lock"
                    break
                if pending and receipt.deepest >= highest:
                    receipt.stop = "passed"
                    break
        finally:
            receipt.stopped = _monotonic()

    def _give_back(self, receiver: Any, held: dict[int, Any]) -> _GivenBack:
        """Abandon the held messages, the newest locks first (the oldest run out first by themselves), until
        ``timeout`` plus :data:`GIVE_BACK_GRACE`."""
        until = max(self.deadline, _monotonic()) + GIVE_BACK_GRACE
        given = _GivenBack()
        for message in reversed(held.values()):
            if _monotonic() >= until:
                break
            if _lock_left(message) <= 0:
                given.ran_out += 1
                continue
            try:
                receiver.abandon_message(message)
            except Exception as exc:
                if is_lock_lost(exc):
                    given.ran_out += 1
                    continue
                if is_link_gone(exc):  # every held lock went with the link: all available again
                    _LOGGER.warning("giving back %d dead-lettered messages of %r on the %s: the link went (%s); "
                                    "they are available again", len(held) - given.back, self.entity, self.side,
                                    type(exc).__name__)
                    given.link_gone = True
                    return given
                raise
            given.back += 1
        return given

    def _report(self, done: _Done, receipt: _Receipt, given: _GivenBack, unlooked: set[int]) -> None:
        """One line: INFO when nothing asked for is left, else WARNING saying why and what to do."""
        held = len(receipt.held)
        back, ran_out = given.back, given.ran_out
        kept = 0 if given.link_gone else held - back - ran_out
        summary = (f"dead-letter queue of {self.entity!r} on the {self.side}: removed {len(done.removed)}, not "
                   f"found {len(done.missing)}, left {len(done.left)}")
        if receipt.started:
            summary += (f"; received {held} others down to sequence number {receipt.deepest} in "
                        f"{receipt.stopped - receipt.started:.1f} s and held them ({receipt.stop})")
        if held:
            summary += f"; {back} given back, {ran_out} available again as their locks had run out"
            if kept:
                summary += f", {kept} not given back in time (available when their locks run out)"
        if not done.left:
            _LOGGER.info("%s", summary)
            return
        looked = [n for n in done.left if n not in unlooked]
        stopped_short = receipt.stop in ("lock", "cap", "timeout")
        beyond = sum(1 for n in looked if n > receipt.deepest) if stopped_short else 0
        passed = len(looked) - beyond
        reasons = []
        if passed:
            reasons.append(f"{passed} were there but not received: locked by another receiver (or deferred); call "
                           "remove again with Removed.left once that receiver has let go")
        if beyond and receipt.stop == "lock":
            lock = f"about {receipt.lock_seconds:.0f} s" if receipt.lock_seconds else "the entity's"
            reasons.append(f"{beyond} lie deeper than one receiver gets: it must hold the lock of every message in "
                           f"front of them, and stopped before the oldest lock ran out (lock duration {lock}). "
                           f"Raise the lock duration of {self.entity!r} (at most 5 min) and call remove again "
                           "with Removed.left, or first take the messages in front of them out of the dead-letter "
                           "queue")
        elif beyond and receipt.stop == "cap":
            reasons.append(f"{beyond} lie deeper than the {MOST_HELD} messages one pass holds; first take the "
                           "messages in front of them out of the dead-letter queue")
        elif beyond:
            reasons.append(f"{beyond} were not reached before the timeout ({self.budget:.0f} s; the pass stops in "
                           "time to give back what it holds); call remove again with Removed.left and a longer "
                           "timeout")
        if unlooked:
            reasons.append(f"{len(unlooked)} were not looked for before the timeout ({self.budget:.0f} s) ran out")
        _LOGGER.warning("%s. %s", summary, "; ".join(reasons))


def _peek_present(receiver: Any, numbers: list[int], deadline: float) -> tuple[set[int], set[int]]:
    """Which of ``numbers`` (sorted, each at least 1) are in the queue, peeked from the smallest, jumping to the
    next number asked for after each page: ``(there, not looked for before the deadline)``. Nothing is locked."""
    wanted = set(numbers)
    there: set[int] = set()
    i = 0
    while i < len(numbers):
        if _monotonic() >= deadline:
            return there, set(numbers[i:])
        start = numbers[i]
        # sequence numbers are unique: every message from start up to the last number asked for within a page's
        # reach fits in one page of that span
        last = numbers[bisect.bisect_right(numbers, start + _PAGE - 1, i) - 1]
        page = receiver.peek_messages(max_message_count=last - start + 1, sequence_number=start)
        if not page:
            break
        there.update(n for n in (int(m.sequence_number) for m in page) if n in wanted)
        i = bisect.bisect_right(numbers, int(page[-1].sequence_number), i)
    return there, set()


def _lock_left(message: Any) -> float:
    """Seconds until the lock of ``message`` runs out, by this machine's clock (as the SDK's own check)."""
    until = message.locked_until_utc
    return math.inf if until is None else (until - _utcnow()).total_seconds()


# --- resend: send the fixed rows to the primary, then remove exactly what it accepted -----------------------

#: rows sent per call to the primary
_RESEND_CHUNK = 250


@dataclass(frozen=True)
class Resent:
    """What :func:`resend` did: ``sent``, the dead-lettered messages whose rows the primary accepted;
    ``rejected``, those whose row could not be sent (``(message, reason)``: a bad row, a subscription as the
    destination, the primary refusing or unavailable), which stay in their dead-letter queue; ``removed``, what
    :func:`remove` then did with ``sent``."""

    sent: tuple[DeadLettered, ...]
    rejected: tuple[tuple[DeadLettered, str], ...]
    removed: Removed

    def __str__(self) -> str:
        return f"sent {len(self.sent)}, rejected {len(self.rejected)}; {self.removed}"


def resend(conf: str | os.PathLike[str] | Mapping[str, Any] | SparkSbConfig, rows: Any, *, to: str | None = None,
           timeout: float = DEFAULT_TIMEOUT) -> Resent:
    """The dead-letter round trip in one call: send each row to the primary, then :func:`remove` exactly the
    dead-lettered messages whose rows the primary accepted.

    ``rows``: a DataFrame of a batch read of dead-letter queues (fixed as needed) or its Rows, with the
    columns ``namespace``, ``entity`` and ``sequence_number`` naming the dead-lettered message and the message
    columns of the ``servicebus`` writer (``body``, ``message_id``, ``application_properties`` with
    ``application_property_types``, ``time_to_live_ms``...). A DataFrame is read once, a partition at a time
    (``toLocalIterator``): what is removed is what was read and sent, never what a second read would find.
    ``to``: where the rows go (a queue or a topic); by default each row's ``entity``, which must then be a
    queue (a subscription takes no message: give its topic as ``to``).

    Sent to the primary only, without failover: a row the primary does not accept (a bad row, an outage) is in
    :attr:`Resent.rejected` with why, and its message stays in the dead-letter queue to be resent later.
    Give the rows a new ``message_id`` that is the same on every run (e.g. derived from the sequence number):
    with duplicate detection, the original id is still in the entity's window."""
    from .sink import message_for_row

    config = load_config(conf)
    primary = shared_namespace(config, "primary")
    iterator = rows.toLocalIterator() if hasattr(rows, "toLocalIterator") else iter(rows)
    sent: list[DeadLettered] = []
    rejected: list[tuple[DeadLettered, str]] = []
    chunk: dict[str, list[tuple[DeadLettered, Any]]] = {}
    index = 0
    unavailable: str | None = None
    for row in iterator:
        values = row.asDict(recursive=True) if hasattr(row, "asDict") else dict(row)
        side, entity, number = _message(values, index)
        index += 1
        key = DeadLettered(side, entity, number)
        destination = to or entity
        problem = unsendable(destination)
        if problem is not None:
            rejected.append((key, f"the destination {destination!r} {problem} (give resend(..., to=topic))"))
            continue
        if unavailable is not None:
            rejected.append((key, unavailable))
            continue
        try:
            message = message_for_row(values)
        except ENCODING_ERRORS as err:
            rejected.append((key, f"cannot build the message: {err}"))
            continue
        pending = chunk.setdefault(destination, [])
        pending.append((key, message))
        if len(pending) >= _RESEND_CHUNK:
            unavailable = _send_chunk(primary, destination, chunk.pop(destination), sent, rejected)
    for destination, pending in chunk.items():
        if unavailable is not None:
            rejected.extend((key, unavailable) for key, _ in pending)
        else:
            unavailable = _send_chunk(primary, destination, pending, sent, rejected)
    removed = remove(config, sent, timeout=timeout) if sent else Removed()
    result = Resent(tuple(sent), tuple(rejected), removed)
    (_LOGGER.warning if rejected or removed.left else _LOGGER.info)("dead-letter resend: %s", result)
    return result


def _send_chunk(primary: Any, destination: str, pending: list[tuple[DeadLettered, Any]], sent: list[DeadLettered],
                rejected: list[tuple[DeadLettered, str]]) -> str | None:
    """Send ``pending`` to ``destination`` on the primary; record what it accepted in ``sent`` and what it did
    not in ``rejected``. Returns why the primary is unavailable (then the caller sends nothing more), or None."""
    from .bus.batches import PartialSend, send_batches

    try:
        send_batches(primary, destination, [message for _, message in pending], destination)
    except PartialSend as partial:
        sent.extend(key for key, _ in pending[:partial.sent])
        reason = redact(f"the primary did not accept it ({type(partial.error).__name__}: {partial.error})")[:300]
        rejected.extend((key, reason) for key, _ in pending[partial.sent:])
        return reason
    except BadMessageError:
        if len(pending) == 1:
            raise
        for one in pending:  # find the bad one: the others are sent
            try:
                _send_chunk(primary, destination, [one], sent, rejected)
            except BadMessageError as bad:
                rejected.append((one[0], bad.reason))
        return None
    sent.extend(key for key, _ in pending)
    return None
