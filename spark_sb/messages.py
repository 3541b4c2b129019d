"""Messages: the backlog rewrite and its inverse, pings, and the encoded size. Pure functions, no I/O.

:func:`to_backlog` rewrites a message bound for an entity on the primary into a copy for a backlog queue on
the secondary; :func:`from_backlog` restores it for its destination (behaviour.md, "Rewriting a message for
the backlog" and "The syphon"):

=========================== ==============================================================================
original field              in the backlog message
=========================== ==============================================================================
(destination path)          application property ``x-ms-path`` (string), always set
session_id                  ``x-ms-sessionid`` (string); session id cleared
time_to_live                ``x-ms-timetolive`` (AMQP long, milliseconds); TTL cleared
scheduled_enqueue_time_utc  ``x-ms-scheduledenqueuetimeutc`` (AMQP timestamp); cleared
partition_key               ``x-ms-partitionkey`` (string); cleared
everything else             unchanged: body (data, value or sequence), message_id, correlation_id, subject,
                            content_type, to, reply_to, reply_to_session_id, other application properties
=========================== ==============================================================================

What the SDK does to a message on the wire, and so what :func:`from_backlog` accepts: a received message
has ``bytes`` application property keys and string values, a timestamp arrives as an ``int`` of
milliseconds since the epoch, and an AMQP string inside a value or sequence body arrives as ``bytes`` (the
SDK's decoder does not keep the string/binary distinction there, so such a body is restored as received).
Restored application property keys and string values are ``str`` again (the SDK sends ``bytes`` values as
strings anyway); the restored properties (message_id, subject, ...) are ``str``. Times have millisecond
precision, as on the wire.
"""

from __future__ import annotations

import copy
import datetime
import enum
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from azure.servicebus import ServiceBusMessage
from azure.servicebus._pyamqp.types import TYPE, VALUE
from azure.servicebus._pyamqp.utils import amqp_long_value, get_message_encoded_size
from azure.servicebus._transport._pyamqp_transport import PyamqpTransport
from azure.servicebus.amqp import AmqpAnnotatedMessage, AmqpMessageBodyType

_LOGGER = logging.getLogger(__name__)

__all__ = [
    "BACKLOG_PROPERTIES",
    "DESTINATION_NOT_FOUND",
    "PING_CONTENT_TYPE",
    "TTL_EXPIRED_IN_BACKLOG",
    "X_MS_PARTITION_KEY",
    "X_MS_PATH",
    "X_MS_SCHEDULED_ENQUEUE_TIME",
    "X_MS_SESSION_ID",
    "X_MS_TIME_TO_LIVE",
    "RestoreStatus",
    "Restored",
    "from_backlog",
    "is_ping",
    "message_size",
    "ping_message",
    "to_backlog",
]

X_MS_PATH = "x-ms-path"
X_MS_SESSION_ID = "x-ms-sessionid"
X_MS_TIME_TO_LIVE = "x-ms-timetolive"
X_MS_SCHEDULED_ENQUEUE_TIME = "x-ms-scheduledenqueuetimeutc"
X_MS_PARTITION_KEY = "x-ms-partitionkey"
BACKLOG_PROPERTIES = (X_MS_PATH, X_MS_SESSION_ID, X_MS_TIME_TO_LIVE, X_MS_SCHEDULED_ENQUEUE_TIME, X_MS_PARTITION_KEY)

PING_CONTENT_TYPE = "application/vnd.ms-servicebus-ping"
#: dead-letter reason for a backlog message whose TTL ran out while it waited in the backlog
TTL_EXPIRED_IN_BACKLOG = "TTLExpiredInBacklog"
#: dead-letter reason for a backlog message whose destination entity does not exist (used by the syphon)
DESTINATION_NOT_FOUND = "DestinationNotFound"

_X_OPT_PARTITION_KEY = "x-opt-partition-key"
_X_OPT_SCHEDULED_ENQUEUE_TIME = "x-opt-scheduled-enqueue-time"
_X_OPT_ENQUEUED_TIME = "x-opt-enqueued-time"
_BROKER_ANNOTATION_PREFIX = "x-opt-"  # reserved for the broker (sequence number, lock, enqueued time, ...)
_MAX_PROPERTY_LENGTH = 128  # the SDK's limit for session id and partition key
_MAX_AMQP_TTL_MS = 0xFFFFFFFF  # the AMQP header ttl is a uint
_MAX_INT64 = 2**63 - 1
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


# --- small helpers over the SDK's representations --------------------------------------------------------


def _key(key: object) -> str:
    if isinstance(key, bytes | bytearray):
        return bytes(key).decode("utf-8", "replace")
    return str(key)


def _plain(value: Any) -> Any:
    """Unwrap a pyamqp typed value (``{TYPE: ..., VALUE: ...}``) built in this process."""
    if isinstance(value, Mapping) and set(value) == {TYPE, VALUE}:
        return value[VALUE]
    return value


def _as_str(value: Any) -> str | None:
    """A string property as ``str``: the SDK hands received strings over as UTF-8 ``bytes``."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return None
    return None


def _str_or_raw(value: Any) -> Any:
    """``str`` for UTF-8 text (``bytes`` as received), anything else unchanged."""
    text = _as_str(value)
    return value if text is None else text


def _utc(value: Any) -> datetime.datetime | None:
    """A timestamp (aware or naive-as-UTC datetime, or int milliseconds since the epoch) as an aware UTC
    datetime with millisecond precision; ``None`` when it is not a timestamp."""
    value = _plain(value)
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:  # the SDK's encoder reads a naive datetime as UTC
            value = value.replace(tzinfo=datetime.UTC)
        value = value.astimezone(datetime.UTC)
        return value.replace(microsecond=(value.microsecond // 1000) * 1000)
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return _EPOCH + datetime.timedelta(milliseconds=value)
        except OverflowError:
            return None
    return None


def _raw(message: ServiceBusMessage | AmqpAnnotatedMessage) -> AmqpAnnotatedMessage:
    if isinstance(message, AmqpAnnotatedMessage):
        return message
    raw = getattr(message, "raw_amqp_message", None)
    if not isinstance(raw, AmqpAnnotatedMessage):
        raise TypeError(f"expected a ServiceBusMessage or AmqpAnnotatedMessage, got {type(message).__name__}")
    return raw


def _body_kwargs(raw: AmqpAnnotatedMessage) -> dict[str, Any]:
    """A copy of the body, of the same body type."""
    if raw.body_type == AmqpMessageBodyType.DATA:
        return {"data_body": [bytes(section) for section in raw.body]}
    if raw.body_type == AmqpMessageBodyType.SEQUENCE:
        return {"sequence_body": copy.deepcopy(list(raw.body))}
    return {"value_body": copy.deepcopy(raw.body)}


def _annotation(raw: AmqpAnnotatedMessage, name: str) -> Any:
    for key, value in (raw.annotations or {}).items():
        if _key(key) == name:
            return value
    return None


def _wrap(annotated: AmqpAnnotatedMessage) -> ServiceBusMessage:
    """A ``ServiceBusMessage`` over ``annotated``, the way the SDK wraps an AmqpAnnotatedMessage it sends
    (``_common/utils.py`` ``_convert_to_single_service_bus_message``); the sender encodes it when sending."""
    return ServiceBusMessage(None, message=None, raw_amqp_message=annotated)


# --- to the backlog --------------------------------------------------------------------------------------


def to_backlog(message: ServiceBusMessage, entity: str) -> ServiceBusMessage:
    """A copy of ``message`` for a backlog queue, carrying its destination ``entity`` and the fields a
    backlog queue cannot hold (session, TTL, schedule, partition key) as ``x-ms-*`` application properties.
    ``message`` is not modified. Stale ``x-ms-*`` backlog properties on the input are replaced."""
    if not isinstance(entity, str) or not entity:
        raise ValueError(f"entity must be a non-empty string, got {entity!r}")
    raw = _raw(message)

    properties: dict[Any, Any] = {
        key: value
        for key, value in (raw.application_properties or {}).items()
        if _key(key) not in BACKLOG_PROPERTIES
    }
    properties[X_MS_PATH] = entity
    source = raw.properties
    session_id = source.group_id if source is not None else None
    if session_id is not None:
        properties[X_MS_SESSION_ID] = _str_or_raw(session_id)
    header = raw.header
    ttl_ms = header.time_to_live if header is not None else None
    if ttl_ms:
        properties[X_MS_TIME_TO_LIVE] = amqp_long_value(int(ttl_ms))
    scheduled = _utc(_annotation(raw, _X_OPT_SCHEDULED_ENQUEUE_TIME))
    if scheduled is not None:
        properties[X_MS_SCHEDULED_ENQUEUE_TIME] = scheduled
    partition_key = _annotation(raw, _X_OPT_PARTITION_KEY)
    if partition_key is not None:
        properties[X_MS_PARTITION_KEY] = _str_or_raw(partition_key)

    annotations: dict[Any, Any] = {
        key: copy.deepcopy(value)
        for key, value in (raw.annotations or {}).items()
        if _key(key) not in (_X_OPT_PARTITION_KEY, _X_OPT_SCHEDULED_ENQUEUE_TIME)
    }
    new_header = None
    if header is not None and (header.durable is not None or header.priority is not None):
        new_header = {"durable": header.durable, "priority": header.priority}
    new_properties = None
    if source is not None:
        new_properties = {
            "message_id": source.message_id,
            "user_id": source.user_id,
            "to": source.to,
            "subject": source.subject,
            "reply_to": source.reply_to,
            "correlation_id": source.correlation_id,
            "content_type": source.content_type,
            "content_encoding": source.content_encoding,
            "creation_time": source.creation_time,
            "group_sequence": source.group_sequence,
            "reply_to_group_id": source.reply_to_group_id,
        }
    annotated = AmqpAnnotatedMessage(
        header=new_header,
        properties=new_properties,
        application_properties=properties,
        annotations=annotations or None,
        footer=copy.deepcopy(raw.footer),
        **_body_kwargs(raw),
    )
    return _wrap(annotated)


# --- from the backlog ------------------------------------------------------------------------------------


class RestoreStatus(enum.Enum):
    RESTORED = "restored"  #: send ``message`` to ``entity`` on the primary
    INVALID = "invalid"  #: dead-letter in the backlog queue with ``reason`` (names the bad property)
    EXPIRED = "expired"  #: dead-letter in the backlog queue with reason ``TTLExpiredInBacklog``


@dataclass(frozen=True)
class Restored:
    """The verdict on one backlog message.

    :ivar status: what the syphon does with it.
    :ivar entity: the destination (``x-ms-path``); ``None`` when it is missing or not a string.
    :ivar message: the restored copy (only when ``status`` is RESTORED).
    :ivar reason: the dead-letter reason: names the bad property, or ``TTLExpiredInBacklog``.
    :ivar description: the dead-letter error description: what was wrong, with the value found.
    """

    status: RestoreStatus
    entity: str | None = None
    message: ServiceBusMessage | None = None
    reason: str | None = None
    description: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is RestoreStatus.RESTORED


class _Invalid(Exception):
    def __init__(self, reason: str, description: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.description = description


def _type_name(value: Any) -> str:
    return type(value).__name__


def _string_property(properties: Mapping[str, Any], name: str) -> str | None:
    if name not in properties:
        return None
    value = properties[name]
    text = _as_str(_plain(value))
    if text is None:
        raise _Invalid(f"{name} is not a string", f"{name} must be a string, got {_type_name(value)} {value!r:.80}")
    if len(text) > _MAX_PROPERTY_LENGTH:
        raise _Invalid(f"{name} is longer than {_MAX_PROPERTY_LENGTH} characters", f"{name} has {len(text)} characters")
    return text


def _ttl_property(properties: Mapping[str, Any]) -> int | None:
    if X_MS_TIME_TO_LIVE not in properties:
        return None
    value = _plain(properties[X_MS_TIME_TO_LIVE])
    if isinstance(value, datetime.timedelta):
        value = round(value / datetime.timedelta(milliseconds=1))
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Invalid(
            f"{X_MS_TIME_TO_LIVE} is not an int64 number of milliseconds",
            f"{X_MS_TIME_TO_LIVE} must be an int64 number of milliseconds, got {_type_name(value)} {value!r:.80}",
        )
    if not 0 < value <= _MAX_INT64:
        raise _Invalid(
            f"{X_MS_TIME_TO_LIVE} is not a positive int64 number of milliseconds",
            f"{X_MS_TIME_TO_LIVE} must be between 1 and {_MAX_INT64} milliseconds, got {value}",
        )
    return value


def _scheduled_property(properties: Mapping[str, Any]) -> datetime.datetime | None:
    if X_MS_SCHEDULED_ENQUEUE_TIME not in properties:
        return None
    value = properties[X_MS_SCHEDULED_ENQUEUE_TIME]
    when = _utc(value)
    if when is None:
        raise _Invalid(
            f"{X_MS_SCHEDULED_ENQUEUE_TIME} is not a UTC timestamp",
            f"{X_MS_SCHEDULED_ENQUEUE_TIME} must be an AMQP timestamp, got {_type_name(value)} {value!r:.80}",
        )
    return when


def _user_properties(entries: Mapping[str, Any]) -> dict[str, Any]:
    """The application properties other than ``x-ms-*``, with ``str`` keys and ``str`` string values."""
    user: dict[str, Any] = {}
    for name, value in entries.items():
        if name.lower().startswith("x-ms-"):
            continue
        if isinstance(value, bytes | bytearray):
            text = _as_str(value)
            if text is None:  # the SDK's sender would fail on it (it decodes bytes values as UTF-8)
                raise _Invalid(
                    f"application property {name} is binary, not UTF-8 text",
                    f"application property {name!r} holds {len(value)} bytes that are not UTF-8; the SDK cannot "
                    "send them",
                )
            value = text
        user[name] = value
    return user


def from_backlog(
    received: ServiceBusMessage | AmqpAnnotatedMessage,
    now: datetime.datetime,
    backlog_enqueued_time: datetime.datetime | None = None,
) -> Restored:
    """Restore a backlog message for its destination, or say why it must be dead-lettered.

    ``received`` is a ``ServiceBusReceivedMessage`` (or any ``ServiceBusMessage``/``AmqpAnnotatedMessage``;
    only its AMQP sections are read). ``backlog_enqueued_time`` is when the backlog queue accepted it,
    by default the received message's ``x-opt-enqueued-time``; the restored TTL is ``x-ms-timetolive`` minus
    the time since then (``now - backlog_enqueued_time``, at least 0). A TTL larger than the AMQP header can
    carry (about 49.7 days, e.g. .NET's TimeSpan.MaxValue) is restored as no TTL: the entity's default applies.
    Every ``x-ms-*`` application property and every broker annotation (``x-opt-*``) is removed.
    """
    raw = _raw(received)
    entries = {_key(key): value for key, value in (raw.application_properties or {}).items()}
    entity = _as_str(_plain(entries.get(X_MS_PATH))) or None
    if entity is None:
        value = entries.get(X_MS_PATH)
        shown = "missing" if X_MS_PATH not in entries else f"{_type_name(value)} {value!r:.80}"
        return Restored(
            RestoreStatus.INVALID,
            reason=f"{X_MS_PATH} missing or not a string",
            description=f"{X_MS_PATH} must be the destination path as a non-empty string, got {shown}",
        )
    try:
        session_id = _string_property(entries, X_MS_SESSION_ID)
        partition_key = _string_property(entries, X_MS_PARTITION_KEY)
        ttl_ms = _ttl_property(entries)
        scheduled = _scheduled_property(entries)
        if session_id is not None and partition_key is not None and session_id != partition_key:
            raise _Invalid(
                f"{X_MS_PARTITION_KEY} differs from {X_MS_SESSION_ID}",
                f"Service Bus requires the partition key to equal the session id, got {partition_key!r} "
                f"and {session_id!r}",
            )
        user_properties = _user_properties(entries)
    except _Invalid as invalid:
        return Restored(RestoreStatus.INVALID, entity, reason=invalid.reason, description=invalid.description)

    remaining_ms: int | None = None
    if ttl_ms is not None:
        enqueued = _utc(backlog_enqueued_time) or _utc(_annotation(raw, _X_OPT_ENQUEUED_TIME))
        current = _utc(now)
        if enqueued is None or current is None:
            raise ValueError("from_backlog needs now and the backlog enqueued time (none on the message) as datetimes")
        spent_ms = max(0, round((current - enqueued) / datetime.timedelta(milliseconds=1)))
        remaining_ms = ttl_ms - spent_ms
        if remaining_ms <= 0:
            return Restored(
                RestoreStatus.EXPIRED,
                entity,
                reason=TTL_EXPIRED_IN_BACKLOG,
                description=f"{X_MS_TIME_TO_LIVE} was {ttl_ms} ms and the message spent {spent_ms} ms in the backlog",
            )
        if remaining_ms > _MAX_AMQP_TTL_MS:
            remaining_ms = None

    annotations: dict[Any, Any] = {
        key: value
        for key, value in (raw.annotations or {}).items()
        if not _key(key).startswith(_BROKER_ANNOTATION_PREFIX)
    }
    if partition_key is not None:
        annotations[_X_OPT_PARTITION_KEY.encode()] = partition_key
    if scheduled is not None:
        annotations[_X_OPT_SCHEDULED_ENQUEUE_TIME.encode()] = scheduled

    header = raw.header
    new_header: dict[str, Any] = {"time_to_live": remaining_ms}
    if header is not None:
        new_header.update(durable=header.durable, priority=header.priority)
    source = raw.properties
    new_properties: dict[str, Any] = {"group_id": session_id}
    if source is not None:
        new_properties.update(
            message_id=_str_or_raw(source.message_id),
            user_id=source.user_id,
            to=_str_or_raw(source.to),
            subject=_str_or_raw(source.subject),
            reply_to=_str_or_raw(source.reply_to),
            correlation_id=_str_or_raw(source.correlation_id),
            content_type=_str_or_raw(source.content_type),
            content_encoding=_str_or_raw(source.content_encoding),
            group_sequence=source.group_sequence,
            reply_to_group_id=_str_or_raw(source.reply_to_group_id),
        )
    annotated = AmqpAnnotatedMessage(
        header=new_header,
        properties=new_properties,
        application_properties=user_properties or None,
        annotations=annotations or None,
        footer=copy.deepcopy(raw.footer),
        **_body_kwargs(raw),
    )
    return Restored(RestoreStatus.RESTORED, entity, _wrap(annotated))


# --- pings and sizes -------------------------------------------------------------------------------------


def is_ping(message: ServiceBusMessage | AmqpAnnotatedMessage) -> bool:
    """True for a ping (content type ``application/vnd.ms-servicebus-ping``); every reader drops these."""
    properties = _raw(message).properties
    content_type = _as_str(properties.content_type) if properties is not None else None
    return content_type is not None and content_type.strip().lower() == PING_CONTENT_TYPE


def ping_message(session_id: str | None = None) -> ServiceBusMessage:
    """An empty ping: content type ``application/vnd.ms-servicebus-ping``, TTL 1 s, a fresh message id, and
    ``session_id`` for an entity that requires sessions."""
    return ServiceBusMessage(
        b"",
        content_type=PING_CONTENT_TYPE,
        time_to_live=datetime.timedelta(seconds=1),
        message_id=str(uuid.uuid4()),
        session_id=session_id,
    )


def message_size(message: ServiceBusMessage | AmqpAnnotatedMessage) -> int:
    """The encoded AMQP size in bytes, computed by the SDK's own encoder as ``ServiceBusMessageBatch`` does
    (``get_message_encoded_size(to_outgoing_amqp_message(...))``). ``message`` is not modified. In a batch
    each message costs 5 more bytes (8 from 256 bytes on). Raises ``TypeError``/``ValueError`` when the SDK
    cannot encode the message at all (an unsupported property type, a TTL beyond the AMQP range)."""
    raw = copy.copy(_raw(message))
    if raw.application_properties is not None:
        # the SDK's conversion rewrites bytes values to str in place: give it a copy
        raw.application_properties = dict(raw.application_properties)
    return int(get_message_encoded_size(PyamqpTransport.to_outgoing_amqp_message(raw)))
