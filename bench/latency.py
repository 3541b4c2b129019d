"""The outage path at full speed (issue 21): far namespaces, one table of ratios, each against the raw SDK sending
sequentially (one batch, then its acknowledgement, then the next) on the same emulator with the same latency.

A namespace "N ms away" is an emulator namespace with ``latency=N/2`` (every byte delayed that long each way,
:mod:`spark_sb.emulator.relay`): a round trip costs N ms. Messages are 1 KiB, in chunks of 500 as a Spark
partition hands them to the sender.

Rows:

* **sink failed over, loopback / secondary 40 ms away**: the sink's partition run (``PartitionRun``, what each
  executor runs inside ``mapInArrow``; no Spark scheduling in the timing) with the primary down and its entity
  failed over, over the raw SDK's sequential batch send of the same messages to the backlog queue;
* **sink healthy, primary 5 ms away**: the same run to a healthy primary, over the raw SDK's sequential send to
  the primary entity;
* **syphon job, secondary 40 ms away**: ``jobs/syphon.py``'s query on a local Spark session moving messages
  parked over ten backlog queues (the default count) home, over bench/syphon.py's raw loop (receive a page, send
  it, complete each message: one round trip per message to the far secondary);
* **sink healthy, loopback, one connection per entity**: the partition run with its ``sends_in_flight`` sends
  sharing one connection per entity (the default, ``connections_per_entity: 1``), over the same run with a
  connection per send in flight (``connections_per_entity`` = ``sends_in_flight``, as the sink sent before);
* **active replication, secondary 40 ms away**: the partition run in active mode (both namespaces), over the raw
  SDK's sequential send to the primary; its ratio to the paired run on the same emulator is printed too.

Rounds alternate which side goes first; each rate is the median of the rounds. Prints a Markdown table.

    .venv/bin/python bench/latency.py [--messages 12000] [--rounds 3] [--in-flight 8] [--syphon-messages 1200]
                                      [--no-spark]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
from azure.servicebus import ServiceBusClient, ServiceBusMessage

from spark_sb import sink as sink_module
from spark_sb.config import load_config
from spark_sb.emulator import EmulatorProcess, NamespaceOptions, fault, heal

BODY = b"x" * 1024
CHUNK = 500
QUEUE = "orders"


def raw_sequential(conn_str: str, queue: str, n: int) -> float:
    """Messages/s of the raw SDK: build each chunk's messages, send its batches one after the other."""
    with ServiceBusClient.from_connection_string(conn_str) as client, \
            client.get_queue_sender(queue, keep_alive=0) as sender:
        sender.send_messages(ServiceBusMessage(b"warm-up"))
        tag = uuid.uuid4().hex[:8]
        started = time.perf_counter()
        for offset in range(0, n, CHUNK):
            batch = sender.create_message_batch()
            for i in range(offset, min(offset + CHUNK, n)):
                message = ServiceBusMessage(BODY, message_id=f"raw-{tag}-{i}")
                try:
                    batch.add_message(message)
                except ValueError:
                    sender.send_messages(batch)
                    batch = sender.create_message_batch()
                    batch.add_message(message)
            sender.send_messages(batch)
        return n / (time.perf_counter() - started)


class _Warm(list):
    """A one-message call that waits until every send lane has one: each lane opens its connection."""

    def __init__(self, barrier: threading.Barrier) -> None:
        super().__init__([ServiceBusMessage(b"warm-up")])
        self._barrier = barrier

    def __iter__(self):  # the sender lists its messages once, in the lane's thread
        self._barrier.wait(30)
        return super().__iter__()


def partition_run(config: Any, n: int, failed_over: tuple[str, ...] = ()) -> float:
    """Messages/s of one sink partition run over ``n`` rows (Arrow batches of 10,000 rows, as mapInArrow)."""
    tag = uuid.uuid4().hex[:8]
    batches = [pa.RecordBatch.from_pydict({"body": [BODY] * min(10_000, n - start),
                                           "message_id": [f"run-{tag}-{i}" for i in range(start, min(start + 10_000, n))]})
               for start in range(0, n, 10_000)]
    run = sink_module.PartitionRun(config, config.fingerprint(), 1, 0, failed_over, reject=False)
    # every connection open before the clock starts (a worker keeps them from batch to batch): the calling
    # thread's and each send lane's
    run.sender.send(QUEUE, ServiceBusMessage(b"warm-up"))
    warm = threading.Barrier(config.sink.sends_in_flight)
    futures = [run.sender.submit(QUEUE, _Warm(warm)) for _ in range(config.sink.sends_in_flight)]
    for future in futures:
        future.result()
    started = time.perf_counter()
    out = list(run.run(iter(batches)))
    seconds = time.perf_counter() - started
    summary = out[-1].to_pydict()
    if summary["sent"] != [n]:
        raise RuntimeError(f"the partition run sent {summary['sent']} of {n}")
    return n / seconds


def rounds(count: int, raw: Callable[[], float], ours: Callable[[], float]) -> tuple[float, float]:
    rates: dict[str, list[float]] = {"raw": [], "ours": []}
    for r in range(count):
        for name in (("raw", "ours") if r % 2 == 0 else ("ours", "raw")):
            rates[name].append(raw() if name == "raw" else ours())
    return statistics.median(rates["raw"]), statistics.median(rates["ours"])


def emulator(work: Path, name: str, primary_latency: float, secondary_latency: float) -> EmulatorProcess:
    entities = work / f"{name}.yaml"
    entities.write_text("queues:\n" + "".join(f"  - name: {q}\n    max_size_in_megabytes: 5120\n"
                                               for q in (QUEUE, "syphon-raw", "syphon-job")))
    return EmulatorProcess.start(data_dir=work / name, entities=entities, namespaces=[
        NamespaceOptions("primary", latency=primary_latency), NamespaceOptions("secondary", latency=secondary_latency)])


def config_for(emu: EmulatorProcess, in_flight: int, connections: int = 1, **replication: Any) -> Any:
    p, s = emu["primary"], emu["secondary"]
    return load_config({
        "primary": {"connection_string": p.connection_string, "admin_endpoint": p.admin_url},
        "secondary": {"connection_string": s.connection_string, "admin_endpoint": s.admin_url},
        "send_availability": {"backlog_queue_count": 1, "failover_interval": "0s", "ping_primary_interval": "30m"},
        "sink": {"entity": QUEUE, "sends_in_flight": in_flight, "connections_per_entity": connections},
        **({"replication": replication} if replication else {}),
    })


def failed_over_row(emu: EmulatorProcess, args: argparse.Namespace) -> tuple[float, float]:
    config = config_for(emu, args.in_flight)
    sender = sink_module.sender_for(config)
    sender.pair()
    [backlog] = sender.backlog_queues
    fault(emu["primary"].admin_url, "down")
    try:
        sender.board.assume_failed_over(QUEUE)
        return rounds(args.rounds, lambda: raw_sequential(emu["secondary"].connection_string, backlog, args.messages),
                      lambda: partition_run(config, args.messages, (QUEUE,)))
    finally:
        heal(emu["primary"].admin_url)
        sink_module.close_senders()


def healthy_row(emu: EmulatorProcess, args: argparse.Namespace) -> tuple[float, float]:
    config = config_for(emu, args.in_flight)
    try:
        return rounds(args.rounds, lambda: raw_sequential(emu["primary"].connection_string, QUEUE, args.messages),
                      lambda: partition_run(config, args.messages))
    finally:
        sink_module.close_senders()


def shared_connection_row(emu: EmulatorProcess, args: argparse.Namespace) -> tuple[float, float]:
    """(a connection per send in flight, one connection per entity): the healthy sink on loopback, the sends in
    flight each on its own connection (``connections_per_entity`` = ``sends_in_flight``, the sink before issue
    36) against all of them sharing one."""
    shared = config_for(emu, args.in_flight)
    each = config_for(emu, args.in_flight, connections=args.in_flight)
    try:
        return rounds(args.rounds, lambda: partition_run(each, args.messages),
                      lambda: partition_run(shared, args.messages))
    finally:
        sink_module.close_senders()


def active_row(emu: EmulatorProcess, args: argparse.Namespace) -> tuple[float, float, float]:
    """(raw, active, paired) rates: active replication and the paired sink on the same emulator."""
    active = config_for(emu, args.in_flight, mode="active")
    paired = config_for(emu, args.in_flight)
    try:
        raw, act = rounds(args.rounds, lambda: raw_sequential(emu["primary"].connection_string, QUEUE, args.messages),
                          lambda: partition_run(active, args.messages))
        sink_module.close_senders()
        pair = statistics.median(partition_run(paired, args.messages) for _ in range(args.rounds))
        return raw, act, pair
    finally:
        sink_module.close_senders()


def syphon_row(emu: EmulatorProcess, args: argparse.Namespace, work: Path) -> tuple[float, float]:
    """(raw loop, syphon job) rates moving ``--syphon-messages`` parked evenly over ten backlog queues (the
    product's default ``backlog_queue_count``, over which the rotation spreads a failed-over sink's chunks;
    bench/syphon.py: the raw loop receives, sends and completes one page after the other; the job is timed from
    its first batch's end and reads up to ``syphon.receives_in_flight``, 8, queues at once)."""
    import importlib.util

    # bench/syphon.py under another name: its spark_job imports jobs/syphon.py as "syphon"
    spec = importlib.util.spec_from_file_location("syphon_bench", Path(__file__).resolve().parent / "syphon.py")
    assert spec is not None and spec.loader is not None
    syphon_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(syphon_bench)

    p, s = emu["primary"], emu["secondary"]
    config = {
        "primary": {"connection_string": p.connection_string, "admin_endpoint": p.admin_url},
        "secondary": {"connection_string": s.connection_string, "admin_endpoint": s.admin_url},
        "send_availability": {"backlog_queue_count": 10, "backlog_prefix": "latency-syphon"},
        "syphon": {"receive_batch": 100, "retry_interval": "1s", "checkpoint_location": str(work / "checkpoint"),
                   "ledger": str(work / "ledger")},
    }
    sender = sink_module.sender_for(load_config(config))
    sender.pair()
    queues = list(sender.backlog_queues)
    sink_module.close_senders()
    n = args.syphon_messages
    syphon_bench.park_evenly(s.connection_string, queues, "syphon-raw", n, "raw")
    raw = syphon_bench.raw_loop(s.connection_string, p.connection_string, queues, "syphon-raw", n, 100)
    syphon_bench.park_evenly(s.connection_string, queues, "syphon-job", n, "job")
    job, _ = syphon_bench.spark_job(config, n, max(100, n // 3))
    return raw, job


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=12000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--in-flight", type=int, default=8, help="sink.sends_in_flight (default: %(default)s)")
    parser.add_argument("--syphon-messages", type=int, default=1200,
                        help="messages the syphon rows move (default: %(default)s; the raw loop completes one "
                             "message per round trip)")
    parser.add_argument("--no-spark", action="store_true", help="skip the syphon job row (the only one on Spark)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sb-bench-latency-"))
    rows: list[tuple[str, float, float, str]] = []

    def emit(what: str, raw: float, ours: float, goal: str) -> None:
        rows.append((what, raw, ours, goal))
        print(f"{what}: raw {raw:,.0f} msg/s, spark-sb {ours:,.0f} msg/s, ratio {ours / raw:.2f} ({goal})",
              flush=True)

    emu = emulator(work, "near", 0.0, 0.0)
    try:
        emit("sink failed over, secondary on loopback", *failed_over_row(emu, args), ">= 0.90")
        emit("sink healthy, loopback: one connection per entity (raw: a connection per send in flight)",
             *shared_connection_row(emu, args), ">= 0.95")
    finally:
        emu.stop()
    emu = emulator(work, "far-secondary", 0.0, 0.020)
    try:
        emit("sink failed over, secondary 40 ms away", *failed_over_row(emu, args), ">= 2.0")
        raw, act, pair = active_row(emu, args)
        emit("active replication, secondary 40 ms away", raw, act, f"{act / pair:.2f} of paired; goal >= 0.75")
        if not args.no_spark:
            emit("syphon job, secondary 40 ms away (raw: receive, send, complete)", *syphon_row(emu, args, work),
                 ">= 1.5")
    finally:
        emu.stop()
    emu = emulator(work, "near-primary", 0.0025, 0.0)
    try:
        emit("sink healthy, primary 5 ms away", *healthy_row(emu, args), ">= 1.5")
    finally:
        emu.stop()

    print(f"\n{args.messages} x 1 KiB messages in chunks of {CHUNK}, sink.sends_in_flight {args.in_flight}, "
          f"median of {args.rounds} rounds; raw = the SDK sending sequentially on the same emulator\n")
    print("| path | raw SDK, sequential | spark-sb | ratio | goal |")
    print("| --- | ---: | ---: | ---: | --- |")
    for what, raw, ours, goal in rows:
        print(f"| {what} | {raw:,.0f} msg/s | {ours:,.0f} msg/s | {ours / raw:.2f} | {goal} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
