"""Proton's Python reactor without ``select.select``: what lets one namespace hold thousands of connections.

python-qpid-proton's reactor waits in ``IO.Selector.select``, which calls ``select.select``: that fails with
``filedescriptor out of range in select()`` on any descriptor of 1024 or more, and the exception ends the reactor
thread (about 1,010 idle sockets killed a namespace for good). Its bookkeeping is also linear in the number of
selectables on every event: ``update_deadline`` walks them all on each ``update``, and ``select`` walks them all
again to find the expired ones.

:func:`install` replaces ``proton._io.IO.Selector`` with :class:`PollSelector`: the platform's best
``selectors.DefaultSelector`` (epoll on Linux, kqueue on macOS), registered once per socket and modified only when
what it waits for changes, and a heap of deadlines (stale entries are skipped when they reach the top), so an
event costs O(log n) and a wake-up costs what is ready, not what is open. The semantics are Proton's: ``select``
returns the readable, the writable and the expired selectables. It also widens the backlog of ``IO.listen`` (10)
to :data:`LISTEN_BACKLOG`, so a burst of connects is not refused.

The reactor builds its selector when a ``Container`` is made: :func:`install` must run before (the emulator's
:class:`~spark_sb.emulator.amqp.NamespaceServer` calls it when it starts). Installing is process-wide and
idempotent; nothing else in the process notices but the limit.
"""

from __future__ import annotations

import errno
import heapq
import itertools
import selectors
import socket
import threading
import time
from typing import Any

#: the listen backlog of every Proton acceptor (Proton's own is 10)
LISTEN_BACKLOG = 1024

_installed = False
_lock = threading.Lock()


class PollSelector:
    """A drop-in for ``proton._io.IO.Selector`` on ``selectors.DefaultSelector`` and a deadline heap."""

    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()
        self._selectables: set[Any] = set()
        #: selectable -> (fd, events) it is registered with
        self._registered: dict[Any, tuple[int, int]] = {}
        #: selectable -> the deadline it has in the heap (absent: none)
        self._deadlines: dict[Any, float] = {}
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()

    # Proton's interface: add, remove, update, selectables, select
    def add(self, selectable: Any) -> None:
        self._selectables.add(selectable)
        self.update(selectable)

    def remove(self, selectable: Any) -> None:
        self._selectables.discard(selectable)
        self._deadlines.pop(selectable, None)
        reg = self._registered.pop(selectable, None)
        if reg is not None:
            self._unregister(reg[0])

    @property
    def selectables(self) -> int:
        return len(self._selectables)

    def update_deadline(self) -> None:
        """Proton's Selector has it; the heap keeps deadlines current, so there is nothing to do."""

    def update(self, selectable: Any) -> None:
        if selectable not in self._selectables:
            return
        events = (selectors.EVENT_READ if selectable.reading else 0) | (
            selectors.EVENT_WRITE if selectable.writing else 0)
        fd = selectable.fileno() if events else -1
        reg = self._registered.get(selectable)
        if reg != (fd, events) or fd < 0:
            if reg is not None:
                self._unregister(reg[0])
                del self._registered[selectable]
            if events and fd >= 0:
                try:
                    self._sel.register(fd, events, selectable)
                except KeyError:  # a closed socket's descriptor, reused: the new one wins
                    self._unregister(fd)
                    self._sel.register(fd, events, selectable)
                self._registered[selectable] = (fd, events)
        deadline = selectable.deadline
        if deadline:
            if self._deadlines.get(selectable) != deadline:
                self._deadlines[selectable] = deadline
                heapq.heappush(self._heap, (deadline, next(self._seq), selectable))
        else:
            self._deadlines.pop(selectable, None)

    def _unregister(self, fd: int) -> None:
        try:
            self._sel.unregister(fd)
        except (KeyError, ValueError, OSError):
            pass

    def _next_deadline(self) -> float | None:
        heap = self._heap
        while heap:
            deadline, _, sel = heap[0]
            if self._deadlines.get(sel) == deadline:
                return deadline
            heapq.heappop(heap)  # stale: the selectable moved its deadline or is gone
        return None

    def select(self, timeout: float | None) -> tuple[list[Any], list[Any], list[Any]]:
        deadline = self._next_deadline()
        now = time.time()
        if deadline is not None:
            wait = max(0.0, deadline - now)
            timeout = wait if timeout is None else max(0.0, min(timeout, wait))
        readable: list[Any] = []
        writable: list[Any] = []
        if self._registered:
            try:
                ready = self._sel.select(timeout)
            except InterruptedError:
                ready = []
            except OSError as err:
                if err.errno != errno.EINTR:
                    raise
                ready = []
            for key, events in ready:
                if events & selectors.EVENT_READ:
                    readable.append(key.data)
                if events & selectors.EVENT_WRITE:
                    writable.append(key.data)
        elif timeout is None or timeout > 0:
            time.sleep(1.0 if timeout is None else timeout)
        now = time.time()
        expired = []
        while True:
            deadline = self._next_deadline()
            if deadline is None or deadline >= now:
                break
            _, _, sel = heapq.heappop(self._heap)
            # reported once; an ``update`` with a deadline (the same or a new one) arms it again
            del self._deadlines[sel]
            expired.append(sel)
        return readable, writable, expired


def _listen(host: str, port: int) -> socket.socket:
    """``IO.listen`` with a backlog of :data:`LISTEN_BACKLOG`."""
    s = socket.socket()
    s.setsockopt(socket.SOL_TCP, socket.TCP_NODELAY, True)
    s.setblocking(False)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, True)
    s.bind((host, port))
    s.listen(LISTEN_BACKLOG)
    return s


def install() -> None:
    """Make every Proton reactor built from now on in this process wait with :class:`PollSelector` and listen
    with a backlog of :data:`LISTEN_BACKLOG`. Idempotent."""
    global _installed
    with _lock:
        if _installed:
            return
        from proton import _io

        _io.IO.Selector = PollSelector  # type: ignore[misc,assignment]
        _io.IO.listen = staticmethod(_listen)  # type: ignore[method-assign]
        _installed = True
