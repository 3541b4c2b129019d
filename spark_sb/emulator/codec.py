"""AMQP message bytes: split into sections, unpack batches, and render messages for delivery.

Stored messages are kept exactly as the client encoded them. Delivery only replaces the header
(delivery count), merges the broker's annotations into the message annotations, and for dead-lettered
messages adds the reason to the application properties; every other section goes out byte for byte.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from proton import Array, Data, Described, int32, symbol, timestamp, ulong

from .broker import DLQ_SUFFIX, BrokerError, Incoming, Stored
from .model import RuleSpec
from .sections import (  # noqa: F401 - part of this module's interface
    _BODY,
    APPLICATION_PROPERTIES,
    DATA,
    DELIVERY_ANNOTATIONS,
    FOOTER,
    HEADER,
    MESSAGE_ANNOTATIONS,
    PROPERTIES,
    SEQUENCE,
    VALUE,
    MalformedMessage,
    _decode,
    _encode,
    _skip,
    check_depth,
    rewrite,
    split_sections,
    with_message_id,
)

X_OPT_SEQUENCE_NUMBER = symbol("x-opt-sequence-number")
X_OPT_ENQUEUED_TIME = symbol("x-opt-enqueued-time")
X_OPT_LOCKED_UNTIL = symbol("x-opt-locked-until")
X_OPT_LOCK_TOKEN = symbol("x-opt-lock-token")
X_OPT_MESSAGE_STATE = symbol("x-opt-message-state")
X_OPT_DEADLETTER_SOURCE = symbol("x-opt-deadletter-source")
X_OPT_SCHEDULED = "x-opt-scheduled-enqueue-time"
X_OPT_PARTITION_KEY = "x-opt-partition-key"
#: the service's condition for a request argument it cannot take (answered 400 on $management)
ARGUMENT_ERROR = "com.microsoft:argument-error"




def _data_payload(section: bytes) -> bytes:
    """The binary of a data section (descriptor 00 53 75 then vbin8/vbin32)."""
    off = 3 if section[1] == 0x53 else len(section) - _value_len_from_end(section)
    c = section[off]
    if c == 0xA0:
        return section[off + 2 : off + 2 + section[off + 1]]
    if c == 0xB0:
        n = int.from_bytes(section[off + 1 : off + 5], "big")
        return section[off + 5 : off + 5 + n]
    raise MalformedMessage("data section does not hold binary")


def _value_len_from_end(section: bytes) -> int:
    # descriptor forms other than 0x53 are rare; find the value by skipping the descriptor
    return len(section) - _skip(section, 1)


def _looks_like_message(payload: bytes) -> bool:
    try:
        secs = split_sections(payload)
    except (MalformedMessage, IndexError):
        return False
    # a body section is not required: the SDK encodes a message with a None value body without one
    return all(HEADER <= c <= FOOTER for c, _ in secs)


def unpack(raw: bytes) -> list[bytes]:
    """The messages carried by one transfer: the inner messages of a batch envelope (message format
    0x80013700, one data section per encoded message) or the transfer itself.

    Proton does not expose the transfer's message format, so a batch is recognised by its shape: every
    data section of the envelope is itself a complete AMQP message. When only some are, the transfer is
    refused as malformed rather than guessed at, so that no message is ever stored wrongly or dropped. A single
    message whose body bytes all happen to be encoded AMQP messages would be taken for a batch (documented)."""
    sections = split_sections(raw)
    datas = [s for c, s in sections if c == DATA]
    if not datas or any(c in (SEQUENCE, VALUE) for c, _ in sections):
        return [raw]
    payloads = [_data_payload(s) for s in datas]
    shaped = [_looks_like_message(p) for p in payloads]
    if all(shaped):
        return payloads
    if any(shaped):
        raise MalformedMessage("a batch envelope whose data sections are not all encoded AMQP messages")
    return [raw]


def _to_epoch(value: Any) -> float | None:
    if value is None:
        return None
    return float(value) / 1000.0


def text(value: Any) -> str | None:
    """An AMQP string-ish value (str, symbol, bytes, uuid, ...) as text; None stays None."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


_PROPERTY_FIELDS = ("message_id", "user_id", "to", "subject", "reply_to", "correlation_id", "content_type",
                    "content_encoding", "absolute_expiry_time", "creation_time", "group_id", "group_sequence",
                    "reply_to_group_id")


def _fields(section: bytes | None, names: tuple[str, ...]) -> dict[str, Any]:
    if section is None:
        return {}
    values = list(_decode(section).value or [])
    return dict(zip(names, values, strict=False))


def _map(section: bytes | None) -> dict[str, Any]:
    if section is None:
        return {}
    value = _decode(section).value
    return {str(k): v for k, v in value.items()} if isinstance(value, dict) else {}


@dataclass(frozen=True)
class Parts:
    """One stored message's sections decoded, for people to read (the live page): ``body`` is the bytes of its data
    sections joined, or the value of its amqp-value section, or the lists of its amqp-sequence sections, or None;
    ``body_kind`` says which (``data``, ``value``, ``sequence``, ``none``)."""

    header: dict[str, Any]
    properties: dict[str, Any]
    annotations: dict[str, Any]
    application: dict[str, Any]
    body: Any
    body_kind: str


def _head(raw: bytes, each: Callable[[int, bytes], None] | None = None
          ) -> tuple[dict[int, bytes], dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A message's sections by code (the first of each) and its header, properties, message annotations and
    application properties decoded; ``each(code, section)`` sees every section on the way. Raises
    MalformedMessage."""
    try:
        by_code: dict[int, bytes] = {}
        for code, sec in split_sections(raw):
            by_code.setdefault(code, sec)
            if each is not None:
                each(code, sec)
        header = _fields(by_code.get(HEADER), ("durable", "priority", "ttl", "first_acquirer", "delivery_count"))
        props = _fields(by_code.get(PROPERTIES), _PROPERTY_FIELDS)
        ann = _map(by_code.get(MESSAGE_ANNOTATIONS))
        app = _map(by_code.get(APPLICATION_PROPERTIES))
    except MalformedMessage:
        raise
    except Exception as err:  # noqa: BLE001 - proton raises its own error types
        raise MalformedMessage(f"cannot decode AMQP message: {err}") from err
    return by_code, header, props, ann, app


def parts(raw: bytes) -> Parts:
    """The sections of an encoded message, decoded (:class:`Parts`). Raises MalformedMessage."""
    datas: list[bytes] = []
    sequences: list[Any] = []
    values: list[Any] = []

    def body(code: int, sec: bytes) -> None:
        if code == DATA:
            datas.append(bytes(_data_payload(sec)))
        elif code == SEQUENCE:
            sequences.append(_decode(sec).value)
        elif code == VALUE:
            values.append(_decode(sec).value)

    _, header, props, ann, app = _head(raw, body)
    if datas:
        return Parts(header, props, ann, app, b"".join(datas), "data")
    if sequences:
        return Parts(header, props, ann, app, sequences, "sequence")
    if values:
        return Parts(header, props, ann, app, values[0], "value")
    return Parts(header, props, ann, app, None, "none")


def incoming(raw: bytes) -> Incoming:
    """Decode what the broker needs from one encoded message: header, properties, annotations and application
    properties. The body is never decoded (any AMQP value is kept as the client sent it)."""
    _, header, props, ann, app = _head(raw)
    ttl = header.get("ttl")
    message_id = text(props.get("message_id"))
    if message_id is None:
        # Service Bus gives every message an id: "ServiceBus sets an ID as default, only if the application
        # doesn't set its own ID" (its team, azure-service-bus-java#69). The JavaScript SDK sends none unless told
        # and keys its lock renewal on it ("Failed to stop auto lock renewal - no message ID" at settlement)
        message_id = uuid.uuid4().hex
        raw = with_message_id(raw, message_id)
    return Incoming(
        raw=bytes(raw),
        message_id=message_id,
        session_id=text(props.get("group_id")),
        ttl=float(ttl) / 1000.0 if ttl else None,  # the header carries milliseconds
        scheduled_enqueue_time=_to_epoch(ann.get(X_OPT_SCHEDULED)),
        partition_key=text(ann.get(X_OPT_PARTITION_KEY)),
        filter_fields={
            "message_id": message_id,
            "correlation_id": text(props.get("correlation_id")),
            "to": text(props.get("to")),
            "reply_to": text(props.get("reply_to")),
            "subject": text(props.get("subject")),
            "session_id": text(props.get("group_id")),
            "reply_to_session_id": text(props.get("reply_to_group_id")),
            "content_type": text(props.get("content_type")),
            "properties": app,
        },
    )



def _header(original: bytes | None, delivery_count: int) -> bytes:
    durable, priority, ttl, first = False, None, None, None
    if original is not None:
        fields = _decode(original).value or []
        fields = list(fields) + [None] * (5 - len(fields))
        durable, priority, ttl, first = fields[0], fields[1], fields[2], fields[3]
    d = Data()
    d.put_described()
    d.enter()
    d.put_ulong(HEADER)
    d.put_list()
    d.enter()
    d.put_bool(bool(durable))
    if priority is None:
        d.put_null()
    else:
        d.put_ubyte(int(priority))
    if ttl is None:
        d.put_null()
    else:
        d.put_uint(int(ttl))
    d.put_bool(bool(first))
    d.put_uint(max(0, delivery_count))
    d.exit()
    d.exit()
    return bytes(d.encode())


def _merge_map(original: bytes | None, code: int, extra: dict[Any, Any]) -> bytes:
    base: dict[Any, Any] = {}
    if original is not None:
        value = _decode(original).value
        if isinstance(value, dict):
            base = dict(value)
    base.update(extra)
    return _encode(Described(ulong(code), base))


def render(
    stored: Stored,
    *,
    lock_token: uuid.UUID | None = None,
    locked_until: float | None = None,
    peeked: bool = False,
    tagless: bool = False,
) -> bytes:
    """The message as a receiver sees it: broker annotations merged into the client's own bytes.

    ``tagless``: the message travels in a ``$management`` answer (receive-by-sequence-number), with no delivery tag
    to carry its lock: the lock token also goes in the delivery annotations (``x-opt-lock-token``), where a client
    that decodes the message reads it, as the service puts it."""
    sections = split_sections(stored.raw)
    by_code: dict[int, bytes] = {}
    for code, sec in sections:
        by_code.setdefault(code, sec)
    ann: dict[Any, Any] = {
        X_OPT_SEQUENCE_NUMBER: stored.sequence_number,
        X_OPT_ENQUEUED_TIME: timestamp(int(stored.enqueued_time * 1000)),
        X_OPT_MESSAGE_STATE: int32(stored.state),
    }
    if locked_until is not None:
        ann[X_OPT_LOCKED_UNTIL] = timestamp(int(locked_until * 1000))
    if lock_token is not None:
        ann[X_OPT_LOCK_TOKEN] = lock_token
    if stored.dead_letter_source:
        ann[X_OPT_DEADLETTER_SOURCE] = stored.dead_letter_source
    # the service reports the number of earlier deliveries; the broker counts this one already
    count = stored.delivery_count if peeked else stored.delivery_count - 1
    out = [_header(by_code.get(HEADER), count)]
    if tagless and lock_token is not None:
        out.append(_merge_map(by_code.get(DELIVERY_ANNOTATIONS), DELIVERY_ANNOTATIONS, {X_OPT_LOCK_TOKEN: lock_token}))
    elif DELIVERY_ANNOTATIONS in by_code:
        out.append(by_code[DELIVERY_ANNOTATIONS])
    out.append(_merge_map(by_code.get(MESSAGE_ANNOTATIONS), MESSAGE_ANNOTATIONS, ann))
    if PROPERTIES in by_code:
        out.append(by_code[PROPERTIES])
    if stored.entity.endswith(DLQ_SUFFIX) and (stored.dead_letter_reason or stored.dead_letter_description):
        extra = {}
        if stored.dead_letter_reason is not None:
            extra["DeadLetterReason"] = stored.dead_letter_reason
        if stored.dead_letter_description is not None:
            extra["DeadLetterErrorDescription"] = stored.dead_letter_description
        out.append(_merge_map(by_code.get(APPLICATION_PROPERTIES), APPLICATION_PROPERTIES, extra))
    elif APPLICATION_PROPERTIES in by_code:
        out.append(by_code[APPLICATION_PROPERTIES])
    out.extend(sec for code, sec in sections if code in _BODY or code == FOOTER)
    return b"".join(out)


def iter_incoming(raw: bytes) -> Iterator[Incoming]:
    for payload in unpack(raw):
        yield incoming(payload)


# ------------------------------------------------------------------ $management request fields
_MISSING: Any = object()
_AMQP_NAMES = {type(None): "null", bool: "boolean", int: "long", int32: "int", ulong: "ulong", str: "string",
               symbol: "symbol", bytes: "binary", memoryview: "binary", uuid.UUID: "uuid", timestamp: "timestamp",
               float: "double", list: "list", dict: "map", Described: "described value"}


def amqp_type(value: Any) -> str:
    """The AMQP name of a decoded value's type, for an error message (``string``, ``list``, ``array of long``)."""
    if isinstance(value, Array):
        return f"array of {_ARRAY_NAMES.get(value.type, 'type ' + str(value.type))}"
    return _AMQP_NAMES.get(type(value), type(value).__name__)


_ARRAY_NAMES = {Data.LONG: "long", Data.INT: "int", Data.ULONG: "ulong", Data.UINT: "uint", Data.UUID: "uuid",
                Data.STRING: "string", Data.SYMBOL: "symbol", Data.BINARY: "binary", Data.MAP: "map",
                Data.TIMESTAMP: "timestamp", Data.LIST: "list"}


def _is_integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _as_uuid(v: Any) -> uuid.UUID | None:
    if isinstance(v, uuid.UUID):
        return v
    if isinstance(v, bytes | memoryview) and len(v) == 16:
        return uuid.UUID(bytes=bytes(v))
    if isinstance(v, str):
        try:
            return uuid.UUID(v)
        except ValueError:
            return None
    return None


#: what each expected kind accepts, and how it is converted
_SCALARS: dict[str, Any] = {
    "long": (_is_integer, int),
    "string": (lambda v: isinstance(v, str), str),
    "binary": (lambda v: isinstance(v, bytes | memoryview), bytes),
    "map": (lambda v: isinstance(v, dict), lambda v: {str(k): x for k, x in v.items()}),
    "uuid": (lambda v: _as_uuid(v) is not None, _as_uuid),
    # a string-ish value the service reads as text (a correlation filter's ids: string, binary or uuid)
    "text": (lambda v: isinstance(v, str | bytes | uuid.UUID), text),
}


def request_field(body: dict[str, Any], name: str, kind: str, default: Any = _MISSING) -> Any:
    """Field ``name`` of a ``$management`` request body, of the AMQP ``kind`` (``long``, ``string``, ``binary``,
    ``map``, ``uuid``, or ``list of`` one of them: a list or an array), converted (a list of ``kind`` comes back as a
    Python list). A missing or null field is ``default``, or an error when there is none. Any other value is a
    :class:`BrokerError` with ``com.microsoft:argument-error`` (answered 400) naming the field and what it got."""
    value = body.get(name)
    if value is None:
        if default is _MISSING:
            raise BrokerError(ARGUMENT_ERROR, f"The request's '{name}' is required ({kind}); it is missing.")
        return default
    accepts, convert = _SCALARS[kind.removeprefix("list of ")]
    if kind.startswith("list of "):
        items = list(value.elements) if isinstance(value, Array) else value if isinstance(value, list) else None
        if items is not None and all(accepts(v) for v in items):
            return [convert(v) for v in items]
    elif accepts(value):
        return convert(value)
    raise BrokerError(ARGUMENT_ERROR, f"The request's '{name}' must be a {kind}; got a {amqp_type(value)}"
                      f"{_element_types(value)}.")


def _element_types(value: Any) -> str:
    if isinstance(value, list) and value:
        return " of " + ", ".join(sorted({amqp_type(v) for v in value}))
    return ""


# ------------------------------------------------------------------ rules on $management (the rule manager)
#: the descriptors of a rule description and its parts, as the service and the SDKs encode them
RULE_DESCRIPTION = 0x13700000004
SQL_FILTER = 0x1370000006
TRUE_FILTER = 0x1370000007
FALSE_FILTER = 0x1370000008
CORRELATION_FILTER = 0x1370000009
EMPTY_RULE_ACTION = 0x13700000005
SQL_RULE_ACTION = 0x13700000006
_SQL_COMPATIBILITY_LEVEL = int32(20)
#: the correlation filter's fields in the order of its described list; the map keys of add-rule name them
_CORRELATION_WIRE = (("correlation-id", "correlation_id"), ("message-id", "message_id"), ("to", "to"),
                     ("reply-to", "reply_to"), ("label", "subject"), ("session-id", "session_id"),
                     ("reply-to-session-id", "reply_to_session_id"), ("content-type", "content_type"))


def _dotted(value: dict[str, Any], prefix: str) -> dict[str, Any]:
    """A request map's fields under their dotted names (``rule-description.sql-filter.expression``), so that a
    refusal names where the field is."""
    return {f"{prefix}.{k}": v for k, v in value.items()}


def rule_from_amqp(name: str, description: dict[str, Any]) -> RuleSpec:
    """The rule of an ``add-rule`` request: its ``rule-description`` map holds ``sql-filter`` or
    ``correlation-filter`` (maps) and ``sql-rule-action`` (a map with an expression, or null). A field of the wrong
    type is refused with 400 naming it (:func:`request_field`)."""
    top = "rule-description"
    d = _dotted(description, top)
    sql_filter = request_field(d, f"{top}.sql-filter", "map", None)
    correlation = request_field(d, f"{top}.correlation-filter", "map", None)
    flt: dict[str, Any]
    if sql_filter is not None:
        where = f"{top}.sql-filter"
        flt = {"type": "sql", "expression": request_field(_dotted(sql_filter, where), f"{where}.expression", "string")}
    elif correlation is not None:
        where = f"{top}.correlation-filter"
        c = _dotted(correlation, where)
        flt = {"type": "correlation"}
        for wire, field in _CORRELATION_WIRE:
            value = request_field(c, f"{where}.{wire}", "text", None)
            if value is not None:
                flt[field] = value
        properties = request_field(c, f"{where}.properties", "map", None)
        if properties:
            flt["properties"] = properties
    else:
        flt = {"type": "true"}
    action = request_field(d, f"{top}.sql-rule-action", "map", None)
    where = f"{top}.sql-rule-action"
    expression = request_field(_dotted(action, where), f"{where}.expression", "string", None) if action else None
    return RuleSpec(name=name, filter=flt, action=None if expression is None else {"expression": expression})


def rule_to_amqp(rule: RuleSpec) -> Described:
    """A rule as ``enumerate-rules`` answers it: described(rule-description, [filter, action, name])."""
    f = rule.filter
    kind = f.get("type")
    if kind == "sql":
        flt = Described(ulong(SQL_FILTER), [f.get("expression"), _SQL_COMPATIBILITY_LEVEL])
    elif kind == "correlation":
        values: list[Any] = [f.get(field) for _wire, field in _CORRELATION_WIRE]
        values.append({str(k): v for k, v in (f.get("properties") or {}).items()})
        flt = Described(ulong(CORRELATION_FILTER), values)
    elif kind == "false":
        flt = Described(ulong(FALSE_FILTER), ["1=0", _SQL_COMPATIBILITY_LEVEL])
    else:
        flt = Described(ulong(TRUE_FILTER), ["1=1", _SQL_COMPATIBILITY_LEVEL])
    if rule.action is None:
        action = Described(ulong(EMPTY_RULE_ACTION), [])
    else:
        action = Described(ulong(SQL_RULE_ACTION), [rule.action.get("expression"), _SQL_COMPATIBILITY_LEVEL])
    return Described(ulong(RULE_DESCRIPTION), [flt, action, rule.name])
