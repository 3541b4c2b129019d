"""One namespace's SDK handles: a ``ServiceBusClient`` and the senders and receivers it opened, cached per
entity, built lazily and rebuilt after a detach.

**Generations.** The handles of one client belong to a generation. :meth:`Namespace.detach` (after a
connection error, or on close) starts a new generation for later uses and never pulls a handle from under a
use in progress: the detached generation is closed (senders and receivers first, then the client) as soon as
no ``with`` block holds any of its handles, by the last block to let go, in a helper thread.

**One sender per entity, shared.** An SDK sender or receiver is not thread-safe: one lock per entity (senders)
or per (queue, receive mode) (receivers) serialises every call into it. :meth:`Namespace.send` keeps several
batches in flight on an entity's one sender (:mod:`spark_sb.bus.pipeline`): threads that send to the same entity
share its link and its connection instead of opening one each, so a process holds one sending connection per
entity it sends to, whatever its sends in flight. :meth:`Namespace.sender` hands the sender to one ``with``
block at a time (pings, building batches, the syphon's sends).

**Lanes** (:func:`send_lane`) are kept for the pools that set them; senders no longer depend on them.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal, TypeVar

from azure.servicebus import ServiceBusClient, ServiceBusReceiveMode, ServiceBusReceiver, ServiceBusSender
from azure.servicebus.exceptions import ServiceBusConnectionError
from azure.servicebus.management import ServiceBusAdministrationClient

from .. import messages as msgs
from ..admin import admin_client as build_admin_client
from ..config import NamespaceConfig, SparkSbConfig
from ..errors import is_link_gone, is_message_not_found, needs_session, raise_if_refused
from . import pipeline
from ._registry import close_quietly, shared

_LOGGER = logging.getLogger(__name__)
_T = TypeVar("_T")


def _one_listener(sdk_receiver: ServiceBusReceiver) -> ServiceBusReceiver:
    """``sdk_receiver``, whose connection is listened on by one thread at a time.

    With ``prefetch_count=0`` azure-servicebus (pyamqp) starts a keep-alive thread per receiver that calls
    ``connection.listen()`` every 5 s, while the thread that receives and settles calls it too. Two threads then
    process one link's transfers at once, and ``ReceiverLink._incoming_transfer`` keeps the transfer in progress
    on the link: a message comes out with the delivery id and tag of another transfer. Settling it settles that
    other delivery, and its own stays locked until the lock runs out (a message a lock's duration late: docs/sizing.md,
    "A straggler, found and fixed"). The keep-alive thread is kept, because it also releases messages that reach the receiver
    between calls; each connection the SDK opens for this receiver (on open and on reconnect) gets a lock around
    ``listen``. An SDK without these internals is left as it is."""
    create = getattr(sdk_receiver, "_create_handler", None)
    if create is None:
        return sdk_receiver

    def create_handler(auth: Any) -> None:
        create(auth)
        handler: Any = getattr(sdk_receiver, "_handler", None)
        open_handler = getattr(handler, "open", None)
        if open_handler is None:
            return

        def open_locked(*args: Any, **kwargs: Any) -> None:
            open_handler(*args, **kwargs)
            _lock_listen(getattr(handler, "_connection", None))

        handler.open = open_locked

    sdk_receiver._create_handler = create_handler  # type: ignore[method-assign]
    return sdk_receiver


def _refusal_raised(sdk_handle: _T, namespace: str, entity: str) -> _T:
    """``sdk_handle`` (an SDK sender or receiver of ``entity``), which raises a rejected credential at once, as
    :class:`~spark_sb.errors.CredentialRejectedError` naming ``namespace`` (``"primary <host>"``), the entity and
    the refusal.

    The SDK marks ``ServiceBusAuthenticationError`` and ``ServiceBusAuthorizationError`` retryable, whatever their
    cause, and retries them for its whole retry policy (four refusals in about 15 s with its defaults) before the
    caller sees them, saying only "Service Bus has encountered an error". A credential the service refused (a CBS
    401 or 403, ``amqp:unauthorized-access``: :func:`~spark_sb.errors.classify` says ``configuration-credential``) is
    refused again on every retry: it is raised on the first one. A broken CBS exchange (no status, a lost
    connection) is still retried as the SDK does. Every retry of the SDK, its own and :mod:`.pipeline`'s, maps an
    error through the handle's ``_handle_exception``; an SDK without it is left as it is."""
    handle_exception = getattr(sdk_handle, "_handle_exception", None)
    if handle_exception is None:
        return sdk_handle

    def handle_refusal(exception: BaseException) -> Any:
        error = handle_exception(exception)  # raises the errors the SDK does not retry
        raise_if_refused(error, namespace, entity=entity)
        return error

    sdk_handle._handle_exception = handle_refusal  # type: ignore[attr-defined]
    return sdk_handle


def _lock_listen(connection: Any) -> None:
    """Serialise ``connection.listen`` (re-entrant: closing the connection listens from inside a listen)."""
    listen = getattr(connection, "listen", None)
    if listen is None or getattr(listen, "spark_sb_locked", False):
        return
    lock = threading.RLock()

    def listen_alone(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return listen(*args, **kwargs)

    listen_alone.spark_sb_locked = True  # type: ignore[attr-defined]
    connection.listen = listen_alone


__all__ = ["NAMESPACE_KIND", "PING_SCHEDULE_AHEAD", "SENDER_KWARGS", "STALE_AFTER", "Namespace", "admin_client",
           "current_lane", "send_lane", "shared_namespace"]

# The SDK's keep-alive thread makes a failed sender's close() wait up to 1 s (it sleeps in 1 s steps), which
# delays every outage signal by about half a second. Senders here run without it; a connection the service
# dropped while idle is caught by the stale-connection rule (:meth:`Namespace.stale`) instead.
SENDER_KWARGS: Mapping[str, Any] = {"keep_alive": 0}
# A connection error on the first attempt after this long without a successful operation on a namespace is
# taken for a stale connection: the caller may retry at once on a new one.
STALE_AFTER = 30.0
#: a ping is scheduled this far ahead and cancelled at once: nobody can ever receive it
PING_SCHEDULE_AHEAD = timedelta(days=365)

#: the kind of the shared namespaces in the process registry (:func:`spark_sb.bus.shared`)
NAMESPACE_KIND = "namespace"

Spawn = Callable[[Callable[[], None]], None]

_LANES = threading.local()


def current_lane() -> int:
    """The calling thread's send lane: 0, unless the thread was made a lane of its own by :func:`send_lane`."""
    return getattr(_LANES, "lane", 0)


def send_lane(lane: int) -> None:
    """Give the calling thread lane ``lane`` (:func:`current_lane`): a number a pool's threads can tell each other
    apart by. Senders used to be per lane (a connection each); they are shared per entity now
    (:meth:`Namespace.send`)."""
    _LANES.lane = lane


class _Generation:
    """One generation of a namespace's SDK handles: a client and the senders and receivers it opened. Closed
    once, by whoever finds it detached with no ``with`` block holding it (``users``); ``done`` is set once it is
    closed."""

    def __init__(self) -> None:
        self.client: Any = None
        self.senders: dict[tuple[str, int], Any] = {}  # by (entity, slot)
        self.receivers: dict[tuple[str, bool], Any] = {}
        self.users = 0
        self.detached = False
        self.taken = False
        self.done = threading.Event()

    def take(self) -> list[Any]:
        """What must be closed (senders and receivers first, then the client), handed out once."""
        if self.taken:
            return []
        self.taken = True
        handles = [*self.senders.values(), *self.receivers.values()]
        if self.client is not None:
            handles.append(self.client)
        self.senders, self.receivers, self.client = {}, {}, None
        if not handles:
            self.done.set()
        return handles


def _close_handles(handles: Sequence[Any], done: threading.Event) -> None:
    """Close a generation's ``handles``: its senders and receivers at once, each in a thread of its own (each has
    a connection of its own), then its client. Closing a receiver waits for its SDK keep-alive thread, which
    sleeps in 1 s steps, plus a few round trips: one after the other, the receivers of ten backlog queues took
    about 5 s on loopback (the syphon's, at the end of bench/latency.py's syphon row), longer to a far namespace."""
    try:
        links = [h for h in handles if not isinstance(h, ServiceBusClient)]
        closers = [threading.Thread(target=close_quietly, args=(h,), name="spark-sb-close-link", daemon=True)
                   for h in links[1:]]
        for closer in closers:
            closer.start()
        if links:
            close_quietly(links[0])
        for closer in closers:
            closer.join()
        for handle in handles:
            if isinstance(handle, ServiceBusClient):
                close_quietly(handle)
    finally:
        done.set()


class Namespace:
    """The SDK handles of one namespace (``name`` is what logs and errors call it: ``primary``,
    ``secondary``). ``client_kwargs`` go to every ``ServiceBusClient`` it builds (retry policy, timeouts);
    ``clock`` dates :attr:`last_ok` (for :meth:`stale`); ``spawn(close)`` runs the closing of a detached
    generation in a helper thread (default: a daemon thread that :meth:`wait_closed` joins);
    ``connections_per_entity``: the SDK senders (each a connection) of one entity, shared by the threads that
    send to it (a thread uses the one of its lane, :func:`send_lane`, modulo this count). Thread-safe."""

    def __init__(self, name: str, namespace: NamespaceConfig, client_kwargs: Mapping[str, Any] = {}, *,
                 clock: Callable[[], float] = time.monotonic, spawn: Spawn | None = None,
                 connections_per_entity: int = 1) -> None:
        if connections_per_entity < 1:
            raise ValueError(f"connections_per_entity must be at least 1, got {connections_per_entity}")
        self.name = name
        self.connections_per_entity = connections_per_entity
        self.namespace = namespace
        self._client_kwargs = dict(client_kwargs)
        self._clock = clock
        self._spawn = spawn or self._spawn_thread
        #: when a ``with`` block of this namespace last ended without an exception
        self.last_ok: float | None = None
        self._lock = threading.Lock()
        self._current = _Generation()
        self._detached: list[_Generation] = []  # detached generations not closed yet
        self._handle_locks: dict[object, threading.RLock] = {}
        self._sender_ios: dict[tuple[str, int], pipeline.SenderIo] = {}
        self._session_entities: set[str] = set()  # entities whose pings need a session id
        self._closers: list[threading.Thread] = []
        self.closed = False

    def __repr__(self) -> str:
        return f"Namespace({self.name!r}, {self.namespace.fully_qualified_namespace!r})"

    @property
    def where(self) -> str:
        """What errors call it: ``"<name> <host>"`` (``primary contoso.servicebus.windows.net``)."""
        return f"{self.name} {self.namespace.fully_qualified_namespace}"

    # --- handles ---------------------------------------------------------------------------------------

    def _handle_lock(self, key: object) -> threading.RLock:
        with self._lock:
            return self._handle_locks.setdefault(key, threading.RLock())

    @contextmanager
    def _use(self, cache: Callable[[_Generation], dict[Any, Any]], key: object,
             open_handle: Callable[[Any], Any]) -> Iterator[tuple[_Generation, Any]]:
        """The cached handle ``cache(generation)[key]`` of the current generation, opened with
        ``open_handle(client)`` when missing, held (``users``) for the ``with`` block."""
        with self._lock:
            if self.closed:
                raise RuntimeError(f"the {self.name} namespace's handles are closed")
            generation = self._current
            handles = cache(generation)
            handle = handles.get(key)
            if handle is None:
                if generation.client is None:
                    _LOGGER.debug("opening a client for the %s namespace %s", self.name,
                                  self.namespace.fully_qualified_namespace)
                    generation.client = self.namespace.client(**self._client_kwargs)
                handle = handles[key] = open_handle(generation.client)
            generation.users += 1
        try:
            yield generation, handle
            self.last_ok = self._clock()
        finally:
            self._release(generation)

    def _sender_key(self, entity: str) -> tuple[str, int]:
        """The calling thread's sender of ``entity``: ``(entity, slot)``, the slot from its lane."""
        return entity, current_lane() % self.connections_per_entity

    def _sender_lock(self, key: tuple[str, int]) -> pipeline.SenderIo:
        """The lock around every call into the SDK sender ``key`` (:class:`.pipeline.SenderIo`)."""
        with self._lock:
            return self._sender_ios.setdefault(key, pipeline.SenderIo())

    def _use_sender(self, key: tuple[str, int]) -> Any:
        return self._use(lambda g: g.senders, key,
                         lambda client: _refusal_raised(client.get_queue_sender(key[0], **SENDER_KWARGS), self.where,
                                                        key[0]))

    @contextmanager
    def sender(self, entity: str) -> Iterator[ServiceBusSender]:
        """This namespace's SDK sender of ``entity`` (a queue or topic: an AMQP sender only needs the path), held
        exclusively for the ``with`` block: other threads' :meth:`send` calls wait for it to end."""
        key = self._sender_key(entity)
        with self._sender_lock(key), self._use_sender(key) as (_, sdk_sender):
            yield sdk_sender

    @contextmanager
    def batch_sender(self, entity: str) -> Iterator[ServiceBusSender]:
        """This namespace's SDK sender of ``entity``, open, for building batches (``create_message_batch``,
        ``ServiceBusMessageBatch.add_message``): held for the ``with`` block without its lock, so that the sends in
        flight on it and the pump that reads their answers go on while the batches are built (an open sender's
        ``create_message_batch`` does not touch its link). A sender another thread dropped meanwhile
        (:meth:`drop_sender`) fails the block with :class:`~spark_sb.bus.pipeline.SenderClosed`: build again.
        An SDK whose sender does not say it is open (``_max_message_size_on_link``) holds the lock for the block."""
        key = self._sender_key(entity)
        io = self._sender_lock(key)
        with self._use_sender(key) as (_, sdk_sender):
            if not hasattr(sdk_sender, "_max_message_size_on_link"):
                with io:
                    yield sdk_sender
                return
            with io:
                if not sdk_sender._max_message_size_on_link:
                    sdk_sender.create_message_batch()  # opens the link: the batch size is the link's
            try:
                yield sdk_sender
            except ValueError as exc:
                if sdk_sender._shutdown.is_set():  # closed under the block: "the handler has already been shutdown"
                    raise pipeline.SenderClosed from exc
                raise

    def send(self, entity: str, batch: Any) -> None:
        """Send ``batch`` (a ``ServiceBusMessageBatch`` built by this namespace's sender of ``entity``) on that
        sender, with the SDK's retry policy and try timeout: several threads' batches are in flight on its one
        link at once (:func:`spark_sb.bus.pipeline.send_batch`). Raises the SDK's error. A sender another thread
        dropped (:meth:`drop_sender`) under this send is replaced, and the batch sent on the new one (three
        times at most; then the send fails as a lost connection would)."""
        key = self._sender_key(entity)
        for _ in range(3):
            with self._use_sender(key) as (_, sdk_sender):
                try:
                    pipeline.send_batch(sdk_sender, self._sender_lock(key), batch,
                                        check=lambda error: raise_if_refused(error, self.where, entity=entity))
                    return
                except pipeline.SenderClosed:
                    _LOGGER.debug("the %s namespace's sender of %r was dropped under a send; sending on a new one",
                                  self.name, entity)
                    with self._lock:
                        if self._current.senders.get(key) is sdk_sender:
                            del self._current.senders[key]
        raise ServiceBusConnectionError(message=f"the {self.name} namespace's sender of {entity!r} was closed under "
                                                f"three sends in a row")

    def has_sender(self, entity: str) -> bool:
        """Whether this namespace holds an open sender of ``entity`` (used before)."""
        with self._lock:
            return self._sender_key(entity) in self._current.senders

    def with_sender(self, entity: str, attempt: Callable[[ServiceBusSender], _T]) -> _T:
        """``attempt(sdk_sender)`` with the sender of ``entity``, held exclusively. A sender used before whose link the
        service detached meanwhile (idle for 10 minutes, or forced in an upgrade: ``amqp:link:detach-forced``)
        fails its next operation: it is dropped and ``attempt`` runs once more on a new one. Any other failure,
        or a second one, is raised. ``attempt`` must be safe to run again after a failure (it sent nothing)."""
        reused = self.has_sender(entity)
        try:
            with self.sender(entity) as sdk_sender:
                return attempt(sdk_sender)
        except Exception as exc:
            if not (reused and is_link_gone(exc)):
                raise
            _LOGGER.info("the %s namespace's sender of %r was detached (%s): opening a new one", self.name, entity,
                         type(exc).__name__)
            self.drop_sender(entity)
        with self.sender(entity) as sdk_sender:
            return attempt(sdk_sender)

    def drop_sender(self, entity: str) -> None:
        """Close and forget the sender of ``entity`` (after a failed send, or when its backlog queue leaves the
        rotation): the next use opens a new one. Waits for a ``with`` block of another thread holding it; a
        :meth:`send` in flight on it fails and is retried on the new one."""
        key = self._sender_key(entity)
        with self._sender_lock(key):
            with self._lock:
                sdk_sender = self._current.senders.pop(key, None)
            if sdk_sender is not None:
                close_quietly(sdk_sender, f"the sender of {entity!r}")

    @contextmanager
    def receiver(self, queue: str, *, delete: bool = False) -> Iterator[ServiceBusReceiver]:
        """This namespace's receiver of ``queue`` (prefetch 0; peek-lock, or receive-and-delete when
        ``delete``), held exclusively for the ``with`` block. An exception in the block other than "message not
        found" (:func:`~spark_sb.errors.is_message_not_found`: an answer, not a broken link) closes and forgets
        the receiver, the next use opens a new one, and the exception is re-raised."""
        key = (queue, delete)
        mode = ServiceBusReceiveMode.RECEIVE_AND_DELETE if delete else ServiceBusReceiveMode.PEEK_LOCK
        with self._handle_lock(("receiver", *key)), self._use(
                lambda g: g.receivers, key,
                lambda client: _refusal_raised(_one_listener(
                    client.get_queue_receiver(queue, prefetch_count=0, receive_mode=mode)), self.where, queue),
        ) as (generation, sdk_receiver):
            try:
                # open it here, with the SDK's retries and try timeout (at once when open): left to the first
                # receive_messages, the opening would have only that call's max_wait_time, and against a far
                # namespace (several round trips to open) a short wait never opened it
                sdk_receiver.__enter__()
                yield sdk_receiver
            except Exception as exc:
                if not is_message_not_found(exc):
                    with self._lock:
                        if generation.receivers.get(key) is sdk_receiver:
                            del generation.receivers[key]
                    close_quietly(sdk_receiver, f"the receiver of {queue!r}")
                raise

    def drop_receiver(self, queue: str, *, delete: bool = False) -> None:
        """Close and forget the receiver of ``queue`` (peek-lock, or receive-and-delete when ``delete``) after a
        block that ended without an exception found its link or connection gone (the SDK shut its handler down):
        the next use opens a new one. Waits for a ``with`` block of another thread holding it."""
        key = (queue, delete)
        with self._handle_lock(("receiver", *key)):
            with self._lock:
                sdk_receiver = self._current.receivers.pop(key, None)
            if sdk_receiver is not None:
                close_quietly(sdk_receiver, f"the receiver of {queue!r}")

    # --- pings -----------------------------------------------------------------------------------------

    def ping(self, entity: str) -> None:
        """Prove ``entity`` accepts a message without anyone receiving it: schedule a ping message far in the
        future and cancel it at once (with a random session id when the entity requires sessions, remembered
        per entity). Raises the SDK's error when it is refused."""
        with self._lock:
            with_session = entity in self._session_entities
        try:
            self._schedule_and_cancel(entity, with_session)
        except Exception as exc:
            if with_session or not needs_session(exc):
                raise
            with self._lock:
                self._session_entities.add(entity)
            self._schedule_and_cancel(entity, True)

    def _schedule_and_cancel(self, entity: str, with_session: bool) -> None:
        ping = msgs.ping_message(str(uuid.uuid4()) if with_session else None)
        when = datetime.datetime.now(datetime.UTC) + PING_SCHEDULE_AHEAD
        sequence_numbers = self.with_sender(entity, lambda sdk_sender: sdk_sender.schedule_messages(ping, when))
        try:
            with self.sender(entity) as sdk_sender:
                sdk_sender.cancel_scheduled_messages(sequence_numbers)
        except Exception as exc:  # accepted: the ping proved the point; it expires unseen (TTL 1 s)
            _LOGGER.warning("cancelling ping %s on %r failed: %s", sequence_numbers, entity, type(exc).__name__)

    # --- generations and closing -----------------------------------------------------------------------

    def _spawn_thread(self, close: Callable[[], None]) -> None:
        closer = threading.Thread(target=close, name="spark-sb-close", daemon=True)
        with self._lock:
            self._closers = [t for t in self._closers if t.is_alive()]
            self._closers.append(closer)
        closer.start()

    def _release(self, generation: _Generation) -> None:
        with self._lock:
            generation.users -= 1
            handles = generation.take() if generation.detached and generation.users == 0 else []
        if handles:
            self._spawn(lambda: _close_handles(handles, generation.done))

    def stale(self) -> bool:
        """True when the connection has been idle long enough (:data:`STALE_AFTER`) that the service may have
        dropped it."""
        last = self.last_ok
        return last is not None and self._clock() - last >= STALE_AFTER

    def detach(self, *, final: bool = False) -> bool:
        """Forget the client and its handles: they are closed (in a helper thread) now, or by the last ``with``
        block still holding one; the next use opens new ones. ``final``: no client is built any more (a use
        racing with close() fails instead of reopening). Returns True when there was a client."""
        with self._lock:
            self.closed = self.closed or final
            generation, self._current = self._current, _Generation()
            had_client = generation.client is not None
            generation.detached = True
            self._detached = [g for g in self._detached if not g.done.is_set()]
            handles = generation.take() if generation.users == 0 else []
            if not generation.done.is_set():
                self._detached.append(generation)
        if handles:
            self._spawn(lambda: _close_handles(handles, generation.done))
        return had_client

    def wait_closed(self, deadline: float) -> bool:
        """Wait until ``deadline`` (``time.monotonic()``) for every detached generation to be closed (and for
        the closing threads of the default ``spawn``); True when all are."""
        with self._lock:
            pending = [g for g in self._detached if not g.done.is_set()]
            closers = list(self._closers)
        for generation in pending:
            generation.done.wait(max(0.0, deadline - time.monotonic()))
        for thread in closers:
            thread.join(max(0.0, deadline - time.monotonic()))
        return all(g.done.is_set() for g in pending) and not any(t.is_alive() for t in closers)

    def force_close(self) -> None:
        """Close what ``with`` blocks still hold (a close ran out of time waiting for them)."""
        with self._lock:
            taken = [(g.take(), g) for g in self._detached if not g.done.is_set()]
        for handles, generation in taken:
            _close_handles(handles, generation.done)

    def close(self, timeout: float = 5.0) -> None:
        """Close every handle within ``timeout`` seconds (:meth:`detach` ``final``, wait, then force);
        idempotent. Any later use raises ``RuntimeError``."""
        self.detach(final=True)
        if not self.wait_closed(time.monotonic() + timeout):
            _LOGGER.warning("the %s namespace's handles were not all closed after %.0f s (a use still held one, or "
                            "closing took longer); closing them anyway", self.name, timeout)
            self.force_close()


def admin_client(namespace: NamespaceConfig, **kwargs: Any) -> ServiceBusAdministrationClient:
    """A ``ServiceBusAdministrationClient`` for ``namespace`` (its connection string, or its namespace and
    credential), built by :func:`spark_sb.admin.admin_client`; ``kwargs`` go to the SDK. Close it. A real
    namespace's client goes through the namespace's ``http_proxy`` and trusts its ``connection_verify``; the
    emulator's administration API is plain HTTP on its own port. Every request is bounded by the namespace's
    ``admin_timeout`` (connect and read), unless ``kwargs`` set ``connection_timeout`` or ``read_timeout``."""
    timeout = namespace.admin_timeout_seconds
    kwargs = {"connection_timeout": timeout, "read_timeout": timeout, **kwargs}
    if not namespace.is_emulator:
        kwargs = {**namespace.admin_kwargs(), **kwargs}
    if namespace.connection_string is not None:
        return build_admin_client(namespace.connection_string.reveal(), admin_endpoint=namespace.admin_endpoint, **kwargs)
    return build_admin_client(fully_qualified_namespace=namespace.fully_qualified_namespace,
                              credential=namespace.credential(), admin_endpoint=namespace.admin_endpoint,
                              use_tls=not namespace.is_emulator, **kwargs)


def shared_namespace(config: SparkSbConfig, side: Literal["primary", "secondary"], *,
                     retries: bool = True, lane: int = 0) -> Namespace:
    """The process-wide :class:`Namespace` of ``config``'s ``side`` for ``(config.fingerprint(), side,
    retries, lane)``. Each lane is its own connection: two threads that must use the namespace at once each
    take a lane (the SDK's handles of one connection must not be used from two threads at once). The primary's clients are built with ``send_availability.primary_client_kwargs()`` (the
    failover interval, not the SDK, decides); the secondary's with the SDK's default retry policy.
    ``retries=False`` adds ``retry_total=0``: for requests whose failure is an answer, e.g. fetching deferred
    messages by sequence number, which the SDK would otherwise retry with backoff. Closed (for good) by
    :func:`close_all` and at interpreter exit: look it up at each use rather than keeping it."""
    if side == "primary":
        namespace, kwargs = config.primary, dict(config.send_availability.primary_client_kwargs())
    elif side == "secondary":
        namespace, kwargs = config.secondary, {}
    else:
        raise ValueError(f"side must be 'primary' or 'secondary', got {side!r}")
    if not retries:
        kwargs["retry_total"] = 0
    key = (config.fingerprint(), side, retries, lane)
    return shared(NAMESPACE_KIND, key, lambda: Namespace(side, namespace, kwargs))
