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
(AMQP types)                ``x-ms-propertytypes``, ``x-ms-bodytypes`` (strings), when a receiver could not
                            tell a type (a datetime property, a string inside a value body, ...)
everything else             unchanged: body (data, value or sequence), message_id, correlation_id, subject,
                            content_type, to, reply_to, reply_to_session_id, other application properties
=========================== ==============================================================================

What the SDK does to a message on the wire, and so what :func:`from_backlog` accepts: a received message
has ``bytes`` application property keys and string values, a timestamp arrives as an ``int`` of
milliseconds since the epoch, and an AMQP string, binary or symbol inside a value or sequence body arrives as
``bytes``. :func:`to_backlog` records the AMQP types a receiver cannot tell apart (``x-ms-propertytypes``,
``x-ms-bodytypes``, only when needed) and :func:`from_backlog` restores them: a datetime property is sent
again as a timestamp, a body string as a string, binary as binary. Restored property keys and string values
are ``str``; the restored properties (message_id, subject, ...) are ``str``. Times have millisecond
precision, as on the wire. Only the backlog's own properties (:data:`BACKLOG_PROPERTIES`) are consumed.

:func:`check_encodable` says which field of a message the SDK cannot encode; :func:`set_time_to_live` sets a
TTL in milliseconds (the SDK's setter keeps whole seconds).

Rows hold application properties as text with each one's AMQP type beside it (the ``servicebus`` source's
``application_property_types``): :func:`property_types` says what a message's are (as the service sent them when
it was peeked under :func:`keeping_property_types`, the one helper here that touches an SDK object: it lends a
receiver a transport that reads them off the wire) and :func:`property_value` turns a row's text back into a
value of its type, or says why it cannot.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import datetime
import decimal
import enum
import functools
import json
import logging
import math
import re
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from azure.servicebus import ServiceBusMessage, ServiceBusReceivedMessage
from azure.servicebus._pyamqp._encode import (
    _ENCODE_MAP,
    describe_performative,
    encode_annotations,
    encode_application_properties,
    encode_payload,
    encode_value,
)
from azure.servicebus._pyamqp.message import Header, Properties
from azure.servicebus._pyamqp.types import TYPE, VALUE, AMQPTypes
from azure.servicebus._pyamqp.utils import amqp_long_value, get_message_encoded_size
from azure.servicebus._transport._pyamqp_transport import PyamqpTransport
from azure.servicebus.amqp import (
    AmqpAnnotatedMessage,
    AmqpMessageBodyType,
    AmqpMessageHeader,
    AmqpMessageProperties,
)

from . import wire
from .errors import BadMessageError

_LOGGER = logging.getLogger(__name__)

__all__ = [
    "BACKLOG_PROPERTIES",
    "DESTINATION_NOT_FOUND",
    "PING_CONTENT_TYPE",
    "TTL_EXPIRED_IN_BACKLOG",
    "X_MS_PARTITION_KEY",
    "X_MS_BODY_TYPES",
    "X_MS_PATH",
    "X_MS_PROPERTY_TYPES",
    "X_MS_REPARKED_FROM",
    "X_MS_SCHEDULED_ENQUEUE_TIME",
    "X_MS_SESSION_ID",
    "X_MS_TIME_TO_LIVE",
    "SENDABLE_PROPERTY_TYPES",
    "RestoreStatus",
    "Restored",
    "check_encodable",
    "check_time_to_live",
    "encoded_body",
    "from_backlog",
    "from_received_bytes",
    "is_ping",
    "keeping_property_types",
    "message_size",
    "received_bytes",
    "parked_session",
    "ping_message",
    "property_types",
    "property_types_on_wire",
    "property_reader",
    "property_value",
    "set_time_to_live",
    "text",
    "to_backlog",
]

X_MS_PATH = "x-ms-path"
X_MS_SESSION_ID = "x-ms-sessionid"
X_MS_TIME_TO_LIVE = "x-ms-timetolive"
X_MS_SCHEDULED_ENQUEUE_TIME = "x-ms-scheduledenqueuetimeutc"
X_MS_PARTITION_KEY = "x-ms-partitionkey"
#: the AMQP types of application properties that the SDK's decoder loses (JSON: name -> type code)
X_MS_PROPERTY_TYPES = "x-ms-propertytypes"
#: the AMQP types of the leaves of a value or sequence body that the SDK's decoder loses (type codes)
X_MS_BODY_TYPES = "x-ms-bodytypes"
#: set by the syphon when it parks a restored message in the backlog again (the queue it came from)
X_MS_REPARKED_FROM = "x-ms-reparked-from"
#: what :func:`to_backlog` writes (a stale copy on its input is replaced)
_REWRITE_PROPERTIES = (X_MS_PATH, X_MS_SESSION_ID, X_MS_TIME_TO_LIVE, X_MS_SCHEDULED_ENQUEUE_TIME, X_MS_PARTITION_KEY,
                       X_MS_PROPERTY_TYPES, X_MS_BODY_TYPES)
#: every property the backlog rewrite adds, by exact name: :func:`from_backlog` consumes these and only these
BACKLOG_PROPERTIES = (*_REWRITE_PROPERTIES, X_MS_REPARKED_FROM)

PING_CONTENT_TYPE = "application/vnd.ms-servicebus-ping"
#: dead-letter reason for a backlog message whose TTL ran out while it waited in the backlog
TTL_EXPIRED_IN_BACKLOG = "TTLExpiredInBacklog"
#: dead-letter reason for a backlog message whose destination entity does not exist (used by the syphon)
DESTINATION_NOT_FOUND = "DestinationNotFound"

_X_OPT_PARTITION_KEY = "x-opt-partition-key"
_X_OPT_SCHEDULED_ENQUEUE_TIME = "x-opt-scheduled-enqueue-time"
_X_OPT_ENQUEUED_TIME = "x-opt-enqueued-time"
_BROKER_ANNOTATION_PREFIX = "x-opt-"  # reserved for the broker (sequence number, lock, enqueued time, ...)
# what a broker sets on a received message: meaningless on a copy (a forwarded received message)
_BROKER_ANNOTATIONS = ("x-opt-sequence-number", "x-opt-enqueued-time", "x-opt-locked-until", "x-opt-lock-token",
                       "x-opt-message-state", "x-opt-enqueue-sequence-number", "x-opt-deadletter-source")
_MAX_PROPERTY_LENGTH = 128  # the SDK's limit for session id and partition key
_MAX_AMQP_TTL_MS = 0xFFFFFFFF  # the AMQP header ttl is a uint
_MAX_INT64 = 2**63 - 1
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


# --- small helpers over the SDK's representations --------------------------------------------------------


def _key(key: object) -> str:
    kind = type(key)
    if kind is str:
        return key  # type: ignore[return-value]
    if kind is bytes:  # as the SDK decodes a received map's keys
        return key.decode("utf-8", "replace")  # type: ignore[attr-defined,no-any-return]
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
    kind = type(value)
    if kind is str:
        return value  # type: ignore[no-any-return]
    if kind is not bytes and kind is not bytearray and isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return None
    return None


def text(value: Any) -> str | None:
    """Any received value as text for people and tables: ``None`` stays ``None``, bytes are decoded as UTF-8
    (invalid sequences replaced), anything else is ``str(value)``."""
    if value is None:
        return None
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


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
        utc: datetime.datetime = value.astimezone(datetime.UTC)
        return utc.replace(microsecond=(utc.microsecond // 1000) * 1000)
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


# --- the AMQP types the SDK's decoder loses ---------------------------------------------------------------
#
# The SDK's decoder (``_pyamqp/_decode.py``) hands an AMQP string, binary and symbol all over as ``bytes``,
# every integer type and a timestamp as ``int``, a float and a double as ``float``; its encoder sends a plain
# ``int`` as an AMQP int (32 bits), ``bytes`` as binary (but as a string in application properties), a
# ``datetime`` as a timestamp. So a value received from a backlog queue cannot say by itself what it was sent
# as. :func:`to_backlog` records, one letter per value, the AMQP type the SDK sent where the value as received
# would not tell it (``x-ms-propertytypes``, ``x-ms-bodytypes``); :func:`from_backlog` gives each value that
# type back, as a plain Python value where the SDK's encoder infers the type (str, bytes, int, float,
# datetime), else as a pyamqp typed value (``{TYPE: ..., VALUE: ...}``, as ``amqp_long_value`` builds).

_CODES = {
    AMQPTypes.string: "s", AMQPTypes.binary: "b", AMQPTypes.symbol: "y",
    AMQPTypes.int: "i", AMQPTypes.long: "l", AMQPTypes.timestamp: "t", AMQPTypes.uint: "I",
    AMQPTypes.ulong: "L", AMQPTypes.short: "h", AMQPTypes.ushort: "H", AMQPTypes.byte: "c",
    AMQPTypes.ubyte: "C", AMQPTypes.float: "f", AMQPTypes.double: "d",
    AMQPTypes.decimal128: "D",  # an application property only, carried as its text (see _decimal_text)
}
_AMQP_TYPES = {code: amqp_type for amqp_type, code in _CODES.items()}
_BYTES_CODES = frozenset("sbyD")  # received as bytes
_INT_CODES = frozenset("iltILhHcC")  # received as int
_FLOAT_CODES = frozenset("fd")  # received as float
_BODY_TYPES_PATTERN = re.compile(r"(?:[sbyiltILhHcCfd][0-9]*)*")
_RUN = re.compile(r"([sbyiltILhHcCfd])([0-9]*)")
_MIN_INT32, _MAX_INT32 = -(2**31), 2**31 - 1
_MIN_DATETIME_MS = -62135596800000  # 0001-01-01
_MAX_DATETIME_MS = 253402300799999  # 9999-12-31 23:59:59.999


class _Typed(dict):  # type: ignore[type-arg]
    """A pyamqp typed value that can also be a map key."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash((self[TYPE], self[VALUE]))


def _typed(amqp_type: str, value: Any) -> _Typed:
    return _Typed({TYPE: amqp_type, VALUE: value})


def _is_typed(value: Any) -> bool:
    """True for a pyamqp typed value, read as the SDK's encoder reads one inside a map or list."""
    if not isinstance(value, dict) or TYPE not in value or VALUE not in value:
        return False
    try:
        return value[TYPE] in _ENCODE_MAP
    except TypeError:  # unhashable
        return False


def _ms(value: datetime.datetime) -> int:
    """Milliseconds since the epoch, as the SDK's encoder computes them (a naive datetime is UTC)."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=datetime.UTC)
    delta = value - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1000 + delta.microseconds // 1000


def _received_code(value: Any, *, property_value: bool = False) -> str:
    """The type a received value is restored as when nothing says otherwise: bytes as binary in a body, as a
    string in application properties (what the SDK sends them as); an int as an AMQP int when it fits one,
    else a long (ulong beyond); a float as a double."""
    if isinstance(value, bytes | bytearray):
        return "s" if property_value else "b"
    if isinstance(value, float):
        return "d"
    if _MIN_INT32 <= value <= _MAX_INT32:
        return "i"
    return "l" if value < 2**63 else "L"


def _decimal_text(value: Any) -> str | None:
    """The text a decimal128 application property is carried as in a backlog copy (a ``Decimal``, or one typed
    decimal128, that the SDK can encode); ``None`` for any other value. The SDK's decoder cannot read the
    decimal128 its own encoder writes (``Invalid AMQP decimal128 encoding``: a receive of the whole batch fails),
    so a backlog copy that carried one could never be read by the syphon; :func:`from_backlog` gives it back."""
    inner = value[VALUE] if _is_typed(value) and value[TYPE] == AMQPTypes.decimal128 else value
    if not isinstance(inner, decimal.Decimal):
        return None
    try:
        encode_value(bytearray(), inner)  # NaN, an infinity, too many digits: left to the encoder's check
    except (ValueError, TypeError, decimal.DecimalException):
        return None
    return str(inner)


def _sent(value: Any, *, property_value: bool = False) -> tuple[str, Any] | None:
    """(the code of the AMQP type the SDK sends ``value`` as, ``value`` as a receiver gets it) for a leaf
    whose type a receiver cannot tell; ``None`` for anything else (a decimal: ``D``, for a property only)."""
    if property_value:
        text = _decimal_text(value)
        if text is not None:
            return "D", text.encode("ascii")
    if _is_typed(value):
        code = _CODES.get(value[TYPE])
        if code is None:
            return None
        inner = value[VALUE]
        if isinstance(inner, datetime.datetime):
            inner = _ms(inner)
        elif isinstance(inner, str):
            inner = inner.encode("utf-8", "surrogatepass")
        return code, inner
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, str):
        return "s", value.encode("utf-8", "surrogatepass")
    if isinstance(value, bytes | bytearray):
        return ("s" if property_value else "b"), bytes(value)
    if isinstance(value, int):
        return "i", value
    if isinstance(value, float):
        return "d", value
    if isinstance(value, datetime.datetime):
        return "t", _ms(value)
    return None


def _sent_codes(value: Any, out: list[tuple[str, Any]], *, top: bool = False) -> None:
    """The leaves of a body value whose type a receiver cannot tell, in the order the SDK's encoder writes
    (and its decoder reads) them. At the top of a value body the SDK encodes a typed value as a plain map."""
    if _is_typed(value) and not top:
        kind, inner = value[TYPE], value[VALUE]
        if kind is None:
            _sent_codes(inner, out)
        elif kind in (AMQPTypes.list, AMQPTypes.array):
            for item in inner:
                _sent_codes(item, out)
        elif kind == AMQPTypes.map:
            for key, item in inner.items() if isinstance(inner, dict) else inner:
                _sent_codes(key, out)
                _sent_codes(item, out)
        elif kind == AMQPTypes.described:
            _sent_codes(inner[1], out)
        else:
            leaf = _sent(value)
            if leaf is not None:
                out.append(leaf)
    elif isinstance(value, dict):
        for key, item in value.items():
            _sent_codes(key, out)
            _sent_codes(item, out)
    elif isinstance(value, list):
        for item in value:
            _sent_codes(item, out)
    elif isinstance(value, tuple):  # described: a receiver gets the value only
        if len(value) == 2:
            _sent_codes(value[1], out)
    else:
        leaf = _sent(value)
        if leaf is not None:
            out.append(leaf)


def _body_types(raw: AmqpAnnotatedMessage) -> str | None:
    """``x-ms-bodytypes`` for a value or sequence body: one code per leaf a receiver gets as bytes, int or
    float, run-length encoded (``s3bi2``); ``None`` when every leaf comes back as what it was sent as."""
    leaves: list[tuple[str, Any]] = []
    if raw.body_type == AmqpMessageBodyType.VALUE:
        _sent_codes(raw.body, leaves, top=True)
    elif raw.body_type == AmqpMessageBodyType.SEQUENCE:
        for section in raw.body:
            _sent_codes(section, leaves, top=True)
    else:
        return None
    if all(code == _received_code(value) for code, value in leaves):
        return None
    runs: list[str] = []
    previous, count = "", 0
    for code, _ in leaves:
        if code == previous:
            count += 1
            continue
        if count:
            runs.append(previous + (str(count) if count > 1 else ""))
        previous, count = code, 1
    runs.append(previous + (str(count) if count > 1 else ""))
    return "".join(runs)


def _property_types(properties: dict[Any, Any]) -> str | None:
    """``x-ms-propertytypes``: ``{"name": code}`` (JSON) for the application properties a receiver would not
    get back as what they were sent as (a datetime, a typed long that fits an int, ...); ``None`` if none. A
    decimal's value in ``properties`` is replaced by its text (:func:`_decimal_text`)."""
    codes: dict[str, str] = {}
    for name, value in properties.items():
        leaf = _sent(value, property_value=True)
        if leaf is not None and leaf[0] != _received_code(leaf[1], property_value=True):
            codes[_key(name)] = leaf[0]
            if leaf[0] == "D":
                properties[name] = leaf[1].decode("ascii")
    return json.dumps(codes, separators=(",", ":"), ensure_ascii=False) if codes else None


class _Mismatch(Exception):
    """A recorded type does not fit the value received."""


def _restore(value: Any, code: str, *, top: bool = False) -> Any:
    """A received leaf as the AMQP type ``code`` stands for (see the section comment)."""
    if isinstance(value, bytes | bytearray):
        if code not in _BYTES_CODES:
            raise _Mismatch(code)
        if code == "b":
            return bytes(value)
        if code == "D":  # a decimal128 property carried as its text
            try:
                return decimal.Decimal(bytes(value).decode("ascii"))
            except (UnicodeDecodeError, decimal.InvalidOperation):
                raise _Mismatch(code) from None
        if code == "s":
            try:
                return bytes(value).decode("utf-8")
            except UnicodeDecodeError:
                return bytes(value) if top else _typed(AMQPTypes.string, bytes(value))
        return bytes(value) if top else _typed(AMQPTypes.symbol, bytes(value))
    if isinstance(value, float):
        if code not in _FLOAT_CODES:
            raise _Mismatch(code)
        return value if code == "d" or top else _typed(AMQPTypes.float, value)
    if code not in _INT_CODES:
        raise _Mismatch(code)
    if code == "i" and _MIN_INT32 <= value <= _MAX_INT32:
        return value
    if code == "t" and _MIN_DATETIME_MS <= value <= _MAX_DATETIME_MS:
        return _EPOCH + datetime.timedelta(milliseconds=value)
    if top:  # the SDK encodes a typed value at the top of a value body as a map: leave it as received
        return value
    if code == "i":  # an int that does not fit an AMQP int was sent as something longer
        code = _received_code(value)
    return _typed(_AMQP_TYPES[code], value)


def _is_leaf(value: Any) -> bool:
    return isinstance(value, bytes | bytearray | int | float) and not isinstance(value, bool)


def _received_only(value: Any) -> bool:
    """True when ``value`` looks decoded by the SDK (maps, lists and plain leaves only), not built in process
    with its types (str, datetime, typed values), which are kept as they are."""
    if isinstance(value, dict):
        return not _is_typed(value) and all(_received_only(k) and _received_only(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_received_only(item) for item in value)
    return not isinstance(value, str | datetime.datetime | tuple)


def _restore_body_value(value: Any, codes: Iterator[str] | None, *, top: bool = False) -> Any:
    if isinstance(value, dict):
        return {_restore_body_value(k, codes): _restore_body_value(v, codes) for k, v in value.items()}
    if isinstance(value, list):
        return [_restore_body_value(item, codes) for item in value]
    if _is_leaf(value):
        code = _received_code(value) if codes is None else next(codes, "")
        if not code:
            raise _Mismatch("too few codes")
        return _restore(value, code, top=top)
    return value


def _codes(text: str) -> Iterator[str]:
    for code, count in _RUN.findall(text):
        for _ in range(int(count or 1)):
            yield code


def _restored_body(raw: AmqpAnnotatedMessage, body_types: str | None) -> dict[str, Any]:
    """The body of a backlog message for its destination, with the types ``x-ms-bodytypes`` records (as
    received where nothing is recorded, or where the record does not fit the body)."""
    if raw.body_type == AmqpMessageBodyType.DATA:
        return _body_kwargs(raw)
    sections = [raw.body] if raw.body_type == AmqpMessageBodyType.VALUE else list(raw.body)
    if not all(_received_only(section) for section in sections):  # built in process: types intact
        return _body_kwargs(raw)
    for attempt in (body_types, None):
        codes = None if attempt is None else _codes(attempt)
        try:
            restored = [_restore_body_value(section, codes, top=True) for section in sections]
            if codes is not None and next(codes, None) is not None:
                raise _Mismatch("too many codes")
        except _Mismatch as mismatch:
            _LOGGER.warning("%s does not fit the body (%s); the body is restored as received", X_MS_BODY_TYPES,
                            mismatch)
            continue
        if raw.body_type == AmqpMessageBodyType.VALUE:
            return {"value_body": restored[0]}
        return {"sequence_body": restored}
    return _body_kwargs(raw)  # not reached: the attempt without codes cannot mismatch


# --- to the backlog --------------------------------------------------------------------------------------


def to_backlog(message: ServiceBusMessage, entity: str, *, check: bool = True) -> ServiceBusMessage:
    """A copy of ``message`` for a backlog queue, carrying its destination ``entity`` and the fields a
    backlog queue cannot hold (session, TTL, schedule, partition key) as ``x-ms-*`` application properties,
    and the AMQP types a receiver could not tell (``x-ms-propertytypes``, ``x-ms-bodytypes``, only when
    needed). ``message`` is not modified. Stale copies of these properties on the input are replaced; any other
    property (``x-ms-foo`` too) is kept.

    Raises :class:`~spark_sb.errors.BadMessageError` (naming the field and value) when the SDK cannot encode
    ``message`` (see :func:`check_encodable`). ``check=False`` leaves that to whoever encodes the copy next (a
    batch's ``add_message``): one encode instead of two; :func:`check_time_to_live` is then the check the copy
    cannot make (it carries the TTL in a property, where any value encodes)."""
    if not isinstance(entity, str) or not entity:
        raise ValueError(f"entity must be a non-empty string, got {entity!r}")
    if wire.is_encoded(message):
        fast = _encoded_to_backlog(message, entity)  # type: ignore[arg-type]
        if fast is not None:
            return fast
    raw = _raw(message)

    properties: dict[Any, Any] = {
        key: value
        for key, value in (raw.application_properties or {}).items()
        if _key(key) not in _REWRITE_PROPERTIES
    }
    property_types = _property_types(properties)
    body_types = _body_types(raw)
    properties[X_MS_PATH] = entity
    if property_types is not None:
        properties[X_MS_PROPERTY_TYPES] = property_types
    if body_types is not None:
        properties[X_MS_BODY_TYPES] = body_types
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
        if _key(key) not in (_X_OPT_PARTITION_KEY, _X_OPT_SCHEDULED_ENQUEUE_TIME, *_BROKER_ANNOTATIONS)
    }
    new_header: dict[str, Any] | None = None
    if header is not None and (header.durable is not None or header.priority is not None):
        new_header = {"durable": header.durable, "priority": header.priority}
    new_properties: dict[str, Any] | None = None
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
    # A shallow copy that shares the body (nothing here or in the encoder modifies it) with every other section
    # replaced: a third of the cost of AmqpAnnotatedMessage(...), which copies the body and checks its arguments
    annotated = copy.copy(raw)
    # the SDK types these setters without None, which its getters and constructor allow
    annotated.header = AmqpMessageHeader(**new_header) if new_header else None  # type: ignore[assignment]
    annotated.properties = AmqpMessageProperties(**new_properties) if new_properties is not None else None  # type: ignore[assignment]
    annotated.application_properties = properties
    annotated.annotations = annotations or None
    annotated.delivery_annotations = None
    annotated.footer = copy.deepcopy(raw.footer)
    if check:
        _check_encodable(raw, entity, annotated)
    return _wrap(annotated)


def _encoded_to_backlog(message: wire.EncodedMessage, entity: str) -> ServiceBusMessage | None:
    """:func:`to_backlog` of a message that carries its bytes (no TTL, no schedule, a data body: what
    :func:`spark_sb.wire.encoded_message` covers), as one too, with the same bytes; ``None`` when the copy is not
    covered."""
    fields = message.fields
    properties = {key: value for key, value in (fields.application_properties or {}).items()
                  if key not in _REWRITE_PROPERTIES}
    property_types = _property_types(properties)
    properties[X_MS_PATH] = entity
    if property_types is not None:
        properties[X_MS_PROPERTY_TYPES] = property_types
    if fields.session_id is not None:
        properties[X_MS_SESSION_ID] = fields.session_id
    if fields.partition_key is not None:
        properties[X_MS_PARTITION_KEY] = fields.partition_key
    return wire.encoded_message(fields.body, fields.message_id, subject=fields.subject,
                                content_type=fields.content_type, correlation_id=fields.correlation_id,
                                to=fields.to, reply_to=fields.reply_to, application_properties=properties)


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


_TYPES_READ: dict[str, Any] = {}  # x-ms-propertytypes texts read (most messages of a queue repeat a few; bounded)


def _types_property(properties: Mapping[str, Any]) -> dict[str, str]:
    if X_MS_PROPERTY_TYPES not in properties:
        return {}
    value = properties[X_MS_PROPERTY_TYPES]
    text = _as_str(_plain(value))
    codes = _TYPES_READ.get(text) if text is not None else None
    if codes is None:
        try:
            codes = json.loads(text) if text is not None else None
        except ValueError:
            codes = None
        if text is not None and isinstance(codes, dict) and len(text) <= 1024:
            if len(_TYPES_READ) >= 256:
                _TYPES_READ.clear()
            _TYPES_READ[text] = codes
    if not isinstance(codes, dict) or not all(isinstance(c, str) and c in _AMQP_TYPES for c in codes.values()):
        raise _Invalid(
            f"{X_MS_PROPERTY_TYPES} is not a JSON map of type codes",
            f"{X_MS_PROPERTY_TYPES} must map property names to AMQP type codes, got {_type_name(value)} "
            f"{value!r:.80}",
        )
    return codes


def _body_types_property(properties: Mapping[str, Any]) -> str | None:
    if X_MS_BODY_TYPES not in properties:
        return None
    value = properties[X_MS_BODY_TYPES]
    text = _as_str(_plain(value))
    if text is None or not _BODY_TYPES_PATTERN.fullmatch(text):
        raise _Invalid(
            f"{X_MS_BODY_TYPES} is not a string of type codes",
            f"{X_MS_BODY_TYPES} must be a run of AMQP type codes, got {_type_name(value)} {value!r:.80}",
        )
    return text


def _user_properties(entries: Mapping[str, Any], codes: Mapping[str, str]) -> dict[str, Any]:
    """The application properties but the backlog's own (exact names), with ``str`` keys, each value of the
    AMQP type it was sent as (``codes``: what ``x-ms-propertytypes`` records; by default a received string as
    ``str``, an int beyond 32 bits as a long)."""
    user: dict[str, Any] = {}
    for name, value in entries.items():
        if name in BACKLOG_PROPERTIES:
            continue
        if _is_leaf(value):
            code = codes.get(name) or _received_code(value, property_value=True)
            if code == "s" and isinstance(value, bytes | bytearray) and _as_str(value) is None:
                # the SDK's sender would fail on it (it decodes bytes values as UTF-8)
                raise _Invalid(
                    f"application property {name} is binary, not UTF-8 text",
                    f"application property {name!r} holds {len(value)} bytes that are not UTF-8; the SDK cannot "
                    "send them",
                )
            try:
                value = _restore(value, code)
            except _Mismatch:
                raise _Invalid(
                    f"{X_MS_PROPERTY_TYPES} does not fit application property {name}",
                    f"{X_MS_PROPERTY_TYPES} says {name!r} is {_AMQP_TYPES[code]}, got {_type_name(value)} "
                    f"{value!r:.80}",
                ) from None
        user[name] = value
    return user


def from_backlog(
    received: ServiceBusMessage | AmqpAnnotatedMessage,
    now: datetime.datetime,
    backlog_enqueued_time: datetime.datetime | None = None,
    *,
    fast: bool = True,
) -> Restored:
    """Restore a backlog message for its destination, or say why it must be dead-lettered.

    ``received`` is a ``ServiceBusReceivedMessage`` (or any ``ServiceBusMessage``/``AmqpAnnotatedMessage``;
    only its AMQP sections are read). ``backlog_enqueued_time`` is when the backlog queue accepted it,
    by default the received message's ``x-opt-enqueued-time``; the restored TTL is ``x-ms-timetolive`` minus
    the time since the message would have become visible: ``max(0, now - max(backlog_enqueued_time,
    scheduled enqueue time))`` (Service Bus starts a scheduled message's TTL at its scheduled time). A TTL
    larger than the AMQP header can carry (about 49.7 days, e.g. .NET's TimeSpan.MaxValue) is restored as no
    TTL: the entity's default applies. The backlog's own properties (:data:`BACKLOG_PROPERTIES`, exact names)
    and every broker annotation (``x-opt-*``) are removed; a user's other ``x-ms-*`` properties are kept.
    Application properties and value or sequence bodies get back the AMQP types ``x-ms-propertytypes`` and
    ``x-ms-bodytypes`` record (see "the AMQP types the SDK's decoder loses").

    ``fast``: the restored message carries its bytes (:mod:`spark_sb.wire`) when that module covers it (a data
    body, no TTL nor schedule, no header, annotation or property it does not write); else it is the SDK's.
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
        user_properties = _user_properties(entries, _types_property(entries))
        body_types = _body_types_property(entries)
    except _Invalid as invalid:
        return Restored(RestoreStatus.INVALID, entity, reason=invalid.reason, description=invalid.description)

    remaining_ms: int | None = None
    if ttl_ms is not None:
        enqueued = _utc(backlog_enqueued_time) or _utc(_annotation(raw, _X_OPT_ENQUEUED_TIME))
        current = _utc(now)
        if enqueued is None or current is None:
            raise ValueError("from_backlog needs now and the backlog enqueued time (none on the message) as datetimes")
        # Service Bus starts a scheduled message's TTL at its scheduled enqueue time
        visible = enqueued if scheduled is None else max(enqueued, scheduled)
        spent_ms = max(0, round((current - visible) / datetime.timedelta(milliseconds=1)))
        remaining_ms = ttl_ms - spent_ms
        if remaining_ms <= 0:
            since = "it was enqueued in the backlog" if visible == enqueued else "its scheduled enqueue time"
            return Restored(
                RestoreStatus.EXPIRED,
                entity,
                reason=TTL_EXPIRED_IN_BACKLOG,
                description=f"{X_MS_TIME_TO_LIVE} was {ttl_ms} ms and {spent_ms} ms passed since {since} "
                f"({visible.isoformat()})",
            )
        if remaining_ms > _MAX_AMQP_TTL_MS:
            remaining_ms = None

    annotations: dict[Any, Any] = {
        key: value
        for key, value in (raw.annotations or {}).items()
        if not _key(key).startswith(_BROKER_ANNOTATION_PREFIX)
    }
    if fast and remaining_ms is None and scheduled is None and not annotations and body_types is None:
        encoded = _encoded_restore(raw, session_id, partition_key, user_properties)
        if encoded is not None:
            return Restored(RestoreStatus.RESTORED, entity, encoded)
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
        **_restored_body(raw, body_types),
    )
    return Restored(RestoreStatus.RESTORED, entity, _wrap(annotated))


def _encoded_restore(raw: AmqpAnnotatedMessage, session_id: str | None, partition_key: str | None,
                     user_properties: Mapping[str, Any]) -> ServiceBusMessage | None:
    """:func:`from_backlog`'s message as one that carries its bytes, when :mod:`spark_sb.wire` writes every part
    of it: one data section, no footer, the properties it covers as text; else ``None``."""
    header, source = raw.header, raw.properties
    if raw.body_type != AmqpMessageBodyType.DATA or raw.footer or source is None:
        return None
    sections = list(raw.body)
    if len(sections) != 1 or any(value is not None for value in (
            source.user_id, source.content_encoding, source.group_sequence, source.reply_to_group_id)):
        return None
    texts = {name: getattr(source, name) for name in (
        "message_id", "to", "subject", "reply_to", "correlation_id", "content_type")}
    for name, value in texts.items():
        if value is not None:
            text = _as_str(value)
            if text is None:  # not UTF-8 text, or of another type (a UUID or ulong id): the SDK's
                return None
            texts[name] = text
    message_id = texts.pop("message_id")
    if message_id is None:
        return None
    return wire.encoded_message(bytes(sections[0]), message_id, session_id=session_id,
                                partition_key=partition_key, application_properties=user_properties,
                                durable=None if header is None else header.durable,
                                priority=None if header is None else header.priority, **texts)


# --- application properties in rows: their text and their AMQP types -----------------------------------
#
# The ``servicebus`` source's rows hold application properties as text (``map<string, string>``) and, beside
# them, each one's AMQP type by its name in the AMQP 1.0 specification (``application_property_types``):
# ``{"p": "int", "at": "timestamp", "region": "string"}``. The sink reads the text back as that type, so a
# message written back from a row carries the same types as the one read (a numeric SQL filter on a
# subscription still matches it). The SDK's decoder loses most of these types (an int, a long and a timestamp
# all arrive as ``int``); :func:`keeping_property_types` reads them off the wire while a receiver peeks.

#: the types a row can give a property back: text -> value (:func:`property_value`)
SENDABLE_PROPERTY_TYPES = ("string", "symbol", "binary", "boolean", "byte", "short", "int", "long", "ubyte",
                           "ushort", "uint", "ulong", "float", "double", "decimal128", "timestamp", "uuid")
#: the type name of each AMQP constructor a property value can start with (the high nibble gives its width)
_WIRE_TYPE_NAMES = {
    0x40: "null", 0x41: "boolean", 0x42: "boolean", 0x56: "boolean", 0x50: "ubyte", 0x51: "byte",
    0x60: "ushort", 0x61: "short", 0x70: "uint", 0x52: "uint", 0x43: "uint", 0x80: "ulong", 0x53: "ulong",
    0x44: "ulong", 0x71: "int", 0x54: "int", 0x81: "long", 0x55: "long", 0x72: "float", 0x82: "double",
    0x74: "decimal32", 0x84: "decimal64", 0x94: "decimal128", 0x73: "char", 0x83: "timestamp", 0x98: "uuid",
    0xA0: "binary", 0xB0: "binary", 0xA1: "string", 0xB1: "string", 0xA3: "symbol", 0xB3: "symbol",
    0x45: "list", 0xC0: "list", 0xD0: "list", 0xC1: "map", 0xD1: "map", 0xE0: "array", 0xF0: "array",
    0x00: "described",
}
_FIXED_WIDTHS = {0x4: 0, 0x5: 1, 0x6: 2, 0x7: 4, 0x8: 8, 0x9: 16}
_APPLICATION_PROPERTIES_SECTION = 0x74
_INTEGER_RANGES = {
    "byte": (-(2**7), 2**7 - 1), "short": (-(2**15), 2**15 - 1), "int": (_MIN_INT32, _MAX_INT32),
    "long": (-(2**63), 2**63 - 1), "ubyte": (0, 2**8 - 1), "ushort": (0, 2**16 - 1), "uint": (0, 2**32 - 1),
    "ulong": (0, 2**64 - 1),
}
_TYPE_NAMES = {
    AMQPTypes.null: "null", AMQPTypes.boolean: "boolean", AMQPTypes.ubyte: "ubyte", AMQPTypes.byte: "byte",
    AMQPTypes.ushort: "ushort", AMQPTypes.short: "short", AMQPTypes.uint: "uint", AMQPTypes.int: "int",
    AMQPTypes.ulong: "ulong", AMQPTypes.long: "long", AMQPTypes.float: "float", AMQPTypes.double: "double",
    AMQPTypes.timestamp: "timestamp", AMQPTypes.uuid: "uuid", AMQPTypes.binary: "binary",
    AMQPTypes.string: "string", AMQPTypes.symbol: "symbol", AMQPTypes.list: "list", AMQPTypes.map: "map",
    AMQPTypes.array: "array", AMQPTypes.described: "described", AMQPTypes.decimal128: "decimal128",
}
_BY_TYPE_NAME = {name: amqp_type for amqp_type, name in _TYPE_NAMES.items()}
_INTEGER_TEXT = re.compile(r"[+-]?[0-9]+")
_MAX_FLOAT32 = 3.4028234663852886e38
#: the attribute :func:`keeping_property_types` sets on each message it sees peeked
_WIRE_TYPES_ATTRIBUTE = "_spark_sb_property_types"


def _after(view: memoryview, at: int, depth: int = 0) -> int:
    """Where the AMQP value whose constructor is at ``at`` ends (read by its width, never decoded)."""
    if depth > 64:
        raise ValueError("described values nested too deep")
    constructor = view[at]
    at += 1
    if constructor == 0x00:  # described: a descriptor, then the value
        return _after(view, _after(view, at, depth + 1), depth + 1)
    width = constructor >> 4
    if width in _FIXED_WIDTHS:
        end = at + _FIXED_WIDTHS[width]
    elif width in (0xA, 0xC, 0xE):
        end = at + 1 + view[at]
    elif width in (0xB, 0xD, 0xF):
        end = at + 4 + int.from_bytes(view[at:at + 4], "big")
    else:
        raise ValueError(f"0x{constructor:02x} is no AMQP constructor")
    if end > len(view):
        raise ValueError("the value runs past the end of the message")
    return end


def property_types_on_wire(payload: bytes | bytearray | memoryview) -> dict[str, str]:
    """``{name: AMQP type}`` of the application properties of an encoded AMQP message (its sections, as the
    service sends them), null values left out; a type spark-sb cannot send back is named too (``described``,
    ``list``, ``char``...). Raises ``ValueError`` (or ``IndexError``) when ``payload`` is not a message."""
    view = memoryview(payload)
    at = 0
    while at < len(view):
        if view[at] != 0x00:
            raise ValueError(f"byte {at} does not start a message section")
        if view[at + 1] == 0x53:  # smallulong descriptor
            code, at = view[at + 2], at + 3
        elif view[at + 1] == 0x80:  # ulong descriptor
            code, at = int.from_bytes(view[at + 2:at + 10], "big"), at + 10
        else:  # a symbolic descriptor
            code, at = None, _after(view, at + 1)
        if code == _APPLICATION_PROPERTIES_SECTION:
            return _wire_map_types(view, at)
        at = _after(view, at)
    return {}


def _wire_map_types(view: memoryview, at: int) -> dict[str, str]:
    constructor = view[at]
    if constructor == 0x40:  # null: no properties
        return {}
    if constructor == 0xC1:
        count, at = view[at + 2], at + 3
    elif constructor == 0xD1:
        count, at = int.from_bytes(view[at + 5:at + 9], "big"), at + 9
    else:
        raise ValueError(f"the application properties are not a map (constructor 0x{constructor:02x})")
    types: dict[str, str] = {}
    for _ in range(count // 2):
        key_constructor, key_end = view[at], _after(view, at)
        if key_constructor in (0xA1, 0xA3):
            key = bytes(view[at + 2:key_end])
        elif key_constructor in (0xB1, 0xB3):
            key = bytes(view[at + 5:key_end])
        else:
            raise ValueError(f"an application property name is not a string (constructor 0x{key_constructor:02x})")
        name = _wire_described(view, key_end) if view[key_end] == 0x00 else _WIRE_TYPE_NAMES.get(
            view[key_end], f"0x{view[key_end]:02x}")
        at = _after(view, key_end)
        if name != "null":
            types[_key(key)] = name
    return types


def _wire_described(view: memoryview, at: int) -> str:
    """The type of the described value at ``at``: ``described:<descriptor>:<type of its value>`` (a symbol, or a
    number as ``0x...``) when that value is of a type :func:`property_value` sends, e.g. .NET's DateTimeOffset
    ``described:com.microsoft:datetime-offset:long``; else ``described``."""
    constructor = view[at + 1]
    if constructor in (0xA3, 0xB3):
        start = at + 3 if constructor == 0xA3 else at + 6
        descriptor = bytes(view[start:_after(view, at + 1)]).decode("ascii", "replace")
    elif constructor == 0x53:
        descriptor = f"0x{view[at + 2]:x}"
    elif constructor == 0x80:
        descriptor = f"0x{int.from_bytes(view[at + 2:at + 10], 'big'):x}"
    else:
        return "described"
    inner = _WIRE_TYPE_NAMES.get(view[_after(view, at + 1)])
    return f"described:{descriptor}:{inner}" if inner in SENDABLE_PROPERTY_TYPES else "described"


def _record_wire_types(parsed: Any, answer: Any) -> None:
    """Give each message of ``parsed`` (what a management operation's callback made of ``answer``, the service's
    reply) the application property types its bytes in ``answer`` have (:data:`_WIRE_TYPES_ATTRIBUTE`)."""
    value = getattr(answer, "value", None)
    wire = value.get(b"messages") if isinstance(value, dict) else None
    if not isinstance(parsed, list) or not isinstance(wire, list) or len(wire) != len(parsed):
        return
    for received, item in zip(parsed, wire, strict=True):
        try:
            types = property_types_on_wire(item[b"message"])
        except Exception as exc:  # never fails a peek: the decoded values say what they can
            _LOGGER.debug("application property types not read off the wire: %s: %s", type(exc).__name__, exc)
            continue
        setattr(received, _WIRE_TYPES_ATTRIBUTE, types)


def _keeping_types(base: type) -> type:
    """``base`` (the SDK's pyamqp transport) whose management requests (a peek, a receive by sequence number) also
    record the application property types of the messages they return, read off the bytes of the service's reply.
    The SDK parses those messages in the request's callback (``mgmt_handlers.peek_op``), to which
    ``PyamqpTransport.mgmt_client_request`` hands ``PyamqpTransport`` itself whatever the receiver's transport is:
    so the callback is wrapped, not the parse."""
    cached = _KEEPING_TYPES.get(base)
    if cached is not None:
        return cached

    def mgmt_client_request(mgmt_client: Any, mgmt_msg: Any, **kwargs: Any) -> Any:
        callback = kwargs.pop("callback")

        def recording(status: Any, answer: Any, description: Any, **more: Any) -> Any:
            parsed = callback(status, answer, description, **more)
            _record_wire_types(parsed, answer)
            return parsed

        request = base.mgmt_client_request  # type: ignore[attr-defined]
        return request(mgmt_client, mgmt_msg, callback=recording, **kwargs)

    kept = type(f"{base.__name__}KeepingPropertyTypes", (base,),
                {"mgmt_client_request": staticmethod(mgmt_client_request), "__module__": __name__})
    _KEEPING_TYPES[base] = kept
    return kept


_KEEPING_TYPES: dict[type, type] = {}


@contextlib.contextmanager
def keeping_property_types(receiver: Any) -> Iterator[Any]:
    """While the block runs, every message ``receiver`` (a ``ServiceBusReceiver`` held by this thread alone)
    peeks or receives by sequence number records its application properties' AMQP types as the service sent
    them, which :func:`property_types` then reports (the SDK's decoder loses them). The receiver's management
    requests go through its transport: for the block, a subclass of it whose requests also read the types off
    the reply's bytes (see :func:`_keeping_types`); the receiver's own is put back when the block ends. Does
    nothing for a transport other than the SDK's pyamqp one (the types are then inferred from the values)."""
    transport = getattr(receiver, "_amqp_transport", None)
    if not (isinstance(transport, type) and issubclass(transport, PyamqpTransport)):
        yield receiver
        return
    receiver._amqp_transport = _keeping_types(transport)
    try:
        yield receiver
    finally:
        receiver._amqp_transport = transport


def _inferred_type(value: Any) -> str:
    """The AMQP type of a decoded (or in-process) property value, as far as the value tells: the SDK hands a
    string, a binary and a symbol over as ``bytes`` (sent back as a string), an int, a long and a timestamp as
    ``int`` (an int when it fits 32 bits, else a long), a float and a double as ``float`` (a double)."""
    if _is_typed(value):
        return _TYPE_NAMES.get(value[TYPE], "described")
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "int" if _MIN_INT32 <= value <= _MAX_INT32 else "long" if value < 2**63 else "ulong"
    if isinstance(value, float):
        return "double"
    if isinstance(value, str | bytes | bytearray):
        return "string"
    if isinstance(value, datetime.datetime):
        return "timestamp"
    if isinstance(value, uuid.UUID):
        return "uuid"
    if isinstance(value, decimal.Decimal):
        return "decimal128"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "map"
    return "described"


def property_types(message: ServiceBusMessage | AmqpAnnotatedMessage) -> dict[str, str]:
    """``{name: AMQP type}`` for each application property of ``message`` that is not null: as the service sent
    it when ``message`` was peeked under :func:`keeping_property_types`, else as far as the decoded value tells
    (see :func:`_inferred_type`: a timestamp then reads as a long, a binary as a string)."""
    wire = getattr(message, _WIRE_TYPES_ATTRIBUTE, None) or {}
    types: dict[str, str] = {}
    for key, value in (_raw(message).application_properties or {}).items():
        if _plain(value) is None:
            continue
        name = _key(key)
        types[name] = wire.get(name) or _inferred_type(value)
    return types


def _an(amqp_type: str) -> str:
    return f"an {amqp_type}" if amqp_type == "int" else f"a {amqp_type}"


def property_value(name: str, text: str | None, amqp_type: str) -> Any:
    """The value to send for application property ``name`` whose text (as a row holds it) is of ``amqp_type``
    (a name of :data:`SENDABLE_PROPERTY_TYPES`, or ``described:<descriptor>:<one of those>``, the descriptor a
    symbol or a ``0x`` number): a plain Python value where the SDK's encoder infers that type,
    else a pyamqp typed value. A timestamp's text is its milliseconds since the epoch (what the source writes) or
    an ISO 8601 time (UTC when it has no offset); a binary's is base64. Raises ``ValueError`` naming the property,
    the text and the type when the text is not of that type: never sent as something else."""
    if text is None:
        return None
    if str(amqp_type).startswith("described:"):  # described:<descriptor>:<type>
        described, _, inner = str(amqp_type).rpartition(":")
        descriptor = described[len("described:"):]
        if inner.strip().lower() in SENDABLE_PROPERTY_TYPES and descriptor:
            code: Any = _typed(AMQPTypes.ulong, int(descriptor, 16)) if re.fullmatch(
                r"0x[0-9a-fA-F]{1,16}", descriptor) else _typed(AMQPTypes.symbol, descriptor)
            return _typed(AMQPTypes.described, (code, property_value(name, text, inner)))
    kind = str(amqp_type).strip().lower()
    where = f"application property {name!r}"
    if kind not in SENDABLE_PROPERTY_TYPES:
        raise ValueError(f"{where} has type {amqp_type!r:.40} in application_property_types, which cannot be sent "
                         f"from text (the types that can: {', '.join(SENDABLE_PROPERTY_TYPES)}): remove the property "
                         "or give it one of those types")
    wrong = ValueError(f"{where}: {text!r:.80} is not {_an(kind)} (its type in application_property_types)")
    if kind == "string":
        return text
    if kind == "symbol":
        return _typed(AMQPTypes.symbol, text)
    if kind == "binary":
        try:
            return _typed(AMQPTypes.binary, base64.b64decode(text, validate=True))
        except ValueError:  # binascii.Error too
            raise ValueError(f"{where}: {text!r:.80} is not base64 (a binary's text)") from None
    if kind == "boolean":
        flag = text.strip().lower()
        if flag not in ("true", "false"):
            raise wrong
        return flag == "true"
    if kind in _INTEGER_RANGES:
        if not _INTEGER_TEXT.fullmatch(text.strip()):
            raise wrong
        number = int(text.strip())
        low, high = _INTEGER_RANGES[kind]
        if not low <= number <= high:
            raise ValueError(f"{where}: {number} is out of range for {_an(kind)} ({low}..{high})")
        return number if kind == "int" else _typed(_BY_TYPE_NAME[kind], number)
    if kind in ("float", "double"):
        try:
            number_f = float(text)
        except ValueError:
            raise wrong from None
        if kind == "double":
            return number_f
        if math.isfinite(number_f) and abs(number_f) > _MAX_FLOAT32:
            raise ValueError(f"{where}: {text!r:.80} is out of range for a float (32 bits)")
        return _typed(AMQPTypes.float, number_f)
    if kind == "timestamp":
        stripped = text.strip()
        if _INTEGER_TEXT.fullmatch(stripped):
            ms = int(stripped)
        else:
            try:
                ms = _ms(datetime.datetime.fromisoformat(stripped))
            except ValueError:
                raise ValueError(f"{where}: {text!r:.80} is not a timestamp (milliseconds since the epoch, or "
                                 "an ISO 8601 time)") from None
        if not -(2**63) <= ms < 2**63:
            raise ValueError(f"{where}: {ms} ms is out of range for a timestamp")
        return _typed(AMQPTypes.timestamp, ms)
    if kind == "uuid":
        try:
            return uuid.UUID(text.strip())
        except ValueError:
            raise wrong from None
    try:  # decimal128
        return decimal.Decimal(text.strip())
    except decimal.InvalidOperation:
        raise wrong from None


def property_reader(amqp_type: str) -> Callable[[str, Any], Any]:
    """``read(name, text)``: :func:`property_value` for one type, faster for the types most rows carry (a string,
    a long, an int, a double): their common texts are read at once, anything else by :func:`property_value`
    (same value, same error)."""
    kind = str(amqp_type).strip().lower() if isinstance(amqp_type, str) else None
    if kind == "string":
        return _read_text
    if kind == "double":
        return _read_double
    if kind in ("long", "int"):
        return _read_long if kind == "long" else _read_int
    return functools.partial(_read_other, amqp_type)


def _read_text(name: str, text: Any) -> Any:
    return text


def _read_double(name: str, text: Any) -> Any:
    if text is None:
        return None
    try:
        return float(text)
    except (TypeError, ValueError):
        return property_value(name, text, "double")


def _digits(text: Any, most: int) -> bool:
    """True for a plain decimal integer text (an optional ``-``) of fewer than ``most`` digits."""
    if type(text) is not str:
        return False
    digits = text[1:] if text[:1] == "-" else text
    return 0 < len(digits) < most and digits.isascii() and digits.isdigit()


def _read_long(name: str, text: Any) -> Any:
    if _digits(text, 19):  # below 10**18: in range
        return _typed(AMQPTypes.long, int(text))
    return property_value(name, text, "long")


def _read_int(name: str, text: Any) -> Any:
    if _digits(text, 10):  # below 10**9: in range
        return int(text)
    return property_value(name, text, "int")


def _read_other(amqp_type: str, name: str, text: Any) -> Any:
    return property_value(name, text, amqp_type)


# --- pings and sizes -------------------------------------------------------------------------------------


def is_ping(message: ServiceBusMessage | AmqpAnnotatedMessage) -> bool:
    """True for a ping (content type ``application/vnd.ms-servicebus-ping``); every reader drops these."""
    properties = _raw(message).properties
    content_type = _as_str(properties.content_type) if properties is not None else None
    return content_type is not None and content_type.strip().lower() == PING_CONTENT_TYPE


def parked_session(received: ServiceBusMessage | AmqpAnnotatedMessage) -> tuple[str | None, str | None]:
    """``(entity, session id)`` of a backlog message, read from ``x-ms-path`` and ``x-ms-sessionid``; ``None``
    for either when it is missing or not a string (never raises: the syphon dead-letters such a message)."""
    try:
        raw = _raw(received)
    except TypeError:
        return None, None
    entries = {_key(key): value for key, value in (raw.application_properties or {}).items()}
    entity = _as_str(_plain(entries.get(X_MS_PATH))) or None
    session = _as_str(_plain(entries.get(X_MS_SESSION_ID))) if X_MS_SESSION_ID in entries else None
    return entity, session


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


def encoded_body(message: ServiceBusMessage | AmqpAnnotatedMessage) -> bytes:
    """The body section(s) of a value or sequence body as AMQP bytes (what the SDK's encoder writes), a
    received body's types restored as :func:`from_backlog` does without ``x-ms-bodytypes`` (an int beyond 32
    bits as a long); a data body's sections joined. Raises what the SDK's encoder raises."""
    raw = _raw(message)
    if raw.body_type == AmqpMessageBodyType.DATA:
        return b"".join(bytes(section) for section in raw.body)
    body = _restored_body(raw, None)
    annotated = AmqpAnnotatedMessage(**body)
    return bytes(encode_payload(bytearray(), PyamqpTransport.to_outgoing_amqp_message(annotated)))


# --- what the SDK can send -------------------------------------------------------------------------------


def received_bytes(message: ServiceBusReceivedMessage) -> bytes:
    """A received (or peeked) message as the AMQP bytes the service sent it in (sections and broker
    annotations, sequence number included): what :func:`from_received_bytes` reads back. The syphon source's
    rows carry it, so that the republisher sends without fetching the message again."""
    wire = message._message  # noqa: SLF001 (the SDK keeps the decoded AMQP message there)
    value = wire.value
    wire = wire._replace(message_annotations=_reencodable(wire.message_annotations),
                         application_properties=_reencodable(wire.application_properties),
                         value=None, sequence=_reencodable(wire.sequence))
    out = bytearray()
    encode_payload(out, wire)
    if value is not None:  # written here: the SDK's encoder drops a false value (0, "", False) and types none
        value = _reencodable(value)
        encode_value(out, {TYPE: AMQPTypes.described, VALUE: (
            {TYPE: AMQPTypes.ulong, VALUE: _AMQP_VALUE_SECTION},
            value if _is_typed(value) else {TYPE: None, VALUE: value})})
    return bytes(out)


_AMQP_VALUE_SECTION = 0x77  # the descriptor of the amqp-value body section


_INT32 = range(-(2**31), 2**31)
_INT64 = range(-(2**63), 2**63)


def _reencodable(value: Any) -> Any:
    """A value the SDK decoded, typed so that its encoder takes it back and its decoder gives the same value:
    the decoder turns timestamps and longs into plain ints, which the encoder would write as 32-bit ints."""
    if isinstance(value, dict):
        return {_reencodable(k): _reencodable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_reencodable(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and value not in _INT32:
        return amqp_long_value(value) if value in _INT64 else {TYPE: AMQPTypes.ulong, VALUE: value}
    return value


def from_received_bytes(data: bytes) -> ServiceBusReceivedMessage:
    """The message :func:`received_bytes` encoded, as the SDK's own received message (it belongs to no
    receiver: it cannot be settled through this object)."""
    return ServiceBusReceivedMessage.from_bytes(data)


def set_time_to_live(message: ServiceBusMessage, ttl: datetime.timedelta) -> None:
    """Set ``message``'s TTL to ``ttl`` in milliseconds, rounded up to a whole millisecond (never to 0).

    The SDK's own ``time_to_live`` setter keeps whole seconds only (0.5 s becomes no TTL, 1.5 s becomes 1 s);
    this sets the AMQP header's ttl directly (the SDK derives the expiry properties from it when sending).
    Raises ``ValueError`` naming ``time_to_live`` and the value for a TTL <= 0 or beyond what the header (an
    unsigned 32-bit number of milliseconds, about 49.7 days) can carry."""
    if not isinstance(ttl, datetime.timedelta):
        raise ValueError(f"time_to_live must be a timedelta, got {_type_name(ttl)} {ttl!r:.80}")
    microseconds = (ttl.days * 86_400 + ttl.seconds) * 1_000_000 + ttl.microseconds
    if microseconds <= 0:
        raise ValueError(f"time_to_live must be positive, got {ttl}")
    ms = -(-microseconds // 1000)
    if ms > _MAX_AMQP_TTL_MS:
        raise ValueError(
            f"time_to_live must be at most {_MAX_AMQP_TTL_MS} ms (about 49.7 days, what the AMQP header can "
            f"carry), got {ttl}"
        )
    raw = _raw(message)
    header = raw.header if raw.header is not None else AmqpMessageHeader()
    header.time_to_live = ms
    raw.header = header


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _seconds(ms: int) -> str:
    return f"{ms // 1000} s" if ms % 1000 == 0 else f"{ms / 1000:.3f} s"


def _encodes(value: Any) -> BaseException | None:
    """The exception the SDK's encoder raises for ``value`` (inside a map or list), or ``None``."""
    try:
        encode_value(bytearray(), value)
    except Exception as exc:  # whatever the encoder raises, this value cannot be sent
        return exc
    return None


def _leaf_problem(value: Any, exc: BaseException) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and not _MIN_INT32 <= value <= _MAX_INT32:
        return f"int {value} is out of range for the SDK's encoder ({_MIN_INT32}..{_MAX_INT32}; send a larger " \
               "number as an AMQP long, e.g. azure.servicebus._pyamqp.utils.amqp_long_value)"
    if isinstance(value, str) and isinstance(exc, UnicodeError):
        return f"str {_show(value)} is not valid Unicode text ({exc})"
    if isinstance(exc, TypeError) and not _is_typed(value):
        return f"{_type_name(value)} {_show(value)} is not a type the SDK can encode"
    return f"{_type_name(value)} {_show(value)} cannot be encoded ({type(exc).__name__}: {exc})"


def _body_problem(value: Any, where: str = "", *, top: bool = False) -> tuple[str, str] | None:
    """(where in a value or sequence body the SDK's encoder fails, why); ``None`` when it does not. At the top
    of a body the SDK encodes a typed value as a plain map."""
    exc = _encodes(_typed(AMQPTypes.null, None) if value is None else {TYPE: None, VALUE: value} if top else value)
    if exc is None:
        return None
    if isinstance(value, dict) and (top or not _is_typed(value)):
        for key, item in value.items():
            found = _body_problem(key, f"{where} key {_show(key)}".strip()) or _body_problem(
                item, f"{where}[{_show(key)}]")
            if found:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = _body_problem(item, f"{where}[{index}]")
            if found:
                return found
    return where, _leaf_problem(value, exc)


_FIELD_NAMES = {"group_id": "session_id", "reply_to_group_id": "reply_to_session_id"}
_ANNOTATION_NAMES = {_X_OPT_PARTITION_KEY: "partition_key", _X_OPT_SCHEDULED_ENQUEUE_TIME: "scheduled_enqueue_time_utc"}


def _ttl_problem(raw: AmqpAnnotatedMessage) -> str | None:
    """A TTL the SDK cannot send: beyond the AMQP header's uint, or negative (which the SDK's encoder would
    send as its absolute value)."""
    ttl = raw.header.time_to_live if raw.header is not None else None
    if ttl is None or isinstance(ttl, bool) or not isinstance(ttl, int | float):
        return None
    if ttl < 0:
        return f"time_to_live: {_seconds(int(ttl))} is negative"
    if ttl > _MAX_AMQP_TTL_MS:
        return f"time_to_live: {_seconds(int(ttl))} is beyond what the AMQP header can carry " \
               f"({_seconds(_MAX_AMQP_TTL_MS)}, about 49.7 days)"
    return None


def _problem(raw: AmqpAnnotatedMessage) -> str | None:
    """The first field of ``raw`` the SDK's encoder fails on, named as the user knows it, with its value."""
    header = raw.header
    ttl_problem = _ttl_problem(raw)
    if ttl_problem:
        return ttl_problem
    if header is not None:
        for name in ("durable", "priority", "first_acquirer", "delivery_count"):
            value = getattr(header, name, None)
            if value is not None:
                exc = _encodes(describe_performative(Header(**{name: value})))
                if exc is not None:
                    return f"header {name}: {_type_name(value)} {_show(value)} cannot be encoded ({exc})"
    properties = raw.properties
    if properties is not None:
        for name in ("message_id", "user_id", "to", "subject", "reply_to", "correlation_id", "content_type",
                     "content_encoding", "absolute_expiry_time", "creation_time", "group_id", "group_sequence",
                     "reply_to_group_id"):
            value = getattr(properties, name, None)
            if value is None:
                continue
            exc = _encodes(describe_performative(Properties(**{name: value})))
            if exc is not None:
                return f"{_FIELD_NAMES.get(name, name)}: {_leaf_problem(value, exc)}"
    for section, entries in (("message annotation", raw.annotations), ("delivery annotation",
                                                                      raw.delivery_annotations),
                             ("footer", raw.footer)):
        for key, value in (entries or {}).items():
            exc = _encodes(encode_annotations({key: value}))
            if exc is not None:
                name = _ANNOTATION_NAMES.get(_key(key)) or f"{section} {_show(_key(key))}"
                return f"{name}: {_leaf_problem(value, exc)}"
    for key, value in (raw.application_properties or {}).items():
        name = f"application property {_show(_key(key))}"
        if not isinstance(key, str | bytes):
            return f"{name}: the name is a {_type_name(key)}, not a string"
        if isinstance(value, bytes | bytearray):
            binary = bytes(value)
            try:
                value = binary.decode("utf-8")  # what the SDK does to a bytes value before sending it
            except UnicodeDecodeError:
                return f"{name}: bytes {_show(binary)} are not UTF-8 text (the SDK sends bytes as a string)"
        exc = _encodes(encode_application_properties({key: value}))
        if exc is not None:
            if _encodes(encode_application_properties({key: None})) is not None:
                return f"{name}: the name is not valid Unicode text"
            return f"{name}: {_leaf_problem(value, exc)}"
    if raw.body_type == AmqpMessageBodyType.VALUE:
        found = _body_problem(raw.body, top=True)
        if found:
            return f"value body{' ' + found[0] if found[0] else ''}: {found[1]}"
    elif raw.body_type == AmqpMessageBodyType.SEQUENCE:
        for index, section in enumerate(raw.body):
            found = _body_problem(section, top=True)
            if found:
                return f"sequence body section {index}{' ' + found[0] if found[0] else ''}: {found[1]}"
    else:
        for index, section in enumerate(raw.body or ()):
            if not isinstance(section, bytes | bytearray | memoryview):
                return f"data body section {index}: {_type_name(section)} {_show(section)} is not bytes"
    return None


def check_encodable(message: ServiceBusMessage, entity: str) -> None:
    """Raise :class:`~spark_sb.errors.BadMessageError` (``message_id``, ``entity``, reason) when the SDK cannot
    encode ``message``; the reason names the field and its value, e.g. ``application property 'n': int
    3000000000 is out of range for the SDK's encoder``, ``application property 'b': bytes b'\\xff' are not UTF-8
    text``, ``time_to_live: -1 s is negative`` (the SDK would send its absolute value). One encode attempt
    (:func:`message_size`) in the common case; only a failure looks field by field for the culprit.
    ``message`` is not modified."""
    _check_encodable(_raw(message), entity)


def check_time_to_live(message: ServiceBusMessage, entity: str) -> None:
    """Raise :class:`~spark_sb.errors.BadMessageError` when ``message``'s TTL is one the SDK cannot send
    (negative, or beyond the AMQP header's range): the part of :func:`check_encodable` that needs no encode."""
    if wire.is_encoded(message):
        return  # built without a TTL
    raw = _raw(message)
    problem = _ttl_problem(raw)
    if problem:
        properties = raw.properties
        raise BadMessageError(_str_or_raw(properties.message_id) if properties is not None else None, entity,
                              problem)


def _check_encodable(raw: AmqpAnnotatedMessage, entity: str, sent: AmqpAnnotatedMessage | None = None) -> None:
    """:func:`check_encodable` of ``raw``, or of ``sent`` (a rewrite of ``raw``) when given: a failure is
    then explained by ``raw``'s fields where they are the cause."""
    properties = raw.properties
    message_id = _str_or_raw(properties.message_id) if properties is not None else None
    ttl_problem = _ttl_problem(raw)
    if ttl_problem:
        raise BadMessageError(message_id, entity, ttl_problem)
    try:
        message_size(raw if sent is None else sent)
    except Exception as exc:  # any failure of the SDK's encoder: this message can never be sent
        reason = (_problem(raw) or (None if sent is None else _problem(sent))
                  or f"the SDK cannot encode it ({type(exc).__name__}: {exc})")
        raise BadMessageError(message_id, entity, reason) from exc
