"""A message's bytes built at once from its fields, the bytes the SDK's encoder writes (issue 50).

azure-servicebus builds a ``ServiceBusMessage`` (an ``AmqpAnnotatedMessage`` and its sections), converts it to its
wire ``Message`` and encodes it twice when a batch takes it (once to size it, once to add it), in pure Python: three
quarters of the sink's CPU per message. :func:`encoded_message` builds what the sink sends (a data body, the
message properties, a partition key, a header's durable and priority, application properties of the types a
row's can have) straight into the AMQP bytes of
``_pyamqp/_encode.py``'s ``encode_payload``, the same bytes (tests/test_wire.py compares them over generated
messages), and returns an :class:`EncodedMessage`: a ``ServiceBusMessage`` that carries them, and becomes a full SDK
message the first time anything but its ids is asked of it (the bytes are then dropped, and the SDK encodes it as
any other). :func:`append` adds its bytes to a ``ServiceBusMessageBatch`` as ``add_message`` would, without
encoding anything. What it does not cover (a TTL, a scheduled time, bytes or a string that are not UTF-8, a
value of another type) it leaves to the SDK (``None``), as does :func:`append` when a tracer is configured or the batch lacks an
internal it writes (:func:`missing_internals`; said once).
"""

from __future__ import annotations

import datetime
import decimal
import logging
import struct
import threading
import uuid
from collections.abc import Mapping
from typing import Any, NamedTuple

from azure.servicebus import ServiceBusMessage, ServiceBusMessageBatch
from azure.servicebus._pyamqp._encode import encode_value
from azure.servicebus._pyamqp.types import TYPE, VALUE, AMQPTypes
from azure.servicebus._transport._pyamqp_transport import PyamqpTransport
from azure.servicebus.amqp import AmqpMessageHeader
from azure.servicebus.exceptions import MessageSizeExceededError

_LOGGER = logging.getLogger(__name__)

__all__ = ["EncodedMessage", "Fields", "append", "encoded_message", "is_encoded", "missing_internals", "not_covered"]

_MAX_ID_LENGTH = 128  # the SDK's limit for a message id, a session id and a partition key
_INT32 = range(-(2**31), 2**31)
_PACK_D = struct.Struct(">d").pack
_PACK_I = struct.Struct(">i").pack
_PACK_L = struct.Struct(">L").pack
_PACK_Q = struct.Struct(">q").pack
_INT64 = range(-(2**63), 2**63)

_HEADER = b"\x00\x53\x70"
_ANNOTATIONS = b"\x00\x53\x72"
_PROPERTIES = b"\x00\x53\x73"
_APPLICATION_PROPERTIES = b"\x00\x53\x74"
_DATA = b"\x00\x53\x75"
_NULL = b"\x40"
_PARTITION_KEY = b"\xa3\x13x-opt-partition-key"


class Fields(NamedTuple):
    """What an :class:`EncodedMessage` was built from, as ``ServiceBusMessage``'s keyword arguments name it."""

    body: bytes
    message_id: str
    session_id: str | None = None
    partition_key: str | None = None
    subject: str | None = None
    content_type: str | None = None
    correlation_id: str | None = None
    to: str | None = None
    reply_to: str | None = None
    application_properties: Mapping[str, Any] | None = None
    #: the header's (a received message's, restored by the syphon)
    durable: bool | None = None
    priority: int | None = None

    def sdk_message(self) -> ServiceBusMessage:
        """The SDK's message of these fields."""
        kwargs = {name: value for name, value in self._asdict().items()
                  if value is not None and name not in ("body", "durable", "priority")}
        if self.application_properties is not None:
            kwargs["application_properties"] = dict(self.application_properties)
        message = ServiceBusMessage(self.body, **kwargs)
        if self.durable is not None or self.priority is not None:
            message.raw_amqp_message.header = AmqpMessageHeader(durable=self.durable, priority=self.priority)
        return message


class _Unsupported(Exception):
    """A value :func:`encoded_message` leaves to the SDK (``reason``: what it is, without the value)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


_NOTED: set[str] = set()


def not_covered(reason: str) -> None:
    """Say once per process and ``reason`` (e.g. "a time to live") that such messages are encoded by the SDK."""
    if reason not in _NOTED:
        _NOTED.add(reason)
        _LOGGER.info("messages with %s are encoded by the SDK (spark_sb.wire covers the others)", reason)


def _utf8(value: str) -> bytes:
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: the SDK says what it makes of it
        raise _Unsupported("a string that is not UTF-8 (a lone surrogate)") from None


def _variable(small: int, large: int, data: bytes) -> bytes:
    n = len(data)
    return bytes((small, n)) + data if n <= 255 else bytes((large,)) + _PACK_L(n) + data


def _string(value: str) -> bytes:
    return _variable(0xA1, 0xB1, _utf8(value))


_KEYS: dict[str, bytes] = {}  # application property names, encoded (bounded: cleared when full)


def _key(name: str) -> bytes:
    encoded = _KEYS.get(name)
    if encoded is None:
        if len(_KEYS) >= 4096:
            _KEYS.clear()
        encoded = _KEYS[name] = _string(name)
    return encoded


def _field(value: str | None) -> bytes:
    return _NULL if value is None else _string(value)


def _symbol(value: str | None) -> bytes:
    return _NULL if value is None else _variable(0xA3, 0xB3, _utf8(value))


def _compound(small: int, large: int, count: int, content: bytes) -> bytes:
    """A list (0xc0/0xd0) or map (0xc1/0xd1) of ``count`` items, as the SDK sizes them."""
    size = len(content)
    if count <= 255 and size < 255:
        return bytes((small, size + 1, count)) + content
    return bytes((large,)) + _PACK_L(size + 4) + _PACK_L(count) + content


def _value(value: Any) -> bytes:
    """An application property's value, as ``encode_value`` writes it inside a map."""
    kind = type(value)
    if kind is str:
        return _string(value)
    if kind is bool:
        return b"\x56\x01" if value else b"\x56\x00"
    if kind is int:
        if -128 <= value <= 127:
            return bytes((0x54, value & 0xFF))
        if value in _INT32:
            return b"\x71" + _PACK_I(value)
        raise _Unsupported("an int property beyond 32 bits")  # the SDK refuses it: its error names it
    if kind is float:
        return b"\x82" + _PACK_D(value)
    if value is None:
        return _NULL
    if isinstance(value, dict) and TYPE in value and VALUE in value and not isinstance(value[VALUE], dict | list):
        inner = value[VALUE]
        if value[TYPE] == AMQPTypes.long and type(inner) is int and inner in _INT64:  # encode_long's bytes
            return bytes((0x55, inner & 0xFF)) if -128 <= inner <= 127 else b"\x81" + _PACK_Q(inner)
        return _sdk_value(value, value[TYPE])  # a typed value (a long, a symbol, a timestamp...)
    if kind is bytes:  # the SDK sends bytes as a string (uamqp's habit)
        try:
            return _string(value.decode("utf-8"))
        except UnicodeDecodeError:
            raise _Unsupported("a bytes property that is not UTF-8") from None
    if isinstance(value, datetime.datetime | uuid.UUID | decimal.Decimal):
        return _sdk_value(value, kind.__name__)  # a timestamp, a UUID, a decimal128
    raise _Unsupported(f"a {kind.__name__} property")


def _sdk_value(value: Any, kind: str) -> bytes:
    """``value`` as the SDK's own value encoder writes it (``kind`` names it in the log when it cannot)."""
    out = bytearray()
    try:
        encode_value(out, value)
    except Exception:
        raise _Unsupported(f"a {kind} property the SDK cannot encode") from None
    return bytes(out)


def _application_properties(properties: Mapping[str, Any]) -> bytes:
    parts = []
    for key, value in properties.items():
        if type(key) is not str:
            raise _Unsupported(f"a {type(key).__name__} property name")
        parts.append(_key(key))
        parts.append(_value(value))
    return _APPLICATION_PROPERTIES + _compound(0xC1, 0xD1, 2 * len(properties), b"".join(parts))


def encode(fields: Fields) -> bytes:
    """The AMQP bytes of the message of ``fields`` (``encode_payload``'s); raises ``_Unsupported``."""
    out = []
    if fields.durable is not None or fields.priority is not None:
        out.append(_HEADER + _compound(0xC0, 0xD0, 5, b"".join((
            _NULL if fields.durable is None else b"\x56\x01" if fields.durable else b"\x56\x00",
            _NULL if fields.priority is None else bytes((0x50, fields.priority)), _NULL * 3))))
    if fields.partition_key is not None:
        out.append(_ANNOTATIONS + _compound(0xC1, 0xD1, 2, _PARTITION_KEY + _string(fields.partition_key)))
    properties = b"".join((
        _string(fields.message_id), _NULL, _field(fields.to), _field(fields.subject), _field(fields.reply_to),
        _field(fields.correlation_id), _symbol(fields.content_type), _NULL * 3, _field(fields.session_id),
        _NULL * 2))
    out.append(_PROPERTIES + _compound(0xC0, 0xD0, 13, properties))
    if fields.application_properties:
        out.append(_application_properties(fields.application_properties))
    out.append(_DATA + _variable(0xA0, 0xB0, fields.body))
    return b"".join(out)


def _short_id(value: Any) -> bool:
    return value is None or (type(value) is str and len(value) <= _MAX_ID_LENGTH)


def encoded_message(body: bytes | str, message_id: str, *, session_id: str | None = None,
                    partition_key: str | None = None, subject: str | None = None, content_type: str | None = None,
                    correlation_id: str | None = None, to: str | None = None, reply_to: str | None = None,
                    application_properties: Mapping[str, Any] | None = None, durable: bool | None = None,
                    priority: int | None = None, lazy: bool = False) -> EncodedMessage | None:
    """The message ``ServiceBusMessage(body, message_id=..., ...)`` builds, with its bytes built at once; ``None``
    when this module does not cover it (build it with the SDK: its checks and errors are then the SDK's).
    ``lazy``: its bytes are built when first asked for (a message rewritten for the backlog never needs its own);
    a value not covered is then found there, and the message becomes the SDK's."""
    if type(body) is str:
        try:
            body = body.encode("utf-8")
        except UnicodeEncodeError:
            return None
    if type(body) is not bytes or not (_short_id(message_id) and _short_id(session_id) and _short_id(partition_key)):
        return None
    if not message_id or (partition_key is not None and session_id is not None and partition_key != session_id):
        return None  # an empty id is the SDK's to make up (a UUID); two keys that differ, its to refuse
    for text in (subject, content_type, correlation_id, to, reply_to):
        if text is not None and type(text) is not str:
            return None
    if (durable is not None and type(durable) is not bool) or (priority is not None and (
            type(priority) is not int or not 0 <= priority <= 255)):
        return None
    fields = Fields(body, message_id, session_id, partition_key, subject, content_type, correlation_id, to,
                    reply_to, application_properties or None, durable, priority)
    if lazy:
        return EncodedMessage(fields, _LATER)
    try:
        return EncodedMessage(fields, encode(fields))
    except _Unsupported as unsupported:
        not_covered(unsupported.reason)
        return None


_LATER: Any = object()  # an EncodedMessage's bytes, not built yet


def _id_property(name: str) -> Any:
    """An id of an :class:`EncodedMessage` (``message_id``, ``session_id``, ``partition_key``), read from its fields
    while it carries its bytes (without building the SDK's message); set, it becomes the SDK's message first."""

    def get(self: EncodedMessage) -> str | None:
        if self._encoded is not None:
            value: str | None = getattr(self._fields, name)
            return value
        return _sdk_property(self, name)

    def set(self: EncodedMessage, value: str | None) -> None:
        self._materialize()
        vars(ServiceBusMessage)[name].fset(self, value)

    return property(get, set, doc=vars(ServiceBusMessage)[name].__doc__)


class EncodedMessage(ServiceBusMessage):
    """A ``ServiceBusMessage`` built by :func:`encoded_message`: it carries its bytes and its ids; the first use of
    anything else builds the SDK's message in it (``ServiceBusMessage(**fields)``) and drops the bytes, so that
    whatever is then changed is encoded by the SDK."""

    def __init__(self, fields: Fields, encoded: bytes) -> None:  # noqa: D107 - the SDK's __init__ runs later, if ever
        self._fields = fields
        self._encoded: Any = encoded  # bytes; _LATER; None once the SDK's message

    @property
    def encoded(self) -> bytes | None:
        """The message's bytes, or ``None`` once it became an SDK message (or it is one that this module does not
        cover: it becomes the SDK's then)."""
        encoded: bytes | None = self._encoded
        if encoded is _LATER:
            try:
                encoded = self._encoded = encode(self._fields)
            except _Unsupported as unsupported:
                not_covered(unsupported.reason)
                with _MATERIALIZING:
                    self._materialize()
                return None
        return encoded

    @property
    def fields(self) -> Fields:
        return self._fields

    def _materialize(self) -> None:
        if self._encoded is None and "_raw_amqp_message" in self.__dict__:
            return
        sdk = self._fields.sdk_message()
        self.__dict__.update(sdk.__dict__)
        self._encoded = None

    def __getattr__(self, name: str) -> Any:
        # reached only for what is not set: the SDK's own attributes, built on first use
        if name.startswith("__") or name in ("_fields", "_encoded"):
            raise AttributeError(name)
        with _MATERIALIZING:
            self._materialize()
        return object.__getattribute__(self, name)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # pickled or copied: as fields while it carries its bytes (built again on use), else as the SDK's message
        if self._encoded is not None:
            return _lazy, (self._fields,)
        return super().__reduce_ex__(protocol)

    message_id = _id_property("message_id")
    session_id = _id_property("session_id")
    partition_key = _id_property("partition_key")


_MATERIALIZING = threading.RLock()


def _lazy(fields: Fields) -> EncodedMessage:
    return EncodedMessage(fields, _LATER)


def _sdk_property(message: ServiceBusMessage, name: str) -> str | None:
    """``ServiceBusMessage``'s own property ``name`` of ``message``."""
    value: str | None = vars(ServiceBusMessage)[name].fget(message)
    return value


def is_encoded(message: object) -> bool:
    """Whether ``message`` still carries the bytes :func:`encoded_message` built."""
    return isinstance(message, EncodedMessage) and message._encoded is not None


# --- into a batch -------------------------------------------------------------------------------------------

_OVERHEAD = (5, 8)  # what a message adds to a batch besides its bytes (the SDK's _BATCH_MESSAGE_OVERHEAD_COST)


def missing_internals(batch: ServiceBusMessageBatch) -> list[str]:
    """The internals of the SDK's batch :func:`append` writes that ``batch`` lacks (empty when it has them)."""
    missing = [f"ServiceBusMessageBatch.{name}" for name in ("_message", "_size", "_count", "_messages")
               if not hasattr(batch, name)]
    if not callable(getattr(PyamqpTransport, "set_batch_envelope_properties", None)):
        missing.append("PyamqpTransport.set_batch_envelope_properties")
    return missing


_checked: dict[str, bool] = {}


def _appendable(batch: Any) -> bool:
    """Whether :func:`append` may write into ``batch``: the SDK has what it writes and no tracer is configured
    (the SDK adds each message a span and its trace properties); asked once per batch."""
    known: bool | None = getattr(batch, "_spark_sb_appendable", None)
    if known is None:
        known = _check_appendable(batch)
        try:
            batch._spark_sb_appendable = known
        except AttributeError:  # a batch without a __dict__: asked each time
            pass
    return known


def _check_appendable(batch: Any) -> bool:
    from azure.core.settings import settings

    if settings.tracing_implementation() is not None:
        return False
    ok = _checked.get("batch")
    if ok is None:
        missing = missing_internals(batch)
        ok = _checked["batch"] = not missing
        if missing:
            _LOGGER.warning("this azure-servicebus lacks %s: messages are encoded by the SDK (add_message)",
                            ", ".join(missing))
    return ok and type(batch._message) is list


def append(batch: Any, message: ServiceBusMessage) -> bool:
    """Add ``message`` to ``batch`` (a ``ServiceBusMessageBatch``) as ``batch.add_message`` would, from the bytes
    it carries: ``False`` (nothing done) when it carries none or the batch cannot take them this way (then
    ``add_message``). Raises the SDK's ``MessageSizeExceededError`` when it does not fit."""
    if not isinstance(message, EncodedMessage) or message._encoded is None or not _appendable(batch):
        return False
    encoded = message.encoded
    if encoded is None:
        return False
    size = len(encoded)
    after = batch._size + size + _OVERHEAD[0 if size < 256 else 1]
    if after > batch.max_size_in_bytes:
        raise MessageSizeExceededError(message=f"ServiceBusMessageBatch has reached its size limit: "
                                               f"{batch.max_size_in_bytes}")
    batch._message[5].append(encoded)
    batch._size = after
    batch._count += 1
    batch._messages.append(message)
    if batch._count == 1:  # the batch envelope takes the first message's ids, as the SDK does
        fields = message._fields
        batch._amqp_transport.set_batch_envelope_properties(batch._message, fields.message_id, fields.session_id,
                                                            fields.partition_key)
    return True
