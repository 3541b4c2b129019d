"""The AMQP 1.0 side of one emulated namespace, on Proton's reactor.

One ``NamespaceServer`` owns a Proton ``Container`` running in its own thread, a ``Broker`` that only
that thread touches, and the namespace's fault table. Other threads (the admin HTTP server, the
Python API, tests) run code on the reactor thread through ``call``.

What the SDK expects on the wire is described in ``shared/design/emulator.md``: SASL ANONYMOUS then
``$cbs`` put-token; links per entity; batches as one transfer; settlement replies; ``$management``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from proton import (
    UNDESCRIBED,
    Array,
    Condition,
    Data,
    Delivery,
    Handler,
    Message,
    Terminus,
    int32,
    symbol,
    timestamp,
)
from proton.reactor import ApplicationEvent, Container, EventInjector

from . import _poll, aad, codec, frames, limits, sas
from .broker import Broker, BrokerError, Cond, Incoming, Stored

_LOGGER = logging.getLogger(__name__)
# Proton logs every write to a socket a client already closed (release churn, killed clients) as an error.
logging.getLogger("proton").setLevel(logging.CRITICAL)
T = TypeVar("T")

SESSION_FILTER = symbol("com.microsoft:session-filter")
LOCKED_UNTIL_UTC = symbol("com.microsoft:locked-until-utc")
LINK_TIMEOUT = symbol("com.microsoft:timeout")
DOTNET_EPOCH_TICKS = 621355968000000000
#: the injectable faults: the one definition (the control API in server.py and the CLI use it).
#: ``timeout``: a send is held unanswered and nothing is stored; ``ack-lost``: a send is stored (receivers get it)
#: but its delivery is held unanswered (the outages page's "duplicate reception": the sender times out although
#: the message is there). On heal, held deliveries of both are settled with a timeout error.
FAULT_KINDS = ("down", "timeout", "ack-lost", "busy", "disabled", "notfound", "quota", "unauthorized")
#: the faults that hold a send's delivery without answering it
_HOLDING_FAULTS = ("timeout", "ack-lost")
_FAULT_CONDITIONS = {
    "busy": (Cond.BUSY, "The server is busy. Please retry the operation after 10 seconds. (injected fault)"),
    "disabled": (Cond.DISABLED, "Messaging entity '{e}' is currently disabled. (injected fault)"),
    "notfound": (Cond.NOT_FOUND, "The messaging entity '{e}' could not be found. (injected fault)"),
    "quota": (Cond.QUOTA, "The maximum entity size of '{e}' has been reached. (injected fault)"),
    "unauthorized": (Cond.UNAUTHORIZED, "Unauthorized access to '{e}'. (injected fault)"),
    "down": ("amqp:link:detach-forced", "The namespace is unavailable. (injected fault)"),
}
_CREDIT = 1000
_DETACH_FORCED = "amqp:link:detach-forced"
_BATCH_ENVELOPE_SLACK = 1024
MGMT_SUFFIX = "/$management"
#: seconds a client has from its TCP connect to its AMQP ``open`` before the namespace closes the socket
DEFAULT_HANDSHAKE_TIMEOUT = 60.0
#: seconds a connection has from its AMQP ``open`` to its first accepted put-token before the namespace closes it
#: with ``amqp:unauthorized-access`` (the condition the service gives any access without a valid token). The SDKs
#: put their token within milliseconds of the open; a connection that puts none only holds a slot of the
#: namespace's ``max_connections`` (issue 49: a flood of such connections kept every client out)
DEFAULT_AUTH_TIMEOUT = 10.0
#: seconds a connection may send nothing (an empty frame is enough) before the namespace closes it
#: (``amqp:resource-limit-exceeded``, "local-idle-timeout expired"), as Service Bus closes idle connections; its
#: ``open`` advertises half of it as its idle-time-out (Proton's rule: a peer that heartbeats at the advertised
#: interval is heard twice per window). Off (0, nothing advertised) by default: azure-servicebus 7.x's receiver
#: does not recover from that close (its next receive fails with "Timed out waiting for the AMQP link to open").
DEFAULT_IDLE_TIMEOUT = 0.0
#: sessions (the channel-max its open advertises) and links a connection may hold at once: the service's (its open
#: says channel-max 4999; past 4,999 links it refuses an attach with "Cannot allocate more handles. The maximum
#: number of handles is 4999."). Proton's binding cannot set the handle-max a begin advertises, so the links are
#: counted per connection (what the service's words count), whatever their session
CHANNEL_MAX = 4999
MAX_LINKS_PER_CONNECTION = 4999
#: links a connection may hold before it has put an accepted token: the SDKs attach the two ``$cbs`` links, put the
#: token, and only then their entity and ``$management`` links (each link costs the emulator ~5 KiB: 4,999 links
#: of a connection without a token were 25 MiB a connection)
MAX_LINKS_BEFORE_TOKEN = 16
#: refused attaches a connection may leave undetached before it is closed: each holds memory until the client
#: detaches it, and a client that attaches on past the limit is not going to
_MAX_REFUSED_LINKS = 100
#: seconds the namespace waits for the answer to a close it sent before it drops the socket
_CLOSE_GRACE = 2.0
#: a ``last-updated-time`` at or after 9999-01-01 means "every session" (the SDK's DateTime.MaxValue marker)
_ALL_SESSIONS_MS = 253370764800000


def _ticks(epoch_seconds: float) -> int:
    return int(epoch_seconds * 10_000_000) + DOTNET_EPOCH_TICKS


def entity_path(address: str | None) -> str:
    """``amqps://localhost:5672/orders`` -> ``orders``; ``sb://host/a/b`` -> ``a/b``; ``orders`` -> ``orders``."""
    if not address:
        return ""
    a = address
    if "://" in a:
        a = a.split("://", 1)[1]
        a = a.split("/", 1)[1] if "/" in a else ""
    return a.strip("/")


@dataclass
class Fault:
    kind: str
    until: float | None  # epoch seconds, None = until healed


@dataclass(eq=False)
class LinkState:
    """What we know of one attached entity link.

    Proton hands a new Python wrapper for the same link on each event, but attributes set on a wrapper live
    in the link's record, so ``link.sb`` is the same object for the link's whole life: it is the link's
    identity (the owner of a session lock), compared by identity (``eq=False``)."""

    path: str  # entity path as the broker knows it (queue, topic, subscription, or a DLQ path)
    kind: str
    sending: bool  # True: the client sends to us (our Receiver)
    peek_lock: bool = True
    session_id: str | None = None
    wants_session: bool = False
    next_available: bool = False
    #: whether the client sent its session filter as a described value (it is echoed in the same form)
    session_filter_described: bool = True
    waiting_since: float | None = None
    wait_timeout: float = 65.0
    held: list[Any] = field(default_factory=list)  # deliveries held by a timeout or ack-lost fault
    active_at: float = 0.0  # the link's last transfer, flow or settlement (for idle detach)
    error: tuple[str, str] | None = None  # a doomed sending link: every transfer is rejected with this


def _guard(fn: Callable[..., None]) -> Callable[..., None]:
    """A handler's exception is logged; it never stops the reactor (and so every other client)."""

    def wrapper(self: NamespaceServer, event: Any) -> None:
        try:
            fn(self, event)
        except Exception:  # noqa: BLE001
            _LOGGER.exception("namespace %s: %s failed", self.name, fn.__name__)

    wrapper.__name__ = fn.__name__
    return wrapper


class NamespaceDown(BrokerError):
    """The namespace's reactor is not running (stopped, or failed: :attr:`NamespaceServer.failure`); the admin API
    answers it with 503."""

    def __init__(self, description: str) -> None:
        super().__init__(Cond.BUSY, description)


class NamespaceServer(Handler):
    """Serves one namespace on ``host:port`` with a broker. Start with ``start()``; stop with ``stop()``.

    ``handshake_timeout``: a connection that has not sent its AMQP ``open`` this many seconds after its TCP connect
    is closed; ``auth_timeout``: a connection that has put no accepted token this many seconds after its ``open`` is
    closed with ``amqp:unauthorized-access``; ``idle_timeout``: a connection silent this long is closed (its ``open`` advertises half of it); 0
    turns either off. If the reactor fails, the namespace closes its port and every connection, logs the error
    (CRITICAL), keeps it in :attr:`failure` and calls ``on_failure(server, error)``.

    Service Bus's limits (:mod:`spark_sb.emulator.limits`): ``max_connections`` concurrent connections (at the
    limit, a new connection takes the slot of the oldest one that has no accepted token yet, closed with
    ``amqp:unauthorized-access``; only when every connection held has one is the new one refused),
    ``max_receivers`` receiver links per queue or subscription, ``ops_per_second`` (None: no throttling)."""

    def __init__(
        self,
        name: str,
        broker_factory: Callable[[Callable[[str], None]], Broker],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        keys: dict[str, str],
        clock: Callable[[], float] = time.time,
        max_message_size: int = 256 * 1024,
        tick_interval: float = 0.05,
        authority: aad.Authority | None = None,
        idle_detach: float = 0.0,
        detach_every: float = 0.0,
        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        auth_timeout: float = DEFAULT_AUTH_TIMEOUT,
        on_failure: Callable[[NamespaceServer, BaseException], None] | None = None,
        max_connections: int = limits.DEFAULT_MAX_CONNECTIONS,
        max_receivers: int = limits.DEFAULT_MAX_RECEIVERS,
        ops_per_second: float | None = None,
    ) -> None:
        super().__init__()
        self.max_connections = max_connections
        self.max_receivers = max_receivers
        self.ops_per_second = ops_per_second
        self._bucket = limits.TokenBucket(ops_per_second) if ops_per_second is not None else None
        #: connections refused at ``max_connections``, receiver attaches refused at ``max_receivers``, operations
        #: refused busy by the throttle, operations counted (messages sent and delivered, management requests)
        self.connections_refused = 0
        self.receivers_refused = 0
        self.throttled = 0
        self.ops = 0
        #: receiver links whose deliveries wait for the throttle's bucket to hold tokens again
        self._starved: list[Any] = []
        self.handshake_timeout = handshake_timeout
        self.idle_timeout = idle_timeout
        #: connections waiting for their AMQP open, oldest first: connection -> monotonic deadline. Dicts, not
        #: queues, here and below: a closed connection leaves them at once (a queue held every connection, and
        #: its links, until its deadline: 60 s of a flood's memory)
        self._handshakes: dict[Any, float] = {}
        #: connections closed for not sending their AMQP open within ``handshake_timeout``
        self.handshakes_timed_out = 0
        self.auth_timeout = auth_timeout
        #: the connections held that have no accepted token yet, oldest first (a dict: ordered, and a connection
        #: leaves it in O(1) when it puts one or closes)
        self._unauthenticated: dict[Any, None] = {}
        #: connections that opened, waiting for their first token: connection -> monotonic deadline
        self._auth_deadlines: dict[Any, float] = {}
        #: connections closed without an accepted token: at ``auth_timeout``, or to give their slot to a new one
        self.unauthenticated_closed = 0
        #: connections sent their close, dropped at the deadline if the client has not answered it
        self._closing: dict[Any, float] = {}
        #: the error that stopped the reactor after it started (None while it runs or after a clean stop)
        self.failure: BaseException | None = None
        self.on_failure = on_failure
        self._running = False
        self.name = name
        self.host = host
        self.port = port
        #: the port of this namespace's AMQPS (TLS) endpoint, when it has one: a client that came through it names
        #: that port in its token audiences
        self.tls_port: int | None = None
        #: the namespace's other ports (admin, WebSockets), set by the Emulator: a token may name any of them
        self.other_ports: Callable[[], Iterable[int | None]] = lambda: ()
        self._warned_unfiltered = False
        self.keys = dict(keys)
        #: Microsoft Entra ID: verifies ``jwt`` put-tokens (None: only SAS tokens are accepted)
        self.authority = authority
        self.clock = clock
        self.max_message_size = max_message_size
        self.tick_interval = tick_interval
        #: Service Bus's habits (NamespaceOptions): detach an entity link idle this long; every entity link this
        #: often; 0: never
        self.idle_detach = idle_detach
        self.detach_every = detach_every
        self._next_detach: float | None = None
        #: entity links detached by these habits, by why (idle, forced): for tests and the soak's tally
        self.detached: dict[str, int] = {"idle": 0, "forced": 0}
        self._broker_factory = broker_factory
        self.broker: Broker | None = None
        self.faults: dict[str | None, Fault] = {}
        self._container: Container | None = None
        self._injector: EventInjector | None = None
        self._calls: queue.Queue[tuple[Callable[[], Any], Future[Any]]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._connections: set[Any] = set()
        #: connections accepted since the start (for monitoring and the tests: a client that reconnects shows)
        self.connections_opened = 0
        #: put-tokens accepted, and of those the ones that replaced an earlier token of the connection for the
        #: same audience (a client renewing its token)
        self.tokens_accepted = 0
        self.tokens_renewed = 0
        self._links_by_path: dict[str, list[Any]] = {}
        self._waiting_attach: list[Any] = []
        self._acceptor: Any = None
        self._stopping = False

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 15.0) -> NamespaceServer:
        self._thread = threading.Thread(target=self._run, name=f"sb-emulator-{self.name}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"namespace {self.name}: the AMQP server did not start within {timeout} s")
        if self._start_error is not None:
            raise self._start_error
        return self

    def _run(self) -> None:
        try:
            _poll.install()  # poll, not select: thousands of connections (spark_sb.emulator._poll)
            self.broker = self._broker_factory(self._on_available)
            self._container = Container(self)
            self._container.container_id = f"spark-sb-emulator-{self.name}"
            self._injector = EventInjector()
            self._container.selectable(self._injector)
            self._container.run()
        except BaseException as err:  # noqa: BLE001 - reported to start(), or a failure of the running namespace
            if self._ready.is_set() and self._start_error is None:
                self._failed(err)
            else:
                _LOGGER.exception("namespace %s: reactor failed", self.name)
                self._start_error = err
                self._ready.set()
        finally:
            self._running = False
            self._fail_pending_calls()
            if self.broker is not None:
                try:
                    self.broker.close()
                except Exception:  # noqa: BLE001
                    _LOGGER.exception("namespace %s: closing the store failed", self.name)

    def on_reactor_init(self, event: Any) -> None:
        try:
            self._acceptor = event.container.acceptor(self.host, self.port)
            sock = self._acceptor._selectable._delegate
            # Proton listens with a backlog of 10: a burst of clients connecting at once (a Spark job's
            # executors) would see dropped SYNs and the SDK's connect timeout. Widen it.
            sock.listen(1024)
            self.port = sock.getsockname()[1]
        except BaseException as err:  # noqa: BLE001
            self._start_error = OSError(f"namespace {self.name}: cannot listen on {self.host}:{self.port}: {err}")
            self._ready.set()
            event.container.stop()
            return
        event.container.schedule(self.tick_interval, self)
        self._running = True
        self._ready.set()

    def stop(self, timeout: float = 5.0) -> None:
        if self._thread is None or not self._thread.is_alive():
            return
        try:
            self.call(self._shutdown, timeout=timeout)
        except Exception:  # noqa: BLE001 - stopping anyway
            _LOGGER.debug("namespace %s: shutdown call failed", self.name, exc_info=True)
        self._thread.join(timeout)

    def _shutdown(self) -> None:
        self._stopping = True
        for conn in list(self._connections):
            self._drop(conn)
        if self._acceptor is not None:
            self._acceptor.close()
        if self._injector is not None:
            self._injector.close()
        assert self._container is not None
        self._container.stop()

    def own_ports(self) -> set[int]:
        """Every port of this namespace (AMQP, AMQPS, admin, WebSockets): the ports its tokens may name."""
        return {p for p in (self.port, self.tls_port, *self.other_ports()) if p is not None}

    def call(self, fn: Callable[[], T], timeout: float = 30.0) -> T:
        """Run ``fn`` on the reactor thread and return its result (or raise its exception); :class:`NamespaceDown`
        when the reactor is not running."""
        if threading.current_thread() is self._thread and self._running:
            return fn()
        if not self._running:
            raise self._down()
        fut: Future[T] = Future()
        self._calls.put((fn, fut))
        assert self._injector is not None
        self._injector.trigger(ApplicationEvent("emulator_call"))
        if not self._running:  # it stopped meanwhile: nobody will take the call
            self._fail_pending_calls()
        return fut.result(timeout)

    def _down(self) -> NamespaceDown:
        if self.failure is not None:
            return NamespaceDown(f"namespace {self.name}: the AMQP server failed: {type(self.failure).__name__}: "
                                 f"{self.failure}")
        return NamespaceDown(f"namespace {self.name}: the AMQP server is not running")

    def _fail_pending_calls(self) -> None:
        while True:
            try:
                _, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            if not fut.done():
                fut.set_exception(self._down())

    def _failed(self, err: BaseException) -> None:
        """The running reactor failed: close the port and every socket, so clients fail fast instead of waiting on
        a port nobody serves; say so loudly; tell the owner (``on_failure``)."""
        self.failure = err
        self._running = False
        _LOGGER.critical("namespace %s: the AMQP server failed and stopped serving port %s: %s: %s", self.name,
                         self.port, type(err).__name__, err, exc_info=err)
        io = getattr(self._container, "_global_handler", None)
        io = getattr(io, "base", io)  # the Container wraps Proton's IOHandler in its GlobalOverrides
        selector = getattr(io, "_selector", None)
        for sel in list(getattr(selector, "_selectables", ())):
            try:
                sel.close()
            except Exception:  # noqa: BLE001 - closing what can be closed
                pass
        if self._acceptor is not None:
            try:
                self._acceptor._selectable._delegate.close()
            except Exception:  # noqa: BLE001
                pass
        if self.on_failure is not None:
            try:
                self.on_failure(self, err)
            except Exception:  # noqa: BLE001
                _LOGGER.exception("namespace %s: on_failure failed", self.name)

    @_guard
    def on_emulator_call(self, event: Any) -> None:
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                fut.set_result(fn())
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                fut.set_exception(err)

    # ------------------------------------------------------------------ timers
    def on_timer_task(self, event: Any) -> None:
        if self._stopping:
            return
        now = self.clock()
        for key, f in list(self.faults.items()):
            if f.until is not None and f.until <= now:
                self._heal(key)
        self._expire_handshakes()
        self._expire_unauthenticated()
        self._habits(now)
        try:
            assert self.broker is not None
            self.broker.tick()
        except Exception:  # noqa: BLE001 - a timer must never kill the reactor
            _LOGGER.exception("namespace %s: broker tick failed", self.name)
        for link in list(self._waiting_attach):
            self._try_session_attach(link)
        if self._starved and self._bucket is not None and self._bucket.tokens() > 0:
            starved, self._starved = self._starved, []
            for link in starved:
                if link.sb is not None:
                    self._pump(link)
        event.container.schedule(self.tick_interval, self)

    def _expire_handshakes(self) -> None:
        """Close the connections that did not send their AMQP ``open`` within ``handshake_timeout`` (a port scan,
        a client that died mid-connect, a bare TCP connection): each holds a socket, and sockets are finite."""
        for conn in _due(self._handshakes):
            t = conn.transport
            if conn.state & conn.REMOTE_UNINIT and t is not None and not t.closed:
                self.handshakes_timed_out += 1
                _LOGGER.info("namespace %s: closed a connection that sent no AMQP open within %g s", self.name,
                             self.handshake_timeout)
                self._drop(conn)

    def _expire_unauthenticated(self) -> None:
        """Close the connections that put no accepted token within ``auth_timeout`` of their ``open``."""
        for conn in _due(self._closing):
            t = conn.transport
            if t is not None and not t.closed:
                self._drop(conn)
        for conn in _due(self._auth_deadlines):
            if conn in self._unauthenticated:
                self._close_unauthenticated(conn, f"The connection was closed: no token was put on $cbs within "
                                                  f"{self.auth_timeout:g} s of its open (auth-timeout).")

    def _close_unauthenticated(self, conn: Any, description: str) -> None:
        """Close ``conn``, which has no accepted token, with ``amqp:unauthorized-access``; its slot is free at once.
        One that has not opened yet is dropped (there is no open to answer)."""
        self.unauthenticated_closed += 1
        _LOGGER.info("namespace %s: %s", self.name, description)
        self._forget_connection(conn)
        t = conn.transport
        if not conn.state & conn.REMOTE_ACTIVE or t is None:
            self._drop(conn)
            return
        conn.condition = _condition(Cond.UNAUTHORIZED, description)
        conn.close()
        # the close frame goes out now; the socket is closed when the client answers, or at the grace's end
        self._closing[conn] = time.monotonic() + _CLOSE_GRACE

    def _habits(self, now: float) -> None:
        """Service Bus's habits: entity links idle longer than ``idle_detach`` are detached, and every entity link
        every ``detach_every`` seconds, both with ``amqp:link:detach-forced`` as the service does (the SDK opens
        the link again on its next use)."""
        if self.detach_every > 0:
            if self._next_detach is None:
                self._next_detach = now + self.detach_every
            elif now >= self._next_detach:
                self._next_detach = now + self.detach_every
                self.detach_links()
        if self.idle_detach > 0:
            for link in [link for links in self._links_by_path.values() for link in links]:
                state: LinkState = link.sb
                if now - state.active_at > self.idle_detach:
                    self.detached["idle"] += 1
                    self._close_link(link, _DETACH_FORCED, f"The link was force detached by the broker because it "
                                     f"was idle for more than {self.idle_detach:g} s. (emulator: idle-detach)")

    def detach_links(self, entity: str | None = None) -> int:
        """Detach every entity link (of ``entity``, or all) and the entity's ``$management`` links with
        ``amqp:link:detach-forced``, as Service Bus does when it moves entities in upgrades and load balancing;
        returns how many. ``$cbs`` links are namespace links, not detached (the SDK never opens a detached
        ``$cbs`` link again: its handlers wait for a token forever). Run on the reactor thread (:meth:`call`)."""
        links = list(self._links_by_path.get(entity, [])) if entity is not None else [
            link for links in self._links_by_path.values() for link in links]
        links += self._management_links(entity)
        for link in links:
            self.detached["forced"] += 1
            self._close_link(link, _DETACH_FORCED, "The link was force detached by the broker (upgrade or load "
                             "balancing); reconnect. (emulator)")
        return len(links)

    def _management_links(self, entity: str | None) -> list[Any]:
        """The open ``$management`` links (of ``entity``'s node, or all) of every connection, forgotten by it."""
        out = []
        for conn in self._connections:
            link = conn.link_head(0)
            while link is not None:
                if (_has_attr(link, "role_kind") and link.role_kind == "mgmt" and not link.state & link.LOCAL_CLOSED
                        and (entity is None or _management_node(link) == entity)):
                    out.append(link)
                link = link.next(0)
            conn.mgmt_senders = {node: s for node, s in conn.mgmt_senders.items() if s not in out}
        return out

    def stats(self) -> dict[str, Any]:
        """The namespace's counts, for monitoring, tests and benchmarks (``GET /$emulator/stats`` on its admin port):

        - ``namespace``: its name;
        - ``connections``: the connections it holds now, every transport (AMQP, AMQPS, ws, wss), each counted from
          its TCP accept to its close (a bare socket that never spoke AMQP counts; a refused one does not);
        - ``connections_opened``: connections accepted since the start (refused ones included);
        - ``connections_refused``: connections refused at ``max_connections``;
        - ``entity_links``: attached entity links (senders and receivers; not ``$cbs`` or ``$management``);
        - ``receivers_refused``: receiver attaches refused at ``max_receivers``;
        - ``ops``: operations admitted and counted, throttled or not: messages sent (a batch of k: k), messages
          delivered to receivers, ``$management`` requests;
        - ``throttled``: sends and management requests refused with ``com.microsoft:server-busy`` by the throttle;
        - ``limits``: the limits in force: ``max_connections``, ``max_receivers``, ``ops_per_second`` (null: off),
          ``message_overhead`` (the bytes each stored message counts against its entity's size quota besides its
          encoded size: what its copy costs in memory);
        - ``tokens_accepted``, ``tokens_renewed``: put-tokens accepted, and those that renewed one of the connection;
        - ``unauthenticated``: connections held now that have no accepted token yet; ``unauthenticated_closed``:
          connections closed without one (at ``auth_timeout``, or to give their slot to a new connection).
        """
        links = sum(len(v) for v in self._links_by_path.values())
        return {"namespace": self.name, "connections": len(self._connections), "entity_links": links,
                "connections_opened": self.connections_opened, "connections_refused": self.connections_refused,
                "receivers_refused": self.receivers_refused, "ops": self.ops, "throttled": self.throttled,
                "limits": {"max_connections": self.max_connections, "max_receivers": self.max_receivers,
                           "ops_per_second": self.ops_per_second,
                           "message_overhead": self.broker.message_overhead if self.broker is not None else None},
                "tokens_accepted": self.tokens_accepted, "tokens_renewed": self.tokens_renewed,
                "unauthenticated": len(self._unauthenticated), "unauthenticated_closed": self.unauthenticated_closed}

    # ------------------------------------------------------------------ faults
    def fault(self, kind: str, entity: str | None = None, duration: float | None = None) -> None:
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {', '.join(FAULT_KINDS)}, got {kind!r}")
        until = None if duration is None else self.clock() + duration
        self.faults[entity or None] = Fault(kind, until)
        _LOGGER.info("namespace %s: fault %s on %s for %s", self.name, kind, entity or "the namespace",
                     "ever" if duration is None else f"{duration} s")
        if kind == "down":
            if entity is None:
                for conn in list(self._connections):
                    self._drop(conn)
            else:
                for link in list(self._links_by_path.get(entity, [])):
                    self._close_link(link, *_FAULT_CONDITIONS["down"])

    def heal(self, entity: str | None = None) -> None:
        if entity is None:
            for key in list(self.faults):
                self._heal(key)
        else:
            self._heal(entity)

    def _heal(self, key: str | None) -> None:
        f = self.faults.pop(key, None)
        if f is None:
            return
        _LOGGER.info("namespace %s: healed %s on %s", self.name, f.kind, key or "the namespace")
        if f.kind in _HOLDING_FAULTS:
            # deliveries held unanswered are answered now with an error (for "timeout" nothing was stored; for
            # "ack-lost" the messages stay stored: the answer, not the message, was lost)
            for links in self._links_by_path.values():
                for link in links:
                    st: LinkState = link.sb
                    for dlv in st.held:
                        self._settle_error(dlv, Cond.TIMEOUT, "The operation timed out. (injected fault)")
                    st.held.clear()

    def fault_for(self, entity: str | None) -> str | None:
        now = self.clock()
        for key in ((entity, None) if entity else (None,)):
            f = self.faults.get(key)
            if f is not None and (f.until is None or f.until > now):
                return f.kind
        if entity:
            # a fault on a topic covers its subscriptions; a fault on an entity covers its DLQ
            base = entity.split("/subscriptions/")[0].replace("/$DeadLetterQueue", "")
            if base != entity:
                return self.fault_for(base)
        return None

    # ------------------------------------------------------------------ connections
    @_guard
    def on_connection_bound(self, event: Any) -> None:
        transport = event.transport
        # the reactor pushes the socket's bytes into the Transport object the acceptor made, not this wrapper
        selectable = getattr(transport, "_selectable", None)
        if selectable is not None and getattr(selectable, "_transport", None) is not None:
            frames.install(selectable._transport, _tracking_info(), label=f"namespace {self.name}")
        elif not self._warned_unfiltered:
            self._warned_unfiltered = True
            _LOGGER.warning("namespace %s: this Proton version hides the transport the reactor reads into; "
                            "clients that number deliveries out of sequence (AutoLockRenewer) will be disconnected",
                            self.name)
        sasl = transport.sasl()
        sasl.allowed_mechs("ANONYMOUS PLAIN EXTERNAL")
        sasl.allow_insecure_mechs = True
        transport.channel_max = CHANNEL_MAX
        if self.idle_timeout > 0:
            transport.idle_timeout = self.idle_timeout
        conn = event.connection
        if self.handshake_timeout > 0:
            self._handshakes[conn] = time.monotonic() + self.handshake_timeout
        conn.authorized = {}  # entity path (audience) -> the aad.Grant its last accepted put-token gave
        conn.cbs_sender = None
        conn.mgmt_senders = {}
        conn.refused = False
        conn.links_held = 0  # links attached and counted against MAX_LINKS_PER_CONNECTION
        conn.links_refused = 0  # attaches refused past it that the client has not detached
        if self.fault_for(None) == "down" or self._stopping:
            transport.close_tail()
            transport.close_head()
            return
        self.connections_opened += 1
        if len(self._connections) >= self.max_connections and self._unauthenticated:
            # a connection without a token gives its slot up: a flood of them cannot keep a client with a key out
            oldest = next(iter(self._unauthenticated))
            self._close_unauthenticated(oldest, f"The connection was closed: it had put no token on $cbs and the "
                                                f"namespace '{self.name}' needed its slot for a new connection "
                                                f"({self.max_connections} connections, max-connections).")
        if len(self._connections) >= self.max_connections:
            # over the quota: not held, refused when it opens (its handshake timeout still applies)
            conn.refused = True
            self.connections_refused += 1
            return
        self._connections.add(conn)
        self._unauthenticated[conn] = None

    @_guard
    def on_connection_remote_open(self, event: Any) -> None:
        conn = event.connection
        if self.fault_for(None) == "down":
            self._drop(conn)
            return
        self._handshakes.pop(conn, None)
        conn.container = f"spark-sb-emulator-{self.name}"
        conn.open()
        if self.auth_timeout > 0 and conn in self._unauthenticated:
            self._auth_deadlines[conn] = time.monotonic() + self.auth_timeout
        if _refused(conn):  # as the service refuses it: its open answered, then closed with the error
            _LOGGER.info("namespace %s: refused a connection: %d connections held, the maximum", self.name,
                         self.max_connections)
            conn.condition = _condition(Cond.QUOTA, limits.connections_text(self.name, self.max_connections))
            conn.close()

    @_guard
    def on_connection_remote_close(self, event: Any) -> None:
        event.connection.close()
        self._forget_connection(event.connection)

    @_guard
    def on_transport_closed(self, event: Any) -> None:
        if event.connection is not None:
            self._forget_connection(event.connection)

    @_guard
    def on_transport_error(self, event: Any) -> None:
        cond = event.transport.condition
        _LOGGER.debug("namespace %s: transport error %s", self.name, cond)
        if event.connection is not None:
            self._forget_connection(event.connection)

    def _forget_connection(self, conn: Any) -> None:
        if conn in self._connections:
            self._connections.discard(conn)
        self._unauthenticated.pop(conn, None)
        self._handshakes.pop(conn, None)
        self._auth_deadlines.pop(conn, None)
        self._closing.pop(conn, None)
        if _has_attr(conn, "mgmt_senders"):
            # the connection's record holds these link wrappers, and each link holds its connection: a cycle
            # through Proton's reference counts that Python's collector cannot see, kept after the close
            conn.mgmt_senders = {}
            conn.cbs_sender = None
        link = conn.link_head(0)
        while link is not None:
            self._forget_link(link)
            link = link.next(0)

    def _drop(self, conn: Any) -> None:
        """Drop a connection abruptly, as a namespace outage does."""
        self._forget_connection(conn)
        t = conn.transport
        if t is not None:
            t.close_tail()
            t.close_head()

    @_guard
    def on_session_remote_open(self, event: Any) -> None:
        if not _refused(event.connection):
            event.session.open()

    @_guard
    def on_session_remote_close(self, event: Any) -> None:
        event.session.close()

    # ------------------------------------------------------------------ links
    @_guard
    def on_link_remote_open(self, event: Any) -> None:
        link = event.link
        conn = link.connection
        if _refused(conn):  # pipelined after its open: the connection is closing
            return
        if not self._count_link(conn, link):
            return
        link.source.copy(link.remote_source)
        link.target.copy(link.remote_target)
        link.max_message_size = self.max_message_size
        link.snd_settle_mode = link.remote_snd_settle_mode
        link.rcv_settle_mode = link.remote_rcv_settle_mode
        if link.is_receiver:
            address = link.remote_target.address
        else:
            address = link.remote_source.address
        path = entity_path(address)
        link.sb = None
        if path == "$cbs":
            link.role_kind = "cbs"
            if link.is_sender:
                conn.cbs_sender = link
            link.open()
            if link.is_receiver:
                link.flow(_CREDIT)
            return
        if path.endswith(MGMT_SUFFIX):
            link.role_kind = "mgmt"
            node = path[: -len(MGMT_SUFFIX)]
            if link.is_sender:
                conn.mgmt_senders[node] = link
            link.open()
            if link.is_receiver:
                link.flow(_CREDIT)
            return
        link.role_kind = "entity"
        if link.is_receiver and link.remote_target.type == Terminus.COORDINATOR:
            # a transaction controller (createTransaction of the Java and .NET SDKs): its declare is refused
            # with a clear error rather than taken for a send to an entity named ''
            self._refuse_link(link, Cond.NOT_IMPLEMENTED, "Transactions are not supported by the emulator.")
            return
        fault = self.fault_for(path)
        if fault == "down":
            self._refuse_link(link, *_FAULT_CONDITIONS["down"])
            return
        if fault in ("notfound", "unauthorized"):
            cond, text = _FAULT_CONDITIONS[fault]
            self._refuse_link(link, cond, text.format(e=path))
            return
        # the client's sender (our receiver) sends; the client's receiver listens
        refusal = self._refusal(conn, path, aad.SEND if link.is_receiver else aad.LISTEN)
        if refusal is not None:
            self._refuse_link(link, Cond.UNAUTHORIZED, refusal)
            return
        try:
            assert self.broker is not None
            kind, broker_path = self.broker.resolve(path)
        except BrokerError as err:
            self._refuse_link(link, err.condition, err.description)
            return
        if link.is_receiver and kind not in ("queue", "topic"):
            self._refuse_link(link, Cond.NOT_IMPLEMENTED, f"Cannot send to '{path}': only queues and topics accept messages.")
            return
        if link.is_sender and kind == "topic":
            self._refuse_link(link, Cond.NOT_IMPLEMENTED, f"Cannot receive from topic '{path}': receive from a subscription.")
            return
        if link.is_sender and self._receivers(broker_path) >= self.max_receivers:
            self.receivers_refused += 1
            self._refuse_link(link, Cond.QUOTA, limits.receivers_text(broker_path, self.max_receivers),
                              null_source=True)
            return
        state = LinkState(path=broker_path, kind=kind, sending=link.is_receiver)
        link.sb = state
        if link.is_receiver:
            self._register(link)
            link.open()
            link.flow(_CREDIT)
            return
        # a receiver of the client: peek-lock unless the client pre-settles
        state.peek_lock = link.remote_snd_settle_mode != 1  # 1 = settled
        filters = _data_object(link.remote_source.filter)
        if isinstance(filters, dict) and SESSION_FILTER in filters:
            state.wants_session = True
            value = filters[SESSION_FILTER]
            state.session_filter_described = hasattr(value, "value")
            if state.session_filter_described:
                value = value.value
            state.session_id = None if value is None else str(value)
            state.next_available = value is None
            props = link.remote_properties or {}
            if LINK_TIMEOUT in props and props[LINK_TIMEOUT]:
                state.wait_timeout = float(props[LINK_TIMEOUT]) / 1000.0
            state.waiting_since = self.clock()
            self._try_session_attach(link)
            return
        self._register(link)
        link.open()

    def _count_link(self, conn: Any, link: Any) -> bool:
        """Count ``link`` against the connection's MAX_LINKS_PER_CONNECTION; False: refused (the service's words,
        ``amqp:resource-limit-exceeded``), or the connection closed for attaching on past the limit."""
        if not _has_attr(conn, "links_held"):
            return True
        without_token = conn in self._unauthenticated
        limit = MAX_LINKS_BEFORE_TOKEN if without_token else MAX_LINKS_PER_CONNECTION
        if conn.links_held < limit:
            conn.links_held += 1
            link.counted = True
            return True
        if conn.links_refused >= _MAX_REFUSED_LINKS:
            if conn.state & conn.LOCAL_ACTIVE:
                _LOGGER.info("namespace %s: closed a connection that kept attaching links past %d",
                             self.name, limit)
                self._forget_connection(conn)
                conn.condition = _condition(Cond.QUOTA, f"The connection was closed: it kept attaching links past "
                                            f"its maximum of {limit}, refused.")
                conn.close()
                self._closing[conn] = time.monotonic() + _CLOSE_GRACE
            return False
        conn.links_refused += 1
        link.refused_over = True
        if link.is_receiver:
            link.target.type = Terminus.UNSPECIFIED
        else:
            link.source.type = Terminus.UNSPECIFIED
        link.open()
        text = f"Cannot allocate more handles. The maximum number of handles is {limit}."
        if without_token:
            text += " (emulator: a connection without a token on $cbs holds at most this many links; put one first)"
        link.condition = _condition(Cond.QUOTA, text)
        link.close()
        return False

    def _try_session_attach(self, link: Any) -> None:
        state: LinkState = link.sb
        assert self.broker is not None
        if link in self._waiting_attach:
            self._waiting_attach.remove(link)
        try:
            sid, locked_until = self.broker.lock_session(state.path, state.session_id, owner=state)
        except BrokerError as err:
            if err.condition == Cond.TIMEOUT and state.next_available:
                waited = self.clock() - (state.waiting_since or self.clock())
                if waited < state.wait_timeout:
                    self._waiting_attach.append(link)
                    return
            self._refuse_link(link, err.condition, err.description, null_source=True)
            return
        state.session_id = sid
        link.source.filter.clear()
        link.source.filter.put_map()
        link.source.filter.enter()
        link.source.filter.put_symbol(SESSION_FILTER)
        if state.session_filter_described:
            # a described value, as the client sent it (a strict decoder refuses a plain string here)
            link.source.filter.put_described()
            link.source.filter.enter()
            link.source.filter.put_symbol(SESSION_FILTER)
            link.source.filter.put_string(sid)
            link.source.filter.exit()
        else:  # a plain string, as the JavaScript SDK (rhea) sends it and reads it back
            link.source.filter.put_string(sid)
        link.source.filter.exit()
        link.properties = {LOCKED_UNTIL_UTC: _ticks(locked_until)}
        self._register(link)
        link.open()
        if link.credit > 0:
            self._pump(link)

    def _receivers(self, path: str) -> int:
        """The client receivers attached to ``path``, and those waiting for a session of it."""
        attached = sum(1 for link in self._links_by_path.get(path, ()) if not link.sb.sending)
        return attached + sum(1 for link in self._waiting_attach if link.sb is not None and link.sb.path == path)

    def _register(self, link: Any) -> None:
        link.sb.active_at = self.clock()
        self._links_by_path.setdefault(link.sb.path, []).append(link)

    def _refuse_link(self, link: Any, condition: str, description: str, *, null_source: bool = False) -> None:
        """Attach (echoing source and target, as the SDK requires) and detach with the error.

        A client's sender takes the attach as readiness and sends at once, so for it the error is put on
        the first transfer's rejection (which the SDK maps to the right exception), then the link closes.

        ``null_source``: refuse a client's receiver as the service refuses a session it cannot lock (AMQP's
        link refusal: an attach with a null source, then the detach with the error). The SDK then skips its
        session attach callback and raises the error (SessionCannotBeLockedError, OperationTimeoutError)
        while it opens the receiver, not at the first receive.

        A client's sender refused for want of a token gets no credit at all: AMQP's link refusal (an attach with a
        null target, then the detach with ``amqp:unauthorized-access``), which the SDK raises while it opens."""
        if link.is_receiver and condition != Cond.UNAUTHORIZED:
            link.sb = LinkState(path="", kind="refused", sending=True, error=(condition, description))
            link.open()
            link.flow(1)
            return
        if null_source:
            link.source.type = Terminus.UNSPECIFIED
        elif link.is_receiver:
            link.target.type = Terminus.UNSPECIFIED
        link.open()
        link.condition = _condition(condition, description)
        link.close()

    def _close_link(self, link: Any, condition: str, description: str) -> None:
        self._forget_link(link)
        link.condition = _condition(condition, description)
        link.close()

    def _forget_link(self, link: Any) -> None:
        state = link.sb if _has_attr(link, "sb") else None
        if link in self._waiting_attach:
            self._waiting_attach.remove(link)
        if link in self._starved:
            self._starved.remove(link)
        if state is None:
            return
        links = self._links_by_path.get(state.path)
        if links and link in links:
            links.remove(link)
        if state.wants_session and state.session_id is not None and self.broker is not None:
            try:
                self.broker.release_session(state.path, state.session_id, owner=state)
            except BrokerError:
                pass
        link.sb = None

    @_guard
    def on_link_remote_close(self, event: Any) -> None:
        link = event.link
        self._forget_link(link)
        conn = link.connection
        if _has_attr(link, "counted") and link.counted:
            link.counted = False
            conn.links_held -= 1
        elif _has_attr(link, "refused_over") and link.refused_over:
            link.refused_over = False
            conn.links_refused -= 1
        link.close()

    @_guard
    def on_link_flow(self, event: Any) -> None:
        link = event.link
        if _has_attr(link, "sb") and link.sb is not None:
            link.sb.active_at = self.clock()
        if link.is_sender and _has_attr(link, "sb") and link.sb is not None and not link.sb.sending:
            self._pump(link)
        elif link.is_sender and link.drain_mode and link.credit > 0:
            link.drained()

    def _on_available(self, path: str) -> None:
        for link in list(self._links_by_path.get(path, [])):
            st: LinkState = link.sb
            if st is not None and not st.sending and link.credit > 0:
                self._pump(link)

    def _pump(self, link: Any) -> None:
        st: LinkState = link.sb
        assert self.broker is not None
        n = link.credit
        if n <= 0 or st.sending:
            return
        if st.wants_session and st.session_id is None:
            return
        fault = self.fault_for(st.path)
        if fault in ("timeout", "busy", "unauthorized", "down"):
            return  # nothing is delivered while the entity is unavailable
        if fault in ("disabled", "notfound"):
            cond, text = _FAULT_CONDITIONS[fault]
            self._close_link(link, cond, text.format(e=st.path))
            return
        refusal = self._refusal(link.connection, st.path, aad.LISTEN)
        if refusal is not None:  # the token expired and was not renewed
            self._close_link(link, Cond.UNAUTHORIZED, refusal)
            return
        if self._bucket is not None:  # throttled: deliveries wait until the bucket holds tokens, as many as it holds
            tokens = self._bucket.tokens()
            if tokens <= 0:
                if link not in self._starved:
                    self._starved.append(link)
                if link.drain_mode:  # a drain is answered at once, with nothing: the client waits for no one
                    link.drained()
                return
            n = min(n, math.ceil(tokens))
        try:
            messages = self.broker.receive(st.path, n, peek_lock=st.peek_lock, session_id=st.session_id)
        except BrokerError as err:
            self._close_link(link, err.condition, err.description)
            return
        if messages:
            self.ops += len(messages)
            if self._bucket is not None:
                self._bucket.charge(len(messages))
        for m in messages:
            self._deliver(link, m)
        if link.drain_mode and link.credit > 0:
            link.drained()

    def _deliver(self, link: Any, m: Stored) -> None:
        st: LinkState = link.sb
        if st.peek_lock:
            assert m.lock_token is not None
            payload = codec.render(m, lock_token=m.lock_token, locked_until=m.locked_until)
            dlv = link.delivery(m.lock_token.bytes_le)
            dlv.lock = (st.path, m.lock_token)
        else:
            payload = codec.render(m)
            dlv = link.delivery(uuid.uuid4().bytes_le)
        link.send(payload)
        link.advance()
        if not st.peek_lock:
            dlv.settle()

    # ------------------------------------------------------------------ deliveries
    @_guard
    def on_delivery(self, event: Any) -> None:
        dlv = event.delivery
        link = dlv.link
        if _has_attr(link, "sb") and link.sb is not None:
            link.sb.active_at = self.clock()
        if link.is_receiver:
            if not dlv.readable:
                return
            if dlv.partial or _has_attr(dlv, "oversize"):
                self._read_partial(link, dlv)
                return
            data = link.recv(dlv.pending) or b""
            if _has_attr(dlv, "chunks"):
                data = b"".join([*dlv.chunks, data])
                dlv.chunks = None
            link.advance()
            if link.credit < _CREDIT // 2:
                link.flow(_CREDIT - link.credit)
            kind = getattr(link, "role_kind", None) if _has_attr(link, "role_kind") else None
            try:
                if kind == "cbs":
                    self._on_cbs(link, dlv, data)
                elif kind == "mgmt":
                    self._on_mgmt(link, dlv, data)
                elif kind == "entity" and link.sb is not None and link.sb.error is not None:
                    self._settle_error(dlv, *link.sb.error)
                    self._close_link(link, *link.sb.error)
                elif kind == "entity" and link.sb is not None:
                    self._on_send(link, dlv, data)
                elif kind == "entity" and getattr(link, "condition", None) is not None:
                    # a transfer the client wrote before it read the detach: answered with the detach's condition
                    self._settle_error(dlv, link.condition.name, link.condition.description)
                else:
                    self._settle_error(dlv, Cond.INTERNAL, "The link is closed.")
            except codec.MalformedMessage as err:
                if not dlv.settled:
                    self._settle_error(dlv, "amqp:decode-error", f"Malformed message: {err}")
            except Exception as err:  # noqa: BLE001 - never crash the reactor on one message
                _LOGGER.exception("namespace %s: failed to handle a transfer", self.name)
                if not dlv.settled:
                    self._settle_error(dlv, Cond.INTERNAL, f"The emulator failed to handle the transfer: {err}")
            return
        # our sender: the client settles a delivery it received
        if dlv.updated and not _has_attr(dlv, "done"):
            self._on_settle(dlv)

    def _read_partial(self, link: Any, dlv: Any) -> None:
        """Take what has arrived of a delivery still in transfer, so that Proton does not hold it all. A delivery
        that grows past the link's max-message-size (plus a batch envelope's slack) is dropped from then on: what
        the client still sends of it is read and counted, never buffered, and the delivery is rejected with
        ``amqp:link:message-size-exceeded`` when its last frame arrives, as the service answers it (the SDKs map
        that outcome to their message-size error; the JavaScript SDK takes a detached link for a timeout)."""
        chunk = link.recv(dlv.pending) or b""
        size = (dlv.received if _has_attr(dlv, "received") else 0) + len(chunk)
        dlv.received = size
        if not _has_attr(dlv, "oversize"):
            if size <= self.max_message_size + _BATCH_ENVELOPE_SLACK:
                chunks: list[bytes] = dlv.chunks if _has_attr(dlv, "chunks") and dlv.chunks is not None else []
                chunks.append(chunk)
                dlv.chunks = chunks
                return
            dlv.oversize = True
            dlv.chunks = None  # nothing more is kept of it
        if dlv.partial:
            return
        link.advance()
        if link.credit < _CREDIT // 2:
            link.flow(_CREDIT - link.credit)
        entity = link.sb.path if _has_attr(link, "sb") and link.sb is not None else entity_path(
            link.remote_target.address)
        _LOGGER.info("namespace %s: a transfer of %d bytes to %s exceeds the limit (%d bytes): rejected", self.name,
                     size, entity, self.max_message_size)
        self._settle_error(dlv, Cond.SIZE, f"The received message (size: {size} bytes) exceeds the limit "
                           f"({self.max_message_size} bytes) currently allowed on the link to '{entity}'.")

    def _settle_ok(self, dlv: Any) -> None:
        dlv.update(Delivery.ACCEPTED)
        dlv.settle()

    def _settle_error(self, dlv: Any, condition: str, description: str) -> None:
        dlv.local.condition = _condition(condition, description)
        dlv.update(Delivery.REJECTED)
        dlv.settle()

    def _on_send(self, link: Any, dlv: Any, data: bytes) -> None:
        st: LinkState = link.sb
        fault = self.fault_for(st.path)
        if fault == "timeout":
            st.held.append(dlv)  # accepted on the wire, never answered
            return
        if fault in _FAULT_CONDITIONS and fault not in ("down", "unauthorized"):
            cond, text = _FAULT_CONDITIONS[fault]
            self._settle_error(dlv, cond, text.format(e=st.path))
            return
        refusal = self._refusal(link.connection, st.path, aad.SEND)
        if refusal is not None:  # the token expired and was not renewed
            self._settle_error(dlv, Cond.UNAUTHORIZED, refusal)
            self._close_link(link, Cond.UNAUTHORIZED, refusal)
            return
        try:
            messages = list(codec.iter_incoming(data))
        except codec.MalformedMessage as err:
            self._settle_error(dlv, "amqp:decode-error", f"Malformed message: {err}")
            return
        # The limit applies to each message. The SDK fills a batch up to the limit without counting the
        # envelope's own framing, so an envelope may exceed it by that much (the broker checks each message).
        allowed = self.max_message_size + (_BATCH_ENVELOPE_SLACK if len(messages) > 1 else 0)
        if len(data) > allowed:
            self._settle_error(dlv, Cond.SIZE, f"The received message (size {len(data)} bytes) exceeds the limit ({self.max_message_size} bytes) of '{st.path}'.")
            return
        busy = self._admit(len(messages))
        if busy is not None:
            self._settle_error(dlv, Cond.BUSY, busy)
            return
        try:
            assert self.broker is not None
            self.broker.send(st.path, messages)
        except BrokerError as err:
            self._settle_error(dlv, err.condition, err.description)
            return
        if fault == "ack-lost":
            st.held.append(dlv)  # stored, but the answer is lost: the sender times out
            return
        self._settle_ok(dlv)

    def _admit(self, cost: int) -> str | None:
        """Count an operation of ``cost`` (a send of that many messages, a management request): None when the
        throttle admits it, else why not (the service's words, with the seconds to wait)."""
        if self._bucket is not None:
            wait = self._bucket.take(cost)
            if wait is not None:
                self.throttled += 1
                return limits.busy_text(self.name, wait)
        self.ops += cost
        return None

    def _on_settle(self, dlv: Any) -> None:
        if not _has_attr(dlv, "lock"):
            dlv.settle()
            return
        dlv.done = True
        path, token = dlv.lock
        state = dlv.remote_state
        remote = dlv.remote
        assert self.broker is not None
        try:
            refusal = self._refusal(dlv.link.connection, path, aad.LISTEN)
            if refusal is not None and state != Delivery.RELEASED:
                raise BrokerError(Cond.UNAUTHORIZED, refusal)
            if state == Delivery.ACCEPTED:
                self.broker.complete(path, token)
            elif state == Delivery.REJECTED:
                cond = remote.condition
                info = (cond.info if cond is not None else None) or {}
                info = {str(k): v for k, v in dict(info).items()}
                reason = codec.text(info.pop("DeadLetterReason", None))
                description = codec.text(info.pop("DeadLetterErrorDescription", None))
                # the rest of the info is the properties to modify (the Java SDK puts them there)
                self.broker.dead_letter(path, token, reason, description, info or None)
            elif state == Delivery.MODIFIED:
                if remote.undeliverable:
                    self.broker.defer(path, token, _annotations(remote.annotations))
                else:
                    self.broker.abandon(path, token, _annotations(remote.annotations))
            elif state == Delivery.RELEASED:
                self.broker.release(path, token)
            else:
                return
        except BrokerError as err:
            dlv.local.condition = _condition(err.condition, err.description)
            dlv.update(Delivery.REJECTED)
            dlv.settle()
            return
        dlv.update(state)
        dlv.settle()

    # ------------------------------------------------------------------ $cbs
    def _on_cbs(self, link: Any, dlv: Any, data: bytes) -> None:
        msg = _decode_request(data)
        self._settle_ok(dlv)
        props = _str_keys(msg.properties)
        audience = str(props.get("name", ""))
        token_type = str(props.get("type", ""))
        status, text = 202, "Accepted"
        renewing = False
        try:
            status, text, renewing = self._put_token(link.connection, audience, msg.body)
        except Exception:  # noqa: BLE001 - a put-token always gets its answer, or the client waits for ever
            _LOGGER.exception("namespace %s: put-token for %s failed", self.name, audience)
            status, text = 500, "Internal error: the emulator could not check the token (see its log)"
        if status != 202:
            _LOGGER.info("namespace %s: put-token (%s) for %s refused: %s", self.name, token_type or "no type",
                         audience, text)
        else:
            self.tokens_accepted += 1
            self.tokens_renewed += renewing
            self._unauthenticated.pop(link.connection, None)  # it may stay
            self._auth_deadlines.pop(link.connection, None)
        reply = Message(
            correlation_id=msg.id,
            # an AMQP int, as the service sends: the Java SDK casts it to int (a long fails every operation)
            properties={"status-code": int32(status), "status-description": text},
        )
        # on the link named by the request's reply-to (as the service answers), else the connection's last one
        sender = _reply_link(link.connection, msg.reply_to, "cbs") or link.connection.cbs_sender
        if sender is not None:
            sender.send(reply)

    def _put_token(self, conn: Any, audience: str, body: Any) -> tuple[int, str, bool]:
        """Check a put-token and record its grant on ``conn``: (status, description, renewing). The grant covers
        the audience as :func:`sas.parse_resource` reads it (the one reading), which a SAS token's ``sr`` must
        cover: a crafted name never names more than the token does."""
        try:
            token = body.decode() if isinstance(body, bytes) else str(body)
        except UnicodeDecodeError:
            return 401, "Unauthorized: the put-token body is not UTF-8 text", False
        try:
            resource = sas.parse_resource(audience, "put-token name")
        except sas.SasError as err:
            return 401, f"Unauthorized: {err}", False
        path = resource.path
        renewing = path in conn.authorized
        if self.fault_for(None) == "unauthorized" or self.fault_for(path or None) == "unauthorized":
            return 401, "Unauthorized: the token was rejected. (injected fault)", renewing
        if resource.port is not None and resource.port not in self.own_ports():
            return 401, f"Unauthorized: audience {audience!r} is not this namespace (port {self.port})", renewing
        if not token.startswith("SharedAccessSignature "):
            # an Entra ID token. The SDK says type "jwt" for SAS tokens too (pyamqp's JWTTokenAuth default), so
            # the token itself tells which kind it is
            if self.authority is None:
                return 401, ("Unauthorized: Microsoft Entra ID tokens are not enabled on this namespace (start the "
                             "emulator with --entra-id, or Emulator(..., entra_id=True))"), renewing
            try:
                # a put-token for the same audience replaces the earlier one: that is how a client renews
                conn.authorized[path] = self.authority.verify(token, now=self.clock())
            except aad.AadError as err:
                return 401, f"Unauthorized: {err}", renewing
            return 202, "Accepted", renewing
        try:
            key_name = sas.verify(token, self.keys, audience=resource, now=self.clock())
        except sas.SasError as err:
            return 401, f"Unauthorized: {err}", renewing
        # valid until its se, as on Service Bus: a client renews it with a new put-token
        conn.authorized[path] = dataclasses.replace(
            aad.SAS_GRANT, expires=sas.expiry(token), principal=f"the shared access key {key_name!r}")
        return 202, "Accepted", renewing

    def _refusal(self, conn: Any, path: str, right: str) -> str | None:
        """None when a token put on ``conn`` covers ``path`` (the audience is the path or a prefix of it) and
        allows ``right`` now; else why not (no token, an expired one, a missing role), as the service says it."""
        now = self.clock()
        reasons: list[tuple[int, str]] = []
        lowered = path.lower()  # entity names are case-insensitive (topic/Subscriptions/name)
        for aud, grant in conn.authorized.items():
            aud = aud.lower()
            if aud == "" or lowered == aud or lowered.startswith(aud + "/"):
                reason = grant.refusal(right, path, now)
                if reason is None:
                    return None
                reasons.append((len(aud), reason))
        if reasons:
            return max(reasons)[1]  # the most specific token's reason
        return f"Unauthorized access to '{path}': no valid token was put on $cbs for it."

    # ------------------------------------------------------------------ $management
    def _on_mgmt(self, link: Any, dlv: Any, data: bytes) -> None:
        msg = _decode_request(data)
        self._settle_ok(dlv)
        node = entity_path(link.remote_target.address)[: -len(MGMT_SUFFIX)]
        props = _str_keys(msg.properties)
        operation = str(props.get("operation", ""))
        status, desc, cond, result = 200, "OK", None, None
        fault = self.fault_for(node)
        try:
            body = codec.request_field({"body": msg.body}, "body", "map", {})
            if fault == "timeout":
                return  # never answered
            if fault in _FAULT_CONDITIONS:
                c, text = _FAULT_CONDITIONS[fault]
                raise BrokerError(c, text.format(e=node))
            # a token for the entity covers its management node; so does one for the node itself, which is what the
            # JavaScript SDK puts before a management call on an entity it has no link to (scheduleMessages)
            refusal = self._refusal(link.connection, f"{node}{MGMT_SUFFIX}",
                                    _MGMT_RIGHTS.get(operation.removeprefix("com.microsoft:"), aad.LISTEN))
            if refusal is not None:
                raise BrokerError(Cond.UNAUTHORIZED, refusal)
            busy = self._admit(1)
            if busy is not None:
                raise BrokerError(Cond.BUSY, busy)
            result = self._management(node, operation, body)
            if result is None:
                status, desc = 204, "No Content"
        except BrokerError as err:
            status, desc, cond = _MGMT_STATUS.get(err.condition, 500), err.description, err.condition
        if fault == "ack-lost" and cond is None and operation.removeprefix("com.microsoft:") == "schedule-message":
            return  # scheduled (a send), but the answer is lost
        reply_props: dict[str, Any] = {"statusCode": int32(status), "statusDescription": desc}
        if cond is not None:
            reply_props["errorCondition"] = symbol(cond)
            reply_props["error-condition"] = symbol(cond)
        reply = Message(correlation_id=msg.id, properties=reply_props, body=result if result is not None else {})
        # the service answers on the link whose address is the request's reply-to (a client may open one reply link
        # per handler on one connection, to one entity); a request without a known reply-to, on the entity's link
        sender = _reply_link(link.connection, msg.reply_to) or link.connection.mgmt_senders.get(node)
        if sender is None:
            _LOGGER.warning("namespace %s: no $management reply link for %s", self.name, node)
            return
        sender.send(reply)

    def _management(self, node: str, op: str, body: dict[str, Any]) -> dict[str, Any] | None:
        b = self.broker
        assert b is not None
        _, path = b.resolve(node)
        op = op.removeprefix("com.microsoft:")
        session_id = codec.text(body.get("session-id"))
        if op == "renew-lock":
            tokens = codec.request_field(body, "lock-tokens", "list of uuid")
            expirations = b.renew_lock(path, tokens)
            # arrays, as the service sends (the Java SDK reads Date[] here and long[] for sequence numbers)
            return {"expirations": _array(Data.TIMESTAMP, [timestamp(int(e * 1000)) for e in expirations])}
        if op == "update-disposition":
            status = codec.request_field(body, "disposition-status", "string")
            modify = _annotations(codec.request_field(body, "properties-to-modify", "map", None))
            for token in codec.request_field(body, "lock-tokens", "list of uuid"):
                if status == "completed":
                    b.complete(path, token)
                elif status == "abandoned":
                    b.abandon(path, token, modify)
                elif status == "defered":
                    b.defer(path, token, modify)
                elif status == "suspended":
                    b.dead_letter(path, token, codec.text(body.get("deadletter-reason")),
                                  codec.text(body.get("deadletter-description")), modify)
                else:
                    raise BrokerError(Cond.INVALID, f"disposition-status {status!r} is not known")
            return {}
        if op == "receive-by-sequence-number":
            seqs = codec.request_field(body, "sequence-numbers", "list of long")
            peek_lock = codec.request_field(body, "receiver-settle-mode", "long", 1) != 0
            msgs = b.receive_deferred(path, seqs, peek_lock=peek_lock, session_id=session_id)
            out = []
            for m in msgs:
                entry: dict[str, Any] = {"message": codec.render(m, lock_token=m.lock_token, locked_until=m.locked_until,
                                                                 tagless=True)}
                if m.lock_token is not None:
                    entry["lock-token"] = m.lock_token
                out.append(entry)
            return {"messages": out}
        if op == "peek-message":
            start = codec.request_field(body, "from-sequence-number", "long", 0)
            count = codec.request_field(body, "message-count", "long", 1)
            msgs = b.peek(path, start, count, session_id=session_id)
            if not msgs:
                return None
            return {"messages": [{"message": codec.render(m, peeked=True)} for m in msgs]}
        if op == "schedule-message":
            seqs = []
            for entry in codec.request_field(body, "messages", "list of map"):
                inc = codec.incoming(codec.request_field(entry, "message", "binary"))
                when = inc.scheduled_enqueue_time if inc.scheduled_enqueue_time is not None else self.clock()
                seqs.extend(b.schedule(path, [inc], when))
            return {"sequence-numbers": _array(Data.LONG, seqs)}
        if op == "cancel-scheduled-message":
            b.cancel_scheduled(path, codec.request_field(body, "sequence-numbers", "list of long"))
            return {}
        if op == "renew-session-lock":
            if session_id is None:
                raise BrokerError(Cond.INVALID, "session-id is required")
            until = b.renew_session_lock(path, session_id, owner=None)
            return {"expiration": timestamp(int(until * 1000))}
        if op == "get-session-state":
            if session_id is None:
                raise BrokerError(Cond.INVALID, "session-id is required")
            return {"session-state": b.get_session_state(path, session_id)}
        if op == "set-session-state":
            if session_id is None:
                raise BrokerError(Cond.INVALID, "session-id is required")
            b.set_session_state(path, session_id, codec.request_field(body, "session-state", "binary", None))
            return {}
        if op == "get-message-sessions":
            since = codec.request_field(body, "last-updated-time", "long", None)
            # no date: the SDK sends .NET's DateTime.MaxValue (year 10000, some clients 9999-12-31) for "all"
            if since is not None and int(since) >= _ALL_SESSIONS_MS:
                since = None
            ids = b.list_sessions(path, None if since is None else float(since) / 1000.0)
            skip = codec.request_field(body, "skip", "long", 0)
            top = codec.request_field(body, "top", "long", len(ids))
            page = ids[skip: skip + top]
            if not page:
                return None
            # as the service documents it: an array of strings and an int
            return {"sessions-ids": _array(Data.STRING, page), "skip": int32(skip + len(page))}
        if op in ("add-rule", "remove-rule", "enumerate-rules"):
            return self._rules(path, op, body)
        raise BrokerError(Cond.NOT_IMPLEMENTED, f"The $management operation {op!r} is not supported by the emulator.")

    def _rules(self, path: str, op: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """The rule manager's operations (Listen is enough, as on the service), on a subscription's node."""
        b = self.broker
        assert b is not None
        topic, sep, sub = path.partition("/subscriptions/")
        if not sep:
            raise BrokerError(Cond.INVALID, f"Rules belong to subscriptions; '{path}' is not one.")
        if op == "add-rule":
            name = codec.request_field(body, "rule-name", "string")
            b.create_rule(topic, sub, codec.rule_from_amqp(name, codec.request_field(body, "rule-description", "map")))
            return {}
        if op == "remove-rule":
            b.delete_rule(topic, sub, codec.request_field(body, "rule-name", "string"))
            return {}
        rules = b.list_rules(topic, sub)
        skip = codec.request_field(body, "skip", "long", 0)
        top = codec.request_field(body, "top", "long", len(rules))
        page = rules[skip: skip + top]
        if not page:
            return None
        return {"rules": [{"rule-description": codec.rule_to_amqp(r)} for r in page]}


#: the right each $management operation needs (every other one: Listen)
_MGMT_RIGHTS = {"schedule-message": aad.SEND, "cancel-scheduled-message": aad.SEND}

_MGMT_STATUS = {
    Cond.NOT_FOUND: 404,
    Cond.MESSAGE_NOT_FOUND: 404,
    Cond.UNAUTHORIZED: 401,
    Cond.LOCK_LOST: 410,
    Cond.SESSION_LOCK_LOST: 410,
    Cond.SESSION_CANNOT_BE_LOCKED: 409,
    Cond.ALREADY_EXISTS: 409,
    Cond.BUSY: 503,
    Cond.TIMEOUT: 408,
    Cond.QUOTA: 403,
    Cond.DISABLED: 400,
    Cond.INVALID: 400,
    codec.ARGUMENT_ERROR: 400,
    Cond.NOT_IMPLEMENTED: 501,
}


def _condition(name: str, description: str) -> Condition:
    """An error with a tracking id in its info, as the service sends: the SDK reads the info field of a
    rejected outcome by position, so it must be present."""
    return Condition(name, description, _tracking_info())


def _tracking_info() -> dict[Any, Any]:
    return {symbol("com.microsoft:tracking-id"): uuid.uuid4().hex}


def _data_object(data: Any) -> Any:
    """The first value of a Proton ``Data`` (a terminus filter), or None."""
    if data is None:
        return None
    data.rewind()
    if data.next() is None:
        return None
    return data.get_object()


def _array(element_type: int, values: list[Any]) -> Array:
    """An AMQP array (not a list): the Java SDK reads long[] and Date[] and ignores a list."""
    return Array(UNDESCRIBED, element_type, *values)  # type: ignore[arg-type]  # proton's stub: no Constant


def _management_node(link: Any) -> str:
    """The entity of a ``$management`` link (``orders/$management`` -> ``orders``)."""
    address = link.remote_target.address if link.is_receiver else link.remote_source.address
    return entity_path(address)[: -len(MGMT_SUFFIX)]


def _reply_link(conn: Any, reply_to: str | None, kind: str = "mgmt") -> Any:
    """The connection's open ``$management`` (``kind`` "mgmt") or ``$cbs`` ("cbs") reply link (a client's receiver)
    whose target address is ``reply_to``."""
    if not reply_to:
        return None
    link = conn.link_head(0)
    while link is not None:
        if (link.is_sender and _has_attr(link, "role_kind") and link.role_kind == kind
                and not link.state & (link.LOCAL_CLOSED | link.REMOTE_CLOSED)
                and link.remote_target.address == reply_to):
            return link
        link = link.next(0)
    return None


def _due(pending: dict[Any, float]) -> list[Any]:
    """Take from ``pending`` (insertion order is deadline order: one timeout for all) the keys whose deadline has
    passed."""
    now = time.monotonic()
    due = []
    for key, deadline in pending.items():
        if deadline > now:
            break
        due.append(key)
    for key in due:
        del pending[key]
    return due


def _refused(conn: Any) -> bool:
    """Whether ``conn`` came over the namespace's ``max_connections`` (it is refused when it opens)."""
    return _has_attr(conn, "refused") and conn.refused


def _has_attr(obj: Any, name: str) -> bool:
    try:
        return name in obj.__dict__["_attrs"]
    except (KeyError, TypeError):
        return False


def _str_keys(mapping: Any) -> dict[str, Any]:
    return {str(k): v for k, v in dict(mapping or {}).items()}


def _decode_request(data: bytes) -> Message:
    """A ``$cbs`` or ``$management`` request; MalformedMessage (refused with ``amqp:decode-error``) when it cannot be
    read, nesting too deep included (Proton's decoder recurses once per level)."""
    codec.check_depth(data)
    msg = Message()
    try:
        msg.decode(data)
    except Exception as err:  # noqa: BLE001 - proton raises its own error types
        raise codec.MalformedMessage(f"cannot decode the request: {err}") from err
    return msg


def _annotations(v: Any) -> dict[Any, Any] | None:
    if not v:
        return None
    return {str(k): val for k, val in dict(v).items()}


__all__ = ["NamespaceServer", "FAULT_KINDS", "entity_path", "Incoming"]
