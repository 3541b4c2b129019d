"""Per-process, per-entity send availability state, shared by every sender in the process ("all senders
learn"; behaviour.md, "The paired sender").

States of one entity::

    healthy --outage--> failing (t0) --now - t0 >= failover_interval--> failed_over
       ^                   |                                                |
       +----success--------+                  <----ping succeeded-----------+

* ``failover_interval`` 0 fails over on the first outage-class failure.
* **one outage, one interval**: a failing state lives only as long as the sends living through it
  (:meth:`HealthBoard.sending`); when the last of them leaves otherwise than by a success or a failover (another
  error, a killed task), the entity is healthy again, so a send hours later tries the primary for a full
  interval instead of failing over at once.
* **fast re-failover**: after a successful ping returns an entity to healthy it is *on probation* until the
  first successful primary send; an outage-class failure while on probation returns it to failed over at once,
  without a new interval. (behaviour.md says "a failure right after failing back"; "right after" is defined
  as "before the first successful primary send after failback".)
* while failed over a ping is due every ``ping_primary_interval``, counted from the failover or the last ping;
  :meth:`HealthBoard.claim_ping` hands it to exactly one caller (the board's ping task, :attr:`HealthBoard.pings`,
  or a send). A ping refused for configuration is kept (:meth:`HealthBoard.refused`) until a later ping.

The board also keeps the backlog rotation of the process: the backlog queue each entity uses (chosen at random,
kept until it fails) and the queues cooling down after a failed send.

:func:`join_board` returns the board for one pairing (primary, secondary, backlog prefix); the first sender
that asks creates it, with its intervals and its clock. The intervals (failover interval, ping interval,
backlog cool-down) belong to the pairing, not to one sender: a sender whose options differ from those of a
sender of the same pairing still open in the process is refused with a :class:`~spark_sb.errors.ConfigError`
naming each option and both values (keying the state by the options instead would split one entity's health
in two within a process, so "all senders learn" would silently stop holding). Once every sender of the board
is closed, the next one's options replace them (the entity states stay). Every method is thread-safe.
"""

from __future__ import annotations

import enum
import logging
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

from ..config import format_duration
from ..errors import ConfigError
from ._registry import entries, shared
from .pings import Clock, PingTask, Wait

_LOGGER = logging.getLogger(__name__)

__all__ = ["EntityState", "HealthBoard", "all_boards", "entity_key", "join_board", "shared_board"]

#: the board's settings, as named in the configuration (``send_availability.<name>``)
SETTINGS = ("failover_interval", "ping_primary_interval", "backlog_cooldown")


def entity_key(entity: str) -> str:
    """What identifies an entity of a namespace: its name as Service Bus compares names, case-insensitively
    (``Orders`` and ``orders`` are one queue, so one health, one backlog rotation and one session)."""
    return entity.lower()


class EntityState(enum.Enum):
    HEALTHY = "healthy"
    FAILING = "failing"
    FAILED_OVER = "failed_over"


@dataclass
class _Entity:
    name: str  # as first spelled in this process (the board keys it by entity_key)
    state: EntityState = EntityState.HEALTHY
    failing_since: float | None = None
    next_ping: float | None = None
    pinging: bool = False
    refused: BaseException | None = None  # the SDK error of the last ping, when refused for configuration
    probation: bool = False
    backlog_queue: str | None = None
    sending: int = 0  # sends of this entity in progress (see HealthBoard.sending)


class HealthBoard:
    """The state of every entity of one pairing in this process."""

    def __init__(
        self,
        *,
        failover_interval: float,
        ping_interval: float,
        backlog_cooldown: float,
        clock: Clock,
        wait: Wait | None = None,
    ) -> None:
        self.failover_interval = float(failover_interval)
        self.ping_interval = float(ping_interval)
        self.backlog_cooldown = float(backlog_cooldown)
        self.clock = clock
        self._lock = threading.Lock()
        self._entities: dict[str, _Entity] = {}
        self._cooling: dict[str, float] = {}  # backlog queue -> back in the rotation at
        self._counters: dict[str, int] = {"failovers": 0, "failbacks": 0, "assumed_failovers": 0}
        self._open = 0  # senders of this board not closed yet (join / leave)
        #: the background pings of this board (see :mod:`spark_sb.bus.pings`); ``wait`` is its wait
        self.pings = PingTask(self, wait)

    def settings(self) -> dict[str, float]:
        """``{option name: seconds}`` for :data:`SETTINGS`."""
        return {"failover_interval": self.failover_interval, "ping_primary_interval": self.ping_interval,
                "backlog_cooldown": self.backlog_cooldown}

    def join(self, settings: dict[str, float], pairing: str = "this pairing") -> None:
        """A sender with ``settings`` (as :meth:`settings`) starts using this board. Raises
        :class:`ConfigError` naming every option that differs, with both values, while another sender of the
        board is open; when none is, ``settings`` replace the board's. Pair with :meth:`leave`."""
        with self._lock:
            current = self.settings()
            differing = [name for name in SETTINGS if float(settings[name]) != current[name]]
            if differing and self._open > 0:
                def shown(seconds: float) -> str:
                    return format_duration(timedelta(seconds=seconds))

                first, *others = differing
                problem = (f"{shown(settings[first])} differs from the {shown(current[first])} of a PairedSender "
                           f"of {pairing} already open in this process")
                for name in others:
                    problem += (f"; send_availability.{name}: {shown(settings[name])} differs from its "
                                f"{shown(current[name])}")
                problem += (". Every sender of one pairing in a process shares the entity health, so these options "
                            "must agree: use the same values, close the other sender first, or use another "
                            "send_availability.backlog_prefix")
                raise ConfigError(f"send_availability.{first}", problem)
            if differing:
                _LOGGER.info("the shared health of %s now uses %s", pairing, settings)
                self.failover_interval = float(settings["failover_interval"])
                self.ping_interval = float(settings["ping_primary_interval"])
                self.backlog_cooldown = float(settings["backlog_cooldown"])
            self._open += 1

    def leave(self) -> None:
        """A sender that joined (:meth:`join`) is closed."""
        with self._lock:
            self._open = max(0, self._open - 1)

    def _entity(self, entity: str) -> _Entity:
        found = self._entities.get(entity_key(entity))
        if found is None:
            found = self._entities[entity_key(entity)] = _Entity(entity)
        return found

    def _fail_over(self, entity: str, record: _Entity, now: float) -> None:
        record.state = EntityState.FAILED_OVER
        record.failing_since = None
        record.probation = False
        record.next_ping = now + self.ping_interval
        self._counters["failovers"] += 1
        _LOGGER.warning("entity %r failed over to the backlog; next ping in %.3g s", entity, self.ping_interval)

    # --- the failover timer ----------------------------------------------------------------------------

    def state(self, entity: str) -> EntityState:
        """The current state, after applying the timer (a failing entity whose interval ran out is failed
        over)."""
        with self._lock:
            record = self._entity(entity)
            now = self.clock()
            if (record.state is EntityState.FAILING and record.failing_since is not None
                    and now - record.failing_since >= self.failover_interval):
                self._fail_over(entity, record, now)
            return record.state

    def remaining(self, entity: str) -> float:
        """Seconds until a failing entity fails over (0 when not failing or already due)."""
        with self._lock:
            record = self._entity(entity)
            if record.state is not EntityState.FAILING or record.failing_since is None:
                return 0.0
            return max(0.0, record.failing_since + self.failover_interval - self.clock())

    def record_success(self, entity: str) -> None:
        """A primary send for ``entity`` succeeded: healthy, timer stopped, probation over."""
        with self._lock:
            record = self._entity(entity)
            if record.state is not EntityState.HEALTHY:
                _LOGGER.info("entity %r is healthy again", entity)
            record.state = EntityState.HEALTHY
            record.failing_since = None
            record.probation = False
            record.next_ping = None
            record.refused = None

    def record_failure(self, entity: str) -> EntityState:
        """An outage-class failure of a primary send for ``entity``; returns the new state."""
        with self._lock:
            record = self._entity(entity)
            now = self.clock()
            if record.state is EntityState.HEALTHY:
                if record.probation or self.failover_interval <= 0:
                    self._fail_over(entity, record, now)
                else:
                    record.state = EntityState.FAILING
                    record.failing_since = now
                    _LOGGER.warning("entity %r is failing; failover in %.3g s unless a send succeeds",
                                    entity, self.failover_interval)
            elif record.state is EntityState.FAILING:
                if record.failing_since is None or now - record.failing_since >= self.failover_interval:
                    self._fail_over(entity, record, now)
            return record.state

    @contextmanager
    def sending(self, entity: str) -> Iterator[None]:
        """Around one send of ``entity``: a failing state does not outlive the sends living through it. When
        the last of them leaves while the entity is still failing (another error, a killed task, an
        exception), the outage it measured is over for this board: the entity is healthy again and the next
        outage-class failure starts a new interval (behaviour.md, "one outage, one interval")."""
        with self._lock:
            self._entity(entity).sending += 1
        try:
            yield
        finally:
            with self._lock:
                record = self._entity(entity)
                record.sending -= 1
                abandoned = record.sending == 0 and record.state is EntityState.FAILING
                if abandoned:
                    record.state = EntityState.HEALTHY
                    record.failing_since = None
            if abandoned:
                _LOGGER.info("the send(s) living through the outage of %r ended without success or failover; "
                             "the next failure starts a new failover interval", entity)

    # --- pings -----------------------------------------------------------------------------------------

    def claim_ping(self, entity: str) -> bool:
        """True for exactly one caller when ``entity`` is failed over and its ping is due; that caller must
        report with :meth:`ping_result`."""
        with self._lock:
            record = self._entities.get(entity_key(entity))
            if record is None or record.state is not EntityState.FAILED_OVER or record.pinging:
                return False
            if record.next_ping is not None and self.clock() < record.next_ping:
                return False
            record.pinging = True
            return True

    def ping_result(self, entity: str, ok: bool | None, refused: BaseException | None = None) -> None:
        """The result of a ping claimed with :meth:`claim_ping`: ``ok`` True (fail back), False (still down;
        with ``refused``, the SDK error of a ping refused for configuration, which :meth:`refused` hands to the
        next send), or None (no result: the pinger was closed; the ping stays due)."""
        with self._lock:
            record = self._entity(entity)
            record.pinging = False
            if record.state is not EntityState.FAILED_OVER or ok is None:
                return
            record.refused = None if ok else refused
            if ok:
                record.state = EntityState.HEALTHY
                record.failing_since = None
                record.next_ping = None
                record.probation = True
                self._counters["failbacks"] += 1
                _LOGGER.info("ping to entity %r succeeded; failing back to the primary", entity)
            else:
                record.next_ping = self.clock() + self.ping_interval

    def refused(self, entity: str) -> BaseException | None:
        """The SDK error of the last ping of ``entity`` when it was refused for configuration (a rejected
        credential, an unknown entity): every send raises it as a configuration error until a later ping
        answers otherwise."""
        with self._lock:
            record = self._entities.get(entity_key(entity))
            return record.refused if record is not None else None

    def due_pings(self) -> list[str]:
        """The failed-over entities whose ping is due and not running (the ping task's round)."""
        with self._lock:
            now = self.clock()
            return sorted(record.name for record in self._entities.values()
                          if record.state is EntityState.FAILED_OVER and not record.pinging
                          and (record.next_ping is None or record.next_ping <= now))

    def next_ping_in(self) -> float | None:
        """Seconds until the next ping of a failed-over entity is due (0 when one is due now), ``None`` when
        no entity is failed over."""
        with self._lock:
            now = self.clock()
            due = [max(0.0, (record.next_ping or now) - now) for record in self._entities.values()
                   if record.state is EntityState.FAILED_OVER]
            return min(due) if due else None

    def on_probation(self, entity: str) -> bool:
        with self._lock:
            return self._entity(entity).probation

    # --- backlog rotation ------------------------------------------------------------------------------

    def backlog_queue(self, entity: str, usable: Sequence[str], rng: random.Random,
                      exclude: Sequence[str] = ()) -> str | None:
        """The backlog queue ``entity`` uses: its current one while it stays in the rotation, else one picked
        at random among the usable queues not cooling down (and not in ``exclude``); ``None`` when none is
        left."""
        with self._lock:
            now = self.clock()
            for queue, until in list(self._cooling.items()):
                if until <= now:
                    del self._cooling[queue]
            record = self._entity(entity)
            current = record.backlog_queue
            if current is not None and current in usable and current not in self._cooling and current not in exclude:
                return current
            candidates = [q for q in usable if q not in self._cooling and q not in exclude]
            if not candidates:
                record.backlog_queue = None
                return None
            record.backlog_queue = rng.choice(candidates)
            _LOGGER.info("entity %r now uses backlog queue %r", entity, record.backlog_queue)
            return record.backlog_queue

    def cool_down(self, queue: str) -> None:
        """``queue`` failed a send: out of the rotation for every sender in the process for the cool-down."""
        with self._lock:
            self._cooling[queue] = self.clock() + self.backlog_cooldown
            for record in self._entities.values():
                if record.backlog_queue == queue:
                    record.backlog_queue = None
        _LOGGER.warning("backlog queue %r leaves the rotation for %.3g s", queue, self.backlog_cooldown)

    def cooling(self) -> list[str]:
        with self._lock:
            now = self.clock()
            return sorted(q for q, until in self._cooling.items() if until > now)

    def assume_failed_over(self, entity: str) -> bool:
        """Start ``entity`` failed over without waiting out the failover interval, because another process
        of the same pairing saw it fail over (the Spark sink passes the merged health of the previous batch
        to its new workers). The first send pings the primary at once, so an entity that is back is failed
        back on the first send. Returns False (and changes nothing) when this board already knows the entity
        as failed over, or knows it healthy from a primary send, a ping or a failback."""
        with self._lock:
            record = self._entities.get(entity_key(entity))
            if record is not None and (record.state is EntityState.FAILED_OVER or record.probation
                                       or record.state is EntityState.HEALTHY):
                return False
            record = self._entity(entity)
            record.state = EntityState.FAILED_OVER
            record.failing_since = None
            record.probation = False
            record.next_ping = self.clock()
            self._counters["assumed_failovers"] += 1
        _LOGGER.info("entity %r starts failed over (another worker of this pairing failed it over)", entity)
        return True

    def stats(self) -> dict[str, int]:
        """Counters since the board was created: ``failovers`` (interval ran out, or a failure on
        probation), ``failbacks`` (a ping succeeded) and ``assumed_failovers`` (:meth:`assume_failed_over`)."""
        with self._lock:
            return dict(self._counters)

    def snapshot(self) -> dict[str, str]:
        """``{entity: state}`` for every entity seen by this board, each named as first spelled here."""
        with self._lock:
            return {record.name: record.state.value for _, record in sorted(self._entities.items())}


#: the kind of the boards in the process registry (:func:`spark_sb.bus.shared`)
BOARD_KIND = "health-board"


def shared_board(key: tuple[str, ...], factory: Callable[[], HealthBoard]) -> HealthBoard:
    """The process-wide board for ``key``, created by ``factory`` on first use."""
    return shared(BOARD_KIND, key, factory)


def join_board(key: tuple[str, ...], settings: dict[str, float], clock: Clock, pairing: str,
               wait: Wait | None = None) -> HealthBoard:
    """The process-wide board for ``key``, created with ``settings``, ``clock`` and the ping task's ``wait``
    on first use, joined with ``settings`` (see :meth:`HealthBoard.join`; call :meth:`HealthBoard.leave` when
    done)."""
    board = shared_board(key, lambda: HealthBoard(
        failover_interval=settings["failover_interval"], ping_interval=settings["ping_primary_interval"],
        backlog_cooldown=settings["backlog_cooldown"], clock=clock, wait=wait))
    board.join(settings, pairing)
    return board


def all_boards() -> dict[tuple[str, ...], HealthBoard]:
    return entries(BOARD_KIND)
