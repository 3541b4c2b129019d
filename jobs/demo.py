"""The README's main command (`make demo`): the embedded default, end to end, on the local emulator pair.

Starts the emulator pair (primary and secondary namespaces, durable store in a temporary folder) in a
child process, provisions the backlog queues, and runs the paired writer stream (`jobs/paired_writer.py`:
Spark's rate source, `foreachBatch(PairedSink)`, `conf/local.yaml` with the emulator's actual ports) on a
local Spark session. Part-way the primary namespace goes down; later it
heals. Each batch prints where its rows went. After the stream stops, the syphon job (`jobs/syphon.py`:
the `servicebus-backlog` source, `foreachBatch(Republisher)`, a checkpoint and a Delta ledger) moves the
parked messages home and stops once the backlog is empty; the end accounts for every row by message id: in the primary, left in a backlog queue, dead-lettered
(with reasons), lost, or duplicated. Exits 0 only when every row is in the primary once (none lost,
duplicated, left in a backlog queue or dead-lettered), else 1. No cloud account, no manual step. Last, it draws the picture of the outage (`spark_sb.report`, as `spark-sb report` does from a
real run) from the sink's metrics table and the syphon's ledger into `data/demo/outage.png` (`--picture`).

`--mode active` or `--mode passive` shows replication instead (docs/replication.md): the same stream sends every row to both namespaces (active) or to the active one, swapping on an
outage (passive: the primary goes down, then, after it healed, the secondary, so the roles swap twice); then
`format("servicebus")` reads the entity on both namespaces through `spark_sb.dedupe` into a Delta table, and
the end counts each row: lost, or kept twice.

`--through-proxy` runs the paired demo as a locked-down workspace would: every AMQP connection (the sink's
executors, the syphon's readers and republisher) is AMQP over WebSockets with TLS (the emulator's wss ports,
its CA trusted through `connection_verify`) through a local HTTP proxy with a password that lets only those
ports through (`transport: websockets`, `http_proxy`, `custom_endpoint_address`); the end says how many
tunnels the proxy opened.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from azure.servicebus import ServiceBusClient, ServiceBusReceiveMode, ServiceBusSubQueue

from spark_sb import messages
from spark_sb.durations import seconds_argument
from spark_sb.emulator import DEFAULT_NAMESPACES, EmulatorProcess, NamespaceOptions, fault, heal
from spark_sb.paired import PairedSender

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # Spark's Python workers: this interpreter
ENTITY = "orders"
ENTITIES = f"""
queues:
  - name: {ENTITY}
    requires_duplicate_detection: true
    duplicate_detection_history_time_window: 10m
"""


def _say(text: str = "") -> None:
    print(text, flush=True)


def _emulator(work: Path, free_ports: bool, websockets: bool = False) -> EmulatorProcess:
    """The emulator pair of this run (the demo's entity in both namespaces), on free ports unless told; with
    ``websockets`` it also serves AMQP over WebSockets (ws and wss, its own CA)."""
    (work / "entities.yaml").write_text(ENTITIES)
    namespaces = [NamespaceOptions(n.name) for n in DEFAULT_NAMESPACES] if free_ports else list(DEFAULT_NAMESPACES)
    _say(f"starting the local Service Bus emulator pair (data in {work / 'emulator'})")
    return EmulatorProcess.start(data_dir=work / "emulator", namespaces=namespaces, entities=work / "entities.yaml",
                                 log_file=work / "emulator.log", websockets=websockets)


def _page_line(emu: EmulatorProcess, what: str) -> str:
    """The line that gives the emulator's live page (spark_sb/emulator/page.py): both namespaces, updating."""
    return f"watch both namespaces live ({what}): {emu['primary'].page_url}"


def _through(proxy: Any, emu: EmulatorProcess, config: dict) -> None:
    """Both namespaces over AMQP over WebSockets with TLS, through ``proxy`` (its password by reference)."""
    os.environ["SPARK_SB_DEMO_PROXY_PASSWORD"] = proxy.http_proxy["password"]  # inherited by Spark's workers
    for side in ("primary", "secondary"):
        info = emu[side]
        config[side].update(transport="websockets", custom_endpoint_address=f"sb://localhost:{info.wss_port}",
                            connection_verify=info.ca_file,
                            http_proxy={"host": proxy.host, "port": proxy.port, "username": proxy.username,
                                        "password": "${SPARK_SB_DEMO_PROXY_PASSWORD}"})


def _config(conf: Path, emu: EmulatorProcess, work: Path, rows: int, trigger: float) -> dict:
    """conf/local.yaml with the endpoints of the emulator pair this run started, and the demo's sink: the rate
    source, ``rows`` a batch every ``trigger`` seconds, to the demo's entity."""
    config = yaml.safe_load(conf.read_text())
    for side in ("primary", "secondary"):
        info = emu[side]
        config[side] = {"connection_string": info.connection_string, "admin_endpoint": info.admin_url}
    config["sink"] = {
        "entity": ENTITY,
        "key_column": "key",
        "source": {"format": "rate", "rows_per_second": max(1, int(rows / trigger)), "num_partitions": 2},
        "trigger": f"{trigger}s",
        "checkpoint_location": str(work / "checkpoint"),
    }
    return config


def _primary_ids(conn_str: str) -> list[str]:
    with ServiceBusClient.from_connection_string(conn_str) as client:
        with client.get_queue_receiver(ENTITY, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as r:
            ids: list[str] = []
            while page := r.receive_messages(max_message_count=250, max_wait_time=2):
                ids.extend(str(m.message_id) for m in page)
            return ids


def _backlog_ids(conn_str: str, queues: tuple[str, ...]) -> dict[str, list[str]]:
    """Message ids parked in each backlog queue (peeked: they stay for the syphon), checked to be bound for
    the demo's entity."""
    out: dict[str, list[str]] = {}
    with ServiceBusClient.from_connection_string(conn_str) as client:
        for queue in queues:
            with client.get_queue_receiver(queue) as r:
                ids, seq = [], 1
                while page := r.peek_messages(max_message_count=250, sequence_number=seq):
                    for m in page:
                        restored = messages.from_backlog(m, datetime.datetime.now(datetime.UTC))
                        if restored.entity == ENTITY:
                            ids.append(str(m.message_id))
                    seq = page[-1].sequence_number + 1
            out[queue] = ids
    return out


def _dead_lettered(conn_str: str, queues: tuple[str, ...]) -> dict[str, int]:
    """Dead-lettered backlog messages by reason (peeked)."""
    reasons: collections.Counter[str] = collections.Counter()
    with ServiceBusClient.from_connection_string(conn_str) as client:
        for queue in queues:
            with client.get_queue_receiver(queue, sub_queue=ServiceBusSubQueue.DEAD_LETTER) as r:
                seq = 0
                while page := r.peek_messages(max_message_count=250, sequence_number=seq):
                    reasons.update(str(m.dead_letter_reason) for m in page)
                    seq = page[-1].sequence_number + 1
    return dict(reasons)


def _metrics_table(spark: Any, path: str) -> None:
    """Create the sink's (empty) metrics table before the stream starts, so that the first write of Delta in
    this JVM (seconds on a small machine) is not inside a batch; and write a Delta checkpoint every 100 commits
    rather than 10 (each costs seconds here too, and the demo's tables live for a minute), so that the
    batches of the picture come at the trigger's pace."""
    from spark_sb.sink import METRICS_SCHEMA

    spark.conf.set("spark.databricks.delta.properties.defaults.checkpointInterval", "100")
    spark.createDataFrame([], METRICS_SCHEMA).write.format("delta").save(path)


def _shown(path: Path) -> str:
    """``path`` relative to the current directory when it is below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _stream(spark: Any, config: dict, batches: int, each_batch: Any, holder: dict[str, Any]) -> None:
    """Run the writer stream for ``batches`` batches, each through ``each_batch`` (which calls
    ``holder["sink"]``, the query's sink)."""
    from spark_sb.jobs import await_batches
    from spark_sb.jobs import start_writer as start

    query, holder["sink"] = start(spark, config, foreach_batch=each_batch)
    try:
        await_batches(query, batches)
    finally:
        if query.isActive:
            query.stop()


def run(work: Path, conf: Path, batches: int, rows: int, trigger: float, free_ports: bool,
        picture: Path | None = None, through_proxy: bool = False) -> int:
    import contextlib
    import secrets

    from spark_sb.config import load_config
    from spark_sb.jobs import await_until_empty, build_session, start_syphon, starting_line
    from spark_sb.report import write_report
    from spark_sb.source import backlog_depth

    with contextlib.ExitStack() as stack:
        emu = stack.enter_context(_emulator(work, free_ports, websockets=through_proxy))
        for info in emu.info.values():
            _say(f"  {info.name:9s} amqp://localhost:{info.amqp_port}  admin {info.admin_url}"
                 + (f"  wss://localhost:{info.wss_port}" if through_proxy else ""))
        _say(_page_line(emu, "the outage, the backlog filling, the syphon draining it"))
        config = _config(conf, emu, work, rows, trigger)
        proxy = None
        if through_proxy:
            from spark_sb.emulator.proxy import HttpProxy

            proxy = stack.enter_context(HttpProxy(username="demo", password=secrets.token_urlsafe(12),
                                                  allowed_ports={info.wss_port for info in emu.info.values()}))
            _through(proxy, emu, config)
            _say(f"  every AMQP connection: WebSockets over TLS through the proxy {proxy.url} "
                 "(it lets only the wss ports through)")
        config["sink"]["metrics_table"] = str(work / "metrics")  # one row per batch: the picture's input
        sa = config["send_availability"]
        config["syphon"] = {**config.get("syphon", {}), "retry_interval": "1s",
                            "checkpoint_location": str(work / "syphon-checkpoint"), "ledger": str(work / "ledger")}
        with PairedSender.from_config(config) as sender:
            usable = sender.pair()
            backlog_queues = sender.backlog_queues
        _say(f"provisioned {usable} backlog queues on the secondary "
             f"(failover interval {sa['failover_interval']}, ping interval {sa['ping_primary_interval']})")
        _say(starting_line("spark-sb-demo"))
        spark = build_session("spark-sb-demo")
        spark.sparkContext.setLogLevel("ERROR")
        # an idle stream reports progress every second (default 10 s): the syphon sees an empty backlog sooner
        spark.conf.set("spark.sql.streaming.noDataProgressEventInterval", "1s")
        _metrics_table(spark, config["sink"]["metrics_table"])
        down_at, heal_at = batches // 4, (2 * batches) // 3
        produced: list[str] = []
        holder: dict[str, Any] = {}
        _say(f"streaming rate rows through the paired sink, {rows} rows a batch every {trigger:g} s")
        _say("")

        def each_batch(df: Any, batch_id: int) -> None:
            if batch_id == down_at:
                fault(emu["primary"].admin_url, "down")
                _say(">>> the primary namespace is DOWN")
            if batch_id == heal_at:
                heal(emu["primary"].admin_url)
                _say(">>> the primary namespace is healed")
            # the produced keys (the message ids), for the final count: one short string per row of the demo
            keys = [row["key"] for row in df.select("key").collect()]
            summary = holder["sink"].send_batch(df, batch_id)
            produced.extend(keys)
            where = ", ".join([f"{summary.primary} -> primary"] + [
                f"{n} -> backlog queue {q.rsplit('/', 1)[-1]}" for q, n in sorted(summary.backlog.items())])
            flags = f"failovers {summary.failovers}" if summary.failovers else ""
            flags += f" failbacks {summary.failbacks}" if summary.failbacks else ""
            state = "failed over" if summary.failed_over else "healthy"
            _say(f"batch {batch_id:2d}: {summary.rows:3d} rows: {where}   [{state}, {summary.seconds:.1f} s] {flags}")

        _stream(spark, config, batches, each_batch, holder)
        totals = holder["sink"].totals
        _say("")
        _say(f"sink totals: {totals.describe()}")
        _say("")
        _say("running the syphon job: servicebus-backlog -> foreachBatch(Republisher) -> primary, Delta ledger")
        syphon_query, _ = start_syphon(spark, config, max_per_trigger=500, receive_timeout=0.5)
        # the depth from the administration API where the query's progress has none (Spark 4.0, 4.1)
        await_until_empty(syphon_query, idle_batches=1, depth=lambda: backlog_depth(load_config(config)))
        ledger = spark.read.format("delta").load(config["syphon"]["ledger"])
        outcomes = {r["outcome"]: r["count"] for r in ledger.groupBy("outcome").count().collect()}
        _say(f"syphon: batches {ledger.select('batch_id').distinct().count()}; ledger rows by outcome: "
             + (", ".join(f"{k} {n}" for k, n in sorted(outcomes.items())) or "none"))
        if picture is not None:
            picture.parent.mkdir(parents=True, exist_ok=True)
            write_report(spark, config["sink"]["metrics_table"], config["syphon"]["ledger"], picture,
                         options=("sink.metrics_table", "syphon.ledger"))
            _say(f"the picture of the outage: {_shown(picture)}  "
                 f"(spark-sb report --metrics PATH --ledger PATH --out FILE.png draws it from a real run)")
        spark.stop()
        dead = _dead_lettered(emu["secondary"].connection_string, backlog_queues)
        in_primary = _primary_ids(emu["primary"].connection_string)
        in_backlog = _backlog_ids(emu["secondary"].connection_string, backlog_queues)
        if proxy is not None:
            _say(f"the proxy opened {sum(proxy.tunnels.values())} tunnels, refused {proxy.refused} requests")
    count = Count.of(produced, in_primary, in_backlog, dead)
    _say("")
    for line in count.lines():
        _say(line)
    return 0 if count.clean else 1


@dataclasses.dataclass(frozen=True)
class Count:
    """The end of the paired demo: every row produced, accounted for by message id. ``clean`` (the demo's exit
    status 0) only when every row is in the primary once: none lost, none duplicated, none left in a backlog
    queue and none dead-lettered."""

    produced: int
    in_primary: int
    left: dict[str, int]
    dead_lettered: dict[str, int]
    lost: int
    duplicated: int
    unexpected: int

    @classmethod
    def of(cls, produced: list[str], in_primary: list[str], in_backlog: dict[str, list[str]],
           dead_lettered: dict[str, int]) -> Count:
        everywhere = collections.Counter(in_primary + [m for ids in in_backlog.values() for m in ids])
        return cls(produced=len(set(produced)), in_primary=len(in_primary),
                   left={q.rsplit("/", 1)[-1]: len(ids) for q, ids in in_backlog.items() if ids},
                   dead_lettered=dead_lettered, lost=len(set(produced) - set(everywhere)),
                   duplicated=sum(1 for n in everywhere.values() if n > 1),
                   unexpected=len(set(everywhere) - set(produced)))

    @property
    def clean(self) -> bool:
        return (self.produced > 0 and self.in_primary == self.produced and not self.lost and not self.duplicated
                and not self.unexpected and not sum(self.left.values()) and not sum(self.dead_lettered.values()))

    def lines(self) -> list[str]:
        lines = [
            f"rows produced:             {self.produced}",
            f"in the primary '{ENTITY}':    {self.in_primary}",
            f"left in the backlog:       {sum(self.left.values())}  "
            + ", ".join(f"{q}: {n}" for q, n in self.left.items()),
            f"dead-lettered:             {sum(self.dead_lettered.values())}  "
            + ", ".join(f"{r}: {n}" for r, n in self.dead_lettered.items()),
            f"lost:                      {self.lost}",
            f"duplicated:                {self.duplicated}",
        ]
        if self.unexpected:
            lines.append(f"not produced by this run:  {self.unexpected}")
        lines.append("every row is in the primary once" if self.clean
                     else "NOT CLEAN: a row is lost, duplicated, left behind or dead-lettered (exit 1)")
        return lines


def run_replication(work: Path, conf: Path, mode: str, batches: int, rows: int, trigger: float,
                    free_ports: bool) -> int:
    """The ``--mode active|passive`` demo: see the module docstring."""
    from spark_sb import dedupe, register
    from spark_sb.bus import admin_client
    from spark_sb.config import load_config
    from spark_sb.jobs import build_session, starting_line
    from spark_sb.source import config_options

    with _emulator(work, free_ports) as emu:
        _say(_page_line(emu, "each namespace's copies, the outage"))
        config = _config(conf, emu, work, rows, trigger)
        config["replication"] = {"mode": mode, "retry_interval": "2s"}
        _say(starting_line("spark-sb-demo"))
        spark = build_session("spark-sb-demo")
        spark.sparkContext.setLogLevel("ERROR")
        register(spark)
        # active: the primary down for a stretch; passive: the primary down, healed, then the secondary down
        outages = ([(batches // 4, "primary", "DOWN"), ((2 * batches) // 3, "primary", "healed")] if mode == "active"
                   else [(batches // 5, "primary", "DOWN"), ((2 * batches) // 5, "primary", "healed"),
                         ((3 * batches) // 5, "secondary", "DOWN"), ((4 * batches) // 5, "secondary", "healed")])
        produced: list[str] = []
        holder: dict[str, Any] = {}
        _say(f"streaming rate rows through the sink in {mode} replication, {rows} rows a batch every {trigger:g} s")
        _say("")

        def each_batch(df: Any, batch_id: int) -> None:
            for at, side, what in outages:
                if batch_id == at:
                    if what == "DOWN":
                        fault(emu[side].admin_url, "down")
                    else:
                        heal(emu[side].admin_url)
                    _say(f">>> the {side} namespace is {what}")
            keys = [row["key"] for row in df.select("key").collect()]
            summary = holder["sink"].send_batch(df, batch_id)
            produced.extend(keys)
            swaps = f"  swaps {summary.swaps}" if summary.swaps else ""
            _say(f"batch {batch_id:2d}: {summary.rows:3d} rows: {summary.primary} -> primary, {summary.secondary} -> "
                 f"secondary   [{', '.join(sorted(set(holder['sink'].health.values()))) or '-'}, "
                 f"{summary.seconds:.1f} s]{swaps}")

        _stream(spark, config, batches, each_batch, holder)
        for _, side, _ in outages:
            heal(emu[side].admin_url)
        _say("")
        _say(f"sink totals: {holder['sink'].totals.describe()}")
        copies = {}
        loaded = load_config(config)
        for side, namespace in (("primary", loaded.primary), ("secondary", loaded.secondary)):
            with admin_client(namespace, retry_total=0) as admin:
                copies[side] = int(admin.get_queue_runtime_properties(ENTITY).active_message_count or 0)
        _say(f"copies stored: primary {copies['primary']}, secondary {copies['secondary']}")
        _say("")
        _say("reading both namespaces: format('servicebus') -> spark_sb.dedupe(window='10 minutes') -> Delta")
        table = str(work / "received")
        stream = (spark.readStream.format("servicebus").options(**config_options(config)).option("entity", ENTITY)
                  .option("namespaces", "primary,secondary").option("maxMessagesPerTrigger", "1000")
                  .option("receiveTimeout", "0.5").load())
        reader = (dedupe(stream, window="10 minutes").select("message_id", "namespace", "enqueued_time")
                  .writeStream.format("delta").option("checkpointLocation", str(work / "reader-checkpoint"))
                  .start(table))
        try:
            reader.processAllAvailable()
            reader.processAllAvailable()  # the batch received ahead, and the commit of the last one
        finally:
            reader.stop()
        received = spark.read.format("delta").load(table)
        by_namespace = {r["namespace"]: r["count"] for r in received.groupBy("namespace").count().collect()}
        ids = collections.Counter(str(r["message_id"]) for r in received.select("message_id").collect())
        spark.stop()
    lost = sorted(set(produced) - set(ids))
    duplicated = sorted(m for m, n in ids.items() if n > 1)
    _say(f"rows produced:             {len(produced)}")
    _say(f"rows received (deduped):   {sum(ids.values())}  (first copy from: "
         + ", ".join(f"{k} {n}" for k, n in sorted(by_namespace.items())) + ")")
    _say(f"copies dropped by dedupe:  {copies['primary'] + copies['secondary'] - sum(ids.values())}")
    _say(f"lost:                      {len(lost)}")
    _say(f"duplicated:                {len(duplicated)}")
    return 0 if produced and not lost and not duplicated else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conf", type=Path, default=ROOT / "conf" / "local.yaml",
                        help="the configuration whose options the demo keeps (send_availability, syphon); its "
                             "namespaces become the demo's emulator pair and its sink the demo's (default: "
                             "conf/local.yaml)")
    parser.add_argument("--batches", type=int, default=16,
                        help="sink batches the stream runs, the outage part-way (default: %(default)s)")
    parser.add_argument("--rows", type=int, default=50,
                        help="rows a batch: the rate source makes ROWS every TRIGGER (a batch that starts late "
                             "takes more; default: %(default)s)")
    parser.add_argument("--trigger", type=seconds_argument, default=1.0, metavar="DURATION",
                        help="time between batches, e.g. 1s or 500ms (a bare number is seconds; default: 1s)")
    parser.add_argument("--mode", choices=("paired", "active", "passive"), default="paired",
                        help="paired (send availability, the default), or active / passive replication")
    parser.add_argument("--default-ports", action="store_true",
                        help="use 5672/5300 and 5673/5301 (as conf/local.yaml) instead of free ports")
    parser.add_argument("--picture", type=Path, default=ROOT / "data" / "demo" / "outage.png", metavar="FILE.png",
                        help="paired mode: where the picture of the outage goes (default: data/demo/outage.png)")
    parser.add_argument("--no-picture", dest="picture", action="store_const", const=None,
                        help="paired mode: draw no picture")
    parser.add_argument("--through-proxy", action="store_true",
                        help="paired mode: AMQP over WebSockets with TLS through a local HTTP proxy, as a "
                             "workspace whose egress allows only https through a proxy")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="spark-sb-demo-") as tmp:
        if args.mode != "paired":
            return run_replication(Path(tmp), args.conf, args.mode, args.batches, args.rows, args.trigger,
                                   not args.default_ports)
        return run(Path(tmp), args.conf, args.batches, args.rows, args.trigger, not args.default_ports, args.picture,
                   args.through_proxy)


if __name__ == "__main__":
    sys.exit(main())
