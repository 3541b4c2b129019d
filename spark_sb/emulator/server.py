"""The emulator as a whole: several namespaces, each an AMQP port and an admin HTTP port, and optionally an
AMQPS (TLS) port (:mod:`spark_sb.emulator.tls`) and AMQP over WebSockets ports, ``ws://`` and ``wss://``
(:mod:`spark_sb.emulator.websocket`). A namespace may be far away: a ``latency`` delays its AMQP bytes each way
(:mod:`spark_sb.emulator.relay`).

In-process::

    with Emulator.default(data_dir="data/emulator") as emu:
        conn_str = emu["primary"].connection_string
        emu.fault("primary", "down", duration=5)

As a subprocess (what tests and the demo use when they need kill -9)::

    proc = EmulatorProcess.start(data_dir=tmp, namespaces=[NamespaceOptions("primary")])
    proc["primary"].connection_string; proc.kill(); proc.stop()
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..durations import duration_text, parse_seconds
from . import aad as _aad
from . import limits as _limits
from . import model
from . import page as _page
from . import relay as _relay
from ._http_loop import AdminLimits
from .amqp import (
    DEFAULT_AUTH_TIMEOUT,
    DEFAULT_HANDSHAKE_TIMEOUT,
    DEFAULT_IDLE_TIMEOUT,
    FAULT_KINDS,
    NamespaceDown,
    NamespaceServer,
)
from .broker import Broker, BrokerError, Cond

if TYPE_CHECKING:
    from . import tls as _tls
    from . import websocket as _websocket

_LOGGER = logging.getLogger(__name__)

DEFAULT_KEY_NAME = "RootManageSharedAccessKey"
DEFAULT_KEY = "SAS_KEY_VALUE"  # Microsoft's emulator uses the same well-known development key
#: where AMQP over WebSockets is served (what every Service Bus SDK opens; :mod:`spark_sb.emulator.websocket`)
WEBSOCKET_PATH = "/$servicebus/websocket"
#: the form of ``--namespace`` (:meth:`NamespaceOptions.parse`)
NAMESPACE_FORM = ("NAME=AMQP_PORT:ADMIN_PORT[:TLS_PORT][,ws=PORT][,wss=PORT][,latency=DURATION]"
                  "[,idle-detach=DURATION][,detach-every=DURATION][,max-connections=N][,max-receivers=N]"
                  "[,ops-per-second=RATE][,max-entities=N][,max-subscriptions=N][,max-sql-filters=N]")
#: the ``--namespace`` extras that take a duration, and the option each sets
_DURATIONS = {"latency": "latency", "idle-detach": "idle_detach", "detach-every": "detach_every"}
#: the ``--namespace`` extras that set one of Service Bus's limits (:mod:`spark_sb.emulator.limits`), the option
#: each sets and the kind of number it takes
_LIMITS: dict[str, tuple[str, type]] = {"max-connections": ("max_connections", int),
                                        "max-receivers": ("max_receivers", int),
                                        "ops-per-second": ("ops_per_second", float),
                                        "max-entities": ("max_entities", int),
                                        "max-subscriptions": ("max_subscriptions", int),
                                        "max-sql-filters": ("max_sql_filters", int)}
_LIMIT_VALUES = {int: "N", float: "RATE"}


@dataclass(frozen=True)
class NamespaceOptions:
    name: str
    amqp_port: int = 0
    admin_port: int = 0
    key_name: str = DEFAULT_KEY_NAME
    key: str = field(default=DEFAULT_KEY, repr=False)
    max_message_size: int = 256 * 1024
    host: str = "127.0.0.1"
    #: AMQP over TLS (AMQPS) on this port (0: a free port); None: none, unless the Emulator is asked for TLS
    tls_port: int | None = None
    #: AMQP over WebSockets, plain (``ws://``), on this port (0: a free port); None: none, unless the Emulator is
    #: asked for WebSockets
    ws_port: int | None = None
    #: AMQP over secure WebSockets (``wss://``, TLS with the emulator's CA) on this port; None likewise
    wss_port: int | None = None
    #: a far namespace: seconds added to each direction of every AMQP connection (AMQP, AMQPS, ws, wss), so a
    #: round trip costs twice this (:mod:`spark_sb.emulator.relay`); the admin API is not delayed
    latency: float = 0.0
    #: Service Bus's habits: detach (``amqp:link:detach-forced``) an entity link that had no transfer, flow or
    #: settlement for this many seconds (Azure: 10 minutes); 0: never
    idle_detach: float = 0.0
    #: detach every entity link every this many seconds (Azure does now and then, in upgrades and rebalancing); 0:
    #: never
    detach_every: float = 0.0
    #: Service Bus's limits (:mod:`spark_sb.emulator.limits`): concurrent connections to the namespace, every
    #: transport counted (the next is refused with ``amqp:resource-limit-exceeded``)
    max_connections: int = _limits.DEFAULT_MAX_CONNECTIONS
    #: receiver links attached to one queue or subscription at once (the next attach is refused likewise)
    max_receivers: int = _limits.DEFAULT_MAX_RECEIVERS
    #: throttling: operations a second (messages sent and delivered, management requests) the namespace admits, a
    #: token bucket holding one second's worth; over it sends and management requests get
    #: ``com.microsoft:server-busy``, deliveries wait. None: off (the service's rate depends on its tier)
    ops_per_second: float | None = None
    #: queues and topics in the namespace, subscriptions on one topic, SQL filters (true and false ones and
    #: ``$Default`` included) across one topic's subscriptions: the service's quotas; the next create is refused
    #: with ``amqp:resource-limit-exceeded`` (the admin API: 403) naming the limit
    max_entities: int = _limits.DEFAULT_MAX_ENTITIES
    max_subscriptions: int = _limits.DEFAULT_MAX_SUBSCRIPTIONS
    max_sql_filters: int = _limits.DEFAULT_MAX_SQL_FILTERS

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_receivers", "max_entities", "max_subscriptions", "max_sql_filters"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        rate = self.ops_per_second
        if rate is not None and (not isinstance(rate, int | float) or isinstance(rate, bool)
                                 or not math.isfinite(rate) or rate <= 0):
            raise ValueError(f"ops_per_second must be a positive number of operations a second (or None: no "
                             f"throttling), got {rate!r}")

    @classmethod
    def parse(cls, text: str) -> NamespaceOptions:
        """``NAME=AMQP_PORT:ADMIN_PORT[:TLS_PORT][,ws=PORT][,wss=PORT][,latency=DURATION][,idle-detach=DURATION]
        [,detach-every=DURATION][,max-connections=N][,max-receivers=N][,ops-per-second=RATE][,max-entities=N]
        [,max-subscriptions=N][,max-sql-filters=N]`` (ports may be 0 for
        a free port; the latency is one way, e.g. ``20ms``; the limits as :class:`NamespaceOptions` describes them)."""
        form = NAMESPACE_FORM
        name, sep, rest = text.partition("=")
        ports, *extras = rest.split(",")
        parts = ports.split(":")
        if not sep or not name or len(parts) not in (2, 3) or not all(p.isdigit() for p in parts):
            raise ValueError(f"--namespace must look like {form}, got {text!r}")
        named: dict[str, str] = {}
        for extra in extras:
            key, eq, value = extra.partition("=")
            if not eq or key not in ("ws", "wss", *_DURATIONS, *_LIMITS) or key in named or (
                    key in ("ws", "wss") and not value.isdigit()):
                raise ValueError(f"--namespace {text!r}: after the ports come ws=PORT, wss=PORT, the durations "
                                 f"{', '.join(f'{k}=DURATION' for k in _DURATIONS)} and the limits "
                                 f"{', '.join(f'{k}={_LIMIT_VALUES[kind]}' for k, (_, kind) in _LIMITS.items())} "
                                 f"({form}), got {extra!r}")
            named[key] = value
        numbers: dict[str, Any] = {}
        for key, (field_name, kind) in _LIMITS.items():
            if key in named:
                value = named.pop(key)
                try:
                    number = kind(value)
                except ValueError:
                    number = None
                if number is None or not number > 0 or not math.isfinite(number):
                    what = "a positive integer" if kind is int else "a positive number of operations a second"
                    raise ValueError(f"--namespace {text!r}: {key} must be {what}, got {value!r}")
                numbers[field_name] = number
        durations: dict[str, float] = {}
        for key, field_name in _DURATIONS.items():
            if key in named:
                try:
                    durations[field_name] = parse_seconds(named.pop(key))
                except ValueError as err:
                    raise ValueError(f"--namespace {text!r}: {key}: {err}") from None
                if durations[field_name] < 0:
                    raise ValueError(f"--namespace {text!r}: {key} must not be negative, got "
                                     f"{durations[field_name]:g} s")
        for what, port in [*zip(("AMQP_PORT", "ADMIN_PORT", "TLS_PORT"), parts, strict=False), *named.items()]:
            if int(port) > 65535:
                raise ValueError(f"--namespace {text!r}: {what} must be a port number (0-65535), got {port}")
        return cls(name=name, amqp_port=int(parts[0]), admin_port=int(parts[1]),
                   tls_port=int(parts[2]) if len(parts) == 3 else None,
                   ws_port=int(named["ws"]) if "ws" in named else None,
                   wss_port=int(named["wss"]) if "wss" in named else None, latency=durations.get("latency", 0.0),
                   idle_detach=durations.get("idle_detach", 0.0), detach_every=durations.get("detach_every", 0.0),
                   **numbers)

    def spec(self) -> str:
        """The ``--namespace`` text for these ports."""
        tls = "" if self.tls_port is None else f":{self.tls_port}"
        ws = "" if self.ws_port is None else f",ws={self.ws_port}"
        wss = "" if self.wss_port is None else f",wss={self.wss_port}"
        durations = "".join(f",{key}={duration_text(getattr(self, field_name))}"
                            for key, field_name in _DURATIONS.items() if getattr(self, field_name))
        defaults = NamespaceOptions(self.name)
        limits = "".join(f",{key}={_number_text(getattr(self, field_name))}" for key, (field_name, _) in _LIMITS.items()
                         if getattr(self, field_name) != getattr(defaults, field_name))
        return f"{self.name}={self.amqp_port}:{self.admin_port}{tls}{ws}{wss}{durations}{limits}"


DEFAULT_NAMESPACES = (NamespaceOptions("primary", 5672, 5300), NamespaceOptions("secondary", 5673, 5301))
#: the default namespaces' AMQPS ports with TLS on: 5671 is the SDK's own AMQPS port, so a client built with
#: ``fully_qualified_namespace="localhost"`` reaches the primary
DEFAULT_TLS_PORTS = {"primary": 5671, "secondary": 5674}
#: the Entra ID authority's https port of :meth:`Emulator.default` with TLS on (``ClientSecretCredential``'s
#: ``authority="https://localhost:5310"``)
DEFAULT_AUTHORITY_PORT = 5310
#: the default namespaces' AMQP over WebSockets ports (ws, wss) with WebSockets on. Service Bus itself serves wss
#: on 443, which an unprivileged user cannot listen on: clients name the port (``websocket_client_kwargs``)
DEFAULT_WEBSOCKET_PORTS = {"primary": (5380, 5443), "secondary": (5381, 5444)}


def connection_string(host: str, port: int, key_name: str, key: str) -> str:
    return (
        f"Endpoint=sb://{host}:{port};SharedAccessKeyName={key_name};"
        f"SharedAccessKey={key};UseDevelopmentEmulator=true"
    )


@dataclass
class NamespaceInfo:
    """Where a running namespace listens. ``connection_string`` holds the key: do not log it."""

    name: str
    amqp_port: int
    admin_port: int
    key_name: str
    key: str = field(repr=False)
    #: the AMQPS (TLS) port, when the namespace has one
    tls_port: int | None = None
    #: the CA certificate TLS clients trust (``connection_verify=``), when the namespace has a TLS or wss port
    ca_file: str | None = None
    #: AMQP over WebSockets: the plain (``ws://``) port and the secure (``wss://``) one, when the namespace has them
    ws_port: int | None = None
    wss_port: int | None = None
    #: the emulator's Entra ID authority (https, one per emulator), when it has one
    authority_port: int | None = None

    @property
    def connection_string(self) -> str:
        return connection_string("localhost", self.amqp_port, self.key_name, self.key)

    @property
    def tls_client_kwargs(self) -> dict[str, Any]:
        """What ``ServiceBusClient("localhost", credential, **kwargs)`` (sync or aio) needs to reach this
        namespace over TLS on any port: with TLS the SDK ignores a port in the namespace and connects to 5671
        unless given a custom endpoint (which it would take as a WebSocket one without ``transport_type``)."""
        if self.tls_port is None or self.ca_file is None:
            raise ValueError(f"namespace {self.name!r} has no TLS port (start the emulator with TLS)")
        from azure.servicebus import TransportType

        return {"custom_endpoint_address": f"sb://localhost:{self.tls_port}", "transport_type": TransportType.Amqp,
                "connection_verify": self.ca_file}

    @property
    def websocket_client_kwargs(self) -> dict[str, Any]:
        """What ``ServiceBusClient("localhost", credential, **kwargs)`` (sync or aio) needs to speak AMQP over
        secure WebSockets (``wss://``) to this namespace: the SDK would connect to port 443 unless given a custom
        endpoint. Add ``http_proxy=`` to go through a proxy."""
        if self.wss_port is None or self.ca_file is None:
            raise ValueError(f"namespace {self.name!r} has no wss port (start the emulator with WebSockets)")
        from azure.servicebus import TransportType

        return {"custom_endpoint_address": f"sb://localhost:{self.wss_port}",
                "transport_type": TransportType.AmqpOverWebsocket, "connection_verify": self.ca_file}

    @property
    def websocket_connection_string_kwargs(self) -> dict[str, Any]:
        """What ``ServiceBusClient.from_connection_string(info.connection_string, **kwargs)`` needs to speak AMQP
        over WebSockets to this namespace: an emulator connection string (``UseDevelopmentEmulator=true``) turns
        TLS off, so the SDK opens ``ws://``, on port 80 (sync) or 443 (aio) unless given a custom endpoint."""
        if self.ws_port is None:
            raise ValueError(f"namespace {self.name!r} has no ws port (start the emulator with WebSockets)")
        from azure.servicebus import TransportType

        return {"custom_endpoint_address": f"sb://localhost:{self.ws_port}",
                "transport_type": TransportType.AmqpOverWebsocket}

    @property
    def admin_url(self) -> str:
        return f"http://localhost:{self.admin_port}"

    @property
    def page_url(self) -> str:
        """The emulator's live page (:mod:`spark_sb.emulator.page`), served on this namespace's admin port; every
        namespace of the emulator is on it."""
        return f"{self.admin_url}/"

    @property
    def identity_endpoint(self) -> str:
        """The managed-identity token endpoint (``IDENTITY_ENDPOINT``) on this namespace's admin port; its
        tokens are good for every namespace of the emulator."""
        return f"{self.admin_url}{_aad.TOKEN_PATH}"

    @property
    def authority_url(self) -> str:
        """The emulator's Entra ID authority (``authority=`` of ``ClientSecretCredential``)."""
        if self.authority_port is None:
            raise ValueError("the emulator has no Entra ID authority (start it with TLS, or an authority port)")
        return f"https://localhost:{self.authority_port}"

    @property
    def authority_kwargs(self) -> dict[str, Any]:
        """What ``ClientSecretCredential(tenant_id, client_id, client_secret, **kwargs)`` needs to get its tokens
        from the emulator's authority: ``authority``, ``disable_instance_discovery=True`` (the authority is not
        Microsoft's) and ``connection_verify`` (the emulator's CA)."""
        return {"authority": self.authority_url, "disable_instance_discovery": True,
                "connection_verify": self.ca_file}


class StoreInUseError(OSError):
    """Another emulator (another process, or another :class:`Emulator` here) runs a namespace on the same store:
    ``spark-sb emulator start`` exits 2 naming the directory and the process."""


class Emulator:
    """Runs namespaces in this process. ``data_dir=None`` keeps messages in memory only.

    ``entra_id=True``: the emulator also plays Microsoft Entra ID (off by default, and then only the SAS key opens
    its namespaces: ``jwt`` put-tokens and Bearer JWTs on the admin API are refused, no token endpoint is served).
    ``aad`` (only with ``entra_id=True``): Entra ID as this emulator plays it
    (:class:`~spark_sb.emulator.aad.AadOptions`: the managed identities its token endpoint serves, their roles, the
    tokens' lifetime, the identity header, the signing key); default: the system-assigned identity as Data Owner,
    one-hour tokens, the well-known (public) header and key.

    ``tls=True``: every namespace also serves AMQP over TLS, on its ``tls_port`` or, when that is None, a free
    port (a namespace with a ``tls_port`` has TLS either way). The certificates are made by the emulator and kept
    in ``<data_dir>/tls`` (a temporary directory without a data_dir); ``info[name].ca_file`` is the CA to trust.

    ``websockets=True``: every namespace also serves AMQP over WebSockets at ``/$servicebus/websocket``, plain
    (``ws://``, what an emulator connection string makes the SDK open) on its ``ws_port`` and over TLS with the
    same CA (``wss://``, what a namespace and a credential make it open) on its ``wss_port``, or free ports where
    those are None (a namespace with a ``ws_port`` or ``wss_port`` has it either way).

    ``authority_port``: the Entra ID authority (https, with the same CA; :mod:`spark_sb.emulator.authority_http`)
    that azure-identity's ``ClientSecretCredential`` gets the tokens of ``aad``'s app registrations from, on this
    port (0: a free one) of the first namespace's host; None: on a free port when ``tls`` and ``entra_id``, else none.
    ``info[name].authority_url`` and ``.authority_kwargs`` say where.

    ``allowed_origins``: the web origins (``http://localhost:8080``) whose pages may open the WebSocket endpoints;
    a client that sends no ``Origin`` (every SDK) or its own endpoint's is always let in, any other is refused.

    ``handshake_timeout``: seconds a client has from its TCP connect to its AMQP ``open`` before the namespace
    closes the socket; ``idle_timeout``: seconds a connection may send nothing before the namespace closes it (its
    AMQP ``open`` advertises half as its idle-time-out); ``auth_timeout``: seconds a connection has from its AMQP
    ``open`` to its first accepted put-token before the namespace closes it with ``amqp:unauthorized-access``
    (default 10 s; the SDKs put their token at once); 0: off, for each. A namespace whose AMQP server fails
    closes its port and shows in :attr:`failures`.

    ``admin_limits``: how every namespace's admin port bounds its clients (:class:`AdminLimits`: its request and
    idle timeouts, its workers, its caps on connections in all and per client address); default: ``AdminLimits()``.
    """

    def __init__(
        self,
        namespaces: Sequence[NamespaceOptions] = DEFAULT_NAMESPACES,
        *,
        data_dir: str | Path | None = None,
        entities: str | Path | dict[str, Any] | model.EntitiesFile | None = None,
        clock: Callable[[], float] = time.time,
        aad: _aad.AadOptions | None = None,
        tls: bool = False,
        websockets: bool = False,
        authority_port: int | None = None,
        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        allowed_origins: Sequence[str] = (),
        entra_id: bool = False,
        auth_timeout: float = DEFAULT_AUTH_TIMEOUT,
        admin_limits: AdminLimits | None = None,
    ) -> None:
        names = [n.name for n in namespaces]
        if not entra_id:  # Entra ID is asked for, never implied: its development secrets are public
            for option, given in (("aad", aad), ("authority_port", authority_port)):
                if given is not None:
                    raise ValueError(f"{option}={given!r}: Microsoft Entra ID is off; pass entra_id=True to use it")
        for what, value in (("handshake_timeout", handshake_timeout), ("idle_timeout", idle_timeout),
                            ("auth_timeout", auth_timeout)):
            if value < 0:
                raise ValueError(f"{what} must not be negative, got {value:g} s")
        self.handshake_timeout = handshake_timeout
        self.auth_timeout = auth_timeout
        self.idle_timeout = idle_timeout
        self.admin_limits = admin_limits or AdminLimits()
        if len(set(names)) != len(names):
            raise ValueError(f"namespace names must be distinct, got {names}")
        self.options = list(namespaces)
        self.data_dir = Path(data_dir) if data_dir is not None else None
        if entities is None or isinstance(entities, model.EntitiesFile):
            self.entities = entities or model.EntitiesFile()
        else:
            self.entities = model.load_entities(entities)
        self.clock = clock
        #: issues (token endpoint) and verifies (put-token, admin API) the emulator's Entra ID tokens; None when
        #: Entra ID is off (``entra_id=False``, the default): only the SAS key opens the namespaces
        self.entra_id = entra_id
        self.authority: _aad.Authority | None = _aad.Authority(aad, clock) if entra_id else None
        self._servers: dict[str, NamespaceServer] = {}
        self._admins: dict[str, Any] = {}
        #: the open lock file of each namespace's store while it runs (:meth:`_lock_stores`)
        self._store_locks: list[Any] = []
        self.info: dict[str, NamespaceInfo] = {}
        self.tls = tls
        self.certificates: _tls.Certificates | None = None
        self._relay: _tls.TlsRelay | None = None
        self._latency_relay: _relay.Relay | None = None
        self._tls_tmp: str | None = None
        self.websockets = websockets
        #: the browser origins (``https://app.example:8443``) whose pages may open the WebSocket endpoints
        self.allowed_origins = tuple(allowed_origins)
        self._ws_relay: _websocket.WebSocketRelay | None = None
        self.authority_port = authority_port if authority_port is not None else (0 if tls and entra_id else None)
        self._authority_server: Any = None
        #: the live page of every namespace, served on each admin port at ``/`` (:mod:`spark_sb.emulator.page`)
        self.page = _page.Page(self._page_namespaces)

    @classmethod
    def default(cls, *, tls: bool = False, websockets: bool = False, **kwargs: Any) -> Emulator:
        """The primary (5672, admin 5300) and the secondary (5673, admin 5301); with ``tls=True`` their AMQPS
        ports are 5671 and 5674 (:data:`DEFAULT_TLS_PORTS`), with ``websockets=True`` their ws and wss ports
        5380 and 5443, 5381 and 5444 (:data:`DEFAULT_WEBSOCKET_PORTS`); with ``tls=True`` the Entra ID
        authority's is 5310 (:data:`DEFAULT_AUTHORITY_PORT`)."""
        if tls and kwargs.get("entra_id"):
            kwargs.setdefault("authority_port", DEFAULT_AUTHORITY_PORT)
        return cls(default_namespaces(tls, websockets), tls=tls, websockets=websockets, **kwargs)

    def _tls_port(self, opt: NamespaceOptions) -> int | None:
        if opt.tls_port is not None:
            return opt.tls_port
        return 0 if self.tls else None

    def _ws_ports(self, opt: NamespaceOptions) -> tuple[int | None, int | None]:
        """The namespace's (ws, wss) ports: its own, else free ones with ``websockets``, else none."""
        free = 0 if self.websockets else None
        return (opt.ws_port if opt.ws_port is not None else free,
                opt.wss_port if opt.wss_port is not None else free)

    def __getitem__(self, name: str) -> NamespaceInfo:
        try:
            return self.info[name]
        except KeyError:
            raise KeyError(f"no namespace {name!r}; running: {', '.join(self.info)}") from None

    def __enter__(self) -> Emulator:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _store(self, name: str) -> Any:
        from . import store

        if self.data_dir is None:
            return store.MemoryStore()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        return store.SqliteStore(self.data_dir / f"{name}.db")

    def _lock_stores(self) -> None:
        """Hold ``<data_dir>/<namespace>.db.lock`` for each namespace while this emulator runs. Two emulators on
        one store would each serve the same messages, with locks neither sees: the getting-started page's other
        ports, started beside the default pair on the default ``--data-dir``, showed the other pair's 42,850
        messages. The operating system releases the lock when the process ends, however it ends."""
        if self.data_dir is None:
            return
        try:
            import fcntl
        except ImportError:  # not a POSIX system: no lock
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        for opt in self.options:
            path = self.data_dir / f"{opt.name}.db.lock"
            handle = open(path, "a+")  # noqa: SIM115 - held until stop()
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                handle.seek(0)
                holder = handle.read().strip()
                handle.close()
                self._unlock_stores()
                raise StoreInUseError(
                    f"the store of namespace {opt.name!r} in {self.data_dir} is in use by another emulator"
                    f"{f' (process {holder})' if holder else ''}: stop it, or give this one another --data-dir "
                    "(or --in-memory)") from None
            handle.seek(0)
            handle.truncate()
            handle.write(str(os.getpid()))
            handle.flush()
            self._store_locks.append(handle)

    def _unlock_stores(self) -> None:
        for handle in self._store_locks:
            handle.close()  # closing the file releases its lock
        self._store_locks.clear()

    def _page_namespaces(self) -> list[_page.PageNamespace]:
        """The namespaces running now, as the live page sees them."""
        spaces = []
        for opt in self.options:
            server = self._servers.get(opt.name)
            if server is None:
                continue
            spaces.append(_page.PageNamespace(
                opt.name, server, _control(server), {opt.key_name: opt.key},
                functools.partial(self._page_ports, opt.name), secret=opt.key != DEFAULT_KEY))
        return spaces

    def _page_ports(self, name: str) -> dict[str, int | None]:
        info = self.info.get(name)
        if info is None:
            return {}
        return {"amqp": info.amqp_port, "admin": info.admin_port, "amqps": info.tls_port, "ws": info.ws_port,
                "wss": info.wss_port}

    def start(self) -> Emulator:
        from .admin_http import AdminServer

        self._lock_stores()
        try:
            for opt in self.options:
                def factory(on_available: Callable[[str], None], opt: NamespaceOptions = opt) -> Broker:
                    broker = Broker(self._store(opt.name), clock=self.clock,
                                    max_message_size=opt.max_message_size, on_available=on_available,
                                    max_entities=opt.max_entities, max_subscriptions=opt.max_subscriptions,
                                    max_sql_filters=opt.max_sql_filters, name=opt.name)
                    _apply_entities(broker, self.entities)
                    return broker

                # a far namespace listens on loopback behind its latency relay, which takes its AMQP port
                far = opt.latency > 0
                server = NamespaceServer(
                    opt.name, factory, host=_loopback(opt.host) if far else opt.host, port=0 if far else opt.amqp_port,
                    keys={opt.key_name: opt.key}, clock=self.clock, max_message_size=opt.max_message_size,
                    authority=self.authority, idle_detach=opt.idle_detach, detach_every=opt.detach_every,
                    handshake_timeout=self.handshake_timeout, idle_timeout=self.idle_timeout,
                    auth_timeout=self.auth_timeout,
                    max_connections=opt.max_connections, max_receivers=opt.max_receivers,
                    ops_per_second=opt.ops_per_second,
                )
                server.start()
                self._servers[opt.name] = server
                admin = AdminServer(
                    opt.host, opt.admin_port,
                    broker=_BrokerProxy(server), call=server.call, keys={opt.key_name: opt.key},
                    fault=_fault_reader(server), control=_control(server), namespace_port=server.port,
                    other_ports=functools.partial(self._ports_of, opt.name),
                    authority=self.authority, allowed_hosts=[o.host for o in self.options],
                    limits=self.admin_limits, page=self.page,
                )
                admin.start()
                self._admins[opt.name] = admin
                self.info[opt.name] = NamespaceInfo(opt.name, server.port, admin.port, opt.key_name, opt.key)
                server.other_ports = functools.partial(self._ports_of, opt.name)
                _LOGGER.info("namespace %s: AMQP on %s:%d, admin on http://%s:%d", opt.name, opt.host,
                             server.port, opt.host, admin.port)
            self._start_latency()
            self._start_tls()
            self._start_websockets()
            self._start_authority()
        except BaseException:
            self.stop()
            raise
        return self

    def _ensure_certificates(self) -> _tls.Certificates:
        """The CA and server certificate of every TLS endpoint (AMQPS, wss), made or checked once per start."""
        if self.certificates is not None:
            return self.certificates
        from . import tls as _tls  # cryptography is imported only when TLS is on

        if self.data_dir is not None:
            directory = self.data_dir / "tls"
        else:
            self._tls_tmp = tempfile.mkdtemp(prefix="sb-emu-tls-")
            directory = Path(self._tls_tmp)
        secure = [opt for opt in self.options
                  if self._tls_port(opt) is not None or self._ws_ports(opt)[1] is not None]
        if self.authority_port is not None:  # the Entra ID authority listens on the first namespace's host
            secure.append(self.options[0])
        hosts = [h for opt in secure for h in _tls.certificate_hosts(opt.host)]
        # certificates are checked by clients against the real time, whatever clock the broker follows
        self.certificates = _tls.ensure_certificates(directory, hosts)
        return self.certificates

    def _start_latency(self) -> None:
        """The far namespaces: each AMQP port relayed, with its latency each way, to the namespace on loopback.
        Their AMQPS and WebSocket endpoints relay to that port, so they are as far."""
        routes = [_relay.Route(opt.name, opt.host, opt.amqp_port, _loopback(opt.host), self._servers[opt.name].port,
                               delay=opt.latency) for opt in self.options if opt.latency > 0]
        if not routes:
            return
        self._latency_relay = _relay.Relay(routes, name="sb-emulator-latency").start()
        for route in routes:
            self.info[route.name].amqp_port = route.port

    def _upstream(self, opt: NamespaceOptions) -> tuple[str, int]:
        """Where the AMQPS and WebSocket relays hand a namespace's AMQP bytes: its AMQP port (a far one's relay)."""
        return _loopback(opt.host), self.info[opt.name].amqp_port

    def _start_tls(self) -> None:
        """The AMQPS endpoints: TLS on each TLS port, the plain bytes relayed to the namespace's AMQP port."""
        wanted = [(opt, port) for opt in self.options if (port := self._tls_port(opt)) is not None]
        if not wanted:
            return
        from . import tls as _tls

        certs = self._ensure_certificates()
        routes = [_relay.Route(opt.name, opt.host, port, *self._upstream(opt)) for opt, port in wanted]
        self._relay = _tls.TlsRelay(routes, certs.server_context()).start()
        for route in routes:
            self._servers[route.name].tls_port = route.port
            self.info[route.name].tls_port = route.port
            self.info[route.name].ca_file = str(certs.ca_file)

    def _ports_of(self, name: str) -> tuple[int | None, ...]:
        """A namespace's ports other than AMQP (admin, AMQPS, ws, wss): a token naming one is this namespace's."""
        info = self.info.get(name)
        if info is None:
            return ()
        return (info.amqp_port, info.admin_port, info.tls_port, info.ws_port, info.wss_port)

    def _start_websockets(self) -> None:
        """The AMQP over WebSockets endpoints (ws and wss), their AMQP bytes relayed to the namespace's AMQP port."""
        wanted = [(opt, ws, wss) for opt in self.options for ws, wss in [self._ws_ports(opt)]
                  if ws is not None or wss is not None]
        if not wanted:
            return
        from . import websocket as _websocket  # the websockets package is imported only when they are on

        context = None
        if any(wss is not None for _, _, wss in wanted):
            context = self._ensure_certificates().server_context()
        routes: list[_websocket.WebSocketRoute] = []
        for opt, ws, wss in wanted:
            upstream = self._upstream(opt)
            if ws is not None:
                routes.append(_websocket.WebSocketRoute(opt.name, opt.host, ws, *upstream))
            if wss is not None:
                routes.append(_websocket.WebSocketRoute(opt.name, opt.host, wss, *upstream, context=context))
        self._ws_relay = _websocket.WebSocketRelay(routes, allowed_origins=self.allowed_origins).start()
        for route in routes:
            info = self.info[route.name]
            if route.context is None:
                info.ws_port = route.port
            else:
                info.wss_port = route.port
                info.ca_file = str(self._ensure_certificates().ca_file)

    def _start_authority(self) -> None:
        """The Entra ID authority (https) for ``ClientSecretCredential``, when it is wanted."""
        if self.authority_port is None or self.authority is None:
            return
        from .authority_http import AuthorityServer

        certs = self._ensure_certificates()
        server = AuthorityServer(self.options[0].host, self.authority_port, self.authority, certs.server_context())
        self._authority_server = server.start()
        for info in self.info.values():
            info.authority_port = server.port
            info.ca_file = str(certs.ca_file)

    def stop(self) -> None:
        if self._authority_server is not None:
            self._authority_server.stop()
            self._authority_server = None
        if self._ws_relay is not None:
            self._ws_relay.stop()
            self._ws_relay = None
        for relay in (self._relay, self._latency_relay):
            if relay is not None:
                relay.stop()
        self._relay = self._latency_relay = None
        for admin in self._admins.values():
            admin.stop()
        for server in self._servers.values():
            server.stop()
        self._admins.clear()
        self._servers.clear()
        self._unlock_stores()
        if self._tls_tmp is not None:
            shutil.rmtree(self._tls_tmp, ignore_errors=True)
            self._tls_tmp = None
        self.certificates = None

    def server(self, name: str) -> NamespaceServer:
        return self._servers[name]

    @property
    def failures(self) -> dict[str, BaseException]:
        """The namespaces whose AMQP server failed while running, and why (their ports are closed)."""
        return {name: s.failure for name, s in self._servers.items() if s.failure is not None}

    def token(self, client_id: str | None = None, **kwargs: Any) -> tuple[str, int]:
        """An Entra ID access token and its expiry (epoch seconds) for a configured identity, as the token
        endpoint issues it; ``roles=``, ``lifetime=``, ``resource=`` override (see
        :meth:`~spark_sb.emulator.aad.Authority.issue`)."""
        if self.authority is None:
            raise RuntimeError("Microsoft Entra ID is off on this emulator: start it with Emulator(..., entra_id=True)")
        return self.authority.issue(client_id, **kwargs)

    def fault(self, namespace: str, kind: str, entity: str | None = None, duration: float | None = None) -> None:
        server = self._servers[namespace]
        server.call(lambda: server.fault(kind, entity, duration))

    def heal(self, namespace: str, entity: str | None = None) -> None:
        server = self._servers[namespace]
        server.call(lambda: server.heal(entity))


def default_namespaces(tls: bool = False, websockets: bool = False) -> list[NamespaceOptions]:
    """:data:`DEFAULT_NAMESPACES`, with their :data:`DEFAULT_TLS_PORTS` when ``tls`` and their
    :data:`DEFAULT_WEBSOCKET_PORTS` when ``websockets``."""
    namespaces = list(DEFAULT_NAMESPACES)
    if tls:
        namespaces = [dataclasses.replace(n, tls_port=DEFAULT_TLS_PORTS.get(n.name, 0)) for n in namespaces]
    if websockets:
        namespaces = [dataclasses.replace(n, ws_port=DEFAULT_WEBSOCKET_PORTS.get(n.name, (0, 0))[0],
                                          wss_port=DEFAULT_WEBSOCKET_PORTS.get(n.name, (0, 0))[1])
                      for n in namespaces]
    return namespaces


def _number_text(value: float) -> str:
    """``500`` for 500 and 500.0, ``0.5`` for 0.5: what :meth:`NamespaceOptions.parse` reads back as the same."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _loopback(host: str) -> str:
    """Where the relay reaches a namespace's plain AMQP port listening on ``host``."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


class _BrokerProxy:
    """Lets the admin server name ``broker`` before the reactor thread has built it."""

    def __init__(self, server: NamespaceServer) -> None:
        self._server = server

    def __getattr__(self, name: str) -> Any:
        assert self._server.broker is not None
        return getattr(self._server.broker, name)


def _apply_entities(broker: Broker, entities: model.EntitiesFile) -> None:
    """Create what the entities file describes and the store does not hold yet. Existing entities keep
    their stored description (the admin API may have changed them)."""
    specs: list[model.QueueSpec | model.TopicSpec | model.SubscriptionSpec] = [
        *entities.queues, *entities.topics, *entities.subscriptions]
    for spec in specs:
        try:
            broker.create_entity(spec)
        except BrokerError as err:
            if err.condition != Cond.ALREADY_EXISTS:
                raise


def _fault_reader(server: NamespaceServer) -> Callable[[str | None], str | None]:
    def read(entity: str | None) -> str | None:
        return server.call(lambda: server.fault_for(entity))

    return read


def _entity_paths(server: NamespaceServer) -> list[str]:
    """The namespace's queues, topics and subscriptions (``TOPIC/subscriptions/NAME``), sorted."""
    broker = server.broker
    assert broker is not None
    return sorted(path for path, _ in _page.entities(broker))


def _control(server: NamespaceServer) -> Callable[[str, str, dict[str, Any]], tuple[int, dict[str, Any]]]:
    """The ``/$emulator/`` endpoints of the admin port: fault, heal, faults, stats, entities."""

    def handle(method: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        op = path.rstrip("/").rsplit("/", 1)[-1]
        if method == "POST" and op == "fault":
            kind = body.get("kind")
            if kind not in FAULT_KINDS:
                return 400, {"error": f"kind must be one of {', '.join(FAULT_KINDS)}, got {kind!r}"}
            duration = body.get("duration")
            if duration is not None and (not isinstance(duration, int | float) or duration <= 0):
                return 400, {"error": f"duration must be a positive number of seconds, got {duration!r}"}
            entity = body.get("entity") or None
            server.call(lambda: server.fault(kind, entity, duration))
            return 200, {"namespace": server.name, "kind": kind, "entity": entity, "duration": duration}
        if method == "POST" and op == "heal":
            entity = body.get("entity") or None
            server.call(lambda: server.heal(entity))
            return 200, {"namespace": server.name, "healed": entity or "all"}
        if method == "GET" and op == "faults":
            faults = server.call(lambda: {k or "": asdict(v) for k, v in server.faults.items()})
            return 200, {"namespace": server.name, "faults": faults}
        if method == "GET" and op == "stats":
            return 200, server.call(server.stats)
        if method == "GET" and op == "entities":  # what a fault can name: spark-sb emulator fault --entity
            return 200, {"namespace": server.name, "entities": server.call(lambda: _entity_paths(server))}
        return 404, {"error": f"unknown control endpoint {method} {path}"}

    def guarded(method: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        try:
            return handle(method, path, body)
        except NamespaceDown as err:
            return 503, {"error": err.description}

    return guarded


# ---------------------------------------------------------------------- remote control (CLI, other processes)
def send_control(admin_url: str, op: str, body: dict[str, Any] | None = None, timeout: float = 10.0) -> dict[str, Any]:
    import urllib.error
    import urllib.request

    from .admin_http import CONTROL_HEADER

    url = admin_url.rstrip("/") + "/$emulator/" + op
    data = None if body is None else json.dumps(body).encode()
    # the header the controls need (a web page cannot send it cross-site), and a JSON body
    req = urllib.request.Request(url, data=data, method="POST" if body is not None else "GET",
                                 headers={"Content-Type": "application/json", CONTROL_HEADER: "1"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            answer: dict[str, Any] = json.loads(resp.read() or b"{}")
            return answer
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")
        try:
            detail = json.loads(detail).get("error", detail)
        except ValueError:
            pass
        raise RuntimeError(f"{url}: {detail}") from None
    except urllib.error.URLError as err:
        raise ConnectionError(f"cannot reach the emulator's admin API at {admin_url}: {err.reason}") from None


def fault(admin_url: str, kind: str, entity: str | None = None, duration: float | None = None) -> dict[str, Any]:
    """Inject a fault into the namespace whose admin API is at ``admin_url``."""
    return send_control(admin_url, "fault", {"kind": kind, "entity": entity, "duration": duration})


def heal(admin_url: str, entity: str | None = None) -> dict[str, Any]:
    return send_control(admin_url, "heal", {"entity": entity})


# ---------------------------------------------------------------------- subprocess
class EmulatorProcess:
    """The emulator in a child process (``spark-sb emulator start``), for kill -9 tests and the demo."""

    def __init__(self, proc: subprocess.Popen[bytes], info: dict[str, NamespaceInfo], args: list[str],
                 namespaces: Sequence[NamespaceOptions] = ()) -> None:
        self.proc = proc
        self.info = info
        self.args = args
        #: the namespaces as asked for (a restart keeps their options: latency, Service Bus's habits)
        self.namespaces = {n.name: n for n in namespaces}

    def __getitem__(self, name: str) -> NamespaceInfo:
        return self.info[name]

    @classmethod
    def start(
        cls,
        *,
        data_dir: str | Path | None,
        namespaces: Sequence[NamespaceOptions] = DEFAULT_NAMESPACES,
        entities: str | Path | None = None,
        timeout: float = 30.0,
        log_file: str | Path | None = None,
        tls: bool = False,
        websockets: bool = False,
        authority_port: int | None = None,
        token_lifetime: float | None = None,
        handshake_timeout: float | None = None,
        idle_timeout: float | None = None,
        entra_id: bool = False,
        auth_timeout: float | None = None,
        admin_limits: AdminLimits | None = None,
    ) -> EmulatorProcess:
        """``data_dir=None`` keeps messages in memory only; ``tls``, ``websockets``, ``entra_id`` (``--entra-id``),
        ``handshake_timeout``, ``idle_timeout``, ``auth_timeout`` and ``admin_limits`` as for :class:`Emulator` (None: its default); ``token_lifetime``:
        seconds the Entra ID tokens it issues live (``--token-lifetime``, with ``entra_id`` only)."""
        if not entra_id:
            for what, value in (("authority_port", authority_port), ("token_lifetime", token_lifetime)):
                if value is not None:
                    raise ValueError(f"{what}={value!r}: Microsoft Entra ID is off; pass entra_id=True to use it")
        status = Path(tempfile.mkdtemp(prefix="sb-emu-")) / "status.json"
        store = ["--in-memory"] if data_dir is None else ["--data-dir", str(data_dir)]
        args = [sys.executable, "-m", "spark_sb.cli", "emulator", "start", *store, "--status-file", str(status)]
        if tls:
            args.append("--tls")
        if websockets:
            args.append("--websockets")
        if entra_id:
            args.append("--entra-id")
        if authority_port is not None:
            args += ["--authority-port", str(authority_port)]
        if token_lifetime is not None:
            args += ["--token-lifetime", f"{token_lifetime:g}s"]
        if handshake_timeout is not None:
            args += ["--handshake-timeout", f"{handshake_timeout:g}s"]
        if idle_timeout is not None:
            args += ["--idle-timeout", f"{idle_timeout:g}s"]
        if auth_timeout is not None:
            args += ["--auth-timeout", f"{auth_timeout:g}s"]
        if admin_limits is not None:
            args += admin_limit_args(admin_limits)
        for n in namespaces:
            args += ["--namespace", n.spec()]
        if entities is not None:
            args += ["--entities", str(entities)]
        return cls._launch(args, status, timeout, log_file, namespaces)

    @classmethod
    def _launch(cls, args: list[str], status: Path, timeout: float, log_file: str | Path | None,
                namespaces: Sequence[NamespaceOptions]) -> EmulatorProcess:
        log = open(log_file, "ab") if log_file else subprocess.DEVNULL  # noqa: SIM115
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if status.exists():
                try:
                    data = json.loads(status.read_text())
                except ValueError:
                    data = None
                if data:
                    info = {d["name"]: NamespaceInfo(**d) for d in data["namespaces"]}
                    return cls(proc, info, args, namespaces)
            if proc.poll() is not None:
                raise RuntimeError(f"the emulator exited with code {proc.returncode} before it was ready")
            time.sleep(0.05)
        proc.kill()
        raise TimeoutError(f"the emulator did not start within {timeout} s")

    def restart(self, timeout: float = 30.0) -> EmulatorProcess:
        """Start again with the same arguments and ports (after ``kill``)."""
        args = list(self.args)
        status = Path(args[args.index("--status-file") + 1])
        status.unlink(missing_ok=True)
        # keep the ports the first run picked so clients' connection strings stay valid
        out: list[str] = []
        skip = False
        for a in args:
            if skip:
                skip = False
                continue
            if a in ("--namespace", "--authority-port"):
                skip = True
                continue
            out.append(a)
        authority = next((n.authority_port for n in self.info.values() if n.authority_port is not None), None)
        if authority is not None:
            out += ["--authority-port", str(authority)]
        namespaces = [dataclasses.replace(self.namespaces.get(n.name, NamespaceOptions(n.name)), amqp_port=n.amqp_port,
                                          admin_port=n.admin_port, tls_port=n.tls_port, ws_port=n.ws_port,
                                          wss_port=n.wss_port) for n in self.info.values()]
        for n in namespaces:
            out += ["--namespace", n.spec()]
        return self._launch(out, status, timeout, None, namespaces)

    def kill(self) -> None:
        """kill -9: no clean shutdown."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self) -> EmulatorProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def admin_limit_args(limits: AdminLimits) -> list[str]:
    """The ``spark-sb emulator start`` options that set ``limits``."""
    return ["--admin-request-timeout", f"{limits.request_timeout:g}s", "--admin-idle-timeout",
            f"{limits.idle_timeout:g}s", "--admin-workers", str(limits.workers), "--admin-max-connections",
            str(limits.max_connections), "--admin-max-connections-per-client", str(limits.max_connections_per_client)]


def run_foreground(
    namespaces: Sequence[NamespaceOptions],
    data_dir: str | Path | None,
    entities: str | Path | None,
    status_file: str | Path | None,
    out: Any = sys.stdout,
    tls: bool = False,
    websockets: bool = False,
    authority_port: int | None = None,
    token_lifetime: float | None = None,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
    allowed_origins: Sequence[str] = (),
    entra_id: bool = False,
    signing_key: str | None = None,
    identity_header: str | None = None,
    auth_timeout: float = DEFAULT_AUTH_TIMEOUT,
    admin_limits: AdminLimits | None = None,
) -> int:
    """What ``spark-sb emulator start`` does: start, print one line per namespace (``NAME <connection string>``),
    then with TLS one ``AMQPS NAME localhost:PORT`` line per TLS namespace, with WebSockets ``WS NAME <url>`` and
    ``WSS NAME <url>`` lines, ``CA <file>`` when there is TLS, ``AUTHORITY <url>`` for the Entra ID authority
    (https), and ``PAGE <url>``, the live page (:mod:`spark_sb.emulator.page`); wait for a signal. A namespace whose AMQP server fails stops the emulator: the error goes to stderr
    and the exit code is 1."""

    aad = None
    if entra_id:  # Entra ID with the user's signing key and identity header, when given (else the well-known ones)
        defaults = _aad.AadOptions()
        aad = _aad.AadOptions(token_lifetime=token_lifetime or defaults.token_lifetime,
                              signing_key=signing_key or defaults.signing_key,
                              identity_header=identity_header or defaults.identity_header)
    emu = Emulator(namespaces, data_dir=data_dir, entities=entities, tls=tls, websockets=websockets, entra_id=entra_id,
                   authority_port=authority_port, aad=aad, handshake_timeout=handshake_timeout,
                   idle_timeout=idle_timeout, allowed_origins=allowed_origins, auth_timeout=auth_timeout,
                   admin_limits=admin_limits)
    emu.start()
    # a flag, not a threading.Event: the handler runs in the main thread between two bytecodes, and Event.set takes
    # the lock that the main thread's Event.wait holds (a SIGTERM there deadlocked the emulator for good)
    stop: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        stop.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for info in emu.info.values():
            print(f"{info.name} {info.connection_string}", file=out, flush=True)
            _LOGGER.info("%s: admin API and fault control at %s", info.name, info.admin_url)
        for info in emu.info.values():
            if info.tls_port is not None:
                print(f"AMQPS {info.name} localhost:{info.tls_port}", file=out, flush=True)
        for info in emu.info.values():
            for scheme, port in (("ws", info.ws_port), ("wss", info.wss_port)):
                if port is not None:
                    print(f"{scheme.upper()} {info.name} {scheme}://localhost:{port}{WEBSOCKET_PATH}", file=out,
                          flush=True)
        if emu.certificates is not None:
            print(f"CA {emu.certificates.ca_file}", file=out, flush=True)
        first = next(iter(emu.info.values()), None)
        if first is not None and first.authority_port is not None:
            print(f"AUTHORITY {first.authority_url}", file=out, flush=True)
        if first is not None:  # the live page of every namespace, on each admin port: the first's is printed
            print(f"PAGE {first.page_url}", file=out, flush=True)
        if status_file is not None:
            tmp = Path(str(status_file) + ".tmp")
            tmp.write_text(json.dumps({"pid": os.getpid(), "namespaces": [asdict(i) for i in emu.info.values()]}))
            tmp.replace(status_file)
        while not stop:
            time.sleep(0.2)
            if emu.failures:
                for name, err in emu.failures.items():
                    print(f"spark-sb emulator: namespace {name}: the AMQP server failed: {type(err).__name__}: "
                          f"{err}; stopping", file=sys.stderr, flush=True)
                return 1
    finally:
        emu.stop()
    return 0
