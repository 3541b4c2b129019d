"""What the emulator tolerates in the bytes a client sends, before Proton's engine reads them.

The SDK's ``AutoLockRenewer`` renews locks from a pool of threads over one receiver, and pyamqp numbers a session's
deliveries without a lock: two management requests can leave with the same delivery-id, or out of order. Service
Bus takes them; Proton's engine closes the connection ("sequencing error, expected delivery-id 6, got 4"). So each
connection's incoming frames pass through :class:`DeliveryIdRenumbering`, which gives every new delivery of a
session the id the engine expects and leaves well-numbered traffic byte for byte as it came.

The engine then names deliveries by its own numbers in what it sends back. The SDK's management and token links,
where the threads race, wait for the answer (matched by correlation id), not for the disposition, so nothing it
waits for is lost; a client that numbered its deliveries correctly never notices anything.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass, field
from typing import Any

from cproton import pn_condition_info, pn_transport_condition
from proton import Data

_LOGGER = logging.getLogger(__name__)

_HEADER = struct.Struct(">IBBH")  # frame size, data offset (in 4-byte words), type, channel
_AMQP_FRAME = 0
_BEGIN, _TRANSFER, _END = 0x11, 0x14, 0x17

# encoded sizes of the AMQP types by constructor: fixed widths, then the widths of a variable type's size field
_FIXED = {**dict.fromkeys(range(0x40, 0x46), 0), **dict.fromkeys(range(0x50, 0x57), 1),
          **dict.fromkeys(range(0x60, 0x62), 2), **dict.fromkeys(range(0x70, 0x75), 4),
          **dict.fromkeys(range(0x80, 0x85), 8), 0x94: 16, 0x98: 16}
_SIZED = {0xA0: 1, 0xA1: 1, 0xA3: 1, 0xC0: 1, 0xC1: 1, 0xE0: 1, 0xB0: 4, 0xB1: 4, 0xB3: 4, 0xD0: 4, 0xD1: 4, 0xF0: 4}


class _Unparsed(Exception):
    """A frame this filter does not understand: it passes through untouched, for the engine to judge."""


def _skip(buf: bytes | memoryview, pos: int) -> int:
    """The position after the AMQP value that starts at ``pos``."""
    code = buf[pos]
    if code == 0x00:  # described: a descriptor, then the value
        return _skip(buf, _skip(buf, pos + 1))
    if code in _FIXED:
        return pos + 1 + _FIXED[code]
    width = _SIZED.get(code)
    if width is None:
        raise _Unparsed(f"constructor 0x{code:02x}")
    size = buf[pos + 1] if width == 1 else struct.unpack_from(">I", buf, pos + 1)[0]
    return pos + 1 + width + size


def _uint(buf: bytes | memoryview, pos: int) -> int | None:
    code = buf[pos]
    if code == 0x40:
        return None
    if code == 0x43:
        return 0
    if code == 0x52:
        return int(buf[pos + 1])
    if code == 0x70:
        return int(struct.unpack_from(">I", buf, pos + 1)[0])
    raise _Unparsed(f"uint constructor 0x{code:02x}")


def _bool(buf: bytes | memoryview, pos: int) -> bool | None:
    code = buf[pos]
    if code == 0x56:
        return buf[pos + 1] != 0
    return {0x41: True, 0x42: False, 0x40: None}[code] if code in (0x40, 0x41, 0x42) else None


@dataclass
class _Session:
    #: the delivery-id the engine expects next (None until the session's first transfer, which sets it)
    expected: int | None = None
    #: handles whose last transfer said ``more``: their next transfer continues that delivery
    continuing: set[int] = field(default_factory=set)


#: how much of a frame's start is read before it is let through: the frame header, the performative's descriptor
#: and list header, and the transfer's first six fields (a delivery-tag is at most 32 bytes)
_LOOKAHEAD = 96


class DeliveryIdRenumbering:
    """Reads a connection's incoming byte stream and renumbers out-of-sequence delivery-ids.

    ``feed(data)`` returns the bytes to hand to the engine. A frame's first bytes (at most ``_LOOKAHEAD`` past
    its header) wait until they are all there; then they go on, rewritten where a new delivery's id is not the
    one its session expects, and the rest of the frame streams through as it comes. ``renumbered`` counts the
    deliveries whose id it changed.
    """

    def __init__(self, label: str = "") -> None:
        self.label = label
        self.renumbered = 0
        self._held = b""  # the start of a frame (or a protocol header) not yet complete enough to read
        self._through = 0  # bytes of the current frame still to let through as they are (or to drop)
        self._dropping = False
        self._ended: set[int] = set()  # channels whose session the client ended
        self._sessions: dict[int, _Session] = {}
        self._passthrough = False

    def feed(self, data: bytes) -> bytes:
        if self._passthrough:
            return data
        buf = self._held + data if self._held else data
        out: list[bytes] = []
        pos = 0
        while pos < len(buf):
            if self._through:
                n = min(self._through, len(buf) - pos)
                if not self._dropping:
                    out.append(buf[pos:pos + n])
                pos += n
                self._through -= n
                continue
            self._dropping = False
            if len(buf) - pos < 8:
                break
            if buf[pos:pos + 4] == b"AMQP":  # a protocol header: AMQP, or SASL before it
                out.append(buf[pos:pos + 8])
                pos += 8
                continue
            size, doff, kind, channel = _HEADER.unpack_from(buf, pos)
            if size < 8 or doff < 2:
                # not a frame: hand everything to the engine, which closes the connection with its own error
                self._passthrough = True
                out.append(buf[pos:])
                pos = len(buf)
                break
            if kind != _AMQP_FRAME or size <= doff * 4:
                self._through = size
                continue
            need = min(size, doff * 4 + _LOOKAHEAD)
            if len(buf) - pos < need:
                break
            head, consumed = self._frame(buf[pos:pos + need], doff, channel)
            if head is None:  # a frame to drop, whole
                self._through, self._dropping = size, True
                continue
            out.append(head)
            pos += consumed
            self._through = size - consumed
        self._held = buf[pos:]
        return b"".join(out)

    def _frame(self, head: bytes, doff: int, channel: int) -> tuple[bytes | None, int]:
        """The bytes to send for the start of a frame, and how many of ``head`` they stand for; None to drop it."""
        body = doff * 4
        descriptor = head[body:body + 3]
        if descriptor == b"\x00\x53\x11":  # begin: a new session on the channel
            self._sessions.pop(channel, None)
            self._ended.discard(channel)
            return head, len(head)
        if descriptor in (b"\x00\x53\x10", b"\x00\x53\x18"):
            # open and close belong to the connection, whatever channel carries them: rhea (the JavaScript SDK)
            # ends its session on channel 0, then closes on channel 0, and waited 60 s for a close answer
            return head, len(head)
        if channel in self._ended:
            # pyamqp's threads can still send on a session it has just ended (a lock renewal's detach as its
            # receiver closes); the engine would close the whole connection ("no such channel")
            _LOGGER.debug("%s: a frame on channel %d after its end dropped", self.label, channel)
            return None, 0
        if descriptor == b"\x00\x53\x17":  # end
            self._sessions.pop(channel, None)
            self._ended.add(channel)
            return head, len(head)
        if descriptor != b"\x00\x53\x14":
            return head, len(head)
        try:
            return self._transfer(head, body + 3, channel)
        except (_Unparsed, IndexError, struct.error, RecursionError) as err:  # deep nesting: the engine judges it
            _LOGGER.debug("%s: a transfer passed unread (%s)", self.label, err)
            return head, len(head)

    def _transfer(self, head: bytes, start: int, channel: int) -> tuple[bytes, int]:
        code = head[start]
        if code == 0xC0:
            list_size, count, fields = head[start + 1], head[start + 2], start + 3
            items = list_size - 1
        elif code == 0xD0:
            list_size, count = struct.unpack_from(">II", head, start + 1)
            fields = start + 9
            items = list_size - 4
        else:
            raise _Unparsed(f"transfer list constructor 0x{code:02x}")
        # handle, delivery-id, delivery-tag, message-format, settled, more
        positions = [fields]
        for _ in range(min(count, 6)):
            positions.append(_skip(head, positions[-1]))
        if positions[-1] > len(head):
            raise _Unparsed("the transfer's first fields run past the look-ahead")
        handle = _uint(head, positions[0])
        if handle is None:
            raise _Unparsed("a transfer without a handle")
        delivery_id = _uint(head, positions[1]) if count > 1 else None
        more = bool(_bool(head, positions[5])) if count > 5 else False
        session = self._sessions.setdefault(channel, _Session())
        if handle in session.continuing:  # the next frame of a delivery already numbered
            if not more:
                session.continuing.discard(handle)
            return head, len(head)
        if more:
            session.continuing.add(handle)
        if session.expected is None:
            session.expected = delivery_id if delivery_id is not None else 0
        wanted = session.expected
        session.expected = (wanted + 1) & 0xFFFFFFFF
        if delivery_id is None or delivery_id == wanted:
            return head, len(head)
        self.renumbered += 1
        _LOGGER.debug("%s: channel %d: delivery-id %d renumbered %d (the client numbered it out of sequence)",
                      self.label, channel, delivery_id, wanted)
        old_id = head[positions[1]:positions[2]]
        new_id = b"\x70" + struct.pack(">I", wanted)
        items += len(new_id) - len(old_id)
        rewritten = (head[4:start] + b"\xd0" + struct.pack(">II", items + 4, count) + head[fields:positions[1]]
                     + new_id)
        size = struct.unpack_from(">I", head)[0] - positions[2] + 4 + len(rewritten)
        return struct.pack(">I", size) + rewritten, positions[2]


def install(transport: Any, info: dict[str, Any], label: str = "") -> DeliveryIdRenumbering:
    """Puts the renumbering between the socket and ``transport`` (the Proton ``Transport`` object the reactor
    pushes a connection's bytes into).

    The reactor reads at most ``capacity()`` bytes and pushes them; what the renumbering gives back can be a little
    more (the start of a frame held from the read before), so what the engine cannot take yet waits here and goes
    first, as soon as the engine asks for more (the reactor asks after every push and event).

    An error the engine raises while reading closes the connection at once, with the name and description the
    engine gives and the info the transport's condition already holds; pyamqp reads that info by position and
    crashed (``IndexError``) when it was missing, so the condition gets ``info`` up front.
    """
    renumbering = DeliveryIdRenumbering(label)
    push, capacity = transport.push, transport.capacity
    waiting = bytearray()

    def flush() -> int:
        room = capacity()
        while waiting and room > 0:
            n = min(room, len(waiting))
            push(bytes(waiting[:n]))
            del waiting[:n]
            room = capacity()
        return room if not waiting else 0

    def filtered_push(data: bytes) -> None:
        out = renumbering.feed(data)
        if not waiting and len(out) <= capacity():  # the usual case: no copy
            push(out)
        else:
            waiting.extend(out)
            flush()

    transport.push, transport.capacity = filtered_push, flush
    Data(pn_condition_info(pn_transport_condition(transport._impl))).put_object(info)
    return renumbering
