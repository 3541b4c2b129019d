"""Spark sink benchmark, one run, one emulator pair (a child process, messages in memory).

- rows per second through ``PairedSink`` (local[P], P partitions, one batch of N rows) over the raw SDK sending
  the same messages (same bodies, same message ids, batches of ``chunk_size``) from P plain Python processes
  (goal >= 0.8)
- the servicebus format's writer (``df.write.format("servicebus")``, the same sender and partition run) over the
  ``foreachBatch`` sink, same rows, same run (goal >= 0.9); each is run ``--rounds`` times, alternating, the best
  of each counted
- the Python workers' peak memory (ru_maxrss) over those N rows (default 500,000)

    .venv/bin/python bench/sink.py [--rows 500000] [--partitions 2] [--derived-ids] [--rounds 2] [--in-flight 8,1]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from azure.servicebus import ServiceBusClient, ServiceBusMessage

from spark_sb.emulator import EmulatorProcess, NamespaceOptions

CHUNK = 500
PAD = "x" * 90


def body(i: int) -> str:
    return f"row {i} {PAD}"


def raw_worker(conn_str: str, queue: str, start: int, stop: int, out: multiprocessing.Queue) -> None:
    with ServiceBusClient.from_connection_string(conn_str) as client, client.get_queue_sender(queue) as sender:
        sender.send_messages(ServiceBusMessage("warm-up"))
        started = time.perf_counter()
        for offset in range(start, stop, CHUNK):
            batch = sender.create_message_batch()
            for i in range(offset, min(offset + CHUNK, stop)):
                message = ServiceBusMessage(body(i), message_id=str(i))
                try:
                    batch.add_message(message)
                except ValueError:
                    sender.send_messages(batch)
                    batch = sender.create_message_batch()
                    batch.add_message(message)
            sender.send_messages(batch)
        out.put(time.perf_counter() - started)


def raw_sdk(conn_str: str, queue: str, rows: int, processes: int) -> float:
    ctx = multiprocessing.get_context("spawn")
    out: multiprocessing.Queue = ctx.Queue()
    step = -(-rows // processes)
    procs = [ctx.Process(target=raw_worker, args=(conn_str, queue, p * step, min(rows, (p + 1) * step), out))
             for p in range(processes)]
    for proc in procs:
        proc.start()
    durations = [out.get(timeout=1800) for _ in procs]
    for proc in procs:
        proc.join()
    return rows / max(durations)


def _peak_rss(batches: Iterator) -> Iterator:
    import pyarrow as pa

    for _ in batches:
        pass
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    yield pa.RecordBatch.from_pydict({"pid": [os.getpid()], "peak_kib": [peak_kib]})


def worker_peaks(spark, partitions: int) -> dict[int, int]:
    rows = spark.range(partitions, numPartitions=partitions).mapInArrow(_peak_rss, "pid long, peak_kib long").collect()
    return {r["pid"]: r["peak_kib"] for r in rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--derived-ids", action="store_true", help="no key column: message ids derived by the sink")
    parser.add_argument("--in-flight", default=None,
                        help="sink.sends_in_flight, or several (1,8): a sink of each, in the same rounds "
                             "(default: the sink's)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of the sink and of the writer, alternating")
    args = parser.parse_args()
    os.environ["PYSPARK_PYTHON"] = sys.executable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "jobs"))
    from paired_writer import build_session
    from pyspark.sql import functions as F

    from spark_sb.bus import admin_client
    from spark_sb.sink import PairedSink
    from spark_sb.source import config_options, register

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from scale import Meter  # CPU per process group from /proc

    def cpu(meter: Meter) -> str:
        """CPU seconds per 10,000 rows of the Python workers and of the emulator."""
        per = 10_000 / args.rows * meter.wall
        return (f"CPU per 10,000 rows: workers {meter.cores['workers'] * per:.2f} s, emulator "
                f"{meter.cores['emulator'] * per:.2f} s, machine {meter.cores['machine']:.2f} of 2 cores")

    entities = Path(tempfile.mkdtemp(prefix="bench-sink-")) / "entities.yaml"
    entities.write_text("queues:\n  - name: raw\n  - name: sink\n  - name: writer\n  - name: warm\n")
    namespaces = [NamespaceOptions("primary"), NamespaceOptions("secondary")]
    with EmulatorProcess.start(data_dir=None, namespaces=namespaces, entities=entities) as emu:
        conn = emu["primary"].connection_string
        print(f"raw SDK: {args.rows} rows from {args.partitions} processes ...", flush=True)
        raw_rate = raw_sdk(conn, "raw", args.rows, args.partitions)
        print(f"  {raw_rate:,.0f} rows/s", flush=True)

        spark = build_session("spark-sb-bench", master=f"local[{args.partitions}]")
        spark.sparkContext.setLogLevel("ERROR")
        config = {
            "primary": {"connection_string": conn, "admin_endpoint": emu["primary"].admin_url},
            "secondary": {"connection_string": emu["secondary"].connection_string,
                          "admin_endpoint": emu["secondary"].admin_url},
            "send_availability": {"backlog_queue_count": 1},
            "sink": {"entity": "sink", "chunk_size": CHUNK, **({} if args.derived_ids else {"key_column": "key"})},
        }
        in_flight = [None] if args.in_flight is None else [int(n) for n in str(args.in_flight).split(",")]
        sinks = {n: PairedSink.from_config({**config, "sink": {**config["sink"], **({} if n is None else {
            "sends_in_flight": n})}}) for n in in_flight}
        sink = sinks[in_flight[0]]

        def frame(n: int):
            ids = spark.range(n, numPartitions=args.partitions)
            return ids.select(F.concat(F.lit("row "), F.col("id").cast("string"), F.lit(" " + PAD)).alias("body"),
                              F.col("id").cast("string").alias("key"))

        warm = PairedSink.from_config({**config, "sink": {**config["sink"], "entity": "warm"}})
        warm(frame(args.partitions * 10), 0)  # starts the Python workers and pairs their senders
        register(spark)
        options = {**config_options(config), "entity": "writer"}
        frame(args.partitions * 10).write.format("servicebus").options(**options).mode("append").save()  # warm-up
        before = worker_peaks(spark, args.partitions)
        sink_rates: dict[int | None, list[float]] = {n: [] for n in in_flight}
        writer_rates: list[float] = []
        for round_ in range(args.rounds):
            for n, each in sinks.items():
                print(f"round {round_ + 1}: sink (foreachBatch{'' if n is None else f', sends_in_flight {n}'}), "
                      f"{args.rows} rows, {args.partitions} partitions ...", flush=True)
                with Meter(emu.proc.pid) as meter:
                    summary = each(frame(args.rows), round_ + 1)
                sink_rates[n].append(args.rows / meter.wall)
                assert summary.primary == args.rows, summary
                print(f"  {sink_rates[n][-1]:,.0f} rows/s ({summary.describe()}); {cpu(meter)}", flush=True)
            print(f"round {round_ + 1}: df.write.format(\"servicebus\") ...", flush=True)
            with Meter(emu.proc.pid) as meter:
                frame(args.rows).write.format("servicebus").options(**options).mode("append").save()
            writer_rates.append(args.rows / meter.wall)
            print(f"  {writer_rates[-1]:,.0f} rows/s; {cpu(meter)}", flush=True)
        after = worker_peaks(spark, args.partitions)
        with admin_client(sink.config.primary) as admin:  # every row the writer reported sent is there
            arrived = admin.get_queue_runtime_properties("writer").active_message_count
        assert arrived == args.rows * args.rounds + args.partitions * 10, arrived
        sink_rate, writer_rate = max(sink_rates[in_flight[0]]), max(writer_rates)
        spark.stop()

    print()
    first = "" if in_flight[0] is None else f" with sends_in_flight {in_flight[0]}"
    print(f"sink{first} / raw SDK rows per second: {sink_rate / raw_rate:.2f}  (goal >= 0.8; "
          f"{sink_rate:,.0f} vs {raw_rate:,.0f}, {args.partitions} processes each, "
          f"{'derived' if args.derived_ids else 'key column'} message ids)")
    for n in in_flight[1:]:
        print(f"sink with sends_in_flight {n} / raw SDK: {max(sink_rates[n]) / raw_rate:.2f}  "
              f"({max(sink_rates[n]):,.0f} rows/s, best of {args.rounds})")
    print(f"writer / sink rows per second: {writer_rate / sink_rate:.2f}  (goal >= 0.9; {writer_rate:,.0f} vs "
          f"{sink_rate:,.0f}, best of {args.rounds} rounds each); writer / raw SDK: {writer_rate / raw_rate:.2f}")
    peak_mib = max(after.values()) / 1024
    base_mib = max(before.values()) / 1024 if before else 0.0
    print(f"Python worker peak memory over {args.rows:,} rows: {peak_mib:.0f} MiB "
          f"(after warm-up: {base_mib:.0f} MiB; workers {sorted(after)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
