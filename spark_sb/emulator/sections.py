"""AMQP message sections: split a message into its sections, encode and decode one, and rewrite a message's
properties (what a subscription rule's action does to its copy). The lowest layer of the emulator's codec:
it imports nothing of the emulator, so the broker can rewrite a message without importing the codec."""

from __future__ import annotations

from typing import Any

from proton import Data, Described, symbol, ulong

HEADER = 0x70
DELIVERY_ANNOTATIONS = 0x71
MESSAGE_ANNOTATIONS = 0x72
PROPERTIES = 0x73
APPLICATION_PROPERTIES = 0x74
DATA = 0x75
SEQUENCE = 0x76
VALUE = 0x77
FOOTER = 0x78
_BODY = (DATA, SEQUENCE, VALUE)
_SYMBOLIC = {
    b"amqp:header:list": HEADER,
    b"amqp:delivery-annotations:map": DELIVERY_ANNOTATIONS,
    b"amqp:message-annotations:map": MESSAGE_ANNOTATIONS,
    b"amqp:properties:list": PROPERTIES,
    b"amqp:application-properties:map": APPLICATION_PROPERTIES,
    b"amqp:data:binary": DATA,
    b"amqp:amqp-sequence:list": SEQUENCE,
    b"amqp:amqp-value:*": VALUE,
    b"amqp:footer:map": FOOTER,
}
_FIXED = {4: 0, 5: 1, 6: 2, 7: 4, 8: 8, 9: 16}


class MalformedMessage(ValueError):
    """The transfer is not a well-formed AMQP message."""


#: how deep AMQP values may nest (described values, lists, maps, arrays) in what the emulator decodes: Proton's
#: decoder and Python's conversion recurse once per level, so a deeper value (5,000 nested described values fit in
#: a few kilobytes) is refused as malformed (``amqp:decode-error``) instead of exhausting the stack. pyamqp's own
#: decoder stops at 64 too.
MAX_DEPTH = 64


def _skip(buf: bytes | memoryview, pos: int, depth: int = 0) -> int:
    """Position just after the AMQP value starting at ``pos`` (every AMQP type's width follows from its
    constructor's high nibble)."""
    c = buf[pos]
    if c == 0x00:
        if depth >= MAX_DEPTH:
            raise MalformedMessage(f"AMQP described values nest deeper than {MAX_DEPTH} levels")
        return _skip(buf, _skip(buf, pos + 1, depth + 1), depth + 1)
    hi = c >> 4
    if hi in _FIXED:
        return pos + 1 + _FIXED[hi]
    if hi in (0xA, 0xC, 0xE):
        return pos + 2 + buf[pos + 1]
    if hi in (0xB, 0xD, 0xF):
        return pos + 5 + int.from_bytes(buf[pos + 1 : pos + 5], "big")
    raise MalformedMessage(f"invalid AMQP constructor 0x{c:02x} at byte {pos}")


def check_depth(buf: bytes | memoryview, limit: int = MAX_DEPTH) -> None:
    """Raise MalformedMessage when the AMQP values in ``buf`` nest deeper than ``limit`` levels, or are cut short;
    read before anything decodes them (iteration over the bytes, recursion bounded by ``limit``)."""
    pos, end = 0, len(buf)
    try:
        while pos < end:
            pos = _scan(buf, pos, 0, limit)
    except IndexError:
        raise MalformedMessage("truncated AMQP value") from None
    if pos > end:
        raise MalformedMessage("an AMQP value runs past the end of the transfer")


def _scan(buf: bytes | memoryview, pos: int, depth: int, limit: int) -> int:
    if depth > limit:
        raise MalformedMessage(f"AMQP values nest deeper than {limit} levels")
    c = buf[pos]
    if c == 0x00:  # described: a descriptor, then the value
        return _scan(buf, _scan(buf, pos + 1, depth + 1, limit), depth + 1, limit)
    return _scan_body(buf, pos + 1, c, depth, limit)


def _scan_body(buf: bytes | memoryview, pos: int, c: int, depth: int, limit: int) -> int:
    """Position after the value of constructor ``c`` whose encoding (after the constructor) starts at ``pos``."""
    hi = c >> 4
    if hi in _FIXED:
        return pos + _FIXED[hi]
    if hi in (0xA, 0xC, 0xE):
        width, size = 1, buf[pos]
    elif hi in (0xB, 0xD, 0xF):
        width, size = 4, int.from_bytes(buf[pos : pos + 4], "big")
    else:
        raise MalformedMessage(f"invalid AMQP constructor 0x{c:02x} at byte {pos - 1}")
    end = pos + width + size
    if end > len(buf):
        raise MalformedMessage("an AMQP value runs past the end of the transfer")
    if hi in (0xA, 0xB):  # binary, string, symbol
        return end
    count = int.from_bytes(buf[pos + width : pos + 2 * width], "big")
    p = pos + 2 * width
    if hi in (0xC, 0xD):  # list, map: each element has its own constructor
        for _ in range(count):
            p = _scan(buf, p, depth + 1, limit)
            if p > end:
                raise MalformedMessage("a list or map runs past its size")
        return end
    # array: one element constructor (perhaps described), then the elements without one
    if buf[p] == 0x00:
        p = _scan(buf, p + 1, depth + 1, limit)
    element = buf[p]
    if element >> 4 in (0xC, 0xD, 0xE, 0xF):  # elements that nest: read each; any other kind holds nothing deeper
        p += 1
        for _ in range(count):
            p = _scan_body(buf, p, element, depth + 1, limit)
            if p > end:
                raise MalformedMessage("an array runs past its size")
    return end


def split_sections(raw: bytes) -> list[tuple[int, bytes]]:
    """[(section code, encoded section bytes)] in order. Raises MalformedMessage."""
    out: list[tuple[int, bytes]] = []
    pos, end = 0, len(raw)
    try:
        while pos < end:
            if raw[pos] != 0x00:
                raise MalformedMessage(f"expected a described section at byte {pos}")
            d = raw[pos + 1]
            if d == 0x53:
                code = raw[pos + 2]
            elif d == 0x80:
                code = int.from_bytes(raw[pos + 2 : pos + 10], "big")
            elif d == 0xA3:
                n = raw[pos + 2]
                code = _SYMBOLIC.get(bytes(raw[pos + 3 : pos + 3 + n]), -1)
            else:
                raise MalformedMessage(f"unsupported section descriptor 0x{d:02x}")
            nxt = _skip(raw, pos)
            if nxt > end:
                raise MalformedMessage("section runs past the end of the transfer")
            out.append((code, raw[pos:nxt]))
            pos = nxt
    except IndexError:
        raise MalformedMessage("truncated AMQP message") from None
    if not out:
        raise MalformedMessage("empty transfer")
    return out


def _encode(obj: Any) -> bytes:
    d = Data()
    d.put_object(obj)
    return bytes(d.encode())


def _decode(section: bytes) -> Any:
    check_depth(section)
    d = Data()
    d.decode(section)
    d.rewind()
    d.next()
    return d.get_object()


#: filter field -> its index in the AMQP properties list (the system properties a rule action may set)
_SETTABLE_PROPERTY_INDEX = {"to": 2, "subject": 3, "reply_to": 4, "correlation_id": 5, "content_type": 6,
                            "reply_to_session_id": 12}


def rewrite(raw: bytes, properties: dict[str, Any], fields: dict[str, Any]) -> bytes:
    """The message with its application properties replaced by ``properties`` and the system ``fields``
    (filter field names: ``subject``, ``to``, ...) set: what a subscription rule's action does to its copy."""
    sections = split_sections(raw)
    out: list[bytes] = []
    wrote_props = wrote_app = False
    new_app = _encode(Described(ulong(APPLICATION_PROPERTIES), {str(k): v for k, v in properties.items()}))

    def props_section(original: bytes | None) -> bytes:
        values = list(_decode(original).value or []) if original is not None else []
        values += [None] * (13 - len(values))
        for name, value in fields.items():
            i = _SETTABLE_PROPERTY_INDEX[name]
            if value is not None and not isinstance(value, str):
                value = str(value)
            values[i] = symbol(value) if name == "content_type" and value is not None else value
        while values and values[-1] is None:
            values.pop()
        return _encode(Described(ulong(PROPERTIES), values))

    for code, sec in sections:
        if code == PROPERTIES and not wrote_props:
            out.append(props_section(sec) if fields else sec)
            wrote_props = True
            continue
        if code == APPLICATION_PROPERTIES and not wrote_app:
            out.append(new_app)
            wrote_app = True
            continue
        if code in _BODY or code == FOOTER:
            if fields and not wrote_props:
                out.append(props_section(None))
                wrote_props = True
            if not wrote_app:
                out.append(new_app)
                wrote_app = True
        out.append(sec)
    if fields and not wrote_props:
        out.append(props_section(None))
    if not wrote_app:
        out.append(new_app)
    return b"".join(out)


def modify_properties(raw: bytes, changes: dict[str, Any]) -> bytes:
    """The message with ``changes`` merged into its application properties (a settlement's
    properties-to-modify: abandon, defer and dead-letter may set them, as Service Bus applies them)."""
    current: dict[str, Any] = {}
    for code, sec in split_sections(raw):
        if code == APPLICATION_PROPERTIES:
            value = _decode(sec).value
            current = dict(value) if isinstance(value, dict) else {}
            break
    current.update({str(k): v for k, v in changes.items()})
    return rewrite(raw, current, {})


def with_message_id(raw: bytes, message_id: str) -> bytes:
    """The message with ``message_id`` in its properties (a properties section is added where there is none).
    Every other section goes on byte for byte."""
    out: list[bytes] = []
    done = False
    for code, sec in split_sections(raw):
        if not done and code >= PROPERTIES:
            values = list(_decode(sec).value or []) if code == PROPERTIES else []
            values = (values or [None])
            values[0] = message_id
            out.append(_encode(Described(ulong(PROPERTIES), values)))
            done = True
            if code == PROPERTIES:
                continue
        out.append(sec)
    if not done:
        out.append(_encode(Described(ulong(PROPERTIES), [message_id])))
    return b"".join(out)
