"""The emulator as a whole: several namespaces, each an AMQP port and an admin HTTP port, and optionally an
AMQPS (TLS) port (:mod:`spark_sb.emulator.tls`).

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
import json
import logging
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

from . import aad as _aad
from . import model
from .amqp import FAULT_KINDS, NamespaceServer
from .broker import Broker, BrokerError, Cond

if TYPE_CHECKING:
    from . import tls as _tls

_LOGGER = logging.getLogger(__name__)

DEFAULT_KEY_NAME = "RootManageSharedAccessKey"
DEFAULT_KEY = "SAS_KEY_VALUE"  # Microsoft's emulator uses the same well-known development key


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

    @classmethod
    def parse(cls, text: str) -> NamespaceOptions:
        """``NAME=AMQP_PORT:ADMIN_PORT[:TLS_PORT]`` (ports may be 0 for a free port)."""
        name, sep, ports = text.partition("=")
        parts = ports.split(":")
        if not sep or not name or len(parts) not in (2, 3) or not all(p.isdigit() for p in parts):
            raise ValueError(f"--namespace must look like NAME=AMQP_PORT:ADMIN_PORT[:TLS_PORT], got {text!r}")
        for what, port in zip(("AMQP_PORT", "ADMIN_PORT", "TLS_PORT"), parts, strict=False):
            if int(port) > 65535:
                raise ValueError(f"--namespace {text!r}: {what} must be a port number (0-65535), got {port}")
        return cls(name=name, amqp_port=int(parts[0]), admin_port=int(parts[1]),
                   tls_port=int(parts[2]) if len(parts) == 3 else None)

    def spec(self) -> str:
        """The ``--namespace`` text for these ports."""
        tls = "" if self.tls_port is None else f":{self.tls_port}"
        return f"{self.name}={self.amqp_port}:{self.admin_port}{tls}"


DEFAULT_NAMESPACES = (NamespaceOptions("primary", 5672, 5300), NamespaceOptions("secondary", 5673, 5301))
#: the default namespaces' AMQPS ports with TLS on: 5671 is the SDK's own AMQPS port, so a client built with
#: ``fully_qualified_namespace="localhost"`` reaches the primary
DEFAULT_TLS_PORTS = {"primary": 5671, "secondary": 5674}


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
    #: the CA certificate TLS clients trust (``connection_verify=``), when the namespace has a TLS port
    ca_file: str | None = None

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
    def admin_url(self) -> str:
        return f"http://localhost:{self.admin_port}"

    @property
    def identity_endpoint(self) -> str:
        """The managed-identity token endpoint (``IDENTITY_ENDPOINT``) on this namespace's admin port; its
        tokens are good for every namespace of the emulator."""
        return f"{self.admin_url}{_aad.TOKEN_PATH}"


class Emulator:
    """Runs namespaces in this process. ``data_dir=None`` keeps messages in memory only.

    ``aad``: Microsoft Entra ID as this emulator plays it (:class:`~spark_sb.emulator.aad.AadOptions`: the
    managed identities its token endpoint serves, their roles, the tokens' lifetime, the identity header);
    default: the system-assigned identity as Data Owner, one-hour tokens, the well-known header and key.

    ``tls=True``: every namespace also serves AMQP over TLS, on its ``tls_port`` or, when that is None, a free
    port (a namespace with a ``tls_port`` has TLS either way). The certificates are made by the emulator and kept
    in ``<data_dir>/tls`` (a temporary directory without a data_dir); ``info[name].ca_file`` is the CA to trust.
    """

    def __init__(
        self,
        namespaces: Sequence[NamespaceOptions] = DEFAULT_NAMESPACES,
        *,
        data_dir: str | Path | None = None,
        entities: str | Path | dict | model.EntitiesFile | None = None,
        clock: Callable[[], float] = time.time,
        aad: _aad.AadOptions | None = None,
        tls: bool = False,
    ) -> None:
        names = [n.name for n in namespaces]
        if len(set(names)) != len(names):
            raise ValueError(f"namespace names must be distinct, got {names}")
        self.options = list(namespaces)
        self.data_dir = Path(data_dir) if data_dir is not None else None
        if entities is None or isinstance(entities, model.EntitiesFile):
            self.entities = entities or model.EntitiesFile()
        else:
            self.entities = model.load_entities(entities)
        self.clock = clock
        #: issues (token endpoint) and verifies (put-token, admin API) the emulator's Entra ID tokens
        self.authority = _aad.Authority(aad, clock)
        self._servers: dict[str, NamespaceServer] = {}
        self._admins: dict[str, Any] = {}
        self.info: dict[str, NamespaceInfo] = {}
        self.tls = tls
        self.certificates: _tls.Certificates | None = None
        self._relay: _tls.TlsRelay | None = None
        self._tls_tmp: str | None = None

    @classmethod
    def default(cls, *, tls: bool = False, **kwargs: Any) -> Emulator:
        """The primary (5672, admin 5300) and the secondary (5673, admin 5301); with ``tls=True`` their AMQPS
        ports are 5671 and 5674 (:data:`DEFAULT_TLS_PORTS`)."""
        return cls(default_namespaces(tls), tls=tls, **kwargs)

    def _tls_port(self, opt: NamespaceOptions) -> int | None:
        if opt.tls_port is not None:
            return opt.tls_port
        return 0 if self.tls else None

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

    def start(self) -> Emulator:
        from .admin_http import AdminServer

        try:
            for opt in self.options:
                def factory(on_available: Callable[[str], None], opt: NamespaceOptions = opt) -> Broker:
                    broker = Broker(self._store(opt.name), clock=self.clock,
                                    max_message_size=opt.max_message_size, on_available=on_available)
                    _apply_entities(broker, self.entities)
                    return broker

                server = NamespaceServer(
                    opt.name, factory, host=opt.host, port=opt.amqp_port,
                    keys={opt.key_name: opt.key}, clock=self.clock, max_message_size=opt.max_message_size,
                    authority=self.authority,
                )
                server.start()
                self._servers[opt.name] = server
                admin = AdminServer(
                    opt.host, opt.admin_port,
                    broker=_BrokerProxy(server), call=server.call, keys={opt.key_name: opt.key},
                    fault=_fault_reader(server), control=_control(server), namespace_port=server.port,
                    other_ports=lambda server=server: (server.tls_port,),
                    authority=self.authority,
                )
                admin.start()
                self._admins[opt.name] = admin
                self.info[opt.name] = NamespaceInfo(opt.name, server.port, admin.port, opt.key_name, opt.key)
                _LOGGER.info("namespace %s: AMQP on %s:%d, admin on http://%s:%d", opt.name, opt.host,
                             server.port, opt.host, admin.port)
            self._start_tls()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_tls(self) -> None:
        """The AMQPS endpoints: TLS on each TLS port, the plain bytes relayed to the namespace's AMQP port."""
        wanted = [(opt, port) for opt in self.options if (port := self._tls_port(opt)) is not None]
        if not wanted:
            return
        from . import tls as _tls  # cryptography is imported only when TLS is on

        if self.data_dir is not None:
            directory = self.data_dir / "tls"
        else:
            self._tls_tmp = tempfile.mkdtemp(prefix="sb-emu-tls-")
            directory = Path(self._tls_tmp)
        hosts = [h for opt, _ in wanted for h in _tls.certificate_hosts(opt.host)]
        # certificates are checked by clients against the real time, whatever clock the broker follows
        self.certificates = certs = _tls.ensure_certificates(directory, hosts)
        routes = [_tls.Route(opt.name, opt.host, port, _loopback(opt.host), self._servers[opt.name].port)
                  for opt, port in wanted]
        self._relay = _tls.TlsRelay(routes, certs.server_context()).start()
        for route in routes:
            self._servers[route.name].tls_port = route.port
            self.info[route.name].tls_port = route.port
            self.info[route.name].ca_file = str(certs.ca_file)

    def stop(self) -> None:
        if self._relay is not None:
            self._relay.stop()
            self._relay = None
        for admin in self._admins.values():
            admin.stop()
        for server in self._servers.values():
            server.stop()
        self._admins.clear()
        self._servers.clear()
        if self._tls_tmp is not None:
            shutil.rmtree(self._tls_tmp, ignore_errors=True)
            self._tls_tmp = None

    def server(self, name: str) -> NamespaceServer:
        return self._servers[name]

    def token(self, client_id: str | None = None, **kwargs: Any) -> tuple[str, int]:
        """An Entra ID access token and its expiry (epoch seconds) for a configured identity, as the token
        endpoint issues it; ``roles=``, ``lifetime=``, ``resource=`` override (see
        :meth:`~spark_sb.emulator.aad.Authority.issue`)."""
        return self.authority.issue(client_id, **kwargs)

    def fault(self, namespace: str, kind: str, entity: str | None = None, duration: float | None = None) -> None:
        server = self._servers[namespace]
        server.call(lambda: server.fault(kind, entity, duration))

    def heal(self, namespace: str, entity: str | None = None) -> None:
        server = self._servers[namespace]
        server.call(lambda: server.heal(entity))


def default_namespaces(tls: bool = False) -> list[NamespaceOptions]:
    """:data:`DEFAULT_NAMESPACES`, with their :data:`DEFAULT_TLS_PORTS` when ``tls``."""
    if not tls:
        return list(DEFAULT_NAMESPACES)
    return [dataclasses.replace(n, tls_port=DEFAULT_TLS_PORTS.get(n.name, 0)) for n in DEFAULT_NAMESPACES]


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


def _control(server: NamespaceServer) -> Callable[[str, str, dict], tuple[int, dict]]:
    """The ``/$emulator/`` endpoints of the admin port: fault, heal, faults."""

    def handle(method: str, path: str, body: dict) -> tuple[int, dict]:
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
        return 404, {"error": f"unknown control endpoint {method} {path}"}

    return handle


# ---------------------------------------------------------------------- remote control (CLI, other processes)
def send_control(admin_url: str, op: str, body: dict | None = None, timeout: float = 10.0) -> dict:
    import urllib.error
    import urllib.request

    url = admin_url.rstrip("/") + "/$emulator/" + op
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST" if body is not None else "GET",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")
        try:
            detail = json.loads(detail).get("error", detail)
        except ValueError:
            pass
        raise RuntimeError(f"{url}: {detail}") from None
    except urllib.error.URLError as err:
        raise ConnectionError(f"cannot reach the emulator's admin API at {admin_url}: {err.reason}") from None


def fault(admin_url: str, kind: str, entity: str | None = None, duration: float | None = None) -> dict:
    """Inject a fault into the namespace whose admin API is at ``admin_url``."""
    return send_control(admin_url, "fault", {"kind": kind, "entity": entity, "duration": duration})


def heal(admin_url: str, entity: str | None = None) -> dict:
    return send_control(admin_url, "heal", {"entity": entity})


# ---------------------------------------------------------------------- subprocess
class EmulatorProcess:
    """The emulator in a child process (``spark-sb emulator start``), for kill -9 tests and the demo."""

    def __init__(self, proc: subprocess.Popen, info: dict[str, NamespaceInfo], args: list[str]) -> None:
        self.proc = proc
        self.info = info
        self.args = args

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
    ) -> EmulatorProcess:
        """``data_dir=None`` keeps messages in memory only; ``tls`` as for :class:`Emulator`."""
        status = Path(tempfile.mkdtemp(prefix="sb-emu-")) / "status.json"
        store = ["--in-memory"] if data_dir is None else ["--data-dir", str(data_dir)]
        args = [sys.executable, "-m", "spark_sb.cli", "emulator", "start", *store, "--status-file", str(status)]
        if tls:
            args.append("--tls")
        for n in namespaces:
            args += ["--namespace", n.spec()]
        if entities is not None:
            args += ["--entities", str(entities)]
        return cls._launch(args, status, timeout, log_file)

    @classmethod
    def _launch(cls, args: list[str], status: Path, timeout: float, log_file: str | Path | None) -> EmulatorProcess:
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
                    return cls(proc, info, args)
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
            if a == "--namespace":
                skip = True
                continue
            out.append(a)
        for n in self.info.values():
            out += ["--namespace", NamespaceOptions(n.name, n.amqp_port, n.admin_port, tls_port=n.tls_port).spec()]
        return self._launch(out, status, timeout, None)

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


def run_foreground(
    namespaces: Sequence[NamespaceOptions],
    data_dir: str | Path | None,
    entities: str | Path | None,
    status_file: str | Path | None,
    out: Any = sys.stdout,
    tls: bool = False,
) -> int:
    """What ``spark-sb emulator start`` does: start, print one line per namespace (``NAME <connection string>``),
    then with TLS one ``AMQPS NAME localhost:PORT`` line per TLS namespace and ``CA <file>``; wait for a signal."""
    import threading

    emu = Emulator(namespaces, data_dir=data_dir, entities=entities, tls=tls)
    emu.start()
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for info in emu.info.values():
            print(f"{info.name} {info.connection_string}", file=out, flush=True)
            _LOGGER.info("%s: admin API and fault control at %s", info.name, info.admin_url)
        for info in emu.info.values():
            if info.tls_port is not None:
                print(f"AMQPS {info.name} localhost:{info.tls_port}", file=out, flush=True)
        if emu.certificates is not None:
            print(f"CA {emu.certificates.ca_file}", file=out, flush=True)
        if status_file is not None:
            tmp = Path(str(status_file) + ".tmp")
            tmp.write_text(json.dumps({"pid": os.getpid(), "namespaces": [asdict(i) for i in emu.info.values()]}))
            tmp.replace(status_file)
        while not stop.wait(0.5):
            pass
    finally:
        emu.stop()
    return 0
