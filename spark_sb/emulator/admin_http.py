"""The administration REST API of an emulated namespace, as ``ServiceBusAdministrationClient`` expects it.

Atom XML over plain HTTP (Microsoft's emulator serves the same API on port 5300), stdlib and defusedxml: an event
loop reads the requests' heads and a bounded pool of workers serves them (:mod:`._http_loop`, bounded by
:class:`AdminLimits`: timeouts of seconds, caps on connections). Every broker access goes through ``call`` so that
the broker is only ever touched from its own (reactor) thread.

Routes (entity names may contain ``/``; the SDK percent-encodes them as ``%2F``)::

    PUT|GET|DELETE /{queue-or-topic}                       create (update with If-Match), get, delete
    GET            /$Resources/queues|topics?$skip&$top    list
    PUT|GET|DELETE /{topic}/subscriptions/{sub}
    GET            /{topic}/subscriptions?$skip&$top
    PUT|GET|DELETE /{topic}/subscriptions/{sub}/rules/{rule}
    GET            /{topic}/subscriptions/{sub}/rules?$skip&$top
    GET            /$namespaceinfo
    *              /$emulator/...                          local test controls, JSON: with the header
                                                           X-Spark-SB-Emulator: 1 (or a token with Manage);
                                                           a body is application/json
    GET            /msi/token?api-version=2019-08-01&resource=...[&client_id=...]
                                                           managed-identity tokens (App Service protocol,
                                                           header X-IDENTITY-HEADER), JSON; see aad.py

Requests are authorized by a SAS token (``Authorization: SharedAccessSignature ...``) or by an Entra ID token
of the emulator (``Authorization: Bearer <jwt>``) whose roles include Azure Service Bus Data Owner (the
``Manage`` right). ``/msi/token`` is reserved: a queue of that name cannot be administered here.

Status codes follow the service: 201 on create, 200 otherwise, 401 for a bad or missing token, 404 for a
missing entity, 409 when it exists, 400 for an invalid description, 503 when busy.

What a web page can forge is refused: a request whose ``Host`` is not this machine by a name a page cannot
rebind (``localhost``, an IP address, the emulator's configured host names) is answered 403, so a DNS-rebinding
page reaches nothing; the controls need the header ``X-Spark-SB-Emulator: 1`` (a page cannot send a custom header
cross-site without a CORS preflight, which this server never grants) or a token with Manage, and a JSON body.
Nothing of a body is read before the request is authenticated from its head, and no body beyond
``MAX_BODY_BYTES`` is read at all, whatever its framing. XML bodies are parsed with defusedxml: no DTD, in any
encoding.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import re
import socket
import time
import urllib.parse
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any, Protocol, TypeVar
from xml.sax.saxutils import escape, quoteattr

from defusedxml import DefusedXmlException
from defusedxml import ElementTree as _safe_xml

from ..durations import DurationError, iso_duration, parse_seconds
from . import aad, model, sas
from . import page as _page
from ._http_loop import AdminLimits, HttpLoop, Outcome
from .broker import Broker, BrokerError, Cond, RuntimeCounts
from .model import QUEUE, SUBSCRIPTION, TOPIC, QueueSpec, RuleSpec, SubscriptionSpec, TopicSpec

_LOGGER = logging.getLogger(__name__)

T = TypeVar("T")

ATOM_NS = "http://www.w3.org/2005/Atom"
SB_NS = "http://schemas.microsoft.com/netservices/2010/10/servicebus/connect"
COUNT_NS = "http://schemas.microsoft.com/netservices/2011/06/servicebus"
XSI_NS = "http://www.w3.org/2001/XMLSchema-instance"
XSD_NS = "http://www.w3.org/2001/XMLSchema"

MAX_TIMESPAN = "P10675199DT2H48M5.4775807S"  # TimeSpan.MaxValue as the service writes it
DEFAULT_API_VERSION = "2021-05"
MAX_BODY_BYTES = 1024 * 1024
#: the header every client of the controls (``/$emulator/...``) sends, value ``1``: a web page cannot send a custom
#: header cross-site without a CORS preflight, which this server never grants
CONTROL_HEADER = "X-Spark-SB-Emulator"
#: the most trailer bytes read after a chunked body
_MAX_TRAILER_BYTES = 8 * 1024
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,8}")

_CT_ENTRY = "application/atom+xml;type=entry;charset=utf-8"
_CT_FEED = "application/atom+xml;type=feed;charset=utf-8"
_CT_ERROR = "application/xml; charset=utf-8"
_CT_JSON = "application/json"


class BrokerCall(Protocol):
    """Runs ``fn()`` on the broker's thread and returns its result, or raises its exception."""

    def __call__(self, fn: Callable[[], T], /) -> T: ...


class _HttpError(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


# --------------------------------------------------------------------------- durations and times

def format_duration(seconds: float | None) -> str:
    """ISO 8601 as .NET writes a TimeSpan: ``PT1M``, ``P1DT2H``, ``PT0.5S``; None (or beyond) = MaxValue."""
    if seconds is None or seconds >= model.MAX_TTL_SECONDS:
        return MAX_TIMESPAN
    return iso_duration(seconds)


def parse_duration(text: str, field: str) -> float:
    """Seconds from an ISO 8601 duration (weeks, days, hours, minutes, seconds)."""
    try:
        return parse_seconds(text, iso_only=True)
    except DurationError:
        raise _HttpError(400, f"{field}: expected an ISO 8601 duration such as PT1M, got {text!r}") from None


def _format_time(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _bool(value: bool) -> str:
    return "true" if value else "false"


# --------------------------------------------------------------------------- parsing request bodies


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _children(elem: ET.Element) -> dict[str, ET.Element]:
    return {_local(child.tag): child for child in elem}


def _xsi_type(elem: ET.Element) -> str | None:
    value = elem.get(f"{{{XSI_NS}}}type")
    return value.rsplit(":", 1)[-1] if value else None


def parse_body(body: bytes) -> ET.Element:
    """The description element inside ``<entry><content>``: QueueDescription, TopicDescription, ..."""
    if not body.strip():
        raise _HttpError(400, "the request body is empty; expected an Atom entry with a description")
    try:  # defusedxml refuses a DTD (and so any entity) whatever the body's encoding: UTF-16 hides no <!DOCTYPE
        root = _safe_xml.fromstring(body, forbid_dtd=True)
    except DefusedXmlException:
        raise _HttpError(400, "document type declarations are not accepted") from None
    except ET.ParseError as err:
        raise _HttpError(400, f"the request body is not well-formed XML ({err})") from None
    if _local(root.tag) != "entry":
        raise _HttpError(400, f"expected an Atom <entry>, got <{_local(root.tag)}>")
    content = root.find(f"{{{ATOM_NS}}}content")
    if content is None:
        content = next((c for c in root if _local(c.tag) == "content"), None)
    if content is None or len(content) == 0:
        raise _HttpError(400, "the Atom entry has no <content> with a description")
    description: ET.Element = content[0]
    return description


def _to_bool(text: str | None, field: str) -> bool:
    value = (text or "").strip().lower()
    if value in ("true", "1"):
        return True
    if value in ("false", "0"):
        return False
    raise _HttpError(400, f"{field}: expected true or false, got {text!r}")


def _to_int(text: str | None, field: str) -> int:
    try:
        return int((text or "").strip())
    except ValueError:
        raise _HttpError(400, f"{field}: expected an integer, got {text!r}") from None


def _to_duration(text: str | None, field: str) -> float:
    if text is None or not text.strip():
        raise _HttpError(400, f"{field}: expected an ISO 8601 duration such as PT1M, got {text!r}")
    return parse_duration(text, field)


def _to_duration_or_max(text: str | None, field: str) -> float | None:
    seconds = _to_duration(text, field)
    return None if seconds >= model.MAX_TTL_SECONDS else seconds


def _to_str(text: str | None, field: str) -> str | None:
    return text.strip() if text and text.strip() else None


def _to_entity_ref(text: str | None, field: str) -> str | None:
    """``sb://host/name`` (as the SDK sends forward_to) or a bare ``name`` -> ``name``."""
    if not text or not text.strip():
        return None
    value = text.strip()
    parsed = urllib.parse.urlsplit(value)
    if parsed.scheme and parsed.netloc:
        value = urllib.parse.unquote(parsed.path)
    value = value.strip("/")
    if not value:
        raise _HttpError(400, f"{field}: expected an entity name or sb://namespace/entity, got {text!r}")
    return value


_Converter = Callable[[str | None, str], Any]

_QUEUE_FIELDS: dict[str, tuple[str, _Converter]] = {
    "LockDuration": ("lock_duration", _to_duration),
    "MaxSizeInMegabytes": ("max_size_in_megabytes", _to_int),
    "RequiresDuplicateDetection": ("requires_duplicate_detection", _to_bool),
    "RequiresSession": ("requires_session", _to_bool),
    "DefaultMessageTimeToLive": ("default_message_time_to_live", _to_duration_or_max),
    "DeadLetteringOnMessageExpiration": ("dead_lettering_on_message_expiration", _to_bool),
    "DuplicateDetectionHistoryTimeWindow": ("duplicate_detection_history_time_window", _to_duration),
    "MaxDeliveryCount": ("max_delivery_count", _to_int),
    "EnableBatchedOperations": ("enable_batched_operations", _to_bool),
    "Status": ("status", _to_str),
    "AutoDeleteOnIdle": ("auto_delete_on_idle", _to_duration_or_max),
    "ForwardTo": ("forward_to", _to_entity_ref),
    "ForwardDeadLetteredMessagesTo": ("forward_dead_lettered_messages_to", _to_entity_ref),
}
_TOPIC_FIELDS: dict[str, tuple[str, _Converter]] = {
    "DefaultMessageTimeToLive": ("default_message_time_to_live", _to_duration_or_max),
    "MaxSizeInMegabytes": ("max_size_in_megabytes", _to_int),
    "RequiresDuplicateDetection": ("requires_duplicate_detection", _to_bool),
    "DuplicateDetectionHistoryTimeWindow": ("duplicate_detection_history_time_window", _to_duration),
    "EnableBatchedOperations": ("enable_batched_operations", _to_bool),
    "Status": ("status", _to_str),
    "SupportOrdering": ("support_ordering", _to_bool),
    "AutoDeleteOnIdle": ("auto_delete_on_idle", _to_duration_or_max),
}
_SUBSCRIPTION_FIELDS: dict[str, tuple[str, _Converter]] = {
    "LockDuration": ("lock_duration", _to_duration),
    "RequiresSession": ("requires_session", _to_bool),
    "DefaultMessageTimeToLive": ("default_message_time_to_live", _to_duration_or_max),
    "DeadLetteringOnMessageExpiration": ("dead_lettering_on_message_expiration", _to_bool),
    "MaxDeliveryCount": ("max_delivery_count", _to_int),
    "EnableBatchedOperations": ("enable_batched_operations", _to_bool),
    "Status": ("status", _to_str),
    "ForwardTo": ("forward_to", _to_entity_ref),
    "ForwardDeadLetteredMessagesTo": ("forward_dead_lettered_messages_to", _to_entity_ref),
    "AutoDeleteOnIdle": ("auto_delete_on_idle", _to_duration_or_max),
}
_FIELDS = {QUEUE: _QUEUE_FIELDS, TOPIC: _TOPIC_FIELDS, SUBSCRIPTION: _SUBSCRIPTION_FIELDS}
_DESCRIPTION_KIND = {"QueueDescription": QUEUE, "TopicDescription": TOPIC, "SubscriptionDescription": SUBSCRIPTION}


def description_changes(desc: ET.Element, kind: str) -> dict[str, Any]:
    """The spec fields a Queue/Topic/SubscriptionDescription sets (elements not given are left out;
    read-only and unsupported elements such as MessageCount or EnablePartitioning are ignored)."""
    element = _local(desc.tag)
    changes: dict[str, Any] = {}
    for name, child in _children(desc).items():
        known = _FIELDS[kind].get(name)
        if known is None:
            continue
        attr, convert = known
        changes[attr] = convert(child.text, f"{element}/{name}")
    return changes


_KV_TYPES_IN = {
    "string": str, "int": int, "long": int, "short": int, "byte": int, "double": float, "float": float,
    "decimal": float,
}


def _parse_key_values(parent: ET.Element | None, field: str) -> dict[str, Any]:
    """``<KeyValueOfstringanyType><Key/><Value i:type="d6p1:int"/>`` children -> dict."""
    out: dict[str, Any] = {}
    if parent is None:
        return out
    for kv in parent:
        parts = _children(kv)
        key_el, value_el = parts.get("Key"), parts.get("Value")
        if key_el is None or not key_el.text or value_el is None:
            raise _HttpError(400, f"{field}: each KeyValueOfstringanyType needs a Key and a Value")
        key = key_el.text
        vtype = _xsi_type(value_el) or "string"
        text = value_el.text or ""
        label = f"{field}[{key!r}]"
        if vtype == "boolean":
            out[key] = _to_bool(text, label)
        elif vtype in _KV_TYPES_IN:
            try:
                out[key] = _KV_TYPES_IN[vtype](text)
            except ValueError:
                raise _HttpError(400, f"{label}: expected a {vtype}, got {text!r}") from None
        elif vtype in ("dateTime", "duration"):
            out[key] = text  # kept as its ISO 8601 text
        else:
            raise _HttpError(400, f"{label}: unsupported value type {vtype!r}")
    return out


_CORRELATION_IN = {
    "CorrelationId": "correlation_id",
    "MessageId": "message_id",
    "To": "to",
    "ReplyTo": "reply_to",
    "Label": "subject",
    "SessionId": "session_id",
    "ReplyToSessionId": "reply_to_session_id",
    "ContentType": "content_type",
}


def parse_rule(desc: ET.Element, name: str, *, check_tag: bool = True) -> RuleSpec:
    """A RuleDescription element -> RuleSpec named ``name`` (the URL's name wins over <Name>)."""
    if check_tag and _local(desc.tag) != "RuleDescription":
        raise _HttpError(400, f"expected a RuleDescription, got <{_local(desc.tag)}>")
    parts = _children(desc)
    filt = parts.get("Filter")
    spec: dict[str, Any]
    if filt is None:
        spec = {"type": "true"}
    else:
        ftype = _xsi_type(filt)
        fparts = _children(filt)
        if ftype == "CorrelationFilter":
            spec = {"type": "correlation"}
            for element, key in _CORRELATION_IN.items():
                child = fparts.get(element)
                if child is not None and child.text is not None:
                    spec[key] = child.text
            props = _parse_key_values(fparts.get("Properties"), "RuleDescription/Filter/Properties")
            if props:
                spec["properties"] = props
        elif ftype in ("TrueFilter", "FalseFilter"):
            spec = {"type": "true" if ftype == "TrueFilter" else "false"}
        elif ftype == "SqlFilter":
            expr = fparts.get("SqlExpression")
            if expr is None or not (expr.text or "").strip():
                raise _HttpError(400, "RuleDescription/Filter/SqlExpression: a SQL filter needs an expression")
            spec = {"type": "sql", "expression": expr.text}
            params = _parse_key_values(fparts.get("Parameters"), "RuleDescription/Filter/Parameters")
            if params:
                spec["parameters"] = params
        else:
            raise _HttpError(400, f"RuleDescription/Filter: unsupported filter type {ftype!r} "
                                  "(expected CorrelationFilter, SqlFilter, TrueFilter or FalseFilter)")
    action = parts.get("Action")
    rule_action: dict[str, Any] | None = None
    if action is not None:
        atype = _xsi_type(action)
        aparts = _children(action)
        expr = aparts.get("SqlExpression")
        text = (expr.text or "").strip() if expr is not None else ""
        if atype == "SqlRuleAction":
            if not text:
                raise _HttpError(400, "RuleDescription/Action/SqlExpression: a SQL rule action needs an expression")
            rule_action = {"expression": expr.text if expr is not None else ""}
            params = _parse_key_values(aparts.get("Parameters"), "RuleDescription/Action/Parameters")
            if params:
                rule_action["parameters"] = params
        elif atype not in (None, "EmptyRuleAction"):
            raise _HttpError(400, f"RuleDescription/Action: unsupported action type {atype!r} "
                                  "(expected SqlRuleAction or EmptyRuleAction)")
    return RuleSpec(name=name, filter=spec, action=rule_action)


# --------------------------------------------------------------------------- rendering responses


@dataclasses.dataclass
class _Snapshot:
    """What the broker thread hands back for rendering one entity."""

    spec: Any
    counts: RuntimeCounts | None
    created_at: float
    subscription_count: int = 0
    sql_filter_count: int = 0
    correlation_filter_count: int = 0


def _el(name: str, value: str | None) -> str:
    return f"<{name}>{escape(value)}</{name}>" if value is not None else ""


def _count_details(counts: RuntimeCounts | None) -> str:
    c = counts or RuntimeCounts()
    items = [
        ("ActiveMessageCount", c.active),
        ("DeadLetterMessageCount", c.dead_letter),
        ("ScheduledMessageCount", c.scheduled),
        ("TransferMessageCount", c.transfer),
        ("TransferDeadLetterMessageCount", c.transfer_dead_letter),
    ]
    inner = "".join(f"<d2p1:{n}>{v}</d2p1:{n}>" for n, v in items)
    return f'<CountDetails xmlns:d2p1="{COUNT_NS}">{inner}</CountDetails>'


def _message_count(counts: RuntimeCounts | None) -> int:
    c = counts or RuntimeCounts()
    return c.total + c.transfer + c.transfer_dead_letter


class _Renderer:
    """Atom entries and feeds for one request (``base`` = ``http://host``, ``namespace`` = the SAS host)."""

    def __init__(self, base: str, namespace: str, api_version: str) -> None:
        self.base = base
        self.namespace = namespace
        self.api_version = api_version

    def _ref(self, name: str | None) -> str | None:
        return f"sb://{self.namespace}/{name}" if name else None

    def queue(self, snap: _Snapshot) -> str:
        s: QueueSpec = snap.spec
        c = snap.counts or RuntimeCounts()
        t = _format_time(snap.created_at)
        return (
            f'<QueueDescription xmlns="{SB_NS}" xmlns:i="{XSI_NS}">'
            + _el("LockDuration", format_duration(s.lock_duration))
            + _el("MaxSizeInMegabytes", str(s.max_size_in_megabytes))
            + _el("RequiresDuplicateDetection", _bool(s.requires_duplicate_detection))
            + _el("RequiresSession", _bool(s.requires_session))
            + _el("DefaultMessageTimeToLive", format_duration(s.default_message_time_to_live))
            + _el("DeadLetteringOnMessageExpiration", _bool(s.dead_lettering_on_message_expiration))
            + _el("DuplicateDetectionHistoryTimeWindow", format_duration(s.duplicate_detection_history_time_window))
            + _el("MaxDeliveryCount", str(s.max_delivery_count))
            + _el("EnableBatchedOperations", _bool(s.enable_batched_operations))
            + _el("SizeInBytes", str(c.size_in_bytes))
            + _el("MessageCount", str(_message_count(c)))
            + _el("IsAnonymousAccessible", "false")
            + "<AuthorizationRules/>"
            + _el("Status", s.status)
            + _el("CreatedAt", t) + _el("UpdatedAt", t) + _el("AccessedAt", t)
            + _el("SupportOrdering", "true")
            + _count_details(c)
            + _el("AutoDeleteOnIdle", format_duration(s.auto_delete_on_idle))
            + _el("EnablePartitioning", "false")
            + _el("EntityAvailabilityStatus", "Available")
            + _el("EnableExpress", "false")
            + _el("ForwardTo", self._ref(s.forward_to))
            + _el("ForwardDeadLetteredMessagesTo", self._ref(s.forward_dead_lettered_messages_to))
            + _el("MaxMessageSizeInKilobytes", "256")
            + "</QueueDescription>"
        )

    def topic(self, snap: _Snapshot) -> str:
        s: TopicSpec = snap.spec
        c = snap.counts or RuntimeCounts()
        t = _format_time(snap.created_at)
        return (
            f'<TopicDescription xmlns="{SB_NS}" xmlns:i="{XSI_NS}">'
            + _el("DefaultMessageTimeToLive", format_duration(s.default_message_time_to_live))
            + _el("MaxSizeInMegabytes", str(s.max_size_in_megabytes))
            + _el("RequiresDuplicateDetection", _bool(s.requires_duplicate_detection))
            + _el("DuplicateDetectionHistoryTimeWindow", format_duration(s.duplicate_detection_history_time_window))
            + _el("EnableBatchedOperations", _bool(s.enable_batched_operations))
            + _el("SizeInBytes", str(c.size_in_bytes))
            + _el("FilteringMessagesBeforePublishing", "false")
            + _el("IsAnonymousAccessible", "false")
            + "<AuthorizationRules/>"
            + _el("Status", s.status)
            + _el("CreatedAt", t) + _el("UpdatedAt", t) + _el("AccessedAt", t)
            + _el("SupportOrdering", _bool(s.support_ordering))
            + _count_details(c)
            + _el("SubscriptionCount", str(snap.subscription_count))
            + _el("SqlFilterCount", str(snap.sql_filter_count))
            + _el("CorrelationFilterCount", str(snap.correlation_filter_count))
            + _el("AutoDeleteOnIdle", format_duration(s.auto_delete_on_idle))
            + _el("EnablePartitioning", "false")
            + _el("EntityAvailabilityStatus", "Available")
            + _el("EnableSubscriptionPartitioning", "false")
            + _el("EnableExpress", "false")
            + _el("MaxMessageSizeInKilobytes", "256")
            + "</TopicDescription>"
        )

    def subscription(self, snap: _Snapshot) -> str:
        s: SubscriptionSpec = snap.spec
        c = snap.counts or RuntimeCounts()
        t = _format_time(snap.created_at)
        return (
            f'<SubscriptionDescription xmlns="{SB_NS}" xmlns:i="{XSI_NS}">'
            + _el("LockDuration", format_duration(s.lock_duration))
            + _el("RequiresSession", _bool(s.requires_session))
            + _el("DefaultMessageTimeToLive", format_duration(s.default_message_time_to_live))
            + _el("DeadLetteringOnMessageExpiration", _bool(s.dead_lettering_on_message_expiration))
            + _el("DeadLetteringOnFilterEvaluationExceptions", "true")
            + _el("MessageCount", str(_message_count(c)))
            + _el("MaxDeliveryCount", str(s.max_delivery_count))
            + _el("EnableBatchedOperations", _bool(s.enable_batched_operations))
            + _el("Status", s.status)
            + _el("ForwardTo", self._ref(s.forward_to))
            + _el("CreatedAt", t) + _el("UpdatedAt", t) + _el("AccessedAt", t)
            + _count_details(c)
            + _el("ForwardDeadLetteredMessagesTo", self._ref(s.forward_dead_lettered_messages_to))
            + _el("AutoDeleteOnIdle", format_duration(s.auto_delete_on_idle))
            + _el("EntityAvailabilityStatus", "Available")
            + "</SubscriptionDescription>"
        )

    @staticmethod
    def _key_values(values: dict[str, Any]) -> str:
        out = []
        for key, value in values.items():
            if isinstance(value, bool):
                vtype, text = "boolean", _bool(value)
            elif isinstance(value, int):
                vtype, text = ("int" if -(2**31) <= value < 2**31 else "long"), str(value)
            elif isinstance(value, float):
                vtype, text = "double", repr(value)
            else:
                vtype, text = "string", str(value)
            out.append(
                f"<KeyValueOfstringanyType><Key>{escape(str(key))}</Key>"
                f'<Value xmlns:d6p1="{XSD_NS}" i:type="d6p1:{vtype}">{escape(text)}</Value>'
                "</KeyValueOfstringanyType>"
            )
        return "".join(out)

    def _action(self, action: dict[str, Any] | None) -> str:
        if not action:
            return '<Action i:type="EmptyRuleAction"/>'
        params = action.get("parameters") or {}
        return ('<Action i:type="SqlRuleAction">' + _el("SqlExpression", action.get("expression", ""))
                + "<CompatibilityLevel>20</CompatibilityLevel>"
                + (f"<Parameters>{self._key_values(params)}</Parameters>" if params else "")
                + "</Action>")

    def rule(self, rule: RuleSpec, created_at: float) -> str:
        f = rule.filter
        ftype = f.get("type")
        if ftype == "correlation":
            fields = "".join(_el(element, f.get(key)) for element, key in _CORRELATION_IN.items())
            props = f.get("properties") or {}
            filt = (f'<Filter i:type="CorrelationFilter">{fields}'
                    f"<Properties>{self._key_values(props)}</Properties></Filter>")
        elif ftype == "sql":
            params = f.get("parameters") or {}
            filt = ('<Filter i:type="SqlFilter">' + _el("SqlExpression", f.get("expression", ""))
                    + "<CompatibilityLevel>20</CompatibilityLevel>"
                    + (f"<Parameters>{self._key_values(params)}</Parameters>" if params else "")
                    + "</Filter>")
        elif ftype == "false":
            filt = ('<Filter i:type="FalseFilter"><SqlExpression>1=0</SqlExpression>'
                    "<CompatibilityLevel>20</CompatibilityLevel></Filter>")
        else:
            filt = ('<Filter i:type="TrueFilter"><SqlExpression>1=1</SqlExpression>'
                    "<CompatibilityLevel>20</CompatibilityLevel></Filter>")
        return (
            f'<RuleDescription xmlns="{SB_NS}" xmlns:i="{XSI_NS}">{filt}'
            + self._action(rule.action)
            + _el("CreatedAt", _format_time(created_at))
            + _el("Name", rule.name)
            + "</RuleDescription>"
        )

    def namespace_info(self, name: str, created_at: float) -> str:
        t = _format_time(created_at)
        return (
            f'<NamespaceInfo xmlns="{SB_NS}" xmlns:i="{XSI_NS}">'
            + _el("CreatedTime", t) + _el("MessagingSKU", "Standard") + _el("ModifiedTime", t)
            + _el("Name", name) + _el("NamespaceType", "Messaging")
            + "</NamespaceInfo>"
        )

    def entry(self, path: str, title: str, created_at: float, description: str, *, root: bool = True) -> str:
        # the service's ids spell the segments "Subscriptions" and "Rules": the JavaScript admin client reads the
        # topic, subscription and rule names out of the id by those exact words
        topic, subs, rest = path.partition(_SUBS)
        if subs:
            sub, rules, rule = rest.partition(_RULES)
            path = f"{topic}/Subscriptions/{sub}" + (f"/Rules/{rule}" if rules else "")
        quoted = urllib.parse.quote(path, safe="/$")
        href = f"{self.base}/{quoted}?api-version={urllib.parse.quote(self.api_version)}"
        t = _format_time(created_at)
        ns = f' xmlns="{ATOM_NS}"' if root else ""
        return (
            f"<entry{ns} xml:base={quoteattr(href)}>"
            f"<id>{escape(href)}</id>"
            f'<title type="text">{escape(title)}</title>'
            f"<published>{t}</published><updated>{t}</updated>"
            f"<author><name>{escape(self.namespace)}</name></author>"
            f'<link rel="self" href={quoteattr(href)}/>'
            f'<content type="application/xml">{description}</content>'
            "</entry>"
        )

    def feed(self, path: str, title: str, entries: list[str], skip: int, top: int, more: bool) -> str:
        quoted = urllib.parse.quote(path, safe="/$")
        api = urllib.parse.quote(self.api_version)
        self_href = f"{self.base}/{quoted}?$skip={skip}&$top={top}&api-version={api}"
        links = f'<link rel="self" href={quoteattr(self_href)}/>'
        if more:
            next_href = f"{self.base}/{quoted}?$skip={skip + top}&$top={top}&api-version={api}"
            links += f'<link rel="next" href={quoteattr(next_href)}/>'
        return (
            f'<feed xmlns="{ATOM_NS}"><title type="text">{escape(title)}</title>'
            f"<id>{escape(self_href)}</id><updated>{_format_time(time.time())}</updated>"
            f"{links}{''.join(entries)}</feed>"
        )


def _xml(document: str) -> bytes:
    return ('<?xml version="1.0" encoding="utf-8"?>' + document).encode("utf-8")


def _error_body(status: int, detail: str) -> bytes:
    return _xml(f"<Error><Code>{status}</Code><Detail>{escape(detail)}</Detail></Error>")


# --------------------------------------------------------------------------- routing

_SUBS = "/subscriptions/"
_RULES = "/rules/"


@dataclasses.dataclass
class _Route:
    kind: str  # "namespace", "list", "entity", "subscription", "subscriptions", "rule", "rules"
    path: str = ""  # entity path (queue/topic), subscription path, or "" for namespace-level routes
    topic: str = ""
    subscription: str = ""
    rule: str = ""
    list_of: str = ""  # for kind "list": QUEUE or TOPIC

    @property
    def fault_entity(self) -> str | None:
        if self.kind in ("entity", "subscription", "rule", "rules"):
            return self.path
        if self.kind == "subscriptions":
            return self.topic
        return None


def _route(path: str) -> _Route:
    """Classify a decoded request path (without the leading ``/``)."""
    path = path.rstrip("/")  # the JavaScript admin client lists ".../Subscriptions/" and ".../Rules/"
    lower = path.lower()
    if lower == "$namespaceinfo":
        return _Route("namespace")
    if lower.startswith("$resources/"):
        what = lower[len("$resources/"):].strip("/")
        if what in ("queues", "topics"):
            return _Route("list", list_of=QUEUE if what == "queues" else TOPIC)
        raise _HttpError(404, f"unknown resource collection {path!r} (expected $Resources/queues or topics)")
    if not path or path.startswith("$"):
        raise _HttpError(404, f"no such resource {('/' + path)!r}")
    # the segment names are case-insensitive: the JavaScript and .NET admin clients write "Subscriptions" and "Rules"
    if _SUBS in lower:
        at = lower.index(_SUBS)
        topic, rest = path[:at], path[at + len(_SUBS):]
        if _RULES in rest.lower():
            at = rest.lower().index(_RULES)
            sub, rule = rest[:at], rest[at + len(_RULES):]
            if not sub or not rule or "/" in rule or "/" in sub:
                raise _HttpError(404, f"no such resource {('/' + path)!r}")
            return _Route("rule", model.subscription_path(topic, sub), topic, sub, rule)
        if rest.lower().endswith("/rules"):
            sub = rest[: -len("/rules")]
            if not sub or "/" in sub:
                raise _HttpError(404, f"no such resource {('/' + path)!r}")
            return _Route("rules", model.subscription_path(topic, sub), topic, sub)
        if not rest or "/" in rest:
            raise _HttpError(404, f"no such resource {('/' + path)!r}")
        return _Route("subscription", model.subscription_path(topic, rest), topic, rest)
    if lower.endswith("/subscriptions"):
        return _Route("subscriptions", path, topic=path[: -len("/subscriptions")])
    return _Route("entity", path)


# --------------------------------------------------------------------------- the server


class AdminServer:
    """The admin HTTP API of one namespace.

    ``call(fn)`` runs ``fn()`` on the broker's thread and returns its result (or raises its exception);
    ``broker`` (a ``Broker``, or a proxy forwarding to one) is only ever touched inside it. ``keys`` maps SAS key names to keys. ``fault(entity)``
    gives the active fault kind for an entity path, or for the namespace when called with None.
    ``control(method, path, body)`` answers ``/$emulator/...`` requests with (status, JSON dict).
    """

    hold_seconds = 65.0  # how long a "timeout" fault holds a request without answering

    def __init__(
        self,
        host: str,
        port: int,
        *,
        broker: Any,
        call: BrokerCall,
        keys: dict[str, str],
        fault: Callable[[str | None], str | None] | None = None,
        control: Callable[[str, str, dict[str, Any]], tuple[int, dict[str, Any]]] | None = None,
        namespace_port: int | None = None,
        other_ports: Callable[[], Iterable[int | None]] | None = None,
        authority: aad.Authority | None = None,
        allowed_hosts: Iterable[str] = (),
        limits: AdminLimits | None = None,
        page: _page.Page | None = None,
    ) -> None:
        #: the live page of the emulator's namespaces, at ``/`` (:mod:`.page`); None: no page
        self.page = page
        #: the bounds of its connections: timeouts, workers, caps (emulator-wide)
        self.limits = limits or AdminLimits()
        #: Microsoft Entra ID: serves the token endpoint and verifies Bearer tokens (None: SAS only)
        self.authority = authority
        #: the host names a request's ``Host`` may give besides localhost and IP addresses (DNS rebinding: a name a
        #: web page's owner controls is refused)
        self.allowed_hosts = {h.strip("[]").lower() for h in (host, *allowed_hosts) if h}
        if host in ("0.0.0.0", "::", ""):  # every interface: this machine's own names too
            self.allowed_hosts.add(socket.gethostname().lower())
        #: the AMQP port of the namespace served
        self.namespace_port = namespace_port
        #: its other ports now (AMQPS, WebSockets): with the AMQP port and this admin port, the ports a token may
        #: name (Microsoft's emulator convention names the admin port in the connection string); another port is
        #: another namespace's, and its token is refused
        self._other_ports = other_ports
        self._host = host
        self._requested_port = port
        self._broker = broker
        self._call = call
        self._keys = keys
        self._fault = fault
        self._control = control
        self._loop: HttpLoop | None = None
        self._server = _AdminHTTPServer(self)
        self._started_at = time.time()

    def __repr__(self) -> str:
        return f"AdminServer(host={self._host!r}, port={self.port})"

    @property
    def port(self) -> int:
        if self._loop is not None:
            return int(self._loop.server_address[1])
        return self._requested_port

    def own_ports(self) -> set[int]:
        """The ports of the namespace served (AMQP, admin, AMQPS, WebSockets): the ports its tokens may name."""
        ports = {self.port, self.namespace_port, *(self._other_ports() if self._other_ports else ())}
        return {p for p in ports if p is not None}

    def start(self) -> AdminServer:
        if self._loop is not None:
            raise RuntimeError("the admin server is already started")
        loop = HttpLoop(self._host, self._requested_port, limits=self.limits, serve=self._serve,
                        refusal=_refusal, hold_seconds=lambda: self.hold_seconds, name="spark-sb-admin")
        self._loop = loop
        loop.start()
        _LOGGER.debug("admin API listening on http://%s:%d", self._host, self.port)
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return
        loop.stop()
        self._loop = None

    def stats(self) -> dict[str, Any]:
        """The admin port's connections (:meth:`HttpLoop.stats`), in ``/$emulator/stats`` as ``admin``."""
        loop = self._loop
        return loop.stats() if loop is not None else {}

    def _serve(self, sock: socket.socket, client: Any, head: bytes) -> Outcome:
        """One request whose head is complete, on a worker of the loop."""
        handler = _Handler(sock, client, self._server, head)
        handler.handle_one_request()
        if handler.held:
            return "hold", b""
        if handler.close_connection:
            return "close", b""
        return "keep", handler.rfile.leftover()

    def host_allowed(self, header: str | None) -> bool:
        """Whether a request's ``Host`` names this machine by a name a web page cannot rebind: none (not a
        browser), ``localhost`` (or ``*.localhost``), an IP address, or one of :attr:`allowed_hosts`."""
        if header is None:
            return True
        value = header.strip().lower()
        if value.startswith("["):  # [::1]:5300
            name = value[1:value.find("]")] if "]" in value else ""
        else:
            name = value.rsplit(":", 1)[0] if value.count(":") == 1 else value
        if not name:
            return False
        if name == "localhost" or name.endswith(".localhost") or name in self.allowed_hosts:
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True

    def _fault_for(self, entity: str | None) -> str | None:
        if self._fault is None:
            return None
        kind = self._fault(entity) if entity else None
        if kind is None:
            kind = self._fault(None)
        return kind

    def _broker_call(self, fn: Callable[[Broker], T]) -> T:
        broker = self._broker
        return self._call(lambda: fn(broker))


class _AdminHTTPServer:
    """What a request's handler sees as its server."""

    def __init__(self, admin: AdminServer) -> None:
        self.admin = admin


def _refusal(status: int, reason: str) -> bytes:
    """A whole answer that closes the connection: a connection refused at a cap (503), a head too large (431)."""
    body = _error_body(status, reason)
    phrase = HTTPStatus(status).phrase
    return (f"HTTP/1.1 {status} {phrase}\r\nContent-Type: {_CT_ERROR}\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n" + ("Retry-After: 1\r\n" if status == 503 else "") + "\r\n").encode() + body


class _Reader:
    """A request's bytes: the head the loop read, then the socket, every read by ``deadline`` (a slow body holds a
    worker no longer than the request timeout). It reads ahead no further than one recv; :meth:`leftover` is what
    it read past the request, handed back to the loop with the connection."""

    def __init__(self, sock: socket.socket, data: bytes, deadline: float) -> None:
        self._sock = sock
        self._buf = bytearray(data)
        self._deadline = deadline

    def _fill(self) -> bool:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request was not read within the admin request timeout")
        self._sock.settimeout(left)
        chunk = self._sock.recv(65536)
        self._buf += chunk
        return bool(chunk)

    def readline(self, limit: int = -1) -> bytes:
        start = 0
        while True:
            at = self._buf.find(b"\n", start)
            if at >= 0 and (limit < 0 or at < limit):
                end = at + 1
                break
            if 0 <= limit <= len(self._buf):
                end = limit
                break
            start = len(self._buf)
            if not self._fill():
                end = len(self._buf)
                break
        line = bytes(self._buf[:end])
        del self._buf[:end]
        return line

    def read(self, size: int = -1) -> bytes:
        if size < 0:
            raise ValueError("the admin API reads a body by its length")
        while len(self._buf) < size and self._fill():
            pass
        data = bytes(self._buf[:size])
        del self._buf[:size]
        return data

    def leftover(self) -> bytes:
        return bytes(self._buf)


class _Writer:
    """The answer's bytes, each write bounded by the request timeout."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self._sock = sock
        self._timeout = timeout

    def write(self, data: bytes) -> int:
        self._sock.settimeout(self._timeout)
        self._sock.sendall(data)
        return len(data)

    def flush(self) -> None:
        pass


# Broker-thread functions: each takes the broker and returns plain data for rendering.


def _snapshot(broker: Broker, spec: Any, path: str) -> _Snapshot:
    if spec.kind != TOPIC:
        return _Snapshot(spec, broker.runtime_counts(path), broker.entity_created_at(path))
    subs = broker.list_entities(SUBSCRIPTION, topic=path)
    # as the service counts: true and false filters are SQL filters (1=1, 1=0)
    kinds = [rule.filter.get("type") for sub in subs for rule in sub.rules]
    correlation = sum(1 for k in kinds if k == "correlation")
    return _Snapshot(spec, broker.runtime_counts(path), broker.entity_created_at(path), len(subs),
                     len(kinds) - correlation, correlation)


def _find_entity(broker: Broker, path: str) -> Any | None:
    """The queue or topic at ``path``, or None."""
    for kind in (QUEUE, TOPIC):
        try:
            spec = broker.get_entity(kind, path)
        except BrokerError as err:
            if err.condition == Cond.NOT_FOUND:
                continue
            raise
        if spec is not None and getattr(spec, "kind", kind) == kind:
            return spec
    return None


def _not_found(path: str) -> BrokerError:
    return BrokerError(Cond.NOT_FOUND, f"the messaging entity {path!r} could not be found")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "spark-sb-emulator"
    sys_version = ""
    server: _AdminHTTPServer  # type: ignore[assignment]  # not a socketserver: the loop (_http_loop) serves
    rfile: _Reader  # type: ignore[assignment]
    wfile: _Writer  # type: ignore[assignment]
    _body_pending = False  # the request's head announces a body not read (yet)
    held = False  # a "timeout" fault: the loop holds the connection, answering nothing
    _headers_buffer: list[bytes]  # the base class's head under construction (send_header), written by flush_headers

    # ------------------------------------------------------------------ plumbing
    def __init__(self, sock: socket.socket, client: Any, server: _AdminHTTPServer, head: bytes) -> None:
        # one request (handle_one_request), called by AdminServer._serve; not the base class's handle() loop: the
        # connection goes back to the loop between requests (TCP_NODELAY is set on it there)
        self.request = sock
        self.client_address = client
        self.server = server
        self._head = head
        self.close_connection = True
        self.setup()

    def setup(self) -> None:
        self.connection = self.request
        timeout = self.server.admin.limits.request_timeout
        self.rfile = _Reader(self.request, self._head, time.monotonic() + timeout)
        self.wfile = _Writer(self.request, timeout)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        _LOGGER.debug("admin API %s: %s", self.client_address[0], format % args)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def _declares_body(self) -> bool:
        """Whether the request's head announces a body (chunked, or a Content-Length other than 0)."""
        if self.headers.get("Transfer-Encoding"):
            return True
        return (self.headers.get("Content-Length") or "0").strip() != "0"

    def _read_body(self) -> bytes:
        """The body, only ever called once the request is authenticated. Never more than MAX_BODY_BYTES is read,
        whatever the framing; a malformed framing is a 400 and closes the connection."""
        self._body_pending = False
        keep_alive, self.close_connection = not self.close_connection, True  # closed unless read to its end
        encoding = (self.headers.get("Transfer-Encoding") or "").strip().lower()
        if encoding:
            if encoding != "chunked":
                raise _HttpError(400, f"unsupported Transfer-Encoding {encoding!r} (only chunked)")
            body = self._read_chunked()
        else:
            length_text = (self.headers.get("Content-Length") or "").strip()
            if not length_text:
                body = b""
            elif not (length_text.isascii() and length_text.isdigit()):
                raise _HttpError(400, f"invalid Content-Length {length_text[:40]!r}")
            elif int(length_text) > MAX_BODY_BYTES:
                raise _HttpError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
            else:
                length = int(length_text)
                body = self.rfile.read(length) if length else b""
                if len(body) != length:
                    raise _HttpError(400, "the request body ended before its Content-Length")
        self.close_connection = not keep_alive
        return body

    def _read_chunked(self) -> bytes:
        chunks, total = [], 0
        while True:
            size_line = self.rfile.readline(1024)
            if not size_line.endswith(b"\n"):
                raise _HttpError(400, "malformed chunked request body (a chunk size line without its end)")
            size_text = size_line.split(b";", 1)[0].strip()
            if not _CHUNK_SIZE.fullmatch(size_text):  # hex digits only: no sign, no 0x, no _
                raise _HttpError(400, f"malformed chunked request body (chunk size {size_text[:20]!r})")
            size = int(size_text, 16)
            if size == 0:
                break
            total += size
            if total > MAX_BODY_BYTES:
                raise _HttpError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
            chunk = self.rfile.read(size)
            if len(chunk) != size or self.rfile.readline(3) not in (b"\r\n", b"\n"):
                raise _HttpError(400, "malformed chunked request body (a chunk longer or shorter than its size)")
            chunks.append(chunk)
        trailer = 0
        while (line := self.rfile.readline(1024)) not in (b"\r\n", b"\n"):
            trailer += len(line)
            if not line.endswith(b"\n") or trailer > _MAX_TRAILER_BYTES:
                raise _HttpError(400, "malformed chunked request body (its trailer)")
        return b"".join(chunks)

    def _send(self, status: int, body: bytes, content_type: str | None,
              headers: Iterable[tuple[str, str]] = ()) -> None:
        if self._body_pending:  # answered without reading the body: the connection cannot carry another request
            self.close_connection = True
        self.send_response(status)
        if content_type:
            self.send_header("Content-Type", content_type)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        # head and body in one write: written apart, the body of an answer on a kept-alive connection waited for
        # the client's delayed ACK of the head (Nagle), ~45 ms on every request of an admin client
        self._headers_buffer.extend((b"\r\n", body))
        self.flush_headers()

    def _send_error(self, status: int, detail: str) -> None:
        self._send(status, _error_body(status, detail), _CT_ERROR)

    def _drop(self) -> None:
        """A "down" namespace: close the connection without an answer."""
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _hold(self) -> None:
        """A "timeout" fault: answer nothing until the client gives up (or hold_seconds pass). The loop holds the
        connection: a held request costs no worker."""
        self.held = True

    # ------------------------------------------------------------------ dispatch
    def _dispatch(self, method: str) -> None:
        admin = self.server.admin
        self._body_pending = self._declares_body()
        control = False
        try:
            split = urllib.parse.urlsplit(self.path)
            path = urllib.parse.unquote(split.path)
            control = path == "/$emulator" or path.startswith("/$emulator/")
            host = self.headers.get("Host")
            if not admin.host_allowed(host):
                raise _HttpError(403, f"Host {host!r} does not name this emulator (localhost, an IP address or "
                                      f"{', '.join(sorted(admin.allowed_hosts)) or 'no other name'}): a web page "
                                      "reaching it by DNS rebinding is refused")
            page = admin.page
            if page is not None and (path == "/" or path.startswith(_page.PREFIX)):
                control = path != "/"  # the page's API answers its errors in JSON, as the controls do
                self._page(page, method, path, split.query)
                return
            if control:
                self._control(method, path)
                return
            if path == aad.TOKEN_PATH:
                self._identity_token(method, split.query)
                return
            query = urllib.parse.parse_qs(split.query, keep_blank_values=True)
            route = _route(path.lstrip("/"))
            fault = admin._fault_for(route.fault_entity)
            if fault == "down":
                self._drop()
                return
            if fault == "timeout":
                self._hold()
                return
            namespace = self._authenticate(route, path)
            body = self._read_body()  # only now: an unauthenticated request has nothing of its body read
            if fault == "unauthorized":
                raise _HttpError(401, "Unauthorized access. 'Manage' claim(s) are required for this operation.")
            if fault == "busy":
                raise _HttpError(503, "The server is busy. Please try again later.")
            if fault == "notfound" and route.kind in ("entity", "subscription", "rule") and (
                method in ("GET", "DELETE") or (method == "PUT" and self.headers.get("If-Match"))
            ):
                raise _HttpError(404, f"the messaging entity {route.path!r} could not be found")
            api_version = (query.get("api-version") or [DEFAULT_API_VERSION])[0]
            host = self.headers.get("Host") or f"{admin._host}:{admin.port}"
            renderer = _Renderer(f"http://{host}", namespace, api_version)
            status, payload, content_type = self._handle(method, route, query, body, renderer)
            self._send(status, payload, content_type)
        except _HttpError as err:
            if control:
                self._send_json(err.status, {"error": err.detail})
            else:
                self._send_error(err.status, err.detail)
        except BrokerError as err:
            self._send_error(_BROKER_STATUS.get(err.condition, 400), err.description)
        except model.EntityConfigError as err:
            self._send_error(400, str(err))
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True  # TimeoutError: the body did not come within the request timeout
        except Exception:  # noqa: BLE001 - a bug must not take the server down
            _LOGGER.exception("admin API: %s %s failed", method, self.path.split("?", 1)[0])
            self.close_connection = True
            try:
                self._send_error(500, "internal error in the emulator's admin API (see its log)")
            except OSError:
                pass

    def _control(self, method: str, path: str) -> None:
        """The emulator's controls (fault, heal, faults, stats), refused to what a web page can forge: they need the
        header ``X-Spark-SB-Emulator: 1`` (or a token with Manage), and a body is ``application/json``."""
        control = self.server.admin._control
        if control is None:
            self._send_json(404, {"error": "no emulator controls on this server"})
            return
        if (self.headers.get(CONTROL_HEADER) or "").strip() != "1":
            if not (self.headers.get("Authorization") or "").strip():
                raise _HttpError(403, f"the emulator's controls need the header {CONTROL_HEADER}: 1 (or a SAS token "
                                      "with Manage); spark-sb emulator fault/heal and spark_sb.emulator.fault/heal "
                                      "send it")
            self._authenticate(_Route("control", path.strip("/")), path)
        data = self._json_body(method)
        try:
            status, answer = control(method, path, data)
        except Exception as err:  # noqa: BLE001 - report the failure to the caller
            _LOGGER.exception("admin API: control %s %s failed", method, path)
            self._send_json(500, {"error": f"{type(err).__name__}: {err}"})
            return
        if method == "GET" and status == 200 and path.rstrip("/") == "/$emulator/stats":
            answer = {**answer, "admin": self.server.admin.stats()}  # this port's connections, beside the namespace's
        self._send_json(status, answer)

    def _json_body(self, method: str) -> dict[str, Any]:
        """The JSON object a control's or the page's request carries ({} for a GET without a body): a body of
        another type is refused (415: a web page's form cannot send JSON), as is one that is not a JSON object."""
        if method != "GET" or self._body_pending:
            media = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                raise _HttpError(415, f"the emulator's controls take a JSON body (Content-Type: application/json), "
                                      f"got {media or 'no Content-Type'!r}")
        body = self._read_body()
        try:
            data = json.loads(body) if body.strip() else {}
        except ValueError as err:
            raise _HttpError(400, f"the body is not valid JSON ({err})") from None
        if not isinstance(data, dict):
            raise _HttpError(400, f"the body must be a JSON object, got {type(data).__name__}")
        return data

    def _page(self, page: _page.Page, method: str, path: str, query_text: str) -> None:
        """The live page (:mod:`.page`): the page and its files for anyone the Host check lets in, its API only with
        the controls' header and, for a POST, a JSON body; a namespace with a key of its own also needs it."""
        if path == "/":
            self._only(method, "GET")
            host = self.headers.get("Host") or f"localhost:{self.server.admin.port}"
            self._send(200, page.html(host).encode("utf-8"), "text/html; charset=utf-8", _page.SECURITY_HEADERS)
            return
        name = path[len(_page.PREFIX):]
        found = _page.file(name)
        if found is not None:
            self._only(method, "GET")
            self._send(200, found[0], found[1], _page.SECURITY_HEADERS)
            return
        if (self.headers.get(CONTROL_HEADER) or "").strip() != "1":
            raise _HttpError(403, f"the page's requests need the header {CONTROL_HEADER}: 1 (its script sends it; a "
                                  "page of another site cannot)")
        body = self._json_body(method)
        query = urllib.parse.parse_qs(query_text, keep_blank_values=True)
        try:
            if name == "namespaces":
                self._only(method, "GET")
                self._send(200, page.namespaces_html().encode("utf-8"), "text/html; charset=utf-8",
                           _page.SECURITY_HEADERS)
            elif name == "view":
                self._only(method, "GET")
                self._send_json(200, page.view())
            elif name == "messages":
                self._only(method, "GET")
                peek = page.messages(query, self.headers)
                if (query.get("format") or [""])[0] == "json":
                    self._send_json(200, peek)
                else:
                    self._send(200, page.messages_html(peek).encode("utf-8"), "text/html; charset=utf-8",
                               _page.SECURITY_HEADERS)
            elif name in ("fault", "heal"):
                self._only(method, "POST")
                self._send_json(200, page.fault(body, self.headers) if name == "fault" else page.heal(body,
                                                                                                     self.headers))
            else:
                raise _HttpError(404, f"no page resource {path!r} (the page is at /)")
        except _page.PageError as err:
            self._send_json(err.status, {"error": str(err)})

    def _send_json(self, status: int, data: dict[str, Any]) -> None:
        self._send(status, json.dumps(data).encode("utf-8"), _CT_JSON)

    def _identity_token(self, method: str, query_text: str) -> None:
        """The managed-identity token endpoint (App Service protocol). Neither the header nor the token is
        logged."""
        authority = self.server.admin.authority
        if authority is None:
            self._send_json(404, {"statusCode": 404, "message": "Microsoft Entra ID is not enabled on this emulator "
                                                                "(start it with --entra-id)"})
            return
        if method != "GET":
            self._send_json(405, {"statusCode": 405, "message": f"{method} is not supported here (use GET)"})
            return
        query = urllib.parse.parse_qs(query_text, keep_blank_values=True)
        status, answer = authority.token_response(query, {k: v for k, v in self.headers.items()})
        if status != 200:
            _LOGGER.info("identity endpoint: token request refused (%d): %s", status, answer.get("message"))
        self._send_json(status, answer)

    def _authenticate(self, route: _Route, path: str) -> str:
        """Verify the SAS or Entra ID token for the resource at ``path``; returns the namespace host the token names
        (e.g. ``localhost:5672``; for an Entra ID token, which names none, ``localhost:<the namespace's port>``)."""
        header = (self.headers.get("Authorization") or "").strip()
        if not header:
            raise _HttpError(401, "MissingToken: the request has no Authorization header.")
        token = header[len("Bearer "):].strip() if header.lower().startswith("bearer ") else header
        if aad.looks_like_jwt(token):
            return self._authenticate_jwt(token, route)
        try:
            namespace = _token_namespace(token)
            # the resource is the request's own path: the JavaScript admin client signs each request's URL, so its
            # token for a rule or a list (".../Subscriptions/s/Rules/r") names more than the entity the request is about
            audience = f"{namespace}/{path.strip('/')}".rstrip("/") if namespace else ""
            sas.verify(token, self.server.admin._keys, audience=audience or None)
        except sas.SasError as err:
            raise _HttpError(401, f"InvalidSignature: {err}") from None
        admin, named = self.server.admin, sas.port_of(namespace)
        ports = admin.own_ports()
        if admin.namespace_port is not None and named is not None and named not in ports:
            raise _HttpError(401, f"InvalidAudience: the token is for {namespace}, not this namespace "
                                  f"(ports {', '.join(map(str, sorted(ports)))})")
        return namespace or "localhost"

    def _authenticate_jwt(self, token: str, route: _Route) -> str:
        admin = self.server.admin
        if admin.authority is None:
            raise _HttpError(401, "InvalidToken: Microsoft Entra ID tokens are not enabled on this namespace (start "
                                  "the emulator with --entra-id, or Emulator(..., entra_id=True)).")
        try:
            grant = admin.authority.verify(token)
        except aad.AadError as err:
            raise _HttpError(401, f"Unauthorized: {err}") from None
        served = admin.namespace_port
        namespace = f"localhost:{served}" if served is not None else "localhost"
        refusal = grant.refusal(aad.MANAGE, f"{namespace}/{route.path}".rstrip("/"), admin.authority.clock())
        if refusal is not None:
            raise _HttpError(401, refusal)
        return namespace

    # ------------------------------------------------------------------ the API
    def _handle(
        self, method: str, route: _Route, query: dict[str, list[str]], body: bytes, r: _Renderer
    ) -> tuple[int, bytes, str | None]:
        admin = self.server.admin
        call = admin._broker_call
        kind = route.kind
        if kind == "namespace":
            self._only(method, "GET")
            name = r.namespace.split(":", 1)[0].split(".", 1)[0]
            return 200, _xml(r.entry("$namespaceinfo", name, admin._started_at,
                                     r.namespace_info(name, admin._started_at))), _CT_ENTRY
        if kind == "list":
            self._only(method, "GET")
            skip, top = _paging(query)
            snaps, total = call(lambda b: _list_entities(b, route.list_of, skip, top))
            render = r.queue if route.list_of == QUEUE else r.topic
            entries = [r.entry(s.spec.name, s.spec.name, s.created_at, render(s), root=False) for s in snaps]
            title = "Queues" if route.list_of == QUEUE else "Topics"
            return 200, _xml(r.feed(f"$Resources/{title.lower()}", title, entries, skip, top,
                                    skip + top < total)), _CT_FEED
        if kind == "subscriptions":
            if method == "GET":
                skip, top = _paging(query)
                result = call(lambda b: _list_subscriptions(b, route.topic, route.path, skip, top))
                if isinstance(result, _Snapshot):  # "<name>/subscriptions" was itself a queue or topic
                    return self._entity_response(r, route.path, result, 200)
                snaps, total = result
                entries = [r.entry(s.spec.path, s.spec.name, s.created_at, r.subscription(s), root=False)
                           for s in snaps]
                return 200, _xml(r.feed(route.path, "Subscriptions", entries, skip, top,
                                        skip + top < total)), _CT_FEED
            route = _Route("entity", route.path)
            kind = "entity"
        if kind == "entity":
            return self._entity(method, route.path, body, r)
        if kind == "subscription":
            return self._subscription(method, route, body, r)
        if kind == "rules":
            self._only(method, "GET")
            skip, top = _paging(query)
            rules, created = call(lambda b: _list_rules(b, route))
            page = rules[skip: skip + top]
            entries = [r.entry(f"{route.path}/rules/{rule.name}", rule.name, created, r.rule(rule, created),
                               root=False) for rule in page]
            return 200, _xml(r.feed(f"{route.path}/rules", "Rules", entries, skip, top,
                                    skip + top < len(rules))), _CT_FEED
        return self._rule(method, route, body, r)

    @staticmethod
    def _only(method: str, *allowed: str) -> None:
        if method not in allowed:
            raise _HttpError(405, f"{method} is not supported here (use {', '.join(allowed)})")

    def _entity_response(self, r: _Renderer, path: str, snap: _Snapshot, status: int) -> tuple[int, bytes, str]:
        desc = r.queue(snap) if snap.spec.kind == QUEUE else r.topic(snap)
        return status, _xml(r.entry(path, path, snap.created_at, desc)), _CT_ENTRY

    def _entity(self, method: str, path: str, body: bytes, r: _Renderer) -> tuple[int, bytes, str | None]:
        call = self.server.admin._broker_call
        if method == "GET":
            def get(b: Broker) -> _Snapshot:
                spec = _find_entity(b, path)
                if spec is None:
                    raise _not_found(path)
                return _snapshot(b, spec, path)

            return self._entity_response(r, path, call(get), 200)
        if method == "DELETE":
            def delete(b: Broker) -> None:
                spec = _find_entity(b, path)
                if spec is None:
                    raise _not_found(path)
                b.delete_entity(spec.kind, path)

            call(delete)
            return 200, b"", None
        self._only(method, "GET", "PUT", "DELETE")
        desc = parse_body(body)
        kind = _DESCRIPTION_KIND.get(_local(desc.tag))
        if kind not in (QUEUE, TOPIC):
            raise _HttpError(400, f"expected a QueueDescription or TopicDescription for {path!r}, "
                                  f"got <{_local(desc.tag)}>")
        changes = description_changes(desc, kind)
        update = bool(self.headers.get("If-Match"))
        cls = QueueSpec if kind == QUEUE else TopicSpec

        def put(b: Broker) -> _Snapshot:
            existing = _find_entity(b, path)
            if update:
                if existing is None:
                    raise _not_found(path)
                if existing.kind != kind:
                    raise BrokerError(Cond.INVALID, f"{path!r} is a {existing.kind}, not a {kind}")
                spec = dataclasses.replace(existing, **changes)
                model.validate(spec)
                b.update_entity(spec)
            else:
                if existing is not None:
                    raise BrokerError(Cond.ALREADY_EXISTS, f"the messaging entity {path!r} already exists "
                                                           f"(as a {existing.kind})")
                spec = cls(name=path, **changes)
                model.validate(spec)
                b.create_entity(spec)
            return _snapshot(b, b.get_entity(kind, path), path)

        return self._entity_response(r, path, call(put), 200 if update else 201)

    def _subscription(self, method: str, route: _Route, body: bytes, r: _Renderer) -> tuple[int, bytes, str | None]:
        call = self.server.admin._broker_call
        path = route.path

        def render(snap: _Snapshot, status: int) -> tuple[int, bytes, str]:
            return status, _xml(r.entry(path, route.subscription, snap.created_at, r.subscription(snap))), _CT_ENTRY

        if method == "GET":
            return render(call(lambda b: _snapshot(b, b.get_entity(SUBSCRIPTION, path), path)), 200)
        if method == "DELETE":
            call(lambda b: b.delete_entity(SUBSCRIPTION, path))
            return 200, b"", None
        self._only(method, "GET", "PUT", "DELETE")
        desc = parse_body(body)
        if _local(desc.tag) != "SubscriptionDescription":
            raise _HttpError(400, f"expected a SubscriptionDescription for {path!r}, got <{_local(desc.tag)}>")
        changes = description_changes(desc, SUBSCRIPTION)
        update = bool(self.headers.get("If-Match"))
        parts = _children(desc)
        default_rule = parts.get("DefaultRuleDescription", parts.get("RuleDescription"))
        if default_rule is not None and not update:
            name_el = _children(default_rule).get("Name")
            rule_name = (name_el.text or "").strip() if name_el is not None else ""
            changes["rules"] = [parse_rule(default_rule, rule_name or "$Default", check_tag=False)]

        def put(b: Broker) -> _Snapshot:
            if update:
                spec = dataclasses.replace(b.get_entity(SUBSCRIPTION, path), **changes)
                model.validate(spec)
                b.update_entity(spec)
            else:
                spec = SubscriptionSpec(topic=route.topic, name=route.subscription, **changes)
                model.validate(spec)
                b.create_entity(spec)
            return _snapshot(b, b.get_entity(SUBSCRIPTION, path), path)

        return render(call(put), 200 if update else 201)

    def _rule(self, method: str, route: _Route, body: bytes, r: _Renderer) -> tuple[int, bytes, str | None]:
        call = self.server.admin._broker_call
        entry_path = f"{route.path}/rules/{route.rule}"

        def render(rule: RuleSpec, created: float, status: int) -> tuple[int, bytes, str]:
            return status, _xml(r.entry(entry_path, rule.name, created, r.rule(rule, created))), _CT_ENTRY

        if method == "GET":
            def get(b: Broker) -> tuple[RuleSpec, float]:
                rules, created = _list_rules(b, route)
                for rule in rules:
                    if rule.name == route.rule:
                        return rule, created
                raise BrokerError(Cond.NOT_FOUND, f"rule {route.rule!r} of {route.path!r} could not be found")

            rule, created = call(get)
            return render(rule, created, 200)
        if method == "DELETE":
            call(lambda b: b.delete_rule(route.topic, route.subscription, route.rule))
            return 200, b"", None
        self._only(method, "GET", "PUT", "DELETE")
        rule = parse_rule(parse_body(body), route.rule)
        model.validate_rule(f"subscription {route.path!r}", rule)
        update = bool(self.headers.get("If-Match"))

        def put(b: Broker) -> float:
            if update:
                b.update_rule(route.topic, route.subscription, rule)
            else:
                b.create_rule(route.topic, route.subscription, rule)
            return b.entity_created_at(route.path)

        created = call(put)
        return render(rule, created, 200 if update else 201)


_BROKER_STATUS = {
    Cond.NOT_FOUND: 404,
    Cond.ALREADY_EXISTS: 409,
    Cond.UNAUTHORIZED: 401,
    Cond.BUSY: 503,
    Cond.QUOTA: 403,
    Cond.INTERNAL: 500,
}


def _paging(query: dict[str, list[str]]) -> tuple[int, int]:
    def one(name: str, default: int) -> int:
        values = query.get(name)
        if not values or not values[0]:
            return default
        try:
            value = int(values[0])
        except ValueError:
            raise _HttpError(400, f"{name}: expected a non-negative integer, got {values[0]!r}") from None
        if value < 0:
            raise _HttpError(400, f"{name}: expected a non-negative integer, got {values[0]!r}")
        return value

    return one("$skip", 0), max(1, one("$top", 100))


def _list_entities(broker: Broker, kind: str, skip: int, top: int) -> tuple[list[_Snapshot], int]:
    specs = broker.list_entities(kind)
    return [_snapshot(broker, s, s.name) for s in specs[skip: skip + top]], len(specs)


def _list_subscriptions(
    broker: Broker, topic: str, full_path: str, skip: int, top: int
) -> tuple[list[_Snapshot], int] | _Snapshot:
    try:
        broker.get_entity(TOPIC, topic)
    except BrokerError as err:
        if err.condition != Cond.NOT_FOUND:
            raise
        spec = _find_entity(broker, full_path)
        if spec is not None:
            return _snapshot(broker, spec, full_path)
        raise BrokerError(Cond.NOT_FOUND, f"the topic {topic!r} could not be found") from None
    specs = broker.list_entities(SUBSCRIPTION, topic=topic)
    return [_snapshot(broker, s, s.path) for s in specs[skip: skip + top]], len(specs)


def _list_rules(broker: Broker, route: _Route) -> tuple[list[RuleSpec], float]:
    rules = broker.list_rules(route.topic, route.subscription)
    return list(rules), broker.entity_created_at(route.path)


def _token_namespace(token: str) -> str:
    """The host (and port) of the token's ``sr`` (``https://localhost:5672`` -> ``localhost:5672``); raises
    :class:`sas.SasError` for an ``sr`` that is no resource URI."""
    prefix = "SharedAccessSignature "
    if not token.startswith(prefix):
        return ""
    for part in token[len(prefix):].split("&"):
        name, _, value = part.partition("=")
        if name.strip() == "sr":  # read as the token is checked (sas.SasError for an sr that is no resource URI)
            resource = sas.parse_resource(urllib.parse.unquote_plus(value), "token resource sr")
            return resource.netloc
    return ""
