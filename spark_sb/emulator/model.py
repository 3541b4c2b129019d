"""Entity descriptions of the emulator: queues, topics, subscriptions and rules.

These are plain, validated dataclasses shared by the entities file loader, the broker, the durable
store and the administration REST API. Durations are held in seconds (floats); ``None`` for a TTL
or a window means "the maximum" (TimeSpan.MaxValue in the service's own terms).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ..durations import DurationError, parse_seconds
from . import sql

MAX_TTL_SECONDS = 10_675_199 * 86400.0  # TimeSpan.MaxValue in whole days, as the service reports it

QUEUE = "queue"
TOPIC = "topic"
SUBSCRIPTION = "subscription"
RULE = "rule"

ACTIVE = "Active"
DISABLED = "Disabled"
_STATUSES = (ACTIVE, DISABLED, "SendDisabled", "ReceiveDisabled")

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/]{0,259}$")


class EntityConfigError(ValueError):
    """An entity description is invalid. The message names the entity, the field and the value."""


@dataclass
class QueueSpec:
    name: str
    lock_duration: float = 60.0
    max_delivery_count: int = 10
    default_message_time_to_live: float | None = None
    dead_lettering_on_message_expiration: bool = False
    requires_session: bool = False
    requires_duplicate_detection: bool = False
    duplicate_detection_history_time_window: float = 600.0
    max_size_in_megabytes: int = 1024
    status: str = ACTIVE
    enable_batched_operations: bool = True
    auto_delete_on_idle: float | None = None
    forward_to: str | None = None
    forward_dead_lettered_messages_to: str | None = None

    kind = QUEUE


@dataclass
class TopicSpec:
    name: str
    default_message_time_to_live: float | None = None
    requires_duplicate_detection: bool = False
    duplicate_detection_history_time_window: float = 600.0
    max_size_in_megabytes: int = 1024
    status: str = ACTIVE
    enable_batched_operations: bool = True
    auto_delete_on_idle: float | None = None
    support_ordering: bool = True

    kind = TOPIC


@dataclass
class RuleSpec:
    """A subscription rule. ``filter`` is one of:

    - ``{"type": "true"}`` / ``{"type": "false"}``
    - ``{"type": "correlation", "correlation_id": ..., "message_id": ..., "to": ..., "reply_to": ...,
      "subject": ..., "session_id": ..., "reply_to_session_id": ..., "content_type": ...,
      "properties": {...}}`` (every given field must match exactly)
    - ``{"type": "sql", "expression": "...", "parameters": {"@name": value}}`` (the grammar of
      :mod:`spark_sb.emulator.sql`: comparisons, AND/OR/NOT, IN, LIKE, IS NULL, arithmetic, parameters)

    ``action`` is None or ``{"expression": "SET a = 'x'; REMOVE b", "parameters": {...}}``: applied to the
    subscription's copy of each message the rule's filter matches.
    """

    name: str = "$Default"
    filter: dict[str, Any] = field(default_factory=lambda: {"type": "true"})
    action: dict[str, Any] | None = None

    kind = RULE


@dataclass
class SubscriptionSpec:
    topic: str
    name: str
    lock_duration: float = 60.0
    max_delivery_count: int = 10
    default_message_time_to_live: float | None = None
    dead_lettering_on_message_expiration: bool = False
    requires_session: bool = False
    status: str = ACTIVE
    enable_batched_operations: bool = True
    auto_delete_on_idle: float | None = None
    forward_to: str | None = None
    forward_dead_lettered_messages_to: str | None = None
    rules: list[RuleSpec] = field(default_factory=lambda: [RuleSpec()])

    kind = SUBSCRIPTION

    @property
    def path(self) -> str:
        return subscription_path(self.topic, self.name)


def subscription_path(topic: str, name: str) -> str:
    return f"{topic}/subscriptions/{name}"


_CORRELATION_KEYS = (
    "correlation_id",
    "message_id",
    "to",
    "reply_to",
    "subject",
    "session_id",
    "reply_to_session_id",
    "content_type",
    "properties",
)


def _check(entity: str, name: str, value: Any, ok: bool, expected: str) -> None:
    if not ok:
        raise EntityConfigError(f"{entity}: {name} must be {expected}, got {value!r}")


def validate(spec: QueueSpec | TopicSpec | SubscriptionSpec) -> None:
    """Raise EntityConfigError naming the entity, the field and the bad value."""
    label = f"{spec.kind} {getattr(spec, 'path', spec.name)!r}"
    name = spec.name
    _check(label, "name", name, isinstance(name, str) and bool(_NAME_RE.match(name)),
           "1-260 characters of letters, digits, '.', '-', '_' or '/', starting with a letter or digit")
    if isinstance(spec, QueueSpec | TopicSpec):
        _check(label, "name", name, "/subscriptions/" not in name and not name.endswith("/"),
               "a path without '/subscriptions/'")
    if isinstance(spec, SubscriptionSpec):
        _check(label, "name", name, "/" not in name, "a name without '/'")
    for fname in ("lock_duration",):
        if hasattr(spec, fname):
            v = getattr(spec, fname)
            _check(label, fname, v, isinstance(v, int | float) and 5 <= v <= 300, "between 5 s and 5 min")
    if hasattr(spec, "max_delivery_count"):
        v = spec.max_delivery_count
        _check(label, "max_delivery_count", v, isinstance(v, int) and not isinstance(v, bool) and v >= 1,
               "an integer >= 1")
    v = spec.default_message_time_to_live
    _check(label, "default_message_time_to_live", v, v is None or (isinstance(v, int | float) and v > 0),
           "a positive duration")
    if hasattr(spec, "duplicate_detection_history_time_window"):
        v = spec.duplicate_detection_history_time_window
        _check(label, "duplicate_detection_history_time_window", v,
               isinstance(v, int | float) and 20 <= v <= 7 * 86400, "between 20 s and 7 days")
    if hasattr(spec, "max_size_in_megabytes"):
        v = spec.max_size_in_megabytes
        _check(label, "max_size_in_megabytes", v, isinstance(v, int) and not isinstance(v, bool) and v >= 1,
               "an integer >= 1")
    _check(label, "status", spec.status, spec.status in _STATUSES, f"one of {', '.join(_STATUSES)}")
    for fname in ("dead_lettering_on_message_expiration", "requires_session",
                  "requires_duplicate_detection", "enable_batched_operations"):
        if hasattr(spec, fname):
            v = getattr(spec, fname)
            _check(label, fname, v, isinstance(v, bool), "true or false")
    if isinstance(spec, SubscriptionSpec):
        for rule in spec.rules:
            validate_rule(label, rule)


def validate_rule(label: str, rule: RuleSpec) -> None:
    rlabel = f"{label} rule {rule.name!r}"
    _check(rlabel, "name", rule.name, isinstance(rule.name, str) and 0 < len(rule.name) <= 50,
           "a name of 1-50 characters")
    f = rule.filter
    _check(rlabel, "filter", f, isinstance(f, dict) and f.get("type") in ("true", "false", "correlation", "sql"),
           "a mapping with type true, false, correlation or sql")
    if f["type"] == "correlation":
        unknown = sorted(set(f) - {"type", *_CORRELATION_KEYS})
        _check(rlabel, "filter", unknown, not unknown, f"correlation fields among {', '.join(_CORRELATION_KEYS)}")
    if f["type"] == "sql":
        _check(rlabel, "filter.expression", f.get("expression"), isinstance(f.get("expression"), str),
               "a SQL filter expression string")
        _check(rlabel, "filter.parameters", f.get("parameters"),
               f.get("parameters") is None or isinstance(f.get("parameters"), dict), "a mapping of @name: value")
    a = rule.action
    _check(rlabel, "action", a, a is None or (isinstance(a, dict) and isinstance(a.get("expression"), str)
                                             and (a.get("parameters") is None or isinstance(a.get("parameters"), dict))),
           "a mapping with an expression (SET/REMOVE statements) and optional parameters")


# --------------------------------------------------------------------------- serialisation

def parse_duration(value: Any, label: str) -> float | None:
    """Seconds from a number (seconds), '500ms'/'60s'/'5m'/'1h'/'2d', ISO 8601 'PT1M' (the spellings of
    :mod:`spark_sb.durations`), or None/'max'."""
    if value is None or (isinstance(value, str) and value.lower() in ("max", "none", "")):
        return None
    if isinstance(value, bool):
        raise EntityConfigError(f"{label}: expected a duration, got {value!r}")
    try:
        return parse_seconds(value)
    except DurationError:
        raise EntityConfigError(f"{label}: expected a duration such as 30s, 5m or PT1M, got {value!r}") from None


_DURATION_FIELDS = {
    "lock_duration",
    "default_message_time_to_live",
    "duplicate_detection_history_time_window",
    "auto_delete_on_idle",
}


_Spec = TypeVar("_Spec", QueueSpec, TopicSpec, SubscriptionSpec, RuleSpec)


def _build(cls: type[_Spec], data: dict[str, Any], label: str, **fixed: Any) -> _Spec:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known - set(fixed))
    if unknown:
        raise EntityConfigError(f"{label}: unknown field {unknown[0]!r} (known: {', '.join(sorted(known))})")
    kwargs = dict(fixed)
    for key, value in data.items():
        if key in fixed:
            continue
        if key in _DURATION_FIELDS:
            value = parse_duration(value, f"{label}: {key}")
            if key == "lock_duration" and value is None:
                raise EntityConfigError(f"{label}: lock_duration must be a duration, got {data[key]!r}")
        kwargs[key] = value
    return cls(**kwargs)


def queue_from_dict(data: dict[str, Any]) -> QueueSpec:
    label = f"queue {data.get('name')!r}"
    spec = _build(QueueSpec, data, label)
    validate(spec)
    return spec


def topic_from_dict(data: dict[str, Any]) -> tuple[TopicSpec, list[SubscriptionSpec]]:
    label = f"topic {data.get('name')!r}"
    subs_data = data.get("subscriptions", []) or []
    topic = _build(TopicSpec, {k: v for k, v in data.items() if k != "subscriptions"}, label)
    validate(topic)
    subs = []
    for sd in subs_data:
        if not isinstance(sd, dict):
            raise EntityConfigError(f"{label}: each subscription must be a mapping, got {sd!r}")
        subs.append(subscription_from_dict(topic.name, sd))
    return topic, subs


def subscription_from_dict(topic: str, data: dict[str, Any]) -> SubscriptionSpec:
    label = f"subscription {topic}/subscriptions/{data.get('name')}"
    rules_data = data.get("rules")
    sub = _build(SubscriptionSpec, {k: v for k, v in data.items() if k != "rules"}, label, topic=topic)
    if rules_data is not None:
        if not isinstance(rules_data, list):
            raise EntityConfigError(f"{label}: rules must be a list, got {rules_data!r}")
        sub.rules = [rule_from_dict(label, r) for r in rules_data]
    validate(sub)
    return sub


def rule_from_dict(label: str, data: Any) -> RuleSpec:
    if not isinstance(data, dict):
        raise EntityConfigError(f"{label}: each rule must be a mapping, got {data!r}")
    rule = _build(RuleSpec, data, f"{label} rule {data.get('name')!r}")
    # a SQL filter or action the broker would refuse is refused here, where the file is read
    for part, compile_sql in (("filter", sql.compile_filter), ("action", sql.compile_action)):
        given = getattr(rule, part)
        if isinstance(given, dict) and (part == "action" or given.get("type") == "sql"):
            try:
                compile_sql(given["expression"], given.get("parameters"))
            except (sql.SqlError, KeyError, TypeError) as err:
                raise EntityConfigError(f"{label} rule {rule.name!r}: SQL {part} {given.get('expression')!r}: "
                                        f"{err}") from err
    return rule


def spec_to_dict(spec: Any) -> dict[str, Any]:
    out = dataclasses.asdict(spec)
    return out


def spec_from_stored(kind: str, data: dict[str, Any]) -> Any:
    """Inverse of spec_to_dict, used by the durable store (no re-validation of stored entities)."""
    if kind == QUEUE:
        return QueueSpec(**data)
    if kind == TOPIC:
        return TopicSpec(**data)
    if kind == SUBSCRIPTION:
        d = dict(data)
        d["rules"] = [RuleSpec(**r) for r in d.get("rules", [])]
        return SubscriptionSpec(**d)
    raise ValueError(f"unknown entity kind {kind!r}")


@dataclass
class EntitiesFile:
    queues: list[QueueSpec] = field(default_factory=list)
    topics: list[TopicSpec] = field(default_factory=list)
    subscriptions: list[SubscriptionSpec] = field(default_factory=list)


def load_entities(source: str | Path | dict[str, Any]) -> EntitiesFile:
    """Load an entities file (YAML or JSON)::

        queues:
          - name: orders
            requires_duplicate_detection: true
        topics:
          - name: events
            subscriptions:
              - name: all
              - name: eu
                rules: [{name: eu, filter: {type: correlation, properties: {region: eu}}}]

    Errors name the file, the entity, the field and the value.
    """
    if isinstance(source, dict):
        data: Any = source
        where = "entities"
    else:
        where = str(source)
        try:
            text = Path(source).read_text(encoding="utf-8")
        except OSError as err:
            raise EntityConfigError(f"entities file {where}: cannot be read ({err.strerror})") from err
        try:
            if where.endswith(".json"):
                data = json.loads(text)
            else:
                import yaml

                data = yaml.safe_load(text)
        except Exception as err:  # noqa: BLE001 - any parser error becomes a clear message
            raise EntityConfigError(f"entities file {where}: not valid YAML/JSON ({err})") from err
    if data is None:
        return EntitiesFile()
    if not isinstance(data, dict):
        raise EntityConfigError(f"{where}: the top level must be a mapping with queues/topics, got {type(data).__name__}")
    unknown = sorted(set(data) - {"queues", "topics"})
    if unknown:
        raise EntityConfigError(f"{where}: unknown section {unknown[0]!r} (known: queues, topics)")
    out = EntitiesFile()
    try:
        for q in data.get("queues") or []:
            if not isinstance(q, dict):
                raise EntityConfigError(f"queues: each queue must be a mapping, got {q!r}")
            out.queues.append(queue_from_dict(q))
        for t in data.get("topics") or []:
            if not isinstance(t, dict):
                raise EntityConfigError(f"topics: each topic must be a mapping, got {t!r}")
            topic, subs = topic_from_dict(t)
            out.topics.append(topic)
            out.subscriptions.extend(subs)
    except EntityConfigError as err:
        raise EntityConfigError(f"{where}: {err}") from None
    except TypeError as err:
        raise EntityConfigError(f"{where}: {err}") from None
    return out
