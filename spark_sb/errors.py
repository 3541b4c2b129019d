"""One error hierarchy for spark-sb, and the single place that classifies Service Bus exceptions.

Every error spark-sb raises derives from :class:`SparkSbError`. Like ``azure/servicebus/exceptions.py``,
each class carries its behaviour as flags (``error_class``, ``retryable``) and the code that handles it
acts on the flags, never on message text.

:func:`classify` implements the "Error classes" table of ``behaviour.md``: it maps an exception raised by
azure-servicebus (after the SDK's own retry policy has run) to an :class:`ErrorClass`. Its predicates
(:func:`is_connection_lost`, :func:`needs_session`, :func:`already_exists`, :func:`unreachable_reason`,
:func:`is_unanswered`, :func:`is_message_not_found`, :func:`is_lock_lost`, :func:`is_link_gone`,
:func:`is_too_large`) answer the other questions callers ask about an exception. No other module inspects SDK
exception types or their message text.

A settlement on a receiver whose handler the SDK shut down
----------------------------------------------------------
When a receiver's connection is lost, the SDK shuts its handler down (``_close_handler``; the next receive opens
a new one), and settling a message it delivered before (``complete``, ``abandon``, ``defer``, ``dead-letter``,
renewing its lock) raises a plain ``ValueError("Failed to abandon the message as the handler has already been
shutdown.Please use ServiceBusClient to create a new instance.")``. Nothing is lost: the message's lock went with
the connection, it lapses, and the broker delivers the message again. That exact text (and only it) is an
``OUTAGE`` and :func:`is_link_gone`; any other ``ValueError`` (a sender used after close, an encoding error)
stays ``OTHER``.

Credential rejected versus connection broken
--------------------------------------------
The SDK raises ``ServiceBusAuthenticationError`` for every failure of the claims-based-security (CBS)
handshake and ``ServiceBusAuthorizationError`` for an ``amqp:unauthorized-access`` condition. Read in the
SDK (``_transport/_pyamqp_transport.py`` ``_handle_amqp_exception_with_condition``, ``_pyamqp/cbs.py``),
the causes are:

* a rejected token: the ``$cbs`` node answers ``put-token`` with status 401 (or 403); the SDK raises
  ``TokenAuthFailure(status_code=401, ...)`` and wraps it as ``ServiceBusAuthenticationError`` with
  ``inner_exception`` (and ``__context__``) set to it, condition ``amqp:client-error``;
* a missing claim (e.g. no ``Send`` right): the link attach or the management request fails with
  ``amqp:unauthorized-access`` -> ``ServiceBusAuthorizationError``, condition ``amqp:unauthorized-access``
  (management requests also carry status code 401);
* a credential that cannot produce a token at all (azure-identity raises ``ClientAuthenticationError``):
  the SDK wraps it as a plain ``ServiceBusError("Handler failed: ...")`` with that ``inner_exception``;
* a broken CBS exchange: ``TokenAuthFailure`` with status 0 ("Auth message has been rejected") or with an
  ``amqp:client-error`` status ("CBS authentication link is in broken status"), ``AuthenticationException``
  "Failed to open CBS authentication link" (``amqp:internal-error``), ``TokenExpired``, or a socket or
  connection error (``AMQPConnectionError``) anywhere in the chain.

The rule: an exception is a **rejected credential** (configuration) when it, or any exception reachable
from it through ``inner_exception``, ``__cause__`` or ``__context__``, shows positive evidence of rejection:
condition ``amqp:unauthorized-access`` or ``com.microsoft:auth-failed``, a status code 401 or 403, or an
``azure.core.exceptions.ClientAuthenticationError`` (``__context__`` is followed only when not suppressed;
a status code counts only under an authentication or authorisation error, because a management request
over quota is also answered 403). An authentication or authorisation error without such
evidence is an **outage**: the CBS exchange failed for a reason other than the service saying no, which is
what a dropped connection looks like. A CBS status 404 (the audience's entity does not exist) is
``CONFIGURATION_NOT_FOUND``.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import logging
import re
import socket
from collections.abc import Iterator, Mapping

from azure.core.exceptions import (
    ClientAuthenticationError,
    HttpResponseError,
    ResourceExistsError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.servicebus.exceptions import (
    MessageAlreadySettled,
    MessageLockLostError,
    MessageNotFoundError,
    MessageSizeExceededError,
    MessagingEntityNotFoundError,
    ServiceBusAuthenticationError,
    ServiceBusAuthorizationError,
    ServiceBusConnectionError,
    ServiceBusError,
    ServiceBusServerBusyError,
)

_LOGGER = logging.getLogger(__name__)

__all__ = [
    "BacklogUnavailableError",
    "BadInputError",
    "BadMessageError",
    "ConfigError",
    "ConnectionQuotaError",
    "CredentialRejectedError",
    "ENCODING_ERRORS",
    "EntityNotFoundError",
    "ErrorClass",
    "PairingError",
    "ReplicationError",
    "SourceUnavailableError",
    "SparkSbError",
    "UnsupportedSparkError",
    "already_exists",
    "as_spark_sb_error",
    "classify",
    "encoding_error",
    "is_blip",
    "is_connection_lost",
    "is_connection_quota",
    "is_link_gone",
    "is_lock_lost",
    "is_message_not_found",
    "is_outcome_unknown",
    "is_too_large",
    "is_unanswered",
    "needs_session",
    "mark_outcome_unknown",
    "namespace_words",
    "raise_if_refused",
    "redact",
    "refusal",
    "retry_after",
    "unreachable_reason",
    "unwrap",
]


class ErrorClass(enum.Enum):
    """What a failure means for the paired sender (the "Error classes" table of behaviour.md).

    * ``OUTAGE``: the namespace or entity is unavailable; counts toward failover for that entity.
    * ``THROTTLED``: the service is busy; wait ``server_busy_backoff`` and retry the primary. Never by
      itself causes failover.
    * ``CONFIGURATION_CREDENTIAL``: the service rejected the credential (or it lacks a right); fail at once,
      no failover.
    * ``CONFIGURATION_NOT_FOUND``: the entity does not exist; fail at once, no failover (the syphon could
      never deliver it).
    * ``BAD_MESSAGE``: this message can never be sent (too large, refused as invalid, or the SDK cannot encode
      it); reject it with an error naming its id.
    * ``OTHER``: not a Service Bus failure (a bug, misuse of a client, a closed handler): re-raise unchanged,
      no failover. Not in the table; it keeps programming errors from being mistaken for outages.
    """

    OUTAGE = "outage"
    THROTTLED = "throttled"
    CONFIGURATION_CREDENTIAL = "configuration-credential"
    CONFIGURATION_NOT_FOUND = "configuration-not-found"
    BAD_MESSAGE = "bad-message"
    OTHER = "other"

    @property
    def counts_toward_failover(self) -> bool:
        """True only for outages: the failover timer starts or keeps running."""
        return self is ErrorClass.OUTAGE

    @property
    def is_configuration(self) -> bool:
        return self in (ErrorClass.CONFIGURATION_CREDENTIAL, ErrorClass.CONFIGURATION_NOT_FOUND)

    @property
    def fails_at_once(self) -> bool:
        """True when the caller must see the error now: configuration problems and non-Service-Bus errors."""
        return self.is_configuration or self is ErrorClass.OTHER


# --- redaction -------------------------------------------------------------------------------------------

_SECRET_NAMES = r"SharedAccessKey|SharedAccessSignature|AccountKey|sig|client_secret|clientSecret|password"
# Key=value (connection strings, SAS tokens, query strings)
_SECRET_ASSIGNMENT = re.compile(rf"(?i)\b({_SECRET_NAMES})(\s*=\s*)([^;&\s,'\"]+)")
# 'key': 'value' (a dict or JSON in a message)
_SECRET_ITEM = re.compile(rf"(?i)(['\"](?:{_SECRET_NAMES})['\"]\s*:\s*)(['\"])((?:(?!\2).)*)\2")
_SAS_TOKEN = re.compile(r"(?i)(SharedAccessSignature\s+)(\S+)")


def redact(text: str) -> str:
    """Replace secret values in ``text`` (SAS keys, signatures, client secrets) with ``***``."""
    text = _SAS_TOKEN.sub(r"\1***", text)
    text = _SECRET_ITEM.sub(r"\1\2***\2", text)
    return _SECRET_ASSIGNMENT.sub(r"\1\2***", text)


# --- the hierarchy ---------------------------------------------------------------------------------------


class SparkSbError(Exception):
    """Root of every error spark-sb raises.

    :ivar error_class: how :func:`classify` (and so the paired sender) treats this error.
    :ivar retryable: whether repeating the same call later can succeed without a change of configuration.
    """

    error_class: ErrorClass = ErrorClass.OTHER
    retryable: bool = False


class ConfigError(SparkSbError, ValueError):
    """The configuration is wrong. The message names the option path and the bad value (secrets redacted).

    ``str(ConfigError("send_availability.failover_interval", "must be between 0 s and 60 min", "2 h"))`` is
    ``send_availability.failover_interval: must be between 0 s and 60 min, got 2 h``.
    """

    _NO_VALUE = object()

    def __init__(self, option: str, problem: str, value: object = _NO_VALUE) -> None:
        self.option = option
        self.problem = problem
        self._value = value
        self.value = None if value is ConfigError._NO_VALUE else value
        text = f"{option}: {problem}"
        if value is not ConfigError._NO_VALUE:
            text += f", got {value}"
        super().__init__(redact(text))

    def with_option(self, option: str) -> ConfigError:
        """The same error naming the option differently (e.g. as the user spelled a Spark option)."""
        return ConfigError(option, self.problem, self._value)


class UnsupportedSparkError(SparkSbError, ImportError):
    """The running Spark lacks what a part of spark-sb needs (the streaming sources on Spark 3.5, which has no
    Python data sources), or its Delta is built for another Spark. The message names the Spark version, what is
    missing and what to install or where it runs."""


#: what every :class:`PairingError` message ends with: what happened to the data, and what to check
PAIRING_ADVICE = (
    " What happened to the data: the send that needed the backlog is not acknowledged (none of its messages went to "
    "a backlog queue), so the Spark sink fails the batch and Spark replays it from its checkpoint: nothing is lost "
    "(a message the primary took before the failover may arrive twice; duplicate detection drops it). Check on the "
    "secondary: its administration endpoint is reachable from the workers (admin_endpoint, DNS, firewall; "
    "admin_timeout and send_availability.pairing_timeout bound the wait), the credential gets a token and has "
    "Manage rights, the "
    "namespace's queue quota leaves room for send_availability.backlog_queue_count backlog queues, and "
    "send_availability.backlog_prefix names the backlog queues you mean.")


class PairingError(SparkSbError):
    """Pairing (listing and creating the backlog queues on the secondary) failed: no usable backlog queue, a
    rejected credential, or an administration endpoint that did not answer (refused, host not found, timed out)
    or not within ``send_availability.pairing_timeout``.

    Pairing is lazy: a :class:`~spark_sb.paired.PairedSender` pairs when the backlog is first needed (the last
    wait before a failover, or the failover itself), so a send raises this error, within
    ``send_availability.pairing_timeout``; :meth:`~spark_sb.paired.PairedSender.pair` pairs at once. A send that
    raised it is not acknowledged: the Spark sink fails the batch, Spark replays it from its checkpoint, and
    nothing is lost. The message says what failed (the endpoint, the deadline) and ends with
    :data:`PAIRING_ADVICE`: what to check on the secondary.

    :ivar detail: what failed (the message without the advice).
    """

    def __init__(self, detail: str) -> None:
        # given a whole message (a copy of another PairingError's, or an unpickled one): the advice once
        if detail.endswith(PAIRING_ADVICE):
            detail = detail[: -len(PAIRING_ADVICE)].removesuffix(".")
        self.detail = redact(detail)
        ending = "" if self.detail.endswith((".", "!", "?")) else "."
        super().__init__(f"{self.detail}{ending}{PAIRING_ADVICE}")


class CredentialRejectedError(SparkSbError):
    """A namespace rejected the configured credential, or the credential lacks a right (Send, Listen, Manage).

    The message names the namespace, its host and the refusal, e.g. ``the secondary namespace (localhost:5673)
    refused the credential: 401 InvalidSignature: ...`` (``namespace`` is ``"<primary|secondary> <host>"``).

    :ivar namespace: ``primary <host>`` or ``secondary <host>`` (or a host alone, or None).
    :ivar entity: the entity of the refused call, when one.
    """

    error_class = ErrorClass.CONFIGURATION_CREDENTIAL

    def __init__(self, namespace: str | None, detail: str, *, entity: str | None = None) -> None:
        self.namespace = namespace
        self.entity = entity
        text = f"{namespace_words(namespace)} refused the credential"
        if entity:
            text += f" for {entity!r}"
        super().__init__(redact(f"{text}: {detail}"))


def namespace_words(namespace: str | None) -> str:
    """How a message names a namespace: ``"primary contoso.servicebus.windows.net"`` -> ``the primary namespace
    (contoso.servicebus.windows.net)``; a host alone -> ``the namespace <host>``; None -> ``the namespace``."""
    if not namespace:
        return "the namespace"
    side, _, host = namespace.partition(" ")
    if side in ("primary", "secondary") and host:
        return f"the {side} namespace ({host})"
    return f"the namespace {namespace}"


class EntityNotFoundError(SparkSbError):
    """The queue or topic does not exist on the namespace."""

    error_class = ErrorClass.CONFIGURATION_NOT_FOUND

    def __init__(self, namespace: str | None, entity: str | None, detail: str = "") -> None:
        self.namespace = namespace
        self.entity = entity
        text = f"entity {entity!r} not found on {namespace or 'the namespace'}"
        if detail:
            text += f": {detail}"
        super().__init__(redact(text))


class BadMessageError(SparkSbError, ValueError):
    """This message can never be sent (e.g. too large for the entity, before or after the backlog rewrite)."""

    error_class = ErrorClass.BAD_MESSAGE

    def __init__(self, message_id: object, entity: str | None, reason: str) -> None:
        self.message_id = message_id
        self.entity = entity
        self.reason = reason
        super().__init__(redact(f"message {message_id!r} for entity {entity!r} rejected: {reason}"))


class BadInputError(SparkSbError, ValueError):
    """A Spark batch holds input the sink cannot send: a column of the wrong type (found on the driver before
    anything is sent), or a row that can never be sent (null body, too large, unknown entity...). The message
    names the batch and, for a row, its entity and message id; for a column, the column and its type."""

    error_class = ErrorClass.BAD_MESSAGE

    def __init__(self, batch_id: int | str, reason: str, *, entity: str | None = None, message_id: object = None,
                 column: str | None = None) -> None:
        self.batch_id = batch_id
        self.entity = entity
        self.message_id = message_id
        self.column = column
        self.reason = reason
        where = [f"batch {batch_id}"]
        if column is not None:
            where.append(f"column {column!r}")
        if entity is not None or message_id is not None:
            where.append(f"entity {entity!r}")
            where.append(f"message {message_id!r}")
        super().__init__(redact(f"{', '.join(where)}: {reason}"))


class BacklogUnavailableError(SparkSbError):
    """No backlog queue accepted the message while the primary is failed over. Nothing was acknowledged, so
    the caller can retry (in Spark the batch fails and is replayed from the checkpoint)."""

    error_class = ErrorClass.OUTAGE
    retryable = True

    def __init__(self, entity: str, tried: list[str] | tuple[str, ...] = (), detail: str = "") -> None:
        self.entity = entity
        self.tried = tuple(tried)
        text = f"no backlog queue accepted the message(s) for entity {entity!r}"
        if self.tried:
            text += f" (tried {', '.join(self.tried)})"
        text += "; nothing was acknowledged, the send can be retried"
        if detail:
            text += f": {detail}"
        super().__init__(redact(text))


class ConnectionQuotaError(SparkSbError):
    """A namespace kept refusing new connections: it holds its maximum of concurrent connections (Service Bus:
    5,000 per namespace, ``amqp:resource-limit-exceeded``). It is pushback, not an outage: the paired sender
    waits and tries again for the failover interval, never fails over for it (the secondary would be asked for as
    many connections), then raises this error. Nothing of the call was sent; in Spark the batch fails and is
    replayed. The message says what to lower.

    :ivar namespace: the namespace that refused (``primary <host>`` or ``secondary <host>``).
    """

    error_class = ErrorClass.THROTTLED
    retryable = True

    def __init__(self, namespace: str, waited: float, detail: str = "", *, connections_per_entity: int | None = None
                 ) -> None:
        self.namespace = namespace
        setting = ("sink.connections_per_entity" if connections_per_entity is None
                   else f"sink.connections_per_entity (now {connections_per_entity})")
        text = (f"the {namespace} namespace refused new connections for {waited:.3g} s: it holds its maximum of "
                f"concurrent connections (Service Bus: 5,000 per namespace). Nothing was sent and nothing failed "
                f"over (the secondary would be asked for as many connections). Lower the connections open to it: "
                f"the Python workers sending at once (partitions or cores), {setting}, or other clients of the "
                f"namespace (docs/sizing.md, \"Sizing a job\")")
        if detail:
            text += f". The service said: {detail}"
        super().__init__(redact(text))


class SourceUnavailableError(SparkSbError):
    """A source could not read a batch it had planned: its namespace did not answer for the source's
    ``readRetryTimeout``. Nothing was lost: the batch's messages stay deferred, and a restarted query reads the
    same batch from its checkpoint."""

    error_class = ErrorClass.OUTAGE
    retryable = True


class ReplicationError(SparkSbError):
    """Active or passive replication: no namespace accepted the message(s). Nothing was acknowledged by either
    side, so the caller can retry (in Spark the batch fails and is replayed from the checkpoint); a passive
    sender keeps its roles.

    :ivar entity: the entity.
    :ivar errors: ``{"primary" | "secondary": the exception that side raised}``.
    """

    error_class = ErrorClass.OUTAGE
    retryable = True

    def __init__(self, entity: str, errors: Mapping[str, BaseException]) -> None:
        self.entity = entity
        self.errors = dict(errors)
        causes = "; ".join(f"{side}: {type(err).__name__}: {err}" for side, err in self.errors.items())
        super().__init__(redact(f"neither namespace accepted the message(s) for entity {entity!r}; nothing was "
                                f"acknowledged, the send can be retried ({causes})"))


# --- classification --------------------------------------------------------------------------------------

_REJECTING_CONDITIONS = frozenset({"amqp:unauthorized-access", "com.microsoft:auth-failed"})
_REJECTING_STATUS = frozenset({401, 403})
# the service refused the message itself (e.g. no session id for a session entity): retrying or failing over
# cannot help, the message must be fixed
_MESSAGE_REJECTING_CONDITIONS = frozenset({"amqp:invalid-field", "amqp:decode-error"})
_NOT_FOUND_STATUS = 404
#: the SDK's words for a settlement (complete, abandon, defer, dead-letter, renew) on a receiver whose handler it
#: shut down after losing the connection (``receiver_mixins._check_message_alive``; see the module docstring)
_SETTLED_AFTER_SHUTDOWN = re.compile(r"^Failed to [a-z -]+ the message as the handler has already been shutdown")


def _causes(exc: BaseException, *, implicit: bool = True) -> Iterator[BaseException]:
    """``exc`` and every exception reachable through ``inner_exception`` (where azure-core keeps the cause the
    SDK attaches), ``__cause__``, and ``__context__`` unless suppressed (``raise ... from None``) or ``implicit``
    is False: an exception raised while another was being handled carries it as its context, whatever they have
    to do with each other (a send that timed out in the handler of a ping's refusal is no refused message)."""
    seen: set[int] = set()
    stack = [exc]
    while stack and len(seen) < 32:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        context = None if current.__suppress_context__ or not implicit else current.__context__
        for linked in (getattr(current, "inner_exception", None), current.__cause__, context):
            if isinstance(linked, BaseException):
                stack.append(linked)


def _text(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def _condition(exc: BaseException) -> str | None:
    # ServiceBusError keeps it in _condition (decoded to str); pyamqp's AMQPException in .condition (bytes)
    value = getattr(exc, "_condition", None)
    if value is None:
        value = getattr(exc, "condition", None)
    return _text(value)


def _status(exc: BaseException) -> int | None:
    # ServiceBusError: _status_code; TokenAuthFailure and HttpResponseError: status_code
    for name in ("_status_code", "status_code"):
        value = getattr(exc, name, None)
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int):
            return value
        try:
            return int(_text(value) or "")
        except ValueError:
            continue
    return None


def _credential_rejected(exc: BaseException, *, by_status: bool = True) -> bool:
    for link in _causes(exc):
        if isinstance(link, ClientAuthenticationError):
            return True
        if _condition(link) in _REJECTING_CONDITIONS:
            return True
        if by_status and _status(link) in _REJECTING_STATUS:
            return True
    return False


def _entity_not_found(exc: BaseException) -> bool:
    return any(_status(link) == _NOT_FOUND_STATUS for link in _causes(exc))


def _settled_after_shutdown(exc: BaseException) -> bool:
    """A plain ``ValueError`` the SDK raised settling a message after it shut the receiver's handler down."""
    return type(exc) is ValueError and _SETTLED_AFTER_SHUTDOWN.match(str(exc)) is not None


def classify(exc: BaseException) -> ErrorClass:
    """Map an exception to its :class:`ErrorClass` (behaviour.md, "Error classes").

    Service Bus (AMQP) exceptions:

    * ``MessageSizeExceededError`` (also what ``ServiceBusMessageBatch.add_message`` and a list send raise
      when a message does not fit) -> ``BAD_MESSAGE``
    * ``ServiceBusServerBusyError`` -> ``THROTTLED``; so is a connection the namespace refused at its connection
      quota (:func:`is_connection_quota`): pushback, not an outage
    * ``MessagingEntityNotFoundError`` -> ``CONFIGURATION_NOT_FOUND``
    * ``ServiceBusAuthenticationError`` / ``ServiceBusAuthorizationError``: ``CONFIGURATION_CREDENTIAL`` when
      the credential was rejected (see the module docstring for the rule), ``CONFIGURATION_NOT_FOUND`` for
      a CBS 404, else ``OUTAGE``
    * a ``ServiceBusError`` whose condition says the message itself is invalid (``amqp:invalid-field``, e.g. no
      session id for a session entity; ``amqp:decode-error``) -> ``BAD_MESSAGE``
    * any other ``ServiceBusError`` (connection, communication, timeout, entity disabled, quota exceeded, ...)
      -> ``OUTAGE``, except one whose cause is a rejected credential (the SDK wraps an azure-identity
      ``ClientAuthenticationError`` as a plain ``ServiceBusError``) -> ``CONFIGURATION_CREDENTIAL``; a status
      code alone does not count here (a management request over quota is answered 403)

    Administration (HTTP) exceptions from ``ServiceBusAdministrationClient``: ``ClientAuthenticationError``
    and status 401/403 -> ``CONFIGURATION_CREDENTIAL``; ``ResourceNotFoundError`` and 404 ->
    ``CONFIGURATION_NOT_FOUND``; 429 -> ``THROTTLED``; 408 and 5xx, ``ServiceRequestError``,
    ``ServiceResponseError`` -> ``OUTAGE``.

    spark-sb's own errors return their ``error_class``. Builtin ``ConnectionError`` and ``TimeoutError`` are
    ``OUTAGE``; so is the SDK's ``ValueError("Failed to <settle> the message as the handler has already been
    shutdown...")``, a settlement after the SDK shut a receiver's handler down for a lost connection (its lock
    lapses, the message comes back). Anything else (another ``ValueError``, such as a sender used after close or
    an encoding error, ``TypeError``, ...) is ``OTHER``.
    """
    if isinstance(exc, SparkSbError):
        return exc.error_class
    if isinstance(exc, MessageSizeExceededError):
        return ErrorClass.BAD_MESSAGE
    if isinstance(exc, ServiceBusServerBusyError) or is_connection_quota(exc):
        return ErrorClass.THROTTLED
    if isinstance(exc, MessagingEntityNotFoundError):
        return ErrorClass.CONFIGURATION_NOT_FOUND
    if isinstance(exc, ServiceBusAuthenticationError | ServiceBusAuthorizationError):
        if _credential_rejected(exc):
            return ErrorClass.CONFIGURATION_CREDENTIAL
        if _entity_not_found(exc):
            return ErrorClass.CONFIGURATION_NOT_FOUND
        return ErrorClass.OUTAGE
    if isinstance(exc, ServiceBusError):
        # status codes are not evidence here: a management request over quota also answers 403
        if _credential_rejected(exc, by_status=False):
            return ErrorClass.CONFIGURATION_CREDENTIAL
        if any(_condition(e) in _MESSAGE_REJECTING_CONDITIONS for e in _causes(exc, implicit=False)):
            return ErrorClass.BAD_MESSAGE
        return ErrorClass.OUTAGE
    if isinstance(exc, ClientAuthenticationError):
        return ErrorClass.CONFIGURATION_CREDENTIAL
    if isinstance(exc, ResourceNotFoundError):
        return ErrorClass.CONFIGURATION_NOT_FOUND
    if isinstance(exc, HttpResponseError):
        status = _status(exc)
        if status in _REJECTING_STATUS:
            return ErrorClass.CONFIGURATION_CREDENTIAL
        if status == _NOT_FOUND_STATUS:
            return ErrorClass.CONFIGURATION_NOT_FOUND
        if status == 429:
            return ErrorClass.THROTTLED
        if status is not None and (status == 408 or status >= 500):
            return ErrorClass.OUTAGE
        return ErrorClass.OTHER
    if isinstance(exc, ServiceRequestError | ServiceResponseError | ConnectionError | TimeoutError):
        return ErrorClass.OUTAGE
    if _settled_after_shutdown(exc):
        return ErrorClass.OUTAGE
    return ErrorClass.OTHER


_XML_DETAIL = re.compile(r"<Detail>(.*?)</Detail>", re.DOTALL)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def refusal(exc: BaseException) -> str:
    """What the service said refusing a credential, on one line and without secrets: the status and its
    description (``401 InvalidSignature: ...`` from the administration API, ``401 Unauthorized: ...`` from a
    CBS ``put-token``), else the AMQP condition and its description (``amqp:unauthorized-access: ...``), else what
    the credential raised (azure-identity's ``ClientAuthenticationError``: ``AADSTS...``), else ``exc``'s text.
    The SDK's own wrapper says only "Service Bus has encountered an error": the answer is in its causes."""
    causes = list(_causes(exc))
    for link in causes:
        status = _status(link)
        if status not in _REJECTING_STATUS:
            continue
        if isinstance(link, HttpResponseError):
            found = _XML_DETAIL.search(str(link))
            said = found.group(1) if found else (link.reason or str(link).split("\n")[0])
        else:  # pyamqp's TokenAuthFailure (a CBS answer), or a management request's status
            said = _text(getattr(link, "status_description", None)) or _text(getattr(link, "description", None)) \
                or str(link)
        return redact(_one_line(f"{status} {said}"))[:500]
    for link in causes:
        condition = _condition(link)
        if condition in _REJECTING_CONDITIONS:
            said = _text(getattr(link, "description", None)) or str(link)
            return redact(_one_line(f"{condition}: {said}"))[:500]
    for link in causes:
        if isinstance(link, ClientAuthenticationError):
            return redact(_one_line(str(link.message or link)))[:500]
    return redact(_one_line(str(exc)))[:500]


#: what the SDK's encoder raises for a message it cannot encode (an int property over its range, a TTL out of
#: the AMQP range, non-UTF-8 text, an unsupported type); ``UnicodeError`` is a ``ValueError``. These are bad
#: messages only where they come from encoding: the sender converts them at that call site
#: (:func:`encoding_error`), so a ``ValueError`` from anywhere else (a sender used after close) stays ``OTHER``
#: (but for a settlement on a receiver the SDK shut down, an ``OUTAGE``: see :func:`classify`).
ENCODING_ERRORS: tuple[type[Exception], ...] = (ValueError, TypeError, OverflowError)


def encoding_error(exc: BaseException, message_id: object, entity: str | None) -> BadMessageError:
    """The :class:`BadMessageError` for a message the SDK raised ``exc`` encoding (raise it ``from exc``)."""
    return BadMessageError(message_id, entity, f"cannot be encoded: {type(exc).__name__}: {exc}")


def as_spark_sb_error(
    exc: BaseException,
    *,
    namespace: str | None = None,
    entity: str | None = None,
    message_id: object = None,
) -> SparkSbError | None:
    """The spark-sb error to raise (``raise err from exc``) for a configuration or bad-message class
    exception; ``None`` for the other classes, which the caller handles (retry, fail over, re-raise)."""
    if isinstance(exc, SparkSbError):
        return exc
    error_class = classify(exc)
    detail = redact(str(exc))
    if error_class is ErrorClass.CONFIGURATION_CREDENTIAL:
        return CredentialRejectedError(namespace, refusal(exc), entity=entity)
    if error_class is ErrorClass.CONFIGURATION_NOT_FOUND:
        return EntityNotFoundError(namespace, entity, detail)
    if error_class is ErrorClass.BAD_MESSAGE:
        return BadMessageError(message_id, entity, detail)
    return None


def raise_if_refused(exc: BaseException, namespace: str | None, *, entity: str | None = None) -> None:
    """Raise :class:`CredentialRejectedError` naming ``namespace`` (``"primary <host>"``) and the refusal
    (:func:`refusal`) when ``exc`` is a rejected credential (``configuration-credential``); else return. For the
    places that take any other failure for an outage (a count the administration API did not give, a check that
    falls back to a peek): a rejected credential is never an outage, and is never retried."""
    if classify(exc) is not ErrorClass.CONFIGURATION_CREDENTIAL:
        return
    if isinstance(exc, CredentialRejectedError):
        raise exc
    raise CredentialRejectedError(namespace, refusal(exc), entity=entity) from exc


# --- answers that are not failures: what the syphon and the sources read about one message -------------------

def is_message_not_found(exc: BaseException) -> bool:
    """The service answered that a message asked for by sequence number is not there (gone, or locked by
    someone else): an answer about that message, not a broken link."""
    return isinstance(exc, MessageNotFoundError)


def is_lock_lost(exc: BaseException) -> bool:
    """A settlement found the message's lock lost or the message already settled: the broker decides what
    happens to it (it comes back, or it was settled by someone else)."""
    return isinstance(exc, MessageLockLostError | MessageAlreadySettled)


def is_link_gone(exc: BaseException) -> bool:
    """A settlement failed because the link that delivered the message is gone: the service detached it (idle
    for 10 minutes, or forced in an upgrade: ``amqp:link:detach-forced``) or the connection dropped. The
    message's lock went with its link; the broker delivers the message again. Also the SDK's ``ValueError`` for a
    settlement on a receiver whose handler it shut down after a lost connection (see the module docstring)."""
    if is_connection_lost(exc) or _settled_after_shutdown(exc):
        return True
    for cause in _causes(exc):
        text = str(cause).lower()
        if "link already closed" in text or "detach-forced" in text or type(cause).__name__ == "AMQPLinkError":
            return True
    return False


_OUTCOME_UNKNOWN = "spark_sb_outcome_unknown"


def mark_outcome_unknown(exc: BaseException) -> None:
    """Say on ``exc`` (a failed send's error) that the send's transfer was on the wire when its link died or its
    wait ran out: the service may have stored the messages. A caller that sends them again may store them twice
    (duplicate detection, keyed on the message id, absorbs that)."""
    setattr(exc, _OUTCOME_UNKNOWN, True)


def is_outcome_unknown(exc: BaseException) -> bool:
    """Whether a failed send may have stored its messages all the same (:func:`mark_outcome_unknown`): its
    transfer was written, and no answer came (its link died after it, or its wait ran out)."""
    return any(getattr(cause, _OUTCOME_UNKNOWN, False) for cause in _causes(exc))


def is_too_large(exc: BaseException) -> bool:
    """A message does not fit a batch (or a send) because of its size."""
    return isinstance(exc, MessageSizeExceededError)


# --- what the paired sender, the bus and provisioning read about a failure -----------------------------------

def is_blip(exc: BaseException) -> bool:
    """The namespace did not answer (a lost connection, a timeout) or was busy: the same call may pass in a
    moment, so it is retried with backoff for a bounded time before anything fails."""
    return classify(exc) in (ErrorClass.OUTAGE, ErrorClass.THROTTLED)


_RESOURCE_LIMIT = "amqp:resource-limit-exceeded"
_PLEASE_WAIT = re.compile(r"please wait (\d+(?:\.\d+)?) seconds?", re.IGNORECASE)
#: the longest wait :func:`retry_after` passes on, whatever the service asked
RETRY_AFTER_MAX = 60.0


def retry_after(exc: BaseException) -> float | None:
    """The wait a throttling answer asked for (Service Bus: "... is being throttled. Error code : 50002. Please
    wait 2 seconds and try again."), in seconds, at most :data:`RETRY_AFTER_MAX`; ``None`` when ``exc`` (or a cause
    in its chain) names none."""
    for cause in _causes(exc):
        match = _PLEASE_WAIT.search(str(cause))
        if match:
            return min(float(match.group(1)), RETRY_AFTER_MAX)
    return None


def is_connection_quota(exc: BaseException) -> bool:
    """The namespace refused a new connection because it holds its maximum of concurrent connections: the
    connection was closed with ``amqp:resource-limit-exceeded`` (the SDK raises ``ServiceBusConnectionError``).
    Pushback, not an outage (:func:`classify`: ``THROTTLED``)."""
    return any(isinstance(cause, ServiceBusConnectionError) and _condition(cause) == _RESOURCE_LIMIT
               for cause in _causes(exc))


def is_connection_lost(exc: BaseException) -> bool:
    """The SDK shut the AMQP connection down (``ServiceBusConnectionError``): the client and every handle it
    opened are unusable and must be rebuilt."""
    return isinstance(exc, ServiceBusConnectionError)


def needs_session(exc: BaseException) -> bool:
    """The entity requires sessions and the message had no session id (the service names the missing
    ``SessionId``): the same message with a session id would be accepted."""
    return isinstance(exc, ServiceBusError) and "sessionid" in str(exc).lower()


def already_exists(exc: BaseException) -> bool:
    """An administration request to create an entity found it already there (``ResourceExistsError``)."""
    return isinstance(exc, ResourceExistsError)


def unreachable_reason(exc: BaseException) -> str | None:
    """"connection refused", "host not found", "connection timed out" or, for an HTTP request whose answer did
    not come in time (azure-core's ``ServiceResponseError`` over a timeout), "no answer in time (read timed
    out)" when ``exc`` (or a cause in its chain: ``inner_exception``, ``__cause__``, ``__context__``) shows the
    endpoint could not be reached; else None."""
    waiting_for_answer = False
    for link in _causes(exc):
        if isinstance(link, ServiceResponseError):
            waiting_for_answer = True
        if isinstance(link, ConnectionRefusedError):
            return "connection refused"
        if isinstance(link, socket.gaierror):
            return "host not found"
        if isinstance(link, TimeoutError):
            return "no answer in time (read timed out)" if waiting_for_answer else "connection timed out"
    return None


def is_unanswered(exc: BaseException) -> bool:
    """An administration (HTTP) request got no answer at all: the connection was refused, the host name did not
    resolve, the connect or the read timed out, or the connection broke before a response came (azure-core's
    ``ServiceRequestError`` or ``ServiceResponseError``, or a socket error in the chain). An HTTP error status is
    an answer (False): the endpoint is there, and another request may be answered otherwise."""
    if isinstance(exc, HttpResponseError):
        return False
    return any(isinstance(link, ServiceRequestError | ServiceResponseError | ConnectionError | TimeoutError
                          | socket.gaierror) for link in _causes(exc))


# --- what a user catches from Spark ------------------------------------------------------------------------

#: a spark-sb error as Python prints it on the last line of a traceback (``spark_sb.errors.ConfigError: ...``);
#: Spark appends `` SQLSTATE: 38000`` to an error class's message
_PRINTED = re.compile(r"^[ \t]*(?P<module>spark_sb(?:\.\w+)*)\.(?P<name>[A-Za-z_]\w*): (?P<message>.*?)"
                      r"(?: SQLSTATE: \w{5})?[ \t]*$", re.MULTILINE)


def _printed_class(module: str, name: str) -> type[SparkSbError] | None:
    try:
        found = getattr(importlib.import_module(module), name, None)
    except Exception:  # noqa: BLE001 - a module this process cannot import (an extra missing): not one of ours here
        return None
    return found if isinstance(found, type) and issubclass(found, SparkSbError) else None


def _texts(exc: BaseException) -> Iterator[str]:
    """The text of ``exc`` and of every exception of its chain; for a Py4J error, the Java exception's too."""
    for link in _causes(exc):
        try:
            yield str(link)
        except Exception:  # noqa: BLE001 - a Py4J error's text needs the JVM, which may be gone
            continue


def unwrap(exc: BaseException) -> SparkSbError | None:
    """The spark-sb error behind ``exc``, which is what a user catches from Spark, or None when there is none.

    Spark hands an error raised in a Python data source, a Python worker or a ``foreachBatch`` function to the
    caller wrapped: ``AnalysisException`` (``PYTHON_DATA_SOURCE_ERROR``, a source failing at ``load()``),
    ``PythonException`` (an executor's task), ``StreamingQueryException`` (from ``awaitTermination()``), a Py4J
    ``Py4JJavaError``, or their Spark Connect counterparts. Only the Python traceback's text crosses the process:
    ``unwrap`` finds the last spark-sb error printed in it (``spark_sb.errors.ConfigError: ...``) and rebuilds an
    instance of that class with that message, so ``isinstance``, ``error_class`` and ``retryable`` work as on the
    original. A rebuilt error's other attributes (``option``, ``namespace``, ``entity``...) are None; its
    ``__cause__`` is ``exc``. A spark-sb error itself, or one in ``exc``'s chain (``__cause__``, ``__context__``),
    is returned as it is.

    ``None``: ``exc`` carries no spark-sb error (a bug, a Spark error of its own): re-raise it.
    """
    for link in _causes(exc):
        if isinstance(link, SparkSbError):
            return link
    found: tuple[type[SparkSbError], str] | None = None
    for text in _texts(exc):
        for match in _PRINTED.finditer(text):
            error_type = _printed_class(match["module"], match["name"])
            if error_type is not None:
                found = (error_type, match["message"])
    if found is None:
        return None
    error_type, message = found
    error = error_type.__new__(error_type)
    Exception.__init__(error, message)
    for name in inspect.signature(error_type.__init__).parameters:
        if name not in ("self", "args", "kwargs") and not hasattr(error, name):
            setattr(error, name, None)
    error.__cause__ = exc
    return error
