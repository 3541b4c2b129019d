"""The spark-sb configuration: one typed, frozen, validated object, parsed once.

Built by :func:`load_config` from a YAML file or a dict, or by :func:`from_options` from Spark's flat,
case-insensitive string options. Shape (defaults shown)::

    primary:   {connection_string: "${SB_PRIMARY}"}        # or fully_qualified_namespace + credential
    secondary: {connection_string: "${SB_SECONDARY}"}
    send_availability:
      backlog_queue_count: 10
      failover_interval: 60s          # durations: 500ms / 60s / 5m / 1h / 1h30m, ISO 8601 (PT1M); numbers are seconds
      ping_primary_interval: 60s
      server_busy_backoff: 10s
      backlog_prefix: null            # default: derived from the primary host, see default_backlog_prefix()
      backlog_cooldown: 30s
      provision_retries: 3
      provision_retry_spacing: 1s
      primary_retry_total: 0
      primary_retry_backoff: 800ms
      primary_retry_backoff_max: 5s
      primary_try_timeout: 5s
    syphon: {retry_interval: 1s, receive_batch: 100}
    sink:                             # the Spark sink (spark_sb.sink) and its writer job (jobs/paired_writer.py)
      entity: null                    # default entity when the rows carry none
      columns: {}                     # message field -> column name; default: the field names
      key_column: null                # message ids from this column; default: derived (batch id + row content)
      chunk_size: 500                 # messages per send
      reject_table: null              # Delta path: rejected rows go there instead of failing the batch
      metrics_table: null             # Delta path: one row per batch summary
      checkpoint_location: null       # writer job only
      source: {format: rate, rows_per_second: 10}   # or {table: name} or {path: ..., format: ...}
      trigger: null                   # processing-time trigger, e.g. 2s; null: as fast as possible
      max_batches: null               # writer job: stop after this many batches

Strings may use ``${ENV_VAR}`` or ``${ENV_VAR:-default}`` (``$${`` is a literal ``${``); an unset variable
without a default is an error naming the variable and the option.

Credentials are either a ``connection_string`` (Endpoint, SharedAccessKeyName + SharedAccessKey or
SharedAccessSignature, optional EntityPath and UseDevelopmentEmulator), or a ``fully_qualified_namespace``
plus ``credential: {type: default|client_secret|managed_identity, tenant_id, client_id, client_secret}``
(``DefaultAzureCredential`` when omitted). azure.identity is imported only when a credential is built.

Every error is a :class:`~spark_sb.errors.ConfigError` naming the option path and the bad value; secrets
never appear in an error, a log line, ``repr()`` or ``str()``.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import ipaddress
import json
import logging
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import yaml

from .errors import ConfigError

if TYPE_CHECKING:
    from azure.core.credentials import AzureNamedKeyCredential, AzureSasCredential, TokenCredential
    from azure.servicebus import ServiceBusClient

_LOGGER = logging.getLogger(__name__)

__all__ = [
    "ConnectionString",
    "CredentialConfig",
    "FrozenMap",
    "NamespaceConfig",
    "SendAvailabilityConfig",
    "SinkConfig",
    "SinkSourceConfig",
    "SparkSbConfig",
    "SyphonConfig",
    "default_backlog_prefix",
    "format_duration",
    "from_options",
    "load_config",
    "parse_duration",
    "redact_connection_string",
]

BACKLOG_QUEUE_SEGMENT = "x-servicebus-transfer"
_MAX_ENTITY_PATH = 260
#: upper bounds: each backlog queue is an entity to create, ping and syphon; a receive batch is held in memory
#: and its sequence numbers are written into a Spark offset
MAX_BACKLOG_QUEUES = 100
MAX_RECEIVE_BATCH = 10_000
_REDACTED = "***"


# --- durations -------------------------------------------------------------------------------------------

_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_PART = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|sec|min|s|m|h|d)", re.IGNORECASE)
_ISO_DURATION = re.compile(
    r"^P(?:(?P<d>\d+(?:\.\d+)?)D)?"
    r"(?:T(?:(?P<h>\d+(?:\.\d+)?)H)?(?:(?P<m>\d+(?:\.\d+)?)M)?(?:(?P<s>\d+(?:\.\d+)?)S)?)?$",
    re.IGNORECASE,
)
_NUMBER = re.compile(r"^[+-]?\d+(?:\.\d+)?$")
_DURATION_HELP = "not a duration (write 500ms, 60s, 5m, 1h, 1h30m, a number of seconds, or ISO 8601 such as PT1M)"


def parse_duration(value: object, option: str) -> timedelta:
    """Parse ``500ms``, ``60s``, ``5m``, ``1h30m``, ``PT1M``, a number of seconds, or a timedelta."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool):
        raise ConfigError(option, _DURATION_HELP, repr(value))
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise ConfigError(option, _DURATION_HELP, repr(value))
        return timedelta(seconds=value)
    if not isinstance(value, str):
        raise ConfigError(option, _DURATION_HELP, repr(value))
    text = value.strip()
    if _NUMBER.match(text):
        return timedelta(seconds=float(text))
    iso = _ISO_DURATION.match(text)
    if iso and text.upper() not in ("P", "PT") and any(iso.groupdict().values()):
        parts = {k: float(v) for k, v in iso.groupdict().items() if v}
        return timedelta(
            days=parts.get("d", 0.0), hours=parts.get("h", 0.0), minutes=parts.get("m", 0.0), seconds=parts.get("s", 0.0)
        )
    total = 0.0
    position = 0
    for match in _DURATION_PART.finditer(text):
        if match.start() != position:
            break
        total += float(match.group(1)) * _UNIT_SECONDS[match.group(2).lower()]
        position = match.end()
    if position == 0 or text[position:].strip():
        raise ConfigError(option, _DURATION_HELP, repr(value))
    return timedelta(seconds=total)


def format_duration(value: timedelta) -> str:
    """``timedelta`` as people write it in errors: ``2 h``, ``60 min``, ``90 s``, ``1.5 s``, ``500 ms``."""
    micros = round(value / timedelta(microseconds=1))
    if micros == 0:
        return "0 s"
    sign = "-" if micros < 0 else ""
    micros = abs(micros)
    if micros % 3_600_000_000 == 0 and micros >= 7_200_000_000:  # 60 min stays "60 min", 2 h is "2 h"
        return f"{sign}{micros // 3_600_000_000} h"
    for unit, size in (("min", 60_000_000), ("s", 1_000_000)):
        if micros % size == 0:
            return f"{sign}{micros // size} {unit}"
    if micros >= 1_000_000:
        return f"{sign}{micros / 1_000_000:g} s"
    return f"{sign}{micros / 1000:g} ms"


def _duration_text(value: timedelta) -> str:
    """A duration as a config value that parses back exactly (``1m``, ``800ms``)."""
    micros = round(value / timedelta(microseconds=1))
    for unit, size in (("h", 3_600_000_000), ("m", 60_000_000), ("s", 1_000_000), ("ms", 1_000)):
        if micros % size == 0:
            return f"{micros // size}{unit}"
    return f"{micros / 1_000_000}"


def _check_duration(option: str, value: timedelta, low: timedelta, high: timedelta | None) -> None:
    if not isinstance(value, timedelta):
        raise ConfigError(option, "must be a duration", repr(value))
    if high is None:
        if value < low:
            raise ConfigError(option, f"must be at least {format_duration(low)}", format_duration(value))
    elif not low <= value <= high:
        raise ConfigError(
            option, f"must be between {format_duration(low)} and {format_duration(high)}", format_duration(value)
        )


def _parse_int(value: object, option: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(option, "must be a whole number", repr(value))
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        return int(value)
    raise ConfigError(option, "must be a whole number", repr(value))


def _check_int(option: str, value: int, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(option, "must be a whole number", repr(value))
    if high is None:
        if value < low:
            raise ConfigError(option, f"must be at least {low}", value)
    elif not low <= value <= high:
        raise ConfigError(option, f"must be between {low} and {high}", value)


# --- connection strings ----------------------------------------------------------------------------------

_SECRET_CS_KEYS = {"sharedaccesskey": "SharedAccessKey", "sharedaccesssignature": "SharedAccessSignature"}
_PLAIN_CS_KEYS = {
    "endpoint": "Endpoint",
    "sharedaccesskeyname": "SharedAccessKeyName",
    "entitypath": "EntityPath",
    "usedevelopmentemulator": "UseDevelopmentEmulator",
}


def redact_connection_string(text: str) -> str:
    """The connection string with every secret replaced by ``***``; safe to print even when malformed
    (a segment that is not a known non-secret ``Key=Value`` is shown as ``***`` as a whole)."""
    shown = []
    for segment in text.strip().rstrip(";").split(";"):
        key, sep, value = segment.partition("=")
        lowered = key.strip().lower()
        if sep and lowered in _PLAIN_CS_KEYS:
            shown.append(f"{key.strip()}={value}")
        elif sep and lowered in _SECRET_CS_KEYS:
            shown.append(f"{key.strip()}={_REDACTED}")
        elif segment.strip():
            shown.append(_REDACTED)
    return ";".join(shown)


@dataclass(frozen=True, repr=False)
class ConnectionString:
    """A parsed Service Bus connection string. ``repr``/``str`` show it redacted; :meth:`reveal` gives the
    full string for the SDK only."""

    endpoint: str
    host: str
    port: int | None = None
    shared_access_key_name: str | None = None
    shared_access_key: str | None = None
    shared_access_signature: str | None = None
    entity_path: str | None = None
    use_development_emulator: bool = False

    @classmethod
    def parse(cls, text: object, option: str) -> ConnectionString:
        if not isinstance(text, str) or not text.strip():
            shown = "an empty string" if isinstance(text, str) else type(text).__name__
            raise ConfigError(option, "must be a Service Bus connection string", shown)
        redacted = redact_connection_string(text)
        settings: dict[str, str] = {}
        for segment in text.strip().rstrip(";").split(";"):
            key, sep, value = segment.partition("=")
            if not sep or not key.strip():
                raise ConfigError(option, "malformed: expected Key=Value pairs separated by ';'", redacted)
            settings[key.strip().lower()] = value.strip()
        endpoint = settings.get("endpoint")
        if not endpoint:
            raise ConfigError(option, "missing Endpoint", redacted)
        try:
            parsed = urlparse(endpoint)
            port = parsed.port
        except ValueError as err:
            raise ConfigError(option, f"Endpoint is not a valid address ({err})", redacted) from err
        if not parsed.netloc or not parsed.hostname:
            raise ConfigError(option, "Endpoint must look like sb://<namespace>.servicebus.windows.net/", redacted)
        name = settings.get("sharedaccesskeyname") or None
        access_key = settings.get("sharedaccesskey") or None
        signature = settings.get("sharedaccesssignature") or None
        if bool(name) != bool(access_key):
            raise ConfigError(option, "SharedAccessKeyName and SharedAccessKey must be given together", redacted)
        if access_key and signature:
            raise ConfigError(option, "give either SharedAccessKey or SharedAccessSignature, not both", redacted)
        if not access_key and not signature:
            raise ConfigError(option, "missing SharedAccessKey (with SharedAccessKeyName) or SharedAccessSignature", redacted)
        emulator_text = settings.get("usedevelopmentemulator", "false").lower()
        if emulator_text not in ("true", "false"):
            raise ConfigError(option, "UseDevelopmentEmulator must be true or false", redacted)
        return cls(
            endpoint=endpoint,
            host=parsed.hostname.lower(),
            port=port,
            shared_access_key_name=name,
            shared_access_key=access_key,
            shared_access_signature=signature,
            entity_path=settings.get("entitypath") or None,
            use_development_emulator=emulator_text == "true",
        )

    def _segments(self, reveal: bool) -> list[str]:
        parts = [f"Endpoint={self.endpoint}"]
        if self.shared_access_key_name:
            parts.append(f"SharedAccessKeyName={self.shared_access_key_name}")
        if self.shared_access_key:
            parts.append(f"SharedAccessKey={self.shared_access_key if reveal else _REDACTED}")
        if self.shared_access_signature:
            parts.append(f"SharedAccessSignature={self.shared_access_signature if reveal else _REDACTED}")
        if self.entity_path:
            parts.append(f"EntityPath={self.entity_path}")
        if self.use_development_emulator:
            parts.append("UseDevelopmentEmulator=true")
        return parts

    def redacted(self) -> str:
        return ";".join(self._segments(reveal=False))

    def reveal(self) -> str:
        """The canonical connection string WITH its secret, for ``ServiceBusClient.from_connection_string``."""
        return ";".join(self._segments(reveal=True))

    def __repr__(self) -> str:
        return f"ConnectionString({self.redacted()!r})"

    def __str__(self) -> str:
        return self.redacted()


# --- credentials -----------------------------------------------------------------------------------------

CREDENTIAL_TYPES = ("default", "client_secret", "managed_identity")


@dataclass(frozen=True, repr=False)
class CredentialConfig:
    """How to build an azure.identity credential for a ``fully_qualified_namespace``.

    * ``default``: ``DefaultAzureCredential`` (``client_id`` selects a user-assigned managed identity);
    * ``client_secret``: ``ClientSecretCredential(tenant_id, client_id, client_secret)``, all three required;
    * ``managed_identity``: ``ManagedIdentityCredential`` (``client_id`` for a user-assigned identity).
    """

    type: str = "default"
    tenant_id: str | None = None
    client_id: str | None = None
    client_secret: str | None = None

    def __post_init__(self) -> None:
        self.validate("credential")

    def validate(self, option: str) -> None:
        if self.type not in CREDENTIAL_TYPES:
            raise ConfigError(f"{option}.type", _one_of(CREDENTIAL_TYPES, self.type), repr(self.type))
        if self.type == "client_secret":
            for name in ("tenant_id", "client_id", "client_secret"):
                if not getattr(self, name):
                    raise ConfigError(f"{option}.{name}", "required when type is client_secret")
        else:
            if self.client_secret is not None:
                raise ConfigError(f"{option}.client_secret", "only used with type client_secret", _REDACTED)
            if self.tenant_id is not None:
                raise ConfigError(f"{option}.tenant_id", "only used with type client_secret", repr(self.tenant_id))

    def build(self) -> TokenCredential:
        """A new credential object (each call builds one; keep it for the client's life)."""
        import azure.identity as identity  # imported only when a credential is needed

        if self.type == "client_secret":
            return identity.ClientSecretCredential(
                str(self.tenant_id), str(self.client_id), str(self.client_secret)
            )
        if self.type == "managed_identity":
            if self.client_id:
                return identity.ManagedIdentityCredential(client_id=self.client_id)
            return identity.ManagedIdentityCredential()
        if self.client_id:
            return identity.DefaultAzureCredential(managed_identity_client_id=self.client_id)
        return identity.DefaultAzureCredential()

    def __repr__(self) -> str:
        secret = _REDACTED if self.client_secret else None
        return (
            f"CredentialConfig(type={self.type!r}, tenant_id={self.tenant_id!r}, client_id={self.client_id!r}, "
            f"client_secret={secret!r})"
        )


# --- namespaces ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NamespaceConfig:
    """One Service Bus namespace: a connection string, or a fully qualified namespace plus a credential.

    ``fully_qualified_namespace`` is the host as the SDK wants it (``contoso.servicebus.windows.net``; for a
    development emulator endpoint the port is kept: ``localhost:5672``).
    """

    fully_qualified_namespace: str
    connection_string: ConnectionString | None = None
    credential_config: CredentialConfig | None = None
    #: the emulator's admin REST endpoint (``http://host:port``) for provisioning; only with an emulator
    #: connection string (``UseDevelopmentEmulator=true``). ``None``: ``http://<Endpoint host>:5300``.
    admin_endpoint: str | None = None

    @property
    def host(self) -> str:
        return _split_host_port(self.fully_qualified_namespace)[0]

    @property
    def port(self) -> int | None:
        return _split_host_port(self.fully_qualified_namespace)[1]

    @property
    def is_emulator(self) -> bool:
        return bool(self.connection_string and self.connection_string.use_development_emulator)

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

        if self.connection_string is not None:
            return ServiceBusClient.from_connection_string(self.connection_string.reveal(), **sdk_kwargs)
        return ServiceBusClient(self.fully_qualified_namespace, self.credential(), **sdk_kwargs)  # type: ignore[arg-type]


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
    host = namespace.host.lower()
    port = namespace.port
    if _is_ip(host):
        label = re.sub(r"[^0-9a-z]+", "-", host).strip("-")
        local = True
    else:
        label = host.split(".", 1)[0]
        local = "." not in host
    if port is not None and (namespace.is_emulator or local):
        label = f"{label}-{port}"
    return label


# --- send availability and syphon ------------------------------------------------------------------------

_PREFIX_SEGMENT = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_PREFIX = re.compile(rf"^{_PREFIX_SEGMENT}(?:/{_PREFIX_SEGMENT})*$")


@dataclass(frozen=True)
class SendAvailabilityConfig:
    """The paired sender's options (behaviour.md "Defaults").

    The ``primary_*`` options configure the SDK clients of the primary namespace so that the failover
    interval, not the SDK's own retry policy, decides when failover happens: by default the SDK does not
    retry (``primary_retry_total`` 0; the sender's own loop retries within the interval) and bounds every
    attempt (``primary_try_timeout`` 5 s). The secondary's clients keep the SDK defaults.
    """

    backlog_prefix: str
    backlog_queue_count: int = 10
    failover_interval: timedelta = timedelta(seconds=60)
    ping_primary_interval: timedelta = timedelta(seconds=60)
    server_busy_backoff: timedelta = timedelta(seconds=10)
    #: how long a backlog queue whose send failed stays out of the rotation for every sender in the process
    backlog_cooldown: timedelta = timedelta(seconds=30)
    #: how many times each backlog queue creation is tried (1 = no retry); behaviour.md: up to 3 times
    provision_retries: int = 3
    provision_retry_spacing: timedelta = timedelta(seconds=1)
    #: SDK ``retry_total`` of the primary's clients
    primary_retry_total: int = 0
    #: SDK ``retry_backoff_factor`` of the primary's clients
    primary_retry_backoff: timedelta = timedelta(milliseconds=800)
    #: SDK ``retry_backoff_max`` of the primary's clients
    primary_retry_backoff_max: timedelta = timedelta(seconds=5)
    #: SDK ``try_timeout`` of the primary's clients: bounds one attempt (link open plus send)
    primary_try_timeout: timedelta = timedelta(seconds=5)

    SECTION = "send_availability"

    def __post_init__(self) -> None:
        s = self.SECTION
        _check_int(f"{s}.backlog_queue_count", self.backlog_queue_count, 1, MAX_BACKLOG_QUEUES)
        _check_duration(f"{s}.failover_interval", self.failover_interval, timedelta(0), timedelta(minutes=60))
        _check_duration(
            f"{s}.ping_primary_interval", self.ping_primary_interval, timedelta(seconds=1), timedelta(minutes=30)
        )
        _check_duration(f"{s}.server_busy_backoff", self.server_busy_backoff, timedelta(seconds=10), None)
        _check_duration(f"{s}.backlog_cooldown", self.backlog_cooldown, timedelta(0), timedelta(minutes=60))
        _check_int(f"{s}.provision_retries", self.provision_retries, 1, 10)
        _check_duration(
            f"{s}.provision_retry_spacing", self.provision_retry_spacing, timedelta(0), timedelta(minutes=5)
        )
        _check_int(f"{s}.primary_retry_total", self.primary_retry_total, 0, 10)
        _check_duration(
            f"{s}.primary_retry_backoff", self.primary_retry_backoff, timedelta(0), timedelta(seconds=60)
        )
        _check_duration(
            f"{s}.primary_retry_backoff_max",
            self.primary_retry_backoff_max,
            self.primary_retry_backoff,
            timedelta(minutes=10),
        )
        _check_duration(
            f"{s}.primary_try_timeout", self.primary_try_timeout, timedelta(milliseconds=100), timedelta(minutes=5)
        )
        if not isinstance(self.backlog_prefix, str) or not _PREFIX.match(self.backlog_prefix):
            raise ConfigError(
                f"{s}.backlog_prefix",
                "must be letters, digits, '.', '-' or '_' (segments separated by '/'), starting and ending "
                "with a letter or digit",
                repr(self.backlog_prefix),
            )
        longest = len(self.backlog_queue_name(self.backlog_queue_count - 1))
        if longest > _MAX_ENTITY_PATH:
            raise ConfigError(
                f"{s}.backlog_prefix",
                f"too long: backlog queue paths would be {longest} characters, the limit is {_MAX_ENTITY_PATH}",
                repr(self.backlog_prefix),
            )

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


@dataclass(frozen=True)
class SyphonConfig:
    retry_interval: timedelta = timedelta(seconds=1)
    receive_batch: int = 100
    #: the syphon job's Spark checkpoint (required by jobs/syphon.py)
    checkpoint_location: str | None = None
    #: the syphon job's Delta ledger: a path (contains ``/`` or ``:``) or a table name (required by the job)
    ledger: str | None = None

    SECTION = "syphon"

    def __post_init__(self) -> None:
        _check_duration(
            f"{self.SECTION}.retry_interval", self.retry_interval, timedelta(seconds=1), timedelta(minutes=2)
        )
        _check_int(f"{self.SECTION}.receive_batch", self.receive_batch, 1, MAX_RECEIVE_BATCH)
        for name in ("checkpoint_location", "ledger"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(f"{self.SECTION}.{name}", "must be a non-empty string", repr(value))
        if self.ledger is not None and not _is_ledger_location(self.ledger):
            raise ConfigError(
                f"{self.SECTION}.ledger",
                "must be a path (with '/' or a scheme) or a table name ([catalog.][schema.]table)",
                repr(self.ledger),
            )

    @property
    def ledger_is_path(self) -> bool:
        return self.ledger is not None and ("/" in self.ledger or ":" in self.ledger)

    def require_job_locations(self) -> None:
        """The syphon job needs both a checkpoint and a ledger; a clear error naming the missing one."""
        for name in ("checkpoint_location", "ledger"):
            if getattr(self, name) is None:
                raise ConfigError(f"{self.SECTION}.{name}", "is required by the syphon job (not set)")


_TABLE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*){0,2}$|^`[^`]+`$")


def _is_ledger_location(value: str) -> bool:
    return "/" in value or ":" in value or bool(_TABLE_NAME.match(value))


# --- the sink's reserved section -------------------------------------------------------------------------

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


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return FrozenMap(value)
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, FrozenMap):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


class FrozenMap(Mapping[str, Any]):
    """A read-only, hashable, picklable mapping (nested mappings and lists are frozen too). Its repr hides
    the values of secret-looking keys."""

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
        if isinstance(other, Mapping):
            return dict(self.items()) == dict(other.items())
        return NotImplemented

    def __getstate__(self) -> dict[str, Any]:
        return {"_data": self._data}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._data = state["_data"]

    def __repr__(self) -> str:
        shown = {k: (_REDACTED if is_secret_name(k) else v) for k, v in self._data.items()}
        return f"FrozenMap({shown!r})"

    def to_dict(self) -> dict[str, Any]:
        return _thaw(self)


def _redacted_tree(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: (_REDACTED if is_secret_name(k) else _redacted_tree(v)) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_redacted_tree(v) for v in value]
    return value


# --- the Spark sink --------------------------------------------------------------------------------------

#: the message fields a row can fill, in the order of spark.md ("Input columns"); each one's default column
#: has the field's name
SINK_FIELDS = (
    "body",
    "message_id",
    "entity",
    "session_id",
    "partition_key",
    "subject",
    "content_type",
    "correlation_id",
    "to",
    "reply_to",
    "time_to_live",
    "scheduled_enqueue_time",
    "application_properties",
)
SOURCE_FORMATS_NEED_PATH = ("parquet", "json", "csv", "orc", "text", "delta")
_SOURCE_KEYS = ["format", "rows_per_second", "num_partitions", "table", "path", "options"]
_MAX_CHUNK = 100_000


@dataclass(frozen=True)
class SinkSourceConfig:
    """Where the writer job (``jobs/paired_writer.py``) reads its rows: the ``rate`` source (the default, for
    the demo), a table (``table``), or files or a Delta table at ``path`` in ``format``. ``options`` go to the
    reader as given."""

    format: str = "rate"
    rows_per_second: int = 10
    num_partitions: int | None = None
    table: str | None = None
    path: str | None = None
    options: FrozenMap = field(default_factory=FrozenMap)

    def __post_init__(self) -> None:
        option = "sink.source"
        if not isinstance(self.options, FrozenMap):
            object.__setattr__(self, "options", FrozenMap(self.options))
        _check_int(f"{option}.rows_per_second", self.rows_per_second, 1)
        if self.num_partitions is not None:
            _check_int(f"{option}.num_partitions", self.num_partitions, 1)
        if self.table is not None and self.path is not None:
            raise ConfigError(option, "give either table or path, not both", repr({"table": self.table, "path": self.path}))
        if self.table is None and self.format == "rate" and self.path is not None:
            raise ConfigError(f"{option}.format", "a path needs a file format such as delta or parquet", "'rate'")
        if self.table is None and self.path is None and self.format != "rate":
            raise ConfigError(option, f"format {self.format} needs a path (or give a table)",
                              repr({"format": self.format}))

    @property
    def kind(self) -> str:
        """``rate``, ``table`` or ``path``."""
        return "table" if self.table is not None else "path" if self.path is not None else "rate"

    def to_dict(self) -> dict[str, Any]:
        if self.table is not None:
            out: dict[str, Any] = {"table": self.table}
        elif self.path is not None:
            out = {"format": self.format, "path": self.path}
        else:
            out = {"format": "rate", "rows_per_second": self.rows_per_second}
            if self.num_partitions is not None:
                out["num_partitions"] = self.num_partitions
        if self.options:
            out["options"] = self.options.to_dict()
        return out


@dataclass(frozen=True)
class SinkConfig:
    """The Spark sink's options (``sink:`` section); see :mod:`spark_sb.sink`.

    ``columns`` holds only the fields mapped to a column of another name; :attr:`column_map` is the full
    mapping (a field's default column is its own name).
    """

    entity: str | None = None
    columns: FrozenMap = field(default_factory=FrozenMap)
    key_column: str | None = None
    chunk_size: int = 500
    reject_table: str | None = None
    metrics_table: str | None = None
    checkpoint_location: str | None = None
    source: SinkSourceConfig = field(default_factory=SinkSourceConfig)
    trigger: timedelta | None = None
    max_batches: int | None = None

    SECTION = "sink"

    def __post_init__(self) -> None:
        s = self.SECTION
        if not isinstance(self.columns, FrozenMap):
            object.__setattr__(self, "columns", FrozenMap(self.columns))
        for name, column in self.columns.items():
            if name not in SINK_FIELDS:
                raise ConfigError(f"{s}.columns.{name}", "unknown message field" + _did_you_mean(name, SINK_FIELDS)
                                  + f" (fields: {', '.join(SINK_FIELDS)})")
            if not isinstance(column, str) or not column.strip():
                raise ConfigError(f"{s}.columns.{name}", "must be a column name", repr(column))
        for name in ("entity", "key_column", "reject_table", "metrics_table", "checkpoint_location"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(f"{s}.{name}", "must be a non-empty string", repr(value))
        if self.entity is not None and len(self.entity) > _MAX_ENTITY_PATH:
            raise ConfigError(f"{s}.entity", f"longer than {_MAX_ENTITY_PATH} characters", repr(self.entity))
        if self.key_column is not None and "message_id" in self.columns:
            raise ConfigError(f"{s}.key_column", "give either key_column or columns.message_id, not both",
                              repr(self.key_column))
        _check_int(f"{s}.chunk_size", self.chunk_size, 1, _MAX_CHUNK)
        if self.trigger is not None:
            _check_duration(f"{s}.trigger", self.trigger, timedelta(milliseconds=1), timedelta(days=1))
        if self.max_batches is not None:
            _check_int(f"{s}.max_batches", self.max_batches, 1)
        if self.reject_table is not None and self.reject_table == self.metrics_table:
            raise ConfigError(f"{s}.metrics_table", "must differ from reject_table", repr(self.metrics_table))

    @property
    def column_map(self) -> dict[str, str]:
        """``{message field: column name}`` for every field (the message id's column is ``key_column``
        when given)."""
        mapping = {name: str(self.columns.get(name, name)) for name in SINK_FIELDS}
        if self.key_column is not None:
            mapping["message_id"] = self.key_column
        return mapping

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "columns":
                out[f.name] = value.to_dict()
            elif f.name == "source":
                out[f.name] = value.to_dict()
            elif isinstance(value, timedelta):
                out[f.name] = _duration_text(value)
            else:
                out[f.name] = value
        return out


def _did_you_mean(name: str, allowed: tuple[str, ...] | list[str]) -> str:
    suggestion = _suggest(name, list(allowed))
    return f" (did you mean {suggestion}?)" if suggestion else ""


def _parse_sink(data: Mapping[str, Any], path: str) -> SinkConfig:
    names = [f.name for f in dataclasses.fields(SinkConfig)]
    _check_keys(data, names, path)
    kwargs: dict[str, Any] = {}
    for name in ("entity", "key_column", "reject_table", "metrics_table", "checkpoint_location"):
        if data.get(name) is not None:
            kwargs[name] = _optional_str(data[name], f"{path}.{name}")
    for name in ("chunk_size", "max_batches"):
        if data.get(name) is not None:
            kwargs[name] = _parse_int(data[name], f"{path}.{name}")
    if data.get("trigger") is not None:
        kwargs["trigger"] = parse_duration(data["trigger"], f"{path}.trigger")
    raw_columns = data.get("columns")
    if raw_columns is not None:
        if not isinstance(raw_columns, Mapping):
            raise ConfigError(f"{path}.columns", "must be a mapping of message field to column name",
                              type(raw_columns).__name__)
        columns: dict[str, Any] = {}
        for key, column in raw_columns.items():
            canonical = _canonical(str(key), list(SINK_FIELDS))
            if canonical not in SINK_FIELDS:
                raise ConfigError(f"{path}.columns.{key}", "unknown message field"
                                  + _did_you_mean(str(key), SINK_FIELDS) + f" (fields: {', '.join(SINK_FIELDS)})")
            columns[canonical] = column
        kwargs["columns"] = FrozenMap(columns)
    raw_source = data.get("source")
    if raw_source is not None:
        kwargs["source"] = _parse_sink_source(raw_source, f"{path}.source")
    return _build(SinkConfig, path, **kwargs)


def _parse_sink_source(raw: Any, path: str) -> SinkSourceConfig:
    if isinstance(raw, SinkSourceConfig):
        return raw
    if not isinstance(raw, Mapping):
        raise ConfigError(path, "must be a mapping: {format: rate, rows_per_second: N}, {table: name} or "
                          "{path: ..., format: ...}", type(raw).__name__)
    _check_keys(raw, _SOURCE_KEYS, path)
    kwargs: dict[str, Any] = {}
    for name in ("table", "path"):
        if raw.get(name) is not None:
            kwargs[name] = _optional_str(raw[name], f"{path}.{name}")
    if raw.get("format") is not None:
        fmt = _optional_str(raw["format"], f"{path}.format")
        if not fmt or not re.fullmatch(r"[A-Za-z][A-Za-z0-9_.\-]*", fmt):
            raise ConfigError(f"{path}.format", "must be a source format name such as rate, delta or parquet",
                              repr(raw["format"]))
        kwargs["format"] = fmt.lower()
    elif raw.get("path") is not None:
        kwargs["format"] = "delta"
    for name in ("rows_per_second", "num_partitions"):
        if raw.get(name) is not None:
            kwargs[name] = _parse_int(raw[name], f"{path}.{name}")
    if raw.get("options") is not None:
        if not isinstance(raw["options"], Mapping):
            raise ConfigError(f"{path}.options", "must be a mapping of reader options", type(raw["options"]).__name__)
        kwargs["options"] = FrozenMap({str(k): str(v) for k, v in raw["options"].items()})
    try:
        return SinkSourceConfig(**kwargs)
    except ConfigError as err:
        if err.option.startswith("sink.source") and path != "sink.source":
            raise err.with_option(path + err.option[len("sink.source"):]) from None
        raise


# --- the whole configuration -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SparkSbConfig:
    """The whole spark-sb configuration. Build it with :func:`load_config` or :func:`from_options`."""

    primary: NamespaceConfig
    secondary: NamespaceConfig
    send_availability: SendAvailabilityConfig
    syphon: SyphonConfig = field(default_factory=SyphonConfig)
    sink: SinkConfig = field(default_factory=lambda: SinkConfig())

    def __post_init__(self) -> None:
        if _address_key(self.primary) == _address_key(self.secondary):
            raise ConfigError(
                "secondary",
                "must be a different namespace from the primary",
                self.secondary.fully_qualified_namespace,
            )
        if self.secondary.connection_string and self.secondary.connection_string.entity_path:
            raise ConfigError(
                "secondary.connection_string",
                "EntityPath is not allowed: the secondary holds the backlog queues, use a namespace-level "
                "connection string",
                self.secondary.connection_string.redacted(),
            )
        if isinstance(self.sink, Mapping):
            object.__setattr__(self, "sink", _parse_sink(self.sink, "sink"))
        elif not isinstance(self.sink, SinkConfig):
            raise ConfigError("sink", "must be a mapping of options", type(self.sink).__name__)

    def to_dict(self, *, secrets: bool = False) -> dict[str, Any]:
        """The configuration in the YAML shape; secrets as ``***`` unless ``secrets=True``, in which case
        ``load_config(config.to_dict(secrets=True)) == config``."""
        return _escape_references(
            {
                "primary": _namespace_dict(self.primary, secrets),
                "secondary": _namespace_dict(self.secondary, secrets),
                "send_availability": _section_dict(self.send_availability),
                "syphon": _section_dict(self.syphon),
                "sink": self.sink.to_dict() if secrets else _redacted_tree(self.sink.to_dict()),
            }
        )

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
    if isinstance(value, str):
        return value.replace("${", "$${")
    return value


def _address_key(namespace: NamespaceConfig) -> str:
    return namespace.fully_qualified_namespace.lower()


def _namespace_dict(namespace: NamespaceConfig, secrets: bool) -> dict[str, Any]:
    if namespace.connection_string is not None:
        cs = namespace.connection_string
        shown: dict[str, Any] = {"connection_string": cs.reveal() if secrets else cs.redacted()}
        if namespace.admin_endpoint is not None:
            shown["admin_endpoint"] = namespace.admin_endpoint
        return shown
    out: dict[str, Any] = {"fully_qualified_namespace": namespace.fully_qualified_namespace}
    if namespace.credential_config is not None:
        cred = namespace.credential_config
        out["credential"] = {
            k: v
            for k, v in (
                ("type", cred.type),
                ("tenant_id", cred.tenant_id),
                ("client_id", cred.client_id),
                ("client_secret", cred.client_secret if secrets or cred.client_secret is None else _REDACTED),
            )
            if v is not None
        }
    return out


def _section_dict(section: Any) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        out[f.name] = _duration_text(value) if isinstance(value, timedelta) else value
    return out


# --- loading ---------------------------------------------------------------------------------------------

_ENV_REFERENCE = re.compile(r"\$(\$?)\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


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
        name, default = match.group(2), match.group(3)
        found = environ.get(name)
        if default is not None:  # like the shell's ${NAME:-default}: unset or empty takes the default
            return found or default
        if found is not None:
            return found
        raise ConfigError(
            path or "configuration",
            f"environment variable {name} is not set (referenced as ${{{name}}}; write ${{{name}:-default}} "
            "to give a default)",
        )

    return _ENV_REFERENCE.sub(substitute, value)


def _one_of(allowed: tuple[str, ...] | list[str], value: object) -> str:
    text = f"must be one of {', '.join(allowed)}"
    if isinstance(value, str):
        close = difflib.get_close_matches(value, list(allowed), n=1, cutoff=0.6)
        if close:
            text += f" (did you mean {close[0]}?)"
    return text


def _normal(name: str) -> str:
    return re.sub(r"[_\-\s]", "", name).lower()


def _suggest(name: str, allowed: list[str]) -> str | None:
    for candidate in allowed:
        if _normal(candidate) == _normal(name):
            return candidate
    close = difflib.get_close_matches(name, allowed, n=1, cutoff=0.6)
    return close[0] if close else None


def _check_keys(data: Mapping[Any, Any], allowed: list[str], path: str) -> None:
    unknown = [str(k) for k in data if k not in allowed]
    if not unknown:
        return
    described = []
    for name in unknown:
        suggestion = _suggest(name, allowed)
        described.append(f"{name} (did you mean {suggestion}?)" if suggestion else name)
    if len(unknown) == 1:
        option = f"{path}.{unknown[0]}" if path else unknown[0]
        raise ConfigError(option, "unknown option" + described[0][len(unknown[0]) :])
    raise ConfigError(path or "configuration", f"unknown options {', '.join(described)}")


def _section(data: Mapping[str, Any], name: str, required: bool = False) -> Mapping[str, Any]:
    value = data.get(name)
    if value is None:
        if required:
            raise ConfigError(name, "required")
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(name, "must be a mapping of options", type(value).__name__)
    return value


_NAMESPACE_KEYS = ["connection_string", "fully_qualified_namespace", "credential", "admin_endpoint"]
_CREDENTIAL_KEYS = ["type", "tenant_id", "client_id", "client_secret"]


def _optional_str(value: Any, option: str, secret: bool = False) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str | int) or isinstance(value, bool):
        raise ConfigError(option, "must be a string", _REDACTED if secret else repr(value))
    return str(value)


def _parse_admin_endpoint(value: Any, option: str, cs: ConnectionString) -> str | None:
    """``http://host:port`` (scheme optional, ``http`` assumed), normalised; only for the emulator."""
    if value is None:
        return None
    if not cs.use_development_emulator:
        raise ConfigError(option, "only used with an emulator connection string (UseDevelopmentEmulator=true)",
                          repr(value))
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(option, "must look like http://host:port", repr(value))
    text = value.strip()
    parsed = urlparse(text if "://" in text else f"http://{text}")
    try:
        port = parsed.port
    except ValueError as err:
        raise ConfigError(option, "has an invalid port", repr(value)) from err
    if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.path.strip("/") or parsed.query:
        raise ConfigError(option, "must look like http://host:port", repr(value))
    del port  # validated above
    return f"{parsed.scheme}://{parsed.netloc}"


def _parse_namespace(data: Mapping[str, Any], path: str) -> NamespaceConfig:
    _check_keys(data, _NAMESPACE_KEYS, path)
    raw_cs = data.get("connection_string")
    raw_fqns = data.get("fully_qualified_namespace")
    if raw_cs is not None and raw_fqns is not None:
        raise ConfigError(path, "give either connection_string or fully_qualified_namespace (with credential), not both")
    if raw_cs is not None:
        if data.get("credential") is not None:
            raise ConfigError(f"{path}.credential", "only used with fully_qualified_namespace, not with connection_string")
        cs = ConnectionString.parse(raw_cs, f"{path}.connection_string")
        address = cs.host
        if cs.use_development_emulator and cs.port is not None:
            address = f"{cs.host}:{cs.port}"
        admin_endpoint = _parse_admin_endpoint(data.get("admin_endpoint"), f"{path}.admin_endpoint", cs)
        return NamespaceConfig(fully_qualified_namespace=address, connection_string=cs, admin_endpoint=admin_endpoint)
    if data.get("admin_endpoint") is not None:
        raise ConfigError(
            f"{path}.admin_endpoint",
            "only used with an emulator connection string (UseDevelopmentEmulator=true)",
            repr(data.get("admin_endpoint")),
        )
    if raw_fqns is None:
        raise ConfigError(path, "needs connection_string, or fully_qualified_namespace with an optional credential")
    if not isinstance(raw_fqns, str) or not raw_fqns.strip():
        raise ConfigError(f"{path}.fully_qualified_namespace", "must be a host name", repr(raw_fqns))
    text = raw_fqns.strip()
    parsed = urlparse(text if "//" in text else f"//{text}")
    try:
        port = parsed.port
    except ValueError as err:
        raise ConfigError(f"{path}.fully_qualified_namespace", "has an invalid port", repr(raw_fqns)) from err
    if not parsed.hostname or not re.fullmatch(r"[A-Za-z0-9.\-\[\]:]+", parsed.hostname):
        raise ConfigError(
            f"{path}.fully_qualified_namespace", "must look like <namespace>.servicebus.windows.net", repr(raw_fqns)
        )
    address = parsed.hostname.lower() + (f":{port}" if port is not None else "")
    raw_cred = data.get("credential")
    if raw_cred is None:
        credential = CredentialConfig()
    else:
        cred_path = f"{path}.credential"
        if not isinstance(raw_cred, Mapping):
            raise ConfigError(cred_path, "must be a mapping (type, tenant_id, client_id, client_secret)")
        _check_keys(raw_cred, _CREDENTIAL_KEYS, cred_path)
        cred_type = raw_cred.get("type", "default")
        if not isinstance(cred_type, str) or cred_type not in CREDENTIAL_TYPES:
            raise ConfigError(f"{cred_path}.type", _one_of(CREDENTIAL_TYPES, cred_type), repr(cred_type))
        credential = _build(
            CredentialConfig,
            cred_path,
            type=cred_type,
            tenant_id=_optional_str(raw_cred.get("tenant_id"), f"{cred_path}.tenant_id"),
            client_id=_optional_str(raw_cred.get("client_id"), f"{cred_path}.client_id"),
            client_secret=_optional_str(raw_cred.get("client_secret"), f"{cred_path}.client_secret", secret=True),
        )
    return NamespaceConfig(fully_qualified_namespace=address, credential_config=credential)


def _build(cls: Any, path: str, **kwargs: Any) -> Any:
    """Construct a section, re-labelling its own validation errors with the real option path."""
    try:
        return cls(**kwargs)
    except ConfigError as err:
        section = getattr(cls, "SECTION", "credential")
        if err.option.startswith(section) and path != section:
            raise err.with_option(path + err.option[len(section) :]) from None
        raise


def _parse_fields(cls: Any, data: Mapping[str, Any], path: str, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    names = [f.name for f in dataclasses.fields(cls)]
    _check_keys(data, names, path)
    parsed: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in skip or f.name not in data or data[f.name] is None:
            continue
        option = f"{path}.{f.name}"
        if f.type == "timedelta":
            parsed[f.name] = parse_duration(data[f.name], option)
        elif f.type == "int":
            parsed[f.name] = _parse_int(data[f.name], option)
        else:
            parsed[f.name] = _optional_str(data[f.name], option)
    return parsed


def _from_mapping(data: Mapping[Any, Any]) -> SparkSbConfig:
    data = _interpolate(data, "", os.environ)
    _check_keys(data, ["primary", "secondary", "send_availability", "syphon", "sink"], "")
    primary = _parse_namespace(_section(data, "primary", required=True), "primary")
    secondary = _parse_namespace(_section(data, "secondary", required=True), "secondary")
    sa_data = _section(data, "send_availability")
    sa_fields = _parse_fields(SendAvailabilityConfig, sa_data, "send_availability")
    if not sa_fields.get("backlog_prefix"):
        sa_fields["backlog_prefix"] = default_backlog_prefix(primary)
    send_availability = SendAvailabilityConfig(**sa_fields)
    syphon = SyphonConfig(**_parse_fields(SyphonConfig, _section(data, "syphon"), "syphon"))
    sink = _parse_sink(_section(data, "sink"), "sink")
    config = SparkSbConfig(
        primary=primary, secondary=secondary, send_availability=send_availability, syphon=syphon, sink=sink
    )
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
    return _from_mapping(data)


# --- Spark options ---------------------------------------------------------------------------------------

_OPTION_SECTIONS: dict[str, list[str] | None] = {
    "primary": _NAMESPACE_KEYS,
    "secondary": _NAMESPACE_KEYS,
    "send_availability": [f.name for f in dataclasses.fields(SendAvailabilityConfig)],
    "syphon": [f.name for f in dataclasses.fields(SyphonConfig)],
    "sink": [f.name for f in dataclasses.fields(SinkConfig)],
}


def _canonical(name: str, allowed: list[str]) -> str:
    for candidate in allowed:
        if _normal(candidate) == _normal(name):
            return candidate
    return name


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
    for key, value in options.items():
        parts = str(key).split(".")
        section = _canonical(parts[0], list(_OPTION_SECTIONS))
        if section not in _OPTION_SECTIONS or len(parts) < 2:
            continue
        if value is None or (isinstance(value, str) and not value.strip()):
            continue
        allowed = _OPTION_SECTIONS[section]
        target = nested.setdefault(section, {})
        names = [_canonical(parts[1], allowed or [])]
        if names[0] == "credential" and len(parts) > 2:
            names.append(_canonical(parts[2], _CREDENTIAL_KEYS))
            names.extend(parts[3:])
        elif section == "sink" and names[0] in ("columns", "source") and len(parts) > 2:
            names.append(_canonical(parts[2], list(SINK_FIELDS) if names[0] == "columns" else _SOURCE_KEYS))
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
