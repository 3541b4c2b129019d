"""The replicating sender: active and passive replication over the same entity on two namespaces (behaviour.md,
"Active and passive replication"; the outages page of ``shared/seeds``).

* **active**: every message goes to both namespaces at once with the same message_id; the call succeeds when
  at least one side accepted every message of it.
* **passive**: every message goes to the active side (the primary at first); on an outage the messages that
  side did not acknowledge go to the other side, and the two swap roles for every sender of the process.

Choices where behaviour.md is silent (also in the report):

* the SDK handles are the sender's own two :class:`spark_sb.bus.Namespace` (primary, secondary), both built
  with ``send_availability.primary_client_kwargs()`` (small SDK retry counts, short try timeouts: the sender,
  not the SDK, decides); what an SDK error means is read from :mod:`spark_sb.errors`;
* messages are sent in ``ServiceBusMessageBatch``es built before sending (:mod:`spark_sb.bus.batches`, as the
  paired sender): a message that fits no batch or cannot be encoded is a :class:`~spark_sb.errors.BadMessageError`
  naming its id, and nothing of the call goes to that side;
* a message without a message_id gets one (``uuid4().hex``) before anything is sent, on the caller's object,
  so that both copies carry the same id. In active mode each message is encoded once: the primary's side
  builds the batches and hands them to the secondary's before sending them, and both send the same batches (a
  batch holds its messages encoded; the SDK sends it unchanged). The secondary builds its own only when the
  primary's side built none or its link takes smaller batches, and only after the primary's side is done
  with the messages (adding a message to a batch rewrites its ``_message`` in place);
* **active**: the secondary's send runs in a small thread pool of the sender (:data:`SIDE_THREADS` threads),
  the primary's on the calling thread. A side counts as having accepted the call only if every batch was
  accepted (a side that stored some batches before failing has stored duplicates, which receivers drop by
  message_id). A side that failed with an outage-class error is skipped by this sender's later sends of that
  entity for ``replication.retry_interval`` (per sender, per entity, on the sender's clock); a side that
  accepts is no longer skipped; when every side is skipped a send tries both. When both sides fail for the
  same non-outage reason (both a bad message, both the entity not found, both a rejected credential), that
  error is raised (:func:`~spark_sb.errors.as_spark_sb_error`, naming both namespaces), because the Spark
  sink rejects rows on it; any other pair of failures, including one side's outage and the other's bad
  message, is a :class:`~spark_sb.errors.ReplicationError` (retryable: the outage may be what hides the answer
  of that side). Both sides failing with the same non-Service-Bus error (a bug) re-raise the primary's;
* **passive**: the roles are process-wide state keyed by (primary namespace, secondary namespace, entity),
  shared by every :class:`ReplicatingSender` of the process, swapped with compare-and-set (only when the active
  side is still the one this send failed on). A failure of the other side with any error keeps the roles and
  raises :class:`~spark_sb.errors.ReplicationError` (the active side's outage may be what the other side's
  answer hides); messages one side stored before the failure stay there, and a retry sends them again with
  the same ids. Roles stay swapped until the next outage (no failback timer, as the outages page);
* throttling (``ServiceBusServerBusyError``, or a connection refused at the namespace's connection quota) on a
  side waits what the service asked ("Please wait N seconds") or else ``server_busy_backoff``, and retries that
  side with the messages it has not accepted, for as long as it answers busy (as the paired sender); it never
  skips a side nor swaps roles;
* a ``ServiceBusConnectionError`` (the SDK shut a connection down) closes that side's clients only (the sides
  are independent here), rebuilt on next use; when that side had been idle for
  :data:`~spark_sb.bus.STALE_AFTER`, the send is retried on a new connection at once, once (as the paired
  sender's stale-connection rule);
* topics are sent to with ``get_queue_sender`` (an AMQP sender only needs the entity path).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from azure.servicebus import ServiceBusMessage

from ..bus import Namespace, send_lane
from ..bus.batches import PartialSend, batches_after, call_messages, send_batches
from ..bus.inflight import SendPool
from ..config import SparkSbConfig, load_config
from ..errors import (
    BadMessageError,
    ConfigError,
    ErrorClass,
    ReplicationError,
    as_spark_sb_error,
    classify,
    is_connection_lost,
    redact,
    retry_after,
)
from ..paired.retry import Clock, Sleep

_LOGGER = logging.getLogger(__name__)

__all__ = ["PRIMARY", "SECONDARY", "SIDE_THREADS", "ReplicatingSender", "ReplicationResult", "active_side"]

Side = Literal["primary", "secondary"]
PRIMARY: Side = "primary"
SECONDARY: Side = "secondary"
SIDES: tuple[Side, Side] = (PRIMARY, SECONDARY)
#: threads of an active sender's pool that send to the secondary while the caller sends to the primary
SIDE_THREADS = 8
#: the first send lane of the side threads (:func:`spark_sb.bus.send_lane`); the calls' lanes are below it
_SIDE_LANES = 1000
CLOSE_TIMEOUT = 5.0


def _other(side: Side) -> Side:
    return SECONDARY if side == PRIMARY else PRIMARY


@dataclass(frozen=True)
class ReplicationResult:
    """Where one :meth:`ReplicatingSender.send` call's messages went.

    :ivar entity: the entity (the same path on both namespaces).
    :ivar destinations: ``{"primary" | "secondary": messages that side accepted}``, only sides that accepted
        some. Active mode: the sides that accepted every message of the call. Passive mode: the active side's
        count, and the other side's when the active one failed part way (their sum is the call).
    :ivar errors: ``{side: exception}`` for a side that failed while the call still succeeded.
    :ivar mode: ``"active"`` or ``"passive"``.
    """

    entity: str
    destinations: Mapping[str, int] = field(default_factory=dict)
    errors: Mapping[str, BaseException] = field(default_factory=dict)
    mode: str = "active"

    @property
    def sent(self) -> int:
        """Messages accepted by at least one side: the length of the call (it succeeded)."""
        counts = self.destinations.values()
        if not counts:
            return 0
        return max(counts) if self.mode == "active" else sum(counts)

    @property
    def primary(self) -> int:
        return self.destinations.get(PRIMARY, 0)

    @property
    def secondary(self) -> int:
        return self.destinations.get(SECONDARY, 0)


@dataclass(frozen=True)
class _Outcome:
    """One side's part of a call: ``sent`` messages accepted (in order) before ``error``, or all of them."""

    side: Side
    sent: int
    error: BaseException | None = None

    @property
    def accepted(self) -> bool:
        return self.error is None


class _Roles:
    """The active side of each (primary namespace, secondary namespace, entity) of passive replication in this
    process (the primary until an outage swaps it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: dict[tuple[str, str, str], Side] = {}

    def active(self, key: tuple[str, str, str]) -> Side:
        with self._lock:
            return self._active.get(key, PRIMARY)

    def swap(self, key: tuple[str, str, str], failed: Side) -> bool:
        """Make the other side active if ``failed`` is still the active side; True when this call swapped."""
        with self._lock:
            if self._active.get(key, PRIMARY) != failed:
                return False
            self._active[key] = _other(failed)
            return True


_ROLES = _Roles()


def active_side(config: SparkSbConfig, entity: str) -> Side:
    """The active side of ``entity`` for passive replication between ``config``'s namespaces in this process."""
    return _ROLES.active(_roles_key(config, entity))


def _roles_key(config: SparkSbConfig, entity: str) -> tuple[str, str, str]:
    return (config.primary.fully_qualified_namespace.lower(), config.secondary.fully_qualified_namespace.lower(),
            entity)


def _with_id(message: ServiceBusMessage) -> ServiceBusMessage:
    if message.message_id is None:
        message.message_id = uuid.uuid4().hex
    return message


class ReplicatingSender:
    """Send to the same entity on the primary and the secondary namespace, actively (both) or passively (the
    active side, swapping on an outage), as ``config.replication.mode`` says.

    Build it with :meth:`from_config`; use it as a context manager or call :meth:`close`. Thread-safe: one
    instance may be shared by every thread of the process; passive roles are shared by every instance of the
    process with the same two namespaces.
    """

    def __init__(self, config: SparkSbConfig, *, clock: Clock = time.monotonic, sleep: Sleep = time.sleep) -> None:
        mode = config.replication.mode
        if mode not in ("active", "passive"):
            raise ConfigError("replication.mode", "must be active or passive for a ReplicatingSender (for paired, "
                                                  "use PairedSender)", mode)
        self.config = config
        self.mode: Literal["active", "passive"] = mode
        sa = config.send_availability
        self._clock = clock
        self._sleep = sleep
        self._busy_backoff = sa.server_busy_backoff.total_seconds()
        self._retry_interval = config.replication.retry_interval.total_seconds()
        kwargs = sa.primary_client_kwargs()
        self._sides: dict[Side, Namespace] = {
            PRIMARY: Namespace(PRIMARY, config.primary, kwargs, clock=clock,
                               connections_per_entity=config.sink.connections_per_entity),
            SECONDARY: Namespace(SECONDARY, config.secondary, kwargs, clock=clock,
                                 connections_per_entity=config.sink.connections_per_entity),
        }
        self._lock = threading.Lock()
        self._closed = False
        self._skip_until: dict[tuple[str, Side], float] = {}  # active mode: (entity, side) -> clock time
        self._pool: ThreadPoolExecutor | None = None
        self._in_flight: set[Future[_Outcome]] = set()
        self._calls = SendPool(config.sink.sends_in_flight, "spark-sb-replicate-call")
        self._counters: dict[str, int] = {"sent_primary": 0, "sent_secondary": 0, "busy_waits": 0, "swaps": 0,
                                          "skipped_sides": 0, "degraded_sends": 0}

    @classmethod
    def from_config(
        cls,
        source: str | os.PathLike[str] | Mapping[str, Any] | SparkSbConfig,
        *,
        clock: Clock = time.monotonic,
        sleep: Sleep = time.sleep,
    ) -> ReplicatingSender:
        """From a YAML path, a dict or a :class:`SparkSbConfig`. Nothing connects until the first :meth:`send`;
        a wrong option, or ``replication.mode: paired``, raises :class:`~spark_sb.errors.ConfigError` here.
        ``clock`` and ``sleep`` are the sender's time (the retry interval of a skipped side, busy waits)."""
        return cls(load_config(source), clock=clock, sleep=sleep)

    def __repr__(self) -> str:
        return (f"ReplicatingSender(mode={self.mode!r}, "
                f"primary={self.config.primary.fully_qualified_namespace!r}, "
                f"secondary={self.config.secondary.fully_qualified_namespace!r})")

    def __enter__(self) -> ReplicatingSender:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- state ---------------------------------------------------------------------------------------------

    def _where(self, side: Side) -> str:
        return f"{side} {self._sides[side].namespace.fully_qualified_namespace}"

    def _skipped(self, entity: str, side: Side, now: float) -> bool:
        with self._lock:
            until = self._skip_until.get((entity, side))
        return until is not None and now < until

    def active_namespace(self, entity: str) -> Side:
        """Passive: the active side of ``entity`` (shared by every sender of the process with the same two
        namespaces). Active: ``"primary"`` unless the primary is skipped and the secondary is not."""
        if self.mode == "passive":
            return _ROLES.active(_roles_key(self.config, entity))
        now = self._clock()
        if self._skipped(entity, PRIMARY, now) and not self._skipped(entity, SECONDARY, now):
            return SECONDARY
        return PRIMARY

    def state(self, entity: str) -> str:
        """Passive: ``"primary active"`` or ``"secondary active"``. Active: ``"both"``, ``"primary only
        (secondary skipped)"``, ``"secondary only (primary skipped)"`` or ``"both skipped"`` (the next send
        tries both)."""
        if self.mode == "passive":
            return f"{self.active_namespace(entity)} active"
        now = self._clock()
        skipped = [side for side in SIDES if self._skipped(entity, side, now)]
        if not skipped:
            return "both"
        if len(skipped) == len(SIDES):
            return "both skipped"
        return f"{_other(skipped[0])} only ({skipped[0]} skipped)"

    def stats(self) -> dict[str, int]:
        """Counters of this sender: ``sent_primary`` and ``sent_secondary`` (messages each side accepted in
        calls that succeeded), ``busy_waits`` (server-busy waits), ``swaps`` (passive: role swaps this sender
        made), ``skipped_sides`` (active: sends that left a side out because it was skipped) and
        ``degraded_sends`` (calls that succeeded although a side failed)."""
        with self._lock:
            return dict(self._counters)

    def _count(self, **increments: int) -> None:
        with self._lock:
            for name, n in increments.items():
                self._counters[name] += n

    # --- sending -------------------------------------------------------------------------------------------

    def send(self, entity: str, message: ServiceBusMessage | Sequence[ServiceBusMessage]) -> ReplicationResult:
        """Send one message or a list to ``entity`` on the namespaces the mode says; returns where they went.

        Raises :class:`~spark_sb.errors.ReplicationError` when no side accepted every message (retryable),
        :class:`~spark_sb.errors.BadMessageError` for a message that can never be sent (active: refused so by
        both sides; passive: by the active side), :class:`~spark_sb.errors.EntityNotFoundError` /
        :class:`~spark_sb.errors.CredentialRejectedError` likewise.
        """
        self._check_open()
        batch = [_with_id(item) for item in call_messages(entity, message)]
        if not batch:
            return ReplicationResult(entity, mode=self.mode)
        result = self._send_active(entity, batch) if self.mode == "active" else self._send_passive(entity, batch)
        self._count(sent_primary=result.primary, sent_secondary=result.secondary,
                    degraded_sends=1 if result.errors else 0)
        return result

    def submit(self, entity: str,
               message: ServiceBusMessage | Sequence[ServiceBusMessage]) -> Future[ReplicationResult]:
        """:meth:`send` in one of the sender's ``sink.sends_in_flight`` threads, each with connections of its own
        (:class:`~spark_sb.bus.inflight.SendPool`): several calls in flight at once, each with the guarantees of
        :meth:`send`. Calls to the same entity may be stored in any order."""
        self._check_open()
        return self._calls.submit(self.send, entity, message)

    def _send_side(self, side: Side, entity: str, items: Sequence[ServiceBusMessage], *,
                   built: Sequence[Any] | None = None,
                   on_built: Callable[[list[Any]], None] | None = None) -> _Outcome:
        """Send ``items`` to ``side`` until it accepted all of them or failed otherwise than busy. ``built``:
        the items already in batches (the other side's), ``on_built``: handed this side's batches (see
        :func:`~spark_sb.bus.batches.send_batches`); a retry sends what is left of the same batches."""
        namespace = self._sides[side]
        sent = 0
        pending = items
        batches = built
        stale = namespace.stale()

        def keep(made: list[Any]) -> None:
            nonlocal batches
            batches = made
            if on_built is not None:
                on_built(made)

        while True:
            try:
                send_batches(namespace, entity, pending, entity, built=batches, on_built=keep)
            except PartialSend as partial:
                sent += partial.sent
                pending = pending[partial.sent:]
                batches = batches_after(batches, partial.sent)
                error = partial.error
            except BadMessageError as exc:
                return _Outcome(side, sent, exc)
            else:
                return _Outcome(side, sent + len(pending))
            if classify(error) is ErrorClass.THROTTLED:  # what the service asked, else server_busy_backoff
                wait = retry_after(error)
                wait = self._busy_backoff if wait is None else wait
                self._count(busy_waits=1)
                _LOGGER.info("%s busy for %r; waiting %.3g s", side, entity, wait)
                self._sleep(wait)
                continue
            if is_connection_lost(error):
                namespace.detach()  # the SDK shut the connection down: new handles on next use
                if stale:
                    stale = False
                    _LOGGER.info("the idle connection to the %s was gone; retrying %r on a new one", side, entity)
                    continue
            return _Outcome(side, sent, error)

    def _refusal(self, error: BaseException, namespace: str, entity: str) -> BaseException:
        """What to raise for a side's failure that is no outage: the spark-sb error it converts to, else the
        error itself (not a Service Bus failure)."""
        converted = as_spark_sb_error(error, namespace=namespace, entity=entity)
        return error if converted is None else converted

    @staticmethod
    def _raise(error: BaseException, cause: BaseException) -> None:
        if error is cause:
            raise error
        raise error from cause

    # --- passive -------------------------------------------------------------------------------------------

    def _send_passive(self, entity: str, items: list[ServiceBusMessage]) -> ReplicationResult:
        key = _roles_key(self.config, entity)
        active = _ROLES.active(key)
        first = self._send_side(active, entity, items)
        if first.error is None:
            return ReplicationResult(entity, {active: first.sent}, mode="passive")
        error = first.error
        if classify(error) is not ErrorClass.OUTAGE:
            # a bad message, a missing entity or a rejected credential: the caller must see it; no swap
            self._raise(self._refusal(error, self._where(active), entity), error)
        other = _other(active)
        rest = items[first.sent:]
        _LOGGER.warning("entity %r: the %s namespace failed (%s: %s); sending %d message(s) to the %s", entity,
                        active, type(error).__name__, redact(str(error)), len(rest), other)
        second = self._send_side(other, entity, rest)
        if second.error is not None:
            raise ReplicationError(entity, {active: error, other: second.error}) from second.error
        if _ROLES.swap(key, active):
            self._count(swaps=1)
            _LOGGER.warning("entity %r: the %s namespace is now active (the %s failed: %s)", entity, other,
                            active, type(error).__name__)
        destinations: dict[str, int] = {side: n for side, n in ((active, first.sent), (other, second.sent)) if n}
        return ReplicationResult(entity, destinations, {active: error}, mode="passive")

    # --- active --------------------------------------------------------------------------------------------

    def _send_active(self, entity: str, items: list[ServiceBusMessage]) -> ReplicationResult:
        now = self._clock()
        tried = [side for side in SIDES if not self._skipped(entity, side, now)] or list(SIDES)
        if len(tried) < len(SIDES):
            self._count(skipped_sides=1)
        outcomes = self._run_sides(tried, entity, items)
        if not any(o.accepted for o in outcomes) and len(tried) < len(SIDES):
            # the only side tried failed: the skipped one may be back
            outcomes += self._run_sides([side for side in SIDES if side not in tried], entity, items)
        accepted: dict[str, int] = {o.side: o.sent for o in outcomes if o.accepted}
        failed: dict[str, BaseException] = {o.side: o.error for o in outcomes if o.error is not None}
        with self._lock:
            for o in outcomes:
                if o.accepted:
                    self._skip_until.pop((entity, o.side), None)
                elif o.error is not None and classify(o.error) is ErrorClass.OUTAGE:
                    self._skip_until[(entity, o.side)] = self._clock() + self._retry_interval
        if not accepted:
            raise self._both_failed(entity, failed)
        for side, error in failed.items():
            _LOGGER.warning("entity %r: the %s namespace failed (%s: %s); the other accepted the message(s)%s",
                            entity, side, type(error).__name__, redact(str(error)),
                            f"; skipping the {side} for {self._retry_interval:g} s"
                            if classify(error) is ErrorClass.OUTAGE else "")
        return ReplicationResult(entity, accepted, failed, mode="active")

    def _run_sides(self, sides: Sequence[Side], entity: str, items: list[ServiceBusMessage]) -> list[_Outcome]:
        """Send ``items`` to each of ``sides`` at the same time: the primary on the calling thread, the secondary
        in the pool. Each message is encoded once: the primary builds the batches and hands them to the
        secondary before sending them (the SDK sends a batch without changing it). The secondary builds its
        own only when the primary built none (its link did not open, a message was refused) or its link takes
        smaller batches; it waits for the primary's hand-over or failure first, so that the SDK never rewrites
        a message in two threads at once."""
        if len(sides) == 1:
            return [self._send_side(sides[0], entity, items)]
        handed: Future[list[Any] | None] = Future()

        def hand_over(batches: list[Any] | None) -> None:
            if not handed.done():
                handed.set_result(batches)

        future = self._submit(lambda: self._send_side(SECONDARY, entity, items, built=handed.result()))
        try:
            primary = self._send_side(PRIMARY, entity, items, on_built=hand_over)
        finally:
            hand_over(None)
            secondary = future.result()
        return [primary, secondary]

    def _submit(self, task: Callable[[], _Outcome]) -> Future[_Outcome]:
        with self._lock:
            if self._closed:
                raise RuntimeError("this ReplicatingSender is closed")
            if self._pool is None:
                # lanes of their own (past the calls' lanes): the secondary sends of calls in flight at once
                # are in flight at once too
                lanes = itertools.count(_SIDE_LANES)
                self._pool = ThreadPoolExecutor(max_workers=SIDE_THREADS, thread_name_prefix="spark-sb-replicate",
                                                initializer=lambda: send_lane(next(lanes)))
            future = self._pool.submit(task)
            self._in_flight.add(future)
        future.add_done_callback(self._done)
        return future

    def _done(self, future: Future[_Outcome]) -> None:
        with self._lock:
            self._in_flight.discard(future)

    def _both_failed(self, entity: str, failed: Mapping[str, BaseException]) -> BaseException:
        """The error for a call no side accepted: the side-agnostic error when both refused for the same
        non-outage reason, else a :class:`ReplicationError`."""
        classes = {classify(error) for error in failed.values()}
        if len(failed) == len(SIDES) and len(classes) == 1:
            (error_class,) = classes
            primary = failed[PRIMARY]
            if error_class is ErrorClass.OTHER:
                return primary
            if error_class in (ErrorClass.BAD_MESSAGE, ErrorClass.CONFIGURATION_NOT_FOUND,
                               ErrorClass.CONFIGURATION_CREDENTIAL):
                both = f"{self._where(PRIMARY)} and {self._where(SECONDARY)}"
                refusal = self._refusal(primary, both, entity)
                if refusal is not primary:
                    refusal.__cause__ = primary
                return refusal
        error = ReplicationError(entity, failed)
        error.__cause__ = failed.get(PRIMARY) or next(iter(failed.values()))
        return error

    # --- closing -------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this ReplicatingSender is closed")

    def close(self) -> None:
        """Close both namespaces' clients and the pool within 5 s; idempotent."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
            in_flight = list(self._in_flight)
        self._calls.shutdown()
        deadline = time.monotonic() + CLOSE_TIMEOUT
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        for side in self._sides.values():  # one deadline for both
            side.close(max(0.0, deadline - time.monotonic()))
        for future in in_flight:
            try:
                future.exception(max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - cancelled or still running: nothing more to wait for
                pass
        if pool is not None and not any(not f.done() for f in in_flight):
            pool.shutdown(wait=True)  # idle workers only: they end at once
