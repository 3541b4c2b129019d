"""The connections of an HTTP port (the admin API's): one event-loop thread and a bounded pool of workers.

A thread per connection let 300 slow clients (a slowloris: one header byte a second) hold 307 threads, each read
waiting up to 300 s. Here the loop thread reads every request's head without blocking (``selectors``: epoll on Linux,
no descriptor limit of 1024) and hands a connection to a worker only once its head is complete, so a client that is
slow to send its head, or that keeps its connection open between requests, costs a socket and no thread. A worker
serves one request (its body read, its answer written, each bounded by ``request_timeout``) and hands the
connection back to the loop.

Bounds (:class:`AdminLimits`): a request's head must be complete within ``request_timeout`` of its first byte (a
new connection's first byte within the same time of its accept), a kept-alive connection may wait ``idle_timeout``
for its next request; at most ``max_connections`` connections in all and ``max_connections_per_client`` from one
client address. At a cap, the oldest connection of that client (at the total cap: of any client) that is waiting
for a request or still sending its head is closed to make room, so a flood cannot lock the port against a new
client; when every counted connection is being served the new one is answered ``503`` and closed. Counted in
:meth:`HttpLoop.stats`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import queue
import re
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

_LOGGER = logging.getLogger(__name__)

#: the longest request head (request line and headers) read; longer is answered 431 and closed
MAX_HEAD_BYTES = 64 * 1024
_HEAD_END = re.compile(rb"\r?\n\r?\n")
_ACCEPTS_PER_WAKE = 64


@dataclasses.dataclass(frozen=True)
class AdminLimits:
    """How the admin HTTP port bounds its clients (emulator-wide: every namespace's admin port has its own)."""

    #: seconds a request has to send its head, from its first byte (a new connection's first byte: from its accept),
    #: and then its body; also the bound of each write of the answer
    request_timeout: float = 10.0
    #: seconds a kept-alive connection may wait for its next request (waiting costs no thread); 0: no bound
    idle_timeout: float = 60.0
    #: threads that serve requests whose head is complete (the waiting is done by one more thread, the loop's)
    workers: int = 8
    #: connections open at once, in all and from one client address
    max_connections: int = 512
    max_connections_per_client: int = 128

    def __post_init__(self) -> None:
        for name in ("request_timeout", "idle_timeout"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or (
                    value <= 0 if name == "request_timeout" else value < 0):
                what = "a positive number of seconds" if name == "request_timeout" else "0 or more seconds"
                raise ValueError(f"admin {name} must be {what}, got {value!r}")
        for name in ("workers", "max_connections", "max_connections_per_client"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"admin {name} must be a positive integer, got {value!r}")


#: a new connection (before its first request), kept alive (between requests), sending a head, being served, held
_NEW, _IDLE, _HEAD, _BUSY, _HELD = "new", "idle", "head", "busy", "held"

#: what a worker's ``serve`` returns: ("close" | "keep" | "hold", the bytes read past the request)
Outcome = tuple[str, bytes]


class _Conn:
    __slots__ = ("buf", "client", "deadline", "since", "sock", "state")

    def __init__(self, sock: socket.socket, client: Any, now: float, deadline: float | None) -> None:
        self.sock = sock
        self.client = client
        self.buf = bytearray()
        self.state = _NEW
        self.since = now
        self.deadline = deadline


class HttpLoop:
    """Accepts on ``host:port`` and calls ``serve(sock, client_address, head_bytes)`` on a worker for each request
    whose head is complete. ``serve`` answers it and says what becomes of the connection: ``"close"``, ``"keep"``
    (with the bytes it read past the request), or ``"hold"`` (a fault: answer nothing, drop what comes, close after
    ``hold_seconds()``). ``refusal(status, reason)`` renders a whole answer (with ``Connection: close``) for a
    connection refused at a cap (503) or with a head too large (431)."""

    def __init__(self, host: str, port: int, *, limits: AdminLimits, serve: Callable[[socket.socket, Any, bytes], Outcome],
                 refusal: Callable[[int, str], bytes], hold_seconds: Callable[[], float], name: str) -> None:
        self.limits = limits
        self._serve = serve
        self._refusal = refusal
        self._hold_seconds = hold_seconds
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(socket.SOMAXCONN)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self.server_address = listener.getsockname()
        self._name = f"{name}-{self.server_address[1]}"
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, self)
        self._conns: set[_Conn] = set()
        self._per_client: collections.Counter[str] = collections.Counter()
        self._returns: collections.deque[tuple[_Conn, Outcome]] = collections.deque()
        self._tasks: queue.SimpleQueue[_Conn | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._busy = 0
        self._lock = threading.Lock()
        self._stopping = False
        self._scan_at = 0.0
        self._thread: threading.Thread | None = None
        self.opened = 0
        self.refused = 0
        self.evicted = 0
        self.timed_out = 0

    # ------------------------------------------------------------------ life
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        for _ in self._workers:
            self._tasks.put(None)

    def stats(self) -> dict[str, Any]:
        """``connections`` open now (``busy``: of them being served), ``workers`` started; since the start:
        ``connections_opened`` (accepted), ``connections_refused`` (answered 503 at a cap), ``connections_evicted``
        (closed to make room for a new one at a cap), ``timed_out`` (closed before their head or body came within
        ``request_timeout``); ``limits``: :class:`AdminLimits`."""
        conns = list(self._conns)
        return {"connections": len(conns), "busy": sum(1 for c in conns if c.state == _BUSY),
                "workers": len(self._workers), "connections_opened": self.opened,
                "connections_refused": self.refused, "connections_evicted": self.evicted,
                "timed_out": self.timed_out, "limits": dataclasses.asdict(self.limits)}

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:  # full (a wake is pending anyway) or closed
            pass

    # ------------------------------------------------------------------ the loop thread
    def _run(self) -> None:
        try:
            while not self._stopping:
                now = time.monotonic()
                for key, _ in self._selector.select(max(0.0, min(self._scan_at - now, 1.0))):
                    if key.data is None:
                        self._accept()
                    elif key.data is self:
                        try:
                            while self._wake_r.recv(4096):
                                pass
                        except OSError:
                            pass
                    else:
                        self._readable(key.data)
                self._take_returns()
                now = time.monotonic()
                if now >= self._scan_at:
                    self._scan_at = self._expire(now)
        except Exception:  # noqa: BLE001 - logged; the port is closed below, so clients see it gone
            _LOGGER.exception("admin API %s: the connection loop failed", self._name)
        finally:
            self._close_all()

    def _deadline_set(self, deadline: float | None) -> None:
        if deadline is not None and deadline < self._scan_at:
            self._scan_at = deadline

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_WAKE):
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:  # out of descriptors, say: the connection waits in the backlog
                _LOGGER.debug("admin API %s: accept failed: %s", self._name, err)
                return
            self.opened += 1
            client = str(address[0])
            if not self._make_room(client):
                self.refused += 1
                _LOGGER.debug("admin API %s: connection from %s refused: %d connections open", self._name, client,
                              len(self._conns))
                self._send_and_close(sock, self._refusal(503, "the admin API has all the connections it takes "
                                                              "(admin max-connections); try again"))
                continue
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            now = time.monotonic()
            # a new connection's request must come as promptly as a head: connecting and saying nothing holds no
            # more than a slow head does
            conn = _Conn(sock, address, now, now + self.limits.request_timeout)
            self._conns.add(conn)
            self._per_client[client] += 1
            self._selector.register(sock, selectors.EVENT_READ, conn)
            self._deadline_set(conn.deadline)

    def _make_room(self, client: str) -> bool:
        """Whether a new connection from ``client`` may be kept, closing the oldest waiting one at a cap."""
        if self._per_client[client] >= self.limits.max_connections_per_client:
            victim = self._oldest_waiting(client)
        elif len(self._conns) >= self.limits.max_connections:
            victim = self._oldest_waiting(None)
        else:
            return True
        if victim is None:
            return False
        self.evicted += 1
        self._close(victim)
        return True

    def _oldest_waiting(self, client: str | None) -> _Conn | None:
        waiting = [c for c in self._conns if c.state in (_NEW, _IDLE, _HEAD) and (client is None or c.client[0] == client)]
        return min(waiting, key=lambda c: c.since, default=None)

    def _readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        if conn.state == _HELD:  # a held request answers nothing: what comes is dropped
            return
        if conn.state in (_NEW, _IDLE):
            data = data.lstrip(b"\r\n")  # empty lines before a request line are ignored (RFC 9112 2.2)
            if not data:
                return
            now = time.monotonic()
            conn.state, conn.since, conn.deadline = _HEAD, now, now + self.limits.request_timeout
            self._deadline_set(conn.deadline)
        start = max(0, len(conn.buf) - 3)
        conn.buf += data
        self._check_head(conn, start)

    def _check_head(self, conn: _Conn, start: int = 0) -> None:
        if _HEAD_END.search(conn.buf, start):
            self._selector.unregister(conn.sock)
            conn.state, conn.deadline = _BUSY, None
            self._submit(conn)
        elif len(conn.buf) > MAX_HEAD_BYTES:
            self._forget(conn)
            self._send_and_close(conn.sock, self._refusal(431, f"the request head exceeds {MAX_HEAD_BYTES} bytes"))

    def _take_returns(self) -> None:
        while self._returns:
            conn, (outcome, rest) = self._returns.popleft()
            if conn not in self._conns:
                continue
            if outcome not in ("keep", "hold"):
                self._close(conn)
                continue
            now = time.monotonic()
            conn.sock.setblocking(False)
            conn.since = now
            self._selector.register(conn.sock, selectors.EVENT_READ, conn)
            if outcome == "hold":
                conn.state, conn.deadline, conn.buf = _HELD, now + self._hold_seconds(), bytearray()
            elif rest.strip(b"\r\n"):  # a pipelined request already under way
                conn.state, conn.deadline, conn.buf = _HEAD, now + self.limits.request_timeout, bytearray(rest)
                self._check_head(conn)
            else:
                idle = self.limits.idle_timeout
                conn.state, conn.deadline, conn.buf = _IDLE, (now + idle if idle else None), bytearray()
            self._deadline_set(conn.deadline)

    def _expire(self, now: float) -> float:
        """Close the connections past their deadline; the time of the next deadline (at most a second away)."""
        upcoming = now + 1.0
        for conn in list(self._conns):
            if conn.deadline is None:
                continue
            if conn.deadline <= now:
                if conn.state in (_NEW, _HEAD):
                    self.timed_out += 1
                _LOGGER.debug("admin API %s: closing a connection from %s (%s past its deadline)", self._name,
                              conn.client[0], conn.state)
                self._close(conn)
            else:
                upcoming = min(upcoming, conn.deadline)
        return upcoming

    # ------------------------------------------------------------------ workers
    def _submit(self, conn: _Conn) -> None:
        self._tasks.put(conn)
        with self._lock:
            free = len(self._workers) - self._busy
            if free < self._tasks.qsize() and len(self._workers) < self.limits.workers:
                worker = threading.Thread(target=self._work, name=f"{self._name}-worker-{len(self._workers)}",
                                          daemon=True)
                self._workers.append(worker)
                worker.start()

    def _work(self) -> None:
        while (conn := self._tasks.get()) is not None:
            with self._lock:
                self._busy += 1
            outcome: Outcome = ("close", b"")
            try:
                conn.sock.settimeout(self.limits.request_timeout)
                outcome = self._serve(conn.sock, conn.client, bytes(conn.buf))
            except Exception:  # noqa: BLE001 - one request's failure closes its connection, not the port
                _LOGGER.debug("admin API %s: a request from %s failed", self._name, conn.client[0], exc_info=True)
            finally:
                with self._lock:
                    self._busy -= 1
            if self._stopping:
                _shut(conn.sock)
                conn.sock.close()
                continue
            self._returns.append((conn, outcome))
            self._wake()

    # ------------------------------------------------------------------ closing
    def _forget(self, conn: _Conn) -> None:
        if conn in self._conns:
            self._conns.discard(conn)
            client = str(conn.client[0])
            self._per_client[client] -= 1
            if self._per_client[client] <= 0:
                del self._per_client[client]
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass

    def _close(self, conn: _Conn) -> None:
        self._forget(conn)  # before the close: the selector finds a socket by its descriptor
        _shut(conn.sock)
        conn.sock.close()

    @staticmethod
    def _send_and_close(sock: socket.socket, answer: bytes) -> None:
        try:
            sock.setblocking(False)
            sock.send(answer)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        sock.close()

    def _close_all(self) -> None:
        for conn in list(self._conns):
            if conn.state == _BUSY:  # its worker closes it (stopping); shut down so that its reads and writes end
                _shut(conn.sock)
                self._forget(conn)
            else:
                self._close(conn)
        for sock in (self._listener, self._wake_r):
            try:
                self._selector.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()
        self._selector.close()
        self._wake_w.close()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
