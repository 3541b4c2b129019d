"""The spark-sb configuration: one typed, frozen, validated object (pydantic models), parsed once.

Built by :func:`load_config` from a YAML file or a dict, by :func:`from_options` from Spark's flat,
case-insensitive string options, or by :func:`load_reference` from what :meth:`SparkSbConfig.reference`
gave. Shape (defaults shown)::

    primary:   {connection_string: "${SB_PRIMARY}"}        # or fully_qualified_namespace + credential
    secondary: {connection_string: "${SB_SECONDARY}"}        # each also takes admin_timeout: 10s (every
                                                             # administration API call: connect, and each read)
    send_availability:
      backlog_queue_count: 10
      failover_interval: 60s          # durations: 500ms / 60s / 5m / 1h / 1h30m, ISO 8601 (PT1M); numbers are seconds
      ping_primary_interval: 60s
      server_busy_backoff: 10s
      backlog_prefix: null            # default: derived from the primary host, see default_backlog_prefix()
      backlog_cooldown: 30s
      provision_retries: 3
      provision_retry_spacing: 1s
      pairing_timeout: 30s            # one pairing (and all of one send's attempts) ends within it: PairingError
      primary_retry_total: 0
      primary_retry_backoff: 800ms
      primary_retry_backoff_max: 5s
      primary_try_timeout: 5s
    syphon: {retry_interval: 1s, receive_batch: 100}
    replication:
      mode: paired                    # paired (send availability) | active (both namespaces) | passive (one, swap)
      retry_interval: 30s             # active: a namespace that failed a send is skipped this long, then tried again
    sink:                             # the Spark sink (spark_sb.sink) and its writer job (jobs/paired_writer.py)
      entity: null                    # default entity when the rows carry none
      columns: {}                     # message field -> column name; default: the field names
      key_column: null                # message ids from this column; default: derived (batch id + row content)
      chunk_size: 500                 # messages per send
      sends_in_flight: 8              # sends a partition keeps in flight (1: one at a time, in order)
      connections_per_entity: 1       # sending connections a worker opens per entity and namespace; in-flight sends share them
      reject_table: null              # Delta path: rejected rows go there instead of failing the batch
      metrics_table: null             # Delta path: one row per batch summary
      checkpoint_location: null       # writer job only
      source: {format: rate, rows_per_second: 10}   # or {table: name} or {path: ..., format: ...}
      trigger: null                   # processing-time trigger, e.g. 2s; null: as fast as possible
      max_batches: null               # writer job: stop after this many batches of a run

An option set to null is unset (its default applies). Strings may use ``${ENV_VAR}`` or
``${ENV_VAR:-default}`` (``$${`` is a literal ``${``); an unset variable without a default is an error naming
the variable and the option. ``${ENV_VAR+N}`` and ``${ENV_VAR+N:-default}`` add the whole number N to a variable
holding a whole number (the default is taken as written), so that one variable moves several ports
(``conf/local.yaml``: ``SPARK_SB_BASE_PORT``).

Credentials are either a ``connection_string`` (Endpoint, SharedAccessKeyName + SharedAccessKey or
SharedAccessSignature, optional EntityPath and UseDevelopmentEmulator), or a ``fully_qualified_namespace``
plus ``credential: {type: default|client_secret|managed_identity, tenant_id, client_id, client_secret}``
(``DefaultAzureCredential`` when omitted; ``client_secret`` also takes ``authority``, ``connection_verify`` and
``disable_instance_discovery``, e.g. for the emulator's Entra ID authority, see :class:`CredentialConfig`).
azure.identity is imported only when a credential is built.
``emulator: true`` next to ``fully_qualified_namespace`` (e.g. ``localhost:5672``) reaches spark-sb's local
emulator with such a credential: plain TCP, and provisioning through ``admin_endpoint``.

Every error is a :class:`~spark_sb.errors.ConfigError` naming the option path and the bad value; secrets are
:class:`Secret` values and never appear in an error, a log line, ``repr()``, ``str()``, ``model_dump()`` or a
pickle (where they travel masked).
"""

from __future__ import annotations

import base64
import difflib
import hashlib
import ipaddress
import json
import logging
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import FrozenInstanceError
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args
from urllib.parse import ParseResult, quote, unquote, urlparse

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    PlainSerializer,
    PrivateAttr,
    SecretStr,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import core_schema

from .durations import Duration, DurationError, duration_text, format_duration
from .durations import parse_duration as _parse_duration
from .errors import ConfigError

if TYPE_CHECKING:
    from azure.core.credentials import AzureNamedKeyCredential, AzureSasCredential, TokenCredential
    from azure.servicebus import ServiceBusClient

_LOGGER = logging.getLogger(__name__)

__all__ = [
    "DEAD_LETTER_SUFFIX", "ConnectionString", "CredentialConfig", "Duration", "FrozenMap", "NamespaceConfig", "ProxyConfig", "REPLICATION_MODES", "ReplicationConfig", "Secret", "SendAvailabilityConfig",
    "SinkConfig", "SinkSourceConfig", "SparkSbConfig", "SyphonConfig", "default_backlog_prefix", "did_you_mean", "entity_path", "format_duration",
    "from_options", "is_literal_secret", "is_secret_name", "load_config", "load_reference", "parse_duration", "option_section", "positive_duration", "redact_connection_string",
    "split_dead_letter", "unsendable",
]

BACKLOG_QUEUE_SEGMENT = "x-servicebus-transfer"
_MAX_ENTITY_PATH = 260
#: upper bounds: each backlog queue is an entity to create, ping and syphon; a receive batch is held in memory
#: and its sequence numbers are written into a Spark offset
MAX_BACKLOG_QUEUES = 100
MAX_RECEIVE_BATCH = 10_000
_MAX_CHUNK = 100_000
_REDACTED = "***"
_WHOLE = "must be a whole number"
_UNSET: Any = object()
MS, SECOND, MINUTE, DAY = timedelta(milliseconds=1), timedelta(seconds=1), timedelta(minutes=1), timedelta(days=1)


def parse_duration(value: object, option: str) -> timedelta:
    """:func:`spark_sb.durations.parse_duration`, raising a :class:`ConfigError` naming ``option``."""
    try:
        return _parse_duration(value)
    except DurationError as err:
        raise ConfigError(option, err.problem, err.value) from None


def positive_duration(value: object, option: str) -> timedelta:
    """:func:`parse_duration`, refusing zero and negative spans (a window, an interval) naming ``option``."""
    span = parse_duration(value, option)
    if span <= timedelta(0):
        raise ConfigError(option, "must be longer than 0 s", format_duration(span))
    return span


def entity_path(value: object, option: str = "entity") -> str:
    """A queue (its name may hold ``/``, as backlog queues' do) or a topic subscription written
    ``topic/subscriptions/name``; a :class:`ConfigError` naming ``option`` otherwise."""
    problem = "must name a queue or a subscription as 'topic/subscriptions/name'"
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(option, problem, repr(value))
    path = value.strip()
    topic, marker, subscription = path.partition("/subscriptions/")
    if marker and (not topic.strip("/") or not subscription.strip("/") or "/" in subscription):
        raise ConfigError(option, problem, repr(value))
    return path


def unsendable(entity: str) -> str | None:
    """Why nothing can be sent to ``entity``, or None: Service Bus takes messages at a queue or a topic, never at
    a subscription or a dead-letter queue (a send there is answered not-implemented, which must never be taken
    for an outage and parked where no syphon can deliver it)."""
    base, dead_letter = split_dead_letter(entity.strip())
    at = base.lower().find("/subscriptions/")
    topic = base[:at] if at >= 0 else base
    if dead_letter:
        return f"is a dead-letter queue: Service Bus takes messages at a queue or a topic; send to {topic!r}"
    if at >= 0:
        return f"is a subscription: Service Bus takes messages at its topic; send to {topic!r}"
    return None


#: the suffix of an entity's dead-letter queue (``orders/$DeadLetterQueue``, ``events/subscriptions/all/$DeadLetterQueue``)
DEAD_LETTER_SUFFIX = "/$DeadLetterQueue"


def split_dead_letter(path: str) -> tuple[str, bool]:
    """``(the queue or subscription, whether the path names its dead-letter queue)``; the suffix in any case."""
    if path.lower().endswith(DEAD_LETTER_SUFFIX.lower()):
        return path[:-len(DEAD_LETTER_SUFFIX)], True
    return path, False


class _Invalid(ValueError):
    """A validator's verdict: the problem, the value as it may be shown, and the option below the validated
    one that it concerns (``field``), if any. Turned into a :class:`ConfigError` with the full option path."""

    def __init__(self, problem: str, value: object = _UNSET, field: str | None = None) -> None:
        super().__init__(problem)
        self.problem, self.value, self.field = problem, value, field


def _error(option: str, problem: str, value: object = _UNSET) -> ConfigError:
    return ConfigError(option, problem) if value is _UNSET else ConfigError(option, problem, value)


# --- secrets ---------------------------------------------------------------------------------------------

_PAD = hashlib.sha256(b"spark-sb: a secret in a pickle").digest()


def _xor(data: bytes) -> bytes:
    return bytes(b ^ _PAD[i % len(_PAD)] for i, b in enumerate(data))


def _unmask(blob: bytes) -> Secret:
    return Secret(_xor(base64.b64decode(blob)).decode("utf-8"))


class Secret(SecretStr):
    """A :class:`pydantic.SecretStr` that a pickle does not show either: its value travels masked (obfuscated
    so that it cannot be read in a dump of the bytes; not encrypted: whoever holds the pickle can load it)."""

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return _unmask, (base64.b64encode(_xor(self.get_secret_value().encode("utf-8"))),)


def _with_secrets(info: SerializationInfo) -> bool:
    return bool(isinstance(info.context, Mapping) and info.context.get("secrets"))


def _dump_secret(value: Secret, info: SerializationInfo) -> str:
    return value.get_secret_value() if _with_secrets(info) else _REDACTED


#: a secret option: ``***`` in every dump unless ``to_dict(secrets=True)``
SecretText = Annotated[Secret, PlainSerializer(_dump_secret, return_type=str)]

# Option names whose values are secrets. Names are split into words (at ``.``, ``_``, ``-`` and camelCase), so
# that Hadoop-style names are caught too: ``fs.azure.account.key.<account>``, ``fs.s3a.access.key``,
# ``fs.azure.sas.<container>.<account>``, ``...oauth2.client.secret``, ``apiKey``; column names such as
# ``partition_key`` are not.
_SECRET_WORDS = frozenset({"secret", "secrets", "password", "passwd", "pwd", "token", "signature", "sig", "sas",
                           "sasl", "jaas", "credential", "credentials", "connectionstring", "accesskey",
                           "accountkey", "apikey", "privatekey", "sharedaccesskey", "secretkey"})
#: ``<word> key`` is a secret after these words
_SECRET_KEY_QUALIFIERS = frozenset({"access", "account", "private", "api", "shared", "secret", "storage",
                                    "encryption", "master", "signing", "client", "auth", "subscription", "sas"})
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")


def is_secret_name(name: object) -> bool:
    """True when an option named ``name`` holds a secret (its value is never shown)."""
    words = [w.lower() for w in _WORD.findall(str(name))]
    if any(w in _SECRET_WORDS for w in words) or "connectionstring" in "".join(words):
        return True
    return any(w == "key" and i > 0 and words[i - 1] in _SECRET_KEY_QUALIFIERS for i, w in enumerate(words))


def _redacted_tree(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: (_REDACTED if is_secret_name(k) else _redacted_tree(v)) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_redacted_tree(v) for v in value]
    return value


class FrozenMap(Mapping[str, Any]):
    """A read-only, hashable, picklable mapping (nested mappings and lists are frozen too). Its repr and its
    dumps hide the values of secret-looking keys."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[Any, Any] | None = None) -> None:
        self._data: dict[str, Any] = {str(k): _freeze(v) for k, v in (data or {}).items()}

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._data.items(), key=lambda kv: kv[0])))

    def __eq__(self, other: object) -> bool:
        return dict(self.items()) == dict(other.items()) if isinstance(other, Mapping) else NotImplemented

    def __getstate__(self) -> dict[str, Any]:  # the values of secret-looking keys travel masked
        return {"_data": {k: Secret(v) if is_secret_name(k) and isinstance(v, str) else v for k, v in self._data.items()}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._data = {k: v.get_secret_value() if isinstance(v, Secret) else v for k, v in state["_data"].items()}

    def __repr__(self) -> str:
        return f"FrozenMap({_redacted_tree(self._data)!r})"

    def to_dict(self) -> dict[str, Any]:
        thawed: dict[str, Any] = _thaw(self)
        return thawed

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        def validate(value: Any) -> FrozenMap:
            if not isinstance(value, Mapping):
                raise _Invalid("must be a mapping", type(value).__name__)
            return value if isinstance(value, FrozenMap) else cls(value)

        def dump(value: FrozenMap, info: SerializationInfo) -> dict[str, Any]:
            return value.to_dict() if _with_secrets(info) else _redacted_tree(value.to_dict())

        return core_schema.no_info_plain_validator_function(
            validate, serialization=core_schema.plain_serializer_function_ser_schema(dump, info_arg=True))


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return FrozenMap(value)
    return tuple(_freeze(v) for v in value) if isinstance(value, list | tuple) else value


def _thaw(value: Any) -> Any:
    if isinstance(value, FrozenMap):
        return {k: _thaw(v) for k, v in value.items()}
    return [_thaw(v) for v in value] if isinstance(value, tuple) else value


# --- the models' common ground ---------------------------------------------------------------------------


class _Frozen(BaseModel):
    """Frozen (assigning raises :class:`~dataclasses.FrozenInstanceError`, like a frozen dataclass), unknown
    options refused, null meaning unset, numbers accepted where a string is expected."""

    model_config = ConfigDict(frozen=True, extra="forbid", coerce_numbers_to_str=True, populate_by_name=True,
                              hide_input_in_errors=True, defer_build=True)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in type(self).__private_attributes__:
            return super().__setattr__(name, value)
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    @model_validator(mode="before")
    @classmethod
    def _unset(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            return cls._prepare({k: v for k, v in data.items() if v is not None})
        return data

    @classmethod
    def _prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        """The input mapping, nulls removed, before the fields are validated (for cross-option rules)."""
        return data


def _whole(value: Any) -> Any:
    if isinstance(value, bool):
        raise _Invalid(_WHOLE, repr(value))
    return value


#: a whole number (``"4"`` and ``4.0`` are accepted, ``True`` and ``4.5`` are not)
Count = Annotated[int, BeforeValidator(_whole)]
#: a non-empty string (surrounding blanks removed)
Text = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]


# --- connection strings ----------------------------------------------------------------------------------

_SECRET_CS_KEYS = {"sharedaccesskey": "SharedAccessKey", "sharedaccesssignature": "SharedAccessSignature"}
_PLAIN_CS_KEYS = {"endpoint", "sharedaccesskeyname", "entitypath", "usedevelopmentemulator"}


#: what a key of a connection string looks like (``SharedAccessKey``): letters, far shorter than a key's value
_CS_KEY_NAME = re.compile(r"[A-Za-z]{1,32}")


def redact_connection_string(text: str) -> str:
    """The connection string with every secret replaced by ``***``; safe to print even when malformed. An unknown
    key keeps its name and hides its value (``SharedAccesKey=***``: the misspelling stays visible); a segment
    whose key does not look like a key's name (a pasted secret, say) is shown as ``***`` as a whole."""
    shown = []
    for segment in text.strip().rstrip(";").split(";"):
        key, sep, value = segment.partition("=")
        lowered = key.strip().lower()
        if sep and lowered in _PLAIN_CS_KEYS:
            shown.append(f"{key.strip()}={value}")
        elif sep and _CS_KEY_NAME.fullmatch(key.strip()):
            shown.append(f"{key.strip()}={_REDACTED}")
        elif segment.strip():
            shown.append(_REDACTED)
    return ";".join(shown)


def _misspelt_cs_key(settings: Mapping[str, str], written: Mapping[str, str]) -> str | None:
    """The first key of a connection string that is not one of Service Bus's but close to one: the problem, with
    its did-you-mean (an unknown key that resembles none is left alone, as the SDK does)."""
    known = {"Endpoint", "SharedAccessKeyName", "EntityPath", "UseDevelopmentEmulator", *_SECRET_CS_KEYS.values()}
    for lowered in settings:
        if lowered in _PLAIN_CS_KEYS or lowered in _SECRET_CS_KEYS:
            continue
        close = difflib.get_close_matches(lowered, [k.lower() for k in known], n=1, cutoff=0.8)
        if close:
            name = next(k for k in known if k.lower() == close[0])
            return f"unknown key {written[lowered]} (did you mean {name}?)"
    return None


class ConnectionString(_Frozen):
    """A parsed Service Bus connection string. ``repr``/``str``/dumps show it redacted; :meth:`reveal` gives
    the full string for the SDK only. The key and the signature are :class:`Secret` values (``key``,
    ``signature``); :attr:`shared_access_key` and :attr:`shared_access_signature` reveal them."""

    endpoint: str
    host: str
    port: int | None = None
    shared_access_key_name: str | None = None
    key: SecretText | None = None
    signature: SecretText | None = None
    entity_path: str | None = None
    use_development_emulator: bool = False

    @classmethod
    def parse(cls, text: object, option: str = "connection_string") -> ConnectionString:
        try:
            return cls._parse(text)
        except _Invalid as err:
            raise _error(option, err.problem, err.value) from None

    @classmethod
    def _parse(cls, text: object) -> ConnectionString:
        if not isinstance(text, str) or not text.strip():
            shown = "an empty string" if isinstance(text, str) else type(text).__name__
            raise _Invalid("must be a Service Bus connection string", shown)
        redacted = redact_connection_string(text)
        settings: dict[str, str] = {}
        written: dict[str, str] = {}
        for segment in text.strip().rstrip(";").split(";"):
            key, sep, value = segment.partition("=")
            if not sep or not key.strip():
                raise _Invalid("malformed: expected Key=Value pairs separated by ';'", redacted)
            settings[key.strip().lower()] = value.strip()
            written[key.strip().lower()] = key.strip()
        misspelt = _misspelt_cs_key(settings, written)
        if misspelt:
            raise _Invalid(misspelt, redacted)
        endpoint = settings.get("endpoint")
        if not endpoint:
            raise _Invalid("missing Endpoint", redacted)
        try:
            parsed = urlparse(endpoint)
            port = parsed.port
        except ValueError as err:
            raise _Invalid(f"Endpoint is not a valid address ({err})", redacted) from None
        if not parsed.netloc or not parsed.hostname:
            raise _Invalid("Endpoint must look like sb://<namespace>.servicebus.windows.net/", redacted)
        name = settings.get("sharedaccesskeyname") or None
        access_key = settings.get("sharedaccesskey") or None
        signature = settings.get("sharedaccesssignature") or None
        if bool(name) != bool(access_key):
            raise _Invalid("SharedAccessKeyName and SharedAccessKey must be given together", redacted)
        if access_key and signature:
            raise _Invalid("give either SharedAccessKey or SharedAccessSignature, not both", redacted)
        if not access_key and not signature:
            raise _Invalid("missing SharedAccessKey (with SharedAccessKeyName) or SharedAccessSignature", redacted)
        emulator = settings.get("usedevelopmentemulator", "false").lower()
        if emulator not in ("true", "false"):
            raise _Invalid("UseDevelopmentEmulator must be true or false", redacted)
        if emulator == "true" and parsed.hostname.lower().endswith(_SERVICE_BUS_SUFFIXES):
            raise _Invalid(f"UseDevelopmentEmulator=true turns TLS off, and {parsed.hostname} is a real Service Bus "
                           "namespace, which never runs without TLS (it is for a local emulator only)", redacted)
        return cls(endpoint=endpoint, host=parsed.hostname.lower(), port=port, shared_access_key_name=name,
                   key=Secret(access_key) if access_key else None,
                   signature=Secret(signature) if signature else None,
                   entity_path=settings.get("entitypath") or None, use_development_emulator=emulator == "true")

    @property
    def shared_access_key(self) -> str | None:
        return self.key.get_secret_value() if self.key is not None else None

    @property
    def shared_access_signature(self) -> str | None:
        return self.signature.get_secret_value() if self.signature is not None else None

    @property
    def address(self) -> str:
        """The host as the SDK wants it; an emulator endpoint keeps its port (``localhost:5672``)."""
        keep_port = self.use_development_emulator and self.port is not None
        return f"{self.host}:{self.port}" if keep_port else self.host

    def _segments(self, reveal: bool) -> list[str]:
        secrets = (("SharedAccessKey", self.key), ("SharedAccessSignature", self.signature))
        return [
            f"Endpoint={self.endpoint}",
            *([f"SharedAccessKeyName={self.shared_access_key_name}"] if self.shared_access_key_name else []),
            *(f"{k}={v.get_secret_value() if reveal else _REDACTED}" for k, v in secrets if v is not None),
            *([f"EntityPath={self.entity_path}"] if self.entity_path else []),
            *(["UseDevelopmentEmulator=true"] if self.use_development_emulator else []),
        ]

    def redacted(self) -> str:
        return ";".join(self._segments(reveal=False))

    def reveal(self) -> str:
        """The canonical connection string WITH its secret, for ``ServiceBusClient.from_connection_string``."""
        return ";".join(self._segments(reveal=True))

    @model_serializer
    def _dump(self, info: SerializationInfo) -> str:
        return self.reveal() if _with_secrets(info) else self.redacted()

    def __repr__(self) -> str:
        return f"ConnectionString({self.redacted()!r})"

    def __str__(self) -> str:
        return self.redacted()


# --- credentials and namespaces --------------------------------------------------------------------------

CREDENTIAL_TYPES = ("default", "client_secret", "managed_identity")


class _Compact(_Frozen):
    """Dumped without its unset (None) options."""

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


#: Microsoft's own Entra ID hosts (``azure.identity.AzureAuthorityHosts``): MSAL's instance discovery knows them
_MICROSOFT_AUTHORITIES = ("login.microsoftonline.com", "login.microsoftonline.us", "login.chinacloudapi.cn")


def _url(text: str, default_scheme: str, shown: object) -> tuple[Any, int | None]:
    """``text`` parsed as a URL (``default_scheme`` when it names none) and its port; an invalid port is refused
    showing ``shown`` (the value as it may be shown: a secret in it masked)."""
    parsed = urlparse(text if "://" in text else f"{default_scheme}://{text}")
    try:
        return parsed, parsed.port
    except ValueError:
        raise _Invalid("has an invalid port", shown) from None


def _authority(value: Any) -> str:
    """``https://host[:port]`` (scheme optional, ``https`` assumed; nothing else accepted), normalised."""
    text = value.strip() if isinstance(value, str) else ""
    parsed, _ = _url(text, "https", repr(value))
    if parsed.scheme != "https":
        raise _Invalid("must be an https URL (Entra ID tokens travel over TLS only)", repr(value))
    if not parsed.hostname or parsed.path.strip("/") or parsed.query or parsed.username:
        raise _Invalid("must look like https://host[:port], the authority host without a tenant "
                       "(e.g. login.microsoftonline.com, or the emulator's https://localhost:5310)", repr(value))
    return f"https://{parsed.netloc.lower()}"


class CredentialConfig(_Compact):
    """How to build an azure.identity credential for a ``fully_qualified_namespace``.

    * ``default``: ``DefaultAzureCredential`` (``client_id`` selects a user-assigned managed identity);
    * ``client_secret``: ``ClientSecretCredential(tenant_id, client_id, client_secret)``, all three required
      (the secret is a :class:`Secret`). Its other options:

      - ``authority``: the Entra ID host, ``https://host[:port]`` (default: ``login.microsoftonline.com``, or
        ``AZURE_AUTHORITY_HOST``); e.g. ``login.microsoftonline.us``, or the emulator's authority
        ``https://localhost:5310``;
      - ``disable_instance_discovery``: skip MSAL's check of the authority against Microsoft's list (which needs
        ``login.microsoftonline.com``); default: true for an authority that is not one of Microsoft's
        (:data:`_MICROSOFT_AUTHORITIES`), else false;
      - ``connection_verify``: a CA bundle (PEM file) that the token requests trust instead of certifi's (the
        emulator's ``<data-dir>/tls/ca.pem``); checked to be a readable file when the credential is built;
    * ``managed_identity``: ``ManagedIdentityCredential`` (``client_id`` for a user-assigned identity).
    """

    type: Literal["default", "client_secret", "managed_identity"] = "default"
    """``default`` (``DefaultAzureCredential``), ``client_secret`` (``ClientSecretCredential``) or
    ``managed_identity`` (``ManagedIdentityCredential``)."""
    tenant_id: str | None = None
    """The Microsoft Entra ID tenant (id or domain); required with ``client_secret``, and only used with it."""
    client_id: str | None = None
    """The application (client) id: required with ``client_secret``; with ``default`` or ``managed_identity``
    it selects a user-assigned managed identity."""
    client_secret: SecretText | None = None
    """The application's secret, with ``client_secret`` only. A secret: write it as a ``${ENV_VAR}``
    reference."""
    authority: Annotated[str, BeforeValidator(_authority)] | None = None
    """With ``client_secret`` only: the Entra ID host, ``https://host[:port]`` (default:
    ``login.microsoftonline.com``, or ``AZURE_AUTHORITY_HOST``), e.g. ``https://login.microsoftonline.us`` or
    the emulator's ``https://localhost:5310``."""
    disable_instance_discovery: bool | None = None
    """With ``client_secret`` only: skip MSAL's check of the authority against Microsoft's list (which needs
    ``login.microsoftonline.com``). None: true for an authority that is not one of Microsoft's, else false."""
    connection_verify: Text | None = None
    """With ``client_secret`` only: a CA bundle (PEM file) that the token requests trust instead of certifi's
    (the emulator's ``<data-dir>/tls/ca.pem``); checked to be a readable file when the credential is built."""

    @model_validator(mode="after")
    def _fits_the_type(self) -> CredentialConfig:
        if self.type == "client_secret":
            for name in ("tenant_id", "client_id", "client_secret"):
                if not getattr(self, name):
                    raise _Invalid("required when type is client_secret", field=name)
            if self.tenant_id and not re.fullmatch(r"[A-Za-z0-9.\-]+", self.tenant_id):
                raise _Invalid("must be a tenant id or domain (letters, digits, '-' and '.')", repr(self.tenant_id),
                               field="tenant_id")
            return self
        if self.client_secret is not None:
            raise _Invalid("only used with type client_secret", _REDACTED, field="client_secret")
        for name in ("tenant_id", "authority", "disable_instance_discovery", "connection_verify"):
            if getattr(self, name) is not None:
                raise _Invalid("only used with type client_secret", repr(getattr(self, name)), field=name)
        return self

    def client_secret_kwargs(self) -> dict[str, Any]:
        """The keyword arguments ``ClientSecretCredential`` gets besides the tenant, client and secret."""
        out: dict[str, Any] = {}
        if self.authority is not None:
            out["authority"] = self.authority
        discovery_off = self.disable_instance_discovery
        if discovery_off is None and self.authority is not None:
            discovery_off = urlparse(self.authority).hostname not in _MICROSOFT_AUTHORITIES
        if discovery_off:
            out["disable_instance_discovery"] = True
        if self.connection_verify is not None:
            if not os.path.isfile(self.connection_verify):
                raise ConfigError("credential.connection_verify", "is not a readable CA bundle (PEM) file on this "
                                  "machine", repr(self.connection_verify))
            out["connection_verify"] = self.connection_verify
        return out

    def build(self) -> TokenCredential:
        """A new credential object (each call builds one; keep it for the client's life)."""
        import azure.identity as identity  # imported only when a credential is needed

        if self.type == "client_secret":
            secret = self.client_secret.get_secret_value() if self.client_secret else ""
            return identity.ClientSecretCredential(str(self.tenant_id), str(self.client_id), secret,
                                                   **self.client_secret_kwargs())
        if self.type == "managed_identity":
            if self.client_id:
                return identity.ManagedIdentityCredential(client_id=self.client_id)
            return identity.ManagedIdentityCredential()
        if self.client_id:
            return identity.DefaultAzureCredential(managed_identity_client_id=self.client_id)
        return identity.DefaultAzureCredential()


def _namespace_address(value: Any) -> str:
    """``host[:port]``, lower case, from ``contoso.servicebus.windows.net``, ``sb://host:port/`` ..."""
    if not isinstance(value, str) or not value.strip():
        raise _Invalid("must be a host name", repr(value))
    text = value.strip()
    parsed = urlparse(text if "//" in text else f"//{text}")
    try:
        port = parsed.port
    except ValueError:
        raise _Invalid("has an invalid port", repr(value)) from None
    if not parsed.hostname or not re.fullmatch(r"[A-Za-z0-9.\-\[\]:]+", parsed.hostname):
        raise _Invalid("must look like <namespace>.servicebus.windows.net", repr(value))
    return parsed.hostname.lower() + (f":{port}" if port is not None else "")


def _admin_endpoint(value: Any) -> str:
    """``http://host:port`` (scheme optional, ``http`` assumed), normalised."""
    text = value.strip() if isinstance(value, str) else ""
    parsed, _ = _url(text, "http", repr(value))
    if not text or parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.path.strip("/") \
            or parsed.query:
        raise _Invalid("must look like http://host:port", repr(value))
    return f"{parsed.scheme}://{parsed.netloc}"


TRANSPORTS = ("amqp", "websockets")


def _proxy(value: Any) -> Any:
    """``http://[user:password@]host:port`` (the form of ``HTTPS_PROXY``) as the mapping ProxyConfig takes."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    try:
        shown = _proxy_shown(urlparse(text if "://" in text else f"http://{text}"))
    except ValueError:  # urlparse cannot split it (an unclosed [ of an IPv6 address): masked by hand
        raise _Invalid("is not a URL (an IPv6 host goes in brackets: http://[::1]:3128)",
                       _userinfo_masked(text)) from None
    parsed, port = _url(text, "http", shown)
    if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.path.strip("/") or parsed.query:
        raise _Invalid("must look like http://[user:password@]host:port", shown)
    if port is None:
        raise _Invalid("needs a port (http://host:port)", shown)
    return {"host": parsed.hostname, "port": port,
            "username": unquote(parsed.username) if parsed.username else None,
            "password": unquote(parsed.password) if parsed.password else None}


def _userinfo_masked(text: str) -> str:
    """``scheme://user:password@rest`` with the password masked, for a URL urlparse cannot read."""
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "", text
    userinfo, at, tail = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return text
    return f"{scheme}{sep}{userinfo.split(':', 1)[0]}:{_REDACTED}@{tail}"


def _proxy_shown(parsed: ParseResult) -> str:
    """A proxy URL as it may be shown: its password masked."""
    netloc = parsed.netloc
    if parsed.password is not None:
        netloc = netloc.replace(f":{parsed.password}@", f":{_REDACTED}@", 1)
    return parsed._replace(netloc=netloc).geturl()


class ProxyConfig(_Compact):
    """An HTTP proxy that tunnels (``CONNECT``) to Service Bus: AMQP over WebSockets and the administration API
    over https go through it. Given as a mapping or as ``http://[user:password@]host:port``; the password is a
    secret."""

    host: Text
    """The proxy's host name or address."""
    port: Annotated[int, BeforeValidator(_whole), Field(ge=1, le=65535)]
    """The proxy's port (1 to 65535)."""
    username: Text | None = None
    """For the proxy's Basic authentication, with ``password``."""
    password: SecretText | None = None
    """For the proxy's Basic authentication. A secret: write it as a ``${ENV_VAR}`` reference."""

    def sdk(self) -> dict[str, Any]:
        """The ``http_proxy`` mapping of azure-servicebus."""
        out: dict[str, Any] = {"proxy_hostname": self.host, "proxy_port": self.port}
        if self.username is not None:
            out["username"] = self.username
        if self.password is not None:
            out["password"] = self.password.get_secret_value()
        return out

    def url(self) -> str:
        """``http://user:password@host:port`` WITH the password, for azure-core's ``proxies`` only."""
        auth = ""
        if self.username is not None or self.password is not None:
            secret = self.password.get_secret_value() if self.password is not None else ""
            auth = f"{quote(self.username or '', safe='')}:{quote(secret, safe='')}@"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{auth}{host}:{self.port}"


def _custom_endpoint(value: Any) -> str:
    """``sb://host[:port]`` (scheme optional), normalised; the SDK connects there instead of the namespace."""
    text = value.strip() if isinstance(value, str) else ""
    parsed, port = _url(text, "sb", repr(value))
    if not text or not parsed.hostname or parsed.path.strip("/") or parsed.query or parsed.username:
        raise _Invalid("must look like sb://host[:port]", repr(value))
    host = f"[{parsed.hostname}]" if ":" in parsed.hostname else parsed.hostname
    return f"sb://{host}" + (f":{port}" if port is not None else "")


#: the hosts of real Service Bus namespaces (public, China and US Government clouds): never without TLS
_SERVICE_BUS_SUFFIXES = (".servicebus.windows.net", ".servicebus.chinacloudapi.cn", ".servicebus.usgovcloudapi.net")

_EMULATOR_ONLY = ("only used with an emulator: a connection string with UseDevelopmentEmulator=true, or "
                  "fully_qualified_namespace with emulator: true")


#: seconds an administration API call may take by default (``admin_timeout``)
DEFAULT_ADMIN_TIMEOUT = 10.0


class NamespaceConfig(_Compact):
    """One Service Bus namespace: a connection string, or a fully qualified namespace plus a credential
    (option ``credential``, attribute ``credential_config``).

    ``fully_qualified_namespace`` is the host as the SDK wants it (``contoso.servicebus.windows.net``; for a
    development emulator endpoint the port is kept: ``localhost:5672``).

    ``emulator: true`` (with ``fully_qualified_namespace`` only) says the namespace is spark-sb's local
    emulator reached with a Microsoft Entra ID credential: the SDK talks plain TCP to the port given
    (``use_tls=False``, as a connection string's ``UseDevelopmentEmulator=true`` does) and provisioning goes to
    ``admin_endpoint`` over plain HTTP. Real namespaces always use TLS.

    The network options, passed to every client built for the namespace (senders, receivers, the sources'
    executors, the administration client):

    * ``transport``: ``amqp`` (port 5671, the default) or ``websockets`` (AMQP over WebSockets on port 443, for
      networks that let only https out); ``websockets`` is implied by ``http_proxy``.
    * ``custom_endpoint_address``: ``sb://host[:port]``, where the SDK connects instead of the namespace's own
      address (an application gateway, a private endpoint's name, the emulator's TLS or WebSocket port); the
      tokens still name the namespace.
    * ``http_proxy``: ``http://[user:password@]host:port`` or ``{host, port, username, password}``; AMQP over
      WebSockets and the administration API over https go through it (the password is a secret).
    * ``connection_verify``: a CA bundle (PEM file) that TLS connections trust instead of the system's. With an
      emulator it also turns TLS on for AMQP (the emulator's AMQPS or WebSocket-over-TLS port, named by
      ``custom_endpoint_address``); its administration API stays plain HTTP.
    """

    fully_qualified_namespace: Annotated[str, BeforeValidator(_namespace_address)]
    """The namespace's host as the SDK wants it (``contoso.servicebus.windows.net``; an emulator's keeps its
    port: ``localhost:5672``). Read from ``connection_string`` when one is given; else required, with an
    optional ``credential``."""
    connection_string: ConnectionString | None = None
    """A Service Bus connection string: Endpoint, SharedAccessKeyName with SharedAccessKey (or a
    SharedAccessSignature), optional EntityPath, and UseDevelopmentEmulator=true for an emulator. Its key and
    signature are secrets: never shown in an error, a log line or a dump. Not together with
    ``fully_qualified_namespace``."""
    credential_config: CredentialConfig | None = Field(default=None, alias="credential")
    """Option ``credential``: how tokens for ``fully_qualified_namespace`` are got (:class:`CredentialConfig`;
    ``DefaultAzureCredential`` when omitted). Not with ``connection_string``."""
    emulator: bool | None = None
    """The spark-sb emulator reached with a credential (plain TCP and HTTP); only with
    fully_qualified_namespace."""
    admin_endpoint: Annotated[str, BeforeValidator(_admin_endpoint)] | None = None
    """The emulator's admin REST endpoint (``http://host:port``) for provisioning; only for an emulator (an
    emulator connection string, or ``emulator: true``). ``None``: ``http://<host>:5300``."""
    transport: Literal["amqp", "websockets"] | None = None
    """``amqp`` | ``websockets``; None: ``amqp``, or ``websockets`` with an ``http_proxy``."""
    custom_endpoint_address: Annotated[str, BeforeValidator(_custom_endpoint)] | None = None
    """``sb://host[:port]``: where the SDK connects instead of the namespace's own address (an application
    gateway, a private endpoint's name, the emulator's TLS or WebSocket port); the tokens still name the
    namespace."""
    http_proxy: Annotated[ProxyConfig, BeforeValidator(_proxy)] | None = None
    """An HTTP proxy that tunnels (``CONNECT``) to Service Bus: ``http://[user:password@]host:port`` or a
    mapping (:class:`ProxyConfig`). AMQP over WebSockets and the administration API over https go through it;
    it implies ``transport: websockets``."""
    connection_verify: Text | None = None
    """A CA bundle (PEM) that TLS trusts instead of the system's."""
    admin_timeout: Duration | None = Field(default=None, ge=100 * MS, le=5 * MINUTE)
    """Bounds each call to the administration API (the connect, and each wait for an answer): a management
    endpoint that accepts and never answers costs this, never azure-core's 300 s. None: 10 s."""

    @classmethod
    def _prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        if set(data) - {*cls.model_fields, "credential"}:
            return data  # pydantic names the unknown option
        if data.get("http_proxy") is not None and str(data.get("transport", "websockets")).strip() == "amqp":
            raise _Invalid("a proxy tunnels AMQP over WebSockets only: use transport: websockets, or no "
                           "http_proxy", repr(data["transport"]), field="transport")
        credential = data.pop("credential", data.pop("credential_config", None))
        raw = data.get("connection_string")
        admin = data.get("admin_endpoint")
        emulator = data.get("emulator")
        if raw is None:
            if admin is not None and not _true(emulator):
                raise _Invalid(_EMULATOR_ONLY, repr(admin), field="admin_endpoint")
            if "fully_qualified_namespace" not in data:
                raise _Invalid("needs connection_string, or fully_qualified_namespace with an optional credential")
            if _true(emulator):
                try:
                    host = _split_host_port(_namespace_address(data["fully_qualified_namespace"]))[0]
                except _Invalid:
                    host = ""  # pydantic names the bad fully_qualified_namespace
                if host.endswith(_SERVICE_BUS_SUFFIXES):
                    raise _Invalid(f"turns TLS off, and {host} is a real Service Bus namespace, which never runs "
                                   "without TLS (emulator: true is for spark-sb's local emulator only)",
                                   repr(emulator), field="emulator")
            return {**data, "credential": credential if credential is not None else {}}
        if "fully_qualified_namespace" in data and not isinstance(raw, ConnectionString):
            raise _Invalid("give either connection_string or fully_qualified_namespace (with credential), not both")
        if credential is not None:
            raise _Invalid("only used with fully_qualified_namespace, not with connection_string", field="credential")
        if emulator is not None:
            raise _Invalid("only used with fully_qualified_namespace (a connection string says "
                           "UseDevelopmentEmulator=true)", repr(emulator), field="emulator")
        try:
            cs = raw if isinstance(raw, ConnectionString) else ConnectionString._parse(raw)
        except _Invalid as err:
            raise _Invalid(err.problem, err.value, field="connection_string") from None
        if admin is not None and not cs.use_development_emulator:
            raise _Invalid(_EMULATOR_ONLY, repr(admin), field="admin_endpoint")
        return {**data, "connection_string": cs, "fully_qualified_namespace": cs.address}

    @property
    def host(self) -> str:
        return _split_host_port(self.fully_qualified_namespace)[0]

    @property
    def port(self) -> int | None:
        return _split_host_port(self.fully_qualified_namespace)[1]

    @property
    def is_emulator(self) -> bool:
        """An emulator connection string, or ``fully_qualified_namespace`` with ``emulator: true``."""
        if self.connection_string is not None:
            return self.connection_string.use_development_emulator
        return bool(self.emulator)

    @property
    def use_tls(self) -> bool:
        """Whether AMQP goes over TLS: always for a real namespace; for the emulator only with a CA to trust
        (``connection_verify``). The emulator's administration API is plain HTTP either way."""
        return not self.is_emulator or self.connection_verify is not None

    @property
    def websockets(self) -> bool:
        """AMQP over WebSockets: ``transport: websockets``, or an ``http_proxy`` with no transport given."""
        return self.transport == "websockets" or (self.transport is None and self.http_proxy is not None)

    def network_kwargs(self) -> dict[str, Any]:
        """What every ``ServiceBusClient`` of this namespace is given: the transport, TLS, the endpoint, the
        proxy and the CA (secrets included: for the SDK only)."""
        from azure.servicebus import TransportType

        out: dict[str, Any] = {
            # always explicit: the SDK takes a custom endpoint without a transport type for a WebSocket one
            "transport_type": TransportType.AmqpOverWebsocket if self.websockets else TransportType.Amqp,
        }
        if self.is_emulator:
            out["use_tls"] = self.use_tls
        if self.custom_endpoint_address is not None:
            out["custom_endpoint_address"] = self.custom_endpoint_address
        if self.http_proxy is not None:
            out["http_proxy"] = self.http_proxy.sdk()
        if self.connection_verify is not None:
            out["connection_verify"] = self.ca_bundle()
        return out

    def ca_bundle(self) -> str | None:
        """``connection_verify``, checked to be a readable file (on the process that connects: an executor's
        file system may differ from the driver's)."""
        if self.connection_verify is None:
            return None
        if not os.path.isfile(self.connection_verify):
            raise ConfigError("connection_verify", f"(namespace {self.fully_qualified_namespace}) is not a readable "
                              "CA bundle (PEM) file on this machine", repr(self.connection_verify))
        return self.connection_verify

    @property
    def admin_timeout_seconds(self) -> float:
        """``admin_timeout`` in seconds (10 by default)."""
        return DEFAULT_ADMIN_TIMEOUT if self.admin_timeout is None else self.admin_timeout.total_seconds()

    def admin_kwargs(self) -> dict[str, Any]:
        """What the administration client of a namespace reached over https is given: the proxy and the CA."""
        out: dict[str, Any] = {}
        if self.http_proxy is not None:
            url = self.http_proxy.url()
            out["proxies"] = {"https": url, "http": url}
        if self.connection_verify is not None:
            out["connection_verify"] = self.ca_bundle()
        return out

    def credential(self) -> TokenCredential | AzureNamedKeyCredential | AzureSasCredential:
        """Build the credential: a named key or SAS credential for a connection string, else the configured
        azure.identity credential (``DefaultAzureCredential`` by default)."""
        if self.connection_string is not None:
            from azure.core.credentials import AzureNamedKeyCredential, AzureSasCredential

            cs = self.connection_string
            if cs.shared_access_key:
                return AzureNamedKeyCredential(str(cs.shared_access_key_name), cs.shared_access_key)
            return AzureSasCredential(str(cs.shared_access_signature))
        return (self.credential_config or CredentialConfig()).build()

    def client(self, **sdk_kwargs: Any) -> ServiceBusClient:
        """A new ``ServiceBusClient`` for this namespace (``sdk_kwargs`` go to the SDK: retry settings...)."""
        from azure.servicebus import ServiceBusClient

        sdk_kwargs = {**self.network_kwargs(), **sdk_kwargs}
        if self.connection_string is not None and not (self.is_emulator and self.use_tls):
            sdk_kwargs.pop("use_tls", None)  # the string says it
            return ServiceBusClient.from_connection_string(self.connection_string.reveal(), **sdk_kwargs)
        # a credential; or an emulator connection string over TLS, which from_connection_string would make plain
        return ServiceBusClient(self.fully_qualified_namespace, self.credential(), **sdk_kwargs)

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = {k: v for k, v in handler(self).items() if v is not None}
        if self.connection_string is not None:
            del out["fully_qualified_namespace"]
        return out


def _true(value: Any) -> bool:
    """A raw boolean option's truth as pydantic will read it (``true``, ``"true"``, ``1``...)."""
    return str(value).strip().lower() in ("true", "1", "yes", "on") if value is not None else False


def _split_host_port(address: str) -> tuple[str, int | None]:
    parsed = urlparse(f"//{address}")
    return (parsed.hostname or address), parsed.port


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def default_backlog_prefix(namespace: NamespaceConfig) -> str:
    """The first DNS label of the primary host, lower case (``contoso`` for contoso.servicebus.windows.net).

    For endpoints that have no meaningful first label the address is used instead, so that several local
    primaries sharing one secondary still get distinct prefixes: an IP address is written with ``-`` for
    its separators, and when the endpoint carries a port and is a development emulator, a single-label host
    (``localhost``) or an IP address, ``-<port>`` is appended: ``localhost:5672`` -> ``localhost-5672``,
    ``127.0.0.1:5673`` -> ``127-0-0-1-5673``.
    """
    host, port = namespace.host.lower(), namespace.port
    if _is_ip(host):
        label, local = re.sub(r"[^0-9a-z]+", "-", host).strip("-"), True
    else:
        label, local = host.split(".", 1)[0], "." not in host
    return f"{label}-{port}" if port is not None and (namespace.is_emulator or local) else label


# --- send availability and syphon ------------------------------------------------------------------------

_PREFIX_SEGMENT = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"


class SendAvailabilityConfig(_Frozen):
    """The paired sender's options (behaviour.md "Defaults").

    The ``primary_*`` options configure the SDK clients of the primary namespace so that the failover
    interval, not the SDK's own retry policy, decides when failover happens: by default the SDK does not
    retry (``primary_retry_total`` 0; the sender's own loop retries within the interval) and bounds every
    attempt (``primary_try_timeout`` 5 s). The secondary's clients keep the SDK defaults.
    """

    backlog_prefix: str = Field(
        pattern=rf"^{_PREFIX_SEGMENT}(?:/{_PREFIX_SEGMENT})*$",
        description="letters, digits, '.', '-' or '_' (segments separated by '/'), starting and ending with a "
        "letter or digit")
    """The path before ``/x-servicebus-transfer/<n>`` of this pairing's backlog queues on the secondary:
    letters, digits, '.', '-' or '_', segments separated by '/'. Default: the primary's first DNS label
    (``localhost-5672`` for an emulator)."""
    backlog_queue_count: Count = Field(default=10, ge=1, le=MAX_BACKLOG_QUEUES)
    """How many backlog queues pairing provisions on the secondary (1 to 100); a failed-over entity's messages
    go to one of them, picked at random and kept."""
    failover_interval: Duration = Field(default=60 * SECOND, ge=0 * SECOND, le=60 * MINUTE)
    """How long an entity's sends keep retrying the primary through an outage before they fail over to a
    backlog queue (0 to 60 min; 0: fail over on the first outage)."""
    ping_primary_interval: Duration = Field(default=60 * SECOND, ge=SECOND, le=30 * MINUTE)
    """While an entity is failed over, how often the primary is pinged to fail it back (1 s to 30 min)."""
    server_busy_backoff: Duration = Field(default=10 * SECOND, ge=10 * SECOND)
    """The wait after a ServerBusy answer that names no wait of its own (at least 10 s). A busy namespace is
    waited for, never failed over."""
    backlog_cooldown: Duration = Field(default=30 * SECOND, ge=0 * SECOND, le=60 * MINUTE)
    """How long a backlog queue whose send failed stays out of the rotation for every sender in the process."""
    provision_retries: Count = Field(default=3, ge=1, le=10)
    """How many times each backlog queue creation is tried (1 = no retry); behaviour.md: up to 3 times."""
    provision_retry_spacing: Duration = Field(default=SECOND, ge=0 * SECOND, le=5 * MINUTE)
    """The wait between two tries of one backlog queue's creation (0 to 5 min)."""
    session_order: Literal["strict", "available"] = "strict"
    """What a message with a session id does when its session's backlog queue can neither say whether the session
    has messages parked (the peek failed) nor take the message (the secondary down or not answering) while the
    primary is healthy. ``strict``: the send fails with :class:`~spark_sb.errors.BacklogUnavailableError`
    (nothing acknowledged; in Spark the batch fails and is replayed), so a session never overtakes its parked
    messages, at the cost of the session's sends while the secondary cannot be asked: those of sessions whose
    backlog queue exists or that the process has not reached the secondary to ask about since it started. A
    session whose backlog queue the process found absent is never held (nothing can be parked there; the
    process makes the queue before it parks). ``available``: the message goes to the primary, logged and
    counted in ``session_unordered`` (its order is not guaranteed). Messages without a session id never wait for
    the backlog."""
    pairing_timeout: Duration = Field(default=30 * SECOND, ge=SECOND, le=10 * MINUTE)
    """The deadline of pairing (listing and creating the backlog queues on the secondary): one attempt, and
    all the attempts one send makes together (the last wait before a failover, then the failover itself), stop
    within it with :class:`~spark_sb.errors.PairingError`; each administration request waits at most the
    secondary's ``admin_timeout`` or what is left of it, none (and no retry) starts past it, and a request the
    endpoint did not answer (refused, host not found, timed out) ends the attempt instead of trying the next
    queue."""
    primary_retry_total: Count = Field(default=0, ge=0, le=10)
    """SDK ``retry_total`` of the primary's clients."""
    primary_retry_backoff: Duration = Field(default=800 * MS, ge=0 * SECOND, le=60 * SECOND)
    """SDK ``retry_backoff_factor`` of the primary's clients."""
    primary_retry_backoff_max: Duration = Field(default=5 * SECOND, ge=0 * SECOND, le=10 * MINUTE)
    """SDK ``retry_backoff_max`` of the primary's clients (at least ``primary_retry_backoff``)."""
    primary_try_timeout: Duration = Field(default=5 * SECOND, ge=100 * MS, le=5 * MINUTE)
    """SDK ``try_timeout`` of the primary's clients: bounds one attempt (link open plus send)."""

    @model_validator(mode="after")
    def _consistent(self) -> SendAvailabilityConfig:
        if self.primary_retry_backoff_max < self.primary_retry_backoff:
            raise _Invalid(f"must be between {format_duration(self.primary_retry_backoff)} and 10 min",
                           format_duration(self.primary_retry_backoff_max), field="primary_retry_backoff_max")
        longest = len(self.backlog_queue_name(self.backlog_queue_count - 1))
        if longest > _MAX_ENTITY_PATH:
            raise _Invalid(f"too long: backlog queue paths would be {longest} characters, the limit is "
                           f"{_MAX_ENTITY_PATH}", repr(self.backlog_prefix), field="backlog_prefix")
        return self

    def backlog_queue_name(self, index: int) -> str:
        """``<prefix>/x-servicebus-transfer/<index>``."""
        return f"{self.backlog_prefix}/{BACKLOG_QUEUE_SEGMENT}/{index}"

    def backlog_queue_names(self) -> list[str]:
        return [self.backlog_queue_name(i) for i in range(self.backlog_queue_count)]

    def primary_client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the primary's ``ServiceBusClient`` (SDK retry settings)."""
        return {
            "retry_total": self.primary_retry_total,
            "retry_backoff_factor": self.primary_retry_backoff.total_seconds(),
            "retry_backoff_max": self.primary_retry_backoff_max.total_seconds(),
            "try_timeout": self.primary_try_timeout.total_seconds(),
        }


class SyphonConfig(_Frozen):
    """The syphon's options (``syphon:`` section): :class:`spark_sb.syphon.Syphon` and the syphon job
    (``spark-sb-syphon``), which moves the messages parked in the backlog queues back to the primary."""

    retry_interval: Duration = Field(default=SECOND, ge=SECOND, le=2 * MINUTE)
    """How soon a destination found down is tried again (1 s to 2 min); also the syphon job's trigger
    interval, and the pause before another ``--until-empty`` run."""
    receive_batch: Count = Field(default=100, ge=1, le=MAX_RECEIVE_BATCH)
    """Messages per receive of :meth:`spark_sb.syphon.Syphon.move`."""
    max_messages_per_trigger: Count = Field(default=4000, ge=1, le=MAX_RECEIVE_BATCH)
    """Messages per batch of the syphon job (the source's default ``maxMessagesPerTrigger``): Spark's cost per
    batch (planning, a Delta commit, the offset logs) is spread over this many messages."""
    receives_in_flight: Count = Field(default=8, ge=1, le=32)
    """Backlog queues received from at once (the source's ``receivesInFlight``), each in a thread with its own
    connection: against a secondary in another region each deferred message costs a round trip."""
    encoder: Literal["fast", "sdk"] = "fast"
    """How a restored message becomes its bytes: ``fast`` builds them at once, the bytes the SDK's encoder writes
    (:mod:`spark_sb.wire`; a message it does not cover, e.g. one with a TTL, goes through the SDK); ``sdk``
    builds every restored message with the SDK, for a difference met."""
    checkpoint_location: Text | None = None
    """The syphon job's Spark checkpoint (required by jobs/syphon.py)."""
    ledger: Text | None = Field(
        default=None, pattern=r"^(?:.*[/:].*|[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*){0,2}|`[^`]+`)$",
        description="a path (with '/' or a scheme) or a table name ([catalog.][schema.]table)")
    """The syphon job's Delta ledger: a path (contains ``/`` or ``:``) or a table name (required by the job)."""

    @property
    def ledger_is_path(self) -> bool:
        return self.ledger is not None and ("/" in self.ledger or ":" in self.ledger)

    def require_job_locations(self) -> None:
        """The syphon job needs both a checkpoint and a ledger; a clear error naming the missing one."""
        for name in ("checkpoint_location", "ledger"):
            if getattr(self, name) is None:
                raise ConfigError(f"syphon.{name}", "is required by the syphon job (not set)")


# --- replication ----------------------------------------------------------------------------------------

#: the replication modes of the outages guidance; ``paired`` is send availability (backlog queues)
REPLICATION_MODES = ("paired", "active", "passive")


class ReplicationConfig(_Frozen):
    """``replication``: how messages reach the two namespaces (behaviour.md, "Active and passive replication").

    In ``active`` and ``passive`` mode the primary and the secondary hold the same entities and no backlog queue
    is used; :class:`spark_sb.replication.ReplicatingSender` sends."""

    mode: Literal["paired", "active", "passive"] = "paired"
    """``paired`` (send availability: failover to backlog queues on the secondary, the default), ``active``
    (every message to both namespaces) or ``passive`` (to the active namespace; the other takes over on an
    outage)."""
    retry_interval: Duration = Field(default=30 * SECOND, ge=0 * SECOND, le=60 * MINUTE)
    """Active mode: a namespace whose send failed for an outage is skipped by later sends for this long, then
    the next send tries it again (a send to the other namespace failing tries it at once)."""

    @property
    def replicating(self) -> bool:
        """True in active and passive mode."""
        return self.mode != "paired"


# --- the Spark sink --------------------------------------------------------------------------------------

#: the message fields a row can fill, in the order of spark.md ("Input columns"); each one's default column
#: has the field's name
SINK_FIELDS = ("body", "message_id", "entity", "session_id", "partition_key", "subject", "content_type",
               "correlation_id", "to", "reply_to", "time_to_live", "scheduled_enqueue_time", "application_properties")
SOURCE_FORMATS_NEED_PATH = ("parquet", "json", "csv", "orc", "text", "delta")


def _reader_options(value: Any) -> Any:
    if not isinstance(value, Mapping):
        raise _Invalid("must be a mapping of reader options", type(value).__name__)
    return {str(k): str(v) for k, v in value.items()}


class SinkSourceConfig(_Frozen):
    """Where the writer job (``jobs/paired_writer.py``) reads its rows: the ``rate`` source (the default, for
    the demo), a table (``table``), or files or a Delta table at ``path`` in ``format`` (default ``delta``).
    ``options`` go to the reader as given."""

    format: Annotated[str, StringConstraints(to_lower=True)] = Field(
        default="rate", pattern=r"^[A-Za-z][A-Za-z0-9_.\-]*$", description="a source format name such as rate, delta or parquet")
    """``rate`` (the default: generated rows, for the demo), or the format of the files or table at ``path``,
    such as ``delta`` (the default with a ``path``) or ``parquet``."""
    rows_per_second: Count = Field(default=10, ge=1)
    """The ``rate`` source's rows a second."""
    num_partitions: Count | None = Field(default=None, ge=1)
    """The ``rate`` source's partitions. None: Spark's default."""
    table: Text | None = None
    """A table name to read as a stream (not with ``path``)."""
    path: Text | None = None
    """Files or a Delta table to read as a stream, in ``format`` (not with ``table``)."""
    options: Annotated[FrozenMap, BeforeValidator(_reader_options)] = Field(default_factory=FrozenMap)
    """Reader options, passed to Spark as given."""

    @classmethod
    def _prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        return {"format": "delta", **data} if "path" in data else data

    @model_validator(mode="after")
    def _one_source(self) -> SinkSourceConfig:
        if self.table is not None and self.path is not None:
            raise _Invalid("give either table or path, not both", repr({"table": self.table, "path": self.path}))
        if self.table is None and self.format == "rate" and self.path is not None:
            raise _Invalid("a path needs a file format such as delta or parquet", "'rate'", field="format")
        if self.table is None and self.path is None and self.format != "rate":
            raise _Invalid(f"format {self.format} needs a path (or give a table)", repr({"format": self.format}))
        return self

    @property
    def kind(self) -> str:
        """``rate``, ``table`` or ``path``."""
        return "table" if self.table is not None else "path" if self.path is not None else "rate"

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        kept = {"table": ("table",), "path": ("format", "path"), "rate": ("format", "rows_per_second", "num_partitions")}
        shown = {k: out[k] for k in kept[self.kind] if out[k] is not None}
        return {**shown, "options": out["options"]} if self.options else shown

    def to_dict(self) -> dict[str, Any]:
        """The section in the YAML shape (only the options of its kind of source), secrets included."""
        escaped: dict[str, Any] = _escape_references(self.model_dump(mode="json", context={"secrets": True}))
        return escaped


def _columns(value: Any) -> Any:
    if not isinstance(value, Mapping):
        raise _Invalid("must be a mapping of message field to column name", type(value).__name__)
    columns = {}
    for key, column in value.items():
        name = _canonical(str(key), SINK_FIELDS)
        if name not in SINK_FIELDS:
            raise _Invalid(f"unknown message field{_did_you_mean(str(key), SINK_FIELDS)} (fields: "
                           f"{', '.join(SINK_FIELDS)})", field=str(key))
        if not isinstance(column, str) or not column.strip():
            raise _Invalid("must be a column name", repr(column), field=name)
        columns[name] = column
    return columns


class SinkConfig(_Frozen):
    """The Spark sink's options (``sink:`` section); see :mod:`spark_sb.sink`.

    ``columns`` holds only the fields mapped to a column of another name; :attr:`column_map` is the full
    mapping (a field's default column is its own name).
    """

    entity: Text | None = Field(default=None, max_length=_MAX_ENTITY_PATH)
    """The default entity, a queue or a topic, for rows whose ``entity`` column is null or absent."""
    columns: Annotated[FrozenMap, BeforeValidator(_columns)] = Field(default_factory=FrozenMap)
    """``{message field: column}`` for the fields read from a column of another name, e.g. ``{body: payload}``
    (default: each field from the column of its own name)."""
    key_column: Text | None = None
    """The column whose value is each message's id (not with ``columns.message_id``). None: ids derived from
    the batch, the partition and the row's content, the same when a batch is replayed."""
    chunk_size: Count = Field(default=500, ge=1, le=_MAX_CHUNK)
    """Messages per send: a partition hands its rows to the sender in chunks of this many."""
    sends_in_flight: Count = Field(default=8, ge=1, le=32)
    """Chunks a partition keeps in flight at once (``PairedSender.submit``): a far namespace's round trips
    overlap instead of adding up. 1: one send at a time, in the partition's order."""
    connections_per_entity: Count = Field(default=1, ge=1, le=32)
    """The sending connections a worker (a Python process) opens per entity and namespace: the sends in flight
    share them, several batches in flight on each link (:mod:`spark_sb.bus.pipeline`). A namespace takes at
    most 5,000 connections: docs/sizing.md, "Sizing a job"."""
    encoder: Literal["fast", "sdk"] = "fast"
    """How a row becomes its message's bytes: ``fast`` builds them at once from the row's values, the bytes the
    SDK's encoder writes (:mod:`spark_sb.wire`; a row it does not cover, e.g. one with a TTL, goes through the SDK);
    ``sdk`` builds every message with the SDK (``ServiceBusMessage``, ``add_message``), for a difference met."""
    reject_table: Text | None = None
    """A Delta path or table name: rows that can never be sent go there with their reason, instead of failing
    the batch (the ``servicebus`` writer takes a local path only)."""
    metrics_table: Text | None = None
    """A Delta path or table name: one row per batch summary, which ``spark-sb report`` draws (the
    ``servicebus`` writer takes a local path only). Not the same as ``reject_table``."""
    checkpoint_location: Text | None = None
    """The writer job's Spark checkpoint (``spark-sb-writer``)."""
    source: SinkSourceConfig = Field(default_factory=lambda: SinkSourceConfig())
    """Where the writer job reads its rows (:class:`SinkSourceConfig`)."""
    trigger: Duration | None = Field(default=None, ge=MS, le=DAY)
    """The writer job's processing-time trigger, e.g. ``2s`` (1 ms to 1 day). None: each batch as soon as the
    last one ends."""
    max_batches: Count | None = Field(default=None, ge=1)
    """The writer job stops after this many batches of a run (``--max-batches`` overrides it): a run on an
    existing checkpoint runs this many more, whatever batch it resumes from. None: it runs until stopped."""

    @model_validator(mode="after")
    def _consistent(self) -> SinkConfig:
        if self.key_column is not None and "message_id" in self.columns:
            raise _Invalid("give either key_column or columns.message_id, not both", repr(self.key_column),
                           field="key_column")
        if self.reject_table is not None and self.reject_table == self.metrics_table:
            raise _Invalid("must differ from reject_table", repr(self.metrics_table), field="metrics_table")
        return self

    @property
    def column_map(self) -> dict[str, str]:
        """``{message field: column name}`` for every field (the message id's column is ``key_column``
        when given)."""
        mapping = {name: str(self.columns.get(name, name)) for name in SINK_FIELDS}
        if self.key_column is not None:
            mapping["message_id"] = self.key_column
        return mapping

    def to_dict(self) -> dict[str, Any]:
        """The section in the YAML shape, secrets included (reader options)."""
        escaped: dict[str, Any] = _escape_references(self.model_dump(mode="json", context={"secrets": True}))
        return escaped


# --- the whole configuration -----------------------------------------------------------------------------


class SparkSbConfig(_Frozen):
    """The whole spark-sb configuration. Build it with :func:`load_config`, :func:`from_options` or
    :func:`load_reference`.

    Equal, hashed and fingerprinted by its options only: where it came from (:attr:`origin_path`, the mapping
    behind :meth:`reference`) takes no part.
    """

    primary: NamespaceConfig
    """The namespace sent to while it is healthy, where the syphon brings the backlog home
    (:class:`NamespaceConfig`)."""
    secondary: NamespaceConfig
    """The other namespace: it holds the backlog queues in paired mode, the same entities in active and
    passive replication (:class:`NamespaceConfig`). Not the same namespace as the primary."""
    send_availability: SendAvailabilityConfig = Field(default_factory=dict, validate_default=True)
    """The paired sender's options (:class:`SendAvailabilityConfig`)."""
    syphon: SyphonConfig = Field(default_factory=lambda: SyphonConfig())
    """The syphon's options (:class:`SyphonConfig`)."""
    replication: ReplicationConfig = Field(default_factory=lambda: ReplicationConfig())
    """How messages reach the two namespaces (:class:`ReplicationConfig`)."""
    sink: SinkConfig = Field(default_factory=lambda: SinkConfig())
    """The Spark sink's and the writer job's options (:class:`SinkConfig`)."""

    _origin_path: str | None = PrivateAttr(None)
    _reference: str | None = PrivateAttr(None)  # the raw mapping as JSON, kept only when it holds no secret

    @model_validator(mode="before")
    @classmethod
    def _second_namespace(cls, value: Any) -> Any:
        if isinstance(value, Mapping) and value.get("secondary") is None:
            replication = value.get("replication")
            mode = replication.get("mode") if isinstance(replication, Mapping) else None
            if mode in ("active", "passive"):
                raise _Invalid(f"required: replication mode {mode!r} sends to both namespaces, which hold the same "
                               "entities", field="secondary")
        return value

    @field_validator("send_availability", mode="before")
    @classmethod
    def _default_prefix(cls, value: Any, info: ValidationInfo) -> Any:
        primary = info.data.get("primary")
        if isinstance(value, Mapping) and not value.get("backlog_prefix") and isinstance(primary, NamespaceConfig):
            return {**value, "backlog_prefix": default_backlog_prefix(primary)}
        return value

    @model_validator(mode="after")
    def _a_pair(self) -> SparkSbConfig:
        if self.primary.fully_qualified_namespace.lower() == self.secondary.fully_qualified_namespace.lower():
            raise _Invalid("must be a different namespace from the primary", self.secondary.fully_qualified_namespace,
                           field="secondary")
        cs = self.secondary.connection_string
        if cs is not None and cs.entity_path:
            raise _Invalid("EntityPath is not allowed: the secondary holds the backlog queues, use a namespace-level "
                           "connection string", cs.redacted(), field="secondary.connection_string")
        return self

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SparkSbConfig):
            return NotImplemented
        return self.__dict__ == other.__dict__  # the fields only: the private attributes are left out

    def __hash__(self) -> int:
        return hash(tuple(self.__dict__.values()))

    @property
    def origin_path(self) -> str | None:
        """The absolute path of the YAML file :func:`load_config` read, or None."""
        return self._origin_path

    def reference(self) -> dict[str, Any] | None:
        """The configuration as it was given (its ``${ENV_VAR}`` references unresolved), JSON-serialisable,
        for :func:`load_reference` to rebuild where it runs; None when it holds a literal secret (a
        connection string's SharedAccessKey or SharedAccessSignature, a client_secret, a secret-named reader
        option) that is not a ``${VAR}`` reference."""
        if self._reference is not None:
            return dict(json.loads(self._reference))
        given = self.to_dict(secrets=True)
        return None if _literal_secret(given) else given

    def to_dict(self, *, secrets: bool = False) -> dict[str, Any]:
        """The configuration in the YAML shape; secrets as ``***`` unless ``secrets=True``, in which case
        ``load_config(config.to_dict(secrets=True)) == config``."""
        escaped: dict[str, Any] = _escape_references(self.model_dump(mode="json", by_alias=True,
                                                                    context={"secrets": secrets}))
        return escaped

    def fingerprint(self) -> str:
        """A stable hash of the whole configuration, secrets included in its input (a different key gives a
        different fingerprint) but not recoverable from it. Used as a registry key across processes."""
        canonical = json.dumps(self.to_dict(secrets=True), sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(b"spark-sb-config-v1\x00" + canonical.encode("utf-8")).hexdigest()[:32]


def _escape_references(value: Any) -> Any:
    """Write a literal ``${`` as ``$${`` so that loading the dict again does not interpolate it."""
    if isinstance(value, dict):
        return {k: _escape_references(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escape_references(v) for v in value]
    return value.replace("${", "$${") if isinstance(value, str) else value


# --- validation errors -----------------------------------------------------------------------------------

_PROBLEMS = {"missing": "required", "int_parsing": _WHOLE, "int_from_float": _WHOLE, "int_type": _WHOLE,
             "string_type": "must be a string", "string_too_short": "must be a non-empty string",
             "bool_parsing": "must be true or false", "bool_type": "must be true or false"}
_MAPPING_ERRORS = ("model_type", "model_attributes_type", "dict_type")


def _fields_of(model: type[BaseModel] | None) -> dict[str, FieldInfo]:
    return {(f.alias or name): f for name, f in model.model_fields.items()} if model else {}


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(_model_in, get_args(annotation)) if m is not None), None)


def _walk(model: type[BaseModel], loc: tuple[Any, ...]) -> tuple[type[BaseModel] | None, FieldInfo | None]:
    """The model at ``loc`` and the field of the option at ``loc`` (None where the path leaves the models)."""
    current: type[BaseModel] | None = model
    field = None
    for part in loc:
        field = _fields_of(current).get(str(part))
        if field is None:
            return None, None
        current = _model_in(field.annotation)
    return current, field


def _bounds(field: FieldInfo | None) -> tuple[Any, Any]:
    low = next((m.ge for m in field.metadata if hasattr(m, "ge")), None) if field else None
    high = next((m.le for m in field.metadata if hasattr(m, "le")), None) if field else None
    return low, high


def _config_error(exc: ValidationError, model: type[BaseModel] = SparkSbConfig) -> ConfigError:
    """The first problem of ``exc`` as a :class:`ConfigError` naming the option path; unknown options first."""
    errors = exc.errors(include_url=False)
    unknown = [e["loc"] for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        parent = unknown[0][:-1]
        names = [str(loc[-1]) for loc in unknown if loc[:-1] == parent]
        allowed = list(_fields_of(_walk(model, parent)[0]))
        if len(names) == 1:
            return ConfigError(_dotted(*parent, names[0]), "unknown option" + _did_you_mean(names[0], allowed))
        described = ", ".join(name + _did_you_mean(name, allowed) for name in names)
        return ConfigError(_dotted(*parent) or "configuration", f"unknown options {described}")
    error = errors[0]
    loc, kind, value, ctx = error["loc"], error["type"], error.get("input"), error.get("ctx") or {}
    cause = ctx.get("error")
    if isinstance(cause, _Invalid):
        return _error(_dotted(*loc, *([cause.field] if cause.field else [])), cause.problem, cause.value)
    if isinstance(cause, DurationError):
        return ConfigError(_dotted(*loc), cause.problem, cause.value)
    option = _dotted(*loc) or "configuration"
    if kind == "missing":
        return ConfigError(option, "required")
    field = _walk(model, loc)[1]
    shown: object = _REDACTED if loc and is_secret_name(loc[-1]) else repr(value)
    if kind in ("greater_than_equal", "less_than_equal"):
        low, high = _bounds(field)
        text: Callable[[Any], str]
        if isinstance(low if low is not None else high, timedelta):
            text, shown = format_duration, format_duration(_parse_duration(value))
        else:
            text, shown = str, int(value.strip()) if isinstance(value, str) else value
        problem = (f"must be between {text(low)} and {text(high)}" if low is not None and high is not None
                   else f"must be at least {text(low)}" if low is not None else f"must be at most {text(high)}")
    elif kind == "literal_error":
        problem = _one_of(re.findall(r"'([^']*)'", str(ctx.get("expected", ""))), value)
    elif kind == "string_pattern_mismatch":
        problem = f"must be {field.description}" if field is not None and field.description else "is not valid"
    elif kind == "string_too_long":
        problem = f"longer than {ctx.get('max_length')} characters"
    elif kind in _MAPPING_ERRORS:
        problem, shown = "must be a mapping of options", type(value).__name__
    else:
        problem = _PROBLEMS.get(kind, error["msg"][:1].lower() + error["msg"][1:])
    return ConfigError(option, problem, shown)


def _dotted(*parts: object) -> str:
    return ".".join(str(p) for p in parts)


def _one_of(allowed: list[str], value: object) -> str:
    text = f"must be one of {', '.join(allowed)}"
    close = difflib.get_close_matches(value, allowed, n=1, cutoff=0.6) if isinstance(value, str) else []
    return text + (f" (did you mean {close[0]}?)" if close else "")


def _normal(name: str) -> str:
    return re.sub(r"[_\-\s]", "", name).lower()


def _canonical(name: str, allowed: Any) -> str:
    return next((candidate for candidate in allowed if _normal(candidate) == _normal(name)), name)


def _did_you_mean(name: str, allowed: Any) -> str:
    suggestion = _canonical(name, allowed)
    if suggestion == name:
        close = difflib.get_close_matches(name, list(allowed), n=1, cutoff=0.6)
        suggestion = close[0] if close else ""
    return f" (did you mean {suggestion}?)" if suggestion and suggestion != name else ""


# --- loading ---------------------------------------------------------------------------------------------

#: ``${NAME}``, ``${NAME:-default}``, and with a whole number added to a numeric variable ``${NAME+2}`` and
#: ``${NAME+2:-5300}`` (the default as written: one variable moves several ports, conf/local.yaml)
_ENV_REFERENCE = re.compile(r"\$(\$?)\{([A-Za-z_][A-Za-z0-9_]*)(?:\+([0-9]+))?(?::-([^}]*))?\}")
#: a value that is only a reference: ``${NAME}`` or ``${NAME:-}`` (a non-empty default is a literal)
_PURE_REFERENCE = re.compile(r"^\$\{[A-Za-z_][A-Za-z0-9_]*(?::-)?\}$")


def _interpolate(value: Any, path: str, environ: Mapping[str, str]) -> Any:
    if isinstance(value, Mapping):
        return {k: _interpolate(v, f"{path}.{k}" if path else str(k), environ) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_interpolate(v, f"{path}[{i}]", environ) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match.group(1):  # $${NAME}: a literal ${NAME}
            return match.group(0)[1:]
        name, offset, default = match.group(2), match.group(3), match.group(4)
        found = environ.get(name)
        if default is not None and not found:  # like the shell's ${NAME:-default}: unset or empty takes it
            return default
        if found is None:
            reference = f"{name}+{offset}" if offset is not None else name
            raise ConfigError(
                path or "configuration",
                f"environment variable {name} is not set (referenced as ${{{reference}}}; write "
                f"${{{reference}:-default}} to give a default)",
            )
        if offset is None:
            return found
        try:
            return str(int(found.strip()) + int(offset))
        except ValueError:  # the value is not shown: the variable might hold anything
            raise ConfigError(path or "configuration", f"environment variable {name} must be a whole number "
                              f"(referenced as ${{{name}+{offset}}}, which adds {offset} to it)") from None

    return _ENV_REFERENCE.sub(substitute, value)


def is_literal_secret(name: str, value: Any) -> bool:
    """Whether option ``name`` holds a secret written out, rather than as a ``${VAR}`` reference (a connection
    string counts only when it carries a SharedAccessKey or SharedAccessSignature)."""
    if value is None or value == "" or not is_secret_name(name) or _PURE_REFERENCE.match(str(value).strip()):
        return False
    if _normal(name) != "connectionstring":
        return True
    segments = (segment.partition("=") for segment in str(value).split(";"))
    return any(key.strip().lower() in _SECRET_CS_KEYS and text.strip() and not _PURE_REFERENCE.match(text.strip())
               for key, _, text in segments)


def _literal_secret(value: Any, path: str = "") -> str | None:
    """The option path of the first literal secret in a raw configuration mapping, or None."""
    items = value.items() if isinstance(value, Mapping) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        option = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
        found = (_literal_secret(item, option) if isinstance(item, Mapping | list)
                 else option if is_literal_secret(str(key), item) else None)
        if found:
            return found
    return None


def _json_default(value: Any) -> Any:
    if isinstance(value, timedelta):
        return duration_text(value)
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(type(value).__name__)


def _from_mapping(raw: Mapping[Any, Any], origin: str | None = None) -> SparkSbConfig:
    try:
        config = SparkSbConfig.model_validate(_interpolate(raw, "", os.environ))
    except ValidationError as err:
        raise _config_error(err) from None
    config._origin_path = origin
    try:
        text = json.dumps(raw, default=_json_default)
    except (TypeError, ValueError):
        text = None
    config._reference = None if text is None or _literal_secret(json.loads(text)) else text
    _LOGGER.debug("configuration loaded: %r", config)
    return config


def load_config(source: str | os.PathLike[str] | Mapping[str, Any] | SparkSbConfig) -> SparkSbConfig:
    """Parse a YAML file (path) or a dict into a validated :class:`SparkSbConfig`."""
    if isinstance(source, SparkSbConfig):
        return source
    if isinstance(source, Mapping):
        return _from_mapping(source)
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(str(path), f"cannot read the configuration file ({err.strerror or err})") from err
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or "syntax error"
        raise ConfigError(str(path), f"not valid YAML{where}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(str(path), "must contain a mapping of options at the top level", type(data).__name__)
    return _from_mapping(data, origin=os.path.abspath(path))


def load_reference(value: str | Mapping[str, Any]) -> SparkSbConfig:
    """Rebuild a configuration from :meth:`SparkSbConfig.reference` (a mapping or its JSON text) where it
    runs: its ``${ENV_VAR}`` references are resolved here, then it is validated as :func:`load_config` does.
    A literal secret is refused (naming the option, never showing the secret)."""
    option = "configuration reference"
    if isinstance(value, str | bytes):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ConfigError(option, f"not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})") from None
    if not isinstance(value, Mapping):
        raise ConfigError(option, "must be a mapping of options", type(value).__name__)
    found = _literal_secret(value)
    if found:
        raise ConfigError(found, "must be a ${ENV_VAR} reference when the configuration is passed to Spark by value",
                          _REDACTED)
    return _from_mapping(value)


# --- Spark options ---------------------------------------------------------------------------------------

_OPTION_SECTIONS = {name: list(_fields_of(_model_in(f.annotation))) for name, f in SparkSbConfig.model_fields.items()}


def option_section(key: str) -> str | None:
    """The configuration section a flat Spark option belongs to (``sink`` for ``sink.keyColumn``), or None for a
    key that is no configuration option (:func:`from_options` leaves those to the caller)."""
    parts = str(key).split(".")
    section = _canonical(parts[0], _OPTION_SECTIONS)
    return section if section in _OPTION_SECTIONS and len(parts) >= 2 else None


def did_you_mean(name: str, allowed: Any) -> str:
    """`` (did you mean X?)`` for the closest of ``allowed`` (case, ``_`` and ``-`` aside), or ``""``."""
    return _did_you_mean(name, allowed)


def from_options(options: Mapping[str, str]) -> SparkSbConfig:
    """Build the configuration from Spark-style flat options.

    Keys are case-insensitive, dotted, camelCase or snake_case: ``primary.connectionString``,
    ``secondary.fullyQualifiedNamespace``, ``primary.credential.clientSecret``,
    ``sendAvailability.failoverInterval``, ``syphon.receiveBatch``, ``sink.keyColumn``, ``sink.columns.sessionId``,
    ``sink.source.rowsPerSecond``.
    Keys outside these sections are ignored (they belong to the caller); empty values count as unset.
    Errors name the option as it was written.
    """
    nested: dict[str, Any] = {}
    written: dict[str, str] = {}
    children = {"credential": list(_fields_of(CredentialConfig)), "http_proxy": list(_fields_of(ProxyConfig)),
                "columns": SINK_FIELDS,
                "source": list(_fields_of(SinkSourceConfig))}
    for key, value in options.items():
        parts = str(key).split(".")
        section = _canonical(parts[0], _OPTION_SECTIONS)
        if section not in _OPTION_SECTIONS or len(parts) < 2:
            continue
        if value is None or (isinstance(value, str) and not value.strip()):
            continue
        target = nested.setdefault(section, {})
        names = [_canonical(parts[1], _OPTION_SECTIONS[section])]
        if names[0] in children and len(parts) > 2:
            names.append(_canonical(parts[2], children[names[0]]))
            names.extend(parts[3:])
        else:
            names.extend(parts[2:])
        for name in names[:-1]:
            child = target.setdefault(name, {})
            if not isinstance(child, dict):
                raise ConfigError(str(key), "conflicts with another option", repr(value))
            target = child
        target[names[-1]] = value
        written[".".join([section, *names])] = str(key)
    try:
        return _from_mapping(nested)
    except ConfigError as err:
        if err.option in written:
            raise err.with_option(written[err.option]) from None
        raise
