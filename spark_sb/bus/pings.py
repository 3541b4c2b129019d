"""The ping task: one background thread per pairing in the process (per
:class:`~spark_sb.bus.health.HealthBoard`) that pings every failed-over entity when its ping is due and so
fails it back without waiting for a send (behaviour.md, "the ping task").

* **lifecycle**: the first sender of the board that sends (or calls ``run_pings_once``) attaches itself and
  starts the thread, named ``spark-sb-ping``; later senders attach too. ``close()`` of a sender detaches it;
  the last one to detach stops the thread and joins it (within ``timeout``), so no thread is left behind. A
  forked child (a Spark Python worker) starts its own thread on first use.
* **one ping at a time per entity**: each round claims each due ping through
  :meth:`~spark_sb.bus.health.HealthBoard.claim_ping`, as the send path does, so the task and a send never
  ping the same entity at once. The ping itself (an SDK client of the primary) belongs to a sender: the task
  uses the most recently attached sender that is still open.
* **time**: a round (:meth:`PingTask.run_once`, also what tests call) returns the seconds until the next ping is
  due on the board's clock; the thread then waits ``wait(stop, seconds)`` (at most a ping interval, at least
  :data:`MIN_WAIT`). The default ``wait`` is ``stop.wait(seconds)`` in real time; a test on a fake clock injects
  one that follows the fake clock, or one that waits only for ``stop`` and drives the rounds itself.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .health import HealthBoard

_LOGGER = logging.getLogger(__name__)

__all__ = ["MIN_WAIT", "THREAD_NAME", "Clock", "PingTask", "Pinger", "Wait", "real_wait"]

#: the name of the ping thread
THREAD_NAME = "spark-sb-ping"
#: the shortest wait between rounds (a due ping another caller is running is looked at again after it)
MIN_WAIT = 0.05

#: the board's time (seconds, monotonic)
Clock = Callable[[], float]
#: ``wait(stop, seconds)``: return when ``stop`` is set or ``seconds`` have passed on the board's clock
Wait = Callable[[threading.Event, float], object]


def real_wait(stop: threading.Event, seconds: float) -> object:
    return stop.wait(seconds)


class Pinger(Protocol):
    def ping_if_due(self, entity: str) -> bool:
        """Ping ``entity`` if its ping is due and nobody else is pinging it, and record the result on the
        board. False when this pinger cannot ping any more (it was closed)."""
        ...


class PingTask:
    """The background pings of one board. Thread-safe."""

    def __init__(self, board: HealthBoard, wait: Wait | None = None) -> None:
        self._board = board
        self._wait = wait or real_wait
        self._lock = threading.Lock()
        self._pingers: list[Pinger] = []
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None

    def attach(self, pinger: Pinger) -> None:
        """``pinger`` may ping for this board; starts the thread when it is not running."""
        with self._lock:
            if pinger not in self._pingers:
                self._pingers.append(pinger)
            if self.thread is None or not self.thread.is_alive():
                self._stop = threading.Event()
                self.thread = threading.Thread(target=self._run, args=(self._stop,), name=THREAD_NAME,
                                               daemon=True)
                self.thread.start()

    def detach(self, pinger: Pinger, timeout: float) -> None:
        """``pinger`` is closed; the last one to go stops the thread and waits up to ``timeout`` s for it."""
        with self._lock:
            if pinger in self._pingers:
                self._pingers.remove(pinger)
            if self._pingers:
                return
            thread, self.thread = self.thread, None
            self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                _LOGGER.warning("the ping thread did not stop within %.0f s (a ping in progress)", timeout)

    def run_once(self) -> float | None:
        """One round: ping every failed-over entity whose ping is due. Returns the seconds until the next
        ping is due (board clock; 0 when one is due but another caller is running it), ``None`` when no
        entity is failed over."""
        with self._lock:
            pingers = list(reversed(self._pingers))
        for entity in self._board.due_pings():
            for pinger in pingers:
                if pinger.ping_if_due(entity):
                    break
        return self._board.next_ping_in()

    def _run(self, stop: threading.Event) -> None:
        _LOGGER.debug("ping task started")
        while not stop.is_set():
            try:
                due = self.run_once()
            except Exception:  # a bug: say so loudly, and keep the task alive for the next round
                _LOGGER.exception("a round of the ping task failed")
                due = None
            interval = self._board.ping_interval
            self._wait(stop, interval if due is None else min(interval, max(due, MIN_WAIT)))
        _LOGGER.debug("ping task stopped")
