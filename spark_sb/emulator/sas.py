"""Shared access signatures: parse and verify, as the service does.

A token reads ``SharedAccessSignature sr=<url-encoded resource>&sig=<url-encoded base64 HMAC-SHA256>&se=<expiry>&skn=<key name>``;
the signature is over ``<sr as sent>\\n<se>``. The resource must be a prefix of what is accessed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import time
import urllib.parse
from dataclasses import dataclass


class SasError(Exception):
    """The token is malformed, signed with an unknown key or a wrong key, or expired."""


def make_token(resource: str, key_name: str, key: str, ttl: float = 3600.0, now: float | None = None) -> str:
    expiry = int((time.time() if now is None else now) + ttl)
    sr = urllib.parse.quote_plus(resource)
    sig = base64.b64encode(hmac.new(key.encode(), f"{sr}\n{expiry}".encode(), hashlib.sha256).digest()).decode()
    return f"SharedAccessSignature sr={sr}&sig={urllib.parse.quote_plus(sig)}&se={expiry}&skn={key_name}"


#: the schemes a token's ``sr`` or a put-token's ``name`` may carry (none at all is ``sb://``)
SCHEMES = ("sb", "amqps", "amqp", "https", "http")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*)://")
#: characters no entity path segment has, and which a crafted name uses to end a path early or to climb out of it
_NOT_IN_A_SEGMENT = frozenset(":%\\?#@")


@dataclass(frozen=True)
class Resource:
    """A resource URI as the service reads it: ``host`` (lower case) and ``port`` (None when it names none) of
    the namespace, and ``path``, the entity path (segments joined by ``/``, ``""`` for the whole namespace)."""

    host: str
    port: int | None
    path: str

    def covers(self, other: Resource) -> bool:
        """``other`` is this resource or below it: the same namespace (host and port) and a path that is this one
        or starts with it followed by ``/`` (segments, compared case-insensitively, as entity names are)."""
        if (self.host, self.port) != (other.host, other.port):
            return False
        mine, theirs = self.path.lower(), other.path.lower()
        return mine == "" or theirs == mine or theirs.startswith(mine + "/")

    @property
    def netloc(self) -> str:
        """``host:port`` (``[::1]:5672`` for an IPv6 address), or the host when it names no port."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}" if self.port is not None else host

    def __str__(self) -> str:
        return f"{self.netloc}/{self.path}" if self.path else self.netloc


def parse_resource(text: str, what: str = "resource") -> Resource:
    """The one reading of a resource URI (a token's ``sr``, a put-token's ``name``, a request's URL):
    ``[scheme://]host[:port][/path][?query]`` with a scheme of :data:`SCHEMES` or none. The query is dropped (the
    JavaScript SDK's admin client signs each request's whole URL); the path is percent-decoded once. A path with
    an empty, ``.`` or ``..`` segment, or a ``:``, ``%``, ``\\``, ``?``, ``#`` or ``@`` in a segment (``x://y``
    inside the path, ``%2f..%2f``, a double encoding) is refused: it could only serve to name more than it seems
    to. Raises :class:`SasError` naming ``what`` and the value."""
    if not isinstance(text, str) or not text.strip():
        raise SasError(f"{what} is empty")
    raw = text.strip()
    if any(ord(c) < 0x20 or c in "\\ " for c in raw):
        raise SasError(f"{what} {text!r} has a space, a backslash or a control character")
    scheme = _SCHEME.match(raw)
    if scheme is None:
        raw = f"sb://{raw}"
    elif scheme.group(1).lower() not in SCHEMES:
        raise SasError(f"{what} {text!r}: the scheme must be one of {', '.join(s + '://' for s in SCHEMES)} or none")
    try:
        split = urllib.parse.urlsplit(raw)
        port = split.port
    except ValueError as err:
        raise SasError(f"{what} {text!r} is not a URI ({err})") from None
    if "@" in split.netloc or not split.hostname:
        raise SasError(f"{what} {text!r} names no host (or a user)")
    try:
        path = urllib.parse.unquote(split.path, errors="strict").strip("/")
    except UnicodeDecodeError:
        raise SasError(f"{what} {text!r}: the path is not percent-encoded UTF-8") from None
    segments = path.split("/") if path else []
    for segment in segments:
        if segment in ("", ".", "..") or _NOT_IN_A_SEGMENT.intersection(segment):
            raise SasError(f"{what} {text!r}: the path segment {segment!r} is not an entity name")
    return Resource(split.hostname.lower(), port, "/".join(segments))


def verify(token: str, keys: dict[str, str], *, audience: str | Resource | None = None,
           now: float | None = None) -> str:
    """Verify ``token`` against ``keys`` (key name -> key). Returns the key name.

    ``audience``, when given, is the resource being accessed; the token's ``sr`` must cover it
    (:meth:`Resource.covers`: the same host and port, the same path or one below it), both read by
    :func:`parse_resource`. Raises SasError with a reason that never contains the key or the signature.
    """
    if not isinstance(token, str) or not token.startswith("SharedAccessSignature "):
        raise SasError("not a SharedAccessSignature token")
    fields: dict[str, str] = {}
    for part in token[len("SharedAccessSignature "):].split("&"):
        name, sep, value = part.partition("=")
        if not sep:
            raise SasError("malformed SharedAccessSignature token")
        fields[name.strip()] = value
    missing = [f for f in ("sr", "sig", "se", "skn") if f not in fields]
    if missing:
        raise SasError(f"SharedAccessSignature token lacks {', '.join(missing)}")
    key_name = fields["skn"]
    key = keys.get(key_name)
    if key is None:
        raise SasError(f"unknown shared access key name {key_name!r}")
    if not (fields["se"].isascii() and fields["se"].isdigit()):
        raise SasError(f"token expiry se={fields['se']!r} is not a number of seconds")
    expiry = int(fields["se"])
    expected = hmac.new(key.encode(), f"{fields['sr']}\n{expiry}".encode(), hashlib.sha256).digest()
    try:  # the signature is a secret: its value is never in the reason
        given = base64.b64decode(urllib.parse.unquote_plus(fields["sig"]).encode("ascii"), validate=True)
    except (UnicodeEncodeError, binascii.Error):
        raise SasError(f"the signature sig of key {key_name!r} is not base64 (an HMAC-SHA256 of sr and se)") from None
    if not hmac.compare_digest(expected, given):
        raise SasError(f"invalid signature for key {key_name!r}")
    current = time.time() if now is None else now
    if expiry < current:
        raise SasError(f"token expired at {expiry} (now {int(current)})")
    if audience is not None:
        sr = parse_resource(urllib.parse.unquote_plus(fields["sr"]), "token resource sr")
        aud = audience if isinstance(audience, Resource) else parse_resource(audience, "audience")
        # host and port both count: a token for one emulator namespace never opens another on the same host
        if not sr.covers(aud):
            raise SasError(f"token resource {str(sr)!r} does not cover {str(aud)!r}")
    return key_name


def expiry(token: str) -> float:
    """The ``se`` (epoch seconds) of a SharedAccessSignature token :func:`verify` accepted."""
    for part in token[len("SharedAccessSignature "):].split("&"):
        name, _, value = part.partition("=")
        if name.strip() == "se":
            return float(int(value))
    raise SasError("SharedAccessSignature token lacks se")


def port_of(resource: str) -> int | None:
    """The port of a resource URI or ``host:port/path`` (``None`` when it names none or is no resource URI)."""
    try:
        return parse_resource(resource).port
    except SasError:
        return None
