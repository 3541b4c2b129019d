"""The receiving side of active and passive replication in plain Python (behaviour.md, "Active and passive
replication"): :class:`DedupeReceiver` reads one entity on both namespaces in peek-lock and suppresses the
second copy of a message by ``message_id`` within a bounded, durable window.

The contract
------------
* :meth:`~DedupeReceiver.receive_messages` returns each message id once. A copy whose id is in the window
  (completed earlier, by this receiver or by one that used the same ``state_path`` before a restart) is
  completed and dropped, never returned. A copy whose id is *in flight* (returned, not settled yet) is held:
  not returned and not settled, its lock kept. Pings (content type ``application/vnd.ms-servicebus-ping``)
  are completed and never returned. A message without a ``message_id`` is returned as it is: it cannot be
  de-duplicated (logged once per receiver).
* :meth:`~DedupeReceiver.complete_message` completes a message on the namespace it came from, records its id
  in the window (committed before it returns) and completes the held copies of that id.
  :meth:`~DedupeReceiver.abandon_message` abandons it and clears its in-flight mark: a held copy, or the
  abandoned message's redelivery, is returned by a later call.
* A namespace whose receive fails for an outage (down, busy, timed out) is logged (redacted) and skipped for
  the rest of that call; its receiver is rebuilt on the next call. One namespace down never stops the other.
  Only when every namespace failed in one call does it raise :class:`ReceiveUnavailableError` (a
  :class:`~spark_sb.errors.ReplicationError`) naming each namespace and its error. A configuration failure
  (the entity missing on a namespace, a rejected credential) raises at once, as
  :func:`~spark_sb.errors.as_spark_sb_error` names it: retrying cannot help.

Every returned message must be completed or abandoned through this receiver (not through the SDK). Like the
SDK's receivers, one receiver is used by one thread at a time.

The window
----------
Microsoft's Standard-tier sample keeps the last 256 ids in memory and forgets them on restart. Here the window
is a time span (``window``, default 10 minutes: make it longer than the longest delay between the two copies
of a message, e.g. a passive sender's failover time plus the receiver's worst backlog) and the ids live in
SQLite at ``state_path``, so that a restart remembers them. ``state_path=None`` keeps them in an in-memory
database, which forgets them on restart (as the sample does). Ids are recorded with ``clock`` (epoch
seconds; injectable, so tests move time instead of sleeping). An id older than the window is forgotten at
once (lookups ignore it) and deleted by the pruning that :meth:`~DedupeReceiver.complete_message` runs at
most once a second of ``clock``, so the database holds about one window of ids; SQLite reuses the pages of
deleted rows. The file is written in WAL mode with ``synchronous=FULL``: a completed id is on disk when
:meth:`~DedupeReceiver.complete_message` returns. Rows are keyed by entity (case-insensitive, as Service Bus names are), so receivers
of different entities may share one file. The in-flight marks are in memory only: two processes reading the
same entity each return their own first copy (each sees the other's completed ids through a shared file).

An id is recorded when the caller completes a message even when the settlement itself fails (the lock was
lost, the namespace went down): the caller has processed that id, so the broker's redelivery of it is a
duplicate like any other copy. The settlement's error is still raised.

Choices
-------
* **Concurrent rounds.** Both namespaces are read at once, in rounds of at most :data:`ROUND_WAIT` seconds
  (each namespace's SDK receive waits up to the round's length, bounded by what is left of
  ``max_wait_time``): a call returns after the first round that yields something to return, so messages on
  one namespace are not kept waiting by the other's empty wait; ``max_wait_time=None`` waits 60 s, as the
  SDK does. A receiver the bus opened anew (first use, or rebuilt after a failure) is opened before its
  first round, outside the wait (the SDK counts opening the link against a receive's wait, which a short
  round would not cover): such a call may last longer than ``max_wait_time`` by the time it takes to open,
  at most the clients' ``try_timeout``.
* **max_message_count** bounds what one call returns. Each namespace is asked for up to that many; copies
  beyond it are kept locked and returned first by the next call, which then does not wait on the namespaces
  (a later copy of the same id joins them and is held). A kept copy whose lock ran out is forgotten (the
  broker delivers it again); a returned message whose lock ran out loses its in-flight mark, so a held copy
  can be returned. Locks are judged by the wall clock, as the SDK judges them, not by ``clock``.
* **One attempt per call.** The namespaces' clients run with ``retry_total=0`` and ``try_timeout=10``
  (:data:`DEFAULT_CLIENT_KWARGS`) unless ``client_kwargs`` say otherwise: the next call is the retry, and a
  namespace in an outage costs one connection attempt, not the SDK's backoff. A failed completion of a duplicate or a ping is logged: the broker delivers it again and it
  is dropped again.
* On :meth:`~DedupeReceiver.close`, held copies are abandoned (so the next receiver gets them at once rather
  than after their lock duration); messages returned and not settled are left to their locks.
"""

from __future__ import annotations

import datetime
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from azure.servicebus import ServiceBusReceivedMessage, ServiceBusReceiver
from azure.servicebus.exceptions import MessageLockLostError

from .. import messages as msgs
from ..bus import Namespace
from ..config import SparkSbConfig, entity_path, load_config, positive_duration
from ..durations import format_duration
from ..errors import (
    ConfigError,
    ErrorClass,
    ReplicationError,
    SparkSbError,
    as_spark_sb_error,
    classify,
    is_connection_lost,
    is_link_gone,
    is_lock_lost,
    redact,
)

_LOGGER = logging.getLogger(__name__)

__all__ = ["DEFAULT_CLIENT_KWARGS", "DEFAULT_WAIT", "NAMESPACE_NAMES", "ROUND_WAIT", "DedupeReceiver", "DedupeStats",
           "ReceiveUnavailableError"]

#: the namespaces of a configuration a receiver can read
NAMESPACE_NAMES = ("primary", "secondary")
#: the longest a round of receives waits (seconds): a call returns after the first round with something to return
ROUND_WAIT = 1.0
#: what ``max_wait_time=None`` waits (seconds), as the SDK's ``receive_messages`` does
DEFAULT_WAIT = 60.0
#: what the namespaces' ``ServiceBusClient`` get unless ``client_kwargs`` are given: one attempt (the next call
#: is the retry), and opening a receiver bounded to 10 s
DEFAULT_CLIENT_KWARGS: Mapping[str, Any] = {"retry_total": 0, "try_timeout": 10.0}
#: ``complete_message`` prunes the window at most this often (seconds of the receiver's clock)
PRUNE_EVERY = 1.0
_SCHEMA_VERSION = 1
_SQL_CHUNK = 500  # ids a lookup asks SQLite about at once (well below its limit on parameters)


class ReceiveUnavailableError(ReplicationError):
    """No namespace could be received from in one call of :meth:`DedupeReceiver.receive_messages`. Nothing
    was received, so the call can be repeated: each namespace's receiver is rebuilt.

    :ivar entity: the entity.
    :ivar errors: ``{"primary" | "secondary": the exception that side raised}``.
    """

    def __init__(self, entity: str, errors: Mapping[str, BaseException]) -> None:
        self.entity = entity
        self.errors = dict(errors)
        causes = "; ".join(f"{side}: {type(err).__name__}: {err}" for side, err in self.errors.items())
        names = " and ".join(self.errors)
        SparkSbError.__init__(self, redact(
            f"could not receive from entity {entity!r} on the {names} namespace{'s' if len(self.errors) > 1 else ''}"
            f" ({causes}); nothing was received, the call can be repeated"))


@dataclass(frozen=True)
class DedupeStats:
    """What a :class:`DedupeReceiver` did since it was opened (``returned``, ``duplicates_dropped``,
    ``pings``, ``without_message_id``, ``received`` per namespace: counts) and holds now (``held``: copies
    received and not returned, kept locked; ``in_flight``: ids returned and not settled; ``window``: ids in
    the database, including any older than the window not pruned yet)."""

    returned: int = 0
    duplicates_dropped: int = 0
    held: int = 0
    pings: int = 0
    without_message_id: int = 0
    in_flight: int = 0
    window: int = 0
    received: Mapping[str, int] = field(default_factory=dict)


@dataclass(eq=False)
class _Delivery:
    """One locked message and what settling it needs: the namespace it came from, the SDK receiver that
    delivered it and that receiver's epoch (see :meth:`DedupeReceiver._broken`)."""

    namespace: str
    epoch: int
    receiver: ServiceBusReceiver
    message: ServiceBusReceivedMessage
    key: str | None


def _message_key(message: ServiceBusReceivedMessage) -> str | None:
    """The window's key of a message's id (None when it has none): the id itself when it is text (as every
    Service Bus sender writes it), else its type and value, so that an int 5 is not the text "5"."""
    value: Any = message.message_id
    if value is None or value == "":
        return None
    return value if isinstance(value, str) else f"{type(value).__name__}:{value}"


def _lock_expired(message: ServiceBusReceivedMessage, now: datetime.datetime) -> bool:
    until = message.locked_until_utc
    return until is not None and until <= now


def _namespace_names(namespaces: object) -> tuple[str, ...]:
    if isinstance(namespaces, str) or not isinstance(namespaces, Iterable):
        raise ConfigError("namespaces", "must be a sequence of namespace names such as ('primary', 'secondary')",
                          repr(namespaces))
    names = tuple(namespaces)
    if not names:
        raise ConfigError("namespaces", "must name at least one of 'primary' and 'secondary'", repr(names))
    for name in names:
        if name not in NAMESPACE_NAMES:
            raise ConfigError("namespaces", "unknown namespace (expected 'primary' or 'secondary')", repr(name))
    if len(set(names)) != len(names):
        raise ConfigError("namespaces", "names a namespace twice", repr(names))
    return names


def _open_window(state_path: str | os.PathLike[str] | None) -> sqlite3.Connection:
    """The window's database (created when missing); a :class:`ConfigError` naming ``state_path`` when it
    cannot be opened or is not a window."""
    target = ":memory:" if state_path is None else os.fspath(state_path)
    db: sqlite3.Connection | None = None
    try:
        db = sqlite3.connect(target, check_same_thread=False)
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > _SCHEMA_VERSION:
            raise ConfigError("state_path", f"holds a window of schema version {version}, newer than this "
                              f"spark-sb's ({_SCHEMA_VERSION})", target)
        if state_path is not None:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.execute("PRAGMA busy_timeout=5000")
        with db:
            db.execute("CREATE TABLE IF NOT EXISTS seen (entity TEXT NOT NULL, message_id TEXT NOT NULL, "
                       "recorded_at REAL NOT NULL, namespace TEXT NOT NULL, PRIMARY KEY (entity, message_id)) "
                       "WITHOUT ROWID")
            db.execute("CREATE INDEX IF NOT EXISTS seen_by_time ON seen (entity, recorded_at)")
            db.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")
        return db
    except sqlite3.Error as err:
        if db is not None:
            db.close()
        raise ConfigError("state_path", f"cannot hold the de-duplication window (SQLite: {err})", target) from err
    except BaseException:
        if db is not None:
            db.close()
        raise


class DedupeReceiver:
    """Reads ``entity`` (a queue, or ``topic/subscriptions/name``) on each of ``namespaces`` (bus
    :class:`~spark_sb.bus.Namespace` objects by name, which it owns and closes) and returns each message id
    once within ``window`` (see the module docstring). Built by :meth:`from_config`; a context manager."""

    def __init__(self, namespaces: Mapping[str, Namespace], entity: str, *, window: str | float | datetime.timedelta = "10m",
                 state_path: str | os.PathLike[str] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.entity = entity_path(entity)
        self.window = positive_duration(window, "window")
        self._names = _namespace_names(namespaces)
        self._namespaces = dict(namespaces)
        self.state_path = None if state_path is None else os.fspath(state_path)
        self._clock = clock
        self._db = _open_window(state_path)
        self._db_entity = self.entity.lower()
        self._epochs = dict.fromkeys(self._names, 0)
        self._claims: dict[str, _Delivery] = {}  # id -> the copy returned (or about to be), not settled
        self._waiting: dict[str, list[_Delivery]] = {}  # id -> copies received and not returned, locked
        self._anonymous: list[_Delivery] = []  # messages without an id received beyond max_message_count
        self._returned: dict[str, _Delivery] = {}  # lock token -> a returned message not settled yet
        self._received = dict.fromkeys(self._names, 0)
        self._counts = {"returned": 0, "duplicates_dropped": 0, "pings": 0, "without_message_id": 0}
        self._last_prune: float | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._opened: dict[str, ServiceBusReceiver] = {}  # the receiver each namespace's worker opened last
        self.closed = False

    @classmethod
    def from_config(cls, conf: SparkSbConfig | Mapping[str, Any] | str | os.PathLike[str], entity: str, *,
                    window: str | float | datetime.timedelta = "10m", state_path: str | os.PathLike[str] | None = None,
                    namespaces: Sequence[str] = NAMESPACE_NAMES, clock: Callable[[], float] = time.time,
                    client_kwargs: Mapping[str, Any] | None = None) -> DedupeReceiver:
        """A receiver of ``entity`` on the ``namespaces`` of ``conf`` (a :class:`~spark_sb.config.SparkSbConfig`,
        a dict, or a YAML path, as :func:`~spark_sb.config.load_config` reads it). ``window``: a duration as
        :mod:`spark_sb.durations` reads it (``10m``, ``600s``, ``PT10M``, a number of seconds, a
        ``timedelta``); ``state_path``: the SQLite file of the window (None: in memory, forgotten on
        restart); ``clock``: epoch seconds; ``client_kwargs``: for each namespace's ``ServiceBusClient``
        (default :data:`DEFAULT_CLIENT_KWARGS`). Raises :class:`~spark_sb.errors.ConfigError` naming the
        argument and its value."""
        entity_path(entity)
        positive_duration(window, "window")
        names = _namespace_names(namespaces)
        config = load_config(conf)
        kwargs = dict(DEFAULT_CLIENT_KWARGS if client_kwargs is None else client_kwargs)
        sides = {name: Namespace(name, getattr(config, name), kwargs) for name in names}
        return cls(sides, entity, window=window, state_path=state_path, clock=clock)

    def __repr__(self) -> str:
        return (f"DedupeReceiver(entity={self.entity!r}, namespaces={self._names!r}, "
                f"window={format_duration(self.window)!r}, state_path={self.state_path!r})")

    def __enter__(self) -> DedupeReceiver:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # --- receiving -------------------------------------------------------------------------------------

    def receive_messages(self, max_message_count: int = 1,
                         max_wait_time: float | None = None) -> list[ServiceBusReceivedMessage]:
        """Up to ``max_message_count`` messages, each id once, waiting up to ``max_wait_time`` seconds for the
        first (None: :data:`DEFAULT_WAIT`, as the SDK). Raises :class:`ReceiveUnavailableError` when every
        namespace failed."""
        self._check_open()
        if isinstance(max_message_count, bool) or not isinstance(max_message_count, int) or max_message_count < 1:
            raise ConfigError("max_message_count", "must be a whole number of 1 or more", repr(max_message_count))
        if max_wait_time is not None and not max_wait_time > 0:
            raise ConfigError("max_wait_time", "must be more than 0 seconds, or None", repr(max_wait_time))
        self._expire_claims()
        out = self._promote(max_message_count)
        if out:
            return self._hand_out(out)
        deadline = time.monotonic() + (DEFAULT_WAIT if max_wait_time is None else max_wait_time)
        failed: dict[str, BaseException] = {}
        retried: set[str] = set()
        while True:
            live = [name for name in self._names if name not in failed]
            if not live:
                raise ReceiveUnavailableError(self.entity, failed)
            wait = min(ROUND_WAIT, deadline - time.monotonic())
            if wait <= 0:
                return []
            for name, failure in self._round(live, max_message_count, wait).items():
                # a link the service detached (idle for 10 minutes, or forced in an upgrade) fails its next
                # receive: the namespace is tried once more in this call, on a new link; a second failure is an
                # outage, and the namespace is left out of the call
                what = f"{type(failure).__name__}: {redact(str(failure))}"
                if name in retried:
                    failed[name] = failure
                    _LOGGER.warning("dedupe %s: the %s namespace failed again (%s); skipped for this call, its "
                                    "receiver is rebuilt on the next", self.entity, name, what)
                else:
                    retried.add(name)
                    _LOGGER.info("dedupe %s: the %s namespace failed (%s); trying it once more on a new link",
                                 self.entity, name, what)
            out = self._promote(max_message_count)
            if out:
                return self._hand_out(out)

    def _round(self, names: Sequence[str], count: int, wait: float) -> dict[str, BaseException]:
        """One receive on each of ``names`` at once; what they delivered is taken in. Returns the outages
        (each namespace marked broken); a configuration failure raises (after the other
        namespace's messages are taken in: they are returned by a later call)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=len(self._names), thread_name_prefix="spark-sb-dedupe")
        futures = [(name, self._epochs[name], self._pool.submit(self._receive_from, name, count, wait))
                   for name in names]
        failed: dict[str, BaseException] = {}
        for name, epoch, future in futures:
            try:
                receiver, received = future.result()
            except Exception as exc:
                self._broken(name, exc)
                failed[name] = exc
            else:
                self._take_in(name, epoch, receiver, received)
        for name, failure in failed.items():
            if classify(failure) is ErrorClass.OTHER:  # not a Service Bus failure: a bug, a closed handle
                raise failure
            error = as_spark_sb_error(failure, namespace=name, entity=self.entity)
            if error is not None:  # configuration: retrying cannot help
                raise error from failure
        return failed

    def _receive_from(self, name: str, count: int,
                      wait: float) -> tuple[ServiceBusReceiver, list[ServiceBusReceivedMessage]]:
        with self._namespaces[name].receiver(self.entity) as receiver:  # an error drops it: rebuilt on next use
            if self._opened.get(name) is not receiver:
                # The SDK counts opening the link against a receive's wait, and a round's wait is short: open a
                # new receiver first (the SDK's context-manager entry), bounded by the client's try_timeout.
                receiver.__enter__()
                self._opened[name] = receiver
            return receiver, receiver.receive_messages(max_message_count=count, max_wait_time=wait)

    def _take_in(self, name: str, epoch: int, receiver: ServiceBusReceiver,
                 received: Sequence[ServiceBusReceivedMessage]) -> None:
        """Sort what ``name`` delivered: pings and ids in the window are completed, the rest waits to be
        returned (behind the copy in flight, if any)."""
        self._received[name] += len(received)
        deliveries = [_Delivery(name, epoch, receiver, message, _message_key(message)) for message in received]
        seen = self._in_window(d.key for d in deliveries if d.key is not None)
        for delivery in deliveries:
            if msgs.is_ping(delivery.message):
                self._counts["pings"] += 1
                self._complete_quietly(delivery, "a ping")
            elif delivery.key is None:
                if not self._counts["without_message_id"]:
                    _LOGGER.warning("dedupe %s: a message without a message_id cannot be de-duplicated; such "
                                    "messages are returned as they are (logged once)", self.entity)
                self._counts["without_message_id"] += 1
                self._anonymous.append(delivery)
            elif delivery.key in seen:
                self._drop_duplicate(delivery)
            else:
                self._waiting.setdefault(delivery.key, []).append(delivery)

    def _promote(self, limit: int) -> list[_Delivery]:
        """Up to ``limit`` copies to return: the first live copy of each waiting id not in flight (marked in
        flight now), then messages without an id. Copies whose lock ran out or whose receiver was rebuilt
        are forgotten (the broker delivers them again); copies of an id found in the window are dropped."""
        now = datetime.datetime.now(datetime.UTC)
        free = [key for key in self._waiting if key not in self._claims]
        seen = self._in_window(free)
        out: list[_Delivery] = []
        for key in list(self._waiting):
            copies = [d for d in self._waiting.pop(key) if self._alive(d, now)]
            if key in self._claims:
                if copies:
                    self._waiting[key] = copies
                continue
            if key in seen:
                for delivery in copies:
                    self._drop_duplicate(delivery)
                continue
            if copies and len(out) < limit:
                self._claims[key] = copies.pop(0)
                out.append(self._claims[key])
            if copies:
                self._waiting[key] = copies
        self._anonymous = [d for d in self._anonymous if self._alive(d, now)]
        taken, self._anonymous = self._anonymous[:limit - len(out)], self._anonymous[limit - len(out):]
        return out + taken

    def _hand_out(self, deliveries: Sequence[_Delivery]) -> list[ServiceBusReceivedMessage]:
        for delivery in deliveries:
            self._returned[str(delivery.message.lock_token)] = delivery
        self._counts["returned"] += len(deliveries)
        return [d.message for d in deliveries]

    def _expire_claims(self) -> None:
        """A returned message whose lock ran out is no longer in flight: the broker delivers it again, and
        a held copy may be returned."""
        now = datetime.datetime.now(datetime.UTC)
        for key, delivery in list(self._claims.items()):
            if _lock_expired(delivery.message, now):
                del self._claims[key]
                _LOGGER.info("dedupe %s: the lock of message %r (%s) ran out before it was settled; a copy or "
                             "its redelivery will be returned", self.entity, key, delivery.namespace)

    def _alive(self, delivery: _Delivery, now: datetime.datetime) -> bool:
        return delivery.epoch == self._epochs[delivery.namespace] and not _lock_expired(delivery.message, now)

    # --- settling --------------------------------------------------------------------------------------

    def complete_message(self, message: ServiceBusReceivedMessage) -> None:
        """Complete ``message`` on its namespace, record its id in the window (committed before this
        returns) and complete the held copies of that id. The id is recorded even when the settlement fails
        (the caller processed it): the SDK's error is raised after that."""
        delivery = self._settled(message)
        error = self._settle_or_error(delivery, "complete_message")
        if delivery.key is not None:
            self._record(delivery)
            if self._claims.get(delivery.key) is delivery:
                del self._claims[delivery.key]
            for copy in self._waiting.pop(delivery.key, []):
                self._drop_duplicate(copy)
            self._prune()
        if error is not None:
            raise error

    def abandon_message(self, message: ServiceBusReceivedMessage) -> None:
        """Abandon ``message`` on its namespace and clear its in-flight mark: a held copy, or its
        redelivery, is returned by a later :meth:`receive_messages`."""
        delivery = self._settled(message)
        error = self._settle_or_error(delivery, "abandon_message")
        if delivery.key is not None and self._claims.get(delivery.key) is delivery:
            del self._claims[delivery.key]
        if error is not None:
            raise error

    def namespace_of(self, message: ServiceBusReceivedMessage) -> str:
        """``"primary"`` or ``"secondary"``: where a returned message not settled yet came from."""
        return self._delivery(message).namespace

    def _delivery(self, message: ServiceBusReceivedMessage) -> _Delivery:
        delivery = self._returned.get(str(getattr(message, "lock_token", None)))
        if delivery is None or delivery.message is not message:
            raise ValueError(f"message {getattr(message, 'message_id', None)!r} was not returned by this receiver "
                             "or is settled already")
        return delivery

    def _settled(self, message: ServiceBusReceivedMessage) -> _Delivery:
        self._check_open()
        delivery = self._delivery(message)
        del self._returned[str(message.lock_token)]
        return delivery

    def _settle(self, delivery: _Delivery, operation: str) -> BaseException | None:
        """``operation`` (``complete_message``, ``abandon_message``) on the receiver that delivered it. Its
        lock being gone (lost, already settled, its receiver rebuilt since, or its link detached by the
        service) is returned as ``MessageLockLostError``, not raised; any other error marks the namespace
        broken and is raised."""
        name = delivery.namespace
        if delivery.epoch != self._epochs[name]:
            return MessageLockLostError(message=f"the {name} receiver that delivered this message was rebuilt "
                                        "after a failure: the lock is gone, the broker delivers it again")
        try:
            with self._namespaces[name].receiver(self.entity) as receiver:
                if receiver is not delivery.receiver:
                    return MessageLockLostError(message=f"the {name} receiver that delivered this message is gone")
                try:
                    getattr(receiver, operation)(delivery.message)
                except Exception as exc:
                    if is_lock_lost(exc):
                        return exc
                    raise
        except Exception as exc:
            self._broken(name, exc)
            if is_link_gone(exc):  # detached by the service (idle, forced): the lock went with the link
                return MessageLockLostError(message=f"the {name} link that delivered this message was detached "
                                            f"({type(exc).__name__}): the lock is gone, the broker delivers it "
                                            "again")
            raise
        return None

    def _settle_or_error(self, delivery: _Delivery, operation: str) -> BaseException | None:
        """:meth:`_settle`, its error returned rather than raised (the caller finishes its bookkeeping first)."""
        try:
            return self._settle(delivery, operation)
        except Exception as exc:
            return exc

    def _complete_quietly(self, delivery: _Delivery, what: str) -> None:
        """Complete a copy nobody will see: a failure is logged, the broker delivers it again and it is
        dropped again."""
        error = self._settle_or_error(delivery, "complete_message")
        if error is not None:
            _LOGGER.warning("dedupe %s: completing %s on the %s namespace failed (%s: %s); it comes back and is "
                            "dropped again", self.entity, what, delivery.namespace, type(error).__name__,
                            redact(str(error)))

    def _drop_duplicate(self, delivery: _Delivery) -> None:
        self._counts["duplicates_dropped"] += 1
        self._complete_quietly(delivery, f"the duplicate {delivery.key!r}")

    def _broken(self, name: str, exc: BaseException) -> None:
        """``name``'s receiver failed (the bus dropped it): the copies it delivered can no longer be settled
        and are forgotten; a lost connection rebuilds the namespace's client too."""
        self._epochs[name] += 1
        for key, copies in list(self._waiting.items()):
            kept = [d for d in copies if d.namespace != name]
            if kept:
                self._waiting[key] = kept
            else:
                del self._waiting[key]
        self._anonymous = [d for d in self._anonymous if d.namespace != name]
        if is_connection_lost(exc):
            self._namespaces[name].detach()

    # --- the window ------------------------------------------------------------------------------------

    def _in_window(self, keys: Iterable[str]) -> set[str]:
        wanted = list(dict.fromkeys(keys))
        since = self._clock() - self.window.total_seconds()
        found: set[str] = set()
        for start in range(0, len(wanted), _SQL_CHUNK):
            chunk = wanted[start:start + _SQL_CHUNK]
            rows = self._db.execute(
                f"SELECT message_id FROM seen WHERE entity = ? AND recorded_at >= ? "
                f"AND message_id IN ({', '.join('?' * len(chunk))})", (self._db_entity, since, *chunk))
            found.update(row[0] for row in rows)
        return found

    def _record(self, delivery: _Delivery) -> None:
        with self._db:
            self._db.execute("INSERT OR REPLACE INTO seen (entity, message_id, recorded_at, namespace) "
                             "VALUES (?, ?, ?, ?)", (self._db_entity, delivery.key, self._clock(), delivery.namespace))

    def _prune(self) -> None:
        now = self._clock()
        if self._last_prune is not None and now - self._last_prune < PRUNE_EVERY:
            return
        self._last_prune = now
        with self._db:
            self._db.execute("DELETE FROM seen WHERE entity = ? AND recorded_at < ?",
                             (self._db_entity, now - self.window.total_seconds()))

    # --- the rest --------------------------------------------------------------------------------------

    def stats(self) -> DedupeStats:
        """What this receiver did and holds (:class:`DedupeStats`)."""
        self._check_open()
        window = self._db.execute("SELECT count(*) FROM seen WHERE entity = ?", (self._db_entity,)).fetchone()[0]
        held = sum(len(copies) for copies in self._waiting.values()) + len(self._anonymous)
        return DedupeStats(held=held, in_flight=len(self._claims), window=window, received=dict(self._received),
                           **self._counts)

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"the DedupeReceiver of {self.entity!r} is closed")

    def close(self) -> None:
        """Abandon the held copies, close the SDK handles and the database; idempotent. Messages returned and
        not settled are left to their locks."""
        if self.closed:
            return
        self.closed = True
        try:
            now = datetime.datetime.now(datetime.UTC)
            held = [d for copies in self._waiting.values() for d in copies] + self._anonymous
            self._waiting, self._anonymous = {}, []
            for delivery in held:
                error = self._settle_or_error(delivery, "abandon_message") if self._alive(delivery, now) else None
                if error is not None:  # closing: its lock runs out and the broker delivers it again
                    _LOGGER.debug("dedupe %s: abandoning a held copy on close failed: %s", self.entity,
                                  type(error).__name__)
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            for namespace in self._namespaces.values():  # both close at once, in the bus's helper threads
                namespace.detach(final=True)
            for namespace in self._namespaces.values():
                namespace.close()
            self._db.close()
