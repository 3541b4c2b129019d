"""The spark-sb command line."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .durations import seconds_argument as _duration_seconds
from .durations import timeout_argument as _timeout_seconds


def _positive_int(text: str) -> int:
    """A positive whole number: an ``argparse`` type."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {text!r}")
    return value


def _emulator_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    emu = sub.add_parser("emulator", help="run and control the local Service Bus emulator")
    esub = emu.add_subparsers(dest="action", required=True)

    start = esub.add_parser("start", help="run namespaces in the foreground until SIGINT/SIGTERM")
    start.add_argument("--data-dir", default="data/emulator",
                       help="where messages and entities are stored (default: %(default)s)")
    start.add_argument("--in-memory", action="store_true",
                       help="keep messages in memory only (nothing survives a restart); for comparisons")
    start.add_argument("--namespace", action="append", default=[],
                       metavar="NAME=AMQP_PORT:ADMIN_PORT[:TLS_PORT][,ws=PORT][,wss=PORT][,latency=DURATION]"
                               "[,idle-detach=DURATION][,detach-every=DURATION][,max-connections=N][,max-receivers=N]"
                               "[,ops-per-second=RATE]",
                       help="a namespace to serve; repeatable; port 0 picks a free port; a TLS_PORT serves AMQP "
                            "over TLS there, ws= and wss= AMQP over WebSockets, plain and over TLS; latency= makes it "
                            "a far namespace: every AMQP byte is delayed that long each way, e.g. latency=20ms for a "
                            "40 ms round trip; idle-detach= and detach-every= are Service Bus's habits: detach an entity "
                            "link idle that long (Azure: 10m), and every entity link that often, with "
                            "amqp:link:detach-forced. Service Bus's limits: max-connections= concurrent connections "
                            "(every transport; default 5000, the next is closed with amqp:resource-limit-exceeded), "
                            "max-receivers= receivers attached to one queue or subscription (default 5000, the next "
                            "attach is refused likewise), ops-per-second= throttling: messages sent and delivered and "
                            "management requests a second, one second's burst (default off; over it sends and "
                            "management requests get com.microsoft:server-busy, deliveries wait) "
                            "(default: primary=5672:5300 and secondary=5673:5301; --base-port moves them)")
    start.add_argument("--base-port", metavar="N",
                       help="the default pair on other ports, derived from N: AMQP on N (primary) and N+1 "
                            "(secondary), the admin API on N+2 and N+3; with --tls AMQPS on N+4 and N+5, with "
                            "--websockets ws on N+6 and N+7 and wss on N+8 and N+9, the Entra ID authority on N+10 "
                            "(default: $SPARK_SB_BASE_PORT, which conf/local.yaml reads too, so that one change "
                            "moves both; unset, or with --namespace: the ports above)")
    start.add_argument("--tls", action="store_true",
                       help="also serve AMQP over TLS (AMQPS), for clients built from a namespace and a credential: "
                            "the default namespaces on 5671 (primary, the SDK's AMQPS port) and 5674 (secondary), "
                            "a --namespace on its TLS_PORT or a free port. The emulator makes its own CA and server "
                            "certificate (kept in DATA_DIR/tls, reused while valid) and prints the CA file: pass it "
                            "as connection_verify= (SSL_CERT_FILE has no effect on the SDK). The admin port stays "
                            "plain HTTP")
    start.add_argument("--websockets", action="store_true",
                       help="also serve AMQP over WebSockets at /$servicebus/websocket (the SDKs' "
                            "transport_type=AmqpOverWebsocket, and any http_proxy): ws:// for emulator connection "
                            "strings and wss:// (TLS with the emulator's CA, as for --tls) for a namespace and a "
                            "credential; the default namespaces on ws 5380 and wss 5443 (primary), 5381 and 5444 "
                            "(secondary), a --namespace on its ws= and wss= ports or free ones. Clients name the "
                            "port with custom_endpoint_address=sb://localhost:PORT")
    start.add_argument("--entra-id", action="store_true",
                       help="also play Microsoft Entra ID (off by default: only the SAS key opens the namespaces): "
                            "namespaces take Entra ID tokens (jwt put-tokens, Bearer on the admin API), every admin "
                            "port serves the managed-identity endpoint /msi/token and, with --tls or "
                            "--authority-port, the authority for service principals is served. Tokens are signed "
                            "with the key in $SPARK_SB_EMULATOR_ENTRA_ID_KEY (at least 32 bytes) and the endpoint "
                            "asks for the header in $SPARK_SB_EMULATOR_IDENTITY_HEADER; unset: the well-known "
                            "development ones, which anyone can use: a secret SAS key then protects nothing")
    start.add_argument("--authority-port", type=int, metavar="PORT",
                       help="serve the Entra ID authority (https with the emulator's CA) on this port (0: a free one), "
                            "for azure-identity's ClientSecretCredential(tenant_id, client_id, client_secret, "
                            "authority=\"https://localhost:PORT\", disable_instance_discovery=True, "
                            "connection_verify=CA): the well-known app spark-sb-emulator-app (secret "
                            "spark-sb-emulator-client-secret, Data Owner) of tenant "
                            "5b3e2c1a-0000-4000-8000-00000000e11d. Default: with --tls, 5310 (default namespaces) or "
                            "a free port; else none")
    start.add_argument("--token-lifetime", metavar="DURATION", type=_duration_seconds,
                       help="how long the Entra ID tokens the emulator issues live (managed identity and the "
                            "authority's apps), e.g. 60s: short tokens make every client renew them within minutes "
                            "(default: 1h, as Entra ID)")
    start.add_argument("--handshake-timeout", metavar="DURATION", type=_timeout_seconds, default=60.0,
                       help="close a connection that has not sent its AMQP open this long after connecting "
                            "(default: 60s; 0: never)")
    start.add_argument("--auth-timeout", metavar="DURATION", type=_timeout_seconds, default=10.0,
                       help="close a connection that has put no accepted token on $cbs this long after its AMQP "
                            "open, with amqp:unauthorized-access (default: 10s; 0: never)")
    start.add_argument("--idle-timeout", metavar="DURATION", type=_timeout_seconds, default=0.0,
                       help="close a connection that sends nothing (not even an empty frame) this long; the AMQP "
                            "open advertises half of it as its idle-time-out, which clients heartbeat by "
                            "(default: 0, none: the Python SDK's receiver does not recover from that close)")
    start.add_argument("--admin-request-timeout", metavar="DURATION", type=_duration_seconds, default=10.0,
                       help="the admin port closes a connection whose request head (or body) has not come this long "
                            "after its first byte, or that sends no request this long after connecting; also bounds "
                            "each write of an answer (default: 10s)")
    start.add_argument("--admin-idle-timeout", metavar="DURATION", type=_timeout_seconds, default=60.0,
                       help="the admin port closes a kept-alive connection that sends no next request this long "
                            "(default: 60s; 0: never). Waiting costs no thread")
    start.add_argument("--admin-workers", metavar="N", type=_positive_int, default=8,
                       help="threads that serve the admin port's requests, per namespace (default: 8)")
    start.add_argument("--admin-max-connections", metavar="N", type=_positive_int, default=512,
                       help="connections the admin port holds at once; at the cap the oldest one waiting for a "
                            "request is closed for the new one, or, when all are being served, the new one is "
                            "answered 503 (default: 512)")
    start.add_argument("--admin-max-connections-per-client", metavar="N", type=_positive_int, default=128,
                       help="connections the admin port holds from one client address, as --admin-max-connections "
                            "(default: 128)")
    start.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                       help="a web origin (e.g. http://localhost:8080) whose pages may open the WebSocket endpoints; "
                            "repeatable. Clients sending no Origin (the SDKs) are always let in, other origins refused")
    start.add_argument("--entities", metavar="FILE", help="YAML/JSON file of queues, topics and subscriptions "
                                                          "to create in every namespace")
    start.add_argument("--key-name", default="RootManageSharedAccessKey",
                       help="shared access key name of every namespace (default: %(default)s)")
    start.add_argument("--key-env", metavar="VAR", default="SPARK_SB_EMULATOR_KEY",
                       help="environment variable holding the shared access key (default: %(default)s; "
                            "unset: SAS_KEY_VALUE, as Microsoft's emulator)")
    start.add_argument("--status-file", metavar="FILE", help=argparse.SUPPRESS)
    start.add_argument("-v", "--verbose", action="store_true", help="log every connection and fault")

    fault = esub.add_parser("fault", help="inject a fault into a running namespace")
    fault.add_argument("--admin", required=True, metavar="URL", help="the namespace's admin URL, e.g. http://localhost:5300")
    kinds: tuple[str, ...] | None
    try:
        from .emulator import FAULT_KINDS

        kinds = FAULT_KINDS
    except ModuleNotFoundError:  # no [emulator] extra (a cluster): the command says so when run (_emulator)
        kinds = None
    fault.add_argument("kind", choices=kinds,
                       help="down: drop and refuse connections (an entity: detach its links); timeout: take sends, "
                            "never answer, store nothing; ack-lost: store sends, never answer them (the sender "
                            "times out although the message is there); busy: server-busy; disabled: "
                            "entity-disabled; notfound: not-found; quota: resource-limit-exceeded; unauthorized: "
                            "refuse the credential's token (401)")
    fault.add_argument("--entity", metavar="PATH",
                       help="limit the fault to one entity: a queue, a topic (its subscriptions too) or "
                            "TOPIC/subscriptions/NAME; one the namespace does not have is refused (default: the whole "
                            "namespace)")
    fault.add_argument("--duration", type=_duration_seconds, metavar="DURATION",
                       help="heal by itself after this long, e.g. 30s, 2m or 1m30s (a bare number is seconds)")

    heal = esub.add_parser("heal", help="remove faults from a running namespace")
    heal.add_argument("--admin", required=True, metavar="URL",
                      help="the namespace's admin URL, e.g. http://localhost:5300")
    heal.add_argument("--entity", metavar="PATH", help="heal only this entity's fault (default: all)")

    proxy = esub.add_parser("proxy", help="run a local HTTP proxy (CONNECT tunnels, Basic authentication) to try "
                                          "http_proxy= against the emulator's WebSockets, until SIGINT/SIGTERM")
    proxy.add_argument("--host", default="127.0.0.1", help="where it listens (default: %(default)s)")
    proxy.add_argument("--port", type=int, default=8899,
                       help="its port (default: %(default)s, the port of Microsoft's proxy samples; 0: a free one)")
    proxy.add_argument("--username", help="ask clients for Basic authentication with this username")
    proxy.add_argument("--password-env", metavar="VAR", default="SPARK_SB_PROXY_PASSWORD",
                       help="environment variable holding the password, with --username (default: %(default)s)")
    proxy.add_argument("--allow-port", type=int, action="append", metavar="PORT",
                       help="connect only to this port (repeatable), as an egress firewall would; others get 403")


def _emulator_proxy(args: argparse.Namespace) -> int:
    from .emulator import proxy

    password = os.environ.get(args.password_env) if args.username else None
    if args.username and not password:
        print(f"spark-sb emulator proxy: --username needs the password in ${args.password_env}", file=sys.stderr)
        return 2
    try:
        return proxy.run_foreground(args.host, args.port, username=args.username, password=password,
                                    allowed_ports=args.allow_port)
    except OSError as err:
        print(f"spark-sb emulator proxy: {err}", file=sys.stderr)
        return 2


#: the exit statuses of status and provision, for their --help and docs/operations.md (provision asks only the
#: secondary: it neither reaches the primary nor looks at its entities)
PAIRED_EXIT_STATUSES = ("exit status: 0 both namespaces answered and accepted the credential; 1 a namespace could "
                        "not be reached (connection refused, host not found, no answer within its admin_timeout, "
                        "connection closed) or answered with an error (busy); 2 a configuration problem: the "
                        "configuration file, a credential a namespace refused, an entity the configuration names "
                        "(or that backlog messages are bound for) that the primary does not have. 2 wins over 1.")
PROVISION_EXIT_STATUSES = ("exit status: 0 the secondary answered and at least one backlog queue is usable "
                           "(created, or there already); 1 the secondary could not be reached (connection refused, "
                           "host not found, no answer within its admin_timeout, connection closed), answered with an "
                           "error (busy), or no backlog queue is usable; 2 a configuration problem: the "
                           "configuration file, or a credential the secondary refused. The primary is not asked: "
                           "spark-sb status checks it.")


def _paired_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    provision = sub.add_parser(
        "provision", help="create the missing backlog queues on the secondary and say what it made",
        description="Create the missing backlog queues on the secondary (send_availability.backlog_queue_count, "
                    "named after send_availability.backlog_prefix) and say which it created, which were there "
                    "already and which are left out (not Active). Each request is bounded by the secondary's "
                    "admin_timeout; a refused credential is reported at once, naming the namespace.",
        epilog=PROVISION_EXIT_STATUSES)
    provision.add_argument("--conf", required=True, metavar="FILE", help="the spark-sb YAML configuration")
    status = sub.add_parser(
        "status", help="can each namespace be reached (and if not, why), the primary's entities, and what each "
                       "backlog queue holds",
        description="For the primary and the secondary: reachable or not over the administration API and over "
                    "AMQP, and why not (the host, the refusal or the network error). The state of the primary's "
                    "entities that the configuration names (sink.entity) or that backlog messages are bound for: "
                    "kind, status, active and dead-letter counts, how many wait in the backlog. Each backlog "
                    "queue's active, deferred and dead-letter counts. Every request is made once, bounded by its "
                    "namespace's admin_timeout.",
        epilog=PAIRED_EXIT_STATUSES)
    status.add_argument("--conf", required=True, metavar="FILE", help="the spark-sb YAML configuration")


def _report_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    report = sub.add_parser(
        "report", help="draw the picture of an outage (a PNG) from a run's metrics table and syphon ledger "
                       "(needs spark-sb[spark])",
        description="Rows per sink batch to the primary and to each backlog queue over time, the outage shaded, "
                    "then the syphon moving the parked messages home. PATH_OR_TABLE: a Delta path (it has a "
                    "'/' or a scheme, e.g. data/metrics or abfss://...) or a table name ([catalog.][schema.]table).")
    report.add_argument("--metrics", required=True, metavar="PATH_OR_TABLE",
                        help="the sink's metrics table (sink.metrics_table)")
    report.add_argument("--ledger", required=True, metavar="PATH_OR_TABLE",
                        help="the syphon's ledger (syphon.ledger)")
    report.add_argument("--out", required=True, metavar="FILE.png", help="the PNG to write (replaced if it exists)")
    report.add_argument("--title", help="the picture's title (default: says whether there was an outage)")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="spark-sb", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _emulator_parser(sub)
    _paired_parsers(sub)
    _report_parser(sub)
    return parser


def _paired(args: argparse.Namespace) -> int:
    """``spark-sb provision`` and ``spark-sb status`` (:mod:`spark_sb.status`): errors on one line, no traceback;
    exit 2 for a configuration problem, 1 otherwise."""
    from . import status as report
    from .config import load_config
    from .errors import ConfigError, SparkSbError, classify, redact

    def out(line: str) -> None:
        print(line, flush=True)

    def err(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        if args.command == "provision":
            return report.provision(args.conf, out, err)
        return report.status(load_config(args.conf), out, err)
    except SparkSbError as exc:
        err(f"spark-sb {args.command}: {exc}")
        configuration = isinstance(exc, ConfigError) or classify(exc).is_configuration
        return report.EXIT_CONFIGURATION if configuration else report.EXIT_UNREACHABLE
    except Exception as exc:  # a Service Bus or HTTP failure: one line, no traceback
        first_line = (redact(str(exc)).splitlines() or [type(exc).__name__])[0]
        err(f"spark-sb {args.command}: {classify(exc).value}: {first_line}")
        return report.EXIT_CONFIGURATION if classify(exc).is_configuration else report.EXIT_UNREACHABLE


def _emulator(args: argparse.Namespace) -> int:
    from .durations import format_duration

    try:
        from .emulator import AdminLimits, server
        from .emulator.broker import BrokerError
        from .emulator.model import EntityConfigError
    except ModuleNotFoundError as err:  # a core install: "spark-sb emulator needs the emulator extra: pip install ..."
        print(err, file=sys.stderr)
        return 2

    if args.action == "proxy":
        return _emulator_proxy(args)
    if args.action == "start":
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
        try:
            namespaces = ([server.NamespaceOptions.parse(t) for t in args.namespace]
                          or server.default_namespaces(args.tls, args.websockets))
            if args.base_port is not None and args.namespace:
                raise ValueError("give either --base-port or --namespace, not both")
            # the environment's base port moves the default pair only: a --namespace names its own ports
            text, source = ((args.base_port, "--base-port") if args.base_port is not None
                            else (None, "") if args.namespace
                            else (os.environ.get("SPARK_SB_BASE_PORT") or None, "$SPARK_SB_BASE_PORT"))
            base = None
            if text is not None:  # even ports for the primary, odd for the secondary
                base = int(text) if text.strip().isdigit() else 0
                if not 1024 <= base <= 65535 - 10:
                    raise ValueError(f"{source} must be a port from 1024 to 65525, got {text!r}")
                namespaces = [dataclasses.replace(
                    n, amqp_port=base + i, admin_port=base + 2 + i, tls_port=base + 4 + i if args.tls else None,
                    ws_port=base + 6 + i if args.websockets else None,
                    wss_port=base + 8 + i if args.websockets else None) for i, n in enumerate(namespaces)]
            key = os.environ.get(args.key_env) or server.DEFAULT_KEY
            namespaces = [dataclasses.replace(n, key_name=args.key_name, key=key) for n in namespaces]
            data_dir = None if args.in_memory else args.data_dir
            authority_port = args.authority_port
            for option, value in (("--authority-port", authority_port), ("--token-lifetime", args.token_lifetime)):
                if value is not None and not args.entra_id:
                    raise ValueError(f"{option} {value:g}: Entra ID is off; add --entra-id to use it")
            if authority_port is None and args.tls and args.entra_id and not args.namespace:
                authority_port = server.DEFAULT_AUTHORITY_PORT if base is None else base + 10
            return server.run_foreground(namespaces, data_dir, args.entities, args.status_file, tls=args.tls,
                                         websockets=args.websockets, authority_port=authority_port,
                                         token_lifetime=args.token_lifetime, entra_id=args.entra_id,
                                         signing_key=os.environ.get("SPARK_SB_EMULATOR_ENTRA_ID_KEY") or None,
                                         identity_header=os.environ.get("SPARK_SB_EMULATOR_IDENTITY_HEADER") or None,
                                         handshake_timeout=args.handshake_timeout, idle_timeout=args.idle_timeout,
                                         auth_timeout=args.auth_timeout, allowed_origins=args.allow_origin,
                                         admin_limits=AdminLimits(
                                             request_timeout=args.admin_request_timeout,
                                             idle_timeout=args.admin_idle_timeout, workers=args.admin_workers,
                                             max_connections=args.admin_max_connections,
                                             max_connections_per_client=args.admin_max_connections_per_client))
        except (ValueError, EntityConfigError, BrokerError, OSError) as err:  # BrokerError: a rule it refuses
            print(f"spark-sb emulator: {err}", file=sys.stderr)
            return 2
    try:
        if args.action == "fault":
            if args.entity and (unknown := _unknown_entity(server, args.admin, args.entity)):
                print(f"spark-sb emulator fault: --entity: {unknown}", file=sys.stderr)
                return 2
            result = server.fault(args.admin, args.kind, args.entity, args.duration)
            what = result.get("entity") or "the namespace"
            until = f" for {format_duration(args.duration)}" if args.duration else " until healed"
            print(f"{result['namespace']}: {args.kind} on {what}{until}")
        else:
            result = server.heal(args.admin, args.entity)
            print(f"{result['namespace']}: healed {result['healed']}")
    except (ConnectionError, RuntimeError) as err:
        print(f"spark-sb emulator: {err}", file=sys.stderr)
        return 1
    return 0


def _unknown_entity(server: Any, admin_url: str, entity: str) -> str | None:
    """Why the namespace at ``admin_url`` has no ``entity`` to fault (with a did-you-mean), or None when it has
    it. A fault on an entity covers its subscriptions (a topic) and its dead-letter queue: those paths count as
    the entity's."""
    from .config import did_you_mean

    try:
        answer = server.send_control(admin_url, "entities")
    except RuntimeError as err:
        if "unknown control endpoint" in str(err):
            return None  # an emulator that does not list its entities: the fault as asked
        raise
    paths = [str(path) for path in answer.get("entities", [])]
    base = entity.strip().strip("/").removesuffix("/$DeadLetterQueue").removesuffix("/$deadletterqueue")
    if base in paths:
        return None
    namespace = answer.get("namespace", admin_url)
    return f"namespace {namespace} has no entity {entity!r}{did_you_mean(base, paths)}" + (
        "" if paths else " (it has none)")


def _report(args: argparse.Namespace) -> int:
    """``spark-sb report``: exit 2 with the option and the value named for bad input."""
    out = Path(args.out)
    if out.is_dir():
        print(f"spark-sb report: --out: is a directory, not a file, got {args.out}", file=sys.stderr)
        return 2
    if not out.parent.is_dir():
        print(f"spark-sb report: --out: the directory {out.parent} does not exist, got {args.out}", file=sys.stderr)
        return 2
    from .jobs import build_session, require_spark

    try:
        require_spark("spark-sb report", "matplotlib")
    except SystemExit as exit_:
        return int(exit_.code or 2)

    from pyspark.sql import SparkSession

    from .errors import ConfigError
    from .report import write_report

    started = SparkSession.getActiveSession() is None
    spark = build_session("spark-sb-report")  # a local one rebuilds a Delta table's state over 2 partitions
    try:
        summary = write_report(spark, args.metrics, args.ledger, out, title=args.title)
    except ConfigError as err:
        print(f"spark-sb report: {err}", file=sys.stderr)
        return 2
    finally:
        if started:
            spark.stop()
    print(f"wrote {out}: {summary.describe()}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "emulator":
        return _emulator(args)
    if args.command in ("provision", "status"):
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
        return _paired(args)
    if args.command == "report":
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
        return _report(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
