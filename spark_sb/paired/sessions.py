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
   whether that session still has messages parked (:class:`ParkedSessions`): it reads the session's backlog
   queue from where this process last read it to its end (a queue's sequence numbers only grow, so the other
   entities' backlog is read once per process, not by every question; one request when nothing was parked
   since), then checks that the first of the session's messages it knows there is still there (one request).
   Peeked messages are not locked, and locked or deferred ones are seen too. While it has, the message goes to
   the same backlog queue, behind them. A question is bounded as a whole (``send_availability.pairing_timeout``);
   one the bound ends goes on from there at the next.
3. **The syphon completes a message only after the primary accepted it**, one session's messages in sequence
   order; so a sender that sees no message of the session in the backlog may send to the primary.

What a sender asked is kept per backlog queue (and per session known there) and asked again when
:meth:`ParkedSessions.new_batch` is called (the sink and the writer call it for every partition they send, so a
Spark batch sees what earlier batches parked on any executor; a sender that takes a session over from another
process calls it too) or when it is older than ``send_availability.ping_primary_interval`` (so a session that the
syphon moved home goes back to the primary). What the process knows of a backlog queue is kept once for every
sender of the process (:class:`_Queue`): what it read there, what it parks (known to every thread and sender
from the moment the send starts; no question that began before the send ended can make it forgotten), and
whether it found the queue absent (remembered until the secondary answers again or the process makes the queue:
it parks nothing without making it first, so a secondary that cannot be asked never holds a session whose queue
was found absent).

Entities are keyed as Service Bus compares their names, case-insensitively (:func:`~spark_sb.bus.entity_key`).
Messages without a session id, and sessions with nothing parked, keep the usual path: the cost of a session's
message on a healthy primary is one request per backlog queue per partition.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

from azure.servicebus import ServiceBusMessage

from .. import messages as msgs
from ..bus import entity_key
from ..bus.deferred import PAGE
from ..errors import ErrorClass, classify

_LOGGER = logging.getLogger(__name__)

__all__ = ["ParkedSessions", "session_queue"]

Receiver = Callable[[str], AbstractContextManager[Any]]
#: a session of an entity, as the backlog and the cache know it: ``(entity_key(entity), session id)``
Key = tuple[str, str]


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
class _Queue:
    """What this process knows of one backlog queue, shared by every sender of its secondary (under
    ``_SHARED_LOCK``)."""

    #: None: not known; False: found absent, remembered until it is found again or this process makes it (it
    #: parks nothing without making it first); True: found, or made here
    exists: bool | None = None
    #: the next sequence number no walk of the queue has read: a walk reads only what was parked after the last
    #: one (sequence numbers grow in a queue), so the other entities' backlog is read once per process
    position: int = 1
    #: the sequence numbers (ascending) of each session's messages read in the queue and not known to be gone
    parked: dict[Key, list[int]] = field(default_factory=dict)
    #: this process's sends of each session to the queue in flight, and the tick each last one ended: a question
    #: that began before it ended may not have seen it, so it cannot make the session forgotten
    sending: dict[Key, int] = field(default_factory=dict)
    sent_at: dict[Key, int] = field(default_factory=dict)
    walk_lock: threading.Lock = field(default_factory=threading.Lock)

    def holds(self, key: Key) -> bool:
        """Whether ``key`` has messages parked in the queue, as far as this process knows."""
        return bool(self.parked.get(key)) or self.sending.get(key, 0) > 0 or key in self.sent_at


_SHARED_LOCK = threading.Lock()
_SHARED: dict[tuple[str, str], _Queue] = {}
_TICKS = itertools.count()


def _shared(namespace: str, queue: str) -> _Queue:
    """The process's :class:`_Queue` of backlog queue ``queue`` of secondary ``namespace`` (call under
    ``_SHARED_LOCK``)."""
    key = (namespace.lower(), queue.lower())
    found = _SHARED.get(key)
    if found is None:
        found = _SHARED[key] = _Queue()
    return found


class _Unfinished(Exception):
    """The question's time bound passed before the backlog answered it."""


@dataclass
class _Asked:
    """When this sender last asked (a walk of a queue, or a check of a session's known messages)."""

    generation: int
    at: float


class ParkedSessions:
    """Which ``(entity, session id)`` have messages in the backlog, per backlog queue (thread-safe).

    ``receiver(queue)`` is a context manager giving an SDK receiver of a backlog queue (peek only);
    ``max_age``: how long what was asked stands before it is asked again; ``clock``: seconds; ``timeout``: the
    seconds one question may take in all (its requests, a second try on a new link included; each request waits
    at most half of it), None for the SDK's own bound per request; ``namespace``: the secondary, whose backlog
    queues this process knows once for every sender (what was found absent, read and parked)."""

    def __init__(self, receiver: Receiver, max_age: float, clock: Callable[[], float],
                 exists: Callable[[str, float | None], bool] | None = None, timeout: float | None = None,
                 namespace: str = "") -> None:
        self._receiver = receiver
        self._timeout = timeout
        #: whether a backlog queue exists, asked within the seconds given (the administration API: a peek of a
        #: missing queue costs the SDK a second); one that exists is not asked again
        self._exists = exists
        self._namespace = namespace
        self._max_age = max_age
        self._clock = clock
        self._lock = threading.Lock()
        self._generation = 0
        self._walked: dict[str, _Asked] = {}
        self._checked: dict[tuple[str, Key], _Asked] = {}
        #: a queue whose peek failed is not asked again before this (clock seconds): each partition would wait
        #: out the secondary's timeouts again
        self._failed_until: dict[str, float] = {}
        #: counters: ``session_peeks`` (peek requests), ``session_follows`` (messages sent behind parked ones),
        #: ``session_peek_failures`` (a queue that could not be peeked: the message went by what was known)
        #: ``session_unordered`` (messages sent to the primary without knowing whether their session had any
        #: parked: the backlog could be neither peeked nor sent to)
        #: ``session_held`` (messages whose send failed instead: ``session_order: strict``)
        #: ``session_peeks_unfinished`` (questions the time bound ended: the message went behind what may be
        #: parked, and the next question goes on from there)
        self.counters = {"session_peeks": 0, "session_follows": 0, "session_peek_failures": 0,
                         "session_unordered": 0, "session_held": 0, "session_peeks_unfinished": 0}

    def new_batch(self) -> None:
        """What was asked before is stale: the next question asks again (another process may have parked)."""
        with self._lock:
            self._generation += 1

    def made(self, queues: Iterable[str]) -> None:
        """These backlog queues exist now (paired by this process)."""
        with _SHARED_LOCK:
            for queue in queues:
                _shared(self._namespace, queue).exists = True

    @contextmanager
    def parking(self, queue: str, entity: str, session_ids: Iterable[str]) -> Iterator[None]:
        """Around this process's send of messages of ``session_ids`` of ``entity`` to ``queue``: from its start
        (a send that fails half way may have parked some) every sender and thread of the process knows them
        parked, and no question that began before it ended can make them forgotten (its peek may have missed
        them)."""
        keys = {(entity_key(entity), session_id) for session_id in session_ids}
        with _SHARED_LOCK:
            shared = _shared(self._namespace, queue)
            for key in keys:
                shared.sending[key] = shared.sending.get(key, 0) + 1
        try:
            yield
        finally:
            with _SHARED_LOCK:
                tick = next(_TICKS)
                for key in keys:
                    shared.sending[key] -= 1
                    if not shared.sending[key]:
                        del shared.sending[key]
                    shared.sent_at[key] = tick

    def parked(self, queue: str, entity: str, session_id: str) -> bool | None:
        """Whether ``session_id`` of ``entity`` has messages in ``queue``, asking the backlog when what is known
        is stale; ``None`` when it cannot be told: the queue could not be asked (twice, the second time on a new
        link; counted in ``session_peek_failures``, not asked again for ``max_age``), or not within ``timeout``
        (counted in ``session_peeks_unfinished``; the next question goes on from there), and this process knows
        of no message of the session there. ``False`` without asking when the queue cannot be asked but was found
        absent (nothing can be parked in a queue that does not exist; this process makes it before it parks).
        The caller sends behind whatever may be parked on ``None`` (:meth:`PairedSender._send`)."""
        key = (entity_key(entity), session_id)
        with self._lock:
            if self._fresh(queue, key):
                return self._known(queue, key)
            if self._failed_until.get(queue, float("-inf")) > self._clock():
                return self._known_or_unsure(queue, key)
            generation = self._generation
        started = self._clock()
        deadline = None if self._timeout is None else started + self._timeout
        with _SHARED_LOCK:
            shared = _shared(self._namespace, queue)
            tick = next(_TICKS)
        try:
            with shared.walk_lock:  # one walk of a queue at a time; the next goes on from where it ended
                try:
                    requests = self._ask(queue, key, shared, deadline)
                except _Unfinished:
                    raise
                except Exception:  # noqa: BLE001 - a link the service detached: once more, on a new one
                    requests = self._ask(queue, key, shared, deadline)
        except _Unfinished:
            with self._lock:
                self.counters["session_peeks_unfinished"] += 1
            answer = self._known_or_unsure(queue, key)
            _LOGGER.warning("backlog queue %r was not read to its end within %.3g s for the parked messages of "
                            "session %r of %r; %s", queue, self._timeout, session_id, entity,
                            "they are known to be parked" if answer else
                            "its messages go behind whatever may be parked; the next question goes on from there")
            return answer
        except Exception as exc:  # noqa: BLE001 - an unknown answer is the caller's to decide, never raised
            with self._lock:
                self.counters["session_peek_failures"] += 1
                self._failed_until[queue] = self._clock() + self._max_age
            answer = self._known_or_unsure(queue, key)
            _LOGGER.warning("could not peek backlog queue %r for the parked messages of session %r of %r "
                            "(%s); %s, asking again in %.3g s", queue, session_id, entity, type(exc).__name__,
                            "it has messages parked here" if answer else
                            "it was found absent: nothing can be parked there" if answer is False else
                            "its messages go behind whatever may be parked", self._max_age)
            return answer
        with _SHARED_LOCK:
            if (not shared.parked.get(key) and not shared.sending.get(key)
                    and shared.sent_at.get(key, tick) < tick):
                del shared.sent_at[key]  # this question began after the last send of it ended, and saw none
            answer = shared.holds(key)
        with self._lock:
            self.counters["session_peeks"] += requests
            self._failed_until.pop(queue, None)
            self._walked[queue] = self._checked[(queue, key)] = _Asked(generation, started)
        return answer

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters)

    def count(self, counter: str, n: int = 1) -> None:
        with self._lock:
            self.counters[counter] += n

    def _fresh(self, queue: str, key: Key) -> bool:
        """Whether this sender's last walk of ``queue`` and check of ``key``'s known messages there stand (under
        ``_lock``)."""
        walked = self._walked.get(queue)
        if walked is None or not self._stands(walked):
            return False
        with _SHARED_LOCK:
            known = bool(_shared(self._namespace, queue).parked.get(key))
        checked = self._checked.get((queue, key))
        return not known or (checked is not None and self._stands(checked))

    def _stands(self, asked: _Asked) -> bool:
        return asked.generation == self._generation and self._clock() - asked.at < self._max_age

    def _known(self, queue: str, key: Key) -> bool:
        with _SHARED_LOCK:
            return _shared(self._namespace, queue).holds(key)

    def _known_or_unsure(self, queue: str, key: Key) -> bool | None:
        """What is known without asking: parked (True), the queue found absent (False), else None."""
        with _SHARED_LOCK:
            shared = _shared(self._namespace, queue)
            if shared.holds(key):
                return True
            return False if shared.exists is False else None

    def _bound(self, deadline: float | None) -> dict[str, float]:
        """The next request's ``timeout=``: half of the question's bound or what is left of it;
        :class:`_Unfinished` when nothing is."""
        if deadline is None or self._timeout is None:
            return {}
        left = deadline - self._clock()
        if left <= 0:
            raise _Unfinished
        return {"timeout": min(self._timeout / 2, left)}

    def _ask(self, queue: str, key: Key, shared: _Queue, deadline: float | None) -> int:
        """Read what was parked in ``queue`` since the last walk, then check that ``key``'s known messages there
        are still there; returns the requests it took. Raises :class:`_Unfinished` at ``deadline`` (what was read
        by then is kept: the next question goes on from there)."""
        requests = 0
        if shared.exists is not True and self._exists is not None:
            if not self._exists(queue, self._bound(deadline).get("timeout")):
                with _SHARED_LOCK:  # not provisioned (nothing ever failed over), or deleted: nothing is parked
                    shared.exists, shared.position, shared.parked = False, 1, {}
                return 0
            with _SHARED_LOCK:
                shared.exists = True
        try:
            with self._receiver(queue) as receiver:
                while True:  # the walk: what was parked since the last one, a page per request
                    bound = self._bound(deadline)
                    requests += 1
                    page = receiver.peek_messages(max_message_count=PAGE, sequence_number=shared.position, **bound)
                    if not page:
                        break
                    with _SHARED_LOCK:
                        for message in page:
                            entity, session_id = msgs.parked_session(message)
                            if entity is not None and session_id is not None:
                                numbers = shared.parked.setdefault((entity_key(entity), session_id), [])
                                numbers.append(int(message.sequence_number or 0))
                        shared.position = int(page[-1].sequence_number or 0) + 1
                while True:  # the check: is the first of key's known messages still there?
                    with _SHARED_LOCK:
                        numbers = shared.parked.get(key) or []
                        if not numbers:
                            shared.parked.pop(key, None)
                            return requests
                        first = numbers[0]
                    bound = self._bound(deadline)
                    requests += 1
                    found = receiver.peek_messages(max_message_count=1, sequence_number=first, **bound)
                    at = int(found[0].sequence_number or 0) if found else shared.position
                    with _SHARED_LOCK:
                        # what comes before the first message still there is gone (moved home, dead-lettered)
                        shared.parked[key] = [n for n in numbers if n >= at]
                        if at in numbers:
                            return requests
        except _Unfinished:
            raise
        except Exception as exc:
            if classify(exc) is not ErrorClass.CONFIGURATION_NOT_FOUND:
                raise
            # the queue does not exist (deleted, or not provisioned yet): nothing is parked
            with _SHARED_LOCK:
                shared.exists, shared.position, shared.parked = False, 1, {}
            return requests


def sessions_of(batch: Sequence[ServiceBusMessage]) -> bool:
    """Whether any message of ``batch`` has a session id."""
    return any(message.session_id for message in batch)
