"""Several sends in flight: a sender's pool of threads, each its own send lane.

A sender's :meth:`submit` runs its ``send`` in a thread of this pool. Each thread uses lane 1, 2, ... of every
:class:`~spark_sb.bus.Namespace` (:func:`~spark_sb.bus.send_lane`): its own SDK senders, each on its own
connection, so that a far namespace's round trips overlap instead of adding up. Everything else is the sender's
``send``, unchanged: the same failover, rotation and guarantees, one call at a time per thread; a caller that
needs every acknowledgement waits for every future (the Spark sink does, before a partition reports).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from ._namespace import send_lane

__all__ = ["SendPool"]

T = TypeVar("T")


class SendPool:
    """At most ``size`` calls at once, each in a thread with a lane of its own; started on first use."""

    def __init__(self, size: int, name: str = "spark-sb-send") -> None:
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        self.size = size
        self._name = name
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    def submit(self, fn: Callable[..., T], /, *args: object) -> Future[T]:
        """``fn(*args)`` in a thread of the pool. Raises ``RuntimeError`` once :meth:`shutdown` was called."""
        with self._lock:
            if self._closed:
                raise RuntimeError("this sender is closed")
            if self._pool is None:
                lanes = itertools.count(1)
                self._pool = ThreadPoolExecutor(self.size, thread_name_prefix=self._name,
                                                initializer=lambda: send_lane(next(lanes)))
            return self._pool.submit(fn, *args)

    def shutdown(self) -> None:
        """No new calls; calls not started are cancelled (their futures say so); calls running end by themselves
        (the sender's close closes the handles they use). Idempotent."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
