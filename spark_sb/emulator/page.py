"""The emulator's live page: every namespace of the process side by side, its entities and their counts, the
faults in force, its connections against their quota and the throttle, updating every second; a peek of an
entity's messages and of its dead-letter queue with their reasons; faults set and healed from the page.

Served on every namespace's admin port, and the same page on each: it shows the whole process (the demo's
``http://localhost:5300/`` and ``http://localhost:5301/`` are one page), and a fault on a namespace does not take
its page down::

    GET  /                         the page: HTML rendered here, then its script (page.js) polls
    GET  /$page/page.js, page.css, icon.svg   its files (nothing is loaded from elsewhere)
    GET  /$page/namespaces         the namespaces' part of the page (HTML), what the script polls every second
    GET  /$page/view               the same as JSON
    GET  /$page/messages?namespace=N&entity=E[&dlq=1][&from=SEQ|&before=SEQ][&count=K][&format=json]
                                   a peek: the newest K messages (before SEQ), or K from sequence number SEQ
    POST /$page/fault              {"namespace", "kind", "entity", "duration"}: JSON
    POST /$page/heal               {"namespace", "entity"}

What a web page elsewhere can forge is refused as on the controls (:mod:`.admin_http`): the ``Host`` check, and
every ``/$page/`` request but the page's files needs the header ``X-Spark-SB-Emulator: 1``, which a page
cannot send cross-site (no CORS preflight is ever granted), and a POST a JSON body (which a form cannot send). The
page and its files forbid framing (no clickjacking of its buttons) and load nothing but themselves (CSP). A
namespace with a key other than the well-known development key (:data:`~.server.DEFAULT_KEY`) shows its counts,
but its messages, faults and heals need its key (header ``X-Spark-SB-Key``, what the page's key field sends) or
a SAS token made with it (``Authorization``).
"""

from __future__ import annotations

import hmac
import html
import math
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import resources
from typing import Any, TypeVar

from proton import timestamp

from . import codec, sas
from .amqp import FAULT_KINDS, NamespaceDown
from .broker import DLQ_SUFFIX, STATE_DEFERRED, STATE_SCHEDULED, Broker, BrokerError, Stored
from .model import QUEUE, SUBSCRIPTION, TOPIC

PREFIX = "/$page/"
#: the header of a namespace's key, for its messages, faults and heals when it is not the development key
KEY_HEADER = "X-Spark-SB-Key"
#: what the script asks for each second
POLL_SECONDS = 1.0
#: how long the page's script waits for an answer before it says the emulator cannot be reached (the admin port
#: answers within its request timeout, AdminLimits.request_timeout, 10 s by default)
REQUEST_SECONDS = 10.0
#: a peek's page size, and the most one request may ask for
PEEK_COUNT = 20
MAX_PEEK = 200
#: the most of a body shown (characters of text, bytes of binary as hex)
BODY_SHOWN = 4096
#: how long the page waits for a namespace's reactor (a busy or stopped one shows as such, never hangs the page)
CALL_TIMEOUT = 5.0
#: what the page and its files send besides their content: nothing from elsewhere, no framing, no referrer
SECURITY_HEADERS = (
    ("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                                "connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'"),
    ("X-Frame-Options", "DENY"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-store"),
)
_FILES = {"page.js": "text/javascript; charset=utf-8", "page.css": "text/css; charset=utf-8",
          "icon.svg": "image/svg+xml"}
#: what each fault kind does, for the page's select
FAULT_HELP = {
    "down": "the namespace (or entity) is unreachable: connections and links dropped",
    "timeout": "sends are held unanswered until the client gives up",
    "ack-lost": "messages are stored but the send is never answered",
    "busy": "com.microsoft:server-busy",
    "disabled": "the entity is disabled",
    "notfound": "the entity is not found",
    "quota": "the entity is full (quota exceeded)",
    "unauthorized": "unauthorized access",
}
_STATES = {STATE_DEFERRED: "deferred", STATE_SCHEDULED: "scheduled"}
#: what names a paired sender's backlog queue (``<primary host>/x-servicebus-transfer/<n>``, the .NET paired
#: namespaces' convention): the page says "backlog queue" for it
BACKLOG_MARK = "/x-servicebus-transfer/"
T = TypeVar("T")


class PageError(Exception):
    """A request the page refuses: ``status`` and a message naming the field and the value."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class PageNamespace:
    """One namespace as the page sees it: ``server`` is its :class:`~.amqp.NamespaceServer` (only touched through
    ``server.call``), ``control`` its ``/$emulator/`` handler (the page's faults go through it), ``keys`` its SAS
    keys, ``ports`` its ports by name (``amqp``, ``admin``, ...), ``secret`` whether a key is not the development
    key."""

    name: str
    server: Any
    control: Callable[[str, str, dict[str, Any]], tuple[int, dict[str, Any]]]
    keys: dict[str, str] = field(repr=False)
    ports: Callable[[], dict[str, int | None]]
    secret: bool = False


def _call(ns: PageNamespace, fn: Callable[[], T]) -> T:
    """``fn()`` on the namespace's reactor thread, within :data:`CALL_TIMEOUT`; a stopped or silent reactor is a
    503 naming the namespace."""
    try:
        return ns.server.call(fn, timeout=CALL_TIMEOUT)  # type: ignore[no-any-return]
    except NamespaceDown as err:
        raise PageError(503, err.description) from None
    except TimeoutError:
        raise PageError(503, f"namespace {ns.name}: its AMQP server did not answer within {CALL_TIMEOUT:g} s") \
            from None


class Page:
    """The live page of the namespaces ``namespaces()`` gives (the emulator's, in order)."""

    def __init__(self, namespaces: Callable[[], list[PageNamespace]]) -> None:
        self._namespaces = namespaces

    def _find(self, name: Any) -> PageNamespace:
        spaces = self._namespaces()
        for ns in spaces:
            if ns.name == name:
                return ns
        raise PageError(404, f"namespace: no namespace {name!r} in this emulator "
                             f"(it has {', '.join(n.name for n in spaces)})")

    # ------------------------------------------------------------------ what the page shows
    def view(self) -> dict[str, Any]:
        """Every namespace: its state, faults, connections, throttle and entities with their counts (JSON)."""
        return {"namespaces": [self._namespace_view(ns) for ns in self._namespaces()],
                "poll_seconds": POLL_SECONDS}

    def _namespace_view(self, ns: PageNamespace) -> dict[str, Any]:
        server = ns.server
        base = {"name": ns.name, "ports": ns.ports(), "locked": ns.secret}
        try:
            return {**base, **_call(ns, lambda: _live(server))}
        except PageError as err:
            return {**base, "error": str(err)}

    def messages(self, query: dict[str, list[str]], headers: Any) -> dict[str, Any]:
        """A peek of an entity's messages (or its dead-letter queue's): the newest, or from a sequence number."""
        ns = self._find(_one(query, "namespace"))
        self.authorize(ns, headers)
        entity = _one(query, "entity")
        if not entity:
            raise PageError(400, "entity: name the queue or subscription to peek, got nothing")
        dlq_text = _one(query, "dlq").lower()
        if dlq_text not in ("", "0", "1", "false", "true"):
            raise PageError(400, f"dlq must be 1 (the dead-letter queue) or 0, got {dlq_text!r}")
        dlq = dlq_text in ("1", "true")
        count = _number(query, "count", PEEK_COUNT, 1, MAX_PEEK) or PEEK_COUNT
        start = _number(query, "from", None, 0, None)
        before = _number(query, "before", None, 1, None)
        if start is not None and before is not None:
            raise PageError(400, f"from={start} and before={before}: give one of them (from: oldest first from that "
                                 "sequence number; before: newest first below it)")
        path = entity.removesuffix(DLQ_SUFFIX) + (DLQ_SUFFIX if dlq else "")
        server = ns.server

        def peek() -> tuple[list[Stored], float]:
            broker: Broker = server.broker
            if start is not None:
                found = broker.peek(path, start, count)
            else:
                found = broker.peek_newest(path, count, before)
            return found, server.clock()

        try:
            found, now = _call(ns, peek)
        except BrokerError as err:
            raise PageError(404 if "could not be found" in err.description else 400,
                            f"entity {entity!r}: {err.description}") from None
        return {"namespace": ns.name, "entity": entity.removesuffix(DLQ_SUFFIX), "dlq": dlq, "count": count,
                "from": start, "before": before, "oldest_first": start is not None,
                "messages": [message_view(m, now) for m in found]}

    # ------------------------------------------------------------------ faults
    def _target(self, body: dict[str, Any], headers: Any) -> tuple[PageNamespace, str | None]:
        """The namespace a fault or a heal names (authorized) and its entity (one it has), or None for all of it."""
        ns = self._find(body.get("namespace"))
        self.authorize(ns, headers)
        entity = body.get("entity") or None
        if entity is not None:
            self._check_entity(ns, entity)
        return ns, entity

    def fault(self, body: dict[str, Any], headers: Any) -> dict[str, Any]:
        ns, entity = self._target(body, headers)
        duration = body.get("duration")
        if duration in ("", None):
            duration = None
        status, answer = ns.control("POST", "/$emulator/fault", {"kind": body.get("kind"), "entity": entity,
                                                                 "duration": duration})
        if status != 200:
            raise PageError(status, str(answer.get("error")))
        target = f"{entity} on {ns.name}" if entity else f"namespace {ns.name}"
        how_long = "until healed" if duration is None else f"for {duration:g} s"
        return {**answer, "message": f"fault {answer['kind']} set on {target} {how_long}"}

    def heal(self, body: dict[str, Any], headers: Any) -> dict[str, Any]:
        """Heal an entity's fault, or every fault of the namespace; says so when there was none to heal."""
        ns, entity = self._target(body, headers)
        server = ns.server
        in_force = _call(ns, lambda: {key: f.kind for key, f in server.faults.items()})
        status, answer = ns.control("POST", "/$emulator/heal", {"entity": entity})
        if status != 200:
            raise PageError(status, str(answer.get("error")))
        healed = sorted(f"{kind} on {key or 'the namespace'}" for key, kind in in_force.items()
                        if entity is None or key == entity)
        what = f"{entity} on {ns.name}" if entity else f"namespace {ns.name}"
        if not healed:
            return {**answer, "healed_faults": [], "message": f"no fault was in force on {what}: nothing to heal"}
        return {**answer, "healed_faults": healed, "message": f"healed {what}: {', '.join(healed)}"}

    def _check_entity(self, ns: PageNamespace, entity: Any) -> None:
        if not isinstance(entity, str):
            raise PageError(400, f"entity must be an entity's path (text), got {entity!r}")
        server = ns.server
        paths = _call(ns, lambda: [p for p, _ in entities(server.broker)])
        if entity.lower() not in {p.lower() for p in paths}:
            raise PageError(404, f"entity: namespace {ns.name} has no entity {entity!r} "
                                 f"(it has {', '.join(paths) or 'none'})")

    def authorize(self, ns: PageNamespace, headers: Any) -> None:
        """A namespace with a secret key: its key (``X-Spark-SB-Key``) or a SAS token made with it is needed."""
        if not ns.secret:
            return
        given = (headers.get(KEY_HEADER) or "").strip()
        if given and any(hmac.compare_digest(given.encode(), k.encode()) for k in ns.keys.values()):
            return
        token = (headers.get("Authorization") or "").strip()
        if token:
            try:
                sas.verify(token, ns.keys)
                return
            except sas.SasError as err:
                raise PageError(401, f"namespace {ns.name}: the SAS token is refused: {err}") from None
        raise PageError(401, f"namespace {ns.name} has a key of its own: type it in the page's key field (or send "
                             f"it as {KEY_HEADER}, or a SAS token made with it as Authorization)"
                             + (" - the key given is not the namespace's" if given else ""))

    # ------------------------------------------------------------------ HTML
    def html(self, host: str) -> str:
        """The whole page, its namespaces rendered as of now."""
        spaces = self._namespaces()
        view = self.view()
        options = "".join(f"<option>{_e(ns.name)}</option>" for ns in spaces)
        kinds = "".join(f'<option value="{_e(k)}" title="{_e(FAULT_HELP.get(k, ""))}">{_e(k)}</option>'
                        for k in FAULT_KINDS)
        locked = any(ns.secret for ns in spaces)
        key_field = ('<p><label for="key">Key of a namespace with its own key (or a SAS token)</label> '
                     '<input id="key" type="password" autocomplete="off" size="30"></p>') if locked else ""
        return _PAGE.substitute(
            title=_e(f"spark-sb emulator - {', '.join(ns.name for ns in spaces)}"), host=_e(host),
            namespaces=self.namespaces_html(view), namespace_options=options, kind_options=kinds,
            key_field=key_field, poll_ms=int(POLL_SECONDS * 1000), timeout_ms=int(REQUEST_SECONDS * 1000),
        )

    def namespaces_html(self, view: dict[str, Any] | None = None) -> str:
        view = view if view is not None else self.view()
        paths = sorted({e["path"] for n in view["namespaces"] for e in n.get("entities", [])})
        datalist = ('<datalist id="entity-paths">' + "".join(f'<option value="{_e(p)}">' for p in paths)
                    + "</datalist>")
        return "".join(_namespace_html(n) for n in view["namespaces"]) + datalist

    def messages_html(self, peek: dict[str, Any]) -> str:
        return _messages_html(peek)


def file(name: str) -> tuple[bytes, str] | None:
    """One of the page's files (``page.js``, ``page.css``, ``icon.svg``) and its content type; None for any other
    name."""
    content_type = _FILES.get(name)
    if content_type is None:
        return None
    return resources.files(__package__).joinpath("page_files", name).read_bytes(), content_type


# ---------------------------------------------------------------------- on the reactor thread
def entities(broker: Broker) -> list[tuple[str, Any]]:
    """A namespace's queues, topics and subscriptions (``TOPIC/subscriptions/NAME``) with their descriptions, by
    path."""
    topics = broker.list_entities(TOPIC)
    found = [(q.name, q) for q in broker.list_entities(QUEUE)] + [(t.name, t) for t in topics]
    found += [(s.path, s) for t in topics for s in broker.list_entities(SUBSCRIPTION, t.name)]
    return sorted(found, key=lambda item: item[0].lower())


def _live(server: Any) -> dict[str, Any]:
    """What the page shows of a namespace now: run on its reactor thread."""
    broker: Broker = server.broker
    now = server.clock()
    faults = [{"entity": key, "kind": f.kind, "seconds_left": None if f.until is None else max(0.0, f.until - now)}
              for key, f in server.faults.items() if f.until is None or f.until > now]
    rows = []
    for path, spec in entities(broker):
        counts = broker.runtime_counts(path)
        rows.append({"path": path, "kind": spec.kind, "status": spec.status,
                     "sessions": bool(getattr(spec, "requires_session", False)),
                     "active": counts.active, "deferred": 0 if spec.kind == TOPIC else broker.deferred_count(path),
                     "scheduled": counts.scheduled, "dead_letter": counts.dead_letter,
                     "size_in_bytes": counts.size_in_bytes,
                     "max_size_in_bytes": getattr(spec, "max_size_in_megabytes", 0) * 1024 * 1024 or None,
                     "fault": server.fault_for(path)})
    return {"down": server.fault_for(None) == "down", "fault": server.fault_for(None), "faults": faults,
            "stats": server.stats(), "entities": rows}


# ---------------------------------------------------------------------- messages
def message_view(m: Stored, now: float) -> dict[str, Any]:
    """A stored message as the page shows it: its system properties, its application properties (with their
    AMQP types) and its body (text when it is UTF-8 text, else hex)."""
    system: dict[str, Any] = {"sequence_number": m.sequence_number, "message_id": m.message_id,
                              "enqueued_time": _time(m.enqueued_time),
                              "state": _STATES.get(m.state, "locked" if m.locked_until and m.locked_until > now
                                                   else "active"),
                              "delivery_count": m.delivery_count}
    for name, value in (("session_id", m.session_id), ("partition_key", m.partition_key),
                        ("expires_at", _time(m.expires_at)), ("locked_until", _time(m.locked_until)),
                        ("scheduled_enqueue_time", _time(m.scheduled_enqueue_time)),
                        ("dead_letter_reason", m.dead_letter_reason),
                        ("dead_letter_description", m.dead_letter_description),
                        ("dead_letter_source", m.dead_letter_source)):
            if value is not None:
                system[name] = value
    try:
        p = codec.parts(m.raw)
    except codec.MalformedMessage as err:
        return {"system": system, "application": [], "body": {"kind": "unreadable", "text": str(err), "size": 0}}
    for name in ("correlation_id", "subject", "content_type", "to", "reply_to", "reply_to_group_id"):
        value = p.properties.get(name)
        if value is not None:
            system["reply_to_session_id" if name == "reply_to_group_id" else name] = codec.text(value)
    ttl = p.header.get("ttl")
    if ttl:
        system["time_to_live"] = f"{int(ttl) / 1000:g} s"
    application = [{"name": k, "type": codec.amqp_type(v), "value": _shown(v)} for k, v in p.application.items()]
    return {"system": system, "application": application, "body": _body(p)}


def _body(p: codec.Parts) -> dict[str, Any]:
    if p.body_kind == "none":
        return {"kind": "none", "text": "", "size": 0}
    if p.body_kind != "data":
        shown = _shown(p.body)
        return {"kind": p.body_kind, "text": shown[:BODY_SHOWN], "size": len(shown), "cut": len(shown) > BODY_SHOWN}
    data: bytes = p.body
    text: str | None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and all(c.isprintable() or c in "\n\r\t" for c in text):
        return {"kind": "text", "text": text[:BODY_SHOWN], "size": len(data), "cut": len(text) > BODY_SHOWN}
    return {"kind": "binary", "text": data[:BODY_SHOWN].hex(" "), "size": len(data), "cut": len(data) > BODY_SHOWN}


def _shown(value: Any) -> str:
    """A decoded AMQP value as text: numbers as numbers (not proton's ``int32(5)``), timestamps in ISO 8601 UTC,
    binary in hex."""
    if isinstance(value, bytes | memoryview):
        return bytes(value).hex(" ")
    if isinstance(value, timestamp):
        return _time(int(value) / 1000.0) or str(int(value))
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, float):
        return repr(float(value))
    return str(value)


def _time(epoch: float | None) -> str | None:
    if epoch is None or not math.isfinite(epoch) or epoch > 253402300799:  # beyond year 9999: never
        return None
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# ---------------------------------------------------------------------- request fields
def _one(query: dict[str, list[str]], name: str) -> str:
    values = query.get(name) or [""]
    return values[0].strip()


def _number(query: dict[str, list[str]], name: str, default: int | None, low: int,
            high: int | None) -> int | None:
    text = _one(query, name)
    if not text:
        return default
    if not text.isdigit() or int(text) < low or (high is not None and int(text) > high):
        bound = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise PageError(400, f"{name} must be a whole number {bound}, got {text!r}")
    return int(text)


# ---------------------------------------------------------------------- rendering
def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _size(n: int | None) -> str:
    if n is None:
        return ""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n = n / 1024  # type: ignore[assignment]
    return str(n)


def _path(path: str) -> str:
    """An entity's path that wraps at its slashes only (a backlog queue's name is long and full of hyphens)."""
    return "/<wbr>".join(f'<span class="seg">{_e(part)}</span>' for part in path.split("/"))


def _left(seconds: float | None) -> str:
    return "until healed" if seconds is None else f"{seconds:.0f} s left"


def _button(action: str, label: str, name: str, **data: str | None) -> str:
    """A button of the page: ``label`` is its accessible name and its tooltip, ``name`` what it shows."""
    attrs = "".join(f' data-{k.replace("_", "-")}="{_e(v)}"' for k, v in data.items() if v is not None)
    return (f'<button type="button" data-action="{action}" aria-label="{_e(label)}" title="{_e(label)}"{attrs}>'
            f'{_e(name)}</button>')


def _namespace_html(n: dict[str, Any]) -> str:
    name = n["name"]
    ports = " ".join(f"{k} {v}" for k, v in n.get("ports", {}).items() if v)
    head = f'<article class="namespace" id="ns-{_e(name)}" aria-labelledby="title-{_e(name)}">'
    if "error" in n:
        return (f'{head}<h2 id="title-{_e(name)}">{_e(name)} <span class="state failed">unreachable</span></h2>'
                f'<p class="error">{_e(n["error"])}</p></article>')
    fault = n.get("fault")
    state = ('<span class="state down">DOWN</span>' if n.get("down") else
             f'<span class="state faulted">fault: {_e(fault)}</span>' if fault else
             '<span class="state up">up</span>')
    stats = n["stats"]
    limits = stats.get("limits", {})
    rate = limits.get("ops_per_second")
    throttle = f"throttle {rate:g} ops/s, {stats.get('throttled', 0)} refused" if rate else "throttle off"
    lock = ' <span class="locked" title="this namespace has a key of its own">key needed</span>' if n.get("locked") \
        else ""
    parts = [head, f'<h2 id="title-{_e(name)}">{_e(name)} {state}{lock}</h2>',
             f'<p class="meta"><span data-stat="connections">connections {stats.get("connections", 0)} / '
             f'{limits.get("max_connections", "?")}</span> · entity links {stats.get("entity_links", 0)} · '
             f'operations {stats.get("ops", 0)} · {_e(throttle)} · <span class="ports">{_e(ports)}</span></p>']
    faults = n.get("faults", [])
    if faults:
        rows = "".join(
            f'<tr><td>{_e(f["entity"] or "the namespace")}</td><td>{_e(f["kind"])}</td>'
            f'<td>{_e(_left(f["seconds_left"]))}</td><td>'
            + _button("heal", f"Heal {f['kind']} on {f['entity'] or 'namespace ' + name}", "Heal",
                      namespace=name, entity=f["entity"]) + "</td></tr>" for f in faults)
        parts.append(f'<table class="faults"><caption>Faults in force on {_e(name)}</caption><thead><tr>'
                     f'<th scope="col">on</th><th scope="col">kind</th><th scope="col">for</th>'
                     f'<th scope="col"><span class="sr">action</span></th></tr></thead><tbody>{rows}</tbody></table>')
    else:
        parts.append(f'<p class="nofaults">No fault on {_e(name)}.</p>')
    lines = []
    for e in n.get("entities", []):
        path = e["path"]
        kind = ("backlog queue" if BACKLOG_MARK in path.lower() else e["kind"]) + \
            (" (sessions)" if e["sessions"] else "") + ("" if e["status"] == "Active" else f" ({e['status']})")
        actions = "" if e["kind"] == TOPIC else (
            _button("peek", f"Peek {path} on {name}", "Peek", namespace=name, entity=path)
            + _button("dlq", f"Dead letters of {path} on {name}", "DLQ", namespace=name, entity=path))
        full = e["max_size_in_bytes"]
        lines.append(
            f'<tr data-entity="{_e(path)}"{" class=faulted" if e["fault"] else ""}>'
            f'<th scope="row">{_path(path)}</th><td>{_e(kind)}</td>'
            f'<td class="n" data-count="active">{e["active"]}</td>'
            f'<td class="n" data-count="deferred">{e["deferred"]}</td>'
            f'<td class="n" data-count="scheduled">{e["scheduled"]}</td>'
            f'<td class="n" data-count="dead_letter">{e["dead_letter"]}</td>'
            f'<td class="n" title="{e["size_in_bytes"]} bytes of {_e(full)}">{_e(_size(e["size_in_bytes"]))}</td>'
            f'<td>{_e(e["fault"] or "")}</td><td class="actions">{actions}</td></tr>')
    parts.append(
        f'<table class="entities"><caption>Entities of {_e(name)}</caption><thead><tr><th scope="col">entity</th>'
        '<th scope="col">kind</th><th scope="col" class="n">active</th><th scope="col" class="n">deferred</th>'
        '<th scope="col" class="n">scheduled</th><th scope="col" class="n">dead-letter</th>'
        '<th scope="col" class="n">size</th><th scope="col">fault</th>'
        f'<th scope="col"><span class="sr">actions</span></th></tr></thead><tbody>{"".join(lines)}</tbody></table>'
        "</article>")
    return "".join(parts)


def _properties(pairs: Iterable[tuple[str, Any]]) -> str:
    return "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in pairs)


def _messages_html(peek: dict[str, Any]) -> str:
    ns, entity, dlq = peek["namespace"], peek["entity"], peek["dlq"]
    which = f"dead-letter queue of {entity}" if dlq else entity
    order = (f"oldest first from sequence number {peek['from']}" if peek["oldest_first"] else
             "newest first" + (f" below sequence number {peek['before']}" if peek["before"] else ""))
    msgs = peek["messages"]
    out = [f'<h2 id="messages-title">Messages of {_e(which)} on {_e(ns)}</h2>',
           f'<p class="meta">{len(msgs)} shown, {_e(order)} (a peek: nothing locked, no delivery counted)</p>',
           '<p class="paging">'
           + _button("page", f"Newest messages of {which}", "Newest", namespace=ns, entity=entity,
                     dlq="1" if dlq else "0")]
    if msgs and not peek["oldest_first"]:
        out.append(_button("page", "Older messages", "Older", namespace=ns, entity=entity, dlq="1" if dlq else "0",
                           before=str(min(m["system"]["sequence_number"] for m in msgs))))
    if msgs and peek["oldest_first"]:
        out.append(_button("page", "Next messages", "Next", namespace=ns, entity=entity, dlq="1" if dlq else "0",
                           start=str(max(m["system"]["sequence_number"] for m in msgs) + 1)))
    out.append(f' <label for="from-seq">From sequence number</label> <input id="from-seq" type="number" min="0" '
               f'size="8"> {_button("from", "Peek from this sequence number", "Go", namespace=ns, entity=entity, dlq="1" if dlq else "0")}'
               "</p>")
    if not msgs:
        out.append(f'<p class="empty">No message in {_e(which)}.</p>')
    for m in msgs:
        system = m["system"]
        summary = f"#{system['sequence_number']} {system.get('message_id') or ''}"
        if dlq:
            summary += f" - {system.get('dead_letter_reason') or 'no reason'}"
        body = m["body"]
        cut = f" (first {BODY_SHOWN} of {body['size']})" if body.get("cut") else ""
        app = "".join(f"<dt>{_e(a['name'])}</dt><dd>{_e(a['value'])} <span class=type>{_e(a['type'])}</span></dd>"
                      for a in m["application"]) or "<dt>none</dt><dd></dd>"
        out.append(
            f'<details class="message" data-sequence="{system["sequence_number"]}"><summary>{_e(summary)}</summary>'
            '<div class="props"><section><h3>System properties</h3><dl>'
            + _properties(system.items())
            + f"</dl></section><section><h3>Application properties</h3><dl>{app}</dl></section></div>"
            f'<section><h3>Body: {_e(body["kind"])}, {body["size"]} {"bytes" if body["kind"] != "text" else "bytes of UTF-8"}'
            f"{_e(cut)}</h3><pre>{_e(body['text'])}</pre></section></details>")
    return "".join(out)


_PAGE = string.Template("""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>$title</title>
<link rel="stylesheet" href="/$$page/page.css">
<link rel="icon" href="/$$page/icon.svg" type="image/svg+xml">
<script src="/$$page/page.js" defer></script>
</head>
<body data-poll-ms="$poll_ms" data-timeout-ms="$timeout_ms">
<header>
<h1>spark-sb emulator <small>$host</small></h1>
<p id="updated" role="status" aria-live="polite">rendered by the emulator; live updates start when the script runs</p>
</header>
<main>
<section id="namespaces" aria-label="Namespaces">$namespaces</section>
<section id="controls" aria-labelledby="controls-title">
<h2 id="controls-title">Faults</h2>
$key_field
<form id="fault-form">
<p>
<label for="fault-namespace">Namespace</label> <select id="fault-namespace">$namespace_options</select>
<label for="fault-entity">Entity (empty: the whole namespace)</label>
<input id="fault-entity" list="entity-paths" size="28" autocomplete="off">
<label for="fault-kind">Fault</label> <select id="fault-kind">$kind_options</select>
<label for="fault-duration">For seconds (empty: until healed)</label>
<input id="fault-duration" type="number" min="1" step="any" size="6">
</p>
<p><button type="submit" id="set-fault">Set fault</button>
<button type="button" id="heal-fault">Heal</button></p>
</form>
<p id="fault-result" role="status" aria-live="polite"></p>
</section>
<section id="messages" aria-live="polite" aria-labelledby="messages-title">
<h2 id="messages-title">Messages</h2>
<p>Peek an entity's messages or its dead letters with the buttons beside it.</p>
</section>
</main>
</body>
</html>
""")
