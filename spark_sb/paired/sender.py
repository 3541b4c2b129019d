"""The paired sender: send to the primary; through an outage keep retrying inside the failover interval, then
send to a backlog queue on the secondary until a ping shows the primary accepts messages again
(behaviour.md, "The paired sender").

Choices where behaviour.md is silent (also in the report):

* the SDK handles are the sender's own two :class:`spark_sb.bus.Namespace` (primary, secondary): senders
  cached per entity (opening one costs a round trip), one lock per (namespace, entity) serialising their use,
  because an SDK sender is not thread-safe; what an SDK error means is read from :mod:`spark_sb.errors`;
* messages are sent in ``ServiceBusMessageBatch``es built before anything is sent (:mod:`spark_sb.bus.batches`):
  a message that does not fit an empty batch (or, rewritten, a backlog batch), or that the SDK cannot encode
  (``add_message`` raises ``ValueError``/``TypeError``/``OverflowError``), is rejected with
  :class:`~spark_sb.errors.BadMessageError` and nothing of that call is sent; such a message never counts
  toward failover nor against a backlog queue;
* pings run in the background ping task of the pairing (:mod:`spark_sb.bus.pings`, one thread per process
  and pairing, started by the first send, stopped by the last close()) and on the send path when a send finds
  one due; :meth:`HealthBoard.claim_ping` hands each due ping to one of them. A ping refused for a rejected
  credential or an unknown entity makes every send of that entity raise that configuration error until a
  later ping answers otherwise;
* pairing (the backlog queues listed and created on the secondary) waits until the backlog is first needed: the
  last wait before a failover (:meth:`PairedSender._prepare_backlog`) or the failover itself, unless
  :meth:`PairedSender.pair` was called. A send to a healthy primary never needs the secondary; a secondary that
  cannot be reached when the backlog is needed is that send's :class:`~spark_sb.errors.PairingError`;
* pairing has a deadline, ``send_availability.pairing_timeout`` (30 s by default), for one attempt and for all
  the attempts of one send together (its last wait before the failover, then the failover): each administration
  request waits at most the secondary's ``admin_timeout`` or what is left, none starts past the deadline, and a
  request the endpoint did not answer at all (refused, host not found, timed out, retries included) ends the
  attempt instead of trying the next backlog queues one by one against it. An endpoint that answers with an
  error for one queue is still asked for the others. So a secondary whose administration endpoint hangs costs a
  failing-over send at most ``pairing_timeout`` before its ``PairingError`` (not acknowledged: the batch is
  replayed);
* a ``ServiceBusConnectionError`` (the SDK shut its connection down) on either side closes both sides'
  clients (in a helper thread, within 5 s) and both are rebuilt on next use;
* a rejected credential on the secondary raises :class:`~spark_sb.errors.CredentialRejectedError` naming it
  (no queue is to blame, none leaves the rotation);
* any other failure of a backlog send except a bad message takes that queue out of the rotation; the secondary's
  clients do not retry by themselves either (``retry_total`` 0, ``try_timeout`` = ``primary_try_timeout``):
  the rotation is the retry, and a failed send surfaces as :class:`BacklogUnavailableError` for the caller;
* topics are sent to with ``get_queue_sender`` (an AMQP sender only needs the entity path).
"""

from __future__ import annotations

import gc
import logging
import os
import random
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

from azure.servicebus import ServiceBusMessage
from azure.servicebus.management import ServiceBusAdministrationClient

from .. import bus
from .. import messages as msgs
from ..bus import EntityState, HealthBoard, Namespace, join_board
from ..bus.batches import PartialSend, call_messages, send_batches
from ..bus.inflight import SendPool
from ..bus.pings import Wait
from ..config import NamespaceConfig, SparkSbConfig, load_config
from ..durations import format_duration
from ..errors import (
    BacklogUnavailableError,
    BadMessageError,
    ConnectionQuotaError,
    CredentialRejectedError,
    EntityNotFoundError,
    ErrorClass,
    PairingError,
    SparkSbError,
    already_exists,
    as_spark_sb_error,
    classify,
    is_blip,
    is_connection_lost,
    is_connection_quota,
    is_unanswered,
    redact,
    refusal,
    retry_after,
    unreachable_reason,
)
from .retry import Backoff, Clock, ConstantBackoff, ExponentialBackoff, Retry, Sleep
from .sessions import ParkedSessions, session_id_problem, session_queue, sessions_of

_LOGGER = logging.getLogger(__name__)

__all__ = ["PRIMARY", "PairedSender", "SendResult", "pairing_key"]

#: the destination name of the primary entity in a :class:`SendResult`
PRIMARY = "primary"
CLOSE_TIMEOUT = 5.0
#: TimeSpan.MaxValue, "the maximum" for DefaultMessageTimeToLive and AutoDeleteOnIdle
MAX_TIMESPAN = timedelta(days=10675199, hours=2, minutes=48, seconds=5, microseconds=477580)
BACKLOG_QUEUE_PROPERTIES: Mapping[str, Any] = {
    "max_size_in_megabytes": 5120,
    "max_delivery_count": 2147483647,
    "default_message_time_to_live": MAX_TIMESPAN,
    "auto_delete_on_idle": MAX_TIMESPAN,
    "lock_duration": timedelta(minutes=1),
    "dead_lettering_on_message_expiration": True,
    "enable_batched_operations": True,
}


@dataclass(frozen=True)
class SendResult:
    """Where one :meth:`PairedSender.send` call's messages went.

    :ivar entity: the entity on the primary.
    :ivar destinations: ``{"primary" or backlog queue name: count}``.
    """

    entity: str
    destinations: Mapping[str, int] = field(default_factory=dict)

    @property
    def sent(self) -> int:
        return sum(self.destinations.values())

    @property
    def primary(self) -> int:
        return self.destinations.get(PRIMARY, 0)

    @property
    def backlog(self) -> int:
        return self.sent - self.primary

    @property
    def destination(self) -> str | None:
        """The only destination, or ``None`` when there were several (or none)."""
        return next(iter(self.destinations)) if len(self.destinations) == 1 else None


def _explained(bad: BadMessageError, items: Sequence[ServiceBusMessage], entity: str) -> BadMessageError:
    """The error for a failed-over call a backlog batch could not encode: the first of ``items`` (the caller's
    messages, before the backlog rewrite) that the full checks refuse, naming its field as the caller knows it;
    ``bad`` itself when they find nothing (e.g. a message too large once rewritten)."""
    for item in items:
        try:
            msgs.check_encodable(item, entity)
            msgs.to_backlog(item, entity)
        except BadMessageError as precise:
            return precise
    return bad


def _check_session_ids(entity: str, batch: Sequence[ServiceBusMessage]) -> None:
    """Raise :class:`~spark_sb.errors.BadMessageError` naming the first message of ``batch`` whose session id the
    SDK cannot encode (a lone surrogate), its field and value, before anything of the call is sent."""
    seen: set[str] = set()
    for message in batch:
        session_id = message.session_id
        if not session_id or session_id in seen:
            continue
        seen.add(session_id)
        problem = session_id_problem(session_id)
        if problem is not None:
            raise BadMessageError(message.message_id, entity, problem)


def _token_refused(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it wraps) is the credential failing to get a token (azure-identity: a wrong
    secret, an unknown app), not the namespace refusing a token it got."""
    from azure.core.exceptions import ClientAuthenticationError

    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            return False
        if type(seen).__module__.startswith("azure.identity") or (
                isinstance(seen, ClientAuthenticationError) and getattr(seen, "response", None) is None):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class _PairingTime:
    """What a send may still spend pairing, in seconds on the sender's clock: ``send_availability.pairing_timeout``
    at first, shared by every attempt the send makes (the last wait before a failover, then the failover itself)
    and used up by each as it goes."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds


class _OutOfTime(Exception):
    """No time is left before the pairing attempt's deadline for another administration request."""


def _add_counts(counts: dict[str, int], more: Mapping[str, int]) -> None:
    for destination, n in more.items():
        counts[destination] = counts.get(destination, 0) + n


def _one_line(error: BaseException, limit: int = 300) -> str:
    """``error``'s text on one line, cut at ``limit`` characters (an HTTP error carries its response body on the
    next lines)."""
    text = " ".join(str(error).split())
    return f"{text[:limit]}{'...' if len(text) > limit else ''}"


def pairing_key(config: SparkSbConfig) -> tuple[str, str, str]:
    """What identifies a pairing in a process: its senders share one health board (primary, secondary,
    backlog prefix)."""
    return (config.primary.fully_qualified_namespace.lower(), config.secondary.fully_qualified_namespace.lower(),
            config.send_availability.backlog_prefix)


class PairedSender:
    """Send to an entity of the primary namespace, failing over to backlog queues on the secondary.

    Build it with :meth:`from_config`; use it as a context manager or call :meth:`close`. Thread-safe: one
    instance may be shared by every thread of the process, and every instance of the same pairing in the
    process shares the entity states (see :mod:`spark_sb.bus.health`).
    """

    def __init__(
        self,
        config: SparkSbConfig,
        *,
        clock: Clock = time.monotonic,
        sleep: Sleep = time.sleep,
        rng: random.Random | None = None,
        backoff: Backoff | None = None,
        ping_wait: Wait | None = None,
    ) -> None:
        self.config = config
        sa = config.send_availability
        self._sa = sa
        self._clock = clock
        self._sleep = sleep
        self._rng = rng if rng is not None else random.Random()
        #: the wait between primary attempts inside the failover interval
        self._backoff = backoff if backoff is not None else ExponentialBackoff(0.5, 10.0)
        self._busy_backoff = sa.server_busy_backoff.total_seconds()
        # this sender's own handles (close() closes them), not the process-wide ones of bus.shared_namespace
        connections = config.sink.connections_per_entity
        self._primary = Namespace("primary", config.primary, sa.primary_client_kwargs(), clock=clock,
                                  connections_per_entity=connections)
        # the rotation, not the SDK, retries a failed backlog send: no SDK retries on the secondary either
        self._secondary = Namespace("secondary", config.secondary,
                                    {"retry_total": 0, "try_timeout": sa.primary_try_timeout.total_seconds()},
                                    clock=clock, connections_per_entity=connections)
        key = pairing_key(config)
        settings = {"failover_interval": sa.failover_interval.total_seconds(),
                    "ping_primary_interval": sa.ping_primary_interval.total_seconds(),
                    "backlog_cooldown": sa.backlog_cooldown.total_seconds()}
        pairing = (f"primary {config.primary.fully_qualified_namespace}, secondary "
                   f"{config.secondary.fully_qualified_namespace}, backlog_prefix {sa.backlog_prefix!r}")
        self._usable: tuple[str, ...] | None = None
        self._pair_lock = threading.Lock()
        self._pair_attempts = 0  # pairing attempts ended (under _pair_lock)
        self._pair_error: PairingError | None = None  # the last attempt's error, None after a success
        self._state_lock = threading.Lock()
        self._closed = False
        self._saw_connection_error = False
        self._counters: dict[str, int] = {"sent_primary": 0, "sent_backlog": 0, "busy_waits": 0,
                                          "connection_refusals": 0}
        self._pool = SendPool(config.sink.sends_in_flight)
        #: which sessions have messages in the backlog (spark_sb.paired.sessions: sessions keep their order)
        # a question is part of a send: it fits in the pairing timeout, its second try (on a new link) included
        self.sessions = ParkedSessions(self._peek_receiver, sa.ping_primary_interval.total_seconds(), clock,
                                       self._backlog_queue_exists, timeout=sa.pairing_timeout.total_seconds(),
                                       namespace=config.secondary.fully_qualified_namespace)
        # joined last (nothing after it can fail); close() leaves it
        self._attached = False  # to the board's ping task
        self.board: HealthBoard = join_board(key, settings, clock, pairing, ping_wait)

    @classmethod
    def from_config(
        cls,
        source: str | os.PathLike[str] | Mapping[str, Any] | SparkSbConfig,
        *,
        clock: Clock = time.monotonic,
        sleep: Sleep = time.sleep,
        rng: random.Random | None = None,
        backoff: Backoff | None = None,
        ping_wait: Wait | None = None,
    ) -> PairedSender:
        """From a YAML path, a dict or a :class:`SparkSbConfig`. Nothing connects until :meth:`pair` or the
        first :meth:`send`; a wrong option raises :class:`~spark_sb.errors.ConfigError` here.

        ``clock`` and ``sleep`` are the sender's time (the failover timer, backoff waits); ``ping_wait`` is the
        wait of the pairing's background ping task (see :mod:`spark_sb.bus.pings`; default: real time).
        The first sender of a pairing in the process sets the clock and ``ping_wait`` of its shared state."""
        return cls(load_config(source), clock=clock, sleep=sleep, rng=rng, backoff=backoff, ping_wait=ping_wait)

    def __repr__(self) -> str:
        return (f"PairedSender(primary={self.config.primary.fully_qualified_namespace!r}, "
                f"secondary={self.config.secondary.fully_qualified_namespace!r}, "
                f"prefix={self._sa.backlog_prefix!r})")

    def __enter__(self) -> PairedSender:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- pairing -------------------------------------------------------------------------------------------

    @property
    def backlog_queues(self) -> tuple[str, ...]:
        """The usable backlog queues (empty before pairing)."""
        return self._usable or ()

    @property
    def backlog_queue_count(self) -> int:
        """The usable backlog queue count after pairing (0 before)."""
        return len(self.backlog_queues)

    def admin_client(self, namespace: NamespaceConfig | None = None) -> ServiceBusAdministrationClient:
        """A ``ServiceBusAdministrationClient`` for ``namespace`` (default: the secondary), without SDK retries
        (provisioning retries by itself). Close it."""
        return bus.admin_client(namespace or self.config.secondary, retry_total=0)

    def pair(self) -> int:
        """Provision the backlog queues on the secondary (behaviour.md, "Backlog queue provisioning") and
        return the usable count. Raises :class:`PairingError` on zero usable queues, a rejected credential, or
        an administration endpoint that does not answer, within ``send_availability.pairing_timeout``."""
        self._check_open()
        with self._pair_lock:
            return self._pair_locked(_PairingTime(self._sa.pairing_timeout.total_seconds()))

    def _pair_locked(self, time_left: _PairingTime) -> int:
        """:meth:`pair` under ``_pair_lock``: one attempt within ``time_left`` (which it uses up as it goes), its
        answer kept for the calls that waited for it."""
        started = self._clock()
        try:
            usable = self._provision(started + time_left.seconds)
        except PairingError as exc:
            self._pair_error = exc
            raise
        finally:
            time_left.seconds -= self._clock() - started
            self._pair_attempts += 1  # counted when it ends: a call that read the count before waits for it
        self._pair_error = None
        self._usable = tuple(usable)
        self.sessions.made(usable)
        return len(usable)

    def _provision(self, deadline: float) -> list[str]:
        """List the backlog queues on the secondary and create the missing ones; returns the usable ones.

        Bounded by ``deadline`` (on the sender's clock): each administration request waits at most the
        secondary's ``admin_timeout`` or what is left before it, no request or retry starts past it, and
        reaching it with queues still to create ends the attempt. A request the endpoint did not answer at all,
        retries included (refused, host not found, timed out: :func:`~spark_sb.errors.is_unanswered`), ends it
        too: the next queues would only wait on the same dead endpoint, one after the other. Queues that exist or
        were created by then are used; none is :class:`PairingError` naming the endpoint and the deadline. An
        endpoint that answers with an error for one queue (e.g. over quota) still gets asked for the others."""
        sa = self._sa
        secondary = self.config.secondary.fully_qualified_namespace
        wanted = sa.backlog_queue_names()
        admin_timeout = self.config.secondary.admin_timeout_seconds
        retry = Retry(ConstantBackoff(sa.provision_retry_spacing.total_seconds()), sa.provision_retries,
                      sleep=self._sleep, clock=self._clock)

        def bounded() -> dict[str, Any]:  # the SDK's timeout keywords (its **kwargs)
            """The next request's connect and read timeouts: ``admin_timeout``, or what is left before the
            deadline; :class:`_OutOfTime` when nothing is."""
            left = deadline - self._clock()
            if left <= 0:
                raise _OutOfTime
            timeout = min(admin_timeout, left)
            return {"connection_timeout": timeout, "read_timeout": timeout}

        def credential_error(exc: BaseException, doing: str) -> PairingError:
            hint = ("the secondary's credential could not get a token" if _token_refused(exc)
                    else "the secondary's credential needs Manage rights")
            return PairingError(redact(f"secondary {secondary}: credential rejected while {doing} ({hint}): {exc}"))

        last_error: BaseException | None = None
        stopped: str | None = None  # why the attempt ended before every missing queue was tried
        try:
            client = self.admin_client()
        except ValueError as exc:
            raise PairingError(f"secondary {secondary}: cannot build an administration client: {exc}") from exc
        try:
            existing: dict[str, Any] = {}
            prefix = f"{sa.backlog_prefix}/"
            try:
                for props in retry.call(lambda: list(client.list_queues(**bounded())), is_blip, deadline=deadline):
                    if props.name in wanted or props.name.startswith(prefix):
                        existing[props.name] = props
            except _OutOfTime:
                stopped = "listing the queues"
            except Exception as exc:
                if classify(exc) is ErrorClass.CONFIGURATION_CREDENTIAL:
                    raise credential_error(exc, "listing queues") from exc
                last_error = exc
                if is_unanswered(exc):
                    stopped = "listing the queues"
                else:
                    _LOGGER.warning("listing the queues of the secondary failed (%s); creating every backlog queue",
                                    redact(str(exc)))
            usable: set[str] = set()
            for name in wanted:
                if name not in existing:
                    continue
                status = str(getattr(existing[name], "status", "Active") or "Active")
                if status.lower() == "active":
                    usable.add(name)
                else:
                    _LOGGER.warning("backlog queue %r exists with status %s; left out (never modified)", name, status)
            for name in (name for name in wanted if name not in existing):
                if stopped is not None:
                    break

                def create(name: str = name) -> bool:
                    try:
                        client.create_queue(name, **BACKLOG_QUEUE_PROPERTIES, **bounded())
                    except Exception as exc:
                        if not already_exists(exc):
                            raise
                    return True

                try:
                    retry.call(create, is_blip, deadline=deadline)
                except _OutOfTime:
                    stopped = f"creating backlog queue {name!r}"
                    continue
                except Exception as exc:
                    if classify(exc) is ErrorClass.CONFIGURATION_CREDENTIAL:
                        raise credential_error(exc, f"creating backlog queue {name!r}") from exc
                    last_error = exc
                    if is_unanswered(exc):
                        stopped = f"creating backlog queue {name!r}"
                        continue
                    _LOGGER.warning("backlog queue %r could not be created: %s", name, redact(str(exc)))
                    continue
                _LOGGER.info("created backlog queue %r", name)
                usable.add(name)
        finally:
            client.close()
        usable_names = [name for name in wanted if name in usable]
        if stopped is not None:
            why = self._stopped_cause(stopped, last_error, deadline)
            if not usable_names:
                raise PairingError(redact(f"secondary {secondary}: no usable backlog queue under "
                                          f"{sa.backlog_prefix!r}: {why}")) from last_error
            _LOGGER.warning("pairing stopped with %d of %d backlog queues usable (%s); using those", len(usable_names),
                            len(wanted), redact(why))
            return usable_names
        if not usable_names:
            raise PairingError(redact(
                f"secondary {secondary}: no usable backlog queue under {sa.backlog_prefix!r} "
                f"(wanted send_availability.backlog_queue_count={sa.backlog_queue_count})"
                + self._provision_cause(last_error))) from last_error
        if len(usable_names) < len(wanted):
            _LOGGER.warning("%d of %d backlog queues usable", len(usable_names), len(wanted))
        return usable_names

    def _admin_endpoint(self) -> str:
        """Where the secondary's administration requests go (for messages; no secret)."""
        from ..admin import admin_endpoint_of

        ns = self.config.secondary
        return admin_endpoint_of(ns.connection_string.reveal() if ns.connection_string is not None else None,
                                 ns.fully_qualified_namespace, ns.admin_endpoint, use_tls=not ns.is_emulator)

    def _stopped_cause(self, doing: str, error: BaseException | None, deadline: float) -> str:
        """Why an attempt ended while ``doing``: the administration endpoint did not answer ``error`` (its
        reason), or the deadline came first."""
        limits = (f"send_availability.pairing_timeout {format_duration(self._sa.pairing_timeout)}, at most "
                  f"{self.config.secondary.admin_timeout_seconds:g} s (admin_timeout) per request")
        endpoint = self._admin_endpoint()
        if error is not None and self._clock() < deadline:
            reason = unreachable_reason(error) or "no answer"
            return (f"the administration endpoint {endpoint} did not answer while {doing} ({reason}: "
                    f"{type(error).__name__}: {_one_line(error)}); pairing stopped there instead of trying each "
                    f"backlog queue against it ({limits})")
        detail = f"; the last error: {type(error).__name__}: {_one_line(error)}" if error is not None else ""
        return (f"the pairing deadline passed while {doing} at the administration endpoint {endpoint} "
                f"({limits}){detail}")

    def _provision_cause(self, error: BaseException | None) -> str:
        """``: <why>`` for the last provisioning error, naming the administration endpoint when it could not be
        reached (e.g. a wrong ``admin_endpoint``); no secret."""
        if error is None:
            return ""
        endpoint = self._admin_endpoint()
        reason = unreachable_reason(error)
        detail = f"{type(error).__name__}: {_one_line(error)}"
        if reason is not None:
            return f": the administration endpoint {endpoint} cannot be reached: {reason} ({detail})"
        return f": the last request to the administration endpoint {endpoint} failed: {detail}"

    def _ensure_paired(self, time_left: _PairingTime | None = None) -> tuple[str, ...]:
        """The usable backlog queues, pairing first when not paired yet. One pairing at a time: a call that
        waited for another thread's attempt takes that attempt's answer (its queues, or its error) instead of
        trying again, so sends in flight at once wait out one pairing, not one each.

        ``time_left``: what the calling send may still spend pairing (``send_availability.pairing_timeout`` in
        all, over its attempts: the last wait before a failover, then the failover itself); with nothing left,
        the last attempt's error is raised again instead of trying once more. Default: a whole
        ``pairing_timeout``."""
        usable, attempts = self._usable, self._pair_attempts
        if usable is not None:
            return usable
        if time_left is None:
            time_left = _PairingTime(self._sa.pairing_timeout.total_seconds())
        with self._pair_lock:
            if self._usable is None and self._pair_attempts != attempts and self._pair_error is not None:
                raise PairingError(self._pair_error.detail) from self._pair_error
            if self._usable is None:
                if time_left.seconds <= 0 and self._pair_error is not None:
                    raise PairingError(
                        f"{self._pair_error.detail.rstrip('.')}; not tried again: this send spent "
                        f"send_availability.pairing_timeout ({format_duration(self._sa.pairing_timeout)}) on "
                        f"pairing already") from self._pair_error
                self._pair_locked(time_left)
            return self._usable or ()

    # --- sending -------------------------------------------------------------------------------------------

    def state(self, entity: str) -> str:
        """``healthy``, ``failing`` or ``failed_over`` (shared by every sender of this pairing)."""
        return self.board.state(entity).value

    def send(self, entity: str, message: ServiceBusMessage | Sequence[ServiceBusMessage]) -> SendResult:
        """Send one message or a list to ``entity`` (primary, or a backlog queue when failed over).

        Messages with a session id keep their session's order through outages (:mod:`spark_sb.paired.sessions`)
        when one thread sends the session, one call after the other, and a session handed over from a sender of
        another process is preceded by :meth:`new_batch`. ``entity`` is compared case-insensitively, as Service
        Bus compares entity names.

        Returns where they went. Raises :class:`~spark_sb.errors.EntityNotFoundError` /
        :class:`~spark_sb.errors.CredentialRejectedError` at once (nothing goes to the backlog),
        :class:`~spark_sb.errors.BadMessageError` for a message too large or one the SDK cannot encode, its
        session id included (nothing of the call is sent), and
        :class:`BacklogUnavailableError` when failed over and no backlog queue accepts.
        """
        self._attach_pings()
        batch = call_messages(entity, message)
        # no pairing here: a send to a healthy primary never needs the secondary; the backlog queues are
        # provisioned when the backlog is first needed (_send_backlog, _prepare_backlog)
        with self.board.sending(entity):
            counts = self._send(entity, batch)
        result = SendResult(entity, counts)
        with self._state_lock:
            self._counters["sent_primary"] += result.primary
            self._counters["sent_backlog"] += result.backlog
        return result

    def submit(self, entity: str, message: ServiceBusMessage | Sequence[ServiceBusMessage]) -> Future[SendResult]:
        """:meth:`send` in one of the sender's ``sink.sends_in_flight`` threads, each with connections of its own
        (:class:`~spark_sb.bus.inflight.SendPool`): several calls in flight at once, each with the guarantees of
        :meth:`send`. The future holds its :class:`SendResult` or its error; what was not acknowledged is never
        in a result. Calls to the same entity may be stored in any order."""
        self._check_open()
        return self._pool.submit(self.send, entity, message)

    def new_batch(self) -> None:
        """Forget what the backlog was seen to hold for sessions: the next session message asks it again
        (:mod:`spark_sb.paired.sessions`). The sink and the writer call it for every partition: another executor
        may have parked a session's messages in an earlier batch.

        **Call it before sending a session that a sender of another process sent before** (a session handed
        over): what this sender found in the backlog stands for ``ping_primary_interval`` otherwise, and a message
        the other process parked meanwhile would be overtaken on the primary. Threads and senders of one process
        need not: what the process parks is known to all of them at once."""
        self.sessions.new_batch()

    def _send(self, entity: str, batch: list[ServiceBusMessage]) -> dict[str, int]:
        """The loop of :meth:`send`: returns ``{destination: count}``."""
        counts: dict[str, int] = {}
        pending = batch
        failures = 0
        refused_since: float | None = None  # when the primary began refusing connections (its quota), if it is
        # what this send may spend pairing, over the last wait before a failover and the failover itself
        pairing_time = _PairingTime(self._sa.pairing_timeout.total_seconds())
        asked = not sessions_of(pending)  # whether the backlog was asked about the sessions' parked messages
        if not asked:
            _check_session_ids(entity, pending)
        while pending:
            self.ping_if_due(entity)
            refused = self.board.refused(entity)
            if refused is not None:
                raise self._refused(refused, entity) from refused
            if self.board.state(entity) is EntityState.FAILED_OVER:
                for queue, n in self._send_backlog(entity, pending, pairing_time).items():
                    counts[queue] = counts.get(queue, 0) + n
                break
            if not asked:
                # here, not before the loop: a ping just above may have failed the entity back (spark_sb.paired.
                # sessions: messages of a session with parked ones follow them, whatever the primary's health)
                asked = True
                pending = self._follow_parked(entity, pending, counts, pairing_time)
                if not pending:
                    break
            stale = failures == 0 and self._primary.stale()
            try:
                send_batches(self._primary, entity, pending, entity)
            except PartialSend as partial:
                if partial.sent:
                    counts[PRIMARY] = counts.get(PRIMARY, 0) + partial.sent
                    pending = pending[partial.sent:]
                    self.board.record_success(entity)
                error = partial.error
            else:
                counts[PRIMARY] = counts.get(PRIMARY, 0) + len(pending)
                self.board.record_success(entity)
                break
            # the decision (retry, wait, fail over, raise) is taken here, outside the attempt
            error_class = classify(error)
            if error_class is ErrorClass.OUTAGE:
                self._after_connection_error(error, "primary")
                if stale and is_connection_lost(error):
                    _LOGGER.info("the idle connection to the primary was gone; retrying %r on a new one", entity)
                    failures = -1  # one immediate retry, not counted; the next error counts
                    continue
                new_state = self.board.record_failure(entity)
                if new_state is EntityState.FAILED_OVER:
                    continue
                failures = max(failures, 0) + 1
                remaining = self.board.remaining(entity)
                delay = min(self._backoff.compute(failures), remaining)
                _LOGGER.info("send to %r failed (%s, attempt %d); retrying the primary in %.3g s",
                             entity, type(error).__name__, failures, delay)
                started = self._clock()
                if delay >= remaining:
                    # the last wait before failing over: open the way there now
                    self._prepare_backlog(entity, pairing_time)
                self._sleep(max(0.0, delay - (self._clock() - started)))
            elif error_class is ErrorClass.THROTTLED:
                refused_since = self._pushback(error, "primary", entity, refused_since)
            else:
                converted = as_spark_sb_error(
                    error, namespace=f"primary {self.config.primary.fully_qualified_namespace}", entity=entity)
                if converted is None:
                    raise error
                raise converted from error
        return counts

    def _pushback(self, error: BaseException, side: str, entity: str, refused_since: float | None) -> float | None:
        """The namespace pushed back (``THROTTLED``): wait, then the caller sends again to the same place. Never
        counts toward a failover.

        * Busy (``ServerBusy``): wait what the service asked ("Please wait N seconds",
          :func:`~spark_sb.errors.retry_after`), else ``server_busy_backoff``; counted in ``busy_waits``.
        * A connection refused at the namespace's connection quota: the same wait, counted in
          ``connection_refusals``, for at most the failover interval from the first refusal (``refused_since``,
          returned for the next call); then :class:`~spark_sb.errors.ConnectionQuotaError` saying what to lower.
        """
        wait = retry_after(error)
        wait = self._busy_backoff if wait is None else wait
        fqdn = (self.config.primary if side == "primary" else self.config.secondary).fully_qualified_namespace
        if not is_connection_quota(error):
            with self._state_lock:
                self._counters["busy_waits"] += 1
            _LOGGER.info("%s busy for %r; waiting %.3g s", side, entity, wait)
            self._sleep(wait)
            return None
        now = self._clock()
        since = now if refused_since is None else refused_since
        patience = self._sa.failover_interval.total_seconds()
        if now - since + wait > patience:
            raise ConnectionQuotaError(f"{side} {fqdn}", now - since, redact(str(error)),
                                       connections_per_entity=self.config.sink.connections_per_entity) from error
        with self._state_lock:
            self._counters["connection_refusals"] += 1
        _LOGGER.warning("the %s namespace %s refused a connection for %r: it holds its maximum of connections (lower "
                        "the connections open to it: docs/sizing.md, \"Sizing a job\"); waiting %.3g s, no failover", side,
                        fqdn, entity, wait)
        self._sleep(wait)
        return since

    def stats(self) -> dict[str, int]:
        """Counters for monitoring: ``sent_primary``, ``sent_backlog``, ``busy_waits`` (server-busy waits) and
        ``connection_refusals`` (waits after a connection refused at the namespace's quota) of this sender, its
        sessions' ``session_follows`` (messages sent behind their session's parked ones, or behind what may be
        parked when the backlog could not be peeked), ``session_peeks`` (requests), ``session_peeks_unfinished``
        (questions their time bound ended), ``session_peek_failures``, ``session_held`` and ``session_unordered``
        (:mod:`spark_sb.paired.sessions`), plus the ``failovers``, ``failbacks`` and
        ``assumed_failovers`` of its shared
        :class:`~spark_sb.bus.health.HealthBoard` (every sender of the pairing in this process)."""
        with self._state_lock:
            counters = dict(self._counters)
        counters.update(self.sessions.stats())
        counters.update(self.board.stats())
        return counters

    def _follow_parked(self, entity: str, pending: list[ServiceBusMessage], counts: dict[str, int],
                       pairing_time: _PairingTime) -> list[ServiceBusMessage]:
        """Send the messages of ``pending`` whose sessions have messages parked (or may have) behind them, into
        the backlog; returns the rest, for the primary."""
        follow, unsure, rest = self._split_parked(entity, pending)
        if follow:
            self.sessions.count("session_follows", len(follow))
            _add_counts(counts, self._send_backlog(entity, follow, pairing_time))
        if unsure:
            rest = self._behind_what_may_be_parked(entity, unsure, counts, pairing_time) + rest
        return rest

    def _split_parked(self, entity: str, batch: list[ServiceBusMessage]
                      ) -> tuple[list[ServiceBusMessage], list[ServiceBusMessage], list[ServiceBusMessage]]:
        """``batch`` as (the messages of sessions with messages parked in the backlog, those of sessions the
        backlog could not tell about, the others), each in its order."""
        names = self._sa.backlog_queue_names()
        follow: list[ServiceBusMessage] = []
        unsure: list[ServiceBusMessage] = []
        rest: list[ServiceBusMessage] = []
        answers: dict[str, bool | None] = {}
        for message in batch:
            session_id = message.session_id
            if not session_id:
                rest.append(message)
                continue
            if session_id not in answers:
                answers[session_id] = self.sessions.parked(session_queue(entity, session_id, names), entity,
                                                           session_id)
            answer = answers[session_id]
            (follow if answer else unsure if answer is None else rest).append(message)
        return follow, unsure, rest

    def _behind_what_may_be_parked(self, entity: str, unsure: list[ServiceBusMessage], counts: dict[str, int],
                                   pairing_time: _PairingTime) -> list[ServiceBusMessage]:
        """Send ``unsure`` (messages of sessions the backlog could not tell about) to their sessions' backlog
        queues, behind whatever may be parked there, which keeps their order either way; returns what is left
        for the primary: nothing, or all of them when the backlog does not take them either (the secondary
        down), with ``send_availability.session_order: available`` (counted in ``session_unordered``). With
        ``strict`` (the default) the send fails then: a session never overtakes what may be parked."""
        try:
            _add_counts(counts, self._send_backlog(entity, unsure, pairing_time))
        except (BacklogUnavailableError, PairingError) as exc:
            if self._sa.session_order == "strict":
                self.sessions.count("session_held", len(unsure))
                sessions = sorted({repr(str(m.session_id)) for m in unsure})
                raise BacklogUnavailableError(
                    entity, detail=f"the backlog can neither say whether session(s) {', '.join(sessions[:5])}"
                    f"{' ...' if len(sessions) > 5 else ''} have messages parked nor take their {len(unsure)} "
                    f"message(s) ({type(exc).__name__}); they are not sent to the primary ahead of what may be "
                    f"parked (send_availability.session_order: strict)") from exc
            self.sessions.count("session_unordered", len(unsure))
            _LOGGER.warning("the backlog can neither tell whether %d messages for %r have their sessions' messages "
                            "parked nor take them (%s); they go to the primary, their order not guaranteed",
                            len(unsure), entity, type(exc).__name__)
            return unsure
        self.sessions.count("session_follows", len(unsure))
        return []

    def _backlog_queue_exists(self, queue: str, timeout: float | None = None) -> bool:
        """Whether backlog queue ``queue`` exists on the secondary: paired here, or the administration API says
        so (one request, within ``timeout`` seconds when given, at most the secondary's ``admin_timeout``; its
        errors are the caller's)."""
        if queue in (self._usable or ()):
            return True
        limit = self.config.secondary.admin_timeout_seconds
        limit = limit if timeout is None else min(limit, timeout)
        with self.admin_client() as admin:
            try:
                admin.get_queue(queue, connection_timeout=limit, read_timeout=limit)
            except Exception as exc:
                if classify(exc) is ErrorClass.CONFIGURATION_NOT_FOUND:
                    return False
                raise
        return True

    def _peek_receiver(self, queue: str) -> Any:
        """The secondary's receiver of backlog queue ``queue``, for a peek (:class:`ParkedSessions`)."""
        return self._secondary.receiver(queue)

    def _send_backlog(self, entity: str, items: Sequence[ServiceBusMessage],
                      pairing_time: _PairingTime | None = None) -> dict[str, int]:
        usable = self._ensure_paired(pairing_time)
        # One encode per message, the batch's own (``add_message``), as a plain batch send pays: the rewrite is not
        # encoded to check it. What the primary could never accept is a bad message here too: a TTL out of range
        # (the rewrite would carry it in an int64 property) is checked without an encode, and a message the batch
        # cannot encode is explained field by field (:func:`_explained`), never the backlog queue's fault.
        for item in items:
            msgs.check_time_to_live(item, entity)
        rewritten = [msgs.to_backlog(item, entity, check=False) for item in items]
        counts: dict[str, int] = {}
        queue: str | None  # a session's backlog queue below, then each one the loop tries
        if sessions_of(items):
            # a session's messages go to its own backlog queue, in order (spark_sb.paired.sessions)
            names = self._sa.backlog_queue_names()
            groups: dict[str, list[tuple[ServiceBusMessage, ServiceBusMessage]]] = {}
            rest: list[ServiceBusMessage] = []
            for item, backlog_message in zip(items, rewritten, strict=True):
                if item.session_id:
                    queue = session_queue(entity, item.session_id, names)
                    groups.setdefault(queue, []).append((item, backlog_message))
                else:
                    rest.append(backlog_message)
            for queue, group in groups.items():
                # known parked by every thread and sender of the process from now on, whatever peeks run meanwhile
                with self.sessions.parking(queue, entity, {str(item.session_id) for item, _ in group}):
                    counts[queue] = counts.get(queue, 0) + self._send_session_queue(entity, queue, group, usable)
            rewritten = rest
        tried: list[str] = []
        last_error: BaseException | None = None
        refused_since: float | None = None
        while rewritten:
            queue = self.board.backlog_queue(entity, usable, self._rng, exclude=tried)
            if queue is None:
                raise BacklogUnavailableError(entity, tried, redact(str(last_error)) if last_error else
                                              "every backlog queue is cooling down") from last_error
            try:
                send_batches(self._secondary, queue, rewritten, entity)
            except BadMessageError as bad:
                raise _explained(bad, items, entity) from bad.__cause__
            except PartialSend as partial:
                if partial.sent:
                    counts[queue] = counts.get(queue, 0) + partial.sent
                    rewritten = rewritten[partial.sent:]
                if classify(partial.error) is ErrorClass.THROTTLED:  # pushback: the same queue, after a wait
                    refused_since = self._pushback(partial.error, "secondary", entity, refused_since)
                    continue
                if classify(partial.error) is ErrorClass.CONFIGURATION_CREDENTIAL:
                    # the secondary said no to the credential: no queue is to blame, and retrying cannot help
                    raise self._secondary_refused(queue, entity, partial.error) from partial.error
                last_error = partial.error
                tried.append(queue)
                _LOGGER.warning("backlog queue %r failed (%s)", queue, type(partial.error).__name__)
                self._after_connection_error(partial.error, "secondary")
                self.board.cool_down(queue)
                continue
            counts[queue] = counts.get(queue, 0) + len(rewritten)
            break
        return counts

    def _send_session_queue(self, entity: str, queue: str,
                            group: list[tuple[ServiceBusMessage, ServiceBusMessage]], usable: Sequence[str]) -> int:
        """Send ``group`` (session messages and their backlog rewrites, in order) to ``queue``, their sessions'
        backlog queue, and to no other: one that does not accept fails the send (another queue would split the
        sessions, and the syphon could then move a later message before an earlier one)."""
        if queue not in usable:
            raise BacklogUnavailableError(entity, [queue], "it is the backlog queue of the message's session, and "
                                          "pairing could not provision it")
        items = [item for item, _ in group]
        pending = [backlog_message for _, backlog_message in group]
        sent = 0
        refused_since: float | None = None
        while pending:
            try:
                send_batches(self._secondary, queue, pending, entity)
            except BadMessageError as bad:
                raise _explained(bad, items, entity) from bad.__cause__
            except PartialSend as partial:
                sent += partial.sent
                pending = pending[partial.sent:]
                if classify(partial.error) is ErrorClass.THROTTLED:
                    refused_since = self._pushback(partial.error, "secondary", entity, refused_since)
                    continue
                if classify(partial.error) is ErrorClass.CONFIGURATION_CREDENTIAL:
                    raise self._secondary_refused(queue, entity, partial.error) from partial.error
                self._after_connection_error(partial.error, "secondary")
                raise BacklogUnavailableError(
                    entity, [queue], f"the backlog queue of the message's session (another would break the "
                    f"session's order): {redact(str(partial.error))}") from partial.error
            else:
                sent += len(pending)
                pending = []
        return sent

    def _secondary_refused(self, queue: str, entity: str, error: BaseException) -> CredentialRejectedError:
        """The error of a backlog send the secondary refused for its credential."""
        return CredentialRejectedError(f"secondary {self.config.secondary.fully_qualified_namespace}",
                                       f"sending to backlog queue {queue!r} for entity {entity!r}: "
                                       f"{refusal(error)}")

    def _prepare_backlog(self, entity: str, pairing_time: _PairingTime | None = None) -> None:
        """Open the sender of the backlog queue this entity will use, so that the first backlog send after
        failover does not pay for a new connection. Best effort: a failure here is met again at send time (a
        pairing that failed here is tried again there only with what is left of the send's ``pairing_time``)."""
        try:
            usable = self._ensure_paired(pairing_time)
            queue = self.board.backlog_queue(entity, usable, self._rng)
            if queue is None:
                return
            with self._secondary.sender(queue) as sdk_sender:
                sdk_sender.__enter__()  # the SDK opens the connection and the link on entering its context
        except Exception as exc:  # noqa: BLE001 - only a head start; the backlog send decides
            _LOGGER.debug("could not open the backlog sender for %r ahead of failover: %s", entity,
                          type(exc).__name__)

    # --- pings ---------------------------------------------------------------------------------------------

    def _attach_pings(self) -> None:
        """Raise when closed; else make sure the pairing's ping task runs and may ping through this sender."""
        with self._state_lock:  # under the lock: close() then sees the attachment and undoes it
            if self._closed:
                raise RuntimeError("this PairedSender is closed")
            if not self._attached:
                self.board.pings.attach(self)
                self._attached = True

    def run_pings_once(self) -> float | None:
        """One round of the pairing's ping task, on the calling thread: ping every failed-over entity whose ping
        is due, and fail back those the primary accepts. Returns the seconds until the next ping is due, or
        ``None`` when no entity is failed over. The background thread runs the same rounds by itself."""
        self._attach_pings()
        return self.board.pings.run_once()

    def ping_if_due(self, entity: str) -> bool:
        """Ping ``entity`` when it is failed over, its ping is due and nobody else is pinging it
        (:meth:`HealthBoard.claim_ping`), and record the result: success fails it back; a rejected credential
        or an unknown entity is kept for the next send (:meth:`HealthBoard.refused`); anything else means still
        down. Returns False when this sender is closed (the ping task then uses another)."""
        if self._closed:
            return False
        if not self.board.claim_ping(entity):
            return True
        ok: bool | None = False
        refused: BaseException | None = None
        try:
            self.ping(entity)
            ok = True
        except Exception as exc:
            if self._closed:
                ok = None  # closed under the ping: no result, the ping stays due
            elif classify(exc).is_configuration:
                refused = exc
                _LOGGER.warning("ping to %r refused (%s): %s", entity, classify(exc).value, redact(str(exc)))
            else:
                _LOGGER.info("ping to %r failed: %s; still failed over", entity, type(exc).__name__)
                self._after_connection_error(exc, "primary")
        finally:
            self.board.ping_result(entity, ok, refused)
        return ok is not None

    def _refused(self, error: BaseException, entity: str) -> SparkSbError:
        """The configuration error a send raises after a ping of ``entity`` was refused with ``error``."""
        namespace = f"primary {self.config.primary.fully_qualified_namespace}"
        if classify(error) is ErrorClass.CONFIGURATION_CREDENTIAL:
            return CredentialRejectedError(namespace, f"a ping while failed over was refused: {refusal(error)}",
                                           entity=entity)
        return EntityNotFoundError(namespace, entity, f"a ping while failed over was refused: {redact(str(error))}")

    def ping(self, entity: str) -> None:
        """Prove the primary entity accepts a message without anyone receiving it (:meth:`Namespace.ping
        <spark_sb.bus.Namespace.ping>`: a ping scheduled far ahead and cancelled at once, with a random session
        id when the entity requires sessions). Raises the SDK's error when the primary does not accept it."""
        self._primary.ping(entity)

    # --- faults and closing --------------------------------------------------------------------------------

    def _after_connection_error(self, error: BaseException, side: Literal["primary", "secondary"]) -> None:
        """An SDK connection of ``side`` shut down: close that side's client (in helper threads, joined by close();
        a handle a send still holds is closed when that send lets go) and rebuild it on next use. The other side's
        is not at fault: closing both made every failed-over send after a ping reconnect (0.9 s instead of
        0.01 s), and every send to the primary that found its connection gone reconnected the backlog's (a worker
        held 3 connections to the secondary in a failover)."""
        if not is_connection_lost(error):
            return
        self._saw_connection_error = True
        namespace = self._primary if side == "primary" else self._secondary
        if namespace.detach():
            _LOGGER.info("connection lost (%s); closing the %s's client", type(error).__name__, side)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this PairedSender is closed")

    def close(self) -> None:
        """Close both namespaces' clients within 5 s; idempotent."""
        with self._state_lock:
            leaving = not self._closed
            self._closed = True
        self._pool.shutdown()  # submitted calls not started are cancelled; running ones meet the closed handles
        deadline = time.monotonic() + CLOSE_TIMEOUT
        if leaving:
            self.board.leave()
            # first: the last sender stops the ping thread, which then uses none of the clients closed below
            self.board.pings.detach(self, CLOSE_TIMEOUT)
        sides = (self._primary, self._secondary)
        for side in sides:
            side.detach(final=True)
        for side in sides:  # one deadline for both
            if not side.wait_closed(deadline):
                _LOGGER.warning("sends still held the %s namespace's clients after %.0f s; closing them anyway",
                                side.name, CLOSE_TIMEOUT)
                side.force_close()
        if self._saw_connection_error:
            # the SDK keeps the socket of a connection that failed while opening in a reference cycle (its
            # exception's traceback); collect it now so that close() leaves no socket behind
            gc.collect()
