"""Replication benchmark, one run, one emulator pair (a child process, messages in memory), one Spark session.

- the price of two copies: rows per second through ``PairedSink`` in active replication (every row to both
  namespaces) over the same sink in paired mode (one copy), and passive mode for reference; local[P], P
  partitions, one batch of N rows each (default 100,000)
- the ``servicebus`` source: messages per second from ``format("servicebus")`` (one queue on the primary,
  ``maxMessagesPerTrigger`` per batch, into a foreachBatch that counts the rows; the source completes them on
  commit) over a raw SDK loop receiving the same messages in peek-lock and completing each (goal >= 0.7); the
  source is timed in its steady state, from the end of its second batch

    .venv/bin/python bench/replication.py [--rows 100000] [--messages 20000] [--per-trigger 4000]

The last line is ``servicebus source ratio: X.XX``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from azure.servicebus import ServiceBusClient, ServiceBusMessage

from spark_sb.emulator import EmulatorProcess, NamespaceOptions

PAD = "x" * 900  # ~1 KiB messages
CHUNK = 500


def fill(conn_str: str, queue: str, n: int, tag: str) -> None:
    with ServiceBusClient.from_connection_string(conn_str) as client, client.get_queue_sender(queue) as sender:
        for start in range(0, n, 200):  # 200 x 1 KiB fit a batch of 256 KiB
            batch = sender.create_message_batch()
            for i in range(start, min(n, start + 200)):
                batch.add_message(ServiceBusMessage(f"{tag} {i} {PAD}", message_id=f"{tag}-{i}"))
            sender.send_messages(batch)


def raw_receive(conn_str: str, queue: str, n: int) -> float:
    """Messages per second: receive in peek-lock (pages of up to 250) and complete each."""
    with ServiceBusClient.from_connection_string(conn_str) as client:
        with client.get_queue_receiver(queue, prefetch_count=0) as receiver:
            done, started = 0, time.perf_counter()
            while done < n:
                page = receiver.receive_messages(max_message_count=250, max_wait_time=5)
                if not page:
                    break
                for message in page:
                    receiver.complete_message(message)
                done += len(page)
            return done / (time.perf_counter() - started)


def sink_rate(spark: Any, config: dict, mode: str, entity: str, rows: int, partitions: int) -> tuple[float, Any]:
    from pyspark.sql import functions as F

    from spark_sb.sink import PairedSink

    conf = {**config, "replication": {"mode": mode}, "sink": {"entity": entity, "chunk_size": CHUNK,
                                                              "key_column": "key"}}

    def frame(n: int) -> Any:
        ids = spark.range(n, numPartitions=partitions)
        return ids.select(F.concat(F.lit("row "), F.col("id").cast("string"), F.lit(" " + PAD[:90])).alias("body"),
                          F.col("id").cast("string").alias("key"))

    warm = PairedSink.from_config({**conf, "sink": {**conf["sink"], "entity": "warm"}})
    warm(frame(partitions * 10), 0)  # starts the workers' senders of this mode
    sink = PairedSink.from_config(conf)
    started = time.perf_counter()
    summary = sink.send_batch(frame(rows), 1)
    rate = rows / (time.perf_counter() - started)
    assert summary.sent == rows, summary
    return rate, summary


def source_rate(spark: Any, config: dict, queue: str, n: int, per_trigger: int, warm: int = 2) -> float:
    """Messages per second through format("servicebus") in the steady state: timed from the end of batch
    ``warm`` (the first batches include the Python workers' start, their first connections, and a first batch
    received without the receive ahead)."""
    from spark_sb.source import config_options, register

    register(spark)
    counts: list[tuple[float, int]] = []

    def count(df: Any, batch_id: int) -> None:
        counts.append((time.perf_counter(), df.count()))

    stream = (spark.readStream.format("servicebus").options(**config_options(config)).option("entity", queue)
              .option("maxMessagesPerTrigger", str(per_trigger)).option("receiveTimeout", "0.5").load())
    query = stream.writeStream.foreachBatch(count).option(
        "checkpointLocation", tempfile.mkdtemp(prefix="bench-source-")).start()
    try:
        while len([c for _, c in counts if c]) < warm and query.isActive:
            query.awaitTermination(0.05)
        first_at, first = counts[-1][0], sum(c for _, c in counts)
        while sum(c for _, c in counts) < n and query.isActive:
            query.awaitTermination(0.05)
        elapsed = counts[-1][0] - first_at
        total = sum(c for _, c in counts)
        print("  batches (s after the first, rows): " + ", ".join(
            f"{at - first_at:.1f}: {c}" for at, c in counts if c), flush=True)
        query.awaitTermination(1)  # the last batch's progress
        timed = [p for p in query.recentProgress if p.get("numInputRows")][1:]
        for name in ("latestOffset", "queryPlanning", "addBatch", "walCommit", "commitOffsets", "triggerExecution"):
            print(f"  per timed batch, spark {name}: "
                  f"{sum(p['durationMs'].get(name, 0) for p in timed) / 1000 / max(1, len(timed)):.2f} s", flush=True)
    finally:
        query.stop()
    assert total == n, f"the source read {total} of {n} messages"
    return (total - first) / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000, help="rows through the sink, per mode")
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--messages", type=int, default=28_000, help="messages read by the source and the raw loop")
    parser.add_argument("--per-trigger", type=int, default=4000, help="the source's maxMessagesPerTrigger")
    parser.add_argument("--source-only", action="store_true", help="skip the sink")
    args = parser.parse_args()
    os.environ["PYSPARK_PYTHON"] = sys.executable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "jobs"))
    from paired_writer import build_session

    work = Path(tempfile.mkdtemp(prefix="bench-replication-"))
    (work / "entities.yaml").write_text("queues:\n" + "".join(
        f"  - name: {q}\n" for q in ("paired", "active", "passive", "warm", "raw", "source")))
    namespaces = [NamespaceOptions("primary"), NamespaceOptions("secondary")]
    with EmulatorProcess.start(data_dir=None, namespaces=namespaces, entities=work / "entities.yaml") as emu:
        p, s = emu["primary"], emu["secondary"]
        config = {
            "primary": {"connection_string": p.connection_string, "admin_endpoint": p.admin_url},
            "secondary": {"connection_string": s.connection_string, "admin_endpoint": s.admin_url},
            "send_availability": {"backlog_queue_count": 1},
        }
        spark = build_session("spark-sb-bench-replication", master=f"local[{args.partitions}]")
        spark.sparkContext.setLogLevel("ERROR")
        rates = {}
        if not args.source_only:  # Spark's warm-up
            sink_rate(spark, config, "paired", "warm", max(1000, args.rows // 10), args.partitions)
        for mode in () if args.source_only else ("paired", "active", "passive"):
            print(f"sink, {mode}: {args.rows} rows, {args.partitions} partitions ...", flush=True)
            rates[mode], summary = sink_rate(spark, config, mode, mode, args.rows, args.partitions)
            print(f"  {rates[mode]:,.0f} rows/s ({summary.describe()})", flush=True)
        print(f"raw SDK receive-and-complete: {args.messages} messages ...", flush=True)
        fill(p.connection_string, "raw", args.messages, "raw")
        raw = raw_receive(p.connection_string, "raw", args.messages)
        print(f"  {raw:,.0f} messages/s", flush=True)
        print(f"servicebus source: {args.messages} messages, {args.per_trigger} per trigger ...", flush=True)
        fill(p.connection_string, "source", args.messages, "src")
        source = source_rate(spark, config, "source", args.messages, args.per_trigger)
        print(f"  {source:,.0f} messages/s", flush=True)
        spark.stop()
    print()
    if rates:
        print(f"active / paired sink rows per second: {rates['active'] / rates['paired']:.2f}  "
              f"(the price of two copies; {rates['active']:,.0f} vs {rates['paired']:,.0f})")
        print(f"passive / paired sink rows per second: {rates['passive'] / rates['paired']:.2f}")
    ratio = source / raw if raw else 0.0
    print(f"servicebus source (steady state) / raw SDK receive-and-complete: {ratio:.2f} (goal >= 0.7): "
          f"{'met' if ratio >= 0.7 else 'NOT met'}  ({source:,.0f} vs {raw:,.0f} messages/s)")
    print(f"servicebus source ratio: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
