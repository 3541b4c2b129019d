"""The broker of one emulated namespace: entities, messages, locks, sessions, timers.

Pure Python, no Proton and no network: the AMQP layer (``amqp.py``) and the administration REST API
(``admin_http.py``) call into it, always from the one reactor thread, so it needs no locking.
Time comes from an injectable ``clock`` (seconds since the epoch, float) so tests drive expiry
without sleeping. The durable store (``store.py``) is the truth: every accepted message is
committed before ``send`` returns, and the in-memory indexes are rebuilt from it at start.

Errors are raised as ``BrokerError(condition, description)`` where ``condition`` is the AMQP error
condition the AMQP layer puts on the wire (see ``Cond``).
"""

from __future__ import annotations

import copy
import dataclasses
import heapq
import itertools
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from . import limits, sections, sql
from .model import (
    DISABLED,
    QUEUE,
    SUBSCRIPTION,
    TOPIC,
    EntityConfigError,
    QueueSpec,
    RuleSpec,
    SubscriptionSpec,
    TopicSpec,
    subscription_path,
    validate,
    validate_rule,
)

_LOGGER = logging.getLogger(__name__)

class Cond:
    """AMQP error conditions the SDK maps to its exceptions."""

    NOT_FOUND = "amqp:not-found"
    UNAUTHORIZED = "amqp:unauthorized-access"
    QUOTA = "amqp:resource-limit-exceeded"
    SIZE = "amqp:link:message-size-exceeded"
    BUSY = "com.microsoft:server-busy"
    TIMEOUT = "com.microsoft:timeout"
    DISABLED = "com.microsoft:entity-disabled"
    LOCK_LOST = "com.microsoft:message-lock-lost"
    SESSION_LOCK_LOST = "com.microsoft:session-lock-lost"
    SESSION_CANNOT_BE_LOCKED = "com.microsoft:session-cannot-be-locked"
    MESSAGE_NOT_FOUND = "com.microsoft:message-not-found"
    ALREADY_EXISTS = "com.microsoft:entity-already-exists"
    INVALID = "amqp:invalid-field"
    NOT_IMPLEMENTED = "amqp:not-implemented"
    INTERNAL = "amqp:internal-error"


class BrokerError(Exception):
    def __init__(self, condition: str, description: str) -> None:
        super().__init__(f"{condition}: {description}")
        self.condition = condition
        self.description = description


# Message states as the SDK reads them from x-opt-message-state
STATE_ACTIVE = 0
STATE_DEFERRED = 1
STATE_SCHEDULED = 2

DLQ_SUFFIX = "/$DeadLetterQueue"


@dataclass
class Incoming:
    """A message as it arrived from a sender, already decoded by the AMQP layer.

    ``raw`` is the fully encoded AMQP message exactly as the client sent it (for a batch: one inner
    message). The broker stores ``raw`` untouched; the other fields are what the broker needs to
    route, filter, expire and schedule it.
    """

    raw: bytes
    message_id: str | None = None
    session_id: str | None = None
    ttl: float | None = None  # seconds, from the header's ttl; None = entity default
    scheduled_enqueue_time: float | None = None  # epoch seconds, from x-opt-scheduled-enqueue-time
    partition_key: str | None = None
    # for subscription rules: correlation_id, message_id, to, reply_to, subject, session_id,
    # reply_to_session_id, content_type, and "properties" (the application properties dict)
    filter_fields: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)  # slots: 160 bytes a message instead of 216 (50,000 one-byte messages, Python 3.11)
class Stored:
    """A message held by an entity (queue, subscription, or a dead-letter sub-queue)."""

    entity: str  # queue path, "topic/subscriptions/sub", or either + "/$DeadLetterQueue"
    sequence_number: int  # unique and increasing per queue or topic, from 1 (a subscription's: its topic's)
    raw: bytes
    message_id: str | None
    session_id: str | None
    enqueued_time: float  # epoch seconds
    expires_at: float | None  # epoch seconds, None = never
    scheduled_enqueue_time: float | None
    partition_key: str | None = None
    delivery_count: int = 0
    state: int = STATE_ACTIVE
    dead_letter_reason: str | None = None
    dead_letter_description: str | None = None
    dead_letter_source: str | None = None
    # lock (peek-lock deliveries only); lock_token is a uuid.UUID
    lock_token: uuid.UUID | None = None
    locked_until: float | None = None


@dataclass
class RuntimeCounts:
    active: int = 0
    dead_letter: int = 0
    scheduled: int = 0
    transfer: int = 0
    transfer_dead_letter: int = 0
    size_in_bytes: int = 0

    @property
    def total(self) -> int:
        return self.active + self.dead_letter + self.scheduled


_MIB = 1024 * 1024
_DLQ_LOWER = DLQ_SUFFIX.lower()
_TTL_EXPIRED = "TTLExpiredException"
_TTL_EXPIRED_DESCRIPTION = "The message expired and was dead lettered."
_MAX_DELIVERY = "MaxDeliveryCountExceeded"
_SEND_BLOCKED = (DISABLED, "SendDisabled")
_RECEIVE_BLOCKED = (DISABLED, "ReceiveDisabled")

# kinds of entries in the deadline heap
_LOCK_EXPIRY = 0
_SESSION_LOCK_EXPIRY = 1
_ACTIVATION = 2
_TTL_EXPIRY = 3


def _path_of(spec: Any) -> str:
    path: str = spec.path if spec.kind == SUBSCRIPTION else spec.name
    return path


def _min_ttl(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def _snapshot(m: Stored) -> Stored:
    """A copy handed to the caller, so later changes inside the broker do not show through."""
    return Stored(
        m.entity, m.sequence_number, m.raw, m.message_id, m.session_id, m.enqueued_time, m.expires_at,
        m.scheduled_enqueue_time, m.partition_key, m.delivery_count, m.state, m.dead_letter_reason,
        m.dead_letter_description, m.dead_letter_source, m.lock_token, m.locked_until,
    )


class _Ready:
    """An ordered set of sequence numbers (a heap with lazy deletion): the next message to deliver."""

    __slots__ = ("heap", "members")

    def __init__(self) -> None:
        self.heap: list[int] = []
        self.members: set[int] = set()

    def __len__(self) -> int:
        return len(self.members)

    def push(self, seq: int) -> None:
        if seq not in self.members:
            self.members.add(seq)
            heapq.heappush(self.heap, seq)

    def discard(self, seq: int) -> None:
        self.members.discard(seq)

    def pop(self) -> int | None:
        heap, members = self.heap, self.members
        while heap:
            seq = heapq.heappop(heap)
            if seq in members:
                members.remove(seq)
                return seq
        return None

    def head(self) -> int | None:
        heap, members = self.heap, self.members
        while heap and heap[0] not in members:
            heapq.heappop(heap)
        return heap[0] if heap else None


class _Box:
    """The messages held by a queue, a subscription, or the dead-letter sub-queue of either.

    ``ready`` holds the active, unlocked messages in sequence order, per session id for a session entity
    (key None otherwise). Deferred and scheduled messages are only in ``msgs``.
    """

    __slots__ = ("path", "owner", "is_dlq", "topic", "sessionful", "msgs", "ready", "size")

    def __init__(self, path: str, owner: str, is_dlq: bool, topic: str | None, sessionful: bool) -> None:
        self.path = path
        self.owner = owner  # the queue or subscription whose description applies
        self.is_dlq = is_dlq
        self.topic = topic
        self.sessionful = sessionful
        self.msgs: dict[int, Stored] = {}
        self.ready: dict[str | None, _Ready] = {}
        self.size = 0

    def make_ready(self, msg: Stored) -> None:
        key = msg.session_id if self.sessionful else None
        ready = self.ready.get(key)
        if ready is None:
            ready = self.ready[key] = _Ready()
        ready.push(msg.sequence_number)

    def unready(self, msg: Stored) -> None:
        ready = self.ready.get(msg.session_id if self.sessionful else None)
        if ready is not None:
            ready.discard(msg.sequence_number)

    def reindex(self, sessionful: bool) -> None:
        members = [seq for ready in self.ready.values() for seq in ready.members]
        self.sessionful = sessionful
        self.ready = {}
        for seq in sorted(members):
            self.make_ready(self.msgs[seq])


# --------------------------------------------------------------------------- subscription filters

Predicate = Callable[[Incoming], bool]


def _always(_m: Incoming) -> bool:
    return True


def _never(_m: Incoming) -> bool:
    return False


def _field(m: Incoming, name: str) -> Any:
    ff = m.filter_fields
    if name in ff:
        return ff[name]
    if name in ("message_id", "session_id"):
        return getattr(m, name)
    return None


def _properties(m: Incoming) -> dict[str, Any]:
    return m.filter_fields.get("properties") or {}


def _context(m: Incoming) -> sql.Context:
    fields = dict(m.filter_fields)
    fields.setdefault("message_id", m.message_id)
    fields.setdefault("session_id", m.session_id)
    return sql.Context(fields, _properties(m), {})


@dataclass
class _Rule:
    """A rule compiled: its filter, and its action's statements (None: no action)."""

    match: Predicate
    action: list[sql.Change] | None = None


#: what a subscription's rules say of a message: None = not taken; else the actions of the matching rules
Router = Callable[[Incoming], "list[list[sql.Change]] | None"]


def _invalid_sql(label: str, rule: RuleSpec, err: sql.SqlError) -> BrokerError:
    return BrokerError(Cond.INVALID, f"{label} rule {rule.name!r}: {err}")


def _compile_filter(label: str, rule: RuleSpec) -> _Rule:
    """The rule compiled; BrokerError(INVALID) naming the text for a filter or action that does not parse."""
    try:
        validate_rule(label, rule)
    except EntityConfigError as err:
        raise BrokerError(Cond.INVALID, str(err)) from err
    action = None
    if rule.action is not None:
        try:
            action = sql.compile_action(rule.action["expression"], rule.action.get("parameters"))
        except sql.SqlError as err:
            raise _invalid_sql(label, rule, err) from err
    f = rule.filter
    kind = f["type"]
    if kind == "true":
        return _Rule(_always, action)
    if kind == "false":
        return _Rule(_never, action)
    if kind == "correlation":
        fields = [(k, v) for k, v in f.items() if k not in ("type", "properties") and v is not None]
        props = list((f.get("properties") or {}).items())

        def correlation(m: Incoming) -> bool:
            if any(_field(m, k) != v for k, v in fields):
                return False
            have = _properties(m)
            return all(k in have and have[k] == v for k, v in props)

        return _Rule(correlation, action)
    try:
        predicate = sql.compile_filter(f["expression"], f.get("parameters"))
    except sql.SqlError as err:
        raise _invalid_sql(label, rule, err) from err

    def sql_match(m: Incoming) -> bool:
        try:
            return predicate(_context(m))
        except sql.BudgetExceeded as err:  # this rule and every one after it on this message: said once
            budget = sql.current_budget()
            if budget is not None and not budget.reported:
                budget.reported = True
                _LOGGER.warning("%s rule %r: %s on message %s; this rule and the rules after it do not match it",
                                label, rule.name, err, m.message_id)
            return False
        except Exception as err:  # noqa: BLE001 - as on the service: a filter that fails does not match
            _LOGGER.warning("%s rule %r: the SQL filter failed on message %s (%s: %s); the rule does not "
                            "match it", label, rule.name, m.message_id, type(err).__name__, err)
            _LOGGER.debug("%s rule %r: the filter's failure", label, rule.name, exc_info=True)
            return False

    return _Rule(sql_match, action)


_TAKE_ALL: list[list[sql.Change]] = []


def _sql_filters(rules: Iterable[RuleSpec]) -> int:
    """The SQL filters among ``rules``, as the service counts them: true and false filters are SQL (1=1, 1=0)."""
    return sum(1 for rule in rules if rule.filter.get("type") != "correlation")


def _compile_rules(label: str, rules: list[RuleSpec]) -> Router:
    """A subscription takes a message when any of its rules matches (no rule: nothing matches); the actions
    of every matching rule apply, in rule order, to the subscription's one copy."""
    seen: set[str] = set()
    compiled = []
    for rule in rules:
        compiled.append(_compile_filter(label, rule))
        if rule.name.lower() in seen:
            raise BrokerError(Cond.INVALID, f"{label}: the rule name {rule.name!r} is used twice.")
        seen.add(rule.name.lower())
    live = [r for r in compiled if r.match is not _never]
    if not live:
        return lambda _m: None
    if not any(r.action for r in live):
        if any(r.match is _always for r in live):
            return lambda _m: _TAKE_ALL
        preds = [r.match for r in live]
        return lambda m: _TAKE_ALL if any(p(m) for p in preds) else None

    def route(m: Incoming) -> list[list[sql.Change]] | None:
        matched = [r for r in live if r.match(m)]
        if not matched:
            return None
        return [r.action for r in matched if r.action]

    return route


def _apply_actions(m: Incoming, actions: list[list[sql.Change]]) -> bytes:
    """The raw message a subscription keeps after its matching rules' actions."""
    ctx = _context(m)
    fields: dict[str, Any] = {}
    props = dict(ctx.properties)
    for changes in actions:
        try:
            props, changed = sql.apply_action(changes, sql.Context({**ctx.fields, **fields}, props, {}))
        except Exception as err:  # noqa: BLE001 - an action that fails leaves the message as it was
            _LOGGER.warning("a rule action failed on message %s (%s: %s); the subscription's copy keeps the "
                            "properties it had before that action", m.message_id, type(err).__name__, err)
            _LOGGER.debug("the action's failure", exc_info=True)
            continue
        fields.update(changed)
    return sections.rewrite(m.raw, props, fields)


# --------------------------------------------------------------------------- the broker


class Broker:
    """One namespace.

    Parameters
    ----------
    store: a ``store.Store`` (durable SQLite or in-memory).
    clock: returns epoch seconds; defaults to ``time.time``.
    max_message_size: bytes; the default is 256 KiB.
    max_entities, max_subscriptions, max_sql_filters: the service's quotas (:mod:`spark_sb.emulator.limits`):
        queues and topics in the namespace, subscriptions per topic, SQL filters per topic.
    evaluation_budget: the units one message sent to a topic may cost across the filters and actions of all its
        rules (:func:`spark_sb.emulator.sql.evaluation_budget`).
    name: the namespace's name, for the refusals' words.
    on_available: called with an entity path (queue path or subscription path) whenever messages may
        have become receivable there (send, abandon, lock expiry, scheduled activation, session unlock).
        The AMQP layer uses it to serve receivers that are waiting with credit.
    """

    def __init__(
        self,
        store: Any,
        *,
        clock: Callable[[], float] = time.time,
        max_message_size: int = 256 * 1024,
        on_available: Callable[[str], None] | None = None,
        max_entities: int = limits.DEFAULT_MAX_ENTITIES,
        max_subscriptions: int = limits.DEFAULT_MAX_SUBSCRIPTIONS,
        max_sql_filters: int = limits.DEFAULT_MAX_SQL_FILTERS,
        evaluation_budget: int = sql.DEFAULT_EVALUATION_BUDGET,
        name: str = "",
    ) -> None:
        self.max_entities = max_entities
        self.max_subscriptions = max_subscriptions
        self.max_sql_filters = max_sql_filters
        self.evaluation_budget = evaluation_budget
        self.name = name
        #: what a stored message costs in memory besides its encoded bytes, counted against max_size_in_megabytes
        #: (the store's :attr:`~spark_sb.emulator.store.Store.message_overhead`)
        self.message_overhead: int = getattr(store, "message_overhead", limits.STORED_MESSAGE_OVERHEAD)
        self._store = store
        self._clock = clock
        self._max_message_size = max_message_size
        self._on_available = on_available
        self._specs: dict[str, Any] = {}  # queue, topic and subscription descriptions by path
        self._created: dict[str, float] = {}
        self._lower: dict[str, str] = {}  # entity names are case-insensitive, as on the service
        self._subscriptions: dict[str, dict[str, str]] = {}  # topic -> {subscription name: path}
        self._filters: dict[str, Router] = {}  # subscription path -> its rules, compiled
        self._boxes: dict[str, _Box] = {}  # queue, subscription and dead-letter paths
        self._topic_refs: dict[str, dict[int, int]] = {}  # topic -> {seq: copies held by its subscriptions}
        self._topic_size: dict[str, int] = {}  # topic -> bytes of the distinct messages its subscriptions hold
        self._locks: dict[uuid.UUID, tuple[str, int]] = {}  # lock token -> (box path, seq)
        self._session_locks: dict[tuple[str, str], tuple[Any, float]] = {}  # (path, session) -> (owner, until)
        self._session_states: dict[tuple[str, str], tuple[bytes, float]] = {}  # -> (state, updated)
        self._history: dict[str, OrderedDict[str, tuple[int, float]]] = {}  # duplicate detection, oldest first
        self._deadlines: list[tuple[float, int, int, Any, Any]] = []  # (time, tiebreak, kind, a, b)
        self._tiebreak = itertools.count()
        self._notify: dict[str, None] = {}  # paths to pass to on_available, in order
        self._seqs: dict[str, int] = {}  # queue or topic path -> its last sequence number (per entity, from 1)
        self._load()

    def _load(self) -> None:
        loaded = self._store.load_all()
        order = {QUEUE: 0, TOPIC: 1, SUBSCRIPTION: 2}
        for spec, created in sorted(loaded.entities, key=lambda e: order[e[0].kind]):
            if spec.kind == SUBSCRIPTION and spec.topic not in self._subscriptions:
                _LOGGER.warning("store: subscription %s of a missing topic is ignored", spec.path)
                continue
            self._install(spec, created)
        # a store written before numbers were per entity has only the namespace's last one: entities without
        # their own continue from it, so numbers never go back
        legacy = loaded.last_sequence_number
        seqs = self._seqs
        for path in seqs:
            seqs[path] = max(loaded.sequences.get(path, legacy), 0)
        orphans = 0
        for msg in loaded.messages:
            box = self._boxes.get(msg.entity)
            if box is None:
                orphans += 1
                continue
            self._attach(box, msg)
            if box.topic is not None:
                self._ref(box.topic, msg.sequence_number, len(msg.raw))
            base = box.topic or box.owner
            if seqs.get(base, 0) < msg.sequence_number:
                seqs[base] = msg.sequence_number
        if orphans:
            _LOGGER.warning("store: %d messages of entities that no longer exist are ignored", orphans)
        for entity, message_id, seq, seen in sorted(loaded.duplicates, key=lambda d: d[3]):
            history = self._history.get(entity)
            if history is not None:
                history[message_id] = (seq, seen)
                if seqs.get(entity, 0) < seq:
                    seqs[entity] = seq
        for entity, session_id, state, updated in loaded.session_states:
            if entity in self._boxes:
                self._session_states[(entity, session_id)] = (state, updated)
        _LOGGER.debug(
            "broker loaded %d entities and %d messages", len(self._specs), len(loaded.messages) - orphans,
        )

    # ------------------------------------------------------------------ internal bookkeeping
    def _install(self, spec: Any, created: float) -> None:
        path = _path_of(spec)
        self._specs[path] = spec
        self._created[path] = created
        self._lower[path.lower()] = path
        if spec.kind == TOPIC:
            self._subscriptions[path] = {}
            self._topic_refs[path] = {}
            self._topic_size[path] = 0
        else:
            topic = spec.topic if spec.kind == SUBSCRIPTION else None
            self._boxes[path] = _Box(path, path, False, topic, spec.requires_session)
            dlq = path + DLQ_SUFFIX
            self._boxes[dlq] = _Box(dlq, path, True, topic, False)
            if topic is not None:
                self._subscriptions[topic][spec.name] = path
                try:
                    self._filters[path] = _compile_rules(path, spec.rules)
                except BrokerError as err:  # stored by an emulator before its filter limits: kept, not loaded
                    _LOGGER.error("%s: its rules do not load (%s); the subscription takes no message until the "
                                  "rule is deleted and created again within the limits", path, err.description)
                    self._filters[path] = lambda _m: None
        if spec.kind != SUBSCRIPTION:
            self._history[path] = OrderedDict()
            self._seqs[path] = 0

    def _uninstall(self, path: str) -> None:
        spec = self._specs.pop(path)
        del self._created[path]
        self._lower.pop(path.lower(), None)
        for box_path in (path, path + DLQ_SUFFIX):
            box = self._boxes.pop(box_path, None)
            if box is None:
                continue
            for msg in box.msgs.values():
                if msg.lock_token is not None:
                    self._locks.pop(msg.lock_token, None)
                if box.topic is not None:
                    self._unref(box.topic, msg.sequence_number, len(msg.raw))
            for key in [k for k in self._session_locks if k[0] == box_path]:
                del self._session_locks[key]
            for key in [k for k in self._session_states if k[0] == box_path]:
                del self._session_states[key]
        self._history.pop(path, None)
        self._seqs.pop(path, None)
        if spec.kind == SUBSCRIPTION:
            self._subscriptions[spec.topic].pop(spec.name, None)
            self._filters.pop(path, None)
        elif spec.kind == TOPIC:
            del self._subscriptions[path]
            del self._topic_refs[path]
            del self._topic_size[path]

    def _ref(self, topic: str, seq: int, size: int) -> None:
        refs = self._topic_refs[topic]
        count = refs.get(seq)
        if count is None:
            refs[seq] = 1
            self._topic_size[topic] += size
        else:
            refs[seq] = count + 1

    def _unref(self, topic: str, seq: int, size: int) -> None:
        refs = self._topic_refs.get(topic)
        if refs is None:
            return
        count = refs.get(seq, 0) - 1
        if count <= 0:
            if refs.pop(seq, None) is not None:
                self._topic_size[topic] -= size
        else:
            refs[seq] = count

    def _push_deadline(self, when: float, kind: int, a: Any, b: Any) -> None:
        heapq.heappush(self._deadlines, (when, next(self._tiebreak), kind, a, b))

    def _attach(self, box: _Box, msg: Stored) -> None:
        """Put a message into a box's indexes (the store is written by the caller)."""
        seq = msg.sequence_number
        box.msgs[seq] = msg
        box.size += len(msg.raw)
        if msg.state == STATE_ACTIVE:
            box.make_ready(msg)
        elif msg.state == STATE_SCHEDULED:
            self._push_deadline(msg.enqueued_time, _ACTIVATION, box.path, seq)
        if msg.expires_at is not None and not box.is_dlq:
            self._push_deadline(msg.expires_at, _TTL_EXPIRY, box.path, seq)

    def _detach(self, box: _Box, msg: Stored) -> None:
        del box.msgs[msg.sequence_number]
        box.size -= len(msg.raw)
        box.unready(msg)
        self._unlock(msg)

    def _remove(self, box: _Box, msg: Stored) -> None:
        """The message leaves the namespace (the caller deletes it from the store)."""
        self._detach(box, msg)
        if box.topic is not None:
            self._unref(box.topic, msg.sequence_number, len(msg.raw))

    def _modify(self, box: _Box, msg: Stored, properties_to_modify: dict[str, Any] | None) -> None:
        """A settlement's properties-to-modify, merged into the stored message's application properties."""
        if not properties_to_modify:
            return
        try:
            raw = sections.modify_properties(msg.raw, properties_to_modify)
        except sections.MalformedMessage as err:
            raise BrokerError(Cond.INVALID, f"cannot modify the message's properties: {err}") from err
        delta = len(raw) - len(msg.raw)
        msg.raw = raw
        box.size += delta
        if box.topic is not None:
            self._topic_size[box.topic] += delta  # the last copy's unref subtracts its own (new) length
        self._store.replace_raw([msg])

    def _unlock(self, msg: Stored) -> None:
        if msg.lock_token is not None:
            self._locks.pop(msg.lock_token, None)
            msg.lock_token = None
            msg.locked_until = None

    def _drop(self, box: _Box, msg: Stored) -> None:
        self._store.delete_messages([(box.path, msg.sequence_number)])
        self._remove(box, msg)

    def _dead_letter(self, box: _Box, msg: Stored, reason: str | None, description: str | None) -> None:
        dlq = self._boxes[box.owner + DLQ_SUFFIX]
        self._detach(box, msg)
        msg.entity = dlq.path
        msg.state = STATE_ACTIVE
        msg.dead_letter_reason = reason
        msg.dead_letter_description = description
        msg.dead_letter_source = box.path
        self._store.move_messages([(box.path, msg)])
        self._attach(dlq, msg)
        self._notify[dlq.path] = None

    def _expire(self, box: _Box, msg: Stored) -> None:
        if self._specs[box.owner].dead_lettering_on_message_expiration:
            self._dead_letter(box, msg, _TTL_EXPIRED, _TTL_EXPIRED_DESCRIPTION)
        else:
            self._drop(box, msg)

    def _max_delivery(self, box: _Box, msg: Stored) -> None:
        limit = self._specs[box.owner].max_delivery_count
        self._dead_letter(
            box, msg, _MAX_DELIVERY, f"Message could not be consumed after {limit} delivery attempts."
        )

    def _release(self, box: _Box, msg: Stored, now: float, *, abandoned: bool) -> None:
        """A lock ended without settlement (abandon or lock expiry): the message is receivable again,
        unless it is due for dead-lettering (abandon only; a lock expiry is caught at the next delivery)
        or expired."""
        if not box.is_dlq:
            if abandoned and msg.delivery_count >= self._specs[box.owner].max_delivery_count:
                self._max_delivery(box, msg)
                return
            if msg.expires_at is not None:
                if msg.expires_at <= now:
                    self._expire(box, msg)
                    return
                self._push_deadline(msg.expires_at, _TTL_EXPIRY, box.path, msg.sequence_number)
        if msg.state == STATE_ACTIVE:
            box.make_ready(msg)
            self._notify[box.path] = None

    def _flush(self) -> None:
        """Tell the AMQP layer where messages may have become receivable (after the state is consistent)."""
        if not self._notify:
            return
        paths = list(self._notify)
        self._notify.clear()
        if self._on_available is not None:
            for path in paths:
                self._on_available(path)

    # ------------------------------------------------------------------ lookups and errors
    def _canon(self, path: str) -> str | None:
        """The stored spelling of an entity or dead-letter path, or None."""
        if path in self._specs or path in self._boxes:
            return path
        low = path.strip("/").lower()
        if low.endswith(_DLQ_LOWER):
            base = self._lower.get(low[: -len(DLQ_SUFFIX)])
            if base is not None and base + DLQ_SUFFIX in self._boxes:
                return base + DLQ_SUFFIX
            return None
        return self._lower.get(low)

    @staticmethod
    def _not_found(path: str) -> BrokerError:
        return BrokerError(Cond.NOT_FOUND, f"The messaging entity '{path}' could not be found.")

    @staticmethod
    def _disabled(path: str, status: str) -> BrokerError:
        how = {"SendDisabled": " for sending", "ReceiveDisabled": " for receiving"}.get(status, "")
        return BrokerError(Cond.DISABLED, f"Messaging entity '{path}' is currently disabled{how}.")

    def _spec_of(self, kind: str, path: str) -> Any:
        canon = self._canon(path)
        spec = self._specs.get(canon) if canon is not None else None
        if spec is None or spec.kind != kind:
            raise self._not_found(path)
        return spec

    def _box(self, path: str) -> _Box:
        canon = self._canon(path)
        box = self._boxes.get(canon) if canon is not None else None
        if box is None:
            if canon is not None:
                raise BrokerError(
                    Cond.INVALID, f"'{canon}' is a topic: messages are received from its subscriptions."
                )
            raise self._not_found(path)
        return box

    def _check_receive(self, box: _Box) -> None:
        spec = self._specs[box.owner]
        if spec.status in _RECEIVE_BLOCKED:
            raise self._disabled(box.owner, spec.status)
        if box.topic is not None and self._specs[box.topic].status == DISABLED:
            raise self._disabled(box.topic, DISABLED)

    def _session_key(self, box: _Box, session_id: str | None, now: float) -> str | None:
        """The ready-list key for a receive; a session entity needs a live session lock."""
        if not box.sessionful:
            if session_id is not None:
                raise BrokerError(
                    Cond.INVALID, f"The messaging entity '{box.path}' does not require sessions; "
                    f"session '{session_id}' cannot be received from it."
                )
            return None
        if session_id is None:
            raise BrokerError(
                Cond.INVALID, f"The messaging entity '{box.path}' requires sessions: accept a session to receive."
            )
        lock = self._session_locks.get((box.path, session_id))
        if lock is None or lock[1] <= now:
            raise self._session_lock_lost(box.path, session_id)
        return session_id

    @staticmethod
    def _session_lock_lost(path: str, session_id: str) -> BrokerError:
        return BrokerError(
            Cond.SESSION_LOCK_LOST,
            f"The session lock has expired on the session '{session_id}' of entity '{path}'. Accept a new session.",
        )

    def _locked(self, box: _Box, lock_token: uuid.UUID, now: float) -> Stored:
        entry = self._locks.get(lock_token)
        msg = box.msgs.get(entry[1]) if entry is not None and entry[0] == box.path else None
        if msg is None or msg.lock_token != lock_token or msg.locked_until is None or msg.locked_until <= now:
            raise BrokerError(
                Cond.LOCK_LOST,
                f"The lock supplied is invalid. Either the lock expired, or the message has already been removed "
                f"from the queue. Lock token {lock_token}, entity '{box.path}'.",
            )
        return msg

    def _validate(self, spec: Any) -> None:
        try:
            validate(spec)
        except EntityConfigError as err:
            raise BrokerError(Cond.INVALID, str(err)) from err

    # ------------------------------------------------------------------ entities (admin + entities file)
    def create_entity(self, spec: QueueSpec | TopicSpec | SubscriptionSpec) -> None:
        """Raise BrokerError(ALREADY_EXISTS) if present; NOT_FOUND for a subscription of a missing topic."""
        self._validate(spec)
        spec = copy.deepcopy(spec)
        if isinstance(spec, SubscriptionSpec):
            spec.topic = _path_of(self._spec_of(TOPIC, spec.topic))
            _compile_rules(spec.path, spec.rules)
        path = _path_of(spec)
        if self._canon(path) is not None:
            raise BrokerError(Cond.ALREADY_EXISTS, f"The messaging entity '{path}' already exists.")
        if isinstance(spec, SubscriptionSpec):
            if len(self._subscriptions.get(spec.topic, {})) >= self.max_subscriptions:
                raise BrokerError(Cond.QUOTA, limits.subscriptions_text(path, spec.topic, self.max_subscriptions))
            self._check_sql_filters(spec.topic, _sql_filters(spec.rules), f"the subscription '{path}'")
        elif sum(1 for s in self._specs.values() if s.kind != SUBSCRIPTION) >= self.max_entities:
            raise BrokerError(Cond.QUOTA, limits.entities_text(path, self.name, self.max_entities))
        created = self._clock()
        self._store.put_entity(spec, created)
        self._install(spec, created)
        _LOGGER.debug("created %s %s", spec.kind, path)

    def update_entity(self, spec: QueueSpec | TopicSpec | SubscriptionSpec) -> None:
        """Replace the description (NOT_FOUND if missing). Messages are kept.

        A subscription keeps its rules: they are changed through the rule methods, as on the service.
        """
        self._validate(spec)
        old = self._spec_of(spec.kind, _path_of(spec))
        path = _path_of(old)
        spec = copy.deepcopy(spec)
        if isinstance(spec, SubscriptionSpec):
            spec.topic = old.topic
            spec.name = old.name
            spec.rules = copy.deepcopy(old.rules)
        else:
            spec.name = old.name
        self._store.put_entity(spec, self._created[path])
        self._specs[path] = spec
        if not isinstance(spec, TopicSpec):
            box = self._boxes[path]
            if box.sessionful != spec.requires_session:
                box.reindex(spec.requires_session)
            self._notify[path] = None  # e.g. re-enabled
            self._notify[path + DLQ_SUFFIX] = None
        self._flush()

    def delete_entity(self, kind: str, path: str) -> None:
        """Delete with all its messages (a topic: with its subscriptions). NOT_FOUND if missing."""
        spec = self._spec_of(kind, path)
        canon = _path_of(spec)
        paths = [canon]
        if spec.kind == TOPIC:
            paths = [*self._subscriptions[canon].values(), canon]
        with self._store.transaction():
            for p in paths:
                self._store.delete_entity(p)
        for p in paths:
            self._uninstall(p)
        _LOGGER.debug("deleted %s %s", kind, canon)

    def get_entity(self, kind: str, path: str) -> QueueSpec | TopicSpec | SubscriptionSpec:
        spec: QueueSpec | TopicSpec | SubscriptionSpec = copy.deepcopy(self._spec_of(kind, path))
        return spec

    def list_entities(self, kind: str, topic: str | None = None) -> list[Any]:
        """Queues or topics of the namespace, or the subscriptions of ``topic``, sorted by name."""
        if kind == SUBSCRIPTION:
            topic_spec = self._spec_of(TOPIC, topic or "")
            subs = self._subscriptions[topic_spec.name]
            return [copy.deepcopy(self._specs[subs[name]]) for name in sorted(subs)]
        if kind not in (QUEUE, TOPIC):
            raise BrokerError(Cond.INVALID, f"Unknown entity kind {kind!r}.")
        return [copy.deepcopy(s) for _p, s in sorted(self._specs.items()) if s.kind == kind]

    def _subscription(self, topic: str, subscription: str) -> SubscriptionSpec:
        spec: SubscriptionSpec = self._spec_of(SUBSCRIPTION, subscription_path(topic, subscription))
        return spec

    def _check_sql_filters(self, topic: str, adding: int, what: str) -> None:
        """Refuse (QUOTA) what would take the SQL filters of ``topic`` past ``max_sql_filters``."""
        if adding <= 0:
            return
        canon = self._canon(topic) or topic
        subs = self._subscriptions.get(canon, {}).values()
        held = sum(_sql_filters(self._specs[path].rules) for path in subs)
        if held + adding > self.max_sql_filters:
            raise BrokerError(Cond.QUOTA, limits.sql_filters_text(what, canon, self.max_sql_filters))

    def _save_rules(self, sub: SubscriptionSpec, rules: list[RuleSpec]) -> None:
        predicate = _compile_rules(sub.path, rules)
        new = dataclasses.replace(sub, rules=rules)
        self._store.put_entity(new, self._created[sub.path])
        self._specs[sub.path] = new
        self._filters[sub.path] = predicate

    @staticmethod
    def _rule_index(sub: SubscriptionSpec, name: str) -> int | None:
        for i, r in enumerate(sub.rules):
            if r.name.lower() == name.lower():
                return i
        return None

    def create_rule(self, topic: str, subscription: str, rule: RuleSpec) -> None:
        sub = self._subscription(topic, subscription)
        _compile_filter(sub.path, rule)
        if self._rule_index(sub, rule.name) is not None:
            raise BrokerError(Cond.ALREADY_EXISTS, f"The messaging entity '{sub.path}/rules/{rule.name}' already exists.")
        self._check_sql_filters(sub.topic, _sql_filters([rule]), f"the rule '{sub.path}/rules/{rule.name}'")
        self._save_rules(sub, [*sub.rules, copy.deepcopy(rule)])

    def update_rule(self, topic: str, subscription: str, rule: RuleSpec) -> None:
        sub = self._subscription(topic, subscription)
        _compile_filter(sub.path, rule)
        i = self._rule_index(sub, rule.name)
        if i is None:
            raise self._not_found(f"{sub.path}/rules/{rule.name}")
        rules = list(sub.rules)
        self._check_sql_filters(sub.topic, _sql_filters([rule]) - _sql_filters([rules[i]]),
                                f"the rule '{sub.path}/rules/{rule.name}'")
        rules[i] = copy.deepcopy(rule)
        self._save_rules(sub, rules)

    def delete_rule(self, topic: str, subscription: str, name: str) -> None:
        sub = self._subscription(topic, subscription)
        i = self._rule_index(sub, name)
        if i is None:
            raise self._not_found(f"{sub.path}/rules/{name}")
        self._save_rules(sub, [r for j, r in enumerate(sub.rules) if j != i])

    def list_rules(self, topic: str, subscription: str) -> list[RuleSpec]:
        return copy.deepcopy(self._subscription(topic, subscription).rules)

    def runtime_counts(self, path: str) -> RuntimeCounts:
        """Counts for a queue, a subscription, or a topic (the topic: scheduled + size; active=0).

        Active counts deferred and locked messages too (as the service's ActiveMessageCount does); a queue's
        size includes its dead-letter sub-queue. A dead-letter path reports its messages as dead_letter.
        """
        kind, canon = self.resolve(path)
        if kind == TOPIC:
            scheduled: set[int] = set()
            for sub_path in self._subscriptions[canon].values():
                msgs = self._boxes[sub_path].msgs
                scheduled.update(s for s, m in msgs.items() if m.state == STATE_SCHEDULED)
            return RuntimeCounts(scheduled=len(scheduled), size_in_bytes=self._topic_size[canon])
        box = self._boxes[canon]
        if box.is_dlq:
            return RuntimeCounts(dead_letter=len(box.msgs), size_in_bytes=box.size)
        dlq = self._boxes[canon + DLQ_SUFFIX]
        n_scheduled = sum(1 for m in box.msgs.values() if m.state == STATE_SCHEDULED)
        return RuntimeCounts(
            active=len(box.msgs) - n_scheduled,
            dead_letter=len(dlq.msgs),
            scheduled=n_scheduled,
            size_in_bytes=box.size + dlq.size,
        )

    def entity_created_at(self, path: str) -> float:
        """Creation time (epoch seconds) for the admin API's CreatedAt/UpdatedAt/AccessedAt."""
        _kind, canon = self.resolve(path)
        return self._created[canon.removesuffix(DLQ_SUFFIX)]

    def resolve(self, address: str) -> tuple[str, str]:
        """Classify a link address (already reduced to a path, e.g. ``orders``, ``orders/$DeadLetterQueue``,
        ``events/subscriptions/all``, ``events``) into (kind, path) where kind is "queue", "topic",
        "subscription", or the same + "-dlq". NOT_FOUND if the entity does not exist."""
        canon = self._canon(address)
        if canon is None:
            raise self._not_found(address)
        box = self._boxes.get(canon)
        if box is not None and box.is_dlq:
            return self._specs[box.owner].kind + "-dlq", canon
        return self._specs[canon].kind, canon

    # ------------------------------------------------------------------ send side
    def send(self, path: str, messages: list[Incoming]) -> list[int]:
        """Accept messages sent to a queue or topic, all or nothing, and commit them to the store.

        Returns the sequence numbers assigned (a topic: the sequence number of the topic's copy; each
        matching subscription gets its own stored copy). Applies: entity status (DISABLED -> DISABLED
        condition; SendDisabled likewise), max_message_size per message (SIZE, naming the message id
        and size), max_size_in_megabytes (QUOTA), requires_session (a message without session_id
        to a session entity -> INVALID), duplicate detection (a message_id seen within the window is
        accepted and silently dropped, returning its original sequence number), default and per-message
        TTL (expires_at = enqueued + min(ttl, entity default)), scheduled_enqueue_time in the future
        -> state SCHEDULED until then.

        The subscription copies of a topic message share the topic's sequence number. A scheduled
        message's enqueued_time is its scheduled time (its TTL runs from then).
        """
        return self._accept(path, messages, None)

    def schedule(self, path: str, messages: list[Incoming], scheduled_enqueue_time: float) -> list[int]:
        """$management schedule-message: like send, forced scheduled at the given time; returns seqs."""
        return self._accept(path, messages, scheduled_enqueue_time)

    def _accept(self, path: str, messages: list[Incoming], forced_time: float | None) -> list[int]:
        now = self._clock()
        canon = self._canon(path)
        if canon is None:
            raise self._not_found(path)
        spec = self._specs.get(canon)
        if spec is None or spec.kind == SUBSCRIPTION:
            raise BrokerError(Cond.INVALID, f"Cannot send to '{canon}': messages are sent to a queue or a topic.")
        if spec.status in _SEND_BLOCKED:
            raise self._disabled(canon, spec.status)
        limit = self._max_message_size
        for m in messages:
            if len(m.raw) > limit:
                raise BrokerError(
                    Cond.SIZE,
                    f"The message '{m.message_id}' of {len(m.raw)} bytes sent to '{canon}' exceeds the maximum "
                    f"message size of {limit} bytes.",
                )
        # (box, default TTL, filter or None, requires session) for each place a copy may go
        targets: list[tuple[_Box, float | None, Router | None, bool]]
        if spec.kind == QUEUE:
            targets = [(self._boxes[canon], spec.default_message_time_to_live, None, spec.requires_session)]
        else:
            targets = []
            for sub_path in self._subscriptions[canon].values():
                sub = self._specs[sub_path]
                if sub.status == DISABLED:
                    continue
                ttl = _min_ttl(spec.default_message_time_to_live, sub.default_message_time_to_live)
                targets.append((self._boxes[sub_path], ttl, self._filters[sub_path], sub.requires_session))
        history = self._history[canon] if spec.requires_duplicate_detection else None
        window = getattr(spec, "duplicate_detection_history_time_window", 0.0)
        seq = first = self._seqs[canon]
        results: list[int] = []
        accepted: list[tuple[_Box, Stored]] = []
        new_history: list[tuple[str, str, int, float]] = []
        batch_ids: dict[str, int] = {}
        new_bytes = 0
        for m in messages:
            mid = m.message_id
            if history is not None and mid is not None:
                original = batch_ids.get(mid)
                if original is None:
                    seen = history.get(mid)
                    if seen is not None and seen[1] + window > now:
                        original = seen[0]
                if original is not None:
                    results.append(original)
                    continue
            seq += 1
            results.append(seq)
            raw = m.raw if type(m.raw) is bytes else bytes(m.raw)
            new_bytes += len(raw)
            scheduled = forced_time if forced_time is not None else m.scheduled_enqueue_time
            if scheduled is not None and scheduled > now:
                state, enqueued = STATE_SCHEDULED, scheduled
            else:
                state, enqueued = STATE_ACTIVE, now
            ttl = m.ttl if m.ttl is not None and m.ttl > 0 else None
            budget: AbstractContextManager[Any] = (
                sql.evaluation_budget(self.evaluation_budget) if spec.kind == TOPIC else nullcontext())
            with budget:  # one budget for the message across every rule of the topic: a bounded time per message
                copies = []
                for box, entity_ttl, route, needs_session in targets:
                    copy_raw = raw
                    if route is not None:
                        actions = route(m)
                        if actions is None:
                            continue
                        if actions:
                            copy_raw = _apply_actions(m, actions)
                    copies.append((box, entity_ttl, needs_session, copy_raw))
            for box, entity_ttl, needs_session, copy_raw in copies:
                if needs_session and m.session_id is None:
                    raise BrokerError(
                        Cond.INVALID,
                        f"The SessionId was not set on message '{mid}', and it cannot be sent to '{box.path}': "
                        "entities that require sessions only accept messages with a session id.",
                    )
                effective = entity_ttl if ttl is None else (ttl if entity_ttl is None else min(ttl, entity_ttl))
                accepted.append((box, Stored(
                    box.path, seq, copy_raw, mid, m.session_id, enqueued,
                    None if effective is None else enqueued + effective, scheduled, m.partition_key, 0, state,
                )))
            if history is not None and mid is not None:
                batch_ids[mid] = seq
                new_history.append((canon, mid, seq, now))
        if new_bytes:
            # each message is counted at what it costs here: its encoded bytes (what the service counts) and the
            # memory of its copy in each queue or subscription, so a quota bounds the process's memory (one-byte
            # messages counted at their 62 encoded bytes cost ~13 times that)
            max_bytes = spec.max_size_in_megabytes * _MIB
            overhead = self.message_overhead
            if spec.kind == QUEUE:
                box, dlq = self._boxes[canon], self._boxes[canon + DLQ_SUFFIX]
                current = box.size + dlq.size + (len(box.msgs) + len(dlq.msgs)) * overhead
            else:
                held = sum(len(self._boxes[p].msgs) + len(self._boxes[p + DLQ_SUFFIX].msgs)
                           for p in self._subscriptions[canon].values())
                current = self._topic_size[canon] + held * overhead
            cost = new_bytes + len(accepted) * overhead
            if current + cost > max_bytes:
                raise BrokerError(
                    Cond.QUOTA,
                    f"The maximum entity size has been reached or exceeded for '{canon}'. Size of entity in bytes: "
                    f"{current}, max entity size in bytes: {max_bytes}, size of the messages sent: {cost} (the "
                    f"emulator counts each stored message at its encoded size plus the {overhead} bytes of memory "
                    f"its copy costs).",
                )
        if seq == first:
            return results  # only duplicates
        self._store.add_messages([s for _b, s in accepted], new_history, {canon: seq})
        # committed: now the indexes
        self._seqs[canon] = seq
        notify = self._notify
        attach = self._attach
        for box, stored in accepted:
            attach(box, stored)
            if box.topic is not None:
                self._ref(box.topic, stored.sequence_number, len(stored.raw))
            if stored.state == STATE_ACTIVE:
                notify[box.path] = None
        if history is not None:
            for _c, mid, s, t in new_history:
                history.pop(mid, None)  # re-sent after the window: moves to the end (newest)
                history[mid] = (s, t)
        self._flush()
        return results

    def cancel_scheduled(self, path: str, sequence_numbers: Iterable[int]) -> None:
        """Remove scheduled messages; unknown numbers are ignored (the service does the same)."""
        canon = self._canon(path)
        spec = self._specs.get(canon) if canon is not None else None
        if canon is None or spec is None:
            raise self._not_found(path)
        if spec.kind == TOPIC:
            boxes = [self._boxes[p] for p in self._subscriptions[canon].values()]
        elif spec.kind == QUEUE:
            boxes = [self._boxes[canon]]
        else:
            raise BrokerError(Cond.INVALID, f"Cannot cancel scheduled messages of '{canon}': use its topic.")
        wanted = set(sequence_numbers)
        with self._store.transaction():
            for box in boxes:
                for seq in wanted:
                    msg = box.msgs.get(seq)
                    if msg is not None and msg.state == STATE_SCHEDULED:
                        self._drop(box, msg)

    # ------------------------------------------------------------------ receive side
    def lock_session(self, path: str, session_id: str | None, owner: Any) -> tuple[str, float]:
        """Lock a session for ``owner`` (any hashable, e.g. the link). ``session_id`` None = next available
        session with active messages (BrokerError(TIMEOUT) when none; the AMQP layer waits and retries
        until the client's timeout). Returns (session_id, locked_until). SESSION_CANNOT_BE_LOCKED when
        held by another owner. INVALID when the entity does not require sessions.

        Locking a session the same owner already holds renews it. Next available picks the session whose
        oldest receivable message is oldest."""
        now = self._clock()
        box = self._box(path)
        self._check_receive(box)
        if not box.sessionful:
            raise BrokerError(
                Cond.INVALID, f"The messaging entity '{box.path}' does not require sessions: it has no session to lock."
            )
        if session_id is None:
            best: tuple[int, str] | None = None
            for sid, ready in list(box.ready.items()):
                if sid is None:
                    continue
                head = ready.head()
                if head is None:
                    del box.ready[sid]
                    continue
                lock = self._session_locks.get((box.path, sid))
                if lock is not None and lock[1] > now:
                    continue
                if best is None or head < best[0]:
                    best = (head, sid)
            if best is None:
                raise BrokerError(Cond.TIMEOUT, f"No session with available messages on '{box.path}' could be accepted.")
            session_id = best[1]
        else:
            lock = self._session_locks.get((box.path, session_id))
            if lock is not None and lock[1] > now and lock[0] != owner:
                raise BrokerError(
                    Cond.SESSION_CANNOT_BE_LOCKED,
                    f"The requested session '{session_id}' of entity '{box.path}' cannot be accepted. "
                    "It may be locked by another receiver.",
                )
        until = now + self._specs[box.owner].lock_duration
        self._session_locks[(box.path, session_id)] = (owner, until)
        self._push_deadline(until, _SESSION_LOCK_EXPIRY, box.path, session_id)
        self._extend_session_messages(box, session_id, until)
        return session_id, until

    def renew_session_lock(self, path: str, session_id: str, owner: Any) -> float:
        """SESSION_LOCK_LOST unless the session holds a live lock of ``owner``. ``owner`` None (a $management
        request, which arrives on its own link) renews whoever holds the live lock."""
        now = self._clock()
        box = self._box(path)
        lock = self._session_locks.get((box.path, session_id))
        if lock is None or lock[1] <= now or (owner is not None and lock[0] != owner):
            raise self._session_lock_lost(box.path, session_id)
        until: float = now + self._specs[box.owner].lock_duration
        self._session_locks[(box.path, session_id)] = (lock[0], until)
        self._push_deadline(until, _SESSION_LOCK_EXPIRY, box.path, session_id)
        self._extend_session_messages(box, session_id, until)
        return until

    def _extend_session_messages(self, box: _Box, session_id: str, until: float) -> None:
        """The session lock covers the messages received in the session: theirs move with it (the SDK
        refuses to renew a message lock on a session receiver: it renews the session)."""
        for path, seq in list(self._locks.values()):
            if path != box.path:
                continue
            msg = box.msgs.get(seq)
            if msg is not None and msg.session_id == session_id and msg.lock_token is not None:
                if msg.locked_until is None or msg.locked_until < until:
                    msg.locked_until = until
                    self._push_deadline(until, _LOCK_EXPIRY, msg.lock_token, None)

    def release_session(self, path: str, session_id: str, owner: Any) -> None:
        """The session link closed: unlock the session. The messages it held locked and did not settle can
        no longer be settled (settling needs the session lock), so they are receivable again at once, their
        delivery counted, as when a lock expires."""
        now = self._clock()
        box = self._box(path)
        key = (box.path, session_id)
        lock = self._session_locks.get(key)
        if lock is not None and lock[0] == owner:
            del self._session_locks[key]
            held = [m for p, seq in list(self._locks.values()) if p == box.path
                    and (m := box.msgs.get(seq)) is not None and m.session_id == session_id]
            if held:
                with self._store.transaction():
                    for msg in sorted(held, key=lambda m: m.sequence_number):
                        self._unlock(msg)
                        self._release(box, msg, now, abandoned=False)
            if box.ready.get(session_id):
                self._notify[box.path] = None
        self._flush()

    def get_session_state(self, path: str, session_id: str) -> bytes | None:
        box = self._box(path)
        entry = self._session_states.get((box.path, session_id))
        return entry[0] if entry is not None else None

    def set_session_state(self, path: str, session_id: str, state: bytes | None) -> None:
        """``None`` clears the state."""
        now = self._clock()
        box = self._box(path)
        self._store.put_session_state(box.path, session_id, None if state is None else bytes(state), now)
        if state is None:
            self._session_states.pop((box.path, session_id), None)
        else:
            self._session_states[(box.path, session_id)] = (bytes(state), now)

    def list_sessions(self, path: str, updated_since: float | None) -> list[str]:
        """Without ``updated_since``: the sessions that hold messages or state. With it: the sessions whose
        state was set at or after that time."""
        box = self._box(path)
        states = {sid: updated for (p, sid), (_s, updated) in self._session_states.items() if p == box.path}
        if updated_since is None:
            found = {m.session_id for m in box.msgs.values() if m.session_id is not None} | set(states)
        else:
            found = {sid for sid, updated in states.items() if updated >= updated_since}
        return sorted(found)

    def receive(
        self, path: str, count: int, *, peek_lock: bool, session_id: str | None = None
    ) -> list[Stored]:
        """Take up to ``count`` active, unlocked, unexpired messages in sequence order.

        ``path`` may be a dead-letter sub-queue. For a session entity only messages of ``session_id``
        (which the caller has locked) are returned; for a non-session entity ``session_id`` is None.
        peek_lock: each message gets a fresh lock_token (uuid4) and locked_until = now + lock_duration,
        and its delivery_count is incremented (stored). Receive-and-delete: the messages are deleted from
        the store before they are returned. Expired messages met on the way are dead-lettered (reason
        ``TTLExpiredException``) when the entity says so, else dropped. Deferred and scheduled messages
        are never returned here.

        A session entity raises SESSION_LOCK_LOST when ``session_id`` is not locked (or its lock expired),
        INVALID when it is None. A message whose delivery_count already reached max_delivery_count (its
        lock expired on its last delivery) is dead-lettered (``MaxDeliveryCountExceeded``) instead. The
        delivery_count of a returned message includes this delivery (1 on the first). Returned objects
        are copies.
        """
        now = self._clock()
        box = self._box(path)
        self._check_receive(box)
        key = self._session_key(box, session_id, now)
        ready = box.ready.get(key)
        out: list[Stored] = []
        if count <= 0 or not ready:
            return out
        spec = self._specs[box.owner]
        max_delivery = spec.max_delivery_count
        lock_duration = spec.lock_duration
        check = not box.is_dlq
        # in a session the session lock covers its messages: they are locked as long as it is
        session_until = self._session_locks[(box.path, key)][1] if key is not None else None
        taken: list[Stored] = []
        with self._store.transaction():
            while len(out) < count:
                seq = ready.pop()
                if seq is None:
                    break
                msg = box.msgs.get(seq)
                if msg is None or msg.state != STATE_ACTIVE or msg.lock_token is not None:
                    continue  # defensive: the ready list only holds active, unlocked messages
                if check:
                    if msg.expires_at is not None and msg.expires_at <= now:
                        self._expire(box, msg)
                        continue
                    if msg.delivery_count >= max_delivery:
                        self._max_delivery(box, msg)
                        continue
                msg.delivery_count += 1
                if peek_lock:
                    token = uuid.uuid4()
                    msg.lock_token = token
                    msg.locked_until = until = now + lock_duration if session_until is None else session_until
                    self._locks[token] = (box.path, seq)
                    self._push_deadline(until, _LOCK_EXPIRY, token, None)
                else:
                    self._remove(box, msg)
                taken.append(msg)
                out.append(_snapshot(msg))
            if taken:
                if peek_lock:
                    self._store.update_messages(taken)
                else:
                    self._store.delete_messages([(box.path, m.sequence_number) for m in taken])
        if not ready and key is not None:
            box.ready.pop(key, None)
        self._flush()
        return out

    def complete(self, path: str, lock_token: uuid.UUID) -> None:
        """LOCK_LOST if the token is unknown or its lock expired."""
        box = self._box(path)
        msg = self._locked(box, lock_token, self._clock())
        self._drop(box, msg)

    def abandon(self, path: str, lock_token: uuid.UUID, properties_to_modify: dict[str, Any] | None = None) -> None:
        """Unlock; when delivery_count >= max_delivery_count the message is dead-lettered with reason
        ``MaxDeliveryCountExceeded``. LOCK_LOST as for complete.

        ``properties_to_modify`` is merged into the message's application properties, as the service does."""
        now = self._clock()
        box = self._box(path)
        msg = self._locked(box, lock_token, now)
        with self._store.transaction():
            self._modify(box, msg, properties_to_modify)
            self._unlock(msg)
            self._release(box, msg, now, abandoned=True)
        self._flush()

    def release(self, path: str, lock_token: uuid.UUID) -> None:
        """The client gave back a message it never processed (AMQP ``released``: prefetched messages of a
        closing receiver). Unlike abandon this is not a delivery attempt: the count is taken back."""
        now = self._clock()
        box = self._box(path)
        msg = self._locked(box, lock_token, now)
        with self._store.transaction():
            msg.delivery_count = max(0, msg.delivery_count - 1)
            self._store.update_messages([msg])
            self._unlock(msg)
            self._release(box, msg, now, abandoned=False)
        self._flush()

    def defer(self, path: str, lock_token: uuid.UUID, properties_to_modify: dict[str, Any] | None = None) -> None:
        """The message becomes DEFERRED: never delivered by receive, only by receive_deferred.
        ``properties_to_modify`` as for abandon."""
        box = self._box(path)
        msg = self._locked(box, lock_token, self._clock())
        with self._store.transaction():
            self._modify(box, msg, properties_to_modify)
            msg.state = STATE_DEFERRED
            self._store.update_messages([msg])
        self._unlock(msg)

    def dead_letter(
        self, path: str, lock_token: uuid.UUID, reason: str | None, description: str | None,
        properties_to_modify: dict[str, Any] | None = None,
    ) -> None:
        """Move to ``path + '/$DeadLetterQueue'`` keeping message id, body and properties; the DLQ copy
        carries dead_letter_reason/description and dead_letter_source = path. ``properties_to_modify`` as
        for abandon.

        On a dead-letter sub-queue (no further dead-lettering) the message is unlocked and stays there."""
        now = self._clock()
        box = self._box(path)
        msg = self._locked(box, lock_token, now)
        with self._store.transaction():
            self._modify(box, msg, properties_to_modify)
            if box.is_dlq:
                self._unlock(msg)
                self._release(box, msg, now, abandoned=False)
            else:
                self._dead_letter(box, msg, reason, description)
        self._flush()

    def renew_lock(self, path: str, lock_tokens: list[uuid.UUID]) -> list[float]:
        """New locked_until for each token; LOCK_LOST if any is unknown/expired."""
        now = self._clock()
        box = self._box(path)
        msgs = [self._locked(box, t, now) for t in lock_tokens]
        until = now + self._specs[box.owner].lock_duration
        for msg in msgs:
            msg.locked_until = until
            self._push_deadline(until, _LOCK_EXPIRY, msg.lock_token, None)
        return [until] * len(msgs)

    def receive_deferred(
        self, path: str, sequence_numbers: list[int], *, peek_lock: bool, session_id: str | None = None
    ) -> list[Stored]:
        """Deferred messages by sequence number (locked as in receive, or deleted for receive-and-delete).
        MESSAGE_NOT_FOUND if any number is not a deferred message of this entity (and session).

        A deferred message stays deferred while locked: abandoning it (or its lock expiring) leaves it
        deferred. One that is locked already counts as not found."""
        now = self._clock()
        box = self._box(path)
        self._check_receive(box)
        session_until = None
        if box.sessionful:
            key = self._session_key(box, session_id, now)
            session_until = self._session_locks[(box.path, key)][1] if key is not None else None
        wanted = list(dict.fromkeys(sequence_numbers))
        msgs: list[Stored] = []
        for seq in wanted:
            msg = box.msgs.get(seq)
            if (
                msg is None
                or msg.state != STATE_DEFERRED
                or (box.sessionful and msg.session_id != session_id)
                or (msg.locked_until is not None and msg.locked_until > now)
            ):
                raise BrokerError(
                    Cond.MESSAGE_NOT_FOUND,
                    f"Failed to lock one or more specified messages: sequence number {seq} is not a deferred "
                    f"message of '{box.path}'" + (f" session '{session_id}'." if box.sessionful else "."),
                )
            msgs.append(msg)
        spec = self._specs[box.owner]
        out: list[Stored] = []
        with self._store.transaction():
            for msg in msgs:
                self._unlock(msg)  # a lock that expired but was not collected yet
                msg.delivery_count += 1
                if peek_lock:
                    token = uuid.uuid4()
                    msg.lock_token = token
                    msg.locked_until = until = now + spec.lock_duration if session_until is None else session_until
                    self._locks[token] = (box.path, msg.sequence_number)
                    self._push_deadline(until, _LOCK_EXPIRY, token, None)
                else:
                    self._remove(box, msg)
                out.append(_snapshot(msg))
            if peek_lock:
                self._store.update_messages(msgs)
            else:
                self._store.delete_messages([(box.path, m.sequence_number) for m in msgs])
        return out

    def peek(
        self, path: str, from_sequence_number: int, count: int, session_id: str | None = None
    ) -> list[Stored]:
        """Messages with sequence_number >= from, in order, any state (active, deferred, scheduled, locked),
        without locking or counting a delivery."""
        box = self._box(path)
        msgs = box.msgs
        if count <= 0:
            return []
        seqs = heapq.nsmallest(
            count,
            (s for s, m in msgs.items()
             if s >= from_sequence_number and (session_id is None or m.session_id == session_id)),
        )
        return [_snapshot(msgs[s]) for s in seqs]

    def peek_newest(self, path: str, count: int, before: int | None = None) -> list[Stored]:
        """The ``count`` messages with the highest sequence numbers (below ``before``, when given), newest first, any
        state, without locking or counting a delivery: the live page's first view of an entity."""
        msgs = self._box(path).msgs
        if count <= 0:
            return []
        seqs = heapq.nlargest(count, (s for s in msgs if before is None or s < before))
        return [_snapshot(msgs[s]) for s in seqs]

    def deferred_count(self, path: str) -> int:
        """How many of a queue's or a subscription's messages are deferred (the service reports none; the live page
        shows them beside its counts): one pass over them."""
        return sum(1 for m in self._box(path).msgs.values() if m.state == STATE_DEFERRED)

    # ------------------------------------------------------------------ time
    def tick(self) -> None:
        """Apply what the clock says is due: expired locks (message back to active, delivery count kept,
        on_available called), expired session locks, scheduled messages becoming active, TTL expiry
        (dead-letter or drop), and the duplicate detection window pruning."""
        now = self._clock()
        due = self.next_deadline()
        if due is None or due > now:
            return
        heap = self._deadlines
        with self._store.transaction():
            while heap and heap[0][0] <= now:
                _when, _n, kind, a, b = heapq.heappop(heap)
                if kind == _LOCK_EXPIRY:
                    self._expire_lock(a, now)
                elif kind == _SESSION_LOCK_EXPIRY:
                    lock = self._session_locks.get((a, b))
                    if lock is not None and lock[1] <= now:
                        del self._session_locks[(a, b)]
                        self._notify[a] = None
                elif kind == _ACTIVATION:
                    self._activate(a, b, now)
                else:
                    box = self._boxes.get(a)
                    msg = box.msgs.get(b) if box is not None else None
                    if (
                        box is not None and msg is not None and msg.lock_token is None
                        and msg.expires_at is not None and msg.expires_at <= now
                    ):
                        self._expire(box, msg)
            self._prune_history(now)
        self._flush()

    def _expire_lock(self, token: uuid.UUID, now: float) -> None:
        entry = self._locks.get(token)
        if entry is None:
            return
        box = self._boxes.get(entry[0])
        msg = box.msgs.get(entry[1]) if box is not None else None
        if box is None or msg is None or msg.lock_token != token:
            self._locks.pop(token, None)
            return
        if msg.locked_until is not None and msg.locked_until > now:
            return  # renewed; a later deadline exists
        self._unlock(msg)
        self._release(box, msg, now, abandoned=False)

    def _activate(self, path: str, seq: int, now: float) -> None:
        box = self._boxes.get(path)
        msg = box.msgs.get(seq) if box is not None else None
        if box is None or msg is None or msg.state != STATE_SCHEDULED or msg.enqueued_time > now:
            return
        msg.state = STATE_ACTIVE
        self._store.update_messages([msg])
        box.make_ready(msg)
        self._notify[path] = None

    def _prune_history(self, now: float) -> None:
        for path, history in self._history.items():
            if not history:
                continue
            window = self._specs[path].duplicate_detection_history_time_window
            gone = []
            while history:
                message_id, (_seq, seen) = next(iter(history.items()))
                if seen + window > now:
                    break
                history.popitem(last=False)
                gone.append(message_id)
            if gone:
                self._store.delete_duplicates(path, gone)

    def _deadline_live(self, entry: tuple[float, int, int, Any, Any]) -> bool:
        when, _n, kind, a, b = entry
        if kind == _LOCK_EXPIRY:
            lock = self._locks.get(a)
            box = self._boxes.get(lock[0]) if lock is not None else None
            msg = box.msgs.get(lock[1]) if box is not None and lock is not None else None
            return msg is not None and msg.lock_token == a and (msg.locked_until or 0.0) <= when
        if kind == _SESSION_LOCK_EXPIRY:
            slock = self._session_locks.get((a, b))
            return slock is not None and slock[1] <= when
        box = self._boxes.get(a)
        msg = box.msgs.get(b) if box is not None else None
        if msg is None:
            return False
        if kind == _ACTIVATION:
            return msg.state == STATE_SCHEDULED
        return msg.lock_token is None  # TTL: a locked message is checked again when its lock ends

    def next_deadline(self) -> float | None:
        """The earliest time at which ``tick`` has something to do, or None."""
        heap = self._deadlines
        while heap and not self._deadline_live(heap[0]):
            heapq.heappop(heap)
        best = heap[0][0] if heap else None
        for path, history in self._history.items():
            if history:
                _seq, seen = next(iter(history.values()))
                due = seen + self._specs[path].duplicate_detection_history_time_window
                if best is None or due < best:
                    best = due
        return best

    def close(self) -> None:
        """Close the store."""
        self._store.close()
