"""Shared access signatures: parse and verify, as the service does.

A token reads ``SharedAccessSignature sr=<url-encoded resource>&sig=<url-encoded base64 HMAC-SHA256>&se=<expiry>&skn=<key name>``;
the signature is over ``<sr as sent>\\n<se>``. The resource must be a prefix of what is accessed.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
import urllib.parse


class SasError(Exception):
    """The token is malformed, signed with an unknown key or a wrong key, or expired."""


def make_token(resource: str, key_name: str, key: str, ttl: float = 3600.0, now: float | None = None) -> str:
    expiry = int((time.time() if now is None else now) + ttl)
    sr = urllib.parse.quote_plus(resource)
    sig = base64.b64encode(hmac.new(key.encode(), f"{sr}\n{expiry}".encode(), hashlib.sha256).digest()).decode()
    return f"SharedAccessSignature sr={sr}&sig={urllib.parse.quote_plus(sig)}&se={expiry}&skn={key_name}"


def _normalise_resource(resource: str) -> str:
    # the query is no part of the resource: the JavaScript SDK's admin client signs each request's whole URL,
    # ``https://host/queue?api-version=2021-05``, and Service Bus takes it
    r = resource.lower().split("?", 1)[0]
    for scheme in ("sb://", "amqps://", "amqp://", "https://", "http://"):
        if r.startswith(scheme):
            r = r[len(scheme):]
            break
    return r.rstrip("/")


def verify(token: str, keys: dict[str, str], *, audience: str | None = None, now: float | None = None) -> str:
    """Verify ``token`` against ``keys`` (key name -> key). Returns the key name.

    ``audience``, when given, is the resource being accessed; the token's ``sr`` must be it or a prefix
    of it (host part compared without scheme). Raises SasError with a reason that never contains the key
    or the signature.
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
    try:
        expiry = int(fields["se"])
    except ValueError:
        raise SasError(f"token expiry se={fields['se']!r} is not a number") from None
    expected = base64.b64encode(
        hmac.new(key.encode(), f"{fields['sr']}\n{expiry}".encode(), hashlib.sha256).digest()
    ).decode()
    given = urllib.parse.unquote_plus(fields["sig"])
    if not hmac.compare_digest(expected, given):
        raise SasError(f"invalid signature for key {key_name!r}")
    current = time.time() if now is None else now
    if expiry < current:
        raise SasError(f"token expired at {expiry} (now {int(current)})")
    if audience is not None:
        sr = _normalise_resource(urllib.parse.unquote_plus(fields["sr"]))
        aud = _normalise_resource(audience)
        # host and port both count: a token for one emulator namespace never opens another on the same host
        if not (aud == sr or aud.startswith(sr + "/")):
            raise SasError(f"token resource {sr!r} does not cover {aud!r}")
    return key_name


def expiry(token: str) -> float:
    """The ``se`` (epoch seconds) of a SharedAccessSignature token :func:`verify` accepted."""
    for part in token[len("SharedAccessSignature "):].split("&"):
        name, _, value = part.partition("=")
        if name.strip() == "se":
            return float(int(value))
    raise SasError("SharedAccessSignature token lacks se")


def port_of(resource: str) -> int | None:
    """The port of a resource URI or ``host:port/path`` (``None`` when it names none)."""
    authority = _normalise_resource(resource).split("/", 1)[0]
    _, sep, port = authority.rpartition(":")
    return int(port) if sep and port.isdigit() else None
