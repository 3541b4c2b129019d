"""Sessions keep their order through an outage: one backlog queue per session, and new messages that follow the
parked ones.

Service Bus sessions give first-in, first-out per session id. A failover that parks some of a session's messages
in the backlog and a failback that sends its next ones to the primary would put the later messages ahead of the
parked ones (the .NET feature gives this up: "messages within a session might arrive out of order"). spark-sb
keeps the order with three rules:

1. **One queue per session.** A message with a session id that fails over goes to the backlog queue its
   ``(entity, session id)`` hashes to (:func:`session_queue`), never to another: the backlog queue holds the
   session in the order it was sent. When that queue does not accept, the send fails
   (:class:`~spark_sb.errors.BacklogUnavailableError`) rather than split the session over two queues.
2. **Follow the parked messages.** Before a session's message goes to the primary, the sender asks the backlog
   whether that session still has messages parked (:class:`ParkedSessions`): it peeks the session's backlog queue
   (one request per 250 messages there, one request when it is empty; peeked messages are not locked, and locked
   or deferred ones are seen too). While it has, the message goes to the same backlog queue, behind them.
3. **The syphon completes a message only after the primary accepted it**, one session's messages in sequence
   order; so a sender that sees no message of the session in the backlog may send to the primary.

What the sender knows is cached per backlog queue and renewed when :meth:`ParkedSessions.new_batch` is called
(the sink and the writer call it for every partition they send, so a Spark batch sees what earlier batches
parked on any executor) or when it is older than ``send_availability.ping_primary_interval`` (so a session
that the syphon moved home goes back to the primary). What this process parks is known at once.

Messages without a session id, and sessions with nothing parked, keep the usual path: the cost of a session's
message on a healthy primary is one peek of an empty queue per backlog queue per partition.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from azure.servicebus import ServiceBusMessage

from .. import messages as msgs
from ..bus import entity_key
from ..bus.deferred import peek_pages
from ..errors import ErrorClass, classify

_LOGGER = logging.getLogger(__name__)

__all__ = ["ParkedSessions", "session_queue"]

Receiver = Callable[[str], AbstractContextManager[Any]]


def session_queue(entity: str, session_id: str, queues: Sequence[str]) -> str:
    """The backlog queue of ``session_id`` of ``entity``: the same in every process (a stable hash, not
    Python's) and for every spelling of the entity's name (Service Bus compares them case-insensitively), among
    ``queues`` in their configured order. ``session_id`` must be encodable (:func:`session_id_problem`)."""
    digest = hashlib.blake2b(f"{entity_key(entity)}\n{session_id}".encode(), digest_size=8).digest()
    return queues[int.from_bytes(digest, "big") % len(queues)]


def session_id_problem(session_id: str) -> str | None:
    """Why the SDK cannot send ``session_id`` (a lone surrogate is not UTF-8 text), or ``None``."""
    try:
        session_id.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"session_id: {session_id!r} is not UTF-8 text ({exc.reason} at index {exc.start})"
    return None


@dataclass
class _Seen:
    """What one backlog queue held when it was last peeked, plus what this process parked there since."""

    generation: int
    at: float
    sessions: set[tuple[str, str]] = field(default_factory=set)


class ParkedSessions:
    """Which ``(entity, session id)`` have messages in the backlog, per backlog queue (thread-safe).

    ``receiver(queue)`` is a context manager giving an SDK receiver of a backlog queue (peek only);
    ``max_age``: how long what a peek found stands before the queue is peeked again; ``clock``: seconds;
    ``timeout``: seconds one peek request may take (a queue that accepts it and never answers), None for the
    SDK's own bound."""

    def __init__(self, receiver: Receiver, max_age: float, clock: Callable[[], float],
                 exists: Callable[[str], bool] | None = None, timeout: float | None = None) -> None:
        self._receiver = receiver
        self._timeout = timeout
        #: whether a backlog queue exists (the administration API: a peek of a missing queue costs the SDK a
        #: second); one that exists is not asked again
        self._exists = exists
        self._existing: set[str] = set()
        self._max_age = max_age
        self._clock = clock
        self._lock = threading.Lock()
        self._generation = 0
        self._seen: dict[str, _Seen] = {}
        self._peek_locks: dict[str, threading.Lock] = {}
        #: a queue whose peek failed is not asked again before this (clock seconds): each partition would wait
        #: out the secondary's timeouts again
        self._failed_until: dict[str, float] = {}
        #: counters: ``session_peeks`` (peek requests), ``session_follows`` (messages sent behind parked ones),
        #: ``session_peek_failures`` (a queue that could not be peeked: the message went by what was known)
        #: ``session_unordered`` (messages sent to the primary without knowing whether their session had any
        #: parked: the backlog could be neither peeked nor sent to)
        #: ``session_held`` (messages whose send failed instead: ``session_order: strict``)
        self.counters = {"session_peeks": 0, "session_follows": 0, "session_peek_failures": 0,
                         "session_unordered": 0, "session_held": 0}

    def new_batch(self) -> None:
        """What was peeked before is stale: the next question peeks again (another process may have parked)."""
        with self._lock:
            self._generation += 1

    def park(self, queue: str, entity: str, session_id: str) -> None:
        """This process sends messages of ``session_id`` to ``queue`` (called before the send: a send that
        fails half way may have parked some)."""
        with self._lock:
            seen = self._seen.get(queue)
            if seen is None:
                # not peeked yet: what else the queue holds is unknown, so it is peeked at the next question
                seen = self._seen[queue] = _Seen(generation=-1, at=float("-inf"))
            seen.sessions.add((entity_key(entity), session_id))

    def parked(self, queue: str, entity: str, session_id: str) -> bool | None:
        """Whether ``session_id`` of ``entity`` has messages in ``queue``, peeking it when what is known is
        stale; ``None`` when it cannot be told: the queue could not be peeked (twice, the second time on a new
        link) and this process parked nothing of the session (counted in ``session_peek_failures``; the queue is
        not asked again for ``max_age``). The caller then sends behind whatever may be parked
        (:meth:`PairedSender._send`)."""
        key = (entity_key(entity), session_id)
        with self._lock:
            seen = self._seen.get(queue)
            if seen is not None and self._fresh(seen):
                return key in seen.sessions
            if self._failed_until.get(queue, float("-inf")) > self._clock():
                return True if seen is not None and key in seen.sessions else None
            peek_lock = self._peek_locks.setdefault(queue, threading.Lock())
        with peek_lock:  # one peek of a queue at a time; the others take its answer
            with self._lock:
                seen = self._seen.get(queue)
                if seen is not None and self._fresh(seen):
                    return key in seen.sessions
                generation = self._generation
                parked_since = set(seen.sessions) if seen is not None else set()
            started = self._clock()
            try:
                try:
                    found, requests = self._peek(queue)
                except Exception:  # noqa: BLE001 - a link the service detached: once more, on a new one
                    found, requests = self._peek(queue)
            except Exception as exc:  # noqa: BLE001 - an unknown answer is the caller's to decide, never raised
                with self._lock:
                    self.counters["session_peek_failures"] += 1
                    self._failed_until[queue] = self._clock() + self._max_age
                _LOGGER.warning("could not peek backlog queue %r for the parked messages of session %r of %r "
                                "(%s); %s, asking again in %.3g s", queue, session_id, entity, type(exc).__name__,
                                "it has messages parked here" if key in parked_since else
                                "its messages go behind whatever may be parked", self._max_age)
                return True if key in parked_since else None
            with self._lock:
                self.counters["session_peeks"] += requests
                self._failed_until.pop(queue, None)
                current = self._seen.get(queue)
                # what this process parked while the peek ran stays known (the peek may not have seen it)
                parked_during = set(current.sessions) - parked_since if current is not None else set()
                self._seen[queue] = _Seen(generation, started, found | parked_during)
                return key in self._seen[queue].sessions

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters)

    def count(self, counter: str, n: int = 1) -> None:
        with self._lock:
            self.counters[counter] += n

    def _fresh(self, seen: _Seen) -> bool:
        return seen.generation == self._generation and self._clock() - seen.at < self._max_age

    def _peek(self, queue: str) -> tuple[set[tuple[str, str]], int]:
        """Every ``(entity, session id)`` with a message in ``queue`` (active, locked, deferred or scheduled),
        and the requests it took."""
        found: set[tuple[str, str]] = set()
        requests = 0
        if self._exists is not None and queue not in self._existing:
            if not self._exists(queue):
                return found, 0  # not provisioned yet (nothing ever failed over): nothing is parked
            self._existing.add(queue)
        try:
            with self._receiver(queue) as receiver:
                requests += 1  # the last page, empty (an empty queue's only one)
                for page in peek_pages(receiver, self._timeout):
                    requests += 1
                    for message in page:
                        entity, session_id = msgs.parked_session(message)
                        if entity is not None and session_id is not None:
                            found.add((entity_key(entity), session_id))
        except Exception as exc:
            if found or classify(exc) is not ErrorClass.CONFIGURATION_NOT_FOUND:
                raise
            # the queue does not exist (deleted, or not provisioned yet): nothing is parked
            self._existing.discard(queue)
        return found, requests


def sessions_of(batch: Sequence[ServiceBusMessage]) -> bool:
    """Whether any message of ``batch`` has a session id."""
    return any(message.session_id for message in batch)
