"""Backoff strategies and a small ``Retry`` policy, after redis-py's ``Retry(backoff, retries)``.

Time is injected: every object that waits takes a ``sleep`` callable, and the failover timer takes a
``clock`` callable (seconds, monotonic), so tests run whole outages in milliseconds with a fake clock.
The retry loop only repeats a call; deciding *whether* to fail over lives in :mod:`spark_sb.bus.health`.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from ..errors import redact, retry_after

_LOGGER = logging.getLogger(__name__)

__all__ = [
    "Backoff",
    "Clock",
    "ConstantBackoff",
    "ExponentialBackoff",
    "NoBackoff",
    "Retry",
    "RetryFor",
    "Sleep",
    "default_clock",
    "default_sleep",
]

T = TypeVar("T")

Clock = Callable[[], float]
Sleep = Callable[[float], object]

default_clock: Clock = time.monotonic
default_sleep: Sleep = time.sleep


class Backoff(Protocol):
    def compute(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th consecutive failure (1-based)."""
        ...


class NoBackoff:
    def compute(self, failures: int) -> float:
        return 0.0

    def __repr__(self) -> str:
        return "NoBackoff()"


class ConstantBackoff:
    def __init__(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"backoff must be at least 0 s, got {seconds}")
        self.seconds = float(seconds)

    def compute(self, failures: int) -> float:
        return self.seconds

    def __repr__(self) -> str:
        return f"ConstantBackoff({self.seconds:g})"


class ExponentialBackoff:
    """``base * 2**(failures-1)`` capped at ``cap``; with ``jitter`` a random value in [half, full]."""

    def __init__(self, base: float = 0.5, cap: float = 10.0, *, jitter: bool = False,
                 rng: random.Random | None = None) -> None:
        if base < 0 or cap < base:
            raise ValueError(f"need 0 <= base <= cap, got base={base}, cap={cap}")
        self.base = float(base)
        self.cap = float(cap)
        self.jitter = jitter
        self._rng = rng or random.Random()

    def compute(self, failures: int) -> float:
        exponent = min(max(failures, 1) - 1, 62)
        value: float = min(self.cap, self.base * (2**exponent))
        if self.jitter:
            value = self._rng.uniform(value / 2, value)
        return value

    def __repr__(self) -> str:
        return f"ExponentialBackoff(base={self.base:g}, cap={self.cap:g}, jitter={self.jitter})"


class Retry:
    """Call a function up to ``retries`` times in all, waiting ``backoff`` between failed attempts, as long
    as ``retryable(exc)`` says the failure may pass (and, given a ``deadline`` on ``clock``, as long as the wait
    ends before it)."""

    def __init__(self, backoff: Backoff, retries: int, *, sleep: Sleep = default_sleep,
                 clock: Clock = default_clock) -> None:
        if retries < 1:
            raise ValueError(f"retries must be at least 1 (the first attempt), got {retries}")
        self.backoff = backoff
        self.retries = retries
        self._sleep = sleep
        self._clock = clock

    def call(self, func: Callable[[], T], retryable: Callable[[BaseException], bool], *,
             deadline: float | None = None) -> T:
        """``func()``, tried again after a retryable failure. With ``deadline`` (a time on ``clock``) no try
        starts at or after it: when the wait before the next try would reach it, the last failure is raised."""
        failures = 0
        while True:
            try:
                return func()
            except Exception as exc:
                failures += 1
                if failures >= self.retries or not retryable(exc):
                    raise
                delay = self.backoff.compute(failures)
                if deadline is not None and self._clock() + delay >= deadline:
                    raise
                _LOGGER.debug("attempt %d failed (%s); retrying in %.3f s", failures, type(exc).__name__, delay)
                self._sleep(delay)

    def __repr__(self) -> str:
        return f"Retry({self.backoff!r}, retries={self.retries})"


class RetryFor:
    """Call a function again with backoff while it fails with what ``retryable`` accepts, for up to ``seconds``
    from its first failure (a bound in time, not in attempts: how long a blip of a namespace is ridden out).
    Each retry is logged as a warning naming ``what``. A failure ``retryable`` rejects is raised at once; the
    last failure, once the time is up, is raised too, or what ``give_up(exc, failures, elapsed)`` makes of it.
    A failure that names the wait the service asked for (:func:`~spark_sb.errors.retry_after`) waits at least
    that long."""

    def __init__(self, seconds: float, backoff: Backoff, *, clock: Clock = default_clock,
                 sleep: Sleep = default_sleep) -> None:
        if seconds < 0:
            raise ValueError(f"the retry bound must be at least 0 s, got {seconds}")
        self.seconds = float(seconds)
        self.backoff = backoff
        self._clock = clock
        self._sleep = sleep

    def call(self, func: Callable[[], T], retryable: Callable[[BaseException], bool], *, what: str,
             give_up: Callable[[Exception, int, float], BaseException] | None = None) -> T:
        first_failure: float | None = None
        failures = 0
        while True:
            try:
                return func()
            except Exception as exc:
                if not retryable(exc):
                    raise
                failures += 1
                now = self._clock()
                first_failure = now if first_failure is None else first_failure
                elapsed = now - first_failure
                left = self.seconds - elapsed
                if left <= 0:
                    if give_up is None:
                        raise
                    raise give_up(exc, failures, elapsed) from exc
                # a busy namespace's own "Please wait N seconds" is the least wait (what the paired sender waits)
                delay = min(max(self.backoff.compute(failures), retry_after(exc) or 0.0), left)
                _LOGGER.warning("%s failed (%s: %s); trying again in %.1f s (%.0f s of %g s used)", what,
                                type(exc).__name__, redact(str(exc))[:200], delay, elapsed, self.seconds)
                self._sleep(delay)

    def __repr__(self) -> str:
        return f"RetryFor({self.seconds:g} s, {self.backoff!r})"
